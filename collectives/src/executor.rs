//! The chip executor: runs one future per chip on a few OS threads, each thread sweeping its
//! own block of chips in id order (up, then down) and polling those that were woken.
//!
//! Why not one tokio task per chip: at 100,000 chips nothing a message touches is in cache,
//! and the order in which chips run decides how much of it is. A chip runs once per wake-up
//! and handles every message that has arrived for it since; the messages it sends go to its
//! torus neighbours. Swept in id order, a chip runs right after a neighbour along x has
//! written into its inbox and a row after a neighbour along y did, while those lines are
//! still in cache; a run queue in wake-up order visits chips all over the pod. Which chips are
//! runnable is one bit each (a wake-up is one atomic OR on a word a thread sweeps anyway), in
//! place of a task header per chip that every wake-up and every poll reads and writes.
//!
//! Sweeps alternate between ascending and descending id order (see [`Direction`]): a ring
//! lane whose data flows the way the sweep goes runs many steps in one visit of each chip, the
//! other lane one step per sweep, and a phase waits for both.
//!
//! Futures still run inside the tokio runtime that called [`run_on_threads`] (its timers, its
//! blocking pool, its channels), and wakers from anywhere (another worker's link, a timer)
//! work as usual. The first chip error (or panic) stops every chip, as does dropping the
//! caller's future.
//!
//! Tests explore schedules: under [`explore_schedule`] each thread visits its words and the
//! runnable chips of a word in an order drawn from a seed (a seed replays its order), so a
//! property test can check over many seeds that results and virtual times do not depend on
//! which chip runs first, as deterministic simulators do.
//!
//! An executor with one thread (a worker's few chips) can be given an [`IdleWait`]: what the
//! thread does instead of parking when none of its chips can run. A transport whose messages
//! arrive on sockets waits on them there, so that the thread a message wakes is the one that
//! runs its chip, not a reader thread that then wakes this one.

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::Duration;

use crate::error::CollectiveError;
use crate::recorder::FlightRecorder;

/// A chip's program, as the executor holds it.
pub(crate) type ChipFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Chips per runnable word.
const WORD: usize = 64;

/// A thread sweeps a word again as long as its chips keep waking each other (neighbours along
/// x mostly share a word), up to this many rounds before it moves on (so that no word can hold
/// a thread forever). Staying while the word's chips are in cache is faster than moving on
/// after one round, with sweeps that alternate direction too: fewer last-level cache misses
/// (docs/PERFORMANCE.md).
const ROUNDS_PER_WORD: usize = 1024;

/// The order in which a thread visits runnable chips: its words, and the chips of a word.
///
/// A ring lane's data flows one way along an axis (to higher ids for `Plus`, lower for
/// `Minus`). When the sweep goes the same way, a chip visited right after its upstream
/// neighbour finds every message that neighbour just sent and runs as many steps as there are,
/// so the lane crosses the whole ring in one sweep; against the flow, each chip finds one new
/// message per sweep. A phase ends when both lanes of an axis do, so sweeping one way only made
/// every phase take one sweep per ring position; alternating lets each lane go with the flow
/// every other sweep. (48x48x48, 1 GiB all-reduce in meta mode: 61-66 s -> 36 s, the same
/// virtual time.) The rounds a thread spends on one word alternate the same way, for the
/// lanes along x whose ring lies (mostly) within a word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Ascending,
    Descending,
}

impl Direction {
    fn reversed(self) -> Direction {
        match self {
            Direction::Ascending => Direction::Descending,
            Direction::Descending => Direction::Ascending,
        }
    }

    /// The `k`-th of the words `start..end` in this direction.
    fn word(self, start: usize, end: usize, k: usize) -> usize {
        match self {
            Direction::Ascending => start + k,
            Direction::Descending => end - 1 - k,
        }
    }

    /// Takes the next chip (bit index) out of `bits` in this direction.
    fn take_bit(self, bits: &mut u64) -> Option<usize> {
        if *bits == 0 {
            return None;
        }
        let bit = match self {
            Direction::Ascending => bits.trailing_zeros(),
            Direction::Descending => 63 - bits.leading_zeros(),
        };
        *bits &= !(1u64 << bit);
        Some(bit as usize)
    }
}

/// What an executor's only thread does when none of its chips can run, in place of parking:
/// wait for input (messages on sockets, say) or a wake-up, delivering what arrives on this
/// thread before the chips it wakes run. One thread hand-off fewer per message than a reader
/// thread that delivers and then wakes the executor's.
pub trait IdleWait: Send + Sync {
    /// Takes over the waiting for one executor until [`IdleWait::finish`]; false when it
    /// cannot (another executor has it), and the executor parks as usual.
    fn begin(&self) -> bool;
    /// Sleeps until [`IdleWait::wake`] or input, delivering the input. May return early.
    fn wait(&self);
    /// Delivers input that has already arrived, without sleeping.
    fn poll(&self);
    /// Makes a [`IdleWait::wait`] in progress return, or the next one return at once.
    fn wake(&self);
    /// Ends what [`IdleWait::begin`] took over.
    fn finish(&self);
}

/// A begun [`IdleWait`], as the executor's thread and wakers use it.
#[derive(Clone)]
struct IdleHook(Arc<dyn IdleWait>);

impl std::fmt::Debug for IdleHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdleHook")
    }
}

/// Finishes a begun [`IdleWait`] when [`run_on_threads`] returns or its future is dropped
/// (not when the last waker goes: a waker a chip left behind must not keep it begun).
struct FinishOnDrop(Option<IdleHook>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let Some(idle) = self.0.take() {
            idle.0.finish();
        }
    }
}

/// Clears a thread's kernel id from [`Shared::os_threads`] when its sweep ends.
struct ForgetOnDrop<'a>(&'a AtomicU32);

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Relaxed);
    }
}

/// How often a busy executor thread with an [`IdleWait`] delivers input without sleeping: a
/// chip that keeps the thread busy must not keep the others' messages unread for long.
const BUSY_POLL_NS: u64 = 1_000_000;

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
    /// Per thread: wall ns when its previous pass over its words started (0 while it sleeps).
    /// A chip woken now runs before the end of the thread's next pass, so `now - this` bounds
    /// how long a runnable chip can have waited to run.
    previous_pass_ns: Box<[AtomicU64]>,
    /// Per thread: its id in the kernel, 0 until it runs or where the kernel does not tell
    /// (for [`crate::CpuWaitMeter`]).
    os_threads: Box<[AtomicU32]>,
    /// Per chip, the flight recorder told where the executor has it (empty: none told).
    observers: Vec<Arc<FlightRecorder>>,
    /// What the only thread does instead of parking, when it was given one that began.
    idle: Option<IdleHook>,
    /// Set under [`explore_schedule`]: the seed of the threads' visiting order.
    schedule_seed: Option<u64>,
}

impl Shared {
    /// The state of `n` chips swept by `words.len() - 1` threads (thread `t` sweeps words
    /// `words[t]..words[t + 1]`), every chip runnable.
    fn new(
        n: usize,
        words: Vec<usize>,
        observers: Vec<Arc<FlightRecorder>>,
        idle: Option<Arc<dyn IdleWait>>,
    ) -> Shared {
        let threads = words.len() - 1;
        Shared {
            runnable: (0..n.div_ceil(WORD))
                .map(|w| {
                    let chips = (n - w * WORD).min(WORD);
                    AtomicU64::new(if chips == WORD { !0 } else { (1 << chips) - 1 })
                })
                .collect(),
            words,
            sleeping: (0..threads).map(|_| AtomicBool::new(false)).collect(),
            threads: (0..threads).map(|_| OnceLock::new()).collect(),
            stop: AtomicBool::new(false),
            previous_pass_ns: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            os_threads: (0..threads).map(|_| AtomicU32::new(0)).collect(),
            observers: if observers.len() == n {
                observers
            } else {
                Vec::new()
            },
            idle: idle.filter(|i| threads == 1 && i.begin()).map(IdleHook),
            schedule_seed: SCHEDULE_SEED.try_with(|seed| *seed).ok(),
        }
    }

    /// Thread `t` found nothing to run: it announces its sleep, looks once more, and sleeps
    /// (or waits on the idle hook) if its words are still idle. Whether it slept.
    fn sleep_when_idle(&self, t: usize) -> bool {
        // Announce the sleep, then look again: a wake-up either sees the announcement or set
        // its bit before this look (both sides are sequentially consistent).
        self.sleeping[t].store(true, Ordering::SeqCst);
        let (start, end) = (self.words[t], self.words[t + 1]);
        let idle = (start..end).all(|w| self.runnable[w].load(Ordering::SeqCst) == 0);
        let slept = idle && !self.stop.load(Ordering::SeqCst);
        if slept {
            // Nothing of this thread's is runnable: it keeps no chip waiting.
            self.previous_pass_ns[t].store(0, Ordering::Relaxed);
            match &self.idle {
                Some(idle) => idle.0.wait(),
                None => std::thread::park(),
            }
        }
        self.sleeping[t].store(false, Ordering::SeqCst);
        slept
    }
}

tokio::task_local! {
    /// The seed of the visiting order of executors started inside [`explore_schedule`].
    static SCHEDULE_SEED: u64;
}

/// Runs `work` with every chip executor it starts (`run_chips`, a worker's chips) visiting
/// words and chips in an order drawn from `seed` instead of id order: for tests that explore
/// schedules. The same seed gives the same order on the same threads.
pub async fn explore_schedule<F: Future>(seed: u64, work: F) -> F::Output {
    SCHEDULE_SEED.scope(seed, work).await
}

/// A seeded order (splitmix64): which word, and which runnable chip of it, a thread visits
/// next under [`explore_schedule`].
#[derive(Debug, Clone)]
struct Shuffle(u64);

impl Shuffle {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Fisher-Yates.
    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            items.swap(i, j);
        }
    }

    /// The set bits of `bits`, in a drawn order.
    fn bits(&mut self, mut bits: u64) -> Vec<usize> {
        let mut order = Vec::with_capacity(bits.count_ones() as usize);
        while let Some(bit) = Direction::Ascending.take_bit(&mut bits) {
            order.push(bit);
        }
        self.shuffle(&mut order);
        order
    }
}

/// Every executor running in this process, for [`scheduling_lag`] and the threads'
/// run-queue delays ([`crate::CpuWaitMeter`]).
static EXECUTORS: Mutex<Vec<Weak<Shared>>> = Mutex::new(Vec::new());

/// The longest a runnable chip of this process may have waited for its thread, now: how far
/// behind a busy host is. A chip that has not moved for longer than this was not runnable all
/// that time (it waits, or it stopped): what lets a watchdog tell a stalled chip from one that
/// did not get a turn. Zero when no chips run.
pub fn scheduling_lag() -> Duration {
    let now = crate::wall_ns();
    let lag = live_executors()
        .iter()
        .flat_map(|s| s.previous_pass_ns.iter().map(|p| p.load(Ordering::Relaxed)))
        .filter(|&p| p > 0)
        .map(|p| now.saturating_sub(p))
        .max()
        .unwrap_or(0);
    Duration::from_nanos(lag)
}

/// Every executor running in this process now.
fn live_executors() -> Vec<Arc<Shared>> {
    let mut executors = EXECUTORS.lock().unwrap_or_else(|e| e.into_inner());
    executors.retain(|w| w.strong_count() > 0);
    executors.iter().filter_map(Weak::upgrade).collect()
}

/// The kernel's ids of the threads of every executor running in this process.
pub(crate) fn executor_thread_ids() -> Vec<u32> {
    live_executors()
        .iter()
        .flat_map(|s| s.os_threads.iter().map(|t| t.load(Ordering::Relaxed)))
        .filter(|&t| t > 0)
        .collect()
}

impl Shared {
    fn owner_of_word(&self, word: usize) -> usize {
        self.words.partition_point(|&start| start <= word) - 1
    }

    /// Chip `chip` can make progress.
    fn mark(&self, chip: usize) {
        if let Some(o) = self.observers.get(chip) {
            o.set_runnable();
        }
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
        if let Some(idle) = &self.idle {
            idle.0.wake();
        } else if let Some(thread) = self.threads[t].get() {
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
/// `observers` (one per future, or none) are told when their chip is runnable, idle or done.
/// `idle` is what the thread does instead of parking, when there is only one thread.
pub(crate) async fn run_on_threads<T, E>(
    futures: Vec<ChipFuture<T, E>>,
    threads: usize,
    observers: Vec<Arc<FlightRecorder>>,
    idle: Option<Arc<dyn IdleWait>>,
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
    let shared = Arc::new(Shared::new(n, bounds.clone(), observers, idle));
    let _finish = FinishOnDrop(shared.idle.clone());
    // Every chip starts runnable.
    shared.observers.iter().for_each(|o| o.set_runnable());
    EXECUTORS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(Arc::downgrade(&shared));
    let mut stop = StopOnDrop {
        shared: shared.clone(),
        armed: true,
    };
    let failure: Arc<Mutex<Option<E>>> = Arc::new(Mutex::new(None));
    // Each thread's block of chips (its words), cut off the end of the list, then put in
    // thread order.
    let mut rest = futures;
    let mut blocks: Vec<Vec<ChipFuture<T, E>>> = (0..threads)
        .rev()
        .map(|t| rest.split_off(bounds[t] * WORD))
        .collect();
    blocks.reverse();
    // Blocking-pool threads run inside the runtime: chips' timers and channels work there.
    let joins: Vec<_> = blocks
        .into_iter()
        .enumerate()
        .map(|(t, block)| {
            let (shared, failure) = (shared.clone(), failure.clone());
            tokio::task::spawn_blocking(move || sweep(&shared, t, block, &failure))
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

/// One thread's loop: polls the runnable chips of its words, in id order one way then the
/// other (see [`Direction`]), until all of them have finished or everything stops. Returns its
/// chips' results (`chips` are those of its words, in order).
fn sweep<T, E>(
    shared: &Arc<Shared>,
    t: usize,
    chips: Vec<ChipFuture<T, E>>,
    failure: &Mutex<Option<E>>,
) -> Vec<Option<T>>
where
    E: From<CollectiveError>,
{
    let _ = shared.threads[t].set(std::thread::current());
    shared.os_threads[t].store(crate::procfs::os_thread_id(), Ordering::Relaxed);
    // The thread goes back to its pool when the sweep ends: no longer the executor's.
    let _forget = ForgetOnDrop(&shared.os_threads[t]);
    let (start, end) = (shared.words[t], shared.words[t + 1]);
    let mut block = Block::new(shared, start * WORD, chips);
    let fail = |e: E| {
        failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(e);
        shared.stop_all();
    };
    let mut pass = Direction::Ascending;
    let mut shuffle = shared
        .schedule_seed
        .map(|seed| Shuffle(seed ^ (t as u64).wrapping_mul(0xa076_1d64_78bd_642f)));
    let mut pass_started = crate::wall_ns();
    let mut polled_ns = pass_started;
    'run: while block.left > 0 {
        let now = crate::wall_ns();
        shared.previous_pass_ns[t].store(pass_started, Ordering::Relaxed);
        pass_started = now;
        if let Some(idle) = &shared.idle
            && now.saturating_sub(polled_ns) >= BUSY_POLL_NS
            && !shared.stop.load(Ordering::Relaxed)
        {
            idle.0.poll();
            polled_ns = now;
        }
        let mut ran = false;
        let drawn_words = shuffle.as_mut().map(|s| {
            let mut words: Vec<usize> = (start..end).collect();
            s.shuffle(&mut words);
            words
        });
        for k in 0..end - start {
            let word = match &drawn_words {
                Some(words) => words[k],
                None => pass.word(start, end, k),
            };
            match block.poll_word(word, pass, &mut shuffle) {
                Ok(polled) => ran |= polled,
                Err(Halt::Stopped) => break 'run,
                Err(Halt::Failed(e)) => {
                    fail(e);
                    break 'run;
                }
            }
        }
        pass = pass.reversed();
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        if !ran && shared.sleep_when_idle(t) {
            pass_started = crate::wall_ns();
            polled_ns = pass_started;
        }
    }
    // Chips still running are dropped here, on their thread.
    let Block { chips, results, .. } = block;
    drop(chips);
    results
}

/// Why a sweep ends before its chips finish.
enum Halt<E> {
    /// Every thread stops (another chip failed, or the caller gave up).
    Stopped,
    /// This chip failed: its error.
    Failed(E),
}

/// One thread's chips (those of its words, from `first_chip`): their futures, their wakers,
/// and the results of those that finished.
struct Block<'s, T, E> {
    shared: &'s Arc<Shared>,
    first_chip: usize,
    chips: Vec<ChipFuture<T, E>>,
    wakers: Vec<Waker>,
    results: Vec<Option<T>>,
    /// How many have not finished.
    left: usize,
}

impl<'s, T, E> Block<'s, T, E>
where
    E: From<CollectiveError>,
{
    fn new(shared: &'s Arc<Shared>, first_chip: usize, chips: Vec<ChipFuture<T, E>>) -> Self {
        let wakers = (0..chips.len())
            .map(|i| {
                Waker::from(Arc::new(ChipWaker {
                    shared: shared.clone(),
                    chip: first_chip + i,
                }))
            })
            .collect();
        Block {
            shared,
            first_chip,
            results: (0..chips.len()).map(|_| None).collect(),
            left: chips.len(),
            chips,
            wakers,
        }
    }

    /// Polls the runnable chips of word `word`, again while it has some (up to
    /// [`ROUNDS_PER_WORD`] rounds, each the other way), in `pass`'s order or `shuffle`'s:
    /// whether any ran.
    fn poll_word(
        &mut self,
        word: usize,
        pass: Direction,
        shuffle: &mut Option<Shuffle>,
    ) -> Result<bool, Halt<E>> {
        let mut ran = false;
        let mut round = pass;
        for _ in 0..ROUNDS_PER_WORD {
            let mut bits = self.shared.runnable[word].swap(0, Ordering::AcqRel);
            if bits == 0 {
                break;
            }
            ran = true;
            let drawn = shuffle.as_mut().map(|s| s.bits(bits));
            let mut drawn = drawn.into_iter().flatten();
            while let Some(bit) = match shuffle {
                Some(_) => drawn.next(),
                None => round.take_bit(&mut bits),
            } {
                if self.shared.stop.load(Ordering::Relaxed) {
                    return Err(Halt::Stopped);
                }
                let i = word * WORD + bit - self.first_chip;
                if self.results[i].is_some() {
                    continue;
                }
                let (chip, waker) = (self.first_chip + i, &self.wakers[i]);
                match poll_chip(self.shared, chip, &mut self.chips[i], waker) {
                    Ok(Some(v)) => {
                        self.results[i] = Some(v);
                        self.left -= 1;
                    }
                    Ok(None) => {}
                    Err(e) => return Err(Halt::Failed(e)),
                }
            }
            round = round.reversed();
        }
        Ok(ran)
    }
}

/// Polls chip `chip` once, telling its observer: its result when it finished, its error (a
/// panic becomes one).
fn poll_chip<T, E>(
    shared: &Shared,
    chip: usize,
    future: &mut ChipFuture<T, E>,
    waker: &Waker,
) -> Result<Option<T>, E>
where
    E: From<CollectiveError>,
{
    let observer = shared.observers.get(chip);
    if let Some(o) = observer {
        o.set_polling();
    }
    let mut cx = Context::from_waker(waker);
    match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(&mut cx))) {
        Ok(Poll::Pending) => {
            if let Some(o) = observer {
                o.set_idle_unless_woken();
            }
            Ok(None)
        }
        Ok(Poll::Ready(Ok(v))) => {
            if let Some(o) = observer {
                o.set_done();
            }
            Ok(Some(v))
        }
        Ok(Poll::Ready(Err(e))) => Err(e),
        Err(_) => Err(CollectiveError::Internal(format!("chip {chip} panicked")).into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_direction_visits_words_and_chips_in_its_order_and_reverses() {
        let take_all = |dir: Direction, mut bits: u64| {
            std::iter::from_fn(|| dir.take_bit(&mut bits)).collect::<Vec<_>>()
        };
        let bits = (1 << 63) | (1 << 40) | (1 << 3) | 1;
        assert_eq!(take_all(Direction::Ascending, bits), [0, 3, 40, 63]);
        assert_eq!(take_all(Direction::Descending, bits), [63, 40, 3, 0]);
        assert_eq!(take_all(Direction::Descending, 0), Vec::<usize>::new());
        let words = |dir: Direction| (0..3).map(|k| dir.word(5, 8, k)).collect::<Vec<_>>();
        assert_eq!(words(Direction::Ascending), [5, 6, 7]);
        assert_eq!(words(Direction::Descending), [7, 6, 5]);
        assert_eq!(Direction::Ascending.reversed(), Direction::Descending);
        assert_eq!(Direction::Descending.reversed(), Direction::Ascending);
    }

    /// An [`IdleWait`] that counts its calls and sleeps on a condition variable.
    #[derive(Default)]
    struct Counting {
        woken: Mutex<bool>,
        bell: std::sync::Condvar,
        begun: AtomicUsize,
        waits: AtomicUsize,
        finished: AtomicUsize,
    }

    impl IdleWait for Counting {
        fn begin(&self) -> bool {
            self.begun.fetch_add(1, Ordering::SeqCst);
            true
        }
        fn wait(&self) {
            self.waits.fetch_add(1, Ordering::SeqCst);
            let mut woken = self.woken.lock().unwrap();
            while !*woken {
                woken = self.bell.wait(woken).unwrap();
            }
            *woken = false;
        }
        fn poll(&self) {}
        fn wake(&self) {
            *self.woken.lock().unwrap() = true;
            self.bell.notify_all();
        }
        fn finish(&self) {
            self.finished.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// An executor with one thread sleeps in its `IdleWait` (begun once, finished once, woken
    /// through it by a waker called from another thread); one with several threads parks and
    /// never begins it.
    #[test]
    fn one_thread_sleeps_in_its_idle_wait_and_several_park() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .expect("runtime");
        let _runtime = rt.enter();
        for (chips, threads) in [(3, 1), (3 * WORD, 3)] {
            let idle = Arc::new(Counting::default());
            let futures: Vec<ChipFuture<usize, CollectiveError>> = (0..chips)
                .map(|i| {
                    let mut timer = (i == 1).then(|| {
                        Box::pin(tokio::time::sleep(std::time::Duration::from_millis(30)))
                    });
                    Box::pin(std::future::poll_fn(move |cx| match &mut timer {
                        Some(t) => t.as_mut().poll(cx).map(|()| Ok(i)),
                        None => Poll::Ready(Ok(i)),
                    })) as ChipFuture<usize, CollectiveError>
                })
                .collect();
            let hook: Arc<dyn IdleWait> = idle.clone();
            let done = rt
                .block_on(async {
                    tokio::time::timeout(
                        std::time::Duration::from_secs(20),
                        run_on_threads(futures, threads, Vec::new(), Some(hook)),
                    )
                    .await
                })
                .expect("finished in time")
                .expect("no chip failed");
            assert_eq!(done, (0..chips).collect::<Vec<_>>());
            let count = |c: &AtomicUsize| c.load(Ordering::SeqCst);
            if threads == 1 {
                assert_eq!((count(&idle.begun), count(&idle.finished)), (1, 1));
                assert!(count(&idle.waits) >= 1);
            } else {
                assert_eq!(count(&idle.begun) + count(&idle.waits), 0);
            }
        }
    }

    /// Under `explore_schedule` a thread's first visit of its chips follows the seed: the
    /// same seed the same order, other seeds other orders, id order none of them (so a
    /// property test over seeds explores schedules, and can fail).
    #[test]
    fn a_seed_draws_the_visiting_order_and_replays_it() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        let _runtime = rt.enter();
        const CHIPS: usize = 2 * WORD + 5;
        let first_visits = |seed: Option<u64>| {
            let order = Arc::new(Mutex::new(Vec::new()));
            let futures: Vec<ChipFuture<(), CollectiveError>> = (0..CHIPS)
                .map(|i| {
                    let order = order.clone();
                    Box::pin(async move {
                        order.lock().expect("order").push(i);
                        Ok(())
                    }) as ChipFuture<(), CollectiveError>
                })
                .collect();
            let run = run_on_threads(futures, 1, Vec::new(), None);
            match seed {
                Some(seed) => rt.block_on(explore_schedule(seed, run)),
                None => rt.block_on(run),
            }
            .expect("no chip failed");
            order.lock().expect("order").clone()
        };
        let ids: Vec<usize> = (0..CHIPS).collect();
        assert_eq!(first_visits(None), ids);
        let a = first_visits(Some(1));
        assert_eq!(a, first_visits(Some(1)));
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, ids);
        assert_ne!(a, ids);
        assert_ne!(a, first_visits(Some(2)));
    }

    /// A token relayed down, and then up, a line of chips spanning several words (chip `i`
    /// waits for its upstream neighbour, then hands on), on one and two threads: whichever way
    /// a sweep goes, every hand-on is seen, no chip is woken more than once, and the relay
    /// finishes.
    #[test]
    fn relays_against_and_with_the_sweep_finish_with_one_wake_up_per_hop() {
        const CHIPS: usize = 3 * WORD + 17;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .expect("runtime");
        for threads in [1, 2] {
            for descending in [true, false] {
                let got: Arc<Vec<AtomicBool>> =
                    Arc::new((0..CHIPS).map(|_| AtomicBool::new(false)).collect());
                let wakers: Arc<Vec<Mutex<Option<Waker>>>> =
                    Arc::new((0..CHIPS).map(|_| Mutex::new(None)).collect());
                let polls: Arc<Vec<AtomicUsize>> =
                    Arc::new((0..CHIPS).map(|_| AtomicUsize::new(0)).collect());
                let first = if descending { CHIPS - 1 } else { 0 };
                let futures: Vec<ChipFuture<usize, CollectiveError>> = (0..CHIPS)
                    .map(|i| {
                        let (got, wakers, polls) = (got.clone(), wakers.clone(), polls.clone());
                        let next = match descending {
                            true => i.checked_sub(1),
                            false => Some(i + 1).filter(|&n| n < CHIPS),
                        };
                        Box::pin(std::future::poll_fn(move |cx| {
                            polls[i].fetch_add(1, Ordering::SeqCst);
                            *wakers[i].lock().unwrap() = Some(cx.waker().clone());
                            if i != first && !got[i].load(Ordering::SeqCst) {
                                return Poll::Pending;
                            }
                            if let Some(n) = next {
                                got[n].store(true, Ordering::SeqCst);
                                if let Some(w) = wakers[n].lock().unwrap().take() {
                                    w.wake();
                                }
                            }
                            Poll::Ready(Ok(i))
                        })) as ChipFuture<usize, CollectiveError>
                    })
                    .collect();
                let done = rt
                    .block_on(async {
                        tokio::time::timeout(
                            std::time::Duration::from_secs(20),
                            run_on_threads(futures, threads, Vec::new(), None),
                        )
                        .await
                    })
                    .expect("the relay finished in time")
                    .expect("no chip failed");
                assert_eq!(done, (0..CHIPS).collect::<Vec<_>>());
                let polled: Vec<usize> = polls.iter().map(|p| p.load(Ordering::SeqCst)).collect();
                for (i, &n) in polled.iter().enumerate() {
                    // Every chip is polled once at the start. On one thread the first sweep
                    // ascends: a relay up the ids is handed on within that sweep (every chip
                    // finds the token on its first poll), a relay down waits for a wake-up at
                    // every chip but the first. On two threads either can happen, but never
                    // more than one wake-up per hop.
                    let expected = match (threads, descending) {
                        (1, true) if i != first => 2..=2,
                        (1, _) => 1..=1,
                        _ => 1..=2,
                    };
                    assert!(
                        expected.contains(&n),
                        "chip {i} polled {n} times ({threads} threads, descending {descending})"
                    );
                }
            }
        }
    }
}
