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

/// The bytes a chip holds for a data-mode collective of `count` input elements in a group of
/// `n`: its input and its output (an all-gather's output is `n` inputs, a reduce-scatter's
/// one share of it). Both a config's memory check and `podsim bench`'s use it.
pub fn data_mode_buffers(op: OpKind, count: usize, dtype: DType, n: u32) -> u128 {
    let input = count as u128;
    let n = u128::from(n.max(1));
    let output = match op {
        OpKind::AllGather => input * n,
        OpKind::ReduceScatter => input / n,
        _ => input,
    };
    (input + output) * dtype.size() as u128
}

/// The inverse: the buffer size nccl-tests reports for `count` input elements.
pub fn buffer_bytes(op: OpKind, count: usize, dtype: DType, n: u32) -> u64 {
    let bytes = count as u64 * dtype.size() as u64;
    match op {
        OpKind::AllGather => bytes * u64::from(n),
        _ => bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_mode_buffers_count_input_and_output() {
        // An all-gather's output holds the group's inputs, a reduce-scatter's one share.
        assert_eq!(
            data_mode_buffers(OpKind::AllGather, 2, DType::F32, 4),
            (2 + 8) * 4
        );
        assert_eq!(
            data_mode_buffers(OpKind::ReduceScatter, 8, DType::F32, 4),
            (8 + 2) * 4
        );
        assert_eq!(
            data_mode_buffers(OpKind::AllReduce, 3, DType::F32, 4),
            (3 + 3) * 4
        );
        // A buffer too large for usize arithmetic is still counted exactly.
        let huge = data_mode_buffers(OpKind::AllGather, usize::MAX, DType::F32, u32::MAX);
        assert!(huge > u128::from(u64::MAX));
    }
}
