//! A pod: `slices` copies of one torus, joined by DCN. Chips are numbered globally as
//! `slice * chips_per_slice + rank_in_slice`; links are named from the sending chip's side.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::TopologyError;
use crate::torus::{Coord, Dir, MAX_CHIPS, Torus};

/// Global chip number across all slices.
pub type ChipId = u32;

/// A directed link as seen from the chip that uses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Link {
    /// ICI link to the torus neighbour along `axis` in direction `dir`.
    Ici { axis: u8, dir: Dir },
    /// DCN link to the chip with the same rank in slice `peer_slice`.
    Dcn { peer_slice: u32 },
}

/// Where a message goes: out on `link`, `hops` chips along its axis. Neighbours are one hop
/// apart; the members of a strided part of an axis ([`crate::AxisPart`]) are `stride` hops
/// apart, the message passing through the chips between (the torus routes it). DCN routes are
/// one hop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Route {
    pub link: Link,
    pub hops: u32,
}

impl Route {
    /// The route to the neighbour across `link`.
    pub fn neighbour(link: Link) -> Route {
        Route { link, hops: 1 }
    }
}

/// The way a point-to-point message takes between two chips ([`Pod::path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// The first link, as the sender names it: DCN when the path crosses slices.
    pub link: Link,
    /// ICI hops along the way, over every torus axis.
    pub ici_hops: u32,
    /// Whether the path crosses DCN (one hop, between slices).
    pub dcn: bool,
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.hops {
            1 => write!(f, "{}", self.link),
            h => write!(f, "{} ({h} hops)", self.link),
        }
    }
}

impl Link {
    pub fn ici(axis: usize, dir: Dir) -> Link {
        // Axis indices are below MAX_AXES (3), so the narrowing is lossless.
        Link::Ici {
            axis: axis as u8,
            dir,
        }
    }

    /// The same wire seen from the other end: what the receiver calls the link to the sender.
    pub fn reverse(self, sender_slice: u32) -> Link {
        match self {
            Link::Ici { axis, dir } => Link::Ici {
                axis,
                dir: dir.flip(),
            },
            Link::Dcn { .. } => Link::Dcn {
                peer_slice: sender_slice,
            },
        }
    }

    pub fn is_dcn(self) -> bool {
        matches!(self, Link::Dcn { .. })
    }

    /// Parses `+x`, `-y`, `ici+z` (as displayed) or `dcn1` / `dcn->slice1`.
    pub fn parse(text: &str) -> Result<Link, String> {
        let t = text.trim();
        if let Some(slice) = t
            .strip_prefix("dcn->slice")
            .or_else(|| t.strip_prefix("dcn"))
        {
            return slice
                .parse()
                .map(|peer_slice| Link::Dcn { peer_slice })
                .map_err(|_| format!("{text:?}: expected dcn<slice>"));
        }
        let t = t.strip_prefix("ici").unwrap_or(t);
        let mut chars = t.chars();
        let dir = match chars.next() {
            Some('+') => Dir::Plus,
            Some('-') => Dir::Minus,
            _ => {
                return Err(format!(
                    "{text:?} is not a link (use +x, -y, +z or dcn<slice>)"
                ));
            }
        };
        let axis = match chars.as_str() {
            "x" => 0,
            "y" => 1,
            "z" => 2,
            _ => {
                return Err(format!(
                    "{text:?} is not a link (use +x, -y, +z or dcn<slice>)"
                ));
            }
        };
        Ok(Link::ici(axis, dir))
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const AXES: [char; 3] = ['x', 'y', 'z'];
        match self {
            Link::Ici { axis, dir } => {
                let name = AXES.get(usize::from(*axis)).copied().unwrap_or('?');
                write!(f, "ici{}{name}", dir.sign())
            }
            Link::Dcn { peer_slice } => write!(f, "dcn->slice{peer_slice}"),
        }
    }
}

/// The whole fabric: the torus of each slice and how many slices there are.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pod {
    torus: Torus,
    slices: u32,
}

impl Pod {
    pub fn new(torus: Torus, slices: u32) -> Result<Pod, TopologyError> {
        if slices == 0 {
            return Err(TopologyError::ZeroSlices(slices));
        }
        let chips = u64::from(torus.chips()) * u64::from(slices);
        if chips > MAX_CHIPS {
            return Err(TopologyError::TooManyChips {
                chips,
                max: MAX_CHIPS,
            });
        }
        Ok(Pod { torus, slices })
    }

    /// A single-slice pod.
    pub fn single(torus: Torus) -> Pod {
        Pod { torus, slices: 1 }
    }

    pub fn torus(&self) -> &Torus {
        &self.torus
    }
    pub fn slices(&self) -> u32 {
        self.slices
    }
    pub fn chips_per_slice(&self) -> u32 {
        self.torus.chips()
    }
    pub fn chips(&self) -> u32 {
        self.torus.chips() * self.slices
    }

    pub fn check(&self, chip: ChipId) -> Result<(), TopologyError> {
        if chip < self.chips() {
            Ok(())
        } else {
            Err(TopologyError::NoSuchChip {
                chip: chip.into(),
                chips: self.chips().into(),
            })
        }
    }

    pub fn slice_of(&self, chip: ChipId) -> u32 {
        chip / self.chips_per_slice()
    }
    pub fn rank_in_slice(&self, chip: ChipId) -> u32 {
        chip % self.chips_per_slice()
    }
    pub fn coord(&self, chip: ChipId) -> Coord {
        self.torus.coord(self.rank_in_slice(chip))
    }
    pub fn chip_at(&self, slice: u32, coord: &Coord) -> ChipId {
        slice * self.chips_per_slice() + self.torus.rank(coord)
    }

    /// The chip at the far end of `link` from `chip`, if that link exists.
    pub fn peer(&self, chip: ChipId, link: Link) -> Option<ChipId> {
        let slice = self.slice_of(chip);
        let base = slice * self.chips_per_slice();
        match link {
            Link::Ici { axis, dir } => self
                .torus
                .neighbor(self.rank_in_slice(chip), usize::from(axis), dir)
                .map(|r| base + r),
            Link::Dcn { peer_slice } if peer_slice != slice && peer_slice < self.slices => {
                Some(peer_slice * self.chips_per_slice() + self.rank_in_slice(chip))
            }
            Link::Dcn { .. } => None,
        }
    }

    /// The chip at the end of `route` from `chip`, if the route exists.
    pub fn route_peer(&self, chip: ChipId, route: Route) -> Option<ChipId> {
        match (route.link, route.hops) {
            (_, 1) => self.peer(chip, route.link),
            (Link::Ici { axis, dir }, hops) if hops > 1 => {
                // Arithmetic, not `hops` steps: the hop count may come from a peer's message.
                let axis = usize::from(axis);
                let d = self.torus.dim(axis);
                if axis >= self.torus.ndims() || hops >= d {
                    return None;
                }
                let mut coord = self.coord(chip);
                let x = coord[axis];
                coord[axis] = match dir {
                    Dir::Plus if x + hops < d => x + hops,
                    Dir::Plus if self.torus.wraps(axis) => x + hops - d,
                    Dir::Minus if x >= hops => x - hops,
                    Dir::Minus if self.torus.wraps(axis) => x + d - hops,
                    _ => return None,
                };
                Some(self.chip_at(self.slice_of(chip), &coord))
            }
            _ => None,
        }
    }

    /// How a point-to-point message goes from `src` to `dst` (`None` when they are the same
    /// chip): across DCN first when the slices differ (to the chip at `src`'s place in
    /// `dst`'s slice), then along each torus axis in turn, the short way round on an axis that
    /// wraps (dimension-order routing, as the torus routes a message between chips that are
    /// not neighbours).
    pub fn path(&self, src: ChipId, dst: ChipId) -> Option<Path> {
        if src == dst || src >= self.chips() || dst >= self.chips() {
            return None;
        }
        let (from, to) = (self.coord(src), self.coord(dst));
        let mut first = None;
        let mut ici_hops = 0;
        for axis in 0..self.torus.ndims() {
            let d = self.torus.dim(axis);
            let ahead = (to[axis] + d - from[axis]) % d;
            if ahead == 0 {
                continue;
            }
            let (dir, hops) = match (to[axis] > from[axis], self.torus.wraps(axis)) {
                (_, true) if ahead <= d - ahead => (Dir::Plus, ahead),
                (_, true) => (Dir::Minus, d - ahead),
                (true, false) => (Dir::Plus, to[axis] - from[axis]),
                (false, false) => (Dir::Minus, from[axis] - to[axis]),
            };
            first.get_or_insert(Link::ici(axis, dir));
            ici_hops += hops;
        }
        let dst_slice = self.slice_of(dst);
        let dcn = self.slice_of(src) != dst_slice;
        let link = if dcn {
            Link::Dcn {
                peer_slice: dst_slice,
            }
        } else {
            first?
        };
        Some(Path {
            link,
            ici_hops,
            dcn,
        })
    }

    /// Every outgoing link of `chip` that exists, ICI first then DCN.
    pub fn links(&self, chip: ChipId) -> Vec<Link> {
        let mut links = Vec::new();
        for axis in 0..self.torus.ndims() {
            for dir in [Dir::Plus, Dir::Minus] {
                let link = Link::ici(axis, dir);
                if self.peer(chip, link).is_some() {
                    links.push(link);
                }
            }
        }
        let slice = self.slice_of(chip);
        links.extend(
            (0..self.slices)
                .filter(|&s| s != slice)
                .map(|s| Link::Dcn { peer_slice: s }),
        );
        links
    }
}

impl fmt::Display for Pod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.slices > 1 {
            write!(f, "{} x {} slices", self.torus, self.slices)
        } else {
            write!(f, "{}", self.torus)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(dims: &[u32], slices: u32) -> Pod {
        Pod::new(Torus::new(dims).expect("a torus"), slices).expect("a pod")
    }

    #[test]
    fn paths_go_the_short_way_round_one_axis_after_another() {
        let p = pod(&[8, 4], 1);
        let at = |x: u32, y: u32| p.chip_at(0, &[x, y, 0]);
        // Neighbours: one hop.
        let to_next = p.path(at(0, 0), at(1, 0)).expect("a path");
        assert_eq!(
            (to_next.link, to_next.ici_hops),
            (Link::ici(0, Dir::Plus), 1)
        );
        // 0 -> 6 on a ring of 8 is 2 hops backwards over the wraparound.
        let back = p.path(at(0, 0), at(6, 0)).expect("a path");
        assert_eq!((back.link, back.ici_hops), (Link::ici(0, Dir::Minus), 2));
        // x first, then y: 3 + 2 hops.
        let both = p.path(at(1, 1), at(4, 3)).expect("a path");
        assert_eq!(
            (both.link, both.ici_hops, both.dcn),
            (Link::ici(0, Dir::Plus), 5, false)
        );
        assert_eq!(p.path(at(2, 2), at(2, 2)), None);
    }

    #[test]
    fn paths_without_wraparound_never_cross_the_edge() {
        let p = Pod::single(Torus::with_wrap(&[8], &[false]).expect("a line"));
        let path = p.path(0, 7).expect("a path");
        assert_eq!((path.link, path.ici_hops), (Link::ici(0, Dir::Plus), 7));
        let path = p.path(7, 1).expect("a path");
        assert_eq!((path.link, path.ici_hops), (Link::ici(0, Dir::Minus), 6));
    }

    #[test]
    fn paths_across_slices_take_dcn_first() {
        let p = pod(&[4], 3);
        // Chip 1 of slice 0 to chip 3 of slice 2: DCN, then 2 hops on the ring of 4.
        let path = p.path(1, 2 * 4 + 3).expect("a path");
        assert_eq!(path.link, Link::Dcn { peer_slice: 2 });
        assert_eq!((path.ici_hops, path.dcn), (2, true));
        // The same place in another slice: DCN alone.
        let path = p.path(1, 4 + 1).expect("a path");
        assert_eq!((path.ici_hops, path.dcn), (0, true));
        assert_eq!(p.path(0, 12), None, "chip 12 is outside the pod");
    }
}
