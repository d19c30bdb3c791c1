//! podsim's chip runtime: the programs emulated chips execute (scripted collectives and the
//! benchmark), the fabric of a worker process (in-memory links between its own chips, gRPC
//! streams to other workers) and the worker's control session with the coordinator.

pub mod bench;
mod error;
pub mod faults;
pub mod job;
pub mod net;
pub mod programs;
pub mod session;
pub mod train;
pub mod watch;
pub mod wire;

pub use error::WorkerError;
