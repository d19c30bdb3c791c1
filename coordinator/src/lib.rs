//! podsim's coordinator: the `podsim` command-line tool (`src/main.rs`) and the drivers
//! behind it.
//!
//! Modules:
//! - [`config`]: job configs (TOML), validated with every problem reported at once, file:line;
//!   [`toml_lines`]: where a key or table sits in a TOML file (configs and studies);
//! - [`launch`]: the control service, spawning or awaiting workers, running a job, no orphans;
//!   [`supervisor`]: the launcher's decisions while a job runs (pure, like the watchdog);
//!   [`recovery`]: relaunching a training job from its last checkpoint after a failure;
//!   [`outdir`]: one job per output folder (a lock held for the job's life);
//! - [`watchdog`]: the join of the workers' heartbeat summaries into a hang diagnosis (pure);
//! - [`report`]: `report.json` and the terminal summary; [`html`]: `report.html` and
//!   `study.html`; [`trace`]: `--trace` files (Chrome JSON trace format);
//! - [`bench`](mod@bench): `podsim bench`; [`study`]: `podsim study` (sweeps, results.csv, plots);
//!   [`compare`]: `podsim compare` (predictions against published step times);
//! - [`run`]: `podsim run` (a PyTorch program, one rank per chip, as a `kind = "torch"` job);
//! - [`status`]: how a job ended ([`JobStatus`]: its name and exit code, one place);
//! - [`units`]: sizes and their parsing.
#![forbid(unsafe_code)]

pub mod bench;
pub mod compare;
pub mod compare_collectives;
mod compare_rows;
pub mod config;
pub mod csv;
pub mod html;
pub mod launch;
pub mod outdir;
pub mod pages;
mod process_faults;
pub mod recovery;
pub mod report;
pub mod run;
pub mod status;
pub mod study;
pub mod supervisor;
pub mod toml_lines;
pub mod torchrun;
pub mod trace;
pub mod units;
pub mod watchdog;

pub use status::JobStatus;
use thiserror::Error;

/// The user's interruptions, watched from the first [`interrupted`] on.
static INTERRUPTS: std::sync::OnceLock<tokio::sync::watch::Receiver<bool>> =
    std::sync::OnceLock::new();

/// Resolves when the user interrupts the command: Ctrl-C (SIGINT) or, on Unix, SIGTERM (what
/// `kill`, a job scheduler or a CI timeout sends) or SIGHUP (the terminal or ssh session
/// closed). `podsim launch` and `podsim study` then stop what they started before they exit.
///
/// The signals are watched from the first call for the rest of the process, so a signal that
/// arrives while nothing waits (between a job's attempts, while it verifies checkpoints to
/// restart from) is kept for the next wait and [`was_interrupted`]. Watched afresh by each
/// wait, it was lost: once watched, a signal no longer ends the process by itself.
pub async fn interrupted() {
    let mut seen = INTERRUPTS.get_or_init(|| latch(signal_arrives())).clone();
    if seen.wait_for(|&yes| yes).await.is_err() {
        // The runtime that watched has ended (a command's later runtime): watch here.
        signal_arrives().await;
    }
}

/// Whether the user interrupted the command (see [`interrupted`]).
pub fn was_interrupted() -> bool {
    INTERRUPTS.get().is_some_and(|seen| *seen.borrow())
}

/// A flag set, from a task of its own, once `event` happens, whoever is waiting then.
fn latch(
    event: impl std::future::Future<Output = ()> + Send + 'static,
) -> tokio::sync::watch::Receiver<bool> {
    let (tx, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        event.await;
        let _ = tx.send(true);
    });
    rx
}

/// The next interrupting signal.
async fn signal_arrives() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut hangup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::hangup()),
        ) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
                _ = hangup.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// How a command failed; its [`JobStatus`] gives the exit code.
#[derive(Debug, Error)]
pub enum CliError {
    /// Bad arguments or configuration (`bad_config`).
    #[error("{0}")]
    Usage(String),
    /// The job itself failed (`error`).
    #[error("{0}")]
    Job(String),
    /// The watchdog's verdict (`hang`, `desync`, or `error` for a corrupting link).
    #[error("{message}")]
    Hang { status: JobStatus, message: String },
}

impl CliError {
    pub fn status(&self) -> JobStatus {
        match self {
            CliError::Usage(_) => JobStatus::BadConfig,
            CliError::Job(_) => JobStatus::Error,
            CliError::Hang { status, .. } => *status,
        }
    }

    pub fn exit_code(&self) -> u8 {
        self.status().exit_code()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn a_latched_event_is_kept_for_a_wait_that_comes_after_it() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut seen = super::latch(tokio::time::sleep(Duration::from_millis(10)));
            assert!(!*seen.borrow());
            // Nobody waits while the event happens (a job between two attempts)...
            std::thread::sleep(Duration::from_millis(100));
            // ...and the next wait sees it at once.
            let waited = tokio::time::timeout(Duration::from_secs(5), seen.wait_for(|&y| y));
            assert!(matches!(waited.await, Ok(Ok(_))));
        });
    }
}
