//! One rank server for all the rows of a study of a PyTorch program: each row's ranks fork
//! from it instead of each row starting a server that imports torch again (5-7 s of CPU a
//! row). It is `python -m podsim.rank_server` (python/podsim/rank_server.py) serving until
//! its standard input ends, which is when the study drops it, or when the study dies.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::config;
use podsim_programs::job::Program;

/// The variable that names a shared rank server to the rows' workers.
const RANK_SERVER: &str = "PODSIM_RANK_SERVER";
/// Keys whose sweep could give rows another interpreter or no forked ranks: a study that
/// sweeps one leaves each row its own server. (A row's mode, eager mode or pod does not
/// matter: each forked rank loads podsim for its own job.)
const PER_ROW_KEYS: [&str; 4] = ["job.kind", "job.program", "job.intercept", "job.prefork"];
/// How long the server may take to import torch before the study goes on without it.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// A running shared rank server, ended when dropped.
pub struct SharedRankServer {
    child: Child,
    /// Its socket's name, for `PODSIM_RANK_SERVER`.
    pub name: String,
}

impl SharedRankServer {
    /// A server for the study's rows, when they are torch jobs that fork their ranks from
    /// one interpreter and no server is named already; `None` otherwise, or when it cannot
    /// start (the rows then start their own, and say why they fail if they do).
    pub fn for_rows(base: &Path, swept: &[String]) -> Option<SharedRankServer> {
        if std::env::var_os(RANK_SERVER).is_some()
            || swept.iter().any(|k| PER_ROW_KEYS.contains(&k.as_str()))
        {
            return None;
        }
        let cfg = config::load(base, &[]).ok()?;
        let Program::Torch(spec) = &cfg.program else {
            return None;
        };
        if !podsim_programs::forks_ranks(spec) {
            return None;
        }
        start(spec.command.first()?)
    }
}

/// Starts `python -m podsim.rank_server` and waits for its name.
fn start(python: &str) -> Option<SharedRankServer> {
    let mut child = Command::new(python)
        .args(["-m", "podsim.rank_server"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    let stdout = child.stdout.take()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let name = rx
        .recv_timeout(READY_WITHIN)
        .ok()
        .and_then(|line| {
            line.trim()
                .strip_prefix("PODSIM_RANK_SERVER=")
                .map(str::to_string)
        })
        .filter(|name| !name.is_empty());
    let server = SharedRankServer {
        child,
        name: name.unwrap_or_default(),
    };
    // Dropped without a name, it is killed.
    (!server.name.is_empty()).then_some(server)
}

impl Drop for SharedRankServer {
    fn drop(&mut self) {
        // Its input's end ends it; killed too, should it be stuck, and reaped.
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
