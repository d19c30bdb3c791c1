//! podsim's chip runtime: the programs emulated chips execute (scripted collectives, the
//! benchmark, training, PyTorch ranks) and the worker's control session with the coordinator.
//! The links between workers are `podsim_links`; this crate wires them to a job.
//!
//! The crate's API is deliberately small: [`protocol`] (the types coordinator and workers
//! exchange), [`train`] (training as a library: specs, models, strategies, checkpoints),
//! [`transport`] (the links between workers, for tests that attack them), and at the root the
//! entry points: [`run_worker`] and [`WorkerOptions`], [`run_program`] and [`enable_traces`]
//! (a job's program on chips in this process), the trace track names, the benchmark's buffer
//! arithmetic, the heartbeat [`Summariser`] and [`WorkerError`].
//!
//! Modules (crate-private unless named above):
//! - `job`: the job a worker receives and what it reports (results, heartbeats, failures,
//!   flight-recorder dumps) and the links it asks of the fabric; `programs`: runs a job's
//!   program on a set of chips;
//! - `bench`: one timed, checked collective per chip; [`train`]: training (models, kernel
//!   model, strategies, DTensor, remat, HBM ledger, the step loop, the single-chip reference);
//! - `torch`: PyTorch programs, one rank process per chip, served by its chip;
//! - `session`: a worker from joining the coordinator to exit; `watch`: the per-worker
//!   summary each heartbeat carries; `faults`: fault injection;
//! - [`tls`]: mutual TLS for a job across machines (re-exported from `podsim_links`);
//! - `error`: [`WorkerError`].
#![forbid(unsafe_code)]

mod bench;
mod error;
mod faults;
mod job;
mod programs;
pub mod protocol;
mod session;
pub use podsim_links::tls;
mod torch;
pub mod train;
mod watch;

pub use error::WorkerError;
pub use job::{buffer_bytes, elements_for_buffer};
pub use programs::{COMPUTE_TRACK, STEPS_TRACK, enable_traces, run_program};
pub use session::{WorkerOptions, run as run_worker};
pub use watch::Summariser;

/// The links between workers: a worker's fabric, the gRPC link service and the record links
/// (Unix-socket listener, TCP link port), as the tests that send them garbage reach them.
pub mod transport {
    pub use podsim_links::net::{
        NodeFabric, TOKEN_HEADER, WORKER_HEADER, check_token, link_service, server_builder,
    };
    /// Record links: the Unix-socket listener between workers on one host, and the router of
    /// the TCP link port.
    pub mod records {
        pub use podsim_links::records::{bind, route_tcp, serve};
    }
}
