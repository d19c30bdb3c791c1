//! The mirror fabric: one chip stands for every chip of a symmetric job.
//!
//! On a torus whose every axis wraps (and across identical slices), translating the pod maps
//! it onto itself. When every chip runs the same program on equal sizes, as every data- and
//! tensor-parallel strategy and every collective but a rooted broadcast does in meta mode,
//! the message a chip receives on a link at a step is the translate of the one it sent itself
//! on the opposite link at that step: same size, same tag, same virtual departure. The mirror
//! router therefore hands each message a chip sends straight back to that chip's own inbox, as
//! if it came from the neighbour on the other side. The chip runs the unchanged algorithms
//! (same sends, receives, tags and link clocks), so its virtual time is that of every chip of
//! the full simulation, at the cost of one chip instead of 100,000. Shards that `torch.chunk`
//! leaves uneven break the symmetry slightly: chip 0 holds the largest, so its clock is the
//! slowest chip's to within the compute on the padding.

use std::sync::Arc;

use podsim_topology::{ChipId, Hardware, Link, Pod, Route};

use crate::chip::Chip;
use crate::error::CollectiveError;
use crate::fabric::{Delivery, Inbox, Message, Router};
use crate::fingerprint::OpKind;

/// Routes every message back to its sender as the message its mirror image sent it.
#[derive(Debug)]
pub struct MirrorRouter {
    pod: Arc<Pod>,
    inbox: Arc<Inbox>,
}

impl MirrorRouter {
    /// The chip that sends to `me` on the wire `me` sends on as `link`, `hops` chips away,
    /// and its name for it.
    fn mirror(&self, me: ChipId, link: Link, hops: u32) -> Option<(ChipId, Link)> {
        let pod = &self.pod;
        match link {
            Link::Ici { axis, dir } => {
                let back = Link::Ici {
                    axis,
                    dir: dir.flip(),
                };
                let from = pod.route_peer(me, Route { link: back, hops })?;
                Some((from, link))
            }
            Link::Dcn { peer_slice } => {
                let (slices, mine) = (pod.slices(), pod.slice_of(me));
                let back = (2 * mine + slices - peer_slice % slices) % slices;
                let from = pod.peer(me, Link::Dcn { peer_slice: back })?;
                Some((from, Link::Dcn { peer_slice: mine }))
            }
        }
    }
}

impl Router for MirrorRouter {
    fn deliver(&self, mut msg: Message) -> Result<Delivery<'_>, CollectiveError> {
        let (src, link) =
            self.mirror(msg.src, msg.link, msg.hops)
                .ok_or(CollectiveError::NoLink {
                    chip: msg.src,
                    link: msg.link,
                })?;
        msg.dst = msg.src;
        msg.src = src;
        msg.link = link;
        self.inbox.push(msg);
        Ok(Delivery::Done)
    }
}

/// Chip `id` of `pod` on a mirror fabric (see the module docs).
pub fn mirror_chip(pod: Pod, hardware: Hardware, id: ChipId) -> Chip {
    let pod = Arc::new(pod);
    let inbox = Arc::new(Inbox::new());
    let router = Arc::new(MirrorRouter {
        pod: pod.clone(),
        inbox: inbox.clone(),
    });
    let mut chip = Chip::new(id, pod, Arc::new(hardware), inbox, router);
    chip.set_mirrored();
    chip
}

/// Why a job of `ops` on `pod` cannot be simulated by one mirrored chip (nothing when it can):
/// a torus axis without wraparound, real values (they differ from chip to chip), a rooted
/// collective. Launch-level obstacles (several workers, faults) are the caller's.
pub fn symmetry_obstacles(
    pod: &Pod,
    meta: bool,
    ops: impl IntoIterator<Item = OpKind>,
) -> Vec<String> {
    let torus = pod.torus();
    let mut out: Vec<String> = (0..torus.dims().len())
        .filter(|&a| torus.dims()[a] > 1 && !torus.wraps(a))
        .map(|a| {
            format!(
                "axis {a} of {torus} does not wrap around: chips at its ends are not like the others"
            )
        })
        .collect();
    if !meta {
        out.push("needs meta mode (values differ from chip to chip)".into());
    }
    let ops: Vec<OpKind> = ops.into_iter().collect();
    if ops.contains(&OpKind::Broadcast) {
        out.push("a broadcast has a root, which no other chip is like".into());
    }
    if ops.contains(&OpKind::SendRecv) {
        out.push(
            "a point-to-point message goes to one named chip, and a ring shift's next member is not the same neighbour for every chip".into(),
        );
    }
    out
}
