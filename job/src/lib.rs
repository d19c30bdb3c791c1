//! The job description every podsim process shares, at the bottom of the crates above the
//! collectives: plain data that travels as JSON between the coordinator and its workers, with
//! no behaviour of its own.
//!
//! | module | what |
//! |---|---|
//! | [`faults`] | a job's `[[faults]]` as validated, and the record of one that fired |
//! | [`heartbeat`] | what a worker's heartbeat tells the watchdog about its chips |
//! | [`program`] | what every kind of program shares (how collectives are issued) |
//! | [`torch`] | a PyTorch program's job: its command, and how its work is counted |
//!
//! The rest of the job (the job spec itself, training programs, reports) is still the
//! worker's (`podsim_worker::protocol` re-exports all of it in one place).

#![forbid(unsafe_code)]

pub mod faults;
pub mod heartbeat;
pub mod program;
pub mod torch;

pub use faults::{DesyncMode, FaultEvent, FaultKind, FaultSpec};
pub use heartbeat::{HeartbeatStatus, Ranges, Root, STRAGGLER_WAITS_CHIPS, Summary, Wait};
pub use program::Eager;
pub use torch::{Count, TorchSpec};
