//! podsim's collectives: the fabric abstraction, the virtual-time link model, the collective
//! algorithms and an in-memory fabric that runs any number of chips in one process.
//!
//! Nothing here opens a socket or starts a process: the multi-process fabric plugs in through
//! [`Router`] and [`Inbox`].
//!
//! Modules:
//! - `chip`: a chip (id, virtual clock, link clocks, inbox) and the virtual-time rules of a
//!   send and a receive; `collective`: the collectives as methods on [`Chip`]; `p2p`:
//!   point-to-point messages between any two chips (`send_to` / `recv_from`);
//! - `algo`: lanes, phases and schedules (ring, bidirectional ring, torus);
//! - `fabric`: messages, tags, [`Router`] and [`Inbox`], the receives a chip waits for and
//!   its links' counter slots; `local`: all chips in one process and [`run_chips`]; `mirror`:
//!   a few chips standing for a symmetric pod;
//! - `executor`: runs chips as futures on a few threads, id order (see [`scheduling_lag`]);
//!   `run_queue`: how long its threads waited for a CPU ([`CpuWaitMeter`]); [`procfs`]: what
//!   Linux's `/proc` tells about threads and processes;
//! - `payload` and `buffer`: data (shared f32 slices) and meta (sizes only) payloads; `reduce`:
//!   reduce ops; `bits`: f32 and byte conversions;
//! - `fingerprint`: op kinds, dtypes and a collective's identity; `recorder`: the flight
//!   recorder and live status the watchdog reads; [`faults`]: the hook fault injection uses;
//! - [`trace`]: timelines of sampled chips; `wall`: the exact and the coarse wall clock;
//!   [`reference`](mod@reference): naive collectives for tests; `error`: [`CollectiveError`].
//!
//! ```
//! use podsim_collectives::{Algo, Comm, LocalFabric, Payload, ReduceOp, run_chips};
//! use podsim_topology::{Group, Hardware, Pod};
//!
//! let pod = Pod::single("2x2".parse().unwrap());
//! let fabric = LocalFabric::new(pod.clone(), Hardware::preset("v5e").unwrap());
//! let comm = Comm::new(Group::world(&pod), Algo::Torus);
//! let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
//! let sums = rt.block_on(run_chips(fabric.chips(), move |mut chip| async move {
//!     let mine = Payload::from_vec(vec![chip.id() as f32; 3]);
//!     let sum = chip.all_reduce(&comm, &mine, ReduceOp::Sum).await?;
//!     Ok::<_, podsim_collectives::CollectiveError>((sum.to_vec().unwrap(), chip.clock()))
//! })).unwrap();
//! assert_eq!(sums[0].0, vec![6.0; 3]);
//! assert!(sums[0].1 > 0.0); // virtual nanoseconds on the modelled v5e
//! ```
#![forbid(unsafe_code)]

mod algo;
pub mod bits;
pub mod buffer;
mod chip;
mod collective;
mod error;
mod executor;
mod fabric;
pub mod faults;
mod fingerprint;
mod local;
mod mirror;
mod names;
mod nanos;
mod p2p;
mod payload;
pub mod procfs;
mod recorder;
mod reduce;
pub mod reference;
mod run_queue;
pub mod trace;
mod wall;

pub use algo::Algo;
pub use chip::{Chip, ChipStats, DEFAULT_STREAM, Nanos, PausedTrace, TimeSnapshot, TraceHandle};
pub use collective::{Comm, chunk_len};
pub use error::CollectiveError;
pub use executor::{IdleWait, explore_schedule, scheduling_lag};
pub use fabric::{Blocked, Delivery, Inbox, Message, Router, Tag, WaitForRoom, link_slot};
pub use fingerprint::{DType, Fingerprint, MAX_TAG as MAX_P2P_TAG, OpKind};
pub use local::{LocalFabric, LocalRouter, run_chips, run_chips_waiting};
pub use mirror::{MirrorRouter, Symmetry, mirror_chips, symmetry_obstacles};
pub use payload::{Payload, Rope, Run};
pub use recorder::DEFAULT_CAPACITY as DEFAULT_RECORDER_ENTRIES;
pub use recorder::{
    ChipStatus, FlightRecorder, Glance, OpState, RecordEntry, RunState, counters_judge_wait,
};
pub use reduce::ReduceOp;
pub use run_queue::CpuWaitMeter;
pub use wall::wall_ns;
