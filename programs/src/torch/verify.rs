//! Checking that a representative rank stands for the others (`--verify-ranks`).
//!
//! In meta mode one process (rank 0, on the mirror fabric) stands for every rank of a pod that
//! its torus and device mesh make alike; that holds only if every rank's program calls the
//! same collectives in the same order. A few other ranks, spread over the pod, run too as
//! *shadows*: their collectives do not run on the fabric (their chips are the
//! representative's translates); each is compared with the representative's call of the same
//! index, and the first that differs - a rank-dependent branch, a skipped backward, a
//! different size - ends the job as a desync naming the rank, both collectives and both
//! Python lines.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use podsim_collectives::{CollectiveError, DType, Fingerprint, OpKind, Payload, ReduceOp};
use podsim_topology::Pod;
use tokio::sync::Notify;

use super::TorchSpec;
use super::objects::{Board, EndsOnBoard};
use super::ranks::{Rank, RankLink, exited};
use super::wire::{Frame, Reply, Request};
use crate::error::ProgramError;

/// One collective as ranks are compared on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub fingerprint: Fingerprint,
    pub site: String,
}

impl Call {
    /// The `seq`-th collective of a rank (`None` for requests that are not collectives).
    pub fn of(request: &Request, site: Option<&str>, words: u64, seq: u64) -> Option<Call> {
        let (group, op, dtype, reduce) = match request {
            Request::AllReduce {
                group,
                reduce,
                dtype,
            } => (
                *group,
                OpKind::AllReduce,
                (*dtype).into(),
                Some(ReduceOp::from(*reduce)),
            ),
            Request::AllGather { group, dtype } => {
                (*group, OpKind::AllGather, (*dtype).into(), None)
            }
            Request::ReduceScatter {
                group,
                reduce,
                dtype,
            } => (
                *group,
                OpKind::ReduceScatter,
                (*dtype).into(),
                Some(ReduceOp::from(*reduce)),
            ),
            Request::Broadcast { group, dtype, .. } => {
                (*group, OpKind::Broadcast, (*dtype).into(), None)
            }
            Request::AllToAll { group, dtype } => (*group, OpKind::AllToAll, (*dtype).into(), None),
            Request::Barrier { group } => (*group, OpKind::Barrier, DType::F32, None),
            Request::Send { .. } | Request::Recv { .. } => {
                (u32::MAX, OpKind::SendRecv, DType::F32, None)
            }
            _ => return None,
        };
        Some(Call {
            fingerprint: Fingerprint {
                // A group by its index in the rank's program: ranks that create their groups
                // in the same order number them alike.
                group: u64::from(group),
                seq,
                op,
                dtype,
                count: words,
                reduce,
            },
            site: site.unwrap_or("an unknown line").to_string(),
        })
    }
}

/// The representative's collectives, in order, as its chip runs them.
#[derive(Debug, Default)]
pub struct Reference {
    calls: Mutex<Vec<Call>>,
    ended: Mutex<Option<Ended>>,
    changed: Notify,
}

/// How a representative's program ended, as its shadows learn it.
#[derive(Debug, Clone)]
pub struct Ended {
    /// Its last line or exit, said after "it".
    pub how: String,
    /// It failed: that failure is the job's error, which the representatives report.
    pub failed: bool,
}

impl Reference {
    pub fn push(&self, call: Call) {
        if let Ok(mut calls) = self.calls.lock() {
            calls.push(call);
        }
        self.changed.notify_waiters();
    }

    /// The representative's program ended (`how`: its last line or exit); the first ending
    /// told is kept.
    pub fn end(&self, how: String, failed: bool) {
        if let Ok(mut ended) = self.ended.lock() {
            ended.get_or_insert(Ended { how, failed });
        }
        self.changed.notify_waiters();
    }

    /// The representative's `seq`-th call, once it made it; `Err` with how it ended if it
    /// ended before.
    async fn call(&self, seq: usize) -> Result<Call, Ended> {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(call) = self.calls.lock().ok().and_then(|c| c.get(seq).cloned()) {
                return Ok(call);
            }
            if let Some(how) = self.ended.lock().ok().and_then(|e| e.clone()) {
                return Err(how);
            }
            notified.await;
        }
    }
}

/// What a shadow is served against: its representative's calls, and the job's object
/// broadcasts.
pub struct Shadow<'a> {
    pub representative: u32,
    pub reference: &'a Reference,
    pub board: &'a Board,
    /// Set when a group makes the job run again (see `serve::Context::quiet`).
    pub quiet: &'a AtomicBool,
}

/// Serves shadow rank `rank`: every request is answered at once (meta mode moves no values,
/// but an object broadcast's pickle), every collective compared with the representative's of
/// the same index. Ends when the rank exits; an error is the desync, or the rank's failure.
pub async fn serve_shadow(
    mut rank: Rank,
    spec: &TorchSpec,
    shadow: &Shadow<'_>,
    pod: &Pod,
) -> Result<(), ProgramError> {
    let Shadow {
        representative,
        reference,
        board,
        quiet,
    } = *shadow;
    let _board_ends = EndsOnBoard(board, rank.rank);
    let mut link = connected(&mut rank, spec).await?;
    let mut seq = 0usize;
    let mut said_bye = false;
    let mut raised = None;
    while let Some(next) = link.requests.recv().await {
        let (frame, values) = next.map_err(ProgramError::Invalid)?;
        let words = frame.request.words(frame.meta, values.len());
        match &frame.request {
            Request::Raised { error } => {
                raised = Some(super::ranks::raised(error, frame.site.as_deref()));
                continue; // no reply: its exit is reported below
            }
            Request::Bye { .. } => said_bye = true,
            _ => {}
        }
        if let Some(mine) = Call::of(&frame.request, frame.site.as_deref(), words, seq as u64) {
            let theirs = match reference.call(seq).await {
                Ok(theirs) => theirs,
                // The representative's failure ends the job and is its error; this shadow
                // only stopped with it.
                Err(ended) if ended.failed => return Ok(()),
                Err(ended) => {
                    return Err(ended_early(rank.rank, &mine, representative, &ended.how));
                }
            };
            if mine.fingerprint != theirs.fingerprint {
                return Err(desync(rank.rank, mine, representative, theirs));
            }
            seq += 1;
        }
        let answer = answer(&frame, values, rank.rank, spec, board, pod)
            .await
            .inspect_err(|e| {
                if e.is_regroup() {
                    quiet.store(true, Ordering::Relaxed);
                }
            })?;
        let _ = link.replies.send(answer).await;
    }
    if let Some(raised) = raised {
        // Its program failed: an error of the program, not a divergence from its class.
        let exit = exited(&mut rank.exit).await;
        let how = exit.map_or("closed its connection".into(), |e| e.to_string());
        return Err(shadow_exit(
            &rank,
            &format!("{}{raised}, and {how}", TorchSpec::RAISED),
        ));
    }
    if said_bye {
        // Every call the representative makes, the shadow must have made too.
        if let Ok(theirs) = reference.call(seq).await {
            return Err(desync_missing(rank.rank, seq, representative, theirs));
        }
    }
    match exited(&mut rank.exit).await {
        Some(e) if e.success() => Ok(()),
        other => Err(shadow_exit(
            &rank,
            &other.map_or("closed its connection".into(), |e| e.to_string()),
        )),
    }
}

/// A shadow's reply to `frame`: at once, with nothing but a group's verdict (judged as its
/// representative's is: it sees the translate) or an object broadcast's pickle.
async fn answer(
    frame: &Frame,
    values: Vec<f32>,
    rank: u32,
    spec: &TorchSpec,
    board: &Board,
    pod: &Pod,
) -> Result<(Reply, Option<Payload>), ProgramError> {
    let (error, payload) = match frame.request {
        Request::Group { ref ranks, .. } => {
            let site = frame.site.as_deref();
            let declared = super::groups::declare(pod, spec, rank, ranks, site, true)?;
            (declared.err(), None)
        }
        Request::PostObjects { key } => {
            board.post(rank, key, values);
            (None, None)
        }
        Request::FetchObjects { key, src } => {
            let words = board.fetch(src, key).await;
            (None, words.map(Payload::from_vec))
        }
        _ => (None, None),
    };
    let reply = Reply {
        error,
        clock_ns: 0.0,
    };
    Ok((reply, payload))
}

/// Shadow rank `rank`'s connection, once it has made its process group; the error when it
/// exits first (its program's failure when it exits with an error code) or takes longer than
/// the job's bound (then it is killed).
async fn connected(rank: &mut Rank, spec: &TorchSpec) -> Result<RankLink, ProgramError> {
    let bound = std::time::Duration::from_secs(spec.connect_timeout_s);
    let start = tokio::select! {
        link = &mut rank.link => Ok(link.ok()),
        exit = exited(&mut rank.exit) => Err(Some(exit)),
        () = tokio::time::sleep(bound) => Err(None),
    };
    match start {
        Ok(Some(link)) => Ok(link),
        Ok(None) => Err(shadow_exit(rank, "closed its connection to podsim")),
        // Its program failed before its first collective (an import, its arguments): the
        // program's error, as for a representative.
        Err(Some(Some(exit))) if exit.code.is_some_and(|c| c != 0) => {
            let how = format!("{}{exit}", TorchSpec::FAILED_BEFORE_CONNECTING);
            Err(shadow_exit(rank, &how))
        }
        Err(Some(exit)) => {
            let how = exit.map_or("exited".into(), |e| e.to_string());
            Err(shadow_exit(
                rank,
                &format!("{how} without connecting to podsim"),
            ))
        }
        Err(None) => {
            rank.group.kill();
            let how = format!(
                "{} {} s (job.connect_timeout_s) of its start; podsim killed it and its \
                 process group",
                TorchSpec::NOT_CONNECTED,
                spec.connect_timeout_s
            );
            Err(shadow_exit(rank, &how))
        }
    }
}

/// Said of a desync between a verified rank and its representative: the ranks were run as
/// alike, which a program whose ranks differ by design is not.
pub const RUN_EVERY_RANK: &str = " Meta mode ran one program for the ranks alike with its \
     representative and checked this rank against it: if the two run different code by design \
     (pipeline stages, a rank-dependent role), run every rank with --set job.symmetric=false.";

fn desync(rank: u32, mine: Call, representative: u32, theirs: Call) -> ProgramError {
    ProgramError::AtCallSites {
        error: Box::new(CollectiveError::Mismatch {
            chip: rank,
            mine: mine.fingerprint,
            peer: representative,
            theirs: theirs.fingerprint.to_string(),
        }),
        chip: rank,
        mine: mine.site,
        peer: representative,
        theirs: theirs.site,
        verified: true,
    }
}

/// The shadow ended its program where the representative went on to `theirs`.
fn desync_missing(rank: u32, seq: usize, representative: u32, theirs: Call) -> ProgramError {
    ProgramError::Invalid(format!(
        "desync: rank {rank} ended its program after {seq} collectives, where its \
         representative rank {representative} went on to {} at {}.{RUN_EVERY_RANK}",
        theirs.fingerprint, theirs.site
    ))
}

fn ended_early(rank: u32, mine: &Call, representative: u32, how: &str) -> ProgramError {
    ProgramError::Invalid(format!(
        "desync: rank {rank} called {} at {}, but its representative rank {representative} \
         made no such call: it {how}.{RUN_EVERY_RANK}",
        mine.fingerprint, mine.site
    ))
}

fn shadow_exit(rank: &Rank, how: &str) -> ProgramError {
    ProgramError::RankExited {
        chip: rank.rank,
        pid: rank.pid,
        how: how.to_string(),
        stderr_tail: rank
            .stderr_tail
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default(),
    }
}
