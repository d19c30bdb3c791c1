//! `podsim bench` end to end: the real binary, its JSON rows, its exit codes.
#![allow(clippy::unwrap_used)]

use std::process::Output;
use std::time::Duration;

use crate::support::run_bounded;

/// `podsim ARGS` to its end (at most 120 s), as the other end-to-end tests start it: a test
/// killed mid-run takes it along.
fn podsim(args: &[&str]) -> Output {
    let mut command = crate::support::podsim();
    command.args(args);
    run_bounded(command, Duration::from_secs(120))
}

#[test]
fn json_rows_carry_the_documented_fields() {
    let out = podsim(&[
        "bench",
        "--topology",
        "2x3",
        "--collective",
        "all-gather",
        "--algo",
        "bidir-ring",
        "--sizes",
        "6KiB,96KiB",
        "--iters",
        "2",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(rows.len(), 2);
    for key in [
        "collective",
        "algo",
        "topology",
        "chips",
        "bytes",
        "mode",
        "wall_s",
        "algbw_gbps",
        "busbw_gbps",
        "virtual_s",
        "virtual_busbw_gbps",
        "errors",
    ] {
        assert!(rows[0].get(key).is_some(), "missing {key}");
    }
    assert_eq!(rows[0]["collective"], "all-gather");
    assert_eq!(rows[0]["chips"], 6);
    assert_eq!(rows[0]["bytes"], 6144);
    assert_eq!(rows[1]["errors"], 0);
    assert!(rows[1]["checked"].as_u64().unwrap() > 0);
    assert!(rows[1]["virtual_s"].as_f64().unwrap() > 0.0);
    // One wall time per timed iteration, and their mean is the row's wall time.
    for row in &rows {
        let walls: Vec<f64> = row["iteration_wall_s"]
            .as_array()
            .expect("iteration_wall_s")
            .iter()
            .map(|w| w.as_f64().unwrap())
            .collect();
        assert_eq!(walls.len(), 2);
        assert!(walls.iter().all(|&w| w > 0.0), "{walls:?}");
        let mean = walls.iter().sum::<f64>() / 2.0;
        let wall = row["wall_s"].as_f64().unwrap();
        assert!(
            (mean - wall).abs() <= 1e-9 * wall.max(1.0),
            "{mean} vs {wall}"
        );
    }
}

#[test]
fn defaults_run_and_print_a_table() {
    let out = podsim(&["bench", "--sizes", "4KiB:64KiB", "--iters", "1"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("busbw"));
    assert!(text.contains("0 wrong elements"));
}

#[test]
fn bad_flags_exit_2_naming_the_flag() {
    for (args, needle) in [
        (vec!["bench", "--topology", "4x0"], "--topology"),
        (vec!["bench", "--collective", "all-scatter"], "--collective"),
        (vec!["bench", "--sizes", "16K:4K"], "--sizes"),
        (vec!["bench", "--dtype", "bf16"], "--dtype"),
        (
            vec!["bench", "--group", "z", "--topology", "4x4"],
            "--group",
        ),
        (vec!["bench", "--no-such-flag"], "--no-such-flag"),
        // Each of these panicked or aborted (overflow, allocation) instead.
        (vec!["bench", "--iters", "18446744073709551615"], "--iters"),
        (vec!["bench", "--warmup", "1000000000000"], "--warmup"),
        (vec!["bench", "--threads", "100000"], "--threads"),
        (
            vec!["bench", "--sizes", "1000000GB"],
            "--sizes: data mode holds",
        ),
        (
            vec!["bench", "--sizes", "4KiB,0"],
            "--sizes: size \"0\": a collective moves at least one byte",
        ),
        // Replaced the device (as root) with the trace, after the whole run.
        (
            vec!["bench", "--trace", "/dev/null"],
            "--trace: /dev/null: not a regular file",
        ),
        (
            vec!["bench", "--trace", "/proc/self/status/x"],
            "--trace: /proc/self/status: not a folder",
        ),
    ] {
        let out = podsim(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
