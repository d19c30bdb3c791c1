//! Placement of chips onto worker processes: each worker gets a contiguous block (a box of the
//! torus, or whole slices), chosen to minimise the links whose ends sit on different workers,
//! because those links leave the process and cost real network traffic.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::TopologyError;
use crate::pod::{ChipId, Link, Pod};
use crate::torus::Dir;

/// Which worker hosts each chip.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    workers: u32,
    owner: Vec<u32>,
    crossing_links: u64,
}

impl Placement {
    /// Places the chips of `pod` onto `workers` processes.
    pub fn new(pod: &Pod, workers: u32) -> Result<Placement, TopologyError> {
        let chips = pod.chips();
        let err = |reason: &str| TopologyError::Placement {
            chips: chips.into(),
            workers: workers.into(),
            reason: reason.to_string(),
        };
        if workers == 0 {
            return Err(err("at least one worker is needed"));
        }
        if workers > chips {
            return Err(err("more workers than chips"));
        }
        let candidates = box_splits(pod, workers);
        let best = candidates
            .into_iter()
            .map(|owner| Placement::from_owner(pod, workers, owner))
            .min_by_key(|p| p.crossing_links);
        Ok(best.unwrap_or_else(|| {
            // No box split exists (e.g. a prime number of workers that divides no axis):
            // contiguous rank ranges of near-equal size.
            let owner = (0..chips)
                .map(|c| (u64::from(c) * u64::from(workers) / u64::from(chips)) as u32)
                .collect();
            Placement::from_owner(pod, workers, owner)
        }))
    }

    fn from_owner(pod: &Pod, workers: u32, owner: Vec<u32>) -> Placement {
        let crossing_links = crossing_ici(pod, &owner) + crossing_dcn(pod, &owner);
        Placement {
            workers,
            owner,
            crossing_links,
        }
    }

    pub fn workers(&self) -> u32 {
        self.workers
    }

    /// The worker hosting `chip`.
    pub fn worker_of(&self, chip: ChipId) -> u32 {
        self.owner[chip as usize]
    }

    /// The chips of `worker`, ascending.
    pub fn chips_of(&self, worker: u32) -> Vec<ChipId> {
        (0..self.owner.len() as u32)
            .filter(|&c| self.owner[c as usize] == worker)
            .collect()
    }

    /// Directed links (ICI and DCN) whose two ends are on different workers.
    pub fn crossing_links(&self) -> u64 {
        self.crossing_links
    }
}

/// Directed ICI links whose ends `owner` puts on different workers (at most six a chip).
fn crossing_ici(pod: &Pod, owner: &[u32]) -> u64 {
    let links: Vec<Link> = (0..pod.torus().ndims())
        .flat_map(|axis| [Dir::Plus, Dir::Minus].map(|dir| Link::ici(axis, dir)))
        .collect();
    let crossing = (0..pod.chips())
        .flat_map(|c| {
            links
                .iter()
                .filter_map(move |&l| Some((c, pod.peer(c, l)?)))
        })
        .filter(|&(c, peer)| owner[peer as usize] != owner[c as usize])
        .count();
    u64::try_from(crossing).unwrap_or(u64::MAX)
}

/// Directed DCN links whose ends `owner` puts on different workers. Every chip has one to
/// each other slice (the chip of the same rank there): counted one by one that is chips x
/// slices, so per rank instead: of the `slices` chips of a rank, the `k` on one worker each
/// have `slices - k` links leaving it.
fn crossing_dcn(pod: &Pod, owner: &[u32]) -> u64 {
    let (slices, per_slice) = (pod.slices(), pod.chips_per_slice());
    if slices < 2 {
        return 0;
    }
    let mut on: HashMap<u32, u64> = HashMap::new();
    let mut crossing = 0u64;
    for rank in 0..per_slice {
        on.clear();
        for slice in 0..slices {
            *on.entry(owner[(slice * per_slice + rank) as usize])
                .or_default() += 1;
        }
        crossing += on
            .values()
            .map(|&k| k * (u64::from(slices) - k))
            .sum::<u64>();
    }
    crossing
}

/// Every way to cut the pod into `workers` equal boxes: whole groups of slices, or each slice
/// cut by a factor along each torus axis.
fn box_splits(pod: &Pod, workers: u32) -> Vec<Vec<u32>> {
    let slices = pod.slices();
    let mut out = Vec::new();
    if workers <= slices && slices.is_multiple_of(workers) {
        let per = slices / workers;
        out.push((0..pod.chips()).map(|c| pod.slice_of(c) / per).collect());
    }
    if workers.is_multiple_of(slices) {
        let per_slice = workers / slices;
        let dims = pod.torus().dims().to_vec();
        for cuts in factorizations(per_slice, &dims) {
            let owner = (0..pod.chips())
                .map(|c| {
                    let coord = pod.coord(c);
                    let mut w = 0;
                    for axis in (0..dims.len()).rev() {
                        let block = dims[axis] / cuts[axis];
                        w = w * cuts[axis] + coord[axis] / block;
                    }
                    pod.slice_of(c) * per_slice + w
                })
                .collect();
            out.push(owner);
        }
    }
    out
}

/// Ways to write `n` as a product of per-axis factors, each dividing its axis.
fn factorizations(n: u32, dims: &[u32]) -> Vec<Vec<u32>> {
    let Some((&first, rest)) = dims.split_first() else {
        return if n == 1 { vec![vec![]] } else { vec![] };
    };
    let mut out = Vec::new();
    for f in (1..=first.min(n)).filter(|&f| first.is_multiple_of(f) && n.is_multiple_of(f)) {
        for mut tail in factorizations(n / f, rest) {
            tail.insert(0, f);
            out.push(tail);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Torus;

    #[test]
    fn splits_the_slowest_axis_of_a_cube() {
        let pod = Pod::single("4x4x4".parse::<Torus>().unwrap());
        let p = Placement::new(&pod, 4).unwrap();
        // Four 4x4x1 planes: 4 cuts around the z ring, 16 links each, both directions = 128
        // directed links. No 4-way box split of a 4x4x4 torus crosses fewer.
        assert_eq!(p.crossing_links(), 128);
        for w in 0..4 {
            assert_eq!(p.chips_of(w).len(), 16);
        }
    }

    /// Every directed link, one by one.
    fn crossing_by_hand(pod: &Pod, p: &Placement) -> u64 {
        (0..pod.chips())
            .flat_map(|c| pod.links(c).into_iter().map(move |l| (c, l)))
            .filter(|&(c, l)| {
                pod.peer(c, l)
                    .is_some_and(|peer| p.worker_of(peer) != p.worker_of(c))
            })
            .count() as u64
    }

    #[test]
    fn crossing_links_are_counted_as_one_by_one() {
        for (shape, slices) in [("4x4x4", 1), ("2x2", 6), ("4x2", 5), ("3", 4), ("2x1x3", 3)] {
            let pod = Pod::new(shape.parse::<Torus>().unwrap(), slices).unwrap();
            for workers in 1..=pod.chips().min(12) {
                let p = Placement::new(&pod, workers).unwrap();
                assert_eq!(
                    p.crossing_links(),
                    crossing_by_hand(&pod, &p),
                    "{shape} x {slices} slices on {workers} workers"
                );
            }
        }
    }

    #[test]
    fn rejects_more_workers_than_chips() {
        let pod = Pod::single("2x2".parse::<Torus>().unwrap());
        assert!(Placement::new(&pod, 5).is_err());
        assert!(Placement::new(&pod, 0).is_err());
        // 3 workers on 4 chips: no box split, falls back to ranges.
        assert_eq!(Placement::new(&pod, 3).unwrap().workers(), 3);
    }
}
