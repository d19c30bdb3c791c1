//! Shared helpers for the collectives integration tests.
#![allow(clippy::unwrap_used, dead_code)]

use podsim_collectives::{
    Algo, Chip, CollectiveError, Comm, LocalFabric, Nanos, OpKind, Payload, ReduceOp, run_chips,
};
use podsim_topology::{Group, Hardware, Pod};

/// One collective call in a scripted sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Call {
    Op(OpKind, Option<ReduceOp>),
}

/// Deterministic positive input values (positive keeps sums well conditioned).
pub fn input(chip: u32, count: usize, salt: u32) -> Vec<f32> {
    (0..count)
        .map(|i| {
            let mut x = (chip as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (i as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
                ^ u64::from(salt).wrapping_mul(0x1656_67B1_9E37_79F9);
            x ^= x >> 29;
            x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x ^= x >> 32;
            0.5 + (x % 10_000) as f32 / 10_000.0
        })
        .collect()
}

pub fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_time()
        .build()
        .expect("runtime")
}

/// Runs one collective on each of `chips` (every chip of a fabric, or those of a mirror
/// fabric); returns each chip's output (`None` in meta mode for values) with its length and
/// the chip's virtual clock afterwards.
pub async fn run_op(
    chips: Vec<Chip>,
    comm: Comm,
    op: OpKind,
    reduce: ReduceOp,
    count: usize,
    meta: bool,
    salt: u32,
) -> Result<Vec<(Option<Vec<f32>>, usize, Nanos)>, CollectiveError> {
    run_chips(chips, move |mut chip: Chip| async move {
        let data = if meta {
            Payload::Meta(count)
        } else {
            Payload::from_vec(input(chip.id(), count, salt))
        };
        let out = match op {
            OpKind::AllReduce => chip.all_reduce(&comm, &data, reduce).await?,
            OpKind::ReduceScatter => chip.reduce_scatter(&comm, &data, reduce).await?,
            OpKind::AllGather => chip.all_gather(&comm, &data).await?,
            OpKind::Broadcast => {
                chip.broadcast(&comm, &data, 1 % comm.group.size(chip.pod()))
                    .await?
            }
            OpKind::AllToAll => chip.all_to_all(&comm, &data).await?,
            OpKind::Barrier => {
                chip.barrier(&comm).await?;
                Payload::Meta(0)
            }
            OpKind::SendRecv => chip.shift(comm.group, &data).await?,
        };
        Ok::<_, CollectiveError>((out.to_vec(), out.len(), chip.clock()))
    })
    .await
}

/// The reference output of chip `chip` for `op`.
pub fn expected(
    pod: &Pod,
    group: Group,
    chip: u32,
    op: OpKind,
    reduce: ReduceOp,
    count: usize,
    salt: u32,
) -> Vec<f32> {
    use podsim_collectives::reference as r;
    let members = group.members(pod, chip);
    let inputs: Vec<Vec<f32>> = members.iter().map(|&m| input(m, count, salt)).collect();
    let rank = group.rank_of(pod, chip) as usize;
    match op {
        OpKind::AllReduce => r::all_reduce(&inputs, reduce),
        OpKind::ReduceScatter => r::reduce_scatter(&inputs, reduce, rank),
        OpKind::AllGather => r::all_gather(&inputs),
        OpKind::Broadcast => inputs[1 % inputs.len()].clone(),
        OpKind::AllToAll => r::all_to_all(&inputs, rank),
        OpKind::Barrier => Vec::new(),
        OpKind::SendRecv => inputs[(rank + inputs.len() - 1) % inputs.len()].clone(),
    }
}

/// Exact for max, min and data movement; 1e-5 relative for sum and avg.
pub fn assert_close(got: &[f32], want: &[f32], reduce: ReduceOp, exact: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if exact || matches!(reduce, ReduceOp::Max | ReduceOp::Min) {
            g == w
        } else {
            (g - w).abs() <= 1e-5 * w.abs().max(1e-30)
        };
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

pub fn fabric(shape: &str, wrap: bool, slices: u32) -> LocalFabric {
    let torus = shape
        .parse::<podsim_topology::Torus>()
        .expect("shape")
        .set_wrap_all(wrap);
    let pod = Pod::new(torus, slices).expect("pod");
    LocalFabric::new(pod, Hardware::preset("v5p").expect("preset"))
}

pub fn algos() -> [Algo; 3] {
    Algo::ALL
}

/// The link model's closed-form pieces for a preset, written from docs/DESIGN.md ("The link
/// model") rather than read from the code that charges them.
#[derive(Debug)]
pub struct LinkModel {
    /// Latency of one ICI hop, ns.
    pub alpha: f64,
    /// What an ICI link sustains, bytes per ns.
    pub w: f64,
    /// Fixed cost of one collective, ns.
    pub overhead: f64,
    /// What a reduction streams through HBM, bytes per ns.
    pub hbm: f64,
}

impl LinkModel {
    pub fn of(hw: &Hardware) -> LinkModel {
        LinkModel {
            alpha: hw.ici_latency_ns,
            w: hw.ici_bandwidth * hw.ici_efficiency / 1e9,
            overhead: hw.collective_overhead_ns,
            hbm: hw.hbm_bandwidth * hw.hbm_efficiency / 1e9,
        }
    }

    /// One ring step's reduction of `bytes` received, on a lane that shares the chip's HBM
    /// with `sharing` lanes (both operands read, the sum written).
    pub fn reduce(&self, bytes: f64, sharing: f64) -> f64 {
        3.0 * bytes * sharing / self.hbm
    }
}
