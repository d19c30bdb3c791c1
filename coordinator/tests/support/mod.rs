//! Helpers for tests that run the real `podsim` binary: bounded waits, temp dirs, free ports.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `podsim` binary, killed should this test's thread end first (a test binary killed, or
/// one that panicked past its deadline): no job outlives the test that started it.
pub fn podsim() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_podsim"));
    c.env("RUST_LOG", "warn");
    podsim_links::procs::die_with_parent(&mut c);
    c
}

/// Runs to completion within `limit`, or kills it and panics.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start podsim");
    wait_bounded(child, limit)
}

pub fn wait_bounded(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "podsim did not finish within {limit:?}\nstdout: {}\nstderr: {}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A fresh folder `name` for one test (removed first if it exists), under the transport the
/// tests run over (`PODSIM_TRANSPORT`): the test command runs its transport passes side by
/// side, and two jobs must never share an output folder.
pub fn temp_dir(name: &str) -> PathBuf {
    let transport = std::env::var("PODSIM_TRANSPORT").unwrap_or_else(|_| "default".into());
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(transport)
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `dir`'s report.json as JSON, after checking that it also reads back as a typed report
/// that writes the same JSON (every test that reads a report checks the round trip).
pub fn report(dir: &Path) -> serde_json::Value {
    let path = dir.join("report.json");
    let text = std::fs::read_to_string(&path).expect("report.json");
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let typed = podsim_coordinator::report::read(&path).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        serde_json::to_value(&typed).unwrap(),
        json,
        "{}: the typed report writes other JSON",
        path.display()
    );
    json
}

/// Whether a process exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .split(')')
            .nth(1)
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// Child processes of `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let fields: Vec<&str> = stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .collect();
        if fields.get(1).and_then(|s| s.parse::<u32>().ok()) == Some(pid) {
            out.push(p);
        }
    }
    out
}

/// Waits until `cond` holds or `limit` passes.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    cond()
}

/// A small collectives job config.
pub fn job_config(out: &Path, workers: u32, iterations: u32, extra: &str) -> String {
    format!(
        r#"name = "test"

[topology]
shape = "2x2x2"
hardware = "v5p"

[launch]
workers = {workers}

[job]
kind = "collectives"
mode = "data"
iterations = {iterations}

[[job.collectives]]
op = "all-reduce"
size = "256KiB"

[[job.collectives]]
op = "all-to-all"
size = "64KiB"
algo = "ring"

[[job.collectives]]
op = "all-gather"
size = "64KiB"
group = "y,z"

[output]
dir = "{}"
{extra}"#,
        out.display()
    )
}
