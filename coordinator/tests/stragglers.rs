//! Slow and delayed jobs are not hangs: they finish `ok`, naming the chip that held the
//! others up, and a fault-free job names none.
//!
//! A binary of its own, so that it runs alone: straggler accounting measures wall time, and
//! the fault tests beside it (each with four worker processes) on a small machine made a
//! fault-free job's chip look slow now and then (`none: stragglers [15]`).
#![allow(clippy::unwrap_used)]

mod fault_jobs;
mod support;

use fault_jobs::launch;

#[test]
fn slow_and_delayed_jobs_are_not_hangs() {
    // The delayed job runs 24 steps: about 9 s, over four of the watchdog's 2 s timeouts,
    // since every message over the link waits 30 ms (120 steps took 46 s of the suite).
    for (tag, steps, fault, straggler) in [
        ("none", 120, "", None),
        (
            "slow",
            120,
            "[[faults]]\nkind = \"slow\"\nchip = 5\nfactor = 10",
            Some(5),
        ),
        (
            "delay",
            24,
            "[[faults]]\nkind = \"delay\"\nlink = \"7:+y\"\ndelay_ms = 30",
            Some(7),
        ),
    ] {
        let (code, r) = launch(&format!("ok-{tag}"), steps, fault);
        assert_eq!(code, 0, "{tag}: {r}");
        assert_eq!(r["status"], "ok", "{tag}");
        assert!(r.get("hang").is_none(), "{tag}");
        assert!(r.get("faults_not_fired").is_none(), "{tag}: {r}");
        let stragglers: Vec<u64> = r["stragglers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["chip"].as_u64().unwrap())
            .collect();
        match straggler {
            Some(c) => assert!(stragglers.contains(&c), "{tag}: stragglers {stragglers:?}"),
            None => assert!(stragglers.is_empty(), "{tag}: stragglers {stragglers:?}"),
        }
    }
}
