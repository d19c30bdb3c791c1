//! Point-to-point messages: any chip to any chip, one channel per ordered pair and tag, the
//! closed-form virtual time of a path, and a desync when a receive expects another size.
#![allow(clippy::unwrap_used)]

use std::future::Future;

use crate::common::{fabric, input, runtime};
use podsim_collectives::{Chip, CollectiveError, LocalFabric, Payload, run_chips};
use podsim_topology::Hardware;

/// Runs `program` on every chip of `fabric` (two threads).
fn on_chips<T, F, Fut>(fabric: &LocalFabric, program: F) -> Result<Vec<T>, CollectiveError>
where
    F: Fn(Chip) -> Fut,
    Fut: Future<Output = Result<T, CollectiveError>> + Send + 'static,
    T: Send + 'static,
{
    runtime(2).block_on(run_chips(fabric.chips(), program))
}

#[test]
fn every_chip_sends_to_a_far_chip_and_gets_what_was_sent() {
    // 4x4 in 2 slices: the permutation i -> 7i + 3 (mod 32) sends most messages over several
    // axes, half of them across DCN.
    let fabric = fabric("4x4", true, 2);
    let n = fabric.pod().chips();
    let to = move |i: u32| (7 * i + 3) % n;
    let from = move |j: u32| (0..n).find(|&i| to(i) == j).unwrap();
    let got = on_chips(&fabric, move |mut chip: Chip| async move {
        let me = chip.id();
        let data = Payload::from_vec(input(me, 33, 1));
        if to(me) != me {
            chip.send_to(to(me), &data, 0).await?;
        }
        let src = from(me);
        let out = if src == me {
            data
        } else {
            chip.recv_from(src, 33, 0).await?
        };
        Ok::<_, CollectiveError>(out.to_vec().unwrap())
    })
    .unwrap();
    for (me, values) in got.iter().enumerate() {
        assert_eq!(values, &input(from(me as u32), 33, 1), "chip {me}");
    }
}

/// Chip 0's message to `dst` on `shape` x `slices` of v5p: (arrival at the receiver, the
/// sender's clock after the send).
fn one_message(shape: &str, slices: u32, dst: u32, count: usize) -> (f64, f64) {
    let fabric = fabric(shape, true, slices);
    let times = on_chips(&fabric, move |mut chip: Chip| async move {
        match chip.id() {
            0 => chip.send_to(dst, &Payload::Meta(count), 0).await?,
            id if id == dst => {
                chip.recv_from(0, count, 0).await?;
            }
            _ => {}
        }
        Ok::<_, CollectiveError>(chip.clock())
    })
    .unwrap();
    (times[dst as usize], times[0])
}

#[test]
fn a_message_costs_its_launch_a_transfer_and_every_hop() {
    let hw = Hardware::preset("v5p").unwrap();
    let count = 1 << 20;
    let bytes = 4.0 * count as f64;
    // 8x8: chip 0 to (3, 5) is 3 hops on x, then 3 on y the short way round.
    let (arrive, sent) = one_message("8x8", 1, 5 * 8 + 3, count);
    // A point-to-point message is the collective's fixed cost (its launch), then one
    // transfer.
    let launch = hw.collective_overhead_ns;
    assert!(launch > 0.0);
    let transfer = bytes / (hw.ici_bandwidth * hw.ici_efficiency) * 1e9;
    let want = launch + transfer + 6.0 * hw.ici_latency_ns;
    assert!((arrive - want).abs() < 1e-6 * want, "{arrive} vs {want}");
    assert!(
        (sent - launch - transfer).abs() < 1e-6 * transfer,
        "{sent} vs {launch} + {transfer}"
    );
    // Across slices: through the hosts (PCIe into the sender's host, its share of the NICs,
    // the network, PCIe into the receiver), then 2 ICI hops on the ring of 8.
    let (arrive, _) = one_message("8", 2, 8 + 2, count);
    let pcie = bytes / hw.host_bandwidth * 1e9;
    let nic = bytes / (hw.dcn_bandwidth * hw.dcn_efficiency) * 1e9;
    let want = launch + pcie + nic + hw.dcn_latency_ns + pcie + 2.0 * hw.ici_latency_ns;
    assert!((arrive - want).abs() < 1e-6 * want, "{arrive} vs {want}");
}

#[test]
fn channels_are_matched_per_pair_and_tag_in_order() {
    let fabric = fabric("4", true, 1);
    let got = on_chips(&fabric, |mut chip: Chip| async move {
        let v = |x: f32| Payload::from_vec(vec![x]);
        let mut out = Vec::new();
        match chip.id() {
            // Two tags, two messages on tag 1; and a message to chip 2 in between.
            0 => {
                chip.send_to(1, &v(10.0), 1).await?;
                chip.send_to(2, &v(99.0), 1).await?;
                chip.send_to(1, &v(11.0), 1).await?;
                chip.send_to(1, &v(20.0), 2).await?;
            }
            // Receives tag 2 first: channels do not wait on each other.
            1 => {
                for tag in [2, 1, 1] {
                    out.extend(chip.recv_from(0, 1, tag).await?.to_vec().unwrap());
                }
            }
            2 => out.extend(chip.recv_from(0, 1, 1).await?.to_vec().unwrap()),
            _ => {}
        }
        Ok::<_, CollectiveError>(out)
    })
    .unwrap();
    assert_eq!(got[1], vec![20.0, 10.0, 11.0]);
    assert_eq!(got[2], vec![99.0]);
}

#[test]
fn a_receive_of_another_size_is_a_desync_naming_both_chips() {
    let fabric = fabric("2x2", true, 1);
    let err = on_chips(&fabric, |mut chip: Chip| async move {
        match chip.id() {
            0 => chip.send_to(3, &Payload::from_vec(vec![1.0; 8]), 0).await?,
            3 => {
                chip.recv_from(0, 4, 0).await?;
            }
            _ => {}
        }
        Ok::<_, CollectiveError>(())
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("send-recv#0 from chip 0 to chip 3"), "{text}");
    match err {
        CollectiveError::Desync {
            chip,
            peer,
            expected,
            got,
            ..
        } => {
            assert_eq!((chip, peer), (3, 0));
            assert_eq!((expected.count, got.count), (4, 8));
            assert_eq!(expected.op.name(), "send-recv");
        }
        other => panic!("expected a desync, got {other}"),
    }
}

#[test]
fn impossible_messages_are_refused_with_a_reason() {
    let fabric = fabric("2x2", true, 1);
    let mut chip = fabric.chip(1);
    let rt = runtime(1);
    let data = Payload::from_vec(vec![1.0]);
    let to_self = rt.block_on(chip.send_to(1, &data, 0)).unwrap_err();
    assert!(
        to_self
            .to_string()
            .contains("cannot send to or receive from itself"),
        "{to_self}"
    );
    let outside = rt.block_on(chip.send_to(9, &data, 0)).unwrap_err();
    assert!(outside.to_string().contains("no chip 9"), "{outside}");
    let tag = podsim_collectives::MAX_P2P_TAG + 1;
    let big_tag = rt.block_on(chip.recv_from(0, 1, tag)).unwrap_err();
    assert!(big_tag.to_string().contains("tag"), "{big_tag}");
}

#[test]
fn point_to_point_is_not_run_on_the_mirror_fabric() {
    // One chip standing for all cannot send to a named chip: refused before running.
    let why = podsim_collectives::symmetry_obstacles(true, [podsim_collectives::OpKind::SendRecv]);
    assert!(why.iter().any(|w| w.contains("point-to-point")), "{why:?}");
    assert!(
        podsim_collectives::symmetry_obstacles(true, [podsim_collectives::OpKind::AllReduce])
            .is_empty()
    );
}

#[test]
fn only_messages_between_a_links_two_ends_count_on_it() {
    // 4x4: chip 0 sends to its +x neighbour (1), along x past it (2) and across two axes
    // (5, whose path leaves on +x too). Only the message to chip 1 counts on chip 0's +x and
    // chip 1's -x: the watchdog sets one against the other to find a lost message, and a
    // message forwarded past the neighbour (counted at its sender's link, but received at
    // another chip) made a pipeline whose stage waited two seconds look like one that lost
    // a message.
    let fabric = fabric("4x4", true, 1);
    let plus_x = podsim_topology::Link::Ici {
        axis: 0,
        dir: podsim_topology::Dir::Plus,
    };
    let slot = podsim_collectives::link_slot(plus_x);
    let back = podsim_collectives::link_slot(plus_x.reverse(0));
    let counts = on_chips(&fabric, move |mut chip: Chip| async move {
        let me = chip.id();
        match me {
            0 => {
                for dst in [1, 2, 5] {
                    chip.send_to(dst, &Payload::Meta(4), 0).await?;
                }
            }
            1 | 2 | 5 => {
                chip.recv_from(0, 4, 0).await?;
            }
            _ => {}
        }
        let s = chip.recorder().status();
        Ok::<_, CollectiveError>((s.sent[slot], s.received[back]))
    })
    .unwrap();
    assert_eq!(counts[0].0, 1, "chip 0 sent on +x");
    assert_eq!(counts[1].1, 1, "chip 1 received on -x");
    assert_eq!((counts[2].1, counts[5].1), (0, 0), "forwarded messages");
}
