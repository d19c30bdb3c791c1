//! A chip that enters a different collective than its group gets a desync error that names
//! both chips and both fingerprints, within a second, instead of a hang or garbage.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use crate::common::*;
use podsim_collectives::{Algo, CollectiveError, Comm, OpKind, Payload, ReduceOp, run_chips};
use podsim_topology::Group;

fn run_mismatch(
    shape: &str,
    algo: Algo,
    odd_chip: u32,
    odd: OpKind,
    odd_count: usize,
) -> CollectiveError {
    let fabric = fabric(shape, true, 1);
    let comm = Comm::new(Group::world(fabric.pod()), algo);
    let rt = runtime(2);
    let started = Instant::now();
    let result = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(1),
            run_chips(fabric.chips(), move |mut chip| async move {
                // One collective everybody agrees on first, so the desync is on seq 1.
                chip.barrier(&comm).await?;
                if chip.id() == odd_chip {
                    let data = Payload::from_vec(vec![1.0; odd_count]);
                    match odd {
                        OpKind::AllGather => chip.all_gather(&comm, &data).await?,
                        _ => chip.all_reduce(&comm, &data, ReduceOp::Max).await?,
                    };
                } else {
                    chip.all_reduce(&comm, &Payload::from_vec(vec![1.0; 1000]), ReduceOp::Sum)
                        .await?;
                }
                Ok::<(), CollectiveError>(())
            }),
        )
        .await
    });
    let elapsed = started.elapsed();
    let err = result
        .expect("desync must be reported within a second, not hang")
        .unwrap_err();
    assert!(elapsed < Duration::from_secs(1));
    err
}

fn assert_names_both(err: &CollectiveError, odd_chip: u32, odd_op: OpKind) {
    let CollectiveError::Desync {
        chip,
        expected,
        peer,
        got,
        ..
    } = err
    else {
        panic!("expected a desync, got {err}");
    };
    assert_ne!(chip, peer);
    assert!(*chip == odd_chip || *peer == odd_chip, "{err}");
    assert_eq!(expected.seq, 1);
    assert_eq!(got.seq, 1);
    assert_ne!(expected, got);
    let ops = [expected.op, got.op];
    assert!(ops.contains(&odd_op), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("chip {chip}")) && text.contains(&format!("chip {peer}")),
        "{text}"
    );
}

#[test]
fn different_op_is_a_desync() {
    let err = run_mismatch("4x4", Algo::Torus, 5, OpKind::AllGather, 1000);
    assert_names_both(&err, 5, OpKind::AllGather);
}

#[test]
fn every_algorithm_reports_a_desync_whatever_link_it_waits_on() {
    // A ring waits on one link while the out-of-step message may arrive on another.
    for algo in Algo::ALL {
        for (shape, odd_chip) in [("4x4", 5), ("2x3x4", 23), ("8", 0)] {
            let err = run_mismatch(shape, algo, odd_chip, OpKind::AllGather, 1000);
            assert_names_both(&err, odd_chip, OpKind::AllGather);
        }
    }
}

#[test]
fn different_size_or_reduce_op_is_a_desync() {
    let err = run_mismatch("2x3x4", Algo::Torus, 0, OpKind::AllReduce, 999);
    assert_names_both(&err, 0, OpKind::AllReduce);
}

#[test]
fn debug_mode_compares_fingerprints_before_any_data_moves() {
    let fabric = fabric("2x2x2", true, 1);
    let comm = Comm::new(Group::world(fabric.pod()), Algo::Torus).verified(true);
    let rt = runtime(2);
    let result = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(5),
            run_chips(fabric.chips(), move |mut chip| async move {
                // Agreeing collectives pass the check.
                let sum = chip
                    .all_reduce(&comm, &Payload::from_vec(vec![1.0; 10]), ReduceOp::Sum)
                    .await?;
                assert_eq!(sum.to_vec().unwrap(), vec![8.0; 10]);
                let count = if chip.id() == 6 { 999 } else { 1000 };
                chip.all_reduce(&comm, &Payload::from_vec(vec![1.0; count]), ReduceOp::Sum)
                    .await?;
                Ok::<(), CollectiveError>(())
            }),
        )
        .await
    });
    let err = result.expect("no hang").unwrap_err();
    let CollectiveError::Mismatch {
        chip,
        mine,
        peer,
        theirs,
    } = &err
    else {
        panic!("expected a fingerprint mismatch, got {err}");
    };
    assert!(*chip == 6 || *peer == 6, "{err}");
    assert_eq!(mine.seq, 1);
    assert!(theirs.contains("999") || mine.count == 999, "{err}");
}
