//! The collectives' tests against naive references, virtual time, desyncs, point to point
//! and scale, one module per concern, in one binary (`common` is shared, and no longer a
//! test binary of its own).
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

mod correctness;
mod desync;
mod harness;
mod p2p;
mod scale;
mod virtual_time;
