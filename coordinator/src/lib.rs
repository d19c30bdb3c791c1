//! podsim's coordinator: the `podsim` command-line tool and the drivers behind it.
//! Config validation, the launcher and control service, reports, and `podsim bench`.

pub mod bench;
pub mod config;
pub mod launch;
pub mod report;
pub mod units;

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
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Job(_) => 1,
        }
    }
}
