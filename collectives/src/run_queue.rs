//! How much of the wall time the executor's threads spent ready to run but without a CPU:
//! what a host running more threads than it has cores takes away from its chips.
//!
//! The executor's scheduling lag ([`crate::scheduling_lag`]) says how far behind its own
//! sweep is at one instant; it does not see a thread the kernel takes off the CPU between two
//! heartbeats. The kernel counts that time per thread (its run-queue delay, the second field
//! of Linux's `/proc/self/task/TID/schedstat`), and [`CpuWaitMeter`] turns the counts into the
//! share of an interval the busiest executor thread spent waiting. On a host four workers
//! share with two cores, every executor thread waits for a third to almost half of it, and a chip
//! whose peers wait on it then is held up by the host, not slow itself (the straggler
//! accounting of the coordinator's watchdog discounts it so).
//!
//! Where the kernel does not tell (another OS, no `/proc`), every share is zero: the measure
//! is absent, and nothing is discounted.

use std::collections::HashMap;
use std::time::Instant;

/// The share of wall time, between two readings, that the busiest executor thread of this
/// process spent waiting for a CPU while ready to run.
#[derive(Debug)]
pub struct CpuWaitMeter {
    /// Per thread id, its run-queue delay at the previous reading.
    last: HashMap<u32, u64>,
    at: Instant,
}

impl CpuWaitMeter {
    /// A meter whose first interval starts `now`: it takes a first reading of the threads
    /// there are and reports nothing for it; threads seen only later count from their first
    /// reading.
    pub fn new(now: Instant) -> CpuWaitMeter {
        let mut meter = CpuWaitMeter {
            last: HashMap::new(),
            at: now,
        };
        meter.share(now);
        meter
    }

    /// The share (0 to 1) of the time since the previous reading that the executor thread
    /// that waited longest spent ready to run without a CPU. A thread first seen now counts
    /// from now: its earlier delay may have been spent on other work (the threads come from a
    /// pool).
    pub fn share(&mut self, now: Instant) -> f64 {
        let delays = crate::executor::executor_thread_ids()
            .into_iter()
            .filter_map(|tid| Some((tid, crate::procfs::run_queue_delay_ns(tid)?)));
        self.share_of(now, delays)
    }

    /// A meter of another process's threads (see [`CpuWaitMeter::share_of_process`]), its
    /// first interval starting `now`.
    pub fn for_process(now: Instant, pid: u32) -> CpuWaitMeter {
        let mut meter = CpuWaitMeter {
            last: HashMap::new(),
            at: now,
        };
        meter.share_of_process(now, pid);
        meter
    }

    /// [`CpuWaitMeter::share`] for every thread of another process, `pid` (a worker, as its
    /// launcher sees it): the share of the interval its busiest-waiting thread spent ready to
    /// run without a CPU.
    pub fn share_of_process(&mut self, now: Instant, pid: u32) -> f64 {
        let delays = crate::procfs::process_run_queue_delays(pid);
        self.share_of(now, delays.into_iter())
    }

    fn share_of(&mut self, now: Instant, delays: impl Iterator<Item = (u32, u64)>) -> f64 {
        let interval = now.duration_since(self.at).as_nanos() as f64;
        self.at = now;
        let mut seen = HashMap::new();
        let mut longest = 0u64;
        for (tid, delay) in delays {
            if let Some(before) = self.last.get(&tid) {
                longest = longest.max(delay.saturating_sub(*before));
            }
            seen.insert(tid, delay);
        }
        self.last = seen;
        if interval > 0.0 {
            (longest as f64 / interval).min(1.0)
        } else {
            0.0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_share_is_the_busiest_threads_wait_over_the_interval() {
        let t0 = Instant::now();
        let mut m = CpuWaitMeter {
            last: HashMap::new(),
            at: t0,
        };
        // First sight of threads 1 and 2: their history is not this interval's.
        assert_eq!(
            m.share_of(
                t0 + Duration::from_millis(100),
                [(1, 5_000_000), (2, 0)].into_iter()
            ),
            0.0
        );
        // 100 ms later thread 1 waited 40 ms more, thread 2 10 ms; thread 3 is new.
        let s = m.share_of(
            t0 + Duration::from_millis(200),
            [(1, 45_000_000), (2, 10_000_000), (3, 90_000_000)].into_iter(),
        );
        assert!((s - 0.4).abs() < 1e-9, "{s}");
        // A thread gone and one that waited longer than the interval (clock skew): capped.
        let s = m.share_of(
            t0 + Duration::from_millis(300),
            [(3, 300_000_000)].into_iter(),
        );
        assert_eq!(s, 1.0);
    }
}
