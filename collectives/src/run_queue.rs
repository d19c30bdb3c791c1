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

/// This thread's id in the kernel, or 0 where the kernel does not tell.
pub(crate) fn os_thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// The time thread `tid` of this process has spent, in all, ready to run but waiting for a
/// CPU, ns (`None` where the kernel does not tell).
fn run_queue_delay_ns(tid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    parse_schedstat_delay(&text)
}

/// The run-queue delay of a `schedstat` line: `<on-cpu ns> <run-queue ns> <timeslices>`.
fn parse_schedstat_delay(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

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
            .filter_map(|tid| Some((tid, run_queue_delay_ns(tid)?)));
        self.share_of(now, delays)
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
    fn the_run_queue_delay_is_the_second_field() {
        assert_eq!(
            parse_schedstat_delay("208603983 13944972 383\n"),
            Some(13944972)
        );
        assert_eq!(parse_schedstat_delay("garbage"), None);
        assert_eq!(parse_schedstat_delay(""), None);
    }

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

    #[cfg(target_os = "linux")]
    #[test]
    fn this_threads_delay_is_read_where_the_kernel_counts_it() {
        let tid = os_thread_id();
        assert!(tid > 0);
        // Kernels built without scheduler statistics have no file: the measure is absent.
        if std::path::Path::new(&format!("/proc/self/task/{tid}/schedstat")).exists() {
            assert!(run_queue_delay_ns(tid).is_some());
        }
    }
}
