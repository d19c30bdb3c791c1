//! The fabric of one worker process: chips it hosts talk through in-memory inboxes; chips of
//! other workers are reached over one link per neighbouring worker: a record stream
//! ([`crate::records`]) over a Unix socket on this host or over TCP to another, or under TLS a
//! bidirectional gRPC stream carrying frames that batch many envelopes.
//!
//! Flow control: messages to another worker wait in a queue bounded in bytes (a semaphore of
//! [`PEER_BUDGET_BYTES`]); a chip whose send would overflow it waits for room, so a fast sender
//! cannot grow memory without limit. The receiving side always drains its streams into the
//! destination chips' inboxes, so sends never wait on a receiver's progress (no deadlock);
//! what waits there is bounded by the algorithms (a chip never runs more than one collective
//! ahead of its neighbours).

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use podsim_collectives::{Chip, CollectiveError, Delivery, Inbox, Message, Router};
use podsim_proto::v1 as pb;
use podsim_proto::v1::link_service_client::LinkServiceClient;
use podsim_proto::v1::link_service_server::{LinkService, LinkServiceServer};
use podsim_topology::{ChipId, Group, Hardware, Placement, Pod, Route};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status, Streaming};

use crate::LinkError;
use crate::intake::Deliver;
use crate::outgoing::{Outgoing, Refusal};
use crate::records::{self, LinkHost};
use crate::socket::{Limits, LinkStream, same_token};
use crate::tls::Tls;
use crate::transport::Transport;
use crate::wire::{self, MAX_FRAME_BYTES};

/// What a worker's fabric needs of its job: the pod and its hardware, how many workers share
/// it and how their links are carried, and which chips beyond the torus neighbours its chips
/// send to (the worker derives those from the job's program).
#[derive(Debug, Clone)]
pub struct FabricSpec {
    pub pod: Pod,
    pub hardware: Hardware,
    pub workers: u32,
    pub transport: Transport,
    /// Routes longer than one hop the chips send on (the strided parts of torus axes a device
    /// mesh lays its dimensions on).
    pub strided_routes: Vec<Route>,
    /// Groups whose members send point-to-point around their ring (a `send-recv`): each
    /// chip's next and previous members are its peers too.
    pub shift_groups: Vec<Group>,
}

/// A link between two workers and how it is carried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerLink {
    pub peer: u32,
    pub transport: Transport,
    /// Whether the link is encrypted and both ends authenticated (mutual TLS; links over TCP,
    /// records or gRPC, of a job with `[launch.tls]`).
    #[serde(default)]
    pub tls: bool,
}

/// Bytes of messages that may wait to be sent to one peer worker.
pub const PEER_BUDGET_BYTES: usize = 128 << 20;
/// A frame is sent once it holds this many payload bytes (or nothing more is queued).
const FRAME_TARGET_BYTES: usize = 4 << 20;
/// Metadata keys of the link and control services.
pub const TOKEN_HEADER: &str = "x-podsim-token";
pub const WORKER_HEADER: &str = "x-podsim-worker";

#[derive(Debug)]
struct Peer {
    /// Messages handed to the transport for this peer, and received from it (the watchdog
    /// compares the two ends: equal totals mean nothing is in flight between the workers).
    handed: AtomicU64,
    arrived: AtomicU64,
    queue: mpsc::UnboundedSender<Outgoing>,
    /// Taken by whichever side sets up the stream to this peer.
    queue_rx: Mutex<Option<mpsc::UnboundedReceiver<Outgoing>>>,
    room: Arc<Semaphore>,
    /// The sending end of a record link (once it has its socket): chips write to it
    /// directly while its writer task is idle.
    writer: Arc<records::LinkWriter>,
}

impl Peer {
    /// Queues `o` for the writer task. On a Unix-socket link the writer is marked busy in the
    /// same critical section, so that no chip writes directly while anything queued before
    /// its message is still unsent.
    /// False when the queue is closed (the link is gone).
    fn enqueue(&self, o: Outgoing) -> bool {
        let _busy = self.writer.mark_busy();
        self.queue.send(o).is_ok()
    }
}

/// Where a worker's links can be reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerAddress {
    /// `host:port` of its gRPC link service.
    pub tcp: String,
    /// Name of its same-host link listener, if it has one.
    pub local: Option<String>,
    /// Its host and network namespace ([`records::host_id`]).
    pub host_id: String,
}

/// One worker's share of the fabric.
#[derive(Debug)]
pub struct NodeFabric {
    pub spec: FabricSpec,
    pub me: u32,
    placement: Placement,
    inboxes: Vec<Option<Arc<Inbox>>>,
    peers: HashMap<u32, Peer>,
    /// Each linked peer: how, and for a record link whether it runs inside TLS.
    connected: Mutex<HashMap<u32, (Transport, bool)>>,
    connected_changed: Notify,
    link_errors: Mutex<Vec<String>>,
    /// Set once this worker's chips are done: peers closing their streams is then expected.
    finished: AtomicBool,
    /// The record links into this worker, and who reads them.
    inputs: Arc<crate::intake::LinkInputs>,
    this: std::sync::Weak<NodeFabric>,
}

impl NodeFabric {
    /// Per neighbouring worker: messages handed to the transport for it, and received from it.
    pub fn transport_counts(&self) -> Vec<(u32, u64, u64)> {
        let mut out: Vec<(u32, u64, u64)> = self
            .peers
            .iter()
            .map(|(w, p)| {
                (
                    *w,
                    p.handed.load(Ordering::Relaxed),
                    p.arrived.load(Ordering::Relaxed),
                )
            })
            .collect();
        out.sort_unstable();
        out
    }

    pub fn new(spec: FabricSpec, me: u32) -> Result<Arc<NodeFabric>, LinkError> {
        let placement = Placement::new(&spec.pod, spec.workers)
            .map_err(|e| LinkError::Invalid(e.to_string()))?;
        if me >= spec.workers {
            return Err(LinkError::Invalid(format!(
                "worker {me} of {}",
                spec.workers
            )));
        }
        let pod = &spec.pod;
        let mut inboxes = vec![None; pod.chips() as usize];
        let mut neighbours = HashSet::new();
        let routed = &spec.strided_routes;
        let shifted = &spec.shift_groups;
        for chip in placement.chips_of(me) {
            inboxes[chip as usize] = Some(Arc::new(Inbox::new()));
            let routes = pod.links(chip).into_iter().map(Route::neighbour);
            let along_routes = routes
                .chain(routed.iter().copied())
                .filter_map(|route| pod.route_peer(chip, route));
            let around_rings = shifted
                .iter()
                .flat_map(|&group| group.ring_neighbours(pod, chip));
            for peer in along_routes.chain(around_rings) {
                let w = placement.worker_of(peer);
                if w != me {
                    neighbours.insert(w);
                }
            }
        }
        let peers = neighbours
            .into_iter()
            .map(|w| {
                let (tx, rx) = mpsc::unbounded_channel();
                let peer = Peer {
                    handed: AtomicU64::new(0),
                    arrived: AtomicU64::new(0),
                    queue: tx,
                    queue_rx: Mutex::new(Some(rx)),
                    room: Arc::new(Semaphore::new(PEER_BUDGET_BYTES)),
                    writer: Arc::new(records::LinkWriter::new()),
                };
                (w, peer)
            })
            .collect();
        Ok(Arc::new_cyclic(|this: &std::sync::Weak<NodeFabric>| {
            NodeFabric {
                spec,
                me,
                placement,
                inboxes,
                peers,
                connected: Mutex::new(HashMap::new()),
                connected_changed: Notify::new(),
                link_errors: Mutex::new(Vec::new()),
                finished: AtomicBool::new(false),
                inputs: Arc::new(crate::intake::LinkInputs::new(this.clone() as _)),
                this: this.clone(),
            }
        }))
    }

    /// The workers this one shares links with.
    pub fn neighbours(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.peers.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub fn local_chips(&self) -> Vec<ChipId> {
        self.placement.chips_of(self.me)
    }

    /// Chip objects for the chips this worker hosts.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    pub fn chips(&self) -> Vec<Chip> {
        let pod = Arc::new(self.spec.pod.clone());
        let hw = Arc::new(self.spec.hardware.clone());
        let router: Arc<dyn Router> = match self.this.upgrade() {
            Some(this) => this,
            None => return Vec::new(),
        };
        self.local_chips()
            .into_iter()
            .filter_map(|id| {
                let inbox = self.inboxes[id as usize].clone()?;
                Some(Chip::new(
                    id,
                    pod.clone(),
                    hw.clone(),
                    inbox,
                    router.clone(),
                ))
            })
            .collect()
    }

    pub fn link_errors(&self) -> Vec<String> {
        self.link_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Marks this worker's part of the job as done.
    pub fn finish(&self) {
        self.finished.store(true, Ordering::SeqCst);
    }

    /// Waits until streams to every neighbouring worker are up.
    pub async fn wait_connected(&self, timeout: Duration) -> Result<(), LinkError> {
        let wanted = self.peers.len();
        let waiting = async {
            loop {
                let notified = self.connected_changed.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                if self
                    .connected
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .len()
                    >= wanted
                {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, waiting).await.map_err(|_| {
            let have = self
                .connected
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let missing: Vec<u32> = self
                .neighbours()
                .into_iter()
                .filter(|w| !have.contains_key(w))
                .collect();
            LinkError::Link(format!("no link to workers {missing:?} after {timeout:?}"))
        })
    }

    fn connected_by(&self, peer: u32, transport: Transport, inside_tls: bool) {
        self.connected
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(peer, (transport, inside_tls));
        self.connected_changed.notify_waiters();
    }

    /// The transport of each link to another worker, by peer, and whether it is mutual TLS:
    /// a record link when it runs inside TLS, a gRPC link when this worker's gRPC does
    /// (`tls`).
    pub fn links(&self, tls: bool) -> Vec<PeerLink> {
        let connected = self.connected.lock().unwrap_or_else(|e| e.into_inner());
        let mut links: Vec<PeerLink> = connected
            .iter()
            .map(|(&peer, &(transport, inside_tls))| PeerLink {
                peer,
                transport,
                tls: match transport {
                    Transport::Grpc => tls,
                    _ => inside_tls,
                },
            })
            .collect();
        links.sort_by_key(|l| l.peer);
        links
    }

    /// Starts the pumps of the gRPC stream to `peer`: `incoming` from it, `outgoing` towards
    /// it.
    fn attach(
        self: &Arc<Self>,
        peer: u32,
        incoming: Streaming<pb::Frame>,
        outgoing: mpsc::Sender<pb::Frame>,
    ) -> Result<(), Status> {
        let queue = self.claim(peer).map_err(|r| match r {
            Refusal::NoLink(why) => Status::permission_denied(why),
            Refusal::Taken(why) => Status::already_exists(why),
        })?;
        tokio::spawn(pump_out(queue, outgoing));
        tokio::spawn(pump_in(self.clone(), peer, incoming));
        self.connected_by(peer, Transport::Grpc, false);
        Ok(())
    }

    /// Delivers what has already arrived on this worker's record links, on the calling thread
    /// (see `intake`): the heartbeat's, before it reports who waits on whom.
    pub fn deliver_arrived(&self) {
        self.inputs.deliver_arrived();
    }

    /// What the chip executor's thread does instead of parking: read this worker's record
    /// links itself (see `intake`).
    pub fn idle_wait(&self) -> Arc<dyn podsim_collectives::IdleWait> {
        self.inputs.clone()
    }

    /// Links to `peer`, whose addresses are `at`. On this host (automatically, or when the
    /// job's transport says so) a Unix socket, with shared memory unless `uds`; to another
    /// host, or when forced with `tcp`, the record stream over TCP (inside TLS when the job
    /// uses it); gRPC when forced with `grpc`.
    pub async fn dial(
        self: &Arc<Self>,
        peer: u32,
        at: &PeerAddress,
        mine: &PeerAddress,
        token: &str,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<(), LinkError> {
        let same_host = !mine.host_id.is_empty() && mine.host_id == at.host_id;
        let transport = self.spec.transport;
        let local = match transport {
            Transport::Tcp | Transport::Grpc => None,
            Transport::Auto => at.local.as_deref().filter(|_| same_host),
            Transport::Uds | Transport::Shm => {
                Some(at.local.as_deref().filter(|_| same_host).ok_or_else(|| {
                    LinkError::Link(format!(
                        "launch.transport = \"{}\" but worker {peer} is not on this host \
                         (or has no Unix socket link)",
                        transport.name()
                    ))
                })?)
            }
        };
        let (stream, regions) = match local {
            Some(name) => {
                let sharing = records::Sharing::of(transport);
                records::dial(name, self.me, peer, token, sharing).await?
            }
            None if transport == Transport::Grpc || !records::RECORDS_OVER_TCP => {
                return self.dial_grpc(peer, &at.tcp, token, tls).await;
            }
            None => records::dial_tcp(&at.tcp, self.me, peer, token, tls).await?,
        };
        let queue = self
            .claim(peer)
            .map_err(|r| LinkError::Link(r.to_string()))?;
        self.run_record_link(peer, stream, queue, regions);
        Ok(())
    }

    /// Dials the gRPC link service of `peer` at `addr` and attaches the stream.
    async fn dial_grpc(
        self: &Arc<Self>,
        peer: u32,
        addr: &str,
        token: &str,
        tls: Option<&crate::tls::Tls>,
    ) -> Result<(), LinkError> {
        let endpoint = crate::tls::url(addr, tls);
        let mut client = connect_with_retry(&endpoint, tls, crate::socket::DIAL_PATIENCE)
            .await
            .map_err(|e| match e {
                LinkError::Link(why) => LinkError::Link(format!("worker {peer}: {why}")),
                other => other,
            })?;
        let (tx, rx) = mpsc::channel::<pb::Frame>(4);
        let mut request = Request::new(ReceiverStream::new(rx));
        insert_header(&mut request, TOKEN_HEADER, token)?;
        insert_header(&mut request, WORKER_HEADER, &self.me.to_string())?;
        let response = client
            .exchange(request)
            .await
            .map_err(|s| LinkError::Link(format!("worker {peer} at {addr}: {}", s.message())))?;
        self.attach(peer, response.into_inner(), tx)
            .map_err(|s| LinkError::Link(s.message().to_string()))
    }
}

/// HTTP/2 windows and frames sized for bulk streams: the 64 KiB defaults would cap each link
/// at one window per round trip. Measured (docs/PERFORMANCE.md, gRPC links forced): the
/// defaults give half the bandwidth of these; windows past 2 MiB change nothing, frames of
/// 16 KiB cost a fifth of it, 1 MiB frames or more none.
const STREAM_WINDOW: u32 = 32 << 20;
const CONNECTION_WINDOW: u32 = 64 << 20;
const H2_FRAME: u32 = (1 << 24) - 1;

/// `host` and `port` as the text of a socket address: an IPv6 address in brackets (`[::1]:80`,
/// as socket-address and URL parsers want it; `::1:80` is no address), a host name or IPv4
/// address as it is.
pub fn host_port(host: &str, port: u16) -> String {
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    match bare.parse::<std::net::Ipv6Addr>() {
        Ok(_) => format!("[{bare}]:{port}"),
        Err(_) => format!("{host}:{port}"),
    }
}

/// Why `addr` is not a `host:port` to dial, if it is not: a port of 1 to 65535 after the
/// last colon, a host before it, an IPv6 host in brackets, no scheme. A worker given
/// `127.0.0.1:99999` or `http://host:port` retried the impossible address for half a
/// minute before it said so.
pub fn dial_address_problem(addr: &str) -> Option<String> {
    if addr.contains("://") {
        return Some(format!("{addr:?}: give host:port, without a scheme"));
    }
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Some(format!("{addr:?}: give host:port (no port)"));
    };
    if host.is_empty() || host == "[]" {
        return Some(format!("{addr:?}: no host before the port"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Some(format!(
            "{addr:?}: an IPv6 address goes in brackets, e.g. [::1]:{port}"
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => None,
        _ => Some(format!("{addr:?}: the port must be 1 to 65535")),
    }
}

/// How often a worker pings its coordinator over the control channel, and how long it waits
/// for the answer before it gives the session up: a coordinator stopped (or gone without
/// closing the connection) loses its workers within the two together. The coordinator says
/// so when it resumes.
pub const CONTROL_KEEPALIVE_EVERY: Duration = Duration::from_secs(5);
pub const CONTROL_KEEPALIVE_PATIENCE: Duration = Duration::from_secs(20);

/// `--bind`'s value as an address to bind: kept when it has a port (`localhost:7500`,
/// `[::1]:0`, `0.0.0.0:0`), else the host with port 0 (any free one), bracketed if IPv6.
pub fn bind_address(bind: &str) -> String {
    match listen_address_problem(bind) {
        None => bind.to_string(),
        Some(_) => host_port(bind, 0),
    }
}

/// Why `addr` is not a `host:port` to listen on, if it is not: as [`dial_address_problem`],
/// with port 0 (any free one) allowed.
pub fn listen_address_problem(addr: &str) -> Option<String> {
    match addr.strip_suffix(":0") {
        Some(host) => dial_address_problem(&format!("{host}:1")),
        None => dial_address_problem(addr),
    }
}

/// A server builder with the link transport settings.
pub fn server_builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(H2_FRAME)
        .tcp_nodelay(true)
}

/// A client endpoint with the link transport settings.
pub fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, LinkError> {
    Ok(tonic::transport::Endpoint::from_shared(url.to_string())
        .map_err(|e| LinkError::Link(format!("bad address {url}: {e}")))?
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(H2_FRAME)
        .tcp_nodelay(true))
}

async fn connect_with_retry(
    url: &str,
    tls: Option<&crate::tls::Tls>,
    patience: Duration,
) -> Result<LinkServiceClient<tonic::transport::Channel>, LinkError> {
    let endpoint = crate::tls::secure(endpoint(url)?, tls)?;
    // A handshake refused over a certificate is refused again: said at once, not after the
    // dial's patience.
    let lasting = |e: &tonic::transport::Error| crate::tls::handshake_failure(e).is_some();
    match crate::socket::with_retry(patience, || endpoint.connect(), lasting).await {
        Ok(channel) => Ok(LinkServiceClient::new(channel)
            .max_decoding_message_size(MAX_FRAME_BYTES)
            .max_encoding_message_size(MAX_FRAME_BYTES)),
        Err(Some(e)) => Err(LinkError::Link(dial_failure(url, &e, tls))),
        Err(None) => Err(LinkError::Link(format!(
            "cannot reach {url}: no answer in time"
        ))),
    }
}

/// Why `url` could not be reached: a failed TLS handshake as such, with rustls's reason and
/// what it asks of the job's files, or the last error.
fn dial_failure(url: &str, e: &tonic::transport::Error, tls: Option<&crate::tls::Tls>) -> String {
    match (crate::tls::handshake_failure(e), tls) {
        (Some(reason), Some(tls)) => format!(
            "TLS handshake with {url} failed: {reason} ({})",
            tls.mismatch_hint()
        ),
        (Some(reason), None) => format!("TLS handshake with {url} failed: {reason}"),
        (None, _) => format!("cannot reach {url}: {}", crate::tls::chain(e)),
    }
}

pub fn insert_header<T>(
    request: &mut Request<T>,
    key: &'static str,
    value: &str,
) -> Result<(), LinkError> {
    let v: MetadataValue<_> = value
        .parse()
        .map_err(|_| LinkError::Invalid(format!("bad {key} value")))?;
    request.metadata_mut().insert(key, v);
    Ok(())
}

/// Accepts links from workers on this host for as long as the listener lives, handing each
/// to the fabric `fabric` holds once the worker has built it (see [`crate::records`]).
pub async fn serve_records(
    listener: tokio::net::UnixListener,
    token: String,
    fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
) {
    records::serve_with(listener, token, fabric, Limits::default()).await
}

/// Serves the TCP port of this worker's link service: record links (inside TLS with `tls`)
/// go to the fabric `fabric` holds, gRPC connections to `grpc` (see [`crate::records`]).
pub async fn route_tcp(
    listener: tokio::net::TcpListener,
    tls: Option<Tls>,
    token: String,
    fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
    grpc: mpsc::Sender<std::io::Result<tokio::net::TcpStream>>,
) {
    records::route_tcp_with(listener, tls, token, fabric, grpc, Limits::default()).await
}

impl LinkHost for NodeFabric {
    fn transport(&self) -> Transport {
        self.spec.transport
    }

    fn claim(&self, peer: u32) -> Result<mpsc::UnboundedReceiver<Outgoing>, Refusal> {
        let Some(p) = self.peers.get(&peer) else {
            return Err(Refusal::NoLink(format!(
                "worker {peer} shares no link with worker {}",
                self.me
            )));
        };
        p.queue_rx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| Refusal::Taken(format!("worker {peer} is already linked")))
    }

    fn run_record_link(
        self: &Arc<Self>,
        peer: u32,
        stream: LinkStream,
        queue: mpsc::UnboundedReceiver<Outgoing>,
        regions: records::Regions,
    ) {
        let (transport, inside_tls) = (regions.transport(&stream), stream.is_tls());
        let (input, output) = match stream.into_split() {
            Ok(halves) => halves,
            Err(e) => return self.link_failed(format!("link from worker {peer}: {e}")),
        };
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        if !p.writer.attach(output, regions.outbound) {
            return;
        }
        tokio::spawn(records::pump_out(queue, p.writer.clone()));
        self.inputs.add(peer, input, regions.inbound);
        self.connected_by(peer, transport, inside_tls);
    }
}

impl Deliver for NodeFabric {
    fn decode(
        &self,
        env: pb::Envelope,
        payload: podsim_collectives::Payload,
        peer: u32,
    ) -> Result<Message, String> {
        wire::message(
            env,
            || Ok(payload),
            &self.spec.pod,
            &self.placement,
            peer,
            self.me,
        )
    }

    fn accept(&self, peer: u32, msg: Message) -> Result<(), String> {
        match self.inboxes.get(msg.dst as usize) {
            Some(Some(inbox)) => {
                if let Some(p) = self.peers.get(&peer) {
                    p.arrived.fetch_add(1, Ordering::Relaxed);
                }
                inbox.push(msg);
                Ok(())
            }
            _ => Err(format!(
                "link from worker {peer}: chip {} is not hosted here",
                msg.dst
            )),
        }
    }

    fn link_failed(&self, error: String) {
        if self.finished.load(Ordering::SeqCst) {
            return;
        }
        tracing::error!("{error}");
        self.link_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(error.clone());
        for inbox in self.inboxes.iter().flatten() {
            inbox.close(&error);
        }
    }
}

impl Router for NodeFabric {
    fn deliver(&self, msg: Message) -> Result<Delivery<'_>, CollectiveError> {
        let dst = msg.dst as usize;
        if let Some(Some(inbox)) = self.inboxes.get(dst) {
            inbox.push(msg);
            return Ok(Delivery::Done);
        }
        if dst >= self.inboxes.len() {
            return Err(CollectiveError::Transport(format!("no chip {dst}")));
        }
        let worker = self.placement.worker_of(msg.dst);
        let peer = self.peers.get(&worker).ok_or_else(|| {
            CollectiveError::Transport(format!(
                "chip {} on worker {worker} is not a neighbour",
                msg.dst
            ))
        })?;
        peer.handed.fetch_add(1, Ordering::Relaxed);
        let bytes = (msg.payload.len() * 4).clamp(1, PEER_BUDGET_BYTES);
        let cost = u32::try_from(bytes).unwrap_or(u32::MAX);
        let closed = move || {
            CollectiveError::Transport(match peer.writer.failure() {
                Some(why) => format!("link to worker {worker} is closed: {why}"),
                None => format!("link to worker {worker} is closed"),
            })
        };
        // An idle Unix-socket link takes the message from this thread: no hand-off to the
        // writer task, whose wake-up is most of a small message's latency.
        // What the socket did not take goes first in the queue, queued before the writer's
        // lock is let go so that nothing else lands on the wire in between (straight into the
        // queue: `Peer::enqueue` would take that lock again).
        let queue_rest = |msg, skip, lent| {
            // The rest cannot wait for queue room with the writer's lock held, so it takes
            // room only when there is some. This overdraws the peer's budget by at most one
            // direct record (256 KiB) per time the link goes from idle to busy: every message
            // after it is queued with room.
            let room = peer.room.clone().try_acquire_many_owned(cost).ok();
            let rest = Outgoing::new(msg, bytes, skip, lent, room);
            peer.queue.send(rest).is_ok()
        };
        let (msg, lent) = match peer.writer.write_if_idle(msg, queue_rest) {
            records::Direct::Done => return Ok(Delivery::Done),
            records::Direct::Busy(msg, lent) => (msg, lent),
            records::Direct::Failed => return Err(closed()),
        };
        match peer.room.clone().try_acquire_many_owned(cost) {
            Ok(room) => {
                if !peer.enqueue(Outgoing::new(msg, bytes, 0, lent, Some(room))) {
                    return Err(closed());
                }
                Ok(Delivery::Done)
            }
            Err(_) => Ok(Delivery::Wait(Box::pin(async move {
                let room = peer.room.clone().acquire_many_owned(cost).await;
                let room = room.map_err(|_| closed())?;
                let queued = peer.enqueue(Outgoing::new(msg, bytes, 0, lent, Some(room)));
                queued.then_some(()).ok_or_else(closed)
            }))),
        }
    }
}

/// Batches queued messages into frames and hands them to the stream.
async fn pump_out(mut queue: mpsc::UnboundedReceiver<Outgoing>, frames: mpsc::Sender<pb::Frame>) {
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        let mut bytes = batch[0].bytes;
        while bytes < FRAME_TARGET_BYTES {
            match queue.try_recv() {
                Ok(next) if bytes + next.bytes <= MAX_FRAME_BYTES / 2 => {
                    bytes += next.bytes;
                    batch.push(next);
                }
                Ok(next) => {
                    // Too big to join this frame: send what we have, start the next with it.
                    let frame = encode_batch(std::mem::take(&mut batch));
                    if frames.send(frame).await.is_err() {
                        return;
                    }
                    bytes = next.bytes;
                    batch.push(next);
                }
                Err(_) => break,
            }
        }
        // Permits (queue room) are released only once the frame is with the transport.
        let frame = encode_batch(batch);
        if frames.send(frame).await.is_err() {
            return;
        }
    }
}

fn encode_batch(batch: Vec<Outgoing>) -> pb::Frame {
    pb::Frame {
        envelopes: batch.into_iter().map(|o| wire::encode(o.msg)).collect(),
    }
}

/// Validates every envelope from `peer` and delivers it to the local chip's inbox.
async fn pump_in(fabric: Arc<NodeFabric>, peer: u32, mut incoming: Streaming<pb::Frame>) {
    loop {
        match incoming.message().await {
            Ok(Some(frame)) => {
                for env in frame.envelopes {
                    let decoded =
                        wire::decode(env, &fabric.spec.pod, &fabric.placement, peer, fabric.me)
                            .map_err(|e| format!("link from worker {peer}: bad frame: {e}"));
                    if let Err(e) = decoded.and_then(|msg| fabric.accept(peer, msg)) {
                        fabric.link_failed(e);
                        return;
                    }
                }
            }
            Ok(None) => return,
            Err(status) => {
                fabric.link_failed(format!("link from worker {peer}: {}", status.message()));
                return;
            }
        }
    }
}

/// The link service of one worker. Until the job is set up it holds connections back.
#[derive(Debug, Clone)]
pub struct LinkServer {
    fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
}

type FrameStream = Pin<Box<dyn Stream<Item = Result<pb::Frame, Status>> + Send>>;

#[tonic::async_trait]
impl LinkService for LinkServer {
    type ExchangeStream = FrameStream;

    async fn exchange(
        &self,
        request: Request<Streaming<pb::Frame>>,
    ) -> Result<Response<FrameStream>, Status> {
        let peer: u32 = request
            .metadata()
            .get(WORKER_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Status::invalid_argument("missing or bad x-podsim-worker header"))?;
        let mut fabric = self.fabric.clone();
        let ready = tokio::time::timeout(Duration::from_secs(30), fabric.wait_for(Option::is_some))
            .await
            .map_err(|_| Status::unavailable("this worker has no job yet"))?
            .map_err(|_| Status::unavailable("this worker is shutting down"))?;
        let fabric = ready.clone().ok_or_else(|| Status::internal("no fabric"))?;
        let (tx, rx) = mpsc::channel::<pb::Frame>(4);
        fabric.attach(peer, request.into_inner(), tx)?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

/// Checks the job token of a request (constant-time comparison).
pub fn check_token(token: &str, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
    let given = metadata
        .get(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if same_token(given.as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(Status::unauthenticated("missing or wrong job token"))
    }
}

/// The link service with token checking and frame size limits, ready to serve.
pub fn link_service(
    token: String,
    fabric: watch::Receiver<Option<Arc<NodeFabric>>>,
) -> tonic::service::interceptor::InterceptedService<
    LinkServiceServer<LinkServer>,
    impl tonic::service::Interceptor + Clone,
> {
    let server = LinkServiceServer::new(LinkServer { fabric })
        .max_decoding_message_size(MAX_FRAME_BYTES)
        .max_encoding_message_size(MAX_FRAME_BYTES);
    tonic::service::interceptor::InterceptedService::new(server, move |req: Request<()>| {
        check_token(&token, req.metadata())?;
        Ok(req)
    })
}

/// Peak resident memory of this process (VmHWM), bytes; 0 where unknown.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::tests::test_tls;

    #[test]
    fn a_bind_address_keeps_its_port_or_takes_any() {
        for (bind, want) in [
            ("localhost:7500", "localhost:7500"),
            ("0.0.0.0:0", "0.0.0.0:0"),
            ("[::1]:0", "[::1]:0"),
            ("127.0.0.1", "127.0.0.1:0"),
            ("::1", "[::1]:0"),
            ("localhost", "localhost:0"),
        ] {
            assert_eq!(bind_address(bind), want, "{bind}");
        }
    }

    #[test]
    fn a_dial_address_is_host_and_port() {
        for good in [
            "127.0.0.1:7401",
            "[::1]:7401",
            "coordinator.internal:1",
            "h:65535",
        ] {
            assert_eq!(dial_address_problem(good), None, "{good}");
        }
        for (bad, why) in [
            ("127.0.0.1:99999", "1 to 65535"),
            ("127.0.0.1:0", "1 to 65535"),
            ("127.0.0.1", "no port"),
            ("http://127.0.0.1:7401", "without a scheme"),
            ("::1:7401", "in brackets"),
            (":7401", "no host"),
        ] {
            let problem = dial_address_problem(bad).unwrap_or_default();
            assert!(problem.contains(why), "{bad}: {problem}");
        }
    }

    #[test]
    fn an_ipv6_host_is_bracketed_before_its_port() {
        for (host, want) in [
            ("::1", "[::1]:0"),
            ("[::1]", "[::1]:0"),
            ("fe80::1", "[fe80::1]:0"),
            ("127.0.0.1", "127.0.0.1:0"),
            ("localhost", "localhost:0"),
        ] {
            let text = host_port(host, 0);
            assert_eq!(text, want);
            if host != "localhost" {
                assert!(text.parse::<std::net::SocketAddr>().is_ok(), "{text}");
            }
        }
    }

    /// A gRPC link dialled with the job's authority to a link service whose certificate
    /// another authority signed: refused at once (not after the dial's patience), naming the
    /// address and rustls's reason.
    #[test]
    fn a_grpc_dial_to_a_stranger_fails_at_once_saying_why() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{e}"));
        runtime.block_on(async {
            let (job, foreign) = (test_tls("job-node"), test_tls("other-node"));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
            let (_fabric, rx) = watch::channel(None);
            let server = server_builder()
                .tls_config(foreign.server())
                .unwrap_or_else(|e| panic!("{e}"));
            let incoming = tonic::transport::server::TcpIncoming::from(listener);
            tokio::spawn(server.serve_with_incoming(link_service("t".into(), rx), incoming));
            let url = crate::tls::url(&addr.to_string(), Some(&job));
            let soon = Duration::from_secs(5);
            let dialled = tokio::time::timeout(
                soon,
                connect_with_retry(&url, Some(&job), crate::socket::DIAL_PATIENCE),
            )
            .await;
            let e = match dialled {
                Ok(Err(e)) => e.to_string(),
                Ok(Ok(_)) => panic!("connected to a server of another authority"),
                Err(_) => panic!("no verdict within {soon:?}"),
            };
            assert!(
                e.contains(&addr.to_string())
                    && e.contains("TLS handshake")
                    && e.contains("invalid peer certificate"),
                "{e}"
            );
        });
    }
}
