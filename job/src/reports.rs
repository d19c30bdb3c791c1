//! What workers report besides heartbeats: each chip's timed calls of a script or benchmark,
//! flight-recorder dumps for a diagnosis, a PyTorch rank's exit; the collectives of a script
//! and which chips trace; and the largest control message either side accepts.

use podsim_collectives::{Algo, ChipStatus, Comm, DType, OpKind, ReduceOp};
use podsim_topology::{Group, Pod};
use serde::{Deserialize, Serialize};

use crate::bench::{BenchCase, elements_for_buffer};

/// The largest control message either side accepts. A worker's final report carries every
/// chip's step records: about 700 bytes a chip, 75 MB for 110,592 chips in one worker.
pub const MAX_CONTROL_MESSAGE_BYTES: usize = 256 << 20;

/// Which chips record a trace, and whether their messages are recorded too (flow arrows).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    pub chips: Vec<u32>,
    pub flows: bool,
}

/// One chip's flight recorder as dumped for a diagnosis.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecorderDump {
    pub status: ChipStatus,
    pub entries: Vec<podsim_collectives::RecordEntry>,
    /// A traced chip's timeline up to the dump.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<podsim_collectives::trace::ChipTrace>,
    /// Where the chip's driving program is in its own code (a PyTorch rank's Python stack,
    /// `file:line function`, innermost last), when it reports one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub host_stack: Vec<String>,
}

/// A PyTorch rank whose process ended before its job did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankExitReport {
    pub pid: u32,
    /// `exited with code 1`, `was killed by signal 9`.
    pub how: String,
    /// Its last lines of standard error.
    pub stderr_tail: Vec<String>,
}

/// One collective of a script.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollectiveStep {
    pub op: OpKind,
    /// Per-chip buffer, nccl-tests convention (whole output for all-gather).
    pub bytes: u64,
    pub algo: Algo,
    pub group: Group,
    pub reduce: ReduceOp,
    pub root: u32,
    pub dtype: DType,
}

impl CollectiveStep {
    /// Elements in each chip's input for this step on `pod`.
    pub fn count(&self, pod: &Pod) -> usize {
        elements_for_buffer(self.op, self.bytes, self.dtype, self.group.size(pod))
    }

    /// The step as a one-iteration benchmark case (timed once, checked).
    pub fn case(&self, pod: &Pod, meta: bool) -> BenchCase {
        BenchCase {
            op: self.op,
            comm: Comm {
                group: self.group,
                algo: self.algo,
                dtype: self.dtype,
                verify: false,
                instance: 0,
            },
            reduce: self.reduce,
            count: self.count(pod),
            meta,
            warmup: 0,
            iters: 1,
            root: self.root,
        }
    }
}

/// One timed call on one chip.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// Host wall clock at start and end, ns since the Unix epoch.
    pub wall_start_ns: u64,
    pub wall_end_ns: u64,
    /// The chip's virtual clock before and after, ns.
    pub virtual_start_ns: f64,
    pub virtual_end_ns: f64,
    /// Messages this chip sent during the call (simulated message events).
    #[serde(default)]
    pub messages: u64,
}

/// What one chip did for one step or case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipStepReport {
    pub chip: u32,
    /// Script step (collectives) or case (bench) index.
    pub step: usize,
    pub iteration: u32,
    pub calls: Vec<CallRecord>,
    pub checked: u64,
    pub wrong: u64,
}
