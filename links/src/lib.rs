//! What crosses a process boundary in podsim, and the only crate with `unsafe` code: the links
//! between worker processes, the frames between a PyTorch rank and its chip, and the rank
//! processes a worker holds to itself. Every other crate says `#![forbid(unsafe_code)]`.
//!
//! - [`net`]: one worker's fabric ([`NodeFabric`]): in-memory inboxes for its own chips, one
//!   link per neighbouring worker, flow control; the gRPC link service; the listeners that
//!   hand record links to it;
//! - [`transport`]: how messages between two workers travel, as the job chooses;
//! - `outgoing`: a message queued for another worker, and why a link is refused;
//! - [`records`]: the default link (reaching the fabric through its `LinkHost` trait), raw records over a Unix socket to a worker on the same host
//!   (large payloads through [`shm`], shared-memory regions) or over TCP to another host,
//!   inside TLS under `[launch.tls]`; [`socket`] hides which stream carries them;
//! - `intake`: who reads the record links (the chip executor's own thread while it runs);
//! - [`wire`]: chip messages to and from checked protobuf envelopes;
//! - [`tls`]: mutual TLS for a job across machines (its gRPC connections and record links);
//! - [`rank_wire`]: the frames between a rank process and the chip that serves it;
//! - [`procs`]: processes a worker starts that must not outlive it (a job's ranks).
//!
//! `unsafe` is confined to system calls std does not wrap, each block saying why it holds:
//! `shm` (memfd and mmap), `intake` (poll(2) and an eventfd), `socket` (handing a descriptor
//! to tokio's reactor) and `procs` (a rank's parent-death signal between fork and exec,
//! kill(2) of its process group, sysconf(3)).

mod error;
mod intake;
pub mod net;
mod outgoing;
pub mod procs;
pub mod rank_wire;
pub mod records;
pub mod shm;
pub mod socket;
pub mod tls;
pub mod transport;
pub mod wire;
#[cfg(test)]
mod wire_fuzz;

pub use error::LinkError;
pub use net::{FabricSpec, NodeFabric, PeerLink};
pub use transport::{TRANSPORT_ENV, Transport};
