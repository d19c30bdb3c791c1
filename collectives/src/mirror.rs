//! The mirror fabric: a few chips stand for every chip of a symmetric job.
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
//!
//! Where a job is symmetric only under some translations (a device mesh that takes a
//! two-chip segment of an axis is alike every second chip along it; an axis without
//! wraparound is alike nowhere), [`Symmetry`] gives the smallest translation per axis that
//! maps the job onto itself, and [`mirror_chips`] simulates one chip per class of chips
//! alike under those translations: the chips of slice 0 whose coordinates lie below the steps.
//! A message to chip `d` goes to the representative of `d`'s class, as the message the
//! translate of its sender sent: chip `d` and its representative differ by a translation, so
//! what arrives at one is the translate of what arrives at the other. One step of 1 on every
//! axis is the single mirrored chip above.

use std::sync::Arc;

use podsim_topology::{AxisPart, ChipId, Coord, Hardware, Link, Pod, PodAxis};

use crate::chip::Chip;
use crate::error::CollectiveError;
use crate::fabric::{Delivery, Inbox, Message, Router};
use crate::fingerprint::OpKind;

/// The translations a job is symmetric under: along each torus axis, by multiples of a step
/// (1: every chip along the axis is alike; the axis's length: none is); across slices, by
/// any number of slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Symmetry {
    steps: Vec<u32>,
}

impl Symmetry {
    /// Every translation of `pod` (steps of 1), except along axes without wraparound.
    pub fn of_torus(pod: &Pod) -> Symmetry {
        let torus = pod.torus();
        Symmetry {
            steps: (0..torus.ndims())
                .map(|a| if torus.wraps(a) { 1 } else { torus.dim(a) })
                .collect(),
        }
    }

    /// This symmetry, keeping along `axis` only translations by multiples of `step` as well.
    pub fn with_step(mut self, axis: usize, step: u32) -> Symmetry {
        if let Some(s) = self.steps.get_mut(axis) {
            *s = lcm(*s, step.max(1));
        }
        self
    }

    /// This symmetry, keeping only the translations that map each of `parts` (a group's, a
    /// mesh dimension's) onto a part of the same kind: along an axis that a part takes only a
    /// segment of (it neither covers the axis nor closes into a ring), multiples of the block
    /// the part repeats in (`stride x extent` chips).
    pub fn keeping(self, parts: &[AxisPart], pod: &Pod) -> Symmetry {
        parts
            .iter()
            .filter(|p| !p.is_whole(pod) && !p.wraps(pod))
            .fold(self, |s, p| match p.axis {
                PodAxis::Torus(a) => s.with_step(usize::from(a), p.stride * p.extent),
                PodAxis::Slices => s,
            })
    }

    /// Translation step per torus axis.
    pub fn steps(&self) -> &[u32] {
        &self.steps
    }

    /// Chips a mirror fabric simulates: one per class of chips alike.
    pub fn classes(&self) -> u32 {
        self.steps.iter().product()
    }

    /// The chip that stands for `chip` on a mirror fabric of this symmetry: the one of its
    /// class in slice 0 whose coordinates lie below the steps.
    pub fn representative(&self, pod: &Pod, chip: ChipId) -> ChipId {
        let mut coord = pod.coord(chip);
        for (a, &step) in self.steps.iter().enumerate() {
            coord[a] %= step;
        }
        pod.chip_at(0, &coord)
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

fn lcm(a: u32, b: u32) -> u32 {
    a / gcd(a, b) * b
}

/// Routes every message to the representative of its destination's class, as the message
/// the translate of its sender sent.
#[derive(Debug)]
pub struct MirrorRouter {
    pod: Arc<Pod>,
    steps: Vec<u32>,
    /// One inbox per representative, in mixed-radix order of its coordinates (x fastest).
    inboxes: Vec<Arc<Inbox>>,
}

impl MirrorRouter {
    /// The representative of `coord`'s class: its index and coordinates.
    fn representative(&self, coord: &Coord) -> (usize, Coord) {
        let mut rep = *coord;
        let mut index = 0usize;
        for a in (0..self.steps.len()).rev() {
            rep[a] = coord[a] % self.steps[a];
            index = index * self.steps[a] as usize + rep[a] as usize;
        }
        (index, rep)
    }

    fn chip(&self, index: usize) -> ChipId {
        let mut coord: Coord = Default::default();
        let mut rest = index as u32;
        for (a, &step) in self.steps.iter().enumerate() {
            coord[a] = rest % step;
            rest /= step;
        }
        self.pod.chip_at(0, &coord)
    }
}

impl Router for MirrorRouter {
    fn deliver(&self, mut msg: Message) -> Result<Delivery<'_>, CollectiveError> {
        let pod = &self.pod;
        if msg.dst >= pod.chips() || msg.src >= pod.chips() {
            return Err(CollectiveError::NoLink {
                chip: msg.src,
                link: msg.link,
            });
        }
        let to = pod.coord(msg.dst);
        let (index, rep) = self.representative(&to);
        // The translation taking the representative to the destination, applied backwards
        // to the sender.
        let (from, dims) = (pod.coord(msg.src), pod.torus().dims());
        let mut src: Coord = from;
        for (a, &n) in dims.iter().enumerate() {
            src[a] = (from[a] + n - (to[a] - rep[a]) % n) % n;
        }
        let slices = pod.slices();
        let src_slice = (pod.slice_of(msg.src) + slices - pod.slice_of(msg.dst)) % slices;
        msg.src = pod.chip_at(src_slice, &src);
        msg.dst = pod.chip_at(0, &rep);
        if let Link::Dcn { .. } = msg.link {
            // Named from the sender's side: the slice it sends to, now the representative's.
            msg.link = Link::Dcn { peer_slice: 0 };
        }
        self.inboxes[index].push(msg);
        Ok(Delivery::Done)
    }
}

/// One chip per class of chips alike under `symmetry`, in slice 0 (see the module docs).
pub fn mirror_chips(pod: Pod, hardware: Hardware, symmetry: &Symmetry) -> Vec<Chip> {
    let pod = Arc::new(pod);
    let hardware = Arc::new(hardware);
    let classes = symmetry.classes() as usize;
    let router = Arc::new(MirrorRouter {
        pod: pod.clone(),
        steps: symmetry.steps.clone(),
        inboxes: (0..classes).map(|_| Arc::new(Inbox::new())).collect(),
    });
    (0..classes)
        .map(|index| {
            let id = router.chip(index);
            let mut chip = Chip::new(
                id,
                pod.clone(),
                hardware.clone(),
                router.inboxes[index].clone(),
                router.clone(),
            );
            chip.set_mirrored();
            chip
        })
        .collect()
}

/// Why a job of `ops` cannot run on a mirror fabric (nothing when it can): real values (they
/// differ from chip to chip), a rooted collective. An axis without wraparound is no obstacle:
/// [`Symmetry::of_torus`] keeps every position along it. Launch-level obstacles (several
/// workers, faults) are the caller's.
pub fn symmetry_obstacles(meta: bool, ops: impl IntoIterator<Item = OpKind>) -> Vec<String> {
    let mut out = Vec::new();
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

#[cfg(test)]
mod tests {
    use super::*;
    use podsim_topology::Torus;

    #[test]
    fn steps_combine_as_least_common_multiples_and_count_the_classes() {
        let torus: Torus = "8x8x4".parse().unwrap_or_else(|e| panic!("{e}"));
        let pod = Pod::single(torus.set_wrap_all(true));
        let all = Symmetry::of_torus(&pod);
        assert_eq!((all.steps(), all.classes()), (&[1, 1, 1][..], 1));
        // A two-chip segment along y, then a four-chip block along y: every fourth y.
        let s = all.with_step(1, 2).with_step(1, 4).with_step(2, 3);
        assert_eq!((s.steps(), s.classes()), (&[1, 4, 3][..], 12));
        let lines = Pod::single(
            "8x4"
                .parse::<Torus>()
                .unwrap_or_else(|e| panic!("{e}"))
                .set_wrap_all(false),
        );
        assert_eq!(Symmetry::of_torus(&lines).steps(), &[8, 4]);
    }

    #[test]
    fn a_chip_belongs_to_the_class_of_its_coordinates_modulo_the_steps() {
        let torus: Torus = "4x4".parse().unwrap_or_else(|e| panic!("{e}"));
        let pod = Pod::new(torus.set_wrap_all(true), 2).unwrap_or_else(|e| panic!("{e}"));
        let symmetry = Symmetry::of_torus(&pod).with_step(1, 2);
        let router = MirrorRouter {
            pod: Arc::new(pod.clone()),
            steps: symmetry.steps().to_vec(),
            inboxes: (0..2).map(|_| Arc::new(Inbox::new())).collect(),
        };
        // (1, 2) of slice 1 is in the class of (0, 0) of slice 0; (3, 1) of slice 0 in that of
        // (0, 1), the second representative.
        for (slice, at, index, rep) in [(1, [1, 2, 0], 0, [0, 0, 0]), (0, [3, 1, 0], 1, [0, 1, 0])]
        {
            let chip = pod.chip_at(slice, &at);
            let got = router.representative(&pod.coord(chip));
            assert_eq!(got, (index, rep));
            assert_eq!(router.chip(index), pod.chip_at(0, &rep));
            assert_eq!(symmetry.representative(&pod, chip), router.chip(index));
        }
    }
}
