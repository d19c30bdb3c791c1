//! The worker crate's error type.

use podsim_collectives::CollectiveError;
use thiserror::Error;

/// Why a chip program failed.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ProgramError {
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    #[error("invalid program: {0}")]
    Invalid(String),
    #[error("link: {0}")]
    Link(String),
    #[error("control session: {0}")]
    Session(String),
    /// A chip's HBM budget is exceeded.
    #[error(
        "out of memory: chip {chip} needs {need} more bytes for {what} with {in_use} of {capacity} bytes of HBM in use (peak so far {peak})"
    )]
    OutOfMemory {
        chip: u32,
        what: String,
        need: u64,
        in_use: u64,
        peak: u64,
        capacity: u64,
    },
    /// Debug mode: replicas that must hold the same values do not.
    #[error("replicas diverged after step {step}: {detail}")]
    Diverged { step: u64, detail: String },
    /// A collective of PyTorch ranks that failed (a desync), with the line of each rank's
    /// program that made its call.
    #[error("{error} (chip {chip} called at {mine}; chip {peer} at {theirs})")]
    AtCallSites {
        error: Box<CollectiveError>,
        chip: u32,
        mine: String,
        peer: u32,
        theirs: String,
        /// `chip` is a rank verified against its representative `peer` (meta mode).
        verified: bool,
    },
    /// A PyTorch rank's process ended before its job did (or badly).
    #[error("rank {chip} (pid {pid}) {how}")]
    RankExited {
        chip: u32,
        pid: u32,
        how: String,
        /// Its last lines of standard error.
        stderr_tail: Vec<String>,
    },
    /// Meta mode: a representative rank made a group its class does not stand for (a
    /// segment of a torus axis); the job runs again with a representative per class of
    /// `steps` (see `TorchSpec::representative_steps`).
    #[error("{why}: the job runs again with one representative rank per class")]
    Regroup { steps: Vec<u32>, why: String },
    /// A PyTorch job's failure, with what its failing rank had done until then (its steps):
    /// the job's report keeps its `torch` section.
    #[error("{error}")]
    TorchFailed {
        error: Box<ProgramError>,
        ranks: Vec<crate::torch::report::RankReport>,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<podsim_links::LinkError> for ProgramError {
    fn from(e: podsim_links::LinkError) -> ProgramError {
        match e {
            podsim_links::LinkError::Invalid(why) => ProgramError::Invalid(why),
            podsim_links::LinkError::Link(why) => ProgramError::Link(why),
        }
    }
}

impl ProgramError {
    /// Whether this is a [`ProgramError::Regroup`] (as it is, or inside the steps it carries).
    pub fn is_regroup(&self) -> bool {
        match self {
            ProgramError::Regroup { .. } => true,
            ProgramError::TorchFailed { error, .. } => error.is_regroup(),
            _ => false,
        }
    }
}
