//! The coordinator's tests end to end, one module per concern, in one binary: one link
//! instead of eleven (each links the whole coordinator). `faults` and `stragglers` stay
//! binaries of their own, so that they run alone: they measure wall time.
#![allow(clippy::unwrap_used)]

#[path = "../support/mod.rs"]
mod support;

mod bench_cli;
mod compare;
mod config_errors;
mod fuzz_config;
mod garbage;
mod launch;
mod orphans;
mod study;
mod torch_run;
mod trace;
mod training;
