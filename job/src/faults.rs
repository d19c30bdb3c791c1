//! The faults a job injects (`[[faults]]`), as validated, and the record of one that fired.
//! What each kind does to a chip, a link or a worker is the worker's (`worker/src/faults.rs`).

use podsim_topology::{ChipId, Link};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    Stall,
    Crash,
    Freeze,
    Drop,
    Delay,
    Slow,
    Desync,
    Corrupt,
    Partition,
}

podsim_collectives::named_enum!(FaultKind, "fault", {
    Stall => "stall",
    Crash => "crash",
    Freeze => "freeze",
    Drop => "drop",
    Delay => "delay",
    Slow => "slow",
    Desync => "desync",
    Corrupt => "corrupt",
    Partition => "partition",
});

impl FaultKind {
    /// Whether the fault ends or stops its worker's process as it fires (`crash`, `freeze`):
    /// no heartbeat carries its event, so only the coordinator can tell it fired.
    pub fn ends_its_worker(self) -> bool {
        matches!(self, FaultKind::Crash | FaultKind::Freeze)
    }
}

/// How a `desync` fault makes its chip differ from the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DesyncMode {
    Skip,
    Op,
    Size,
}

/// One fault of a job, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultSpec {
    pub kind: FaultKind,
    /// Target chip (stall, slow, desync; crash/freeze: its worker; drop/delay/corrupt: the
    /// sending chip of `link`).
    pub chip: Option<ChipId>,
    /// Target worker (crash, freeze).
    pub worker: Option<u32>,
    pub link: Option<Link>,
    /// Partition: the two groups of workers cut apart...
    pub groups: Vec<Vec<u32>>,
    /// ...or the two groups of chips.
    #[serde(default)]
    pub chip_groups: Vec<Vec<ChipId>>,
    pub at_step: Option<u64>,
    pub at_seq: Option<u64>,
    pub after_ms: Option<u64>,
    /// Drop: only the first message after the trigger.
    pub once: bool,
    pub delay_ms: f64,
    pub factor: f64,
    pub desync: DesyncMode,
}

/// A fault that fired.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FaultEvent {
    /// Index in the job's fault list.
    pub fault: usize,
    pub kind: FaultKind,
    pub at_wall_ns: u64,
    pub detail: String,
}
