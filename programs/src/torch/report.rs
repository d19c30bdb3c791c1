//! What one rank did, in virtual time, as a worker reports it and the job's report gives it:
//! plain data, so that the error of a failed job can carry it without the rank server.

use serde::{Deserialize, Serialize};

use podsim_links::rank_wire::{StandIn, StepCounting};

/// What one rank did, in virtual time.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    pub rank: u32,
    pub pid: u32,
    /// How the process ended.
    pub exit: Option<String>,
    /// The chip's virtual clock at the end, ns.
    pub virtual_ns: f64,
    /// Compute charged from the torch ops the rank ran, ns.
    pub compute_ns: f64,
    /// Time in collectives, ns.
    pub comm_ns: f64,
    /// Per collective kind: calls, bytes of this rank's inputs, virtual time.
    pub collectives: Vec<OpTotals>,
    /// Per step the program marked (`podsim.torch.step()`, or each `optimizer.step()`).
    pub steps: Vec<RankStep>,
    /// Whether the rank connected to its chip (created a podsim process group).
    #[serde(default)]
    pub connected: bool,
    /// Meta mode: the values made up for the program, by what and where.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stand_ins: Vec<StandIn>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OpTotals {
    pub op: String,
    pub calls: u64,
    pub bytes: u64,
    pub virtual_ns: f64,
}

/// One step of a rank, in virtual ns. A collective runs on a communication stream from its
/// issue and the rank's compute waits for it where the program waits (see
/// `python/podsim/_streams.py`), so communication overlapped with compute is hidden.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankStep {
    pub step_ns: f64,
    pub compute_ns: f64,
    pub comm_ns: f64,
    /// Step time minus compute.
    pub exposed_comm_ns: f64,
    /// Of `compute_ns`, what kernels lost waiting for HBM that communication in flight took.
    #[serde(default)]
    pub hbm_wait_ns: f64,
    /// The rank's peak of live device bytes over the step (0: not counted).
    #[serde(default)]
    pub peak_hbm_bytes: u64,
    /// Those bytes by kind at the peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hbm_by_kind: Vec<(String, u64)>,
    /// Matmul and attention flops the step executed (recomputation included).
    #[serde(default)]
    pub flops: f64,
    /// Of `flops`, the model's: what activation checkpointing recomputed left out.
    #[serde(default)]
    pub model_flops: f64,
    /// How the step's compute was known: counted op by op, or replayed from the rank's
    /// steady step (`python/podsim/_replay.py`).
    #[serde(default)]
    pub counting: StepCounting,
}
