//! The byte stream under a record link ([`crate::records`]): a Unix domain socket between workers
//! on one host, a TCP connection between hosts, and under `[launch.tls]` TLS over that TCP
//! connection. All carry the same hello and the same records; only how the bytes travel
//! differs, so the link code is written once against these types. Also how every link
//! (record or gRPC) keeps dialling a peer that may still be starting ([`with_retry`]).
//!
//! The hello runs on tokio's sockets ([`LinkStream`]). Once linked, the socket leaves tokio's
//! reactor ([`LinkStream::into_split`]): its writing half is watched by tokio only while a
//! write waits for room ([`LinkWrite`]), and its reading half ([`RawLink`]) is read by
//! whoever waits for the link's input ([`crate::intake`]). A socket tokio watched for input
//! too would wake a tokio thread for every message that arrives, even while the chip
//! executor's own thread reads the link.
//!
//! A TLS link leaves tokio the same way once its handshake and hello are done: its rustls
//! state, shared by both halves under a lock, is then driven without blocking on the
//! socket ([`TlsLink`]), so the intake reads it like any other. Reading decrypts what the
//! socket holds; writing encrypts into rustls's buffer and sends what the socket takes, and
//! what it does not take is sent first by the next write or by [`LinkWrite::flush`].

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
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
            $kind::Tls($x) => $body,
        }
    };
}

/// A connected link socket.
#[derive(Debug)]
pub(crate) enum LinkStream {
    Unix(UnixStream),
    Tcp(TcpStream),
    /// Boxed: rustls's state is large, and only links across hosts carry it.
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

/// A linked socket outside tokio's reactor, non-blocking: read and written from any thread.
#[derive(Debug)]
pub(crate) enum RawLink {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
    Tls(TlsLink),
}

impl RawLink {
    /// Reads what has arrived; `WouldBlock` when nothing has. A read that returns less than
    /// `buf` holds took everything the socket held (a TLS link reads on until it has).
    pub(crate) fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            RawLink::Unix(s) => (&*s).read(buf),
            RawLink::Tcp(s) => (&*s).read(buf),
            RawLink::Tls(s) => s.read(buf),
        }
    }

    fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            RawLink::Unix(s) => (&*s).write_vectored(bufs),
            RawLink::Tcp(s) => (&*s).write_vectored(bufs),
            RawLink::Tls(s) => s.write_vectored(bufs),
        }
    }

    fn try_clone(&self) -> io::Result<RawLink> {
        Ok(match self {
            RawLink::Unix(s) => RawLink::Unix(s.try_clone()?),
            RawLink::Tcp(s) => RawLink::Tcp(s.try_clone()?),
            RawLink::Tls(s) => RawLink::Tls(s.try_clone()?),
        })
    }
}

impl AsRawFd for RawLink {
    fn as_raw_fd(&self) -> RawFd {
        either!(RawLink, self, s => s.as_raw_fd())
    }
}

/// A TLS link outside tokio: its own descriptor of the TCP socket (each half has one, so
/// that each can be watched on its own) and the rustls state both halves share.
#[derive(Debug)]
pub(crate) struct TlsLink {
    socket: std::net::TcpStream,
    state: Arc<Mutex<TlsState>>,
}

/// A TLS link's rustls state, and the encrypted bytes read from the socket that rustls has
/// not taken yet: rustls takes at most one TLS record (16 KiB) a call, and feeding it from
/// one large read costs a copy where reading the socket a record at a time would cost a
/// system call.
#[derive(Debug)]
struct TlsState {
    tls: rustls::Connection,
    arrived: Box<[u8]>,
    start: usize,
    end: usize,
}

/// The most plaintext one write hands rustls, and the most encrypted bytes it buffers: what
/// one vectored write sends.
const TLS_WRITE_CHUNK: usize = 256 << 10;
/// Encrypted bytes read from the socket at once.
const TLS_READ_BYTES: usize = 256 << 10;

impl TlsState {
    /// Hands rustls encrypted bytes: from `arrived`, refilled from `socket` (one read) when
    /// empty. `Ok(0)`: the socket is at its end.
    fn feed(&mut self, socket: &std::net::TcpStream) -> io::Result<usize> {
        if self.start == self.end {
            let n = (&*socket).read(&mut self.arrived)?;
            (self.start, self.end) = (0, n);
            if n == 0 {
                return Ok(0);
            }
        }
        let n = self
            .tls
            .read_tls(&mut &self.arrived[self.start..self.end])?;
        if n == 0 {
            // rustls took nothing from bytes it was offered (0 would read as the end).
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "TLS took no input",
            ));
        }
        self.start += n;
        Ok(n)
    }
}

impl TlsLink {
    fn new(socket: std::net::TcpStream, mut tls: rustls::Connection) -> TlsLink {
        tls.set_buffer_limit(Some(TLS_WRITE_CHUNK));
        TlsLink {
            socket,
            state: Arc::new(Mutex::new(TlsState {
                tls,
                arrived: vec![0u8; TLS_READ_BYTES].into_boxed_slice(),
                start: 0,
                end: 0,
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, TlsState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn try_clone(&self) -> io::Result<TlsLink> {
        Ok(TlsLink {
            socket: self.socket.try_clone()?,
            state: self.state.clone(),
        })
    }

    /// Plaintext into `buf` until it is full or the socket is empty; `WouldBlock` when
    /// nothing had arrived. A peer that closed, with or without TLS's close notification,
    /// reads as the end (0), as a plain socket's close does.
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        let mut guard = self.state();
        let state = &mut *guard;
        let mut got = 0;
        let mut ended = false;
        loop {
            match state.tls.reader().read(&mut buf[got..]) {
                Ok(0) => return Ok(got),
                Ok(n) => {
                    got += n;
                    if got == buf.len() {
                        return Ok(got);
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && !ended => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof || ended => return Ok(got),
                Err(e) => return Err(e),
            }
            // Nothing decrypted is left: take what has arrived. What this read already
            // decrypted is returned whatever stops it (an error that lasts comes back at the
            // next read, which a short read is followed by once the socket says so).
            match state.feed(&self.socket) {
                Ok(0) => ended = true,
                Ok(_) => {}
                Err(_) if got > 0 => return Ok(got),
                Err(e) => return Err(e),
            }
            if let Err(e) = state.tls.process_new_packets() {
                // The alert rustls queued for the peer goes, if the socket takes it.
                let _ = send_pending(&mut state.tls, &self.socket);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            // What rustls answers by itself (a key update, an alert) goes now if it can, or
            // ahead of the next write.
            let _ = send_pending(&mut state.tls, &self.socket);
        }
    }

    /// Sends what rustls holds, then encrypts from `bufs` and sends that too; the plaintext
    /// bytes taken. `WouldBlock` when earlier bytes still wait for room (none taken then).
    fn write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let mut guard = self.state();
        let state = &mut guard.tls;
        if !send_pending(state, &self.socket)? {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut taken = 0;
        for buf in bufs {
            let want = buf.len().min(TLS_WRITE_CHUNK - taken);
            let n = state.writer().write(&buf[..want])?;
            taken += n;
            if n < want || taken == TLS_WRITE_CHUNK {
                break;
            }
        }
        send_pending(state, &self.socket)?;
        Ok(taken)
    }

    /// Whether everything written has gone to the socket.
    fn flushed(&self) -> bool {
        !self.state().tls.wants_write()
    }

    /// Sends what rustls holds: `Ok` once nothing is left, `WouldBlock` while some is.
    fn flush(&self) -> io::Result<()> {
        match send_pending(&mut self.state().tls, &self.socket)? {
            true => Ok(()),
            false => Err(io::ErrorKind::WouldBlock.into()),
        }
    }
}

impl AsRawFd for TlsLink {
    fn as_raw_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

/// Writes rustls's encrypted output to `socket` until none is left (true) or the socket is
/// full (false).
fn send_pending(state: &mut rustls::Connection, socket: &std::net::TcpStream) -> io::Result<bool> {
    while state.wants_write() {
        match state.write_tls(&mut &*socket) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
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

/// The writing half of a linked socket: written without blocking, from any thread.
///
/// tokio's reactor watches it for room only while a write waits for some: a socket in an
/// epoll set for `EPOLLOUT` has the kernel wake that epoll's thread each time the peer reads
/// and frees room, which for a link the peer reads message by message is a wasted wake-up of
/// one of this worker's tokio threads per message (measured: a tenth of a 1 MiB
/// all-reduce's CPU on 4 workers went to such wake-ups).
#[derive(Debug)]
pub(crate) struct LinkWrite(RawLink);

/// A descriptor another value owns, as tokio's reactor watches it (the owner outlives the
/// watch: see [`watch_fd`]).
pub(crate) struct SocketFd(pub(crate) RawFd);

impl AsRawFd for SocketFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

impl LinkStream {
    /// The linked socket out of tokio's reactor: the half its input is read from, and the
    /// half to write to (a second descriptor of the same socket).
    pub(crate) fn into_split(self) -> io::Result<(RawLink, LinkWrite)> {
        // tokio's `into_std` leaves the socket non-blocking.
        let input = match self {
            LinkStream::Unix(s) => RawLink::Unix(s.into_std()?),
            LinkStream::Tcp(s) => RawLink::Tcp(s.into_std()?),
            LinkStream::Tls(s) => {
                // What arrived after the hello stays in the rustls state, decrypted or not.
                let (socket, state) = match *s {
                    tokio_rustls::TlsStream::Client(c) => {
                        let (socket, state) = c.into_inner();
                        (socket, rustls::Connection::from(state))
                    }
                    tokio_rustls::TlsStream::Server(c) => {
                        let (socket, state) = c.into_inner();
                        (socket, rustls::Connection::from(state))
                    }
                };
                RawLink::Tls(TlsLink::new(socket.into_std()?, state))
            }
        };
        let output = input.try_clone()?;
        Ok((input, LinkWrite(output)))
    }

    /// Whether the peer is reached over TCP, with or without TLS (maybe on another host: no
    /// shared memory).
    pub(crate) fn is_tcp(&self) -> bool {
        matches!(self, LinkStream::Tcp(_) | LinkStream::Tls(_))
    }

    /// Whether the link runs TLS.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, LinkStream::Tls(_))
    }
}

impl LinkWrite {
    /// Writes what the socket takes now; `WouldBlock` when it takes nothing.
    pub(crate) fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        self.0.write_vectored(bufs)
    }

    /// Whether everything written has reached the socket (a TLS link may hold encrypted
    /// bytes the socket had no room for; the next write sends them first).
    pub(crate) fn flushed(&self) -> bool {
        match &self.0 {
            RawLink::Tls(s) => s.flushed(),
            _ => true,
        }
    }

    /// Waits until everything written has reached the socket.
    pub(crate) async fn flush(&self) -> io::Result<()> {
        match &self.0 {
            RawLink::Tls(s) => self.when_writable(|| s.flush()).await,
            _ => Ok(()),
        }
    }

    /// Runs `write` (non-blocking writes) at once, and again after each `WouldBlock` it
    /// returns once room is made: a full socket is waited on (not retried in a loop), watched
    /// by tokio's reactor only for that wait. One wait at a time per link (its writer task's):
    /// a second registration of the descriptor would fail, and the link with it.
    pub(crate) async fn when_writable<R>(
        &self,
        mut write: impl FnMut() -> io::Result<R>,
    ) -> io::Result<R> {
        match write() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            done => return done,
        }
        // Room made between that write and this registration is not missed: epoll reports a
        // descriptor's state when it is added, not only later changes.
        // SAFETY: `self.0` owns the descriptor and outlives `watched`, dropped in this call.
        #[allow(unsafe_code)]
        let watched = unsafe { watch_fd(SocketFd(self.0.as_raw_fd()), Interest::WRITABLE) }?;
        loop {
            let mut ready = watched.writable().await?;
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

/// `link`'s input watched by tokio's reactor through a descriptor of its own: tests wait on
/// it as the intake's tasks do.
#[cfg(test)]
pub(crate) fn watch_input(link: &RawLink) -> io::Result<AsyncFd<RawLink>> {
    // SAFETY: the AsyncFd owns the clone, whose descriptor stays open until it is dropped.
    #[allow(unsafe_code)]
    unsafe {
        watch_fd(link.try_clone()?, Interest::READABLE)
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
