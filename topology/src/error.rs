//! The one error type of the topology crate: every impossible input gets a variant that says
//! what was wrong, so callers (config validation, the CLI) can report it precisely.

use thiserror::Error;

/// Why a topology, hardware description, placement or mesh was rejected.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum TopologyError {
    #[error("cannot parse torus shape {text:?}: {reason}")]
    BadShape { text: String, reason: String },
    #[error("a torus has 1 to 3 axes, got {0}")]
    AxisCount(usize),
    #[error("axis {axis} has size 0; every axis needs at least one chip")]
    ZeroAxis { axis: usize },
    #[error("{chips} chips is more than podsim supports ({max})")]
    TooManyChips { chips: u64, max: u64 },
    #[error("slices must be at least 1, got {0}")]
    ZeroSlices(u32),
    #[error("wraparound is given for {given} axes but the torus has {axes}")]
    WrapLength { given: usize, axes: usize },
    #[error("unknown hardware preset {0:?} (known: {known})", known = crate::hardware::PRESETS.join(", "))]
    UnknownHardware(String),
    #[error("hardware field {field} must be a positive finite number, got {value}")]
    BadHardwareValue { field: &'static str, value: f64 },
    #[error("cannot place {chips} chips on {workers} workers: {reason}")]
    Placement {
        chips: u64,
        workers: u64,
        reason: String,
    },
    #[error("device mesh {mesh}: {reason}")]
    Mesh { mesh: String, reason: String },
    #[error("chip {chip} does not exist in a pod of {chips} chips")]
    NoSuchChip { chip: u64, chips: u64 },
}
