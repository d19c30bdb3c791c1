//! `podsim bench`: an nccl-tests style benchmark of one collective over a range of sizes.
//!
//! Each row: the per-chip buffer size as nccl-tests counts it (the whole output buffer for
//! all-gather), element count, mean wall time per iteration, algbw and busbw from wall time,
//! virtual time on the modelled hardware with its algbw and busbw, and the number of wrong
//! output elements (data mode checks every element of every chip).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use clap::Args;
use podsim_collectives::trace::ChipTrace;
use podsim_collectives::{
    Algo, Comm, DType, LocalFabric, OpKind, ReduceOp, Symmetry, mirror_chips,
};
use podsim_job::BenchCase;
use podsim_job::{ChipStepReport, TraceRequest};
use podsim_job::{buffer_bytes, data_mode_buffers, elements_for_buffer};
use podsim_programs::job::{JobSpec, Program, Transport};
use podsim_programs::{enable_traces, run_program};
use podsim_topology::{Group, Hardware, Pod, Torus};
use serde::Serialize;

use crate::launch::{ControlPlane, Launch, Workers, new_token};
use crate::units::{format_size, parse_sizes};

/// Options of `podsim bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Torus shape of one slice: `8`, `4x4`, `4x4x4`...
    #[arg(long, default_value = "2x2x2")]
    pub topology: String,
    /// Number of slices joined by DCN.
    #[arg(long, default_value_t = 1)]
    pub slices: u32,
    /// Turn off wraparound on every axis (lines instead of rings).
    #[arg(long)]
    pub no_wrap: bool,
    /// Hardware preset: v4, v5e, v5p, v6e, tpu7x.
    #[arg(long, default_value = "v5p")]
    pub hardware: String,
    /// all-reduce, all-gather, reduce-scatter, broadcast, all-to-all, barrier, or send-recv
    /// (each chip sends its buffer to the next member of its group: a ring shift).
    #[arg(long, default_value = "all-reduce")]
    pub collective: String,
    /// ring, bidir-ring or torus.
    #[arg(long, default_value = "torus")]
    pub algo: String,
    /// Reduce op for all-reduce and reduce-scatter: sum, avg, max, min.
    #[arg(long, default_value = "sum")]
    pub op: String,
    /// Sizes per chip: `A:B` (powers of two) or a comma list, e.g. `4KiB:256MiB`, `1MiB,16MiB`.
    #[arg(long, default_value = "4KiB:64MiB")]
    pub sizes: String,
    /// `data` moves and checks real f32 values; `meta` moves sizes only.
    #[arg(long, default_value = "data")]
    pub mode: String,
    /// Element type: f32, or bf16 (meta mode only).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Pod axes the collective spans: `world`, or a comma list of x, y, z, dcn.
    #[arg(long, default_value = "world")]
    pub group: String,
    /// Timed iterations per size.
    #[arg(long, default_value_t = 5)]
    pub iters: usize,
    /// Untimed warm-up iterations per size.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Runtime threads (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Run the chips in this many worker processes (default: in this process).
    #[arg(long)]
    pub workers: Option<u32>,
    /// How worker processes reach each other: auto (on one host a Unix socket with large
    /// payloads in shared memory; the default unless PODSIM_TRANSPORT says otherwise), tcp
    /// (records over TCP), uds (the socket carries every byte), shm (shared memory or fail)
    /// or grpc (gRPC over TCP).
    #[arg(long, value_parser = ["auto", "tcp", "uds", "shm", "grpc"])]
    pub transport: Option<String>,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Simulate chip 0 alone on a mirror fabric, standing for every chip: exact for symmetric
    /// collectives on wraparound tori in meta mode, at any scale (along an axis without
    /// wraparound, every position is simulated).
    #[arg(long)]
    pub symmetric: bool,
    #[command(flatten)]
    pub trace: crate::trace::TraceArgs,
}

/// One row of results.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRow {
    pub collective: String,
    pub algo: String,
    pub topology: String,
    pub slices: u32,
    pub hardware: String,
    pub chips: u32,
    pub group_size: u32,
    pub bytes: u64,
    pub count: u64,
    pub mode: String,
    pub iters: usize,
    /// Mean wall time per timed iteration.
    pub wall_s: f64,
    /// Each timed iteration's wall time (first chip's start to last chip's end), in order:
    /// whether the mean is a steady rate or carries a few slow iterations.
    pub iteration_wall_s: Vec<f64>,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub virtual_s: f64,
    pub virtual_algbw_gbps: f64,
    pub virtual_busbw_gbps: f64,
    pub checked: u64,
    pub errors: u64,
    /// Messages the chips sent per iteration (simulated message events), and how many the
    /// emulator moved per second of wall time.
    pub messages: u64,
    pub events_per_s: f64,
}

/// A fully parsed benchmark.
#[derive(Debug, Clone)]
pub struct BenchPlan {
    pub pod: Pod,
    pub hardware: Hardware,
    pub op: OpKind,
    pub comm: Comm,
    pub reduce: ReduceOp,
    pub sizes: Vec<u64>,
    pub meta: bool,
    pub iters: usize,
    pub warmup: usize,
    pub threads: usize,
    pub symmetric: bool,
    /// Chips to trace (`--trace`).
    pub trace: Option<TraceRequest>,
    pub transport: Transport,
}

/// The most timed (or warm-up) iterations a size takes.
const MOST_ITERATIONS: usize = 1_000_000;
/// The most runtime threads.
const MOST_THREADS: usize = 1024;

/// Refuses a benchmark this host cannot hold (memory `available`): in data mode its buffers,
/// in meta mode its chips simulated one by one (not `--symmetric`).
fn fits_on_host(plan: &BenchPlan, available: Option<u64>) -> Result<(), String> {
    if !plan.meta {
        return data_mode_fits(plan, available);
    }
    match available.filter(|_| !plan.symmetric) {
        Some(a) => crate::config::meta_mode_problem(plan.pod.chips(), a)
            .map_or(Ok(()), |why| Err(format!("--topology: {why}"))),
        None => Ok(()),
    }
}

/// Refuses a data-mode benchmark whose buffers cannot fit in the memory `available` on this
/// host (unknown: nothing checked): every chip holds the largest size's input and output
/// (`podsim_job::data_mode_buffers`, as a config's check counts them). It aborted, out of
/// memory, instead.
fn data_mode_fits(plan: &BenchPlan, available: Option<u64>) -> Result<(), String> {
    let (Some(available), Some(&largest)) = (available, plan.sizes.iter().max()) else {
        return Ok(());
    };
    let n = plan.comm.group.size(&plan.pod);
    let per_chip = data_mode_buffers(plan.op, plan.count(largest), plan.comm.dtype, n);
    let needed = per_chip * u128::from(plan.pod.chips());
    if needed <= u128::from(available) {
        return Ok(());
    }
    let gib = |b: u128| b as f64 / f64::from(1u32 << 30);
    Err(format!(
        "--sizes: data mode holds {} chips x {:.2} GiB of buffers at {largest} bytes, {:.1} GiB, \
         more than this host's {:.1} GiB available: use --mode meta (sizes only) or smaller sizes",
        plan.pod.chips(),
        gib(per_chip),
        gib(needed),
        gib(u128::from(available))
    ))
}

impl BenchPlan {
    /// Validates the arguments; every problem is a message naming the flag.
    pub fn from_args(a: &BenchArgs) -> Result<BenchPlan, String> {
        let torus: Torus = a.topology.parse().map_err(|e| format!("--topology: {e}"))?;
        let torus = torus.set_wrap_all(!a.no_wrap);
        let pod = Pod::new(torus, a.slices).map_err(|e| format!("--slices: {e}"))?;
        let hardware = Hardware::preset(&a.hardware).map_err(|e| format!("--hardware: {e}"))?;
        let op: OpKind = a
            .collective
            .parse()
            .map_err(|e| format!("--collective: {e}"))?;
        let algo: Algo = a.algo.parse().map_err(|e| format!("--algo: {e}"))?;
        let reduce: ReduceOp = a.op.parse().map_err(|e| format!("--op: {e}"))?;
        let sizes = parse_sizes(&a.sizes).map_err(|e| format!("--sizes: {e}"))?;
        let meta = match a.mode.as_str() {
            "data" => false,
            "meta" => true,
            other => return Err(format!("--mode: {other:?} is not data or meta")),
        };
        let dtype: DType = a.dtype.parse().map_err(|e| format!("--dtype: {e}"))?;
        if dtype == DType::Bf16 && !meta {
            return Err("--dtype bf16 needs --mode meta (data mode moves f32)".into());
        }
        let group = Group::parse(&a.group, &pod).map_err(|e| format!("--group: {e}"))?;
        // Bounds far past any use, below what would overflow a count or exhaust the host
        // (an iteration count is allocated for; every runtime thread has its stack).
        if !(1..=MOST_ITERATIONS).contains(&a.iters) {
            return Err(format!("--iters must be 1 to {MOST_ITERATIONS}"));
        }
        if a.warmup > MOST_ITERATIONS {
            return Err(format!("--warmup must be 0 to {MOST_ITERATIONS}"));
        }
        let threads = a
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        if !(1..=MOST_THREADS).contains(&threads) {
            return Err(format!("--threads must be 1 to {MOST_THREADS}"));
        }
        let comm = Comm {
            group,
            algo,
            dtype,
            verify: false,
            instance: 0,
        };
        if a.symmetric {
            let mut why = podsim_collectives::symmetry_obstacles(meta, [op]);
            if a.workers.is_some() {
                why.push("the mirror fabric runs in one process: no --workers".into());
            }
            if !why.is_empty() {
                return Err(format!("--symmetric: {}", why.join("; ")));
            }
        }
        let trace_chips = a.trace.resolve(pod.chips())?;
        let plan = BenchPlan {
            pod,
            hardware,
            op,
            comm,
            reduce,
            sizes,
            meta,
            iters: a.iters,
            warmup: a.warmup,
            threads,
            symmetric: a.symmetric,
            trace: (!trace_chips.is_empty()).then_some(TraceRequest {
                chips: trace_chips,
                flows: a.trace.trace_flows,
            }),
            transport: Transport::choose(a.transport.as_deref(), "--transport")?,
        };
        fits_on_host(&plan, crate::config::host_available_memory())?;
        Ok(plan)
    }

    /// One size of one collective in meta mode, in this process, one iteration on the mirror
    /// fabric (what `podsim compare` runs for a row of published collective timings).
    pub fn meta_in_process(
        pod: Pod,
        hardware: Hardware,
        op: OpKind,
        comm: Comm,
        reduce: ReduceOp,
        size: u64,
    ) -> BenchPlan {
        BenchPlan {
            pod,
            hardware,
            op,
            comm,
            reduce,
            sizes: vec![size],
            meta: true,
            iters: 1,
            warmup: 0,
            threads: 1,
            symmetric: true,
            trace: None,
            transport: Transport::Auto,
        }
    }

    /// Elements per chip input buffer for a row of `bytes` (nccl-tests convention).
    fn count(&self, bytes: u64) -> usize {
        let n = self.comm.group.size(&self.pod);
        elements_for_buffer(self.op, bytes, self.comm.dtype, n)
    }

    /// The buffer size a row reports for `count` elements.
    fn reported_bytes(&self, count: usize) -> u64 {
        buffer_bytes(
            self.op,
            count,
            self.comm.dtype,
            self.comm.group.size(&self.pod),
        )
    }

    fn case(&self, size: u64) -> BenchCase {
        BenchCase {
            op: self.op,
            comm: self.comm,
            reduce: self.reduce,
            count: self.count(size),
            meta: self.meta,
            warmup: self.warmup,
            iters: self.iters,
            root: 0,
        }
    }

    /// The benchmark as a job for worker processes.
    pub fn spec(&self, workers: u32) -> JobSpec {
        let (heartbeat_ms, watchdog_ms) =
            podsim_job::watchdog_defaults(self.pod.chips().div_ceil(workers.max(1)));
        JobSpec {
            name: format!("bench-{}", self.op),
            pod: self.pod.clone(),
            hardware: self.hardware.clone(),
            workers,
            program: Program::Bench {
                cases: self.sizes.iter().map(|&s| self.case(s)).collect(),
            },
            faults: Vec::new(),
            heartbeat_ms,
            recorder_entries: podsim_collectives::DEFAULT_RECORDER_ENTRIES,
            watchdog_ms,
            busy_ms: podsim_job::DEFAULT_BUSY_MS,
            symmetric: false,
            trace: self.trace.clone(),
            transport: self.transport,
        }
    }
}

/// Rows of a benchmark, and the timelines of its traced chips.
pub type BenchResult = (Vec<BenchRow>, Vec<ChipTrace>);

/// Runs every size of the plan in this process; `on_row` sees each row as it completes.
/// Each size runs on fresh chips: their traces are laid one after another in virtual time.
pub fn run_in_process(
    plan: &BenchPlan,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<BenchResult, String> {
    let rt = runtime(plan.threads)?;
    // One chip on a mirror fabric needs no fabric of all chips.
    let fabric =
        (!plan.symmetric).then(|| LocalFabric::new(plan.pod.clone(), plan.hardware.clone()));
    let mut rows = Vec::new();
    let mut traces: Vec<ChipTrace> = Vec::new();
    let mut offset_ns = 0.0;
    for &size in &plan.sizes {
        let program = Program::Bench {
            cases: vec![plan.case(size)],
        };
        let mut chips = match &fabric {
            Some(fabric) => fabric.chips(),
            None => {
                let symmetry = Symmetry::of_torus(&plan.pod);
                mirror_chips(plan.pod.clone(), plan.hardware.clone(), &symmetry)
            }
        };
        enable_traces(&mut chips, plan.trace.as_ref());
        let out = rt
            .block_on(run_program(chips, &program, Arc::new(AtomicU64::new(0))))
            .map_err(|e| format!("{} of {}: {e}", plan.op, format_size(size)))?;
        let row = make_row(plan, size, &out.steps);
        on_row(&row);
        rows.push(row);
        let end = out
            .traces
            .iter()
            .flat_map(|t| t.spans.iter().filter_map(|s| s.virtual_end_ns))
            .fold(0.0, f64::max);
        for mut t in out.traces {
            crate::trace::shift(&mut t, offset_ns);
            match traces.iter_mut().find(|o| o.chip == t.chip) {
                Some(o) => {
                    o.spans.extend(t.spans);
                    o.counters.extend(t.counters);
                    o.link_busy.extend(t.link_busy);
                    o.messages.extend(t.messages);
                    o.left_out += t.left_out;
                }
                None => traces.push(t),
            }
        }
        offset_ns += end;
    }
    Ok((rows, traces))
}

fn runtime(threads: usize) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))
}

/// Runs every size across `workers` worker processes on loopback.
pub fn run_on_workers(
    plan: &BenchPlan,
    workers: u32,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<BenchResult, String> {
    let rt = runtime(plan.threads)?;
    let spec = plan.spec(workers);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the podsim binary: {e}"))?;
    let outcome = rt
        .block_on(async {
            let mut control = ControlPlane::start("127.0.0.1:0", new_token(), None).await?;
            let workers = Workers::Spawn {
                exe,
                log_dir: None,
                restart: None,
            };
            Launch::new(&spec, workers).run(&mut control).await
        })
        .map_err(|e| e.to_string())?;
    let traces: Vec<ChipTrace> = outcome
        .reports
        .iter()
        .flat_map(|r| r.traces.iter().cloned())
        .collect();
    let steps: Vec<ChipStepReport> = outcome.reports.into_iter().flat_map(|r| r.steps).collect();
    let mut rows = Vec::new();
    for (k, &size) in plan.sizes.iter().enumerate() {
        let mine: Vec<ChipStepReport> = steps.iter().filter(|s| s.step == k).cloned().collect();
        let row = make_row(plan, size, &mine);
        on_row(&row);
        rows.push(row);
    }
    Ok((rows, traces))
}

/// Per-iteration wall time (first start to last end over all chips) and virtual time.
pub fn iteration_times(steps: &[ChipStepReport]) -> Vec<(f64, f64)> {
    let iters = steps.iter().map(|s| s.calls.len()).max().unwrap_or(0);
    (0..iters)
        .map(|i| {
            let calls = steps.iter().filter_map(|s| s.calls.get(i));
            let (mut w0, mut w1, mut v0, mut v1) = (u64::MAX, 0u64, f64::MAX, 0f64);
            for c in calls {
                w0 = w0.min(c.wall_start_ns);
                w1 = w1.max(c.wall_end_ns);
                v0 = v0.min(c.virtual_start_ns);
                v1 = v1.max(c.virtual_end_ns);
            }
            (w1.saturating_sub(w0) as f64 / 1e9, (v1 - v0).max(0.0) / 1e9)
        })
        .collect()
}

/// nccl-tests' algbw: a chip's buffer of `bytes` per `secs`, in GB/s (0 when no time passed).
/// busbw is this times [`OpKind::busbw_factor`] of the group size.
pub fn algbw_gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

fn make_row(plan: &BenchPlan, size: u64, steps: &[ChipStepReport]) -> BenchRow {
    let count = plan.count(size);
    let bytes = plan.reported_bytes(count);
    let n = plan.comm.group.size(&plan.pod);
    let factor = plan.op.busbw_factor(n);
    let times = iteration_times(steps);
    let k = times.len().max(1) as f64;
    let messages = (steps
        .iter()
        .flat_map(|s| &s.calls)
        .map(|c| c.messages)
        .sum::<u64>() as f64
        / k) as u64;
    let wall_s = times.iter().map(|t| t.0).sum::<f64>() / k;
    let virtual_s = times.iter().map(|t| t.1).fold(0.0, f64::max);
    let gbps = |secs: f64| algbw_gbps(bytes, secs);
    BenchRow {
        collective: plan.op.name().to_string(),
        algo: plan.comm.algo.name().to_string(),
        topology: plan.pod.torus().to_string(),
        slices: plan.pod.slices(),
        hardware: plan.hardware.name.clone(),
        chips: plan.pod.chips(),
        group_size: n,
        bytes,
        count: count as u64,
        mode: if plan.meta { "meta" } else { "data" }.to_string(),
        iters: plan.iters,
        wall_s,
        iteration_wall_s: times.iter().map(|t| t.0).collect(),
        algbw_gbps: gbps(wall_s),
        busbw_gbps: gbps(wall_s) * factor,
        virtual_s,
        virtual_algbw_gbps: gbps(virtual_s),
        virtual_busbw_gbps: gbps(virtual_s) * factor,
        checked: steps.iter().map(|r| r.checked).sum(),
        errors: steps.iter().map(|r| r.wrong).sum(),
        messages,
        events_per_s: if wall_s > 0.0 {
            messages as f64 / wall_s
        } else {
            0.0
        },
    }
}

/// The table header, nccl-tests style.
pub fn table_header(plan: &BenchPlan) -> String {
    let torus = plan.pod.torus();
    let wrap = if torus.wrap().iter().all(|&w| w) {
        ""
    } else {
        " (no wraparound)"
    };
    format!(
        "# podsim bench: {} {} on {}{wrap}, {} chips, group of {}, {} {}, {} mode, {} iters\n\
         #\n\
         # {:>10} {:>12} {:>11} {:>9} {:>9} {:>11} {:>9} {:>9} {:>8}\n\
         # {:>10} {:>12} {:>11} {:>9} {:>9} {:>11} {:>9} {:>9} {:>8}",
        plan.op,
        plan.comm.algo,
        plan.pod,
        plan.pod.chips(),
        plan.comm.group.size(&plan.pod),
        plan.hardware.name,
        plan.comm.dtype.name(),
        if plan.meta { "meta" } else { "data" },
        plan.iters,
        "size",
        "count",
        "wall",
        "algbw",
        "busbw",
        "virtual",
        "v.algbw",
        "v.busbw",
        "errors",
        "",
        "(elements)",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "(us)",
        "(GB/s)",
        "(GB/s)",
        "",
    )
}

pub fn table_row(r: &BenchRow) -> String {
    let errors = if r.mode == "meta" {
        "n/a".to_string()
    } else {
        r.errors.to_string()
    };
    format!(
        "  {:>10} {:>12} {:>11.1} {:>9.3} {:>9.3} {:>11.2} {:>9.2} {:>9.2} {:>8}",
        format_size(r.bytes),
        r.count,
        r.wall_s * 1e6,
        r.algbw_gbps,
        r.busbw_gbps,
        r.virtual_s * 1e6,
        r.virtual_algbw_gbps,
        r.virtual_busbw_gbps,
        errors
    )
}

/// Runs `podsim bench`; returns whether every element was right.
pub fn main(args: &BenchArgs) -> Result<crate::JobStatus, crate::CliError> {
    let plan = BenchPlan::from_args(args).map_err(crate::CliError::Usage)?;
    let started = Instant::now();
    if !args.json {
        println!("{}", table_header(&plan));
    }
    let print = |row: &BenchRow| {
        if args.json {
            match serde_json::to_string(row) {
                Ok(line) => println!("{line}"),
                Err(e) => eprintln!("cannot encode row: {e}"),
            }
        } else {
            println!("{}", table_row(row));
        }
    };
    let (rows, traces) = match args.workers {
        None => run_in_process(&plan, print),
        Some(w) => {
            podsim_topology::Placement::new(&plan.pod, w)
                .map_err(|e| crate::CliError::Usage(format!("--workers: {e}")))?;
            run_on_workers(&plan, w, print)
        }
    }
    .map_err(crate::CliError::Job)?;
    let errors: u64 = rows.iter().map(|r| r.errors).sum();
    if let Some(file) = &args.trace.trace {
        let input = crate::trace::TraceInput {
            chips: traces,
            wall: args.trace.trace_wall,
            pod: Some(&plan.pod),
            ..Default::default()
        };
        let size = crate::trace::write(file, &crate::trace::build(&input))
            .map_err(crate::CliError::Job)?;
        eprintln!(
            "trace: {} ({}, {} chips)",
            file.display(),
            format_size(size),
            input.chips.len()
        );
    }
    if !args.json {
        for r in &rows {
            println!(
                "# {}: {} message events per iteration, {:.2} million events/s",
                format_size(r.bytes),
                r.messages,
                r.events_per_s / 1e6
            );
        }
        println!(
            "# {} wrong elements of {} checked; {:.2} s wall",
            errors,
            rows.iter().map(|r| r.checked).sum::<u64>(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(if errors == 0 {
        crate::JobStatus::Ok
    } else {
        crate::JobStatus::WrongResults
    })
}
