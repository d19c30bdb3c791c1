//! podsim's chip runtime: the programs emulated chips execute on a fabric (for now the
//! collective benchmark behind `podsim bench`).

pub mod bench;
mod error;

pub use error::WorkerError;
