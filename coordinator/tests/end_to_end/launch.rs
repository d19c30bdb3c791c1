//! `podsim launch` end to end: the collectives config on 4 workers, virtual-time identity across
//! worker counts and transports, external mode, a wrong token, and `bench --workers`.
#![allow(clippy::unwrap_used)]

use std::collections::HashSet;
use std::time::Duration;

use crate::support::*;

fn launch(config: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let mut c = podsim();
    c.arg("launch").arg(config).args(extra);
    run_bounded(c, Duration::from_secs(120))
}

#[test]
fn collectives_config_runs_on_four_workers() {
    let dir = temp_dir("collectives");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/collectives.toml");
    let out = launch(
        std::path::Path::new(config),
        &["--out", dir.to_str().unwrap()],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = report(&dir);
    assert_eq!(r["status"], "ok");
    let workers = r["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 4);
    let pids: HashSet<u64> = workers.iter().map(|w| w["pid"].as_u64().unwrap()).collect();
    assert_eq!(pids.len(), 4, "distinct pids");
    assert!(r["correctness"]["elements_checked"].as_u64().unwrap() > 0);
    assert_eq!(r["correctness"]["wrong_elements"], 0);
    assert!(r["latency_us"]["all-reduce"]["p99"].as_f64().unwrap() > 0.0);
    for w in workers {
        assert!(w["peak_rss_bytes"].as_u64().unwrap() > 0);
        assert!(
            !alive(w["pid"].as_u64().unwrap() as u32),
            "worker left behind"
        );
    }
}

fn virtual_times(r: &serde_json::Value) -> Vec<u64> {
    r["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|c| {
            c["calls"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x["virtual_s"].as_f64().unwrap().to_bits())
        })
        .collect()
}

#[test]
fn virtual_time_is_the_same_on_one_or_four_workers() {
    let mut seen = Vec::new();
    for workers in [1, 4] {
        let dir = temp_dir(&format!("identity-{workers}"));
        let config = write(&dir, "job.toml", &job_config(&dir, workers, 2, ""));
        let out = launch(&config, &[]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = report(&dir);
        assert_eq!(r["workers"].as_array().unwrap().len(), workers as usize);
        seen.push((
            virtual_times(&r),
            r["virtual_s"].as_f64().unwrap().to_bits(),
        ));
    }
    assert!(!seen[0].0.is_empty());
    assert_eq!(
        seen[0], seen[1],
        "virtual time changed with the number of workers"
    );
}

/// What `auto` picks between workers on this host: shared memory where Linux gives it.
const AUTO_LOCAL: &str = if cfg!(target_os = "linux") {
    "shm"
} else {
    "tcp"
};

#[test]
fn each_transport_moves_the_same_values_in_the_same_virtual_time() {
    // The links between 4 workers forced over records on TCP, gRPC, Unix sockets, and Unix
    // sockets with shared memory, then chosen automatically (shared memory, on one Linux
    // host): the same values checked, the same virtual time, and report.json names each
    // link's transport.
    let mut seen = Vec::new();
    for (transport, shown) in [
        ("tcp", "tcp"),
        ("grpc", "grpc"),
        ("uds", "uds"),
        ("shm", "shm"),
        ("auto", AUTO_LOCAL),
    ] {
        let dir = temp_dir(&format!("transport-{transport}"));
        // Also payloads large enough (256 KiB per message) to go through shared memory.
        let large = "[[job.collectives]]\nop = \"all-reduce\"\nsize = \"2MiB\"\n";
        let config = write(&dir, "job.toml", &job_config(&dir, 4, 2, large));
        let set = format!("launch.transport={transport}");
        let out = launch(&config, &["--set", &set]);
        assert!(
            out.status.success(),
            "{transport}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r = report(&dir);
        let command: Vec<&str> = r["job"]["command"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a.as_str())
            .collect();
        assert!(
            command.ends_with(&["--set", set.as_str()]),
            "{transport}: {command:?}"
        );
        assert_eq!(r["correctness"]["wrong_elements"], 0, "{transport}");
        assert!(r["correctness"]["elements_checked"].as_u64().unwrap() > 0);
        for w in r["workers"].as_array().unwrap() {
            let links = w["links"].as_array().unwrap();
            assert!(
                !links.is_empty(),
                "{transport}: worker {} has no links",
                w["id"]
            );
            for l in links {
                assert_eq!(l["transport"], shown, "{transport}: {l}");
            }
        }
        seen.push(virtual_times(&r));
    }
    for other in &seen[1..] {
        assert_eq!(&seen[0], other, "virtual time depends on the transport");
    }
}

/// `podsim coordinator CONFIG` in external mode on a free loopback port, with `extra`
/// arguments: the process and the address workers join.
fn external_coordinator(
    config: &std::path::Path,
    token: &str,
    extra: &[&str],
) -> (std::process::Child, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut coord = podsim();
    coord.args([
        "coordinator",
        config.to_str().unwrap(),
        "--listen",
        &addr,
        "--token",
        token,
    ]);
    coord.args(extra);
    let child = coord
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    (child, addr)
}

/// `podsim worker` joining `addr` with `extra` arguments.
fn external_worker(addr: &str, token: &str, extra: &[&str]) -> std::process::Child {
    let mut w = podsim();
    w.args(["worker", "--join", addr, "--token", token]);
    w.args(extra);
    w.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for the coordinator, then the workers; each must succeed.
fn all_succeed(coord: std::process::Child, workers: Vec<std::process::Child>) {
    let out = wait_bounded(coord, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for w in workers {
        let o = wait_bounded(w, Duration::from_secs(30));
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

#[test]
fn external_mode_with_workers_started_by_hand() {
    let dir = temp_dir("external");
    let config = write(&dir, "job.toml", &job_config(&dir, 2, 1, ""));
    let token = "test-token-0123456789";
    let (coord, addr) = external_coordinator(&config, token, &[]);
    // A worker with the wrong token is refused and exits with an error.
    let mut bad = podsim();
    bad.args(["worker", "--join", &addr, "--token", "wrong"]);
    let refused = run_bounded(bad, Duration::from_secs(60));
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("token"), "{err}");
    // An id past the job's workers is refused, saying which ids there are.
    let mut past = podsim();
    past.args([
        "worker",
        "--join",
        &addr,
        "--token",
        token,
        "--worker-id",
        "5",
    ]);
    let refused = run_bounded(past, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("worker id 5 is out of range: the job's workers are 0 to 1"),
        "{err}"
    );
    // A worker with TLS against this plain coordinator is told so, not "InvalidContentType".
    let mut tls = podsim();
    tls.args(["worker", "--join", &addr, "--token", token]);
    tls.args([
        "--tls-ca",
        &tls_file("job-ca.pem"),
        "--tls-cert",
        &tls_file("job-node.pem"),
    ]);
    tls.args(["--tls-key", &tls_file("job-node.key")]);
    let refused = run_bounded(tls, Duration::from_secs(60));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("the coordinator answers without TLS"), "{err}");
    // Two proper workers join (ids assigned by the coordinator).
    let workers: Vec<_> = (0..2).map(|_| external_worker(&addr, token, &[])).collect();
    all_succeed(coord, workers);
    let r = report(&dir);
    assert_eq!(r["status"], "ok");
    assert_eq!(r["workers"].as_array().unwrap().len(), 2);
}

#[test]
fn a_worker_sent_to_a_server_that_is_not_podsims_says_so() {
    // An HTTP/1 server (a wrong port, a proxy) answers every connection and closes it, for as
    // long as the test runs (the worker's client may connect several times).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut stream = stream;
            let mut buf = [0u8; 1024];
            let _ = std::io::Read::read(&mut stream, &mut buf);
            let _ = std::io::Write::write_all(
                &mut stream,
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
            );
        }
    });
    let mut c = podsim();
    c.args(["worker", "--join", &addr, "--token", "some-token"]);
    let out = run_bounded(c, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("is an HTTP/1 server: it is not a podsim coordinator"),
        "{err}"
    );
    assert!(!err.contains("the coordinator refused"), "{err}");
}

#[test]
fn external_workers_are_for_the_coordinator_and_the_coordinator_leaves_memory_to_them() {
    let dir = temp_dir("external-launch");
    let external = job_config(&dir, 2, 1, "").replace("[launch]\n", "[launch]\nexternal = true\n");
    let config = write(&dir, "job.toml", &external);
    // `podsim launch` started the workers here anyway: refused, pointing to the coordinator.
    let mut c = podsim();
    c.arg("launch").arg(&config);
    let out = run_bounded(c, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("run it with `podsim coordinator`"), "{err}");
    // A --listen that is no address is a usage error, before any setup or report.
    for listen in ["nonsense", "127.0.0.1:99999"] {
        let mut c = podsim();
        c.args(["coordinator", config.to_str().unwrap(), "--listen", listen]);
        let out = run_bounded(c, Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{listen}: {err}");
        assert!(err.contains("--listen"), "{listen}: {err}");
    }
    // The coordinator does not hold its workers' buffers: a host of 1 KiB does not stop it,
    // where `podsim launch` on it is refused.
    let plain = write(&dir, "plain.toml", &job_config(&dir, 2, 1, ""));
    let mut c = podsim();
    c.arg("launch")
        .arg(&plain)
        .env("PODSIM_MEM_AVAILABLE", "1KiB");
    let out = run_bounded(c, Duration::from_secs(30));
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = "test-token-memory-0123";
    let addr = format!("127.0.0.1:{}", free_port());
    let coord = podsim()
        .args([
            "coordinator",
            plain.to_str().unwrap(),
            "--listen",
            &addr,
            "--token",
            token,
        ])
        .env("PODSIM_MEM_AVAILABLE", "1KiB")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let workers: Vec<_> = (0..2).map(|_| external_worker(&addr, token, &[])).collect();
    all_succeed(coord, workers);
}

/// Whether a line holding `needle` comes out of `pipe` within `patience`; the pipe is
/// drained by a thread of its own for as long as it is open (a writer must never block).
fn line_appears(
    pipe: impl std::io::Read + Send + 'static,
    needle: &str,
    patience: Duration,
) -> bool {
    use std::io::BufRead;
    let (tx, rx) = std::sync::mpsc::channel();
    let needle = needle.to_string();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
            if line.contains(&needle) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(patience).is_ok()
}

/// A job of two external workers in folder `external-NAME`, its coordinator started with
/// `extra`: the folder, the coordinator and the address workers join.
fn two_worker_job(
    name: &str,
    token: &str,
    extra: &[&str],
) -> (std::path::PathBuf, std::process::Child, String) {
    let dir = temp_dir(&format!("external-{name}"));
    let config = write(&dir, "job.toml", &job_config(&dir, 2, 1, ""));
    let (coord, addr) = external_coordinator(&config, token, extra);
    (dir, coord, addr)
}

#[test]
fn a_worker_past_the_jobs_count_is_turned_away_at_once() {
    let token = "test-token-surplus-0123";
    // Long enough to be running when the third worker comes.
    let (_, mut coord, addr) =
        two_worker_job("surplus", token, &["--set", "job.iterations=1000000"]);
    let workers: Vec<_> = (0..2).map(|_| external_worker(&addr, token, &[])).collect();
    // The job runs once the coordinator reports progress (every second off a terminal).
    let stdout = coord.stdout.take().unwrap();
    assert!(
        line_appears(stdout, "progress", Duration::from_secs(60)),
        "the job did not start"
    );
    let mut third = podsim();
    third.args(["worker", "--join", &addr, "--token", token]);
    let started = std::time::Instant::now();
    let out = run_bounded(third, Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &coord.id().to_string()])
        .status();
    let _ = wait_bounded(coord, Duration::from_secs(30));
    for w in workers {
        let _ = wait_bounded(w, Duration::from_secs(30));
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("already has all its"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_worker_that_leaves_before_the_start_frees_its_place() {
    let token = "test-token-left-0123";
    let (dir, mut coord, addr) = two_worker_job("left", token, &["--join-timeout", "60"]);
    // Worker 1 joins and is killed before the job can start (worker 0 is missing); the
    // coordinator says the place is free (it only can if the worker had joined).
    let mut gone = external_worker(&addr, token, &["--worker-id", "1"]);
    std::thread::sleep(Duration::from_secs(2));
    gone.kill().unwrap();
    let _ = gone.wait();
    let stderr = coord.stderr.take().unwrap();
    assert!(
        line_appears(
            stderr,
            "worker 1 left before the job started",
            Duration::from_secs(30)
        ),
        "the coordinator did not free the place"
    );
    // Two more join: the job takes them both and runs (it had counted the dead one, so the
    // second was refused as out of range and the job timed out).
    let workers: Vec<_> = (0..2).map(|_| external_worker(&addr, token, &[])).collect();
    all_succeed(coord, workers);
    assert_eq!(report(&dir)["status"], "ok");
}

/// A file of the TLS test material (`tests/fixtures/tls/README.md`).
fn tls_file(name: &str) -> String {
    format!("{}/tests/fixtures/tls/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn tls_admits_workers_with_the_jobs_certificate_and_refuses_others() {
    let dir = temp_dir("tls");
    let tls = format!(
        "[launch.tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        tls_file("job-ca.pem"),
        tls_file("job-node.pem"),
        tls_file("job-node.key")
    );
    let config = write(&dir, "job.toml", &job_config(&dir, 2, 1, &tls));
    let token = "test-token-tls-0123456789";
    // Worker-to-worker links over TCP (not Unix sockets): record links inside TLS, whose
    // data-mode collectives must check out as any link's do.
    let (coord, addr) = external_coordinator(&config, token, &["--set", "launch.transport=tcp"]);
    let worker = |tls: &[&str]| external_worker(&addr, token, tls);
    let (ca, job_cert, job_key) = (
        tls_file("job-ca.pem"),
        tls_file("job-node.pem"),
        tls_file("job-node.key"),
    );
    let (other_cert, other_key) = (tls_file("other-node.pem"), tls_file("other-node.key"));
    // Refused: a worker without TLS, by the coordinator itself before any worker is
    // admitted (the job cannot end until two are, so a refusal here is the coordinator's
    // answer to the worker's TLS, not a coordinator that is gone: a worker that finds no
    // coordinator retries until its patience runs out, and says so); and one that trusts
    // the job's authority but holds a certificate another authority signed, by itself.
    let plain = worker(&[]);
    let foreign = worker(&[
        "--tls-ca",
        &ca,
        "--tls-cert",
        &other_cert,
        "--tls-key",
        &other_key,
    ]);
    // A worker whose trust store holds another authority refuses the coordinator's
    // certificate itself: at once, with rustls's reason, not after retrying for its patience.
    let distrustful = worker(&[
        "--tls-ca",
        &tls_file("other-ca.pem"),
        "--tls-cert",
        &other_cert,
        "--tls-key",
        &other_key,
    ]);
    let started = std::time::Instant::now();
    let o = wait_bounded(distrustful, Duration::from_secs(90));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("invalid peer certificate"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "a trust mismatch was retried for {:?}: {err}",
        started.elapsed()
    );
    let o = wait_bounded(plain, Duration::from_secs(90));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("the coordinator refused the session") && err.contains("expects TLS"),
        "{err}"
    );
    assert!(
        err.contains("--tls-ca") && !err.contains("not a podsim"),
        "{err}"
    );
    // A certificate the job's authority did not sign is refused by the worker's own check,
    // before it dials (every peer's handshake would refuse it).
    let o = wait_bounded(foreign, Duration::from_secs(90));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--tls-cert") && err.contains("is not a certificate of"),
        "{err}"
    );
    let admitted: Vec<_> = (0..2)
        .map(|_| {
            worker(&[
                "--tls-ca",
                &ca,
                "--tls-cert",
                &job_cert,
                "--tls-key",
                &job_key,
            ])
        })
        .collect();
    all_succeed(coord, admitted);
    let r = report(&dir);
    assert_eq!(r["status"], "ok");
    let workers = r["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2);
    for w in workers {
        let links = w["links"].as_array().unwrap();
        assert!(!links.is_empty());
        assert!(
            links
                .iter()
                .all(|l| l["transport"] == "tcp" && l["tls"] == true),
            "{links:?}"
        );
    }
}

#[test]
fn tls_files_that_are_missing_or_not_pem_are_a_config_error() {
    let dir = temp_dir("tls-bad");
    let not_pem = write(&dir, "not.pem", "hello");
    let tls = format!(
        "[launch.tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
        tls_file("job-ca.pem"),
        not_pem.display(),
        dir.join("missing.key").display()
    );
    let config = write(&dir, "job.toml", &job_config(&dir, 2, 1, &tls));
    let mut c = podsim();
    c.arg("validate").arg(&config);
    let out = run_bounded(c, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("launch.tls.cert") && err.contains("not a PEM file"),
        "{err}"
    );
    assert!(
        err.contains("launch.tls.key") && err.contains("missing.key"),
        "{err}"
    );
    // PEM files whose contents are wrong: each problem is named as its file's.
    let garbage = write(
        &dir,
        "garbage.pem",
        "-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n",
    );
    let cases = [
        (
            garbage.display().to_string(),
            tls_file("job-node.key"),
            "launch.tls.ca",
        ),
        (
            tls_file("job-ca.pem"),
            tls_file("other-node.key"),
            "launch.tls.cert",
        ),
    ];
    for (i, (ca, key, field)) in cases.into_iter().enumerate() {
        let tls = format!(
            "[launch.tls]\nca = {ca:?}\ncert = {:?}\nkey = {key:?}\n",
            tls_file("job-node.pem")
        );
        let config = write(&dir, &format!("job{i}.toml"), &job_config(&dir, 2, 1, &tls));
        let mut c = podsim();
        c.arg("validate").arg(&config);
        let out = run_bounded(c, Duration::from_secs(30));
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{err}");
    }
}

#[test]
fn bench_across_worker_processes() {
    let mut c = podsim();
    c.args([
        "bench",
        "--topology",
        "8",
        "--workers",
        "4",
        "--sizes",
        "64KiB,1MiB",
        "--iters",
        "2",
        "--json",
    ]);
    let out = run_bounded(c, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2);
    for r in &rows {
        assert_eq!(r["errors"], 0);
        assert!(r["checked"].as_u64().unwrap() > 0);
    }
    // Same virtual time as in one process.
    let mut c = podsim();
    c.args([
        "bench",
        "--topology",
        "8",
        "--sizes",
        "64KiB,1MiB",
        "--iters",
        "2",
        "--json",
    ]);
    let local = run_bounded(c, Duration::from_secs(120));
    let local: Vec<serde_json::Value> = String::from_utf8(local.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (a, b) in rows.iter().zip(&local) {
        assert_eq!(a["virtual_s"], b["virtual_s"]);
    }
}
