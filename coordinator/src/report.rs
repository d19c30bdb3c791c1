//! `report.json` and the human summary of a job.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;
use std::path::Path;

use hdrhistogram::Histogram;
use podsim_collectives::trace::{ChipTrace, Span};
use podsim_job::ChipStepReport;
use podsim_programs::job::Program;
use serde::{Deserialize, Serialize};

use crate::watchdog::HangKind;

use crate::JobStatus;
use crate::bench::iteration_times;
use crate::config::JobConfig;
use crate::launch::{HangReport, Outcome, WorkerInfo};

#[derive(Debug, Serialize, Deserialize)]
pub struct Report {
    pub podsim_version: String,
    pub job: JobInfo,
    pub topology: TopologyInfo,
    pub workers: Vec<WorkerEntry>,
    pub status: JobStatus,
    pub error: Option<String>,
    pub collectives: Vec<CollectiveEntry>,
    /// Wall latency of every collective call (first chip in to last chip out), per op, µs.
    pub latency_us: BTreeMap<String, Latency>,
    pub correctness: Correctness,
    /// The diagnosis of a detected hang or desync.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hang: Option<Hang>,
    /// Faults that fired in any attempt: those the workers reported, and the crashes and
    /// freezes the coordinator saw fire (`process_faults`: no worker can report them).
    pub faults_injected: Vec<podsim_job::FaultEvent>,
    /// A finished job's faults that never fired, each said with its target and trigger: a
    /// fault-injection run whose fault never came tested nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults_not_fired: Vec<String>,
    /// Checkpoints and the restarts after failures (train jobs with `[recovery]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recovery: Option<Recovery>,
    /// Chips that were slow but kept making progress.
    pub stragglers: Vec<crate::watchdog::Straggler>,
    /// Training jobs: the strategy, every step and each chip's memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub training: Option<Training>,
    /// PyTorch jobs: every rank's virtual time per collective and per marked step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub torch: Option<TorchRun>,
    /// Virtual time of the whole job: the latest chip clock, seconds.
    pub virtual_s: f64,
    pub wall_s: f64,
    pub link_errors: Vec<String>,
    /// One step (the median one) of chip 0 and, when others were traced, of the traced chip
    /// whose same step took longest: every slice of it, for the page's Gantt chart.
    pub timelines: Vec<StepTimeline>,
}

/// One step of one chip, slice by slice (times in ns from the step's start).
#[derive(Debug, Serialize, Deserialize)]
pub struct StepTimeline {
    pub chip: u32,
    pub step: String,
    pub virtual_ms: f64,
    pub slices: Vec<TimelineSlice>,
    /// Slices left out past [`TIMELINE_SLICES`].
    pub slices_left_out: usize,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TimelineSlice {
    pub track: String,
    pub name: String,
    pub cat: String,
    pub start_ns: f64,
    pub end_ns: f64,
}

/// A PyTorch program's run: each rank's report, and each marked step over all ranks.
#[derive(Debug, Serialize, Deserialize)]
pub struct TorchRun {
    pub command: Vec<String>,
    /// Step `i` of the job: the slowest rank's step time, with that rank's split.
    pub steps: Vec<TorchStep>,
    pub ranks: Vec<podsim_programs::RankReport>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TorchStep {
    pub step: usize,
    /// The rank whose step took longest.
    pub rank: u32,
    pub virtual_ms: f64,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub exposed_comm_ms: f64,
    /// Of `compute_ms`, what the rank's kernels lost waiting for HBM that its communication in
    /// flight took.
    #[serde(default)]
    pub hbm_wait_ms: f64,
    /// The largest peak of live device bytes any rank had in the step, and its split by kind.
    #[serde(default)]
    pub peak_hbm_bytes: u64,
    #[serde(default)]
    pub hbm_by_kind: Vec<(String, u64)>,
    /// Hardware flops utilisation of the slowest rank: the matmul and attention flops it
    /// executed (recomputation included) over the chip's peak for the step's time.
    #[serde(default)]
    pub hfu: f64,
    /// Model flops utilisation of the slowest rank: as `hfu`, without the work activation
    /// checkpointing recomputed.
    #[serde(default)]
    pub mfu: f64,
}

/// Each step marked by every rank, as its slowest rank saw it.
fn torch_steps(ranks: &[podsim_programs::RankReport], peak_flops: f64) -> Vec<TorchStep> {
    let steps = ranks.iter().map(|r| r.steps.len()).min().unwrap_or(0);
    (0..steps)
        .filter_map(|i| {
            let slowest = ranks
                .iter()
                .max_by(|a, b| a.steps[i].step_ns.total_cmp(&b.steps[i].step_ns))?;
            let s = &slowest.steps[i];
            let utilisation = |flops: f64| match s.step_ns {
                ns if ns > 0.0 => flops / (peak_flops * ns / 1e9),
                _ => 0.0,
            };
            let fullest = ranks
                .iter()
                .map(|r| &r.steps[i])
                .max_by_key(|s| s.peak_hbm_bytes)?;
            Some(TorchStep {
                step: i,
                rank: slowest.rank,
                virtual_ms: s.step_ns / 1e6,
                compute_ms: s.compute_ns / 1e6,
                comm_ms: s.comm_ns / 1e6,
                exposed_comm_ms: s.exposed_comm_ns / 1e6,
                hbm_wait_ms: s.hbm_wait_ns / 1e6,
                peak_hbm_bytes: fullest.peak_hbm_bytes,
                hbm_by_kind: fullest.hbm_by_kind.clone(),
                hfu: utilisation(s.flops),
                mfu: utilisation(s.model_flops),
            })
        })
        .collect()
}

/// Slices a report's step timeline keeps.
pub const TIMELINE_SLICES: usize = 4000;

/// The steps-track slice of `trace` named `name`.
fn step_span<'t>(trace: &'t ChipTrace, name: &str) -> Option<&'t Span> {
    trace
        .spans
        .iter()
        .find(|s| s.track == podsim_programs::STEPS_TRACK && s.name == name)
}

/// Chip 0's median step and the same step of the traced chip where it took longest.
fn timelines(traces: &[&ChipTrace]) -> Vec<StepTimeline> {
    let Some(first) = traces.iter().find(|t| t.chip == 0) else {
        return Vec::new();
    };
    let mut steps: Vec<&Span> = first
        .spans
        .iter()
        .filter(|s| s.track == podsim_programs::STEPS_TRACK && s.name != "setup")
        .filter(|s| s.virtual_end_ns.is_some())
        .collect();
    steps.sort_by(|a, b| span_ns(a).total_cmp(&span_ns(b)));
    let Some(median) = steps.get(steps.len() / 2) else {
        return Vec::new();
    };
    let name = median.name.clone();
    let slowest = traces
        .iter()
        .filter_map(|t| step_span(t, &name).map(|s| (*t, span_ns(s))))
        .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.chip.cmp(&a.0.chip)));
    let mut out = vec![timeline(first, median)];
    if let Some((t, _)) = slowest
        && t.chip != 0
        && let Some(s) = step_span(t, &name)
    {
        out.push(timeline(t, s));
    }
    out
}

fn span_ns(s: &Span) -> f64 {
    s.virtual_end_ns.unwrap_or(s.virtual_start_ns) - s.virtual_start_ns
}

fn timeline(trace: &ChipTrace, step: &Span) -> StepTimeline {
    let (start, end) = (
        step.virtual_start_ns,
        step.virtual_end_ns.unwrap_or(step.virtual_start_ns),
    );
    let inside: Vec<TimelineSlice> = trace
        .spans
        .iter()
        .filter(|s| s.track != podsim_programs::STEPS_TRACK)
        .filter_map(|s| {
            let e = s.virtual_end_ns?;
            (s.virtual_start_ns >= start && e <= end).then(|| TimelineSlice {
                track: s.track.clone(),
                name: s.name.clone(),
                cat: s.cat.clone(),
                start_ns: s.virtual_start_ns - start,
                end_ns: e - start,
            })
        })
        .collect();
    let left_out = inside.len().saturating_sub(TIMELINE_SLICES);
    StepTimeline {
        chip: trace.chip,
        step: step.name.clone(),
        virtual_ms: (end - start) / 1e6,
        slices: inside.into_iter().take(TIMELINE_SLICES).collect(),
        slices_left_out: left_out,
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct JobInfo {
    pub name: String,
    pub kind: String,
    pub mode: String,
    pub config: String,
    /// The podsim command line that wrote this report, `--set` overrides included: how to run
    /// the same job again.
    #[serde(default)]
    pub command: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct TopologyInfo {
    pub shape: String,
    pub wraparound: Vec<bool>,
    pub chips: u32,
    pub slices: u32,
    pub hardware: podsim_topology::Hardware,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerEntry {
    pub id: u32,
    pub pid: u32,
    pub address: String,
    pub chips: Vec<u32>,
    pub peak_rss_bytes: u64,
    pub messages_sent: u64,
    pub bytes_sent: u64,
    /// Each link to another worker and its transport (`tcp`: records over TCP, `grpc`, `uds` or
    /// `shm`).
    pub links: Vec<podsim_programs::job::PeerLink>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct CollectiveEntry {
    pub step: usize,
    pub op: String,
    pub bytes: u64,
    pub algo: String,
    pub group: String,
    /// Chips in the group.
    pub group_size: u32,
    /// One entry per iteration of the script.
    pub calls: Vec<CallTimes>,
    /// nccl-tests' algbw and busbw from the calls' mean virtual time, GB/s.
    pub virtual_algbw_gbps: f64,
    pub virtual_busbw_gbps: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct CallTimes {
    pub iteration: u32,
    pub wall_s: f64,
    pub virtual_s: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Latency {
    pub count: u64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Correctness {
    pub elements_checked: u64,
    pub wrong_elements: u64,
    /// Training: largest difference of the final parameters to single-chip training on the
    /// global batch (absolute, and relative to each tensor's largest value).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_abs_diff: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_rel_diff: Option<f64>,
    /// Training: the same relative measure between single-chip training and the same started
    /// one unit in the last place away: how far rounding alone takes this run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rounding_spread: Option<f64>,
    /// Training: why the final parameters could not be checked against single-chip
    /// training: they are further from it than the tolerance, but rounding alone moves this
    /// run as far (a long run whose updates amplify small differences). Neither a pass nor a
    /// failure: a shorter run (fewer steps) checks the strategy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unverified: Option<String>,
    /// Training: a hash of the final parameters' bits (equal hashes: bit-identical runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_params_hash: Option<String>,
    /// Training: every chip ends with the same full parameters, bit for bit.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas_identical: Option<bool>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Hang {
    pub kind: crate::watchdog::HangKind,
    pub culprit: Culprit,
    /// The collective at fault (the culprit's, or the one waited for).
    pub seq: Option<u64>,
    pub op: Option<String>,
    /// From the moment the fault took effect (the injected fault firing, else the culprit's
    /// last sign of life) to the diagnosis.
    pub detected_after_ms: f64,
    /// When the diagnosis was made, ms since the Unix epoch (to line it up with the logs of a
    /// program, e.g. a PyTorch rank that printed when it went wrong).
    pub detected_at_unix_ms: f64,
    /// How many chips were left waiting, and their ids as inclusive ranges `[first, last]`
    /// (the full lists are in the flight recorders).
    pub waiting_count: u64,
    pub waiting_chips: Vec<(u32, u32)>,
    pub explanation: String,
    /// Flight-recorder files written beside the report.
    pub flight_recorders: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Recovery {
    pub checkpoint_every: u32,
    pub max_restarts: u32,
    pub restarts: Vec<Restart>,
    /// Steps run again because they came after the checkpoint a restart resumed from.
    pub steps_lost: u64,
    /// Why the job was not restarted although restarts remained (no checkpoint verified).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Checkpoints that could not be written (training went on; older ones stood).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub write_failures: Vec<String>,
}

/// One failure the job recovered from.
#[derive(Debug, Serialize, Deserialize)]
pub struct Restart {
    pub attempt: u32,
    pub kind: crate::watchdog::HangKind,
    pub explanation: String,
    pub failed_at_step: u64,
    pub resumed_from_step: u32,
    pub steps_lost: u64,
    /// Newer checkpoints passed over because they did not verify, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checkpoints_skipped: Vec<podsim_programs::train::checkpoint::Skipped>,
    /// The faults that fired in the failed attempt (a restart runs without the job's faults,
    /// so the report's lists of fired and unfired faults are made from every attempt's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub faults_fired: Vec<podsim_job::FaultEvent>,
}

/// Fills `report.recovery` for train jobs that checkpoint: the restarts made, why the last
/// failure was not restarted from (`refused`), and the checkpoint writes the chips of the last
/// attempt reported failing (`outcome`, when it finished).
pub fn add_recovery(
    report: &mut Report,
    cfg: &JobConfig,
    outcome: Option<&Outcome>,
    restarts: Vec<Restart>,
    refused: Option<String>,
) {
    if !restarts.is_empty() {
        // A restart runs without the job's faults (they did their work: the failure it
        // recovers from): what fired, and what never did, is told by every attempt's.
        let earlier = restarts.iter().flat_map(|r| r.faults_fired.iter().cloned());
        report.faults_injected = earlier.chain(report.faults_injected.drain(..)).collect();
        if outcome.is_some() {
            // A crash or freeze no worker can tell of (see `process_faults`) may have fired in
            // a failed attempt diagnosed otherwise: only the others are known never to have.
            let unfired = not_fired(&cfg.faults, &report.faults_injected);
            report.faults_not_fired = unfired
                .into_iter()
                .filter(|(i, _)| !cfg.faults[*i].kind.ends_its_worker())
                .map(|(_, said)| said)
                .collect();
        }
    }
    if let Program::Train(t) = &cfg.program
        && t.checkpoint_every > 0
    {
        let write_failures = outcome
            .into_iter()
            .flat_map(|o| &o.reports)
            .flat_map(|r| &r.train)
            .flat_map(|c| c.checkpoint_failures.iter().cloned())
            .collect();
        if let (Some(why), Some(error)) = (&refused, &mut report.error) {
            error.push_str("; ");
            error.push_str(why);
        }
        report.recovery = Some(Recovery {
            checkpoint_every: t.checkpoint_every,
            max_restarts: cfg.max_restarts,
            steps_lost: restarts.iter().map(|r| r.steps_lost).sum(),
            restarts,
            refused,
            write_failures,
        });
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Culprit {
    pub chip: Option<u32>,
    pub coordinates: Option<Vec<u32>>,
    pub worker: Option<u32>,
    pub pid: Option<u32>,
    /// Named from its sending chip.
    pub link: Option<String>,
    /// A PyTorch rank's Python stack where it was last seen outside podsim's calls
    /// (`file:line function`, innermost last).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_stack: Vec<String>,
}

/// Whether a `file:line function` frame is in installed packages, the standard library or
/// podsim's own Python, not in the program.
fn in_a_package(frame: &str) -> bool {
    let file = frame.split(':').next().unwrap_or(frame);
    let stdlib = file
        .split("/lib/python3.")
        .nth(1)
        .is_some_and(|rest| rest.split_once('/').is_some());
    ["/site-packages/", "/dist-packages/", "<frozen "]
        .iter()
        .any(|p| file.contains(p))
        || stdlib
        || file.contains("/podsim/_")
        || file.ends_with("/podsim/torch.py")
}

/// The explanation, and where a PyTorch culprit's Python program sits: its innermost frame
/// of the program's own code, and the innermost of all when that is in a package or the
/// standard library (a loop calling `dist.get_rank()` sits in torch most of the time).
fn with_python_line(
    f: &crate::watchdog::Finding,
    recorders: &BTreeMap<u32, serde_json::Value>,
) -> String {
    let stack = host_stack_of(recorders, f.chip);
    let (Some(innermost), Some(chip)) = (stack.last(), f.chip) else {
        return f.explanation.clone();
    };
    let line = match stack.iter().rev().find(|frame| !in_a_package(frame)) {
        Some(own) if own != innermost => format!("{own} (inside {innermost})"),
        _ => innermost.clone(),
    };
    match f.kind {
        HangKind::StalledChip => format!(
            "{} Rank {chip}'s Python program is at {line}.",
            f.explanation
        ),
        HangKind::DeadWorker => format!("{} Rank {chip} was last seen at {line}.", f.explanation),
        // A desync names both calls' lines itself.
        _ => f.explanation.clone(),
    }
}

/// The stack the culprit's program last reported (from the flight-recorder dumps).
fn host_stack_of(recorders: &BTreeMap<u32, serde_json::Value>, chip: Option<u32>) -> Vec<String> {
    let Some(chip) = chip else {
        return Vec::new();
    };
    recorders
        .values()
        .filter_map(|dump| dump.as_array())
        .flatten()
        .find(|d| d["status"]["chip"].as_u64() == Some(u64::from(chip)))
        .and_then(|d| d["host_stack"].as_array())
        .map(|frames| {
            frames
                .iter()
                .filter_map(|f| f.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Fills `report.hang` from a diagnosed hang and writes the flight recorders into `dir`.
pub fn add_hang(report: &mut Report, cfg: &JobConfig, h: &crate::launch::HangReport) {
    let f = &h.finding;
    // How far the job got in virtual time: the latest collective a chip completed (the
    // flight recorders keep each chip's last ones), not 0.
    report.virtual_s = report
        .virtual_s
        .max(latest_completed_ns(&h.recorders) / 1e9);
    let mut files = Vec::new();
    for (worker, dump) in &h.recorders {
        let name = format!("flight-recorder-worker-{worker}.json");
        let path = cfg.output_dir.join(&name);
        if let Ok(text) = serde_json::to_string_pretty(dump)
            && std::fs::create_dir_all(&cfg.output_dir).is_ok()
            && crate::outdir::write_atomic(&path, text.as_bytes()).is_ok()
        {
            files.push(name);
        }
    }
    let effect = h
        .faults
        .iter()
        .map(|e| e.at_wall_ns)
        .min()
        .unwrap_or(f.effect_wall_ns)
        .min(h.detected_wall_ns);
    report.status = f.kind.status();
    report.faults_injected = h.faults.clone();
    report.hang = Some(Hang {
        kind: f.kind,
        culprit: Culprit {
            chip: f.chip,
            coordinates: f.chip.map(|c| cfg.pod.coord(c).to_vec()),
            worker: f.worker,
            pid: f.worker.and_then(|w| h.pids.get(&w).copied()),
            link: f.link.map(|l| l.to_string()),
            python_stack: host_stack_of(&h.recorders, f.chip),
        },
        seq: f.seq,
        op: f.op.clone(),
        detected_after_ms: h.detected_wall_ns.saturating_sub(effect) as f64 / 1e6,
        detected_at_unix_ms: h.detected_wall_ns as f64 / 1e6,
        waiting_count: f.waiting.count(),
        waiting_chips: f.waiting.0.clone(),
        explanation: with_python_line(f, &h.recorders),
        flight_recorders: files,
    });
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Training {
    pub strategy: String,
    pub eager: String,
    /// The model as configured (`kind` mlp with `widths`, or transformer with its shape).
    pub model: podsim_programs::train::ModelSpec,
    pub parameters: usize,
    pub global_batch: usize,
    /// Model flops of one step on the global batch (6 per weight per token, plus attention).
    pub flops_per_step: f64,
    /// The median step's virtual time (slowest chip), its compute and exposed communication.
    pub step_ms: f64,
    pub compute_ms: f64,
    pub exposed_comm_ms: f64,
    /// Of `compute_ms`, what kernels lost waiting for HBM that communication in flight took.
    #[serde(default)]
    pub hbm_wait_ms: f64,
    /// Model flops utilisation: `flops_per_step / (chips * peak_flops * step time)`.
    pub mfu: f64,
    /// The largest peak HBM of any chip, and the capacity.
    pub peak_hbm_bytes: u64,
    pub hbm_capacity_bytes: u64,
    /// Meta mode: the first chip's first allocation that would not fit (out of memory).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oom: Option<String>,
    pub steps: Vec<TrainStep>,
    /// Steps per second of wall time (median step, slowest chip).
    pub steps_per_s: f64,
    pub hbm: Vec<ChipMemory>,
}

/// One step over the whole pod: loss averaged over chips, times of the slowest chip.
#[derive(Debug, Serialize, Deserialize)]
pub struct TrainStep {
    pub step: u32,
    pub loss: Option<f64>,
    pub virtual_ms: f64,
    pub compute_ms: f64,
    pub comm_ms: f64,
    pub exposed_comm_ms: f64,
    /// Of `compute_ms`, what kernels lost waiting for HBM beside communication (the slowest
    /// chip's).
    #[serde(default)]
    pub hbm_wait_ms: f64,
    pub wall_ms: f64,
    /// Offloaded activations held in host memory (the most of any chip), bytes.
    pub host_activations_bytes: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct ChipMemory {
    pub chip: u32,
    #[serde(flatten)]
    pub hbm: podsim_programs::train::HbmReport,
}

/// Builds the report of a finished (`Ok`) or failed (`Err`) job.
/// A failed job still lists the workers that had joined (`roster`), with the chips placed on
/// each.
pub fn build(cfg: &JobConfig, outcome: Result<&Outcome, (String, &[WorkerInfo])>) -> Report {
    let mut report = empty(cfg);
    let out = match outcome {
        Ok(out) => out,
        Err((e, roster)) => {
            report.status = JobStatus::Error;
            report.error = Some(e);
            report.workers = joined_workers(cfg, roster);
            return report;
        }
    };
    report.wall_s = out.wall.as_secs_f64();
    let traces: Vec<&ChipTrace> = out.reports.iter().flat_map(|r| &r.traces).collect();
    report.timelines = timelines(&traces);
    report.stragglers = out.stragglers.clone();
    report.faults_injected = out.faults.clone();
    report.faults_not_fired = not_fired(&cfg.faults, &out.faults)
        .into_iter()
        .map(|(_, said)| said)
        .collect();
    report.workers = finished_workers(out);
    let steps: Vec<&ChipStepReport> = out.reports.iter().flat_map(|r| &r.steps).collect();
    report.correctness.elements_checked = steps.iter().map(|s| s.checked).sum();
    report.correctness.wrong_elements = steps.iter().map(|s| s.wrong).sum();
    report.link_errors = out
        .reports
        .iter()
        .flat_map(|r| r.link_errors.clone())
        .collect();
    report.virtual_s = steps
        .iter()
        .flat_map(|s| s.calls.iter().map(|c| c.virtual_end_ns))
        .fold(0.0, f64::max)
        / 1e9;
    match &cfg.program {
        Program::Collectives {
            script, iterations, ..
        } => collectives(&mut report, &cfg.pod, script, *iterations, &steps),
        Program::Train(spec) => training(&mut report, &cfg.pod, cfg.hardware.peak_flops, spec, out),
        Program::Torch(spec) => {
            let ranks = out.reports.iter().flat_map(|r| r.torch.clone()).collect();
            torch(&mut report, spec, cfg.hardware.peak_flops, ranks);
        }
        Program::Bench { .. } => {}
    }
    if report.correctness.wrong_elements > 0 {
        report.status = JobStatus::WrongResults;
        report.error = Some(format!(
            "{} wrong elements",
            report.correctness.wrong_elements
        ));
    }
    report
}

/// The report of `cfg` before anything ran.
fn empty(cfg: &JobConfig) -> Report {
    let pod = &cfg.pod;
    Report {
        podsim_version: env!("CARGO_PKG_VERSION").to_string(),
        job: JobInfo {
            name: cfg.name.clone(),
            kind: cfg.kind().to_string(),
            mode: cfg.mode().to_string(),
            config: cfg.source.display().to_string(),
            command: std::env::args().collect(),
        },
        topology: TopologyInfo {
            shape: pod.torus().to_string(),
            wraparound: pod.torus().wrap().to_vec(),
            chips: pod.chips(),
            slices: pod.slices(),
            hardware: cfg.hardware.clone(),
        },
        workers: Vec::new(),
        status: JobStatus::Ok,
        error: None,
        collectives: Vec::new(),
        latency_us: BTreeMap::new(),
        correctness: Correctness {
            elements_checked: 0,
            wrong_elements: 0,
            max_abs_diff: None,
            max_rel_diff: None,
            rounding_spread: None,
            unverified: None,
            final_params_hash: None,
            replicas_identical: None,
        },
        training: None,
        torch: None,
        hang: None,
        faults_injected: Vec::new(),
        faults_not_fired: Vec::new(),
        stragglers: Vec::new(),
        recovery: None,
        virtual_s: 0.0,
        wall_s: 0.0,
        link_errors: Vec::new(),
        timelines: Vec::new(),
    }
}

/// The faults of `faults` that no event of `fired` reports, each with its index and said as
/// "#i kind on target, at trigger".
fn not_fired(
    faults: &[podsim_job::FaultSpec],
    fired: &[podsim_job::FaultEvent],
) -> Vec<(usize, String)> {
    faults
        .iter()
        .enumerate()
        .filter(|(i, _)| !fired.iter().any(|e| e.fault == *i))
        .map(|(i, f)| {
            let target = match (f.chip, f.worker, f.link) {
                (_, _, Some(link)) => format!("link {}:{link}", f.chip.unwrap_or_default()),
                (Some(chip), _, None) => format!("chip {chip}"),
                (None, Some(worker), None) => format!("worker {worker}"),
                (None, None, None) => "the partition".to_string(),
            };
            let triggers: Vec<String> = [
                f.at_step.map(|n| format!("step {n}")),
                f.at_seq.map(|n| format!("collective {n}")),
                f.after_ms.map(|n| format!("{n} ms")),
            ]
            .into_iter()
            .flatten()
            .collect();
            let trigger = match triggers.is_empty() {
                true => "from the start".to_string(),
                false => format!("at {}", triggers.join(" and ")),
            };
            (i, format!("#{i} {} on {target}, {trigger}", f.kind.name()))
        })
        .collect()
}

/// A failed job's workers: those that had joined, with the chips placed on each.
fn joined_workers(cfg: &JobConfig, roster: &[WorkerInfo]) -> Vec<WorkerEntry> {
    let placement = podsim_topology::Placement::new(&cfg.pod, cfg.workers).ok();
    roster
        .iter()
        .map(|w| WorkerEntry {
            id: w.id,
            pid: w.pid,
            address: w.link_addr.clone(),
            chips: placement
                .as_ref()
                .map(|p| p.chips_of(w.id))
                .unwrap_or_default(),
            peak_rss_bytes: 0,
            messages_sent: 0,
            bytes_sent: 0,
            links: Vec::new(),
        })
        .collect()
}

/// A finished job's workers, with what each reported.
fn finished_workers(out: &Outcome) -> Vec<WorkerEntry> {
    out.workers
        .iter()
        .map(|info| {
            let r = out.reports.iter().find(|r| r.worker == info.id);
            WorkerEntry {
                id: info.id,
                pid: info.pid,
                address: info.link_addr.clone(),
                chips: r.map(|r| r.chips.clone()).unwrap_or_default(),
                peak_rss_bytes: r.map_or(0, |r| r.peak_rss_bytes),
                messages_sent: r.map_or(0, |r| r.messages_sent),
                bytes_sent: r.map_or(0, |r| r.bytes_sent),
                links: r.map(|r| r.links.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// A failed PyTorch job's `torch` section: the steps its failing ranks made before the
/// failure (`hang.torch`), so that what ran is not lost with the job.
pub fn add_failed_torch(report: &mut Report, cfg: &JobConfig, hang: &HangReport) {
    if let (Program::Torch(spec), None) = (&cfg.program, &report.torch)
        && !hang.torch.is_empty()
    {
        torch(report, spec, cfg.hardware.peak_flops, hang.torch.clone());
    }
}

/// A PyTorch program's ranks and steps; the job's virtual time is its latest rank clock.
fn torch(
    report: &mut Report,
    spec: &podsim_job::TorchSpec,
    peak_flops: f64,
    mut ranks: Vec<podsim_programs::RankReport>,
) {
    ranks.sort_by_key(|r| r.rank);
    report.virtual_s = ranks.iter().map(|r| r.virtual_ns).fold(0.0, f64::max) / 1e9;
    report.torch = Some(TorchRun {
        command: spec.command.clone(),
        steps: torch_steps(&ranks, peak_flops),
        ranks,
    });
}

/// A collectives job: each scripted collective's calls, bandwidths and wall latencies.
fn collectives(
    report: &mut Report,
    pod: &podsim_topology::Pod,
    script: &[podsim_job::CollectiveStep],
    iterations: u32,
    steps: &[&ChipStepReport],
) {
    let mut hists: BTreeMap<String, Histogram<u64>> = BTreeMap::new();
    for (k, step) in script.iter().enumerate() {
        let mut entry = CollectiveEntry {
            step: k,
            op: step.op.to_string(),
            bytes: step.bytes,
            algo: step.algo.to_string(),
            group: step.group.to_string(),
            group_size: step.group.size(pod),
            calls: Vec::new(),
            virtual_algbw_gbps: 0.0,
            virtual_busbw_gbps: 0.0,
        };
        for it in 0..iterations {
            let mine: Vec<ChipStepReport> = steps
                .iter()
                .filter(|s| s.step == k && s.iteration == it)
                .map(|s| (*s).clone())
                .collect();
            for (wall_s, virtual_s) in iteration_times(&mine) {
                entry.calls.push(CallTimes {
                    iteration: it,
                    wall_s,
                    virtual_s,
                });
                let h = match hists.entry(step.op.to_string()) {
                    Entry::Occupied(o) => o.into_mut(),
                    Entry::Vacant(v) => match Histogram::new(3) {
                        Ok(h) => v.insert(h),
                        Err(_) => continue,
                    },
                };
                h.saturating_record((wall_s * 1e6).round().max(1.0) as u64);
            }
        }
        // The buffer as moved (a whole number of elements), as `podsim bench` reports it.
        let bytes =
            podsim_job::buffer_bytes(step.op, step.count(pod), step.dtype, entry.group_size);
        let n = entry.calls.len().max(1) as f64;
        let mean_virtual_s = entry.calls.iter().map(|c| c.virtual_s).sum::<f64>() / n;
        entry.virtual_algbw_gbps = crate::bench::algbw_gbps(bytes, mean_virtual_s);
        entry.virtual_busbw_gbps =
            entry.virtual_algbw_gbps * step.op.busbw_factor(entry.group_size);
        report.collectives.push(entry);
    }
    for (op, h) in hists {
        report.latency_us.insert(
            op,
            Latency {
                count: h.len(),
                p50: h.value_at_quantile(0.5) as f64,
                p99: h.value_at_quantile(0.99) as f64,
                max: h.max() as f64,
            },
        );
    }
}

/// Samples of one training step over the pod: per data-parallel rank, times ranks, times
/// micro-batches.
pub fn global_batch(pod: &podsim_topology::Pod, spec: &podsim_programs::train::TrainSpec) -> usize {
    let data_parallel = spec
        .plan(pod, false)
        .map_or(1, |plan| plan.data_parallel(&vec![0; plan.mesh.ndim()]).0);
    spec.batch * data_parallel * spec.grad_accum as usize
}

fn training(
    report: &mut Report,
    pod: &podsim_topology::Pod,
    peak_flops: f64,
    spec: &podsim_programs::train::TrainSpec,
    out: &Outcome,
) {
    let mut chips: Vec<&podsim_programs::train::ChipTrainReport> =
        out.reports.iter().flat_map(|r| &r.train).collect();
    chips.sort_by_key(|c| c.chip);
    let steps = train_steps(&chips);
    let walls: Vec<f64> = steps.iter().map(|s| s.wall_ms).collect();
    let median_wall_ms = median(&walls);
    report.virtual_s = steps.iter().map(|s| s.virtual_ms).sum::<f64>() / 1e3;
    training_correctness(report, &chips, adaptive_rounding_bound(spec));
    let global_batch = global_batch(pod, spec);
    let flops_per_step = spec.model.step_flops(global_batch as f64);
    let mut by_time: Vec<&TrainStep> = steps.iter().collect();
    by_time.sort_by(|a, b| a.virtual_ms.total_cmp(&b.virtual_ms));
    let typical = by_time.get(by_time.len() / 2).copied();
    let step_ms = typical.map_or(0.0, |s| s.virtual_ms);
    let pod_flops = f64::from(pod.chips()) * peak_flops;
    report.training = Some(Training {
        strategy: spec.strategy.to_string(),
        eager: spec.eager.name().to_string(),
        model: spec.model.clone(),
        parameters: spec.model.parameters(),
        global_batch,
        flops_per_step,
        step_ms,
        compute_ms: typical.map_or(0.0, |s| s.compute_ms),
        exposed_comm_ms: typical.map_or(0.0, |s| s.exposed_comm_ms),
        hbm_wait_ms: typical.map_or(0.0, |s| s.hbm_wait_ms),
        mfu: if step_ms > 0.0 {
            flops_per_step / (pod_flops * step_ms / 1e3)
        } else {
            0.0
        },
        peak_hbm_bytes: chips.iter().map(|c| c.hbm.peak_bytes).max().unwrap_or(0),
        hbm_capacity_bytes: chips.first().map_or(0, |c| c.hbm.capacity_bytes),
        oom: chips.iter().find_map(|c| c.hbm.oom.clone()),
        steps,
        steps_per_s: if median_wall_ms > 0.0 {
            1e3 / median_wall_ms
        } else {
            0.0
        },
        hbm: chips
            .iter()
            .map(|c| ChipMemory {
                chip: c.chip,
                hbm: c.hbm.clone(),
            })
            .collect(),
    });
}

/// Each training step over every chip: the mean loss, the slowest chip's times. Steps by
/// number: a resumed run reports the steps after its checkpoint.
fn train_steps(chips: &[&podsim_programs::train::ChipTrainReport]) -> Vec<TrainStep> {
    let numbers: std::collections::BTreeSet<u32> = chips
        .iter()
        .flat_map(|c| c.steps.iter().map(|r| r.step))
        .collect();
    numbers
        .into_iter()
        .map(|n| {
            let records: Vec<&podsim_programs::train::StepRecord> = chips
                .iter()
                .filter_map(|c| c.steps.iter().find(|r| r.step == n))
                .collect();
            let losses: Vec<f64> = records.iter().filter_map(|r| r.loss).collect();
            let max = |f: &dyn Fn(&podsim_programs::train::StepRecord) -> f64| {
                records.iter().map(|r| f(r)).fold(0.0, f64::max)
            };
            TrainStep {
                step: n,
                loss: (!losses.is_empty())
                    .then(|| losses.iter().sum::<f64>() / losses.len() as f64),
                virtual_ms: max(&|r| r.virtual_ns) / 1e6,
                compute_ms: max(&|r| r.compute_ns) / 1e6,
                comm_ms: max(&|r| r.comm_ns) / 1e6,
                exposed_comm_ms: max(&|r| r.exposed_ns) / 1e6,
                hbm_wait_ms: max(&|r| r.hbm_wait_ns) / 1e6,
                wall_ms: max(&|r| r.wall_ns as f64) / 1e6,
                host_activations_bytes: records
                    .iter()
                    .map(|r| r.host_activations_bytes)
                    .max()
                    .unwrap_or(0),
            }
        })
        .collect()
}

/// Training's checks of the final parameters: against single-chip training, and replicas
/// bit-identical (a job whose replicas differ has wrong results).
fn training_correctness(
    report: &mut Report,
    chips: &[&podsim_programs::train::ChipTrainReport],
    adaptive_bound: Option<f64>,
) {
    let replicas: Vec<bool> = chips.iter().filter_map(|c| c.replicas_identical).collect();
    report.correctness.replicas_identical =
        (!replicas.is_empty()).then(|| replicas.iter().all(|r| *r));
    report.correctness.max_abs_diff = chips.iter().find_map(|c| c.max_abs_diff);
    report.correctness.max_rel_diff = chips.iter().find_map(|c| c.max_rel_diff);
    report.correctness.rounding_spread = chips.iter().find_map(|c| c.rounding_spread);
    report.correctness.final_params_hash = chips.iter().find_map(|c| c.params_hash.clone());
    let problems: Vec<String> = [
        (report.correctness.replicas_identical == Some(false))
            .then(|| "replicas ended with different parameters".to_string()),
        reference_disagreement(
            report.correctness.max_abs_diff,
            report.correctness.max_rel_diff,
            report.correctness.rounding_spread,
            adaptive_bound,
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !problems.is_empty() {
        report.status = JobStatus::WrongResults;
        report.error = Some(problems.join("; "));
    }
    report.correctness.unverified = unverifiable(
        report.correctness.max_abs_diff,
        report.correctness.max_rel_diff,
        report.correctness.rounding_spread,
        adaptive_bound,
    );
}

/// Why a run within the rounding spread's tolerance but past [`REFERENCE_TOLERANCE`] was not
/// checked (see `Correctness::unverified`).
fn unverifiable(
    abs: Option<f64>,
    rel: Option<f64>,
    spread: Option<f64>,
    adaptive_bound: Option<f64>,
) -> Option<String> {
    let (rel, spread) = (rel?, spread?);
    let verified = rel <= REFERENCE_TOLERANCE
        || adaptive_bound.is_some_and(|bound| abs.is_some_and(|a| a <= bound));
    let within_spread = spread_tolerance(spread).is_some_and(|t| rel <= t);
    (!verified && within_spread).then(|| {
        format!(
            "not checked against single-chip training: its final parameters are {rel:.3e} of their scale from it, and rounding alone moves this run by {spread:.3e} (its updates amplify small differences), so the comparison cannot tell a fault from rounding; a run of fewer steps checks the strategy"
        )
    })
}

/// Why the final parameters do not pass for single-chip training's on the global batch, if
/// they do not: further from it than rounding can take them (see [`REFERENCE_TOLERANCE`] and
/// [`adaptive_rounding_bound`]), or not a number.
fn reference_disagreement(
    abs: Option<f64>,
    rel: Option<f64>,
    spread: Option<f64>,
    adaptive_bound: Option<f64>,
) -> Option<String> {
    let rel = rel?;
    let abs = abs.unwrap_or(f64::NAN);
    let within = |x: f64, bound: f64| x <= bound; // false for NaN
    let tolerance = spread
        .and_then(spread_tolerance)
        .map_or(REFERENCE_TOLERANCE, |t| t.max(REFERENCE_TOLERANCE));
    // Not a number, or infinite, is never rounding (`within` is also false for NaN).
    let rounding = rel.is_finite()
        && (within(rel, tolerance) || adaptive_bound.is_some_and(|bound| within(abs, bound)));
    (!rounding).then(|| {
        let adaptive = adaptive_bound
            .map(|b| format!(", or {b:.3e} absolute under AdamW"))
            .unwrap_or_default();
        let spread = spread
            .map(|s| format!(", {SPREAD_FACTOR}x the {s:.3e} that rounding alone moved it"))
            .unwrap_or_default();
        format!(
            "the final parameters differ from single-chip training on the global batch by {rel:.3e} of their scale (largest absolute difference {abs:.3e}), more than rounding explains (tolerance {tolerance:.3e} relative: at least {REFERENCE_TOLERANCE:e}{spread}{adaptive})"
        )
    })
}

/// The largest relative difference of the final parameters to single-chip training on the
/// global batch that is still rounding under SGD: every strategy and mode lands within 1e-5
/// after 20 steps (`worker/tests/integration/training.rs`); a sharded run sums in another order than one
/// chip, which moves the result by rounding, never by a thousandth of its scale.
pub const REFERENCE_TOLERANCE: f64 = 1e-3;

/// How many times the rounding spread (`Correctness::rounding_spread`: single-chip training
/// against itself started a unit in the last place away) a strategy's run may differ from
/// single-chip training before it is wrong. A strategy sums each step in another order than
/// one chip, moving each sum by a few units in the last place, and a run that amplifies
/// small differences amplifies both alike: the quickstart job's distance is 1.0-1.2 times
/// its spread from 150 to 600 steps. Where the spread is itself of the parameters' order,
/// no comparison can tell a fault from rounding: such a run is reported as not checked.
pub const SPREAD_FACTOR: f64 = 10.0;

/// The tolerance a rounding spread allows, if it is a measure at all: a spread that is not
/// a finite positive number (a reference that overflowed or went NaN) allows nothing.
fn spread_tolerance(spread: f64) -> Option<f64> {
    (spread.is_finite() && spread > 0.0).then_some(SPREAD_FACTOR * spread)
}

/// How far rounding alone can take AdamW's parameters from the reference's over `steps`
/// steps: Adam normalises each element's step by its own gradient's scale, so an element
/// whose gradient is near zero in both runs (where rounding decides its sign) still moves by
/// up to `lr * max(1, (1 - beta1) / sqrt(1 - beta2))` per step (Kingma and Ba's bound on
/// the update), each run its own way. Weight decay only shrinks a difference. `None` for SGD,
/// whose steps scale with the gradient.
pub fn adaptive_rounding_bound(spec: &podsim_programs::train::TrainSpec) -> Option<f64> {
    match spec.optimizer {
        podsim_programs::train::OptimizerSpec::Adamw {
            lr, beta1, beta2, ..
        } => {
            let (lr, beta1, beta2) = (f64::from(lr), f64::from(beta1), f64::from(beta2));
            let per_step = lr * ((1.0 - beta1) / (1.0 - beta2).sqrt()).max(1.0);
            Some(2.0 * f64::from(spec.steps) * per_step)
        }
        podsim_programs::train::OptimizerSpec::Sgd { .. } => None,
    }
}

/// Writes `report.json` into `dir`.
pub fn write(dir: &Path, report: &Report) -> Result<std::path::PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = dir.join("report.json");
    let json = serde_json::to_string_pretty(report).map_err(|e| e.to_string())?;
    crate::outdir::write_atomic(&path, json.as_bytes())
}

/// Reads `path` (a `report.json`) back: the report as this version of podsim writes it.
pub fn read(path: &Path) -> Result<Report, String> {
    let text = crate::outdir::read_text(path, crate::outdir::MOST_OUTPUT_BYTES)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: not a report of podsim {}: {e}",
            path.display(),
            env!("CARGO_PKG_VERSION")
        )
    })
}

/// Writes `report.html` into `dir`, drawn from the report as `report.json` holds it.
pub fn write_html(dir: &Path, report: &Report) -> Result<std::path::PathBuf, String> {
    let value = serde_json::to_value(report).map_err(|e| e.to_string())?;
    let path = dir.join("report.html");
    crate::outdir::write_atomic(&path, crate::html::render_report(&value).as_bytes())
}

/// A few lines for a person.
pub fn summary(report: &Report) -> String {
    let mut s = format!(
        "{} ({} job, {} mode) on {} ({} chips, {}), {} workers: {}\n",
        report.job.name,
        report.job.kind,
        report.job.mode,
        report.topology.shape,
        report.topology.chips,
        report.topology.hardware.name,
        report.workers.len(),
        report.status
    );
    summarise_collectives(&mut s, &report.collectives);
    if let Some(t) = &report.training {
        summarise_training(&mut s, t, &report.correctness);
    }
    if let Some(t) = &report.torch {
        summarise_torch(&mut s, t);
        s.push_str(&representatives_note(t, report.topology.chips));
    }
    if report.job.kind == "train" || report.job.kind == "torch" {
        s.push_str(&format!(
            "  virtual time {:.3} ms; wall {:.2} s\n",
            report.virtual_s * 1e3,
            report.wall_s
        ));
    } else {
        s.push_str(&format!(
            "  checked {} elements, {} wrong; virtual time {:.3} ms; wall {:.2} s\n",
            report.correctness.elements_checked,
            report.correctness.wrong_elements,
            report.virtual_s * 1e3,
            report.wall_s
        ));
    }
    for f in &report.faults_not_fired {
        s.push_str(&format!(
            "  fault {f} never fired: the job ended before its trigger (it tested nothing)\n"
        ));
    }
    for st in &report.stragglers {
        s.push_str(&format!(
            "  straggler: chip {} held its peers up for {:.0} ms ({:.1}x the median chip)\n",
            st.chip, st.waited_on_ms, st.slowdown
        ));
    }
    if let Some(h) = &report.hang {
        let kind = serde_json::to_value(h.kind)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        s.push_str(&format!(
            "  {} detected after {:.0} ms: {}\n  flight recorders: {}\n",
            kind.to_uppercase(),
            h.detected_after_ms,
            h.explanation,
            h.flight_recorders.join(", ")
        ));
    } else if let Some(e) = &report.error {
        s.push_str(&format!("  error: {e}\n"));
    }
    s
}

fn summarise_collectives(s: &mut String, collectives: &[CollectiveEntry]) {
    for c in collectives {
        let n = c.calls.len().max(1) as f64;
        let wall = c.calls.iter().map(|x| x.wall_s).sum::<f64>() / n;
        let virt = c.calls.iter().map(|x| x.virtual_s).sum::<f64>() / n;
        s.push_str(&format!(
            "  #{:<2} {:<15} {:>10} {:<10} group {:<10} wall {:>9.1} us   virtual {:>9.2} us\n",
            c.step,
            c.op,
            crate::units::format_size(c.bytes),
            c.algo,
            c.group,
            wall * 1e6,
            virt * 1e6
        ));
    }
}

fn summarise_training(s: &mut String, t: &Training, c: &Correctness) {
    s.push_str(&format!(
        "  {} ({} mode), {} ({} parameters), global batch {}\n",
        t.strategy, t.eager, t.model, t.parameters, t.global_batch
    ));
    s.push_str("  step      loss   virtual us  (compute     comm  exposed)   wall ms\n");
    for st in &t.steps {
        let loss = st.loss.map_or("-".to_string(), |l| format!("{l:.4}"));
        s.push_str(&format!(
            "  {:>4}  {:>8}  {:>10.2}  ({:>7.2} {:>8.2} {:>8.2})  {:>8.1}\n",
            st.step,
            loss,
            st.virtual_ms * 1e3,
            st.compute_ms * 1e3,
            st.comm_ms * 1e3,
            st.exposed_comm_ms * 1e3,
            st.wall_ms
        ));
    }
    s.push_str(&format!(
        "  step {:.3} ms (compute {:.3}{}, exposed communication {:.3}); MFU {:.1}%\n",
        t.step_ms,
        t.compute_ms,
        hbm_wait_note(t.hbm_wait_ms),
        t.exposed_comm_ms,
        t.mfu * 100.0
    ));
    if let Some(oom) = &t.oom {
        s.push_str(&format!("  does not fit: {oom}\n"));
    }
    let peak = t.peak_hbm_bytes;
    let state = t
        .hbm
        .iter()
        .map(|c| c.hbm.peak_state_bytes)
        .max()
        .unwrap_or(0);
    s.push_str(&format!(
        "  peak HBM per chip {} (parameters + gradients + optimizer {}); {:.1} steps/s wall\n",
        crate::units::format_size(peak),
        crate::units::format_size(state),
        t.steps_per_s
    ));
    if let (Some(abs), Some(rel)) = (c.max_abs_diff, c.max_rel_diff) {
        let spread = c
            .rounding_spread
            .map(|s| format!("; rounding alone moves this run by {s:.3e}"))
            .unwrap_or_default();
        s.push_str(&format!(
            "  vs single-chip training on the global batch: max |diff| {abs:.3e} (relative {rel:.3e}{spread})\n"
        ));
    }
    if let Some(same) = c.replicas_identical {
        s.push_str(&format!("  replicas identical: {same}\n"));
    }
    if let Some(why) = &c.unverified {
        s.push_str(&format!("  {why}\n"));
    }
}

/// How the ranks' step compute was known, when any step was not counted op by op.
fn summarise_counting(s: &mut String, t: &TorchRun) {
    use podsim_programs::StepCounting;
    let states = t
        .ranks
        .iter()
        .flat_map(|r| r.steps.iter().map(|s| s.counting));
    let (mut counted, mut replayed, mut partial) = (0, 0, 0);
    for state in states {
        match state {
            StepCounting::Counted => counted += 1,
            StepCounting::Replayed => replayed += 1,
            StepCounting::Partial => partial += 1,
        }
    }
    if replayed + partial > 0 {
        s.push_str(&format!(
            "  rank steps: {counted} counted op by op, {replayed} replayed from the steady step, {partial} partial (--set job.count=every counts every op)\n"
        ));
    }
}

/// `", X of it waiting for HBM beside communication"` when kernels lost time that way.
fn hbm_wait_note(ms: f64) -> String {
    if ms >= 0.0005 {
        format!(", {ms:.3} of it waiting for HBM beside communication")
    } else {
        String::new()
    }
}

/// The latest virtual end of a collective any chip's flight recorder holds, ns.
fn latest_completed_ns(recorders: &BTreeMap<u32, serde_json::Value>) -> f64 {
    recorders
        .values()
        .filter_map(|dump| dump.as_array())
        .flatten()
        .filter_map(|chip| chip["entries"].as_array())
        .flatten()
        .filter_map(|entry| entry["virtual_end_ns"].as_f64())
        .filter(|ns| ns.is_finite())
        .fold(0.0, f64::max)
}

/// Meta mode with ranks standing for others: which ran. A rank that would have run other
/// code (a branch on its rank) did not, and nothing else tells the user so.
fn representatives_note(t: &TorchRun, chips: u32) -> String {
    let ran: Vec<u32> = t.ranks.iter().map(|r| r.rank).collect();
    if ran.is_empty() || ran.len() as u64 >= u64::from(chips) {
        return String::new();
    }
    let shown: Vec<String> = ran.iter().take(8).map(u32::to_string).collect();
    format!(
        "  ran {} of {chips} ranks ({}{}), each standing for the ranks alike on the torus: code \
         only other ranks run (a branch on the rank) did not run; --verify-ranks N runs N more \
         beside them, --verify-ranks 3,7 those ranks, and checks their calls\n",
        ran.len(),
        shown.join(", "),
        if ran.len() > 8 { ", ..." } else { "" }
    )
}

fn summarise_torch(s: &mut String, t: &TorchRun) {
    s.push_str(&format!("  {}\n", t.command.join(" ")));
    if !t.steps.is_empty() {
        let ms: Vec<f64> = t.steps.iter().map(|s| s.virtual_ms).collect();
        let last = &t.steps[t.steps.len() - 1];
        s.push_str(&format!(
            "  {} steps marked; last step {:.3} ms virtual (compute {:.3}{}, communication {:.3}, exposed {:.3}); median {:.3} ms\n",
            t.steps.len(),
            last.virtual_ms,
            last.compute_ms,
            hbm_wait_note(last.hbm_wait_ms),
            last.comm_ms,
            last.exposed_comm_ms,
            median(&ms)
        ));
        if last.peak_hbm_bytes > 0 {
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            let kinds: Vec<String> = last
                .hbm_by_kind
                .iter()
                .map(|(k, b)| format!("{k} {:.2}", gib(*b)))
                .collect();
            s.push_str(&format!(
                "  peak HBM per chip {:.2} GiB ({}), counted at the dispatcher; MFU {:.1}%, HFU {:.1}%\n",
                gib(last.peak_hbm_bytes),
                kinds.join(", "),
                100.0 * last.mfu,
                100.0 * last.hfu
            ));
        }
    }
    // A rank that made no collective (it failed first) has nothing to list.
    for r in t.ranks.iter().take(1).filter(|r| !r.collectives.is_empty()) {
        let ops: Vec<String> = r
            .collectives
            .iter()
            .map(|c| format!("{} x{} {:.3} ms", c.op, c.calls, c.virtual_ns / 1e6))
            .collect();
        s.push_str(&format!("  rank {}: {}\n", r.rank, ops.join(", ")));
    }
    summarise_counting(s, t);
    let stand_ins: Vec<_> = t.ranks.iter().flat_map(|r| &r.stand_ins).collect();
    if let Some(first) = stand_ins.first() {
        let values: u64 = stand_ins.iter().map(|s| s.2).sum();
        s.push_str(&format!(
            "  meta mode made up {values} values the program asked for, at {} lines (first: {} at {}); report.json lists them\n",
            stand_ins.len(),
            first.0,
            first.1
        ));
    }
}

/// What `--trace` draws of a finished or hung job: the traced chips among `traced`, pod-wide
/// steps, and the diagnosis of a hang.
pub fn trace_input<'a>(
    cfg: &'a JobConfig,
    result: &Result<Outcome, crate::launch::LaunchError>,
    traced: &[u32],
    wall: bool,
) -> crate::trace::TraceInput<'a> {
    let mut input = crate::trace::TraceInput {
        wall,
        pod: Some(&cfg.pod),
        ..Default::default()
    };
    match result {
        Ok(out) => {
            input.chips = out
                .reports
                .iter()
                .flat_map(|r| &r.traces)
                .filter(|t| traced.contains(&t.chip))
                .cloned()
                .collect();
            input.pod_spans = pod_spans(out);
        }
        Err(crate::launch::LaunchError::Hang(h)) => {
            let f = &h.finding;
            input.chips = crate::trace::from_recorders(&h.recorders, traced, f.chip);
            let kind = serde_json::to_value(f.kind)
                .ok()
                .and_then(|v| v.as_str().map(str::to_uppercase))
                .unwrap_or_default();
            input.hang = Some(crate::trace::HangMark {
                title: match f.chip {
                    Some(c) => format!("{kind}: chip {c}"),
                    None => kind,
                },
                explanation: f.explanation.clone(),
                culprit: f.chip,
            });
        }
        Err(_) => {}
    }
    input
}

/// Each step (training) or script iteration of the whole pod: from the first chip in to the
/// last chip out, with every chip's finishing time.
fn pod_spans(out: &Outcome) -> Vec<crate::trace::PodSpan> {
    // (order, name) -> per chip (start, end)
    let mut by_step: BTreeMap<(u64, String), BTreeMap<u32, (f64, f64)>> = BTreeMap::new();
    for r in &out.reports {
        for s in &r.steps {
            for c in &s.calls {
                let e = by_step
                    .entry((u64::from(s.iteration), format!("iteration {}", s.iteration)))
                    .or_default()
                    .entry(s.chip)
                    .or_insert((f64::INFINITY, 0.0));
                e.0 = e.0.min(c.virtual_start_ns);
                e.1 = e.1.max(c.virtual_end_ns);
            }
        }
        for t in &r.train {
            for st in &t.steps {
                by_step
                    .entry((u64::from(st.step), format!("step {}", st.step)))
                    .or_default()
                    .insert(
                        t.chip,
                        (st.virtual_start_ns, st.virtual_start_ns + st.virtual_ns),
                    );
            }
        }
    }
    by_step
        .into_iter()
        .map(|((_, name), chips)| crate::trace::PodSpan {
            name,
            start_ns: chips.values().map(|c| c.0).fold(f64::INFINITY, f64::min),
            end_ns: chips.values().map(|c| c.1).fold(0.0, f64::max),
            chip_ends_ns: chips.values().map(|c| c.1).collect(),
        })
        .collect()
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hangs_virtual_time_is_the_latest_collective_a_recorder_holds() {
        let dump = serde_json::json!([
            {"entries": [{"virtual_end_ns": 7000.0}, {"virtual_end_ns": 14000.0}]},
            {"entries": [{"virtual_end_ns": 9000.0}, {"state": "started"}]},
            {"entries": []}
        ]);
        let recorders = BTreeMap::from([(0, dump), (1, serde_json::json!(null))]);
        assert_eq!(latest_completed_ns(&recorders), 14000.0);
        assert_eq!(latest_completed_ns(&BTreeMap::new()), 0.0);
    }

    #[test]
    fn a_meta_run_of_representative_ranks_says_which_ran() {
        let run = |ranks: &[u32]| TorchRun {
            command: vec!["python".into()],
            steps: Vec::new(),
            ranks: ranks
                .iter()
                .map(|&rank| podsim_programs::RankReport {
                    rank,
                    ..Default::default()
                })
                .collect(),
        };
        let note = representatives_note(&run(&[0]), 16);
        assert!(
            note.contains("ran 1 of 16 ranks (0)") && note.contains("--verify-ranks"),
            "{note}"
        );
        assert_eq!(
            representatives_note(&run(&[0, 1, 2, 3]), 4),
            "",
            "every rank ran"
        );
    }

    #[test]
    fn a_frame_in_a_package_or_the_standard_library_is_not_the_programs() {
        for frame in [
            "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:3472 get_rank",
            "/usr/lib/python3.11/subprocess.py:2004 _try_wait",
            "<frozen importlib._bootstrap>:241 _call_with_frames_removed",
            "/home/me/src/python/podsim/_meta.py:211 _site",
        ] {
            assert!(in_a_package(frame), "{frame}");
        }
        for frame in [
            "<string>:4 <module>",
            "/home/me/train.py:12 main",
            "/home/me/lib/python3.11.py:1 x",
        ] {
            assert!(!in_a_package(frame), "{frame}");
        }
    }

    #[test]
    fn final_parameters_beyond_rounding_or_not_a_number_are_wrong_results() {
        assert_eq!(
            reference_disagreement(None, None, None, None),
            None,
            "unchecked"
        );
        assert_eq!(
            reference_disagreement(Some(1e-6), Some(3e-6), None, None),
            None,
            "rounding"
        );
        for rel in [2e-3, f64::INFINITY, f64::NAN] {
            let why = reference_disagreement(Some(0.5), Some(rel), None, None);
            assert!(
                why.as_deref()
                    .is_some_and(|w| w.contains("single-chip training")),
                "{rel}: {why:?}"
            );
        }
        // AdamW: a small absolute difference of a small parameter is rounding; the exponent
        // flip of a corrupted checkpoint (2.4e37) or a NaN is not.
        assert_eq!(
            reference_disagreement(Some(6e-4), Some(8e-3), None, Some(0.06)),
            None
        );
        assert!(reference_disagreement(Some(2.4e37), Some(1e36), None, Some(0.06)).is_some());
        assert!(reference_disagreement(Some(f64::NAN), Some(f64::NAN), None, Some(0.06)).is_some());
    }

    #[test]
    fn a_run_that_amplifies_rounding_is_unverified_not_wrong_and_a_fault_still_fails() {
        // 600 steps of the quickstart job: 0.22 from single-chip training, 0.19 between it
        // and itself a unit in the last place away.
        assert_eq!(
            reference_disagreement(Some(0.06), Some(0.22), Some(0.19), None),
            None
        );
        let why = unverifiable(Some(0.06), Some(0.22), Some(0.19), None).expect("unverified");
        assert!(why.contains("cannot tell a fault from rounding"), "{why}");
        // A short run stays verified; a difference past 10x the spread is a fault.
        assert_eq!(unverifiable(Some(1e-7), Some(4e-7), Some(4e-7), None), None);
        assert!(reference_disagreement(Some(0.5), Some(0.5), Some(1e-2), None).is_some());
        assert_eq!(unverifiable(Some(0.5), Some(0.5), Some(1e-2), None), None);
        // Not a number, infinite, or against a reference that overflowed, is never rounding.
        for (rel, spread) in [
            (f64::NAN, 0.19),
            (f64::INFINITY, 0.19),
            (0.5, f64::INFINITY),
            (0.5, f64::NAN),
        ] {
            let abs = Some(rel);
            assert!(
                reference_disagreement(abs, Some(rel), Some(spread), None).is_some(),
                "{rel} {spread}"
            );
            assert_eq!(unverifiable(abs, Some(rel), Some(spread), None), None);
        }
        // What AdamW's bound verified is not "not checked".
        assert_eq!(
            unverifiable(Some(6e-4), Some(8e-3), Some(1e-3), Some(0.06)),
            None
        );
    }

    #[test]
    fn adamws_rounding_bound_is_its_largest_step_twice_per_step() {
        let cfg = crate::config::from_text(
            "t",
            "name = \"t\"\n[topology]\nshape = \"2\"\n[job]\nkind = \"train\"\nstrategy = \"ddp\"\nsteps = 10\n[job.model]\nwidths = [4, 4]\n[job.optimizer]\nkind = \"adamw\"\nlr = 0.001\n",
            &[],
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let Program::Train(spec) = &cfg.program else {
            panic!("a train job")
        };
        // beta1 0.9, beta2 0.999: (1 - 0.9) / sqrt(0.001) = 3.16 times lr, twice, ten steps.
        let bound = adaptive_rounding_bound(spec).unwrap_or(0.0);
        assert!(
            (bound - 2.0 * 10.0 * 1e-3 * 0.1 / 0.001f64.sqrt()).abs() < 1e-6,
            "{bound}"
        );
        let mut sgd = spec.clone();
        sgd.optimizer = podsim_programs::train::OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        assert_eq!(adaptive_rounding_bound(&sgd), None);
    }
}
