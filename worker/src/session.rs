//! A worker process from start to finish: serve links, join the coordinator's control session,
//! receive the job, link up with neighbouring workers, run the chips, report, exit.
//!
//! A worker never outlives its job: it exits when the control session ends or fails (the
//! coordinator stopped, crashed or was killed: its sockets close), and, when started by a
//! coordinator, when its standard input reaches end-of-file (the coordinator's end of that
//! pipe closes however the coordinator dies).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use podsim_proto::v1 as pb;
use podsim_proto::v1::control_client::ControlClient;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;

use podsim_collectives::{FlightRecorder, TraceHandle};

use crate::faults::FaultPlan;
use podsim_links::net::{self, NodeFabric, TOKEN_HEADER, insert_header};
use podsim_programs::ProgramError;
use podsim_programs::job::{
    FailureReport, HeartbeatStatus, JobSpec, MAX_CONTROL_MESSAGE_BYTES, Program, RecorderDump,
    WorkerReport,
};
use podsim_programs::{run_program_waiting, total_units};

/// How a worker was started.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Coordinator control address, `host:port`.
    pub join: String,
    pub token: String,
    /// Worker id asked for (`None`: the coordinator assigns one).
    pub worker_id: Option<u32>,
    /// Address to bind the link service to (`host` or `host:port`).
    pub bind: String,
    /// Host name other workers use to reach this one (default: the bound address).
    pub advertise: Option<String>,
    /// Exit when standard input closes (set when a coordinator spawned this worker).
    pub watch_stdin: bool,
    /// Mutual TLS on the connections over TCP (to the coordinator and to other workers).
    pub tls: Option<podsim_links::tls::Tls>,
}

fn session_error(e: impl std::fmt::Display) -> ProgramError {
    ProgramError::Session(e.to_string())
}

/// Runs one worker to completion: serve links, join, link up, run the chips under
/// heartbeats, report.
pub async fn run(opts: WorkerOptions) -> Result<(), ProgramError> {
    if opts.watch_stdin {
        tokio::spawn(exit_when_stdin_closes());
    }
    let links = Links::serve(&opts).await?;
    let mut session = Session::join(&opts, &links).await?;
    let spec = session.spec.take().ok_or_else(|| session_error("no job"))?;
    let fabric = match link_up(&opts, &links, &mut session, &spec).await {
        Ok(fabric) => fabric,
        Err(e) => {
            session.tell_setup_failure(&e).await;
            return Err(e);
        }
    };
    let (chips, watched) = local_chips(&spec, &fabric, session.me);
    let program = spec.program.clone();
    let total = total_units(&program, chips.len());
    let done = Arc::new(AtomicU64::new(0));
    let heartbeats = Heartbeats::start(&spec, &fabric, &session, &watched, done.clone(), total)?;
    let run = run_program_waiting(chips, &program, done, Some(fabric.idle_wait()));
    tokio::pin!(run);
    let outcome = loop {
        tokio::select! {
            r = &mut run => break r,
            m = session.from_coord.next() => match m {
                Ok(pb::coordinator_msg::Body::Dump(_)) => session.send_dump(&watched).await?,
                Ok(pb::coordinator_msg::Body::Shutdown(s)) => break Err(session_error(format!("stopped: {}", s.reason))),
                Ok(other) => break Err(session_error(format!("unexpected {other:?} during the job"))),
                Err(e) => break Err(e),
            },
        }
    };
    // No heartbeat may follow the result (the coordinator would count the worker's chips as
    // live again).
    heartbeats.stop().await;
    fabric.finish();
    match outcome {
        Ok(out) => {
            let report = WorkerReport {
                worker: session.me,
                pid: std::process::id(),
                link_addr: links.mine.tcp.clone(),
                chips: fabric.local_chips(),
                steps: out.steps,
                train: out.train,
                traces: out.traces,
                messages_sent: out.messages_sent,
                bytes_sent: out.bytes_sent,
                peak_rss_bytes: net::peak_rss_bytes(),
                link_errors: fabric.link_errors(),
                links: fabric.links(opts.tls.is_some()),
                torch: out.torch,
                faults: watched.faults.events(),
            };
            let json = serde_json::to_vec(&report).map_err(session_error)?;
            session
                .send(pb::worker_msg::Body::Result(pb::WorkerResult { json }))
                .await?;
            // Wait for the coordinator to let go (it may still need our links for other
            // workers).
            let _ = tokio::time::timeout(Duration::from_secs(60), session.from_coord.next()).await;
            Ok(())
        }
        Err(e) => {
            session.report_failure(&e, &watched).await;
            Err(e)
        }
    }
}

/// This worker's chips (on a mirror fabric, one per class of chips alike under the job's
/// symmetry: one standing for all when it has every translation of the torus), with their
/// recorders, faults and traces set up.
fn local_chips(
    spec: &JobSpec,
    fabric: &Arc<NodeFabric>,
    me: u32,
) -> (Vec<podsim_collectives::Chip>, Watched) {
    let mut chips = if spec.symmetric {
        let symmetry = match &spec.program {
            Program::Train(train) => train.symmetry(&spec.pod),
            Program::Torch(torch) => torch.symmetry(&spec.pod),
            _ => podsim_collectives::Symmetry::of_torus(&spec.pod),
        };
        podsim_collectives::mirror_chips(spec.pod.clone(), spec.hardware.clone(), &symmetry)
    } else {
        fabric.chips()
    };
    let faults = Arc::new(FaultPlan::new(
        spec.faults.clone(),
        fabric.placement().clone(),
        me,
        spec.pod.chips() as usize,
    ));
    for chip in &mut chips {
        chip.set_recorder_entries(spec.recorder_entries);
        if !faults.is_empty() {
            chip.set_faults(faults.clone());
        }
    }
    podsim_programs::enable_traces(&mut chips, spec.trace.as_ref());
    let watched = Watched {
        recorders: chips.iter().map(|c| c.recorder()).collect(),
        traces: chips.iter().map(|c| c.trace_handle()).collect(),
        faults,
    };
    (chips, watched)
}

/// A coordinator that started this worker holds its standard input: end-of-file means the
/// coordinator is gone, however it went.
async fn exit_when_stdin_closes() {
    let mut stdin = tokio::io::stdin();
    let mut buf = [0u8; 64];
    while matches!(stdin.read(&mut buf).await, Ok(n) if n > 0) {}
    tracing::warn!("coordinator gone (stdin closed); exiting");
    std::process::exit(1);
}

/// This worker's link listeners (one TCP port for record links and gRPC, and a Unix socket
/// for workers on this host) and the fabric they serve once the job is known.
struct Links {
    mine: net::PeerAddress,
    fabric: watch::Sender<Option<Arc<NodeFabric>>>,
    bound_ip: String,
}

impl Links {
    async fn serve(opts: &WorkerOptions) -> Result<Links, ProgramError> {
        let bind = net::bind_address(&opts.bind);
        let listener = tokio::net::TcpListener::bind(&bind).await.map_err(|e| {
            ProgramError::Link(format!("cannot bind the link service to {bind}: {e}"))
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| ProgramError::Link(e.to_string()))?;
        let link_addr = match &opts.advertise {
            Some(host) => net::host_port(host, local.port()),
            None => local.to_string(),
        };
        let (fabric_tx, fabric_rx) = watch::channel::<Option<Arc<NodeFabric>>>(None);
        // Workers on this host reach this one over a Unix socket (see `records`).
        let link_local = match podsim_links::records::bind() {
            Some((listener, name)) => {
                tokio::spawn(podsim_links::net::serve_records(
                    listener,
                    opts.token.clone(),
                    fabric_rx.clone(),
                ));
                Some(name)
            }
            None => None,
        };
        let fabric_rx_tcp = fabric_rx.clone();
        let service = net::link_service(opts.token.clone(), fabric_rx);
        let mut server = net::server_builder();
        if let Some(tls) = &opts.tls {
            server = server
                .tls_config(tls.server())
                .map_err(|e| ProgramError::Link(podsim_links::tls::chain(&e)))?;
        }
        // One port for both: connections that open as record links (inside TLS when the job
        // uses it) become record links and the others go to gRPC.
        let (grpc_tx, grpc_rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(podsim_links::net::route_tcp(
            listener,
            opts.tls.clone(),
            opts.token.clone(),
            fabric_rx_tcp,
            grpc_tx,
        ));
        let incoming = tokio_stream::wrappers::ReceiverStream::new(grpc_rx);
        tokio::spawn(async move {
            if let Err(e) = server.serve_with_incoming(service, incoming).await {
                tracing::error!("link service stopped: {e}");
            }
        });
        Ok(Links {
            mine: net::PeerAddress {
                tcp: link_addr,
                local: link_local,
                host_id: podsim_links::records::host_id(),
            },
            fabric: fabric_tx,
            bound_ip: local.ip().to_string(),
        })
    }
}

/// The control session with the coordinator, and the job it handed out.
struct Session {
    me: u32,
    setup: pb::Setup,
    spec: Option<JobSpec>,
    to_coord: mpsc::Sender<pb::WorkerMsg>,
    from_coord: Inbound,
}

impl Session {
    /// Says hello and waits for the job (`Setup`).
    async fn join(opts: &WorkerOptions, links: &Links) -> Result<Session, ProgramError> {
        let endpoint = podsim_links::tls::url(&opts.join, opts.tls.as_ref());
        let mut client =
            connect_control(&endpoint, opts.tls.as_ref(), Duration::from_secs(30)).await?;
        let (to_coord, rx) = mpsc::channel::<pb::WorkerMsg>(16);
        let mut request = Request::new(ReceiverStream::new(rx));
        insert_header(&mut request, TOKEN_HEADER, &opts.token)?;
        let hello = pb::Hello {
            worker_id: opts.worker_id.map_or(-1, |w| w as i32),
            pid: std::process::id(),
            link_addr: links.mine.tcp.clone(),
            host: links.bound_ip.clone(),
            link_local: links.mine.local.clone().unwrap_or_default(),
            host_id: links.mine.host_id.clone(),
        };
        to_coord
            .send(pb::WorkerMsg {
                body: Some(pb::worker_msg::Body::Hello(hello)),
            })
            .await
            .map_err(session_error)?;
        let answer = match client.session(request).await {
            Ok(answer) => answer,
            Err(s) => return Err(session_refused(&opts.join, &s, opts.tls.as_ref()).await),
        };
        let mut from_coord = Inbound(answer.into_inner());
        drop(client);
        let setup = match from_coord.next().await? {
            pb::coordinator_msg::Body::Setup(s) => s,
            pb::coordinator_msg::Body::Shutdown(s) => return Err(session_error(s.reason)),
            other => return Err(session_error(format!("expected setup, got {other:?}"))),
        };
        let spec: JobSpec = serde_json::from_slice(&setup.job_json)
            .map_err(|e| session_error(format!("bad job description: {e}")))?;
        Ok(Session {
            me: setup.worker_id,
            setup,
            spec: Some(spec),
            to_coord,
            from_coord,
        })
    }

    async fn send(&self, body: pb::worker_msg::Body) -> Result<(), ProgramError> {
        self.to_coord
            .send(pb::WorkerMsg { body: Some(body) })
            .await
            .map_err(session_error)
    }

    /// Sends every local chip's flight recorder to the coordinator.
    async fn send_dump(&self, watched: &Watched) -> Result<(), ProgramError> {
        send_dump(&self.to_coord, &watched.recorders, &watched.traces).await
    }

    /// Tells the coordinator why this worker could not link up (a neighbour that never
    /// answered), and waits a moment for its answer so the words arrive before the process
    /// ends: it reported a closed session ("h2 protocol error") of this worker instead.
    async fn tell_setup_failure(&mut self, e: &ProgramError) {
        let failure = pb::WorkerFailure {
            error: e.to_string(),
            error_json: Vec::new(),
        };
        if self
            .send(pb::worker_msg::Body::Failure(failure))
            .await
            .is_ok()
        {
            let _ = tokio::time::timeout(Duration::from_secs(5), self.from_coord.next()).await;
        }
    }

    /// Tells the coordinator why the chips failed (structured where it can: a desync, a
    /// corrupted message) and stays until it has read it (it answers with a shutdown), or the
    /// message could die with this process; a diagnosis may ask for the recorders meanwhile.
    async fn report_failure(&mut self, e: &ProgramError, watched: &Watched) {
        let error_json = FailureReport::from_error(e)
            .map(|d| FailureReport {
                faults: watched.faults.events(),
                ..d
            })
            .and_then(|d| serde_json::to_vec(&d).ok())
            .unwrap_or_default();
        let failure = pb::WorkerFailure {
            error: e.to_string(),
            error_json,
        };
        let _ = self.send(pb::worker_msg::Body::Failure(failure)).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while let Ok(Ok(pb::coordinator_msg::Body::Dump(_))) =
            tokio::time::timeout_at(deadline, self.from_coord.next()).await
        {
            let _ = self.send_dump(watched).await;
        }
    }
}

/// Builds this worker's fabric, links up with every neighbouring worker, says it is ready
/// and waits for the start.
async fn link_up(
    opts: &WorkerOptions,
    links: &Links,
    session: &mut Session,
    spec: &JobSpec,
) -> Result<Arc<NodeFabric>, ProgramError> {
    let me = session.me;
    let fabric = NodeFabric::new(spec.fabric(), me)?;
    let _ = links.fabric.send(Some(fabric.clone()));
    let setup = &session.setup;
    let dial_all = async {
        for peer in fabric.neighbours().into_iter().filter(|&p| p > me) {
            let tcp = setup
                .link_addrs
                .get(&peer)
                .ok_or_else(|| session_error(format!("no address for worker {peer}")))?;
            let at = net::PeerAddress {
                tcp: tcp.clone(),
                local: setup
                    .link_locals
                    .get(&peer)
                    .filter(|name| !name.is_empty())
                    .cloned(),
                host_id: setup.host_ids.get(&peer).cloned().unwrap_or_default(),
            };
            fabric
                .dial(peer, &at, &links.mine, &opts.token, opts.tls.as_ref())
                .await?;
        }
        fabric.wait_connected(Duration::from_secs(30)).await?;
        Ok::<(), ProgramError>(())
    };
    // The coordinator may end the job meanwhile (another worker failed, it was stopped or
    // died): the worker goes at once instead of after the dials' patience.
    tokio::select! {
        linked = dial_all => linked?,
        said = session.from_coord.next() => {
            return Err(match said {
                Ok(pb::coordinator_msg::Body::Shutdown(s)) => session_error(s.reason),
                Ok(other) => session_error(format!("expected start, got {other:?}")),
                Err(e) => e,
            });
        }
    }
    session
        .send(pb::worker_msg::Body::Ready(pb::Ready {}))
        .await?;
    match session.from_coord.next().await? {
        pb::coordinator_msg::Body::Start(_) => Ok(fabric),
        pb::coordinator_msg::Body::Shutdown(s) => Err(session_error(s.reason)),
        other => Err(session_error(format!("expected start, got {other:?}"))),
    }
}

/// What the coordinator may ask about while the chips run: their flight recorders and traces,
/// and the faults fired.
struct Watched {
    recorders: Vec<Arc<FlightRecorder>>,
    traces: Vec<Option<TraceHandle>>,
    faults: Arc<FaultPlan>,
}

/// Which chips wait, each with the peers it waits on (the heartbeat lists them for the
/// straggler verdict of small jobs).
fn waits_of(recorders: &[Arc<podsim_collectives::FlightRecorder>]) -> Vec<(u32, Vec<u32>)> {
    recorders
        .iter()
        .filter(|r| r.glance().blocked > 0)
        .map(|r| {
            let s = r.status();
            (s.chip, s.blocked.iter().map(|b| b.peer).collect())
        })
        .collect()
}

/// Heartbeats: progress and every chip's live status, on a thread of their own so that they
/// keep coming while chips wait (a chip stuck in a kernel shows as computing) and while tens of
/// thousands of chips keep every core busy.
struct Heartbeats {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Heartbeats {
    fn start(
        spec: &JobSpec,
        fabric: &Arc<NodeFabric>,
        session: &Session,
        watched: &Watched,
        done: Arc<AtomicU64>,
        total: u64,
    ) -> Result<Heartbeats, ProgramError> {
        let (tx, recorders, faults) = (
            session.to_coord.clone(),
            watched.recorders.clone(),
            watched.faults.clone(),
        );
        let every = Duration::from_millis(spec.heartbeat_ms.max(1));
        let transport = fabric.clone();
        let mut summariser = crate::watch::Summariser::new(
            &spec.pod,
            recorders.iter().map(|r| r.chip()).collect(),
            Duration::from_millis(spec.watchdog_ms),
            std::time::Instant::now(),
        )
        .with_busy_limit(Duration::from_millis(spec.busy_ms));
        let mut cpu_wait = podsim_collectives::CpuWaitMeter::new(std::time::Instant::now());
        let beats = async move {
            let mut tick = tokio::time::interval(every);
            let list_waits = recorders.len() <= podsim_programs::job::STRAGGLER_WAITS_CHIPS;
            loop {
                tick.tick().await;
                // Messages waiting in a socket while their chips' executor is busy count as
                // arrived: a chip waits on its peer only if the peer has not sent.
                transport.deliver_arrived();
                let mut summary = summariser.beat(
                    std::time::Instant::now(),
                    podsim_collectives::wall_ns(),
                    podsim_collectives::scheduling_lag(),
                    |i| recorders[i].glance(),
                    |i| recorders[i].status(),
                );
                summary.transport = transport.transport_counts();
                summary.cpu_wait_share = cpu_wait.share(std::time::Instant::now());
                let waits = match list_waits {
                    true => waits_of(&recorders),
                    false => Vec::new(),
                };
                let status = HeartbeatStatus {
                    summary,
                    waits,
                    faults: faults.events(),
                };
                let msg = pb::WorkerMsg {
                    body: Some(pb::worker_msg::Body::Progress(pb::Progress {
                        done: done.load(Ordering::Relaxed),
                        total,
                        status_json: serde_json::to_vec(&status).unwrap_or_default(),
                    })),
                };
                if tx.send(msg).await.is_err() {
                    return;
                }
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .map_err(|e| session_error(format!("cannot start the heartbeat runtime: {e}")))?;
        let thread = std::thread::Builder::new()
            .name("podsim-heartbeat".into())
            .spawn(move || {
                rt.block_on(async move {
                    tokio::select! {
                        () = beats => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(|e| session_error(format!("cannot start the heartbeat thread: {e}")))?;
        Ok(Heartbeats { stop, thread })
    }

    /// Stops the heartbeats and waits for their thread, off this runtime's threads.
    async fn stop(self) {
        let _ = self.stop.send(());
        let thread = self.thread;
        let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    }
}

/// Sends every local chip's flight recorder to the coordinator.
async fn send_dump(
    to_coord: &mpsc::Sender<pb::WorkerMsg>,
    recorders: &[Arc<FlightRecorder>],
    traces: &[Option<TraceHandle>],
) -> Result<(), ProgramError> {
    let dump: Vec<RecorderDump> = recorders
        .iter()
        .zip(traces)
        .map(|(r, t)| RecorderDump {
            status: r.status(),
            entries: r.entries(),
            trace: t.as_ref().map(TraceHandle::snapshot),
            host_stack: r.host_stack(),
        })
        .collect();
    let json = serde_json::to_vec(&dump).unwrap_or_default();
    to_coord
        .send(pb::WorkerMsg {
            body: Some(pb::worker_msg::Body::Dump(pb::FlightRecorderDump { json })),
        })
        .await
        .map_err(session_error)
}

/// Messages from the coordinator.
struct Inbound(tonic::Streaming<pb::CoordinatorMsg>);

impl Inbound {
    async fn next(&mut self) -> Result<pb::coordinator_msg::Body, ProgramError> {
        match self.0.message().await {
            Ok(Some(m)) => m.body.ok_or_else(|| session_error("empty message")),
            Ok(None) => Err(session_error("the coordinator closed the session")),
            Err(s) => Err(session_error(lost_coordinator(s.message()))),
        }
    }
}

/// A broken control stream in words: the transport's own (`h2 protocol error: error reading
/// a body from connection`) says nothing of why.
fn lost_coordinator(transport: &str) -> String {
    if transport.contains("keep-alive") || transport.contains("h2 protocol error") {
        format!(
            "the coordinator stopped answering (stopped, killed, or its host unreachable; pings go unanswered after {} s): {transport}",
            (KEEPALIVE_EVERY + KEEPALIVE_PATIENCE).as_secs()
        )
    } else {
        transport.to_string()
    }
}

/// Why the coordinator at `join` gave no session, told by what answered: nothing, a server
/// that is not podsim's, a TLS server spoken to in the clear, or a coordinator that refused
/// this worker.
async fn session_refused(
    join: &str,
    status: &tonic::Status,
    tls: Option<&podsim_links::tls::Tls>,
) -> ProgramError {
    let why = podsim_links::tls::chain(status);
    let not_podsim = "it is not a podsim coordinator";
    // A broken connection with no gRPC answer: what is there is asked in the clear.
    let broken = std::error::Error::source(status).is_some() && tls.is_none();
    session_error(if why.contains("keep-alive timed out") {
        format!(
            "{join} did not answer for {} s: {not_podsim}, or it is stopped",
            (KEEPALIVE_EVERY + KEEPALIVE_PATIENCE).as_secs()
        )
    } else if status.code() == tonic::Code::Unimplemented {
        // A gRPC server without podsim's control service.
        format!(
            "{join} does not serve podsim's control service: {not_podsim}, or another podsim \
             version's ({why})"
        )
    } else if broken {
        match answer_in_the_clear(join).await {
            Answer::Tls => format!(
                "the coordinator refused the session: {join} expects TLS{} ({why})",
                tls_hint(tls)
            ),
            Answer::Http1 => format!("{join} is an HTTP/1 server: {not_podsim} ({why})"),
            Answer::Other => format!(
                "{join} answered in no protocol of podsim's (gRPC over HTTP/2): {not_podsim}, \
                 or it stopped ({why})"
            ),
        }
    } else {
        format!(
            "the coordinator refused the session: {why}{}",
            tls_hint(tls)
        )
    })
}

/// What a server says to an HTTP/2 client's first bytes sent in the clear.
enum Answer {
    /// A TLS record (an alert or a handshake): it expects TLS.
    Tls,
    /// An HTTP/1 status line.
    Http1,
    /// Anything else, or nothing within a second.
    Other,
}

async fn answer_in_the_clear(join: &str) -> Answer {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let talk = async {
        let mut stream = tokio::net::TcpStream::connect(join).await.ok()?;
        stream
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .ok()?;
        let mut first = [0u8; 5];
        let n = stream.read(&mut first).await.ok()?;
        Some(first[..n].to_vec())
    };
    match tokio::time::timeout(Duration::from_secs(1), talk).await {
        // TLS records open with their content type: 21 an alert, 22 a handshake.
        Ok(Some(bytes)) if matches!(bytes.first(), Some(21 | 22)) => Answer::Tls,
        Ok(Some(bytes)) if bytes.starts_with(b"HTTP/") => Answer::Http1,
        _ => Answer::Other,
    }
}

/// What to check when the coordinator cannot be reached or refuses the session, as far as
/// TLS goes (a TLS server and a plain client, or a certificate of another authority, fail
/// with transport errors that do not say so).
fn tls_hint(tls: Option<&podsim_links::tls::Tls>) -> String {
    match tls {
        None => " (if the job uses [launch.tls], start the worker with --tls-ca, --tls-cert and \
                  --tls-key)"
            .to_string(),
        Some(tls) => format!(
            " (with TLS: this worker's certificate must be signed by the job's authority and \
             both certificates must name {:?})",
            tls.files().server_name
        ),
    }
}

use podsim_links::net::{
    CONTROL_KEEPALIVE_EVERY as KEEPALIVE_EVERY, CONTROL_KEEPALIVE_PATIENCE as KEEPALIVE_PATIENCE,
};

async fn connect_control(
    endpoint: &str,
    tls: Option<&podsim_links::tls::Tls>,
    patience: Duration,
) -> Result<ControlClient<tonic::transport::Channel>, ProgramError> {
    let deadline = tokio::time::Instant::now() + patience;
    // The coordinator answers pings while it lives and runs: one stopped (SIGSTOP) or gone
    // without closing the connection, or a server that is not a coordinator and says
    // nothing, ends the session within KEEPALIVE_EVERY + KEEPALIVE_PATIENCE instead of never.
    let target = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| session_error(format!("bad coordinator address {endpoint}: {e}")))?
        .http2_keep_alive_interval(KEEPALIVE_EVERY)
        .keep_alive_timeout(KEEPALIVE_PATIENCE)
        .keep_alive_while_idle(true);
    let target = podsim_links::tls::secure(target, tls)?;
    loop {
        match target.connect().await {
            Ok(channel) => {
                return Ok(ControlClient::new(channel)
                    .max_decoding_message_size(MAX_CONTROL_MESSAGE_BYTES));
            }
            // A certificate the other side refuses (or that this side refuses) is refused
            // again on every try: say so now rather than after the whole patience.
            Err(e)
                if tokio::time::Instant::now() >= deadline
                    || podsim_links::tls::handshake_failure(&e).is_some() =>
            {
                let why = podsim_links::tls::chain(&e);
                // rustls's words for a peer that answered a TLS hello in plain text.
                let hint = if tls.is_some() && why.contains("InvalidContentType") {
                    " (the coordinator answers without TLS: its job has no [launch.tls]; start \
                     the worker without --tls-ca, --tls-cert and --tls-key)"
                        .to_string()
                } else {
                    tls_hint(tls)
                };
                return Err(session_error(format!(
                    "cannot reach the coordinator at {endpoint}: {why}{hint}"
                )));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
