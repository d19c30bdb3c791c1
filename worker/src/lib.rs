//! podsim's chip runtime: the programs emulated chips execute (scripted collectives, the
//! benchmark, training), the fabric of a worker process (in-memory links between its own
//! chips, record streams over Unix sockets or TCP, or gRPC streams, to other workers) and the
//! worker's control session with the coordinator.
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
//!   flight-recorder dumps); `programs`: runs a job's program on a set of chips;
//! - `bench`: one timed, checked collective per chip; [`train`]: training (models, kernel
//!   model, strategies, DTensor, remat, HBM ledger, the step loop, the single-chip reference);
//! - `torch`: PyTorch programs, one rank process per chip, served by its chip;
//! - `net`: the worker's fabric (local inboxes, one link per neighbouring worker: `records`,
//!   raw records over a Unix socket to a worker on the same host, whose large payloads go through
//!   `shm`: shared-memory regions; the same records over TCP to another host, inside TLS under
//!   `[launch.tls]` (`socket` hides which); or gRPC when forced); `intake`: who reads the record links (the chip executor's
//!   own thread while it runs); `wire`: chip messages to and from checked protobuf
//!   envelopes (`shm`, `intake`, `socket` and `procs` are the crate's only modules with
//!   `unsafe`, each for system calls std does not wrap);
//! - `session`: a worker from joining the coordinator to exit; `watch`: the per-worker
//!   summary each heartbeat carries; `faults`: fault injection;
//! - [`tls`]: mutual TLS for a job across machines (its gRPC connections, and its record
//!   links over TCP);
//! - `error`: [`WorkerError`].

mod bench;
mod error;
mod faults;
mod intake;
mod job;
mod net;
mod procs;
mod programs;
pub mod protocol;
mod records;
mod session;
mod shm;
mod socket;
pub mod tls;
mod torch;
pub mod train;
mod watch;
mod wire;
#[cfg(test)]
mod wire_fuzz;

pub use bench::{buffer_bytes, elements_for_buffer};
pub use error::WorkerError;
pub use programs::{COMPUTE_TRACK, STEPS_TRACK, enable_traces, run_program};
pub use session::{WorkerOptions, run as run_worker};
pub use watch::Summariser;

/// The links between workers: a worker's fabric, the gRPC link service and the record links
/// (Unix-socket listener, TCP link port), as the tests that send them garbage reach them.
pub mod transport {
    pub use crate::net::{
        NodeFabric, TOKEN_HEADER, WORKER_HEADER, check_token, link_service, server_builder,
    };
    /// Record links: the Unix-socket listener between workers on one host, and the router of
    /// the TCP link port.
    pub mod records {
        pub use crate::records::{bind, route_tcp, serve};
    }
}
