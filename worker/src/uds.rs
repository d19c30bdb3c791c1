//! Links between workers on one host: one Unix domain socket per worker pair, carrying each
//! message as a fixed binary header followed by its payload's raw bytes.
//!
//! Why not gRPC here: on loopback the cost of a link is copies and hand-offs, not the network.
//! The gRPC path copies every value into a protobuf buffer, again into HTTP/2 frames, and
//! back out on the other side, and each message passes several tasks. Here a payload goes from
//! the chip's shared buffers straight into the socket (the messages waiting together go out
//! in one vectored write, headers and payload runs side by side), and the receiver reads it
//! straight into a pooled buffer that becomes the message's payload: one copy into the kernel
//! and one out. A small message offered while the link's writer task is idle is written by
//! the chip's own thread ([`LinkWriter`]), which saves a thread hand-off per message. The
//! header carries exactly the
//! envelope's fields and goes through the same validation ([`crate::wire::message`]), so a garbage or
//! oversized record from a peer is refused the same way.
//!
//! A connection opens with a hello (magic, version, the dialling worker's id, the job token);
//! the listener answers `OK` or `NO` with a reason. Sockets live in the abstract namespace
//! (Linux): nothing on disk to clean up after a killed worker, and the token keeps other
//! local users out. Workers on one host and network namespace are recognised by
//! [`host_id`]. Both ends write and read the payload in the host's byte order, which is the
//! same at both ends by construction.

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use podsim_collectives::{Message, Payload, Run};
use podsim_proto::v1 as pb;
use podsim_topology::{Dir, Link};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, watch};

use crate::error::WorkerError;
use crate::net::{NodeFabric, Outgoing, same_token};
use crate::wire::MAX_FRAME_BYTES;

const HELLO_MAGIC: &[u8; 8] = b"PODSIMLK";
const VERSION: u32 = 1;
/// Longest job token a hello may carry.
const MAX_TOKEN_BYTES: u32 = 4096;
/// How long a dialled connection may take to say hello and be answered.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// First four bytes of every message record ("PSM1"), to catch a stream out of step.
const RECORD_MAGIC: u32 = 0x314D_5350;
const HEADER_BYTES: usize = 88;
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
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("{prefix}-{}-{nanos:09}", std::process::id());
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

/// Accepts links from workers on this host for as long as the listener lives.
pub async fn serve(
    listener: tokio::net::UnixListener,
    token: String,
    fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let token = token.clone();
        let fabric = fabric.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, answer(stream, &token, fabric)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!("refused a local link: {e}"),
                Err(_) => tracing::warn!("a local link did not finish its hello"),
            }
        });
    }
}

/// The listening side of a hello: checks it, waits for the job's fabric, attaches the link.
async fn answer(
    mut stream: UnixStream,
    token: &str,
    mut fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
) -> Result<(), String> {
    let peer = match read_hello(&mut stream, token).await {
        Ok(peer) => peer,
        Err(e) => {
            refuse(&mut stream, &e).await;
            return Err(e);
        }
    };
    let ready = fabric
        .wait_for(Option::is_some)
        .await
        .map_err(|_| "this worker is shutting down".to_string())?
        .clone();
    let Some(fabric) = ready else {
        return Err("no fabric".into());
    };
    let claimed = fabric.claim(peer);
    match claimed {
        Ok(queue) => {
            stream
                .write_all(b"OK")
                .await
                .map_err(|e| format!("worker {peer}: {e}"))?;
            fabric.run_local_link(peer, stream, queue);
            Ok(())
        }
        Err(e) => {
            let e = e.to_string();
            refuse(&mut stream, &e).await;
            Err(e)
        }
    }
}

async fn refuse(stream: &mut UnixStream, reason: &str) {
    let mut out = b"NO".to_vec();
    out.extend((reason.len() as u32).to_le_bytes());
    out.extend(reason.as_bytes());
    let _ = stream.write_all(&out).await;
}

async fn read_hello(stream: &mut UnixStream, token: &str) -> Result<u32, String> {
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
    if !same_token(&given, token.as_bytes()) {
        return Err(format!("worker {peer}: missing or wrong job token"));
    }
    Ok(peer)
}

/// Dials the link of worker `peer` at `name` as worker `me`; the stream once accepted.
pub async fn dial(name: &str, me: u32, peer: u32, token: &str) -> Result<UnixStream, WorkerError> {
    let failed = |e: String| WorkerError::Link(format!("worker {peer} at unix:{name}: {e}"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut stream = loop {
        match connect(name) {
            Ok(s) => break s,
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(failed(e.to_string())),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut hello = HELLO_MAGIC.to_vec();
    hello.extend(VERSION.to_le_bytes());
    hello.extend(me.to_le_bytes());
    hello.extend((token.len() as u32).to_le_bytes());
    hello.extend(token.as_bytes());
    let answered = async {
        stream.write_all(&hello).await?;
        let mut verdict = [0u8; 2];
        stream.read_exact(&mut verdict).await?;
        if &verdict == b"OK" {
            return Ok(Ok(()));
        }
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len).min(MAX_TOKEN_BYTES) as usize;
        let mut reason = vec![0u8; len];
        stream.read_exact(&mut reason).await?;
        Ok::<_, io::Error>(Err(String::from_utf8_lossy(&reason).into_owned()))
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, answered).await {
        Ok(Ok(Ok(()))) => Ok(stream),
        Ok(Ok(Err(reason))) => Err(failed(format!("refused: {reason}"))),
        Ok(Err(e)) => Err(failed(e.to_string())),
        Err(_) => Err(failed("no answer to hello".into())),
    }
}

/// The fixed header of one message record.
fn encode_header(msg: &Message, out: &mut Vec<u8>) {
    let (kind, axis, positive, peer_slice) = match msg.link {
        Link::Ici { axis, dir } => (0u8, axis, u8::from(dir == Dir::Plus), 0u32),
        Link::Dcn { peer_slice } => (1, 0, 0, peer_slice),
    };
    let fp = msg.fingerprint;
    let (payload_kind, len) = match &msg.payload {
        Payload::Meta(n) => (0u8, *n as u64),
        other => (1, other.len() as u64),
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
    debug_assert_eq!(out.len() - start, HEADER_BYTES);
}

/// What a header says: the envelope's fields (no payload) and the payload's kind and length.
fn decode_header(h: &[u8; HEADER_BYTES]) -> Result<(pb::Envelope, bool, u64), String> {
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
    let payload_kind = match h[51] {
        0 => false,
        1 => true,
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
    Ok((env, payload_kind, u64_at(80)))
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
    out: std::sync::OnceLock<OwnedWriteHalf>,
    /// Exists from the peer's creation, so that every message ever queued to the peer was
    /// queued under it, including those queued before the socket was attached.
    idle: std::sync::Mutex<bool>,
}

/// What became of a message offered to [`LinkWriter::write_if_idle`].
pub(crate) enum Direct {
    /// On the socket (whole, or its start, with the rest queued first).
    Done,
    /// The writer task is busy: queue the message.
    Busy(Message),
    /// The socket refused the write: the link is broken and the message lost, as a queued
    /// message is when the writer task finds the link broken (the caller reports the link
    /// closed; the coordinator learns of the dead worker through its session).
    Failed,
}

impl LinkWriter {
    pub(crate) fn new() -> LinkWriter {
        LinkWriter {
            out: std::sync::OnceLock::new(),
            idle: std::sync::Mutex::new(false),
        }
    }

    /// Gives the link its socket (once; false when it had one already). It stays busy until
    /// its writer task has found the queue empty.
    pub(crate) fn attach(&self, out: OwnedWriteHalf) -> bool {
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

    /// Writes `msg` from this thread when the writer task is idle. When the socket takes only
    /// part of the record, `queue_rest(msg, bytes_written)` queues the rest while the lock is
    /// held (it returns false when the queue is closed; it must not take this lock again).
    pub(crate) fn write_if_idle(
        &self,
        msg: Message,
        queue_rest: impl FnOnce(Message, usize) -> bool,
    ) -> Direct {
        let Some(out) = self.out.get() else {
            return Direct::Busy(msg);
        };
        if msg.payload.len() * 4 > DIRECT_MAX_BYTES {
            return Direct::Busy(msg);
        }
        // A pending reduction is finished before the lock is taken: the writer task may be
        // waiting for the lock.
        let msg = Message {
            payload: msg.payload.resolve(),
            ..msg
        };
        let mut idle = self.idle();
        if !*idle {
            return Direct::Busy(msg);
        }
        let mut header = Vec::with_capacity(HEADER_BYTES);
        encode_header(&msg, &mut header);
        let mut slices = Vec::new();
        record_slices(&msg, &header, &mut slices);
        let mut rest: &mut [IoSlice<'_>] = &mut slices;
        let written = match write_now(out, &mut rest) {
            Ok(n) => n,
            Err(_) => return Direct::Failed,
        };
        if rest.is_empty() {
            return Direct::Done;
        }
        *idle = false;
        if queue_rest(msg, written) {
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
/// is copied in user space however finely an algorithm cuts its messages. With nothing left
/// to write the task marks the link idle, and chips write to it themselves until they queue
/// again.
pub(crate) async fn pump_out(
    mut queue: mpsc::UnboundedReceiver<Outgoing>,
    writer: Arc<LinkWriter>,
) {
    let Some(out) = writer.out.get() else {
        return;
    };
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
            let msg = Message {
                payload: o.msg.payload.resolve(),
                ..o.msg
            };
            encode_header(&msg, &mut headers);
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
        if write_batch(&batch, &headers, skip, out).await.is_err() {
            return;
        }
    }
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
    out: &OwnedWriteHalf,
) -> io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::new();
    for (msg, header) in batch.iter().zip(headers.chunks_exact(HEADER_BYTES)) {
        record_slices(msg, header, &mut slices);
    }
    let mut rest: &mut [IoSlice<'_>] = &mut slices;
    IoSlice::advance_slices(&mut rest, skip);
    while !rest.is_empty() {
        out.writable().await?;
        write_now(out, &mut rest)?;
    }
    Ok(())
}

/// Writes from `rest` what the socket takes without blocking, advancing `rest` past it;
/// returns how many bytes that was. A socket that takes nothing while writable is an error.
fn write_now(out: &OwnedWriteHalf, rest: &mut &mut [IoSlice<'_>]) -> io::Result<usize> {
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

/// Reads records from the socket, validates each and delivers it, until the peer closes.
pub(crate) async fn pump_in(fabric: Arc<NodeFabric>, peer: u32, input: OwnedReadHalf) {
    let mut input = BufReader::with_capacity(READ_BUFFER_BYTES, input);
    loop {
        match input.fill_buf().await {
            // The peer closed the link (as the gRPC stream's end: a worker that died is the
            // coordinator's to find, through its control session).
            Ok([]) => return,
            Ok(_) => {}
            Err(e) => return fabric.link_failed(format!("link from worker {peer}: {e}")),
        }
        match read_message(&fabric, peer, &mut input).await {
            Ok(msg) => {
                if let Err(e) = fabric.accept(peer, msg) {
                    return fabric.link_failed(e);
                }
            }
            Err(e) => {
                return fabric.link_failed(format!("link from worker {peer}: bad record: {e}"));
            }
        }
    }
}

async fn read_message(
    fabric: &NodeFabric,
    peer: u32,
    input: &mut BufReader<OwnedReadHalf>,
) -> Result<Message, String> {
    let mut header = [0u8; HEADER_BYTES];
    input
        .read_exact(&mut header)
        .await
        .map_err(|e| format!("short header: {e}"))?;
    let (env, has_values, len) = decode_header(&header)?;
    let len = payload_len(has_values, len)?;
    let payload = if has_values {
        let mut values = Payload::receive_buffer(len);
        input
            .read_exact(bytemuck::cast_slice_mut(&mut values))
            .await
            .map_err(|e| format!("short payload: {e}"))?;
        Payload::from_vec(values)
    } else {
        Payload::Meta(len)
    };
    fabric.decode(env, payload, peer)
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
mod tests {
    use super::*;
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
        encode_header(&msg, &mut out);
        let header: [u8; HEADER_BYTES] = out.try_into().unwrap_or([0; HEADER_BYTES]);
        let (env, values, len) = decode_header(&header).unwrap_or_else(|e| panic!("{e}"));
        let direct = wire::encode(msg);
        assert!(!values);
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
        Message {
            src,
            dst: 0,
            link: Link::Ici {
                axis: 0,
                dir: Dir::Plus,
            },
            hops: 1,
            fingerprint: Fingerprint {
                group: 1,
                seq: u64::from(seq),
                op: OpKind::AllReduce,
                dtype: DType::F32,
                count: len as u64,
                reduce: Some(ReduceOp::Sum),
            },
            tag: Tag {
                lane: 0,
                phase: 0,
                step: seq,
            },
            arrive_ns: 0.0,
            payload: Payload::from_vec(values.collect()),
            checksum: None,
        }
    }

    #[test]
    fn chips_writing_directly_never_overtake_or_tear_queued_records() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        let (senders, per_sender) = (4u32, 150u32);
        rt.block_on(async {
            let (a, b) = UnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
            let (_, out) = a.into_split();
            let writer = Arc::new(LinkWriter::new());
            assert!(writer.attach(out));
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
                                |msg, skip| tx.send(Outgoing::unbudgeted(msg, skip)).is_ok();
                            let msg = match writer.write_if_idle(numbered(src, seq, len), queue) {
                                Direct::Done => continue,
                                Direct::Busy(msg) => msg,
                                Direct::Failed => panic!("the link failed"),
                            };
                            let _busy = writer.mark_busy();
                            assert!(tx.send(Outgoing::unbudgeted(msg, 0)).is_ok());
                        }
                    })
                })
                .collect();
            // A reader slower than the writers, so that the socket fills up.
            let (input, _) = b.into_split();
            let mut input = BufReader::with_capacity(READ_BUFFER_BYTES, input);
            let mut next = vec![0u32; senders as usize];
            let read_all = async {
                for _ in 0..senders * per_sender {
                    let mut header = [0u8; HEADER_BYTES];
                    input
                        .read_exact(&mut header)
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let (env, _, len) = decode_header(&header).unwrap_or_else(|e| panic!("{e}"));
                    let mut values = vec![0f32; len as usize];
                    input
                        .read_exact(bytemuck::cast_slice_mut(&mut values))
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let (src, seq) = (env.src_chip, env.tag.map_or(0, |t| t.step));
                    assert_eq!(seq, next[src as usize], "chip {src}: out of order");
                    next[src as usize] += 1;
                    assert_eq!(values[0], (src * 1000 + seq) as f32);
                    assert!(
                        values
                            .iter()
                            .enumerate()
                            .skip(1)
                            .all(|(i, v)| *v == i as f32)
                    );
                    if seq % 16 == 0 {
                        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
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
}
