//! The byte stream under a record link ([`crate::records`]): a Unix domain socket between workers
//! on one host, a TCP connection between hosts, and under `[launch.tls]` TLS over that TCP
//! connection. All carry the same hello and the same records; only how the bytes travel
//! differs, so the link code is written once against these types. Also how every link
//! (record or gRPC) keeps dialling a peer that may still be starting (`with_retry`).
//!
//! The hello runs on tokio's sockets (`LinkStream`). Once linked, the socket leaves tokio's
//! reactor (`LinkStream::into_split`): its writing half is watched by tokio only while a
//! write waits for room (`LinkWrite`), and its reading half (`RawLink`) is read by
//! whoever waits for the link's input (`crate::intake`). A socket tokio watched for input
//! too would wake a tokio thread for every message that arrives, even while the chip
//! executor's own thread reads the link.
//!
//! A TLS link leaves tokio the same way once its handshake and hello are done: its rustls
//! state, shared by both halves under a lock, is then driven without blocking on the
//! socket (`TlsLink`), so the intake reads it like any other. Reading decrypts what the
//! socket holds; writing encrypts into rustls's buffer and sends what the socket takes, and
//! what it does not take is sent first by the next write or by `LinkWrite::flush`.
//!
//! And how a link listener admits connections, which anyone who can reach it may open: a
//! Unix-socket peer must run as this process's user ([`same_user`], before anything is read
//! from it); at most [`Limits::pending`] connections wait for their hello at once, each for at
//! most [`Limits::hello`] ([`Admission`]); and a failing `accept` (out of descriptors, say)
//! costs the one connection it was taking, never the listener ([`Acceptor`]).

use std::collections::BTreeMap;
use std::future::Future;
use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::oneshot;

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
/// one of this worker's tokio threads per message (docs/PERFORMANCE.md measures it).
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
/// last error otherwise (`None` when no attempt ended before the deadline). An error that
/// `lasting` says another attempt cannot change (a certificate the other side refuses) is
/// returned at once: a peer still starting refuses the connection, it does not fail a
/// handshake.
pub(crate) async fn with_retry<T, E, F>(
    patience: Duration,
    mut connect: impl FnMut() -> F,
    lasting: impl Fn(&E) -> bool,
) -> Result<T, Option<E>>
where
    F: Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + patience;
    let mut last = None;
    loop {
        match tokio::time::timeout_at(deadline, connect()).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) if lasting(&e) => return Err(Some(e)),
            Ok(Err(e)) => last = Some(e),
            Err(_) => return Err(last),
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connections a link listener holds at once that have not finished their hello. A worker
/// has a few neighbours, each of which dials once: this is room for all of them many times
/// over, and little next to a process's descriptors (1024 by default).
pub(crate) const MAX_PENDING_HELLOS: usize = 64;
/// How long a connection to a link listener may take from its acceptance to the end of its
/// hello (on a TLS port: its first bytes, the handshake and the hello). A worker says hello
/// as soon as it is connected; this leaves room for a host loaded while a job starts.
pub(crate) const HELLO_DEADLINE: Duration = Duration::from_secs(10);
/// How long a listener rests after `accept` failed for want of resources (descriptors,
/// memory): long enough not to spin, short enough that a peer dialling meanwhile is taken as
/// soon as some are freed.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
/// A repeated warning is said once, then again only after this long.
const QUIET: Duration = Duration::from_secs(10);

/// What a link listener allows connections that have not said hello yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How many may wait at once.
    pub pending: usize,
    /// How long each may take, from its acceptance.
    pub hello: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            pending: MAX_PENDING_HELLOS,
            hello: HELLO_DEADLINE,
        }
    }
}

/// The connections one listener has accepted that have not finished their hello, oldest
/// first, each with the means to close it.
///
/// When all [`Limits::pending`] places are taken, a new connection takes the place of the one
/// that has waited longest, which is closed: a peer's hello ends within milliseconds of its
/// connection, so a connection that has waited long is the one least likely to be a worker.
/// Refusing the newcomer instead would let anyone who keeps that many connections open, and
/// renews them as they time out, refuse every worker for as long as they like.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    waiting: Mutex<Waiting>,
    refusals: Mutex<Burst>,
}

#[derive(Debug, Default)]
struct Waiting {
    next: u64,
    /// By arrival: sending (or dropping) a sender closes its connection.
    by_age: BTreeMap<u64, oneshot::Sender<()>>,
}

/// One accepted connection's place among those waiting for their hello; given up when
/// dropped.
#[derive(Debug)]
pub struct Pending {
    admission: Arc<Admission>,
    id: u64,
    deadline: tokio::time::Instant,
    /// Fires when a newer connection takes this one's place (`None` once it has).
    evicted: Option<oneshot::Receiver<()>>,
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits: Limits {
                pending: limits.pending.max(1),
                hello: limits.hello,
            },
            waiting: Mutex::new(Waiting::default()),
            refusals: Mutex::new(Burst::default()),
        })
    }

    fn waiting(&self) -> MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place for a connection just accepted, closing the longest-waiting one if every
    /// place is taken.
    pub fn admit(self: &Arc<Self>) -> Pending {
        let (evict, evicted) = oneshot::channel();
        let mut waiting = self.waiting();
        while waiting.by_age.len() >= self.limits.pending {
            if let Some((_, oldest)) = waiting.by_age.pop_first() {
                let _ = oldest.send(());
            }
        }
        let id = waiting.next;
        waiting.next += 1;
        waiting.by_age.insert(id, evict);
        Pending {
            admission: self.clone(),
            id,
            deadline: tokio::time::Instant::now() + self.limits.hello,
            evicted: Some(evicted),
        }
    }

    /// How many connections wait for their hello now.
    #[cfg(test)]
    pub fn pending(&self) -> usize {
        self.waiting().by_age.len()
    }

    /// Logs why a connection was refused: the first of a burst, then once per `QUIET`
    /// (anyone who can reach the listener can make it refuse connections).
    pub fn refused(&self, why: &str) {
        let said = self
            .refusals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .say();
        match said {
            Some(unsaid) => tracing::warn!("{why}{}", Burst::since(unsaid)),
            None => tracing::debug!("{why}"),
        }
    }
}

impl Pending {
    /// The listener's admission this connection waits in.
    pub fn admission(&self) -> &Arc<Admission> {
        &self.admission
    }

    /// Runs `step` of the hello until it ends, this connection's deadline passes or a newer
    /// connection takes its place; the connection is to be closed on an error.
    pub async fn within<T>(
        &mut self,
        step: impl Future<Output = Result<T, String>>,
    ) -> Result<T, String> {
        let pending = self.admission.limits.pending;
        let crowded = || format!("closed: {pending} newer connections wait for their hello");
        let Some(evicted) = self.evicted.as_mut() else {
            return Err(crowded());
        };
        let (deadline, hello) = (self.deadline, self.admission.limits.hello);
        let ended = tokio::select! {
            done = tokio::time::timeout_at(deadline, step) => Some(done),
            _ = evicted => None,
        };
        match ended {
            Some(Ok(done)) => done,
            Some(Err(_)) => Err(format!("no hello within {hello:?}")),
            None => {
                self.evicted = None;
                Err(crowded())
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        self.admission.waiting().by_age.remove(&self.id);
    }
}

/// Says a repeated event once per burst: the first, then nothing until [`QUIET`] has passed
/// since the last one said.
#[derive(Debug, Default)]
struct Burst {
    said: Option<Instant>,
    unsaid: u64,
}

impl Burst {
    /// `Some(n)` when this one is to be said (`n`: how many were not since the last), `None`
    /// when it is kept quiet.
    fn say(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.said {
            Some(said) if now.duration_since(said) < QUIET => {
                self.unsaid += 1;
                None
            }
            _ => {
                self.said = Some(now);
                Some(std::mem::take(&mut self.unsaid))
            }
        }
    }

    /// How a warning says that `unsaid` more came since the last one said.
    fn since(unsaid: u64) -> String {
        match unsaid {
            0 => String::new(),
            n => format!(" ({n} more like it since the last said)"),
        }
    }
}

/// How a link listener takes connections: a failed `accept` never ends it and never spins.
#[derive(Debug)]
pub struct Acceptor {
    /// The listener, as its warnings name it.
    what: &'static str,
    failures: Burst,
    failing: bool,
}

impl Acceptor {
    pub fn new(what: &'static str) -> Acceptor {
        Acceptor {
            what,
            failures: Burst::default(),
            failing: false,
        }
    }

    /// The next connection `accept` takes. A connection that went away before it was taken
    /// is skipped; any other failure (out of descriptors: the connection stays queued in the
    /// kernel) is warned of once per burst and tried again after `ACCEPT_PAUSE`, so that
    /// the listener neither ends nor spins a core while the process has no descriptor to
    /// spare.
    pub async fn next<S, A, F>(&mut self, mut accept: impl FnMut() -> F) -> S
    where
        F: Future<Output = io::Result<(S, A)>>,
    {
        loop {
            match accept().await {
                Ok((stream, _)) => {
                    if std::mem::take(&mut self.failing) {
                        tracing::info!("{} accepts connections again", self.what);
                    }
                    return stream;
                }
                Err(e) if gone_before_accepted(&e) => {
                    tracing::debug!("{}: a connection went away: {e}", self.what);
                }
                Err(e) => {
                    self.failing = true;
                    if let Some(unsaid) = self.failures.say() {
                        tracing::warn!(
                            "{} cannot accept: {e} (trying again every {ACCEPT_PAUSE:?}){}",
                            self.what,
                            Burst::since(unsaid)
                        );
                    }
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                }
            }
        }
    }
}

/// Whether `accept` failed for the connection it was taking only (aborted or reset by its
/// peer, or a network error Linux reports on the connection): the next is taken at once.
fn gone_before_accepted(e: &io::Error) -> bool {
    use io::ErrorKind as K;
    if matches!(
        e.kind(),
        K::ConnectionAborted | K::ConnectionReset | K::Interrupted | K::WouldBlock
    ) {
        return true;
    }
    // accept(2): "Linux accept() passes already-pending network errors on the new socket as
    // an error code from accept()", to be treated like EAGAIN.
    matches!(
        e.raw_os_error(),
        Some(
            libc::EPROTO
                | libc::ENOPROTOOPT
                | libc::EHOSTDOWN
                | libc::EHOSTUNREACH
                | libc::ENETDOWN
                | libc::ENETUNREACH
                | libc::EOPNOTSUPP
                | libc::EPERM
        )
    )
}

/// Whether a process running as `peer` may link to this one, running as `own`: only the same
/// user's. The job token keeps other jobs out, but reading a hello costs a descriptor and
/// time that another user's process must not be able to take.
pub fn admits_uid(peer: u32, own: u32) -> Result<(), String> {
    match peer == own {
        true => Ok(()),
        false => Err(format!(
            "a process of uid {peer} dialled the link socket of a worker running as uid {own}"
        )),
    }
}

/// Refuses a Unix-socket peer that does not run as this process's (effective) user, as the
/// kernel saw it when it connected (`SO_PEERCRED`): nothing it sent has been read.
pub fn same_user(socket: &impl AsRawFd) -> Result<(), String> {
    let peer =
        peer_uid(socket).map_err(|e| format!("cannot tell who dialled the link socket: {e}"))?;
    admits_uid(peer, own_uid())
}

/// This process's effective uid.
#[allow(unsafe_code)]
pub fn own_uid() -> u32 {
    // SAFETY: geteuid takes nothing, touches no memory of ours and cannot fail.
    unsafe { libc::geteuid() }
}

/// The effective uid of the process at the other end of a Unix socket when it connected.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn peer_uid(socket: &impl AsRawFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let size = std::mem::size_of::<libc::ucred>();
    let mut len = size as libc::socklen_t;
    // SAFETY: `cred` and `len` are live, writable locals for the call's duration, and `len`
    // holds the size of `cred`, which the kernel writes no more than.
    let done = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if done != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != size {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("SO_PEERCRED gave {len} bytes, not {size}"),
        ));
    }
    Ok(cred.uid)
}

#[cfg(not(target_os = "linux"))]
fn peer_uid(_socket: &impl AsRawFd) -> io::Result<u32> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "peer credentials of a Unix socket need Linux",
    ))
}

/// Whether two tokens are equal, in time that does not depend on where they differ.
pub(crate) fn same_token(given: &[u8], token: &[u8]) -> bool {
    given.len() == token.len()
        && given
            .iter()
            .zip(token)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn only_the_same_user_may_link() {
        assert!(admits_uid(1000, 1000).is_ok());
        assert!(admits_uid(0, 0).is_ok());
        // Root dialling a user's worker is refused too: it is not the job's user.
        for (peer, own) in [(65534, 1000), (0, 1000), (1000, 0)] {
            let why = admits_uid(peer, own).err().unwrap_or_default();
            assert!(
                why.contains(&format!("uid {peer}")) && why.contains(&format!("uid {own}")),
                "{why}"
            );
        }
        // A real connection from this process: its own user.
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(peer_uid(&a).ok(), Some(own_uid()));
        assert!(same_user(&b).is_ok());
    }

    #[test]
    fn a_full_admission_closes_the_oldest_waiting_connection() {
        runtime().block_on(async {
            let limits = Limits {
                pending: 2,
                hello: Duration::from_secs(30),
            };
            let admission = Admission::new(limits);
            let never = || std::future::pending::<Result<(), String>>();
            let mut first = admission.admit();
            let mut second = admission.admit();
            assert_eq!(admission.pending(), 2);
            let mut third = admission.admit();
            assert_eq!(admission.pending(), 2);
            // The first gave way at once; the others still wait.
            let bounded = Duration::from_secs(5);
            let gone = tokio::time::timeout(bounded, first.within(never())).await;
            assert!(
                matches!(&gone, Ok(Err(e)) if e.contains("newer")),
                "{gone:?}"
            );
            // And stays gone.
            assert!(first.within(async { Ok(()) }).await.is_err());
            let short = Duration::from_millis(20);
            assert!(
                tokio::time::timeout(short, second.within(never()))
                    .await
                    .is_err()
            );
            assert_eq!(third.within(async { Ok(7) }).await, Ok(7));
            // A place given up is free again.
            drop((first, second));
            assert_eq!(admission.pending(), 1);
            drop(third);
            assert_eq!(admission.pending(), 0);
        });
    }

    #[test]
    fn a_hello_past_its_deadline_fails_saying_so() {
        runtime().block_on(async {
            let admission = Admission::new(Limits {
                pending: 4,
                hello: Duration::from_millis(50),
            });
            let mut slow = admission.admit();
            let never = std::future::pending::<Result<(), String>>();
            let waited = tokio::time::timeout(Duration::from_secs(5), slow.within(never)).await;
            assert!(
                matches!(&waited, Ok(Err(e)) if e.contains("no hello")),
                "{waited:?}"
            );
        });
    }

    #[test]
    fn a_failing_accept_pauses_and_goes_on() {
        runtime().block_on(async {
            let mut acceptor = Acceptor::new("test listener");
            let mut calls = 0;
            let start = tokio::time::Instant::now();
            let accepted = acceptor
                .next(|| {
                    calls += 1;
                    let result = match calls {
                        1 => Err(io::Error::from_raw_os_error(libc::ECONNABORTED)),
                        2 | 3 => Err(io::Error::from_raw_os_error(libc::EMFILE)),
                        _ => Ok((calls, ())),
                    };
                    std::future::ready(result)
                })
                .await;
            assert_eq!(accepted, 4);
            // Two pauses for the two EMFILEs, none for the aborted connection.
            let waited = start.elapsed();
            assert!(waited >= ACCEPT_PAUSE * 2, "{waited:?}");
            assert!(!gone_before_accepted(&io::Error::from_raw_os_error(
                libc::ENFILE
            )));
        });
    }
}
