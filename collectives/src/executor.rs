//! The chip executor: runs one future per chip on a few OS threads, each thread sweeping its
//! own block of chips in id order and polling those that were woken.
//!
//! Why not one tokio task per chip: at 100,000 chips nothing a message touches is in cache,
//! and the order in which chips run decides how much of it is. A chip runs once per wake-up
//! and handles every message that has arrived for it since; the messages it sends go to its
//! torus neighbours. Swept in id order, a chip runs right after its neighbour along x has
//! written into its inbox and a plane after its neighbour along y did, while those lines are
//! still in cache; a run queue in wake-up order visits chips all over the pod. Which chips are
//! runnable is one bit each (a wake-up is one atomic OR on a word a thread sweeps anyway), in
//! place of a task header per chip that every wake-up and every poll reads and writes.
//!
//! Futures still run inside the tokio runtime that called [`run_on_threads`] (its timers, its
//! blocking pool, its channels), and wakers from anywhere (another worker's link, a timer)
//! work as usual. The first chip error (or panic) stops every chip, as does dropping the
//! caller's future.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;

use crate::error::CollectiveError;

/// A chip's program, as the executor holds it.
pub(crate) type ChipFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Chips per runnable word.
const WORD: usize = 64;

/// A thread sweeps a word again as long as its chips keep waking each other (neighbours along
/// x mostly share a word), up to this many rounds before it moves on (so that no word can hold
/// a thread forever). Staying while the word's chips are in cache measured better than moving
/// on after one round (about 10-25% more message events per second at 24x24x24 and 32x32x32
/// for 16 rounds against 1, and more again up to this bound).
const ROUNDS_PER_WORD: usize = 1024;

/// What the threads and the wakers share.
#[derive(Debug)]
struct Shared {
    /// Runnable chips, one bit each.
    runnable: Box<[AtomicU64]>,
    /// The words each thread sweeps: `words[t]..words[t + 1]`.
    words: Vec<usize>,
    /// Per thread: whether it is about to sleep or sleeps, and its handle to wake it.
    sleeping: Box<[AtomicBool]>,
    threads: Box<[OnceLock<Thread>]>,
    /// Set when every thread must stop: a chip failed, or the caller gave up.
    stop: AtomicBool,
}

impl Shared {
    fn owner_of_word(&self, word: usize) -> usize {
        self.words.partition_point(|&start| start <= word) - 1
    }

    /// Chip `chip` can make progress.
    fn mark(&self, chip: usize) {
        let (word, bit) = (chip / WORD, 1u64 << (chip % WORD));
        let before = self.runnable[word].fetch_or(bit, Ordering::SeqCst);
        if before & bit == 0 {
            let owner = self.owner_of_word(word);
            if self.sleeping[owner].load(Ordering::SeqCst) {
                self.wake_thread(owner);
            }
        }
    }

    fn wake_thread(&self, t: usize) {
        if let Some(thread) = self.threads[t].get() {
            thread.unpark();
        }
    }

    fn stop_all(&self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in 0..self.threads.len() {
            self.wake_thread(t);
        }
    }
}

/// The waker of one chip.
struct ChipWaker {
    shared: Arc<Shared>,
    chip: usize,
}

impl Wake for ChipWaker {
    fn wake(self: Arc<Self>) {
        self.shared.mark(self.chip);
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.shared.mark(self.chip);
    }
}

/// Stops the threads when the caller's future is dropped before they finish.
struct StopOnDrop {
    shared: Arc<Shared>,
    /// Cleared once every thread has finished: there is nothing left to stop (and the blocking
    /// pool's threads have other work by then, which a stray unpark could disturb).
    armed: bool,
}

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.shared.stop_all();
        }
    }
}

/// Runs every future to completion on `threads` OS threads (inside the current tokio runtime)
/// and returns the results in order. The first error, or a panic, stops all the others.
pub(crate) async fn run_on_threads<T, E>(
    futures: Vec<ChipFuture<T, E>>,
    threads: usize,
) -> Result<Vec<T>, E>
where
    T: Send + 'static,
    E: From<CollectiveError> + Send + 'static,
{
    let n = futures.len();
    let words = n.div_ceil(WORD);
    let threads = threads.clamp(1, words.max(1));
    // Whole words per thread, as even as they come.
    let bounds: Vec<usize> = (0..=threads).map(|t| t * words / threads).collect();
    let shared = Arc::new(Shared {
        runnable: (0..words)
            .map(|w| {
                // Every chip starts runnable.
                let chips = (n - w * WORD).min(WORD);
                AtomicU64::new(if chips == WORD { !0 } else { (1 << chips) - 1 })
            })
            .collect(),
        words: bounds.clone(),
        sleeping: (0..threads).map(|_| AtomicBool::new(false)).collect(),
        threads: (0..threads).map(|_| OnceLock::new()).collect(),
        stop: AtomicBool::new(false),
    });
    let mut stop = StopOnDrop {
        shared: shared.clone(),
        armed: true,
    };
    let failure: Arc<Mutex<Option<E>>> = Arc::new(Mutex::new(None));
    // Each thread's block of chips, cut off the end of the list, then put in thread order.
    let mut rest = futures;
    let mut blocks: Vec<(usize, Vec<ChipFuture<T, E>>)> = (0..threads)
        .rev()
        .map(|t| {
            let first_chip = (bounds[t] * WORD).min(rest.len());
            (first_chip, rest.split_off(first_chip))
        })
        .collect();
    blocks.reverse();
    // Blocking-pool threads run inside the runtime: chips' timers and channels work there.
    let joins: Vec<_> = blocks
        .into_iter()
        .enumerate()
        .map(|(t, (first_chip, block))| {
            let (shared, failure) = (shared.clone(), failure.clone());
            tokio::task::spawn_blocking(move || sweep(&shared, t, first_chip, block, &failure))
        })
        .collect();
    let mut per_thread: Vec<Vec<Option<T>>> = Vec::with_capacity(threads);
    let mut thread_failed = None;
    for join in joins {
        match join.await {
            Ok(done) => per_thread.push(done),
            Err(e) => {
                shared.stop_all();
                thread_failed.get_or_insert(e);
            }
        }
    }
    stop.armed = false;
    // A chip's own error comes first: a thread that failed afterwards (say, dropping its
    // chips) must not hide it.
    if let Some(e) = failure.lock().unwrap_or_else(|e| e.into_inner()).take() {
        return Err(e);
    }
    if let Some(e) = thread_failed {
        return Err(CollectiveError::Internal(format!("chip executor thread failed: {e}")).into());
    }
    per_thread
        .into_iter()
        .flatten()
        .collect::<Option<Vec<T>>>()
        .ok_or_else(|| CollectiveError::Internal("a chip returned no result".into()).into())
}

/// One thread's loop: polls the runnable chips of its words, in id order, until all of them
/// have finished or everything stops. Returns its chips' results.
fn sweep<T, E>(
    shared: &Arc<Shared>,
    t: usize,
    first_chip: usize,
    mut chips: Vec<ChipFuture<T, E>>,
    failure: &Mutex<Option<E>>,
) -> Vec<Option<T>>
where
    E: From<CollectiveError>,
{
    let _ = shared.threads[t].set(std::thread::current());
    let wakers: Vec<Waker> = (0..chips.len())
        .map(|i| {
            Waker::from(Arc::new(ChipWaker {
                shared: shared.clone(),
                chip: first_chip + i,
            }))
        })
        .collect();
    // A chip with a result has finished.
    let mut results: Vec<Option<T>> = (0..chips.len()).map(|_| None).collect();
    let mut left = chips.len();
    let (start, end) = (shared.words[t], shared.words[t + 1]);
    let fail = |e: E| {
        failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(e);
        shared.stop_all();
    };
    'run: while left > 0 {
        let mut ran = false;
        for word in start..end {
            for _ in 0..ROUNDS_PER_WORD {
                let mut bits = shared.runnable[word].swap(0, Ordering::AcqRel);
                if bits == 0 {
                    break;
                }
                ran = true;
                while bits != 0 {
                    if shared.stop.load(Ordering::Relaxed) {
                        break 'run;
                    }
                    let i = word * WORD + bits.trailing_zeros() as usize - first_chip;
                    bits &= bits - 1;
                    if results[i].is_some() {
                        continue;
                    }
                    let mut cx = Context::from_waker(&wakers[i]);
                    let polled = catch_unwind(AssertUnwindSafe(|| chips[i].as_mut().poll(&mut cx)));
                    match polled {
                        Ok(Poll::Pending) => {}
                        Ok(Poll::Ready(Ok(v))) => {
                            results[i] = Some(v);
                            left -= 1;
                        }
                        Ok(Poll::Ready(Err(e))) => {
                            fail(e);
                            break 'run;
                        }
                        Err(_) => {
                            fail(
                                CollectiveError::Internal(format!(
                                    "chip {} panicked",
                                    first_chip + i
                                ))
                                .into(),
                            );
                            break 'run;
                        }
                    }
                }
            }
        }
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if !ran {
            // Announce the sleep, then look again: a wake-up either sees the announcement or
            // set its bit before this look (both sides are sequentially consistent).
            shared.sleeping[t].store(true, Ordering::SeqCst);
            let idle = (start..end).all(|w| shared.runnable[w].load(Ordering::SeqCst) == 0);
            if idle && !shared.stop.load(Ordering::SeqCst) {
                std::thread::park();
            }
            shared.sleeping[t].store(false, Ordering::SeqCst);
        }
    }
    // Chips still running are dropped here, on their thread.
    drop(chips);
    results
}
