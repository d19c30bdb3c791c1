//! podsim's coordinator: the `podsim` command-line tool and the drivers behind it.
//! Config validation, the launcher and control service, reports, `podsim bench` and
//! `podsim study`.

pub mod bench;
pub mod compare;
pub mod config;
pub mod html;
pub mod launch;
pub mod report;
pub mod study;
pub mod trace;
pub mod units;
pub mod watchdog;

use thiserror::Error;

/// Resolves when the user interrupts the command: Ctrl-C (SIGINT) or, on Unix, SIGTERM (what
/// `kill`, a job scheduler or a CI timeout sends). `podsim launch` and `podsim study` then stop
/// what they started before they exit.
pub async fn interrupted() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// How a command failed; maps onto the documented exit codes.
#[derive(Debug, Error)]
pub enum CliError {
    /// Bad arguments or configuration (exit 2).
    #[error("{0}")]
    Usage(String),
    /// The job itself failed (exit 1).
    #[error("{0}")]
    Job(String),
    /// A hang (exit 3) or a desync (exit 4) was detected.
    #[error("{message}")]
    Hang { code: u8, message: String },
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Job(_) => 1,
            CliError::Hang { code, .. } => *code,
        }
    }
}
