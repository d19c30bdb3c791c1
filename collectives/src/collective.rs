//! The collective operations a chip calls. Semantics (what each chip gets back):
//!
//! | op | input per chip | output |
//! |---|---|---|
//! | all-reduce | `C` | `C`, reduced over the group |
//! | reduce-scatter | `C` | block `r` of the reduced buffer, `torch.chunk` rules: blocks of `ceil(C/N)`, the last ones shorter or empty |
//! | all-gather | `C` | `N * C`, rank order |
//! | broadcast | `C` | the root's `C` values |
//! | all-to-all | `C`, cut into `N` `torch.chunk` blocks | block `r` of every rank, rank order |
//! | barrier | none | returns once every member has entered |
//!
//! Counts that do not divide by the group size are zero-padded to whole blocks (padding travels
//! and is charged to virtual time, as on real hardware) and cut off afterwards.

use podsim_topology::{Dir, Group};

use crate::algo::Algo;
use crate::algo::schedule::Schedule;
use crate::bits::{f32s_to_word, word_to_f32s};
use crate::chip::{Call, Chip, Nanos};
use crate::error::CollectiveError;
use crate::fabric::Tag;
use crate::fingerprint::{DType, Fingerprint, INSTANCE_SHIFT, OpKind};
use crate::payload::Payload;
use crate::reduce::ReduceOp;

/// Which chips take part, with which algorithm, on which element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Comm {
    pub group: Group,
    pub algo: Algo,
    pub dtype: DType,
    /// Debug mode: before each collective the members exchange fingerprints and a mismatch
    /// fails with both chips and both fingerprints named (data mode; in meta mode the fabric's
    /// per-message check is the only one). Costs one small all-gather per collective.
    #[serde(default)]
    pub verify: bool,
    /// Which of the communicators over the same chips this is: a PyTorch program may make
    /// several groups of the same ranks, and each keeps its own sequence of calls, as each
    /// NCCL communicator does (collectives on one never meet those on another).
    #[serde(default)]
    pub instance: u32,
}

/// The instances a key holds, between `INSTANCE_SHIFT` and the point-to-point channel bit.
const INSTANCE_MASK: u32 = (1 << (63 - INSTANCE_SHIFT)) - 1;

impl Comm {
    pub fn new(group: Group, algo: Algo) -> Comm {
        Comm {
            group,
            algo,
            dtype: DType::F32,
            verify: false,
            instance: 0,
        }
    }

    /// The key of this communicator's sequence of calls (its fingerprints' `group`): the
    /// group's id, and its instance when not the first over those chips.
    pub fn key(&self) -> u64 {
        self.group.id() | u64::from(self.instance & INSTANCE_MASK) << INSTANCE_SHIFT
    }

    /// How it is named in traces and diagnoses.
    fn label(&self) -> String {
        match self.instance {
            0 => self.group.to_string(),
            n => format!("{} (instance {n})", self.group),
        }
    }

    /// The same communicator with debug fingerprint checks on or off.
    pub fn verified(self, verify: bool) -> Comm {
        Comm { verify, ..self }
    }
}

/// Marks the group id of debug fingerprint exchanges, outside the range of real group masks,
/// so that the check never shares sequence numbers with the collectives it checks.
const VERIFY_GROUP_BIT: u64 = 1 << podsim_topology::Group::ID_BITS;

/// Real length of block `r` when `c` elements are cut into blocks of `l` (`torch.chunk`).
pub fn chunk_len(c: usize, l: usize, r: usize) -> usize {
    c.saturating_sub(r * l).min(l)
}

fn encode_fingerprint(fp: &Fingerprint) -> Vec<f32> {
    let mut out: Vec<f32> = [fp.group, fp.seq, fp.count]
        .into_iter()
        .flat_map(word_to_f32s)
        .collect();
    out.push(fp.op.code() as f32);
    out.push(fp.dtype.code() as f32);
    out.push(fp.reduce.map_or(0, ReduceOp::code) as f32);
    out
}

fn decode_fingerprint(v: &[f32]) -> Option<Fingerprint> {
    Some(Fingerprint {
        group: f32s_to_word(v.get(0..3)?),
        seq: f32s_to_word(v.get(3..6)?),
        count: f32s_to_word(v.get(6..9)?),
        op: OpKind::from_code(*v.get(9)? as u32)?,
        dtype: DType::from_code(*v.get(10)? as u32)?,
        reduce: match *v.get(11)? as u32 {
            0 => None,
            code => Some(ReduceOp::from_code(code)?),
        },
    })
}

impl Chip {
    /// Checks `input` and opens the next collective of `comm.group`: its fingerprint.
    async fn start(
        &mut self,
        comm: &Comm,
        op: OpKind,
        input: &Payload,
        reduce: Option<ReduceOp>,
    ) -> Result<Fingerprint, CollectiveError> {
        let fp = self
            .begin_on(
                comm.key(),
                || comm.label(),
                op,
                comm.dtype,
                input.len(),
                reduce,
            )
            .await;
        // Its launch and the group's synchronisation, before any data moves.
        let overhead = self.hardware().collective_overhead_ns;
        self.set_clock(self.clock() + overhead);
        self.set_verify(comm.verify);
        self.trace_note("algo", crate::trace::Arg::from(comm.algo.name()));
        if comm.verify && !input.is_meta() {
            self.verify_fingerprint(comm, fp).await?;
        }
        Ok(fp)
    }

    /// Debug mode: all-gathers every member's fingerprint of the collective about to run and
    /// fails on the first member whose fingerprint differs from this chip's.
    async fn verify_fingerprint(
        &mut self,
        comm: &Comm,
        fp: Fingerprint,
    ) -> Result<(), CollectiveError> {
        let mine = encode_fingerprint(&fp);
        let width = mine.len();
        let check = Fingerprint {
            group: fp.group | VERIFY_GROUP_BIT,
            seq: fp.seq,
            op: OpKind::AllGather,
            dtype: DType::F32,
            count: width as u64,
            reduce: None,
        };
        let call = Call::new(self, check);
        let sched = Schedule::new(&call, comm.group, comm.algo);
        let (all, t) = sched
            .all_gather(call, &Payload::from_vec(mine), width, 0, self.clock())
            .await?;
        self.set_clock(t);
        let all = all.to_vec().unwrap_or_default();
        let members = comm.group.members(self.pod(), self.id());
        for (rank, values) in all.chunks(width).enumerate() {
            let theirs = decode_fingerprint(values);
            if theirs != Some(fp) {
                return Err(CollectiveError::Mismatch {
                    chip: self.id(),
                    mine: fp,
                    peer: members.get(rank).copied().unwrap_or(u32::MAX),
                    theirs: theirs
                        .map_or_else(|| "an undecodable fingerprint".into(), |t| t.to_string()),
                });
            }
        }
        Ok(())
    }

    /// The reduce-scatter every reducing collective starts with: pads `input` to whole
    /// blocks and returns this chip's reduced block (divided for `avg`), the block length, the
    /// schedule and the clock after it.
    async fn reduce_own_block(
        &self,
        comm: &Comm,
        fp: Fingerprint,
        input: Payload,
        op: ReduceOp,
    ) -> Result<(Payload, usize, Schedule, Nanos), CollectiveError> {
        let call = Call::new(self, fp);
        let sched = Schedule::new(&call, comm.group, comm.algo);
        let n = sched.size();
        let c = input.len();
        let l = c.div_ceil(n);
        let padded = input.pad(n * l - c);
        let (mut own, t) = sched
            .reduce_scatter(call, &padded, l, op, 0, self.clock())
            .await?;
        if op == ReduceOp::Avg {
            own = own.divide(n as f32);
        }
        Ok((own, l, sched, t))
    }

    /// Reduce-scatter then all-gather of `input` under fingerprint `fp`.
    async fn reduce_then_gather(
        &mut self,
        comm: &Comm,
        fp: Fingerprint,
        input: Payload,
        op: ReduceOp,
    ) -> Result<Payload, CollectiveError> {
        let c = input.len();
        let (own, l, sched, t) = self.reduce_own_block(comm, fp, input, op).await?;
        let call = Call::new(self, fp);
        let (all, t) = sched.all_gather(call, &own, l, sched.phases(), t).await?;
        self.set_clock(t);
        self.finish();
        Ok(all.truncate(c))
    }

    /// Every chip gets the element-wise reduction of all members' inputs.
    pub async fn all_reduce(
        &mut self,
        comm: &Comm,
        input: &Payload,
        op: ReduceOp,
    ) -> Result<Payload, CollectiveError> {
        let fp = self.start(comm, OpKind::AllReduce, input, Some(op)).await?;
        self.reduce_then_gather(comm, fp, input.clone(), op).await
    }

    /// Chip of group rank `r` gets block `r` (`ceil(C/N)` elements, fewer at the end) of the
    /// element-wise reduction.
    pub async fn reduce_scatter(
        &mut self,
        comm: &Comm,
        input: &Payload,
        op: ReduceOp,
    ) -> Result<Payload, CollectiveError> {
        let fp = self
            .start(comm, OpKind::ReduceScatter, input, Some(op))
            .await?;
        let c = input.len();
        let (own, l, sched, t) = self.reduce_own_block(comm, fp, input.clone(), op).await?;
        let r = sched.rank();
        self.set_clock(t);
        self.finish();
        Ok(own.truncate(chunk_len(c, l, r)))
    }

    /// Every chip gets all members' inputs concatenated in group-rank order.
    pub async fn all_gather(
        &mut self,
        comm: &Comm,
        input: &Payload,
    ) -> Result<Payload, CollectiveError> {
        let fp = self.start(comm, OpKind::AllGather, input, None).await?;
        let call = Call::new(self, fp);
        let sched = Schedule::new(&call, comm.group, comm.algo);
        let (all, t) = sched
            .all_gather(call, input, input.len(), 0, self.clock())
            .await?;
        self.set_clock(t);
        self.finish();
        Ok(all)
    }

    /// Every chip gets the input of the member with group rank `root` (scatter, then
    /// all-gather: the root's blocks travel the reduce-scatter paths with nothing added).
    pub async fn broadcast(
        &mut self,
        comm: &Comm,
        input: &Payload,
        root: u32,
    ) -> Result<Payload, CollectiveError> {
        let n = comm.group.size(self.pod());
        if root >= n {
            return Err(CollectiveError::Invalid(format!(
                "broadcast root {root} is outside a group of {n} chips"
            )));
        }
        let fp = self.start(comm, OpKind::Broadcast, input, None).await?;
        let mine = comm.group.rank_of(self.pod(), self.id()) == root;
        let contribution = if mine {
            input.clone()
        } else {
            input.zeros_like(input.len())
        };
        self.reduce_then_gather(comm, fp, contribution, ReduceOp::Sum)
            .await
    }

    /// Block `j` of this chip's input goes to group rank `j`; every chip gets the block bound
    /// for it from each member, in source-rank order. Blocks travel hop by hop.
    pub async fn all_to_all(
        &mut self,
        comm: &Comm,
        input: &Payload,
    ) -> Result<Payload, CollectiveError> {
        let fp = self.start(comm, OpKind::AllToAll, input, None).await?;
        let call = Call::new(self, fp);
        let sched = Schedule::new(&call, comm.group, comm.algo);
        let (n, r) = (sched.size(), sched.rank());
        let c = input.len();
        let l = c.div_ceil(n);
        let padded = input.clone().pad(n * l - c);
        let (blocks, t) = sched.all_to_all(call, &padded, l, self.clock()).await?;
        self.set_clock(t);
        self.finish();
        let keep = chunk_len(c, l, r);
        let per_source = blocks.split_even(n);
        Ok(Payload::concat(
            per_source.into_iter().map(|b| b.truncate(keep)),
        ))
    }

    /// A barrier for harnesses (benchmark iterations, job scripts): returns once every member
    /// of `group` has entered, after at most three messages per chip. Tokens climb a spanning
    /// tree made of torus lines (along x to position 0, then along y among the chips at x = 0,
    /// and so on, DCN last) and a release comes back down the same way. On entering, a chip
    /// also tells each of its children that it entered: a child that runs a sequence number
    /// ahead of its group (it skipped a collective) finds that older message where it waits
    /// for its release and reports the desync, where it would otherwise wait for a parent
    /// that waits for it. The ring barrier sends hundreds of messages per chip on a large
    /// torus: at 100,000 chips it cost as much as a sixth of the collective being measured.
    /// Its virtual time models nothing in particular (harnesses put their clocks back). A chip
    /// on a mirror fabric, whose tree would have no root, takes the ring barrier on one ring
    /// lane per axis instead.
    pub async fn harness_barrier(&mut self, group: Group) -> Result<(), CollectiveError> {
        if self.mirrored() {
            return self.barrier(&Comm::new(group, Algo::Ring)).await;
        }
        let fp = self
            .begin(group, OpKind::Barrier, DType::F32, 0, None)
            .await;
        self.set_verify(false);
        let call = Call::new(self, fp);
        let axes = Schedule::new(&call, group, Algo::Ring).axes;
        // The axis on which this chip hangs from its parent: its first non-zero position.
        let level = axes.iter().position(|a| a.pos > 0);
        let lines = level.map_or(axes.len(), |l| l + 1);
        // Lanes of the three kinds of message.
        const ENTERED: u16 = 0;
        const TOKEN: u16 = 1;
        const RELEASE: u16 = 2;
        let tag = |lane: u16, axis: usize| Tag {
            lane,
            phase: axis as u16,
            step: 0,
        };
        let children = || {
            axes.iter()
                .enumerate()
                .take(lines)
                .filter(|(_, path)| path.pos + 1 < path.n)
        };
        let mut t = self.clock();
        for (a, path) in children() {
            let (towards_higher, _) = path.links(Dir::Plus);
            call.send(t, towards_higher, tag(ENTERED, a), Payload::Meta(0))
                .await?;
        }
        // Up: a token from the child on each line through this chip, then one to the parent.
        for (a, path) in axes.iter().enumerate().take(lines) {
            let (towards_lower, from_higher) = path.links(Dir::Minus);
            if path.pos + 1 < path.n {
                call.recv(&mut t, from_higher, tag(TOKEN, a)).await?;
            }
            if Some(a) == level {
                call.send(t, towards_lower, tag(TOKEN, a), Payload::Meta(0))
                    .await?;
            }
        }
        // Down: the parent's word that it entered and its release, then a release to each
        // child, last line first.
        if let Some(a) = level {
            let (_, from_lower) = axes[a].links(Dir::Plus);
            call.recv(&mut t, from_lower, tag(ENTERED, a)).await?;
            call.recv(&mut t, from_lower, tag(RELEASE, a)).await?;
        }
        let releases: Vec<usize> = children().map(|(a, _)| a).rev().collect();
        for a in releases {
            let (towards_higher, _) = axes[a].links(Dir::Plus);
            call.send(t, towards_higher, tag(RELEASE, a), Payload::Meta(0))
                .await?;
        }
        self.set_clock(t);
        self.finish();
        Ok(())
    }

    /// Returns once every member of the group has entered the barrier.
    pub async fn barrier(&mut self, comm: &Comm) -> Result<(), CollectiveError> {
        let n = comm.group.size(self.pod()) as usize;
        let fp = self
            .begin_on(
                comm.key(),
                || comm.label(),
                OpKind::Barrier,
                comm.dtype,
                0,
                None,
            )
            .await;
        self.set_verify(false);
        // One token per member, reduced and gathered: nobody leaves before everybody arrived.
        self.reduce_then_gather(comm, fp, Payload::Meta(n), ReduceOp::Sum)
            .await
            .map(|_| ())
    }
}
