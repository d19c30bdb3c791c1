//! `podsim bench` end to end: the real binary, its JSON rows, its exit codes.
#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn podsim(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_podsim"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start podsim");
    // Bounded wait: a test must never hang.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("podsim {args:?} did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
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
    ] {
        let out = podsim(&args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
