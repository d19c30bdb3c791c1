//! No orphan processes: when the coordinator is killed with SIGKILL, or interrupted with
//! Ctrl-C (SIGINT) or SIGTERM, every worker exits within a few seconds; so does every rank of
//! a PyTorch job (`podsim run`), with the processes the ranks started, whichever of the
//! coordinator or the worker is killed; so does a study's running point when the study is
//! killed or its terminal hangs up; and a rank that never connects ends its job within the
//! job's bound, named.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::support::*;

/// Starts a long job and returns the coordinator and its worker pids once they are running.
fn start_long_job(name: &str) -> (std::process::Child, Vec<u32>) {
    let (coord, workers, _) = start_long_job_in(name);
    (coord, workers)
}

fn start_long_job_in(name: &str) -> (std::process::Child, Vec<u32>, std::path::PathBuf) {
    let dir = temp_dir(name);
    let config = write(&dir, "job.toml", &job_config(&dir, 4, 100_000, ""));
    let mut c = podsim();
    c.arg("launch").arg(&config);
    let coord = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut workers = Vec::new();
    assert!(
        eventually(Duration::from_secs(30), || {
            workers = children_of(coord.id());
            workers.len() == 4
        }),
        "the workers did not start"
    );
    // Let the job get going.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(workers.iter().all(|&p| alive(p)));
    (coord, workers, dir)
}

#[test]
fn sigkill_of_the_coordinator_leaves_no_worker() {
    let (mut coord, workers) = start_long_job("orphans-kill");
    coord.kill().unwrap();
    let _ = coord.wait();
    assert!(
        eventually(Duration::from_secs(5), || workers
            .iter()
            .all(|&p| !alive(p))),
        "workers survived their coordinator: {:?}",
        workers.iter().filter(|&&p| alive(p)).collect::<Vec<_>>()
    );
}

/// Interrupts a long job with `signal` and checks that it stops, with its workers.
fn signal_stops_the_job_and_its_workers(signal: &str) {
    let (coord, workers) = start_long_job(&format!("orphans-{signal}"));
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &coord.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(coord, Duration::from_secs(20));
    assert!(!out.status.success());
    assert!(eventually(Duration::from_secs(5), || workers
        .iter()
        .all(|&p| !alive(p))));
}

#[test]
fn ctrl_c_stops_the_job_and_its_workers() {
    signal_stops_the_job_and_its_workers("INT");
}

#[test]
fn sigterm_stops_the_job_and_its_workers() {
    signal_stops_the_job_and_its_workers("TERM");
}

/// A study of one long point, ended by `signal` once the point's workers run: the study, the
/// point's `podsim launch` and its workers all go (SIGKILL left the point running as an
/// orphan, writing into the study's folder; SIGHUP too).
fn study_ended_leaves_nothing(signal: &str) {
    let dir = temp_dir(&format!("orphans-study-{signal}"));
    write(&dir, "job.toml", &job_config(&dir, 2, 100_000, ""));
    let study = write(
        &dir,
        "s.toml",
        "base = \"job.toml\"\n[sweep]\njob.iterations = [100000]\n",
    );
    let mut c = podsim();
    c.arg("study").arg(&study).arg("--out").arg(dir.join("out"));
    let study = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut below = Vec::new();
    assert!(
        eventually(Duration::from_secs(30), || {
            below = descendants(study.id());
            below.len() >= 3 // the point's launch and its two workers
        }),
        "the point did not start: {below:?}"
    );
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &study.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(study, Duration::from_secs(20));
    assert!(!out.status.success());
    let gone = eventually(Duration::from_secs(10), || below.iter().all(|&p| !alive(p)));
    assert!(gone, "left behind: {:?}", survivors(&below));
}

#[test]
fn sigkill_of_a_study_leaves_no_point_running() {
    study_ended_leaves_nothing("KILL");
}

#[test]
fn sighup_of_a_study_stops_its_point() {
    study_ended_leaves_nothing("HUP");
}

#[test]
fn a_worker_killed_mid_job_is_diagnosed_as_a_dead_worker() {
    let (coord, workers, dir) = start_long_job_in("orphans-worker-killed");
    let victim = workers[1];
    let status = std::process::Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(coord, Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(3));
    assert!(eventually(Duration::from_secs(5), || workers
        .iter()
        .all(|&p| !alive(p))));
    let r = report(&dir);
    assert_eq!(r["status"], "hang");
    let hang = &r["hang"];
    assert_eq!(hang["kind"], "dead_worker");
    let explanation = hang["explanation"].as_str().unwrap();
    assert!(explanation.contains("signal 9"), "{explanation}");
    let listed = r["workers"].as_array().unwrap();
    assert_eq!(listed.len(), 4);
    let named = listed
        .iter()
        .find(|w| w["pid"].as_u64() == Some(u64::from(victim)))
        .expect("victim listed");
    assert_eq!(hang["culprit"]["worker"], named["id"]);
    assert_eq!(hang["culprit"]["pid"], u64::from(victim));
}

/// Every process below `pid`: its children, theirs, and so on.
fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        for c in children_of(p) {
            out.push(c);
            next.push(c);
        }
    }
    out
}

/// Kills whatever of `pids` is still running (a failed test must not leave them behind) and
/// says which were.
fn survivors(pids: &[u32]) -> Vec<u32> {
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    for p in &left {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
    left
}

/// `podsim run` on 2x2 whose ranks never connect, each with a child of its own (a `sleep`):
/// the coordinator, its worker, and every process below the coordinator once all are up
/// (the worker, its ranks, their children, the worker's keeper of their process groups).
fn start_torch_job(name: &str) -> (std::process::Child, u32, Vec<u32>) {
    let dir = temp_dir(name);
    let mut c = podsim();
    c.args(["run", "--topology", "2x2", "--out"])
        .arg(&dir)
        .args(["--", "sh", "-c", "sleep 600 & wait"]);
    let coord = c
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut below = Vec::new();
    // The worker, 4 ranks, 4 sleeps and the keeper.
    let up = eventually(Duration::from_secs(30), || {
        below = descendants(coord.id());
        below.len() >= 10
    });
    if !up {
        survivors(&below);
    }
    assert!(up, "the ranks did not start: {below:?}");
    let worker = children_of(coord.id())[0];
    (coord, worker, below)
}

/// Sends `signal` to the coordinator of a `podsim run` (or to its worker, `at_worker`) and
/// checks that every process below the coordinator is gone within a few seconds.
fn torch_job_killed_leaves_nothing(signal: &str, at_worker: bool) {
    let name = format!(
        "orphans-torch-{signal}-{}",
        if at_worker { "worker" } else { "coord" }
    );
    let (coord, worker, below) = start_torch_job(&name);
    let target = if at_worker { worker } else { coord.id() };
    let status = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &target.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(coord, Duration::from_secs(30));
    assert!(!out.status.success());
    eventually(Duration::from_secs(5), || below.iter().all(|&p| !alive(p)));
    let left = survivors(&below);
    assert!(left.is_empty(), "outlived their job: {left:?} of {below:?}");
}

#[test]
fn sigkill_of_the_coordinator_leaves_no_rank_nor_its_children() {
    torch_job_killed_leaves_nothing("KILL", false);
}

#[test]
fn sigterm_of_the_coordinator_leaves_no_rank_nor_its_children() {
    torch_job_killed_leaves_nothing("TERM", false);
}

#[test]
fn ctrl_c_of_the_coordinator_leaves_no_rank_nor_its_children() {
    torch_job_killed_leaves_nothing("INT", false);
}

#[test]
fn sigkill_of_the_worker_leaves_no_rank_nor_its_children() {
    torch_job_killed_leaves_nothing("KILL", true);
}

#[test]
fn sigterm_of_the_worker_leaves_no_rank_nor_its_children() {
    torch_job_killed_leaves_nothing("TERM", true);
}

#[test]
fn a_rank_that_never_connects_ends_the_job_within_its_bound_named() {
    let dir = temp_dir("orphans-torch-never-connects");
    let mut cmd = podsim();
    // Rank 1 announces itself and sleeps; the others exit at once without connecting (a
    // program that never uses the backend), which is no error.
    cmd.args(["run", "--topology", "2x2", "--out"])
        .arg(&dir)
        .args(["--set", "job.connect_timeout_s=3", "--", "sh", "-c"])
        .arg(
            r#"if [ "$RANK" = 1 ]; then echo "pid $$"; echo "loading forever"; exec sleep 600; fi"#,
        );
    let out = run_bounded(cmd, Duration::from_secs(60));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let pid: u32 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("[rank 1] pid "))
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no pid from rank 1: {stdout}"));
    let left = survivors(&[pid]);
    assert!(left.is_empty(), "the rank outlived its job");
    assert_eq!(
        out.status.code(),
        Some(3),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&dir);
    let hang = &r["hang"];
    assert_eq!(hang["kind"], "stalled_chip", "{hang}");
    assert_eq!(hang["culprit"]["chip"], 1, "{hang}");
    let explanation = hang["explanation"].as_str().unwrap();
    for part in [
        &format!("Rank 1 (pid {pid}) did not connect"),
        "3 s (job.connect_timeout_s)",
        "sleeping",
        "\"loading forever\"",
    ] {
        assert!(explanation.contains(part), "{part:?} not in {explanation}");
    }
}

#[test]
fn a_connect_bound_of_zero_is_refused_naming_the_key() {
    let mut cmd = podsim();
    cmd.args([
        "run",
        "--topology",
        "2x2",
        "--set",
        "job.connect_timeout_s=0",
    ])
    .args(["--", "sh", "-c", "true"]);
    let out = run_bounded(cmd, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("job.connect_timeout_s: 0 "), "{stderr}");
}

/// The processes whose command line is exactly `args`.
fn processes_running(args: &[&str]) -> Vec<u32> {
    let want: Vec<u8> = args
        .iter()
        .flat_map(|a| [a.as_bytes(), b"\0"].concat())
        .collect();
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|p| std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| c == want))
        .collect()
}

#[test]
fn a_ranks_child_in_a_session_of_its_own_does_not_outlive_the_job() {
    // `setsid` takes the child out of its rank's process group and session, which the group
    // kill and the keeper never reach; a duration no other test sleeps names it.
    let seconds = format!("{}", 100_000 + std::process::id());
    let dir = temp_dir("orphans-setsid");
    let mut c = podsim();
    c.args(["run", "--topology", "2x2", "--out"])
        .arg(&dir)
        .args([
            "--",
            "sh",
            "-c",
            &format!("setsid sleep {seconds} & sleep 1"),
        ]);
    let out = run_bounded(c, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&out.stderr);
    let left = processes_running(&["sleep", &seconds]);
    for &p in &left {
        let _ = std::process::Command::new("kill")
            .args(["-9", &p.to_string()])
            .status();
    }
    assert!(left.is_empty(), "outlived their job: {left:?}\n{err}");
    let log = std::fs::read_to_string(dir.join("worker-0.log")).unwrap_or_default();
    assert!(log.contains("left behind in a session of its own"), "{log}");
}
