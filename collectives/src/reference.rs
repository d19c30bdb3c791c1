//! Naive reference collectives over whole buffers, written directly from the definitions with
//! no algorithm in common with the real ones: the tests and `podsim bench` check against these.

use crate::reduce::ReduceOp;

/// Element-wise reduction of `inputs` in rank order.
pub fn all_reduce(inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let n = inputs.len();
    let len = inputs.first().map_or(0, Vec::len);
    (0..len)
        .map(|i| {
            let column = inputs.iter().map(|v| v[i]);
            match op {
                ReduceOp::Sum => column.sum(),
                ReduceOp::Avg => column.sum::<f32>() / n as f32,
                ReduceOp::Max => column.fold(f32::NEG_INFINITY, f32::max),
                ReduceOp::Min => column.fold(f32::INFINITY, f32::min),
            }
        })
        .collect()
}

/// Block `rank` of the reduction, `torch.chunk` rules.
pub fn reduce_scatter(inputs: &[Vec<f32>], op: ReduceOp, rank: usize) -> Vec<f32> {
    let full = all_reduce(inputs, op);
    chunk(&full, inputs.len(), rank).to_vec()
}

pub fn all_gather(inputs: &[Vec<f32>]) -> Vec<f32> {
    inputs.concat()
}

/// Block `rank` of every input, in source order.
pub fn all_to_all(inputs: &[Vec<f32>], rank: usize) -> Vec<f32> {
    inputs
        .iter()
        .flat_map(|v| chunk(v, inputs.len(), rank).to_vec())
        .collect()
}

/// `torch.chunk(values, n)[rank]`, or empty when there are fewer chunks.
pub fn chunk(values: &[f32], n: usize, rank: usize) -> &[f32] {
    let l = values.len().div_ceil(n.max(1));
    let start = (rank * l).min(values.len());
    let end = (start + l).min(values.len());
    &values[start..end]
}
