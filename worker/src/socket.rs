//! The byte stream under a record link ([`crate::records`]): a Unix domain socket between workers
//! on one host, a TCP connection between hosts. Both carry the same hello and the same
//! records; only how the bytes travel differs, so the link code is written once against
//! these three types. Also how every link (record or gRPC) keeps dialling a peer that may
//! still be starting ([`with_retry`]).

use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream, tcp, unix};

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

/// The reading half of a [`LinkStream`].
#[derive(Debug)]
pub(crate) enum LinkRead {
    Unix(unix::OwnedReadHalf),
    Tcp(tcp::OwnedReadHalf),
}

/// The writing half of a [`LinkStream`]: written without blocking, from any thread.
#[derive(Debug)]
pub(crate) enum LinkWrite {
    Unix(unix::OwnedWriteHalf),
    Tcp(tcp::OwnedWriteHalf),
}

impl LinkStream {
    pub(crate) fn into_split(self) -> (LinkRead, LinkWrite) {
        match self {
            LinkStream::Unix(s) => {
                let (r, w) = s.into_split();
                (LinkRead::Unix(r), LinkWrite::Unix(w))
            }
            LinkStream::Tcp(s) => {
                let (r, w) = s.into_split();
                (LinkRead::Tcp(r), LinkWrite::Tcp(w))
            }
        }
    }

    /// Whether the peer is reached over TCP (maybe on another host: no shared memory).
    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, LinkStream::Tcp(_))
    }
}

impl LinkWrite {
    /// Writes what the socket takes now; `WouldBlock` when it takes nothing.
    pub(crate) fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        either!(LinkWrite, self, w => w.try_write_vectored(bufs))
    }

    /// Waits until the socket may take more.
    pub(crate) async fn writable(&self) -> io::Result<()> {
        either!(LinkWrite, self, w => w.writable().await)
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

impl AsyncRead for LinkRead {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        either!(LinkRead, self.get_mut(), r => Pin::new(r).poll_read(cx, buf))
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
