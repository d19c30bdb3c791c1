//! Phases: one axis of a collective. A phase runs one or two lanes concurrently (each with its
//! own virtual clock, both starting at the phase's start) and assembles their results.

use futures_util::future::try_join;
use podsim_topology::Dir;

use super::lane::Lane;
use super::{AxisPath, PhaseKind};
use crate::chip::{Call, Nanos};
use crate::error::CollectiveError;
use crate::payload::Payload;
use crate::reduce::ReduceOp;

/// Identifies a phase's lanes in message tags (lane ids `part * 4 + dir`), and says how many
/// lanes of the collective run at once on the chip (they share its HBM when they reduce).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PhaseId {
    pub part: u16,
    pub phase: u16,
    pub sharing: u16,
}

impl PhaseId {
    /// Phase `phase` of part `part`, one of `parts` that run at once, on an axis of `kind`.
    pub fn new(part: usize, phase: u16, parts: usize, kind: PhaseKind) -> PhaseId {
        let lanes = if kind == PhaseKind::UniRing { 1 } else { 2 };
        PhaseId {
            part: part as u16,
            phase,
            sharing: (parts * lanes) as u16,
        }
    }
}

fn lane<'a>(call: Call<'a>, path: &AxisPath, id: PhaseId, dir: Dir) -> Lane<'a> {
    let (send, recv) = path.links(dir);
    let p = match dir {
        Dir::Plus => path.pos,
        Dir::Minus => path.n - 1 - path.pos,
    };
    Lane {
        call,
        send,
        recv,
        lane: id.part * 4 + dir.index() as u16,
        phase: id.phase,
        sharing: id.sharing,
        p,
        n: path.n,
    }
}

/// The two lanes of a phase: towards higher and towards lower positions.
fn lanes<'a>(call: Call<'a>, path: &AxisPath, id: PhaseId) -> (Lane<'a>, Lane<'a>) {
    (
        lane(call, path, id, Dir::Plus),
        lane(call, path, id, Dir::Minus),
    )
}

/// Joins what the two lanes received: `minus` is in mirrored positions; each position came
/// from one lane or the other.
fn merge_received(plus: Vec<Option<Payload>>, minus: Vec<Option<Payload>>) -> Vec<Option<Payload>> {
    plus.into_iter()
        .zip(minus.into_iter().rev())
        .map(|(x, y)| x.or(y))
        .collect()
}

fn mirrored<T: Clone>(v: &[T]) -> Vec<T> {
    v.iter().rev().cloned().collect()
}

fn halves(p: &Payload) -> (Payload, Payload) {
    let lo = p.len() / 2;
    (p.slice(0, lo), p.slice(lo, p.len() - lo))
}

/// What the lanes received, with this chip's own group in its position: every position.
fn with_own(
    mut got: Vec<Option<Payload>>,
    pos: usize,
    own: Payload,
) -> Result<Vec<Payload>, CollectiveError> {
    got[pos] = Some(own);
    got.into_iter().collect::<Option<Vec<_>>>().ok_or_else(|| {
        CollectiveError::Internal("a lane finished without the group it owed".into())
    })
}

/// Reduce-scatter along one axis: `groups[q]` is this chip's contribution to position `q`;
/// returns the group of this chip's position, reduced over the axis.
pub(crate) async fn reduce_scatter(
    call: Call<'_>,
    path: &AxisPath,
    kind: PhaseKind,
    id: PhaseId,
    groups: Vec<Payload>,
    op: ReduceOp,
    t0: Nanos,
) -> Result<(Payload, Nanos), CollectiveError> {
    let (plus, minus) = lanes(call, path, id);
    match kind {
        PhaseKind::UniRing => {
            let (own, t) = plus.ring_reduce_scatter(&groups, op, t0).await?;
            Ok((own.resolve_async().await?, t))
        }
        PhaseKind::BidirRing => {
            let (lo, hi): (Vec<_>, Vec<_>) = groups.iter().map(halves).unzip();
            let hi = mirrored(&hi);
            let ((a, ta), (b, tb)) = try_join(
                plus.ring_reduce_scatter(&lo, op, t0),
                minus.ring_reduce_scatter(&hi, op, t0),
            )
            .await?;
            let (a, b) = try_join(a.resolve_async(), b.resolve_async()).await?;
            Ok((Payload::concat([a, b]), ta.max(tb)))
        }
        PhaseKind::Line => {
            let mirror = mirrored(&groups);
            let ((left, ta), (right, tb)) = try_join(
                plus.line_reduce_scatter(&groups, op, t0),
                minus.line_reduce_scatter(&mirror, op, t0),
            )
            .await?;
            let own = groups[path.pos].clone();
            let mut t = ta.max(tb);
            let mut acc = match left {
                Some(l) => {
                    t = plus.reduced(t, l.len());
                    l.combine(&own, op)?
                }
                None => own,
            };
            if let Some(r) = right {
                t = plus.reduced(t, r.len());
                acc = acc.combine(&r, op)?;
            }
            Ok((acc.resolve_async().await?, t))
        }
    }
}

/// All-gather along one axis: returns the groups of every position, in position order.
pub(crate) async fn all_gather(
    call: Call<'_>,
    path: &AxisPath,
    kind: PhaseKind,
    id: PhaseId,
    own: Payload,
    t0: Nanos,
) -> Result<(Vec<Payload>, Nanos), CollectiveError> {
    let (plus, minus) = lanes(call, path, id);
    let (got, t) = match kind {
        PhaseKind::UniRing => plus.ring_all_gather(own.clone(), t0).await?,
        PhaseKind::BidirRing => {
            let (lo, hi) = halves(&own);
            let ((a, ta), (b, tb)) =
                try_join(plus.ring_all_gather(lo, t0), minus.ring_all_gather(hi, t0)).await?;
            let b = mirrored(&b);
            let joined = a
                .into_iter()
                .zip(b)
                .map(|(x, y)| match (x, y) {
                    (Some(x), Some(y)) => Some(Payload::concat([x, y])),
                    _ => None,
                })
                .collect();
            (joined, ta.max(tb))
        }
        PhaseKind::Line => {
            let ((a, ta), (b, tb)) = try_join(
                plus.line_all_gather(own.clone(), t0),
                minus.line_all_gather(own.clone(), t0),
            )
            .await?;
            (merge_received(a, b), ta.max(tb))
        }
    };
    Ok((with_own(got, path.pos, own)?, t))
}

/// All-to-all along one axis: `groups[q]` goes to position `q`; returns what every position
/// sent to this chip, in source-position order.
pub(crate) async fn all_to_all(
    call: Call<'_>,
    path: &AxisPath,
    kind: PhaseKind,
    id: PhaseId,
    groups: Vec<Payload>,
    t0: Nanos,
) -> Result<(Vec<Payload>, Nanos), CollectiveError> {
    let (plus, minus) = lanes(call, path, id);
    let n = path.n;
    let (got, t) = match kind {
        PhaseKind::UniRing => plus.ring_all_to_all(&groups, n - 1, t0).await?,
        PhaseKind::BidirRing => {
            let mirror = mirrored(&groups);
            let ((a, ta), (b, tb)) = try_join(
                plus.ring_all_to_all(&groups, n / 2, t0),
                minus.ring_all_to_all(&mirror, (n - 1) / 2, t0),
            )
            .await?;
            (merge_received(a, b), ta.max(tb))
        }
        PhaseKind::Line => {
            let mirror = mirrored(&groups);
            let ((a, ta), (b, tb)) = try_join(
                plus.line_all_to_all(&groups, t0),
                minus.line_all_to_all(&mirror, t0),
            )
            .await?;
            (merge_received(a, b), ta.max(tb))
        }
    };
    let own = groups[path.pos].clone();
    Ok((with_own(got, path.pos, own)?, t))
}
