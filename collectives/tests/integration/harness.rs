//! The harness barrier and the chip executor: nobody leaves the barrier before everybody has
//! entered, it sends three messages per chip, a chip that skipped a collective is a desync
//! wherever it sits in the tree, and `run_chips` returns results in chip order,
//! stops every chip at the first error and serves timers and wakers from other threads.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use podsim_collectives::faults::{BeforeCollective, FaultHook, OnSend};
use podsim_collectives::{
    Algo, Chip, CollectiveError, Comm, Fingerprint, LocalFabric, Message, Payload, ReduceOp,
    Symmetry, mirror_chips, run_chips,
};
use podsim_topology::{Group, Hardware, Pod, Torus};

fn pod(shape: &str, wrap: bool, slices: u32) -> Pod {
    let torus: Torus = shape.parse().unwrap();
    Pod::new(torus.set_wrap_all(wrap), slices).unwrap()
}

/// Every chip but one enters at once; chip `late` enters a while later. Nobody may leave
/// before it entered.
fn check_barrier(pod: Pod, late: u32) {
    let chips = pod.chips();
    let fabric = LocalFabric::new(pod.clone(), Hardware::preset("v5p").unwrap());
    let entered = Arc::new(AtomicBool::new(false));
    let left = Arc::new(AtomicUsize::new(0));
    let rt = crate::common::runtime(2);
    let sent = rt
        .block_on(run_chips(fabric.chips(), {
            let (entered, left) = (entered.clone(), left.clone());
            move |mut chip: Chip| {
                let (entered, left) = (entered.clone(), left.clone());
                async move {
                    if chip.id() == late {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        entered.store(true, Ordering::SeqCst);
                    }
                    chip.harness_barrier(Group::world(chip.pod())).await?;
                    assert!(
                        entered.load(Ordering::SeqCst),
                        "chip {} left before chip {late} entered",
                        chip.id()
                    );
                    left.fetch_add(1, Ordering::SeqCst);
                    Ok::<_, CollectiveError>(chip.stats().messages_sent.load(Ordering::Relaxed))
                }
            }
        }))
        .unwrap();
    assert_eq!(left.load(Ordering::SeqCst), chips as usize);
    // A spanning tree: per chip but the root, its parent's word that it entered, one token up
    // and one release down.
    assert_eq!(
        sent.iter().sum::<u64>(),
        3 * (u64::from(chips) - 1),
        "{pod}"
    );
}

#[test]
fn harness_barrier_waits_for_everyone() {
    check_barrier(pod("8", true, 1), 5);
    check_barrier(pod("4x4", false, 1), 15);
    check_barrier(pod("3x4x2", true, 1), 0);
    check_barrier(pod("2x3", true, 3), 17);
    check_barrier(pod("1", true, 1), 0);
}

/// Runs collective `index` of chip `chip` one sequence number ahead (it skipped one).
#[derive(Debug)]
struct SkipAt {
    chip: u32,
    index: u64,
}

impl FaultHook for SkipAt {
    fn at_step(&self, _: u32, _: u64) -> BeforeCollective {
        BeforeCollective::Proceed
    }
    fn before_collective(&self, chip: u32, index: u64, _: &mut Fingerprint) -> BeforeCollective {
        if (chip, index) == (self.chip, self.index) {
            BeforeCollective::Skip
        } else {
            BeforeCollective::Proceed
        }
    }
    fn on_send(&self, _: &mut Message, _: Duration) -> OnSend {
        OnSend::Deliver
    }
}

#[test]
fn a_chip_that_skipped_a_collective_is_a_desync_anywhere_in_the_tree() {
    // 4x4: chip 0 is the root, 3 and 15 leaves along x, 12 the end of the y line, 5 inside.
    for skipper in [0, 3, 5, 12, 15] {
        let fabric = LocalFabric::new(pod("4x4", true, 1), Hardware::preset("v5p").unwrap());
        let rt = crate::common::runtime(2);
        let result = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                run_chips(fabric.chips(), move |mut chip: Chip| async move {
                    chip.set_faults(Arc::new(SkipAt {
                        chip: skipper,
                        index: 1,
                    }));
                    let world = Group::world(chip.pod());
                    chip.harness_barrier(world).await?;
                    chip.harness_barrier(world).await?;
                    Ok::<_, CollectiveError>(())
                }),
            )
            .await
        });
        let err = result
            .unwrap_or_else(|_| panic!("chip {skipper} skipping hung the barrier"))
            .unwrap_err();
        assert!(
            matches!(err, CollectiveError::Desync { .. }),
            "chip {skipper}: {err}"
        );
    }
}

#[test]
fn harness_barrier_on_a_mirror_chip() {
    let rt = crate::common::runtime(1);
    let pod = pod("4x4x4", true, 1);
    let mut chips = mirror_chips(
        pod.clone(),
        Hardware::preset("v5p").unwrap(),
        &Symmetry::of_torus(&pod),
    );
    assert_eq!(chips.len(), 1);
    let chip = chips.remove(0);
    let out = rt
        .block_on(run_chips(vec![chip], |mut chip: Chip| async move {
            chip.harness_barrier(Group::world(chip.pod())).await?;
            Ok::<_, CollectiveError>(chip.id())
        }))
        .unwrap();
    assert_eq!(out, vec![0]);
}

#[test]
fn results_come_back_in_chip_order_on_any_thread_count() {
    for threads in [1, 2, 3] {
        let rt = crate::common::runtime(threads);
        let fabric = LocalFabric::new(pod("5x5x5", true, 1), Hardware::preset("v5p").unwrap());
        let comm = Comm::new(Group::world(fabric.pod()), Algo::Torus);
        let ids = rt
            .block_on(run_chips(
                fabric.chips(),
                move |mut chip: Chip| async move {
                    let sum = chip
                        .all_reduce(&comm, &Payload::from_vec(vec![1.0; 7]), ReduceOp::Sum)
                        .await?;
                    assert_eq!(sum.to_vec().unwrap(), vec![125.0; 7]);
                    Ok::<_, CollectiveError>(chip.id())
                },
            ))
            .unwrap();
        assert_eq!(ids, (0..125).collect::<Vec<u32>>());
    }
}

#[test]
fn the_first_error_stops_every_chip() {
    let rt = crate::common::runtime(2);
    // 200 chips: more than one runnable word, so both threads have chips.
    let fabric = LocalFabric::new(pod("200", true, 1), Hardware::preset("v5p").unwrap());
    let comm = Comm::new(Group::world(fabric.pod()), Algo::Ring);
    let result = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(30),
            run_chips(fabric.chips(), move |mut chip: Chip| async move {
                if chip.id() == 150 {
                    return Err(CollectiveError::Invalid("chip 150 gives up".into()));
                }
                // Everyone else waits for chip 150 forever.
                chip.all_reduce(&comm, &Payload::Meta(400), ReduceOp::Sum)
                    .await?;
                Ok(())
            }),
        )
        .await
    });
    let err = result.expect("stopped, not hung").unwrap_err();
    assert!(err.to_string().contains("chip 150 gives up"), "{err}");
}

#[test]
fn a_panicking_chip_is_an_error() {
    let rt = crate::common::runtime(2);
    let fabric = LocalFabric::new(pod("4", true, 1), Hardware::preset("v5p").unwrap());
    let result = rt.block_on(run_chips(fabric.chips(), |chip: Chip| async move {
        if chip.id() == 2 {
            panic!("chip 2 trips");
        }
        Ok::<_, CollectiveError>(())
    }));
    let err = result.unwrap_err();
    assert!(err.to_string().contains("chip 2 panicked"), "{err}");
}
