//! Admission to a worker's same-host link listener, through the entry points the worker runs
//! (`transport::records::{bind, serve}`): a flood of connections that never say hello leaves
//! room for a worker, a process of another user is refused before its hello is read, and
//! running out of descriptors costs connections, never the listener.
//!
//! The last two need a process of their own (another uid; a low descriptor limit): the test
//! runs this test binary again, under those conditions, for one helper test that is ignored
//! otherwise and does its part only when the environment says so.
#![allow(clippy::unwrap_used)]

use std::io::{Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use podsim_programs::job::{JobSpec, Program, Transport};
use podsim_topology::{Hardware, Pod};
use podsim_worker::transport::NodeFabric;
use podsim_worker::transport::records;

const TOKEN: &str = "admission-token";
/// Names the helper's part when this binary runs again for one of the tests.
const ROLE: &str = "PODSIM_ADMISSION_ROLE";
/// The listener the helper dials.
const SOCKET: &str = "PODSIM_ADMISSION_SOCKET";
/// Every wait of these tests ends by this.
const BOUNDED: Duration = Duration::from_secs(30);
/// Connections the listener lets wait for their hello (`socket::MAX_PENDING_HELLOS`).
const PENDING: usize = 64;
/// The arguments that run [`helper`] alone (named by its path in the test binary).
fn helper_alone() -> [String; 5] {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    [
        "--exact".into(),
        format!("{module}::helper"),
        "--ignored".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]
}

/// Worker 0 of a ring of 4 chips on 2 workers (its one neighbour: worker 1), linking over
/// plain Unix sockets.
fn spec() -> JobSpec {
    let pod = Pod::single("4".parse().unwrap());
    JobSpec {
        name: "admission".into(),
        pod,
        hardware: Hardware::preset("v5p").unwrap(),
        workers: 2,
        program: Program::Collectives {
            iterations: 1,
            meta: true,
            script: Vec::new(),
            verify: false,
        },
        faults: Vec::new(),
        heartbeat_ms: 100,
        recorder_entries: podsim_collectives::DEFAULT_RECORDER_ENTRIES,
        watchdog_ms: 2000,
        busy_ms: podsim_job::DEFAULT_BUSY_MS,
        symmetric: false,
        trace: None,
        transport: Transport::Uds,
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Worker 0's same-host link listener, as a worker serves it, its fabric set: its name.
fn listen(runtime: &tokio::runtime::Runtime) -> (String, Arc<NodeFabric>) {
    let fabric = NodeFabric::new(spec().fabric(), 0).unwrap();
    let (tx, rx) = tokio::sync::watch::channel(Some(fabric.clone()));
    let _guard = runtime.enter();
    let (listener, name) = records::bind().unwrap();
    runtime.spawn(async move {
        // The fabric stays set for the listener's life.
        let _tx = tx;
        records::serve(listener, TOKEN.into(), rx).await
    });
    (name, fabric)
}

fn connect(name: &str) -> std::io::Result<UnixStream> {
    UnixStream::connect_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)
}

/// A worker's hello (version 2, no shared region), followed by its answer that it did not
/// map the listener's region.
fn hello(worker: u32, token: &str) -> Vec<u8> {
    let mut h = b"PODSIMLK".to_vec();
    h.extend(2u32.to_le_bytes());
    h.extend(worker.to_le_bytes());
    h.extend((token.len() as u32).to_le_bytes());
    h.extend(token.as_bytes());
    h.extend([0u8; 16]);
    h.push(0);
    h
}

/// Bytes of an `OK` answer to a hello: the verdict, whether the listener mapped the offered
/// region, its own region's offer.
const OK_BYTES: usize = 2 + 1 + 16;

/// Says worker 1's hello on a new connection to `name`: the listener's answer (a whole `OK`,
/// or what it sent until it closed; what came in `BOUNDED` otherwise), and the connection.
fn worker_dials(name: &str) -> (Vec<u8>, UnixStream) {
    let mut s = connect(name).unwrap();
    // A refused peer may be closed before its hello is written: the answer says why.
    let _ = s.write_all(&hello(1, TOKEN));
    s.set_read_timeout(Some(BOUNDED)).unwrap();
    let mut answer = Vec::new();
    let mut chunk = [0u8; 512];
    while !(answer.starts_with(b"OK") && answer.len() >= OK_BYTES) {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend(&chunk[..n]),
        }
    }
    (answer, s)
}

/// Whether the listener closes `s` within `wait` (it sends nothing to a silent connection).
fn closed_within(s: &mut UnixStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

#[test]
fn a_flood_of_silent_connections_leaves_room_for_a_worker() {
    let runtime = runtime();
    let (name, fabric) = listen(&runtime);
    let mut flood: Vec<UnixStream> = (0..200).map(|_| connect(&name).unwrap()).collect();
    // The oldest give way to newer ones as they come (long before their deadline).
    let (oldest, newest) = flood.split_at_mut(200 - PENDING);
    for (i, s) in oldest.iter_mut().enumerate() {
        assert!(
            closed_within(s, BOUNDED),
            "silent connection {i} still open"
        );
    }
    assert!(!closed_within(
        &mut newest[PENDING - 1],
        Duration::from_millis(10)
    ));
    // A worker is linked all the same.
    let (answer, _link) = worker_dials(&name);
    assert!(
        answer.starts_with(b"OK"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    runtime.block_on(fabric.wait_connected(BOUNDED)).unwrap();
    let links = fabric.links(false);
    assert!(links.len() == 1 && links[0].peer == 1, "{links:?}");
}

/// Runs this test binary again for [`helper`] to dial `name` as `uid`: its output once it has
/// ended (killed after `BOUNDED`). `None` when the binary cannot be run that way here.
fn dial_as(uid: u32, name: &str) -> Option<Output> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().unwrap();
    let mut command = Command::new(&exe);
    command
        .args(helper_alone())
        .env(ROLE, "dial")
        .env(SOCKET, name)
        .uid(uid)
        .gid(uid)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("skipped: cannot run {} that way: {e}", exe.display());
            return None;
        }
    };
    let deadline = Instant::now() + BOUNDED;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the helper did not end within {BOUNDED:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(child.wait_with_output().unwrap())
}

/// Where the helper tests learn their part; `None` when run as ordinary tests.
fn role() -> Option<(String, String)> {
    Some((
        std::env::var(ROLE).ok()?,
        std::env::var(SOCKET).unwrap_or_default(),
    ))
}

const NOBODY: u32 = 65534;

#[test]
fn a_process_of_another_user_is_refused_before_its_hello_is_read() {
    let runtime = runtime();
    let (name, fabric) = listen(&runtime);
    // SO_PEERCRED reports the dialler's effective uid: only root can dial as another user.
    if !is_root() {
        eprintln!("skipped: only root can run a process as another user");
        return;
    }
    let Some(out) = dial_as(NOBODY, &name) else {
        return;
    };
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("answer: NO") && said.contains(&format!("uid {NOBODY}")),
        "{said}"
    );
    assert!(fabric.links(false).is_empty(), "{:?}", fabric.links(false));
    // This user's worker is taken.
    let (answer, _link) = worker_dials(&name);
    assert!(
        answer.starts_with(b"OK"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
}

/// A worker whose listener runs out of descriptors (a process limited to 64, flooded by
/// this one with 100 silent connections: some wait in the kernel for an `accept` that fails)
/// neither spins nor stops listening: once the flood ends, a worker is linked.
#[test]
fn running_out_of_descriptors_costs_connections_not_the_listener() {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new("/bin/sh")
        .args(["-c", "ulimit -n 64 && exec \"$0\" \"$@\""])
        .arg(&exe)
        .args(helper_alone())
        .env(ROLE, "exhaust")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut to_child = child.stdin.take().unwrap();
    let from_child = lines(child.stdout.take().unwrap());
    let mut ask = |what: &str| -> String {
        writeln!(to_child, "{what}").unwrap();
        let answer = from_child.recv_timeout(BOUNDED);
        answer.unwrap_or_else(|_| panic!("the helper did not answer {what:?}"))
    };
    let name = ask("name");
    let flood: Vec<UnixStream> = (0..100).map(|_| connect(&name).unwrap()).collect();
    // The helper has taken what it could: the rest wait in the kernel, its accept failing.
    std::thread::sleep(Duration::from_millis(300));
    let before: u64 = ask("cpu").parse().unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let spent = ask("cpu").parse::<u64>().unwrap() - before;
    // A listener retrying a failing accept at once keeps a core busy: about 100 ticks.
    assert!(
        spent < 50,
        "{spent} ticks of CPU in 1 s while out of descriptors"
    );
    // The flood ends (the listener closes its ends as they do, and takes the waiting ones,
    // which have ended too); a worker is then linked.
    drop(flood);
    let (answer, _link) = worker_dials(&name);
    assert!(
        answer.starts_with(b"OK"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(ask("linked"), "yes");
    drop(to_child);
    let deadline = Instant::now() + BOUNDED;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the helper did not end");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The answers a helper prints (what follows `> ` on a line: the test harness's own words
/// may come first), as they come.
fn lines(out: std::process::ChildStdout) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        let answers = std::io::BufReader::new(out)
            .lines()
            .map_while(Result::ok)
            .filter_map(|line| Some(line.split_once("> ")?.1.to_string()));
        for answer in answers {
            if tx.send(answer).is_err() {
                return;
            }
        }
    });
    rx
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .and_then(|l| l.split_whitespace().nth(2))
        == Some("0")
}

/// The helper's parts, each in a process the test above started; nothing otherwise.
#[test]
#[ignore = "run by the tests above, in a process of its own"]
fn helper() {
    match role() {
        Some((role, name)) if role == "dial" => dial_as_this_user(&name),
        Some((role, _)) if role == "exhaust" => exhaust_descriptors(),
        _ => {}
    }
}

/// Says a worker's hello to `name` and prints the answer.
fn dial_as_this_user(name: &str) {
    let (answer, _) = worker_dials(name);
    println!("answer: {}", String::from_utf8_lossy(&answer));
}

/// CPU time this process has used, in clock ticks, read from `stat` (`/proc/self/stat`, opened
/// while descriptors were left).
fn cpu_ticks(stat: &std::fs::File) -> u64 {
    use std::os::unix::fs::FileExt;
    let mut buf = [0u8; 1024];
    let n = stat.read_at(&mut buf, 0).unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    // After the command name: state is field 3, utime 14 and stime 15.
    let after = text.rsplit_once(')').map_or("", |(_, rest)| rest);
    after
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|f| f.parse::<u64>().unwrap())
        .sum()
}

/// Serves a listener and answers the test's questions, one a line on stdin, until it ends:
/// `name` (the listener's), `cpu` (this process's CPU ticks), `linked` (once worker 1 is).
fn exhaust_descriptors() {
    let runtime = runtime();
    let (name, fabric) = listen(&runtime);
    let stat = std::fs::File::open("/proc/self/stat").unwrap();
    for question in std::io::stdin().lines() {
        let answer = match question.unwrap().as_str() {
            "name" => name.clone(),
            "cpu" => cpu_ticks(&stat).to_string(),
            "linked" => match runtime.block_on(fabric.wait_connected(BOUNDED)) {
                Ok(()) => "yes".into(),
                Err(e) => e.to_string(),
            },
            other => format!("what is {other:?}?"),
        };
        println!("> {answer}");
    }
}
