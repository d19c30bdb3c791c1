//! The links' error type; the worker's own error takes it in whole (`From`).

use thiserror::Error;

/// Why a link, or the fabric a job's links make, failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LinkError {
    /// The job cannot be laid on links as given (a worker outside the job, a bad address).
    #[error("invalid program: {0}")]
    Invalid(String),
    /// A link failed or could not be made.
    #[error("link: {0}")]
    Link(String),
}
