//! Reduction operators of all-reduce and reduce-scatter.

use serde::{Deserialize, Serialize};

/// How values from different chips are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the group size.
    Avg,
    Max,
    Min,
}

crate::named_enum!(ReduceOp, "reduce op", {
    Sum => "sum",
    Avg => "avg",
    Max => "max",
    Min => "min",
});

impl ReduceOp {
    /// The element-wise combination used while reducing (avg sums, then divides once).
    pub fn apply_in_place(self, acc: &mut [f32], other: &[f32]) {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => acc.iter_mut().zip(other).for_each(|(a, b)| *a += *b),
            ReduceOp::Max => acc.iter_mut().zip(other).for_each(|(a, b)| *a = a.max(*b)),
            ReduceOp::Min => acc.iter_mut().zip(other).for_each(|(a, b)| *a = a.min(*b)),
        }
    }

    /// Writes `a[i] op b[i]` into `out[i]` for every `i`: the same values as copying `a` and
    /// then [`ReduceOp::apply_in_place`] with `b`, in one pass.
    pub fn combine_into(self, out: &mut [f32], a: &[f32], b: &[f32]) {
        let triples = out.iter_mut().zip(a.iter().zip(b));
        match self {
            ReduceOp::Sum | ReduceOp::Avg => triples.for_each(|(o, (x, y))| *o = x + y),
            ReduceOp::Max => triples.for_each(|(o, (x, y))| *o = x.max(*y)),
            ReduceOp::Min => triples.for_each(|(o, (x, y))| *o = x.min(*y)),
        }
    }

    pub fn code(self) -> u32 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Avg => 2,
            ReduceOp::Max => 3,
            ReduceOp::Min => 4,
        }
    }

    pub fn from_code(code: u32) -> Option<ReduceOp> {
        ReduceOp::ALL.into_iter().find(|o| o.code() == code)
    }
}
