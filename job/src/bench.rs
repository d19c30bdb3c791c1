//! Benchmark cases (`podsim bench`, a script's collectives) and nccl-tests' convention for
//! the size of a collective's buffer.

use podsim_collectives::{Comm, DType, OpKind, ReduceOp};
use serde::{Deserialize, Serialize};

/// One benchmark case (one size).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BenchCase {
    pub op: OpKind,
    pub comm: Comm,
    pub reduce: ReduceOp,
    /// Elements in each chip's input buffer.
    pub count: usize,
    pub meta: bool,
    pub warmup: usize,
    pub iters: usize,
    /// Group rank of the broadcast root.
    pub root: u32,
}

/// Elements in each chip's input for a per-chip buffer of `bytes` as nccl-tests counts it
/// (the whole output buffer for all-gather), in a group of `n`; at least one.
pub fn elements_for_buffer(op: OpKind, bytes: u64, dtype: DType, n: u32) -> usize {
    let elem = dtype.size() as u64;
    let count = match op {
        OpKind::AllGather => bytes / elem / u64::from(n.max(1)),
        _ => bytes / elem,
    };
    count.max(1) as usize
}

/// The inverse: the buffer size nccl-tests reports for `count` input elements.
pub fn buffer_bytes(op: OpKind, count: usize, dtype: DType, n: u32) -> u64 {
    let bytes = count as u64 * dtype.size() as u64;
    match op {
        OpKind::AllGather => bytes * u64::from(n),
        _ => bytes,
    }
}
