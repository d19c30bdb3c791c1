//! The benchmark program a chip runs for `podsim bench` (and for each step of a scripted
//! collectives job): warm-up and timed iterations of one collective, each started together
//! (a barrier over the fabric, untimed) from virtual time zero, then a check of every output
//! element against values computed from the definition of the collective.
//!
//! Inputs are small integers, `value(rank, i) = (i % 1021) + (rank % 4096)`, so every sum any
//! algorithm forms is exact in f32 and the expected output has a closed form per element:
//! a wrong element is a real error, never rounding.

use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use podsim_collectives::{Chip, OpKind, Payload, ReduceOp};
use podsim_topology::Group;
use serde::{Deserialize, Serialize};

use crate::error::ProgramError;
use crate::job::{BenchCase, CallRecord};

/// What one chip measured for one case.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipBench {
    /// Each timed iteration.
    pub calls: Vec<CallRecord>,
    /// Output elements checked (0 in meta mode).
    pub checked: u64,
    /// Output elements that differ from the expected value.
    pub wrong: u64,
}

/// Host wall clock, ns since the Unix epoch: comparable between processes of one host.
pub fn epoch_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Period of the rank term of [`value`].
const RANK_PERIOD: usize = 4096;

fn value(rank: usize, i: usize) -> f32 {
    ((i % 1021) + (rank % RANK_PERIOD)) as f32
}

/// `sum over r < n of (r % RANK_PERIOD)`: whole periods, then the partial one.
fn rank_term_sum(n: usize) -> u64 {
    let triangle = |k: u64| k * k.saturating_sub(1) / 2;
    let period = RANK_PERIOD as u64;
    let n = n as u64;
    (n / period) * triangle(period) + triangle(n % period)
}

/// `max over r < n of (r % RANK_PERIOD)` (0 for no ranks).
fn rank_term_max(n: usize) -> u64 {
    (n.min(RANK_PERIOD) as u64).saturating_sub(1)
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
        // Every chip builds this, so the sums over ranks are closed forms too (summing n terms
        // on each of n chips was quadratic: seconds at 100,000 chips).
        Expected {
            case,
            n,
            rank,
            l,
            keep: c.saturating_sub(rank * l).min(l),
            g_sum: rank_term_sum(n),
            g_max: rank_term_max(n),
        }
    }

    fn len(&self) -> usize {
        let c = self.case.count;
        match self.case.op {
            OpKind::AllReduce | OpKind::Broadcast | OpKind::SendRecv => c,
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
            // The ring shift: the previous member's input.
            OpKind::SendRecv => value((self.rank + self.n - 1) % self.n, i),
        }
    }
}

async fn run_once(
    chip: &mut Chip,
    case: &BenchCase,
    input: &Payload,
) -> Result<Payload, ProgramError> {
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
        OpKind::SendRecv => chip.shift(comm.group, input).await?,
    })
}

/// Runs `case` on this chip. Every iteration starts after a barrier of the whole pod. In a
/// `benchmark` each iteration starts from virtual time zero, and one more barrier ends the
/// timed loop before the result is checked. In a job (one call per iteration of its script)
/// virtual time accumulates from where the chip's clock stood before the barrier (the
/// harness's synchronisation costs no virtual time), and no closing barrier is added: the
/// job's collective numbers, which fault configs count (`at_seq`), stay as they were.
pub async fn bench_chip(
    chip: &mut Chip,
    case: &BenchCase,
    benchmark: bool,
) -> Result<ChipBench, ProgramError> {
    let n = case.comm.group.size(chip.pod()) as usize;
    let rank = case.comm.group.rank_of(chip.pod(), chip.id()) as usize;
    let input = if case.meta {
        Payload::Meta(case.count)
    } else {
        Payload::from_vec(bench_input(rank, case.count))
    };
    // The harness's barrier costs no virtual time, and three messages per chip.
    let everyone = Group::world(chip.pod());
    let mut calls = Vec::with_capacity(case.iters);
    let mut last = None;
    for it in 0..case.warmup + case.iters {
        let before = chip.time_snapshot();
        chip.harness_barrier(everyone).await?;
        if benchmark {
            chip.reset_time();
        } else {
            chip.restore_time(before);
        }
        let virtual_start_ns = chip.clock();
        let wall_start_ns = epoch_ns();
        let sent_before = chip.stats().messages_sent.load(Ordering::Relaxed);
        let out = run_once(chip, case, &input).await?;
        let messages = chip.stats().messages_sent.load(Ordering::Relaxed) - sent_before;
        let wall_end_ns = epoch_ns();
        if it >= case.warmup {
            calls.push(CallRecord {
                wall_start_ns,
                wall_end_ns,
                virtual_start_ns,
                virtual_end_ns: chip.clock(),
                messages,
            });
        }
        last = Some(out);
    }
    // Nobody checks before every chip has finished timing: a chip that checked its result
    // while others were still in the last iteration would take their CPU and lengthen it
    // (several times over, on a machine with fewer cores than workers).
    if benchmark {
        let before = chip.time_snapshot();
        chip.harness_barrier(everyone).await?;
        chip.restore_time(before);
    }
    let (checked, wrong) = match last {
        Some(out) => check(case, n, rank, &out)?,
        None => (0, 0),
    };
    Ok(ChipBench {
        calls,
        checked,
        wrong,
    })
}

fn check(
    case: &BenchCase,
    n: usize,
    rank: usize,
    out: &Payload,
) -> Result<(u64, u64), ProgramError> {
    let want = Expected::new(case, n, rank);
    if out.len() != want.len() {
        return Err(ProgramError::Invalid(format!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_sums_match_the_naive_sums() {
        for n in [1, 2, 7, 4095, 4096, 4097, 10_000, 3 * 4096 + 5] {
            let naive: u64 = (0..n).map(|r| (r % RANK_PERIOD) as u64).sum();
            assert_eq!(rank_term_sum(n), naive, "n = {n}");
            let max = (0..n).map(|r| (r % RANK_PERIOD) as u64).max().unwrap_or(0);
            assert_eq!(rank_term_max(n), max, "n = {n}");
        }
    }
}
