//! The launcher's decisions while a job runs, as the watchdog's are: pure logic over events,
//! no I/O, so unit tests feed it made-up events. The launcher ([`crate::launch`]) turns
//! control-session messages, lost sessions and ticks into [`Event`]s (looking up, where the
//! supervisor needs it, which worker processes have exited) and carries out each [`Decision`]:
//! a broadcast, a progress report, collecting flight recorders for a diagnosis, stopping the
//! job with an error, or finishing it.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use podsim_job::{HeartbeatStatus, RankExitReport, TorchSpec};
use podsim_programs::job::{FailureReport, WorkerReport};
use podsim_proto::v1 as pb;

use crate::watchdog::{Finding, HangKind, Watchdog};

/// What the launcher observed.
pub enum Event<'a> {
    /// A message on worker `id`'s control session.
    Message(u32, pb::worker_msg::Body),
    /// Worker `id`'s control session ended with `error`; `external`: the workers were
    /// started by hand (no process to watch).
    Lost {
        id: u32,
        error: String,
        external: bool,
    },
    /// Time passed. `exited`: every worker process that has exited (id, how, whether it
    /// failed); `process(w)`: what the kernel says of worker `w`'s process (stopped, or
    /// running and how much of the last interval it waited for a CPU), where known.
    Tick {
        now: Instant,
        exited: Vec<(u32, String, bool)>,
        process: &'a dyn Fn(u32) -> crate::watchdog::Liveness,
    },
}

impl std::fmt::Debug for Event<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Event::Message(id, body) => write!(f, "Message({id}, {body:?})"),
            Event::Lost { id, error, .. } => write!(f, "Lost({id}, {error})"),
            Event::Tick { exited, .. } => write!(f, "Tick(exited {exited:?})"),
        }
    }
}

/// What the launcher does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Nothing to do.
    Continue,
    /// Every worker is ready: start the job.
    Start,
    /// The job's progress: units done, units in all.
    Progress(u64, u64),
    /// A hang, dead worker, desync or corruption: collect the flight recorders and stop.
    Diagnose(Box<Finding>),
    /// Worker `id` failed (`reason` is what it said or how its session ended): unless a
    /// dead worker explains it ([`Supervisor::explained_by`]), stop the job with that error.
    WorkerFailed { id: u32, reason: String },
    /// A representative rank needs finer classes: run the job again with one representative
    /// per class of `steps` (`why`: the group that asked for it).
    Regroup { steps: Vec<u32>, why: String },
    /// The workers broke the protocol.
    Protocol(String),
    /// Every worker sent its results.
    Finished,
}

/// The run phase's state: readiness, progress, results and the watchdog.
#[derive(Debug)]
pub struct Supervisor {
    workers: u32,
    watchdog: Watchdog,
    pids: BTreeMap<u32, u32>,
    ready: u32,
    started: bool,
    done: BTreeMap<u32, u64>,
    total: BTreeMap<u32, u64>,
    reports: BTreeMap<u32, WorkerReport>,
    /// PyTorch jobs: what the failing rank had done until its failure.
    failed_ranks: Vec<podsim_programs::RankReport>,
    /// When the last tick came (a long gap is the coordinator's own pause), and when a pause
    /// was last forgiven.
    last_tick: Option<Instant>,
    last_forgiven: Option<Instant>,
}

impl Supervisor {
    /// A supervisor of the workers with these pids (by worker id).
    pub fn new(watchdog: Watchdog, pids: BTreeMap<u32, u32>) -> Supervisor {
        Supervisor {
            workers: pids.len() as u32,
            watchdog,
            pids,
            ready: 0,
            started: false,
            done: BTreeMap::new(),
            total: BTreeMap::new(),
            reports: BTreeMap::new(),
            failed_ranks: Vec::new(),
            last_tick: None,
            last_forgiven: None,
        }
    }

    pub fn started(&self) -> bool {
        self.started
    }

    pub fn ready(&self) -> u32 {
        self.ready
    }

    pub fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    pub fn pids(&self) -> &BTreeMap<u32, u32> {
        &self.pids
    }

    /// Whether worker `id` already sent its results (its session may end now).
    pub fn reported(&self, id: u32) -> bool {
        self.reports.contains_key(&id)
    }

    /// The workers' results, by worker id, once [`Decision::Finished`].
    pub fn into_reports(self) -> (Vec<WorkerReport>, Watchdog) {
        (self.reports.into_values().collect(), self.watchdog)
    }

    /// PyTorch jobs: what the ranks that failed had done until then.
    pub fn failed_ranks(&self) -> &[podsim_programs::RankReport] {
        &self.failed_ranks
    }

    /// Decides what `event` calls for.
    pub fn on(&mut self, event: Event<'_>) -> Decision {
        match event {
            Event::Message(id, body) => self.on_message(id, body),
            Event::Lost {
                id,
                error,
                external,
            } => self.on_lost(id, error, external),
            Event::Tick {
                now,
                exited,
                process,
            } => self.on_tick(now, exited, process),
        }
    }

    fn on_message(&mut self, id: u32, body: pb::worker_msg::Body) -> Decision {
        use pb::worker_msg::Body;
        match body {
            Body::Ready(_) => {
                self.ready += 1;
                if self.ready == self.workers && !self.started {
                    self.watchdog.start(
                        self.pids.iter().map(|(w, p)| (*w, Some(*p))),
                        Instant::now(),
                    );
                    self.started = true;
                    return Decision::Start;
                }
                Decision::Continue
            }
            Body::Progress(p) => {
                if let Ok(hb) = serde_json::from_slice::<HeartbeatStatus>(&p.status_json) {
                    self.watchdog.heartbeat(id, hb, Instant::now());
                }
                self.done.insert(id, p.done);
                self.total.insert(id, p.total);
                self.progress()
            }
            Body::Result(r) => match serde_json::from_slice::<WorkerReport>(&r.json) {
                Ok(report) => {
                    self.done
                        .insert(id, self.total.get(&id).copied().unwrap_or(0));
                    self.reports.insert(id, report);
                    self.watchdog.finished(id);
                    if self.reports.len() as u32 == self.workers {
                        Decision::Finished
                    } else {
                        self.progress()
                    }
                }
                Err(e) => Decision::WorkerFailed {
                    id,
                    reason: format!("unreadable result: {e} (near {:?})", near(&r.json, &e)),
                },
            },
            Body::Failure(f) => match serde_json::from_slice::<FailureReport>(&f.error_json) {
                Ok(d) if d.kind == FailureReport::REGROUP => Decision::Regroup {
                    steps: d.representative_steps,
                    why: d.theirs,
                },
                Ok(d) => {
                    self.watchdog.faults_fired(&d.faults);
                    self.failed_ranks.extend(d.torch.iter().cloned());
                    Decision::Diagnose(Box::new(diagnosed_failure(&self.watchdog, &d, id)))
                }
                Err(_) => Decision::WorkerFailed {
                    id,
                    reason: f.error,
                },
            },
            Body::Dump(_) => Decision::Continue,
            Body::Hello(_) => Decision::Protocol(format!("worker {id} said hello twice")),
        }
    }

    /// After [`Decision::WorkerFailed`]: `dead` is a worker whose process the launcher saw
    /// exit (it waits briefly for one). While the job runs, a worker that failed because a
    /// neighbour died (a broken link, a lost session) is the dead worker's diagnosis.
    pub fn explained_by(&self, dead: Option<(u32, String)>) -> Option<Decision> {
        let (dead, how) = dead.filter(|_| self.started)?;
        Some(self.dead_worker(dead, &how))
    }

    fn on_lost(&mut self, id: u32, error: String, external: bool) -> Decision {
        if self.reports.contains_key(&id) {
            return Decision::Continue;
        }
        if self.started && external {
            // No process to watch: the lost session is the only sign of a dead worker.
            return self.dead_worker(id, &error);
        }
        let reason = format!("{error}{}", pause_note(&self.watchdog));
        Decision::WorkerFailed { id, reason }
    }

    fn on_tick(
        &mut self,
        now: Instant,
        exited: Vec<(u32, String, bool)>,
        process: &dyn Fn(u32) -> crate::watchdog::Liveness,
    ) -> Decision {
        // The launcher ticks at least every MOST_TICK_INTERVAL: a gap of a
        // timeout more than that is the coordinator's own pause, not its workers' silence.
        // Forgiven once per stretch of regular ticks as long as a timeout: a coordinator slow
        // on every tick would otherwise never judge a hang.
        let timeout = self.watchdog.timeout();
        let gap = self
            .last_tick
            .replace(now)
            .map(|t| now.saturating_duration_since(t));
        if let Some(gap) = gap
            && gap >= timeout + MOST_TICK_INTERVAL
            && self
                .last_forgiven
                .is_none_or(|t| now.saturating_duration_since(t) >= gap + timeout)
        {
            self.last_forgiven = Some(now);
            self.watchdog.resumed_after_pause(now, gap);
            return Decision::Continue;
        }
        if !self.started {
            return Decision::Continue;
        }
        // A worker that died (crash, kill) while others run is a dead worker.
        let dead = exited
            .into_iter()
            .find(|(id, _, abnormal)| *abnormal && !self.reports.contains_key(id));
        if let Some((id, how, _)) = dead {
            return self.dead_worker(id, &how);
        }
        match self.watchdog.check(now, process) {
            Some(finding) => Decision::Diagnose(Box::new(finding)),
            None => Decision::Continue,
        }
    }

    fn progress(&self) -> Decision {
        Decision::Progress(self.done.values().sum(), self.total.values().sum())
    }

    fn dead_worker(&self, id: u32, how: &str) -> Decision {
        Decision::Diagnose(Box::new(dead_worker(
            &self.watchdog,
            id,
            how,
            self.pids.get(&id).copied(),
        )))
    }
}

/// The longest the launcher lets pass between two ticks while the job runs (its
/// `timeouts::TICK`): a longer gap, by a timeout, is the coordinator's own pause.
pub const MOST_TICK_INTERVAL: Duration = Duration::from_millis(500);

/// What a worker's failure owes to the coordinator's own pause, if it paused: a worker gives
/// up a coordinator that answers nothing for 25 s.
fn pause_note(watchdog: &Watchdog) -> String {
    use podsim_links::net::{CONTROL_KEEPALIVE_EVERY, CONTROL_KEEPALIVE_PATIENCE};
    let patience = CONTROL_KEEPALIVE_EVERY + CONTROL_KEEPALIVE_PATIENCE;
    // Only a pause recent enough to be why a worker left: one an hour ago is not.
    let Some((gap, _)) = watchdog
        .paused()
        .filter(|(_, resumed)| resumed.elapsed() < patience + watchdog.timeout())
    else {
        return String::new();
    };
    format!(
        " (the coordinator itself did not run for {:.1} s before: stopped, or starved of CPU; its workers leave a coordinator that does not answer for {} s)",
        gap.as_secs_f64(),
        patience.as_secs()
    )
}

fn dead_worker(watchdog: &Watchdog, id: u32, how: &str, pid: Option<u32>) -> Finding {
    let how = format!("{how}{}", pause_note(watchdog));
    let how = how.as_str();
    let current = watchdog.current_of(id);
    let pid = pid.map_or(String::new(), |p| format!(", pid {p}"));
    Finding {
        kind: HangKind::DeadWorker,
        chip: current.as_ref().map(|c| c.0),
        worker: Some(id),
        link: None,
        seq: current.as_ref().map(|c| c.1),
        op: current.as_ref().map(|c| c.2.clone()),
        waiting: watchdog.waiting_chips(),
        explanation: format!(
            "Worker {id}{pid} {how}{}, leaving its peers waiting: check its log (worker-{id}.log) and the host (out of memory, a crash, a kill).",
            current.map_or(String::new(), |c| format!(
                " (last seen in {} #{} on chip {})",
                c.2, c.1, c.0
            ))
        ),
        // The process died after its last heartbeat: the earliest it can have taken effect.
        effect_wall_ns: watchdog
            .last_heard(id)
            .unwrap_or_else(podsim_collectives::wall_ns),
    }
}

fn diagnosed_failure(watchdog: &Watchdog, d: &FailureReport, worker: u32) -> Finding {
    let seq = d.mine.map(|m| m.seq);
    let op = d.mine.map(|m| m.op.to_string());
    let mine = d.mine.map_or("?".to_string(), |m| m.to_string());
    if let Some(exit) = &d.rank_exit {
        let (kind, explanation) = rank_exit_verdict(d.chip, exit);
        return Finding {
            kind,
            chip: Some(d.chip),
            worker: Some(worker),
            link: None,
            seq: None,
            op: None,
            waiting: watchdog.waiting_chips(),
            explanation,
            effect_wall_ns: podsim_collectives::wall_ns(),
        };
    }
    if d.kind == "corrupt" {
        let link = d.link.map_or("?".to_string(), |l| l.to_string());
        return Finding {
            kind: HangKind::Corrupt,
            chip: Some(d.peer),
            worker: None,
            link: d.link,
            seq,
            op,
            waiting: watchdog.waiting_chips(),
            explanation: format!(
                "Chip {}'s message of {mine} on link {link} reached chip {} with bits flipped (its checksum does not match): the link corrupts data; check that link's transport.",
                d.peer, d.chip
            ),
            effect_wall_ns: podsim_collectives::wall_ns(),
        };
    }
    Finding {
        kind: HangKind::Desync,
        chip: Some(d.chip),
        worker: Some(worker),
        link: d.link,
        seq,
        op,
        waiting: watchdog.waiting_chips(),
        explanation: format!(
            "Chip {} is in {mine} but chip {} is in {}: the chips' programs diverged (a skipped or different collective); check the control flow that leads to this collective on both chips.{}",
            d.chip,
            d.peer,
            d.theirs,
            d.sites
                .iter()
                .map(|(chip, site)| format!(" Rank {chip} made its call at {site}."))
                .collect::<String>()
                + if d.verified {
                    podsim_programs::RUN_EVERY_RANK
                } else {
                    ""
                }
        ),
        effect_wall_ns: podsim_collectives::wall_ns(),
    }
}

/// The text of `json` around where `e` says it went wrong (a worker's result is one line).
fn near(json: &[u8], e: &serde_json::Error) -> String {
    let at = e.column().saturating_sub(1).min(json.len());
    let from = at.saturating_sub(60);
    let to = (at + 20).min(json.len());
    String::from_utf8_lossy(&json[from..to]).into_owned()
}

/// What a rank's exit on `chip` was (its worker's account `exit`), and the explanation: a
/// rank that never connected is not a death (it never reached its first collective, and the
/// job's bound on that ran out); one whose program failed is the program's error; any other
/// exit while the job ran left its peers waiting.
fn rank_exit_verdict(chip: u32, exit: &RankExitReport) -> (HangKind, String) {
    let last = exit
        .stderr_tail
        .iter()
        .rev()
        // A line with words: not a frame's rule (argument parsers draw boxes around errors).
        .find(|l| l.chars().any(char::is_alphanumeric))
        .map_or(String::new(), |l| {
            format!(" (its last words: {:?})", l.trim())
        });
    let (pid, how) = (exit.pid, &exit.how);
    if how.starts_with(TorchSpec::NOT_CONNECTED) {
        (
            HangKind::StalledChip,
            format!(
                "Rank {chip} (pid {pid}) {how}{last}. A rank connects when its program creates its process group (dist.init_process_group or init_device_mesh): check what it does before that (its [rank {chip}] lines), or give a slow start more time with [job] connect_timeout_s (podsim run --set job.connect_timeout_s=N)."
            ),
        )
    } else if how.starts_with(TorchSpec::FAILED_BEFORE_CONNECTING) {
        (
            HangKind::ProgramError,
            format!(
                "Rank {chip} (pid {pid}) {how}{last}: its program failed before its first collective, and the job stopped there. Its output is in its [rank {chip}] lines."
            ),
        )
    } else if how.starts_with(TorchSpec::RAISED) {
        (
            HangKind::ProgramError,
            format!(
                "Rank {chip} (pid {pid}) {how}{last}: its program failed, the job stopped there. Its traceback or message is in its [rank {chip}] lines."
            ),
        )
    } else {
        (
            HangKind::DeadWorker,
            format!(
                "Rank {chip} (pid {pid}) {how}{last} while its job ran, leaving its peers waiting: check its output ([rank {chip}] lines)."
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pb::worker_msg::Body;
    use podsim_collectives::{DType, Fingerprint, OpKind};
    use podsim_topology::Pod;

    use super::*;

    #[test]
    fn a_ranks_last_words_are_its_last_line_with_words() {
        let exit = RankExitReport {
            pid: 7,
            how: format!("{}exited with code 2", TorchSpec::FAILED_BEFORE_CONNECTING),
            stderr_tail: [
                "╭─ Value error ──╮",
                "│ Error parsing Config: bad flag │",
                "╰────────────────╯",
                "",
            ]
            .map(String::from)
            .to_vec(),
        };
        let (kind, said) = rank_exit_verdict(3, &exit);
        assert_eq!(kind, HangKind::ProgramError);
        assert!(
            said.contains("(its last words: \"│ Error parsing Config: bad flag │\")"),
            "{said}"
        );
    }

    /// A supervisor of 2 workers (pids 100, 101) on a ring of 4 chips.
    fn two_workers() -> Supervisor {
        let pod = Pod::single("4".parse().unwrap_or_else(|e| panic!("{e}")));
        let watchdog = Watchdog::new(pod, Duration::from_secs(2), Duration::from_millis(100));
        Supervisor::new(watchdog, BTreeMap::from([(0, 100), (1, 101)]))
    }

    fn ready() -> Body {
        Body::Ready(pb::Ready {})
    }

    fn result(worker: u32) -> Body {
        let report = WorkerReport {
            worker,
            pid: 100 + worker,
            link_addr: String::new(),
            chips: vec![2 * worker, 2 * worker + 1],
            steps: Vec::new(),
            messages_sent: 0,
            bytes_sent: 0,
            peak_rss_bytes: 0,
            link_errors: Vec::new(),
            train: Vec::new(),
            traces: Vec::new(),
            links: Vec::new(),
            torch: Vec::new(),
            faults: Vec::new(),
        };
        let json = serde_json::to_vec(&report).unwrap_or_default();
        Body::Result(pb::WorkerResult { json })
    }

    fn progress(done: u64, total: u64) -> Body {
        Body::Progress(pb::Progress {
            done,
            total,
            status_json: Vec::new(),
        })
    }

    fn tick(exited: Vec<(u32, String, bool)>) -> Event<'static> {
        Event::Tick {
            now: Instant::now(),
            exited,
            process: &|_| crate::watchdog::Liveness::Unknown,
        }
    }

    /// The kind of the first diagnosis `events` bring the supervisor to, if any.
    fn first_finding<'a>(
        s: &mut Supervisor,
        events: impl Iterator<Item = Event<'a>>,
    ) -> Option<HangKind> {
        events
            .map(|e| s.on(e))
            .find(|d| *d != Decision::Continue)
            .as_ref()
            .and_then(kind)
            .map(|k| k.0)
    }

    fn kind(d: &Decision) -> Option<(HangKind, Option<u32>)> {
        match d {
            Decision::Diagnose(f) => Some((f.kind, f.worker)),
            _ => None,
        }
    }

    #[test]
    fn the_coordinators_own_pause_is_not_its_workers_silence() {
        let mut s = two_workers();
        s.on(Event::Message(0, ready()));
        assert_eq!(s.on(Event::Message(1, ready())), Decision::Start);
        let stopped = |_| crate::watchdog::Liveness::Stopped;
        let at = |now| Event::Tick {
            now,
            exited: Vec::new(),
            process: &stopped,
        };
        let t0 = Instant::now();
        assert_eq!(s.on(at(t0)), Decision::Continue);
        // Nothing ticked for 40 s (the coordinator was stopped): the workers' silence is not
        // judged, and counts afresh from the tick after.
        let back = t0 + Duration::from_secs(40);
        assert_eq!(s.on(at(back)), Decision::Continue);
        assert_eq!(
            s.on(at(back + Duration::from_millis(100))),
            Decision::Continue
        );
        assert!(pause_note(&s.watchdog).contains("did not run for 40.0 s"));
        // Silent for a timeout while the coordinator ticks: a frozen worker, as before.
        let later = (1..=6).map(|i| back + Duration::from_millis(500 * i));
        assert_eq!(
            first_finding(&mut s, later.map(at)),
            Some(HangKind::FrozenWorker)
        );
        // A coordinator slow on every tick (3 s, past the 2 s timeout and a tick) is
        // forgiven once, not for ever.
        let mut s = two_workers();
        s.on(Event::Message(0, ready()));
        s.on(Event::Message(1, ready()));
        let slow = (0..5).map(|i| t0 + Duration::from_secs(3 * i));
        assert_eq!(
            first_finding(&mut s, slow.map(at)),
            Some(HangKind::FrozenWorker)
        );
        // A pause that ended long before is no reason for a worker's end.
        let mut old = two_workers();
        old.on(Event::Message(0, ready()));
        old.on(Event::Message(1, ready()));
        let Some(long_ago) = Instant::now().checked_sub(Duration::from_secs(300)) else {
            return;
        };
        old.on(at(long_ago));
        old.on(at(long_ago + Duration::from_secs(40)));
        assert_eq!(pause_note(&old.watchdog), "");
    }

    #[test]
    fn the_job_starts_once_every_worker_is_ready_and_finishes_with_every_result() {
        let mut s = two_workers();
        assert_eq!(s.on(Event::Message(0, ready())), Decision::Continue);
        assert!(!s.started());
        assert_eq!(s.on(Event::Message(1, ready())), Decision::Start);
        assert!(s.started());
        assert_eq!(
            s.on(Event::Message(0, progress(3, 10))),
            Decision::Progress(3, 10)
        );
        assert_eq!(
            s.on(Event::Message(1, progress(4, 10))),
            Decision::Progress(7, 20)
        );
        assert_eq!(s.on(tick(Vec::new())), Decision::Continue);
        // A worker's results count its units as done.
        assert_eq!(
            s.on(Event::Message(0, result(0))),
            Decision::Progress(14, 20)
        );
        assert!(s.reported(0));
        // Its session ending afterwards is expected, and so is its process exiting cleanly.
        let gone = Event::Lost {
            id: 0,
            error: "closed its control session".into(),
            external: false,
        };
        assert_eq!(s.on(gone), Decision::Continue);
        assert_eq!(
            s.on(tick(vec![(0, "exited".into(), false)])),
            Decision::Continue
        );
        assert_eq!(s.on(Event::Message(1, result(1))), Decision::Finished);
        assert_eq!(s.into_reports().0.len(), 2);
    }

    #[test]
    fn a_worker_that_dies_while_the_job_runs_is_a_dead_worker() {
        let mut s = two_workers();
        // Before the start, an exit is the launcher's to report (no diagnosis).
        assert_eq!(
            s.on(tick(vec![(1, "killed".into(), true)])),
            Decision::Continue
        );
        s.on(Event::Message(0, ready()));
        s.on(Event::Message(1, ready()));
        let d = s.on(tick(vec![(1, "was killed by signal 9".into(), true)]));
        assert_eq!(kind(&d), Some((HangKind::DeadWorker, Some(1))));
        let Decision::Diagnose(f) = d else { return };
        assert!(f.explanation.contains("pid 101"), "{}", f.explanation);
    }

    #[test]
    fn a_lost_session_is_a_failure_unless_a_dead_worker_explains_it() {
        let mut s = two_workers();
        let lost = |id: u32, external| Event::Lost {
            id,
            error: "control session failed".into(),
            external,
        };
        // Before the start: the worker failed, whatever else happened.
        assert_eq!(
            s.on(lost(0, false)),
            Decision::WorkerFailed {
                id: 0,
                reason: "control session failed".into()
            }
        );
        assert_eq!(s.explained_by(Some((1, "exited".into()))), None);
        s.on(Event::Message(0, ready()));
        s.on(Event::Message(1, ready()));
        // While it runs: a neighbour's death explains a lost session or a broken link.
        assert!(matches!(
            s.on(lost(0, false)),
            Decision::WorkerFailed { id: 0, .. }
        ));
        let explained = s.explained_by(Some((1, "exited with code 1".into())));
        assert_eq!(
            explained.as_ref().and_then(kind),
            Some((HangKind::DeadWorker, Some(1)))
        );
        // Workers started by hand have no process to watch: the lost session is the death.
        assert_eq!(
            kind(&s.on(lost(1, true))),
            Some((HangKind::DeadWorker, Some(1)))
        );
    }

    #[test]
    fn a_rank_that_never_connected_is_a_stalled_chip_and_one_that_died_a_dead_worker() {
        let failure = |how: &str| {
            // The rank's part of a failure report is read as it travels, from JSON.
            let report = serde_json::json!({
                "kind": "rank_exit", "chip": 3, "peer": 3, "mine": null, "theirs": "",
                "link": null,
                "rank_exit": {"pid": 4242, "how": how, "stderr_tail": ["", "loading"]},
            });
            Body::Failure(pb::WorkerFailure {
                error: how.into(),
                error_json: serde_json::to_vec(&report).unwrap_or_default(),
            })
        };
        let mut s = two_workers();
        s.on(Event::Message(0, ready()));
        s.on(Event::Message(1, ready()));
        let late = format!(
            "{} 300 s (job.connect_timeout_s) of its start: it was alive",
            TorchSpec::NOT_CONNECTED
        );
        let d = s.on(Event::Message(1, failure(&late)));
        assert_eq!(kind(&d), Some((HangKind::StalledChip, Some(1))));
        let Decision::Diagnose(f) = d else { return };
        assert_eq!(f.chip, Some(3));
        for part in ["Rank 3 (pid 4242)", "connect_timeout_s", "\"loading\""] {
            assert!(f.explanation.contains(part), "{part}: {}", f.explanation);
        }
        let d = s.on(Event::Message(1, failure("exited with code 1")));
        assert_eq!(kind(&d), Some((HangKind::DeadWorker, Some(1))));
    }

    #[test]
    fn a_reported_desync_is_diagnosed_and_broken_protocol_refused() {
        let mut s = two_workers();
        s.on(Event::Message(0, ready()));
        s.on(Event::Message(1, ready()));
        let fp = |seq| Fingerprint {
            group: 1,
            seq,
            op: OpKind::AllReduce,
            dtype: DType::F32,
            count: 8,
            reduce: None,
        };
        let report = FailureReport {
            mine: Some(fp(3)),
            theirs: fp(4).to_string(),
            ..FailureReport::between("desync", 2, 1)
        };
        let failure = Body::Failure(pb::WorkerFailure {
            error: "desync".into(),
            error_json: serde_json::to_vec(&report).unwrap_or_default(),
        });
        assert_eq!(
            kind(&s.on(Event::Message(1, failure))),
            Some((HangKind::Desync, Some(1)))
        );
        // An unstructured failure names the worker; a second hello breaks the protocol; an
        // unreadable result is the worker's failure.
        let plain = Body::Failure(pb::WorkerFailure {
            error: "out of memory".into(),
            error_json: Vec::new(),
        });
        assert!(matches!(
            s.on(Event::Message(0, plain)),
            Decision::WorkerFailed { id: 0, .. }
        ));
        let hello = Body::Hello(pb::Hello::default());
        assert!(matches!(
            s.on(Event::Message(1, hello)),
            Decision::Protocol(_)
        ));
        let garbage = Body::Result(pb::WorkerResult {
            json: b"{".to_vec(),
        });
        assert!(matches!(
            s.on(Event::Message(1, garbage)),
            Decision::WorkerFailed { id: 1, .. }
        ));
    }
}
