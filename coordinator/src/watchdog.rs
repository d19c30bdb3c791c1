//! The hang watchdog and its diagnosis, as pure logic over heartbeats (no I/O: the launcher
//! feeds it and acts on what it finds).
//!
//! Every heartbeat carries each chip's progress counter, the receives it is blocked on (link,
//! tag, peer) and its per-link message counters. A chip whose counter has not moved for the
//! timeout is *stale*. A hang is a stale chip that waits, all of whose transitive waits end
//! on stale chips too; then the wait-for graph names the root:
//! - a stale chip that waits on no one (and is not inside a kernel): `stalled_chip`;
//! - everyone waits, and a peer's send counter on a link is ahead of the waiting receiver's
//!   receive counter on it: the message was lost on that link (`lost_message`), or, when
//!   several links between the same groups of workers lost messages, `partition`;
//! - a worker that sends no heartbeats while its process lives: `frozen_worker`.
//!
//! Dead workers and desyncs are reported by the launcher as they happen.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use podsim_collectives::{ChipStatus, link_slot, wall_ns};
use podsim_topology::{ChipId, Link, Pod};
use podsim_worker::faults::FaultEvent;
use podsim_worker::job::HeartbeatStatus;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HangKind {
    StalledChip,
    DeadWorker,
    FrozenWorker,
    LostMessage,
    Desync,
    Partition,
    /// Not a hang: a link that flips bits, caught by debug-mode checksums (a job error).
    Corrupt,
}

impl HangKind {
    pub fn exit_code(self) -> u8 {
        match self {
            HangKind::Desync => 4,
            HangKind::Corrupt => 1,
            _ => 3,
        }
    }
}

/// What the watchdog found.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    pub kind: HangKind,
    pub chip: Option<ChipId>,
    pub worker: Option<u32>,
    /// The link at fault, named from its sending chip.
    pub link: Option<Link>,
    pub seq: Option<u64>,
    pub op: Option<String>,
    pub waiting: Vec<ChipId>,
    pub explanation: String,
    /// When the fault took effect as far as the heartbeats tell (wall ns); a fault event
    /// reported by the workers, when there is one, is more exact.
    pub effect_wall_ns: u64,
}

#[derive(Debug)]
struct Seen {
    status: ChipStatus,
    worker: u32,
    changed: Instant,
    changed_wall_ns: u64,
}

#[derive(Debug)]
pub struct Watchdog {
    timeout: Duration,
    heartbeat: Duration,
    pod: Pod,
    chips: BTreeMap<ChipId, Seen>,
    workers: BTreeMap<u32, (Instant, u64)>,
    /// When any chip of each worker last made progress. A worker whose host is busy with
    /// tens of thousands of other chips may leave one unscheduled for longer than the
    /// timeout; that is a slow job, not a hang.
    worker_progress: BTreeMap<u32, Instant>,
    finished: BTreeSet<u32>,
    faults: Vec<FaultEvent>,
    /// How long each chip held others up: peers waited on it while it waited on no one.
    waited_on: BTreeMap<ChipId, Duration>,
    /// Every chip ever heard of.
    seen: BTreeSet<ChipId>,
    first_tick: Option<Instant>,
    last_tick: Option<Instant>,
}

/// A chip that was slow but kept making progress.
#[derive(Debug, Clone, Serialize)]
pub struct Straggler {
    pub chip: ChipId,
    /// Time its peers spent waiting on it while it waited on no one, ms (sampled at every
    /// heartbeat).
    pub waited_on_ms: f64,
    /// That time over the median chip's (at least 1 ms): how much more it held the job up.
    pub slowdown: f64,
}

impl Watchdog {
    pub fn new(pod: Pod, timeout: Duration, heartbeat: Duration) -> Watchdog {
        Watchdog {
            timeout,
            heartbeat,
            pod,
            chips: BTreeMap::new(),
            workers: BTreeMap::new(),
            worker_progress: BTreeMap::new(),
            finished: BTreeSet::new(),
            faults: Vec::new(),
            waited_on: BTreeMap::new(),
            seen: BTreeSet::new(),
            first_tick: None,
            last_tick: None,
        }
    }

    /// The job starts: from now on every worker owes heartbeats.
    pub fn start(&mut self, workers: impl IntoIterator<Item = u32>, now: Instant) {
        for w in workers {
            self.workers.entry(w).or_insert((now, wall_ns()));
        }
    }

    /// Faults a worker reports as fired (once each).
    pub fn faults_fired(&mut self, events: &[FaultEvent]) {
        for f in events {
            if !self.faults.iter().any(|g| g.fault == f.fault) {
                self.faults.push(f.clone());
            }
        }
    }

    pub fn heartbeat(&mut self, worker: u32, hb: HeartbeatStatus, now: Instant) {
        let wall = wall_ns();
        self.workers.insert(worker, (now, wall));
        self.faults_fired(&hb.faults);
        if !hb.moved.is_empty() {
            self.worker_progress.insert(worker, now);
        }
        for chip in hb.moved {
            // Moving: not hung, and whatever it last waited on is over.
            let seen = self.chips.entry(chip).or_insert_with(|| Seen {
                status: ChipStatus {
                    chip,
                    ..ChipStatus::default()
                },
                worker,
                changed: now,
                changed_wall_ns: wall,
            });
            seen.changed = now;
            seen.changed_wall_ns = wall;
            seen.status.blocked.clear();
            seen.status.computing_since_ns = None;
        }
        for status in hb.chips {
            match self.chips.get_mut(&status.chip) {
                Some(seen) if seen.status.progress == status.progress => seen.status = status,
                _ => {
                    self.worker_progress.insert(worker, now);
                    self.chips.insert(
                        status.chip,
                        Seen {
                            status,
                            worker,
                            changed: now,
                            changed_wall_ns: wall_ns(),
                        },
                    );
                }
            }
        }
    }

    /// Worker `id` delivered its results: it no longer heartbeats and nobody waits on it.
    pub fn finished(&mut self, worker: u32) {
        self.finished.insert(worker);
        self.chips.retain(|_, s| s.worker != worker);
    }

    pub fn faults(&self) -> &[FaultEvent] {
        &self.faults
    }

    /// The step every chip has reached (the slowest chip's current step).
    pub fn step_reached(&self) -> u64 {
        self.chips
            .values()
            .map(|s| s.status.step)
            .min()
            .unwrap_or(0)
    }

    /// The last heartbeat of `worker` (wall ns), if any.
    pub fn last_heard(&self, worker: u32) -> Option<u64> {
        self.workers.get(&worker).map(|w| w.1)
    }

    /// Chips whose status shows them waiting right now (for a dead worker's report).
    pub fn waiting_chips(&self) -> Vec<ChipId> {
        self.chips
            .iter()
            .filter(|(_, s)| !s.status.blocked.is_empty())
            .map(|(c, _)| *c)
            .collect()
    }

    /// The chip a worker's chips were in, for reports on a dead worker.
    pub fn current_of(&self, worker: u32) -> Option<(ChipId, u64, String)> {
        self.chips
            .iter()
            .filter(|(_, s)| s.worker == worker)
            .find_map(|(c, s)| {
                s.status
                    .current
                    .as_ref()
                    .map(|e| (*c, e.fingerprint.seq, e.fingerprint.op.to_string()))
            })
    }

    /// Chips that held others up for a large share of the run: while peers waited on them
    /// they were not waiting themselves (working, or slow to send).
    pub fn stragglers(&self) -> Vec<Straggler> {
        let run = self
            .first_tick
            .zip(self.last_tick)
            .map_or(0.0, |(a, b)| b.duration_since(a).as_secs_f64() * 1e3);
        let mut held: Vec<f64> = self
            .seen
            .iter()
            .map(|c| self.waited_on.get(c).map_or(0.0, |d| d.as_secs_f64() * 1e3))
            .collect();
        held.sort_by(f64::total_cmp);
        let median = held.get(held.len() / 2).copied().unwrap_or(0.0).max(1.0);
        self.waited_on
            .iter()
            .map(|(c, d)| (*c, d.as_secs_f64() * 1e3))
            // Sampled at heartbeats: a few samples are noise, not evidence.
            .filter(|(_, ms)| {
                *ms > 3.0 * median
                    && *ms > 0.2 * run
                    && *ms >= 3.5 * self.heartbeat.as_secs_f64() * 1e3
            })
            .map(|(chip, ms)| Straggler {
                chip,
                waited_on_ms: ms,
                slowdown: ms / median,
            })
            .collect()
    }

    fn stale(&self, s: &Seen, now: Instant) -> bool {
        let quiet = now.duration_since(s.changed) >= self.timeout;
        // A chip inside a long kernel is judged against a longer bound.
        match s.status.computing_since_ns {
            Some(_) => now.duration_since(s.changed) >= 5 * self.timeout,
            None => quiet,
        }
    }

    /// Looks for a hang now.
    pub fn check(&mut self, now: Instant) -> Option<Finding> {
        // Waiting time, for stragglers.
        if let Some(last) = self.last_tick {
            let dt = now.duration_since(last);
            let targets: BTreeSet<ChipId> = self
                .chips
                .values()
                .flat_map(|s| s.status.blocked.iter().map(|b| b.peer))
                .filter(|t| {
                    self.chips
                        .get(t)
                        .is_some_and(|s| s.status.blocked.is_empty())
                })
                .collect();
            for t in targets {
                *self.waited_on.entry(t).or_default() += dt;
            }
        }
        self.seen.extend(self.chips.keys());
        self.first_tick.get_or_insert(now);
        self.last_tick = Some(now);
        for (&w, &(at, wall)) in &self.workers {
            if !self.finished.contains(&w) && now.duration_since(at) >= self.timeout {
                return Some(self.frozen(w, now.duration_since(at), wall));
            }
        }
        let stale: BTreeSet<ChipId> = self
            .chips
            .iter()
            .filter(|(_, s)| self.stale(s, now))
            .map(|(c, _)| *c)
            .collect();
        for (&c, s) in &self.chips {
            if s.status.blocked.is_empty() || !stale.contains(&c) {
                continue;
            }
            let closure = self.closure(c);
            // A busy host excuses the wait for at most five timeouts: chips of a worker that
            // never sync with the stuck one must not hide it for the rest of the job.
            let host_busy = now.duration_since(s.changed) < 5 * self.timeout
                && closure
                    .iter()
                    .filter_map(|x| self.chips.get(x).map(|s| s.worker))
                    .filter_map(|w| self.worker_progress.get(&w))
                    .any(|t| now.duration_since(*t) < self.timeout);
            if !host_busy
                && closure
                    .iter()
                    .all(|x| stale.contains(x) || !self.chips.contains_key(x))
            {
                // Chips of a worker whose heartbeats stopped look stuck too: name the worker.
                let late = (5 * self.heartbeat).max(self.timeout / 2);
                let silent = closure
                    .iter()
                    .filter_map(|x| self.chips.get(x).map(|s| s.worker))
                    .filter_map(|w| self.workers.get(&w).map(|h| (w, *h)))
                    .find(|(_, (at, _))| now.duration_since(*at) >= late);
                if let Some((w, (at, wall))) = silent {
                    return Some(self.frozen(w, now.duration_since(at), wall));
                }
                return Some(self.diagnose(&closure));
            }
        }
        None
    }

    /// Every chip `c` waits on, transitively (itself included).
    fn closure(&self, c: ChipId) -> BTreeSet<ChipId> {
        let mut seen = BTreeSet::from([c]);
        let mut queue = VecDeque::from([c]);
        while let Some(x) = queue.pop_front() {
            if let Some(s) = self.chips.get(&x) {
                for b in &s.status.blocked {
                    if seen.insert(b.peer) {
                        queue.push_back(b.peer);
                    }
                }
            }
        }
        seen
    }

    fn describe_chip(&self, c: ChipId) -> String {
        let worker = self
            .chips
            .get(&c)
            .map_or(String::from("?"), |s| s.worker.to_string());
        format!(
            "chip {c} (coordinates {:?}, worker {worker})",
            self.pod.coord(c)
        )
    }

    fn frozen(&self, w: u32, quiet: Duration, last_wall: u64) -> Finding {
        let chips: Vec<ChipId> = self
            .chips
            .iter()
            .filter(|(_, s)| s.worker == w)
            .map(|(c, _)| *c)
            .collect();
        let current = self.current_of(w);
        Finding {
            kind: HangKind::FrozenWorker,
            chip: chips.first().copied(),
            worker: Some(w),
            link: None,
            seq: current.as_ref().map(|c| c.1),
            op: current.map(|c| c.2),
            waiting: self
                .waiting_chips()
                .into_iter()
                .filter(|c| !chips.contains(c))
                .collect(),
            explanation: format!(
                "Worker {w} is alive but has sent no heartbeat for {:.1} s, so its chips {chips:?} make no progress: the process is stopped or frozen (e.g. SIGSTOP); resume it with kill -CONT or kill it.",
                quiet.as_secs_f64()
            ),
            effect_wall_ns: last_wall,
        }
    }

    fn diagnose(&self, closure: &BTreeSet<ChipId>) -> Finding {
        let waiting: Vec<ChipId> = closure
            .iter()
            .copied()
            .filter(|c| {
                self.chips
                    .get(c)
                    .is_some_and(|s| !s.status.blocked.is_empty())
            })
            .collect();
        // Roots: chips in the closure that wait on no one.
        let mut roots: Vec<(usize, ChipId)> = closure
            .iter()
            .filter(|c| {
                self.chips
                    .get(c)
                    .is_some_and(|s| s.status.blocked.is_empty())
            })
            .map(|&c| {
                let waiters = self
                    .chips
                    .values()
                    .filter(|s| s.status.blocked.iter().any(|b| b.peer == c))
                    .count();
                (waiters, c)
            })
            .collect();
        roots.sort_by(|a, b| b.cmp(a));
        if let Some(&(_, root)) = roots.first() {
            let s = &self.chips[&root];
            // The collective at fault: the root's own, or the one its waiters are in.
            let waited = self
                .chips
                .values()
                .flat_map(|w| w.status.blocked.iter())
                .find(|b| b.peer == root)
                .map(|b| b.fingerprint);
            let current = s.status.current.as_ref();
            let fp = current.map(|e| e.fingerprint).or(waited);
            let what = current.map_or("between collectives".to_string(), |e| {
                format!("in {}", e.fingerprint)
            });
            return Finding {
                kind: HangKind::StalledChip,
                chip: Some(root),
                worker: Some(s.worker),
                link: None,
                seq: fp.map(|f| f.seq),
                op: fp.map(|f| f.op.to_string()),
                waiting: waiting.clone(),
                explanation: format!(
                    "{} stopped making progress at step {} {what} without waiting on any peer, and {} chips wait on it: look at what that chip's program is doing (a stuck kernel, a lock, host code).",
                    self.describe_chip(root),
                    s.status.step,
                    waiting.len()
                ),
                effect_wall_ns: s.changed_wall_ns,
            };
        }
        // Everyone waits: find receives whose message the sender did send.
        let mut lost: Vec<(ChipId, Link, ChipId, u64)> = Vec::new();
        for &a in closure {
            let Some(sa) = self.chips.get(&a) else {
                continue;
            };
            for b in &sa.status.blocked {
                let Some(sb) = self.chips.get(&b.peer) else {
                    continue;
                };
                let sender_link = b.link.reverse(self.pod.slice_of(a));
                let sent = sb
                    .status
                    .sent
                    .get(link_slot(sender_link))
                    .copied()
                    .unwrap_or(0);
                let got = sa
                    .status
                    .received
                    .get(link_slot(b.link))
                    .copied()
                    .unwrap_or(0);
                if sent > got {
                    lost.push((b.peer, sender_link, a, b.since_wall_ns));
                }
            }
        }
        let worker = |c: ChipId| self.chips.get(&c).map_or(u32::MAX, |s| s.worker);
        let pairs: BTreeSet<(u32, u32)> = lost
            .iter()
            .map(|(s, _, d, _)| (worker(*s).min(worker(*d)), worker(*s).max(worker(*d))))
            .collect();
        let links: BTreeSet<(ChipId, Link)> = lost.iter().map(|(s, l, _, _)| (*s, *l)).collect();
        let since = lost.iter().map(|l| l.3).min().unwrap_or_else(wall_ns);
        if links.len() >= 2 && pairs.iter().all(|(a, b)| a != b) {
            let (first, ..) = lost[0];
            let fp = self.chips[&first]
                .status
                .current
                .as_ref()
                .map(|e| e.fingerprint);
            return Finding {
                kind: HangKind::Partition,
                chip: Some(first),
                worker: Some(worker(first)),
                link: Some(lost[0].1),
                seq: fp.map(|f| f.seq),
                op: fp.map(|f| f.op.to_string()),
                waiting,
                explanation: format!(
                    "Workers are cut apart: messages sent on {} links between worker pairs {pairs:?} never arrived and every chip on both sides waits; check the network between those workers.",
                    links.len()
                ),
                effect_wall_ns: since,
            };
        }
        if let Some(&(src, link, dst, since)) = lost.first() {
            let fp = self.chips[&dst]
                .status
                .blocked
                .iter()
                .find(|b| b.peer == src)
                .map(|b| b.fingerprint);
            return Finding {
                kind: HangKind::LostMessage,
                chip: Some(src),
                worker: Some(worker(src)),
                link: Some(link),
                seq: fp.map(|f| f.seq),
                op: fp.map(|f| f.op.to_string()),
                waiting,
                explanation: format!(
                    "{} sent its message of {} on link {link} to chip {dst}, which never received it and waits for it: the link lost a message (worker {} to worker {}); check that link's transport.",
                    self.describe_chip(src),
                    fp.map_or("the collective".to_string(), |f| f.to_string()),
                    worker(src),
                    worker(dst)
                ),
                effect_wall_ns: since,
            };
        }
        // A cycle with nothing lost: the oldest quiet chip.
        let oldest = closure
            .iter()
            .filter_map(|c| self.chips.get(c).map(|s| (s.changed, *c)))
            .min()
            .map_or(0, |x| x.1);
        let s = self.chips.get(&oldest);
        Finding {
            kind: HangKind::StalledChip,
            chip: Some(oldest),
            worker: s.map(|s| s.worker),
            link: None,
            seq: s.and_then(|s| s.status.current.as_ref().map(|e| e.fingerprint.seq)),
            op: s.and_then(|s| {
                s.status
                    .current
                    .as_ref()
                    .map(|e| e.fingerprint.op.to_string())
            }),
            waiting,
            explanation: format!(
                "Chips {closure:?} all wait on each other and nothing was lost on the way: a deadlock; {} went quiet first.",
                self.describe_chip(oldest)
            ),
            effect_wall_ns: s.map_or(0, |s| s.changed_wall_ns),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_collectives::{Blocked, DType, Fingerprint, OpKind, Tag};
    use podsim_topology::Dir;

    const T: Duration = Duration::from_millis(100);

    fn fp() -> Fingerprint {
        Fingerprint {
            group: 1,
            seq: 3,
            op: OpKind::AllReduce,
            dtype: DType::F32,
            count: 8,
            reduce: None,
        }
    }

    fn status(chip: ChipId, progress: u64, waits_on: &[(ChipId, Link)]) -> ChipStatus {
        ChipStatus {
            chip,
            progress,
            blocked: waits_on
                .iter()
                .map(|&(peer, link)| Blocked {
                    link,
                    peer,
                    tag: Tag {
                        lane: 0,
                        phase: 0,
                        step: 0,
                    },
                    fingerprint: fp(),
                    since_wall_ns: 0,
                })
                .collect(),
            sent: vec![0; 7],
            received: vec![0; 7],
            ..ChipStatus::default()
        }
    }

    fn watchdog() -> Watchdog {
        Watchdog::new(
            Pod::single("4".parse().unwrap()),
            T,
            Duration::from_millis(10),
        )
    }

    fn beat(w: &mut Watchdog, worker: u32, chips: Vec<ChipStatus>, at: Instant) {
        w.heartbeat(
            worker,
            HeartbeatStatus {
                chips,
                moved: Vec::new(),
                faults: Vec::new(),
            },
            at,
        );
    }

    const PLUS: Link = Link::Ici {
        axis: 0,
        dir: Dir::Plus,
    };
    const MINUS: Link = Link::Ici {
        axis: 0,
        dir: Dir::Minus,
    };

    #[test]
    fn a_quiet_chip_nobody_waits_for_is_not_a_hang_and_progress_is_never_one() {
        let mut w = watchdog();
        let t0 = Instant::now();
        for i in 0..10u64 {
            // Chip 0 waits on chip 1, but chip 1 keeps making progress.
            let at = t0 + T * i as u32;
            beat(
                &mut w,
                0,
                vec![status(0, 1, &[(1, PLUS)]), status(1, i, &[])],
                at,
            );
            assert_eq!(w.check(at), None, "tick {i}");
        }
    }

    #[test]
    fn the_root_of_the_waits_is_the_stalled_chip() {
        let mut w = watchdog();
        let t0 = Instant::now();
        let chips = || {
            vec![
                status(0, 5, &[(1, PLUS)]),
                status(1, 5, &[(2, PLUS)]),
                status(2, 5, &[]),
                status(3, 9, &[]),
            ]
        };
        beat(&mut w, 0, chips(), t0);
        assert_eq!(w.check(t0 + T / 2), None);
        beat(&mut w, 0, chips(), t0 + T * 2);
        let f = w.check(t0 + T * 2).unwrap();
        assert_eq!((f.kind, f.chip), (HangKind::StalledChip, Some(2)));
        assert_eq!(f.waiting, vec![0, 1]);
        assert_eq!(f.seq, Some(3));
    }

    #[test]
    fn a_message_sent_but_never_received_names_the_link() {
        let mut w = watchdog();
        let t0 = Instant::now();
        let mut a = status(0, 5, &[(1, PLUS)]);
        let mut b = status(1, 5, &[(0, MINUS)]);
        // Chip 1 sent 4 messages on its -x link (to chip 0); chip 0 took 3 from its +x link.
        b.sent[link_slot(MINUS)] = 4;
        a.received[link_slot(PLUS)] = 3;
        a.sent[link_slot(PLUS)] = 3;
        b.received[link_slot(MINUS)] = 3;
        beat(&mut w, 0, vec![a, b], t0);
        beat(&mut w, 0, vec![], t0 + T * 2);
        let f = w.check(t0 + T * 2).unwrap();
        assert_eq!(
            (f.kind, f.chip, f.link),
            (HangKind::LostMessage, Some(1), Some(MINUS))
        );
    }

    #[test]
    fn a_worker_that_stops_heartbeating_is_frozen() {
        let mut w = watchdog();
        let t0 = Instant::now();
        w.start([0, 1], t0);
        for i in 0..3u32 {
            beat(
                &mut w,
                0,
                vec![status(0, u64::from(i), &[])],
                t0 + T * i / 2,
            );
        }
        let f = w.check(t0 + T + T / 2).unwrap();
        assert_eq!((f.kind, f.worker), (HangKind::FrozenWorker, Some(1)));
        w.finished(1);
    }
}
