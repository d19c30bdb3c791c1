//! The protocol between a PyTorch rank (the `podsim.torch` backend, `python/podsim/torch.py`)
//! and the chip that serves it, over one Unix socket per rank.
//!
//! Every frame, both ways: a 16-byte header (magic `PDT1`, the JSON length as u32, the payload
//! length as u64, little-endian), a small JSON object saying what the frame is, then the
//! payload: f32 values in the host's byte order (both ends are on one host). JSON keeps the
//! Python side a few lines of `json` and `struct`; the payload travels raw, read straight into
//! a pooled buffer and written straight from the chip's buffers. Every length is checked
//! against its limit and every request against what it claims (a count that is not the
//! payload's), so a garbage frame is an error naming the rank, never a panic or a huge
//! allocation.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use podsim_collectives::{DType, Payload, ReduceOp, Run};

/// `b"PDT1"` read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"PDT1");
pub const HEADER_BYTES: usize = 16;
/// Longest JSON part of a frame (a request names a group by id; only `group` and `stack`
/// carry lists).
pub const MAX_JSON_BYTES: u32 = 1 << 20;
/// Largest payload of one call (a rank's tensor), bytes.
pub const MAX_PAYLOAD_BYTES: u64 = 16 << 30;

/// How a step's compute was known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepCounting {
    /// Every op counted at the rank's dispatcher.
    #[default]
    Counted,
    /// The rank's requests were those of its steady step, and each was charged the compute
    /// counted before it in that step.
    Replayed,
    /// Replayed until a request differed from the steady step's, counted from there: the
    /// ops before that point were not seen.
    Partial,
}

/// The most ranks a group's runs may expand to (a pod's most chips).
const MOST_GROUP_RANKS: u64 = 1 << 24;

/// A group's ranks as the rank sends them: runs `[first, count, stride]`, each the ranks
/// `first + i * stride` for `i` below `count`. The world group of a pod is one run, and a
/// device mesh's groups a run or a few, so the frame stays small at any pod size: as a
/// list of every rank, the world group of 262,144 ranks took 1.7 MB, past the JSON limit,
/// and the job failed as the program's error. Runs that overflow or expand past a pod's
/// most chips are refused.
fn rank_runs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
    let runs = Vec::<(u32, u32, u32)>::deserialize(d)?;
    let total: u64 = runs.iter().map(|&(_, count, _)| u64::from(count)).sum();
    if total > MOST_GROUP_RANKS {
        return Err(serde::de::Error::custom(format!(
            "a group of {total} ranks: more than a pod's {MOST_GROUP_RANKS} chips"
        )));
    }
    let mut ranks = Vec::with_capacity(total as usize);
    for (first, count, stride) in runs {
        for i in 0..count {
            let rank = u64::from(first) + u64::from(i) * u64::from(stride);
            let rank = u32::try_from(rank).map_err(|_| {
                serde::de::Error::custom(format!("run [{first}, {count}, {stride}] overflows"))
            })?;
            ranks.push(rank);
        }
    }
    Ok(ranks)
}

/// What a rank asks of its chip.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The first frame of a connection: who is calling, with the job's token.
    Hello {
        rank: u32,
        pid: u32,
        token: String,
    },
    /// Declares group `id` (a `new_group`, a device mesh dimension) as its global ranks, sent
    /// as runs (see [`rank_runs`]).
    Group {
        id: u32,
        #[serde(deserialize_with = "rank_runs")]
        ranks: Vec<u32>,
    },
    AllReduce {
        group: u32,
        reduce: ReduceName,
        dtype: DTypeName,
    },
    AllGather {
        group: u32,
        dtype: DTypeName,
    },
    ReduceScatter {
        group: u32,
        reduce: ReduceName,
        dtype: DTypeName,
    },
    Broadcast {
        group: u32,
        root: u32,
        dtype: DTypeName,
    },
    AllToAll {
        group: u32,
        dtype: DTypeName,
    },
    Barrier {
        group: u32,
    },
    /// The payload goes to global rank `peer` under `tag` (`dist.send`, `isend`).
    Send {
        peer: u32,
        #[serde(default)]
        tag: u32,
    },
    /// The next message from global rank `peer` under `tag`, of `count` f32 words
    /// (`dist.recv`, or the wait of an `irecv`).
    Recv {
        peer: u32,
        #[serde(default)]
        tag: u32,
        count: u64,
    },
    /// The program marks the end of a training step (`podsim.torch.step()`).
    Step {
        /// The rank's HBM peak since its previous step (absent when it does not count).
        #[serde(default)]
        hbm: Option<StepHbm>,
        /// Marked by `optimizer.step()`, not by the program: dropped (folded into the next)
        /// once the program marks steps itself.
        #[serde(default)]
        auto: bool,
        /// How the step's compute was known (counted, or replayed from the steady step).
        #[serde(default)]
        counting: StepCounting,
    },
    /// Meta mode: the rank, source of its `key`-th object broadcast or scatter
    /// (`broadcast_object_list`), hands its pickle (the payload) to the job's other processes.
    PostObjects {
        key: u64,
    },
    /// Meta mode: global rank `src`'s pickle for the rank's `key`-th object broadcast or
    /// scatter, as the reply's payload; none when `src` runs no process of the job.
    FetchObjects {
        key: u64,
        src: u32,
    },
    /// The chip's clock where the rank's compute stream is (a timing event recorded:
    /// `torch.cuda.Event(enable_timing=True).record()`): the reply's `clock_ns`, after the
    /// frame's compute and waits.
    Clock,
    /// The rank's Python stack while it is outside podsim calls (no reply).
    Stack {
        frames: Vec<String>,
    },
    /// The rank's stack sampler names its own thread (the kernel's id), which the chip leaves
    /// out when it asks whether the rank is working (no reply).
    Sampler {
        thread: u32,
    },
    /// An exception is ending the rank's program (no reply): what it was; its line is the
    /// frame's `site`.
    Raised {
        error: String,
    },
    /// The rank is done (`destroy_process_group`, or the interpreter exits), with the
    /// stand-in values meta mode gave its program.
    Bye {
        #[serde(default)]
        stand_ins: Vec<StandIn>,
    },
}

impl Request {
    /// The f32 words the request moves: a meta-mode request names them (`meta`), a receive
    /// asks for them, any other carries them (`values` of them).
    pub fn words(&self, meta: Option<u64>, values: usize) -> u64 {
        match (self, meta) {
            (Request::Recv { count, .. }, _) => *count,
            (_, Some(meta)) => meta,
            _ => values as u64,
        }
    }
}

/// A rank's HBM over a step, as counted at its dispatcher: the peak of its live device bytes
/// and their split by kind at that moment.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct StepHbm {
    pub peak_bytes: u64,
    #[serde(default)]
    pub by_kind: Vec<(String, u64)>,
}

/// A value meta mode made up because the program asked for one (`.item()` of a tensor that
/// has no values): what was asked, at which line, how many times.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandIn(pub String, pub String, pub u64);

/// A request with what every request carries: the compute the rank ran since its previous
/// request and the line of the user's program that made the call.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Frame {
    #[serde(flatten)]
    pub request: Request,
    #[serde(default)]
    pub compute: Compute,
    /// `file:line function` of the call in the user's program.
    #[serde(default)]
    pub site: Option<String>,
    /// Meta mode: the request's tensor as a count of f32 words, with no payload.
    #[serde(default)]
    pub meta: Option<u64>,
    /// A collective's id (its work): it runs on a communication stream from its issue, and
    /// the compute stream waits for it only at a [`Waited`] naming it.
    #[serde(default)]
    pub work: Option<u64>,
    /// Where the rank's compute stream waited for collectives since its previous request,
    /// each after the compute it ran before waiting; the frame's own `compute` follows them.
    #[serde(default)]
    pub waits: Vec<Waited>,
}

/// The compute stream waited for collectives `works`, after running `compute`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Waited {
    #[serde(default)]
    pub compute: Compute,
    #[serde(default)]
    pub works: Vec<u64>,
}

/// Torch ops a rank ran, counted at the dispatcher: matrix products by shape, everything else
/// as bytes moved through HBM and a number of kernels.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct Compute {
    /// `[m, k, n, calls, element bytes]` per distinct product shape.
    #[serde(default)]
    pub matmuls: Vec<[u64; 5]>,
    /// Bytes read and written by the other kernels.
    #[serde(default)]
    pub pass_bytes: u64,
    /// Kernels other than matrix products.
    #[serde(default)]
    pub kernels: u64,
    /// Flash-attention kernels: `[batch, seq, heads, head_dim, causal, backward, elem_bytes,
    /// calls]` (`scaled_dot_product_attention`, priced as the chip's kernel, not as the
    /// decomposition the rank's host ran).
    #[serde(default)]
    pub attention: Vec<[u64; 8]>,
    /// Of `matmuls` and `attention`, what `torch.utils.checkpoint` recomputed in backward
    /// (left out of model flops, for MFU).
    #[serde(default)]
    pub recomputed_matmuls: Vec<[u64; 5]>,
    #[serde(default)]
    pub recomputed_attention: Vec<[u64; 8]>,
}

impl Compute {
    pub fn is_empty(&self) -> bool {
        self.matmuls.is_empty()
            && self.pass_bytes == 0
            && self.kernels == 0
            && self.attention.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceName {
    Sum,
    Avg,
    Max,
    Min,
}

impl From<ReduceName> for ReduceOp {
    fn from(r: ReduceName) -> ReduceOp {
        match r {
            ReduceName::Sum => ReduceOp::Sum,
            ReduceName::Avg => ReduceOp::Avg,
            ReduceName::Max => ReduceOp::Max,
            ReduceName::Min => ReduceOp::Min,
        }
    }
}

/// The element type the rank's tensor has, for virtual time (values travel as f32; 16-bit
/// floats are widened by the rank and cost their own size on the modelled links).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DTypeName {
    F32,
    Bf16,
    F16,
}

impl From<DTypeName> for DType {
    fn from(d: DTypeName) -> DType {
        match d {
            DTypeName::F32 => DType::F32,
            DTypeName::Bf16 | DTypeName::F16 => DType::Bf16,
        }
    }
}

/// What a chip answers.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Reply {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The chip's virtual clock after the call, ns.
    pub clock_ns: f64,
}

/// Reads one frame whose payload is at most `max_payload` bytes: `None` at a clean end of
/// the stream (between frames). A connection's first frame, read before its token is
/// checked, is read with a limit of 0, so that no stranger can make the chip allocate.
pub async fn read_frame(
    r: &mut (impl AsyncRead + Unpin),
    max_payload: u64,
) -> Result<Option<(Frame, Vec<f32>)>, String> {
    let mut header = [0u8; HEADER_BYTES];
    match r.read_exact(&mut header[..1]).await {
        Ok(_) => {}
        // Between frames, a reset is the end of the stream too: a process killed with data
        // unread on its socket resets it (a forked rank whose rank server died). Its exit
        // then tells what happened, not "connection reset" as the program's error.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset
            ) =>
        {
            return Ok(None);
        }
        Err(e) => return Err(e.to_string()),
    }
    r.read_exact(&mut header[1..])
        .await
        .map_err(|e| format!("a frame's header was cut short: {e}"))?;
    let (json_len, payload_len) = parse_header(&header, max_payload)?;
    let mut json = vec![0u8; json_len];
    r.read_exact(&mut json)
        .await
        .map_err(|e| format!("a frame's JSON was cut short: {e}"))?;
    let frame: Frame = serde_json::from_slice(&json).map_err(|e| {
        format!(
            "bad request {:?}: {e}",
            String::from_utf8_lossy(&json[..json.len().min(200)])
        )
    })?;
    let mut values = Payload::receive_buffer(payload_len / 4);
    r.read_exact(bytemuck::cast_slice_mut(&mut values))
        .await
        .map_err(|e| format!("a frame's payload was cut short: {e}"))?;
    Ok(Some((frame, values)))
}

/// The JSON and payload lengths a header announces, checked against the limits (a payload
/// of at most `max_payload` bytes).
pub fn parse_header(
    header: &[u8; HEADER_BYTES],
    max_payload: u64,
) -> Result<(usize, usize), String> {
    let word = |at: usize| {
        u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
    };
    if word(0) != MAGIC {
        return Err(format!(
            "not a podsim rank frame (magic {:#010x}, expected {MAGIC:#010x})",
            word(0)
        ));
    }
    let json_len = word(4);
    if json_len == 0 || json_len > MAX_JSON_BYTES {
        return Err(format!(
            "a frame's JSON of {json_len} bytes is outside 1..={MAX_JSON_BYTES}"
        ));
    }
    let payload_len = u64::from(word(8)) | (u64::from(word(12)) << 32);
    if payload_len > max_payload || !payload_len.is_multiple_of(4) {
        return Err(format!(
            "a payload of {payload_len} bytes is not a whole number of f32 values up to {max_payload}"
        ));
    }
    Ok((json_len as usize, payload_len as usize))
}

/// Writes one frame: `reply` as JSON, then `payload`'s values.
pub async fn write_frame(
    w: &mut (impl AsyncWrite + Unpin),
    reply: &Reply,
    payload: Option<&Payload>,
) -> std::io::Result<()> {
    let json = serde_json::to_vec(reply).map_err(std::io::Error::other)?;
    // A meta-mode result is a size the rank already knows: no values follow.
    let values = match payload {
        None | Some(Payload::Meta(_)) => 0,
        Some(p) => p.len(),
    };
    let mut head = Vec::with_capacity(HEADER_BYTES + json.len());
    head.extend_from_slice(&MAGIC.to_le_bytes());
    head.extend_from_slice(&(json.len() as u32).to_le_bytes());
    head.extend_from_slice(&(4 * values as u64).to_le_bytes());
    head.extend_from_slice(&json);
    w.write_all(&head).await?;
    if let Some(rope) = payload.and_then(Payload::as_rope) {
        for run in rope.runs() {
            match run {
                Run::Values(v) => w.write_all(bytemuck::cast_slice(v)).await?,
                Run::Zeros(n) => {
                    // Padding owns no memory: write it from a small block, not a fresh one.
                    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
                    let mut left = 4 * n;
                    while left > 0 {
                        let k = left.min(ZEROS.len());
                        w.write_all(&ZEROS[..k]).await?;
                        left -= k;
                    }
                }
            }
        }
    }
    w.flush().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(json: &str, payload: &[f32]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_le_bytes());
        out.extend_from_slice(&(json.len() as u32).to_le_bytes());
        out.extend_from_slice(&(4 * payload.len() as u64).to_le_bytes());
        out.extend_from_slice(json.as_bytes());
        out.extend_from_slice(bytemuck::cast_slice(payload));
        out
    }

    fn read(bytes: &[u8]) -> Result<Option<(Frame, Vec<f32>)>, String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let mut r = bytes;
        rt.block_on(read_frame(&mut r, MAX_PAYLOAD_BYTES))
    }

    #[test]
    fn a_group_travels_as_runs_and_absurd_runs_are_refused() {
        let group = |runs: &str| {
            read(&frame(
                &format!(r#"{{"op":"group","id":1,"ranks":{runs}}}"#),
                &[],
            ))
            .map(|f| f.map(|(f, _)| f.request))
        };
        assert_eq!(
            group("[[0,3,1],[10,2,5]]"),
            Ok(Some(Request::Group {
                id: 1,
                ranks: vec![0, 1, 2, 10, 15]
            }))
        );
        // A pod's world group of 2^24 ranks is one short run; more ranks, or ranks past u32,
        // are errors, not allocations.
        let world = group("[[0,16777216,1]]").expect("the largest pod");
        assert!(matches!(world, Some(Request::Group { ranks, .. }) if ranks.len() == 1 << 24));
        for bad in [
            "[[0,16777217,1]]",
            "[[0,4294967295,1],[0,4294967295,1]]",
            "[[4294967295,2,1]]",
        ] {
            assert!(group(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_request_reads_back_with_its_payload_compute_and_call_site() {
        let json = r#"{"op":"all_reduce","group":0,"reduce":"avg","dtype":"bf16","site":"t.py:3 f","compute":{"matmuls":[[2,3,4,1,4]],"pass_bytes":64,"kernels":2}}"#;
        let (f, values) = read(&frame(json, &[1.0, 2.0]))
            .expect("ok")
            .expect("a frame");
        assert_eq!(
            f.request,
            Request::AllReduce {
                group: 0,
                reduce: ReduceName::Avg,
                dtype: DTypeName::Bf16
            }
        );
        assert_eq!(f.compute.matmuls, vec![[2, 3, 4, 1, 4]]);
        assert_eq!(f.site.as_deref(), Some("t.py:3 f"));
        assert_eq!(values, vec![1.0, 2.0]);
        assert_eq!(read(&[]).expect("ok"), None);
        let (f, _) = read(&frame(r#"{"op":"sampler","thread":4242}"#, &[]))
            .expect("ok")
            .expect("a frame");
        assert_eq!(f.request, Request::Sampler { thread: 4242 });
        let (f, _) = read(&frame(r#"{"op":"clock","compute":{"pass_bytes":8}}"#, &[]))
            .expect("ok")
            .expect("a frame");
        assert_eq!((f.request, f.compute.pass_bytes), (Request::Clock, 8));
    }

    #[test]
    fn garbage_frames_are_refused_with_what_is_wrong() {
        let good = frame(r#"{"op":"bye"}"#, &[]);
        let mut bad_magic = good.clone();
        bad_magic[0] ^= 0xff;
        assert!(read(&bad_magic).expect_err("magic").contains("magic"));
        let mut huge = good.clone();
        huge[8..16].copy_from_slice(&(MAX_PAYLOAD_BYTES + 4).to_le_bytes());
        assert!(read(&huge).expect_err("huge").contains("payload"));
        let mut odd = good.clone();
        odd[8..16].copy_from_slice(&3u64.to_le_bytes());
        assert!(read(&odd).expect_err("odd").contains("whole number"));
        assert!(
            read(&frame(r#"{"op":"teleport"}"#, &[]))
                .expect_err("op")
                .contains("bad request")
        );
        assert!(read(&good[..10]).expect_err("short").contains("cut short"));
        // Before the token is checked, no payload at all: nothing is allocated for a stranger.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let hello = frame(r#"{"op":"hello","rank":0,"pid":1,"token":"t"}"#, &[1.0]);
        let mut r = hello.as_slice();
        let e = rt.block_on(read_frame(&mut r, 0)).expect_err("payload");
        assert!(e.contains("up to 0"), "{e}");
    }
}
