//! Lanes: one direction of data flow along one axis, with its own virtual clock.
//!
//! Every lane is written for the `Plus` direction in "lane coordinates" (position `p` of `n`,
//! sending to `p + 1`); the `Minus` lane is the same code on mirrored positions
//! (`n - 1 - p`) and mirrored group indices. All sends of a step happen before its receive,
//! and sends never block, so lanes of neighbouring chips cannot deadlock.

use podsim_topology::Route;

use crate::chip::{Call, Nanos};
use crate::error::CollectiveError;
use crate::fabric::Tag;
use crate::payload::Payload;
use crate::recorder::add_own;
use crate::reduce::ReduceOp;

/// One lane of one phase of one collective call on one chip.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lane<'a> {
    pub call: Call<'a>,
    pub send: Route,
    pub recv: Route,
    pub lane: u16,
    pub phase: u16,
    /// Lanes of the collective that run at once on this chip, sharing its HBM.
    pub sharing: u16,
    /// Position in lane coordinates.
    pub p: usize,
    pub n: usize,
}

impl Lane<'_> {
    fn tag(&self, step: usize) -> Tag {
        Tag {
            lane: self.lane,
            phase: self.phase,
            step: step as u32,
        }
    }

    // Plain functions returning the call's future, not async ones: a state machine around
    // another, built for every message, only costs.
    fn put(
        &self,
        t: Nanos,
        step: usize,
        payload: Payload,
    ) -> impl Future<Output = Result<(), CollectiveError>> + '_ {
        self.call.send(t, self.send, self.tag(step), payload)
    }

    fn get<'t>(
        &'t self,
        t: &'t mut Nanos,
        step: usize,
    ) -> impl Future<Output = Result<Payload, CollectiveError>> + 't {
        self.call.recv(t, self.recv, self.tag(step))
    }

    /// The clock after reducing `elems` received elements into this chip's own: a ring
    /// step forwards only what it has reduced, so the reduction sits between the receive and
    /// the next send.
    pub fn reduced(&self, t: Nanos, elems: usize) -> Nanos {
        let bytes = elems as f64 * self.call.elem_bytes;
        add_own(&self.call.chip.stats.bytes_reduced, bytes as u64);
        t + self
            .call
            .chip
            .hardware()
            .reduction_ns(bytes, f64::from(self.sharing))
    }

    fn at(&self, i: isize) -> usize {
        i.rem_euclid(self.n as isize) as usize
    }

    /// Ring reduce-scatter: block `b` starts at chip `b + 1` and travels `n - 1` hops, each chip
    /// adding its contribution; returns this chip's fully reduced group.
    pub async fn ring_reduce_scatter(
        self,
        groups: &[Payload],
        op: ReduceOp,
        mut t: Nanos,
    ) -> Result<(Payload, Nanos), CollectiveError> {
        let p = self.p as isize;
        let mut acc = groups[self.at(p - 1)].clone();
        for s in 0..self.n - 1 {
            self.put(t, s, acc).await?;
            let incoming = self.get(&mut t, s).await?;
            t = self.reduced(t, incoming.len());
            acc = incoming.combine(&groups[self.at(p - 2 - s as isize)], op)?;
        }
        Ok((acc, t))
    }

    /// Ring all-gather: each step forwards the group received in the previous one. Returns
    /// the groups this lane received, indexed by lane position.
    pub async fn ring_all_gather(
        self,
        own: Payload,
        mut t: Nanos,
    ) -> Result<(Vec<Option<Payload>>, Nanos), CollectiveError> {
        let p = self.p as isize;
        let mut out = vec![None; self.n];
        let mut current = own;
        for s in 0..self.n - 1 {
            self.put(t, s, current).await?;
            let incoming = self.get(&mut t, s).await?;
            out[self.at(p - 1 - s as isize)] = Some(incoming.clone());
            current = incoming;
        }
        Ok((out, t))
    }

    /// Line reduce-scatter (no wraparound): partial sums flow towards higher positions, the
    /// farthest destination first, so every destination `d` receives the sum of all chips
    /// below it. Returns that "left" partial (`None` for position 0).
    pub async fn line_reduce_scatter(
        self,
        groups: &[Payload],
        op: ReduceOp,
        mut t: Nanos,
    ) -> Result<(Option<Payload>, Nanos), CollectiveError> {
        let (p, n) = (self.p, self.n);
        let mut carry: Option<Payload> = None;
        let mut mine = None;
        for s in 0..n - 1 {
            if p + 1 < n && s >= p {
                let d = n - 1 - s + p;
                let out = match carry.take() {
                    Some(partial) => {
                        t = self.reduced(t, partial.len());
                        partial.combine(&groups[d], op)?
                    }
                    None => groups[d].clone(),
                };
                self.put(t, s, out).await?;
            }
            if p >= 1 && s + 1 >= p {
                let incoming = self.get(&mut t, s).await?;
                if n - 2 - s + p == p {
                    mine = Some(incoming);
                } else {
                    carry = Some(incoming);
                }
            }
        }
        Ok((mine, t))
    }

    /// Line all-gather: groups flow towards higher positions, forwarded hop by hop. Returns the
    /// groups of all lower positions.
    pub async fn line_all_gather(
        self,
        own: Payload,
        mut t: Nanos,
    ) -> Result<(Vec<Option<Payload>>, Nanos), CollectiveError> {
        let (p, n) = (self.p, self.n);
        let mut out = vec![None; n];
        let mut current = own;
        for s in 0..n - 1 {
            if p + 1 < n && s <= p {
                self.put(t, s, current.clone()).await?;
            }
            if p >= 1 && s < p {
                let incoming = self.get(&mut t, s).await?;
                out[p - 1 - s] = Some(incoming.clone());
                current = incoming;
            }
        }
        Ok((out, t))
    }

    /// Ring all-to-all for destinations 1..=`reach` positions ahead: a bundle of groups leaves
    /// each chip, every hop keeps the first group and forwards the rest. Returns the groups
    /// received, indexed by source position.
    pub async fn ring_all_to_all(
        self,
        groups: &[Payload],
        reach: usize,
        mut t: Nanos,
    ) -> Result<(Vec<Option<Payload>>, Nanos), CollectiveError> {
        let p = self.p as isize;
        let mut out = vec![None; self.n];
        let mut bundle =
            Payload::concat((1..=reach).map(|d| groups[self.at(p + d as isize)].clone()));
        for s in 0..reach {
            self.put(t, s, bundle).await?;
            let incoming = self.get(&mut t, s).await?;
            let mut items = incoming.split_even(reach - s);
            let first = items.remove(0);
            out[self.at(p - 1 - s as isize)] = Some(first);
            bundle = Payload::concat(items);
        }
        Ok((out, t))
    }

    /// Line all-to-all towards higher positions: like [`Lane::ring_all_to_all`] but the bundle
    /// from each source serves every chip above it.
    pub async fn line_all_to_all(
        self,
        groups: &[Payload],
        mut t: Nanos,
    ) -> Result<(Vec<Option<Payload>>, Nanos), CollectiveError> {
        let (p, n) = (self.p, self.n);
        let mut out = vec![None; n];
        let mut bundle = Payload::concat(groups[p + 1..].iter().cloned());
        for s in 0..n - 1 {
            if p + 1 < n && s <= p {
                self.put(t, s, bundle.clone()).await?;
            }
            if p >= 1 && s < p {
                let incoming = self.get(&mut t, s).await?;
                // From source p - 1 - s: one group for each position p..n.
                let mut items = incoming.split_even(n - p);
                out[p - 1 - s] = Some(items.remove(0));
                bundle = Payload::concat(items);
            }
        }
        Ok((out, t))
    }
}
