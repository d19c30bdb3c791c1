//! Whole programs on chips (training, the transformer, DTensor placements), one module per
//! concern, in one binary.
#![allow(clippy::unwrap_used)]

#[path = "../common/mod.rs"]
mod common;

mod dtensor;
mod training;
mod transformer;
