//! No orphan processes: when the coordinator is killed with SIGKILL, or interrupted with
//! Ctrl-C (SIGINT), every worker exits within a few seconds.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::Duration;

use support::*;

/// Starts a long job and returns the coordinator and its worker pids once they are running.
fn start_long_job(name: &str) -> (std::process::Child, Vec<u32>) {
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
    (coord, workers)
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

#[test]
fn ctrl_c_stops_the_job_and_its_workers() {
    let (coord, workers) = start_long_job("orphans-int");
    let status = std::process::Command::new("kill")
        .args(["-INT", &coord.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = wait_bounded(coord, Duration::from_secs(20));
    assert!(!out.status.success());
    assert!(eventually(Duration::from_secs(5), || workers
        .iter()
        .all(|&p| !alive(p))));
}
