//! The hang watchdog and its diagnosis, as pure logic over heartbeats (no I/O: the launcher
//! feeds it and acts on what it finds).
//!
//! Each worker resolves its own part of the wait-for graph and heartbeats a bounded summary
//! ([`podsim_job::Summary`]): its stuck chips as id ranges, its roots (quiet chips waiting
//! on no one) with how many of its chips wait on them, its chips' waits on other workers'
//! chips, lost messages between its own chips, and send counters on its boundary. The
//! watchdog joins the summaries, so its cost per heartbeat does not grow with chips:
//! - a root that stuck chips wait on (on its worker or another): `stalled_chip`;
//! - a stuck chip whose sender sent more on the link than it received (found by its worker
//!   for a local sender, here from the boundary counters for a sender on another worker):
//!   `lost_message`, or `partition` when several links between different workers lost one (or
//!   several links inside workers: chips cut apart);
//! - every worker stuck for the timeout (or finished) with nothing lost and no root: a deadlock (reported
//!   as `stalled_chip` on the chip that went quiet first);
//! - a worker that sends no heartbeats while its process lives: `frozen_worker`.
//!
//! Dead workers and desyncs are reported by the launcher as they happen.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use podsim_collectives::{Fingerprint, counters_judge_wait, link_slot, wall_ns};
use podsim_job::FaultEvent;
use podsim_job::HeartbeatStatus;
use podsim_job::{Ranges, Root, Summary, Wait};
use podsim_topology::{ChipId, Link, Pod};
use serde::{Deserialize, Serialize};

/// What a frozen worker's diagnosis says when its process is stopped (a freeze fault's mark).
pub const STOPPED: &str =
    "the process is stopped (SIGSTOP, a debugger); resume it with kill -CONT or kill it.";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
    /// Not a hang: a PyTorch rank's program raised an exception (a job error), named with
    /// its line.
    ProgramError,
}

impl HangKind {
    /// How a job with this finding ended.
    pub fn status(self) -> crate::JobStatus {
        match self {
            HangKind::Desync => crate::JobStatus::Desync,
            HangKind::Corrupt | HangKind::ProgramError => crate::JobStatus::Error,
            _ => crate::JobStatus::Hang,
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
    /// Chips left waiting (the full lists are in the flight recorders).
    pub waiting: Ranges,
    pub explanation: String,
    /// When the fault took effect as far as the heartbeats tell (wall ns); a fault event
    /// reported by the workers, when there is one, is more exact.
    pub effect_wall_ns: u64,
}

/// The watchdog's view of one worker.
#[derive(Debug)]
struct WorkerView {
    heard: Instant,
    /// Of the silence since `heard`, the time its process spent ready to run without a CPU
    /// (a starved host's, not the worker's): not counted towards `frozen_worker`.
    starved_since_heard: Duration,
    heard_wall_ns: u64,
    pid: Option<u32>,
    summary: Summary,
    /// When any of its chips last moved.
    last_moving: Instant,
    /// Heartbeats received.
    beats: u64,
}

/// What the kernel says of a worker's process, where its launcher can ask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Liveness {
    /// Not known (a worker on another host, or no `/proc`).
    Unknown,
    /// Stopped (SIGSTOP, a debugger).
    Stopped,
    /// Running or asleep; `cpu_wait_share` of the last interval its busiest-waiting thread
    /// spent ready to run without a CPU (0 where the kernel does not tell).
    Running { cpu_wait_share: f64 },
}

#[derive(Debug)]
pub struct Watchdog {
    timeout: Duration,
    heartbeat: Duration,
    pod: Pod,
    workers: BTreeMap<u32, WorkerView>,
    finished: BTreeSet<u32>,
    faults: Vec<FaultEvent>,
    /// Send counters `(chip, link slot)` on worker boundaries, as last reported.
    boundary_sent: HashMap<(ChipId, u8), u64>,
    /// Waits across workers that looked lost: (waiter, link) -> (sent, arrived, first seen,
    /// the waiter's worker's heartbeat then, the peer).
    suspects: HashMap<(ChipId, Link), Suspect>,
    /// Small workers' current waits (waiter -> peers), for stragglers.
    waits: BTreeMap<u32, Vec<(ChipId, Vec<ChipId>)>>,
    /// How long each chip held others up: peers waited on it while it waited on no one.
    waited_on: BTreeMap<ChipId, Duration>,
    first_tick: Option<Instant>,
    last_tick: Option<Instant>,
    /// The coordinator's last pause: how long it did not run, and when it resumed.
    paused: Option<(Duration, Instant)>,
    /// Checks since the first (they come on every heartbeat of every worker as well as on a
    /// timer, so they may outnumber the heartbeats of a worker).
    counted_ticks: u64,
    /// Of the time since the first check, how much counted at all: the mean over live
    /// workers of the share of each interval their chips could be held against (see
    /// `count_waits`).
    observed: Duration,
}

/// A chip that was slow but kept making progress.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Straggler {
    pub chip: ChipId,
    /// Time its peers spent waiting on it while it waited on no one, ms (sampled at every
    /// heartbeat).
    pub waited_on_ms: f64,
    /// That time over the median chip's (at least 1 ms): how much more it held the job up.
    pub slowdown: f64,
}

/// Family-wise chance of naming a straggler in a job where no chip is special, were the
/// heartbeats' samples independent (they are not quite: a wait can outlast a heartbeat).
const STRAGGLER_FALSE_ALARM: f64 = 1e-3;

/// Whether a chip held the others up for a share `q` of the run by more than chance, when the
/// other chips were held against at a share `p` on average and the waits were sampled `n`
/// times (heartbeat intervals): in a job where no chip is special each sample falls on a
/// given chip with chance `p`, and a count of `q n` or more has chance at most
/// `exp(-n KL(q || p))` (the Chernoff bound on a binomial tail). Tested for every one of
/// `chips` chips, so the bar is that chance under `STRAGGLER_FALSE_ALARM / chips`. A short
/// run gives few samples: on gRPC links a fault-free 120-step job on four workers lasts about
/// 16 heartbeats, and one chip in sixteen falls on a quarter of them now and then by chance
/// alone; a chip slowed tenfold falls on nearly all. The price: over 16 samples, against
/// others at 5%, a chip needs about 42% of the run to be named; over 160, the fifth of the
/// run the floors ask.
fn beyond_chance(q: f64, p: f64, n: f64, chips: f64) -> bool {
    let q = q.clamp(0.0, 1.0);
    if q <= p {
        return false;
    }
    // Where no other chip was ever waited on, any share is beyond chance (the evidence
    // floors of `Watchdog::stragglers` still apply).
    let p = p.max(f64::MIN_POSITIVE);
    let term = |a: f64, b: f64| if a > 0.0 { a * (a / b).ln() } else { 0.0 };
    let divergence = term(q, p) + term(1.0 - q, 1.0 - p);
    n * divergence > (chips.max(1.0) / STRAGGLER_FALSE_ALARM).ln()
}

/// `12,345`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `1 chip` / `32,767 chips`.
fn chips_count(n: u64) -> String {
    if n == 1 {
        "1 chip".into()
    } else {
        format!("{} chips", thousands(n))
    }
}

impl Watchdog {
    pub fn new(pod: Pod, timeout: Duration, heartbeat: Duration) -> Watchdog {
        Watchdog {
            timeout,
            heartbeat,
            pod,
            workers: BTreeMap::new(),
            finished: BTreeSet::new(),
            faults: Vec::new(),
            boundary_sent: HashMap::new(),
            suspects: HashMap::new(),
            waits: BTreeMap::new(),
            waited_on: BTreeMap::new(),
            first_tick: None,
            last_tick: None,
            paused: None,
            counted_ticks: 0,
            observed: Duration::ZERO,
        }
    }

    /// The job starts: from now on every worker (id, pid) owes heartbeats.
    pub fn start(&mut self, workers: impl IntoIterator<Item = (u32, Option<u32>)>, now: Instant) {
        for (w, pid) in workers {
            self.workers.entry(w).or_insert(WorkerView {
                heard: now,
                starved_since_heard: Duration::ZERO,
                heard_wall_ns: wall_ns(),
                pid,
                summary: Summary::default(),
                last_moving: now,
                beats: 0,
            });
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
        self.faults_fired(&hb.faults);
        for &(chip, slot, sent) in &hb.summary.boundary_sent {
            self.boundary_sent.insert((chip, slot), sent);
        }
        if hb.waits.is_empty() {
            self.waits.remove(&worker);
        } else {
            self.waits.insert(worker, hb.waits);
        }
        let view = self.workers.entry(worker).or_insert(WorkerView {
            heard: now,
            starved_since_heard: Duration::ZERO,
            heard_wall_ns: 0,
            pid: None,
            summary: Summary::default(),
            last_moving: now,
            beats: 0,
        });
        view.beats += 1;
        view.heard = now;
        view.starved_since_heard = Duration::ZERO;
        view.heard_wall_ns = wall_ns();
        if hb.summary.moving > 0 {
            view.last_moving = now;
        }
        view.summary = hb.summary;
    }

    /// Worker `id` delivered its results: it no longer heartbeats and nobody waits on it.
    pub fn finished(&mut self, worker: u32) {
        self.finished.insert(worker);
        self.waits.remove(&worker);
        if let Some(v) = self.workers.get_mut(&worker) {
            v.summary = Summary::default();
        }
    }

    pub fn faults(&self) -> &[FaultEvent] {
        &self.faults
    }

    fn live(&self) -> impl Iterator<Item = (u32, &WorkerView)> {
        self.workers
            .iter()
            .filter(|(w, _)| !self.finished.contains(w))
            .map(|(w, v)| (*w, v))
    }

    /// The step every chip has reached (the slowest worker's slowest chip).
    pub fn step_reached(&self) -> u64 {
        self.live().map(|(_, v)| v.summary.step).min().unwrap_or(0)
    }

    /// The last heartbeat of `worker` (wall ns), if any.
    pub fn last_heard(&self, worker: u32) -> Option<u64> {
        self.workers.get(&worker).map(|w| w.heard_wall_ns)
    }

    /// Chips stuck waiting right now, over every worker.
    pub fn waiting_chips(&self) -> Ranges {
        self.live().fold(Ranges::default(), |acc, (_, v)| {
            acc.union(&v.summary.waiting)
        })
    }

    /// The worker that hosts `chip`, as its summaries tell.
    fn worker_of(&self, chip: ChipId) -> Option<u32> {
        self.workers
            .iter()
            .find(|(_, v)| v.summary.chips.contains(chip))
            .map(|(w, _)| *w)
    }

    /// A chip of `worker` others wait on, and the collective they wait in (for a report on a
    /// dead or frozen worker).
    pub fn current_of(&self, worker: u32) -> Option<(ChipId, u64, String)> {
        let chips = &self.workers.get(&worker)?.summary.chips;
        self.live()
            .flat_map(|(_, v)| &v.summary.remote)
            .find(|w| chips.contains(w.peer))
            .map(|w| (w.peer, w.fingerprint.seq, w.fingerprint.op.to_string()))
    }

    /// Chips that held others up for a large share of the run: while peers waited on them
    /// they were not waiting themselves (working, or slow to send).
    pub fn stragglers(&self) -> Vec<Straggler> {
        let run = self
            .first_tick
            .zip(self.last_tick)
            .map_or(0.0, |(a, b)| b.duration_since(a).as_secs_f64() * 1e3);
        // Every chip of the pod counts toward the median, those never waited on at zero (the
        // workers' summaries cannot say how many: a finished worker's is cleared).
        let chips = self.pod.chips() as usize;
        let mut held: Vec<f64> = self
            .waited_on
            .values()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        held.resize(chips.max(held.len()), 0.0);
        let total: f64 = held.iter().sum();
        held.sort_by(f64::total_cmp);
        let median = held.get(held.len() / 2).copied().unwrap_or(0.0).max(1.0);
        let heartbeat_ms = self.heartbeat.as_secs_f64() * 1e3;
        // The evidence is the time that counted (a busy or unheard host's is not its chips'),
        // new once a heartbeat at most and once a check at most.
        let observed = self.observed.as_secs_f64() * 1e3;
        if observed <= 0.0 {
            return Vec::new();
        }
        let samples = (self.counted_ticks as f64).min(observed / heartbeat_ms);
        // Sampled at heartbeats: a few samples are noise, not evidence.
        let candidates: Vec<(ChipId, f64)> = self
            .waited_on
            .iter()
            .map(|(c, d)| (*c, d.as_secs_f64() * 1e3))
            .filter(|(_, ms)| *ms > 3.0 * median && *ms > 0.2 * run && *ms >= 3.5 * heartbeat_ms)
            .collect();
        // Chance is what the chips that are no candidates were held against: several slow
        // chips (one slow host's) would otherwise raise each other's bar.
        let others = held.len().saturating_sub(candidates.len());
        let rest: f64 = total - candidates.iter().map(|(_, ms)| ms).sum::<f64>();
        let chance = if others == 0 {
            0.0
        } else {
            rest.max(0.0) / (others as f64 * observed)
        };
        candidates
            .into_iter()
            .filter(|(_, ms)| beyond_chance(*ms / observed, chance, samples, held.len() as f64))
            .map(|(chip, ms)| Straggler {
                chip,
                waited_on_ms: ms,
                slowdown: ms / median,
            })
            .collect()
    }

    /// Straggler accounting at a check: the time since the last check, counted against each
    /// chip waited on that does not wait itself (the share of it its host let it run).
    fn count_waits(&mut self, now: Instant) {
        let Some(last) = self.last_tick else {
            return;
        };
        let dt = now.duration_since(last);
        self.counted_ticks = self.counted_ticks.saturating_add(1);
        let heartbeat = self.heartbeat;
        // A worker's view is known while it has been heard within two heartbeats.
        let recent = |v: &WorkerView| now.saturating_duration_since(v.heard) < 2 * heartbeat;
        // How much of the tick counts against a chip of a worker: none while the worker
        // is not recent (what its chips did is not known) or its host is too busy to run
        // them promptly (the executor's scheduling lag is half a heartbeat or more); else
        // the share of the time its executor had a CPU: a host running more threads than
        // it has cores holds every chip up part of the time, and that part is the host's.
        let counted = |v: &WorkerView| {
            let busy = Duration::from_millis(v.summary.lag_ms) >= heartbeat / 2;
            if busy || !recent(v) {
                0.0
            } else {
                1.0 - v.summary.cpu_wait_share.clamp(0.0, 1.0)
            }
        };
        // The waits of workers heard recently (a silent worker's last list is stale).
        let waits: Vec<&(ChipId, Vec<ChipId>)> = self
            .waits
            .iter()
            .filter(|(w, _)| self.workers.get(w).is_some_and(recent))
            .flat_map(|(_, list)| list)
            .collect();
        let waiters: BTreeSet<ChipId> = waits.iter().map(|(c, _)| *c).collect();
        // Each chip waited on, and the share of the tick that counts against it: none
        // until a live worker's summary says it hosts the chip.
        let mut targets: BTreeMap<ChipId, f64> = waits
            .iter()
            .flat_map(|(_, peers)| peers.iter().copied())
            .filter(|t| !waiters.contains(t))
            .map(|t| (t, 0.0))
            .collect();
        let (mut shares, mut workers) = (0.0, 0u32);
        for (_, v) in self.live() {
            let share = counted(v);
            (shares, workers) = (shares + share, workers + 1);
            for &(first, last) in &v.summary.chips.0 {
                targets
                    .range_mut(first..=last)
                    .for_each(|(_, s)| *s = share);
            }
        }
        if workers > 0 {
            self.observed += dt.mul_f64(shares / f64::from(workers));
        }
        for (t, share) in targets {
            if share > 0.0 {
                *self.waited_on.entry(t).or_default() += dt.mul_f64(share);
            }
        }
    }

    /// Looks for a hang now. `process(worker)` tells what the kernel says of a worker's
    /// process ([`Liveness::Unknown`] for a worker on another host).
    pub fn check(&mut self, now: Instant, process: impl Fn(u32) -> Liveness) -> Option<Finding> {
        self.count_waits(now);
        self.first_tick.get_or_insert(now);
        let previous_tick = self.last_tick.replace(now);
        if let Some((w, silent, heard, state)) = self.silent_worker(now, previous_tick, &process) {
            return Some(self.frozen(w, silent, heard, state));
        }
        if let Some(f) = self.stalled() {
            return Some(f);
        }
        if let Some(f) = self.lost(now) {
            return Some(f);
        }
        self.deadlock(now)
    }

    /// The coordinator itself did not run for `gap` until `now` (stopped with SIGSTOP, a
    /// suspended machine, a host that starved it: its supervisor's ticks say so): the
    /// workers' silence meanwhile is not theirs, so every worker's silence and every chip's
    /// stillness count from now. A heartbeat gap the workers make while the coordinator runs
    /// is still judged.
    pub fn resumed_after_pause(&mut self, now: Instant, gap: Duration) {
        tracing::warn!(
            "the coordinator did not run for {:.1} s (stopped, or starved of CPU): the workers' silence meanwhile is not judged",
            gap.as_secs_f64()
        );
        self.paused = Some((gap, now));
        self.suspects.clear();
        for v in self.workers.values_mut() {
            v.heard = v.heard.max(now);
            v.last_moving = v.last_moving.max(now);
            v.starved_since_heard = Duration::ZERO;
        }
        self.last_tick = Some(now);
    }

    /// The hang timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The coordinator's last pause (see `resumed_after_pause`): how long, and when it ended.
    pub fn paused(&self) -> Option<(Duration, Instant)> {
        self.paused
    }

    /// `chip 20000 (coordinates [16, 17, 19], worker 1, pid 4242)`.
    fn describe_chip(&self, c: ChipId, worker: Option<u32>) -> String {
        let worker = worker.or_else(|| self.worker_of(c));
        let pid = worker
            .and_then(|w| self.workers.get(&w))
            .and_then(|v| v.pid)
            .map_or(String::new(), |p| format!(", pid {p}"));
        let worker = worker.map_or("?".to_string(), |w| w.to_string());
        let coords = self.pod.coord(c).to_vec();
        let slice = if self.pod.slices() > 1 {
            format!(" of slice {}", self.pod.slice_of(c))
        } else {
            String::new()
        };
        format!("chip {c} (coordinates {coords:?}{slice}, worker {worker}{pid})")
    }

    /// `32,767 chips wait (ids 0-19999, 20001-32767)`.
    fn describe_waiting(waiting: &Ranges) -> String {
        let n = waiting.count();
        if n == 0 {
            return "no chip waits on it yet".into();
        }
        let verb = if n == 1 { "waits" } else { "wait" };
        format!("{} {verb} (ids {waiting})", chips_count(n))
    }

    /// A worker silent for too long: at once if its process is stopped (or nobody can
    /// tell); a process that runs but cannot get a heartbeat out for five timeouts is hung
    /// all the same, but until then it may only be starved of CPU by a host running far more
    /// than it has, and the time it spent waiting for a CPU does not count (as the straggler
    /// accounting discounts it).
    fn silent_worker(
        &mut self,
        now: Instant,
        previous_tick: Option<Instant>,
        process: &impl Fn(u32) -> Liveness,
    ) -> Option<(u32, Duration, u64, Liveness)> {
        let timeout = self.timeout;
        let finished = &self.finished;
        self.workers
            .iter_mut()
            .filter(|(w, _)| !finished.contains(w))
            .find_map(|(&w, v)| {
                let state = process(w);
                let silent = now.duration_since(v.heard);
                let limit = match state {
                    Liveness::Running { cpu_wait_share } => {
                        let since = previous_tick.map_or(v.heard, |t| t.max(v.heard));
                        let interval = now.saturating_duration_since(since);
                        v.starved_since_heard += interval.mul_f64(cpu_wait_share.clamp(0.0, 1.0));
                        5 * timeout
                    }
                    Liveness::Stopped | Liveness::Unknown => timeout,
                };
                let counted = silent.saturating_sub(v.starved_since_heard);
                (counted >= limit).then_some((w, silent, v.heard_wall_ns, state))
            })
    }

    fn frozen(&self, w: u32, quiet: Duration, last_wall: u64, state: Liveness) -> Finding {
        let view = &self.workers[&w];
        let chips = &view.summary.chips;
        let current = self.current_of(w);
        let pid = view.pid.map_or(String::new(), |p| format!(" (pid {p})"));
        let waiting = self
            .live()
            .filter(|(o, _)| *o != w)
            .fold(Ranges::default(), |acc, (_, v)| {
                acc.union(&v.summary.waiting)
            });
        Finding {
            kind: HangKind::FrozenWorker,
            chip: chips.0.first().map(|r| r.0),
            worker: Some(w),
            link: None,
            seq: current.as_ref().map(|c| c.1),
            op: current.map(|c| c.2),
            explanation: format!(
                "Worker {w}{pid} is alive but has sent no heartbeat for {:.1} s, so its {} (ids {chips}) make no progress and {}: {}",
                quiet.as_secs_f64(),
                chips_count(chips.count()),
                Self::describe_waiting(&waiting),
                match state {
                    Liveness::Stopped => STOPPED,
                    Liveness::Running { .. } =>
                        "the process runs but its heartbeat thread cannot get through, though it was not kept waiting for a CPU (the process hung); look at the process.",
                    Liveness::Unknown =>
                        "the process is stopped or frozen (e.g. SIGSTOP), or its host unreachable; resume it with kill -CONT or kill it.",
                },
            ),
            waiting,
            effect_wall_ns: last_wall,
        }
    }

    /// Waits on `chip` from other workers than `worker`.
    fn remote_waits_on(&self, chip: ChipId, worker: u32) -> impl Iterator<Item = &Wait> {
        self.live()
            .filter(move |(o, _)| *o != worker)
            .flat_map(|(_, v)| &v.summary.remote)
            .filter(move |w| w.peer == chip)
    }

    /// The root most chips wait on, if any chip waits on one.
    fn stalled(&self) -> Option<Finding> {
        let (worker, root, _) = self
            .live()
            .flat_map(|(w, v)| v.summary.roots.iter().map(move |r| (w, r)))
            .map(|(w, r)| {
                let remote = self.remote_waits_on(r.status.chip, w).count() as u64;
                (w, r, u64::from(r.local_waiters) + remote)
            })
            .filter(|(_, _, waiters)| *waiters > 0)
            .max_by_key(|(_, r, waiters)| (*waiters, std::cmp::Reverse(r.status.chip)))?;
        Some(self.stalled_finding(worker, root))
    }

    fn stalled_finding(&self, worker: u32, root: &Root) -> Finding {
        let chip = root.status.chip;
        // The link: one a waiter waits on, named from the culprit's side.
        let waiter = root.first_waiter.or_else(|| {
            self.remote_waits_on(chip, worker)
                .next()
                .map(|w| (w.waiter, w.link, w.fingerprint))
        });
        let link = waiter.map(|(w, l, _)| l.reverse(self.pod.slice_of(w)));
        let waited: Option<Fingerprint> = waiter.map(|(.., f)| f);
        let current = root.status.current.as_ref();
        let fp = current.map(|e| e.fingerprint).or(waited);
        let what = match (current, waited) {
            (Some(e), _) => format!("in {}", e.fingerprint),
            (None, Some(f)) => format!("before {f}"),
            (None, None) => "between collectives".to_string(),
        };
        let waiting = self.waiting_chips().without(chip);
        let through = match waiter {
            Some((w, l, _)) => format!(", chip {w} first, on its link {l}"),
            None => String::new(),
        };
        Finding {
            kind: HangKind::StalledChip,
            chip: Some(chip),
            worker: Some(worker),
            link,
            seq: fp.map(|f| f.seq),
            op: fp.map(|f| f.op.to_string()),
            explanation: match root.status.computing_since_ns {
                // Its program ended while its peers still call collectives with it.
                _ if root.status.ended.is_some() => format!(
                    "{}: its program ended ({}) at step {} after {} collectives, and {} on it{through} {what}: the ranks did not make the same calls (one left its loop early, or skipped a call).",
                    self.describe_chip(chip, Some(worker)),
                    root.status.ended.as_deref().unwrap_or_default(),
                    root.status.step,
                    root.status.completed,
                    Self::describe_waiting(&waiting),
                ),
                // Past the workers' busy limit: its own work that long is the hang.
                Some(since) => format!(
                    "{} has been busy in its program's own work for {:.0} s at step {} {what}, past the watchdog's busy limit ([watchdog] busy_timeout_s), and {} on it{through}: a loop that never ends, or host work longer than the limit.",
                    self.describe_chip(chip, Some(worker)),
                    podsim_collectives::wall_ns().saturating_sub(since) as f64 / 1e9,
                    root.status.step,
                    Self::describe_waiting(&waiting),
                ),
                None => format!(
                    "{} stopped at step {} {what} without waiting on any peer, and {} on it{through}: look at what that chip's program is doing (a stuck kernel, a lock, host code).",
                    self.describe_chip(chip, Some(worker)),
                    root.status.step,
                    Self::describe_waiting(&waiting),
                ),
            },
            waiting,
            effect_wall_ns: root.quiet_since_wall_ns,
        }
    }

    /// Messages sent and never received: found by a worker between its own chips, or here on
    /// a link between workers from the boundary counters.
    fn lost(&mut self, now: Instant) -> Option<Finding> {
        let mut lost: Vec<LostMessage> = Vec::new();
        let mut suspects = HashMap::new();
        for (waiter_worker, v) in self.live() {
            for (w, _) in &v.summary.lost {
                let link = w.link.reverse(self.pod.slice_of(w.waiter));
                lost.push((w.peer, link, w.waiter, w.since_wall_ns, w.fingerprint));
            }
            let judged = |w: &&Wait| counters_judge_wait(&self.pod, w.waiter, w.link, w.peer);
            for w in v.summary.remote.iter().filter(|w| w.stuck).filter(judged) {
                // Only while nothing is in flight between the two workers: on a loaded host a
                // message can sit in the transport for seconds.
                if !self.transport_idle(self.worker_of(w.peer), waiter_worker) {
                    continue;
                }
                let link = w.link.reverse(self.pod.slice_of(w.waiter));
                let Some(&sent) = self.boundary_sent.get(&(w.peer, link_slot(link) as u8)) else {
                    continue;
                };
                if sent > w.received {
                    let key = (w.waiter, w.link);
                    let (since, beat) = match self.suspects.get(&key) {
                        Some(&(s, r, since, beat, _)) if (s, r) == (sent, w.received) => {
                            (since, beat)
                        }
                        _ => (now, v.beats),
                    };
                    // Counted on two hosts at different moments, and a message may sit in the
                    // transport of a loaded host: the same counts over two of the waiter's
                    // heartbeats and a quarter of the timeout.
                    if beat != v.beats && now.duration_since(since) >= self.timeout / 4 {
                        lost.push((w.peer, link, w.waiter, w.since_wall_ns, w.fingerprint));
                    }
                    suspects.insert(key, (sent, w.received, since, beat, w.peer));
                }
            }
        }
        self.suspects = suspects;
        if self.cut_still_confirming(&lost, now) {
            return None;
        }
        (!lost.is_empty()).then(|| self.lost_finding(&lost))
    }

    /// Whether one link between two workers is confirmed lost while another link between
    /// workers is still a suspect: a cut of the network shows on several links (between
    /// several pairs of workers when it splits them into groups), and on a loaded host their
    /// confirmations can land a heartbeat apart. Called one lost message, it would send the
    /// user to a link instead of the network; so the finding waits for the others, at most
    /// another quarter of the timeout past the first confirmation.
    fn cut_still_confirming(&self, lost: &[LostMessage], now: Instant) -> bool {
        let [(peer, link, waiter, ..)] = lost else {
            return false;
        };
        let between_workers = |a: ChipId, b: ChipId| self.worker_of(a) != self.worker_of(b);
        if !between_workers(*peer, *waiter) {
            return false;
        }
        let confirmed = self.suspects.iter().find(|&(&(w, l), s)| {
            (w, s.4) == (*waiter, *peer) && l.reverse(self.pod.slice_of(w)) == *link
        });
        let Some((&key, &(.., confirmed_since, _, _))) = confirmed else {
            return false;
        };
        let others = self
            .suspects
            .iter()
            .any(|(&(w, l), s)| (w, l) != key && between_workers(w, s.4));
        others && now.duration_since(confirmed_since) < self.timeout / 2
    }

    /// The finding for messages `lost` (sender, its link, receiver, waited since,
    /// fingerprint; not empty): one lost message, or a cut when several links lost one.
    fn lost_finding(&self, lost: &[LostMessage]) -> Finding {
        let (src, link, dst, _, fp) = lost[0];
        let worker = |c: ChipId| self.worker_of(c).unwrap_or(u32::MAX);
        let pairs: BTreeSet<(u32, u32)> = lost
            .iter()
            .map(|(s, _, d, _, _)| (worker(*s).min(worker(*d)), worker(*s).max(worker(*d))))
            .collect();
        let links: BTreeSet<(ChipId, Link)> = lost.iter().map(|(s, l, ..)| (*s, *l)).collect();
        let since = lost.iter().map(|l| l.3).min().unwrap_or_else(wall_ns);
        let waiting = self.waiting_chips();
        let first = format!(
            "the first from {} on link {link}, in {fp}",
            self.describe_chip(src, None)
        );
        // Several links between different workers: the network between them, not one link.
        // Several links inside workers (chips cut apart, as an injected partition of a torch
        // job's ranks does): the cut, named by its chips.
        let (kind, explanation) = if links.len() >= 2 && pairs.iter().all(|(a, b)| a == b) {
            (
                HangKind::Partition,
                format!(
                    "Chips are cut apart: messages sent on {} links between chips of the same worker ({}) never arrived ({first}), and {}: in-process links lose nothing, so look for an injected partition or drop.",
                    links.len(),
                    cut_pairs(lost),
                    Self::describe_waiting(&waiting),
                ),
            )
        } else if links.len() >= 2 && pairs.iter().all(|(a, b)| a != b) {
            let pairs: Vec<String> = pairs.iter().map(|(a, b)| format!("{a}-{b}")).collect();
            (
                HangKind::Partition,
                format!(
                    "Workers are cut apart: messages sent on {} links between workers {} never arrived ({first}), and {}: check the network between those workers.",
                    links.len(),
                    pairs.join(", "),
                    Self::describe_waiting(&waiting),
                ),
            )
        } else {
            (
                HangKind::LostMessage,
                format!(
                    "{} sent its message of {fp} on link {link} to chip {dst} (worker {}), which never received it, and {}: the link lost a message; check that link's transport.",
                    self.describe_chip(src, None),
                    worker(dst),
                    Self::describe_waiting(&waiting),
                ),
            )
        };
        Finding {
            kind,
            chip: Some(src),
            worker: Some(worker(src)),
            link: Some(link),
            seq: Some(fp.seq),
            op: Some(fp.op.to_string()),
            explanation,
            waiting,
            effect_wall_ns: since,
        }
    }

    /// Whether every message worker `from` handed to the transport for worker `to` has
    /// arrived there, as their last heartbeats tell.
    fn transport_idle(&self, from: Option<u32>, to: u32) -> bool {
        let Some(from) = from else { return false };
        let count = |w: u32, peer: u32, pick: fn(&(u32, u64, u64)) -> u64| {
            self.workers
                .get(&w)?
                .summary
                .transport
                .iter()
                .find(|t| t.0 == peer)
                .map(pick)
        };
        let handed = count(from, to, |t| t.1);
        let arrived = count(to, from, |t| t.2);
        handed.is_some() && handed == arrived
    }

    /// Every worker stuck for the timeout (or finished) with nothing lost and no root: the
    /// chips wait on each other in a cycle.
    fn deadlock(&self, now: Instant) -> Option<Finding> {
        // A lost message still being confirmed explains the waits better.
        if !self.suspects.is_empty() || self.live().any(|(_, v)| v.summary.suspected > 0) {
            return None;
        }
        let mut oldest: Option<(u64, ChipId, u32)> = None;
        for (w, v) in self.live() {
            if now.duration_since(v.last_moving) < self.timeout {
                return None;
            }
            // A worker none of whose chips waits (their programs finished) is not part of
            // the cycle; one whose waiting chips are not judged stuck yet may still be.
            if v.summary.oldest.is_none() && v.summary.waiting.count() > 0 {
                return None;
            }
            if let Some((c, since)) = v.summary.oldest
                && oldest.is_none_or(|o| since < o.0)
            {
                oldest = Some((since, c, w));
            }
        }
        let (since, chip, worker) = oldest?;
        let fp = self
            .workers
            .get(&worker)
            .and_then(|v| v.summary.remote.iter().find(|w| w.waiter == chip))
            .map(|w| w.fingerprint);
        let waiting = self.waiting_chips();
        Some(Finding {
            kind: HangKind::StalledChip,
            chip: Some(chip),
            worker: Some(worker),
            link: None,
            seq: fp.map(|f| f.seq),
            op: fp.map(|f| f.op.to_string()),
            explanation: format!(
                "{} all wait on each other and nothing was lost on the way: a deadlock; {} went quiet first.",
                chips_count(waiting.count()),
                self.describe_chip(chip, Some(worker)),
            ),
            waiting,
            effect_wall_ns: since,
        })
    }
}

/// A message sent and never received: its sender, the link as the sender names it, its
/// receiver, since when (wall ns) the receiver waits, and the collective.
type LostMessage = (ChipId, Link, ChipId, u64, Fingerprint);

/// A wait across workers that looked lost: sent and arrived counts, when first seen, the
/// waiter's worker's heartbeat then, and the peer.
type Suspect = (u64, u64, Instant, u64, ChipId);

/// The chip pairs of `lost` (`3->7`), sorted, at most 8 and how many more.
fn cut_pairs(lost: &[LostMessage]) -> String {
    let mut cut: Vec<String> = lost
        .iter()
        .map(|(s, _, d, ..)| format!("{s}->{d}"))
        .collect();
    cut.sort();
    cut.dedup();
    let more = cut.len().saturating_sub(8);
    cut.truncate(8);
    let mut text = cut.join(", ");
    if more > 0 {
        text.push_str(&format!(" and {more} more"));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_collectives::{Blocked, ChipStatus, DType, OpKind, Tag};
    use podsim_topology::Dir;
    use podsim_worker::Summariser;

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

    fn pod() -> Pod {
        Pod::single("4".parse().unwrap())
    }

    /// Workers of a 4-chip ring: each owns `chips`, summarised from statuses as its
    /// heartbeat thread would.
    struct Worker {
        id: u32,
        summariser: Summariser,
        /// The share of each heartbeat interval its executor waited for a CPU.
        cpu_wait_share: f64,
    }

    impl Worker {
        fn new(id: u32, chips: &[ChipId], t0: Instant) -> Worker {
            Worker {
                id,
                summariser: Summariser::new(&pod(), chips.to_vec(), T, t0),
                cpu_wait_share: 0.0,
            }
        }

        fn beat(&mut self, w: &mut Watchdog, statuses: &[ChipStatus], at: Instant) {
            self.beat_lagging(w, statuses, at, Duration::ZERO);
        }

        /// A heartbeat while a runnable chip may have waited `lag` for its turn.
        fn beat_lagging(
            &mut self,
            w: &mut Watchdog,
            statuses: &[ChipStatus],
            at: Instant,
            lag: Duration,
        ) {
            self.beat_with_waits(w, statuses, at, lag, Vec::new());
        }

        /// A heartbeat that also lists which chip waits on which (as a small worker's do).
        fn beat_with_waits(
            &mut self,
            w: &mut Watchdog,
            statuses: &[ChipStatus],
            at: Instant,
            lag: Duration,
            waits: Vec<(ChipId, Vec<ChipId>)>,
        ) {
            let mut summary = self.summariser.beat(
                at,
                wall_ns(),
                lag,
                |i| {
                    let s = &statuses[i];
                    podsim_collectives::Glance {
                        progress: s.progress,
                        blocked: s.blocked.len(),
                        blocked_since_wall_ns: s.blocked.iter().map(|b| b.since_wall_ns).min(),
                        computing: false,
                        idle: s.idle,
                        step: 0,
                    }
                },
                |i| statuses[i].clone(),
            );
            // The tests' workers pair up (0 and 1), with nothing in flight between them.
            summary.transport = vec![(1 - self.id.min(1), 7, 7)];
            summary.cpu_wait_share = self.cpu_wait_share;
            w.heartbeat(
                self.id,
                HeartbeatStatus {
                    summary,
                    waits,
                    faults: Vec::new(),
                },
                at,
            );
        }
    }

    /// A check where no process state is known.
    fn check(w: &mut Watchdog, at: Instant) -> Option<Finding> {
        w.check(at, |_| Liveness::Unknown)
    }

    fn watchdog(workers: &[u32], t0: Instant) -> Watchdog {
        let mut w = Watchdog::new(pod(), T, Duration::from_millis(10));
        w.start(workers.iter().map(|&w| (w, Some(100 + w))), t0);
        w
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
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        for i in 0..10u64 {
            // Chip 0 waits on chip 1, but chip 1 keeps making progress; chips 2 and 3 are
            // quiet and wait on no one, and nobody waits on them (finished).
            let at = t0 + T * i as u32;
            let chips = [
                status(0, 1, &[(1, PLUS)]),
                status(1, i, &[]),
                status(2, 1, &[]),
                status(3, 1, &[]),
            ];
            worker.beat(&mut w, &chips, at);
            assert_eq!(check(&mut w, at), None, "tick {i}");
        }
    }

    #[test]
    fn the_root_of_the_waits_is_the_stalled_chip() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        let chips = [
            status(0, 5, &[(1, PLUS)]),
            status(1, 5, &[(2, PLUS)]),
            status(2, 5, &[]),
            status(3, 9, &[]),
        ];
        worker.beat(&mut w, &chips, t0);
        worker.beat(&mut w, &chips, t0 + T / 2);
        assert_eq!(check(&mut w, t0 + T / 2), None);
        worker.beat(&mut w, &chips, t0 + T * 2);
        assert_eq!(
            check(&mut w, t0 + T * 2),
            None,
            "a root is confirmed by the next beat"
        );
        worker.beat(&mut w, &chips, t0 + T * 3);
        let f = check(&mut w, t0 + T * 3).unwrap();
        assert_eq!(
            (f.kind, f.chip, f.worker),
            (HangKind::StalledChip, Some(2), Some(0))
        );
        assert_eq!(f.waiting, Ranges(vec![(0, 1)]));
        assert_eq!(f.seq, Some(3));
        assert_eq!(
            f.link,
            Some(MINUS),
            "named from the culprit: its -x link to chip 1"
        );
        assert!(f.explanation.contains("pid 100"), "{}", f.explanation);
        assert!(
            f.explanation.contains("2 chips wait (ids 0-1)"),
            "{}",
            f.explanation
        );
    }

    #[test]
    fn a_chip_busy_past_the_busy_limit_is_a_root_and_within_it_is_excused() {
        // Chip 2 has been in its program's own work for a second (a PyTorch rank's loop) while
        // chips 0, 1 and 3 wait on it.
        let t0 = Instant::now();
        let mut chips = [
            status(0, 5, &[(1, PLUS)]),
            status(1, 5, &[(2, PLUS)]),
            status(2, 5, &[]),
            status(3, 5, &[(2, MINUS)]),
        ];
        chips[2].computing_since_ns = Some(wall_ns() - 1_000_000_000);
        for (limit, hang) in [(Duration::from_secs(600), false), (T * 5, true)] {
            let mut w = watchdog(&[0], t0);
            let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
            worker.summariser = worker.summariser.with_busy_limit(limit);
            for at in [t0, t0 + T * 2, t0 + T * 3] {
                worker.beat(&mut w, &chips, at);
            }
            let f = check(&mut w, t0 + T * 3);
            assert_eq!(f.is_some(), hang, "limit {limit:?}: {f:?}");
            if let Some(f) = f {
                assert_eq!((f.kind, f.chip), (HangKind::StalledChip, Some(2)));
                assert!(
                    f.explanation.contains("busy in its program's own work"),
                    "{}",
                    f.explanation
                );
            }
        }
    }

    #[test]
    fn a_stalled_chip_on_another_worker_is_found_through_the_remote_waits() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0, 1], t0);
        let (mut a, mut b) = (Worker::new(0, &[0, 1], t0), Worker::new(1, &[2, 3], t0));
        // Chip 1 waits on chip 2 (worker 1), which waits on no one.
        let left = [status(0, 5, &[(1, PLUS)]), status(1, 5, &[(2, PLUS)])];
        let right = [status(2, 5, &[]), status(3, 5, &[(2, MINUS)])];
        for at in [t0, t0 + T * 2, t0 + T * 3] {
            a.beat(&mut w, &left, at);
            b.beat(&mut w, &right, at);
        }
        let f = check(&mut w, t0 + T * 3).unwrap();
        assert_eq!(
            (f.kind, f.chip, f.worker),
            (HangKind::StalledChip, Some(2), Some(1))
        );
        assert_eq!(f.waiting.count(), 3);
    }

    /// A pipeline whose middle stage stalls just after the stages around it went quiet (as a
    /// PyTorch pipeline does when a stage stops at its step's end): for a moment every waiting
    /// chip has waited the whole timeout and the stalled one not yet. That is not a deadlock -
    /// a chip waiting on no one is one the wait-for graph may end at - and the verdict waits
    /// for the root.
    #[test]
    fn a_chip_quiet_for_less_than_the_timeout_is_a_root_to_come_not_a_deadlock() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        let stalled_at = |progress| {
            [
                status(0, 5, &[(1, PLUS)]),
                status(1, progress, &[]),
                status(2, 5, &[(1, MINUS)]),
                status(3, 5, &[(2, MINUS)]),
            ]
        };
        worker.beat(&mut w, &stalled_at(5), t0);
        // Chip 1 makes its last move (it stalls) just after the others went quiet.
        let last_move = t0 + T / 4;
        worker.beat(&mut w, &stalled_at(6), last_move);
        // One beat a hair short of the timeout after chip 1's move, the check just after it.
        let almost = last_move + T - Duration::from_millis(1);
        worker.beat(&mut w, &stalled_at(6), almost);
        assert_eq!(
            check(&mut w, last_move + T + Duration::from_millis(1)),
            None,
            "chip 1 waits on no one: not yet stale, not a deadlock"
        );
        for at in [last_move + T * 2, last_move + T * 3] {
            worker.beat(&mut w, &stalled_at(6), at);
        }
        let f = check(&mut w, last_move + T * 3).unwrap();
        assert_eq!((f.kind, f.chip), (HangKind::StalledChip, Some(1)));
        assert_eq!(f.waiting.count(), 3);
    }

    /// Chips 0 and 1 each receive from the other first (a classic point-to-point deadlock)
    /// while chips 2 and 3 wait on no one: the cycle is called at once when every chip is in
    /// it, and once the idle chips have been judged (nobody waits on them) when they are not.
    fn deadlock_found(idle_chips_finished: bool) -> Option<Finding> {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        // Finished: waiting on no one. Otherwise chips 2 and 3 are a second cycle.
        let (on_3, on_2): (&[_], &[_]) = if idle_chips_finished {
            (&[], &[])
        } else {
            (&[(3, PLUS)], &[(2, MINUS)])
        };
        let chips = [
            status(0, 5, &[(1, PLUS)]),
            status(1, 5, &[(0, MINUS)]),
            status(2, 5, on_3),
            status(3, 5, on_2),
        ];
        let mut found = None;
        for i in 0..8 {
            let at = t0 + T / 2 * i;
            worker.beat(&mut w, &chips, at);
            if let Some(f) = check(&mut w, at) {
                found = Some((i, f));
                break;
            }
        }
        let (i, f) = found?;
        assert!(i >= 2, "not before the timeout: beat {i}");
        Some(f)
    }

    #[test]
    fn chips_that_wait_on_each_other_are_a_deadlock_even_beside_finished_ones() {
        for finished in [false, true] {
            let f = deadlock_found(finished).unwrap_or_else(|| panic!("finished {finished}"));
            assert_eq!(f.kind, HangKind::StalledChip, "{}", f.explanation);
            assert!(f.explanation.contains("deadlock"), "{}", f.explanation);
            let cycle = if finished { 2 } else { 4 };
            assert_eq!(f.waiting.count(), cycle, "{}", f.explanation);
        }
    }

    #[test]
    fn a_chip_that_may_not_have_had_its_turn_is_not_a_culprit() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        let chips = [
            status(0, 5, &[(1, PLUS)]),
            status(1, 5, &[]),
            status(2, 5, &[]),
            status(3, 5, &[]),
        ];
        // The host is so busy that a runnable chip may have waited half the timeout: chip 1
        // may be runnable, not stalled.
        for i in 0..5 {
            worker.beat_lagging(&mut w, &chips, t0 + T * i, T / 2);
            assert_eq!(check(&mut w, t0 + T * i), None, "tick {i}");
        }
        // Once the host keeps up, it is (confirmed at the next heartbeat).
        worker.beat(&mut w, &chips, t0 + T * 5);
        worker.beat(&mut w, &chips, t0 + T * 6);
        let f = check(&mut w, t0 + T * 6).unwrap();
        assert_eq!((f.kind, f.chip), (HangKind::StalledChip, Some(1)));
    }

    /// Chips 0, 2 and 3 of one worker wait on chip 1 at each of ten heartbeats, `T` apart,
    /// and it moves on each time; its executor lags `lag` and waits `cpu_wait_share` of each
    /// interval for a CPU. The chips named stragglers.
    fn stragglers_of_one_slow_chip(lag: Duration, cpu_wait_share: f64) -> Vec<ChipId> {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        worker.cpu_wait_share = cpu_wait_share;
        for i in 0..10u32 {
            let moving: Vec<ChipStatus> =
                (0..4).map(|c| status(c, 5 + u64::from(i), &[])).collect();
            let waits = vec![(0, vec![1]), (2, vec![1]), (3, vec![1])];
            worker.beat_with_waits(&mut w, &moving, t0 + T * i, lag, waits);
            assert_eq!(check(&mut w, t0 + T * i), None, "tick {i}");
        }
        // As at the end of a launch: the job is done before its stragglers are named.
        w.finished(0);
        w.stragglers().iter().map(|s| s.chip).collect()
    }

    #[test]
    fn a_share_within_chance_of_a_short_run_is_no_evidence() {
        // A fault-free job on gRPC links (16 chips, 16 checks): one chip fell on 25% of the
        // run, the others on 4.8% on average. Chance: exp(-16 KL) = exp(-3.7), against a bar
        // of 1e-3 / 16.
        assert!(!beyond_chance(0.248, 0.048, 16.0, 16.0));
        // The same shares over 160 checks are no chance.
        assert!(beyond_chance(0.248, 0.048, 160.0, 16.0));
        // A chip slowed tenfold falls on nearly every check, even of a short run.
        assert!(beyond_chance(0.9, 0.05, 24.0, 16.0));
        // But three checks are too few for anything.
        assert!(!beyond_chance(0.9, 0.05, 3.0, 16.0));
        // No more than the others, however long the run.
        assert!(!beyond_chance(0.05, 0.05, 1e6, 16.0));
        // Nobody else was ever waited on.
        assert!(beyond_chance(0.3, 0.0, 10.0, 16.0));
        // The more chips tested, the higher the bar: 32,768 chips need more evidence.
        assert!(beyond_chance(0.5, 0.05, 12.0, 16.0));
        assert!(!beyond_chance(0.5, 0.05, 12.0, 32_768.0));
    }

    /// Chip 0 of a 16-chip ring, on one worker, waits at each of `checks` heartbeats `T`
    /// apart on the chips `waited(i)` names at the i-th. The chips named stragglers.
    fn stragglers_on_a_ring_of_16(checks: u32, waited: impl Fn(u32) -> Vec<ChipId>) -> Vec<ChipId> {
        let t0 = Instant::now();
        let ring = Pod::single("16".parse().unwrap());
        let mut w = Watchdog::new(ring.clone(), T, Duration::from_millis(10));
        w.start([(0, Some(100))], t0);
        let mut worker = Worker {
            id: 0,
            summariser: Summariser::new(&ring, (0..16).collect(), T, t0),
            cpu_wait_share: 0.0,
        };
        for i in 0..checks {
            let moving: Vec<ChipStatus> =
                (0..16).map(|c| status(c, 5 + u64::from(i), &[])).collect();
            let waits = vec![(0, waited(i))];
            worker.beat_with_waits(&mut w, &moving, t0 + T * i, Duration::ZERO, waits);
            let _ = check(&mut w, t0 + T * i);
        }
        w.finished(0);
        w.stragglers().iter().map(|s| s.chip).collect()
    }

    #[test]
    fn what_chance_explains_is_no_straggler_and_slow_chips_do_not_hide_each_other() {
        // Nine intervals (a heartbeat's waits count for the interval its check closes): chip
        // 1 is waited on in four, ten other chips in one each. It passes every floor (400 ms,
        // over three medians of 100 ms and a fifth of the run), but one chip in sixteen falls
        // on four of nine samples at a chance of 7% too often to count as evidence.
        let pattern = |i: u32| match (i + 8) % 9 {
            0..=3 => vec![1],
            k => vec![2 * k - 6, 2 * k - 5],
        };
        assert_eq!(
            stragglers_on_a_ring_of_16(10, pattern),
            Vec::<ChipId>::new()
        );
        // The same shares over 90 samples are not chance.
        assert_eq!(stragglers_on_a_ring_of_16(91, pattern), vec![1]);
        // Six chips (one slow host's) waited on throughout three intervals: chance is what
        // the other ten were held against (nothing), not the mean with the other five slow
        // ones (a third), under which none of them would be named.
        let six = |_| (1..=6).collect();
        assert_eq!(
            stragglers_on_a_ring_of_16(4, six),
            (1..=6).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_chip_held_up_by_a_busy_host_is_no_straggler() {
        assert_eq!(stragglers_of_one_slow_chip(Duration::ZERO, 0.0), vec![1]);
        // The host is so far behind that a runnable chip may have waited half a heartbeat.
        assert_eq!(
            stragglers_of_one_slow_chip(T / 2, 0.0),
            Vec::<ChipId>::new()
        );
    }

    #[test]
    fn the_time_a_host_kept_a_chip_off_the_cpu_is_not_the_chips() {
        // Its executor waited for a CPU 30% of the time: the other 70% of the 0.9 s its
        // peers waited on it (0.63 s) is still far above a fifth of the run.
        assert_eq!(stragglers_of_one_slow_chip(Duration::ZERO, 0.3), vec![1]);
        // 90%: the 0.09 s left is under a fifth of the run.
        assert_eq!(
            stragglers_of_one_slow_chip(Duration::ZERO, 0.9),
            Vec::<ChipId>::new()
        );
    }

    #[test]
    fn a_chip_of_a_worker_not_heard_from_is_not_counted() {
        let t0 = Instant::now();
        // Chip 0 (worker 0) waits on chip 1 (worker 1), ten heartbeats `T` apart; worker 0
        // beats the first `waiter_beats` times, worker 1 the first `slow_beats` times.
        let stragglers = |waiter_beats: u32, slow_beats: u32| {
            let mut w = watchdog(&[0, 1], t0);
            let mut waiter = Worker::new(0, &[0], t0);
            let mut slow = Worker::new(1, &[1, 2, 3], t0);
            for i in 0..10u32 {
                let at = t0 + T * i;
                let p = 5 + u64::from(i);
                if i < waiter_beats {
                    let waits = vec![(0, vec![1])];
                    let zero = [status(0, p, &[])];
                    waiter.beat_with_waits(&mut w, &zero, at, Duration::ZERO, waits);
                }
                if i < slow_beats {
                    let three: Vec<ChipStatus> = (1..4).map(|c| status(c, p, &[])).collect();
                    slow.beat(&mut w, &three, at);
                }
                let _ = check(&mut w, at);
            }
            w.stragglers()
                .iter()
                .map(|s| s.chip)
                .collect::<Vec<ChipId>>()
        };
        assert_eq!(stragglers(10, 10), vec![1]);
        // Worker 1 falls silent after its second heartbeat: what chip 1 did after that is
        // not known, so the waits on it are not held against it.
        assert_eq!(stragglers(10, 2), Vec::<ChipId>::new());
        // Worker 1 never reports: nothing says chip 1 is its, or what it does.
        assert_eq!(stragglers(10, 0), Vec::<ChipId>::new());
        // The waiter's worker falls silent: its last list of waits is stale.
        assert_eq!(stragglers(2, 10), Vec::<ChipId>::new());
    }

    #[test]
    fn a_chip_its_executor_reports_idle_is_a_culprit_on_a_busy_host() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        let idle = |s: ChipStatus| ChipStatus { idle: true, ..s };
        // As before the host lags by half the timeout, but chip 1 has had its turn: polled,
        // nothing left to do, not woken since. Its waiters are no culprits whatever they say.
        let chips = [
            status(0, 5, &[(1, PLUS)]),
            idle(status(1, 5, &[])),
            status(2, 5, &[]),
            status(3, 5, &[]),
        ];
        let mut found = None;
        for i in 0..8 {
            worker.beat_lagging(&mut w, &chips, t0 + T * i, T / 2);
            if let Some(f) = check(&mut w, t0 + T * i) {
                found = Some((i, f));
                break;
            }
        }
        let (tick, f) = found.expect("diagnosed while the host still lags");
        assert_eq!((f.kind, f.chip), (HangKind::StalledChip, Some(1)));
        assert!(tick <= 6, "at tick {tick}");
    }

    #[test]
    fn a_wait_on_a_moving_chip_of_the_same_worker_is_excused() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1, 2, 3], t0);
        for i in 0..6u32 {
            // Chip 3 is quiet and waits on no one, but nobody waits on it; 0 -> 1 -> 2 and 2
            // moves.
            let chips = [
                status(0, 5, &[(1, PLUS)]),
                status(1, 5, &[(2, PLUS)]),
                status(2, u64::from(i), &[]),
                status(3, 5, &[]),
            ];
            worker.beat(&mut w, &chips, t0 + T * i);
            assert_eq!(check(&mut w, t0 + T * i), None);
        }
    }

    /// Chips 0 and 1 of one worker wait on each other: each sent 3 messages to the other,
    /// plus one more from chip 0 when `from_0` and from chip 1 when `from_1`, and each took
    /// 3. The watchdog's finding after three heartbeats.
    fn lost_between_two_chips(from_0: bool, from_1: bool) -> Finding {
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1], t0);
        let mut a = status(0, 5, &[(1, PLUS)]);
        let mut b = status(1, 5, &[(0, MINUS)]);
        a.sent[link_slot(PLUS)] = 3 + u64::from(from_0);
        b.sent[link_slot(MINUS)] = 3 + u64::from(from_1);
        a.received[link_slot(PLUS)] = 3;
        b.received[link_slot(MINUS)] = 3;
        let chips = [a, b];
        worker.beat(&mut w, &chips, t0);
        worker.beat(&mut w, &chips, t0 + T * 2);
        worker.beat(&mut w, &chips, t0 + T * 3);
        check(&mut w, t0 + T * 3).unwrap()
    }

    #[test]
    fn a_message_sent_but_never_received_names_the_link() {
        // Chip 1's fourth message on its -x link (to chip 0) never arrived.
        let f = lost_between_two_chips(false, true);
        assert_eq!(
            (f.kind, f.chip, f.link),
            (HangKind::LostMessage, Some(1), Some(MINUS))
        );
    }

    #[test]
    fn messages_lost_on_several_links_of_one_worker_are_a_cut_of_chips() {
        let f = lost_between_two_chips(true, true);
        assert_eq!(f.kind, HangKind::Partition, "{}", f.explanation);
        assert!(f.explanation.contains("0->1, 1->0"), "{}", f.explanation);
    }

    #[test]
    fn a_cut_whose_links_settle_at_different_heartbeats_is_named_whole() {
        // Chip 1's message to chip 0 is lost from the start; chip 0's to chip 1 a heartbeat
        // later, so its suspicion settles later (a quarter of the timeout, 25 ms, each).
        let t0 = Instant::now();
        let mut w = watchdog(&[0], t0);
        let mut worker = Worker::new(0, &[0, 1], t0);
        let mut a = status(0, 5, &[(1, PLUS)]);
        let mut b = status(1, 5, &[(0, MINUS)]);
        a.sent[link_slot(PLUS)] = 3;
        b.sent[link_slot(MINUS)] = 4;
        a.received[link_slot(PLUS)] = 3;
        b.received[link_slot(MINUS)] = 3;
        let ms = Duration::from_millis;
        worker.beat(&mut w, &[a.clone(), b.clone()], t0);
        // Chip 0 sends (progress), then waits again.
        a.sent[link_slot(PLUS)] = 4;
        a.progress += 1;
        let chips = [a, b];
        worker.beat(&mut w, &chips, t0 + ms(20));
        // The first link's loss is confirmed, the second's still settling: no verdict yet.
        worker.beat(&mut w, &chips, t0 + ms(30));
        let early = check(&mut w, t0 + ms(30));
        assert!(
            early
                .as_ref()
                .is_none_or(|f| f.kind != HangKind::LostMessage),
            "{early:?}"
        );
        worker.beat(&mut w, &chips, t0 + ms(50));
        let f = check(&mut w, t0 + ms(50)).unwrap();
        assert_eq!(f.kind, HangKind::Partition, "{}", f.explanation);
    }

    #[test]
    fn a_message_lost_between_workers_is_found_from_the_boundary_counters() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0, 1], t0);
        let (mut x, mut y) = (Worker::new(0, &[0, 1], t0), Worker::new(1, &[2, 3], t0));
        // Chip 2 sent 4 messages on its -x link to chip 1 (another worker), which took 3.
        let mut one = status(1, 5, &[(2, PLUS)]);
        one.received[link_slot(PLUS)] = 3;
        let mut two = status(2, 5, &[(3, PLUS)]);
        two.sent[link_slot(MINUS)] = 4;
        let left = [status(0, 5, &[(1, PLUS)]), one];
        let right = [two, status(3, 5, &[(0, PLUS)])];
        for at in [t0, t0 + T * 2] {
            x.beat(&mut w, &left, at);
            y.beat(&mut w, &right, at);
            assert_eq!(check(&mut w, at), None, "suspected, not yet confirmed");
        }
        // Confirmed by the next heartbeat with the same counts.
        x.beat(&mut w, &left, t0 + T * 3);
        y.beat(&mut w, &right, t0 + T * 3);
        let f = check(&mut w, t0 + T * 3).unwrap();
        assert_eq!(
            (f.kind, f.chip, f.link, f.worker),
            (HangKind::LostMessage, Some(2), Some(MINUS), Some(1))
        );
    }

    #[test]
    fn a_cut_between_workers_whose_links_settle_a_heartbeat_apart_is_named_whole() {
        // Worker 0 holds chips 0 and 1, worker 1 chips 2 and 3, on a ring: two links cross.
        // Chip 2's fourth message to chip 1 is lost from the start; chip 0's fourth to chip 3
        // (around the ring), sent a heartbeat later, is lost too, so its suspicion settles
        // later (a quarter of the timeout, 25 ms, each).
        let t0 = Instant::now();
        let mut w = watchdog(&[0, 1], t0);
        let (mut x, mut y) = (Worker::new(0, &[0, 1], t0), Worker::new(1, &[2, 3], t0));
        let mut zero = status(0, 5, &[(1, PLUS)]);
        zero.sent[link_slot(MINUS)] = 3;
        let mut one = status(1, 5, &[(2, PLUS)]);
        one.received[link_slot(PLUS)] = 3;
        let mut two = status(2, 5, &[(3, PLUS)]);
        two.sent[link_slot(MINUS)] = 4;
        let mut three = status(3, 5, &[(0, PLUS)]);
        three.received[link_slot(PLUS)] = 3;
        let right = [two, three];
        let ms = Duration::from_millis;
        let mut beat = |w: &mut Watchdog, zero: &ChipStatus, at| {
            x.beat(w, &[zero.clone(), one.clone()], at);
            y.beat(w, &right, at);
        };
        beat(&mut w, &zero, t0);
        assert_eq!(check(&mut w, t0), None);
        // Chip 0 sends its fourth message (progress), then waits again.
        zero.sent[link_slot(MINUS)] = 4;
        zero.progress += 1;
        for at in [20, 30, 50] {
            beat(&mut w, &zero, t0 + ms(at));
            assert_eq!(check(&mut w, t0 + ms(at)), None, "at {at} ms");
        }
        // The first link's loss is confirmed (suspected since 30 ms), the second's still
        // settling (since 50 ms): no verdict yet, where one link alone was a lost message.
        beat(&mut w, &zero, t0 + ms(60));
        assert_eq!(check(&mut w, t0 + ms(60)), None);
        beat(&mut w, &zero, t0 + ms(80));
        let f = check(&mut w, t0 + ms(80)).unwrap();
        assert_eq!(f.kind, HangKind::Partition, "{}", f.explanation);
        assert!(f.explanation.contains("workers 0-1"), "{}", f.explanation);
    }

    #[test]
    fn a_worker_that_stops_heartbeating_is_frozen() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0, 1], t0);
        let mut worker = Worker::new(0, &[0, 1], t0);
        for i in 0..3u32 {
            let chips = [status(0, u64::from(i), &[]), status(1, u64::from(i), &[])];
            worker.beat(&mut w, &chips, t0 + T * i / 2);
        }
        let f = check(&mut w, t0 + T + T / 2).unwrap();
        assert_eq!((f.kind, f.worker), (HangKind::FrozenWorker, Some(1)));
        assert!(f.explanation.contains("pid 101"), "{}", f.explanation);
        // A process known to run is given five timeouts (a starved host), one known stopped
        // none.
        let running = Liveness::Running {
            cpu_wait_share: 0.0,
        };
        assert_eq!(w.check(t0 + T + T / 2, |_| running), None);
        let stopped_one = |w: u32| if w == 1 { Liveness::Stopped } else { running };
        let f = w.check(t0 + T + T / 2, stopped_one).unwrap();
        assert!(f.explanation.contains("SIGSTOP"), "{}", f.explanation);
        assert!(w.check(t0 + T * 6, |_| running).is_some());
        w.finished(1);
    }

    #[test]
    fn time_a_silent_process_spent_waiting_for_a_cpu_does_not_count_towards_frozen() {
        let t0 = Instant::now();
        let mut w = watchdog(&[0, 1], t0);
        let mut worker = Worker::new(0, &[0, 1], t0);
        let chips = [status(0, 0, &[]), status(1, 0, &[])];
        worker.beat(&mut w, &chips, t0);
        // Worker 1 is silent from t0 on; its threads wait for a CPU 90 % of the time (a host
        // with twenty times more runnable threads than cores). Checked every half timeout.
        let starved = Liveness::Running {
            cpu_wait_share: 0.9,
        };
        for i in 1..=40u32 {
            let at = t0 + T * i / 2;
            worker.beat(&mut w, &chips, at);
            assert_eq!(
                w.check(at, |_| starved),
                None,
                "silent {} timeouts",
                f64::from(i) / 2.0
            );
        }
        // Twenty timeouts of silence count as two: still not frozen. Not starved any more,
        // it owes a heartbeat within the rest of the five.
        let running = Liveness::Running {
            cpu_wait_share: 0.0,
        };
        worker.beat(&mut w, &chips, t0 + T * 22);
        assert_eq!(w.check(t0 + T * 22, |_| running), None);
        worker.beat(&mut w, &chips, t0 + T * 24);
        let f = w.check(t0 + T * 24, |_| running).unwrap();
        assert_eq!((f.kind, f.worker), (HangKind::FrozenWorker, Some(1)));
        assert!(
            f.explanation.contains("not kept waiting for a CPU"),
            "{}",
            f.explanation
        );
    }

    #[test]
    fn ranges_are_compact_and_readable() {
        let r = Ranges::from_ids([5, 0, 1, 2, 7, 6, 9]);
        assert_eq!(r, Ranges(vec![(0, 2), (5, 7), (9, 9)]));
        assert_eq!((r.count(), r.contains(6), r.contains(8)), (7, true, false));
        assert_eq!(r.to_string(), "0-2, 5-7, 9");
        assert_eq!(r.without(6).to_string(), "0-2, 5, 7, 9");
        let many = Ranges::from_ids((0..40).map(|i| i * 2));
        assert_eq!(many.to_string().matches(", ").count(), 7);
        assert!(many.to_string().ends_with("and 32 more ranges"));
        assert_eq!(
            Ranges::from_ids([1, 2])
                .union(&Ranges::from_ids([3, 9]))
                .to_string(),
            "1-3, 9"
        );
    }
}
