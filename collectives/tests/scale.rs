//! Virtual time at scale: the dimension-ordered closed forms on a 4096-chip torus, and the
//! mirror fabric (one chip standing for all) against the full simulation.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use podsim_collectives::{Algo, Comm, OpKind, Payload, ReduceOp, mirror_chip};
use podsim_topology::{Group, Hardware};

/// Virtual time (max over chips) of one meta-mode collective of `count` f32 per chip, every
/// chip simulated.
fn full(shape: &str, slices: u32, algo: Algo, op: OpKind, count: usize) -> f64 {
    let fabric = fabric(shape, true, slices);
    let comm = Comm::new(Group::world(fabric.pod()), algo);
    let out = runtime(2)
        .block_on(run_op(&fabric, comm, op, ReduceOp::Sum, count, true, 0))
        .expect("collective");
    out.iter().map(|(_, _, t)| *t).fold(0.0, f64::max)
}

/// The same on the mirror fabric: chip 0 alone.
fn mirrored(shape: &str, slices: u32, algo: Algo, op: OpKind, count: usize) -> f64 {
    let fabric = fabric(shape, true, slices);
    let pod = fabric.pod().clone();
    let comm = Comm::new(Group::world(&pod), algo);
    let mut chip = mirror_chip(pod, Hardware::preset("v5p").unwrap());
    runtime(1).block_on(async move {
        let data = Payload::Meta(count);
        match op {
            OpKind::AllReduce => chip.all_reduce(&comm, &data, ReduceOp::Sum).await,
            OpKind::ReduceScatter => chip.reduce_scatter(&comm, &data, ReduceOp::Sum).await,
            OpKind::AllGather => chip.all_gather(&comm, &data).await,
            OpKind::AllToAll => chip.all_to_all(&comm, &data).await,
            other => panic!("not a symmetric collective: {other:?}"),
        }
        .expect("collective");
        chip.clock()
    })
}

fn close(got: f64, want: f64) {
    assert!(
        (got - want).abs() <= 1e-9 * want,
        "virtual time {got} ns, closed form {want} ns"
    );
}

/// `(n-1) * (alpha + v / (2 n W))` per axis, the volume shrinking `n`-fold after each axis.
fn dimension_ordered_reduce_scatter(n: f64, axes: i32, v: f64, alpha: f64, w: f64) -> f64 {
    (0..axes)
        .map(|k| (n - 1.0) * (alpha + v / n.powi(k) / (2.0 * n * w)))
        .sum()
}

#[test]
fn a_4096_chip_torus_matches_the_dimension_ordered_closed_forms() {
    let hw = Hardware::preset("v5p").unwrap();
    let (alpha, w) = (hw.ici_latency_ns, hw.ici_bandwidth / 1e9);
    let n = 16.0;
    // Divisible by 16^3 blocks and by the torus algorithm's three parts: no padding.
    let count = 16 * 16 * 16 * 3 * 64;
    let v = (count * 4) as f64;
    // Bidirectional rings, one axis after another.
    let rs = dimension_ordered_reduce_scatter(n, 3, v, alpha, w);
    close(
        full("16x16x16", 1, Algo::BidirRing, OpKind::AllReduce, count),
        2.0 * rs,
    );
    // Torus: three thirds of the buffer, each on its own axis at every phase, at once.
    let rs_part = dimension_ordered_reduce_scatter(n, 3, v / 3.0, alpha, w);
    close(
        full("16x16x16", 1, Algo::Torus, OpKind::AllReduce, count),
        2.0 * rs_part,
    );
}

#[test]
fn the_mirror_fabric_reproduces_every_chip_of_a_symmetric_job() {
    let count = 4 * 4 * 4 * 3 * 8;
    for (shape, slices) in [("4x4x4", 1), ("4x4", 3), ("8", 2)] {
        for algo in Algo::ALL {
            for op in [
                OpKind::AllReduce,
                OpKind::ReduceScatter,
                OpKind::AllGather,
                OpKind::AllToAll,
            ] {
                let want = full(shape, slices, algo, op, count);
                let got = mirrored(shape, slices, algo, op, count);
                assert!(
                    (got - want).abs() <= 1e-9 * want,
                    "{op:?} {algo} on {slices} x {shape}: mirror {got} ns, full {want} ns"
                );
            }
        }
    }
}
