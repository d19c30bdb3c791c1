//! Virtual time at scale: the dimension-ordered closed forms on a 4096-chip torus, and the
//! mirror fabric (one chip standing for all) against the full simulation.
#![allow(clippy::unwrap_used)]

use crate::common::*;
use podsim_collectives::{Algo, Comm, OpKind, ReduceOp, Symmetry, mirror_chips};
use podsim_topology::{Group, Hardware};

/// Virtual time (max over chips) of one meta-mode collective of `count` f32 per chip, every
/// chip simulated (`mirror`: on the mirror fabric, one chip per class of chips alike under
/// the torus's translations; one chip when every axis wraps), and how many chips ran.
fn virtual_time(
    shape: &str,
    wrap: bool,
    slices: u32,
    algo: Algo,
    op: OpKind,
    count: usize,
    mirror: bool,
) -> (f64, usize) {
    let fabric = fabric(shape, wrap, slices);
    let pod = fabric.pod().clone();
    let chips = if mirror {
        let symmetry = Symmetry::of_torus(&pod);
        mirror_chips(pod.clone(), Hardware::preset("v5p").unwrap(), &symmetry)
    } else {
        fabric.chips()
    };
    let comm = Comm::new(Group::world(&pod), algo);
    let out = runtime(2)
        .block_on(run_op(chips, comm, op, ReduceOp::Sum, count, true, 0))
        .expect("collective");
    (
        out.iter().map(|(_, _, t)| *t).fold(0.0, f64::max),
        out.len(),
    )
}

fn full(shape: &str, slices: u32, algo: Algo, op: OpKind, count: usize) -> f64 {
    virtual_time(shape, true, slices, algo, op, count, false).0
}

fn close(got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-9 * want,
        "virtual time {got} ns, closed form {want} ns"
    );
}

/// `(n-1) * (alpha + v / (2 n W))` per axis, the volume shrinking `n`-fold after each axis.
fn dimension_ordered_links(n: f64, axes: i32, v: f64, m: &LinkModel) -> f64 {
    (0..axes)
        .map(|k| (n - 1.0) * (m.alpha + v / n.powi(k) / (2.0 * n * m.w)))
        .sum()
}

/// The reductions of those phases: each of `sharing` lanes reduces its `v / (lanes n)` per
/// step, the lanes sharing HBM.
fn dimension_ordered_reductions(n: f64, axes: i32, v: f64, lanes: f64, m: &LinkModel) -> f64 {
    (0..axes)
        .map(|k| (n - 1.0) * m.reduce(v / n.powi(k) / (2.0 * n), lanes))
        .sum()
}

#[test]
fn a_4096_chip_torus_matches_the_dimension_ordered_closed_forms() {
    let m = LinkModel::of(&Hardware::preset("v5p").unwrap());
    let n = 16.0;
    // Divisible by 16^3 blocks and by the torus algorithm's three parts: no padding.
    let count = 16 * 16 * 16 * 3 * 64;
    let v = (count * 4) as f64;
    // Bidirectional rings, one axis after another: two lanes at once.
    let links = dimension_ordered_links(n, 3, v, &m);
    let reductions = dimension_ordered_reductions(n, 3, v, 2.0, &m);
    close(
        full("16x16x16", 1, Algo::BidirRing, OpKind::AllReduce, count),
        m.overhead + 2.0 * links + reductions,
    );
    // Torus: three thirds of the buffer, each on its own axis at every phase, at once: six
    // lanes share HBM.
    let links = dimension_ordered_links(n, 3, v / 3.0, &m);
    let reductions = dimension_ordered_reductions(n, 3, v / 3.0, 6.0, &m);
    close(
        full("16x16x16", 1, Algo::Torus, OpKind::AllReduce, count),
        m.overhead + 2.0 * links + reductions,
    );
}

#[test]
fn the_mirror_fabric_reproduces_every_chip_of_a_symmetric_job() {
    let count = 4 * 4 * 4 * 3 * 8;
    // (shape, wraparound, slices, chips the mirror runs): a torus that wraps needs one chip;
    // one that does not, every position of slice 0 (the slices are still alike).
    for (shape, wrap, slices, classes) in [
        ("4x4x4", true, 1, 1),
        ("4x4", true, 3, 1),
        ("8", true, 2, 1),
        ("4x4", false, 3, 16),
        ("8", false, 2, 8),
    ] {
        for algo in Algo::ALL {
            for op in [
                OpKind::AllReduce,
                OpKind::ReduceScatter,
                OpKind::AllGather,
                OpKind::AllToAll,
            ] {
                let case = |mirror| virtual_time(shape, wrap, slices, algo, op, count, mirror);
                let ((want, _), (got, ran)) = (case(false), case(true));
                let what = format!("{op:?} {algo} on {slices} x {shape} (wrap {wrap})");
                assert!(
                    (got - want).abs() <= 1e-9 * want,
                    "{what}: mirror {got} ns, full {want} ns"
                );
                assert_eq!(ran, classes, "{what}");
            }
        }
    }
}
