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
use std::task::{Poll, Waker};

use podsim_topology::{ChipId, Link};
use serde::{Deserialize, Serialize};

use crate::error::CollectiveError;
use crate::fingerprint::Fingerprint;
use crate::payload::Payload;
use crate::recorder::{LINK_SLOTS, link_slot};

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

/// A chip's incoming messages, matched by link and tag when the chip asks for them.
///
/// A receive that finds nothing parks its waker on the slot of the link it receives from,
/// under the same lock as the pending messages, and a message wakes only that slot: a chip
/// runs up to six lanes at once (three torus parts, two directions), and waking all of them
/// for every message, through a separate notifier with its own lock, was most of the
/// per-message cost at scale.
///
/// A chip task wakes for one lane's message and polls all its lanes; the others see, from an
/// atomic count of their slot's events, that nothing changed for them and return at once,
/// without the lock or a scan of the pending messages.
#[derive(Debug, Default)]
pub struct Inbox {
    state: Mutex<InboxState>,
    /// Events per link slot (a message arrived, the parked receive was displaced, the inbox
    /// closed), counted under the lock.
    events: [AtomicU64; LINK_SLOTS],
}

#[derive(Debug, Default)]
struct InboxState {
    pending: Vec<Message>,
    /// The receive parked on each link slot (no two lanes of a chip share a link) and the
    /// collective it belongs to, inline: at 100,000 chips every separate heap block a message
    /// touches is a cache miss.
    parked: [Option<(Waker, Fingerprint)>; LINK_SLOTS],
    /// Why the inbox was closed, once it is.
    closed: Option<String>,
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

impl Inbox {
    pub fn new() -> Inbox {
        Inbox::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, InboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push(&self, msg: Message) {
        // The receiver's name for the link has the same slot whatever the sender's slice.
        let slot = link_slot(msg.link.reverse(0));
        let fp = msg.fingerprint;
        let mut wake: [Option<Waker>; LINK_SLOTS] = Default::default();
        {
            let mut st = self.lock();
            st.pending.push(msg);
            for (i, parked) in st.parked.iter_mut().enumerate() {
                // The receive on this link, and any receive this message proves out of step
                // (same group, another call of it): it must see the desync now, not hang.
                let desync = |want: &Fingerprint| {
                    want.group == fp.group
                        && (fp.seq < want.seq || (fp.seq == want.seq && fp != *want))
                };
                if i == slot || parked.as_ref().is_some_and(|(_, want)| desync(want)) {
                    self.events[i].fetch_add(1, Ordering::Release);
                    wake[i] = parked.take().map(|(waker, _)| waker);
                }
            }
        }
        wake.into_iter().flatten().for_each(Waker::wake);
    }

    /// Wakes every receive on this inbox with an error (the job is being torn down).
    pub fn close(&self, reason: &str) {
        let parked: Vec<Waker> = {
            let mut st = self.lock();
            st.closed = Some(reason.to_string());
            for events in &self.events {
                events.fetch_add(1, Ordering::Release);
            }
            st.parked
                .iter_mut()
                .filter_map(|p| p.take().map(|(waker, _)| waker))
                .collect()
        };
        parked.into_iter().for_each(Waker::wake);
    }

    /// Waits for the message `want` names. Any pending message of the same group that belongs
    /// to another call of it (other fingerprint, same seq; or an older seq) is a desync.
    pub(crate) async fn receive(&self, want: &Expect) -> Result<Message, CollectiveError> {
        let slot = link_slot(want.my_link);
        // The waker this receive parked and its slot's event count then.
        let mut parked: Option<(Waker, u64)> = None;
        std::future::poll_fn(|cx| {
            if let Some((waker, seen)) = &parked
                && waker.will_wake(cx.waker())
                && self.events[slot].load(Ordering::Acquire) == *seen
            {
                return Poll::Pending;
            }
            let mut st = self.lock();
            if let Some(msg) = take_from(&mut st.pending, want)? {
                return Poll::Ready(Ok(msg));
            }
            if let Some(reason) = &st.closed {
                return Poll::Ready(Err(CollectiveError::Closed {
                    chip: want.me,
                    link: want.my_link,
                    reason: reason.clone(),
                }));
            }
            match &mut st.parked[slot] {
                Some((w, fp)) if w.will_wake(cx.waker()) => *fp = want.fingerprint,
                // Another receive on this slot (never by design) is woken to park again
                // rather than forgotten.
                other => {
                    let mine = (cx.waker().clone(), want.fingerprint);
                    if let Some((previous, _)) = other.replace(mine) {
                        self.events[slot].fetch_add(1, Ordering::Release);
                        previous.wake();
                    }
                }
            }
            parked = Some((
                cx.waker().clone(),
                self.events[slot].load(Ordering::Acquire),
            ));
            Poll::Pending
        })
        .await
    }

    /// The message `want` names if it has arrived (desyncs as in [`Inbox::receive`]).
    pub(crate) fn take(&self, want: &Expect) -> Result<Option<Message>, CollectiveError> {
        take_from(&mut self.lock().pending, want)
    }
}

/// Removes the message `want` names from `pending`, if there.
fn take_from(
    pending: &mut Vec<Message>,
    want: &Expect,
) -> Result<Option<Message>, CollectiveError> {
    let fp = &want.fingerprint;
    let mut found = None;
    for (i, m) in pending.iter().enumerate() {
        let other = &m.fingerprint;
        if other.group == fp.group && (other.seq < fp.seq || (other.seq == fp.seq && other != fp)) {
            return Err(CollectiveError::Desync {
                chip: want.me,
                expected: *fp,
                peer: m.src,
                got: *other,
                link: m.link.reverse(m.src / want.chips_per_slice),
            });
        }
        if found.is_none()
            && other == fp
            && m.src == want.src
            && m.link == want.sender_link
            && m.tag == want.tag
        {
            found = Some(i);
        }
    }
    Ok(found.map(|i| pending.swap_remove(i)))
}
