//! Chip groups: the chips that take part in one collective. A group is a set of pod axes (torus
//! axes and/or the DCN slice axis), each whole or a part of it ([`AxisPart`]); the group of a
//! chip is every chip that shares its coordinates on all other axes (and, on a part, the rest
//! of its coordinate on that axis). Group ranks are mixed-radix over the group's axes with
//! torus axis 0 fastest and the slice axis slowest.
//!
//! Parts exist because device meshes do not always factor a pod into whole axes: 16-way tensor
//! parallelism on an 8x8x8 torus takes x and two chips of y, leaving y's four pairs to the
//! other mesh axis. A part of an axis is the chips whose coordinate `c` differs only in
//! `(c / stride) % extent`: the low part (stride 1) is a contiguous segment of the axis, a
//! high part (stride > 1) is every `stride`-th chip, `stride` hops apart on the torus.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::pod::{ChipId, Pod};
use crate::torus::MAX_AXES;

/// One axis of the pod: a torus axis inside every slice, or the axis across slices (DCN).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PodAxis {
    Torus(u8),
    Slices,
}

impl PodAxis {
    fn bit(self) -> u8 {
        match self {
            PodAxis::Torus(a) => 1 << a,
            PodAxis::Slices => 1 << MAX_AXES,
        }
    }

    pub fn size(self, pod: &Pod) -> u32 {
        match self {
            PodAxis::Torus(a) => pod.torus().dim(usize::from(a)),
            PodAxis::Slices => pod.slices(),
        }
    }

    fn index(self) -> usize {
        match self {
            PodAxis::Torus(a) => usize::from(a),
            PodAxis::Slices => MAX_AXES,
        }
    }
}

/// The chips along one pod axis that a group spans: those whose coordinate `c` on the axis
/// differs only in `(c / stride) % extent`. The whole axis is stride 1, extent its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AxisPart {
    pub axis: PodAxis,
    /// Hops between consecutive members on the torus.
    pub stride: u32,
    /// Members.
    pub extent: u32,
}

impl AxisPart {
    pub fn whole(axis: PodAxis, pod: &Pod) -> AxisPart {
        AxisPart {
            axis,
            stride: 1,
            extent: axis.size(pod),
        }
    }

    pub fn is_whole(self, pod: &Pod) -> bool {
        self.stride == 1 && self.extent == self.axis.size(pod)
    }

    /// Whether the members close into a ring: the part reaches around the whole axis (its
    /// last member is `stride` hops from its first over the wraparound) and the axis wraps.
    pub fn wraps(self, pod: &Pod) -> bool {
        let closes = self.stride * self.extent == self.axis.size(pod);
        closes
            && match self.axis {
                PodAxis::Torus(a) => pod.torus().wraps(usize::from(a)),
                PodAxis::Slices => true,
            }
    }

    /// `chip`'s position among the part's members.
    pub fn position(self, pod: &Pod, chip: ChipId) -> u32 {
        (Group::coord_on(pod, chip, self.axis) / self.stride) % self.extent
    }

    /// The two parts joined, when one continues the other (`self` the lower).
    fn joined_below(self, high: AxisPart) -> Option<AxisPart> {
        (self.stride * self.extent == high.stride).then_some(AxisPart {
            axis: self.axis,
            stride: self.stride,
            extent: self.extent * high.extent,
        })
    }
}

impl fmt::Display for AxisPart {
    /// `y` for a whole axis is written by [`Group`]; a part is `y[4@2]`: 4 chips, 2 hops apart.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}@{}]", self.axis, self.extent, self.stride)
    }
}

/// How a group spans one of its axes: the whole axis (the default) or a part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
struct Span {
    /// 0: the whole axis.
    stride: u32,
    extent: u32,
}

impl fmt::Display for PodAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PodAxis::Torus(a) => {
                f.write_str(["x", "y", "z"].get(usize::from(*a)).copied().unwrap_or("?"))
            }
            PodAxis::Slices => f.write_str("dcn"),
        }
    }
}

/// A set of pod axes, each whole or a part; with a pod it defines which chips a collective
/// spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Group {
    mask: u8,
    /// Per axis (torus axes, then the slice axis): the part spanned, when not the whole.
    #[serde(default)]
    spans: [Span; MAX_AXES + 1],
}

impl Group {
    /// Every axis: the whole pod.
    pub fn world(pod: &Pod) -> Group {
        let mut g = Group::of(&[]);
        for a in 0..pod.torus().ndims() {
            g = g.with(PodAxis::Torus(a as u8));
        }
        if pod.slices() > 1 {
            g = g.with(PodAxis::Slices);
        }
        g
    }

    /// Every torus axis of one slice (no DCN).
    pub fn slice(pod: &Pod) -> Group {
        Group::world(pod).without(PodAxis::Slices)
    }

    pub fn of(axes: &[PodAxis]) -> Group {
        axes.iter().fold(Group::default(), |g, &a| g.with(a))
    }

    /// The group with the whole of `axis` added.
    pub fn with(mut self, axis: PodAxis) -> Group {
        self.mask |= axis.bit();
        self.spans[axis.index()] = Span::default();
        self
    }

    /// The group with `part` added: joined to the part of its axis already in the group when
    /// one continues the other (the whole axis once both halves are in); an error when the
    /// two parts do not join into one.
    pub fn with_part(self, part: AxisPart, pod: &Pod) -> Result<Group, String> {
        let joined = match self.part(part.axis, pod) {
            None => part,
            Some(have) => have
                .joined_below(part)
                .or_else(|| part.joined_below(have))
                .ok_or_else(|| {
                    format!("parts {have} and {part} of one axis do not join into one")
                })?,
        };
        let mut g = self.with(part.axis);
        if !joined.is_whole(pod) {
            g.spans[part.axis.index()] = Span {
                stride: joined.stride,
                extent: joined.extent,
            };
        }
        Ok(g)
    }

    pub fn without(mut self, axis: PodAxis) -> Group {
        self.mask &= !axis.bit();
        self.spans[axis.index()] = Span::default();
        self
    }

    /// The part of `axis` the group spans (whole when no part was given), if it has the axis.
    pub fn part(self, axis: PodAxis, pod: &Pod) -> Option<AxisPart> {
        if !self.contains(axis) {
            return None;
        }
        let span = self.spans[axis.index()];
        Some(match span.stride {
            0 => AxisPart::whole(axis, pod),
            stride => AxisPart {
                axis,
                stride,
                extent: span.extent,
            },
        })
    }

    pub fn contains(self, axis: PodAxis) -> bool {
        self.mask & axis.bit() != 0
    }

    /// Parses `world`, `slice` (every torus axis, no DCN) or a comma list of `x`, `y`, `z`,
    /// `dcn`, checking the axes exist in `pod`.
    pub fn parse(text: &str, pod: &Pod) -> Result<Group, String> {
        match text.trim() {
            "world" => return Ok(Group::world(pod)),
            "slice" => return Ok(Group::slice(pod)),
            _ => {}
        }
        let mut g = Group::of(&[]);
        for name in text.split(',') {
            let axis = match name.trim() {
                "x" => PodAxis::Torus(0),
                "y" => PodAxis::Torus(1),
                "z" => PodAxis::Torus(2),
                "dcn" => PodAxis::Slices,
                other => {
                    return Err(format!(
                        "unknown axis {other:?} (use world, slice, or a list of x, y, z, dcn)"
                    ));
                }
            };
            if let PodAxis::Torus(a) = axis
                && usize::from(a) >= pod.torus().ndims()
            {
                return Err(format!(
                    "the torus {} has no axis {}",
                    pod.torus(),
                    name.trim()
                ));
            }
            g = g.with(axis);
        }
        Ok(g)
    }

    /// Bits a group id uses ([`Group::id`]); the bits above are free for collectives to mark
    /// ids of their own (debug-mode fingerprint exchanges).
    pub const ID_BITS: u32 = 40;

    /// A stable number naming the group's axes and parts (used in collective fingerprints),
    /// below `2^ID_BITS`: the axis mask for whole axes, as it always was; parts hashed into
    /// the bits above the mask's byte.
    pub fn id(self) -> u64 {
        let mut id = u64::from(self.mask);
        if self.spans.iter().any(|s| s.stride != 0) {
            // FNV-1a over the spans, kept above the mask's byte.
            let mut h: u64 = 0xcbf2_9ce4_8422_2325;
            for s in self.spans {
                for v in [s.stride, s.extent] {
                    h = (h ^ u64::from(v)).wrapping_mul(0x0100_0000_01b3);
                }
            }
            id |= (h & ((1 << (Group::ID_BITS - 8)) - 1)) << 8;
        }
        id
    }

    /// The group's axes that have more than one chip, in canonical order (x, y, z, dcn).
    pub fn axes(self, pod: &Pod) -> Vec<PodAxis> {
        self.parts(pod).into_iter().map(|p| p.axis).collect()
    }

    /// The group's parts of axes with more than one member, in canonical order (x, y, z, dcn).
    pub fn parts(self, pod: &Pod) -> Vec<AxisPart> {
        let torus = (0..pod.torus().ndims()).map(|a| PodAxis::Torus(a as u8));
        torus
            .chain(std::iter::once(PodAxis::Slices))
            .filter_map(|a| self.part(a, pod))
            .filter(|p| p.extent > 1)
            .collect()
    }

    pub fn size(self, pod: &Pod) -> u32 {
        self.parts(pod).iter().map(|p| p.extent).product()
    }

    /// Position of `chip` along `axis`.
    pub fn coord_on(pod: &Pod, chip: ChipId, axis: PodAxis) -> u32 {
        match axis {
            PodAxis::Torus(a) => pod.coord(chip)[usize::from(a)],
            PodAxis::Slices => pod.slice_of(chip),
        }
    }

    /// The rank of `chip` inside its group.
    pub fn rank_of(self, pod: &Pod, chip: ChipId) -> u32 {
        self.parts(pod)
            .iter()
            .rev()
            .fold(0, |acc, p| acc * p.extent + p.position(pod, chip))
    }

    /// The group whose members, seen from `chip`, are exactly `members` (any order): a product
    /// of parts of axes, as `torch.distributed.new_group` or a device mesh asks for. An error
    /// names why a set is not such a group (podsim routes collectives along torus axes).
    pub fn from_members(pod: &Pod, chip: ChipId, members: &[ChipId]) -> Result<Group, String> {
        let mut wanted: Vec<ChipId> = members.to_vec();
        wanted.sort_unstable();
        wanted.dedup();
        if wanted.binary_search(&chip).is_err() {
            return Err(format!("chip {chip} is not among the members {wanted:?}"));
        }
        if let Some(&bad) = wanted.iter().find(|&&m| m >= pod.chips()) {
            return Err(format!(
                "chip {bad} is outside the pod of {} chips",
                pod.chips()
            ));
        }
        let axes = (0..pod.torus().ndims())
            .map(|a| PodAxis::Torus(a as u8))
            .chain(std::iter::once(PodAxis::Slices));
        let mut group = Group::of(&[]);
        for axis in axes {
            let mut at: Vec<u32> = wanted
                .iter()
                .map(|&m| Group::coord_on(pod, m, axis))
                .collect();
            at.sort_unstable();
            at.dedup();
            if at.len() < 2 {
                continue;
            }
            let part = AxisPart {
                axis,
                stride: at[1] - at[0],
                extent: at.len() as u32,
            };
            group = group.with_part(part, pod)?;
        }
        let mut got = group.members(pod, chip);
        got.sort_unstable();
        if got != wanted {
            return Err(format!(
                "chips {wanted:?} are not a sub-torus of {} (evenly spaced along each axis, every combination present)",
                pod.torus()
            ));
        }
        Ok(group)
    }

    /// The members of `chip`'s group in group-rank order.
    pub fn members(self, pod: &Pod, chip: ChipId) -> Vec<ChipId> {
        let parts = self.parts(pod);
        (0..self.size(pod))
            .map(|gr| Group::member_on(&parts, pod, chip, gr))
            .collect()
    }

    /// The next and the previous member of `chip` in group-rank order, wrapping around (a
    /// group of one chip: the chip itself, twice).
    pub fn ring_neighbours(self, pod: &Pod, chip: ChipId) -> [ChipId; 2] {
        let parts = self.parts(pod);
        let n = self.size(pod);
        let rank = self.rank_of(pod, chip);
        [1, n - 1].map(|step| Group::member_on(&parts, pod, chip, (rank + step) % n))
    }

    fn member_on(parts: &[AxisPart], pod: &Pod, chip: ChipId, rank: u32) -> ChipId {
        let mut slice = pod.slice_of(chip);
        let mut coord = pod.coord(chip);
        let mut r = rank;
        for p in parts {
            let at = |c: u32| c - p.position(pod, chip) * p.stride + (r % p.extent) * p.stride;
            match p.axis {
                PodAxis::Torus(t) => coord[usize::from(t)] = at(coord[usize::from(t)]),
                PodAxis::Slices => slice = at(slice),
            }
            r /= p.extent;
        }
        pod.chip_at(slice, &coord)
    }
}

impl fmt::Display for Group {
    /// `{x,y}` for whole axes; a part is written with its extent and stride, `{x,y[2@1]}`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = [
            PodAxis::Torus(0),
            PodAxis::Torus(1),
            PodAxis::Torus(2),
            PodAxis::Slices,
        ]
        .iter()
        .filter(|&&a| self.contains(a))
        .map(|&a| match self.spans[a.index()] {
            Span { stride: 0, .. } => a.to_string(),
            Span { stride, extent } => AxisPart {
                axis: a,
                stride,
                extent,
            }
            .to_string(),
        })
        .collect();
        if names.is_empty() {
            f.write_str("{}")
        } else {
            write!(f, "{{{}}}", names.join(","))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(shape: &str) -> Pod {
        Pod::single(shape.parse().expect("shape"))
    }

    #[test]
    fn member_lists_of_axes_and_parts_are_groups_in_rank_order() {
        let p = pod("2x4");
        // A row of the 2x4 device mesh over 8 ranks (x has 2 chips, y 4): ranks 0..4 are
        // x = 0,1 and y = 0,1.
        for (members, size) in [
            (vec![0, 1, 2, 3, 4, 5, 6, 7], 8),
            (vec![0, 1], 2),
            (vec![1, 3, 5, 7], 4),
            (vec![0, 4], 2),
            (vec![0, 1, 2, 3], 4),
        ] {
            for &chip in &members {
                let g = Group::from_members(&p, chip, &members).expect("a group");
                assert_eq!(g.size(&p), size);
                let mut sorted = members.clone();
                sorted.sort_unstable();
                assert_eq!(g.members(&p, chip), sorted, "{members:?} from {chip}");
            }
        }
    }

    #[test]
    fn sets_that_are_not_sub_tori_are_refused_with_a_reason() {
        let p = pod("2x4");
        for members in [vec![0, 1, 2], vec![0, 3], vec![0, 1, 2, 5]] {
            let e = Group::from_members(&p, 0, &members).expect_err("not a group");
            assert!(e.contains("sub-torus") || e.contains("join"), "{e}");
        }
        assert!(Group::from_members(&p, 7, &[0, 1]).is_err());
        assert!(Group::from_members(&p, 0, &[0, 9]).is_err());
    }
}
