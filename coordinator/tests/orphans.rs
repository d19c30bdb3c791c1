//! No orphan processes: when the coordinator is killed with SIGKILL, or interrupted with
//! Ctrl-C (SIGINT) or SIGTERM, every worker exits within a few seconds.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::*;

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
