//! `podsim run` with ranks that speak the rank protocol without torch (`fake_rank.py`, the
//! standard library only): rank processes, their output, the collectives they call, the
//! report, and what happens to garbage, a wrong token and a rank that dies. The real torch
//! backend is tested by `scripts/torch_tests.py` (run by the test command).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::support::*;

const FAKE_RANK: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fake_rank.py");

fn run_fake(dir_name: &str, what: &str) -> (std::process::Output, serde_json::Value) {
    let dir = temp_dir(dir_name);
    let mut cmd = podsim();
    // The fake rank speaks the wire itself, under a Python without podsim's package.
    cmd.args(["run", "--no-intercept", "--topology", "2x2", "--out"])
        .arg(&dir)
        .args(["--", "python3", FAKE_RANK])
        .env("FAKE_RANK_DO", what);
    let out = run_bounded(cmd, Duration::from_secs(120));
    (out, report(&dir))
}

#[test]
fn ranks_run_their_collectives_on_the_chips_and_the_report_has_each_rank() {
    let (out, report) = run_fake("torch-run-sum", "sum");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..4 {
        assert!(
            stdout.contains(&format!("[rank {rank}] rank {rank} sum [6.0, 4.0] ok")),
            "{stdout}"
        );
        // {0, 3} is not a sub-torus of 2x2: refused at the call, with the reason.
        assert!(
            stdout.contains(&format!("[rank {rank}] rank {rank} refused group")),
            "{stdout}"
        );
        let previous = (rank + 3) % 4;
        let shifted = format!("[{:.1}, -1.0]", 10.0 * f64::from(previous));
        assert!(
            stdout.contains(&format!("[rank {rank}] rank {rank} shift {shifted} ok")),
            "{stdout}"
        );
        assert!(
            stdout.contains(&format!(
                "rank {rank} refused send: chip {rank} cannot send to or receive from itself"
            )),
            "{stdout}"
        );
    }
    let torch = &report["torch"];
    assert_eq!(torch["ranks"].as_array().unwrap().len(), 4);
    let r0 = &torch["ranks"][0];
    assert_eq!(r0["collectives"][0]["op"], "all-reduce");
    assert_eq!(r0["collectives"][0]["calls"], 1);
    // One send and one receive, 2 values each.
    assert_eq!(r0["collectives"][1]["op"], "send-recv");
    assert_eq!(r0["collectives"][1]["calls"], 2);
    assert_eq!(r0["collectives"][1]["bytes"], 16);
    // The compute the rank reported was charged before its collective.
    assert!(r0["compute_ns"].as_f64().unwrap() > 0.0);
    assert!(r0["comm_ns"].as_f64().unwrap() > 0.0);
    assert_eq!(torch["steps"].as_array().unwrap().len(), 1);
    assert_eq!(report["status"], "ok");
}

#[test]
fn a_rank_that_dies_is_a_dead_worker_naming_it_and_its_exit_code() {
    let (out, report) = run_fake("torch-run-exit", "exit");
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let hang = &report["hang"];
    assert_eq!(hang["kind"], "dead_worker");
    assert_eq!(hang["culprit"]["chip"], 2);
    assert!(
        hang["explanation"]
            .as_str()
            .unwrap()
            .contains("exited with code 7"),
        "{hang}"
    );
}

#[test]
fn a_garbage_frame_fails_the_job_naming_the_rank() {
    let (out, report) = run_fake("torch-run-garbage", "garbage");
    assert!(!out.status.success());
    let error = report["error"].as_str().unwrap_or_default().to_string();
    assert!(
        error.contains("rank 1") && error.contains("magic"),
        "{error}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn a_rank_with_the_wrong_token_is_refused() {
    let (out, _) = run_fake("torch-run-token", "wrong-token");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("refused: wrong job token"), "{stdout}");
}

/// `podsim run` of the system's `python3 -c pass` on 2 chips, with interception, into `dir`.
fn python_pass(dir: &std::path::Path) -> std::process::Command {
    let mut cmd = podsim();
    cmd.args(["run", "--topology", "2", "--out"])
        .arg(dir)
        .args(["--", "python3", "-c", "pass"]);
    cmd
}

/// A Python without podsim's package (here the system's `python3`, run with interception)
/// fails in every rank before its process group exists: a program error (exit 1) naming why,
/// not a hang.
#[test]
fn a_python_without_the_backend_is_a_program_error_not_a_hang() {
    let dir = temp_dir("torch-run-no-backend");
    let mut cmd = python_pass(&dir);
    cmd.env_remove("PYTHONPATH");
    let out = run_bounded(cmd, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let report = report(&dir);
    let hang = &report["hang"];
    assert_eq!(hang["kind"], "program_error", "{hang}");
    let explanation = hang["explanation"].as_str().unwrap();
    for said in [
        "failed before it created its process group",
        "cannot load podsim's torch backend",
    ] {
        assert!(explanation.contains(said), "{explanation}");
    }
}

/// `PODSIM_RANK_SERVER` naming a rank server that is not running (ended, or mistyped) fails
/// the job before any rank starts, naming the variable and how to start one: no rank's stub
/// waits out its connect bound for it.
#[test]
fn a_shared_rank_server_that_is_not_running_is_an_error_before_any_rank() {
    let dir = temp_dir("torch-run-no-shared-server");
    let mut cmd = python_pass(&dir);
    cmd.env("PODSIM_RANK_SERVER", "podsim-rank-server-that-never-ran");
    let started = std::time::Instant::now();
    let out = run_bounded(cmd, Duration::from_secs(120));
    let said =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{said}");
    for part in [
        "PODSIM_RANK_SERVER=\"podsim-rank-server-that-never-ran\"",
        "no rank server listens there",
        "python -m podsim.rank_server",
    ] {
        assert!(said.contains(part), "{part:?} not in {said}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn bad_flags_are_named_by_their_flags_not_the_generated_job() {
    for (flags, needle) in [
        (vec!["--topology", "4x0"], "--topology: "),
        (vec!["--topology", "2x2", "--mode", "fast"], "--mode: "),
        (
            vec!["--topology", "2x2", "--hardware", "v9"],
            "--hardware: ",
        ),
        (vec!["--topology", "2x2", "--set", "job.steps=3"], "--set"),
        // The config's advice, in the command's words.
        (vec!["--topology", "4096x4096"], "use --mode meta"),
    ] {
        let out = run_bounded(
            {
                let mut c = podsim();
                c.arg("run")
                    .args(&flags)
                    .args(["--", "python3", "-c", "pass"]);
                c
            },
            Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {err}");
        assert!(err.contains(needle), "{flags:?}: {needle:?} in {err}");
        assert!(!err.contains("podsim run:"), "{flags:?}: {err}");
    }
}
