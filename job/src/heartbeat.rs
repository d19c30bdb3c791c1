//! What a worker's heartbeat carries to the watchdog: a summary of its chips whose size does
//! not grow with their number (waiting chips as id ranges, candidate culprits, waits on other
//! workers' chips, lost messages), the waits for straggler accounting, and the faults fired.
//! The worker's `Summariser` (`worker/src/watch.rs`) makes it; the coordinator's watchdog
//! reads it.

use std::fmt;

use podsim_collectives::{ChipStatus, Fingerprint};
use podsim_topology::{ChipId, Link};
use serde::{Deserialize, Serialize};

use crate::faults::FaultEvent;

/// Chip ids as inclusive ranges, ascending: compact for the contiguous blocks a worker owns.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ranges(pub Vec<(ChipId, ChipId)>);

impl Ranges {
    /// From ids in any order (duplicates allowed).
    pub fn from_ids(ids: impl IntoIterator<Item = ChipId>) -> Ranges {
        let mut ids: Vec<ChipId> = ids.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        let mut out: Vec<(ChipId, ChipId)> = Vec::new();
        for id in ids {
            match out.last_mut() {
                Some((_, last)) if *last + 1 == id => *last = id,
                _ => out.push((id, id)),
            }
        }
        Ranges(out)
    }

    pub fn count(&self) -> u64 {
        self.0.iter().map(|(a, b)| u64::from(b - a) + 1).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, id: ChipId) -> bool {
        let i = self.0.partition_point(|(_, last)| *last < id);
        self.0.get(i).is_some_and(|(first, _)| *first <= id)
    }

    /// The union with `other`.
    pub fn union(&self, other: &Ranges) -> Ranges {
        let mut all: Vec<(ChipId, ChipId)> = self.0.iter().chain(&other.0).copied().collect();
        all.sort_unstable();
        let mut out: Vec<(ChipId, ChipId)> = Vec::new();
        for (a, b) in all {
            match out.last_mut() {
                Some((_, last)) if a <= last.saturating_add(1) => *last = (*last).max(b),
                _ => out.push((a, b)),
            }
        }
        Ranges(out)
    }

    /// Without `id`.
    pub fn without(&self, id: ChipId) -> Ranges {
        let mut out = Vec::with_capacity(self.0.len() + 1);
        for &(a, b) in &self.0 {
            if id < a || id > b {
                out.push((a, b));
                continue;
            }
            if a < id {
                out.push((a, id - 1));
            }
            if id < b {
                out.push((id + 1, b));
            }
        }
        Ranges(out)
    }
}

/// `0-19999, 20001-32767`; past eight ranges, `and N more ranges`.
impl fmt::Display for Ranges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = 8;
        for (i, (a, b)) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if a == b {
                write!(f, "{a}")?;
            } else {
                write!(f, "{a}-{b}")?;
            }
        }
        if self.0.len() > SHOWN {
            write!(f, " and {} more ranges", self.0.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// A quiet chip that waits on no one: a candidate culprit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Root {
    pub status: ChipStatus,
    /// Wall time (ns) its progress last moved.
    pub quiet_since_wall_ns: u64,
    /// Waiting chips of this worker whose waits lead to it.
    pub local_waiters: u32,
    /// One chip of this worker that waits on it directly, the link it waits on and the
    /// collective it waits in.
    pub first_waiter: Option<(ChipId, Link, Fingerprint)>,
}

/// A stuck chip's wait on one link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Wait {
    pub waiter: ChipId,
    /// The link as the waiter names it.
    pub link: Link,
    pub peer: ChipId,
    /// Messages that reached the waiter on that link (taken, or waiting to be taken).
    pub received: u64,
    pub fingerprint: Fingerprint,
    pub since_wall_ns: u64,
    /// This receive has waited the whole timeout, on a host that keeps up.
    pub stuck: bool,
}

/// One worker's heartbeat view of its chips.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The worker's chips.
    pub chips: Ranges,
    /// Chips whose progress moved since the previous heartbeat.
    pub moving: u32,
    /// Chips that wait and are not excused by live work on this worker.
    pub waiting: Ranges,
    /// Quiet chips waiting on no one, most waited-on first (at most `MAX_ROOTS`).
    pub roots: Vec<Root>,
    /// Waits of waiting chips on other workers' chips, one per (peer, link).
    pub remote: Vec<Wait>,
    /// Waits of stuck chips on a chip of this worker that sent more on the link than the
    /// waiter received, with that send count.
    pub lost: Vec<(Wait, u64)>,
    /// Send counters `(chip, link slot, sent)` of stuck or root chips on links that leave the
    /// worker, new or changed since the previous heartbeat.
    pub boundary_sent: Vec<(ChipId, u8, u64)>,
    /// The stuck chip quiet the longest, with the wall time it went quiet.
    pub oldest: Option<(ChipId, u64)>,
    /// Training step (or script iteration) of the slowest chip.
    pub step: u64,
    /// The executor's scheduling lag at this heartbeat, ms.
    pub lag_ms: u64,
    /// The share (0 to 1) of the time since the previous heartbeat that the executor's
    /// busiest thread spent ready to run without a CPU (filled in by the session;
    /// `podsim_collectives::CpuWaitMeter`): how much the host held its chips up.
    #[serde(default)]
    pub cpu_wait_share: f64,
    /// Lost messages suspected and roots to come (chips waiting on no one, not yet judged):
    /// while any is left, the chips' waits may still end at a root or a lost message, so no
    /// deadlock is called.
    pub suspected: u32,
    /// Per neighbouring worker: messages this worker handed to the transport for it, and
    /// messages received from it (filled in by the session, which owns the transport).
    #[serde(default)]
    pub transport: Vec<(u32, u64, u64)>,
}

/// What a heartbeat carries: the worker's summary of its chips (a worker's `Summariser` makes it), the
/// waits of its chips for straggler accounting (small workers only) and the faults fired so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatStatus {
    pub summary: Summary,
    /// Workers of at most `STRAGGLER_WAITS_CHIPS` chips: every waiting chip and the chips it
    /// waits on, right now (how long each chip holds the others up names stragglers).
    #[serde(default)]
    pub waits: Vec<(u32, Vec<u32>)>,
    pub faults: Vec<FaultEvent>,
}

/// Up to this many chips a worker's heartbeats list every wait (for stragglers); above it they
/// carry the summary alone.
pub const STRAGGLER_WAITS_CHIPS: usize = 2500;

/// How long a chip may stay busy in its program's own code while peers wait on it before it
/// is a hang, ms: NCCL's default timeout (10 minutes). A kernel or a rank's host work that
/// long is rare; a loop that never ends is otherwise never told.
pub const DEFAULT_BUSY_MS: u64 = 600_000;

/// The watchdog's heartbeat interval and hang timeout, ms, for a worker hosting
/// `chips_per_worker` chips: the one place these defaults are written (configs, `podsim
/// bench` and a job description without them all take them from here).
pub fn watchdog_defaults(chips_per_worker: u32) -> (u64, u64) {
    // A heartbeat is a bounded summary, but building it reads every chip's recorder: one
    // every 100 ms up to 10,000 chips a worker, then less often (500 ms at 50,000).
    let heartbeat = (u64::from(chips_per_worker) / 100).clamp(100, 500);
    // The worker excuses waits on live local work itself (a chip waiting on a neighbour that
    // moves is not quiet in that sense), so the timeout need not grow with chips either.
    (heartbeat, 2000)
}
