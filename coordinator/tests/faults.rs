//! Fault injection end to end: every fault kind at several targets (a corner chip, an interior
//! chip, a chip on a worker boundary; first and later steps) is diagnosed with the right kind,
//! culprit and link; SIGSTOP and SIGKILL sent to a worker from outside are diagnosed and leave
//! no process behind. (Slow or delayed jobs, which finish `ok` with stragglers, are
//! `tests/stragglers.rs`.)
#![allow(clippy::unwrap_used)]

mod fault_jobs;
mod support;

use std::process::Stdio;
use std::time::Duration;

use fault_jobs::{config, launch};
use support::*;

struct Expect {
    code: i32,
    kind: &'static str,
    chip: Option<u64>,
    worker: Option<u64>,
    link: Option<&'static str>,
}

fn check(tag: &str, fault: &str, e: Expect) {
    let (code, r) = launch(tag, 30, fault);
    let h = &r["hang"];
    assert_eq!(code, e.code, "{tag}: {r}");
    assert_eq!(h["kind"], e.kind, "{tag}: {h}");
    if let Some(chip) = e.chip {
        assert_eq!(h["culprit"]["chip"], chip, "{tag}: {h}");
    }
    if let Some(worker) = e.worker {
        assert_eq!(h["culprit"]["worker"], worker, "{tag}: {h}");
        assert!(h["culprit"]["pid"].as_u64().unwrap() > 0);
    }
    if let Some(link) = e.link {
        assert_eq!(h["culprit"]["link"], link, "{tag}: {h}");
    }
    let explanation = h["explanation"].as_str().unwrap();
    assert!(explanation.len() > 40, "{tag}: {explanation}");
    let after = h["detected_after_ms"].as_f64().unwrap();
    let limit = if e.kind == "desync" { 1000.0 } else { 3000.0 };
    assert!(after < limit, "{tag}: detected after {after} ms");
}

fn hang(
    kind: &'static str,
    chip: Option<u64>,
    worker: Option<u64>,
    link: Option<&'static str>,
) -> Expect {
    Expect {
        code: 3,
        kind,
        chip,
        worker,
        link,
    }
}

// Chip 0 is a corner of the 4x4 grid, chip 5 (1, 1) an interior chip, chip 7 (3, 1) sits on
// worker 1 with neighbours on workers 0 and 2.

#[test]
fn stalled_chips_are_named() {
    check(
        "stall-corner-first",
        "[[faults]]\nkind = \"stall\"\nchip = 0\nat_step = 0",
        hang("stalled_chip", Some(0), Some(0), None),
    );
    check(
        "stall-interior-later",
        "[[faults]]\nkind = \"stall\"\nchip = 5\nat_step = 4",
        hang("stalled_chip", Some(5), Some(1), None),
    );
    check(
        "stall-boundary-seq",
        "[[faults]]\nkind = \"stall\"\nchip = 7\nat_seq = 6",
        hang("stalled_chip", Some(7), Some(1), None),
    );
}

#[test]
fn dead_and_frozen_workers_are_named() {
    for (tag, fault, kind, worker) in [
        (
            "crash-first",
            "kind = \"crash\"\nchip = 0\nat_step = 0",
            "dead_worker",
            0,
        ),
        (
            "crash-later",
            "kind = \"crash\"\nworker = 2\nat_step = 5",
            "dead_worker",
            2,
        ),
        (
            "freeze-first",
            "kind = \"freeze\"\nworker = 3\nat_step = 0",
            "frozen_worker",
            3,
        ),
        (
            "freeze-later",
            "kind = \"freeze\"\nchip = 5\nat_step = 4",
            "frozen_worker",
            1,
        ),
    ] {
        check(
            tag,
            &format!("[[faults]]\n{fault}"),
            hang(kind, None, Some(worker), None),
        );
    }
}

#[test]
fn lost_messages_name_the_link() {
    check(
        "drop-corner-first",
        "[[faults]]\nkind = \"drop\"\nlink = \"0:+x\"\nmode = \"once\"\nat_seq = 0",
        hang("lost_message", Some(0), Some(0), Some("ici+x")),
    );
    check(
        "drop-interior",
        "[[faults]]\nkind = \"drop\"\nlink = \"5:-x\"\nmode = \"once\"\nat_step = 3",
        hang("lost_message", Some(5), Some(1), Some("ici-x")),
    );
    check(
        "drop-boundary",
        "[[faults]]\nkind = \"drop\"\nlink = \"7:+y\"\nat_step = 2",
        hang("lost_message", Some(7), Some(1), Some("ici+y")),
    );
}

#[test]
fn partitions_desyncs_and_corruption_are_diagnosed() {
    check(
        "partition",
        "[[faults]]\nkind = \"partition\"\ngroups = [[0, 1], [2, 3]]\nat_step = 2",
        hang("partition", None, None, None),
    );
    // Chips cut apart inside their workers (as a torch job's ranks, which share one worker):
    // columns 0-1 from columns 2-3, so every lost message is on an x link of one worker: a
    // cut of chips, named as a partition.
    let (code, r) = launch(
        "partition-chips",
        30,
        "[[faults]]\nkind = \"partition\"\nchip_groups = [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]\nat_step = 2",
    );
    assert_eq!(code, 3, "{r}");
    let h = &r["hang"];
    assert_eq!(h["kind"], "partition", "{h}");
    let link = h["culprit"]["link"].as_str().unwrap();
    assert!(link.starts_with("ici") && link.ends_with('x'), "{h}");
    let text = h["explanation"].as_str().unwrap();
    assert!(text.starts_with("Chips are cut apart"), "{text}");
    for (tag, chip, mode, at) in [
        ("desync-skip", 0, "skip", "at_seq = 0"),
        ("desync-op", 5, "op", "at_step = 3"),
        ("desync-size", 7, "size", "at_seq = 9"),
    ] {
        let fault =
            format!("[[faults]]\nkind = \"desync\"\nchip = {chip}\nmode = \"{mode}\"\n{at}");
        let (code, r) = launch(tag, 30, &fault);
        assert_eq!(code, 4, "{tag}: {r}");
        let h = &r["hang"];
        assert_eq!(h["kind"], "desync", "{tag}");
        // Either end of the mismatch may see it first: both chips are named in the sentence.
        let text = h["explanation"].as_str().unwrap();
        assert!(text.contains(&format!("hip {chip} ")), "{tag}: {text}");
        assert!(
            h["detected_after_ms"].as_f64().unwrap() < 1000.0,
            "{tag}: {h}"
        );
    }
    let (code, r) = launch(
        "corrupt",
        30,
        "[[faults]]\nkind = \"corrupt\"\nlink = \"6:+y\"\nat_step = 2",
    );
    // Without debug mode corruption is silent, but the replicas end up different: the job
    // finished with wrong results (not an error: it ran to the end).
    assert_eq!(code, 1, "{r}");
    assert_eq!(r["status"], "wrong_results", "{r}");
    let dir = temp_dir("fault-corrupt-debug");
    let path = config(
        &dir,
        30,
        "[[faults]]\nkind = \"corrupt\"\nlink = \"6:+y\"\nat_step = 2",
    );
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("eager = \"fused\"", "eager = \"debug\"");
    std::fs::write(&path, text).unwrap();
    let mut c = podsim();
    c.arg("launch").arg(&path);
    let out = run_bounded(c, Duration::from_secs(90));
    assert_eq!(out.status.code(), Some(1));
    let r = report(&dir);
    assert_eq!(r["status"], "error");
    let h = &r["hang"];
    assert_eq!(h["kind"], "corrupt");
    assert_eq!(h["culprit"]["chip"], 6);
    assert_eq!(h["culprit"]["link"], "ici+y");
}

/// Starts a long job, waits for its 4 workers, applies `signal` to worker 2's process, and
/// checks that the job ends as a hang of `kind` blamed on that worker and process: the
/// report's `hang`.
fn signal_a_worker(tag: &str, signal: &str, kind: &str) -> serde_json::Value {
    let dir = temp_dir(&format!("fault-{tag}"));
    let path = config(&dir, 100_000, "");
    let mut c = podsim();
    c.arg("launch")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = c.spawn().unwrap();
    let coordinator = child.id();
    assert!(
        eventually(Duration::from_secs(20), || children_of(coordinator).len()
            == 4),
        "workers did not start"
    );
    // Let the job get going, then find worker 2 by its command line.
    std::thread::sleep(Duration::from_millis(1500));
    let victim = children_of(coordinator)
        .into_iter()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|cmd| {
                cmd.split('\0')
                    .collect::<Vec<_>>()
                    .windows(2)
                    .any(|w| w == ["--worker-id", "2"])
            })
        })
        .expect("worker 2");
    let status = std::process::Command::new("kill")
        .arg(signal)
        .arg(victim.to_string())
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(child, Duration::from_secs(30));
    let r = report(&dir);
    assert!(
        eventually(Duration::from_secs(5), || !alive(victim)),
        "{tag}: worker {victim} left behind"
    );
    for w in r["workers"].as_array().unwrap() {
        assert!(
            !alive(w["pid"].as_u64().unwrap() as u32),
            "{tag}: worker left behind"
        );
    }
    assert_eq!(out.status.code(), Some(3), "{r}");
    let h = r["hang"].clone();
    assert_eq!(h["kind"], kind, "{h}");
    assert_eq!(h["culprit"]["worker"], 2, "{h}");
    assert_eq!(h["culprit"]["pid"], u64::from(victim), "{h}");
    h
}

#[test]
fn sigstop_from_outside_is_a_frozen_worker() {
    let h = signal_a_worker("sigstop", "-STOP", "frozen_worker");
    assert!(h["detected_after_ms"].as_f64().unwrap() < 3000.0, "{h}");
}

#[test]
fn sigkill_from_outside_is_a_dead_worker() {
    let h = signal_a_worker("sigkill", "-KILL", "dead_worker");
    assert!(
        h["explanation"].as_str().unwrap().contains("signal 9"),
        "{h}"
    );
}

#[test]
fn a_crash_is_recovered_from_the_last_checkpoint_bit_identically() {
    let config = format!(
        "{}/../configs/faults/recovery.toml",
        env!("CARGO_MANIFEST_DIR")
    );
    let run = |tag: &str, extra: &[&str]| {
        let dir = temp_dir(&format!("recovery-{tag}"));
        let mut c = podsim();
        c.arg("launch")
            .arg(&config)
            .arg("--out")
            .arg(&dir)
            .args(extra);
        let out = run_bounded(c, Duration::from_secs(120));
        assert!(
            out.status.success(),
            "{tag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (report(&dir), dir)
    };
    let (crashed, crashed_dir) = run("crash", &[]);
    let (clean, _) = run("clean", &["--set", "faults=[]"]);
    // The crashed worker's log keeps what it said before the restart (the restart's message
    // sends the user there; the restarted worker's log started anew over it).
    let logs: Vec<String> = std::fs::read_dir(&crashed_dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("worker-"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .collect();
    let separator = "--- podsim: the job runs again here (attempt 2) ---";
    assert!(
        logs.iter().any(|l| l
            .split_once(separator)
            .is_some_and(|(before, _)| !before.trim().is_empty())),
        "no worker log kept the first attempt: {logs:?}"
    );
    let rec = &crashed["recovery"];
    assert_eq!(rec["restarts"].as_array().unwrap().len(), 1, "{rec}");
    // The crash fired (the restart is its work): it is no fault that never fired, and the
    // report's fired list, made from every attempt's, holds it.
    assert!(crashed.get("faults_not_fired").is_none(), "{crashed}");
    assert_eq!(crashed["faults_injected"][0]["kind"], "crash", "{crashed}");
    // A second fault due after the crash never comes (the restart runs without faults): it
    // is named, the crash is not.
    let (twice, _) = run(
        "crash-then-stall",
        &[
            "--set",
            "faults=[{kind=\"crash\", chip=6, at_step=7}, {kind=\"stall\", chip=1, at_step=12}]",
        ],
    );
    assert_eq!(
        twice["faults_not_fired"],
        serde_json::json!(["#1 stall on chip 1, at step 12"]),
        "{twice}"
    );
    let restart = &rec["restarts"][0];
    assert_eq!(restart["kind"], "dead_worker");
    assert_eq!(restart["failed_at_step"], 7);
    assert_eq!(restart["resumed_from_step"], 5);
    assert_eq!(rec["steps_lost"], 2);
    assert_eq!(clean["recovery"]["restarts"].as_array().unwrap().len(), 0);
    let hash = |r: &serde_json::Value| {
        r["correctness"]["final_params_hash"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(
        hash(&crashed),
        hash(&clean),
        "recovered run differs from the clean one"
    );
    assert_eq!(crashed["status"], "ok");
}

#[test]
fn a_finished_job_names_the_faults_that_never_fired() {
    // A stall a day into a job of a few steps never comes: the job ends `ok`, and says so.
    let (code, r) = launch(
        "never-fired",
        4,
        "[[faults]]\nkind = \"stall\"\nchip = 5\nafter_ms = 86400000",
    );
    assert_eq!((code, &r["status"]), (0, &serde_json::json!("ok")), "{r}");
    assert_eq!(
        r["faults_not_fired"],
        serde_json::json!(["#0 stall on chip 5, at 86400000 ms"]),
        "{r}"
    );
    assert_eq!(r["faults_injected"], serde_json::json!([]), "{r}");
}
