//! podsim's coordinator: the `podsim` command-line tool and the drivers behind it.
//! Config validation, the launcher and control service, reports, `podsim bench` and
//! `podsim study`.

pub mod bench;
pub mod config;
pub mod launch;
pub mod report;
pub mod study;
pub mod units;
pub mod watchdog;

use thiserror::Error;

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
