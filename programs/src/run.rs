//! Running a job's program on a set of chips (all of a pod in one process, or one worker's
//! share of it), counting finished units of work for progress reports.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use podsim_collectives::{Chip, IdleWait, run_chips_waiting};

use crate::bench::bench_chip;
use crate::error::ProgramError;
use crate::job::{BenchCase, ChipStepReport, CollectiveStep, Program, TraceRequest};
use crate::train::{ChipTrainReport, train_chip};

/// The track of a traced chip's steps (script iterations, bench cases, training steps).
pub const STEPS_TRACK: &str = "steps";
/// The track of a traced chip's compute kernels.
pub const COMPUTE_TRACK: &str = "compute";

/// Units of work (one chip finishing one step) a program has for `chips` chips.
pub fn total_units(program: &Program, chips: usize) -> u64 {
    let per_chip = match program {
        Program::Collectives {
            iterations, script, ..
        } => *iterations as usize * script.len(),
        Program::Bench { cases } => cases.len(),
        Program::Train(spec) => spec.steps as usize,
        // Steps are whatever the program marks; its length is not known ahead.
        Program::Torch(_) => 0,
    };
    (per_chip * chips) as u64
}

/// Starts a trace on the requested chips among `chips`.
pub fn enable_traces(chips: &mut [Chip], request: Option<&TraceRequest>) {
    let Some(request) = request else { return };
    for chip in chips {
        if request.chips.contains(&chip.id()) {
            chip.enable_trace(request.flows);
        }
    }
}

/// Runs `program` on every chip (traced chips report their timelines); `done` counts finished units as they happen.
pub async fn run_program(
    chips: Vec<Chip>,
    program: &Program,
    done: Arc<AtomicU64>,
) -> Result<ProgramOutput, ProgramError> {
    run_program_waiting(chips, program, done, None).await
}

/// [`run_program`], with what the chip executor's thread does instead of parking (a
/// worker's: read its links, see `intake`).
pub async fn run_program_waiting(
    chips: Vec<Chip>,
    program: &Program,
    done: Arc<AtomicU64>,
    idle: Option<Arc<dyn IdleWait>>,
) -> Result<ProgramOutput, ProgramError> {
    if let Program::Torch(spec) = program {
        let (torch, traces) = crate::torch::run(chips, spec, done).await?;
        return Ok(ProgramOutput {
            torch,
            traces,
            ..ProgramOutput::default()
        });
    }
    // Each program's future is boxed: a chip task's future is as large as the largest
    // program it could run (the trainer's), which at 100,000 chips was most of the memory.
    let per_chip = run_chips_waiting(
        chips,
        |mut chip| {
            let program = program.clone();
            let done = done.clone();
            async move {
                let mut reports = Vec::new();
                let mut train = None;
                match &program {
                    Program::Collectives {
                        iterations,
                        meta,
                        script,
                        verify,
                    } => {
                        let (meta, verify) = (*meta, *verify);
                        for iteration in 0..*iterations {
                            let iterated =
                                iterate_script(&mut chip, script, iteration, meta, verify);
                            reports.extend(Box::pin(iterated).await?);
                            done.fetch_add(script.len() as u64, Ordering::Relaxed);
                        }
                    }
                    Program::Bench { cases } => {
                        for (step, case) in cases.iter().enumerate() {
                            reports.push(Box::pin(bench_case(&mut chip, step, case)).await?);
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Program::Train(spec) => {
                        train = Some(Box::pin(train_chip(&mut chip, spec, done.clone())).await?);
                    }
                    Program::Torch(_) => {
                        return Err(ProgramError::Internal("torch programs run apart".into()));
                    }
                }
                let stats = chip.stats();
                let sent = (
                    stats.messages_sent.load(Ordering::Relaxed),
                    stats.bytes_sent.load(Ordering::Relaxed),
                );
                let trace = chip.take_trace();
                Ok::<_, ProgramError>((reports, train, sent, trace))
            }
        },
        idle,
    )
    .await?;
    let mut out = ProgramOutput::default();
    for (reports, train, (messages, bytes), trace) in per_chip {
        out.steps.extend(reports);
        out.train.extend(train);
        out.traces.extend(trace);
        out.messages_sent += messages;
        out.bytes_sent += bytes;
    }
    Ok(out)
}

/// One iteration of a collectives script on `chip`: each step's report.
async fn iterate_script(
    chip: &mut Chip,
    script: &[CollectiveStep],
    iteration: u32,
    meta: bool,
    verify: bool,
) -> Result<Vec<ChipStepReport>, ProgramError> {
    chip.enter_step(u64::from(iteration)).await;
    let span = chip.trace_open(
        STEPS_TRACK,
        "step",
        || format!("iteration {iteration}"),
        Vec::new(),
    );
    let mut reports = Vec::with_capacity(script.len());
    for (step, s) in script.iter().enumerate() {
        let mut case = s.case(chip.pod(), meta);
        case.comm.verify = verify;
        let r = bench_chip(chip, &case, false).await?;
        reports.push(ChipStepReport {
            chip: chip.id(),
            step,
            iteration,
            calls: r.calls,
            checked: r.checked,
            wrong: r.wrong,
        });
    }
    chip.trace_close(span);
    Ok(reports)
}

/// Bench case `step` on `chip`: its report.
async fn bench_case(
    chip: &mut Chip,
    step: usize,
    case: &BenchCase,
) -> Result<ChipStepReport, ProgramError> {
    let span = chip.trace_open(
        STEPS_TRACK,
        "step",
        || format!("case {step}: {} of {} elements", case.op, case.count),
        Vec::new(),
    );
    let r = bench_chip(chip, case, true).await?;
    chip.trace_close(span);
    Ok(ChipStepReport {
        chip: chip.id(),
        step,
        iteration: 0,
        calls: r.calls,
        checked: r.checked,
        wrong: r.wrong,
    })
}

/// What the chips of one process did.
#[derive(Debug, Default)]
pub struct ProgramOutput {
    pub steps: Vec<ChipStepReport>,
    pub train: Vec<ChipTrainReport>,
    pub traces: Vec<podsim_collectives::trace::ChipTrace>,
    pub messages_sent: u64,
    pub bytes_sent: u64,
    pub torch: Vec<crate::torch::RankReport>,
}
