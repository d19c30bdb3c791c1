//! One emulated chip as the collectives see it: its identity, its virtual clock, the
//! `busy_until` of each outgoing link, its inbox, and the per-group sequence numbers that
//! make fingerprints.
//!
//! The virtual-time rules (DESIGN.md) live here and nowhere else:
//! - send of `S` bytes at `t`: `depart = max(t, busy_until)`, `busy_until = depart + S/bw`,
//!   the message carries `arrive = busy_until + latency`; the sender does not wait;
//! - receive: `t = max(t, arrive)`.
//!
//! ICI links each have their own `busy_until`; all DCN traffic of a chip shares one egress.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use podsim_topology::{ChipId, Coord, Dir, Group, Hardware, Link, MAX_AXES, Pod, Route};

use crate::error::CollectiveError;
use crate::fabric::{Delivery, Expect, Inbox, Message, Router, Tag, WaitForRoom};
use crate::fabric::{LINK_SLOTS, link_slot};
use crate::faults::{FaultHook, OnSend};
use crate::fingerprint::{DType, Fingerprint, OpKind};
use crate::payload::Payload;
use crate::recorder::{self, FlightRecorder, add_own};
use crate::reduce::ReduceOp;
use crate::trace::{Arg, ChipTrace, MessageEvent, TraceLog};

pub use crate::nanos::Nanos;

/// The track collectives are traced on until a program names its streams.
pub const DEFAULT_STREAM: &str = "collectives";

/// When each outgoing link of a chip is next free (f64 bits), by link slot: ICI links each
/// have their own, all DCN traffic shares the last (one egress per chip). Only the chip's own
/// task writes them, one lane at a time, so a load and a store update a slot without a lock.
#[derive(Debug, Default)]
struct LinkClocks([AtomicU64; LINK_SLOTS]);

impl LinkClocks {
    fn get(&self, slot: usize) -> Nanos {
        f64::from_bits(self.0[slot].load(Ordering::Relaxed))
    }

    fn set(&self, slot: usize, t: Nanos) {
        self.0[slot].store(t.to_bits(), Ordering::Relaxed);
    }

    fn snapshot(&self) -> [Nanos; LINK_SLOTS] {
        std::array::from_fn(|slot| self.get(slot))
    }

    fn restore(&self, times: &[Nanos; LINK_SLOTS]) {
        for (slot, &t) in times.iter().enumerate() {
            self.set(slot, t);
        }
    }
}

/// A chip's virtual clock and link occupancy at one moment.
#[derive(Debug, Clone)]
pub struct TimeSnapshot {
    clock: Nanos,
    links: [Nanos; LINK_SLOTS],
}

/// Traffic counters of one chip (written by its own task only; read by anyone).
#[derive(Debug, Default)]
pub struct ChipStats {
    pub messages_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    /// Bytes received that a reduction added into the chip's own.
    pub bytes_reduced: AtomicU64,
}

impl ChipStats {
    /// Bytes the chip's communication has moved through its HBM so far: what it sent was read
    /// from HBM and what it received written there (a message routed through other chips
    /// touches only its two ends' HBM: ICI routers forward it), and a reduction reads both
    /// operands and writes the sum (as [`podsim_topology::Hardware::reduction_ns`] charges).
    pub fn hbm_traffic(&self) -> u64 {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        load(&self.bytes_sent) + load(&self.bytes_received) + 3 * load(&self.bytes_reduced)
    }
}

/// The parts of a chip that the concurrent lanes of one collective share.
#[derive(Debug)]
pub struct ChipCore {
    id: ChipId,
    /// ICI neighbour across each (axis, direction): computed once, as every message asks.
    neighbours: [[Option<ChipId>; 2]; MAX_AXES],
    /// This chip's slice and the chips in a slice, for the same reason.
    slice: u32,
    chips_per_slice: u32,
    pod: Arc<Pod>,
    hardware: Arc<Hardware>,
    inbox: Arc<Inbox>,
    router: Arc<dyn Router>,
    links: LinkClocks,
    pub(crate) stats: ChipStats,
    recorder: Arc<FlightRecorder>,
    faults: Option<Arc<dyn FaultHook>>,
    /// The chip stands for every chip of a symmetric job (a mirror fabric).
    mirrored: bool,
    /// Present on a chip being traced (see [`crate::trace`]).
    trace: Option<Arc<Mutex<TraceLog>>>,
    /// The track a traced chip's next collective is drawn on (its communication stream).
    pub(crate) stream: &'static str,
}

impl ChipCore {
    /// The modelled hardware, whose figures time this chip's messages and reductions.
    pub(crate) fn hardware(&self) -> &Hardware {
        &self.hardware
    }

    /// The trace being recorded, on a traced chip.
    pub(crate) fn trace(&self) -> Option<MutexGuard<'_, TraceLog>> {
        self.trace
            .as_ref()
            .map(|t| t.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
    }
}

/// An emulated chip: a rank with torus coordinates, a virtual clock and a fabric endpoint.
#[derive(Debug)]
pub struct Chip {
    core: ChipCore,
    clock: Nanos,
    seqs: HashMap<u64, u64>,
    /// Flight-recorder index of the collective in progress.
    current: Option<u64>,
    /// The collective in progress checks message payloads (debug mode).
    verify: bool,
    /// The traced slice of the collective in progress.
    open_collective: Option<usize>,
}

impl Chip {
    pub fn new(
        id: ChipId,
        pod: Arc<Pod>,
        hardware: Arc<Hardware>,
        inbox: Arc<Inbox>,
        router: Arc<dyn Router>,
    ) -> Chip {
        let neighbours = std::array::from_fn(|axis| {
            [Dir::Plus, Dir::Minus].map(|dir| pod.peer(id, Link::ici(axis, dir)))
        });
        Chip {
            core: ChipCore {
                id,
                neighbours,
                slice: pod.slice_of(id),
                chips_per_slice: pod.chips_per_slice(),
                pod,
                hardware,
                recorder: Arc::new(FlightRecorder::new(
                    id,
                    recorder::DEFAULT_CAPACITY,
                    inbox.clone(),
                )),
                inbox,
                router,
                links: LinkClocks::default(),
                stats: ChipStats::default(),
                faults: None,
                mirrored: false,
                trace: None,
                stream: DEFAULT_STREAM,
            },
            clock: 0.0,
            seqs: HashMap::new(),
            current: None,
            verify: false,
            open_collective: None,
        }
    }

    /// Marks the chip as standing for every chip of a symmetric job (see `mirror_chips`).
    pub(crate) fn set_mirrored(&mut self) {
        self.core.mirrored = true;
    }

    /// Whether the chip stands for every chip of a symmetric job, on a mirror fabric.
    pub fn mirrored(&self) -> bool {
        self.core.mirrored
    }

    /// Injects faults through `hook` (see [`FaultHook`]).
    pub fn set_faults(&mut self, hook: Arc<dyn FaultHook>) {
        self.core.faults = Some(hook);
    }

    /// The program moves to training step (or script iteration) `step`: recorded, and an
    /// injected fault may stop the chip here.
    pub async fn enter_step(&mut self, step: u64) {
        self.core.recorder.set_step(step);
        if let Some(hook) = self.core.faults.clone()
            && hook.at_step(self.core.id, step) == crate::faults::BeforeCollective::Stall
        {
            std::future::pending::<()>().await;
        }
    }

    /// Keeps the last `entries` collectives in the flight recorder (before the program runs;
    /// the recorder starts afresh).
    pub fn set_recorder_entries(&mut self, entries: usize) {
        self.core.recorder = Arc::new(FlightRecorder::new(
            self.core.id,
            entries,
            self.core.inbox.clone(),
        ));
    }

    /// The chip's flight recorder (shared with whoever reports on the chip).
    pub fn recorder(&self) -> Arc<FlightRecorder> {
        self.core.recorder.clone()
    }

    pub fn id(&self) -> ChipId {
        self.core.id
    }
    pub fn pod(&self) -> &Pod {
        &self.core.pod
    }
    pub fn hardware(&self) -> &Hardware {
        &self.core.hardware
    }
    pub fn coord(&self) -> Coord {
        self.core.pod.coord(self.core.id)
    }
    pub fn slice(&self) -> u32 {
        self.core.slice
    }
    pub fn stats(&self) -> &ChipStats {
        &self.core.stats
    }

    /// The chip's virtual clock, ns.
    pub fn clock(&self) -> Nanos {
        self.clock
    }

    /// The chip's virtual time state (clock and link occupancy).
    pub fn time_snapshot(&self) -> TimeSnapshot {
        TimeSnapshot {
            clock: self.clock,
            links: self.core.links.snapshot(),
        }
    }

    /// Puts back a state from [`Chip::time_snapshot`]: what ran in between costs no virtual
    /// time (harness synchronisation between measurements).
    pub fn restore_time(&mut self, snapshot: TimeSnapshot) {
        self.clock = snapshot.clock;
        self.core.links.restore(&snapshot.links);
    }

    /// Restarts virtual time at zero with idle links (between independent measurements).
    pub fn reset_time(&mut self) {
        self.clock = 0.0;
        self.core.links.restore(&[0.0; LINK_SLOTS]);
    }

    fn next_fingerprint(
        &mut self,
        group: u64,
        op: OpKind,
        dtype: DType,
        count: usize,
        reduce: Option<ReduceOp>,
    ) -> Fingerprint {
        let seq = self.seqs.entry(group).or_insert(0);
        let fp = Fingerprint {
            group,
            seq: *seq,
            op,
            dtype,
            count: count as u64,
            reduce,
        };
        *seq += 1;
        fp
    }

    /// Starts the next collective on `group`: its fingerprint, recorded in the flight
    /// recorder. An injected fault may alter it, skip a sequence number, or stall here.
    pub(crate) async fn begin(
        &mut self,
        group: Group,
        op: OpKind,
        dtype: DType,
        count: usize,
        reduce: Option<ReduceOp>,
    ) -> Fingerprint {
        self.begin_on(group.id(), || group.to_string(), op, dtype, count, reduce)
            .await
    }

    /// [`Chip::begin`] on the sequence of calls `key` (a group's id, or a pair of chips'
    /// point-to-point channel), named `label()` in a trace.
    pub(crate) async fn begin_on(
        &mut self,
        key: u64,
        label: impl FnOnce() -> String,
        op: OpKind,
        dtype: DType,
        count: usize,
        reduce: Option<ReduceOp>,
    ) -> Fingerprint {
        let mut fp = self.next_fingerprint(key, op, dtype, count, reduce);
        if let Some(hook) = self.core.faults.clone() {
            let index = self.core.recorder.started_count();
            match hook.before_collective(self.core.id, index, &mut fp) {
                crate::faults::BeforeCollective::Proceed => {}
                crate::faults::BeforeCollective::Stall => std::future::pending::<()>().await,
                crate::faults::BeforeCollective::Skip => {
                    // As if the previous call had been skipped: one sequence number ahead.
                    *self.seqs.entry(key).or_insert(0) += 1;
                    fp.seq += 1;
                }
            }
        }
        self.current = Some(self.core.recorder.started(fp, self.clock));
        if let Some(mut log) = self.core.trace() {
            let elems = fp.count as f64;
            let mut args = vec![
                ("op".to_string(), Arg::from(fp.op.name())),
                ("seq".to_string(), Arg::from(fp.seq)),
                ("group".to_string(), Arg::from(label())),
                ("elements".to_string(), Arg::from(elems)),
                ("dtype".to_string(), Arg::from(fp.dtype.name())),
                (
                    "bytes".to_string(),
                    Arg::from(elems * fp.dtype.size() as f64),
                ),
            ];
            if let Some(r) = reduce {
                args.push(("reduce".to_string(), Arg::from(r.name())));
            }
            let name = format!("{}#{}", fp.op.name(), fp.seq);
            self.open_collective = log.open(self.core.stream, "collective", name, self.clock, args);
        }
        fp
    }

    /// The collective in progress finished.
    pub(crate) fn finish(&mut self) {
        if let Some(index) = self.current.take() {
            self.core.recorder.completed(index, self.clock);
        }
        if let Some(i) = self.open_collective.take()
            && let Some(mut log) = self.core.trace()
        {
            log.close(i, self.clock);
        }
    }

    /// Adds an argument to the traced slice of the collective in progress.
    pub(crate) fn trace_note(&self, key: &str, value: Arg) {
        if let Some(i) = self.open_collective
            && let Some(mut log) = self.core.trace()
            && let Some(span) = log.trace.spans.get_mut(i)
        {
            span.args.push((key.to_string(), value));
        }
    }

    /// Starts recording a trace of this chip (see [`crate::trace`]); `flows` also records
    /// every message it sends, for flow arrows.
    pub fn enable_trace(&mut self, flows: bool) {
        self.core.trace = Some(Arc::new(Mutex::new(TraceLog::new(self.core.id, flows))));
    }

    /// Sets the trace aside while the program does work that is not part of the modelled job
    /// (checks after the last step); [`Chip::resume_trace`] takes it back.
    pub fn pause_trace(&mut self) -> PausedTrace {
        PausedTrace(self.core.trace.take())
    }

    pub fn resume_trace(&mut self, paused: PausedTrace) {
        if paused.0.is_some() {
            self.core.trace = paused.0;
        }
    }

    /// Whether this chip records a trace.
    pub fn tracing(&self) -> bool {
        self.core.trace.is_some()
    }

    /// The trace recorded so far (tracing stops).
    pub fn take_trace(&mut self) -> Option<ChipTrace> {
        self.core.trace.take().map(|t| TraceHandle(t).snapshot())
    }

    /// A handle that reads this chip's trace from outside while the chip runs (a hung chip's
    /// timeline goes into the flight-recorder dump).
    pub fn trace_handle(&self) -> Option<TraceHandle> {
        self.core.trace.clone().map(TraceHandle)
    }

    /// The track the next collectives are drawn on: programs with several communication
    /// streams name the one a collective is issued on.
    pub fn set_trace_stream(&mut self, stream: &'static str) {
        self.core.stream = stream;
    }

    /// Opens a traced slice at the chip's clock (none on an untraced chip).
    pub fn trace_open(
        &self,
        track: &str,
        cat: &str,
        name: impl FnOnce() -> String,
        args: Vec<(String, Arg)>,
    ) -> Option<usize> {
        self.core
            .trace()
            .and_then(|mut log| log.open(track, cat, name(), self.clock, args))
    }

    /// Closes a slice opened by [`Chip::trace_open`] at the chip's clock.
    pub fn trace_close(&self, index: Option<usize>) {
        if let Some(i) = index
            && let Some(mut log) = self.core.trace()
        {
            log.close(i, self.clock);
        }
    }

    /// Records a slice over `[start, end)` of virtual time; `name` and `args` are only built on
    /// a traced chip.
    pub fn trace_span(
        &self,
        track: &str,
        cat: &str,
        start: Nanos,
        end: Nanos,
        describe: impl FnOnce() -> (String, Vec<(String, Arg)>),
    ) {
        if let Some(mut log) = self.core.trace() {
            let (name, args) = describe();
            log.closed(track.to_string(), cat, name, (start, end), args);
        }
    }

    /// Sets counter `name` to `value` from the chip's clock on.
    pub fn trace_counter(&self, name: &str, value: f64) {
        if let Some(mut log) = self.core.trace() {
            log.counter(name, self.clock, value);
        }
    }

    /// Debug mode for the collective being started: messages carry payload checksums.
    pub(crate) fn set_verify(&mut self, verify: bool) {
        self.verify = verify;
    }

    pub(crate) fn core(&self) -> &ChipCore {
        &self.core
    }

    /// Moves the chip's clock to `t`. Programs that model several streams (compute, and
    /// communication overlapping it) run each collective with the clock set to when its
    /// stream issues it, then set it back; link occupancy stays shared, so overlapping
    /// traffic still contends for the links.
    pub fn set_clock(&mut self, t: Nanos) {
        self.clock = t;
    }

    /// Charges `ns` of computation (what a kernel model priced for the chip's hardware): the
    /// clock advances by it. Returns it.
    pub fn compute(&mut self, ns: Nanos) -> Nanos {
        self.core.recorder.compute_finished();
        self.clock += ns;
        ns
    }
}

/// A chip's trace set aside by [`Chip::pause_trace`].
#[derive(Debug)]
pub struct PausedTrace(Option<Arc<Mutex<TraceLog>>>);

/// Reads a traced chip's trace (see [`Chip::trace_handle`]).
#[derive(Debug, Clone)]
pub struct TraceHandle(Arc<Mutex<TraceLog>>);

impl TraceHandle {
    /// The trace so far.
    pub fn snapshot(&self) -> ChipTrace {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .trace
            .clone()
    }
}

/// One collective call in progress: what its lanes need to send and receive.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    pub chip: &'a ChipCore,
    pub fingerprint: Fingerprint,
    pub elem_bytes: f64,
    pub verify: bool,
    /// Its messages count in their link's `sent` and `received` (the watchdog sets what a
    /// chip sent on a link against what the chip at its far end got). Every collective's
    /// do; a point-to-point call's only between the link's two ends (see
    /// [`crate::counters_judge_wait`]).
    pub counted: bool,
}

impl<'a> Call<'a> {
    pub fn new(chip: &'a Chip, fingerprint: Fingerprint) -> Call<'a> {
        Call {
            chip: chip.core(),
            fingerprint,
            elem_bytes: fingerprint.dtype.size() as f64,
            verify: chip.verify,
            counted: true,
        }
    }

    /// A point-to-point call between this chip and `other` over its `link`: its message
    /// counts on the link only between the link's two ends.
    pub fn point_to_point(
        chip: &'a Chip,
        fingerprint: Fingerprint,
        link: Link,
        other: ChipId,
    ) -> Call<'a> {
        Call {
            counted: crate::recorder::point_to_point_counted(chip.pod(), chip.id(), link, other),
            ..Call::new(chip, fingerprint)
        }
    }

    pub fn pod(&self) -> &'a Pod {
        &self.chip.pod
    }

    pub fn me(&self) -> ChipId {
        self.chip.id
    }

    fn peer(&self, route: Route) -> Result<ChipId, CollectiveError> {
        let core = self.chip;
        let link = route.link;
        let peer = match (link, route.hops) {
            (Link::Ici { axis, dir }, 1) => core
                .neighbours
                .get(usize::from(axis))
                .and_then(|n| n[dir.index()]),
            _ => core.pod.route_peer(core.id, route),
        };
        // A match, not `ok_or`: the error would be built (and dropped) for every message.
        match peer {
            Some(id) => Ok(id),
            None => Err(CollectiveError::NoLink {
                chip: core.id,
                link,
            }),
        }
    }

    /// Sends `payload` to the chip at the end of `route`, leaving at virtual time `t` (or when
    /// the link is free). Resolves at once unless a fault delays the message or a remote
    /// peer's link is full.
    pub async fn send(
        &self,
        t: Nanos,
        route: Route,
        tag: Tag,
        payload: Payload,
    ) -> Result<(), CollectiveError> {
        let dst = self.peer(route)?;
        self.send_to(t, dst, route, 0.0, tag, payload).await
    }

    /// [`Call::send`] to `dst`, which `route` leads towards (its link is the one the message
    /// leaves on and is filed under), arriving `extra_latency_ns` later than the route alone
    /// would bring it (the further hops of a point-to-point path).
    pub async fn send_to(
        &self,
        t: Nanos,
        dst: ChipId,
        route: Route,
        extra_latency_ns: f64,
        tag: Tag,
        payload: Payload,
    ) -> Result<(), CollectiveError> {
        let msg = Message {
            src: self.chip.id,
            dst,
            link: route.link,
            hops: route.hops,
            fingerprint: self.fingerprint,
            tag,
            checksum: None,
            arrive_ns: 0.0,
            payload,
        };
        match self.start_sending(t, msg, extra_latency_ns)? {
            None => Ok(()),
            Some(rest) => {
                // Waiting for room on a full link to another worker (or a fault's delay):
                // busy in the transport, not stopped, as far as the watchdog is concerned.
                let recorder = &self.chip.recorder;
                recorder.compute_started();
                let sent = rest.await;
                recorder.compute_finished();
                sent
            }
        }
    }

    /// Everything a send does without waiting, which is all of it on the common path; what is
    /// left to wait for (a fault's delay, room on a remote link), boxed, when there is any.
    /// (The common path is a plain call: at 100,000 chips a state machine per send, built and
    /// dropped for every message, was a measurable part of the cost of a message.)
    fn start_sending(
        &self,
        t: Nanos,
        mut msg: Message,
        extra_latency_ns: f64,
    ) -> Result<Option<WaitForRoom<'a>>, CollectiveError> {
        if self.verify {
            msg.checksum = msg.payload.checksum();
        }
        let fault = match &self.chip.faults {
            Some(hook) => hook.on_send(&mut msg, self.chip.recorder.busy_since_last_send()),
            None => OnSend::Deliver,
        };
        match fault {
            OnSend::Deliver => self.hand_over(t, msg, extra_latency_ns),
            OnSend::Drop => {
                self.account(t, &msg, extra_latency_ns);
                Ok(None)
            }
            OnSend::Delay { wall, virtual_ns } => {
                let call = *self;
                // `send` marks the chip busy for the whole wait (the delay, then room).
                Ok(Some(Box::pin(async move {
                    tokio::time::sleep(wall).await;
                    match call.hand_over(t, msg, extra_latency_ns + virtual_ns)? {
                        None => Ok(()),
                        Some(rest) => rest.await,
                    }
                })))
            }
        }
    }

    /// When this chip's `link` has finished sending what was booked on it.
    pub fn link_free_at(&self, link: Link) -> Nanos {
        self.chip.links.get(link_slot(link))
    }

    /// Books the message on its link (virtual departure and arrival, counters) and returns its
    /// arrival time at the receiver.
    ///
    /// A message routed `hops` chips along an axis holds this chip's link for `hops` times
    /// its transfer time and pays the latency of every hop. Why this is the time of a routed
    /// message: the members of a strided part of an axis are one of `hops` interleaved groups
    /// that run the same collective at once (SPMD), so every wire of the axis carries one
    /// message of each of the `hops` groups passing over it, and each group gets `1 / hops`
    /// of the wire. Charging the sender's own link for all of them keeps that sharing exact
    /// without a chip reading the others' link clocks.
    fn account(&self, t: Nanos, msg: &Message, extra_latency_ns: f64) -> Nanos {
        let hw = &self.chip.hardware;
        let bytes = msg.payload.len() as f64 * self.elem_bytes;
        let (hold, flight) = hw.link_time_ns(msg.link.is_dcn(), bytes);
        let hops = f64::from(msg.hops);
        let slot = link_slot(msg.link);
        let depart = t.max(self.chip.links.get(slot));
        let busy_until = depart + hops * hold;
        self.chip.links.set(slot, busy_until);
        let arrive = busy_until + hops * flight + extra_latency_ns;
        if let Some(mut log) = self.chip.trace() {
            log.link(slot, depart, busy_until);
            log.message(MessageEvent {
                dst: msg.dst,
                depart_ns: depart,
                arrive_ns: arrive,
                bytes: bytes as u64,
            });
        }
        add_own(&self.chip.stats.messages_sent, 1);
        add_own(&self.chip.stats.bytes_sent, bytes as u64);
        if self.counted {
            self.chip.recorder.sent(msg.link);
        }
        arrive
    }

    /// Books the message and gives it to the router.
    fn hand_over(
        &self,
        t: Nanos,
        mut msg: Message,
        extra_latency_ns: f64,
    ) -> Result<Option<WaitForRoom<'a>>, CollectiveError> {
        msg.arrive_ns = self.account(t, &msg, extra_latency_ns);
        Ok(match self.chip.router.deliver(msg)? {
            Delivery::Done => None,
            Delivery::Wait(room) => Some(room),
        })
    }

    /// Receives the message with `tag` from the chip at the end of `route` (named from this
    /// chip's side); `t` moves to `max(t, arrive)`.
    pub async fn recv(
        &self,
        t: &mut Nanos,
        route: Route,
        tag: Tag,
    ) -> Result<Payload, CollectiveError> {
        let src = self.peer(route)?;
        self.recv_from(t, src, route.link, tag).await
    }

    /// [`Call::recv`] of the message `src` sent on the link this chip names `link` (for a
    /// point-to-point message: the link it left `src` on, named from this side).
    pub async fn recv_from(
        &self,
        t: &mut Nanos,
        src: ChipId,
        link: Link,
        tag: Tag,
    ) -> Result<Payload, CollectiveError> {
        let core = self.chip;
        let sender_link = link.reverse(core.slice);
        let want = Expect {
            me: core.id,
            src,
            sender_link,
            my_link: link,
            fingerprint: self.fingerprint,
            tag,
            chips_per_slice: core.chips_per_slice,
        };
        let (msg, blocked_since) = core.inbox.receive(want).await?;
        core.recorder.received(link, self.counted, blocked_since);
        if let Some(sum) = msg.checksum
            && msg.payload.checksum() != Some(sum)
        {
            return Err(CollectiveError::Corrupt {
                chip: core.id,
                peer: src,
                link: sender_link,
                fingerprint: self.fingerprint,
            });
        }
        *t = t.max(msg.arrive_ns);
        add_own(
            &core.stats.bytes_received,
            (msg.payload.len() as f64 * self.elem_bytes) as u64,
        );
        Ok(msg.payload)
    }
}
