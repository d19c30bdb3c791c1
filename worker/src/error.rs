//! The worker crate's error type.

use podsim_collectives::CollectiveError;
use thiserror::Error;

/// Why a chip program failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum WorkerError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("invalid program: {0}")]
    Invalid(String),
    #[error("link: {0}")]
    Link(String),
    #[error("control session: {0}")]
    Session(String),
}
