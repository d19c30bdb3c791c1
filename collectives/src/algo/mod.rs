//! Collective algorithms. Every algorithm only talks to torus neighbours (and DCN peers), and
//! every receive names its link and tag, so virtual time is deterministic.
//!
//! Structure, bottom up:
//! - [`lane`]: one direction of data flow along one axis (a ring or, without wraparound, a
//!   line), with its own virtual clock. Reduce-scatter, all-gather and all-to-all lanes.
//! - [`phase`]: one axis of a multi-axis collective: one or two lanes run concurrently
//!   (a bidirectional ring sends half the data each way).
//! - [`schedule`]: a whole collective as phases over the group's axes. The `torus` algorithm
//!   splits the buffer into one part per ICI axis and rotates the axis order per part, so the
//!   links of every axis are busy at once; DCN always comes last in reduce-scatter (first in
//!   all-gather), which makes multislice collectives hierarchical.

pub(crate) mod lane;
pub(crate) mod phase;
pub(crate) mod schedule;

use podsim_topology::{Dir, Link, PodAxis, Route};
use serde::{Deserialize, Serialize};

/// Which algorithm a collective uses on each axis of its group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algo {
    /// Unidirectional ring per axis, axes one after another.
    Ring,
    /// Bidirectional ring per axis (half the data each way), axes one after another.
    BidirRing,
    /// Bidirectional rings on every axis at once: one part of the buffer per axis, each part
    /// visiting the axes in a rotated order.
    Torus,
}

crate::named_enum!(Algo, "algorithm", {
    Ring => "ring",
    BidirRing => "bidir-ring",
    Torus => "torus",
});

/// One axis of a collective's group as this chip sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AxisPath {
    pub axis: PodAxis,
    /// Chips along the axis.
    pub n: usize,
    /// This chip's position along it.
    pub pos: usize,
    pub wrap: bool,
    /// Torus hops between consecutive positions (more than 1 on a strided part of an axis).
    pub hops: u32,
}

impl AxisPath {
    /// (send, receive) routes of the lane that moves data towards higher positions (`Plus`)
    /// or lower ones (`Minus`).
    pub fn links(&self, dir: Dir) -> (Route, Route) {
        let (send, recv) = self.link_pair(dir);
        let route = |link| Route {
            link,
            hops: self.hops,
        };
        (route(send), route(recv))
    }

    fn link_pair(&self, dir: Dir) -> (Link, Link) {
        match self.axis {
            PodAxis::Torus(a) => {
                let a = usize::from(a);
                (Link::ici(a, dir), Link::ici(a, dir.flip()))
            }
            PodAxis::Slices => {
                let (n, p) = (self.n as u32, self.pos as u32);
                let next = (p + 1) % n;
                let prev = (p + n - 1) % n;
                match dir {
                    Dir::Plus => (
                        Link::Dcn { peer_slice: next },
                        Link::Dcn { peer_slice: prev },
                    ),
                    Dir::Minus => (
                        Link::Dcn { peer_slice: prev },
                        Link::Dcn { peer_slice: next },
                    ),
                }
            }
        }
    }
}

/// How one axis is traversed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PhaseKind {
    /// One lane around the ring, carrying whole groups.
    UniRing,
    /// Two lanes around the ring, each carrying half of every group.
    BidirRing,
    /// No wraparound: two lanes along the line, each serving the chips on its side.
    Line,
}

impl PhaseKind {
    pub fn of(path: &AxisPath, algo: Algo) -> PhaseKind {
        if path.axis == PodAxis::Slices {
            // One DCN egress per chip: a second direction would not add bandwidth.
            PhaseKind::UniRing
        } else if !path.wrap {
            PhaseKind::Line
        } else if algo == Algo::Ring {
            PhaseKind::UniRing
        } else {
            PhaseKind::BidirRing
        }
    }
}
