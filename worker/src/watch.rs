//! What a worker tells the watchdog about its chips at each heartbeat: a summary whose size
//! does not grow with the number of chips the worker hosts.
//!
//! The worker sees every one of its chips' flight recorders, so it resolves its own part of
//! the wait-for graph and sends only the conclusions:
//! - a chip that waits on a receive and whose progress counter has not moved for a quarter of
//!   the watchdog timeout is *waiting*, unless its waits, followed through this worker's
//!   chips, reach a chip that is still moving or inside a kernel (it waits on live work);
//!   waiting chips are sent as id ranges, and those quiet for the whole timeout are *stuck*;
//! - a chip quiet for the whole timeout that waits on no one and is not inside a kernel is a
//!   *root* (a candidate culprit), sent with its full status and how many chips here wait on
//!   it: its neighbours blocked on it right now (whether or not they are still busy on other
//!   links) and the waiting chips behind them; the root is the one judged;
//! - waits of waiting chips on chips of other workers are sent one per (peer, link), with the
//!   waiter's receive counter on that link, so the coordinator can join the workers' graphs;
//!   so are the waits of chips with a receive parked for the whole timeout, even if they are
//!   still busy on other links;
//! - a receive parked for the whole timeout whose local sender has sent more on the link than
//!   the waiter received is a *lost* message, found here;
//! - quiet chips on a worker boundary send their per-link send counters once (and again when
//!   they change), so the coordinator can find a message lost between workers.
//!
//! A chip that has not moved may simply not have had its turn on a busy host: while the
//! executor's scheduling lag (how long a runnable chip may have waited to run,
//! [`podsim_collectives::scheduling_lag`]) is a quarter of the timeout or more, no lost
//! message or stuck chip is reported, only waiting ranges: a slow host, not a hang. Roots are
//! the exception when their executor reports them idle (polled, nothing left to do, not woken
//! since: [`podsim_collectives::RunState`]): such a chip is not waiting for a thread, and as it
//! waits on no receive and is in no kernel, nothing will wake it. This is what finds a stalled
//! chip while the rest of a large worker is still busy.
//!
//! Cost per heartbeat: one cheap summary read per chip, and a full status read only for quiet
//! chips whose state changed. The coordinator's work per heartbeat is bounded by the caps
//! below, whatever the number of chips.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use podsim_collectives::{ChipStatus, Fingerprint, Glance, counters_judge_wait, link_slot};
pub use podsim_job::heartbeat::{Ranges, Root, Summary, Wait};
use podsim_topology::{ChipId, Link, Pod};

/// At most this many roots per heartbeat (the ones most waited on).
pub const MAX_ROOTS: usize = 8;
/// At most this many waits on other workers' chips, or lost messages, per heartbeat.
pub const MAX_WAITS: usize = 256;

#[derive(Debug, Clone)]
struct Track {
    key: Option<Glance>,
    quiet_since: Instant,
    quiet_since_wall_ns: u64,
    /// The full status, read when the chip went quiet or its key changed while quiet.
    status: Option<ChipStatus>,
}

/// A worker's side of the watchdog: follows its chips from one heartbeat to the next.
#[derive(Debug)]
pub struct Summariser {
    pod: Pod,
    chips: Vec<ChipId>,
    ranges: Ranges,
    local: HashMap<ChipId, usize>,
    /// Per local chip: the link slots that lead to another worker's chips.
    boundary: Vec<Vec<u8>>,
    timeout: Duration,
    /// How long a chip may be inside its program's own work (a kernel, a PyTorch rank's
    /// Python between calls) before that excuses it no more: past it, a chip busy while its
    /// peers wait is a root like a stopped one (a loop that never ends).
    busy_limit: Duration,
    track: Vec<Track>,
    /// Boundary send counters as last reported.
    reported: HashMap<(ChipId, u8), u64>,
    /// Lost messages suspected: (waiter, link slot) -> (sent, arrived, first seen). A message
    /// is reported lost only when the same counts hold for a quarter of the timeout: a
    /// receive that completes between two reads, or a message still between the sender's
    /// count and the receiver's inbox, is gone by then.
    suspects: HashMap<(ChipId, usize), (u64, u64, Instant)>,
    /// Chips that looked like roots at the previous heartbeat.
    root_candidates: HashSet<usize>,
    /// How many of them were not candidates at the heartbeat before (not judged yet).
    new_root_candidates: usize,
}

impl Summariser {
    /// `chips`: the chips whose recorders the heartbeat reads, in that order; `pod` to find
    /// which of their links leave the worker (chips not in `chips` are another worker's).
    pub fn new(pod: &Pod, chips: Vec<ChipId>, timeout: Duration, now: Instant) -> Summariser {
        let local: HashMap<ChipId, usize> =
            chips.iter().enumerate().map(|(i, c)| (*c, i)).collect();
        let boundary = chips
            .iter()
            .map(|&c| {
                let mut slots: Vec<u8> = pod
                    .links(c)
                    .into_iter()
                    .filter(|l| pod.peer(c, *l).is_some_and(|p| !local.contains_key(&p)))
                    .map(|l| link_slot(l) as u8)
                    .collect();
                slots.dedup();
                slots
            })
            .collect();
        let track = vec![
            Track {
                key: None,
                quiet_since: now,
                quiet_since_wall_ns: podsim_collectives::wall_ns(),
                status: None,
            };
            chips.len()
        ];
        Summariser {
            pod: pod.clone(),
            ranges: Ranges::from_ids(chips.iter().copied()),
            chips,
            local,
            boundary,
            timeout,
            track,
            reported: HashMap::new(),
            suspects: HashMap::new(),
            root_candidates: HashSet::new(),
            new_root_candidates: 0,
            busy_limit: Duration::from_millis(podsim_job::DEFAULT_BUSY_MS),
        }
    }

    /// The same, with chips excused for their own work for `limit` at most.
    pub fn with_busy_limit(self, limit: Duration) -> Summariser {
        Summariser {
            busy_limit: limit,
            ..self
        }
    }

    /// Whether `status` shows its chip inside its program's own work, for less than the busy
    /// limit at `wall_ns`.
    fn busy(&self, status: &ChipStatus, wall_ns: u64) -> bool {
        let limit = self.busy_limit.as_nanos() as u64;
        status
            .computing_since_ns
            .is_some_and(|since| wall_ns.saturating_sub(since) < limit)
    }

    /// One heartbeat: `key(i)` and `status(i)` read local chip `i` (in the order given to
    /// [`Summariser::new`]); `lag` is the executor's scheduling lag now. Its phases: glance at
    /// every chip, excuse the waits that reach live local work, judge the roots, gather the
    /// waits that leave the worker or lost a message, and the boundary's send counters.
    pub fn beat(
        &mut self,
        now: Instant,
        wall_ns: u64,
        lag: Duration,
        key: impl Fn(usize) -> Glance,
        status: impl Fn(usize) -> ChipStatus,
    ) -> Summary {
        let (mut reading, moving, step) = self.glance(now, wall_ns, lag, &key, &status);
        self.excuse(&mut reading);
        let waiting_ids: Vec<ChipId> = (0..self.chips.len())
            .filter(|&i| self.is_waiting(&reading, i))
            .map(|i| self.chips[i])
            .collect();
        let roots = self.roots(&reading, &status);
        let waits = self.waits(&reading, now, wall_ns, &status);
        let suspected = (self.suspects.len() + self.roots_to_come(&reading)) as u32;
        let boundary_sent = self.boundary_sends(&reading.quiet);
        Summary {
            chips: self.ranges.clone(),
            moving,
            waiting: Ranges::from_ids(waiting_ids),
            roots,
            remote: waits.remote.into_values().collect(),
            lost: waits.lost,
            boundary_sent,
            oldest: waits.oldest,
            step: if step == u64::MAX { 0 } else { step },
            lag_ms: lag.as_millis() as u64,
            cpu_wait_share: 0.0,
            suspected,
            transport: Vec::new(),
        }
    }

    /// Reads every chip's glance (its full status only when quiet and changed): which chips
    /// moved, which are quiet, stale or parked long; also how many moved and the lowest step.
    fn glance(
        &mut self,
        now: Instant,
        wall_ns: u64,
        lag: Duration,
        key: &impl Fn(usize) -> Glance,
        status: &impl Fn(usize) -> ChipStatus,
    ) -> (Reading, u32, u64) {
        let n = self.chips.len();
        let settle = self.timeout / 4;
        let timeout_ns = self.timeout.as_nanos() as u64;
        let mut r = Reading {
            wall_ns,
            // Verdicts only when every runnable chip has had its turn recently.
            trusted: lag < settle,
            settle,
            timeout_ns,
            quiet: vec![false; n],
            stale: vec![false; n],
            long: vec![false; n],
            excused: vec![false; n],
            waiters_of: vec![Vec::new(); n],
        };
        let mut moving = 0u32;
        let mut step = u64::MAX;
        for (i, t) in self.track.iter_mut().enumerate() {
            let k = key(i);
            step = step.min(k.step);
            let moved = t.key.is_none_or(|old| old.progress != k.progress);
            if moved {
                moving += 1;
                t.quiet_since = now;
                t.quiet_since_wall_ns = wall_ns;
                t.status = None;
            } else {
                let quiet_for = now.duration_since(t.quiet_since);
                r.quiet[i] = quiet_for >= settle;
                r.stale[i] = quiet_for >= self.timeout;
            }
            // A receive parked for the whole timeout, even on a chip still busy on its other
            // links: the wait a lost message leaves.
            r.long[i] = k
                .blocked_since_wall_ns
                .is_some_and(|since| wall_ns.saturating_sub(since) >= timeout_ns);
            if (r.quiet[i] || r.long[i]) && (t.status.is_none() || t.key != Some(k)) {
                t.status = Some(status(i));
            }
            t.key = Some(k);
        }
        (r, moving, step)
    }

    /// Reverse local edges among quiet waiting chips, and the chips excused because their
    /// waits reach live local work (a moving chip, or one inside a kernel).
    fn excuse(&self, r: &mut Reading) {
        let mut live: Vec<usize> = Vec::new();
        for (i, t) in self.track.iter().enumerate() {
            let Some(s) = t.status.as_ref().filter(|_| r.quiet[i]) else {
                live.push(i);
                continue;
            };
            if self.busy(s, r.wall_ns) {
                live.push(i);
            }
            for b in &s.blocked {
                if let Some(&p) = self.local.get(&b.peer) {
                    r.waiters_of[p].push(i);
                }
            }
        }
        while let Some(x) = live.pop() {
            for &w in &r.waiters_of[x] {
                if !r.excused[w] {
                    r.excused[w] = true;
                    live.push(w);
                }
            }
        }
    }

    /// Quiet, not excused, and blocked on a receive.
    fn is_waiting(&self, r: &Reading, i: usize) -> bool {
        r.quiet[i]
            && !r.excused[i]
            && self.track[i]
                .status
                .as_ref()
                .is_some_and(|s| !s.blocked.is_empty())
    }

    /// Roots and the waiting chips that reach each (each counted for the first root found),
    /// most waited on first; remembers this beat's candidates (a root is judged only when it
    /// was a candidate at the previous beat too).
    fn roots(&mut self, r: &Reading, status: &impl Fn(usize) -> ChipStatus) -> Vec<Root> {
        let mut roots: Vec<Root> = Vec::new();
        let mut counted = vec![false; self.chips.len()];
        let mut candidates = HashSet::new();
        for i in 0..self.chips.len() {
            let Some(fresh) = self.root_now(r, i, status) else {
                continue;
            };
            candidates.insert(i);
            if !self.root_candidates.contains(&i) {
                continue;
            }
            let direct = self.waiting_on_now(r, fresh.chip, status);
            let mut waiters = 0u32;
            let mut queue: Vec<usize> = vec![i];
            for &(p, ..) in &direct {
                if !counted[p] {
                    counted[p] = true;
                    waiters += 1;
                    queue.push(p);
                }
            }
            while let Some(x) = queue.pop() {
                for &w in &r.waiters_of[x] {
                    if self.is_waiting(r, w) && !counted[w] {
                        counted[w] = true;
                        waiters += 1;
                        queue.push(w);
                    }
                }
            }
            let first_waiter = direct
                .first()
                .map(|&(p, link, fp)| (self.chips[p], link, fp));
            roots.push(Root {
                status: fresh,
                quiet_since_wall_ns: self.track[i].quiet_since_wall_ns,
                local_waiters: waiters,
                first_waiter,
            });
        }
        self.new_root_candidates = candidates
            .iter()
            .filter(|c| !self.root_candidates.contains(c))
            .count();
        self.root_candidates = candidates;
        // Most waited on first; then the longest quiet (a root nobody here waits on may still
        // hold up another worker's chips).
        roots.sort_by_key(|r| (std::cmp::Reverse(r.local_waiters), r.quiet_since_wall_ns));
        roots.truncate(MAX_ROOTS);
        roots
    }

    /// Chips that may yet be roots: those waiting on no one and in no kernel but not quiet
    /// for the timeout yet, and this beat's new root candidates (judged at the next).
    /// (Without the first, a stall just after its neighbours went quiet looked, for one
    /// heartbeat, like chips that all wait on each other. A root already judged - one nobody
    /// waits on, such as a chip whose program finished - is not counted: it must not keep a
    /// deadlock among the other chips from being called.)
    fn roots_to_come(&self, r: &Reading) -> usize {
        let not_stale_yet = self
            .track
            .iter()
            .zip(&r.stale)
            .filter(|(t, stale)| !**stale && t.key.is_some_and(|k| k.blocked == 0 && !k.computing))
            .count();
        not_stale_yet + self.new_root_candidates
    }

    /// Chip `i`'s status read afresh if it is a root now: quiet for the whole timeout, waiting
    /// on no one, in no kernel, and unchanged since the previous heartbeat (a status read
    /// while the chip ran is a moment's view). On a busy host a quiet chip may only be waiting
    /// for its turn, unless its executor says it is idle: polled, with nothing left to do,
    /// and not woken since.
    fn root_now(
        &self,
        r: &Reading,
        i: usize,
        status: &impl Fn(usize) -> ChipStatus,
    ) -> Option<ChipStatus> {
        let idle = self.track[i].key.is_some_and(|k| k.idle);
        if !r.stale[i] || !(r.trusted || idle) {
            return None;
        }
        if self.track[i]
            .status
            .as_ref()
            .is_none_or(|s| !s.blocked.is_empty() || self.busy(s, r.wall_ns))
        {
            return None;
        }
        let fresh = status(i);
        let unchanged = self.track[i]
            .key
            .is_some_and(|k| k.progress == fresh.progress);
        let root = unchanged
            && fresh.blocked.is_empty()
            && !self.busy(&fresh, r.wall_ns)
            && (r.trusted || fresh.idle);
        root.then_some(fresh)
    }

    /// `chip`'s neighbours here that wait on it right now (read afresh: a neighbour may still
    /// be busy on its other links), with the link and collective of each wait.
    fn waiting_on_now(
        &self,
        r: &Reading,
        chip: ChipId,
        status: &impl Fn(usize) -> ChipStatus,
    ) -> Vec<(usize, Link, Fingerprint)> {
        let mut direct: Vec<(usize, Link, Fingerprint)> = Vec::new();
        for link in self.pod.links(chip) {
            let Some(&p) = self.pod.peer(chip, link).and_then(|p| self.local.get(&p)) else {
                continue;
            };
            let fresh;
            let ps = match self.track[p].status.as_ref().filter(|_| r.quiet[p]) {
                Some(x) => x,
                None => {
                    fresh = status(p);
                    &fresh
                }
            };
            if let Some(b) = ps.blocked.iter().find(|b| b.peer == chip) {
                direct.push((p, b.link, b.fingerprint));
            }
        }
        direct.dedup_by_key(|d| d.0);
        direct
    }

    /// Waits that leave the worker, local sends never received (lost messages, confirmed
    /// on both chips and over a quarter of the timeout), and the oldest stuck chip.
    fn waits(
        &mut self,
        r: &Reading,
        now: Instant,
        wall_ns: u64,
        status: &impl Fn(usize) -> ChipStatus,
    ) -> Waits {
        let mut w = Waits {
            remote: BTreeMap::new(),
            lost: Vec::new(),
            oldest: None,
        };
        let mut suspects = HashMap::new();
        for i in (0..self.chips.len()).filter(|&i| self.is_waiting(r, i) || r.long[i]) {
            let t = &self.track[i];
            let stuck_chip = r.trusted && r.stale[i] && self.is_waiting(r, i);
            if stuck_chip && w.oldest.is_none_or(|(_, q)| t.quiet_since_wall_ns < q) {
                w.oldest = Some((self.chips[i], t.quiet_since_wall_ns));
            }
            let Some(cached) = t.status.as_ref() else {
                continue;
            };
            // Messages may have arrived since the status was read (arrivals alone do not
            // change what a heartbeat glances at): a wait that another worker will judge by
            // its counts is read afresh.
            let fresh;
            let s = if cached
                .blocked
                .iter()
                .any(|b| r.stuck(b, wall_ns) && !self.local.contains_key(&b.peer))
            {
                fresh = status(i);
                &fresh
            } else {
                cached
            };
            for b in &s.blocked {
                let wait = Wait {
                    waiter: s.chip,
                    link: b.link,
                    peer: b.peer,
                    received: arrived(s, b.link),
                    fingerprint: b.fingerprint,
                    since_wall_ns: b.since_wall_ns,
                    stuck: r.stuck(b, wall_ns),
                };
                match self.local.get(&b.peer) {
                    None => {
                        if w.remote.len() < MAX_WAITS {
                            w.remote.entry((b.peer, b.link)).or_insert(wait);
                        }
                    }
                    Some(&p) if wait.stuck && w.lost.len() < MAX_WAITS => {
                        let lost = self.lost_message(r, (i, p), wait, now, &mut suspects, status);
                        w.lost.extend(lost);
                    }
                    Some(_) => {}
                }
            }
        }
        // A cut loses messages on several links, each confirmed a quarter of the timeout after
        // its own wait began: while another suspect is still settling, the lost messages
        // already confirmed wait for it (at most another quarter), so that the cut is
        // reported whole, not as one lost message.
        let age = |wait: &Wait| {
            let key = (wait.waiter, link_slot(wait.link));
            suspects
                .get(&key)
                .map_or(Duration::MAX, |s| now.duration_since(s.2))
        };
        let settling = suspects
            .values()
            .any(|s| now.duration_since(s.2) < r.settle);
        if settling && w.lost.iter().all(|(wait, _)| age(wait) < 2 * r.settle) {
            w.lost.clear();
        }
        self.suspects = suspects;
        w
    }

    /// A stuck wait of local chip `i` on local chip `p`: a lost message if `p` has sent more
    /// on the link than `i` received, the same counts for a quarter of the timeout.
    /// Suspected from what was read before, confirmed on both chips as they are now.
    fn lost_message(
        &self,
        r: &Reading,
        (i, p): (usize, usize),
        wait: Wait,
        now: Instant,
        suspects: &mut HashMap<(ChipId, usize), (u64, u64, Instant)>,
        status: &impl Fn(usize) -> ChipStatus,
    ) -> Option<(Wait, u64)> {
        if !counters_judge_wait(&self.pod, wait.waiter, wait.link, wait.peer) {
            return None;
        }
        let back = link_slot(wait.link.reverse(self.pod.slice_of(wait.waiter)));
        let sent_by = |x: &ChipStatus| x.sent.get(back).copied().unwrap_or(0);
        let sender = self.track[p].status.as_ref().filter(|_| r.quiet[p]);
        if sender.is_some_and(|x| sent_by(x) <= wait.received) {
            return None;
        }
        let sent = sent_by(&status(p));
        let received = arrived(&status(i), wait.link);
        if sent <= received {
            return None;
        }
        let key = (wait.waiter, link_slot(wait.link));
        let since = match self.suspects.get(&key) {
            Some(&(s0, r0, since)) if (s0, r0) == (sent, received) => since,
            _ => now,
        };
        suspects.insert(key, (sent, received, since));
        (now.duration_since(since) >= r.settle).then_some((Wait { received, ..wait }, sent))
    }

    /// Send counters on the worker's boundary, for chips that went quiet there, each once
    /// and again when it changes.
    fn boundary_sends(&mut self, quiet: &[bool]) -> Vec<(ChipId, u8, u64)> {
        let mut boundary_sent = Vec::new();
        for ((t, slots), _) in self
            .track
            .iter()
            .zip(&self.boundary)
            .zip(quiet)
            .filter(|(_, q)| **q)
        {
            let Some(s) = t.status.as_ref() else {
                continue;
            };
            for &slot in slots {
                let sent = s.sent.get(usize::from(slot)).copied().unwrap_or(0);
                if self.reported.insert((s.chip, slot), sent) != Some(sent) {
                    boundary_sent.push((s.chip, slot, sent));
                }
            }
        }
        boundary_sent
    }
}

/// What one heartbeat read of the local chips (`Summariser::glance`, then `excuse`).
struct Reading {
    /// When it was read (wall clock, ns).
    wall_ns: u64,
    /// Every runnable chip has had its turn recently: verdicts may be given.
    trusted: bool,
    /// A quarter of the timeout: quiet this long is waiting.
    settle: Duration,
    timeout_ns: u64,
    /// Quiet for `settle`; for the whole timeout (stale); a receive parked the whole timeout.
    quiet: Vec<bool>,
    stale: Vec<bool>,
    long: Vec<bool>,
    /// Waits that reach live local work.
    excused: Vec<bool>,
    /// Local chips waiting on each local chip.
    waiters_of: Vec<Vec<usize>>,
}

impl Reading {
    /// This receive has waited the whole timeout, on a host that keeps up.
    fn stuck(&self, b: &podsim_collectives::Blocked, wall_ns: u64) -> bool {
        self.trusted && wall_ns.saturating_sub(b.since_wall_ns) >= self.timeout_ns
    }
}

/// The waits a heartbeat reports (`Summariser::waits`).
struct Waits {
    remote: BTreeMap<(ChipId, Link), Wait>,
    lost: Vec<(Wait, u64)>,
    oldest: Option<(ChipId, u64)>,
}

/// What reached a chip on a link: taken, or arrived and not taken yet.
fn arrived(s: &ChipStatus, link: Link) -> u64 {
    [&s.received, &s.pending]
        .iter()
        .filter_map(|v| v.get(link_slot(link)))
        .sum()
}
