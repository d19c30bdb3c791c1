//! The worker's tests of its links' admission (what a listener lets in), in one binary.
#![allow(clippy::unwrap_used)]

mod links_admission;
