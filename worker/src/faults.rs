//! Fault injection from a job's `[[faults]]`: what each fault does, when it fires, and the
//! record of what fired (sent to the coordinator with the heartbeats, so a diagnosis can say
//! how long after the fault it was made).
//!
//! | kind | target | effect |
//! |---|---|---|
//! | `stall` | chip | the chip stops making progress (not waiting on anyone) |
//! | `crash` | worker (or a chip's worker) | the process aborts |
//! | `freeze` | worker (or a chip's worker) | the process stops itself with SIGSTOP |
//! | `drop` | link | messages on it vanish (the sender believes they left): `once` or always |
//! | `delay` | link | every message is `delay_ms` late, in wall and virtual time |
//! | `slow` | chip | the chip runs `factor` times slower (each send waits for the extra time) |
//! | `desync` | chip | the chip skips a collective, calls another op, or another size |
//! | `corrupt` | link | a bit of each message's payload flips (data mode) |
//! | `partition` | worker or chip groups | every message between two groups vanishes |
//!
//! A fault fires when its target reaches `at_step` (training step or script iteration),
//! `at_seq` (the chip's collective number, from 0), or `after_ms` of job time; without a
//! trigger it is active from the start.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use podsim_collectives::faults::{BeforeCollective, FaultHook, OnSend};
use podsim_collectives::{Fingerprint, Message, OpKind, Payload, wall_ns};
use podsim_job::faults::{DesyncMode, FaultEvent, FaultKind, FaultSpec};
use podsim_topology::{ChipId, Placement};

/// A worker's faults, consulted by its chips.
#[derive(Debug)]
pub struct FaultPlan {
    faults: Vec<FaultSpec>,
    placement: Placement,
    me: u32,
    start: Instant,
    steps: Vec<AtomicU64>,
    seqs: Vec<AtomicU64>,
    fired: Vec<AtomicBool>,
    events: Mutex<Vec<FaultEvent>>,
}

impl FaultPlan {
    pub fn new(faults: Vec<FaultSpec>, placement: Placement, me: u32, chips: usize) -> FaultPlan {
        let n = faults.len();
        FaultPlan {
            faults,
            placement,
            me,
            start: Instant::now(),
            steps: (0..chips).map(|_| AtomicU64::new(0)).collect(),
            seqs: (0..chips).map(|_| AtomicU64::new(0)).collect(),
            fired: (0..n).map(|_| AtomicBool::new(false)).collect(),
            events: Mutex::new(Vec::new()),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.faults.is_empty()
    }

    /// Faults fired in this process so far.
    pub fn events(&self) -> Vec<FaultEvent> {
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn triggered(&self, f: &FaultSpec, chip: ChipId) -> bool {
        let i = chip as usize;
        let step = self.steps.get(i).map_or(0, |s| s.load(Ordering::Relaxed));
        let seq = self.seqs.get(i).map_or(0, |s| s.load(Ordering::Relaxed));
        f.at_step.is_none_or(|n| step >= n)
            && f.at_seq.is_none_or(|n| seq >= n)
            && f.after_ms
                .is_none_or(|n| self.start.elapsed() >= Duration::from_millis(n))
    }

    /// Records that fault `i` fired (once); returns whether this call was the first.
    fn fire(&self, i: usize, detail: String) -> bool {
        if self.fired[i].swap(true, Ordering::SeqCst) {
            return false;
        }
        tracing::warn!("fault {i} ({}) fired: {detail}", self.faults[i].kind.name());
        self.events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(FaultEvent {
                fault: i,
                kind: self.faults[i].kind,
                at_wall_ns: wall_ns(),
                detail,
            });
        true
    }

    fn worker_target(&self, f: &FaultSpec) -> Option<u32> {
        f.worker
            .or_else(|| f.chip.map(|c| self.placement.worker_of(c)))
    }

    /// Process-level faults (crash, freeze) due for `chip` now.
    fn process_faults(&self, chip: ChipId) {
        for (i, f) in self.faults.iter().enumerate() {
            let hits = f.kind.ends_its_worker()
                && self.worker_target(f) == Some(self.me)
                && self.placement.worker_of(chip) == self.me
                && self.triggered(f, chip);
            if !hits || !self.fire(i, format!("worker {} at chip {chip}", self.me)) {
                continue;
            }
            match f.kind {
                FaultKind::Crash => std::process::abort(),
                _ => {
                    // SIGSTOP to ourselves, as `kill -STOP <pid>` from outside would.
                    let _ = std::process::Command::new("kill")
                        .arg("-STOP")
                        .arg(std::process::id().to_string())
                        .status();
                }
            }
        }
    }
}

/// The longest a fault holds a message (a `delay`'s, a `slow` chip's extra time): the
/// coordinator refuses longer delays (and any as long as the watchdog's timeout).
pub const MAX_FAULT_WAIT: Duration = Duration::from_secs(60);

/// `secs` of a fault's wait as a `Duration`, whatever the number (a fault arrives from the
/// coordinator: never trusted to be in range): NaN or negative waits nothing, and a wait is
/// at most [`MAX_FAULT_WAIT`].
fn fault_wait(secs: f64) -> Duration {
    if secs.is_nan() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs)
        .unwrap_or(MAX_FAULT_WAIT)
        .min(MAX_FAULT_WAIT)
}

fn other_op(op: OpKind) -> OpKind {
    if op == OpKind::AllGather {
        OpKind::AllReduce
    } else {
        OpKind::AllGather
    }
}

impl FaultHook for FaultPlan {
    fn at_step(&self, chip: ChipId, step: u64) -> BeforeCollective {
        if let Some(s) = self.steps.get(chip as usize) {
            s.store(step, Ordering::Relaxed);
        }
        self.process_faults(chip);
        for (i, f) in self.faults.iter().enumerate() {
            if f.kind == FaultKind::Stall
                && f.chip == Some(chip)
                && f.at_step.is_some()
                && self.triggered(f, chip)
                && self.fire(i, format!("chip {chip} stalls at step {step}"))
            {
                return BeforeCollective::Stall;
            }
        }
        BeforeCollective::Proceed
    }

    fn before_collective(
        &self,
        chip: ChipId,
        index: u64,
        fp: &mut Fingerprint,
    ) -> BeforeCollective {
        if let Some(s) = self.seqs.get(chip as usize) {
            s.store(index, Ordering::Relaxed);
        }
        self.process_faults(chip);
        for (i, f) in self.faults.iter().enumerate() {
            if f.chip != Some(chip) || !self.triggered(f, chip) {
                continue;
            }
            match f.kind {
                FaultKind::Stall
                    if self.fire(
                        i,
                        format!("chip {chip} stalls before collective {index} ({fp})"),
                    ) =>
                {
                    return BeforeCollective::Stall;
                }
                FaultKind::Desync
                    if self.fire(
                        i,
                        format!("chip {chip} desyncs at collective {index} ({fp})"),
                    ) =>
                {
                    match f.desync {
                        DesyncMode::Skip => return BeforeCollective::Skip,
                        DesyncMode::Op => fp.op = other_op(fp.op),
                        DesyncMode::Size => fp.count += 1,
                    }
                }
                _ => {}
            }
        }
        BeforeCollective::Proceed
    }

    fn on_send(&self, msg: &mut Message, busy: Duration) -> OnSend {
        let mut action = OnSend::Deliver;
        for (i, f) in self.faults.iter().enumerate() {
            let on_link = f.chip == Some(msg.src) && f.link == Some(msg.link);
            match f.kind {
                FaultKind::Drop if on_link && self.triggered(f, msg.src) => {
                    let first = self.fire(
                        i,
                        format!(
                            "chip {} link {} drops {}",
                            msg.src, msg.link, msg.fingerprint
                        ),
                    );
                    if first || !f.once {
                        return OnSend::Drop;
                    }
                }
                FaultKind::Partition if self.triggered(f, msg.src) => {
                    let (groups, what, a, b) = if f.chip_groups.is_empty() {
                        let worker = |c| self.placement.worker_of(c);
                        (&f.groups, "workers", worker(msg.src), worker(msg.dst))
                    } else {
                        (&f.chip_groups, "chips", msg.src, msg.dst)
                    };
                    let side = |x: u32| groups.iter().position(|g| g.contains(&x));
                    if let (Some(x), Some(y)) = (side(a), side(b))
                        && x != y
                    {
                        self.fire(i, format!("{what} {groups:?} cut apart"));
                        return OnSend::Drop;
                    }
                }
                FaultKind::Delay if on_link && self.triggered(f, msg.src) => {
                    self.fire(
                        i,
                        format!(
                            "chip {} link {} delayed by {} ms",
                            msg.src, msg.link, f.delay_ms
                        ),
                    );
                    let wall = fault_wait(f.delay_ms / 1e3);
                    action = OnSend::Delay {
                        wall,
                        virtual_ns: wall.as_secs_f64() * 1e9,
                    };
                }
                FaultKind::Corrupt if on_link && self.triggered(f, msg.src) => {
                    if let Some(mut v) = msg.payload.to_vec()
                        && let Some(x) = v.first_mut()
                    {
                        self.fire(i, format!("chip {} link {} flips bits", msg.src, msg.link));
                        *x = f32::from_bits(x.to_bits() ^ 0x0040_0000);
                        msg.payload = Payload::from_vec(v);
                    }
                }
                FaultKind::Slow if f.chip == Some(msg.src) && self.triggered(f, msg.src) => {
                    // The chip's own work since its last send takes `factor` times as long.
                    self.fire(i, format!("chip {} runs {}x slower", msg.src, f.factor));
                    action = OnSend::Delay {
                        wall: fault_wait(busy.as_secs_f64() * (f.factor - 1.0))
                            .min(Duration::from_secs(1)),
                        virtual_ns: 0.0,
                    };
                }
                _ => {}
            }
        }
        action
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_topology::{Dir, Link, Pod, Torus};

    /// A fault of `kind` on chip 1 and its link +x, on a 2x2 pod in one worker.
    fn plan(kind: FaultKind, factor: f64, delay_ms: f64) -> FaultPlan {
        let pod = Pod::single("2x2".parse::<Torus>().unwrap());
        let spec = FaultSpec {
            kind,
            chip: Some(1),
            worker: None,
            link: Some(Link::ici(0, Dir::Plus)),
            groups: Vec::new(),
            chip_groups: Vec::new(),
            at_step: None,
            at_seq: None,
            after_ms: None,
            once: false,
            delay_ms,
            factor,
            desync: DesyncMode::Skip,
        };
        FaultPlan::new(vec![spec], Placement::new(&pod, 1).unwrap(), 0, 4)
    }

    #[test]
    fn a_wait_from_any_number_is_bounded() {
        assert_eq!(fault_wait(f64::NAN), Duration::ZERO);
        assert_eq!(fault_wait(-1.0), Duration::ZERO);
        assert_eq!(fault_wait(f64::INFINITY), MAX_FAULT_WAIT);
        assert_eq!(fault_wait(1e300), MAX_FAULT_WAIT);
        assert_eq!(fault_wait(0.25), Duration::from_millis(250));
    }

    /// A message of one f32 from chip 1 to chip 0 over the x+ link.
    fn one_value_message() -> Message {
        let payload = Payload::from_vec(vec![1.0]);
        Message {
            src: 1,
            dst: 0,
            link: Link::ici(0, podsim_topology::Dir::Plus),
            hops: 1,
            fingerprint: Fingerprint {
                group: 1,
                seq: 0,
                op: OpKind::AllReduce,
                dtype: podsim_collectives::DType::F32,
                count: payload.len() as u64,
                reduce: Some(podsim_collectives::ReduceOp::Sum),
            },
            tag: podsim_collectives::Tag {
                lane: 0,
                phase: 0,
                step: 0,
            },
            arrive_ns: 0.0,
            payload,
            checksum: None,
        }
    }

    #[test]
    fn nonsense_slow_factors_and_delays_neither_panic_nor_wait_unbounded() {
        let cases = [
            (FaultKind::Slow, 1e300, 50.0),
            (FaultKind::Slow, f64::INFINITY, 50.0),
            (FaultKind::Slow, f64::NAN, 50.0),
            (FaultKind::Slow, -5.0, 50.0),
            (FaultKind::Delay, 10.0, 1e11),
            (FaultKind::Delay, 10.0, 30_000.0),
            (FaultKind::Delay, 10.0, f64::NAN),
            (FaultKind::Delay, 10.0, f64::INFINITY),
            (FaultKind::Delay, 10.0, -3.0),
        ];
        for (kind, factor, delay_ms) in cases {
            let mut msg = one_value_message();
            let action = plan(kind, factor, delay_ms).on_send(&mut msg, Duration::from_secs(2));
            let OnSend::Delay { wall, virtual_ns } = action else {
                panic!("{kind:?} {factor} {delay_ms}: a delay, not {action:?}");
            };
            let limit = if kind == FaultKind::Slow {
                Duration::from_secs(1)
            } else {
                MAX_FAULT_WAIT
            };
            assert!(wall <= limit, "{kind:?} {factor} {delay_ms}: {wall:?}");
            assert!(
                virtual_ns.is_finite() && virtual_ns >= 0.0,
                "{kind:?} {factor} {delay_ms}: {virtual_ns}"
            );
        }
    }
}
