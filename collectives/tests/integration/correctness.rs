//! Every algorithm x collective x reduce op on shapes {8, 3x5, 4x4, 2x3x4, 4x4x4} (and without
//! wraparound, and across slices) with element counts {1, n-1, n+1, large}, in data and meta
//! mode: results equal the naive reference, and meta mode gives the same lengths and the same
//! virtual time as data mode.
#![allow(clippy::unwrap_used)]

use crate::common::*;
use podsim_collectives::{Algo, Comm, LocalFabric, OpKind, ReduceOp};
use podsim_topology::{AxisPart, Group, Hardware, PodAxis};

fn cases() -> Vec<(OpKind, ReduceOp)> {
    let mut v: Vec<(OpKind, ReduceOp)> = Vec::new();
    for r in ReduceOp::ALL {
        v.push((OpKind::AllReduce, r));
        v.push((OpKind::ReduceScatter, r));
    }
    for op in [
        OpKind::AllGather,
        OpKind::Broadcast,
        OpKind::AllToAll,
        OpKind::Barrier,
        OpKind::SendRecv,
    ] {
        v.push((op, ReduceOp::Sum));
    }
    v
}

fn check_group(fabric: &LocalFabric, group: Group, algo: Algo, label: &str) {
    let pod = fabric.pod().clone();
    let n = group.size(&pod) as usize;
    let rt = runtime(2);
    for count in [1, n.saturating_sub(1).max(1), n + 1, 64 * n + 7] {
        for (salt, &(op, reduce)) in cases().iter().enumerate() {
            let comm = Comm::new(group, algo);
            let salt = salt as u32;
            let what = format!("{label} {algo} {op} {reduce} count={count}");
            let data = rt
                .block_on(run_op(fabric.chips(), comm, op, reduce, count, false, salt))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let meta = rt
                .block_on(run_op(fabric.chips(), comm, op, reduce, count, true, salt))
                .unwrap_or_else(|e| panic!("{what} (meta): {e}"));
            for chip in 0..pod.chips() {
                let want = expected(&pod, group, chip, op, reduce, count, salt);
                let (got, len, t) = &data[chip as usize];
                let exact = !matches!(op, OpKind::AllReduce | OpKind::ReduceScatter);
                if op != OpKind::Barrier {
                    let got = got.as_ref().expect("data mode returns values");
                    assert_close(got, &want, reduce, exact, &format!("{what} chip {chip}"));
                }
                let (mgot, mlen, mt) = &meta[chip as usize];
                assert!(mgot.is_none() || op == OpKind::Barrier);
                assert_eq!(mlen, len, "{what} chip {chip}: meta length");
                assert_eq!(mt, t, "{what} chip {chip}: meta virtual time");
            }
        }
    }
}

fn check_shape(shape: &str, wrap: bool) {
    let fabric = fabric(shape, wrap, 1);
    let world = Group::world(fabric.pod());
    for algo in Algo::ALL {
        check_group(&fabric, world, algo, &format!("{shape} wrap={wrap}"));
    }
}

#[test]
fn ring_of_8() {
    check_shape("8", true);
}

#[test]
fn torus_3x5() {
    check_shape("3x5", true);
}

#[test]
fn torus_4x4() {
    check_shape("4x4", true);
}

#[test]
fn torus_2x3x4() {
    check_shape("2x3x4", true);
}

#[test]
fn torus_4x4x4() {
    check_shape("4x4x4", true);
}

#[test]
fn without_wraparound() {
    check_shape("8", false);
    check_shape("3x5", false);
    check_shape("2x3x4", false);
}

#[test]
fn subgroups_and_single_chip_groups() {
    let fabric = fabric("2x3x4", true, 1);
    for axes in [
        vec![PodAxis::Torus(1)],
        vec![PodAxis::Torus(0), PodAxis::Torus(2)],
        vec![],
    ] {
        let group = Group::of(&axes);
        for algo in Algo::ALL {
            check_group(&fabric, group, algo, &format!("group {group}"));
        }
    }
}

/// Groups on parts of torus axes, as device meshes that do not factor the pod into whole
/// axes make them: strided parts whose members are several hops apart (rings when they reach
/// around a wrapping axis, lines otherwise) and contiguous segments (lines).
#[test]
fn parts_of_axes_are_correct() {
    let part = |axis, stride, extent| AxisPart {
        axis: PodAxis::Torus(axis),
        stride,
        extent,
    };
    for (shape, wrap, parts) in [
        ("4x8", true, vec![part(1, 2, 4)]),
        ("4x8", true, vec![part(1, 1, 2), part(0, 1, 4)]),
        ("4x8", true, vec![part(1, 4, 2), part(0, 2, 2)]),
        ("2x6", false, vec![part(1, 2, 3)]),
        ("2x6", false, vec![part(1, 1, 3), part(0, 1, 2)]),
    ] {
        let fabric = fabric(shape, wrap, 1);
        let pod = fabric.pod().clone();
        let group = parts
            .iter()
            .try_fold(Group::default(), |g, &p| g.with_part(p, &pod))
            .unwrap();
        for algo in Algo::ALL {
            check_group(&fabric, group, algo, &format!("{shape} group {group}"));
        }
    }
}

/// Members of a strided part are `stride` hops apart, and `stride` interleaved groups share
/// every wire of the axis: a message holds its link `stride` times as long and pays every
/// hop's latency (closed form, one-way ring of two chips four hops apart).
#[test]
fn a_strided_part_shares_the_wires_it_crosses() {
    let fabric = fabric("8", true, 1);
    let pod = fabric.pod().clone();
    let hw = Hardware::preset("v5p").unwrap();
    let group = Group::default()
        .with_part(
            AxisPart {
                axis: PodAxis::Torus(0),
                stride: 4,
                extent: 2,
            },
            &pod,
        )
        .unwrap();
    let count = 1 << 16;
    let rt = runtime(2);
    let out = rt
        .block_on(run_op(
            fabric.chips(),
            Comm::new(group, Algo::Ring),
            OpKind::AllGather,
            ReduceOp::Sum,
            count,
            true,
            0,
        ))
        .unwrap();
    let bytes = 4.0 * count as f64;
    let m = LinkModel::of(&hw);
    let want = m.overhead + 4.0 * (bytes / m.w + m.alpha);
    for (chip, (_, len, t)) in out.iter().enumerate() {
        assert_eq!(*len, 2 * count);
        assert!(
            (t - want).abs() < 1e-6 * want,
            "chip {chip}: {t} ns, want {want}"
        );
    }
}

#[test]
fn multislice_is_hierarchical_and_correct() {
    let fabric = fabric("2x3", true, 3);
    let pod = fabric.pod().clone();
    for group in [
        Group::world(&pod),
        Group::of(&[PodAxis::Slices]),
        Group::slice(&pod),
    ] {
        for algo in Algo::ALL {
            check_group(
                &fabric,
                group,
                algo,
                &format!("3 slices of 2x3, group {group}"),
            );
        }
    }
}
