//! The rank processes of a torch job: one per chip, started with torchrun's environment, their
//! output prefixed with their rank, their exits watched, and every one killed when the job
//! ends, however it ends (the guard's drop; a rank whose worker dies gets `SIGKILL` from the
//! kernel, which `podsim.torch` asks for with `PR_SET_PDEATHSIG`).

use std::collections::{HashMap, VecDeque};
use std::io::Write;
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use podsim_collectives::{FlightRecorder, Payload};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot, watch};

use super::TorchSpec;
use super::wire::{Frame, MAX_PAYLOAD_BYTES, Reply, Request, read_frame, write_frame};
use crate::error::WorkerError;

/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
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
            (_, Some(s)) => write!(f, "was killed by signal {s}"),
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
}

/// One rank process, for the chip that serves it.
#[derive(Debug)]
pub struct Rank {
    pub rank: u32,
    pub pid: u32,
    pub link: oneshot::Receiver<RankLink>,
    pub exit: watch::Receiver<Option<RankExit>>,
    pub stderr_tail: Arc<Mutex<VecDeque<String>>>,
}

/// Waits until a rank's process has exited (`exit` is its [`Rank::exit`]); how it ended
/// (`None`: no longer known).
pub async fn exited(exit: &mut watch::Receiver<Option<RankExit>>) -> Option<RankExit> {
    exit.wait_for(Option::is_some)
        .await
        .ok()
        .and_then(|e| e.clone())
}

/// Kills every rank still running when dropped.
#[derive(Debug)]
pub struct RankGuard {
    kill: watch::Sender<bool>,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        let _ = self.kill.send(true);
    }
}

/// Starts one process per chip of `recorders` (rank = chip id) and the socket they dial.
pub fn start(
    spec: &TorchSpec,
    world: u32,
    recorders: &[Arc<FlightRecorder>],
) -> Result<(Vec<Rank>, RankGuard), WorkerError> {
    let (listener, socket) = crate::records::bind_abstract("podsim-ranks")
        .ok_or_else(|| WorkerError::Invalid("cannot open a Unix socket for the ranks".into()))?;
    let token = random_token();
    let master_port = free_port()?;
    let (kill, kill_rx) = watch::channel(false);
    let mut pending = HashMap::new();
    let mut ranks = Vec::new();
    let Some((program, args)) = spec.command.split_first() else {
        return Err(WorkerError::Invalid("a torch job needs a command".into()));
    };
    for (local, recorder) in recorders.iter().enumerate() {
        let rank = recorder.chip();
        let mut command = tokio::process::Command::new(program);
        command
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", recorders.len().to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", master_port.to_string())
            .env("PODSIM_SOCKET", &socket)
            .env("PODSIM_TOKEN", &token)
            .env("PODSIM_TOPOLOGY", &spec.topology)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        // As torchrun does: one intra-op thread per rank unless the user says otherwise
        // (several ranks share this host's cores; more threads only spin against each other).
        if std::env::var_os("OMP_NUM_THREADS").is_none() && recorders.len() > 1 {
            command.env("OMP_NUM_THREADS", "1");
        }
        if let Some(dir) = &spec.cwd {
            command.current_dir(dir);
        }
        let mut child = command.spawn().map_err(|e| {
            WorkerError::Invalid(format!("cannot start rank {rank} ({program}): {e}"))
        })?;
        let pid = child.id().unwrap_or(0);
        let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(out) = child.stdout.take() {
            tokio::spawn(prefix_lines(out, rank, None));
        }
        if let Some(err) = child.stderr.take() {
            tokio::spawn(prefix_lines(err, rank, Some(stderr_tail.clone())));
        }
        let (exit_tx, exit) = watch::channel(None);
        let mut kill_rx = kill_rx.clone();
        tokio::spawn(async move {
            let status = tokio::select! {
                s = child.wait() => s,
                _ = async { let _ = kill_rx.wait_for(|k| *k).await; } => {
                    let _ = child.kill().await;
                    child.wait().await
                }
            };
            let _ = exit_tx.send(Some(describe(status)));
        });
        let (link_tx, link) = oneshot::channel();
        pending.insert(rank, (link_tx, recorder.clone()));
        ranks.push(Rank {
            rank,
            pid,
            link,
            exit,
            stderr_tail,
        });
    }
    tokio::spawn(accept(listener, token, Arc::new(Mutex::new(pending))));
    Ok((ranks, RankGuard { kill }))
}

/// A free loopback port for rank 0's `torch.distributed` store (`MASTER_PORT`). Another
/// process could take it before rank 0 binds it; rank 0 then fails at start, saying so.
fn free_port() -> Result<u16, WorkerError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| WorkerError::Invalid(format!("no free port for MASTER_PORT: {e}")))
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

/// Copies a rank's output to the worker's standard output, each line prefixed with its rank
/// (`[rank 3] ...`), keeping the last lines of its standard error.
async fn prefix_lines(
    stream: impl AsyncRead + Unpin,
    rank: u32,
    tail: Option<Arc<Mutex<VecDeque<String>>>>,
) {
    let mut lines = BufReader::new(stream).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        {
            let mut out = std::io::stdout().lock();
            let _ = writeln!(out, "[rank {rank}] {line}");
            let _ = out.flush();
        }
        if let Some(tail) = &tail
            && let Ok(mut t) = tail.lock()
        {
            if t.len() == STDERR_TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    }
}

type Pending = Arc<Mutex<HashMap<u32, (oneshot::Sender<RankLink>, Arc<FlightRecorder>)>>>;

/// Takes each rank's connection: a hello with the job's token and a rank still expected, then
/// a reader (requests to the chip; stack reports straight into its flight recorder) and a
/// writer (the chip's replies).
async fn accept(listener: tokio::net::UnixListener, token: String, pending: Pending) {
    while let Ok((stream, _)) = listener.accept().await {
        let (token, pending) = (token.clone(), pending.clone());
        tokio::spawn(async move {
            if let Err(e) = admit(stream, &token, &pending).await {
                tracing::warn!("a rank's connection was refused: {e}");
            }
        });
    }
}

async fn admit(stream: UnixStream, token: &str, pending: &Pending) -> Result<(), String> {
    let (mut read, mut write) = stream.into_split();
    let hello = tokio::time::timeout(HELLO_TIMEOUT, read_frame(&mut read, 0))
        .await
        .map_err(|_| "no hello in time".to_string())??;
    let refuse = |why: String| Reply {
        error: Some(why),
        clock_ns: 0.0,
    };
    let rank = match hello {
        Some((
            Frame {
                request: Request::Hello { rank, token: t, .. },
                ..
            },
            _,
        )) if t == token => rank,
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
    let (replies, mut reply_rx) = mpsc::channel::<(Reply, Option<Payload>)>(REQUEST_QUEUE);
    let sampler_thread = Arc::new(AtomicU32::new(0));
    let _ = link_tx.send(RankLink {
        requests,
        replies,
        sampler_thread: sampler_thread.clone(),
    });
    tokio::spawn(async move {
        while let Some((reply, payload)) = reply_rx.recv().await {
            if write_frame(&mut write, &reply, payload.as_ref())
                .await
                .is_err()
            {
                break;
            }
        }
    });
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
                if req_tx.send(Ok(frame)).await.is_err() {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                let _ = req_tx.send(Err(format!("rank {rank}: {e}"))).await;
                break;
            }
        }
    }
    Ok(())
}
