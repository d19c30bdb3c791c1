//! The types the coordinator and its workers exchange, in one place: the job a worker is
//! handed, what it reports (results, heartbeats and their summaries, failures, flight-recorder
//! dumps, fired faults), and the limits of the control plane. They travel as JSON inside the
//! control protocol's messages (`proto/podsim/v1/control.proto`); training specs and reports
//! are in [`crate::train`]. The faults, heartbeat summaries and the PyTorch job's spec are
//! the `podsim-job` crate's (the bottom crate the job's description moves into).

pub use crate::faults::{DesyncMode, FaultEvent, FaultKind, FaultSpec};
pub use crate::job::{
    BenchCase, ChipStepReport, CollectiveStep, FailureReport, HeartbeatStatus, JobSpec,
    MAX_CONTROL_MESSAGE_BYTES, PeerLink, Program, RankExitReport, RecorderDump, TraceRequest,
    Transport, WorkerReport, watchdog_defaults,
};
pub use crate::torch::{Count, RankReport, StepCounting, TorchSpec};
pub use crate::watch::{Ranges, Root, Summary, Wait};
