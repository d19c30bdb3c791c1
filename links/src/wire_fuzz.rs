//! Fuzzing of every reader of bytes another process sends (test-only): link records over a
//! socket ([`crate::records::RecordReader`]) and the envelope checks behind them
//! ([`crate::wire`]), protobuf envelopes (the gRPC links), and a PyTorch rank's frames
//! ([`crate::rank_wire`]). Each input is a valid message mutated (bytes flipped, cut,
//! repeated, spliced) or plain noise; a reader must return (a message or an error), never
//! panic, hang or allocate beyond its limits.
//!
//! In the suite each target runs a few hundred inputs; `PODSIM_FUZZ_SECS=600` runs each for
//! that long, printing how many inputs it tried. A failure prints the seed that replays it
//! (`PODSIM_FUZZ_SEED`).

use std::io::Write;
use std::time::{Duration, Instant};

use podsim_collectives::{Message, Payload};
use podsim_proto::v1 as pb;
use podsim_topology::{Placement, Pod};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use prost::Message as _;

use crate::rank_wire;
use crate::records::{self, Drained, RecordReader};
use crate::socket::RawLink;
use crate::wire;

/// Inputs per target in the suite (no `PODSIM_FUZZ_SECS`).
const SUITE_CASES: u32 = 300;

/// One input: a seed message's bytes changed by a list of edits.
#[derive(Debug, Clone)]
enum Edit {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Cut { at: usize },
    Repeat { at: usize, len: usize },
    Insert { at: usize, bytes: Vec<u8> },
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let edit = prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Edit::Flip { at, bit }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Edit::Set { at, byte }),
        any::<usize>().prop_map(|at| Edit::Cut { at }),
        (any::<usize>(), 1usize..64).prop_map(|(at, len)| Edit::Repeat { at, len }),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..32))
            .prop_map(|(at, bytes)| Edit::Insert { at, bytes }),
    ];
    prop::collection::vec(edit, 0..6)
}

fn apply(mut bytes: Vec<u8>, edits: &[Edit]) -> Vec<u8> {
    for e in edits {
        let n = bytes.len().max(1);
        match e {
            Edit::Flip { at, bit } => {
                if let Some(b) = bytes.get_mut(at % n) {
                    *b ^= 1 << bit;
                }
            }
            Edit::Set { at, byte } => {
                if let Some(b) = bytes.get_mut(at % n) {
                    *b = *byte;
                }
            }
            Edit::Cut { at } => bytes.truncate(at % n),
            Edit::Repeat { at, len } => {
                let from = at % n;
                let piece: Vec<u8> = bytes.iter().skip(from).take(*len).copied().collect();
                bytes.splice(from..from, piece);
            }
            Edit::Insert { at, bytes: more } => {
                let at = (at % n).min(bytes.len());
                bytes.splice(at..at, more.iter().copied());
            }
        }
    }
    bytes
}

/// An input: seed `which` of `seeds` edited, or noise.
fn input(seeds: Vec<Vec<u8>>) -> impl Strategy<Value = Vec<u8>> {
    let count = seeds.len();
    prop_oneof![
        4 => (0..count, edits()).prop_map(move |(i, e)| apply(seeds[i].clone(), &e)),
        1 => prop::collection::vec(any::<u8>(), 0..512),
    ]
}

/// Runs `check` on inputs from `strategy`: [`SUITE_CASES`] of them, or batches until
/// `PODSIM_FUZZ_SECS` have passed. Panics (with the seed) on the first input that fails.
fn fuzz<S: Strategy>(name: &str, strategy: S, check: impl Fn(S::Value)) {
    let budget = std::env::var("PODSIM_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let fixed_seed = std::env::var("PODSIM_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok());
    let start = Instant::now();
    let mut seed = fixed_seed.unwrap_or_else(|| u64::from(std::process::id()) << 20);
    let mut tried = 0u64;
    loop {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &key);
        let config = Config {
            cases: SUITE_CASES,
            failure_persistence: None,
            ..Config::default()
        };
        let mut runner = TestRunner::new_with_rng(config, rng);
        let outcome = runner.run(&strategy, |v| {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(v)));
            caught.map_err(|_| TestCaseError::fail("the reader panicked"))
        });
        if let Err(e) = outcome {
            panic!("fuzz {name}: {e} (replay: PODSIM_FUZZ_SEED={seed})");
        }
        tried += u64::from(SUITE_CASES);
        seed = seed.wrapping_add(1);
        match budget {
            Some(b) if start.elapsed() < b && fixed_seed.is_none() => {}
            _ => break,
        }
    }
    if budget.is_some() {
        println!(
            "fuzz {name}: {tried} inputs in {:.0} s, no panic",
            start.elapsed().as_secs_f64()
        );
    }
}

fn pod_and_placement() -> (Pod, Placement) {
    let pod = Pod::single("4x4".parse().unwrap_or_else(|e| panic!("{e}")));
    let placement = Placement::new(&pod, 2).unwrap_or_else(|e| panic!("{e}"));
    (pod, placement)
}

/// Messages worker 1 may send worker 0 across their boundary, with values and meta.
fn seed_messages() -> Vec<Message> {
    let (pod, placement) = pod_and_placement();
    let mut out = Vec::new();
    for src in placement.chips_of(1) {
        for axis in 0..2 {
            for dir in [podsim_topology::Dir::Plus, podsim_topology::Dir::Minus] {
                let link = podsim_topology::Link::ici(axis, dir);
                let Some(dst) = pod.peer(src, link) else {
                    continue;
                };
                if placement.worker_of(dst) != 0 {
                    continue;
                }
                let mut m = wire::tests::message(src, 3, Payload::from_vec(vec![1.5, -2.0, 3.25]));
                m.dst = dst;
                m.link = link;
                out.push(m.clone());
                m.payload = Payload::Meta(1 << 20);
                out.push(m);
            }
        }
    }
    assert!(!out.is_empty(), "no chip of worker 1 links to worker 0");
    out
}

#[test]
fn link_records_from_a_socket_are_read_or_refused_never_panicking() {
    let (pod, placement) = pod_and_placement();
    let seeds: Vec<Vec<u8>> = seed_messages()
        .into_iter()
        .map(records::encode_record)
        .collect();
    let all = seeds.concat();
    let seeds = [seeds, vec![all]].concat();
    fuzz("link records", input(seeds), |bytes| {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap_or_else(|e| panic!("{e}"));
        let _ = b.set_nonblocking(true);
        // Inputs stay far below a socket buffer: the write does not block.
        let _ = a.write_all(&bytes);
        drop(a);
        let raw = RawLink::Unix(b);
        let mut reader = RecordReader::new(1, None);
        let mut deliver = |env: pb::Envelope, payload: Payload| {
            wire::message(env, || Ok(payload), &pod, &placement, 1, 0).map(|_| ())
        };
        // Every drain consumes input or ends; far more than enough rounds for 1 KiB.
        for _ in 0..10_000 {
            match reader.drain(&raw, &mut deliver) {
                Ok(Drained::More) => {}
                Ok(Drained::Empty | Drained::Closed) | Err(_) => return,
            }
        }
        panic!("the reader went on draining a closed link");
    });
}

#[test]
fn protobuf_envelopes_are_decoded_or_refused_never_panicking() {
    let (pod, placement) = pod_and_placement();
    let seeds: Vec<Vec<u8>> = seed_messages()
        .into_iter()
        .map(|m| wire::encode(m).encode_to_vec())
        .collect();
    fuzz("envelopes", input(seeds), |bytes| {
        if let Ok(env) = pb::Envelope::decode(bytes.as_slice()) {
            let _ = wire::decode(env, &pod, &placement, 1, 0);
        }
    });
}

#[test]
fn rank_frames_are_read_or_refused_never_panicking() {
    let frame = |json: &str, values: &[f32]| {
        let mut out = Vec::new();
        out.extend(rank_wire::MAGIC.to_le_bytes());
        out.extend((json.len() as u32).to_le_bytes());
        out.extend((4 * values.len() as u64).to_le_bytes());
        out.extend(json.as_bytes());
        out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        out
    };
    let seeds = vec![
        frame(r#"{"op":"hello","rank":3,"pid":77,"token":"t"}"#, &[]),
        frame(r#"{"op":"group","id":1,"ranks":[0,1,2,3]}"#, &[]),
        frame(
            r#"{"op":"all_reduce","group":1,"dtype":"f32","count":3,"reduce":"sum"}"#,
            &[1.0, 2.0, 3.0],
        ),
    ];
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap_or_else(|e| panic!("{e}"));
    fuzz("rank frames", input(seeds), |bytes| {
        rt.block_on(async {
            let mut r = bytes.as_slice();
            // A limit as a connection's first frame has (0) and one a rank's tensors could
            // reach in a test's memory.
            for limit in [0, 1 << 20] {
                let mut r2 = r;
                while let Ok(Some(_)) = rank_wire::read_frame(&mut r2, limit).await {}
            }
            while let Ok(Some(_)) = rank_wire::read_frame(&mut r, 1 << 20).await {}
        });
    });
}
