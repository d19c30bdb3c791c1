//! podsim's chip runtime: the programs emulated chips execute (scripted collectives, the
//! benchmark, training), the fabric of a worker process (in-memory links between its own
//! chips, Unix sockets or gRPC streams to other workers) and the worker's control session with the coordinator.
//!
//! Modules:
//! - [`job`]: the job a worker receives and what it reports (results, heartbeats, failures,
//!   flight-recorder dumps); [`programs`]: runs a job's program on a set of chips;
//! - [`bench`](mod@bench): one timed, checked collective per chip; [`train`]: training (models, kernel
//!   model, strategies, DTensor, remat, HBM ledger, the step loop, the single-chip reference);
//! - [`torch`](mod@torch): PyTorch programs, one rank process per chip, served by its chip;
//! - [`net`]: the worker's fabric (local inboxes, one link per neighbouring worker: gRPC over
//!   TCP, or [`uds`]: a Unix socket with raw records to a worker on the same host);
//!   [`wire`]: chip messages to and from checked protobuf envelopes;
//! - [`session`]: a worker from joining the coordinator to exit; [`watch`]: the per-worker
//!   summary each heartbeat carries; [`faults`]: fault injection;
//! - `error`: [`WorkerError`].

pub mod bench;
mod error;
pub mod faults;
pub mod job;
pub mod net;
pub mod programs;
pub mod session;
pub mod torch;
pub mod train;
pub mod uds;
pub mod watch;
pub mod wire;

pub use error::WorkerError;
