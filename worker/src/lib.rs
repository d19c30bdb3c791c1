//! A podsim worker: one process hosting a share of the pod's chips, from joining the
//! coordinator to its exit. What its chips run is `podsim_programs`; the links between
//! workers are `podsim_links`; this crate wires both to a job's control session.
//!
//! Modules (crate-private unless named above):
//! - `session`: a worker from joining the coordinator to exit ([`run_worker`],
//!   [`WorkerOptions`]);
//! - `watch`: the per-worker summary each heartbeat carries ([`Summariser`]);
//! - `faults`: fault injection, the hooks a job's `[[faults]]` set on its chips;
//! - [`tls`]: mutual TLS for a job across machines (re-exported from `podsim_links`).
#![forbid(unsafe_code)]

mod faults;
mod session;
pub use podsim_links::tls;
mod watch;

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
        pub use podsim_links::net::{route_tcp, serve_records as serve};
        pub use podsim_links::records::bind;
    }
}
