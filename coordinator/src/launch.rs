//! Running a job across worker processes: the control service workers join, spawning them
//! (or waiting for externally started ones), handing out the job, starting it, gathering
//! progress and results, and making sure no worker outlives the job.
//!
//! A launch goes through named phases ([`Launch::run`]): join (every worker says hello), hand
//! out the job (`Setup`), run (ready, start, heartbeats into the watchdog, results), and shut
//! down; every way a job can end early goes through one `fail` path that tells the workers to
//! stop. How long each phase may take is in [`timeouts`].

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Stdio;
use std::time::{Duration, Instant};

use podsim_programs::job::{JobSpec, WorkerReport};
use podsim_proto::v1 as pb;
use podsim_proto::v1::control_server::{Control, ControlServer};
use podsim_worker::tls::{Tls, TlsFiles};

use crate::supervisor::{Decision, Event, Supervisor};
use crate::watchdog::{Finding, Liveness, Watchdog};
use podsim_worker::transport::check_token;
use tokio::process::{Child, Command};
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// How workers come to the job.
#[derive(Debug, Clone)]
pub enum Workers {
    /// The coordinator starts them as child processes of this binary.
    Spawn {
        exe: PathBuf,
        log_dir: Option<PathBuf>,
        /// The job's runs before this one (a restart or a regroup): its workers then add to
        /// the logs (`worker-N.log`) instead of starting them anew, as the failure that made
        /// the job run again named those logs.
        restart: Option<u32>,
    },
    /// They are started elsewhere with `podsim worker --join ADDR --token TOKEN`.
    External,
}

/// One worker as the coordinator knows it.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    pub id: u32,
    pub pid: u32,
    pub link_addr: String,
}

/// What a finished job produced.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub workers: Vec<WorkerInfo>,
    pub reports: Vec<WorkerReport>,
    pub wall: Duration,
    /// Chips the others spent much of the run waiting on (slow, not hung).
    pub stragglers: Vec<crate::watchdog::Straggler>,
    /// Faults the workers reported firing.
    pub faults: Vec<podsim_job::FaultEvent>,
}

/// Why a job did not finish.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot start the control service on {addr}: {reason}")]
    Bind { addr: String, reason: String },
    #[error("cannot start worker {id}: {reason}")]
    Spawn { id: u32, reason: String },
    #[error("worker {id} failed: {reason}")]
    Worker { id: u32, reason: String },
    #[error("{0}")]
    Protocol(String),
    #[error("timed out: {0}")]
    Timeout(String),
    #[error("interrupted")]
    Interrupted,
    /// A representative rank of a meta-mode torch job needs finer classes (see
    /// `TorchSpec::representative_steps`): not a failure, the job runs again with them.
    #[error("{why}")]
    Regroup { steps: Vec<u32>, why: String },
    /// The watchdog found a hang (or a desync): the diagnosis and the evidence.
    #[error("{} detected: {}", serde_json::to_value(.0.finding.kind).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default(), .0.finding.explanation)]
    Hang(Box<HangReport>),
}

/// A diagnosed hang: what the watchdog found, the flight recorders it collected, the faults
/// the workers reported firing, and when it was detected.
#[derive(Debug, Clone)]
pub struct HangReport {
    pub finding: Finding,
    /// Per worker, its chips' flight recorders (JSON).
    pub recorders: BTreeMap<u32, serde_json::Value>,
    pub faults: Vec<podsim_job::FaultEvent>,
    pub detected_wall_ns: u64,
    /// The step the job failed in (the furthest step a live chip had entered).
    pub step_reached: u64,
    /// Pid of each worker that joined.
    pub pids: BTreeMap<u32, u32>,
    /// PyTorch jobs: what the failing ranks had done until the failure.
    pub torch: Vec<podsim_programs::RankReport>,
}

/// A worker that joined the control session.
struct Joined {
    hello: pb::Hello,
    to_worker: mpsc::Sender<Result<pb::CoordinatorMsg, Status>>,
    from_worker: Streaming<pb::WorkerMsg>,
}

#[derive(Debug, Clone)]
struct ControlService {
    joined: mpsc::Sender<Joined>,
}

type CoordStream = Pin<Box<dyn Stream<Item = Result<pb::CoordinatorMsg, Status>> + Send>>;

#[tonic::async_trait]
impl Control for ControlService {
    type SessionStream = CoordStream;

    async fn session(
        &self,
        request: Request<Streaming<pb::WorkerMsg>>,
    ) -> Result<Response<CoordStream>, Status> {
        let mut from_worker = request.into_inner();
        let first = tokio::time::timeout(timeouts::HELLO, from_worker.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no hello within 10 s"))??;
        let Some(pb::WorkerMsg {
            body: Some(pb::worker_msg::Body::Hello(hello)),
        }) = first
        else {
            return Err(Status::invalid_argument(
                "a session must start with a hello",
            ));
        };
        let (to_worker, rx) = mpsc::channel(16);
        self.joined
            .send(Joined {
                hello,
                to_worker,
                from_worker,
            })
            .await
            .map_err(|_| {
                Status::resource_exhausted(
                    "the job already has all its workers, or has ended: it takes no more",
                )
            })?;
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A random job token from the OS's hash seeds (no extra dependency).
pub fn new_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut out = String::new();
    for i in 0..2u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(i);
        h.write_u128(Instant::now().elapsed().as_nanos());
        h.write_u32(std::process::id());
        out.push_str(&format!("{:016x}", h.finish()));
    }
    out
}

/// The protocol's time limits, in one place.
pub mod timeouts {
    use std::time::Duration;

    /// How long a worker may take to send its hello once connected.
    pub const HELLO: Duration = Duration::from_secs(10);
    /// How often the join phase looks for workers that died before joining.
    pub const JOIN_POLL: Duration = Duration::from_millis(200);
    /// How long every worker may take, once given the job, to link up with its neighbours.
    pub const SETUP: Duration = Duration::from_secs(60);
    /// The longest the run phase waits for an event before it checks the watchdog again
    /// (shorter when heartbeats are more frequent).
    pub const TICK: Duration = crate::supervisor::MOST_TICK_INTERVAL;
    /// How long a worker's exit status may take to appear after it reported a failure (a
    /// neighbour of a dead worker reports the broken link first).
    pub const DEAD_AFTER_FAILURE: Duration = Duration::from_secs(1);
    /// The same after a control session was lost.
    pub const DEAD_AFTER_LOST: Duration = Duration::from_millis(500);
    /// Flight-recorder dumps: a second, plus a millisecond per 5 chips of the largest worker
    /// (writing out tens of thousands of recorders takes time).
    pub fn dumps(chips_per_worker: u64) -> Duration {
        Duration::from_millis(1000 + chips_per_worker / 5)
    }
    /// How long workers get to exit on their own before they are killed.
    pub const REAP: Duration = Duration::from_secs(5);
}

/// The control service, bound and serving; dropped, it stops.
pub struct ControlPlane {
    pub addr: std::net::SocketAddr,
    pub token: String,
    /// Mutual TLS on the control service (and, passed on, on the workers it spawns).
    pub tls: Option<Tls>,
    joined: mpsc::Receiver<Joined>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The workers of the last launch, once they all joined (a failed or interrupted job's
    /// report still says who took part).
    roster: Vec<WorkerInfo>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ControlPlane({})", self.addr)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl ControlPlane {
    /// Binds `addr` (`host:port`, port 0 for any) and serves the control service, over
    /// mutual TLS when `tls` is given.
    pub async fn start(
        addr: &str,
        token: String,
        tls: Option<Tls>,
    ) -> Result<ControlPlane, LaunchError> {
        let listener =
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| LaunchError::Bind {
                    addr: addr.to_string(),
                    reason: e.to_string(),
                })?;
        let local = listener.local_addr().map_err(|e| LaunchError::Bind {
            addr: addr.to_string(),
            reason: e.to_string(),
        })?;
        let (tx, joined) = mpsc::channel(64);
        let checked = token.clone();
        let service = tonic::service::interceptor::InterceptedService::new(
            ControlServer::new(ControlService { joined: tx })
                .max_decoding_message_size(podsim_job::MAX_CONTROL_MESSAGE_BYTES),
            move |req: Request<()>| {
                check_token(&checked, req.metadata())?;
                Ok(req)
            },
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let mut server = tonic::transport::Server::builder();
        if let Some(tls) = &tls {
            server = server
                .tls_config(tls.server())
                .map_err(|e| LaunchError::Bind {
                    addr: addr.to_string(),
                    reason: podsim_worker::tls::chain(&e),
                })?;
        }
        tokio::spawn(async move {
            let served = server
                .serve_with_incoming_shutdown(
                    service,
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    async {
                        let _ = stopped.await;
                    },
                )
                .await;
            if let Err(e) = served {
                tracing::error!("control service stopped: {e}");
            }
        });
        Ok(ControlPlane {
            addr: local,
            token,
            tls,
            joined,
            stop: Some(stop),
            roster: Vec::new(),
        })
    }

    /// The workers of the last launch that all joined (empty before that).
    pub fn roster(&self) -> &[WorkerInfo] {
        &self.roster
    }
}

/// Child processes that are killed if they are still running when this is dropped.
#[derive(Debug, Default)]
pub struct Children(
    Vec<(u32, Child)>,
    HashMap<u32, podsim_collectives::CpuWaitMeter>,
);

impl Children {
    /// Exit status of any worker that has already exited.
    fn exited(&mut self) -> Option<(u32, String)> {
        self.all_exited()
            .into_iter()
            .next()
            .map(|(id, how, _)| (id, how))
    }

    /// What the kernel says of each spawned worker's process now: stopped (SIGSTOP, a
    /// debugger), or running with the share of the time since the last call its threads
    /// waited for a CPU. Workers this launcher did not spawn, or where `/proc` cannot tell,
    /// are left out (unknown).
    fn liveness(&mut self, now: std::time::Instant) -> HashMap<u32, Liveness> {
        let mut out = HashMap::new();
        for (id, child) in &self.0 {
            let Some(pid) = child.id() else { continue };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let Some(&state) = podsim_collectives::procfs::stat_fields(&stat)
                .as_ref()
                .and_then(|f| f.first())
            else {
                continue;
            };
            let meter = self
                .1
                .entry(*id)
                .or_insert_with(|| podsim_collectives::CpuWaitMeter::for_process(now, pid));
            let cpu_wait_share = meter.share_of_process(now, pid);
            let live = if matches!(state, "T" | "t") {
                Liveness::Stopped
            } else {
                Liveness::Running { cpu_wait_share }
            };
            out.insert(*id, live);
        }
        out
    }

    /// Every spawned worker that has exited, with how; `abnormal` is true unless it ended
    /// the way a worker that reports its own error does (exit code 1).
    fn all_exited(&mut self) -> Vec<(u32, String, bool)> {
        let mut out = Vec::new();
        for (id, child) in &mut self.0 {
            if let Ok(Some(status)) = child.try_wait() {
                let normal = matches!(status.code(), Some(0 | 1));
                out.push((*id, describe_exit(status), !normal));
            }
        }
        out
    }

    /// A worker that died abnormally, waiting up to `patience` for its exit status to show.
    async fn dead(&mut self, patience: Duration) -> Option<(u32, String)> {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            if let Some((id, how, _)) = self.all_exited().into_iter().find(|e| e.2) {
                return Some((id, how));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The worker to blame when worker `id` failed or went away with `reason`: a worker that
    /// died abnormally (killed, crashed) is the cause, and its neighbours' reports of broken
    /// links are consequences. Waits up to a second for exit statuses to show.
    async fn blame(&mut self, id: u32, reason: String) -> LaunchError {
        let mut seen = Vec::new();
        for _ in 0..20 {
            seen = self.all_exited();
            if seen.iter().any(|e| e.2) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if let Some((dead, how, _)) = seen.iter().find(|e| e.2 && e.0 != id) {
            return LaunchError::Worker {
                id: *dead,
                reason: format!("process {how}; worker {id} then reported: {reason}"),
            };
        }
        match seen.iter().find(|e| e.0 == id) {
            Some((_, how, _)) => LaunchError::Worker {
                id,
                reason: format!("{reason}; process {how}"),
            },
            None => LaunchError::Worker { id, reason },
        }
    }

    /// Waits up to `grace` for every child to exit, then kills the rest.
    pub async fn reap(&mut self, grace: Duration) {
        let deadline = tokio::time::Instant::now() + grace;
        for (_, child) in &mut self.0 {
            // Held until the child has exited: `wait` would otherwise close the child's
            // standard input first, which a worker reads as its coordinator dying (it
            // warns and exits 1) while it is still shutting down as told.
            let _stdin = child.stdin.take();
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if tokio::time::timeout(left, child.wait()).await.is_err() {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
        }
        self.0.clear();
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        for (_, child) in &mut self.0 {
            let _ = child.start_kill();
        }
    }
}

enum WorkersKind {
    Spawned,
    External,
}

fn workers_kind(children: &Children) -> WorkersKind {
    if children.0.is_empty() {
        WorkersKind::External
    } else {
        WorkersKind::Spawned
    }
}

/// Asks every worker for its flight recorders and waits up to `patience` for the answers (a
/// dead or frozen worker sends none).
async fn collect_recorders(
    events: &mut Events,
    sessions: &Sessions,
    finding: &Finding,
    patience: Duration,
) -> BTreeMap<u32, serde_json::Value> {
    sessions
        .broadcast(pb::coordinator_msg::Body::Dump(pb::DumpRequest {}))
        .await;
    let mut out = BTreeMap::new();
    let deadline = tokio::time::Instant::now() + patience;
    while let Ok(Some((id, msg))) = tokio::time::timeout_at(deadline, events.recv()).await {
        if let Ok(pb::worker_msg::Body::Dump(d)) = msg
            && let Ok(v) = serde_json::from_slice(&d.json)
        {
            out.insert(id, v);
        }
    }
    tracing::info!(
        "collected {} flight recorders for a {:?}",
        out.len(),
        finding.kind
    );
    out
}

fn describe_exit(status: std::process::ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return podsim_links::procs::killed_by(sig);
        }
    }
    match status.code() {
        Some(c) => format!("exited with code {c}"),
        None => "exited".to_string(),
    }
}

const MIMALLOC_PURGE_DELAY: &str = "MIMALLOC_PURGE_DELAY";

/// A worker's log: started anew, or after `n` earlier runs of the job continued below a line
/// saying so.
fn worker_log(path: &Path, restart: Option<u32>) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    let Some(n) = restart else {
        return crate::outdir::open_in_output(path, options.truncate(true));
    };
    let mut file = crate::outdir::open_in_output(path, options.append(true))?;
    writeln!(
        file,
        "--- podsim: the job runs again here (attempt {}) ---",
        n + 1
    )?;
    Ok(file)
}

fn spawn_workers(
    exe: &Path,
    log_dir: Option<&Path>,
    restart: Option<u32>,
    control: &ControlPlane,
    workers: u32,
) -> Result<Children, LaunchError> {
    let mut children = Children::default();
    // Workers share this machine's cores: give each its share of runtime threads.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // At least two, so that heartbeats go out while a chip runs a long kernel on the other.
    let threads = (cores / workers as usize).max(2);
    for id in 0..workers {
        let stderr = match log_dir {
            Some(dir) => {
                let path = dir.join(format!("worker-{id}.log"));
                worker_log(&path, restart)
                    .map(Stdio::from)
                    .map_err(|e| LaunchError::Spawn {
                        id,
                        reason: format!("{}: {e}", path.display()),
                    })?
            }
            None => Stdio::inherit(),
        };
        let mut command = Command::new(exe);
        // Every step of a job allocates the same buffer sizes again: keep freed pages mapped
        // rather than return them to the kernel and fault them back in (zeroing huge pages
        // cost a third of all CPU time in a DDP profile). A user's own setting wins.
        if std::env::var_os(MIMALLOC_PURGE_DELAY).is_none() {
            command.env(MIMALLOC_PURGE_DELAY, "-1");
        }
        let child = command
            .arg("worker")
            .arg("--join")
            .arg(control.addr.to_string())
            .arg("--worker-id")
            .arg(id.to_string())
            .arg("--bind")
            .arg(control.addr.ip().to_string())
            .arg("--watch-stdin")
            .arg("--threads")
            .arg(threads.to_string())
            .args(
                control
                    .tls
                    .as_ref()
                    .map(|t| tls_args(t.files()))
                    .unwrap_or_default(),
            )
            .env("PODSIM_TOKEN", &control.token)
            .stdin(Stdio::piped())
            // A worker prints nothing of its own on standard output; a torch job's ranks print
            // there, each line prefixed with its rank, for the user's terminal.
            .stdout(Stdio::inherit())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| LaunchError::Spawn {
                id,
                reason: e.to_string(),
            })?;
        children.0.push((id, child));
    }
    Ok(children)
}

/// The `podsim worker` arguments that give a worker the job's TLS files.
pub fn tls_args(files: &TlsFiles) -> Vec<String> {
    let path = |p: &std::path::Path| p.display().to_string();
    vec![
        "--tls-ca".into(),
        path(&files.ca),
        "--tls-cert".into(),
        path(&files.cert),
        "--tls-key".into(),
        path(&files.key),
        "--tls-server-name".into(),
        files.server_name.clone(),
    ]
}

/// Progress of the whole job: (units done, units in all).
pub type ProgressFn<'a> = &'a mut (dyn FnMut(u64, u64) + Send);

/// One launch of a job: what runs, who runs it and how long joining may take.
pub struct Launch<'a> {
    spec: &'a JobSpec,
    workers: Workers,
    join_timeout: Duration,
    progress: Option<ProgressFn<'a>>,
}

impl std::fmt::Debug for Launch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("job", &self.spec.name)
            .field("workers", &self.workers)
            .field("join_timeout", &self.join_timeout)
            .finish()
    }
}

impl<'a> Launch<'a> {
    /// Runs `spec` on `spec.workers` workers, started as `workers` says; joining may take
    /// 30 s unless told otherwise.
    pub fn new(spec: &'a JobSpec, workers: Workers) -> Launch<'a> {
        Launch {
            spec,
            workers,
            join_timeout: Duration::from_secs(30),
            progress: None,
        }
    }

    pub fn join_timeout(self, join_timeout: Duration) -> Launch<'a> {
        Launch {
            join_timeout,
            ..self
        }
    }

    /// Called with (units done, units in all) as the workers report progress.
    pub fn progress(self, progress: ProgressFn<'a>) -> Launch<'a> {
        Launch {
            progress: Some(progress),
            ..self
        }
    }

    /// Runs the job on the workers that join `control` (their roster stays on `control`,
    /// for the report of a job that fails or is interrupted). No worker outlives it.
    pub async fn run(self, control: &mut ControlPlane) -> Result<Outcome, LaunchError> {
        let started = Instant::now();
        let mut children = match &self.workers {
            Workers::Spawn {
                exe,
                log_dir,
                restart,
            } => spawn_workers(
                exe,
                log_dir.as_deref(),
                *restart,
                control,
                self.spec.workers,
            )?,
            Workers::External => Children::default(),
        };
        let mut no_progress = |_: u64, _: u64| {};
        let progress = match self.progress {
            Some(p) => p,
            None => &mut no_progress,
        };
        let result = drive(
            self.spec,
            control,
            &mut children,
            self.join_timeout,
            progress,
        )
        .await;
        // Whatever happened, no worker outlives the job.
        children.reap(timeouts::REAP).await;
        result.map(|outcome| Outcome {
            wall: started.elapsed(),
            ..outcome
        })
    }
}

async fn drive(
    spec: &JobSpec,
    control: &mut ControlPlane,
    children: &mut Children,
    join_timeout: Duration,
    progress: ProgressFn<'_>,
) -> Result<Outcome, LaunchError> {
    let joined = join(spec.workers, control, children, join_timeout).await?;
    let infos: Vec<WorkerInfo> = joined
        .iter()
        .map(|(&id, j)| WorkerInfo {
            id,
            pid: j.hello.pid,
            link_addr: j.hello.link_addr.clone(),
        })
        .collect();
    control.roster.clone_from(&infos);
    let (sessions, events) = hand_out(spec, joined).await?;
    let (reports, mut watchdog) =
        supervise(spec, &infos, &sessions, events, children, progress).await?;
    for r in &reports {
        watchdog.faults_fired(&r.faults);
    }
    Ok(Outcome {
        workers: infos,
        reports,
        // The launch times the whole run, reaping included.
        wall: Duration::ZERO,
        stragglers: watchdog.stragglers(),
        faults: watchdog.faults().to_vec(),
    })
}

/// Phase 1: every worker joins (says hello), within `join_timeout`.
async fn join(
    n: u32,
    control: &mut ControlPlane,
    children: &mut Children,
    join_timeout: Duration,
) -> Result<BTreeMap<u32, Joined>, LaunchError> {
    let mut joined: BTreeMap<u32, Joined> = BTreeMap::new();
    // A --join-timeout past what the clock can add is as good as none.
    let deadline = tokio::time::Instant::now()
        .checked_add(join_timeout)
        .unwrap_or_else(|| tokio::time::Instant::now() + Duration::from_secs(100 * 365 * 86_400));
    let mut next_free = 0u32;
    while (joined.len() as u32) < n {
        // A worker that joined and went (killed, its host gone) before the job started frees
        // its place: it was counted as joined until the timeout, and no other could take it.
        let before = joined.len();
        joined.retain(|id, j| {
            let gone = j.to_worker.is_closed();
            if gone {
                eprintln!("podsim: worker {id} left before the job started (its session closed); its place is free");
            }
            !gone
        });
        if joined.len() < before {
            // A place below the next free one may be free again.
            next_free = 0;
        }
        if let Some((id, how)) = children.exited() {
            return Err(LaunchError::Worker {
                id,
                reason: format!("{how} before joining"),
            });
        }
        let j = match tokio::time::timeout_at(
            deadline.min(tokio::time::Instant::now() + timeouts::JOIN_POLL),
            control.joined.recv(),
        )
        .await
        {
            Ok(Some(j)) => j,
            Ok(None) => return Err(LaunchError::Protocol("control service stopped".into())),
            Err(_) if tokio::time::Instant::now() >= deadline => {
                return Err(LaunchError::Timeout(format!(
                    "{} of {n} workers joined within {join_timeout:?}",
                    joined.len()
                )));
            }
            Err(_) => continue,
        };
        let id = match place_of(j.hello.worker_id, &joined, n, &mut next_free) {
            Ok(id) => id,
            Err(why) => {
                let _ = j.to_worker.send(Err(Status::already_exists(why))).await;
                continue;
            }
        };
        joined.insert(id, j);
    }
    // The job has its workers: one more is refused at once (it waited for the whole job,
    // then heard the session close), and one that came meanwhile is told so.
    control.joined.close();
    while let Ok(extra) = control.joined.try_recv() {
        let _ = extra
            .to_worker
            .try_send(Err(Status::resource_exhausted(format!(
                "the job already has all its {n} workers"
            ))));
    }
    Ok(joined)
}

/// The id a joining worker takes: the one its hello asks for, or with -1 the lowest free
/// one (`next_free` moves past those taken); else why it is refused. Any other negative id is
/// no id (it was taken as -1).
fn place_of(
    asked: i32,
    joined: &BTreeMap<u32, Joined>,
    n: u32,
    next_free: &mut u32,
) -> Result<u32, String> {
    let out_of_range = |id: i64| {
        format!(
            "worker id {id} is out of range: the job's workers are 0 to {}",
            n - 1
        )
    };
    let id = match u32::try_from(asked) {
        Ok(id) => id,
        Err(_) if asked == -1 => {
            while joined.contains_key(next_free) {
                *next_free += 1;
            }
            *next_free
        }
        Err(_) => return Err(out_of_range(i64::from(asked))),
    };
    if joined.contains_key(&id) {
        return Err(format!("worker id {id} is taken"));
    }
    if id >= n {
        return Err(out_of_range(i64::from(id)));
    }
    Ok(id)
}

/// The workers' control sessions, coordinator to worker.
#[derive(Debug, Clone)]
struct Sessions(BTreeMap<u32, mpsc::Sender<Result<pb::CoordinatorMsg, Status>>>);

/// Every worker's messages, merged: (worker, message or how its session ended).
type Events = mpsc::Receiver<(u32, Result<pb::worker_msg::Body, String>)>;

impl Sessions {
    async fn broadcast(&self, body: pb::coordinator_msg::Body) {
        for tx in self.0.values() {
            let _ = tx
                .send(Ok(pb::CoordinatorMsg {
                    body: Some(body.clone()),
                }))
                .await;
        }
    }

    /// The one way a job ends: every worker is told to stop, with the reason.
    async fn shutdown(&self, reason: String) {
        self.broadcast(pb::coordinator_msg::Body::Shutdown(pb::Shutdown { reason }))
            .await;
    }

    /// Every early end: stop the workers, then return `error`.
    async fn fail<T>(&self, reason: String, error: LaunchError) -> Result<T, LaunchError> {
        self.shutdown(reason).await;
        Err(error)
    }
}

/// Phase 2: every worker gets the job and the others' addresses; their messages merge into
/// one channel.
async fn hand_out(
    spec: &JobSpec,
    joined: BTreeMap<u32, Joined>,
) -> Result<(Sessions, Events), LaunchError> {
    let field = |f: fn(&pb::Hello) -> &String| -> HashMap<u32, String> {
        joined
            .iter()
            .map(|(&id, j)| (id, f(&j.hello).clone()))
            .collect()
    };
    let (link_addrs, link_locals, host_ids) = (
        field(|h| &h.link_addr),
        field(|h| &h.link_local),
        field(|h| &h.host_id),
    );
    let job_json = serde_json::to_vec(spec).map_err(|e| LaunchError::Protocol(e.to_string()))?;
    let (events_tx, events) = mpsc::channel(256);
    let mut senders = BTreeMap::new();
    for (id, j) in joined {
        let setup = pb::Setup {
            worker_id: id,
            workers: spec.workers,
            job_json: job_json.clone(),
            link_addrs: link_addrs.clone(),
            link_locals: link_locals.clone(),
            host_ids: host_ids.clone(),
        };
        let msg = pb::CoordinatorMsg {
            body: Some(pb::coordinator_msg::Body::Setup(setup)),
        };
        j.to_worker
            .send(Ok(msg))
            .await
            .map_err(|_| LaunchError::Worker {
                id,
                reason: "left before setup".into(),
            })?;
        senders.insert(id, j.to_worker);
        tokio::spawn(forward_session(id, j.from_worker, events_tx.clone()));
    }
    Ok((Sessions(senders), events))
}

/// Forwards worker `id`'s messages into the merged channel, then how its session ended.
async fn forward_session(
    id: u32,
    mut stream: Streaming<pb::WorkerMsg>,
    tx: mpsc::Sender<(u32, Result<pb::worker_msg::Body, String>)>,
) {
    loop {
        let item = match stream.message().await {
            Ok(Some(pb::WorkerMsg { body: Some(b) })) => Ok(b),
            Ok(Some(_)) => continue,
            Ok(None) => Err("closed its control session".to_string()),
            Err(s) => Err(format!("control session failed: {}", s.message())),
        };
        let end = item.is_err();
        if tx.send((id, item)).await.is_err() || end {
            return;
        }
    }
}

/// Phase 3: ready, start, progress (heartbeats into the watchdog), results, shut down. The
/// supervisor decides; this loop waits for events and carries out its decisions.
async fn supervise(
    spec: &JobSpec,
    infos: &[WorkerInfo],
    sessions: &Sessions,
    mut events: Events,
    children: &mut Children,
    progress: ProgressFn<'_>,
) -> Result<(Vec<WorkerReport>, Watchdog), LaunchError> {
    let watchdog = Watchdog::new(
        spec.pod.clone(),
        Duration::from_millis(spec.watchdog_ms.max(1)),
        Duration::from_millis(spec.heartbeat_ms.max(1)),
    );
    let pids: BTreeMap<u32, u32> = infos.iter().map(|w| (w.id, w.pid)).collect();
    let mut supervisor = Supervisor::new(watchdog, pids);
    let waits = Waits {
        tick: Duration::from_millis(spec.heartbeat_ms.max(1)).min(timeouts::TICK),
        setup_deadline: tokio::time::Instant::now() + timeouts::SETUP,
        external: matches!(workers_kind(children), WorkersKind::External),
    };
    loop {
        let decision = match next_decision(&mut supervisor, &mut events, children, &waits).await {
            Ok(decision) => decision,
            Err((reason, error)) => return sessions.fail(reason, error).await,
        };
        match decision {
            Decision::Continue => {}
            Decision::Start => {
                sessions
                    .broadcast(pb::coordinator_msg::Body::Start(pb::Start {}))
                    .await;
            }
            Decision::Progress(done, total) => progress(done, total),
            Decision::Diagnose(finding) => {
                let hang = diagnose(*finding, &supervisor, &mut events, sessions, spec).await;
                return sessions.fail("hang detected".into(), hang).await;
            }
            Decision::WorkerFailed { id, reason } => {
                let error = children.blame(id, reason).await;
                return sessions.fail(format!("worker {id} failed"), error).await;
            }
            Decision::Regroup { steps, why } => {
                let regroup = LaunchError::Regroup {
                    steps,
                    why: why.clone(),
                };
                return sessions.fail(why, regroup).await;
            }
            Decision::Protocol(why) => {
                return sessions.fail(why.clone(), LaunchError::Protocol(why)).await;
            }
            Decision::Finished => break,
        }
    }
    sessions.shutdown("job finished".into()).await;
    Ok(supervisor.into_reports())
}

/// How long the run phase waits for events, and whether worker processes can be watched.
#[derive(Debug)]
struct Waits {
    tick: Duration,
    setup_deadline: tokio::time::Instant,
    external: bool,
}

/// Turns what happens next (a tick's process checks, a worker's message, a lost session, a
/// quiet interval) into the supervisor's decision; an error ends the job (reason, error).
async fn next_decision(
    supervisor: &mut Supervisor,
    events: &mut Events,
    children: &mut Children,
    waits: &Waits,
) -> Result<Decision, (String, LaunchError)> {
    let mut decision = Decision::Continue;
    if supervisor.started() {
        let exited = children.all_exited();
        let now = std::time::Instant::now();
        let liveness = children.liveness(now);
        let process = |w: u32| liveness.get(&w).copied().unwrap_or(Liveness::Unknown);
        decision = supervisor.on(Event::Tick {
            now,
            exited,
            process: &process,
        });
    }
    if decision == Decision::Continue {
        let wait = if supervisor.started() {
            waits.tick
        } else {
            waits
                .setup_deadline
                .saturating_duration_since(tokio::time::Instant::now())
        };
        decision = match tokio::time::timeout(wait, events.recv()).await {
            Ok(Some((id, Ok(body)))) => supervisor.on(Event::Message(id, body)),
            Ok(Some((id, Err(error)))) => supervisor.on(Event::Lost {
                id,
                error,
                external: waits.external,
            }),
            Ok(None) => {
                let gone = LaunchError::Protocol("every worker left".into());
                return Err(("every worker left".into(), gone));
            }
            Err(_) if !supervisor.started() => {
                let timeout = LaunchError::Timeout(format!(
                    "{} of {} workers linked up within {:?}",
                    supervisor.ready(),
                    supervisor.pids().len(),
                    timeouts::SETUP
                ));
                return Err(("setup timed out".into(), timeout));
            }
            Err(_) => match children.exited() {
                // Exited without its results (a failed exit is a dead worker, above).
                Some((id, how)) if !supervisor.reported(id) => {
                    Decision::WorkerFailed { id, reason: how }
                }
                _ => Decision::Continue,
            },
        };
    }
    if let Decision::WorkerFailed { .. } = decision
        && supervisor.started()
    {
        // A neighbour of a dead worker reports the broken link first.
        let dead = children.dead(timeouts::DEAD_AFTER_FAILURE).await;
        if let Some(diagnosis) = supervisor.explained_by(dead) {
            decision = diagnosis;
        }
    }
    Ok(decision)
}

/// A finding becomes a hang report: every live worker's flight recorders (they are asked
/// for them now) and the step the job failed in.
async fn diagnose(
    finding: Finding,
    supervisor: &Supervisor,
    events: &mut Events,
    sessions: &Sessions,
    spec: &JobSpec,
) -> LaunchError {
    let detected_wall_ns = podsim_collectives::wall_ns();
    let per_worker = u64::from(spec.pod.chips()) / u64::from(spec.workers.max(1));
    let recorders =
        collect_recorders(events, sessions, &finding, timeouts::dumps(per_worker)).await;
    let watchdog = supervisor.watchdog();
    // The furthest step any live chip entered: the step the job failed in (the live chips'
    // recorders are fresher than the last heartbeats).
    let step_reached = recorders
        .values()
        .filter_map(|d| d.as_array())
        .flatten()
        .filter_map(|c| c["status"]["step"].as_u64())
        .max()
        .unwrap_or_else(|| watchdog.step_reached());
    let mut faults = watchdog.faults().to_vec();
    faults.extend(crate::process_faults::seen_fired(
        spec,
        &finding,
        &faults,
        step_reached,
    ));
    LaunchError::Hang(Box::new(HangReport {
        finding,
        recorders,
        faults,
        detected_wall_ns,
        step_reached,
        pids: supervisor.pids().clone(),
        torch: supervisor.failed_ranks().to_vec(),
    }))
}
