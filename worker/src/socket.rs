//! The byte stream under a record link ([`crate::records`]): a Unix domain socket between workers
//! on one host, a TCP connection between hosts. Both carry the same hello and the same
//! records; only how the bytes travel differs, so the link code is written once against
//! these types. Also how every link (record or gRPC) keeps dialling a peer that may still be
//! starting ([`with_retry`]).
//!
//! The hello runs on tokio's sockets ([`LinkStream`]). Once linked, the socket leaves tokio's
//! reactor ([`LinkStream::into_split`]): its writing half is watched by tokio for room only,
//! and its reading half ([`RawLink`]) is read by whoever waits for the link's input
//! ([`crate::intake`]). A socket tokio watched for input too would wake a tokio thread for
//! every message that arrives, even while the chip executor's own thread reads the link.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// Forwards a call to whichever socket `$s` (a `$kind`: stream or half) holds.
macro_rules! either {
    ($kind:ident, $s:expr, $x:ident => $body:expr) => {
        match $s {
            $kind::Unix($x) => $body,
            $kind::Tcp($x) => $body,
        }
    };
}

/// A connected link socket.
#[derive(Debug)]
pub(crate) enum LinkStream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

/// A linked socket outside tokio's reactor, non-blocking: read and written from any thread.
#[derive(Debug)]
pub(crate) enum RawLink {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

impl RawLink {
    /// Reads what has arrived; `WouldBlock` when nothing has.
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        either!(RawLink, self, s => (&*s).read(buf))
    }

    fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        either!(RawLink, self, s => (&*s).write_vectored(bufs))
    }

    fn try_clone(&self) -> io::Result<RawLink> {
        Ok(match self {
            RawLink::Unix(s) => RawLink::Unix(s.try_clone()?),
            RawLink::Tcp(s) => RawLink::Tcp(s.try_clone()?),
        })
    }
}

impl AsRawFd for RawLink {
    fn as_raw_fd(&self) -> RawFd {
        either!(RawLink, self, s => s.as_raw_fd())
    }
}

/// `inner`'s descriptor registered with tokio's reactor for `interest` only.
///
/// # Safety
/// `inner.as_raw_fd()` must stay an open descriptor of the same socket for as long as the
/// returned `AsyncFd` lives (it does when `inner` owns it).
#[allow(unsafe_code)]
pub(crate) unsafe fn watch_fd<T: AsRawFd>(inner: T, interest: Interest) -> io::Result<AsyncFd<T>> {
    // SAFETY: upheld by the caller.
    unsafe { AsyncFd::register_with_interest(inner, interest) }.map_err(|e| e.into_parts().1)
}

/// [`watch_fd`] for a socket `inner` owns.
fn watch(inner: RawLink, interest: Interest) -> io::Result<AsyncFd<RawLink>> {
    // SAFETY: the AsyncFd owns `inner`, whose descriptor stays open until it is dropped.
    #[allow(unsafe_code)]
    unsafe {
        watch_fd(inner, interest)
    }
}

/// The writing half of a linked socket: written without blocking, from any thread; tokio
/// watches it for room only.
#[derive(Debug)]
pub(crate) struct LinkWrite(AsyncFd<RawLink>);

impl LinkStream {
    /// The linked socket out of tokio's reactor: the half its input is read from, and the
    /// half to write to (a second descriptor of the same socket).
    pub(crate) fn into_split(self) -> io::Result<(RawLink, LinkWrite)> {
        // tokio's `into_std` leaves the socket non-blocking.
        let input = match self {
            LinkStream::Unix(s) => RawLink::Unix(s.into_std()?),
            LinkStream::Tcp(s) => RawLink::Tcp(s.into_std()?),
        };
        let output = watch(input.try_clone()?, Interest::WRITABLE)?;
        Ok((input, LinkWrite(output)))
    }

    /// Whether the peer is reached over TCP (maybe on another host: no shared memory).
    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, LinkStream::Tcp(_))
    }
}

impl LinkWrite {
    /// Writes what the socket takes now; `WouldBlock` when it takes nothing.
    pub(crate) fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.get_ref().write_vectored(bufs)
    }

    /// Runs `write` (non-blocking writes) once the socket may have room, again after each
    /// `WouldBlock` it returns once room is made: a socket with room is written at once, a
    /// full one waited on (not retried in a loop).
    pub(crate) async fn when_writable<R>(
        &self,
        mut write: impl FnMut() -> io::Result<R>,
    ) -> io::Result<R> {
        loop {
            let mut ready = self.0.writable().await?;
            if let Ok(result) = ready.try_io(|_| write()) {
                return result;
            }
        }
    }
}

impl AsyncRead for LinkStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        either!(LinkStream, self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for LinkStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        either!(LinkStream, self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(LinkStream, self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        either!(LinkStream, self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }
}

/// How long a link keeps trying to reach a peer that may still be starting.
pub(crate) const DIAL_PATIENCE: Duration = Duration::from_secs(20);

/// `connect` tried again every 50 ms until it succeeds or `patience` is spent (an attempt
/// that hangs, as a connection to an unreachable host does, is cut off at the deadline); the
/// last error otherwise (`None` when no attempt ended before the deadline).
pub(crate) async fn with_retry<T, E, F>(
    patience: Duration,
    mut connect: impl FnMut() -> F,
) -> Result<T, Option<E>>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    let mut last = None;
    loop {
        match tokio::time::timeout_at(deadline, connect()).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = Some(e),
            Err(_) => return Err(last),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
