//! The benchmark program a chip runs for `podsim bench`: warm-up and timed iterations of one
//! collective, each started together (host barrier) from virtual time zero, then a check of
//! every output element against values computed from the definition of the collective.
//!
//! Inputs are small integers, `value(rank, i) = (i % 1021) + (rank % 4096)`, so every sum any
//! algorithm forms is exact in f32 and the expected output has a closed form per element:
//! a wrong element is a real error, never rounding.

use std::time::Instant;

use podsim_collectives::{Chip, Comm, Nanos, OpKind, Payload, ReduceOp};
use tokio::sync::Barrier;

use crate::error::WorkerError;

/// One benchmark case (one size).
#[derive(Debug, Clone, Copy)]
pub struct BenchCase {
    pub op: OpKind,
    pub comm: Comm,
    pub reduce: ReduceOp,
    /// Elements in each chip's input buffer.
    pub count: usize,
    pub meta: bool,
    pub warmup: usize,
    pub iters: usize,
    /// Group rank of the broadcast root.
    pub root: u32,
}

/// What one chip measured for one case.
#[derive(Debug, Clone)]
pub struct ChipBench {
    /// Host start and end of each timed iteration.
    pub iterations: Vec<(Instant, Instant)>,
    /// Virtual time of one iteration on this chip, ns.
    pub virtual_ns: Nanos,
    /// Output elements checked (0 in meta mode).
    pub checked: u64,
    /// Output elements that differ from the expected value.
    pub wrong: u64,
}

fn value(rank: usize, i: usize) -> f32 {
    ((i % 1021) + (rank % 4096)) as f32
}

/// The input buffer of the chip with group rank `rank`.
pub fn bench_input(rank: usize, count: usize) -> Vec<f32> {
    (0..count).map(|i| value(rank, i)).collect()
}

/// The expected output of one chip, element by element.
struct Expected<'a> {
    case: &'a BenchCase,
    n: usize,
    rank: usize,
    /// Block length (`torch.chunk`) and this rank's real block length.
    l: usize,
    keep: usize,
    g_sum: u64,
    g_max: u64,
}

impl<'a> Expected<'a> {
    fn new(case: &'a BenchCase, n: usize, rank: usize) -> Expected<'a> {
        let c = case.count;
        let l = c.div_ceil(n.max(1));
        // value(r, j) = f(j) + g(r): the reduction over ranks has a closed form per element,
        // and every partial sum is an integer below 2^24, so f32 sums are exact in any order.
        let g = |r: usize| (r % 4096) as u64;
        Expected {
            case,
            n,
            rank,
            l,
            keep: c.saturating_sub(rank * l).min(l),
            g_sum: (0..n).map(g).sum(),
            g_max: (0..n).map(g).max().unwrap_or(0),
        }
    }

    fn len(&self) -> usize {
        let c = self.case.count;
        match self.case.op {
            OpKind::AllReduce | OpKind::Broadcast => c,
            OpKind::ReduceScatter => self.keep,
            OpKind::AllGather => self.n * c,
            OpKind::AllToAll => self.n * self.keep,
            OpKind::Barrier => 0,
        }
    }

    fn reduced(&self, j: usize) -> f32 {
        let f = (j % 1021) as u64;
        let n = self.n as u64;
        match self.case.reduce {
            ReduceOp::Sum => (n * f + self.g_sum) as f32,
            ReduceOp::Avg => (n * f + self.g_sum) as f32 / self.n as f32,
            ReduceOp::Max => (f + self.g_max) as f32,
            ReduceOp::Min => f as f32,
        }
    }

    fn at(&self, i: usize) -> f32 {
        let c = self.case.count;
        match self.case.op {
            OpKind::AllReduce => self.reduced(i),
            OpKind::ReduceScatter => self.reduced(self.rank * self.l + i),
            OpKind::AllGather => value(i / c, i % c),
            OpKind::Broadcast => value(self.case.root as usize, i),
            OpKind::AllToAll => value(i / self.keep, self.rank * self.l + i % self.keep),
            OpKind::Barrier => 0.0,
        }
    }
}

async fn run_once(
    chip: &mut Chip,
    case: &BenchCase,
    input: &Payload,
) -> Result<Payload, WorkerError> {
    let comm = &case.comm;
    Ok(match case.op {
        OpKind::AllReduce => chip.all_reduce(comm, input, case.reduce).await?,
        OpKind::ReduceScatter => chip.reduce_scatter(comm, input, case.reduce).await?,
        OpKind::AllGather => chip.all_gather(comm, input).await?,
        OpKind::Broadcast => chip.broadcast(comm, input, case.root).await?,
        OpKind::AllToAll => chip.all_to_all(comm, input).await?,
        OpKind::Barrier => {
            chip.barrier(comm).await?;
            input.slice(0, 0)
        }
    })
}

/// Runs `case` on this chip; `sync` is a host barrier shared by all chips of the run.
pub async fn bench_chip(
    chip: &mut Chip,
    case: &BenchCase,
    sync: &Barrier,
) -> Result<ChipBench, WorkerError> {
    let n = case.comm.group.size(chip.pod()) as usize;
    let rank = case.comm.group.rank_of(chip.pod(), chip.id()) as usize;
    let input = if case.meta {
        Payload::Meta(case.count)
    } else {
        Payload::from_vec(bench_input(rank, case.count))
    };
    let mut iterations = Vec::with_capacity(case.iters);
    let mut last = None;
    let mut virtual_ns = 0.0;
    for it in 0..case.warmup + case.iters {
        sync.wait().await;
        chip.reset_time();
        let start = Instant::now();
        let out = run_once(chip, case, &input).await?;
        let end = Instant::now();
        virtual_ns = chip.clock();
        if it >= case.warmup {
            iterations.push((start, end));
        }
        last = Some(out);
    }
    let (checked, wrong) = match last {
        Some(out) => check(case, n, rank, &out)?,
        None => (0, 0),
    };
    Ok(ChipBench {
        iterations,
        virtual_ns,
        checked,
        wrong,
    })
}

fn check(
    case: &BenchCase,
    n: usize,
    rank: usize,
    out: &Payload,
) -> Result<(u64, u64), WorkerError> {
    let want = Expected::new(case, n, rank);
    if out.len() != want.len() {
        return Err(WorkerError::Invalid(format!(
            "{} returned {} elements, expected {}",
            case.op,
            out.len(),
            want.len()
        )));
    }
    let Some(rope) = out.as_rope() else {
        return Ok((0, 0));
    };
    let mut i = 0;
    let mut wrong = 0u64;
    rope.for_each_run(|run| {
        for &x in run {
            if x != want.at(i) {
                wrong += 1;
            }
            i += 1;
        }
    });
    Ok((i as u64, wrong))
}
