//! Garbage on the wire: raw bytes, a missing token, out-of-protocol and oversized messages,
//! and malformed envelopes sent to the control service, to a worker's gRPC link service and to
//! its same-host (Unix socket) link listener. Each is refused with an error; nothing panics
//! and every service keeps serving.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use podsim_collectives::{Algo, Comm, DType, OpKind, ReduceOp};
use podsim_coordinator::launch::ControlPlane;
use podsim_job::BenchCase;
use podsim_programs::job::{JobSpec, Program};
use podsim_proto::v1 as pb;
use podsim_proto::v1::control_client::ControlClient;
use podsim_proto::v1::link_service_client::LinkServiceClient;
use podsim_topology::{Group, Hardware, Pod};
use podsim_worker::transport::{self as net, NodeFabric, TOKEN_HEADER, WORKER_HEADER};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Request;

const TOKEN: &str = "secret-token";

async fn send_raw_garbage(addr: std::net::SocketAddr) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let junk: Vec<u8> = (0..100_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let _ = s.write_all(&junk).await;
    let mut buf = vec![0u8; 4096];
    // The server answers with an HTTP/2 error or closes the connection, within a bound.
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await;
}

fn with_token<T>(body: T, token: Option<&str>) -> Request<T> {
    let mut r = Request::new(body);
    if let Some(t) = token {
        r.metadata_mut().insert(TOKEN_HEADER, t.parse().unwrap());
    }
    r
}

async fn session(
    addr: std::net::SocketAddr,
    token: Option<&str>,
    msgs: Vec<pb::WorkerMsg>,
) -> Result<(), tonic::Status> {
    let mut client = ControlClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .max_encoding_message_size(512 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    for m in msgs {
        tx.send(m).await.unwrap();
    }
    let r = client
        .session(with_token(ReceiverStream::new(rx), token))
        .await;
    drop(tx);
    r.map(|_| ())
}

fn hello() -> pb::WorkerMsg {
    pb::WorkerMsg {
        body: Some(pb::worker_msg::Body::Hello(pb::Hello {
            worker_id: 0,
            pid: 1,
            link_addr: "127.0.0.1:1".into(),
            host: "127.0.0.1".into(),
            ..Default::default()
        })),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_service_refuses_garbage_and_keeps_serving() {
    let control = ControlPlane::start("127.0.0.1:0", TOKEN.to_string(), None)
        .await
        .unwrap();
    let addr = control.addr;
    let run = async {
        send_raw_garbage(addr).await;
        let e = session(addr, None, vec![hello()]).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let e = session(addr, Some("wrong"), vec![hello()])
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unauthenticated);
        let ready = pb::WorkerMsg {
            body: Some(pb::worker_msg::Body::Ready(pb::Ready {})),
        };
        let e = session(addr, Some(TOKEN), vec![ready]).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        let huge = pb::WorkerMsg {
            body: Some(pb::worker_msg::Body::Result(pb::WorkerResult {
                json: vec![b'x'; podsim_job::MAX_CONTROL_MESSAGE_BYTES + (1 << 20)],
            })),
        };
        assert!(
            session(addr, Some(TOKEN), vec![huge]).await.is_err(),
            "oversized message accepted"
        );
        // Still serving: a proper hello is accepted.
        session(addr, Some(TOKEN), vec![hello()]).await.unwrap();
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("bounded");
}

fn spec() -> JobSpec {
    let pod = Pod::single("4".parse().unwrap());
    JobSpec {
        name: "garbage".into(),
        pod: pod.clone(),
        hardware: Hardware::preset("v5p").unwrap(),
        workers: 2,
        program: Program::Bench {
            cases: vec![BenchCase {
                op: OpKind::AllReduce,
                comm: Comm {
                    group: Group::world(&pod),
                    algo: Algo::Ring,
                    dtype: DType::F32,
                    verify: false,
                    instance: 0,
                },
                reduce: ReduceOp::Sum,
                count: 4,
                meta: false,
                warmup: 0,
                iters: 1,
                root: 0,
            }],
        },
        faults: Vec::new(),
        heartbeat_ms: 100,
        recorder_entries: podsim_collectives::DEFAULT_RECORDER_ENTRIES,
        watchdog_ms: 2000,
        busy_ms: podsim_job::DEFAULT_BUSY_MS,
        symmetric: false,
        trace: None,
        transport: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn link_service_refuses_garbage_and_bad_frames() {
    // Worker 0 of a 4-chip ring on 2 workers: chips 0 and 1; worker 1 hosts 2 and 3.
    let fabric = NodeFabric::new(spec().fabric(), 0).unwrap();
    let (_tx, rx) = tokio::sync::watch::channel(Some(fabric.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = net::link_service(TOKEN.to_string(), rx);
    tokio::spawn(net::server_builder().serve_with_incoming(
        service,
        tonic::transport::server::TcpIncoming::from(listener),
    ));
    let run = async {
        send_raw_garbage(addr).await;
        let connect = || async {
            LinkServiceClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
        };
        let open = |token: Option<&'static str>, worker: &'static str| {
            let (tx, rx) = tokio::sync::mpsc::channel::<pb::Frame>(4);
            let mut r = with_token(ReceiverStream::new(rx), token);
            r.metadata_mut()
                .insert(WORKER_HEADER, worker.parse().unwrap());
            (tx, r)
        };
        // No token.
        let (_t, r) = open(None, "1");
        assert_eq!(
            connect().await.exchange(r).await.unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        // A worker that shares no link (there is no worker 7).
        let (_t, r) = open(Some(TOKEN), "7");
        assert_eq!(
            connect().await.exchange(r).await.unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        // A proper peer that sends an envelope from a chip it does not host.
        let (tx, r) = open(Some(TOKEN), "1");
        let mut back = connect().await.exchange(r).await.unwrap().into_inner();
        let forged = pb::Envelope {
            src_chip: 0,
            dst_chip: 1,
            ..Default::default()
        };
        tx.send(pb::Frame {
            envelopes: vec![forged],
        })
        .await
        .unwrap();
        let errors = link_errors(&fabric, "the forged envelope was not refused").await;
        assert!(errors[0].contains("does not host"), "{errors:?}");
        // Nothing arrived in any inbox: the chips' receives fail with that error.
        drop(tx);
        let _ = tokio::time::timeout(Duration::from_secs(5), back.message()).await;
        // The service still answers.
        let (_t, r) = open(None, "1");
        assert_eq!(
            connect().await.exchange(r).await.unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    };
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("bounded");
    let _ = Arc::strong_count(&fabric);
}

/// The link errors the fabric has recorded, once there are any (at most 5 s; `refused`
/// says what failed to happen otherwise).
async fn link_errors(fabric: &NodeFabric, refused: &str) -> Vec<String> {
    let recorded = tokio::time::timeout(Duration::from_secs(5), async {
        while fabric.link_errors().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(recorded.is_ok(), "{refused}");
    fabric.link_errors()
}

/// A record-link listener under test: a Unix socket's name, or a link port on TCP.
#[derive(Clone)]
enum Port {
    Unix(String),
    Tcp(std::net::SocketAddr),
}

/// Serves record links for `fabric` on a fresh listener of `port`'s kind (a TCP port hands
/// whatever is not a record hello to a gRPC server that is not there).
#[cfg(target_os = "linux")]
async fn record_port(tcp: bool, fabric: &std::sync::Arc<NodeFabric>) -> Port {
    use podsim_worker::transport::records;
    let (tx, rx) = tokio::sync::watch::channel(Some(fabric.clone()));
    // The fabric stays set for the listener's life.
    tokio::spawn(async move { tx.closed().await });
    if tcp {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (grpc, mut unused) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move { while unused.recv().await.is_some() {} });
        tokio::spawn(records::route_tcp(
            listener,
            None,
            TOKEN.to_string(),
            rx,
            grpc,
        ));
        Port::Tcp(addr)
    } else {
        let (listener, name) = records::bind().unwrap();
        tokio::spawn(records::serve(listener, TOKEN.to_string(), rx));
        Port::Unix(name)
    }
}

/// Dials `port` and sends `bytes`; what it answers (until it closes or 2 s pass).
async fn exchange(port: &Port, bytes: &[u8]) -> Vec<u8> {
    async fn talk<S: AsyncReadExt + AsyncWriteExt + Unpin>(mut s: S, bytes: &[u8]) -> Vec<u8> {
        let _ = s.write_all(bytes).await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut out)).await;
        out
    }
    match port {
        Port::Unix(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let s = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
            s.set_nonblocking(true).unwrap();
            talk(tokio::net::UnixStream::from_std(s).unwrap(), bytes).await
        }
        Port::Tcp(addr) => talk(tokio::net::TcpStream::connect(addr).await.unwrap(), bytes).await,
    }
}

#[cfg(target_os = "linux")]
fn local_hello(worker: u32, token: &str) -> Vec<u8> {
    let mut h = b"PODSIMLK".to_vec();
    h.extend(2u32.to_le_bytes());
    h.extend(worker.to_le_bytes());
    h.extend((token.len() as u32).to_le_bytes());
    h.extend(token.as_bytes());
    // No shared region offered.
    h.extend([0u8; 16]);
    h
}

/// A record header (version 2: 120 bytes) for chip 1 to chip 0 whose payload of `len` values
/// lies, it says, in a shared region at `slot`, `offset`.
#[cfg(target_os = "linux")]
fn lent_record(len: u64, slot: u32, offset: u64) -> Vec<u8> {
    let mut h = vec![0u8; 120];
    h[..4].copy_from_slice(&0x314D_5350u32.to_le_bytes());
    h[4..8].copy_from_slice(&1u32.to_le_bytes());
    h[51] = 2;
    h[80..88].copy_from_slice(&len.to_le_bytes());
    h[88..92].copy_from_slice(&slot.to_le_bytes());
    h[96..104].copy_from_slice(&offset.to_le_bytes());
    h
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_link_listeners_refuse_garbage_and_bad_records() {
    let run = async {
        for tcp in [false, true] {
            refuses_garbage_and_bad_records(tcp).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("bounded");
}

/// The same attacks on the Unix-socket listener and on the TCP link port.
#[cfg(target_os = "linux")]
async fn refuses_garbage_and_bad_records(tcp: bool) {
    let kind = if tcp { "tcp" } else { "unix" };
    let fabric = NodeFabric::new(spec().fabric(), 0).unwrap();
    let port = record_port(tcp, &fabric).await;
    let junk: Vec<u8> = (0..100_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    // Junk where a hello should be (on the TCP port, after the magic: junk from the start
    // is not a record link there, and goes to gRPC).
    let mut opening = if tcp {
        b"PODSIMLK".to_vec()
    } else {
        Vec::new()
    };
    opening.extend(&junk);
    let answer = exchange(&port, &opening).await;
    assert!(answer.starts_with(b"NO"), "{kind}: {answer:?}");
    let answer = exchange(&port, &local_hello(1, "wrong")).await;
    assert!(
        answer.starts_with(b"NO") && String::from_utf8_lossy(&answer).contains("token"),
        "{kind}: {answer:?}"
    );
    let answer = exchange(&port, &local_hello(7, TOKEN)).await;
    assert!(
        String::from_utf8_lossy(&answer).contains("shares no link"),
        "{kind}: {answer:?}"
    );
    // A proper peer whose first record is garbage: the link fails with a named error.
    let mut bytes = local_hello(1, TOKEN);
    bytes.extend(&junk[..200]);
    let answer = exchange(&port, &bytes).await;
    assert!(answer.starts_with(b"OK"), "{kind}: {answer:?}");
    let errors = link_errors(&fabric, "the garbage record was not refused").await;
    assert!(errors[0].contains("bad record"), "{kind}: {errors:?}");
    // A record that points into a shared region the link does not have: refused, named.
    let second = NodeFabric::new(spec().fabric(), 0).unwrap();
    let second_port = record_port(tcp, &second).await;
    let mut bytes = local_hello(1, TOKEN);
    bytes.push(0); // "I did not map your region"
    bytes.extend(lent_record(1 << 16, 3, 1 << 20));
    let answer = exchange(&second_port, &bytes).await;
    assert!(answer.starts_with(b"OK"), "{kind}: {answer:?}");
    let errors = link_errors(&second, "the lent record was not refused").await;
    assert!(
        errors[0].contains("without a shared region"),
        "{kind}: {errors:?}"
    );
    // Still serving: a second link from worker 1 is refused as taken, not ignored.
    let answer = exchange(&port, &local_hello(1, TOKEN)).await;
    assert!(
        String::from_utf8_lossy(&answer).contains("already linked"),
        "{kind}: {answer:?}"
    );
}
