//! A job that runs a PyTorch program on the chips (`kind = "torch"`): the command every rank
//! runs and how its work is counted.

use podsim_collectives::Algo;
use serde::{Deserialize, Serialize};

/// A torch job: the command every rank runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TorchSpec {
    /// Program and arguments (`python train.py --steps 20`).
    pub command: Vec<String>,
    /// The ranks' working directory (default: the worker's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// The pod's torus as written in the config (`PODSIM_TOPOLOGY`, for device meshes).
    pub topology: String,
    /// The algorithm of every collective.
    pub algo: Algo,
    /// How long a rank may take from its start to connecting to its chip (its `hello`, which
    /// `podsim.torch` sends when the program creates the process group), seconds. A rank
    /// still not connected then ends the job, named with what it was doing.
    #[serde(default = "default_connect_timeout_s")]
    pub connect_timeout_s: u64,
    /// Meta mode: the ranks' tensors have no storage (`python/podsim/_meta.py`) and their
    /// collectives move sizes.
    #[serde(default)]
    pub meta: bool,
    /// Whether the ranks' interpreters load `podsim._intercept` before the program (any
    /// backend and any `cuda` device land on podsim); `podsim run --no-intercept` turns it off.
    #[serde(default = "intercept_by_default")]
    pub intercept: bool,
    /// With `intercept`, whether one rank server per job imports torch and podsim once and
    /// forks the ranks (`python/podsim/_prefork.py`), instead of each rank importing them
    /// (3-4 s of CPU each). On unless the config says otherwise (`[job] prefork`); absent
    /// from a spec on the wire, off.
    #[serde(default)]
    pub prefork: bool,
    /// How the ranks' work is counted: `fused` (chains of element-wise ops one pass over HBM,
    /// collectives overlapping compute until waited for), `strict` (every op its own kernel,
    /// every collective waited for at its call), `debug` (as strict).
    #[serde(default = "fused")]
    pub eager: crate::program::Eager,
    /// Which steps the ranks count op by op (the others replay their steady step).
    #[serde(default)]
    pub count: Count,
    /// Ranks that run beside a representative to check that they call what it calls
    /// (`--verify-ranks`; meta mode on the mirror fabric only).
    #[serde(default)]
    pub verify_ranks: Vec<u32>,
    /// Meta mode on the mirror fabric: along each torus axis, every how many chips the ranks
    /// are alike (empty: all of them, one representative rank for the pod). An attempt whose
    /// program made a group alike only every few chips (a tensor-parallel segment of an axis)
    /// ends in the worker's `Regroup` error, and the job runs again with one representative per
    /// class of these translations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub representative_steps: Vec<u32>,
}

fn fused() -> crate::program::Eager {
    crate::program::Eager::Fused
}

fn intercept_by_default() -> bool {
    true
}

fn default_connect_timeout_s() -> u64 {
    TorchSpec::DEFAULT_CONNECT_TIMEOUT_S
}

impl TorchSpec {
    /// The translations the representative ranks stand for (see
    /// [`TorchSpec::representative_steps`]).
    pub fn symmetry(&self, pod: &podsim_topology::Pod) -> podsim_collectives::Symmetry {
        self.representative_steps.iter().enumerate().fold(
            podsim_collectives::Symmetry::of_torus(pod),
            |s, (axis, &step)| s.with_step(axis, step),
        )
    }

    /// [`TorchSpec::connect_timeout_s`] unless the job says: room for 8 ranks importing torch
    /// at once on 2 cores (5 to 20 s each alone on a slow machine) and a program's own setup
    /// before it creates the process group, while a rank that will never connect is still
    /// reported within minutes.
    pub const DEFAULT_CONNECT_TIMEOUT_S: u64 = 300;
    /// How a rank that never connected is described (the start of its failure's `how`), so
    /// that the coordinator tells it from a rank that died.
    pub const NOT_CONNECTED: &'static str = "did not connect to its chip within";
    /// How a rank whose program raised an exception is described (the start of its
    /// failure's `how`): a job error, not a death.
    pub const RAISED: &'static str = "raised ";
    /// How a rank that exited with an error before it connected is described (the start of
    /// its failure's `how`): its program failed before its first collective (an import, its
    /// arguments, an interpreter without podsim), a job error, not a death that left peers
    /// waiting.
    pub const FAILED_BEFORE_CONNECTING: &'static str =
        "failed before it created its process group: it ";
}

/// Which steps a rank counts op by op (`[job] count`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Count {
    /// Until two steps in a row are alike; then one in `RECOUNT_EVERY` of `python/podsim/_replay.py` (the others replay
    /// the steady step's compute).
    #[default]
    Steady,
    /// Every step.
    Every,
}

podsim_collectives::named_enum!(Count, "count", {
    Steady => "steady",
    Every => "every",
});
