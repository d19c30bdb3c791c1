//! What podsim's chips run: a job's program on a set of chips, whatever process hosts them (a
//! worker's share of the pod, or the whole pod inside the coordinator's `compare` and `bench`).
//! No control session and no heartbeats here: that is the worker's (`podsim_worker`).
//!
//! | module | what |
//! |---|---|
//! | [`job`] | the job a worker receives and what it reports (results, failures, the links it asks of the fabric) |
//! | `run` | a job's program on a set of chips: [`run_program`], progress units, traces |
//! | `bench` | one timed, checked collective per chip |
//! | [`train`] | training: models, the kernel model, strategies, DTensor, remat, the HBM ledger, the step loop, the single-chip reference |
//! | `torch` | PyTorch programs: one rank process per chip, served by its chip |
//! | `error` | [`ProgramError`]: why a chip's program failed |
#![forbid(unsafe_code)]

mod bench;
mod error;
pub mod job;
mod run;
mod torch;
pub mod train;

pub use error::ProgramError;
pub use run::{
    COMPUTE_TRACK, ProgramOutput, STEPS_TRACK, enable_traces, run_program, run_program_waiting,
    total_units,
};
pub use torch::{RankReport, StepCounting, ranks::forks_ranks, verify::RUN_EVERY_RANK};
