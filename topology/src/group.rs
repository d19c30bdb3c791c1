//! Chip groups: the chips that take part in one collective. A group is a set of pod axes (torus
//! axes and/or the DCN slice axis); the group of a chip is every chip that shares its
//! coordinates on all other axes. Group ranks are mixed-radix over the group's axes with torus
//! axis 0 fastest and the slice axis slowest.

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

/// A set of pod axes; with a pod it defines which chips a collective spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Group {
    mask: u8,
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
        Group {
            mask: axes.iter().fold(0, |m, a| m | a.bit()),
        }
    }

    pub fn with(self, axis: PodAxis) -> Group {
        Group {
            mask: self.mask | axis.bit(),
        }
    }

    pub fn without(self, axis: PodAxis) -> Group {
        Group {
            mask: self.mask & !axis.bit(),
        }
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

    /// A stable number naming the group's axes (used in collective fingerprints).
    pub fn id(self) -> u64 {
        u64::from(self.mask)
    }

    /// The group's axes that have more than one chip, in canonical order (x, y, z, dcn).
    pub fn axes(self, pod: &Pod) -> Vec<PodAxis> {
        let torus = (0..pod.torus().ndims()).map(|a| PodAxis::Torus(a as u8));
        torus
            .chain(std::iter::once(PodAxis::Slices))
            .filter(|&a| self.contains(a) && a.size(pod) > 1)
            .collect()
    }

    pub fn size(self, pod: &Pod) -> u32 {
        self.axes(pod).iter().map(|a| a.size(pod)).product()
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
        self.axes(pod).iter().rev().fold(0, |acc, &a| {
            acc * a.size(pod) + Group::coord_on(pod, chip, a)
        })
    }

    /// The members of `chip`'s group in group-rank order.
    pub fn members(self, pod: &Pod, chip: ChipId) -> Vec<ChipId> {
        let axes = self.axes(pod);
        let size = self.size(pod);
        (0..size)
            .map(|gr| {
                let mut slice = pod.slice_of(chip);
                let mut coord = pod.coord(chip);
                let mut r = gr;
                for &a in &axes {
                    let n = a.size(pod);
                    match a {
                        PodAxis::Torus(t) => coord[usize::from(t)] = r % n,
                        PodAxis::Slices => slice = r % n,
                    }
                    r /= n;
                }
                pod.chip_at(slice, &coord)
            })
            .collect()
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = [
            PodAxis::Torus(0),
            PodAxis::Torus(1),
            PodAxis::Torus(2),
            PodAxis::Slices,
        ]
        .iter()
        .filter(|&&a| self.contains(a))
        .map(|a| a.to_string())
        .collect();
        if names.is_empty() {
            f.write_str("{}")
        } else {
            write!(f, "{{{}}}", names.join(","))
        }
    }
}
