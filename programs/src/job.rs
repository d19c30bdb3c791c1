//! What a worker is asked to run (sent by the coordinator as JSON) and what it reports back.

use podsim_collectives::{CollectiveError, Fingerprint, OpKind};
use podsim_links::FabricSpec;
pub use podsim_links::{PeerLink, Transport};
use podsim_topology::{Dir, Group, Hardware, Link, Pod, PodAxis, Route};
use serde::{Deserialize, Serialize};

pub use podsim_job::bench::{BenchCase, buffer_bytes, elements_for_buffer};
pub use podsim_job::heartbeat::{HeartbeatStatus, STRAGGLER_WAITS_CHIPS, watchdog_defaults};
pub use podsim_job::reports::{
    CallRecord, ChipStepReport, CollectiveStep, MAX_CONTROL_MESSAGE_BYTES, RankExitReport,
    RecorderDump, TraceRequest,
};

use crate::train::{ChipTrainReport, TrainSpec};
pub use podsim_job::faults::{DesyncMode, FaultEvent, FaultKind, FaultSpec};

/// One job, as every worker receives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    pub pod: Pod,
    pub hardware: Hardware,
    pub workers: u32,
    pub program: Program,
    /// Faults to inject (`[[faults]]`).
    #[serde(default)]
    pub faults: Vec<FaultSpec>,
    /// How often workers report each chip's status, ms.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Collectives each chip's flight recorder keeps.
    #[serde(default = "default_recorder_entries")]
    pub recorder_entries: usize,
    /// The coordinator's hang timeout, ms (workers do not use it).
    #[serde(default = "default_watchdog_ms")]
    pub watchdog_ms: u64,
    /// How long a chip may stay busy in its program's own code while peers wait on it before
    /// the workers' watch takes it for a hang, ms (`[watchdog] busy_timeout_s`).
    #[serde(default = "default_busy_ms")]
    pub busy_ms: u64,
    /// Simulate chip 0 alone on a mirror fabric, standing for every chip (see
    /// `podsim_collectives::MirrorRouter`): symmetric meta-mode jobs at any scale.
    #[serde(default)]
    pub symmetric: bool,
    /// Chips to record a timeline of (`--trace`).
    #[serde(default)]
    pub trace: Option<TraceRequest>,
    /// How workers reach each other (`[launch] transport`).
    #[serde(default)]
    pub transport: Transport,
}

impl JobSpec {
    /// What this job asks of a worker's fabric: its links follow the torus, plus the routes
    /// and rings its program sends on beyond one hop.
    pub fn fabric(&self) -> FabricSpec {
        FabricSpec {
            pod: self.pod.clone(),
            hardware: self.hardware.clone(),
            workers: self.workers,
            transport: self.transport,
            strided_routes: self.strided_routes(),
            shift_groups: self.shift_groups(),
        }
    }

    /// Routes longer than one hop the job's chips send on: the strided parts of torus axes its
    /// device mesh lays dimensions on (their members are `stride` chips apart).
    fn strided_routes(&self) -> Vec<Route> {
        let Program::Train(train) = &self.program else {
            return Vec::new();
        };
        let parts = train.mesh_parts(&self.pod).unwrap_or_default();
        parts
            .into_iter()
            .filter(|p| p.stride > 1)
            .filter_map(|p| match p.axis {
                PodAxis::Torus(a) => Some((a, p.stride)),
                PodAxis::Slices => None,
            })
            .flat_map(|(axis, hops)| {
                [Dir::Plus, Dir::Minus].map(|dir| Route {
                    link: Link::ici(usize::from(axis), dir),
                    hops,
                })
            })
            .collect()
    }

    /// The groups whose members send point-to-point messages around their ring (a
    /// `send-recv` in a script or a benchmark).
    fn shift_groups(&self) -> Vec<Group> {
        match &self.program {
            Program::Collectives { script, .. } => script
                .iter()
                .filter(|step| step.op == OpKind::SendRecv)
                .map(|step| step.group)
                .collect(),
            Program::Bench { cases } => cases
                .iter()
                .filter(|case| case.op == OpKind::SendRecv)
                .map(|case| case.comm.group)
                .collect(),
            Program::Train(_) | Program::Torch(_) => Vec::new(),
        }
    }
}

fn default_heartbeat_ms() -> u64 {
    watchdog_defaults(0).0
}

fn default_recorder_entries() -> usize {
    podsim_collectives::DEFAULT_RECORDER_ENTRIES
}

fn default_busy_ms() -> u64 {
    podsim_job::DEFAULT_BUSY_MS
}

fn default_watchdog_ms() -> u64 {
    watchdog_defaults(0).1
}

/// A failure the watchdog can diagnose, as a worker reports it: a desync (both chips and both
/// collectives), a corrupt message (receiver, sender and link) or a PyTorch rank that died.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailureReport {
    /// `desync`, `corrupt` (a payload that failed its checksum) or `rank_exit`.
    #[serde(default = "desync_kind")]
    pub kind: String,
    pub chip: u32,
    pub peer: u32,
    /// The reporting chip's collective (none for a rank's exit).
    pub mine: Option<Fingerprint>,
    /// The peer's collective as seen (a fingerprint, or its description).
    pub theirs: String,
    /// The link the mismatching message came over (absent for debug-mode checks).
    pub link: Option<Link>,
    /// Faults fired in the reporting worker (an injected desync among them).
    #[serde(default)]
    pub faults: Vec<FaultEvent>,
    /// `rank_exit`: the rank's process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank_exit: Option<RankExitReport>,
    /// PyTorch ranks: where each chip's program made the call (chip, `file:line function`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sites: Vec<(u32, String)>,
    /// `regroup`: the translation steps the job's representatives must stand for (see
    /// `TorchSpec::representative_steps`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub representative_steps: Vec<u32>,
    /// PyTorch jobs: what the failing rank had done until the failure.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub torch: Vec<crate::torch::RankReport>,
    /// A desync of a rank verified against its representative (meta mode): the ranks were
    /// taken as alike, and this one is not.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub verified: bool,
}

fn desync_kind() -> String {
    "desync".into()
}

impl FailureReport {
    /// The kind of a failure that is no failure of the program: the job runs again with more
    /// representative ranks (`theirs` says why).
    pub const REGROUP: &'static str = "regroup";

    /// A failure of `kind` between `chip` and `peer`, with nothing else said yet.
    pub fn between(kind: impl Into<String>, chip: u32, peer: u32) -> FailureReport {
        FailureReport {
            kind: kind.into(),
            chip,
            peer,
            mine: None,
            theirs: String::new(),
            link: None,
            faults: Vec::new(),
            rank_exit: None,
            sites: Vec::new(),
            representative_steps: Vec::new(),
            torch: Vec::new(),
            verified: false,
        }
    }

    /// The desync inside `e`, if it is one.
    pub fn from_error(e: &crate::ProgramError) -> Option<FailureReport> {
        use crate::ProgramError as W;
        match e {
            W::AtCallSites {
                error,
                chip,
                mine,
                peer,
                theirs,
                verified,
            } => FailureReport::from_error(&W::Collective((**error).clone())).map(|r| {
                FailureReport {
                    sites: vec![(*chip, mine.clone()), (*peer, theirs.clone())],
                    verified: *verified,
                    ..r
                }
            }),
            W::Collective(c) => FailureReport::of_collective(c),
            W::RankExited {
                chip,
                pid,
                how,
                stderr_tail,
            } => Some(FailureReport {
                rank_exit: Some(RankExitReport {
                    pid: *pid,
                    how: how.clone(),
                    stderr_tail: stderr_tail.clone(),
                }),
                ..FailureReport::between("rank_exit", *chip, *chip)
            }),
            W::Regroup { steps, why } => Some(FailureReport {
                theirs: why.clone(),
                representative_steps: steps.clone(),
                ..FailureReport::between(FailureReport::REGROUP, 0, 0)
            }),
            W::TorchFailed { error, ranks } => {
                FailureReport::from_error(error).map(|r| FailureReport {
                    torch: ranks.clone(),
                    ..r
                })
            }
            _ => None,
        }
    }

    /// The desync (or corruption) a collective's error is, if it is one.
    fn of_collective(e: &CollectiveError) -> Option<FailureReport> {
        match e {
            CollectiveError::Desync {
                chip,
                expected,
                peer,
                got,
                link,
            } => Some(FailureReport {
                mine: Some(*expected),
                theirs: got.to_string(),
                link: Some(*link),
                ..FailureReport::between(desync_kind(), *chip, *peer)
            }),
            CollectiveError::Mismatch {
                chip,
                mine,
                peer,
                theirs,
            } => Some(FailureReport {
                mine: Some(*mine),
                theirs: theirs.clone(),
                ..FailureReport::between(desync_kind(), *chip, *peer)
            }),
            CollectiveError::Corrupt {
                chip,
                peer,
                link,
                fingerprint,
            } => Some(FailureReport {
                mine: Some(*fingerprint),
                link: Some(*link),
                ..FailureReport::between("corrupt", *chip, *peer)
            }),
            _ => None,
        }
    }
}

/// The program every chip runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// A job holds one program, built once: the training variant being the largest costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Program {
    /// A scripted list of collectives, repeated `iterations` times, every result checked.
    Collectives {
        iterations: u32,
        meta: bool,
        script: Vec<CollectiveStep>,
        /// Debug checks on every collective: payload checksums on every message (a corrupted
        /// one is reported with its link) and fingerprints compared across the group first.
        #[serde(default)]
        verify: bool,
    },
    /// `podsim bench` across processes: each case timed and checked.
    Bench { cases: Vec<BenchCase> },
    /// Training steps of a model under a parallel strategy.
    Train(TrainSpec),
    /// A PyTorch program, one rank process per chip (`podsim run`).
    Torch(crate::torch::TorchSpec),
}

/// Everything a worker reports at the end of a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerReport {
    pub worker: u32,
    pub pid: u32,
    pub link_addr: String,
    pub chips: Vec<u32>,
    pub steps: Vec<ChipStepReport>,
    pub messages_sent: u64,
    pub bytes_sent: u64,
    pub peak_rss_bytes: u64,
    /// Problems seen on link streams (bad frames, peers that went away).
    pub link_errors: Vec<String>,
    /// Training jobs: one report per chip.
    #[serde(default)]
    pub train: Vec<ChipTrainReport>,
    /// Timelines of the traced chips.
    #[serde(default)]
    pub traces: Vec<podsim_collectives::trace::ChipTrace>,
    /// The transport of each link to another worker.
    #[serde(default)]
    pub links: Vec<PeerLink>,
    /// Torch jobs: one report per rank.
    #[serde(default)]
    pub torch: Vec<crate::torch::RankReport>,
    /// The faults that fired in this worker (the heartbeats carry them too, but one that fired
    /// after the last heartbeat arrives only here).
    #[serde(default)]
    pub faults: Vec<podsim_job::FaultEvent>,
}
