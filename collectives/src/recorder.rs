//! The flight recorder: each chip's ring buffer of its last collectives (sequence number,
//! fingerprint, state, virtual and wall start and end) and a live view of what it is doing
//! right now: the receives it is blocked on (link, tag, peer chip), whether it is computing,
//! and counters of messages per link. Heartbeats carry the live view; on a hang the whole
//! recorder is dumped for the diagnosis.
//!
//! Per-message bookkeeping takes no lock and no locked instruction: the counters have one
//! writer, the chip's own task, so a plain load and store updates them (the heartbeat reader
//! only loads). The receives a chip is blocked on are not copied here at all: they are the
//! records its [`Inbox`] keeps of the receives parked on it, read when a heartbeat asks.
//! Collectives starting and finishing take the recorder's lock, once per collective.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use podsim_topology::{ChipId, Link, Pod};
use serde::{Deserialize, Serialize};

use crate::fabric::{Blocked, Inbox, LINK_SLOTS, link_slot};
use crate::fingerprint::Fingerprint;
use crate::wall::{coarse_wall_ns, wall_ns};

/// Adds `n` to a counter that only its chip's task writes (readers only load it): a load and
/// a store instead of a locked read-modify-write, which at ten million messages a second is
/// a real share of the cost of a message.
pub(crate) fn add_own(counter: &AtomicU64, n: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// Collectives a recorder keeps by default.
pub const DEFAULT_CAPACITY: usize = 2000;

/// A collective's state. (There is no separate "scheduled" state: a chip starts a collective
/// the moment its program calls it; waiting for peers shows as `blocked` while started.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpState {
    Started,
    Completed,
}

/// One collective in the recorder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordEntry {
    /// Per-chip running number of the collective (all groups).
    pub index: u64,
    pub fingerprint: Fingerprint,
    pub state: OpState,
    pub virtual_start_ns: f64,
    pub virtual_end_ns: Option<f64>,
    pub wall_start_ns: u64,
    pub wall_end_ns: Option<u64>,
}

/// Whether the counters of `waiter`'s `link` can tell if the message it waits for from
/// `peer` was sent: only when `peer` is the chip at the link's far end. A point-to-point
/// message forwarded further (a pipeline stage's send two axes away leaves on the same link)
/// is counted nowhere; a collective's message to a chip two hops along a strided group is
/// counted on the link, but so are the messages of the groups between them (the neighbour's
/// own), so the sender's count and the waiter's no longer describe the same messages: a
/// mesh of tensor-parallel pairs every second chip was once called a lost message so. Such
/// waits lead to a stalled chip instead.
pub fn counters_judge_wait(pod: &Pod, waiter: ChipId, link: Link, peer: ChipId) -> bool {
    point_to_point_counted(pod, waiter, link, peer)
}

/// Whether a point-to-point message between `me` and `other` counts on `me`'s `link`: only
/// when `other` is the chip at the link's far end (see [`counters_judge_wait`]).
pub(crate) fn point_to_point_counted(pod: &Pod, me: ChipId, link: Link, other: ChipId) -> bool {
    pod.peer(me, link) == Some(other)
}

/// A chip at a glance: what a heartbeat reads of every chip each time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Glance {
    /// The progress counter (see [`ChipStatus::progress`]).
    pub progress: u64,
    /// Receives it waits on.
    pub blocked: usize,
    /// Since when (wall ns) the oldest of them waits.
    pub blocked_since_wall_ns: Option<u64>,
    /// Inside a compute kernel.
    pub computing: bool,
    /// Its executor polled it, it did all it could, and nothing has woken it since (see
    /// [`RunState`]): not a chip waiting for its turn on a busy host.
    pub idle: bool,
    /// Training step or script iteration.
    pub step: u64,
}

/// What a chip is doing now (a heartbeat's view of it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChipStatus {
    pub chip: ChipId,
    /// Bumped by every message sent or received, every collective started or finished and
    /// every compute kernel: a chip whose counter moves is alive and working.
    pub progress: u64,
    /// Collectives completed.
    pub completed: u64,
    /// The collective in progress, if any.
    pub current: Option<RecordEntry>,
    pub blocked: Vec<Blocked>,
    /// Wall time a compute kernel started, while one runs.
    pub computing_since_ns: Option<u64>,
    /// Training step or script iteration the chip is in.
    pub step: u64,
    /// Messages sent and received (taken by a receive) per link slot (which: see
    /// [`counters_judge_wait`]).
    pub sent: Vec<u64>,
    pub received: Vec<u64>,
    /// Messages arrived per link slot and not taken yet: a sender's count ahead of
    /// `received + pending` on a link is a message in flight, or lost.
    #[serde(default)]
    pub pending: Vec<u64>,
    /// See [`Glance::idle`].
    #[serde(default)]
    pub idle: bool,
    /// How the program driving the chip ended, once it has (a PyTorch rank that exited while
    /// its peers still call collectives): a chip nobody drives any more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended: Option<String>,
}

#[derive(Debug)]
struct Inner {
    entries: VecDeque<RecordEntry>,
    computing_since_ns: Option<u64>,
    next_index: u64,
    completed: u64,
    step: u64,
    host_stack: Vec<String>,
    ended: Option<String>,
}

/// A chip's flight recorder.
#[derive(Debug)]
pub struct FlightRecorder {
    chip: ChipId,
    capacity: usize,
    /// The chip's inbox: it holds the records of the receives the chip is blocked on.
    inbox: Arc<Inbox>,
    inner: Mutex<Inner>,
    progress: AtomicU64,
    sent: [AtomicU64; LINK_SLOTS],
    received: [AtomicU64; LINK_SLOTS],
    /// Wall time spent blocked in receives, in all, ns.
    waited_ns: AtomicU64,
    /// Wall clock and `waited_ns` at the last send.
    last_send_ns: AtomicU64,
    waited_at_last_send: AtomicU64,
    /// Where the chip's executor has it ([`RunState`] as a byte).
    run_state: AtomicU8,
}

/// Where a chip's executor has it. Only an executor that reports it sets it: a chip run any
/// other way stays `Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RunState {
    Unknown = 0,
    /// Woken, waiting for its thread.
    Runnable = 1,
    /// Being polled.
    Polling = 2,
    /// Its last poll returned pending and nothing has woken it since: it waits for a wake-up
    /// (a message, a timer), not for a thread.
    Idle = 3,
    /// Its program has finished.
    Done = 4,
}

impl FlightRecorder {
    /// The recorder of chip `chip`, which receives from `inbox`, keeping its last `capacity`
    /// collectives.
    pub fn new(chip: ChipId, capacity: usize, inbox: Arc<Inbox>) -> FlightRecorder {
        FlightRecorder {
            chip,
            capacity: capacity.max(1),
            inbox,
            inner: Mutex::new(Inner {
                entries: VecDeque::new(),
                computing_since_ns: None,
                next_index: 0,
                completed: 0,
                step: 0,
                host_stack: Vec::new(),
                ended: None,
            }),
            progress: AtomicU64::new(0),
            sent: Default::default(),
            received: Default::default(),
            waited_ns: AtomicU64::new(0),
            last_send_ns: AtomicU64::new(coarse_wall_ns()),
            run_state: AtomicU8::new(RunState::Unknown as u8),
            waited_at_last_send: AtomicU64::new(0),
        }
    }

    /// Wall time since the chip's last send that it spent on its own work (not blocked on a
    /// receive): what a slower chip would take longer over.
    pub fn busy_since_last_send(&self) -> std::time::Duration {
        let at = self.last_send_ns.load(Ordering::Relaxed);
        let waited_then = self.waited_at_last_send.load(Ordering::Relaxed);
        let waited = self
            .waited_ns
            .load(Ordering::Relaxed)
            .saturating_sub(waited_then);
        std::time::Duration::from_nanos(coarse_wall_ns().saturating_sub(at).saturating_sub(waited))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn bump(&self) {
        add_own(&self.progress, 1);
    }

    /// A collective starts; returns its per-chip index.
    pub fn started(&self, fingerprint: Fingerprint, virtual_ns: f64) -> u64 {
        self.bump();
        let mut g = self.lock();
        let index = g.next_index;
        g.next_index += 1;
        if g.entries.len() == self.capacity {
            g.entries.pop_front();
        }
        g.entries.push_back(RecordEntry {
            index,
            fingerprint,
            state: OpState::Started,
            virtual_start_ns: virtual_ns,
            virtual_end_ns: None,
            wall_start_ns: wall_ns(),
            wall_end_ns: None,
        });
        index
    }

    /// Collectives started so far (the index the next one gets).
    pub fn started_count(&self) -> u64 {
        self.lock().next_index
    }

    /// The collective `index` finished.
    pub fn completed(&self, index: u64, virtual_ns: f64) {
        self.bump();
        let mut g = self.lock();
        g.completed += 1;
        if let Some(e) = g.entries.iter_mut().rev().find(|e| e.index == index) {
            e.state = OpState::Completed;
            e.virtual_end_ns = Some(virtual_ns);
            e.wall_end_ns = Some(wall_ns());
        }
    }

    pub fn sent(&self, link: Link) {
        add_own(&self.sent[link_slot(link)], 1);
        self.last_send_ns.store(coarse_wall_ns(), Ordering::Relaxed);
        self.waited_at_last_send
            .store(self.waited_ns.load(Ordering::Relaxed), Ordering::Relaxed);
        self.bump();
    }

    /// A message arrived on `link` (counted there when `counted`: see [`counters_judge_wait`]);
    /// `blocked_since` is when the receive started waiting for it (wall ns), if it had to.
    pub fn received(&self, link: Link, counted: bool, blocked_since: Option<u64>) {
        if counted {
            add_own(&self.received[link_slot(link)], 1);
        }
        if let Some(since) = blocked_since {
            add_own(&self.waited_ns, coarse_wall_ns().saturating_sub(since));
        }
        self.bump();
    }

    pub fn compute_started(&self) {
        self.bump();
        self.lock().computing_since_ns = Some(wall_ns());
    }

    pub fn compute_finished(&self) {
        self.bump();
        self.lock().computing_since_ns = None;
    }

    /// The program moved to training step or script iteration `step`.
    pub fn set_step(&self, step: u64) {
        self.bump();
        self.lock().step = step;
    }

    /// Where the program driving the chip is in its own code while the chip is outside a
    /// collective (a PyTorch rank's Python stack, innermost frame last), for a diagnosis that
    /// names the line a stalled program sits on. Empty: not known.
    pub fn set_host_stack(&self, frames: Vec<String>) {
        self.lock().host_stack = frames;
    }

    pub fn host_stack(&self) -> Vec<String> {
        self.lock().host_stack.clone()
    }

    /// The program driving the chip ended, `how` (`exited with code 0`): its chip will make
    /// no call again.
    pub fn program_ended(&self, how: String) {
        self.bump();
        let mut g = self.lock();
        g.ended = Some(how);
        // Where it was last sampled is not where it ended: no line rather than a wrong one.
        g.host_stack.clear();
    }

    /// The executor woke the chip.
    pub(crate) fn set_runnable(&self) {
        self.run_state
            .store(RunState::Runnable as u8, Ordering::Release);
    }

    /// The executor is about to poll the chip.
    pub(crate) fn set_polling(&self) {
        self.run_state
            .store(RunState::Polling as u8, Ordering::Release);
    }

    /// The executor's poll returned pending: idle, unless a wake-up came during the poll.
    pub(crate) fn set_idle_unless_woken(&self) {
        let _ = self.run_state.compare_exchange(
            RunState::Polling as u8,
            RunState::Idle as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    pub(crate) fn set_done(&self) {
        self.run_state
            .store(RunState::Done as u8, Ordering::Release);
    }

    fn idle(&self) -> bool {
        self.run_state.load(Ordering::Acquire) == RunState::Idle as u8
    }

    /// What a heartbeat reads of the chip every time (cheap; [`FlightRecorder::status`] is
    /// the whole view).
    pub fn glance(&self) -> Glance {
        let (blocked, blocked_since_wall_ns) = self.inbox.parked();
        let g = self.lock();
        Glance {
            progress: self.progress.load(Ordering::Relaxed),
            blocked,
            blocked_since_wall_ns,
            computing: g.computing_since_ns.is_some(),
            idle: self.idle(),
            step: g.step,
        }
    }

    /// The chip this recorder belongs to.
    pub fn chip(&self) -> ChipId {
        self.chip
    }

    /// The live view for a heartbeat.
    pub fn status(&self) -> ChipStatus {
        let blocked = self.inbox.blocked();
        let pending = self.inbox.pending_per_slot().to_vec();
        let g = self.lock();
        ChipStatus {
            chip: self.chip,
            progress: self.progress.load(Ordering::Relaxed),
            completed: g.completed,
            current: g
                .entries
                .back()
                .filter(|e| e.state != OpState::Completed)
                .cloned(),
            blocked,
            computing_since_ns: g.computing_since_ns,
            step: g.step,
            sent: self
                .sent
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            received: self
                .received
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            pending,
            idle: self.idle(),
            ended: g.ended.clone(),
        }
    }

    /// Every entry still held, oldest first.
    pub fn entries(&self) -> Vec<RecordEntry> {
        self.lock().entries.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use super::*;
    use crate::fabric::Tag;
    use crate::fabric::testing::{expect, message};
    use crate::fingerprint::{DType, OpKind};
    use podsim_topology::Dir;

    fn fp(seq: u64) -> Fingerprint {
        Fingerprint {
            group: 1,
            seq,
            op: OpKind::AllReduce,
            dtype: DType::F32,
            count: 4,
            reduce: None,
        }
    }

    #[test]
    fn keeps_the_last_entries_and_the_live_view() {
        let inbox = Arc::new(Inbox::new());
        let r = FlightRecorder::new(7, 3, inbox.clone());
        for seq in 0..5 {
            let i = r.started(fp(seq), seq as f64);
            r.completed(i, seq as f64 + 0.5);
        }
        let kept: Vec<u64> = r.entries().iter().map(|e| e.fingerprint.seq).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        assert!(r.entries().iter().all(|e| e.state == OpState::Completed));
        let link = Link::ici(0, Dir::Plus);
        let tag = Tag {
            lane: 0,
            phase: 0,
            step: 1,
        };
        r.started(fp(5), 9.0);
        let want = expect(7, 3, link, fp(5), tag);
        let mut cx = Context::from_waker(Waker::noop());
        // A receive that finds nothing parks, and the chip shows as blocked on it.
        let mut recv = std::pin::pin!(inbox.receive(want));
        assert!(recv.as_mut().poll(&mut cx).is_pending());
        let s = r.status();
        assert_eq!((s.chip, s.completed, s.blocked.len()), (7, 5, 1));
        assert_eq!((s.blocked[0].peer, s.blocked[0].tag), (3, tag));
        assert_eq!(s.current.map(|e| e.fingerprint.seq), Some(5));
        assert_eq!(r.glance().blocked, 1);
        inbox.push(message(3, 7, link.reverse(0), fp(5), tag));
        // Blocked until the chip takes the message.
        assert_eq!(r.status().blocked.len(), 1);
        let Poll::Ready(Ok((msg, since))) = recv.as_mut().poll(&mut cx) else {
            panic!("the message is there");
        };
        assert_eq!(msg.src, 3);
        assert!(since.is_some(), "it had to wait");
        r.received(link, true, since);
        let s = r.status();
        assert!(s.blocked.is_empty());
        assert_eq!(s.received[link_slot(link)], 1);
    }

    #[test]
    fn counters_judge_waits_between_a_links_two_ends_and_collectives() {
        let pod = Pod::single("4x4".parse().unwrap());
        let plus_x = Link::Ici {
            axis: 0,
            dir: podsim_topology::Dir::Plus,
        };
        // Chip 0's +x neighbour is 1; 5 is across two axes, 2 two along x (a collective's
        // strided route reaches it, but chip 1's messages to 2 share the link).
        let minus_x = plus_x.reverse(0);
        assert!(counters_judge_wait(&pod, 1, minus_x, 0));
        assert!(!counters_judge_wait(&pod, 5, minus_x, 0));
        assert!(!counters_judge_wait(&pod, 2, minus_x, 0));
    }

    #[test]
    fn a_dropped_receive_is_no_longer_blocked() {
        let inbox = Arc::new(Inbox::new());
        let r = FlightRecorder::new(0, 4, inbox.clone());
        let link = Link::ici(1, Dir::Minus);
        let tag = Tag {
            lane: 1,
            phase: 0,
            step: 0,
        };
        let want = expect(0, 1, link, fp(0), tag);
        let mut cx = Context::from_waker(Waker::noop());
        {
            let mut recv = std::pin::pin!(inbox.receive(want));
            assert!(recv.as_mut().poll(&mut cx).is_pending());
            assert_eq!(r.glance().blocked, 1);
        }
        assert_eq!(r.glance().blocked, 0);
        assert!(r.status().blocked.is_empty());
    }
}
