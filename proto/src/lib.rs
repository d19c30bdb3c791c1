//! podsim's wire protocol, generated from `proto/podsim/v1/*.proto`.
//!
//! The [`v1::Envelope`] is the one message format every chip-to-chip message uses when it
//! leaves its worker; [`v1::Frame`] batches many of them on one worker-to-worker stream.
#![forbid(unsafe_code)]

#[allow(missing_docs, missing_debug_implementations, clippy::all)]
pub mod v1 {
    tonic::include_proto!("podsim.v1");
}
