//! The worker's tests of whole programs on chips (training, the transformer, DTensor
//! placements) and of its links' admission, one module per concern, in one binary.
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

mod dtensor;
mod links_admission;
mod training;
mod transformer;
