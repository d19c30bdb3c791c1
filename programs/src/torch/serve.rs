//! A chip serving its PyTorch rank: each request the rank sends (a collective on its
//! tensor, a group, a step mark) runs on the chip, on podsim's fabric and algorithms, under
//! its virtual clock; the compute the rank ran since its previous request is charged first,
//! priced by the kernel model.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use podsim_collectives::procfs::stat_fields;
use podsim_collectives::{Chip, CollectiveError, Comm, OpKind, Payload};
use podsim_topology::{Hardware, Pod};

use super::objects::{Board, EndsOnBoard};
use super::ranks::{Rank, RankExit, RankLink, exited};
use super::verify::{Call, Reference};
use super::wire::{Compute, DTypeName, Frame, Reply, Request, StepHbm};
use super::{CallSites, OpTotals, RankReport, RankStep, StepCounting, TorchSpec};
use crate::error::ProgramError;
use crate::train::hbm_share::HbmShare;
use crate::train::kernels::{Kernel, Work};

/// How long a rank that said goodbye (or closed its connection) may take to exit.
const EXIT_GRACE: Duration = Duration::from_secs(30);

/// How often a chip looks at its rank's CPU time while it waits for the rank's next request.
const BUSY_TICK: Duration = Duration::from_millis(100);
/// The window (in ticks of [`BUSY_TICK`]) over which a rank must have used [`BUSY_TICKS`]
/// clock ticks (10 ms each) of CPU to count as busy: a rank in `time.sleep` or a deadlock uses
/// none, its stack sampler about 0.3 % of a core.
const BUSY_WINDOW: usize = 5;
const BUSY_TICKS: u64 = 2;

/// Whether the rank is working between requests (importing torch, computing, loading data)
/// or sitting still: the chip shows a working rank as computing, so that the watchdog does
/// not take a rank that is slow to arrive for one that stopped.
struct BusyWatch {
    pid: u32,
    /// A rank forked by a rank server, not yet connected: `pid` is its stub's, which
    /// only waits, and the rank itself is starting (forked, loading the program, or waiting
    /// for a core with the others) - shown as working until its hello gives its own pid. (A
    /// forked rank that never connects is bounded by `connect_timeout_s`.)
    starting: bool,
    /// The rank's stack-sampling thread (0: not known yet), left out of "running": it wakes
    /// every 200 ms, and on a busy host it waits for a core each time, which made a rank
    /// asleep in `time.sleep` look at work now and then and put off its stall's diagnosis.
    sampler_thread: Arc<AtomicU32>,
    /// CPU ticks at the last few looks, oldest first.
    seen: std::collections::VecDeque<u64>,
    busy: bool,
}

impl BusyWatch {
    fn new(pid: u32, forked: bool) -> BusyWatch {
        BusyWatch {
            pid,
            starting: forked,
            sampler_thread: Arc::new(AtomicU32::new(0)),
            seen: std::collections::VecDeque::new(),
            busy: false,
        }
    }

    fn update(&mut self, chip: &Chip) {
        if self.starting {
            if !self.busy {
                chip.recorder().compute_started();
                self.busy = true;
            }
            return;
        }
        let sampler = self.sampler_thread.load(Ordering::Relaxed);
        let Some((now, running)) = cpu_ticks(self.pid, sampler) else {
            return;
        };
        if self.seen.len() == BUSY_WINDOW {
            self.seen.pop_front();
        }
        self.seen.push_back(now);
        let used = now.saturating_sub(self.seen.front().copied().unwrap_or(now));
        // Running or waiting for a core (8 ranks share 2 cores while they import torch).
        let busy = used >= BUSY_TICKS || running;
        if busy != self.busy {
            let recorder = chip.recorder();
            if busy {
                recorder.compute_started();
            } else {
                recorder.compute_finished();
            }
            self.busy = busy;
        }
    }

    /// A request came: the rank is no longer between requests.
    fn end(&mut self, chip: &Chip) {
        if self.busy {
            chip.recorder().compute_finished();
            self.busy = false;
        }
        self.seen.clear();
    }
}

/// User plus system CPU time of process `pid`, in clock ticks, and whether a thread of it
/// other than `sampler` is running or runnable now (`/proc/PID/stat`).
fn cpu_ticks(pid: u32, sampler: u32) -> Option<(u64, bool)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields = stat_fields(&stat)?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime, any_thread_running(pid, sampler)))
}

/// Whether a thread of process `pid` other than `sampler` is running or waiting for a core
/// (the work of a rank may be on a thread other than its first: autograd, a data loader
/// thread).
fn any_thread_running(pid: u32, sampler: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    let sampler = sampler.to_string();
    tasks
        .flatten()
        .filter(|task| task.file_name() != sampler.as_str())
        .any(|task| {
            std::fs::read_to_string(task.path().join("stat"))
                .is_ok_and(|stat| stat_fields(&stat).is_some_and(|f| f.first() == Some(&"R")))
        })
}

/// The matmul and attention kernels of `compute`: each with its element size and calls.
fn kernels(compute: &Compute) -> impl Iterator<Item = (Kernel, f64, f64)> + '_ {
    let matmuls = compute.matmuls.iter().map(|&[m, k, n, calls, elem_bytes]| {
        let kernel = Kernel::Matmul {
            m: m as usize,
            k: k as usize,
            n: n as usize,
        };
        (kernel, elem_bytes as f64, calls as f64)
    });
    let attention = compute.attention.iter().map(|a| {
        let [
            batch,
            seq,
            heads,
            head_dim,
            causal,
            backward,
            elem_bytes,
            calls,
        ] = *a;
        let kernel = Kernel::Attention {
            seqs: batch as usize,
            seq: seq as usize,
            heads: heads as f64,
            head_dim: head_dim as usize,
            causal: causal != 0,
            backward: backward != 0,
        };
        (kernel, elem_bytes as f64, calls as f64)
    });
    matmuls.chain(attention)
}

/// What the work in `compute` asks of `hw`: each matmul and attention kernel with its calls
/// as one, then the other kernels as element-wise passes over the bytes they read and wrote.
fn works<'c>(compute: &'c Compute, hw: &'c Hardware) -> impl Iterator<Item = Work> + 'c {
    let passes = Work {
        mxu_ns: 0.0,
        hbm_bytes: compute.pass_bytes as f64,
        overhead_ns: compute.kernels as f64 * hw.kernel_overhead_ns,
    };
    kernels(compute)
        .map(|(kernel, elem_bytes, calls)| kernel.work(hw, elem_bytes).times(calls))
        .chain(std::iter::once(passes))
}

/// Flops of the matmuls and attention in `compute`, as executed (recomputation included).
pub fn compute_flops(compute: &Compute) -> f64 {
    kernels(compute)
        .map(|(kernel, _, calls)| calls * kernel.flops())
        .sum()
}

/// The flops of `compute` the model needs: all but what activation checkpointing recomputed.
pub fn model_flops(compute: &Compute) -> f64 {
    let recomputed = Compute {
        matmuls: compute.recomputed_matmuls.clone(),
        attention: compute.recomputed_attention.clone(),
        ..Compute::default()
    };
    compute_flops(compute) - compute_flops(&recomputed)
}

/// What a chip keeps while serving its rank.
struct Served {
    groups: HashMap<u32, Comm>,
    report: RankReport,
    /// Compute and communication since the last step mark, ns.
    step_compute_ns: f64,
    step_comm_ns: f64,
    /// Of that compute, what kernels lost waiting for HBM beside communication.
    step_hbm_wait_ns: f64,
    step_start_ns: f64,
    said_bye: bool,
    /// The exception the rank said is ending its program, with its line.
    raised: Option<String>,
    /// When each communication stream is next free (gathers, reductions).
    stream_free: [f64; 2],
    /// Collectives issued and not yet waited for by the compute stream: when each is done.
    in_flight: HashMap<u64, f64>,
    /// Communication in flight, for the HBM bandwidth it takes from kernels.
    hbm: HbmShare,
    /// Collectives the rank made (the index of its next, for `--verify-ranks`).
    calls: u64,
    /// Whether the program marks its own steps (`podsim.torch.step()`).
    explicit_steps: bool,
    /// The HBM peak of steps folded into the current one.
    folded_hbm: StepHbm,
    /// Matmul and attention flops executed since the last step mark.
    step_flops: f64,
    /// Of those, the model's (recomputation left out).
    step_model_flops: f64,
    /// Where the report goes if this serving is dropped before it ends (`Progress`).
    progress: Progress,
    /// Whether the report was handed on (the rank ended, or its error carries it).
    handed_on: bool,
}

impl Served {
    /// Group `id` of the rank, over `group`'s chips: the next instance of a communicator over
    /// them (every member makes its groups in the same order, as torch requires), so that two
    /// groups of the same ranks keep separate sequences of calls.
    fn add_group(
        &mut self,
        id: u32,
        group: podsim_topology::Group,
        algo: podsim_collectives::Algo,
    ) {
        let instance = self.groups.values().filter(|c| c.group == group).count();
        let mut comm = Comm::new(group, algo);
        comm.instance = u32::try_from(instance).unwrap_or(u32::MAX);
        self.groups.insert(id, comm);
    }

    fn new(rank: &Rank, progress: &Progress) -> Served {
        Served {
            groups: HashMap::new(),
            report: RankReport {
                rank: rank.rank,
                pid: rank.pid,
                ..RankReport::default()
            },
            step_compute_ns: 0.0,
            step_comm_ns: 0.0,
            step_hbm_wait_ns: 0.0,
            step_start_ns: 0.0,
            said_bye: false,
            raised: None,
            stream_free: [0.0; 2],
            in_flight: HashMap::new(),
            hbm: HbmShare::default(),
            calls: 0,
            explicit_steps: false,
            folded_hbm: StepHbm::default(),
            step_flops: 0.0,
            step_model_flops: 0.0,
            progress: progress.clone(),
            handed_on: false,
        }
    }

    /// The report, handed on by the serving's end: dropping `self` keeps nothing more.
    fn hand_on(&mut self) -> RankReport {
        self.handed_on = true;
        std::mem::take(&mut self.report)
    }
}

impl Drop for Served {
    /// Another rank's failure stops the job mid-step and drops this serving: what the rank
    /// had done until then stays with the worker's other ranks' (a failed job's report).
    fn drop(&mut self) {
        if !self.handed_on {
            self.progress.keep(std::mem::take(&mut self.report));
        }
    }
}

/// The reports of a worker's ranks whose serving was stopped before it ended, by rank.
#[derive(Clone, Default)]
pub struct Progress(Arc<std::sync::Mutex<HashMap<u32, RankReport>>>);

impl Progress {
    fn keep(&self, report: RankReport) {
        let mut kept = self.0.lock().unwrap_or_else(|e| e.into_inner());
        kept.insert(report.rank, report);
    }

    /// The kept reports, in rank order.
    pub fn taken(&self) -> Vec<RankReport> {
        let mut kept: Vec<_> =
            std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
                .into_values()
                .collect();
        kept.sort_by_key(|r| r.rank);
        kept
    }
}

/// Serves `rank` on `chip` until the rank exits: its result is the rank's report, or the
/// error that ends the job (a rank that died, a desync, a garbage frame).
pub async fn serve(
    chip: &mut Chip,
    mut rank: Rank,
    context: &Context<'_>,
    progress: &Progress,
) -> Result<RankReport, ProgramError> {
    let ending = EndsReference(context.reference);
    let _board_ends = EndsOnBoard(context.board, chip.id());
    let result = serve_rank(chip, &mut rank, context, progress).await;
    if let Some(reference) = ending.0 {
        match &result {
            Ok(_) => reference.end("ended its program".to_string(), false),
            Err(e) => reference.end(format!("failed: {e}"), true),
        }
    }
    result
}

/// Ends a representative's [`Reference`] when its serving is dropped mid-run (another rank's
/// failure ended the job): its shadows must not wait for calls that will never come.
struct EndsReference<'a>(Option<&'a Reference>);

impl Drop for EndsReference<'_> {
    fn drop(&mut self) {
        if let Some(reference) = self.0 {
            reference.end("stopped when the job failed".to_string(), true);
        }
    }
}

async fn serve_rank(
    chip: &mut Chip,
    rank: &mut Rank,
    context: &Context<'_>,
    progress: &Progress,
) -> Result<RankReport, ProgramError> {
    let spec = context.spec;
    let mut served = Served::new(rank, progress);
    // A rank importing torch is as busy as one computing: watched from the start.
    let mut cpu = BusyWatch::new(rank.pid, rank.forked);
    let mut tick = tokio::time::interval(BUSY_TICK);
    let bound = Duration::from_secs(spec.connect_timeout_s);
    let too_late = tokio::time::sleep(bound.saturating_sub(rank.started.elapsed()));
    tokio::pin!(too_late);
    let link = loop {
        tokio::select! {
            link = &mut rank.link => break link.ok(),
            _ = exited(&mut rank.exit) => break None,
            () = &mut too_late => return Err(not_connected(chip, rank, spec, cpu.busy)),
            _ = tick.tick() => cpu.update(chip),
        }
    };
    cpu.end(chip);
    let Some(mut link) = link else {
        // Exited without connecting: a program that never initialised the backend.
        let exit = wait_exit(rank).await;
        return finish(chip, rank, served, exit);
    };
    cpu.sampler_thread = link.sampler_thread.clone();
    cpu.starting = false;
    if link.pid != 0 {
        cpu.pid = link.pid;
        served.report.pid = link.pid;
    }
    served.report.connected = true;
    loop {
        let next = tokio::select! {
            r = link.requests.recv() => r,
            _ = exited(&mut rank.exit) => None,
            _ = tick.tick() => {
                cpu.update(chip);
                continue;
            }
        };
        cpu.end(chip);
        let (frame, values) = match next {
            Some(Ok(request)) => request,
            Some(Err(e)) => return Err(ProgramError::Invalid(e)),
            None => break,
        };
        if let Err(e) = handle(chip, &mut served, &mut link, context, frame, values).await {
            return Err(with_steps(e, chip, served));
        }
    }
    let exit = wait_exit(rank).await;
    finish(chip, rank, served, exit)
}

/// `error`, carrying what the rank had done until it (its steps, its collectives): the
/// report of a failed job keeps them.
fn with_steps(error: ProgramError, chip: &Chip, mut served: Served) -> ProgramError {
    if matches!(error, ProgramError::TorchFailed { .. }) {
        served.handed_on = true; // the error carries the rank's steps already
        return error;
    }
    served.report.virtual_ns = chip.clock();
    ProgramError::TorchFailed {
        error: Box::new(error),
        ranks: vec![served.hand_on()],
    }
}

/// The error that ends the job when `rank` has not connected within the job's bound: what the
/// rank was doing, as far as this worker can tell (the kernel's view of the process, its last
/// output), after killing it and what it started.
fn not_connected(chip: &Chip, rank: &Rank, spec: &TorchSpec, busy: bool) -> ProgramError {
    // Looked at before the kill, which changes it.
    let seen = match rank.forked {
        // Its stub only waits for it: what it shows says nothing of the rank.
        true => String::new(),
        false => podsim_links::procs::describe(rank.pid),
    };
    rank.group.kill();
    let mut how = format!(
        "{} {} s (job.connect_timeout_s) of its start",
        TorchSpec::NOT_CONNECTED,
        spec.connect_timeout_s
    );
    if rank.forked {
        how.push_str(": it was forked by a rank server and had not said hello");
    } else if seen.is_empty() {
        how.push_str(": its process could not be looked at");
    } else {
        let lately = if busy {
            "using CPU lately"
        } else {
            "using no CPU lately"
        };
        how.push_str(&format!(": it was alive, {lately}, {seen}"));
    }
    if let Some(line) = rank.last_output.lock().ok().and_then(|l| l.clone()) {
        how.push_str(&format!("; its last output: {:?}", line.trim()));
    }
    how.push_str("; podsim killed it and its process group");
    ProgramError::RankExited {
        chip: chip.id(),
        pid: rank.pid,
        how,
        stderr_tail: stderr_tail(rank),
    }
}

fn stderr_tail(rank: &Rank) -> Vec<String> {
    rank.stderr_tail
        .lock()
        .map(|t| t.iter().cloned().collect())
        .unwrap_or_default()
}

async fn wait_exit(rank: &mut Rank) -> Option<RankExit> {
    tokio::time::timeout(EXIT_GRACE, exited(&mut rank.exit))
        .await
        .ok()
        .flatten()
}

fn finish(
    chip: &Chip,
    rank: &Rank,
    mut served: Served,
    exit: Option<RankExit>,
) -> Result<RankReport, ProgramError> {
    match &exit {
        Some(e) if e.success() => {}
        None if served.said_bye => {}
        other => {
            let mut how = other
                .as_ref()
                .map_or("closed its connection without exiting".to_string(), |e| {
                    e.to_string()
                });
            if let Some(raised) = &served.raised {
                how = format!("{}{raised}, and {how}", TorchSpec::RAISED);
            } else if !served.report.connected && other.as_ref().is_some_and(|e| e.code.is_some()) {
                how = format!("{}{how}", TorchSpec::FAILED_BEFORE_CONNECTING);
            }
            let exited = ProgramError::RankExited {
                chip: chip.id(),
                pid: served.report.pid,
                how,
                stderr_tail: stderr_tail(rank),
            };
            return Err(with_steps(exited, chip, served));
        }
    }
    served.report.exit = exit.map(|e| e.to_string());
    // Peers still waiting on this chip wait for a rank that is gone: said so in a diagnosis.
    chip.recorder().program_ended(format!(
        "rank {} {}",
        chip.id(),
        served.report.exit.as_deref().unwrap_or("ended")
    ));
    served.report.virtual_ns = chip.clock();
    Ok(served.hand_on())
}

/// What every request of a rank is served with: the job, where each rank called from, and
/// the representative's calls for `--verify-ranks` (when it is one with shadows).
pub struct Context<'a> {
    pub spec: &'a TorchSpec,
    pub sites: &'a CallSites,
    pub reference: Option<&'a Reference>,
    /// Meta mode's object broadcasts between the job's processes.
    pub board: &'a Board,
    /// Set when a group makes the job run again (a regroup): the ranks' output stops at once,
    /// before their connections close under them (`RankGuard::quiet`).
    pub quiet: &'a AtomicBool,
}

async fn handle(
    chip: &mut Chip,
    served: &mut Served,
    link: &mut RankLink,
    context: &Context<'_>,
    frame: Frame,
    values: Vec<f32>,
) -> Result<(), ProgramError> {
    served.charge_waits(chip, &frame);
    let answer = match frame.request {
        Request::Group { id, ranks } => {
            let (pod, site) = (chip.pod(), frame.site.as_deref());
            let group =
                super::groups::declare(pod, context.spec, chip.id(), &ranks, site, chip.mirrored())
                    .inspect_err(|e| {
                        if e.is_regroup() {
                            context.quiet.store(true, Ordering::Relaxed);
                        }
                    })?;
            let error = group
                .map(|g| served.add_group(id, g, context.spec.algo))
                .err();
            (reply(chip, error), None)
        }
        Request::Clock => (reply(chip, None), None),
        Request::PostObjects { key } => {
            context.board.post(chip.id(), key, values);
            (reply(chip, None), None)
        }
        Request::FetchObjects { key, src } => {
            let words = context.board.fetch(src, key).await;
            (reply(chip, None), words.map(Payload::from_vec))
        }
        Request::Step {
            hbm,
            auto,
            counting,
        } => {
            served.end_step(chip, hbm, auto, counting).await;
            (reply(chip, None), None)
        }
        Request::Bye { stand_ins } => {
            served.wait_for_all(chip);
            served.said_bye = true;
            served.report.stand_ins = stand_ins;
            (reply(chip, None), None)
        }
        Request::Raised { error } => {
            served.raised = Some(super::ranks::raised(&error, frame.site.as_deref()));
            return Ok(()); // no reply: the rank is on its way out
        }
        Request::Hello { .. } | Request::Stack { .. } | Request::Sampler { .. } => {
            return Err(ProgramError::Invalid(format!(
                "rank {}: an unexpected {:?} request",
                served.report.rank, frame.request
            )));
        }
        request => {
            let issue = Issue {
                request,
                site: frame.site,
                meta: frame.meta,
                work: frame.work,
                values,
            };
            match serve_collective(chip, served, context, issue).await? {
                Ok(answer) => answer,
                Err(refused) => (reply(chip, Some(refused.0)), None),
            }
        }
    };
    // A rank that went away no longer reads replies; its exit decides what happens next.
    let _ = link.replies.send(answer).await;
    Ok(())
}

/// The reply to a request, at the chip's clock now.
fn reply(chip: &Chip, error: Option<String>) -> Reply {
    Reply {
        error,
        clock_ns: chip.clock(),
    }
}

/// A collective as the rank issued it.
struct Issue {
    request: Request,
    site: Option<String>,
    meta: Option<u64>,
    work: Option<u64>,
    values: Vec<f32>,
}

/// Runs a collective request on the chip: its reply and result, or why it was refused (the
/// rank raises that at its call); an error of the fabric ends the job.
async fn serve_collective(
    chip: &mut Chip,
    served: &mut Served,
    context: &Context<'_>,
    issue: Issue,
) -> Result<Result<(Reply, Option<Payload>), Refused>, ProgramError> {
    let Issue {
        request,
        site,
        meta,
        work,
        values,
    } = issue;
    let words = request.words(meta, values.len());
    let call = context
        .reference
        .and_then(|_| Call::of(&request, site.as_deref(), words, served.calls));
    context.sites.set(chip.id(), site);
    // A collective with an id runs on its communication stream from its issue (or when the
    // stream is free); the compute stream goes on from the issue.
    let issued_at = chip.clock();
    let stream = work.and(stream_of(&request));
    if let Some(s) = stream {
        chip.set_clock(issued_at.max(served.stream_free[s]));
    }
    let before = chip.clock();
    let hbm_before = chip.stats().hbm_traffic();
    let input = match meta {
        None => Payload::from_vec(values),
        Some(n) if values.is_empty() => Payload::Meta(n as usize),
        Some(_) => return Ok(Err(Refused("a meta-mode request carried values".into()))),
    };
    let (op, result) = match collective(chip, served, request, input).await {
        Ok(done) => done,
        Err(refused) => return Ok(Err(refused)),
    };
    let result = result.map_err(|e| match e {
        ProgramError::Collective(c) => context.sites.name(c),
        other => other,
    })?;
    if let (Some(reference), Some(call)) = (context.reference, call) {
        reference.push(call);
    }
    served.calls += 1;
    let done = chip.clock();
    let spent = done - before;
    if let (Some(s), Some(work)) = (stream, work) {
        served.stream_free[s] = done;
        served.in_flight.insert(work, done);
        served.hbm.collective_ran(chip, before, hbm_before);
        chip.set_clock(issued_at);
    }
    served.step_comm_ns += spent;
    served.report.comm_ns += spent;
    served.report.add(op, 4 * words, spent);
    Ok(Ok((reply(chip, None), result)))
}

impl Served {
    /// The compute the rank ran before each wait for collectives (the wait moves the clock
    /// to when they were done), then the compute since.
    fn charge_waits(&mut self, chip: &mut Chip, frame: &Frame) {
        for waited in &frame.waits {
            self.charge(chip, &waited.compute);
            let ready = waited
                .works
                .iter()
                .filter_map(|w| self.in_flight.remove(w))
                .fold(0.0, f64::max);
            chip.set_clock(chip.clock().max(ready));
        }
        self.charge(chip, &frame.compute);
    }

    /// The rank marked the end of a step (its `optimizer.step()`, or `podsim.torch.step()`).
    async fn end_step(
        &mut self,
        chip: &mut Chip,
        hbm: Option<StepHbm>,
        auto: bool,
        counting: StepCounting,
    ) {
        self.wait_for_all(chip);
        if !auto && !self.explicit_steps {
            self.explicit_steps = true;
            self.fold_auto_steps();
        }
        let now = chip.clock();
        let hbm = match hbm.unwrap_or_default() {
            h if h.peak_bytes >= self.folded_hbm.peak_bytes => h,
            _ => std::mem::take(&mut self.folded_hbm),
        };
        self.folded_hbm = StepHbm::default();
        let step = RankStep {
            step_ns: now - self.step_start_ns,
            compute_ns: self.step_compute_ns,
            comm_ns: self.step_comm_ns,
            exposed_comm_ns: (now - self.step_start_ns - self.step_compute_ns).max(0.0),
            hbm_wait_ns: self.step_hbm_wait_ns,
            peak_hbm_bytes: hbm.peak_bytes,
            hbm_by_kind: hbm.by_kind,
            flops: self.step_flops,
            model_flops: self.step_model_flops,
            counting,
        };
        self.step_flops = 0.0;
        self.step_model_flops = 0.0;
        self.report.steps.push(step);
        self.report.virtual_ns = now;
        self.step_start_ns = now;
        self.step_compute_ns = 0.0;
        self.step_comm_ns = 0.0;
        self.step_hbm_wait_ns = 0.0;
        chip.enter_step(self.report.steps.len() as u64).await;
    }
}

/// The communication stream a collective runs on: gathers and reductions apart, as on the
/// chips of podsim's own trainer. Point-to-point and barriers are not streamed: they finish
/// before the call returns.
fn stream_of(request: &Request) -> Option<usize> {
    match request {
        Request::AllGather { .. } | Request::Broadcast { .. } | Request::AllToAll { .. } => Some(0),
        Request::AllReduce { .. } | Request::ReduceScatter { .. } => Some(1),
        _ => None,
    }
}

impl Served {
    /// Charges compute the rank ran to the chip's clock.
    fn charge(&mut self, chip: &mut Chip, compute: &Compute) {
        if compute.is_empty() {
            return;
        }
        let hw = chip.hardware();
        let waited = self.hbm.waited_ns();
        let ns = self.hbm.run_all(hw, chip.clock(), works(compute, hw));
        self.step_hbm_wait_ns += self.hbm.waited_ns() - waited;
        // The rank's kernels since its last request, one span on a traced chip's timeline.
        let span = chip.trace_open(
            crate::COMPUTE_TRACK,
            "compute",
            || "the rank's kernels".to_string(),
            Vec::new(),
        );
        chip.compute(ns);
        chip.trace_close(span);
        self.report.compute_ns += ns;
        self.step_compute_ns += ns;
        self.step_flops += compute_flops(compute);
        self.step_model_flops += model_flops(compute);
    }

    /// The program marked its first step itself: the steps `optimizer.step()` marked before
    /// (a program that steps its optimizer before its own mark) become part of this one.
    fn fold_auto_steps(&mut self) {
        for step in self.report.steps.drain(..) {
            self.step_start_ns -= step.step_ns;
            self.step_compute_ns += step.compute_ns;
            self.step_hbm_wait_ns += step.hbm_wait_ns;
            self.step_comm_ns += step.comm_ns;
            self.step_flops += step.flops;
            self.step_model_flops += step.model_flops;
            if step.peak_hbm_bytes > self.folded_hbm.peak_bytes {
                self.folded_hbm = StepHbm {
                    peak_bytes: step.peak_hbm_bytes,
                    by_kind: step.hbm_by_kind,
                };
            }
        }
    }

    /// The compute stream waits for every collective in flight (a step's end, the rank's).
    fn wait_for_all(&mut self, chip: &mut Chip) {
        let ready = self.in_flight.drain().map(|(_, t)| t).fold(0.0, f64::max);
        chip.set_clock(chip.clock().max(ready));
    }
}

/// A request the rank made wrongly (an unknown group, a count that does not divide): the rank
/// raises it at the call; the job goes on.
struct Refused(String);

type Done = (OpKind, Result<Option<Payload>, ProgramError>);

async fn collective(
    chip: &mut Chip,
    served: &Served,
    request: Request,
    input: Payload,
) -> Result<Done, Refused> {
    let comm_of = |group: u32| served.comm(group);
    let with_dtype = |group: u32, dtype: DTypeName| {
        comm_of(group).map(|c| Comm {
            dtype: dtype.into(),
            ..c
        })
    };
    let pod = chip.pod().clone();
    let divided = |what: &str, comm: Comm| divided(what, comm, input.len(), &pod);
    let done: Done = match request {
        Request::AllReduce {
            group,
            reduce,
            dtype,
        } => {
            let comm = with_dtype(group, dtype)?;
            let r = chip.all_reduce(&comm, &input, reduce.into()).await;
            (OpKind::AllReduce, r.map(Some).map_err(Into::into))
        }
        Request::AllGather { group, dtype } => {
            let comm = with_dtype(group, dtype)?;
            let r = chip.all_gather(&comm, &input).await;
            (OpKind::AllGather, r.map(Some).map_err(Into::into))
        }
        Request::ReduceScatter {
            group,
            reduce,
            dtype,
        } => {
            let comm = divided("reduce_scatter", with_dtype(group, dtype)?)?;
            let r = chip.reduce_scatter(&comm, &input, reduce.into()).await;
            (OpKind::ReduceScatter, r.map(Some).map_err(Into::into))
        }
        Request::Broadcast { group, root, dtype } => {
            let comm = with_dtype(group, dtype)?;
            let n = comm.group.size(&pod);
            if root >= n {
                return Err(Refused(format!(
                    "broadcast: root {root} is outside a group of {n} ranks"
                )));
            }
            let r = chip.broadcast(&comm, &input, root).await;
            (OpKind::Broadcast, r.map(Some).map_err(Into::into))
        }
        Request::AllToAll { group, dtype } => {
            let comm = divided("all_to_all", with_dtype(group, dtype)?)?;
            let r = chip.all_to_all(&comm, &input).await;
            (OpKind::AllToAll, r.map(Some).map_err(Into::into))
        }
        Request::Barrier { group } => {
            let comm = comm_of(group)?;
            let r = chip.barrier(&comm).await;
            (OpKind::Barrier, r.map(|()| None).map_err(Into::into))
        }
        // A peer or tag the fabric cannot serve is refused before anything is sent or
        // counted: the rank raises it at its call.
        Request::Send { peer, tag } => match chip.send_to(peer, &input, tag).await {
            Err(CollectiveError::Invalid(why)) => return Err(Refused(why)),
            r => (OpKind::SendRecv, r.map(|()| None).map_err(Into::into)),
        },
        Request::Recv { peer, tag, count } => {
            match chip.recv_from(peer, count as usize, tag).await {
                Err(CollectiveError::Invalid(why)) => return Err(Refused(why)),
                r => (OpKind::SendRecv, r.map(Some).map_err(Into::into)),
            }
        }
        other => return Err(Refused(format!("{other:?} is not a collective"))),
    };
    Ok(done)
}

impl Served {
    /// The communicator of a group the rank declared.
    fn comm(&self, group: u32) -> Result<Comm, Refused> {
        self.groups
            .get(&group)
            .copied()
            .ok_or_else(|| Refused(format!("group {group} was never declared")))
    }
}

/// `comm`, when `len` elements cut into one block per rank of its group (the ops that cut
/// their input need it to divide).
fn divided(what: &str, comm: Comm, len: usize, pod: &Pod) -> Result<Comm, Refused> {
    let n = comm.group.size(pod) as usize;
    if len.is_multiple_of(n) {
        Ok(comm)
    } else {
        Err(Refused(format!(
            "{what}: {len} elements do not divide among {n} ranks"
        )))
    }
}

impl RankReport {
    fn add(&mut self, op: OpKind, bytes: u64, ns: f64) {
        let name = op.name();
        if let Some(t) = self.collectives.iter_mut().find(|t| t.op == name) {
            t.calls += 1;
            t.bytes += bytes;
            t.virtual_ns += ns;
        } else {
            self.collectives.push(OpTotals {
                op: name.to_string(),
                calls: 1,
                bytes,
                virtual_ns: ns,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Virtual ns of the work in `compute` on `hw`, with HBM to itself.
    fn compute_ns(compute: &Compute, hw: &Hardware) -> f64 {
        works(compute, hw).map(|w| w.time_ns(hw)).sum()
    }

    #[test]
    fn compute_is_priced_by_the_kernel_model() {
        let hw = Hardware::preset("v5p").expect("preset");
        let matmul = Kernel::Matmul {
            m: 129,
            k: 1024,
            n: 1024,
        }
        .time_ns(&hw, 4.0);
        let c = Compute {
            matmuls: vec![[129, 1024, 1024, 3, 4]],
            pass_bytes: 1 << 30,
            kernels: 10,
            attention: vec![[4, 2048, 8, 128, 1, 1, 2, 3]],
            // One of the three matmuls was recomputed: model flops leave it out.
            recomputed_matmuls: vec![[129, 1024, 1024, 1, 4]],
            recomputed_attention: Vec::new(),
        };
        let passes = (1u64 << 30) as f64 / (hw.hbm_bandwidth * hw.hbm_efficiency) * 1e9
            + 10.0 * hw.kernel_overhead_ns;
        let attention = Kernel::Attention {
            seqs: 4,
            seq: 2048,
            heads: 8.0,
            head_dim: 128,
            causal: true,
            backward: true,
        }
        .time_ns(&hw, 2.0);
        let got = compute_ns(&c, &hw);
        let want = 3.0 * matmul + 3.0 * attention + passes;
        assert!((got - want).abs() < 1e-6 * got, "{got} vs {want}");
        assert_eq!(compute_ns(&Compute::default(), &hw), 0.0);
        let matmul_flops = 2.0 * 129.0 * 1024.0 * 1024.0;
        let gap = compute_flops(&c) - model_flops(&c);
        assert!(
            (gap - matmul_flops).abs() < 1e-9 * gap,
            "{gap} vs {matmul_flops}"
        );
    }

    /// Kills the child when dropped (a failed assertion must not leave it spinning).
    struct Killed(std::process::Child);

    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_spinning_thread_is_running_unless_it_is_the_sampler() {
        let spawn = |program: &str, args: &[&str]| {
            Killed(
                std::process::Command::new(program)
                    .args(args)
                    .spawn()
                    .expect(program),
            )
        };
        let within_5s = |what: &str, cond: &dyn Fn() -> bool| {
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while !cond() {
                assert!(std::time::Instant::now() < deadline, "{what}");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        // One thread that never blocks, once it has started: running or waiting for a core.
        let busy = spawn("sh", &["-c", "while :; do :; done"]);
        let pid = busy.0.id();
        within_5s("the loop never runs", &|| any_thread_running(pid, 0));
        // The same thread named as the rank's sampler (a one-thread process: its id is the
        // pid) is left out, and nothing else runs.
        assert!(!any_thread_running(pid, pid));
        let asleep = spawn("sleep", &["30"]);
        within_5s("sleep keeps running", &|| {
            !any_thread_running(asleep.0.id(), 0)
        });
    }
}
