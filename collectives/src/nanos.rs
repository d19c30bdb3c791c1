//! The unit of virtual time, a leaf every module that keeps time shares.

/// Virtual time in nanoseconds of modelled hardware.
pub type Nanos = f64;
