//! Point-to-point messages between any two chips: a PyTorch program's `send` and `recv`.
//!
//! A message takes the pod's dimension-order path ([`podsim_topology::Pod::path`]): launched
//! at the collective's fixed cost (`collective_overhead_ns`, paid by the sender: a TPU sends
//! by an op it launches, JAX's `ppermute` measures 4.5-6 us for a few KiB), it leaves on the
//! path's first link and arrives after the transfer on that link plus the latency of
//! every hop (the torus forwards it through the chips between, cut-through, without their
//! programs taking part). Across slices the path starts with its DCN hop, the slowest link,
//! so the transfer is charged at DCN bandwidth.
//!
//! Each ordered pair of chips and tag is its own channel with its own call sequence, as MPI
//! and c10d match messages: the k-th `send` from A to B under a tag meets B's k-th `recv`
//! from A under that tag, whatever else either does in between. A channel's calls have
//! fingerprints like collectives (flight recorder, fault hooks, traces), so a `recv` that
//! expects another size than was sent is a desync naming both chips, and a `recv` whose
//! message never comes is a hang the watchdog names by its peer and link.

use podsim_topology::{ChipId, Group, Path, Route};

use crate::chip::{Call, Chip};
use crate::error::CollectiveError;
use crate::fabric::Tag;
use crate::fingerprint::{DType, OpKind};
use crate::payload::Payload;

use crate::fingerprint::{MAX_TAG, channel};

impl Chip {
    /// The path from `src` to `dst`, or why there is none.
    fn p2p_path(&self, src: ChipId, dst: ChipId, tag: u32) -> Result<Path, CollectiveError> {
        if tag > MAX_TAG {
            return Err(CollectiveError::Invalid(format!(
                "point-to-point tag {tag} is above the largest podsim carries ({MAX_TAG})"
            )));
        }
        let chips = self.pod().chips();
        self.pod().path(src, dst).ok_or_else(|| {
            CollectiveError::Invalid(if src == dst {
                format!("chip {src} cannot send to or receive from itself")
            } else {
                format!("no chip {} in a pod of {chips} chips", src.max(dst))
            })
        })
    }

    /// Sends `input` to chip `dst` under `tag`. Returns once the message has left this chip
    /// (its clock moves to when the last byte is on the wire, as a blocking send returns when
    /// its buffer may be reused); the receiver gets it at its arrival time.
    pub async fn send_to(
        &mut self,
        dst: ChipId,
        input: &Payload,
        tag: u32,
    ) -> Result<(), CollectiveError> {
        let me = self.id();
        let path = self.p2p_path(me, dst, tag)?;
        let key = channel(me, dst, tag);
        let label = || format!("{me}->{dst} tag {tag}");
        let fp = self
            .begin_on(key, label, OpKind::SendRecv, DType::F32, input.len(), None)
            .await;
        // A message is an op the chip launches (XLA compiles a send as a collective-permute):
        // it pays the collective's fixed cost before its data moves, as every collective does.
        // The receiver pays nothing more: it has the message no earlier than the launch allows.
        let launch = self.hardware().collective_overhead_ns;
        self.set_clock(self.clock() + launch);
        let hw = self.hardware();
        // The first hop's latency is the route's own; the path's other hops add theirs.
        let further_hops = if path.dcn {
            path.ici_hops
        } else {
            path.ici_hops - 1
        };
        let extra_latency_ns = f64::from(further_hops) * hw.ici_latency_ns;
        let call = Call::point_to_point(self, fp, path.link, dst);
        let route = Route::neighbour(path.link);
        call.send_to(
            self.clock(),
            dst,
            route,
            extra_latency_ns,
            MESSAGE,
            input.clone(),
        )
        .await?;
        let left = call.link_free_at(path.link);
        self.set_clock(self.clock().max(left));
        self.finish();
        Ok(())
    }

    /// Receives the next message chip `src` sends this chip under `tag`, which must hold
    /// `count` elements (another size is a desync naming both calls).
    pub async fn recv_from(
        &mut self,
        src: ChipId,
        count: usize,
        tag: u32,
    ) -> Result<Payload, CollectiveError> {
        let me = self.id();
        let path = self.p2p_path(src, me, tag)?;
        let key = channel(src, me, tag);
        let label = || format!("{src}->{me} tag {tag}");
        let fp = self
            .begin_on(key, label, OpKind::SendRecv, DType::F32, count, None)
            .await;
        // The message is filed under the link it left `src` on, named from this side.
        let my_link = path.link.reverse(self.pod().slice_of(src));
        let call = Call::point_to_point(self, fp, my_link, src);
        let mut t = self.clock();
        let got = call.recv_from(&mut t, src, my_link, MESSAGE).await?;
        self.set_clock(t);
        self.finish();
        Ok(got)
    }
}

/// Every point-to-point message is one message of its call.
const MESSAGE: Tag = Tag {
    lane: 0,
    phase: 0,
    step: 0,
};

impl Chip {
    /// Every member of `group` sends `input` to the next member (group rank + 1, wrapping)
    /// and gets what the previous member sent: the ring shift of pipeline stages and of XLA's
    /// collective-permute, built from point-to-point messages (tag 0). A group of one chip
    /// gets its own input back.
    pub async fn shift(
        &mut self,
        group: Group,
        input: &Payload,
    ) -> Result<Payload, CollectiveError> {
        if group.size(self.pod()) == 1 {
            return Ok(input.clone());
        }
        let [next, previous] = group.ring_neighbours(self.pod(), self.id());
        // Sends never wait for their receiver, so every member sends first.
        self.send_to(next, input, 0).await?;
        self.recv_from(previous, input.len(), 0).await
    }
}
