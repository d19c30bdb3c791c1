//! The wall clock as podsim's bookkeeping reads it: exact (a system call) or coarse (one
//! atomic load, refreshed by a background thread), for what chips record of real time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall clock, ns since the Unix epoch.
pub fn wall_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Wall clock with about a millisecond's resolution that costs one atomic load to read: a
/// background thread refreshes it. Per-message bookkeeping uses it (a system call per message
/// was a sixth of the per-message cost in meta mode).
pub fn coarse_wall_ns() -> u64 {
    static NOW: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::Once = std::sync::Once::new();
    START.call_once(|| {
        NOW.store(wall_ns(), Ordering::Relaxed);
        let _ = std::thread::Builder::new()
            .name("podsim-clock".into())
            .spawn(|| {
                loop {
                    NOW.store(wall_ns(), Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
    });
    NOW.load(Ordering::Relaxed)
}
