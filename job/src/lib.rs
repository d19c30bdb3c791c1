//! The job description every podsim process shares, at the bottom of the crates above the
//! collectives: plain data that travels as JSON between the coordinator and its workers, with
//! no behaviour of its own.
//!
//! | module | what |
//! |---|---|
//! | [`bench`](mod@bench) | a benchmark case, and nccl-tests' convention for a collective's buffer size |
//! | [`faults`] | a job's `[[faults]]` as validated, and the record of one that fired |
//! | [`heartbeat`] | what a worker's heartbeat tells the watchdog about its chips, and the watchdog's defaults |
//! | [`program`] | what every kind of program shares (how collectives are issued) |
//! | [`reports`] | what workers report besides heartbeats (timed calls, recorder dumps, rank exits), a script's collectives, the control message limit |
//! | [`torch`] | a PyTorch program's job: its command, and how its work is counted |
//!
//! The rest of the job (the job spec itself, training programs, the reports that carry
//! link or training types) lives with the programs (`podsim_programs::job`).

#![forbid(unsafe_code)]

pub mod bench;
pub mod faults;
pub mod heartbeat;
pub mod program;
pub mod reports;
pub mod torch;

pub use bench::{BenchCase, buffer_bytes, data_mode_buffers, elements_for_buffer};
pub use faults::{DesyncMode, FaultEvent, FaultKind, FaultSpec};
pub use heartbeat::{
    DEFAULT_BUSY_MS, HeartbeatStatus, Ranges, Root, STRAGGLER_WAITS_CHIPS, Summary, Wait,
    watchdog_defaults,
};
pub use program::Eager;
pub use reports::{
    CallRecord, ChipStepReport, CollectiveStep, MAX_CONTROL_MESSAGE_BYTES, RankExitReport,
    RecorderDump, TraceRequest,
};
pub use torch::{Count, TorchSpec};
