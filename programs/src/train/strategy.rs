//! The parallel strategies as data: which mesh each one builds, what every mesh dimension is
//! for, and where each parameter, its working copy and its gradient live.
//!
//! | strategy | mesh (outermost first) | parameters | gradient sync |
//! |---|---|---|---|
//! | `ddp` | `dp` | replicated | all-reduce (avg) over `dp`, in buckets when fused |
//! | `fsdp` | `dp` | `Shard(0)` over `dp`, all-gathered per layer | reduce-scatter (avg) over `dp` |
//! | `hsdp` | `replicate, shard` | `Shard(0)` over `shard`, replicated over `replicate` | reduce-scatter over `shard`, then all-reduce over `replicate` |
//! | `tp` | `tp` | Megatron: column- then row-parallel pairs | none (each chip owns its shard) |
//! | `fsdp+tp` | `dp, tp` (`replicate, dp, tp` with `replicas`) | Megatron over `tp`, each piece `Shard(0)` over `dp`, replicated over `replicate` | reduce-scatter over `dp` (then all-reduce over `replicate`) |
//!
//! Tensor-parallel layers come in pairs: the first of a pair is column-parallel (weight and
//! bias `Shard(0)`: each chip computes some output features), the second row-parallel
//! (weight `Shard(1)`, replicated bias: each chip holds partial sums that an all-reduce
//! completes). A last unpaired layer is replicated.

use podsim_collectives::{Algo, ReduceOp};
use podsim_topology::{DeviceMesh, Pod};
use serde::{Deserialize, Serialize};

pub use podsim_job::program::Eager;

use crate::error::ProgramError;
use crate::train::dtensor::{Mesh, Placement};

/// A parallel strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    #[serde(rename = "ddp")]
    Ddp,
    #[serde(rename = "fsdp")]
    Fsdp,
    #[serde(rename = "hsdp")]
    Hsdp,
    #[serde(rename = "tp")]
    Tp,
    #[serde(rename = "fsdp+tp")]
    FsdpTp,
}

podsim_collectives::named_enum!(Strategy, "strategy", {
    Ddp => "ddp",
    Fsdp => "fsdp",
    Hsdp => "hsdp",
    Tp => "tp",
    FsdpTp => "fsdp+tp",
});

/// What a mesh dimension is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Data parallel, parameters replicated (DDP, HSDP's replicate axis).
    Replicate,
    /// Data parallel, parameters sharded (FSDP, HSDP's shard axis).
    Shard,
    /// Tensor parallel.
    Tensor,
}

/// How a layer is cut over the tensor-parallel dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Replicated,
    Column,
    Row,
}

/// A strategy laid onto a pod: the mesh, each dimension's role, each layer's style.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mesh: Mesh,
    pub roles: Vec<Role>,
    pub styles: Vec<Style>,
}

impl Plan {
    /// `tp` is the tensor-parallel degree (`tp`, `fsdp+tp`), `replicas` HSDP's replicate degree;
    /// `tp_styles` how tensor parallelism cuts each layer (from the model), used when the
    /// strategy has a tensor-parallel dimension.
    pub fn new(
        pod: &Pod,
        strategy: Strategy,
        tp_styles: &[Style],
        tp: u32,
        replicas: u32,
        algo: Algo,
        verify: bool,
    ) -> Result<Plan, ProgramError> {
        let chips = pod.chips();
        let divide = |by: u32, what: &str| {
            if by == 0 || !chips.is_multiple_of(by) {
                Err(ProgramError::Invalid(format!(
                    "{what} = {by} does not divide the pod's {chips} chips"
                )))
            } else {
                Ok(chips / by)
            }
        };
        // Device-mesh axes outermost first (how they lie on the torus), then the nesting order
        // of placements (tensor parallel outermost, so that gathering a data-parallel shard
        // gives this chip's tensor-parallel piece).
        let (axes, order, roles): (Vec<(&str, u32)>, Vec<&str>, Vec<Role>) = match strategy {
            Strategy::Ddp => (vec![("dp", chips)], vec!["dp"], vec![Role::Replicate]),
            Strategy::Fsdp => (vec![("dp", chips)], vec!["dp"], vec![Role::Shard]),
            Strategy::Hsdp => (
                vec![
                    ("replicate", replicas),
                    ("shard", divide(replicas, "replicas")?),
                ],
                vec!["replicate", "shard"],
                vec![Role::Replicate, Role::Shard],
            ),
            Strategy::Tp => (vec![("tp", chips)], vec!["tp"], vec![Role::Tensor]),
            Strategy::FsdpTp if replicas > 1 => (
                vec![
                    ("replicate", replicas),
                    ("dp", divide(tp * replicas, "tp x replicas")?),
                    ("tp", tp),
                ],
                vec!["tp", "replicate", "dp"],
                vec![Role::Tensor, Role::Replicate, Role::Shard],
            ),
            Strategy::FsdpTp => (
                vec![("dp", divide(tp, "tp")?), ("tp", tp)],
                vec!["tp", "dp"],
                vec![Role::Tensor, Role::Shard],
            ),
        };
        let dm = DeviceMesh::new(pod, &axes)
            .map_err(|e| ProgramError::Invalid(format!("{strategy}: {e}")))?;
        let mesh = Mesh::over(pod, &dm, &order, algo)?.verified(verify);
        let has_tp = roles.contains(&Role::Tensor);
        let styles = tp_styles
            .iter()
            .map(|&s| if has_tp { s } else { Style::Replicated })
            .collect();
        Ok(Plan {
            mesh,
            roles,
            styles,
        })
    }

    fn dim_of(&self, role: Role) -> Option<usize> {
        self.roles.iter().position(|r| *r == role)
    }

    pub fn tp_dim(&self) -> Option<usize> {
        self.dim_of(Role::Tensor)
    }

    pub fn shard_dim(&self) -> Option<usize> {
        self.dim_of(Role::Shard)
    }

    pub fn replicate_dim(&self) -> Option<usize> {
        self.dim_of(Role::Replicate)
    }

    /// Placement over the tensor-parallel dimension of parameter `which` (0 weight, 1 bias).
    fn tp_placement(&self, layer: usize, which: usize) -> Placement {
        match (self.styles[layer], which) {
            (Style::Column, _) => Placement::Shard(0),
            (Style::Row, 0) => Placement::Shard(1),
            _ => Placement::Replicate,
        }
    }

    /// Placements of one parameter's tensor: the tensor-parallel placement of its layer, and
    /// `shard` / `replicate` over the data-parallel dimensions of those roles.
    fn by_role(
        &self,
        layer: usize,
        which: usize,
        shard: Placement,
        replicate: Placement,
    ) -> Vec<Placement> {
        self.roles
            .iter()
            .map(|role| match role {
                Role::Tensor => self.tp_placement(layer, which),
                Role::Shard => shard,
                Role::Replicate => replicate,
            })
            .collect()
    }

    /// Where the chip keeps the parameter between steps.
    pub fn stored(&self, layer: usize, which: usize) -> Vec<Placement> {
        self.by_role(layer, which, Placement::Shard(0), Placement::Replicate)
    }

    /// The working copy the kernels use (unsharded over data-parallel dimensions).
    pub fn compute(&self, layer: usize, which: usize) -> Vec<Placement> {
        self.by_role(layer, which, Placement::Replicate, Placement::Replicate)
    }

    /// A freshly computed gradient: partial (to be averaged) over every data-parallel dimension.
    pub fn gradient(&self, layer: usize, which: usize) -> Vec<Placement> {
        let avg = Placement::Partial(ReduceOp::Avg);
        self.by_role(layer, which, avg, avg)
    }

    /// Number of data-parallel replicas of the batch, and this chip's index among them.
    pub fn data_parallel(&self, coords: &[usize]) -> (usize, usize) {
        let mut size = 1;
        let mut rank = 0;
        for (i, role) in self.roles.iter().enumerate() {
            if *role != Role::Tensor {
                rank = rank * self.mesh.dims()[i].size + coords[i];
                size *= self.mesh.dims()[i].size;
            }
        }
        (size, rank)
    }
}

/// DDP's bucket assignment (`torch.nn.parallel.DistributedDataParallel`): parameters in
/// reverse order fill buckets; the first closes once it holds `first_cap` bytes, the others
/// at `cap` bytes. Returns parameter indices per bucket, in bucket order.
pub fn buckets(param_bytes: &[u64], first_cap: u64, cap: u64) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut current = Vec::new();
    let mut size = 0;
    for i in (0..param_bytes.len()).rev() {
        current.push(i);
        size += param_bytes[i];
        let limit = if out.is_empty() { first_cap } else { cap };
        if size >= limit {
            out.push(std::mem::take(&mut current));
            size = 0;
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_fill_in_reverse_order_with_a_small_first_bucket() {
        let mib = 1 << 20;
        // Six 0.6 MiB parameters, first cap 1 MiB, then 2 MiB.
        let b = buckets(&[6 * mib / 10; 6], mib, 2 * mib);
        assert_eq!(b, vec![vec![5, 4], vec![3, 2, 1, 0]]);
        assert_eq!(buckets(&[10; 3], 1000, 1000), vec![vec![2, 1, 0]]);
    }

    #[test]
    fn fsdp_tp_nests_the_data_parallel_shard_inside_the_tensor_parallel_piece() {
        let pod = Pod::single("2x2x2".parse().unwrap());
        let styles = [Style::Column, Style::Row, Style::Replicated];
        let plan = Plan::new(&pod, Strategy::FsdpTp, &styles, 4, 1, Algo::Torus, false).unwrap();
        assert_eq!(plan.roles, vec![Role::Tensor, Role::Shard]);
        assert_eq!(
            plan.styles,
            vec![Style::Column, Style::Row, Style::Replicated]
        );
        assert_eq!(
            plan.stored(0, 0),
            vec![Placement::Shard(0), Placement::Shard(0)]
        );
        assert_eq!(
            plan.stored(1, 0),
            vec![Placement::Shard(1), Placement::Shard(0)]
        );
        assert_eq!(
            plan.compute(1, 1),
            vec![Placement::Replicate, Placement::Replicate]
        );
        assert_eq!(
            plan.gradient(0, 1),
            vec![Placement::Shard(0), Placement::Partial(ReduceOp::Avg)]
        );
        assert_eq!(plan.data_parallel(&[3, 1]), (2, 1));
    }

    #[test]
    fn fsdp_tp_with_replicas_adds_a_replicated_data_parallel_dimension_across_slices() {
        let pod = Pod::new("2x2x2".parse().unwrap(), 2).unwrap();
        let styles = [Style::Column, Style::Row];
        let plan = Plan::new(&pod, Strategy::FsdpTp, &styles, 2, 2, Algo::Torus, false).unwrap();
        assert_eq!(plan.roles, vec![Role::Tensor, Role::Replicate, Role::Shard]);
        assert_eq!(plan.mesh.dims()[1].size, 2);
        assert_eq!(plan.mesh.dims()[2].size, 4);
        assert_eq!(
            plan.stored(0, 0),
            vec![
                Placement::Shard(0),
                Placement::Replicate,
                Placement::Shard(0)
            ]
        );
        // 8 data-parallel ranks: 2 replicas of 4 shards.
        assert_eq!(plan.data_parallel(&[1, 1, 3]), (8, 7));
    }
}
