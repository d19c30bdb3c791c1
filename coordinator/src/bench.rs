//! `podsim bench`: an nccl-tests style benchmark of one collective over a range of sizes.
//!
//! Each row: the per-chip buffer size as nccl-tests counts it (the whole output buffer for
//! all-gather), element count, mean wall time per iteration, algbw and busbw from wall time,
//! virtual time on the modelled hardware with its algbw and busbw, and the number of wrong
//! output elements (data mode checks every element of every chip).

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use podsim_collectives::{Algo, Comm, DType, LocalFabric, OpKind, ReduceOp, run_chips};
use podsim_topology::{Group, Hardware, Pod, PodAxis, Torus};
use podsim_worker::bench::{BenchCase, bench_chip};
use serde::Serialize;
use tokio::sync::Barrier;

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
    /// Hardware preset: v4, v5e, v5p, v6e.
    #[arg(long, default_value = "v5p")]
    pub hardware: String,
    /// all-reduce, all-gather, reduce-scatter, broadcast, all-to-all or barrier.
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
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    pub json: bool,
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
    pub wall_s: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub virtual_s: f64,
    pub virtual_algbw_gbps: f64,
    pub virtual_busbw_gbps: f64,
    pub checked: u64,
    pub errors: u64,
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
}

fn parse_group(text: &str, pod: &Pod) -> Result<Group, String> {
    if text == "world" {
        return Ok(Group::world(pod));
    }
    let mut axes = Vec::new();
    for name in text.split(',') {
        let axis = match name.trim() {
            "x" => PodAxis::Torus(0),
            "y" => PodAxis::Torus(1),
            "z" => PodAxis::Torus(2),
            "dcn" => PodAxis::Slices,
            other => {
                return Err(format!(
                    "--group: unknown axis {other:?} (use world or x, y, z, dcn)"
                ));
            }
        };
        if let PodAxis::Torus(a) = axis
            && usize::from(a) >= pod.torus().ndims()
        {
            return Err(format!(
                "--group: the torus {} has no axis {name}",
                pod.torus()
            ));
        }
        axes.push(axis);
    }
    Ok(Group::of(&axes))
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
        let dtype = match a.dtype.as_str() {
            "f32" => DType::F32,
            "bf16" if meta => DType::Bf16,
            "bf16" => return Err("--dtype bf16 needs --mode meta (data mode moves f32)".into()),
            other => return Err(format!("--dtype: {other:?} is not f32 or bf16")),
        };
        let group = parse_group(&a.group, &pod)?;
        if a.iters == 0 {
            return Err("--iters must be at least 1".into());
        }
        let threads = a
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
        if threads == 0 {
            return Err("--threads must be at least 1".into());
        }
        let comm = Comm { group, algo, dtype };
        Ok(BenchPlan {
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
        })
    }

    /// Elements per chip input buffer for a row of `bytes` (nccl-tests convention).
    fn count(&self, bytes: u64) -> usize {
        let elem = self.comm.dtype.size() as u64;
        let n = u64::from(self.comm.group.size(&self.pod));
        let count = match self.op {
            OpKind::AllGather => bytes / elem / n,
            _ => bytes / elem,
        };
        count.max(1) as usize
    }

    /// The buffer size a row reports for `count` elements.
    fn reported_bytes(&self, count: usize) -> u64 {
        let elem = self.comm.dtype.size() as u64;
        let n = u64::from(self.comm.group.size(&self.pod));
        match self.op {
            OpKind::AllGather => count as u64 * elem * n,
            _ => count as u64 * elem,
        }
    }
}

/// Runs every size of the plan in this process; `on_row` sees each row as it completes.
pub fn run_in_process(
    plan: &BenchPlan,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>, String> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(plan.threads)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let fabric = LocalFabric::new(plan.pod.clone(), plan.hardware.clone());
    let mut rows = Vec::new();
    for &size in &plan.sizes {
        let count = plan.count(size);
        let case = BenchCase {
            op: plan.op,
            comm: plan.comm,
            reduce: plan.reduce,
            count,
            meta: plan.meta,
            warmup: plan.warmup,
            iters: plan.iters,
            root: 0,
        };
        let sync = Arc::new(Barrier::new(plan.pod.chips() as usize));
        let results = rt
            .block_on(run_chips(fabric.chips(), |mut chip| {
                let sync = sync.clone();
                async move {
                    bench_chip(&mut chip, &case, &sync)
                        .await
                        .map_err(|e| match e {
                            podsim_worker::WorkerError::Collective(c) => c,
                            other => {
                                podsim_collectives::CollectiveError::Internal(other.to_string())
                            }
                        })
                }
            }))
            .map_err(|e| format!("{} of {}: {e}", plan.op, format_size(size)))?;
        let mut wall = Duration::ZERO;
        for it in 0..plan.iters {
            let start = results.iter().map(|r| r.iterations[it].0).min();
            let end = results.iter().map(|r| r.iterations[it].1).max();
            if let (Some(s), Some(e)) = (start, end) {
                wall += e.duration_since(s);
            }
        }
        let row = make_row(
            plan,
            count,
            wall.as_secs_f64() / plan.iters as f64,
            &results,
        );
        on_row(&row);
        rows.push(row);
    }
    Ok(rows)
}

fn make_row(
    plan: &BenchPlan,
    count: usize,
    wall_s: f64,
    results: &[podsim_worker::bench::ChipBench],
) -> BenchRow {
    let bytes = plan.reported_bytes(count);
    let n = plan.comm.group.size(&plan.pod);
    let factor = plan.op.busbw_factor(n);
    let virtual_s = results.iter().map(|r| r.virtual_ns).fold(0.0, f64::max) / 1e9;
    let gbps = |secs: f64| {
        if secs > 0.0 {
            bytes as f64 / secs / 1e9
        } else {
            0.0
        }
    };
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
        algbw_gbps: gbps(wall_s),
        busbw_gbps: gbps(wall_s) * factor,
        virtual_s,
        virtual_algbw_gbps: gbps(virtual_s),
        virtual_busbw_gbps: gbps(virtual_s) * factor,
        checked: results.iter().map(|r| r.checked).sum(),
        errors: results.iter().map(|r| r.wrong).sum(),
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
pub fn main(args: &BenchArgs) -> Result<bool, crate::CliError> {
    let plan = BenchPlan::from_args(args).map_err(crate::CliError::Usage)?;
    let started = Instant::now();
    if !args.json {
        println!("{}", table_header(&plan));
    }
    let rows = run_in_process(&plan, |row| {
        if args.json {
            match serde_json::to_string(row) {
                Ok(line) => println!("{line}"),
                Err(e) => eprintln!("cannot encode row: {e}"),
            }
        } else {
            println!("{}", table_row(row));
        }
    })
    .map_err(crate::CliError::Job)?;
    let errors: u64 = rows.iter().map(|r| r.errors).sum();
    if !args.json {
        println!(
            "# {} wrong elements of {} checked; {:.2} s wall",
            errors,
            rows.iter().map(|r| r.checked).sum::<u64>(),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(errors == 0)
}
