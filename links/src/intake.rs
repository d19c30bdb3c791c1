//! Who reads the record links coming into this worker, and when.
//!
//! A message between workers costs little to copy and a lot to hand over: a reader that wakes
//! for it, delivers it to its chip's inbox and then wakes the chip executor's thread pays two
//! wake-ups and two context switches per message, most of a 1 MiB all-reduce's time on a
//! small host. So while this worker's chips run on an executor with one thread (a worker's
//! few chips), that thread reads the links itself: with nothing to run it sleeps in `poll(2)`
//! on the links' sockets and an eventfd its wakers write ([`LinkInputs`] is its
//! [`IdleWait`]), and a message that arrives wakes the thread that runs its chip, which
//! delivers it and runs the chip at once. A busy executor still reads every millisecond.
//!
//! Outside that (before the chips start, after they finish, or when the executor has several
//! threads) a tokio task per link reads it, and stands aside while an executor has the links:
//! it then drops the socket's registration with tokio's reactor, which would otherwise wake
//! a tokio thread for every message all the same. Both read with the same
//! [`RecordReader`](crate::records::RecordReader), under one lock per link, so a record
//! half-read by one is finished by the other.
//!
//! `unsafe` here is the three system calls std does not wrap: `poll(2)` over several
//! descriptors, and an eventfd's creation and its 8-byte reads and writes.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use podsim_collectives::IdleWait;
use tokio::io::Interest;
use tokio::sync::watch;

use crate::records::{Drained, RecordReader};
use crate::shm::Inbound;
use crate::socket::{RawLink, SocketFd, watch_fd};

/// Where the records read here go: the worker's fabric
/// ([`NodeFabric`](crate::net::NodeFabric), which owns the [`LinkInputs`]), seen through what
/// a reader needs of it so that the two do not import each other.
pub(crate) trait Deliver: std::fmt::Debug + Send + Sync {
    /// Checks a message that came from worker `peer`.
    fn decode(
        &self,
        env: podsim_proto::v1::Envelope,
        payload: podsim_collectives::Payload,
        peer: u32,
    ) -> Result<podsim_collectives::Message, String>;
    /// Hands a checked message from worker `peer` to its chip's inbox.
    fn accept(&self, peer: u32, msg: podsim_collectives::Message) -> Result<(), String>;
    /// Records a broken link, failing the receives of this worker's chips with `error`.
    fn link_failed(&self, error: String);
}

/// One record link into this worker: its socket and its reader.
#[derive(Debug)]
struct LinkInput {
    socket: RawLink,
    reader: Mutex<RecordReader>,
    /// Set when a drain stopped at its budget (and until the first drain): whole records may
    /// wait in the reader's buffer while the socket itself is empty, so `poll(2)` would not
    /// say to drain again.
    pending: AtomicBool,
    /// Set once the link closed or failed: nobody reads it again.
    done: AtomicBool,
}

impl LinkInput {
    fn reader(&self) -> MutexGuard<'_, RecordReader> {
        self.reader.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Delivers what has arrived. `Some(more)` while the link is open (`more`: the budget
    /// ran out before the input did); `None` once it closed or failed (a failure reported).
    fn drain(&self, fabric: &dyn Deliver) -> Option<bool> {
        if self.done.load(Ordering::Acquire) {
            return None;
        }
        self.drain_with(self.reader(), fabric)
    }

    /// [`LinkInput::drain`], unless another thread is reading the link right now.
    fn drain_if_free(&self, fabric: &dyn Deliver) {
        if self.done.load(Ordering::Acquire) {
            return;
        }
        if let Ok(reader) = self.reader.try_lock() {
            self.drain_with(reader, fabric);
        }
    }

    fn drain_with(
        &self,
        mut reader: MutexGuard<'_, RecordReader>,
        fabric: &dyn Deliver,
    ) -> Option<bool> {
        let peer = reader.peer();
        let drained = reader.drain(&self.socket, &mut |env, payload| {
            let msg = fabric
                .decode(env, payload, peer)
                .map_err(|e| format!("link from worker {peer}: bad record: {e}"))?;
            fabric.accept(peer, msg)
        });
        // Stored before the reader is let go: a drain that ends later (the heartbeat's, the
        // task's) stores its own verdict after this one, never before it.
        self.pending
            .store(drained == Ok(Drained::More), Ordering::Release);
        drop(reader);
        match drained {
            Ok(Drained::Empty) => Some(false),
            Ok(Drained::More) => Some(true),
            // A peer that closed is the coordinator's to find, through its control session,
            // as with a gRPC stream's end.
            Ok(Drained::Closed) => {
                self.done.store(true, Ordering::Release);
                None
            }
            Err(e) => {
                self.fail(fabric, e);
                None
            }
        }
    }

    /// Ends the link: nobody reads it again, and the fabric reports why.
    fn fail(&self, fabric: &dyn Deliver, error: String) {
        self.done.store(true, Ordering::Release);
        fabric.link_failed(error);
    }
}

thread_local! {
    /// Set while this thread delivers from inside [`LinkInputs::wait`]: a wake-up the
    /// delivery causes is for this very thread, which looks for runnable chips next anyway.
    static DELIVERING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// [`DELIVERING`] set for as long as it lives (cleared even if a delivery panics).
struct Delivering;

impl Delivering {
    fn start() -> Delivering {
        DELIVERING.with(|d| d.set(true));
        Delivering
    }
}

impl Drop for Delivering {
    fn drop(&mut self) {
        DELIVERING.with(|d| d.set(false));
    }
}

/// The record links into this worker and whoever reads them (see the module doc).
#[derive(Debug)]
pub(crate) struct LinkInputs {
    links: Mutex<Vec<Arc<LinkInput>>>,
    /// Whether an executor's thread reads the links (their tasks stand aside meanwhile).
    claimed: watch::Sender<bool>,
    /// Written to wake the executor's thread from `poll(2)` (none off Linux: no executor
    /// takes the links there, and their tasks read them).
    wake: Option<OwnedFd>,
    fabric: Weak<dyn Deliver>,
}

impl LinkInputs {
    /// The links of `fabric`'s worker (none yet).
    pub(crate) fn new(fabric: Weak<dyn Deliver>) -> LinkInputs {
        LinkInputs {
            links: Mutex::new(Vec::new()),
            claimed: watch::channel(false).0,
            wake: eventfd(),
            fabric,
        }
    }

    fn links(&self) -> MutexGuard<'_, Vec<Arc<LinkInput>>> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts reading a new link from worker `peer` (`shared`: the peer's region, when the
    /// link has one): its task now, the executor's thread whenever it has the links.
    pub(crate) fn add(self: &Arc<Self>, peer: u32, socket: RawLink, shared: Option<Inbound>) {
        let link = Arc::new(LinkInput {
            socket,
            reader: Mutex::new(RecordReader::new(peer, shared)),
            // Drained once before any wait: a TLS link may hold records that arrived with its
            // handshake in its rustls state, where no readiness of the socket says so.
            pending: AtomicBool::new(true),
            done: AtomicBool::new(false),
        });
        self.links().push(link.clone());
        tokio::spawn(self.clone().follow(link));
        // An executor asleep in `poll(2)` looks at the new socket too.
        self.notify();
    }

    /// The task of one link: reads it whenever no executor has the links.
    async fn follow(self: Arc<Self>, link: Arc<LinkInput>) {
        let mut claimed = self.claimed.subscribe();
        loop {
            if *claimed.borrow_and_update() {
                if claimed.changed().await.is_err() {
                    return;
                }
                continue;
            }
            // SAFETY: `link` owns the socket and outlives `watched`, which this task drops first.
            let watched =
                unsafe { watch_fd(SocketFd(link.socket.as_raw_fd()), Interest::READABLE) };
            let Ok(watched) = watched else {
                return self.fail(&link, "cannot watch the link's socket".into());
            };
            // Read until an executor takes the links (the registration is dropped then).
            loop {
                let Some(fabric) = self.fabric.upgrade() else {
                    return;
                };
                match link.drain(&*fabric) {
                    None => return,
                    Some(true) => {
                        tokio::task::yield_now().await;
                        continue;
                    }
                    Some(false) => {}
                }
                drop(fabric);
                tokio::select! {
                    ready = watched.readable() => match ready {
                        // Cleared before the next drain, so input after it wakes the next wait.
                        Ok(mut guard) => guard.clear_ready(),
                        Err(e) => return self.fail(&link, format!("watching the link: {e}")),
                    },
                    changed = claimed.changed() => {
                        if changed.is_err() {
                            return;
                        }
                        if *claimed.borrow() {
                            break;
                        }
                    }
                }
            }
        }
    }

    /// Delivers what has already arrived on every link, on the calling thread (a link another
    /// thread is reading is skipped). A heartbeat calls this before it says which chips wait on
    /// which: a message in a socket whose executor is busy has arrived, and its sender must
    /// not be taken for a straggler.
    pub(crate) fn deliver_arrived(&self) {
        let Some(fabric) = self.fabric.upgrade() else {
            return;
        };
        let links = self.links().clone();
        for link in links {
            link.drain_if_free(&*fabric);
        }
    }

    fn fail(&self, link: &LinkInput, error: String) {
        match self.fabric.upgrade() {
            Some(fabric) => link.fail(&*fabric, error),
            None => link.done.store(true, Ordering::Release),
        }
    }

    /// `poll(2)` on the eventfd and every open link for up to `timeout_ms` (-1: no limit; none
    /// while a link has records pending in its reader), then delivers what arrived, on this
    /// thread.
    fn poll_links(&self, timeout_ms: i32) {
        let Some(wake) = &self.wake else {
            return;
        };
        let links: Vec<Arc<LinkInput>> = {
            let mut links = self.links();
            links.retain(|l| !l.done.load(Ordering::Acquire));
            links.clone()
        };
        let mut fds: Vec<libc::pollfd> = std::iter::once(wake.as_raw_fd())
            .chain(links.iter().map(|l| l.socket.as_raw_fd()))
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let pending = |l: &LinkInput| l.pending.load(Ordering::Acquire);
        let timeout_ms = match links.iter().any(|l| pending(l)) {
            true => 0,
            false => timeout_ms,
        };
        // SAFETY: `fds` is a valid array of `fds.len()` pollfd structs for the call's duration.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
        if ready < 0 {
            // Interrupted: the executor looks again and calls back.
            return;
        }
        if fds[0].revents != 0 {
            let mut count = [0u8; 8];
            // SAFETY: reads at most 8 bytes into `count`, an 8-byte buffer.
            let _ = unsafe { libc::read(fds[0].fd, count.as_mut_ptr().cast(), count.len()) };
        }
        let Some(fabric) = self.fabric.upgrade() else {
            return;
        };
        let _delivering = Delivering::start();
        for (link, fd) in links.iter().zip(&fds[1..]) {
            // A link that stops at its budget stays pending: the rest next time round, after
            // the executor has run what this delivered.
            if fd.revents != 0 || pending(link) {
                link.drain(&*fabric);
            }
        }
    }
}

impl LinkInputs {
    /// Makes the executor's `poll(2)` return (now, or at its next call).
    fn notify(&self) {
        if let Some(wake) = &self.wake {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes the 8 bytes of `one` to an eventfd this struct owns.
            let _ = unsafe { libc::write(wake.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        }
    }
}

impl IdleWait for LinkInputs {
    fn begin(&self) -> bool {
        self.wake.is_some()
            && self
                .claimed
                .send_if_modified(|claimed| !std::mem::replace(claimed, true))
    }

    fn wait(&self) {
        self.poll_links(-1);
    }

    fn poll(&self) {
        self.poll_links(0);
    }

    fn wake(&self) {
        if !DELIVERING.with(|d| d.get()) {
            self.notify();
        }
    }

    fn finish(&self) {
        self.claimed.send_replace(false);
    }
}

/// A non-blocking eventfd (`None` off Linux, or when none can be made).
#[cfg(target_os = "linux")]
fn eventfd() -> Option<OwnedFd> {
    // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor we own.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(not(target_os = "linux"))]
fn eventfd() -> Option<OwnedFd> {
    None
}
