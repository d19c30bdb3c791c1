//! Record links between workers: one socket per worker pair (a Unix domain socket on one
//! host, TCP between hosts; [`crate::socket`]), carrying each message as a fixed binary header
//! followed by its payload's raw bytes.
//!
//! Why not gRPC: the cost of a link is copies and hand-offs more than the network.
//! The gRPC path copies every value into a protobuf buffer, again into HTTP/2 frames, and
//! back out on the other side, and each message passes several tasks. Here a payload goes from
//! the chip's shared buffers straight into the socket (the messages waiting together go out
//! in one vectored write, headers and payload runs side by side), and the receiver reads it
//! straight into a pooled buffer that becomes the message's payload: one copy into the kernel
//! and one out. A small message offered while the link's writer task is idle is written by
//! the chip's own thread (`LinkWriter`), which saves a thread hand-off per message. The
//! header carries exactly the
//! envelope's fields and goes through the same validation ([`crate::wire::message`]), so a garbage or
//! oversized record from a peer is refused the same way.
//!
//! Large payloads can skip the socket: when both workers map each other's region
//! ([`crate::shm`]) a record carries only where its values lie (in the sender's region, or in
//! the region that lent them to the sender), and the receiver reads them there. The hello
//! settles it: each side offers its region, says whether it mapped the other's, and lends only
//! to a peer that mapped.
//!
//! Over TCP the records share the worker's link port with gRPC
//! ([`net::route_tcp`](crate::net::route_tcp) tells them apart by the first bytes) and nothing
//! is shared in memory: the peer may be on another host.
//!
//! A connection opens with a hello (magic, version, the dialling worker's id, the job token,
//! its region offer); the listener answers `OK` (whether it mapped the offered region, its own
//! offer; the dialler then says whether it mapped that) or `NO` with a reason. Unix sockets
//! live in the abstract namespace (Linux): nothing on disk to clean up after a killed worker,
//! and the token keeps other local users out. Workers on one host and network namespace are
//! recognised by [`host_id`]. Both ends write and read the payload in the host's byte order:
//! the same at both ends of a Unix socket by construction; over TCP only little-endian builds
//! speak records ([`RECORDS_OVER_TCP`]). Over TCP the token travels in the clear, as gRPC's
//! does without TLS: a cluster network that others share needs `[launch.tls]`.
//!
//! Under `[launch.tls]` a TCP record link is mutual TLS with the job's certificates
//! ([`crate::tls`]). The dialler opens with a short clear preamble (`TLS_MAGIC`), the
//! listener answers `OK` in the clear (or `NO` with a reason the dialler can print: a worker
//! without TLS, or a job without it), and the TLS handshake follows; the hello and every
//! record then travel inside. A plain record hello on a TLS worker's port is refused the same
//! way, so no record link of a TLS job is ever in the clear.
//!
//! Anyone who can reach a listener can connect to it, so what a connection gets before its
//! hello proves it is one of the job's workers is bounded ([`crate::socket::Admission`]): the
//! Unix-socket listener takes only processes of this worker's own user (checked before
//! anything is read), at most a few dozen connections of either listener wait for their
//! hello at once, each for a few seconds, and a failing `accept` costs one connection, not
//! the listener.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use podsim_collectives::{Message, Payload, Run};
use podsim_proto::v1 as pb;
use podsim_topology::{Dir, Link};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::{mpsc, watch};

use crate::LinkError;
use crate::outgoing::{Outgoing, Refusal};
use crate::shm::{self, Inbound, Outbound, Place, Region};
use crate::socket::{
    Acceptor, Admission, DIAL_PATIENCE, Limits, LinkStream, LinkWrite, Pending, RawLink,
    same_token, with_retry,
};
use crate::tls::Tls;
use crate::transport::Transport;
use crate::wire::MAX_FRAME_BYTES;

const HELLO_MAGIC: &[u8; 8] = b"PODSIMLK";
/// The clear preamble of a TLS record link (as long as [`HELLO_MAGIC`], and differing from an
/// HTTP/2 preface at its second byte too).
const TLS_MAGIC: &[u8; 8] = b"PODSIMTL";
/// Whether this build speaks records over TCP. A record carries payload values in the host's
/// byte order, the same at both ends of a Unix socket but not necessarily across machines:
/// only little-endian builds (every host podsim is built for in practice) do, and a
/// big-endian one links over gRPC and refuses a record hello on its TCP port, saying why.
pub const RECORDS_OVER_TCP: bool = cfg!(target_endian = "little");
const BIG_ENDIAN_REFUSAL: &str =
    "this worker is big-endian and takes no records over TCP: set launch.transport = \"grpc\"";
const VERSION: u32 = 2;
/// Longest job token a hello may carry.
const MAX_TOKEN_BYTES: u32 = 4096;
/// How long a dialled connection may take to say hello and be answered.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// First four bytes of every message record ("PSM1"), to catch a stream out of step.
const RECORD_MAGIC: u32 = 0x314D_5350;
const HEADER_BYTES: usize = 120;
/// Queued messages are written together until this many bytes are in one batch (or nothing
/// more is queued).
const BATCH_BYTES: usize = 256 << 10;
/// Buffers handed to one vectored write (Linux's IOV_MAX).
const MAX_IOVECS: usize = 1024;
/// Where the zero runs of a payload are written from.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
/// Capacity of a link's read buffer: small messages arrive several per read, and a large
/// payload is read straight into its own buffer past the few bytes already buffered.
const READ_BUFFER_BYTES: usize = 64 << 10;

/// This host and network namespace: the boot id and the namespace's inode. Workers with the
/// same id can reach each other's abstract Unix sockets.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let netns = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    if boot.trim().is_empty() {
        return String::new();
    }
    format!("{}/{netns}", boot.trim())
}

/// Binds this worker's same-host link listener; returns it and the name peers dial. `None`
/// where abstract Unix sockets do not exist (the links then go over TCP).
#[cfg(target_os = "linux")]
pub fn bind() -> Option<(tokio::net::UnixListener, String)> {
    bind_abstract("podsim-link")
}

/// Binds a listener in the abstract namespace under a fresh name starting with `prefix`.
#[cfg(target_os = "linux")]
pub fn bind_abstract(prefix: &str) -> Option<(tokio::net::UnixListener, String)> {
    use std::os::linux::net::SocketAddrExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    // The clock alone does not make two names in one process differ: a virtual machine's
    // clock can read the same for two threads binding at once (a bind then fails).
    static BOUND: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = BOUND.fetch_add(1, Ordering::Relaxed);
    let name = format!("{prefix}-{}-{n}-{nanos:09}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).ok()?;
    let listener = std::os::unix::net::UnixListener::bind_addr(&addr).ok()?;
    listener.set_nonblocking(true).ok()?;
    let listener = tokio::net::UnixListener::from_std(listener).ok()?;
    Some((listener, name))
}

#[cfg(not(target_os = "linux"))]
pub fn bind() -> Option<(tokio::net::UnixListener, String)> {
    None
}

#[cfg(not(target_os = "linux"))]
pub fn bind_abstract(_prefix: &str) -> Option<(tokio::net::UnixListener, String)> {
    None
}

#[cfg(target_os = "linux")]
fn connect(name: &str) -> io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    let stream = std::os::unix::net::UnixStream::connect_addr(&addr)?;
    stream.set_nonblocking(true)?;
    UnixStream::from_std(stream)
}

#[cfg(not(target_os = "linux"))]
fn connect(_name: &str) -> io::Result<UnixStream> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "Unix socket links need Linux",
    ))
}

/// What a record link needs of the worker's fabric it joins: the transport the job asked for,
/// the queue of messages for a peer, and where a link goes once its hello has settled it.
/// [`NodeFabric`](crate::net::NodeFabric), which starts the listeners, is the one
/// implementation: through this the links reach the fabric without importing it.
pub(crate) trait LinkHost: Send + Sync + 'static {
    /// How the job asks its links to be carried.
    fn transport(&self) -> Transport;
    /// Takes the queue of messages for `peer`, for the one link that will carry them.
    fn claim(&self, peer: u32) -> Result<mpsc::UnboundedReceiver<Outgoing>, Refusal>;
    /// Starts the pumps of the record link to `peer`, with the shared regions its hello
    /// settled.
    fn run_record_link(
        self: &Arc<Self>,
        peer: u32,
        stream: LinkStream,
        queue: mpsc::UnboundedReceiver<Outgoing>,
        regions: Regions,
    );
}

/// The fabric a listener hands its links to: none until the worker has built it.
pub(crate) type Host<H> = watch::Receiver<Option<Arc<H>>>;

/// Accepts links from workers on this host for as long as the listener lives, with `limits`
/// on the connections that wait for their hello. Each is answered on a task of its own, so
/// that one that is slow to say hello holds up nobody else.
pub(crate) async fn serve_with<H: LinkHost>(
    listener: tokio::net::UnixListener,
    token: String,
    fabric: Host<H>,
    limits: Limits,
) {
    let admission = Admission::new(limits);
    let mut acceptor = Acceptor::new("the same-host link listener");
    loop {
        let stream = acceptor.next(|| listener.accept()).await;
        if let Err(why) = crate::socket::same_user(&stream) {
            // Told why if it listens (one write that does not wait), and closed unread.
            let _ = stream.try_write(&refusal(&why));
            admission.refused(&format!("refused a local link: {why}"));
            continue;
        }
        let pending = admission.admit();
        let (token, fabric) = (token.clone(), fabric.clone());
        tokio::spawn(answer_bounded(
            LinkStream::Unix(stream),
            token,
            fabric,
            pending,
        ));
    }
}

/// [`answer`] within the handshake's time limit; a refusal or a hello that never ends is
/// logged (the dialler hears the reason itself).
async fn answer_bounded<H: LinkHost>(
    stream: LinkStream,
    token: String,
    fabric: Host<H>,
    pending: Pending,
) {
    let what = match (stream.is_tls(), stream.is_tcp()) {
        (true, _) => "TLS",
        (false, true) => "TCP",
        (false, false) => "local",
    };
    let admission = pending.admission().clone();
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, answer(stream, &token, fabric, pending)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => admission.refused(&format!("refused a {what} link: {e}")),
        Err(_) => tracing::warn!("a {what} link did not finish its hello"),
    }
}

/// Whether a link's payloads go through shared memory: never (`uds`), where both workers can
/// map each other's region (`auto`), or always, failing the link otherwise (`shm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sharing {
    Never,
    Try,
    Must,
}

impl Sharing {
    pub(crate) fn of(transport: Transport) -> Sharing {
        match transport {
            Transport::Shm => Sharing::Must,
            Transport::Auto => Sharing::Try,
            Transport::Uds | Transport::Tcp | Transport::Grpc => Sharing::Never,
        }
    }

    /// A region of this side's own, to lend from (none when not sharing, or when it cannot
    /// be made and sharing is only tried).
    fn own_region(self, token: &str) -> Result<Option<Outbound>, String> {
        match self {
            Sharing::Never => Ok(None),
            _ => match Outbound::create(shm::REGION_BYTES, &shm::job_tag(token)) {
                Ok(o) => Ok(Some(o)),
                Err(e) if self == Sharing::Must => Err(format!("no shared region: {e}")),
                Err(_) => Ok(None),
            },
        }
    }

    /// The peer's region mapped here, as far as this side shares.
    fn map_peers(self, region: Region, token: &str) -> Result<Option<Inbound>, String> {
        if self == Sharing::Never {
            return Ok(None);
        }
        if region.is_none() {
            return match self {
                Sharing::Must => Err("the peer offered no shared region".into()),
                _ => Ok(None),
            };
        }
        match Inbound::open(region, &shm::job_tag(token)) {
            Ok(i) => Ok(Some(i)),
            Err(e) if self == Sharing::Must => Err(format!("cannot map the peer's region: {e}")),
            Err(_) => Ok(None),
        }
    }
}

/// The shared regions of one link, as its hello settled them: the one this side lends from
/// (only if the peer mapped it) and the peer's, mapped here.
#[derive(Debug, Default)]
pub(crate) struct Regions {
    pub(crate) outbound: Option<Outbound>,
    pub(crate) inbound: Option<Inbound>,
}

impl Regions {
    /// What the link over `stream` is, as reports name it: `tcp`, or on a Unix socket `shm`
    /// when both directions share memory and `uds` otherwise.
    pub(crate) fn transport(&self, stream: &LinkStream) -> Transport {
        if stream.is_tcp() {
            Transport::Tcp
        } else if self.outbound.is_some() && self.inbound.is_some() {
            Transport::Shm
        } else {
            Transport::Uds
        }
    }
}

/// The listening side of a hello: checks it (within `pending`'s deadline, its place given up
/// once the hello proved the peer one of the job's), waits for the job's fabric, settles the
/// shared regions, attaches the link.
async fn answer<H: LinkHost>(
    mut stream: LinkStream,
    token: &str,
    mut fabric: Host<H>,
    mut pending: Pending,
) -> Result<(), String> {
    let checked = pending.within(async {
        let hello = match stream.is_tcp() && !RECORDS_OVER_TCP {
            true => Err(BIG_ENDIAN_REFUSAL.to_string()),
            false => read_hello(&mut stream, token).await,
        };
        if let Err(e) = &hello {
            refuse(&mut stream, e).await;
        }
        hello
    });
    let (peer, offered) = checked.await?;
    drop(pending);
    let ready = fabric
        .wait_for(Option::is_some)
        .await
        .map_err(|_| "this worker is shutting down".to_string())?
        .clone();
    let Some(fabric) = ready else {
        return Err("no fabric".into());
    };
    // A TCP peer may be on another host: nothing is shared with it.
    let sharing = match stream.is_tcp() {
        true => Sharing::Never,
        false => Sharing::of(fabric.transport()),
    };
    let regions = sharing
        .map_peers(offered, token)
        .and_then(|inbound| Ok((inbound, sharing.own_region(token)?)));
    let (inbound, outbound) = match regions {
        Ok(r) => r,
        Err(e) => {
            let e = format!("worker {peer}: {e}");
            refuse(&mut stream, &e).await;
            return Err(e);
        }
    };
    let claimed = fabric.claim(peer);
    match claimed {
        Ok(queue) => {
            let mut answer = b"OK".to_vec();
            answer.push(u8::from(inbound.is_some()));
            answer.extend(
                outbound
                    .as_ref()
                    .map(Outbound::region)
                    .unwrap_or_default()
                    .encode(),
            );
            let failed = |e: io::Error| format!("worker {peer}: {e}");
            stream.write_all(&answer).await.map_err(failed)?;
            let mut mapped = [0u8];
            stream.read_exact(&mut mapped).await.map_err(failed)?;
            let regions = Regions {
                outbound: outbound.filter(|_| mapped[0] == 1),
                inbound,
            };
            if sharing == Sharing::Must && regions.transport(&stream) != Transport::Shm {
                return Err(format!("worker {peer}: could not map this worker's region"));
            }
            fabric.run_record_link(peer, stream, queue, regions);
            Ok(())
        }
        Err(e) => {
            let e = e.to_string();
            refuse(&mut stream, &e).await;
            Err(e)
        }
    }
}

/// Answers `NO` with `reason` and closes the sending side. Whatever the peer still sends is
/// then read and dropped until it closes (a second at most): a connection closed with
/// input unread is reset, and a reset can discard the refusal before the peer reads it.
async fn refuse<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    reason: &str,
) {
    if stream.write_all(&refusal(reason)).await.is_ok() {
        close_gently(stream).await;
    }
}

/// Closes the sending side of `stream`, then reads and drops what the peer still sends until
/// it closes (a second at most): a connection closed with input unread is reset, and a reset
/// can discard what was last sent (a refusal, a TLS alert) before the peer reads it.
async fn close_gently<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(stream: &mut S) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 4096];
    let drain = async { while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(Duration::from_secs(1), drain).await;
}

/// A `NO` answer with `reason`.
fn refusal(reason: &str) -> Vec<u8> {
    let mut out = b"NO".to_vec();
    out.extend((reason.len() as u32).to_le_bytes());
    out.extend(reason.as_bytes());
    out
}

/// Reads a hello whole (its magic, version and token length checked as they come) and checks
/// its token: the dialling worker and its region offer.
async fn read_hello<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    token: &str,
) -> Result<(u32, Region), String> {
    let mut head = [0u8; 20];
    stream
        .read_exact(&mut head)
        .await
        .map_err(|e| format!("short hello: {e}"))?;
    if &head[..8] != HELLO_MAGIC {
        return Err("not a podsim link (bad magic)".into());
    }
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if word(8) != VERSION {
        return Err(format!(
            "link version {} (this worker speaks {VERSION})",
            word(8)
        ));
    }
    let (peer, len) = (word(12), word(16));
    if len > MAX_TOKEN_BYTES {
        return Err(format!("token of {len} bytes"));
    }
    let mut given = vec![0u8; len as usize];
    stream
        .read_exact(&mut given)
        .await
        .map_err(|e| format!("short hello: {e}"))?;
    let mut offer = [0u8; Region::BYTES];
    stream
        .read_exact(&mut offer)
        .await
        .map_err(|e| format!("short hello: {e}"))?;
    if !same_token(&given, token.as_bytes()) {
        return Err(format!("worker {peer}: missing or wrong job token"));
    }
    Ok((peer, Region::decode(&offer)))
}

/// Dials the same-host link of worker `peer` at `name` as worker `me`: the stream once
/// accepted, and the shared regions the hello settled.
pub(crate) async fn dial(
    name: &str,
    me: u32,
    peer: u32,
    token: &str,
    sharing: Sharing,
) -> Result<(LinkStream, Regions), LinkError> {
    let failed = |e: String| LinkError::Link(format!("worker {peer} at unix:{name}: {e}"));
    let outbound = sharing.own_region(token).map_err(failed)?;
    let stream = with_retry(
        DIAL_PATIENCE,
        || std::future::ready(connect(name)),
        |_| false,
    )
    .await
    .map_err(|e| failed(unreached(e)))?;
    handshake(LinkStream::Unix(stream), me, token, sharing, outbound)
        .await
        .map_err(failed)
}

/// Dials the record link of worker `peer` over TCP at `addr` (its link service's address,
/// which tells a record hello from gRPC by its first bytes) as worker `me`, inside TLS when
/// `tls` is given. Nothing is shared.
pub(crate) async fn dial_tcp(
    addr: &str,
    me: u32,
    peer: u32,
    token: &str,
    tls: Option<&Tls>,
) -> Result<(LinkStream, Regions), LinkError> {
    let failed = |e: String| LinkError::Link(format!("worker {peer} at {addr}: {e}"));
    // Only connecting is tried again: a handshake that fails is refused again, at once.
    let connected = with_retry(
        DIAL_PATIENCE,
        || async {
            let s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok(s)
        },
        |_| false,
    );
    let stream = connected.await.map_err(|e| failed(unreached(e)))?;
    let stream = match tls {
        None => LinkStream::Tcp(stream),
        Some(tls) => tokio::time::timeout(HANDSHAKE_TIMEOUT, start_tls(stream, tls))
            .await
            .unwrap_or_else(|_| Err("no answer to the TLS preamble or handshake".into()))
            .map_err(|e| failed(with_hint(e, tls)))?,
    };
    handshake(stream, me, token, Sharing::Never, None)
        .await
        .map_err(|e| {
            failed(match tls {
                Some(tls) => with_hint(e, tls),
                None => e,
            })
        })
}

/// `why` a TLS link failed, followed by what the job's files must be when it was a
/// handshake's verdict.
fn with_hint(why: String, tls: &Tls) -> String {
    match why.starts_with(TLS_FAILED) {
        true => format!("{why} ({})", tls.mismatch_hint()),
        false => why,
    }
}

/// The dialling side of a TLS record link on a connected `stream`: the clear preamble, the
/// listener's verdict, then the handshake.
async fn start_tls(mut stream: TcpStream, tls: &Tls) -> Result<LinkStream, String> {
    let io = |e: io::Error| e.to_string();
    stream.write_all(TLS_MAGIC).await.map_err(io)?;
    let mut verdict = [0u8; 2];
    stream.read_exact(&mut verdict).await.map_err(io)?;
    if &verdict != b"OK" {
        let reason = read_reason(&mut stream).await.map_err(io)?;
        return Err(format!("refused: {reason}"));
    }
    let config = tls.records();
    let connector = tokio_rustls::TlsConnector::from(config.client.clone());
    tls_linked(connector.connect(config.server_name.clone(), stream).await)
}

/// How the reason of a TLS handshake that failed starts.
const TLS_FAILED: &str = "TLS handshake failed";

/// The end of either side's TLS handshake as a link stream, or why it failed.
fn tls_linked(
    handshake: io::Result<impl Into<tokio_rustls::TlsStream<TcpStream>>>,
) -> Result<LinkStream, String> {
    match handshake {
        Ok(stream) => Ok(LinkStream::Tls(Box::new(stream.into()))),
        Err(e) => Err(link_error(&e)),
    }
}

/// An I/O error of a link, as its reason: a TLS verdict (which, under TLS 1.3, a dialler whose
/// certificate the listener refuses meets at its first read, after its own side of the
/// handshake ended) says so, with rustls's reason.
fn link_error(e: &io::Error) -> String {
    match crate::tls::handshake_failure(e) {
        Some(reason) => format!("{TLS_FAILED}: {reason}"),
        None => crate::tls::chain(e),
    }
}

/// The reason of a `NO` answer (its length, then its text), once `NO` has been read.
async fn read_reason<S: tokio::io::AsyncRead + Unpin>(stream: &mut S) -> io::Result<String> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len).min(MAX_TOKEN_BYTES) as usize;
    let mut reason = vec![0u8; len];
    stream.read_exact(&mut reason).await?;
    Ok(String::from_utf8_lossy(&reason).into_owned())
}

/// Why a dial found no peer: its last error, or that none answered in time.
fn unreached(last: Option<io::Error>) -> String {
    last.map_or_else(|| "no answer in time".to_string(), |e| e.to_string())
}

/// The dialling side of a hello on a connected `stream`, offering `outbound` (this side's
/// region, if any): the stream once accepted, and the regions settled.
async fn handshake(
    mut stream: LinkStream,
    me: u32,
    token: &str,
    sharing: Sharing,
    outbound: Option<Outbound>,
) -> Result<(LinkStream, Regions), String> {
    let mut hello = HELLO_MAGIC.to_vec();
    hello.extend(VERSION.to_le_bytes());
    hello.extend(me.to_le_bytes());
    hello.extend((token.len() as u32).to_le_bytes());
    hello.extend(token.as_bytes());
    hello.extend(
        outbound
            .as_ref()
            .map(Outbound::region)
            .unwrap_or_default()
            .encode(),
    );
    let answered = async {
        stream.write_all(&hello).await?;
        let mut verdict = [0u8; 2];
        stream.read_exact(&mut verdict).await?;
        if &verdict == b"OK" {
            let mut settled = [0u8; 1 + Region::BYTES];
            stream.read_exact(&mut settled).await?;
            return Ok(Ok((settled[0] == 1, Region::decode(&settled[1..]))));
        }
        Ok::<_, io::Error>(Err(read_reason(&mut stream).await?))
    };
    let (mapped_mine, offered) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, answered).await {
        Ok(Ok(Ok(settled))) => settled,
        Ok(Ok(Err(reason))) => return Err(format!("refused: {reason}")),
        Ok(Err(e)) => return Err(link_error(&e)),
        Err(_) => return Err("no answer to hello".into()),
    };
    let inbound = sharing.map_peers(offered, token);
    let mapped = [u8::from(matches!(inbound, Ok(Some(_))))];
    stream.write_all(&mapped).await.map_err(|e| e.to_string())?;
    let regions = Regions {
        outbound: outbound.filter(|_| mapped_mine),
        inbound: inbound?,
    };
    if sharing == Sharing::Must && regions.transport(&stream) != Transport::Shm {
        return Err("the peer could not map this worker's region".into());
    }
    Ok((stream, regions))
}

/// Serves the TCP port of this worker's link service: a connection that opens with a record
/// hello (without `tls`) or with the TLS preamble (with it) becomes a record link
/// (`answer`), the other of the two is refused with a reason, and any other (gRPC's HTTP/2
/// preface, or a TLS handshake for gRPC) is handed to the gRPC server through `grpc`.
/// `limits` bound the connections that have neither said a record hello nor been handed to
/// gRPC. Each is routed on a task of its own.
pub(crate) async fn route_tcp_with<H: LinkHost>(
    listener: tokio::net::TcpListener,
    tls: Option<Tls>,
    token: String,
    fabric: Host<H>,
    grpc: mpsc::Sender<io::Result<TcpStream>>,
    limits: Limits,
) {
    let admission = Admission::new(limits);
    let mut acceptor = Acceptor::new("the link service");
    loop {
        let stream = acceptor.next(|| listener.accept()).await;
        let _ = stream.set_nodelay(true);
        let pending = admission.admit();
        let (token, fabric, grpc, tls) = (token.clone(), fabric.clone(), grpc.clone(), tls.clone());
        tokio::spawn(route(stream, tls, token, fabric, grpc, pending));
    }
}

/// Routes one connection to the link port by what it opens with (see [`route_tcp_with`]), within
/// `pending`'s deadline until it is a record link's hello or gRPC's.
async fn route<H: LinkHost>(
    stream: TcpStream,
    tls: Option<Tls>,
    token: String,
    fabric: Host<H>,
    grpc: mpsc::Sender<io::Result<TcpStream>>,
    mut pending: Pending,
) {
    let opening = pending
        .within(async { opens_with(&stream).await.map_err(|e| e.to_string()) })
        .await;
    let admission = pending.admission().clone();
    let from = stream
        .peer_addr()
        .map_or_else(|_| "an unknown address".into(), |a| a.to_string());
    match (opening, tls) {
        (Ok(Opening::Records), None) => {
            answer_bounded(LinkStream::Tcp(stream), token, fabric, pending).await
        }
        (Ok(Opening::Records), Some(_)) => {
            if let Err(e) = pending.within(refuse_plain(stream)).await {
                admission.refused(&e);
            }
        }
        (Ok(Opening::TlsRecords), Some(tls)) => {
            match pending.within(accept_tls(stream, &tls)).await {
                Ok(stream) => answer_bounded(stream, token, fabric, pending).await,
                Err(e) => admission.refused(&format!("refused a TLS link from {from}: {e}")),
            }
        }
        (Ok(Opening::TlsRecords), None) => {
            if let Err(e) = pending.within(refuse_tls(stream)).await {
                admission.refused(&e);
            }
        }
        (Ok(Opening::Other), _) => {
            // gRPC checks the token of every request itself.
            drop(pending);
            if grpc.send(Ok(stream)).await.is_err() {
                tracing::debug!("a gRPC connection came after the link service stopped");
            }
        }
        (Err(e), _) => tracing::debug!("a link connection sent no opening: {e}"),
    }
}

/// Why a TLS worker refuses a plain record hello.
const PLAIN_REFUSAL: &str = "this job's links between workers use TLS: start the worker with \
                             --tls-ca, --tls-cert and --tls-key (or the job with [launch.tls])";
/// Why a worker without TLS refuses a TLS record link.
const NOT_TLS_REFUSAL: &str = "this worker runs without TLS, but the dialling one with it: give every worker of the job \
     the same --tls-* files (or none)";

/// What a connection to the link port opens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// A record hello in the clear.
    Records,
    /// The preamble of a TLS record link.
    TlsRecords,
    /// Anything else: gRPC's.
    Other,
}

/// What the first bytes a connection sends are (without taking them). Decided as soon as the
/// bytes so far match neither magic; an HTTP/2 preface ("PRI ...") and a TLS handshake (0x16)
/// differ at their first or second byte. A peer that sent part of a magic and no more
/// (peeking again returns the same bytes, even once it has closed) is given up on after a
/// second.
async fn opens_with(stream: &TcpStream) -> io::Result<Opening> {
    let mut first = [0u8; HELLO_MAGIC.len()];
    for _ in 0..1000 {
        let n = stream.peek(&mut first).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let (plain, tls) = (first[..n] == HELLO_MAGIC[..n], first[..n] == TLS_MAGIC[..n]);
        if !plain && !tls {
            return Ok(Opening::Other);
        }
        if n == first.len() {
            return Ok(if plain {
                Opening::Records
            } else {
                Opening::TlsRecords
            });
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Err(io::Error::new(
        io::ErrorKind::TimedOut,
        "only part of a hello arrived",
    ))
}

/// The listening side of a TLS record link: takes the preamble, answers `OK`, runs the
/// handshake (the dialler's certificate must be signed by the job's authority).
async fn accept_tls(mut stream: TcpStream, tls: &Tls) -> Result<LinkStream, String> {
    let io = |e: io::Error| e.to_string();
    let mut magic = [0u8; TLS_MAGIC.len()];
    stream.read_exact(&mut magic).await.map_err(io)?;
    stream.write_all(b"OK").await.map_err(io)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.records().server.clone());
    match acceptor.accept(stream).into_fallible().await {
        Ok(stream) => tls_linked(Ok(stream)),
        Err((e, mut stream)) => {
            // The alert that says why has been sent: let the dialler read it.
            close_gently(&mut stream).await;
            tls_linked(Err::<tokio_rustls::server::TlsStream<TcpStream>, _>(e))
        }
    }
}

/// A TLS preamble on the port of a worker without TLS: taken, and refused in the clear (the
/// error says why, for the log).
async fn refuse_tls(mut stream: TcpStream) -> Result<(), String> {
    let mut magic = [0u8; TLS_MAGIC.len()];
    if stream.read_exact(&mut magic).await.is_ok() {
        refuse(&mut stream, NOT_TLS_REFUSAL).await;
    }
    Err(format!("refused a TLS link: {NOT_TLS_REFUSAL}"))
}

/// A plain record hello on a TLS worker's port: its hello is taken (so that the refusal is
/// read before the connection closes) and refused, saying why (the error says it for the
/// log).
async fn refuse_plain(mut stream: TcpStream) -> Result<(), String> {
    let _ = read_hello(&mut stream, "").await;
    refuse(&mut stream, PLAIN_REFUSAL).await;
    Err(format!("refused a plain link: {PLAIN_REFUSAL}"))
}

/// Where a record's payload values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    /// None: a meta payload (a count).
    Meta,
    /// After the header, on the socket.
    Inline,
    /// In the sender's shared region.
    Lent(Place),
}

/// The fixed header of one message record (`lent`: the payload lies in the shared region).
fn encode_header(msg: &Message, lent: Option<Place>, out: &mut Vec<u8>) {
    let (kind, axis, positive, peer_slice) = match msg.link {
        Link::Ici { axis, dir } => (0u8, axis, u8::from(dir == Dir::Plus), 0u32),
        Link::Dcn { peer_slice } => (1, 0, 0, peer_slice),
    };
    let fp = msg.fingerprint;
    let (payload_kind, len) = match (&msg.payload, lent) {
        (p, Some(_)) => (2u8, p.len() as u64),
        (Payload::Meta(n), None) => (0, *n as u64),
        (p, None) => (1, p.len() as u64),
    };
    let start = out.len();
    out.extend(RECORD_MAGIC.to_le_bytes());
    out.extend(msg.src.to_le_bytes());
    out.extend(msg.dst.to_le_bytes());
    out.extend([kind, axis, positive, u8::from(msg.checksum.is_some())]);
    out.extend(peer_slice.to_le_bytes());
    out.extend(msg.hops.to_le_bytes());
    out.extend(fp.group.to_le_bytes());
    out.extend(fp.seq.to_le_bytes());
    out.extend(fp.count.to_le_bytes());
    out.extend([
        fp.op.code() as u8,
        fp.dtype.code() as u8,
        fp.reduce.map_or(0, |r| r.code()) as u8,
        payload_kind,
    ]);
    out.extend(u32::from(msg.tag.lane).to_le_bytes());
    out.extend(u32::from(msg.tag.phase).to_le_bytes());
    out.extend(msg.tag.step.to_le_bytes());
    out.extend(msg.arrive_ns.to_le_bytes());
    out.extend(msg.checksum.unwrap_or(0).to_le_bytes());
    out.extend(len.to_le_bytes());
    let (slot, offset, region) =
        lent.map_or((0, 0, Region::default()), |p| (p.slot, p.offset, p.region));
    out.extend(slot.to_le_bytes());
    out.extend(0u32.to_le_bytes());
    out.extend(offset.to_le_bytes());
    out.extend(region.encode());
    debug_assert_eq!(out.len() - start, HEADER_BYTES);
}

/// A message's whole record as a link carries it inline: header, then payload values (for
/// tests that feed a reader bytes of their own making).
#[cfg(test)]
pub(crate) fn encode_record(msg: Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES);
    encode_header(&msg, None, &mut out);
    let mut slices = Vec::new();
    let header = out.clone();
    record_slices(&msg, &header, &mut slices);
    slices.iter().skip(1).for_each(|s| out.extend_from_slice(s));
    out
}

/// What a header says: the envelope's fields (no payload), where the payload is, its length.
fn decode_header(h: &[u8; HEADER_BYTES]) -> Result<(pb::Envelope, Body, u64), String> {
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(b)
    };
    if u32_at(0) != RECORD_MAGIC {
        return Err("record out of step (bad magic)".into());
    }
    let link = match h[12] {
        0 => pb::LinkId {
            kind: pb::link_id::Kind::Ici as i32,
            axis: u32::from(h[13]),
            positive: h[14] != 0,
            peer_slice: 0,
        },
        1 => pb::LinkId {
            kind: pb::link_id::Kind::Dcn as i32,
            axis: 0,
            positive: false,
            peer_slice: u32_at(16),
        },
        k => return Err(format!("unknown link kind {k}")),
    };
    let body = match h[51] {
        0 => Body::Meta,
        1 => Body::Inline,
        2 => Body::Lent(Place {
            region: Region::decode(&h[104..120]),
            slot: u32_at(88),
            offset: u64_at(96),
        }),
        k => return Err(format!("unknown payload kind {k}")),
    };
    let env = pb::Envelope {
        src_chip: u32_at(4),
        dst_chip: u32_at(8),
        link: Some(link),
        fingerprint: Some(pb::Fingerprint {
            group: u64_at(24),
            seq: u64_at(32),
            op: u32::from(h[48]),
            dtype: u32::from(h[49]),
            count: u64_at(40),
            reduce_op: u32::from(h[50]),
        }),
        tag: Some(pb::Tag {
            lane: u32_at(52),
            phase: u32_at(56),
            step: u32_at(60),
        }),
        arrive_ns: f64::from_bits(u64_at(64)),
        payload: None,
        checksum: (h[15] != 0).then(|| u64_at(72)),
        hops: u32_at(20),
    };
    Ok((env, body, u64_at(80)))
}

/// Largest payload a chip writes to an idle link itself. Above it latency matters less than
/// throughput: the writer task then sends (and finishes any pending reduction of) the payload
/// while the chip's thread goes on with its next step.
const DIRECT_MAX_BYTES: usize = 256 << 10;

/// The sending end of a link, shared by its writer task and the chips' threads.
///
/// A chip's message normally goes through the link's queue to the writer task, which costs a
/// thread hand-off (the task's wake-up) per message: most of a small message's latency. While
/// the task is idle (nothing queued, nothing in hand) a chip writes its record itself, with
/// a non-blocking vectored write. Order on the wire is kept by one flag under a lock: the
/// task marks itself idle only when its queue is empty, every enqueue marks it busy, and a
/// direct write happens only while it is idle, so nothing a chip writes can overtake what was
/// queued before it.
#[derive(Debug)]
pub(crate) struct LinkWriter {
    /// The socket, once the link runs over one (never, for a gRPC link: then every message
    /// is queued).
    out: std::sync::OnceLock<LinkWrite>,
    /// The shared region large payloads are lent from, when the link has one.
    lender: std::sync::OnceLock<Outbound>,
    /// Exists from the peer's creation, so that every message ever queued to the peer was
    /// queued under it, including those queued before the socket was attached.
    idle: std::sync::Mutex<bool>,
    /// Why the link stopped taking records, once a write to its socket failed: a chip that
    /// finds the link closed says so.
    failure: std::sync::OnceLock<String>,
}

/// What became of a message offered to [`LinkWriter::write_if_idle`].
pub(crate) enum Direct {
    /// On the socket (whole, or its start, with the rest queued first).
    Done,
    /// The writer task is busy: queue the message (and where its payload was lent, if it was).
    Busy(Message, Option<Place>),
    /// The socket refused the write: the link is broken and the message lost, as a queued
    /// message is when the writer task finds the link broken (the caller reports the link
    /// closed, with the socket's error from [`LinkWriter::failure`]; the coordinator learns of
    /// a dead worker through its session).
    Failed,
}

impl LinkWriter {
    pub(crate) fn new() -> LinkWriter {
        LinkWriter {
            out: std::sync::OnceLock::new(),
            lender: std::sync::OnceLock::new(),
            idle: std::sync::Mutex::new(false),
            failure: std::sync::OnceLock::new(),
        }
    }

    /// Why writing to the link failed, once it has.
    pub(crate) fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    fn failed(&self, e: &io::Error) {
        let _ = self.failure.set(format!("writing to it failed: {e}"));
    }

    /// Gives the link its socket (once; false when it had one already). It stays busy until
    /// its writer task has found the queue empty.
    pub(crate) fn attach(&self, out: LinkWrite, lender: Option<Outbound>) -> bool {
        if let Some(lender) = lender
            && self.lender.set(lender).is_err()
        {
            return false;
        }
        self.out.set(out).is_ok()
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, bool> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks the writer task busy for as long as the guard lives (a message is being queued).
    pub(crate) fn mark_busy(&self) -> std::sync::MutexGuard<'_, bool> {
        let mut idle = self.idle();
        *idle = false;
        idle
    }

    /// Writes `msg` from this thread when the writer task is idle (a large enough payload into
    /// the shared region, when the link has one, and only its header to the socket). When
    /// the socket takes only part of the record, `queue_rest(msg, bytes_written, lent)`
    /// queues the rest while the lock is held (it returns false when the queue is closed; it
    /// must not take this lock again).
    pub(crate) fn write_if_idle(
        &self,
        msg: Message,
        queue_rest: impl FnOnce(Message, usize, Option<Place>) -> bool,
    ) -> Direct {
        let Some(out) = self.out.get() else {
            return Direct::Busy(msg, None);
        };
        if msg.payload.len() * 4 > DIRECT_MAX_BYTES {
            return Direct::Busy(msg, None);
        }
        // The payload is lent (its pending reduction computed into the region) or its
        // reduction finished before the lock is taken: the writer task may be waiting for it.
        let (msg, lent) = ready(self.lender.get(), msg);
        let mut idle = self.idle();
        if !*idle {
            return Direct::Busy(msg, lent);
        }
        let mut header = Vec::with_capacity(HEADER_BYTES);
        encode_header(&msg, lent, &mut header);
        let mut slices = Vec::new();
        record_slices(&msg, &header, &mut slices);
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        let written = match write_now(out, &mut rest) {
            Ok(n) => n,
            Err(e) => {
                self.failed(&e);
                return Direct::Failed;
            }
        };
        // A TLS link may hold encrypted bytes the socket had no room for: the writer task
        // sends them (the whole record is then queued as written).
        if rest.is_empty() && out.flushed() {
            return Direct::Done;
        }
        *idle = false;
        if queue_rest(msg, written, lent) {
            Direct::Done
        } else {
            Direct::Failed
        }
    }
}

/// Writes queued messages to the socket until the queue closes or the peer goes away.
///
/// Messages waiting together go out in one vectored write: their headers from one small
/// buffer and their payload runs straight from the chips' shared buffers, so no payload byte
/// is copied in user space however finely an algorithm cuts its messages. A large payload on a
/// link with a shared region is instead written into the region (a pending reduction computed
/// straight into it) and only its header goes on the socket. With nothing left to write the
/// task marks the link idle, and chips write to it themselves until they queue again.
pub(crate) async fn pump_out(
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    writer: Arc<LinkWriter>,
) {
    let Some(out) = writer.out.get() else {
        return;
    };
    let lender = writer.lender.get();
    let mut batch: Vec<Message> = Vec::new();
    let mut headers: Vec<u8> = Vec::new();
    loop {
        let waiting = {
            let mut idle = writer.idle();
            match queue.try_recv() {
                Ok(o) => Some(o),
                Err(mpsc::error::TryRecvError::Empty) => {
                    *idle = true;
                    None
                }
                Err(mpsc::error::TryRecvError::Disconnected) => return,
            }
        };
        let first = match waiting {
            Some(o) => o,
            None => match queue.recv().await {
                Some(o) => o,
                None => return,
            },
        };
        // Only a message queued while the link was idle can have been started directly, and
        // it is then the first one queued.
        let skip = first.skip;
        batch.clear();
        headers.clear();
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(o) = next {
            // A message a chip lent or started keeps the body it has.
            let (msg, lent) = match (o.lent, o.skip) {
                (Some(place), _) => (o.msg, Some(place)),
                (None, 0) => ready(lender, o.msg),
                (None, _) => ready(None, o.msg),
            };
            encode_header(&msg, lent, &mut headers);
            bytes += HEADER_BYTES + payload_bytes(&msg.payload);
            batch.push(msg);
            // `o`'s queue room is released here: its message is in the batch, which is
            // bounded by BATCH_BYTES (and one message).
            next = if bytes < BATCH_BYTES {
                queue.try_recv().ok()
            } else {
                None
            };
        }
        if let Err(e) = write_batch(&batch, &headers, skip, out).await {
            return writer.failed(&e);
        }
    }
}

/// `msg` as its record will carry it: its payload lent through `lender` when the link has a
/// region and the payload is large enough (the record then carries only the place), or with
/// any pending reduction finished, to go inline.
fn ready(lender: Option<&Outbound>, msg: Message) -> (Message, Option<Place>) {
    let lent = lender.and_then(|l| l.lend(&msg.payload));
    let payload = match lent {
        Some(_) => Payload::Meta(msg.payload.len()),
        None => msg.payload.resolve(),
    };
    (Message { payload, ..msg }, lent)
}

/// The bytes of a payload's values on the wire (none for a meta payload).
fn payload_bytes(payload: &Payload) -> usize {
    payload.as_rope().map_or(0, |r| 4 * r.len())
}

/// One message's record as buffers to write: its header, then its payload runs.
fn record_slices<'a>(msg: &'a Message, header: &'a [u8], slices: &mut Vec<IoSlice<'a>>) {
    slices.push(IoSlice::new(header));
    let Some(rope) = msg.payload.as_rope() else {
        return;
    };
    for run in rope.runs() {
        match run {
            Run::Values(values) => slices.push(IoSlice::new(bytemuck::cast_slice(values))),
            Run::Zeros(n) => {
                let mut left = 4 * n;
                while left > 0 {
                    let k = left.min(ZEROS.len());
                    slices.push(IoSlice::new(&ZEROS[..k]));
                    left -= k;
                }
            }
        }
    }
}

/// Writes each message's record with vectored writes, less the first `skip` bytes (already
/// written by a chip).
async fn write_batch(
    batch: &[Message],
    headers: &[u8],
    skip: usize,
    out: &LinkWrite,
) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::new();
    for (msg, header) in batch.iter().zip(headers.chunks_exact(HEADER_BYTES)) {
        record_slices(msg, header, &mut slices);
    }
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    IoSlice::advance_slices(&mut rest, skip);
    // `write_now` stops only when the socket is full or the batch is out: one wait for room
    // (one registration with tokio's reactor) however many times the socket fills.
    out.when_writable(|| {
        write_now(out, &mut rest)?;
        if rest.is_empty() {
            Ok(())
        } else {
            Err(io::ErrorKind::WouldBlock.into())
        }
    })
    .await?;
    out.flush().await
}

/// Writes from `rest` what the socket takes without blocking, advancing `rest` past it;
/// returns how many bytes that was. A socket that takes nothing while writable is an error.
fn write_now(out: &LinkWrite, rest: &mut &mut [IoSlice<'_>]) -> io::Result<usize> {
    let mut written = 0;
    while !rest.is_empty() {
        let upto = rest.len().min(MAX_IOVECS);
        match out.try_write_vectored(&rest[..upto]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                written += n;
                IoSlice::advance_slices(rest, n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(written)
}

/// Records a drain delivers before it lets its caller go on (the rest wait for the next
/// drain): a peer that keeps writing cannot hold the reading thread forever.
const DRAIN_RECORDS: usize = 256;

/// What a [`RecordReader::drain`] left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drained {
    /// Everything that had arrived was delivered: wait for more.
    Empty,
    /// It stopped at its budget: more may have arrived already, in the socket or already in
    /// this reader's buffer (where no readiness of the socket says so): drain again without
    /// waiting.
    More,
    /// The peer closed the link between records.
    Closed,
}

/// Reads a link's records without blocking, validates each and delivers it: what has
/// arrived is delivered, a record still arriving is kept (header or payload in part) for the
/// next drain. Small records arrive several per read into a buffer; an inline payload is
/// read straight into the buffer that becomes the message's payload.
#[derive(Debug)]
pub(crate) struct RecordReader {
    peer: u32,
    /// The peer's region, where its large payloads lie (when the link has one).
    shared: Option<Inbound>,
    buf: Box<[u8]>,
    /// The unread bytes of `buf`.
    start: usize,
    end: usize,
    /// A record whose inline payload is still arriving: its envelope, its values, and how
    /// many of their bytes have come.
    partial: Option<(pb::Envelope, Vec<f32>, usize)>,
}

impl RecordReader {
    pub(crate) fn new(peer: u32, shared: Option<Inbound>) -> RecordReader {
        RecordReader {
            peer,
            shared,
            buf: vec![0u8; READ_BUFFER_BYTES].into_boxed_slice(),
            start: 0,
            end: 0,
            partial: None,
        }
    }

    /// Hands `deliver` every whole record that has arrived on `input` (up to a budget): its
    /// envelope, still to be checked, and its payload. An error says what was wrong with the
    /// link or its records, or is what `deliver` returned.
    pub(crate) fn drain(
        &mut self,
        input: &RawLink,
        deliver: &mut impl FnMut(pb::Envelope, Payload) -> Result<(), String>,
    ) -> Result<Drained, String> {
        let peer = self.peer;
        let failed = |e: io::Error| format!("link from worker {peer}: {e}");
        let bad = |e: String| format!("link from worker {peer}: bad record: {e}");
        // A read that filled less than it asked for took everything the socket held then:
        // the next read would only say `WouldBlock`, a system call per drain for nothing.
        // Input after it (including what TCP's backlog adds just after a read) wakes the next
        // wait: `poll(2)` sees it, and tokio's readiness was cleared before this drain.
        let mut emptied = false;
        for _ in 0..DRAIN_RECORDS {
            if self.partial.is_some() {
                if !self.fill_payload(input, &mut emptied)? {
                    return Ok(Drained::Empty);
                }
                if let Some((env, values, _)) = self.partial.take() {
                    deliver(env, Payload::from_vec(values))?;
                }
                continue;
            }
            if self.end - self.start < HEADER_BYTES {
                if emptied {
                    return Ok(Drained::Empty);
                }
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
                let want = self.buf.len() - self.end;
                match input.read(&mut self.buf[self.end..]) {
                    Ok(0) if self.end == 0 => return Ok(Drained::Closed),
                    Ok(0) => return Err(bad("short header: the peer closed".into())),
                    Ok(n) => {
                        self.end += n;
                        emptied = n < want;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Drained::Empty),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(failed(e)),
                }
                continue;
            }
            let mut header = [0u8; HEADER_BYTES];
            header.copy_from_slice(&self.buf[self.start..self.start + HEADER_BYTES]);
            self.start += HEADER_BYTES;
            let (env, body, len) = decode_header(&header).map_err(bad)?;
            let len = payload_len(body != Body::Meta, len).map_err(bad)?;
            match body {
                Body::Meta => deliver(env, Payload::Meta(len))?,
                Body::Inline => self.partial = Some((env, Payload::receive_buffer(len), 0)),
                Body::Lent(place) => {
                    let payload = self
                        .shared
                        .as_ref()
                        .ok_or("a shared-memory payload on a link without a shared region")
                        .map_err(|e| bad(e.to_string()))?
                        .take(place, len)
                        .map_err(bad)?;
                    deliver(env, payload)?;
                }
            }
        }
        Ok(Drained::More)
    }

    /// Reads the rest of the payload being received, from the buffer, then from `input`
    /// until it is whole (true) or the socket has no more for now (false). `emptied` says,
    /// and is told, whether the last read took everything the socket held.
    fn fill_payload(&mut self, input: &RawLink, emptied: &mut bool) -> Result<bool, String> {
        let peer = self.peer;
        let Some((_, values, got)) = &mut self.partial else {
            return Ok(true);
        };
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(values);
        let buffered = (self.end - self.start).min(bytes.len() - *got);
        bytes[*got..*got + buffered].copy_from_slice(&self.buf[self.start..self.start + buffered]);
        self.start += buffered;
        *got += buffered;
        while *got < bytes.len() {
            if *emptied {
                return Ok(false);
            }
            let want = bytes.len() - *got;
            match input.read(&mut bytes[*got..]) {
                Ok(0) => {
                    return Err(format!(
                        "link from worker {peer}: bad record: short payload: the peer closed"
                    ));
                }
                Ok(n) => {
                    *got += n;
                    *emptied = n < want;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(format!("link from worker {peer}: {e}")),
            }
        }
        Ok(true)
    }

    /// The worker this link comes from.
    pub(crate) fn peer(&self) -> u32 {
        self.peer
    }
}

/// The element count of a record's payload, refused when its values would exceed the frame
/// limit (meta payloads are only a count).
fn payload_len(has_values: bool, len: u64) -> Result<usize, String> {
    let too_big = || format!("payload of {len} elements (limit {MAX_FRAME_BYTES} bytes)");
    let len = usize::try_from(len).map_err(|_| too_big())?;
    if has_values && len > MAX_FRAME_BYTES / 4 {
        return Err(too_big());
    }
    Ok(len)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::net::NodeFabric;
    use crate::wire;
    use podsim_collectives::{DType, Fingerprint, OpKind, ReduceOp, Tag};

    #[test]
    fn a_header_says_what_the_envelope_says() {
        let msg = Message {
            src: 3,
            dst: 11,
            link: Link::Dcn { peer_slice: 2 },
            hops: 1,
            fingerprint: Fingerprint {
                group: 77,
                seq: 5,
                op: OpKind::AllReduce,
                dtype: DType::Bf16,
                count: 1 << 40,
                reduce: Some(ReduceOp::Max),
            },
            tag: Tag {
                lane: 2,
                phase: 9,
                step: 123_456,
            },
            arrive_ns: 1.5e9,
            payload: Payload::Meta(1 << 33),
            checksum: Some(0xdead_beef),
        };
        let mut out = Vec::new();
        encode_header(&msg, None, &mut out);
        let header: [u8; HEADER_BYTES] = out.try_into().unwrap_or([0; HEADER_BYTES]);
        let (env, body, len) = decode_header(&header).unwrap_or_else(|e| panic!("{e}"));
        // A lent payload's place survives the header too.
        let place = Place {
            region: Region::decode(&[9; Region::BYTES]),
            slot: 7,
            offset: 1 << 33,
        };
        let mut lent = Vec::new();
        encode_header(&msg, Some(place), &mut lent);
        let lent: [u8; HEADER_BYTES] = lent.try_into().unwrap_or([0; HEADER_BYTES]);
        assert_eq!(decode_header(&lent).map(|d| d.1), Ok(Body::Lent(place)));
        let direct = wire::encode(msg);
        assert_eq!(body, Body::Meta);
        assert_eq!(len, 1 << 33);
        assert_eq!(
            pb::Envelope {
                payload: None,
                ..direct
            },
            env
        );
        let mut bad = header;
        bad[0] ^= 1;
        assert!(decode_header(&bad).is_err());
    }

    /// Message `seq` of chip `src`: its first value says who sent it and which it is, value
    /// `i` after it is `i` (all exact in f32).
    fn numbered(src: u32, seq: u32, len: usize) -> Message {
        let values = (0..len).map(|i| {
            if i == 0 {
                (src * 1000 + seq) as f32
            } else {
                i as f32
            }
        });
        wire::tests::message(src, seq, Payload::from_vec(values.collect()))
    }

    fn multi_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn chips_writing_directly_never_overtake_or_tear_queued_records() {
        multi_thread().block_on(async {
            let (a, b) = UnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
            records_arrive_whole_and_in_order(LinkStream::Unix(a), LinkStream::Unix(b)).await;
        });
    }

    /// A link whose peer is gone fails at its next write, queued or direct, and says why: a
    /// chip that finds the link closed reports the socket's error, not only that it closed.
    #[test]
    fn a_link_whose_peer_is_gone_says_why_it_failed() {
        multi_thread().block_on(async {
            let gone = || {
                let (a, b) = UnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
                drop(b);
                let (_, out) = LinkStream::Unix(a)
                    .into_split()
                    .unwrap_or_else(|e| panic!("{e}"));
                let writer = Arc::new(LinkWriter::new());
                assert!(writer.attach(out, None));
                let (tx, rx) = mpsc::unbounded_channel();
                let pump = tokio::spawn(pump_out(rx, writer.clone()));
                (writer, tx, pump)
            };
            let broken_pipe = |writer: &LinkWriter| {
                let why = writer
                    .failure()
                    .unwrap_or_else(|| panic!("no failure recorded"));
                assert!(why.contains("Broken pipe"), "{why}");
            };
            // Queued: the writer task's write fails, and the task ends.
            let (writer, tx, pump) = gone();
            assert!(writer.failure().is_none());
            assert!(
                tx.send(Outgoing::unbudgeted(numbered(0, 0, 100), 0))
                    .is_ok()
            );
            tokio::time::timeout(Duration::from_secs(10), pump)
                .await
                .unwrap_or_else(|_| panic!("the writer task did not end"))
                .unwrap_or_else(|e| panic!("{e}"));
            broken_pipe(&writer);
            // Direct: once the task is idle, a chip's own write fails.
            let (writer, _tx, _pump) = gone();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                match writer.write_if_idle(numbered(0, 0, 100), |_, _, _| true) {
                    Direct::Failed => break,
                    Direct::Done => panic!("a write to a closed socket succeeded"),
                    Direct::Busy(..) => {
                        assert!(tokio::time::Instant::now() < deadline, "never idle");
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            broken_pipe(&writer);
        });
    }

    #[test]
    fn records_inside_tls_arrive_whole_and_in_order() {
        multi_thread().block_on(async {
            let tls = test_tls("job-node");
            let (dialler, listener) = tls_pair(&tls, &tls).await;
            let (a, b) = (
                dialler.unwrap_or_else(|e| panic!("{e}")),
                listener.unwrap_or_else(|e| panic!("{e}")),
            );
            assert!(a.is_tls() && b.is_tls());
            records_arrive_whole_and_in_order(a, b).await;
        });
    }

    /// The job's TLS material of the tests (`coordinator/tests/fixtures/tls`), with the
    /// certificate and key of `node` (`job-node`, or `other-node`: signed by another
    /// authority).
    pub(crate) fn test_tls(node: &str) -> Tls {
        test_tls_expecting(node, crate::tls::DEFAULT_SERVER_NAME)
    }

    /// [`test_tls`] expecting `server_name` in the listener's certificate (loaded unchecked:
    /// a foreign node or name is what the handshake must refuse).
    fn test_tls_expecting(node: &str, server_name: &str) -> Tls {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../coordinator/tests/fixtures/tls"
        );
        let files = crate::tls::TlsFiles {
            ca: format!("{dir}/job-ca.pem").into(),
            cert: format!("{dir}/{node}.pem").into(),
            key: format!("{dir}/{node}.key").into(),
            server_name: server_name.into(),
        };
        Tls::load_foreign(&files).unwrap_or_else(|e| panic!("{e:?}"))
    }

    /// A TLS record link over loopback between a dialler with `dialling` and a listener
    /// with `listening`, as each side ends it.
    async fn tls_pair(
        dialling: &Tls,
        listening: &Tls,
    ) -> (Result<LinkStream, String>, Result<LinkStream, String>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let listening = listening.clone();
        let accepted = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap_or_else(|e| panic!("{e}"));
            accept_tls(s, &listening).await
        });
        let s = TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let dialled = tokio::time::timeout(BOUNDED, start_tls(s, dialling))
            .await
            .unwrap_or_else(|_| Err("no handshake in time".into()));
        let accepted = tokio::time::timeout(BOUNDED, accepted).await;
        let accepted = match accepted {
            Ok(Ok(r)) => r,
            _ => Err("the listener did not finish".into()),
        };
        (dialled, accepted)
    }

    #[test]
    fn a_dialler_refuses_a_listener_of_another_authority_or_name() {
        multi_thread().block_on(async {
            let job = test_tls("job-node");
            for (dialling, listening) in [
                // The listener presents a certificate another authority signed.
                (job.clone(), test_tls("other-node")),
                // The listener's certificate is the job's, but names another server.
                (test_tls_expecting("job-node", "not-podsim"), job.clone()),
            ] {
                let (dialled, _) = tls_pair(&dialling, &listening).await;
                match dialled {
                    Err(e) => assert!(e.contains("TLS handshake"), "{e}"),
                    Ok(_) => panic!("the dialler accepted a listener it should not trust"),
                }
            }
        });
    }

    #[test]
    fn a_tls_link_needs_a_certificate_of_the_jobs_authority() {
        multi_thread().block_on(async {
            let (job, foreign) = (test_tls("job-node"), test_tls("other-node"));
            let (dialled, accepted) = tls_pair(&foreign, &job).await;
            let Err(a) = accepted else {
                panic!("a certificate of another authority was admitted");
            };
            assert!(a.contains("TLS handshake"), "{a}");
            // Under TLS 1.3 the dialler's side of the handshake may end before the listener
            // has checked its certificate: it learns of the refusal at its first read.
            if let Ok(mut stream) = dialled {
                let mut byte = [0u8; 1];
                let read = tokio::time::timeout(BOUNDED, stream.read(&mut byte)).await;
                assert!(matches!(read, Ok(Err(_) | Ok(0))), "{read:?}");
            }
        });
    }

    /// Chips on their own threads write records to `a` as a worker's do (directly while the
    /// link is idle, queued otherwise); the intake's reader reads them from `b`: each must
    /// arrive once, whole, in each chip's order.
    async fn records_arrive_whole_and_in_order(a: LinkStream, b: LinkStream) {
        let (senders, per_sender) = (4u32, 150u32);
        {
            let (_, out) = a.into_split().unwrap_or_else(|e| panic!("{e}"));
            let writer = Arc::new(LinkWriter::new());
            assert!(writer.attach(out, None));
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(pump_out(rx, writer.clone()));
            // Chips on their own threads, as in a worker: small records (written directly
            // when the link is idle), larger ones (beyond the socket's buffer: written in
            // part, the rest queued, or queued whole) and some above the direct-write limit
            // (always queued) mixed, so every path meets every other.
            let threads: Vec<_> = (0..senders)
                .map(|src| {
                    let (writer, tx) = (writer.clone(), tx.clone());
                    std::thread::spawn(move || {
                        for seq in 0..per_sender {
                            let len = match (seq + src) % 7 {
                                0 => 60_000,
                                3 => 100_000,
                                _ => 100,
                            };
                            let queue =
                                |msg, skip, _| tx.send(Outgoing::unbudgeted(msg, skip)).is_ok();
                            let msg = match writer.write_if_idle(numbered(src, seq, len), queue) {
                                Direct::Done => continue,
                                // This link has no region: nothing is lent.
                                Direct::Busy(msg, _) => msg,
                                Direct::Failed => panic!("the link failed"),
                            };
                            let _busy = writer.mark_busy();
                            assert!(tx.send(Outgoing::unbudgeted(msg, 0)).is_ok());
                        }
                    })
                })
                .collect();
            // The reader the links use, slower than the writers (it rests between drains),
            // so that the socket fills up and records arrive in pieces.
            let (input, _) = b.into_split().unwrap_or_else(|e| panic!("{e}"));
            let watched = crate::socket::watch_input(&input).unwrap_or_else(|e| panic!("{e}"));
            const STUCK: Duration = Duration::from_secs(10);
            let mut reader = RecordReader::new(0, None);
            let mut next = vec![0u32; senders as usize];
            let got = std::cell::Cell::new(0);
            let mut check = |env: pb::Envelope, payload: Payload| {
                let values = payload.to_vec().ok_or("a meta payload")?;
                let (src, seq) = (env.src_chip, env.tag.map_or(0, |t| t.step));
                if seq != next[src as usize] {
                    return Err(format!("chip {src}: {seq} out of order"));
                }
                next[src as usize] += 1;
                let intact = values[0] == (src * 1000 + seq) as f32
                    && values
                        .iter()
                        .enumerate()
                        .skip(1)
                        .all(|(i, v)| *v == i as f32);
                if !intact {
                    return Err(format!("chip {src}: record {seq} torn"));
                }
                got.set(got.get() + 1);
                Ok(())
            };
            let read_all = async {
                while got.get() < senders * per_sender {
                    match reader.drain(&input, &mut check) {
                        Ok(Drained::More) => {}
                        Ok(Drained::Empty) if got.get() == senders * per_sender => {}
                        Ok(Drained::Empty) => {
                            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                            // Then as the intake waits: on the socket's readiness, so that a
                            // record left inside the link (a TLS link's state) is a failure.
                            let ready = tokio::time::timeout(STUCK, watched.readable()).await;
                            match ready {
                                Ok(Ok(mut ready)) => ready.clear_ready(),
                                Ok(Err(e)) => panic!("{e}"),
                                Err(_) => panic!(
                                    "records missing and the socket silent: {} of {} arrived",
                                    got.get(),
                                    senders * per_sender
                                ),
                            }
                        }
                        other => panic!("{other:?}"),
                    }
                }
            };
            // A torn record would leave the reader waiting for bytes that never come.
            let deadline = std::time::Duration::from_secs(60);
            assert!(
                tokio::time::timeout(deadline, read_all).await.is_ok(),
                "stuck"
            );
            for t in threads {
                assert!(t.join().is_ok());
            }
        }
    }

    #[test]
    fn forced_shared_memory_fails_where_tried_sharing_falls_back() {
        let token = "job-token";
        let region = |tag_token: &str| {
            Outbound::create(1 << 20, &shm::job_tag(tag_token)).unwrap_or_else(|e| panic!("{e}"))
        };
        let ours = region(token);
        let other_job = region("another job's token");
        // A region of this job maps under every mode that shares.
        for sharing in [Sharing::Try, Sharing::Must] {
            assert!(matches!(
                sharing.map_peers(ours.region(), token),
                Ok(Some(_))
            ));
        }
        assert!(matches!(
            Sharing::Never.map_peers(ours.region(), token),
            Ok(None)
        ));
        // No region, or another job's: `auto` goes on over the socket alone, `shm` refuses
        // and says why.
        for offered in [Region::default(), other_job.region()] {
            assert!(matches!(Sharing::Try.map_peers(offered, token), Ok(None)));
            let refused = Sharing::Must.map_peers(offered, token);
            assert!(refused.is_err_and(|e| e.contains("region")), "{offered:?}");
        }
        assert_eq!(Sharing::of(Transport::Auto), Sharing::Try);
        assert_eq!(Sharing::of(Transport::Shm), Sharing::Must);
        assert_eq!(Sharing::of(Transport::Uds), Sharing::Never);
        assert_eq!(Sharing::of(Transport::Tcp), Sharing::Never);
        assert_eq!(Sharing::of(Transport::Grpc), Sharing::Never);
        assert!(matches!(Sharing::Never.own_region(token), Ok(None)));
        assert!(matches!(Sharing::Must.own_region(token), Ok(Some(_))));
    }

    /// The fabric a test's link port waits for (never set; dropping it would read as the
    /// worker shutting down).
    type NoFabric = watch::Sender<Option<Arc<NodeFabric>>>;

    /// A link port on loopback routed by `route_tcp_with` (with `tls` or without): its address,
    /// the receiving end of what it hands to gRPC, and its fabric.
    async fn link_port(
        tls: Option<Tls>,
    ) -> (String, mpsc::Receiver<io::Result<TcpStream>>, NoFabric) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
        let (fabric_tx, fabric) = watch::channel(None);
        let (grpc_tx, grpc_rx) = mpsc::channel(4);
        tokio::spawn(route_tcp_with::<NodeFabric>(
            listener,
            tls,
            "job-token".into(),
            fabric,
            grpc_tx,
            Limits::default(),
        ));
        (addr.to_string(), grpc_rx, fabric_tx)
    }

    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"))
    }

    const BOUNDED: Duration = Duration::from_secs(20);

    #[test]
    fn the_tcp_port_tells_record_links_from_grpc_by_their_first_bytes() {
        current_thread().block_on(async {
            let (addr, mut grpc, _fabric) = link_port(None).await;
            // HTTP/2's preface starts with the same letter as the record magic: it goes to
            // gRPC, its bytes untouched.
            let mut h2 = TcpStream::connect(&addr)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let Ok(Some(Ok(forwarded))) = tokio::time::timeout(BOUNDED, grpc.recv()).await else {
                panic!("the gRPC connection was not handed on");
            };
            let mut first = [0u8; 3];
            let peeked = forwarded
                .peek(&mut first)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(&first[..peeked], &b"PRI"[..peeked]);
            // A record hello with the wrong token is refused, saying why, and never reaches gRPC.
            match tokio::time::timeout(BOUNDED, dial_tcp(&addr, 1, 0, "wrong", None)).await {
                Ok(Err(e)) => assert!(e.to_string().contains("token"), "{e}"),
                Ok(Ok(_)) => panic!("a wrong token was admitted"),
                Err(_) => panic!("no answer to the hello"),
            }
            assert!(grpc.try_recv().is_err());
        });
    }

    #[test]
    fn a_hello_in_pieces_is_a_record_link_and_part_of_one_is_given_up_on() {
        current_thread().block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
            let accept = || async {
                let (s, _) = listener.accept().await.unwrap_or_else(|e| panic!("{e}"));
                s
            };
            // The magic split over two writes, 30 ms apart.
            let mut dialler = TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            dialler.set_nodelay(true).unwrap_or_else(|e| panic!("{e}"));
            let accepted = accept().await;
            dialler
                .write_all(&HELLO_MAGIC[..2])
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let pieces = async {
                tokio::time::sleep(Duration::from_millis(30)).await;
                dialler.write_all(&HELLO_MAGIC[2..]).await
            };
            let (seen, written) = tokio::join!(opens_with(&accepted), pieces);
            assert!(written.is_ok());
            assert_eq!(seen.unwrap_or_else(|e| panic!("{e}")), Opening::Records);
            // The TLS preamble, which shares the record magic's first six bytes.
            let mut tls = TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let accepted = accept().await;
            tls.write_all(TLS_MAGIC)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let seen = opens_with(&accepted).await;
            assert_eq!(seen.unwrap_or_else(|e| panic!("{e}")), Opening::TlsRecords);
            // Part of the magic, then nothing: given up on, not taken for gRPC, within about
            // a second.
            let mut half = TcpStream::connect(addr)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let accepted = accept().await;
            half.write_all(&HELLO_MAGIC[..3])
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            drop(half);
            let verdict = tokio::time::timeout(BOUNDED, opens_with(&accepted)).await;
            assert!(matches!(verdict, Ok(Err(_))), "{verdict:?}");
        });
    }

    #[test]
    fn plain_and_tls_record_links_are_refused_by_the_other_kind_of_port_saying_why() {
        current_thread().block_on(async {
            let tls = test_tls("job-node");
            let refused = |dialled: Option<Result<(LinkStream, Regions), LinkError>>| match dialled
            {
                Some(Err(e)) => e.to_string(),
                Some(Ok(_)) => panic!("a record link was made"),
                None => panic!("no answer"),
            };
            // A plain record hello on a TLS worker's port: refused, never handed to gRPC.
            let (addr, mut grpc, _fabric) = link_port(Some(tls.clone())).await;
            let dialled = tokio::time::timeout(BOUNDED, dial_tcp(&addr, 1, 0, "job-token", None));
            let e = refused(dialled.await.ok());
            assert!(e.contains("use TLS") && e.contains("--tls-ca"), "{e}");
            assert!(grpc.try_recv().is_err());
            // A TLS dialler on a plain worker's port: refused in the clear, before any handshake.
            let (addr, mut grpc, _fabric) = link_port(None).await;
            let dialled =
                tokio::time::timeout(BOUNDED, dial_tcp(&addr, 1, 0, "job-token", Some(&tls)));
            let e = refused(dialled.await.ok());
            assert!(e.contains("without TLS"), "{e}");
            assert!(grpc.try_recv().is_err());
        });
    }

    #[test]
    fn an_oversized_payload_is_refused_before_any_allocation() {
        assert!(payload_len(true, (MAX_FRAME_BYTES / 4 + 1) as u64).is_err());
        assert!(payload_len(true, u64::MAX).is_err());
        assert_eq!(payload_len(true, 1024), Ok(1024));
        // A meta payload is a count, never allocated.
        assert_eq!(payload_len(false, 1 << 40), Ok(1 << 40));
    }

    /// Worker 0 of a ring of 4 chips on 2 workers: its only neighbour is worker 1.
    fn two_workers() -> crate::FabricSpec {
        let pod = podsim_topology::Pod::single("4".parse().unwrap_or_else(|e| panic!("{e:?}")));
        crate::FabricSpec {
            pod,
            hardware: podsim_topology::Hardware::preset("v5p").unwrap_or_else(|e| panic!("{e}")),
            workers: 2,
            transport: Transport::Uds,
            strided_routes: Vec::new(),
            shift_groups: Vec::new(),
        }
    }

    /// A record-link listener of worker 0 of [`two_workers`], its fabric set, on a Unix
    /// socket or on a TCP port (plain), under `limits`.
    #[derive(Debug)]
    enum Port {
        Unix(String),
        Tcp(String),
    }

    async fn listening(tcp: bool, limits: Limits) -> (Port, Arc<NodeFabric>) {
        let fabric = NodeFabric::new(two_workers(), 0).unwrap_or_else(|e| panic!("{e}"));
        let (tx, rx) = watch::channel(Some(fabric.clone()));
        // The fabric stays set for the listener's life.
        tokio::spawn(async move { tx.closed().await });
        let port = match tcp {
            false => {
                let (listener, name) = bind().unwrap_or_else(|| panic!("no Unix socket"));
                tokio::spawn(serve_with(listener, "job-token".into(), rx, limits));
                Port::Unix(name)
            }
            true => {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
                let (grpc, mut unused) = mpsc::channel(4);
                tokio::spawn(async move { while unused.recv().await.is_some() {} });
                tokio::spawn(route_tcp_with(
                    listener,
                    None,
                    "job-token".into(),
                    rx,
                    grpc,
                    limits,
                ));
                Port::Tcp(addr.to_string())
            }
        };
        (port, fabric)
    }

    /// A connection to `port` that says nothing.
    async fn silent(port: &Port) -> LinkStream {
        match port {
            Port::Unix(name) => LinkStream::Unix(connect(name).unwrap_or_else(|e| panic!("{e}"))),
            Port::Tcp(addr) => LinkStream::Tcp(
                TcpStream::connect(addr)
                    .await
                    .unwrap_or_else(|e| panic!("{e}")),
            ),
        }
    }

    /// Worker 1 dialling `port` with the job's token.
    async fn worker_dials(port: &Port) -> Result<(LinkStream, Regions), LinkError> {
        let dialled = async {
            match port {
                Port::Unix(name) => dial(name, 1, 0, "job-token", Sharing::Never).await,
                Port::Tcp(addr) => dial_tcp(addr, 1, 0, "job-token", None).await,
            }
        };
        tokio::time::timeout(BOUNDED, dialled)
            .await
            .unwrap_or_else(|_| panic!("no answer to the worker's hello"))
    }

    /// Waits (at most `BOUNDED`) until the listener closes `stream`.
    async fn closed(stream: &mut LinkStream) -> bool {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(BOUNDED, stream.read(&mut byte)).await;
        matches!(read, Ok(Ok(0) | Err(_)))
    }

    /// Whether `stream` is still open, as far as can be told without waiting.
    async fn still_open(stream: &mut LinkStream) -> bool {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(10), stream.read(&mut byte)).await;
        read.is_err()
    }

    /// 200 connections that never say hello do not keep a worker out, on either listener:
    /// the oldest give way as new ones come (closed at once: the deadline here is longer than
    /// the test), the newest still wait, and the worker's link is made.
    #[test]
    fn a_flood_of_silent_connections_leaves_room_for_a_worker() {
        multi_thread().block_on(async {
            for tcp in [false, true] {
                let limits = Limits {
                    pending: 64,
                    hello: Duration::from_secs(600),
                };
                let (port, fabric) = listening(tcp, limits).await;
                let mut flood = Vec::new();
                for _ in 0..200 {
                    flood.push(silent(&port).await);
                }
                let (oldest, newest) = flood.split_at_mut(200 - 64);
                for (i, s) in oldest.iter_mut().enumerate() {
                    assert!(
                        closed(s).await,
                        "{port:?}: silent connection {i} still open"
                    );
                }
                for s in newest.iter_mut() {
                    assert!(
                        still_open(s).await,
                        "{port:?}: a newer connection was closed"
                    );
                }
                let linked = worker_dials(&port).await;
                assert!(linked.is_ok(), "{port:?}: {linked:?}");
                // The worker took the place of the oldest that still waited.
                assert!(closed(&mut newest[0]).await, "{port:?}");
                assert!(still_open(&mut newest[1]).await, "{port:?}");
                let connected = fabric.wait_connected(BOUNDED).await;
                assert!(connected.is_ok(), "{port:?}: {connected:?}");
                let links = fabric.links(false);
                assert!(
                    links.len() == 1 && links[0].peer == 1,
                    "{port:?}: {links:?}"
                );
            }
        });
    }

    /// A connection that says nothing, or part of a hello, is closed at its deadline, and
    /// not before; the listener then still takes a worker.
    #[test]
    fn a_connection_without_a_whole_hello_is_closed_at_its_deadline() {
        multi_thread().block_on(async {
            for tcp in [false, true] {
                let hello = Duration::from_millis(300);
                let limits = Limits { pending: 64, hello };
                let (port, _fabric) = listening(tcp, limits).await;
                let started = tokio::time::Instant::now();
                let mut quiet = silent(&port).await;
                let mut partial = silent(&port).await;
                let _ = partial.write_all(&HELLO_MAGIC[..]).await;
                assert!(closed(&mut quiet).await, "{port:?}");
                assert!(closed(&mut partial).await, "{port:?}");
                // Accepted after `started`, closed at its deadline after that.
                assert!(started.elapsed() >= hello, "{port:?}");
                let linked = worker_dials(&port).await;
                assert!(linked.is_ok(), "{port:?}: {linked:?}");
            }
        });
    }

    /// A TLS dialler and a listener that do not trust each other: the dialler's error comes
    /// at once (not after the dial's patience), names the peer's address and rustls's reason,
    /// whichever side refused the other's certificate.
    #[test]
    fn a_tls_mismatch_fails_at_once_naming_the_peer_and_the_reason() {
        multi_thread().block_on(async {
            let (job, foreign) = (test_tls("job-node"), test_tls("other-node"));
            for (dialling, listening, reason) in [
                // The dialler refuses the listener's certificate.
                (&job, &foreign, "invalid peer certificate"),
                // The listener refuses the dialler's.
                (&foreign, &job, "alert"),
            ] {
                let (addr, _grpc, _fabric) = link_port(Some(listening.clone())).await;
                let soon = Duration::from_secs(5);
                let dialled = tokio::time::timeout(soon, async {
                    dial_tcp(&addr, 1, 0, "job-token", Some(dialling)).await
                })
                .await;
                let e = match dialled {
                    Ok(Err(e)) => e.to_string(),
                    Ok(Ok(_)) => panic!("a link was made between strangers"),
                    Err(_) => panic!("no verdict within {soon:?}"),
                };
                assert!(
                    e.contains(&addr) && e.contains(TLS_FAILED) && e.contains(reason),
                    "{e}"
                );
                assert!(e.contains("signed by the authority in"), "{e}");
            }
        });
    }
}
