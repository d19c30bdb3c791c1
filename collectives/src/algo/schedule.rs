//! Whole collectives as sequences of phases over the group's axes.
//!
//! Buffers of `N` blocks (one per group rank, each `L` elements) are kept in canonical order
//! over the axes not yet processed (axis x fastest). Reduce-scatter along an axis picks out the
//! blocks bound for each position with an interleaved split (no copy); all-gather puts them
//! back with the inverse merge. With the `torus` algorithm, each block is cut into one part per
//! ICI axis and part `j` visits the axes starting at axis `j`, so every axis carries one part
//! at any time.

use std::collections::BTreeMap;
use std::future::Future;

use futures_util::future::try_join_all;
use podsim_topology::{Group, PodAxis};

use super::phase::{self, PhaseId};
use super::{Algo, AxisPath, PhaseKind};
use crate::chip::{Call, Nanos};
use crate::error::CollectiveError;
use crate::payload::Payload;
use crate::reduce::ReduceOp;
use crate::trace::Arg;

/// One part of a collective in progress on this chip.
#[derive(Debug)]
struct PartState {
    /// Elements of each block that belong to this part.
    len: usize,
    buf: Payload,
    clock: Nanos,
    /// Reduce-scatter: axes not yet reduced; all-gather: axes gathered so far (canonical).
    axes: Vec<usize>,
}

/// The group's axes as one chip sees them, and how its buffer is cut into parts.
#[derive(Debug, Clone)]
pub(crate) struct Schedule {
    /// Axes with more than one chip, canonical order (x, y, z, dcn).
    pub axes: Vec<AxisPath>,
    pub algo: Algo,
    /// Reduce-scatter axis order of each part (indices into `axes`).
    orders: Vec<Vec<usize>>,
}

impl Schedule {
    pub fn new(call: &Call<'_>, group: Group, algo: Algo) -> Schedule {
        let pod = call.pod();
        let me = call.me();
        let axes: Vec<AxisPath> = group
            .parts(pod)
            .into_iter()
            .map(|part| AxisPath {
                axis: part.axis,
                n: part.extent as usize,
                pos: part.position(pod, me) as usize,
                wrap: part.wraps(pod),
                hops: part.stride,
            })
            .collect();
        let ici: Vec<usize> = (0..axes.len())
            .filter(|&i| axes[i].axis != PodAxis::Slices)
            .collect();
        let dcn: Vec<usize> = (0..axes.len())
            .filter(|&i| axes[i].axis == PodAxis::Slices)
            .collect();
        let parts = if algo == Algo::Torus {
            ici.len().max(1)
        } else {
            1
        };
        let orders = (0..parts)
            .map(|j| {
                let mut order: Vec<usize> =
                    (0..ici.len()).map(|k| ici[(j + k) % ici.len()]).collect();
                order.extend(&dcn);
                order
            })
            .collect();
        Schedule { axes, algo, orders }
    }

    /// Chips in the group.
    pub fn size(&self) -> usize {
        self.axes.iter().map(|a| a.n).product()
    }

    /// This chip's rank in the group.
    pub fn rank(&self) -> usize {
        self.axes.iter().rev().fold(0, |acc, a| acc * a.n + a.pos)
    }

    /// Phases one reduce-scatter (or all-gather) takes; tags of a following all-gather start here.
    pub fn phases(&self) -> u16 {
        self.axes.len() as u16
    }

    /// Element ranges (offset, len) of the parts of an `l`-element block; empty parts are skipped.
    fn parts(&self, l: usize) -> Vec<(usize, usize, usize)> {
        let p = self.orders.len();
        let mut off = 0;
        let mut out = Vec::new();
        for j in 0..p {
            let len = l / p + usize::from(j < l % p);
            if len > 0 {
                out.push((j, off, len));
            }
            off += len;
        }
        out
    }

    fn kind(&self, axis: usize) -> PhaseKind {
        PhaseKind::of(&self.axes[axis], self.algo)
    }

    /// Blocks per element-chunk when splitting `remaining` (canonical) along `axis`.
    fn stride(&self, remaining: &[usize], axis: usize) -> usize {
        remaining
            .iter()
            .take_while(|&&a| a != axis)
            .map(|&a| self.axes[a].n)
            .product()
    }

    /// Runs phase `k` of every part. Parts whose phase `k` is on different axes run
    /// concurrently; parts on the same axis (the shared DCN egress) run one after another in
    /// part order. No two concurrent lanes ever share a link, so each link's traffic is issued
    /// in an order fixed by the program, never by host scheduling: virtual time is
    /// deterministic.
    async fn phase_of_parts<S, F, Fut>(
        &self,
        axis_of: impl Fn(usize) -> usize,
        states: Vec<(usize, S)>,
        run: F,
    ) -> Result<Vec<(usize, S)>, CollectiveError>
    where
        F: Fn(usize, usize, S) -> Fut,
        Fut: Future<Output = Result<S, CollectiveError>>,
    {
        let mut by_axis: BTreeMap<usize, Vec<(usize, S)>> = BTreeMap::new();
        for (j, st) in states {
            by_axis.entry(axis_of(j)).or_default().push((j, st));
        }
        let run = &run;
        let buckets = by_axis.into_iter().map(|(axis, members)| async move {
            let mut done = Vec::with_capacity(members.len());
            for (j, st) in members {
                done.push((j, run(j, axis, st).await?));
            }
            Ok::<_, CollectiveError>(done)
        });
        let mut out: Vec<(usize, S)> = try_join_all(buckets).await?.into_iter().flatten().collect();
        out.sort_by_key(|(j, _)| *j);
        Ok(out)
    }

    /// Reduce-scatter of `buf` (`N` blocks of `l`, canonical group-rank order): returns this
    /// chip's block reduced over the group.
    pub async fn reduce_scatter(
        &self,
        call: Call<'_>,
        buf: &Payload,
        l: usize,
        op: ReduceOp,
        phase0: u16,
        t0: Nanos,
    ) -> Result<(Payload, Nanos), CollectiveError> {
        let parts = self.parts(l);
        if parts.is_empty() {
            return Ok((buf.slice(0, 0), t0));
        }
        let all: Vec<usize> = (0..self.axes.len()).collect();
        let mut states = split_parts(&parts, buf, l, t0, &all);
        for k in 0..self.axes.len() {
            states = self
                .phase_of_parts(
                    |j| self.orders[j][k],
                    states,
                    |j, a, mut st: PartState| async move {
                        let chunk = self.stride(&st.axes, a) * st.len;
                        let groups = st.buf.split_interleaved(chunk, self.axes[a].n);
                        let kind = self.kind(a);
                        let id = PhaseId::new(j, phase0 + k as u16, self.orders.len(), kind);
                        let start = st.clock;
                        (st.buf, st.clock) = phase::reduce_scatter(
                            call,
                            &self.axes[a],
                            kind,
                            id,
                            groups,
                            op,
                            st.clock,
                        )
                        .await?;
                        trace_phase(&call, j, "reduce-scatter", &self.axes[a], start, st.clock);
                        st.axes.retain(|&r| r != a);
                        Ok(st)
                    },
                )
                .await?;
        }
        let t = states.iter().fold(t0, |t, (_, st)| t.max(st.clock));
        Ok((Payload::concat(states.into_iter().map(|(_, st)| st.buf)), t))
    }

    /// All-gather of this chip's `l`-element block: returns `N` blocks in group-rank order.
    pub async fn all_gather(
        &self,
        call: Call<'_>,
        own: &Payload,
        l: usize,
        phase0: u16,
        t0: Nanos,
    ) -> Result<(Payload, Nanos), CollectiveError> {
        let parts = self.parts(l);
        if parts.is_empty() {
            return Ok((own.zeros_like(0), t0));
        }
        let phases = self.axes.len();
        let mut states: Vec<(usize, PartState)> = parts
            .iter()
            .map(|&(j, off, len)| {
                (
                    j,
                    PartState {
                        len,
                        buf: own.slice(off, len),
                        clock: t0,
                        axes: Vec::new(),
                    },
                )
            })
            .collect();
        for k in 0..phases {
            states = self
                .phase_of_parts(
                    |j| self.orders[j][phases - 1 - k],
                    states,
                    |j, a, mut st: PartState| async move {
                        let kind = self.kind(a);
                        let id = PhaseId::new(j, phase0 + k as u16, self.orders.len(), kind);
                        let groups;
                        let start = st.clock;
                        (groups, st.clock) =
                            phase::all_gather(call, &self.axes[a], kind, id, st.buf, st.clock)
                                .await?;
                        trace_phase(&call, j, "all-gather", &self.axes[a], start, st.clock);
                        let at = st.axes.partition_point(|&g| g < a);
                        st.axes.insert(at, a);
                        let chunk = self.stride(&st.axes, a) * st.len;
                        st.buf = Payload::merge_interleaved(groups, chunk);
                        Ok(st)
                    },
                )
                .await?;
        }
        Ok(join_parts(states, self.size(), t0))
    }

    /// All-to-all of `N` blocks of `l` (block `r` bound for group rank `r`): returns the blocks
    /// every rank sent to this chip, in source-rank order. A phase along an axis exchanges the
    /// blocks whose destination differs there, after which that axis's digit indexes the source
    /// instead of the destination; the digits keep their places, so the axes may be taken in
    /// any order. With the `torus` algorithm each block is cut into one part per ICI axis and
    /// part `j` takes the axes starting at axis `j`, so every axis's links carry a part at
    /// once, as the ICI routers forward an all-to-all's packets along every dimension at
    /// once: the time is that of the most loaded axis, not the sum over axes.
    pub async fn all_to_all(
        &self,
        call: Call<'_>,
        buf: &Payload,
        l: usize,
        t0: Nanos,
    ) -> Result<(Payload, Nanos), CollectiveError> {
        let parts = self.parts(l);
        if parts.is_empty() {
            return Ok((buf.slice(0, 0), t0));
        }
        let all: Vec<usize> = (0..self.axes.len()).collect();
        let all = &all;
        let mut states = split_parts(&parts, buf, l, t0, &[]);
        for k in 0..self.axes.len() {
            let exchange = |j, a, mut st: PartState| async move {
                let chunk = self.stride(all, a) * st.len;
                let groups = st.buf.split_interleaved(chunk, self.axes[a].n);
                let kind = self.kind(a);
                let id = PhaseId::new(j, k as u16, self.orders.len(), kind);
                let start = st.clock;
                let received;
                (received, st.clock) =
                    phase::all_to_all(call, &self.axes[a], kind, id, groups, st.clock).await?;
                trace_phase(&call, j, "all-to-all", &self.axes[a], start, st.clock);
                st.buf = Payload::merge_interleaved(received, chunk);
                Ok(st)
            };
            states = self
                .phase_of_parts(|j| self.orders[j][k], states, exchange)
                .await?;
        }
        Ok(join_parts(states, self.size(), t0))
    }
}

/// Records one phase of one part on a traced chip: part 0 on the collective's own track
/// (nested in its slice), the parts that run beside it on tracks of their own.
fn trace_phase(
    call: &Call<'_>,
    part: usize,
    what: &str,
    axis: &AxisPath,
    start: Nanos,
    end: Nanos,
) {
    if let Some(mut log) = call.chip.trace() {
        let stream = call.chip.stream;
        let track = if part == 0 {
            stream.to_string()
        } else {
            format!("{stream} part {part}")
        };
        let args = vec![
            ("axis".into(), Arg::from(axis.axis.to_string())),
            ("chips".into(), Arg::from(axis.n as u64)),
            ("part".into(), Arg::from(part as u64)),
        ];
        let name = format!("{what} {}", axis.axis);
        log.closed(track, "phase", name, (start, end), args);
    }
}

/// One state per part (`(part, offset, len)` of each `l`-element block of `buf`), each at
/// `t0` with `axes`; a single whole part keeps the buffer as it is.
fn split_parts(
    parts: &[(usize, usize, usize)],
    buf: &Payload,
    l: usize,
    t0: Nanos,
    axes: &[usize],
) -> Vec<(usize, PartState)> {
    let single = parts.len() == 1 && parts[0].2 == l;
    parts
        .iter()
        .map(|&(j, off, len)| {
            let buf = if single {
                buf.clone()
            } else {
                blocks_part(buf, l, off, len)
            };
            let axes = axes.to_vec();
            (
                j,
                PartState {
                    len,
                    buf,
                    clock: t0,
                    axes,
                },
            )
        })
        .collect()
}

/// Elements `[off, off + len)` of every `l`-element block of `buf`.
fn blocks_part(buf: &Payload, l: usize, off: usize, len: usize) -> Payload {
    if let Payload::Meta(total) = buf {
        return Payload::Meta(total.checked_div(l).unwrap_or(0) * len);
    }
    let blocks = buf.len().checked_div(l).unwrap_or(0);
    let mut lens = Vec::with_capacity(blocks * 3);
    for _ in 0..blocks {
        lens.extend([off, len, l - off - len]);
    }
    let pieces = buf.split_lengths(&lens);
    Payload::concat(pieces.into_iter().skip(1).step_by(3))
}

/// The parts' `n` blocks re-formed (`zip_parts`) and the time the last part finished.
fn join_parts(states: Vec<(usize, PartState)>, n: usize, t0: Nanos) -> (Payload, Nanos) {
    let t = states.iter().fold(t0, |t, (_, st)| t.max(st.clock));
    let lens: Vec<usize> = states.iter().map(|(_, st)| st.len).collect();
    let bufs: Vec<Payload> = states.into_iter().map(|(_, st)| st.buf).collect();
    (zip_parts(&bufs, &lens, n), t)
}

/// Re-forms `n` blocks from per-part buffers: block `r` is part 0's `r`-th piece, then part 1's...
fn zip_parts(parts: &[Payload], lens: &[usize], n: usize) -> Payload {
    if parts.iter().any(Payload::is_meta) {
        return Payload::Meta(parts.iter().map(Payload::len).sum());
    }
    let split: Vec<Vec<Payload>> = parts
        .iter()
        .zip(lens)
        .map(|(p, &len)| p.split_lengths(&vec![len; n]))
        .collect();
    Payload::concat((0..n).flat_map(|r| split.iter().map(move |s| s[r].clone())))
}
