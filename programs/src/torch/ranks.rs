//! The rank processes of a torch job: one per chip, started with torchrun's environment, their
//! output prefixed with their rank, their exits watched, and every one killed with what it
//! started when the job ends, however it ends: each rank leads a process group of its own,
//! killed by the guard's drop, after the rank exits, and by the keeper when the worker dies;
//! the rank itself gets `SIGKILL` from the kernel when its worker dies, asked for before it
//! runs anything (see `podsim_links::procs`).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use podsim_collectives::{FlightRecorder, Payload};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};

use super::TorchSpec;
use super::wire::{Frame, MAX_PAYLOAD_BYTES, Reply, Request, read_frame, write_frame};
use crate::error::ProgramError;
use podsim_links::procs::{Group, die_with_parent};
use podsim_links::socket::{Acceptor, Admission, Limits};

/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a rank's exit waits for the rest of its output to be read.
const OUTPUT_DRAIN: Duration = Duration::from_secs(1);
/// The longest line of a rank's output shown as one; a longer one is cut into several.
const MOST_LINE_BYTES: usize = 64 << 10;
/// Lines of a rank's standard error kept for the report of its death.
const STDERR_TAIL_LINES: usize = 20;
/// Requests read ahead of the chip (a rank waits for each reply, so one is the usual).
const REQUEST_QUEUE: usize = 4;

/// How a rank process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankExit {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

impl RankExit {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.code, self.signal) {
            (_, Some(s)) => write!(f, "was {}", podsim_links::procs::killed_by(s)),
            (Some(c), _) => write!(f, "exited with code {c}"),
            (None, None) => f.write_str("exited"),
        }
    }
}

/// A rank's connection as its chip sees it: requests in, replies out.
#[derive(Debug)]
pub struct RankLink {
    pub requests: mpsc::Receiver<Result<(Frame, Vec<f32>), String>>,
    pub replies: mpsc::Sender<(Reply, Option<Payload>)>,
    /// The kernel's id of the rank's stack-sampling thread, once it said (0 until then).
    pub sampler_thread: Arc<AtomicU32>,
    /// The pid of the process running the rank's program, as it said: the rank's own, or
    /// the child a rank server forked for it (whose CPU time says whether the rank works).
    pub pid: u32,
}

/// One rank process, for the chip that serves it.
#[derive(Debug)]
pub struct Rank {
    pub rank: u32,
    pub pid: u32,
    pub link: oneshot::Receiver<RankLink>,
    pub exit: watch::Receiver<Option<RankExit>>,
    pub stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// The last line it printed on standard output.
    pub last_output: Arc<Mutex<Option<String>>>,
    /// When it was started (its time to connect runs from here).
    pub started: Instant,
    /// Its process group (the rank and what it started).
    pub group: Arc<Group>,
    /// Its process is a stub, its program a process a rank server forked into the
    /// stub's group (see [`forkable`]).
    pub forked: bool,
}

/// Waits until a rank's process has exited (`exit` is its [`Rank::exit`]); how it ended
/// (`None`: no longer known).
pub async fn exited(exit: &mut watch::Receiver<Option<RankExit>>) -> Option<RankExit> {
    exit.wait_for(Option::is_some)
        .await
        .ok()
        .and_then(|e| e.clone())
}

/// Kills every rank still running, and what it started, when dropped: at once, whatever
/// runtime is left to run the tasks that wait for the ranks.
#[derive(Debug)]
pub struct RankGuard {
    kill: watch::Sender<bool>,
    groups: Vec<Arc<Group>>,
    /// Set once the job's attempt is abandoned: its ranks' output is no longer shown.
    quiet: Arc<AtomicBool>,
    /// The ranks' `sitecustomize.py`, removed with the guard.
    _boot: Option<super::boot::BootDir>,
}

impl RankGuard {
    /// Set when the job is about to run again with other ranks (a regroup): what these ranks
    /// say from then on (their connections closing under them) is not the program's, and is
    /// not shown.
    pub fn quiet(&self) -> Arc<AtomicBool> {
        self.quiet.clone()
    }
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        for group in &self.groups {
            group.kill();
        }
        let _ = self.kill.send(true);
    }
}

/// Starts one process per chip of `recorders` (rank = chip id) and the socket they dial:
/// each its own interpreter, or a stub for a rank forked by a rank server (see
/// [`forkable`]).
pub async fn start(
    spec: &TorchSpec,
    world: u32,
    recorders: &[Arc<FlightRecorder>],
    hardware: &podsim_topology::Hardware,
) -> Result<(Vec<Rank>, RankGuard), ProgramError> {
    let (listener, socket) = podsim_links::records::bind_abstract("podsim-ranks")
        .ok_or_else(|| ProgramError::Invalid("cannot open a Unix socket for the ranks".into()))?;
    let token = random_token();
    let master_port = free_port()?;
    let (kill, kill_rx) = watch::channel(false);
    let boot = if spec.intercept {
        Some(super::boot::BootDir::write()?)
    } else {
        None
    };
    let python_path = boot.as_ref().map(super::boot::BootDir::python_path);
    let mut guard = RankGuard {
        kill,
        groups: Vec::new(),
        quiet: Arc::default(),
        _boot: boot,
    };
    let mut pending = HashMap::new();
    let mut ranks = Vec::new();
    let Some((program, args)) = spec.command.split_first() else {
        return Err(ProgramError::Invalid("a torch job needs a command".into()));
    };
    // A rank sees the host its chip sits on in the modelled pod, as a launcher on a TPU VM
    // would start it, whichever worker process runs it here.
    let per_host = (hardware.chips_per_host as u32).clamp(1, world.max(1));
    let job = JobEnv {
        spec,
        hardware,
        world,
        per_host,
        master_port,
        socket: &socket,
        token: &token,
        python_path: python_path.as_deref(),
        ranks: recorders.len(),
    };
    // A shared server is looked for only when the ranks would be forked at all.
    let forked = forkable(spec, program, args);
    let shared = if forked { shared_rank_server()? } else { None };
    let server = match shared {
        Some(name) => Some(name),
        None if forked && recorders.len() > 1 => start_rank_server(program, &job, &mut guard).await,
        None => None,
    };
    let how = RankCommand {
        program,
        args,
        server: server.as_deref(),
        job: &job,
    };
    for recorder in recorders {
        let (rank, link_tx) = how.spawn(recorder.chip(), kill_rx.clone(), &mut guard)?;
        pending.insert(rank.rank, (link_tx, recorder.clone()));
        ranks.push(rank);
    }
    tokio::spawn(accept(listener, token, Arc::new(Mutex::new(pending))));
    Ok((ranks, guard))
}

/// How each rank's process starts: the program and its arguments, run by a stub of the
/// rank server's when there is one.
struct RankCommand<'a> {
    program: &'a str,
    args: &'a [String],
    server: Option<&'a str>,
    job: &'a JobEnv<'a>,
}

impl RankCommand<'_> {
    /// Starts rank `rank`'s process in its own group (listed in `guard`, killed when `kill`
    /// says), its output prefixed and its exit watched; the rank and where its connection
    /// goes once it says hello.
    fn spawn(
        &self,
        rank: u32,
        kill: watch::Receiver<bool>,
        guard: &mut RankGuard,
    ) -> Result<(Rank, oneshot::Sender<RankLink>), ProgramError> {
        let program = self.program;
        let mut command = tokio::process::Command::new(program);
        match self.server {
            Some(server) => {
                command
                    .arg("-S")
                    .arg("-c")
                    .arg(STUB)
                    .args(self.args)
                    .env(PREFORK_SOCKET, server);
            }
            None => {
                command.args(self.args);
            }
        }
        self.job.apply(&mut command);
        let per_host = self.job.per_host;
        command
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", (rank % per_host).to_string())
            .env("GROUP_RANK", (rank / per_host).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        die_with_parent(command.as_std_mut());
        // On an error, `guard` is dropped: the ranks started so far go with it.
        let mut child = command.spawn().map_err(|e| {
            ProgramError::Invalid(format!("cannot start rank {rank} ({program}): {e}"))
        })?;
        let started = Instant::now();
        let pid = child.id().unwrap_or(0);
        let group = Arc::new(Group::new(pid));
        guard.groups.push(group.clone());
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        let last_output = Arc::new(Mutex::new(None));
        let label = format!("rank {rank}");
        let mut readers = Vec::new();
        if let Some(out) = child.stdout.take() {
            let tail = Tail::Last(last_output.clone());
            readers.push(tokio::spawn(prefix_lines(
                out,
                label.clone(),
                tail,
                guard.quiet.clone(),
            )));
        }
        if let Some(err) = child.stderr.take() {
            let tail = Tail::Lines(stderr_tail.clone());
            readers.push(tokio::spawn(prefix_lines(
                err,
                label,
                tail,
                guard.quiet.clone(),
            )));
        }
        let exit = watch_exit(child, group.clone(), kill, readers);
        let (link_tx, link) = oneshot::channel();
        let rank = Rank {
            rank,
            pid,
            link,
            exit,
            stderr_tail,
            last_output,
            started,
            group,
            forked: self.server.is_some(),
        };
        Ok((rank, link_tx))
    }
}

/// Waits, on a task of its own, for a rank's process to exit (or kills it when `kill` says),
/// ends what it started with its group, and tells how it ended once `readers` have read its
/// output to the end (at most [`OUTPUT_DRAIN`] later): the diagnosis of a failed rank quotes
/// its last words.
fn watch_exit(
    mut child: tokio::process::Child,
    group: Arc<Group>,
    mut kill: watch::Receiver<bool>,
    readers: Vec<tokio::task::JoinHandle<()>>,
) -> watch::Receiver<Option<RankExit>> {
    let (exit_tx, exit) = watch::channel(None);
    tokio::spawn(async move {
        let status = tokio::select! {
            s = child.wait() => s,
            _ = async { let _ = kill.wait_for(|k| *k).await; } => {
                group.kill();
                // A rank that left its group on purpose (`setsid`) is not in it.
                let _ = child.start_kill();
                child.wait().await
            }
        };
        // What the rank started goes with it.
        group.end();
        // The readers end at the streams' end, unless something outside the group keeps
        // them open.
        let drained = async {
            for reader in readers {
                let _ = reader.await;
            }
        };
        let _ = tokio::time::timeout(OUTPUT_DRAIN, drained).await;
        let _ = exit_tx.send(Some(describe(status)));
    });
    exit
}

/// The rank server's socket (an abstract Unix socket name), for the stubs.
const PREFORK_SOCKET: &str = "PODSIM_PREFORK_SOCKET";
/// A rank server that many jobs share, started by `python -m podsim.rank_server`.
const RANK_SERVER: &str = "PODSIM_RANK_SERVER";
/// A forked rank's own process (see `python/podsim/_prefork.py`).
const STUB: &str = include_str!("stub.py");

/// What every rank of the job (and the rank server) is started with: torchrun's environment
/// but the rank's own numbers, and podsim's.
struct JobEnv<'a> {
    spec: &'a TorchSpec,
    hardware: &'a podsim_topology::Hardware,
    world: u32,
    per_host: u32,
    master_port: u16,
    socket: &'a str,
    token: &'a str,
    python_path: Option<&'a std::ffi::OsStr>,
    /// Rank processes on this worker.
    ranks: usize,
}

impl JobEnv<'_> {
    fn apply(&self, command: &mut tokio::process::Command) {
        let spec = self.spec;
        command
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_WORLD_SIZE", self.per_host.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", self.master_port.to_string())
            .env("PODSIM_SOCKET", self.socket)
            .env("PODSIM_TOKEN", self.token)
            .env("PODSIM_TOPOLOGY", &spec.topology)
            .env("PODSIM_MODE", if spec.meta { "meta" } else { "data" })
            .env("PODSIM_EAGER", spec.eager.name())
            .env("PODSIM_COUNT", spec.count.name())
            // The chip's HBM: a rank whose live device bytes pass it fails at that op.
            .env(
                "PODSIM_HBM_BYTES",
                format!("{:.0}", self.hardware.hbm_bytes),
            )
            .env("PODSIM_HARDWARE", &self.hardware.name)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .kill_on_drop(true);
        // As torchrun does: one intra-op thread per rank unless the user says otherwise
        // (several ranks share this host's cores; more threads only spin against each other).
        if std::env::var_os("OMP_NUM_THREADS").is_none() && self.ranks > 1 {
            command.env("OMP_NUM_THREADS", "1");
        }
        if let Some(path) = self.python_path {
            command.env("PYTHONPATH", path);
        }
        command.env_remove("PODSIM_BOOTED");
        if let Some(dir) = &spec.cwd {
            command.current_dir(dir);
        }
    }
}

/// Whether the job's ranks are forked by a rank server: with podsim's interceptions (which
/// the server loads once for all), the job's `prefork` on, and a Python interpreter running
/// a script, `-m MODULE` or `-c CODE`. (An interpreter option before it, such as `-u` or
/// `-X`, would be lost in a fork: such ranks start their own.) A job starts its own server
/// only for more than one rank here; a shared one serves a single rank too.
fn forkable(spec: &TorchSpec, program: &str, args: &[String]) -> bool {
    let python = std::path::Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("python"));
    let runs_a_program = match args.first().map(String::as_str) {
        Some("-m" | "-c") => args.len() >= 2,
        Some(first) => !first.starts_with('-'),
        None => false,
    };
    spec.intercept && spec.prefork && python && runs_a_program
}

/// Whether the ranks of a job run as `spec` are forked by a rank server (interception and
/// `prefork` on, a Python interpreter running a program): what `podsim study` asks before it
/// starts one for its rows.
pub fn forks_ranks(spec: &TorchSpec) -> bool {
    spec.command
        .split_first()
        .is_some_and(|(program, args)| forkable(spec, program, args))
}

/// The rank server many jobs share (`python -m podsim.rank_server`), when
/// `PODSIM_RANK_SERVER` names one: checked to be listening, so that a server that has ended
/// is an error here rather than every rank's stub waiting for it.
fn shared_rank_server() -> Result<Option<String>, ProgramError> {
    use std::os::linux::net::SocketAddrExt;
    let Some(name) = std::env::var_os(RANK_SERVER) else {
        return Ok(None);
    };
    let name = name.to_string_lossy().into_owned();
    let invalid = |why: String| ProgramError::Invalid(format!("{RANK_SERVER}={name:?}: {why}"));
    if name.is_empty() {
        return Ok(None);
    }
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
        .map_err(|e| invalid(format!("not a socket name: {e}")))?;
    std::os::unix::net::UnixStream::connect_addr(&address).map_err(|e| {
        invalid(format!(
            "no rank server listens there ({e}): start one with `python -m podsim.rank_server \
             COMMAND`, or unset {RANK_SERVER}"
        ))
    })?;
    Ok(Some(name))
}

/// Starts the job's rank server (`python/podsim/_prefork.py`) and waits until it has loaded
/// torch and podsim; its socket's name, or `None` when it cannot start (its interpreter
/// lacks podsim, say): the ranks then start as their own interpreters, and each says why it
/// fails if it does. The server is killed with the ranks.
async fn start_rank_server(
    program: &str,
    job: &JobEnv<'_>,
    guard: &mut RankGuard,
) -> Option<String> {
    let socket = format!("podsim-rank-server-{}", random_token());
    let mut command = tokio::process::Command::new(program);
    command
        .arg("-c")
        .arg("import podsim._prefork; podsim._prefork.serve()");
    job.apply(&mut command);
    // The server loads torch, not the job: each forked rank loads podsim's interceptions
    // for itself (`podsim._prefork`), as a shared server's ranks must.
    command
        .env("PODSIM_BOOTED", "1")
        .env(PREFORK_SOCKET, &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    die_with_parent(command.as_std_mut());
    let mut child = command.spawn().ok()?;
    let group = Arc::new(Group::new(child.id().unwrap_or(0)));
    guard.groups.push(group.clone());
    let mut said = BufReader::new(child.stdout.take()?).lines();
    let bound = Duration::from_secs(job.spec.connect_timeout_s);
    let ready = tokio::time::timeout(bound, said.next_line()).await;
    if !matches!(&ready, Ok(Ok(Some(line))) if line == "ready") {
        group.kill();
        tracing::warn!(
            "the rank server did not start ({ready:?}): each rank starts its own interpreter"
        );
        return None;
    }
    if let Some(err) = child.stderr.take() {
        let tail = Tail::Lines(Arc::new(Mutex::new(VecDeque::new())));
        tokio::spawn(prefix_lines(
            err,
            "rank server".into(),
            tail,
            Arc::default(),
        ));
    }
    tokio::spawn(async move {
        while let Ok(Some(_)) = said.next_line().await {}
        let _ = child.wait().await;
        group.end();
    });
    Some(socket)
}

/// A free loopback port for rank 0's `torch.distributed` store (`MASTER_PORT`). Another
/// process could take it before rank 0 binds it; rank 0 then fails at start, saying so.
fn free_port() -> Result<u16, ProgramError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| ProgramError::Invalid(format!("no free port for MASTER_PORT: {e}")))
}

fn describe(status: std::io::Result<std::process::ExitStatus>) -> RankExit {
    use std::os::unix::process::ExitStatusExt;
    match status {
        Ok(s) => RankExit {
            code: s.code(),
            signal: s.signal(),
        },
        Err(_) => RankExit {
            code: None,
            signal: None,
        },
    }
}

/// A token for this job's ranks: random per process (std's hasher keys are random), so a
/// rank of another job on the host cannot join by mistake.
fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    format!("{:016x}", h.finish())
}

/// What [`prefix_lines`] keeps of a stream.
enum Tail {
    /// Its last [`STDERR_TAIL_LINES`] lines.
    Lines(Arc<Mutex<VecDeque<String>>>),
    /// Its last line.
    Last(Arc<Mutex<Option<String>>>),
}

/// Copies a rank's output to the worker's standard output, each line prefixed with its rank
/// (`[rank 3] ...`), keeping its last lines in `tail`; once `quiet`, only keeping them.
async fn prefix_lines(
    stream: impl AsyncRead + Unpin,
    label: String,
    tail: Tail,
    quiet: Arc<AtomicBool>,
) {
    // Bytes, not text: a rank may print anything (a stray non-UTF-8 byte ended the reading,
    // and the rank's next print met a closed pipe and failed the job as the program's
    // error), and a line is cut at [`MOST_LINE_BYTES`] (a progress bar's `\r` updates
    // without a newline grew without bound).
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        let chunk = match reader.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(chunk) => chunk,
        };
        let newline = chunk.iter().position(|&b| b == b'\n');
        let wanted = newline.map_or(chunk.len(), |i| i + 1);
        let taken = wanted.min(MOST_LINE_BYTES - line.len());
        line.extend_from_slice(&chunk[..taken]);
        reader.consume(taken);
        if (newline.is_some() && taken == wanted) || line.len() == MOST_LINE_BYTES {
            show_line(&label, &tail, &quiet, &std::mem::take(&mut line));
        }
    }
    if !line.is_empty() {
        show_line(&label, &tail, &quiet, &line);
    }
}

/// One line of a rank's output: shown with its rank (unless `quiet`) and kept in `tail`.
fn show_line(label: &str, tail: &Tail, quiet: &AtomicBool, bytes: &[u8]) {
    let line = String::from_utf8_lossy(bytes);
    let line = line.trim_end_matches(['\n', '\r']).to_string();
    if !quiet.load(Ordering::Relaxed) {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "[{label}] {line}");
        let _ = out.flush();
    }
    match tail {
        Tail::Lines(tail) => {
            if let Ok(mut t) = tail.lock() {
                if t.len() == STDERR_TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
        Tail::Last(last) => {
            if let Ok(mut l) = last.lock() {
                *l = Some(line);
            }
        }
    }
}

type Pending = Arc<Mutex<HashMap<u32, (oneshot::Sender<RankLink>, Arc<FlightRecorder>)>>>;

/// Takes each rank's connection: a hello with the job's token and a rank still expected, then
/// a reader (requests to the chip; stack reports straight into its flight recorder) and a
/// writer (the chip's replies).
/// Takes the ranks' connections as a link listener takes its peers' (the same admission:
/// only this user's processes, a bounded number waiting for their hello, each for a bounded
/// time, and a failed `accept` neither ends the listener nor spins a core).
async fn accept(listener: tokio::net::UnixListener, token: String, pending: Pending) {
    let admission = Admission::new(Limits {
        hello: HELLO_TIMEOUT,
        ..Limits::default()
    });
    let mut acceptor = Acceptor::new("the ranks' socket");
    loop {
        let stream = acceptor.next(|| listener.accept()).await;
        if let Err(why) = podsim_links::socket::same_user(&stream) {
            admission.refused(&format!("refused a rank's connection: {why}"));
            continue;
        }
        let mut waiting = admission.admit();
        let (token, pending) = (token.clone(), pending.clone());
        tokio::spawn(async move {
            if let Err(e) = admit(stream, &token, &pending, &mut waiting).await {
                waiting
                    .admission()
                    .refused(&format!("a rank's connection was refused: {e}"));
            }
        });
    }
}

async fn admit(
    stream: UnixStream,
    token: &str,
    pending: &Pending,
    waiting: &mut podsim_links::socket::Pending,
) -> Result<(), String> {
    let (mut read, mut write) = stream.into_split();
    let hello = waiting
        .within(async { read_frame(&mut read, 0).await })
        .await?;
    let refuse = |why: String| Reply {
        error: Some(why),
        clock_ns: 0.0,
    };
    let (rank, pid) = match hello {
        Some((
            Frame {
                request:
                    Request::Hello {
                        rank,
                        pid,
                        token: t,
                    },
                ..
            },
            _,
        )) if t == token => (rank, pid),
        Some((
            Frame {
                request: Request::Hello { .. },
                ..
            },
            _,
        )) => {
            let _ = write_frame(&mut write, &refuse("wrong job token".into()), None).await;
            return Err("wrong job token".into());
        }
        _ => return Err("the first frame was not a hello".into()),
    };
    let claimed = pending.lock().ok().and_then(|mut p| p.remove(&rank));
    let Some((link_tx, recorder)) = claimed else {
        let why = format!("rank {rank} is not expected (unknown, or already connected)");
        let _ = write_frame(&mut write, &refuse(why.clone()), None).await;
        return Err(why);
    };
    write_frame(&mut write, &Reply::default(), None)
        .await
        .map_err(|e| e.to_string())?;
    let (req_tx, requests) = mpsc::channel(REQUEST_QUEUE);
    let (replies, reply_rx) = mpsc::channel::<(Reply, Option<Payload>)>(REQUEST_QUEUE);
    let sampler_thread = Arc::new(AtomicU32::new(0));
    let _ = link_tx.send(RankLink {
        requests,
        replies,
        sampler_thread: sampler_thread.clone(),
        pid,
    });
    tokio::spawn(write_replies(write, reply_rx));
    read_requests(read, rank, &req_tx, &recorder, &sampler_thread).await;
    Ok(())
}

/// Writes the chip's replies to its rank, in order, until either side goes away.
async fn write_replies(
    mut write: tokio::net::unix::OwnedWriteHalf,
    mut replies: mpsc::Receiver<(Reply, Option<Payload>)>,
) {
    while let Some((reply, payload)) = replies.recv().await {
        if write_frame(&mut write, &reply, payload.as_ref())
            .await
            .is_err()
        {
            break;
        }
    }
}

/// Reads a connected rank's frames until it closes: its stack samples and sampler thread go
/// to the chip's flight recorder and the watch, every other request to the chip.
async fn read_requests(
    mut read: tokio::net::unix::OwnedReadHalf,
    rank: u32,
    requests: &mpsc::Sender<Result<(Frame, Vec<f32>), String>>,
    recorder: &FlightRecorder,
    sampler_thread: &AtomicU32,
) {
    loop {
        match read_frame(&mut read, MAX_PAYLOAD_BYTES).await {
            Ok(Some((
                Frame {
                    request: Request::Stack { frames },
                    ..
                },
                _,
            ))) => recorder.set_host_stack(frames),
            Ok(Some((
                Frame {
                    request: Request::Sampler { thread },
                    ..
                },
                _,
            ))) => sampler_thread.store(thread, Ordering::Relaxed),
            Ok(Some(frame)) => {
                // The rank is in a podsim call now: the line that made it is where its
                // program is (a stall inside the call must not show an old sample).
                if let Some(site) = &frame.0.site {
                    recorder.set_host_stack(vec![site.clone()]);
                }
                if requests.send(Ok(frame)).await.is_err() {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                let _ = requests.send(Err(format!("rank {rank}: {e}"))).await;
                break;
            }
        }
    }
}

/// How a rank's exception is told: its first line, at most [`RAISED_CHARS`] characters (torch's
/// messages can run to pages), and the program's line that raised it.
pub(super) fn raised(error: &str, site: Option<&str>) -> String {
    let first = error.lines().next().unwrap_or_default();
    let shown: String = first.chars().take(RAISED_CHARS).collect();
    let cut = if shown.len() < error.trim_end().len() {
        " ..."
    } else {
        ""
    };
    format!("{shown}{cut} at {}", site.unwrap_or("an unknown line"))
}

/// Characters of a rank's exception a report shows (its traceback is in the rank's output).
const RAISED_CHARS: usize = 300;

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::time::Instant;

    use podsim_collectives::{Algo, Inbox};

    use super::*;

    /// A rank that starts no chip work: it says what the kernel holds for it (its parent-death
    /// signal, whether it leads its process group), starts a child of its own, writes
    /// `SIG LEADER RANK_PID CHILD_PID` to the file it is given, and sleeps.
    const RANK: &str = "import ctypes, os, subprocess, sys, time
sig = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
child = subprocess.Popen(['sleep', '600'])
with open(sys.argv[1] + '.tmp', 'w') as f:
    f.write(f'{sig.value} {os.getpgid(0) == os.getpid()} {os.getpid()} {child.pid}')
os.rename(sys.argv[1] + '.tmp', sys.argv[1])
time.sleep(600)
";

    /// Set to a directory: the test [`launcher`] starts a rank there and waits to be killed.
    const LAUNCHER_DIR: &str = "PODSIM_TEST_LAUNCHER_DIR";

    fn spec(said: &Path) -> TorchSpec {
        TorchSpec {
            command: vec![
                "python3".into(),
                "-c".into(),
                RANK.into(),
                said.display().to_string(),
            ],
            cwd: None,
            topology: "1".into(),
            algo: Algo::Ring,
            connect_timeout_s: TorchSpec::DEFAULT_CONNECT_TIMEOUT_S,
            meta: false,
            intercept: false,
            prefork: false,
            eager: crate::train::Eager::Fused,
            count: podsim_job::torch::Count::Steady,
            verify_ranks: Vec::new(),
            representative_steps: Vec::new(),
        }
    }

    fn hardware() -> podsim_topology::Hardware {
        podsim_topology::Hardware::preset("v5p").expect("the v5p preset")
    }

    fn recorder() -> Arc<FlightRecorder> {
        Arc::new(FlightRecorder::new(0, 16, Arc::new(Inbox::new())))
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("podsim-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    /// Whether `pid` exists and is not a zombie.
    fn alive(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            podsim_collectives::procfs::stat_fields(&stat).is_some_and(|f| f.first() != Some(&"Z"))
        })
    }

    fn within(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        cond()
    }

    /// What the rank wrote: its parent-death signal, whether it leads its group, its pid and
    /// its child's.
    fn said(file: &Path) -> (i32, bool, u32, u32) {
        assert!(
            within(Duration::from_secs(30), || file.exists()),
            "the rank did not start"
        );
        let text = std::fs::read_to_string(file).expect("what the rank said");
        let f: Vec<&str> = text.split_whitespace().collect();
        let num = |i: usize| f.get(i).and_then(|s| s.parse().ok()).expect(&text);
        (num(0) as i32, f.get(1) == Some(&"True"), num(2), num(3))
    }

    #[test]
    fn a_rank_has_its_parent_death_signal_and_group_before_it_runs_and_dies_with_its_guard() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let dir = temp_dir("rank-guard");
        let file = dir.join("said");
        let started = rt.block_on(start(&spec(&file), 1, &[recorder()], &hardware()));
        let (ranks, guard) = started.expect("start");
        let (sig, leader, pid, child) = said(&file);
        assert_eq!(sig, libc::SIGKILL);
        assert!(leader, "the rank does not lead a process group of its own");
        assert_eq!(pid, ranks[0].pid);
        assert!(alive(pid) && alive(child));
        // The job ends: the rank and the process it started go, at once, without the runtime
        // having to run anything.
        drop(guard);
        assert!(
            within(Duration::from_secs(5), || !alive(pid) && !alive(child)),
            "rank {} child {} outlived the guard",
            alive(pid),
            alive(child)
        );
        drop(ranks);
        drop(rt);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Runs `program` (Python) as a rank, quietly, until it exits: how, and its last lines of
    /// standard error as the worker kept them when it was told of the exit.
    fn run_rank(program: &str) -> (RankExit, VecDeque<String>) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let mut spec = spec(Path::new("unused"));
        spec.command = vec!["python3".into(), "-c".into(), program.into()];
        let (mut ranks, guard) = rt
            .block_on(start(&spec, 1, &[recorder()], &hardware()))
            .expect("start");
        guard.quiet().store(true, Ordering::Relaxed);
        let exit = rt.block_on(exited(&mut ranks[0].exit)).expect("its exit");
        let tail = ranks[0].stderr_tail.lock().expect("tail").clone();
        (exit, tail)
    }

    #[test]
    fn a_ranks_exit_is_told_after_its_last_words_are_read() {
        // The rank exits at once; a process it started outside its group (so not killed
        // with it) still holds its standard error and writes the last line 300 ms later.
        // Its exit is told once that line is read (the stream's end), not before.
        let (exit, tail) = run_rank(
            "import os, sys, time
if os.fork() == 0:
    os.setsid()
    time.sleep(0.3)
    os.write(2, b'last words\\n')
    os._exit(0)
os.write(2, b'first words\\n')
sys.exit(3)",
        );
        assert_eq!(exit.code, Some(3));
        assert_eq!(
            tail.back().map(String::as_str),
            Some("last words"),
            "{tail:?}"
        );
    }

    #[test]
    fn a_ranks_bytes_that_are_no_text_and_a_line_without_end_are_shown_not_fatal() {
        // A stray byte that is not UTF-8 ended the reading; the rank's next write then met a
        // closed pipe (BrokenPipeError: the job failed as the program's error).
        let (exit, tail) = run_rank(
            "import os, sys, time
os.write(2, b'\\xff binary\\n')
time.sleep(0.2)
os.write(2, b'x' * 200000)
os.write(2, b'\\nafter\\n')
sys.exit(0)",
        );
        assert_eq!(exit.code, Some(0), "{exit}");
        let lengths: Vec<usize> = tail.iter().map(String::len).collect();
        assert_eq!(
            tail.front().map(String::as_str),
            Some("\u{fffd} binary"),
            "{lengths:?}"
        );
        // 200,000 bytes: three lines of 65,536 and the rest.
        assert_eq!(lengths[1..], [65536, 65536, 65536, 3392, 5], "{lengths:?}");
        assert_eq!(tail.back().map(String::as_str), Some("after"));
    }

    /// Not a test on its own: with [`LAUNCHER_DIR`] set, the process that starts a rank and
    /// is killed by [`a_rank_and_its_children_die_with_a_killed_worker`].
    #[test]
    fn launcher() {
        let Some(dir) = std::env::var_os(LAUNCHER_DIR) else {
            return;
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let file = Path::new(&dir).join("said");
        let started = rt.block_on(start(&spec(&file), 1, &[recorder()], &hardware()));
        let _ranks = started.expect("start");
        // Bounded, should the test that kills it die first.
        std::thread::sleep(Duration::from_secs(60));
    }

    fn killed_launcher_leaves_nothing(signal: &str) {
        let dir = temp_dir(&format!("rank-launcher-{signal}"));
        let exe = std::env::current_exe().expect("test binary");
        let mut launcher = std::process::Command::new(exe)
            .args(["--exact", "torch::ranks::tests::launcher", "--nocapture"])
            .env(LAUNCHER_DIR, &dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("launcher");
        let (sig, _, pid, child) = said(&dir.join("said"));
        assert_eq!(sig, libc::SIGKILL);
        let status = std::process::Command::new("kill")
            .args([format!("-{signal}"), launcher.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
        let _ = launcher.wait();
        let gone = within(Duration::from_secs(5), || !alive(pid) && !alive(child));
        if !gone {
            // Not left behind by a failing test either.
            for p in [pid, child] {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &p.to_string()])
                    .status();
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            gone,
            "the rank or its child outlived its launcher (SIG{signal})"
        );
    }

    #[test]
    fn a_rank_and_its_children_die_with_a_killed_worker() {
        killed_launcher_leaves_nothing("KILL");
    }

    #[test]
    fn a_rank_and_its_children_die_with_a_terminated_worker() {
        killed_launcher_leaves_nothing("TERM");
    }
}
