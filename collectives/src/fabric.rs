//! The fabric as a chip sees it: messages that travel on named links, a [`Router`] that
//! delivers them to the destination chip's [`Inbox`], and the inbox a chip receives from.
//!
//! Routers differ by where the destination lives (same process: push into its inbox; another
//! worker: a gRPC stream), but every chip receives the same way, so algorithms and virtual time
//! do not depend on how chips are split across processes.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use podsim_topology::{ChipId, Link, MAX_AXES};
use serde::{Deserialize, Serialize};

use crate::error::CollectiveError;
use crate::fingerprint::Fingerprint;
use crate::payload::Payload;
use crate::wall::coarse_wall_ns;

/// Messages over each link of a chip: slots are ICI (axis, direction) then DCN.
pub const LINK_SLOTS: usize = 2 * MAX_AXES + 1;

/// The counter slot of `link`.
pub fn link_slot(link: Link) -> usize {
    match link {
        Link::Ici { axis, dir } => 2 * usize::from(axis) + dir.index(),
        Link::Dcn { .. } => 2 * MAX_AXES,
    }
}

/// A receive a chip is waiting for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Blocked {
    /// The link as this chip names it.
    pub link: Link,
    /// The chip at the other end.
    pub peer: ChipId,
    pub tag: Tag,
    pub fingerprint: Fingerprint,
    pub since_wall_ns: u64,
}

/// Where a message belongs inside its collective: the algorithm lane, phase and step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    pub lane: u16,
    pub phase: u16,
    pub step: u32,
}

/// One chip-to-chip message.
#[derive(Debug, Clone)]
pub struct Message {
    pub src: ChipId,
    pub dst: ChipId,
    /// The link as the sender names it.
    pub link: Link,
    /// Chips along the link's axis the message travels (1: to the neighbour).
    pub hops: u32,
    pub fingerprint: Fingerprint,
    pub tag: Tag,
    /// Virtual arrival time at the receiver, ns.
    pub arrive_ns: f64,
    pub payload: Payload,
    /// Debug mode: a checksum of the payload as sent, checked on receipt.
    pub checksum: Option<u64>,
}

/// A send that must wait for room in a bounded queue before it is handed over.
pub type WaitForRoom<'a> = Pin<Box<dyn Future<Output = Result<(), CollectiveError>> + Send + 'a>>;

/// What became of a message handed to a [`Router`].
pub enum Delivery<'a> {
    /// Handed over (the common, allocation-free path).
    Done,
    /// The way to the destination is full: awaiting this hands the message over once there is
    /// room. This is how a fast sender is held back instead of growing queues without limit.
    Wait(WaitForRoom<'a>),
}

impl std::fmt::Debug for Delivery<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Delivery::Done => "Done",
            Delivery::Wait(_) => "Wait",
        })
    }
}

/// Delivers messages to their destination chips.
pub trait Router: Send + Sync + std::fmt::Debug {
    /// Hands `msg` to the fabric; never waits on the receiver to consume it.
    fn deliver(&self, msg: Message) -> Result<Delivery<'_>, CollectiveError>;
}

/// A chip's incoming messages, matched by link and tag when the chip asks for them, and the
/// receives parked on it.
///
/// A receive that finds nothing parks on the slot of the link it receives from, under the same
/// lock as the pending messages, and a message wakes only that slot: a chip runs up to six
/// lanes at once (three torus parts, two directions), and waking all of them for every message
/// was most of the per-message cost at scale. The parked record says what the chip waits for
/// (link, peer, tag, collective, since when): it is what heartbeats report as the chip's
/// blocked receives, so parking is the only bookkeeping a blocked receive does.
///
/// A chip task wakes for one lane's message and polls all its lanes; the others see, from an
/// atomic count of their slot's events, that nothing changed for them and return at once,
/// without the lock or a scan of the pending messages.
///
/// Layout: at 100,000 chips an inbox is never in cache when a message arrives or a receive
/// looks, and every cache line either touches costs a trip to memory. So what both touch comes
/// first, in this order (`repr(C)` keeps it): the event counts and the lock, then which slots
/// have a parked receive, the pending messages' header and their slots, then the fingerprints
/// pending; the wakers and the parked receives' records, read only for a slot that has one,
/// come last.
#[derive(Debug, Default)]
#[repr(C)]
pub struct Inbox {
    /// Events per link slot (a message arrived, the parked receive was displaced, the inbox
    /// closed). Written only under the lock, read without it.
    events: [AtomicU64; LINK_SLOTS],
    state: Mutex<InboxState>,
}

#[derive(Debug, Default)]
#[repr(C)]
struct InboxState {
    /// The slots that have a parked receive, one bit each: which of `records` are set, kept
    /// here on the first cache line so that a delivery need not read the records.
    parked: u8,
    pending: Pending,
    /// The fingerprint all parked receives wait under while they agree (the common case: the
    /// lanes of one collective). A message under it cannot put any of them out of step, so
    /// delivery need not look at their records.
    agreed: Option<Fingerprint>,
    /// The waker of the last receive parked on each link slot (no two lanes of a chip share
    /// a link). Only a slot with a record is woken; the waker stays after its receive
    /// finished, so the chip's next receive on the slot finds its own waker in place.
    wakers: [Option<Waker>; LINK_SLOTS],
    /// Why the inbox was closed, once it is.
    closed: Option<String>,
    /// What the receive parked on each slot waits for. The record stays until the receive
    /// takes its message, fails or is dropped, so a chip whose message came but that has not
    /// run yet still shows what it was blocked on.
    records: [Option<Blocked>; LINK_SLOTS],
}

impl InboxState {
    fn park(&mut self, slot: usize, record: Blocked) -> Option<Blocked> {
        self.agreed = match self.parked {
            0 => Some(record.fingerprint),
            _ => self.agreed.filter(|fp| *fp == record.fingerprint),
        };
        self.parked |= 1 << slot;
        self.records[slot].replace(record)
    }

    fn unpark(&mut self, slot: usize, want: &Expect) -> Option<Blocked> {
        let record = self.records[slot].take_if(|b| is_for(b, want))?;
        self.parked &= !(1 << slot);
        // Those left still agree if they did; none left agree on anything.
        if self.parked == 0 {
            self.agreed = None;
        }
        Some(record)
    }
}

fn is_for(record: &Blocked, want: &Expect) -> bool {
    record.tag == want.tag && record.link == want.my_link && record.fingerprint == want.fingerprint
}

/// A message under `fp` proves a receive waiting under `want` out of step: same group, another
/// call of it.
fn out_of_step(fp: &Fingerprint, want: &Fingerprint) -> bool {
    want.group == fp.group && (fp.seq < want.seq || (fp.seq == want.seq && fp != want))
}

/// What a receive waits for.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expect {
    pub me: ChipId,
    pub src: ChipId,
    /// The link as the sender names it.
    pub sender_link: Link,
    /// The link as the receiver names it (for messages).
    pub my_link: Link,
    pub fingerprint: Fingerprint,
    pub tag: Tag,
    /// To name the sender's slice in a desync report.
    pub chips_per_slice: u32,
}

/// One more event on a slot's counter (the caller holds the inbox lock, so a load and a store
/// suffice).
fn count_event(events: &AtomicU64) {
    events.store(events.load(Ordering::Relaxed) + 1, Ordering::Release);
}

impl Inbox {
    pub fn new() -> Inbox {
        Inbox::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push(&self, msg: Message) {
        let slot = usize::from(slot_of(&msg));
        let fp = msg.fingerprint;
        let mut st = self.lock();
        st.pending.push(slot, msg);
        if st.parked == 0 {
            return;
        }
        // The receive on this link wakes; so does any receive this message proves out of step
        // (it must see the desync now, not hang), which only a message under another
        // fingerprint than the one all parked receives agree on can do: otherwise the other
        // slots' records are not even read. Wakers are woken in place, under the lock: waking
        // only marks a chip runnable, and a waker left in its slot is reused by the chip's
        // next receive there instead of being cloned and dropped for every message.
        let mut candidates = if st.agreed == Some(fp) {
            st.parked & (1 << slot)
        } else {
            st.parked
        };
        while candidates != 0 {
            let i = candidates.trailing_zeros() as usize;
            candidates &= candidates - 1;
            let proves_out_of_step = || {
                st.records[i]
                    .as_ref()
                    .is_some_and(|r| out_of_step(&fp, &r.fingerprint))
            };
            if i == slot || proves_out_of_step() {
                count_event(&self.events[i]);
                if let Some(waker) = &st.wakers[i] {
                    waker.wake_by_ref();
                }
            }
        }
    }

    /// Wakes every receive on this inbox with an error (the job is being torn down).
    pub fn close(&self, reason: &str) {
        let parked: Vec<Waker> = {
            let mut st = self.lock();
            st.closed = Some(reason.to_string());
            for events in &self.events {
                count_event(events);
            }
            st.wakers.iter_mut().filter_map(Option::take).collect()
        };
        parked.into_iter().for_each(Waker::wake);
    }

    /// The receives parked on this inbox: what its chip is blocked on.
    pub fn blocked(&self) -> Vec<Blocked> {
        self.lock().records.iter().flatten().cloned().collect()
    }

    /// Messages that arrived on each link slot and are not taken yet.
    pub fn pending_per_slot(&self) -> [u64; LINK_SLOTS] {
        let st = self.lock();
        let mut out = [0u64; LINK_SLOTS];
        for i in 0..st.pending.messages.len() {
            out[usize::from(st.pending.slot(i))] += 1;
        }
        out
    }

    /// How many receives are parked on this inbox, and since when (wall ns) the oldest waits.
    pub fn parked(&self) -> (usize, Option<u64>) {
        let st = self.lock();
        let oldest = st.records.iter().flatten().map(|r| r.since_wall_ns).min();
        (st.parked.count_ones() as usize, oldest)
    }

    /// Waits for the message `want` names. Any pending message of the same group that belongs
    /// to another call of it (other fingerprint, same seq; or an older seq) is a desync.
    /// Resolves to the message and, if the receive had to wait, since when (wall ns).
    pub(crate) fn receive(&self, want: Expect) -> Receive<'_> {
        Receive {
            inbox: self,
            slot: link_slot(want.my_link),
            want,
            parked: None,
        }
    }
}

/// The future of [`Inbox::receive`].
#[derive(Debug)]
pub(crate) struct Receive<'a> {
    inbox: &'a Inbox,
    want: Expect,
    slot: usize,
    /// Set while this receive is parked: which task it parked for and its slot's event count
    /// then. Nothing new on the slot for the same task means the parked waker is still in
    /// place, so a poll returns at once (without cloning the waker to compare it).
    parked: Option<ParkedAt>,
}

#[derive(Debug)]
struct ParkedAt {
    /// The waker's identity: its data and vtable addresses (what `Waker::will_wake` compares).
    waker: (usize, usize),
    events: u64,
}

fn waker_identity(waker: &Waker) -> (usize, usize) {
    (
        waker.data() as usize,
        std::ptr::from_ref(waker.vtable()) as usize,
    )
}

impl Receive<'_> {
    /// Removes this receive's record from the slot (it took its message, failed, or is
    /// dropped); returns since when it waited.
    fn unpark(&mut self, st: &mut InboxState) -> Option<u64> {
        self.parked.take()?;
        st.unpark(self.slot, &self.want)
            .map(|record| record.since_wall_ns)
    }
}

impl Future for Receive<'_> {
    type Output = Result<(Message, Option<u64>), CollectiveError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let events = &this.inbox.events[this.slot];
        if let Some(at) = &this.parked
            && at.waker == waker_identity(cx.waker())
            && events.load(Ordering::Acquire) == at.events
        {
            return Poll::Pending;
        }
        let inbox = this.inbox;
        let mut st = inbox.lock();
        match st.pending.take(&this.want, this.slot) {
            Ok(Some(msg)) => {
                let since = this.unpark(&mut st);
                return Poll::Ready(Ok((msg, since)));
            }
            Err(e) => {
                this.unpark(&mut st);
                return Poll::Ready(Err(e));
            }
            Ok(None) => {}
        }
        let want = &this.want;
        if let Some(reason) = &st.closed {
            let err = CollectiveError::Closed {
                chip: want.me,
                link: want.my_link,
                reason: reason.clone(),
            };
            this.unpark(&mut st);
            return Poll::Ready(Err(err));
        }
        let slot = this.slot;
        let still_parked =
            this.parked.is_some() && st.records[slot].as_ref().is_some_and(|b| is_for(b, want));
        let displaced = if still_parked {
            None
        } else {
            st.park(
                slot,
                Blocked {
                    link: want.my_link,
                    peer: want.src,
                    tag: want.tag,
                    fingerprint: want.fingerprint,
                    since_wall_ns: coarse_wall_ns(),
                },
            )
        };
        let previous = match &mut st.wakers[slot] {
            Some(w) if w.will_wake(cx.waker()) => None,
            other => other.replace(cx.waker().clone()),
        };
        // Another receive parked on this slot (never by design) is woken to park again rather
        // than forgotten (its task may be this one).
        if displaced.is_some() {
            count_event(events);
            match previous {
                Some(waker) => waker.wake(),
                None => cx.waker().wake_by_ref(),
            }
        }
        this.parked = Some(ParkedAt {
            waker: waker_identity(cx.waker()),
            events: events.load(Ordering::Relaxed),
        });
        Poll::Pending
    }
}

impl Drop for Receive<'_> {
    fn drop(&mut self) {
        if self.parked.is_some() {
            let inbox = self.inbox;
            let mut st = inbox.lock();
            self.unpark(&mut st);
        }
    }
}

/// Distinct fingerprints [`Pending`] tracks with counts; messages beyond them are counted as
/// untracked (a chip has the collective in progress and perhaps the next one in its inbox).
const KINDS: usize = 2;

/// Pending messages whose link slot [`Pending`] keeps inline, beside the messages' header;
/// the slot of any further message is read from the message itself. (A lane that runs ahead
/// with the sweep can leave a neighbour dozens of messages, but more inline slots did not
/// save cache misses.)
const INLINE_SLOTS: usize = 24;

/// The receiver's link slot of a message.
fn slot_of(msg: &Message) -> u8 {
    // The receiver's name for the link has the same slot whatever the sender's slice.
    link_slot(msg.link.reverse(0)) as u8
}

/// Messages that arrived and were not taken yet.
///
/// A receive reads only the messages of its own link slot, found from a byte per message, and
/// checks for desyncs against the few distinct fingerprints pending instead of every message:
/// a chip's inbox holds a few messages for each of its six lanes (more for a lane whose sender
/// ran ahead), and reading all of them (two cache lines each, written by other chips) for
/// every receive was the largest part of receiving. The slot bytes sit inline, on the cache line of the lock, not in a buffer of
/// their own.
#[derive(Debug, Default)]
#[repr(C)]
struct Pending {
    messages: Vec<Message>,
    /// The slot of each of the first [`INLINE_SLOTS`] messages, in the same order.
    slots: [u8; INLINE_SLOTS],
    /// Messages whose fingerprint is not among `kinds`.
    untracked: u32,
    kinds: [Option<(Fingerprint, u32)>; KINDS],
}

impl Pending {
    fn slot(&self, i: usize) -> u8 {
        match self.slots.get(i) {
            Some(&slot) => slot,
            None => slot_of(&self.messages[i]),
        }
    }

    fn push(&mut self, slot: usize, msg: Message) {
        let fp = msg.fingerprint;
        if let Some(cached) = self.slots.get_mut(self.messages.len()) {
            *cached = slot as u8;
        }
        self.messages.push(msg);
        if let Some((_, count)) = self.kinds.iter_mut().flatten().find(|(k, _)| *k == fp) {
            *count += 1;
        } else if let Some(free) = self.kinds.iter_mut().find(|k| k.is_none()) {
            *free = Some((fp, 1));
        } else {
            self.untracked += 1;
        }
    }

    fn remove(&mut self, i: usize) -> Message {
        // The last message moves into `i`, and its slot with it.
        let last = self.messages.len() - 1;
        if i < INLINE_SLOTS && i != last {
            self.slots[i] = self.slot(last);
        }
        let msg = self.messages.swap_remove(i);
        let kind = self
            .kinds
            .iter_mut()
            .find(|k| k.is_some_and(|(fp, _)| fp == msg.fingerprint));
        match kind {
            Some(kind @ Some((_, 1))) => *kind = None,
            Some(Some((_, count))) => *count -= 1,
            _ => self.untracked -= 1,
        }
        msg
    }

    /// Removes the message `want` names (it arrives on the receiver's link `slot`), if there.
    /// A pending message of the same group that belongs to another call of it (other
    /// fingerprint, same seq; or an older seq) is a desync, reported with the first such
    /// message.
    fn take(&mut self, want: &Expect, slot: usize) -> Result<Option<Message>, CollectiveError> {
        let fp = &want.fingerprint;
        let suspect = self.untracked > 0
            || self
                .kinds
                .iter()
                .flatten()
                .any(|(kind, _)| out_of_step(kind, fp));
        if suspect
            && let Some(m) = self
                .messages
                .iter()
                .find(|m| out_of_step(&m.fingerprint, fp))
        {
            return Err(CollectiveError::Desync {
                chip: want.me,
                expected: *fp,
                peer: m.src,
                got: m.fingerprint,
                link: m.link.reverse(m.src / want.chips_per_slice),
            });
        }
        let found = (0..self.messages.len()).position(|i| {
            let m = &self.messages[i];
            usize::from(self.slot(i)) == slot
                && m.fingerprint == *fp
                && m.src == want.src
                && m.link == want.sender_link
                && m.tag == want.tag
        });
        Ok(found.map(|i| self.remove(i)))
    }
}

/// Messages and receives for unit tests, in one place.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A meta message from `src` to `dst`, sent on `link` (as the sender names it).
    pub(crate) fn message(
        src: ChipId,
        dst: ChipId,
        link: Link,
        fp: Fingerprint,
        tag: Tag,
    ) -> Message {
        Message {
            src,
            dst,
            link,
            hops: 1,
            fingerprint: fp,
            tag,
            arrive_ns: 0.0,
            payload: Payload::Meta(1),
            checksum: None,
        }
    }

    /// What chip `me` expects of that message from `src` (one slice), receiving on `my_link`.
    pub(crate) fn expect(
        me: ChipId,
        src: ChipId,
        my_link: Link,
        fp: Fingerprint,
        tag: Tag,
    ) -> Expect {
        Expect {
            me,
            src,
            sender_link: my_link.reverse(0),
            my_link,
            fingerprint: fp,
            tag,
            chips_per_slice: 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use podsim_topology::Dir;

    use super::testing::{expect, message};
    use super::*;
    use crate::fingerprint::{DType, OpKind};

    const FP: Fingerprint = Fingerprint {
        group: 7,
        seq: 0,
        op: OpKind::AllReduce,
        dtype: DType::F32,
        count: 1,
        reduce: None,
    };

    fn tag(step: u32) -> Tag {
        Tag {
            lane: 0,
            phase: 0,
            step,
        }
    }

    /// Takes message `step` that chip 1 sent chip 0 on `link`.
    fn take(pending: &mut Pending, link: Link, step: u32) -> Option<Message> {
        let want = expect(0, 1, link.reverse(0), FP, tag(step));
        pending.take(&want, link_slot(want.my_link)).unwrap()
    }

    #[test]
    fn messages_beyond_the_inline_slots_are_found_on_their_slot() {
        let links: Vec<Link> = (0..3)
            .flat_map(|axis| [Dir::Plus, Dir::Minus].map(|dir| Link::ici(axis, dir)))
            .collect();
        let mut pending = Pending::default();
        // More messages than the inline slots, on every link, then taken in another order
        // (each take moves the last message into the hole, across the inline boundary).
        let sent: Vec<(Link, u32)> = (0..INLINE_SLOTS as u32 + 20)
            .map(|step| (links[step as usize % links.len()], step))
            .collect();
        for &(link, step) in &sent {
            let msg = message(1, 0, link, FP, tag(step));
            pending.push(usize::from(slot_of(&msg)), msg);
        }
        for &(link, step) in sent.iter().rev().step_by(2).chain(sent.iter().step_by(2)) {
            let got = take(&mut pending, link, step)
                .unwrap_or_else(|| panic!("step {step} on {link:?} not found"));
            assert_eq!((got.link, got.tag.step), (link, step));
        }
        assert!(pending.messages.is_empty());
        assert!(take(&mut pending, links[0], 0).is_none());
    }
}
