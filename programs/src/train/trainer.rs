//! The training loop of one chip: forward, backward and optimizer step of the configured model
//! (the MLP or the transformer) under a strategy, with the collectives it needs, on the
//! compute stream and four others.
//!
//! Virtual time has a compute stream (the chip's clock, advanced by every kernel) and four
//! more (`Stream`): parameter gathers, gradient reductions, tensor-parallel activations and
//! the host link of offloaded activations. In `strict` and
//! `debug` mode every collective starts when the compute stream reaches it and compute
//! waits for it. In `fused` mode gradient reductions and FSDP gathers are issued on their
//! stream when their inputs are ready and compute goes on; compute waits only where it needs
//! the result (a gathered layer, the optimizer step). Links stay shared, so overlapped
//! traffic still contends, and so does HBM: a kernel charged while communication is in flight
//! streams its bytes beside it (`hbm_share`). A step's time splits into compute,
//! communication (the sum of its collectives' durations) and exposed communication (step time
//! minus compute: what overlap did not hide).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use podsim_collectives::bits::{fnv1a_f32, word_to_f32s};
use podsim_collectives::{Algo, Chip, Comm, DType, Nanos, Payload, ReduceOp, Symmetry};
use podsim_topology::{AxisPart, Group, Pod};
use serde::{Deserialize, Serialize};

use crate::error::ProgramError;
use crate::train::dtensor::{self, DTensor, Mesh, Placement};
use crate::train::hbm_share::HbmShare;
use crate::train::kernels::{Cost, Kernel};
use crate::train::memory::{Hbm, HbmReport, MemKind};
use crate::train::mlp::{self, Dataset};
use crate::train::model::{self, After, LayerKind, LayerSpec, ModelSpec};
use crate::train::optim::{OptimizerSpec, ParamState};
use crate::train::remat::{Keep, Name, Remat};
use crate::train::strategy::{Eager, Plan, Strategy, Style, buckets};
use crate::train::tensor::Tensor;
use crate::train::{checkpoint, reference};

/// A training job as every chip receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    pub strategy: Strategy,
    pub eager: Eager,
    pub model: ModelSpec,
    pub steps: u32,
    /// Samples per data-parallel rank per micro-batch (chips of one tensor-parallel group
    /// share theirs).
    pub batch: usize,
    /// Micro-batches per step; gradients sync only on the last (DDP's `no_sync`).
    pub grad_accum: u32,
    pub optimizer: OptimizerSpec,
    pub seed: u64,
    /// DDP bucket size after the first 1 MiB bucket.
    pub bucket_cap_mb: f64,
    /// FSDP: free gathered parameters after forward and gather them again for backward.
    pub reshard_after_forward: bool,
    /// Tensor-parallel degree (`fsdp+tp`).
    pub tp: u32,
    /// HSDP replicate degree.
    pub replicas: u32,
    pub algo: Algo,
    pub meta: bool,
    /// Compare the final parameters with single-chip training on the global batch.
    pub check: bool,
    /// Write a checkpoint every this many steps (0: never) under `checkpoint_dir`.
    #[serde(default)]
    pub checkpoint_every: u32,
    #[serde(default)]
    pub checkpoint_dir: Option<String>,
    /// Resume from the checkpoint written after this many steps.
    #[serde(default)]
    pub resume_from: Option<u32>,
    /// One chip stands for all (a mirror fabric): collectives with a root are not symmetric,
    /// so DDP's initial broadcast (which moves no values in meta mode) is left out.
    #[serde(default)]
    pub symmetric: bool,
    /// Activation rematerialisation policy.
    #[serde(default)]
    pub remat: Remat,
    /// How activations between tensor-parallel regions are laid out.
    #[serde(default)]
    pub tp_activations: TpActivations,
    /// When gradients are all-reduced across replicas (HSDP's replicate dimension).
    #[serde(default)]
    pub replica_sync: ReplicaSync,
    /// How a sharded strategy's gradients go into their reduce-scatters.
    #[serde(default)]
    pub grad_reduce: GradReduce,
    /// The dtype gradients are reduced in (FSDP2's `MixedPrecisionPolicy(reduce_dtype=...)`);
    /// none: the model's compute dtype, from the gradient buffers themselves.
    #[serde(default)]
    pub reduce_dtype: Option<DType>,
}

impl TrainSpec {
    /// How this job places its parameters on `pod`: the device mesh and each dimension's
    /// role (`checked`: replicated pieces are compared across their chips, debug mode).
    pub fn plan(&self, pod: &Pod, checked: bool) -> Result<Plan, ProgramError> {
        Plan::new(
            pod,
            self.strategy,
            &self.model.tp_styles(),
            self.tp,
            self.replicas,
            self.algo,
            checked,
        )
    }

    /// The parts of pod axes the job's device mesh lays its dimensions on (whole axes and,
    /// where the mesh does not factor the pod into whole axes, parts of them).
    pub fn mesh_parts(&self, pod: &Pod) -> Result<Vec<AxisPart>, ProgramError> {
        Ok(self
            .plan(pod, false)?
            .mesh
            .dims()
            .iter()
            .flat_map(|d| d.group.parts(pod))
            .collect())
    }

    /// The translations this job's mesh maps onto itself under ([`Symmetry::keeping`] its
    /// dimensions' parts).
    pub fn symmetry(&self, pod: &Pod) -> Symmetry {
        Symmetry::of_torus(pod).keeping(&self.mesh_parts(pod).unwrap_or_default(), pod)
    }
}

/// Activations between tensor-parallel regions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpActivations {
    /// Megatron: replicated; an all-reduce completes each row-parallel layer's output (and
    /// each column-parallel layer's input gradient).
    #[default]
    Replicated,
    /// Sharded on the feature (embedding) dimension: an all-gather before each parallel
    /// region and a reduce-scatter after it (and the reverse in backward); norms and residual
    /// adds run on a slice of the features.
    Sharded,
}

podsim_collectives::named_enum!(TpActivations, "tp_activations layout", {
    Replicated => "replicated",
    Sharded => "sharded",
});

/// When a sharded strategy's gradients are all-reduced across its replicas (the replicate
/// dimension of `hsdp` and of `fsdp+tp` with `replicas`, the DCN slices when there are any).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaSync {
    /// Each layer's reduce-scattered gradients right after its backward, overlapped with the
    /// layers still to run (PyTorch's HSDP).
    #[default]
    PerLayer,
    /// All layers' reduce-scattered gradients in one all-reduce once the backward is done,
    /// as XLA compiles a scanned layer loop: the all-reduce of gradients a loop only
    /// accumulates is sunk out of the loop (XLA's while-loop all-reduce code motion), so
    /// nothing is left to hide it and the optimizer waits for it.
    AfterBackward,
}

podsim_collectives::named_enum!(ReplicaSync, "replica sync", {
    PerLayer => "per_layer",
    AfterBackward => "after_backward",
});

/// How a sharded strategy (fsdp, hsdp, fsdp+tp) hands its gradients to the reduce-scatter, in
/// `fused` mode (`strict` and `debug` reduce each parameter's as written).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GradReduce {
    /// Each layer's gradients once its backward is done, reduced from the gradient buffers
    /// themselves (XLA: a weight's reduce-scatter follows the matmul that made its gradient).
    #[default]
    PerLayer,
    /// PyTorch FSDP2: once a unit's backward is done (a whole transformer block, or one layer
    /// outside blocks), its gradients are copied into one flat input in `reduce_dtype`, padded
    /// to the group, and freed; one reduce-scatter reduces the unit. The input stays allocated
    /// until the next unit's reduction is issued (FSDP2 keeps it until the next post-backward
    /// waits on the reduce-scatter).
    PerUnit,
}

podsim_collectives::named_enum!(GradReduce, "gradient reduction", {
    PerLayer => "per_layer",
    PerUnit => "per_unit",
});

/// DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`).
const FIRST_BUCKET_BYTES: u64 = 1 << 20;

/// One chip's account of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u32,
    /// The chip's virtual clock when the step began, ns.
    #[serde(default)]
    pub virtual_start_ns: f64,
    /// Mean loss of this chip's samples (none in meta mode).
    pub loss: Option<f64>,
    pub virtual_ns: f64,
    pub compute_ns: f64,
    pub comm_ns: f64,
    pub exposed_ns: f64,
    /// Of `compute_ns`, what kernels lost waiting for HBM that communication in flight took.
    #[serde(default)]
    pub hbm_wait_ns: f64,
    pub wall_ns: u64,
    /// Flops of every kernel the step charged (matrix products, element-wise work, the
    /// optimizer), on this chip.
    #[serde(default)]
    pub flops: f64,
    /// Activation bytes held in HBM for backward at the end of the last micro-batch's forward
    /// (what the remat policy keeps on the device).
    #[serde(default)]
    pub activations_bytes: u64,
    /// Bytes moved over the host link (offloaded activations, out and back).
    #[serde(default)]
    pub host_transfer_bytes: u64,
    /// Offloaded activation bytes held in host memory at the end of a forward, the most of
    /// the step's micro-batches (what the remat policy keeps off the device).
    #[serde(default)]
    pub host_activations_bytes: u64,
}

/// What one chip reports after training.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChipTrainReport {
    pub chip: u32,
    pub steps: Vec<StepRecord>,
    pub hbm: HbmReport,
    /// Every chip's final full parameters hash the same (data mode).
    pub replicas_identical: Option<bool>,
    /// Against single-chip training on the global batch (chip 0 only, when checked).
    pub max_abs_diff: Option<f64>,
    /// `max |a - b| / max |b|` over each parameter tensor, the largest.
    pub max_rel_diff: Option<f64>,
    /// The same measure between the single-chip run and one started a unit in the last place
    /// away (`reference::train_nudged`): how far rounding alone takes this run.
    #[serde(default)]
    pub rounding_spread: Option<f64>,
    /// FNV-1a of every final full parameter's f32 bits (data mode), to compare runs.
    #[serde(default)]
    pub params_hash: Option<String>,
    /// Checkpoints this chip could not write (each error names the file and why).
    #[serde(default)]
    pub checkpoint_failures: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Gather = 0,
    Reduce = 1,
    /// Tensor-parallel activations: on the critical path, never queued behind gradients.
    Tensor = 2,
    /// The host link: offloaded activations to host memory and back.
    Host = 3,
}

/// The clocks of a step (see the module docs).
#[derive(Debug, Default)]
struct Timeline {
    stream_free: [Nanos; 4],
    /// Bytes per element of the model's dtype (what kernels stream).
    elem_bytes: f64,
    compute_ns: f64,
    flops: f64,
    comm_ns: f64,
    /// When the last overlapped collective finishes.
    outstanding: Nanos,
    /// Activation bytes held at the end of the last forward.
    activations_bytes: u64,
    /// The most offloaded bytes held in host memory at the end of a forward.
    host_activations_bytes: u64,
    host_transfer_bytes: u64,
    /// Communication in flight, for the HBM bandwidth it takes from kernels.
    hbm: HbmShare,
}

/// A collective in flight on a stream: the compute clock when it was issued and its start.
struct Issued {
    issued_at: Nanos,
    start: Nanos,
    overlap: bool,
    stream: Stream,
    /// The chip's communication traffic through HBM before it began.
    hbm_traffic: u64,
}

impl Stream {
    /// The stream's track in a trace.
    fn track(self) -> &'static str {
        match self {
            Stream::Gather => "gather",
            Stream::Reduce => "reduce",
            Stream::Tensor => "tensor",
            Stream::Host => "host",
        }
    }
}

impl Timeline {
    /// Charges one kernel to the compute stream; a traced chip records it as a slice named by
    /// `what` (called only then), with the HBM in use (`hbm`) as a counter.
    fn compute(&mut self, chip: &mut Chip, cost: Cost, hbm: u64, what: impl FnOnce() -> String) {
        let start = chip.clock();
        let hw = chip.hardware();
        let ns = self.hbm.run_all(hw, start, cost.works(hw, self.elem_bytes));
        self.compute_ns += chip.compute(ns);
        self.flops += cost.flops();
        if chip.tracing() {
            chip.trace_span(
                crate::run::COMPUTE_TRACK,
                "kernel",
                start,
                chip.clock(),
                || {
                    (
                        what(),
                        vec![
                            ("flops".to_string(), cost.flops().into()),
                            ("kernels".to_string(), (cost.kernels.len() as u64).into()),
                        ],
                    )
                },
            );
            chip.trace_counter("HBM in use", hbm as f64);
        }
    }

    /// Moves `bytes` over the host link on its own stream, starting no earlier than
    /// `not_before`; returns when the transfer is done (compute goes on meanwhile).
    fn host_transfer(&mut self, chip: &Chip, bytes: u64, not_before: Nanos) -> Nanos {
        self.host_transfer_bytes += bytes;
        let stream = &mut self.stream_free[Stream::Host as usize];
        let start = stream.max(not_before);
        let done = start + bytes as f64 / chip.hardware().host_bandwidth * 1e9;
        *stream = done;
        self.hbm.communicating(start, done, bytes);
        chip.trace_span(Stream::Host.track(), "transfer", start, done, || {
            (
                "host transfer".to_string(),
                vec![("bytes".to_string(), bytes.into())],
            )
        });
        done
    }

    /// Moves the chip's clock to when `stream` can start a collective issued now.
    fn begin(&self, chip: &mut Chip, stream: Stream, overlap: bool) -> Issued {
        let issued_at = chip.clock();
        let start = issued_at.max(self.stream_free[stream as usize]);
        chip.set_clock(start);
        chip.set_trace_stream(stream.track());
        Issued {
            issued_at,
            start,
            overlap,
            stream,
            hbm_traffic: chip.stats().hbm_traffic(),
        }
    }

    /// Closes a collective: returns when its result is ready. Overlapped collectives put the
    /// clock back to the compute stream.
    fn end(&mut self, chip: &mut Chip, issued: Issued) -> Nanos {
        let done = chip.clock();
        chip.set_trace_stream(podsim_collectives::DEFAULT_STREAM);
        self.stream_free[issued.stream as usize] = done;
        self.comm_ns += done - issued.start;
        self.hbm
            .collective_ran(chip, issued.start, issued.hbm_traffic);
        if issued.overlap {
            chip.set_clock(issued.issued_at);
            self.outstanding = self.outstanding.max(done);
        }
        done
    }

    fn wait(chip: &mut Chip, ready: Nanos) {
        chip.set_clock(chip.clock().max(ready));
    }
}

struct Param {
    name: String,
    layer: usize,
    which: usize,
    stored: DTensor,
    /// Gradient accumulated over the step's micro-batches, in the compute layout.
    grad: Option<Tensor>,
    /// HBM charged for that gradient while it is unsharded (FSDP), freed once it is synced.
    unsharded_grad_bytes: u64,
    /// The synced gradient, in the stored layout: where the collective left it (pieces of
    /// its buffers), read in place by the optimizer.
    synced: Option<Payload>,
    state: ParamState,
}

/// A layer's unsharded working copy (FSDP) and when it is ready.
struct Working {
    tensors: [Tensor; 2],
    bytes: u64,
    ready: Nanos,
}

/// Elements of a chip's piece of a tensor of shape `full` under `placements`, padded as SPMD
/// programs pad an uneven split (XLA's sharding, FSDP2's sharded parameters): every piece as
/// large as the largest. Every chip of a shard group then holds the same bytes, so decisions
/// taken from the HBM ledger (a prefetch that waits for room) are the same on each of them and
/// their collectives stay in step.
fn padded_numel(full: &[usize], placements: &[Placement], mesh: &Mesh) -> u64 {
    let mut shape = full.to_vec();
    for (i, p) in placements.iter().enumerate() {
        if let Placement::Shard(d) = *p {
            shape[d] = shape[d].div_ceil(mesh.dims()[i].size);
        }
    }
    shape.iter().product::<usize>() as u64
}

/// Layer `l`'s weight and bias as the kernels use them: the gathered copy, or the chip's own.
fn working<'t>(working: &'t [Option<Working>], params: &'t [Param], l: usize) -> [&'t Tensor; 2] {
    match &working[l] {
        Some(w) => [&w.tensors[0], &w.tensors[1]],
        None => [
            params[2 * l].stored.local(),
            params[2 * l + 1].stored.local(),
        ],
    }
}

struct Trainer<'a> {
    spec: &'a TrainSpec,
    layers: Vec<LayerSpec>,
    /// Bytes per element of parameters, gradients and activations.
    elem: u64,
    plan: Plan,
    params: Vec<Param>,
    hbm: Hbm,
    tl: Timeline,
    data: Option<Dataset>,
    dp: (usize, usize),
    buckets: Vec<Vec<usize>>,
    next_bucket: usize,
    /// Reduce-scattered gradients (parameter index, piece) waiting for the replicas'
    /// all-reduce after the backward (`ReplicaSync::AfterBackward`).
    unsynced: Vec<(usize, DTensor)>,
    working: Vec<Option<Working>>,
    /// The working copy differs from the stored piece (a data-parallel dimension shards).
    sharded: bool,
    /// What each layer keeps for backward and what backward must recompute.
    keeps: Vec<LayerKeep>,
    /// Activation bytes each layer holds in HBM until its backward (kept or recomputed).
    held: Vec<u64>,
    /// Per rematerialisation block: when its offloaded activations are back in HBM.
    host_ready: Vec<Option<Nanos>>,
    /// Offloaded activation bytes of each block (this micro-batch).
    host_bytes: Vec<u64>,
    /// A layer's input gathered over tensor parallelism during backward, and when it is
    /// ready: gathered ahead for its recomputation, or by it, and held until the layer's
    /// backward reads it (the backward's residual is that very tensor: nothing gathers it
    /// twice).
    regathered: Vec<Option<(Tensor, Nanos)>>,
    /// HBM of the last flat reduce-scatter input FSDP2's copy-in allocated, still held.
    reduce_input: u64,
}

/// What one layer keeps between forward and backward under the job's remat policy, for a
/// micro-batch on this chip.
#[derive(Debug, Clone, Default)]
struct LayerKeep {
    /// Bytes kept in HBM.
    device: u64,
    /// Bytes kept in host memory.
    offload: u64,
    /// The op-after's output is kept (else it is recomputed before the block's backward).
    output: bool,
    /// Fraction of the matmul's output columns backward recomputes.
    recompute_matmul: f64,
    /// The op-after runs again in backward.
    recompute_after: bool,
}

impl LayerKeep {
    fn recomputes(&self) -> bool {
        self.recompute_matmul > 0.0 || self.recompute_after
    }
}

/// Bytes of the named parts `names` (global widths) on `rows` rows at `share` of the width,
/// split into those kept on the device and offloaded; and whether every part is kept.
fn named_bytes(
    remat: &Remat,
    names: &[(Name, usize)],
    rows: usize,
    share: f64,
    elem: u64,
) -> (u64, u64, f64) {
    let (mut device, mut offload, mut lost, mut all) = (0u64, 0u64, 0usize, 0usize);
    for &(name, width) in names {
        let bytes = (rows as f64 * width as f64 * share).round() as u64 * elem;
        all += width;
        match remat.keep(name) {
            Some(Keep::Device) => device += bytes,
            Some(Keep::Offload) => offload += bytes,
            None => lost += width,
        }
    }
    let lost_fraction = if all == 0 {
        0.0
    } else {
        lost as f64 / all as f64
    };
    (device, offload, lost_fraction)
}

/// What an optimizer update reads and writes per parameter, in arrays of the compute type
/// (`elem` bytes an element), for weights and optimizer state of `weight` bytes and `state`
/// state tensors: it reads the gradient (reduced in the compute type), the weight and the
/// state, and writes the weight and the state back; weights wider than the compute type are
/// a master copy, and the working copy is written from it too.
fn update_traffic(elem: u64, weight: u64, state: usize) -> (f64, f64) {
    let held = optimizer_held_bytes(elem, weight, state);
    // The weight the update changes: the working copy itself, or the master copy (held) and
    // the working copy written from it.
    let (weight_read, weight_written) = if weight > elem {
        (0, elem)
    } else {
        (weight, weight)
    };
    let arrays = |bytes: u64| bytes as f64 / elem as f64;
    (
        arrays(elem + held + weight_read),
        arrays(held + weight_written),
    )
}

/// Bytes per parameter the optimizer keeps beside the working weights (compute type, `elem`
/// bytes): `state` tensors in the weights' type (`weight` bytes), and a master copy when the
/// weights are wider than the compute type (mixed precision).
fn optimizer_held_bytes(elem: u64, weight: u64, state: usize) -> u64 {
    weight * state as u64 + if weight > elem { weight } else { 0 }
}

/// `cost` cut to `fraction` of its work (a partial recompute): matmuls to that share of
/// their output columns, element-wise passes (their bias adds) to that share of elements.
fn matmul_share(cost: Cost, fraction: f64) -> Cost {
    let kernels = cost
        .kernels
        .into_iter()
        .filter_map(|k| match k {
            // Nothing of it runs again: no kernel, no fixed cost.
            Kernel::Matmul { .. } | Kernel::Elementwise { .. } if fraction <= 0.0 => None,
            Kernel::Matmul { m, k, n } => Some(Kernel::Matmul {
                m,
                k,
                n: ((n as f64 * fraction).ceil() as usize).max(1),
            }),
            Kernel::Elementwise {
                elems,
                flops_per,
                reads,
                writes,
            } => Some(Kernel::Elementwise {
                elems: (elems as f64 * fraction).ceil() as usize,
                flops_per,
                reads,
                writes,
            }),
            other => Some(other),
        })
        .collect();
    Cost { kernels }
}

/// How a layer's forward is charged: in full, or as backward's recomputation of part of it.
#[derive(Debug, Clone, Copy)]
enum Pass {
    Forward,
    Recompute { matmul: f64, after: bool },
}

impl Pass {
    fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Recompute { .. } => "recompute",
        }
    }
}

/// Trains on one chip; `done` counts finished steps.
pub async fn train_chip(
    chip: &mut Chip,
    spec: &TrainSpec,
    done: Arc<AtomicU64>,
) -> Result<ChipTrainReport, ProgramError> {
    Ok(train_chip_with_parameters(chip, spec, done).await?.0)
}

/// [`train_chip`], also returning the final parameters, whole (weight and bias of each layer).
pub async fn train_chip_with_parameters(
    chip: &mut Chip,
    spec: &TrainSpec,
    done: Arc<AtomicU64>,
) -> Result<(ChipTrainReport, Vec<Tensor>), ProgramError> {
    let setup = chip.trace_open(
        crate::run::STEPS_TRACK,
        "step",
        || "setup".to_string(),
        Vec::new(),
    );
    let mut t = Trainer::new(chip, spec).await?;
    chip.trace_close(setup);
    let dir = spec.checkpoint_dir.as_deref().map(std::path::Path::new);
    let job = checkpoint::job_fingerprint(spec, chip.pod());
    let mut checkpoint_failures = Vec::new();
    let first = match (spec.resume_from, dir) {
        (Some(step), Some(dir)) if !spec.meta => {
            t.restore(&checkpoint::read(dir, step, chip.id(), &job)?)?;
            done.fetch_add(u64::from(step), Ordering::Relaxed);
            step
        }
        _ => 0,
    };
    let mut steps = Vec::with_capacity(spec.steps as usize);
    for step in first..spec.steps {
        chip.enter_step(u64::from(step)).await;
        steps.push(t.step(chip, step).await?);
        done.fetch_add(1, Ordering::Relaxed);
        let finished = step + 1;
        if let Some(dir) = dir
            && spec.checkpoint_every > 0
            && finished % spec.checkpoint_every == 0
            && !spec.meta
        {
            // A checkpoint that cannot be written (a full disk) does not end the job: the
            // older ones still stand to resume from, and the report says which step has none.
            if let Err(e) = checkpoint::write(dir, finished, chip.id(), &job, &t.save()) {
                eprintln!("podsim: chip {}: {e}; training goes on", chip.id());
                checkpoint_failures.push(e.to_string());
            }
        }
    }
    // Verification below is not part of the modelled job: it costs no virtual time.
    let time = chip.time_snapshot();
    let trace = chip.pause_trace();
    let full = t.full_parameters(chip).await?;
    let replicas_identical = if spec.meta {
        None
    } else {
        Some(identical_everywhere(chip, spec.algo, &full).await?)
    };
    let (max_abs_diff, max_rel_diff, rounding_spread) =
        if spec.check && !spec.meta && chip.id() == 0 {
            let (abs, rel, spread) = against_reference(spec, t.dp.0, &full)?;
            (Some(abs), Some(rel), Some(spread))
        } else {
            (None, None, None)
        };
    chip.restore_time(time);
    chip.resume_trace(trace);
    let params_hash = (!spec.meta).then(|| {
        let h = full
            .iter()
            .fold(0u64, |acc, t| acc.rotate_left(5) ^ bits_hash(t));
        format!("{h:016x}")
    });
    let report = ChipTrainReport {
        chip: chip.id(),
        steps,
        hbm: t.hbm.report(),
        replicas_identical,
        max_abs_diff,
        max_rel_diff,
        rounding_spread,
        params_hash,
        checkpoint_failures,
    };
    Ok((report, full))
}

/// `full` against single-chip training on the global batch: the largest absolute and
/// relative differences, and how far rounding alone moves the reference (the same from
/// nudged initial parameters).
fn against_reference(
    spec: &TrainSpec,
    data_parallel: usize,
    full: &[Tensor],
) -> Result<(f64, f64, f64), ProgramError> {
    let reference = reference::train(spec, data_parallel)?;
    let (abs, rel) = reference::compare(full, &reference);
    let nudged = reference::train_nudged(spec, data_parallel)?;
    let (_, spread) = reference::compare(&nudged, &reference);
    Ok((abs, rel, spread))
}

fn missing(l: usize) -> ProgramError {
    ProgramError::Internal(format!("the activations before layer {l} are gone"))
}

fn bits_hash(t: &Tensor) -> u64 {
    fnv1a_f32(t.values().into_iter().flat_map(|a| a.iter().copied()))
}

/// All-gathers `hashes` over `group`; returns the first member whose hashes differ from
/// this chip's, with the index of the first differing entry.
async fn first_mismatch(
    chip: &mut Chip,
    comm: &Comm,
    hashes: &[u64],
) -> Result<Option<(u32, usize)>, ProgramError> {
    let mine: Vec<f32> = hashes.iter().flat_map(|h| word_to_f32s(*h)).collect();
    let width = mine.len();
    let all = chip
        .all_gather(comm, &Payload::from_vec(mine.clone()))
        .await?;
    let all = all.to_vec().unwrap_or_default();
    let members = comm.group.members(chip.pod(), chip.id());
    for (rank, theirs) in all.chunks(width.max(1)).enumerate() {
        if let Some(k) = theirs
            .chunks(3)
            .zip(mine.chunks(3))
            .position(|(a, b)| a != b)
        {
            return Ok(Some((members.get(rank).copied().unwrap_or(u32::MAX), k)));
        }
    }
    Ok(None)
}

async fn identical_everywhere(
    chip: &mut Chip,
    algo: Algo,
    full: &[Tensor],
) -> Result<bool, ProgramError> {
    let world = Comm::new(Group::world(chip.pod()), algo);
    let hashes: Vec<u64> = full.iter().map(bits_hash).collect();
    Ok(first_mismatch(chip, &world, &hashes).await?.is_none())
}

/// Every layer's parameters as this chip stores them (its shards), each charged to HBM with
/// its gradient and optimizer state. The optimizer state is kept in the weights' type;
/// weights wider than the compute type are mixed precision, with a master copy beside the
/// working one. Gradients are charged at the compute type: they are reduced in it and cast
/// into the update. `stream` is the random stream the initial weights are drawn from.
fn init_params(
    chip: &Chip,
    spec: &TrainSpec,
    plan: &Plan,
    lowered: &[LayerSpec],
    hbm: &mut Hbm,
    stream: u64,
) -> Result<Vec<Param>, ProgramError> {
    let elem = spec.model.dtype().size() as u64;
    let weight = spec.model.weight_dtype().size() as u64;
    let state_bytes = optimizer_held_bytes(elem, weight, spec.optimizer.state_per_param());
    let mut params = Vec::with_capacity(2 * lowered.len());
    for (l, layer) in lowered.iter().enumerate() {
        let full = match spec.model.mlp() {
            Some(mlp) => mlp.init_layer(l, spec.seed, stream, spec.meta),
            None => layer.meta_params(),
        };
        for (which, full) in full.iter().enumerate() {
            let placements = plan.stored(l, which);
            let stored = DTensor::distribute(chip, &plan.mesh, full, &placements)?;
            let numel = padded_numel(full.shape(), &placements, &plan.mesh);
            let bytes = numel * elem;
            let name = format!("{}.{}", layer.name, ["weight", "bias"][which]);
            hbm.alloc(MemKind::Params, bytes, || format!("parameter {name}"))?;
            hbm.alloc(MemKind::Grads, bytes, || format!("gradient of {name}"))?;
            hbm.alloc(MemKind::Optimizer, numel * state_bytes, || {
                format!("optimizer state of {name}")
            })?;
            params.push(Param {
                name,
                layer: l,
                which,
                stored,
                grad: None,
                unsharded_grad_bytes: 0,
                synced: None,
                state: ParamState::new(),
            });
        }
    }
    Ok(params)
}

impl<'a> Trainer<'a> {
    async fn new(chip: &mut Chip, spec: &'a TrainSpec) -> Result<Trainer<'a>, ProgramError> {
        let lowered = spec.model.lower();
        let layers = lowered.len();
        let dtype = spec.model.dtype();
        let elem = dtype.size() as u64;
        let mut plan = spec.plan(chip.pod(), spec.eager == Eager::Debug)?;
        plan.mesh = plan.mesh.with_dtype(dtype);
        let coords = plan.mesh.coords(chip);
        let dp = plan.data_parallel(&coords);
        // Meta mode predicts: a model that does not fit gets a verdict, not an abort.
        let mut hbm = Hbm::new(chip.id(), chip.hardware().hbm_bytes as u64).lenient(spec.meta);
        // DDP: every rank draws its own initial weights and rank 0's are broadcast, as
        // DistributedDataParallel does at construction. Other strategies start from one seed.
        let stream = if spec.strategy == Strategy::Ddp {
            dp.1 as u64
        } else {
            0
        };
        let params = init_params(chip, spec, &plan, &lowered, &mut hbm, stream)?;
        let param_bytes: Vec<u64> = params
            .iter()
            .map(|p| p.stored.local().bytes(elem))
            .collect();
        let cap = (spec.bucket_cap_mb * (1u64 << 20) as f64) as u64;
        let data = match (spec.meta, spec.model.mlp()) {
            (true, _) => None,
            (false, Some(mlp)) => Some(Dataset::new(mlp, spec.seed)),
            (false, None) => {
                return Err(ProgramError::Invalid(
                    "a transformer model runs in meta mode only".into(),
                ));
            }
        };
        let mut t = Trainer {
            spec,
            layers: lowered,
            elem,
            sharded: plan.shard_dim().is_some(),
            plan,
            params,
            hbm,
            tl: Timeline::default(),
            data,
            dp,
            buckets: buckets(&param_bytes, FIRST_BUCKET_BYTES, cap),
            next_bucket: 0,
            unsynced: Vec::new(),
            working: (0..layers).map(|_| None).collect(),
            keeps: vec![LayerKeep::default(); layers],
            held: vec![0; layers],
            host_ready: Vec::new(),
            host_bytes: Vec::new(),
            regathered: (0..layers).map(|_| None).collect(),
            reduce_input: 0,
        };
        if spec.strategy == Strategy::Ddp && !spec.symmetric {
            t.broadcast_parameters(chip).await?;
        }
        Ok(t)
    }

    /// Rank 0's parameters to every data-parallel replica (one coalesced broadcast).
    async fn broadcast_parameters(&mut self, chip: &mut Chip) -> Result<(), ProgramError> {
        let Some(dim) = self.plan.replicate_dim() else {
            return Ok(());
        };
        let all = Payload::concat(self.params.iter().map(|p| p.stored.local().to_payload()));
        let out = chip.broadcast(&self.plan.mesh.comm(dim), &all, 0).await?;
        let mut offset = 0;
        for p in &mut self.params {
            let shape = p.stored.local().shape().to_vec();
            let n = p.stored.local().numel();
            *p.stored.local_mut() = Tensor::from_payload(out.slice(offset, n), &shape)?;
            offset += n;
        }
        Ok(())
    }

    fn overlapped(&self) -> bool {
        self.spec.eager == Eager::Fused
    }

    async fn step(&mut self, chip: &mut Chip, step: u32) -> Result<StepRecord, ProgramError> {
        let wall = Instant::now();
        let t0 = chip.clock();
        // Opened now so that a step that never ends shows unfinished.
        let span = chip.trace_open(
            crate::run::STEPS_TRACK,
            "step",
            || format!("step {step}"),
            Vec::new(),
        );
        self.tl = Timeline {
            stream_free: [t0; 4],
            elem_bytes: self.elem as f64,
            ..Timeline::default()
        };
        let k = self.spec.grad_accum.max(1);
        let mut loss = Some(0.0);
        for micro in 0..k {
            let start = ((u64::from(step) * u64::from(k) + u64::from(micro)) * self.dp.0 as u64
                + self.dp.1 as u64)
                * self.spec.batch as u64;
            let (x, labels) = match &self.data {
                Some(d) => {
                    let (x, labels) = d.batch(start, self.spec.batch);
                    (Tensor::Data(x.into_dyn()), labels)
                }
                None => (
                    Tensor::Meta(self.spec.model.input_shape(self.spec.batch)),
                    Vec::new(),
                ),
            };
            let micro_loss = self
                .forward_backward(chip, x, &labels, k, micro + 1 == k)
                .await?;
            loss = loss.zip(micro_loss).map(|(a, b)| a + b / f64::from(k));
        }
        Timeline::wait(chip, self.tl.outstanding);
        self.optimizer_step(chip)?;
        if self.spec.eager == Eager::Debug && !self.spec.meta {
            self.check_replicas(chip, step).await?;
        }
        let virtual_ns = chip.clock() - t0;
        chip.trace_close(span);
        Ok(StepRecord {
            step,
            virtual_start_ns: t0,
            loss,
            virtual_ns,
            compute_ns: self.tl.compute_ns,
            comm_ns: self.tl.comm_ns,
            exposed_ns: (virtual_ns - self.tl.compute_ns).max(0.0),
            hbm_wait_ns: self.tl.hbm.waited_ns(),
            wall_ns: wall.elapsed().as_nanos() as u64,
            flops: self.tl.flops,
            activations_bytes: self.tl.activations_bytes,
            host_transfer_bytes: self.tl.host_transfer_bytes,
            host_activations_bytes: self.tl.host_activations_bytes,
        })
    }

    /// One micro-batch: forward, loss, backward; gradients sync when `sync`.
    async fn forward_backward(
        &mut self,
        chip: &mut Chip,
        x: Tensor,
        labels: &[usize],
        micro_batches: u32,
        sync: bool,
    ) -> Result<Option<f64>, ProgramError> {
        let layers = self.layers.len();
        let elem = self.elem;
        let blocks = self
            .layers
            .iter()
            .filter_map(|l| l.block)
            .max()
            .map_or(0, |b| b + 1);
        self.host_ready = vec![None; blocks];
        self.host_bytes = vec![0; blocks];
        let x_bytes = x.bytes(elem);
        self.hbm
            .alloc(MemKind::Activations, x_bytes, || "the input batch".into())?;
        let mut acts: Vec<Option<Tensor>> = vec![Some(x)];
        for l in 0..layers {
            self.unshard(chip, l).await?;
            if self.overlapped() {
                let unit = self.unit(l);
                if unit.end < layers {
                    // This unit's layers still to run keep their activations, and those not
                    // gathered yet are gathered on demand, one at a time.
                    let rows = acts[l].as_ref().map_or(0, |x| x.shape()[0]);
                    let kept: u64 = (l..unit.end)
                        .map(|m| self.kept_at_most(chip, m, rows))
                        .sum();
                    let gathered = (l + 1..unit.end)
                        .map(|m| self.on_demand_bytes(chip, m))
                        .max()
                        .unwrap_or(0);
                    let reserve = kept + gathered;
                    self.prefetch_ahead(chip, unit.end, reserve).await?;
                }
            }
            let x = acts[l].take().ok_or_else(|| missing(l))?;
            let (z, matmul_width, _) = self.layer_forward(chip, l, &x, Pass::Forward).await?;
            let keep = self.keep_of(l, &z, matmul_width);
            self.hbm.alloc(MemKind::Activations, keep.device, || {
                format!("activations of layer {l}")
            })?;
            self.held[l] = keep.device;
            if keep.offload > 0
                && let Some(b) = self.layers[l].block
            {
                // Copied to host as soon as the layer has produced it, beside compute.
                self.tl.host_transfer(chip, keep.offload, chip.clock());
                self.host_bytes[b] += keep.offload;
            }
            // The layer's input is dropped when its producer's output is not kept (backward
            // recomputes it); the data are really gone.
            let input_kept = l == 0 || self.keeps[l - 1].output;
            acts[l] = input_kept.then_some(x);
            self.keeps[l] = keep;
            acts.push(Some(z));
            if self.spec.reshard_after_forward && !self.root_keeps(l) {
                self.release(l);
            }
        }
        self.tl.activations_bytes = x_bytes + self.held.iter().sum::<u64>();
        let offloaded = self.host_bytes.iter().sum::<u64>();
        self.tl.host_activations_bytes = self.tl.host_activations_bytes.max(offloaded);
        chip.recorder().compute_started();
        let logits = acts[layers].as_ref().ok_or_else(|| missing(layers))?;
        let (loss, dz, cost) = mlp::cross_entropy(logits, labels, 1.0 / micro_batches as f32)?;
        self.tl
            .compute(chip, cost, self.hbm.in_use(), || "loss".to_string());
        self.backward(chip, dz, acts, sync).await?;
        Ok(loss)
    }

    /// Backward of every layer, last first, from the loss's gradient `dz`; `acts` holds what
    /// forward kept. The activation gradient flowing down is live HBM beside what it is
    /// computed from (the one before it, the layer's saved input), as on the hardware.
    async fn backward(
        &mut self,
        chip: &mut Chip,
        mut dz: Tensor,
        mut acts: Vec<Option<Tensor>>,
        sync: bool,
    ) -> Result<(), ProgramError> {
        let layers = self.layers.len();
        let mut flowing = 0;
        self.flow(&mut flowing, dz.bytes(self.elem), layers)?;
        for l in (0..layers).rev() {
            self.after_backward(chip, l, &mut dz, &acts)?;
            if !matches!(self.layers[l].after, After::None) {
                // The op after the layer writes its input's gradient anew.
                self.flow(&mut flowing, dz.bytes(self.elem), l)?;
            }
            let mut dz_ready = None;
            if let Some(b) = self.layers[l].block
                && self.layers.get(l + 1).and_then(|n| n.block) != Some(b)
            {
                if self.gathers_output_grad(l) && self.overlapped() {
                    // The block's output gradient does not depend on its recomputation:
                    // gathered beside it.
                    let (whole, ready) = self
                        .tp_gather(chip, dz, self.layers[l].outputs, true)
                        .await?;
                    (dz, dz_ready) = (whole, Some(ready));
                }
                self.rematerialise(chip, b, l, &mut acts).await?;
                if self.overlapped() {
                    self.gather_ahead_for_recompute(chip, b, &acts).await?;
                }
            }
            self.unshard(chip, l).await?;
            let unit = self.unit(l);
            if self.overlapped() && unit.start > 0 && self.spec.reshard_after_forward {
                let reserve = self.backward_reserve(chip, l);
                self.prefetch_ahead(chip, unit.start - 1, reserve).await?;
            }
            let x = acts[l].take().ok_or_else(|| missing(l))?;
            let dx = self.layer_backward(chip, l, &x, dz, dz_ready).await?;
            acts[l] = Some(x);
            acts.pop();
            self.hbm.free(MemKind::Activations, self.held[l]);
            self.held[l] = 0;
            self.release(l);
            if sync && let Some(reduced) = self.reduced_after(l) {
                self.sync_layers(chip, reduced).await?;
            }
            dz = match dx {
                Some(dx) => dx,
                None => Tensor::Meta(Vec::new()),
            };
            self.flow(&mut flowing, dz.bytes(self.elem), l)?;
        }
        self.hbm.free(MemKind::Transient, flowing);
        self.hbm
            .free(MemKind::Transient, std::mem::take(&mut self.reduce_input));
        let freed = acts.pop().flatten().map_or(0, |a| a.bytes(self.elem));
        self.hbm.free(MemKind::Activations, freed);
        if sync {
            self.sync_replicas(chip).await?;
        }
        Ok(())
    }

    /// The activation gradient now `bytes` (of layer `l`'s backward) replaces the one held in
    /// `flowing`: both are live while the new one is made.
    fn flow(&mut self, flowing: &mut u64, bytes: u64, l: usize) -> Result<(), ProgramError> {
        self.hbm.alloc(MemKind::Transient, bytes, || {
            format!("activation gradient of layer {l}")
        })?;
        self.hbm.free(MemKind::Transient, *flowing);
        *flowing = bytes;
        Ok(())
    }

    /// Backward of the parameter-free op after layer `l`, on its output gradient `dz`.
    fn after_backward(
        &mut self,
        chip: &mut Chip,
        l: usize,
        dz: &mut Tensor,
        acts: &[Option<Tensor>],
    ) -> Result<(), ProgramError> {
        let cost = match self.layers[l].after {
            After::None => Cost::default(),
            After::Relu => {
                let out = acts[l + 1].as_ref().ok_or_else(|| missing(l + 1))?;
                mlp::relu_backward(dz, out)
            }
            after => {
                // Residual + norm keeps the width (sharded or not); the others widen back
                // to the matmul's output on this chip.
                let width = match after {
                    After::ResidualNorm => dz.shape()[1],
                    _ => self.compute_shape(chip, l, 0)[0],
                };
                // What forward kept decides it: an op run again held its probabilities anew.
                let p_kept = !self.keeps[l].recompute_after;
                let scratch = model::after_workspace_elems(
                    &self.layers[l],
                    dz.shape()[0],
                    width,
                    true,
                    p_kept,
                );
                self.workspace(l, scratch)?;
                model::after_backward(&self.layers[l], dz, width)
            }
        };
        self.tl.compute(chip, cost, self.hbm.in_use(), || {
            format!("{} backward (op after)", self.layers[l].name)
        });
        Ok(())
    }

    /// Before block `b`'s backward: gathers the input of block `b - 1`'s first layer when
    /// its recomputation will need it gathered, on the tensor stream beside block `b`'s
    /// backward (the input is kept, so nothing it waits for is left), as XLA's scheduler
    /// starts an asynchronous all-gather as soon as its operand exists.
    async fn gather_ahead_for_recompute(
        &mut self,
        chip: &mut Chip,
        b: usize,
        acts: &[Option<Tensor>],
    ) -> Result<(), ProgramError> {
        let Some(first) = (0..self.layers.len()).find(|&m| self.layers[m].block == Some(b)) else {
            return Ok(());
        };
        let Some(prev_last) = first.checked_sub(1) else {
            return Ok(());
        };
        let start = self.unit(prev_last).start;
        if self.layers[prev_last].block.is_none()
            || !self.keeps[start].recomputes()
            || !self.gathers_input(start)
            || self.regathered[start].is_some()
        {
            return Ok(());
        }
        let Some(x) = acts[start].clone() else {
            return Ok(());
        };
        let (g, ready) = self
            .tp_gather(chip, x, self.layers[start].inputs, true)
            .await?;
        self.hold_gathered(start, g, ready)
    }

    /// What layer `l`'s backward reads of what its forward made (`z`, from `matmul_width` of
    /// the matmul's columns on this chip): its output, the op-after's input where that op's
    /// backward needs it (attention's q, k, v; an activation's gate and up projections), and
    /// the residual. A policy that keeps everything keeps all of it; a recomputed layer holds
    /// it again from its recomputation to its backward.
    fn backward_reads(&self, l: usize, z: &Tensor, matmul_width: usize) -> u64 {
        let layer = &self.layers[l];
        let rows = z.shape()[0];
        let matmul_bytes = (rows * matmul_width) as u64 * self.elem;
        let op_input = match layer.after {
            After::Attention(_) | After::Activation(_) | After::ParallelCore { .. } => matmul_bytes,
            _ => 0,
        };
        let share = matmul_width as f64 / layer.outputs.max(1) as f64;
        let residual = model::after_residual_elems(layer, rows, share) as u64 * self.elem;
        let upcast = model::upcast_elems(layer, rows, z.shape()[1]) as u64 * 4;
        z.bytes(self.elem) + op_input + residual + upcast
    }

    /// What layer `l` keeps for backward, given its output `z` (on this chip) and the width of
    /// its matmul's output here.
    fn keep_of(&self, l: usize, z: &Tensor, matmul_width: usize) -> LayerKeep {
        let layer = &self.layers[l];
        let rows = z.shape()[0];
        let remat = &self.spec.remat;
        let share = matmul_width as f64 / layer.outputs.max(1) as f64;
        if remat.everything || layer.block.is_none() {
            return LayerKeep {
                device: self.backward_reads(l, z, matmul_width),
                output: true,
                ..LayerKeep::default()
            };
        }
        // The block's last matmul only feeds the residual sum that leaves the block (kept as
        // the next block's input): backward never reads it, so whatever the policy names,
        // nothing keeps it and nothing runs it again (XLA drops a recomputation whose result
        // nothing reads).
        let (d1, o1, recompute_matmul) = if layer.ends_block() {
            (0, 0, 0.0)
        } else {
            named_bytes(remat, &layer.out_names, rows, share, self.elem)
        };
        let after_share = z.shape()[1] as f64 / model::after_output_width(layer).max(1) as f64;
        let (d2, o2, lost_after) =
            named_bytes(remat, &layer.after_names, rows, after_share, self.elem);
        let output = !layer.after_names.is_empty() && lost_after == 0.0;
        LayerKeep {
            device: d1 + d2,
            offload: o1 + o2,
            output,
            recompute_matmul,
            recompute_after: layer.after != After::None
                && (!output || recompute_matmul > 0.0 || model::after_needs_recompute(layer)),
        }
    }

    /// Before the backward of block `b` (whose last layer is `last`): brings its offloaded activations back (and starts the
    /// previous block's), then runs again the forward of every layer whose output the policy
    /// did not keep, from the block's input.
    async fn rematerialise(
        &mut self,
        chip: &mut Chip,
        b: usize,
        last: usize,
        acts: &mut [Option<Tensor>],
    ) -> Result<(), ProgramError> {
        let now = chip.clock();
        if self.host_ready[b].is_none() && self.host_bytes[b] > 0 {
            self.host_ready[b] = Some(self.tl.host_transfer(chip, self.host_bytes[b], now));
        }
        if b > 0 && self.host_ready[b - 1].is_none() && self.host_bytes[b - 1] > 0 {
            self.host_ready[b - 1] = Some(self.tl.host_transfer(chip, self.host_bytes[b - 1], now));
        }
        if let Some(ready) = self.host_ready[b] {
            Timeline::wait(chip, ready);
        }
        for l in self.unit(last) {
            let keep = self.keeps[l].clone();
            if !keep.recomputes() {
                continue;
            }
            self.unshard(chip, l).await?;
            let x = acts[l].take().ok_or_else(|| missing(l))?;
            let pass = Pass::Recompute {
                matmul: keep.recompute_matmul,
                after: keep.recompute_after,
            };
            let (z, width, gathered) = self.layer_forward(chip, l, &x, pass).await?;
            acts[l] = Some(x);
            if let Some(g) = gathered {
                let now = chip.clock();
                self.hold_gathered(l, g, now)?;
            }
            // Until its backward the layer holds its recomputed output; under autograd's
            // recomputation, everything that backward reads, as if it had been kept.
            let bytes = if self.spec.remat.autograd {
                self.backward_reads(l, &z, width)
                    .saturating_sub(keep.device)
            } else if keep.output {
                0
            } else {
                z.bytes(self.elem)
            };
            self.hbm.alloc(MemKind::Activations, bytes, || {
                format!("recomputed activations of layer {l}")
            })?;
            self.held[l] += bytes;
            if !keep.output {
                acts[l + 1] = Some(z);
            }
        }
        Ok(())
    }

    /// Whether layer `l`'s output is sharded over the tensor-parallel dimension (sharded
    /// activations: after a row-parallel layer, and after the embedding).
    fn sharded_output(&self, l: usize) -> bool {
        self.spec.tp_activations == TpActivations::Sharded
            && self.plan.tp_dim().is_some()
            && (self.plan.styles[l] == Style::Row || self.layers[l].kind == LayerKind::Embedding)
    }

    /// Whether layer `l` reads its input whole while the layer before leaves it sharded over
    /// tensor parallelism (the first layer of a parallel region).
    fn gathers_input(&self, l: usize) -> bool {
        l > 0 && self.sharded_output(l - 1) && self.plan.styles[l] != Style::Row
    }

    /// Whether layer `l`'s backward reads its output gradient whole while it arrives sharded
    /// like the output (a row-parallel layer before sharded activations).
    fn gathers_output_grad(&self, l: usize) -> bool {
        self.sharded_output(l) && self.plan.styles[l] == Style::Row
    }

    /// Gathers activations `t` sharded on their `width` features whole on the tensor stream
    /// (beside compute when `overlap`): the whole tensor and when it is ready.
    async fn tp_gather(
        &mut self,
        chip: &mut Chip,
        t: Tensor,
        width: usize,
        overlap: bool,
    ) -> Result<(Tensor, Nanos), ProgramError> {
        let gather = (Placement::Shard(1), Placement::Replicate);
        self.tp_move(chip, t, width, gather, overlap).await
    }

    /// Holds layer `l`'s gathered input `g` (ready at `ready`) in HBM for the layer's
    /// recomputation and backward.
    fn hold_gathered(&mut self, l: usize, g: Tensor, ready: Nanos) -> Result<(), ProgramError> {
        self.hbm.alloc(MemKind::Transient, g.bytes(self.elem), || {
            format!("gathered input of layer {l}")
        })?;
        self.regathered[l] = Some((g, ready));
        Ok(())
    }

    /// Charges `elems` elements of working memory an op of layer `l` holds only while it runs
    /// (the score matrices of materialised attention): the peak sees them, nothing keeps them.
    fn workspace(&mut self, l: usize, elems: usize) -> Result<(), ProgramError> {
        if elems == 0 {
            return Ok(());
        }
        let bytes = elems as u64 * self.elem;
        self.hbm.alloc(MemKind::Transient, bytes, || {
            format!("attention scores of layer {l}")
        })?;
        self.hbm.free(MemKind::Transient, bytes);
        Ok(())
    }

    /// Layer `l`'s held gathered input, once ready (compute waits for it), if any.
    fn take_gathered(&mut self, chip: &mut Chip, l: usize) -> Option<Tensor> {
        let (g, ready) = self.regathered[l].take()?;
        self.hbm.free(MemKind::Transient, g.bytes(self.elem));
        Timeline::wait(chip, ready);
        Some(g)
    }

    /// Forward of layer `l` on `x`: returns its output, the width of its matmul's output on
    /// this chip, and the input gathered over tensor parallelism when it had to be. `pass`
    /// says what to charge (backward's recomputation charges only what the policy did not
    /// keep).
    async fn layer_forward(
        &mut self,
        chip: &mut Chip,
        l: usize,
        x: &Tensor,
        pass: Pass,
    ) -> Result<(Tensor, usize, Option<Tensor>), ProgramError> {
        let (matmul_share_of, after_charged) = match pass {
            Pass::Forward => (1.0, true),
            Pass::Recompute { matmul, after } => (matmul, after),
        };
        let style = self.plan.styles[l];
        let gathered = match self.take_gathered(chip, l) {
            Some(g) => Some(g),
            // The region's input, sharded on features, gathered whole.
            None if self.gathers_input(l) => Some(
                self.tp_gather(chip, x.clone(), self.layers[l].inputs, false)
                    .await?
                    .0,
            ),
            None => None,
        };
        let x = gathered.as_ref().unwrap_or(x);
        let [w, b] = working(&self.working, &self.params, l);
        let bias = (style != Style::Row && self.layers[l].bias).then_some(b);
        // The watchdog sees a chip inside a kernel as computing, not as stuck.
        chip.recorder().compute_started();
        let (mut z, cost) = match self.layers[l].kind {
            LayerKind::Linear => mlp::linear(x, w, bias)?,
            LayerKind::Embedding => model::embedding(x, w)?,
        };
        self.tl.compute(
            chip,
            matmul_share(cost, matmul_share_of),
            self.hbm.in_use(),
            || format!("{} {}", self.layers[l].name, pass.name()),
        );
        if style == Style::Row {
            // Each chip holds a partial sum over its slice of the input features; the bias
            // (if any) is added once the sum is whole.
            let to = if self.sharded_output(l) {
                Placement::Shard(1)
            } else {
                Placement::Replicate
            };
            let width = z.shape()[1];
            z = self
                .tp_redistribute(chip, z, width, (Placement::Partial(ReduceOp::Sum), to))
                .await?;
            if self.layers[l].bias {
                let [_, b] = working(&self.working, &self.params, l);
                let b = b.clone();
                let b = self.tp_piece(chip, l, b, width).await?;
                let cost = mlp::add_bias(&mut z, &b)?;
                self.tl.compute(
                    chip,
                    matmul_share(cost, matmul_share_of),
                    self.hbm.in_use(),
                    || format!("{} {} (bias)", self.layers[l].name, pass.name()),
                );
            }
        } else if self.sharded_output(l) {
            // The embedding's output, cut to this chip's features (no communication).
            let width = z.shape()[1];
            z = self
                .tp_redistribute(chip, z, width, (Placement::Replicate, Placement::Shard(1)))
                .await?;
        }
        let matmul_width = z.shape()[1];
        self.op_after(chip, l, &mut z, pass, after_charged)?;
        Ok((z, matmul_width, gathered))
    }

    /// The parameter-free op after layer `l`'s matmul, on its output `z` (charged to the
    /// chip's compute when `charged`: a recomputation may find it kept).
    fn op_after(
        &mut self,
        chip: &mut Chip,
        l: usize,
        z: &mut Tensor,
        pass: Pass,
        charged: bool,
    ) -> Result<(), ProgramError> {
        let cost = match self.layers[l].after {
            After::None => Cost::default(),
            After::Relu => mlp::relu(z),
            after => {
                // Ops that narrow the width (attention, gated activations) hand the next layer
                // what it takes on this chip.
                let width = match after {
                    After::ResidualNorm => z.shape()[1],
                    _ => self.compute_shape(chip, l + 1, 0)[1],
                };
                if charged {
                    let (t, in_width) = (z.shape()[0], z.shape()[1]);
                    let scratch =
                        model::after_workspace_elems(&self.layers[l], t, in_width, false, true);
                    self.workspace(l, scratch)?;
                }
                model::after_forward(&self.layers[l], z, width)
            }
        };
        if charged {
            self.tl.compute(chip, cost, self.hbm.in_use(), || {
                format!("{} {} (op after)", self.layers[l].name, pass.name())
            });
        }
        Ok(())
    }

    /// Backward of layer `l`: accumulates its gradients, returns the input gradient. The
    /// input gradient is formed first so that its tensor-parallel collective runs while the
    /// weight gradient is computed (they do not depend on each other).
    async fn layer_backward(
        &mut self,
        chip: &mut Chip,
        l: usize,
        x: &Tensor,
        dz: Tensor,
        dz_ready: Option<Nanos>,
    ) -> Result<Option<Tensor>, ProgramError> {
        let style = self.plan.styles[l];
        let sharded_in = l > 0 && self.sharded_output(l - 1);
        let inputs = self.layers[l].inputs;
        let dz = match dz_ready {
            // Gathered ahead.
            Some(ready) => {
                Timeline::wait(chip, ready);
                dz
            }
            None if self.gathers_output_grad(l) => {
                self.tp_gather(chip, dz, self.layers[l].outputs, false)
                    .await?
                    .0
            }
            None => dz,
        };
        let gathered;
        let x = if self.gathers_input(l) {
            gathered = match self.take_gathered(chip, l) {
                // Gathered by this backward's recomputation.
                Some(g) => g,
                // The input as the forward used it (gathered again: it was kept sharded).
                None => {
                    self.tp_gather(chip, x.clone(), self.layers[l].inputs, false)
                        .await?
                        .0
                }
            };
            &gathered
        } else {
            x
        };
        let [w, _] = working(&self.working, &self.params, l);
        chip.recorder().compute_started();
        let mlp::Grads {
            dw,
            db,
            dx,
            weight_cost,
            input_cost,
        } = match self.layers[l].kind {
            LayerKind::Linear => mlp::linear_backward(x, w, &dz, l > 0, self.layers[l].bias)?,
            LayerKind::Embedding => model::embedding_backward(x, w),
        };
        // A layer without a bias has a bias parameter of no elements, and so its gradient.
        let db = if self.layers[l].bias {
            db
        } else {
            Tensor::zeros(&[0], self.spec.meta)
        };
        self.tl.compute(chip, input_cost, self.hbm.in_use(), || {
            format!("{} backward (input gradient)", self.layers[l].name)
        });
        let (dx, pending) = match dx {
            Some(dx) => {
                let (dx, pending) = self
                    .input_grad_to(chip, dx, style, inputs, sharded_in)
                    .await?;
                (Some(dx), pending)
            }
            None => (None, None),
        };
        self.tl.compute(chip, weight_cost, self.hbm.in_use(), || {
            format!("{} backward (weight gradient)", self.layers[l].name)
        });
        if let Some(ready) = pending {
            Timeline::wait(chip, ready);
        }
        self.accumulate_grads(l, [dw, db])?;
        Ok(dx)
    }

    /// A layer's input gradient `dx` (of `inputs` features) where the layer below wants it:
    /// a column-parallel layer's covers only this chip's output features and is summed (or
    /// reduce-scattered onto sharded activations) on the tensor stream, in fused mode while
    /// the weight gradient is computed (then the time it is ready comes back); sharded
    /// activations below take their shard.
    async fn input_grad_to(
        &mut self,
        chip: &mut Chip,
        dx: Tensor,
        style: Style,
        inputs: usize,
        sharded_in: bool,
    ) -> Result<(Tensor, Option<Nanos>), ProgramError> {
        if style == Style::Column {
            let to = if sharded_in {
                Placement::Shard(1)
            } else {
                Placement::Replicate
            };
            let sum = (Placement::Partial(ReduceOp::Sum), to);
            let overlap = self.overlapped();
            let (dx, ready) = self.tp_move(chip, dx, inputs, sum, overlap).await?;
            return Ok((dx, Some(ready)));
        }
        if sharded_in {
            let to_shard = (Placement::Replicate, Placement::Shard(1));
            return Ok((
                self.tp_redistribute(chip, dx, inputs, to_shard).await?,
                None,
            ));
        }
        Ok((dx, None))
    }

    /// Layer `l`'s weight and bias gradients, added to what earlier micro-batches left (the
    /// first one held unsharded in HBM until it is reduced).
    fn accumulate_grads(&mut self, l: usize, grads: [Tensor; 2]) -> Result<(), ProgramError> {
        for (which, g) in grads.into_iter().enumerate() {
            let name = self.params[2 * l + which].name.clone();
            let p = &mut self.params[2 * l + which];
            match (&mut p.grad, g) {
                (Some(Tensor::Data(acc)), Tensor::Data(g)) => *acc += &g,
                (Some(_), _) => {}
                (slot @ None, g) => {
                    if self.sharded {
                        let bytes = g.bytes(self.elem);
                        self.hbm.alloc(MemKind::Transient, bytes, || {
                            format!("unsharded gradient of {name}")
                        })?;
                        p.unsharded_grad_bytes = bytes;
                    }
                    *slot = Some(g);
                }
            }
        }
        Ok(())
    }

    /// Placements over the plan's mesh: `tp` on the tensor-parallel dimension, replicated on
    /// the others (activations are per data-parallel rank).
    fn tp_placements(&self, tp: Placement) -> Result<Vec<Placement>, ProgramError> {
        let dim = self.plan.tp_dim().ok_or_else(|| {
            ProgramError::Internal("a tensor-parallel layer without a tp dimension".into())
        })?;
        let mut p = vec![Placement::Replicate; self.plan.mesh.ndim()];
        p[dim] = tp;
        Ok(p)
    }

    /// Moves activations `t` (this chip's piece) between placements over the tensor-parallel
    /// dimension on the tensor stream, and compute waits for the result. `width` is the
    /// activations' feature width over all chips.
    async fn tp_redistribute(
        &mut self,
        chip: &mut Chip,
        t: Tensor,
        width: usize,
        placements: (Placement, Placement),
    ) -> Result<Tensor, ProgramError> {
        Ok(self.tp_move(chip, t, width, placements, false).await?.0)
    }

    /// [`Self::tp_redistribute`], beside compute when `overlap`: returns the result and when
    /// it is ready.
    async fn tp_move(
        &mut self,
        chip: &mut Chip,
        t: Tensor,
        width: usize,
        (from, to): (Placement, Placement),
        overlap: bool,
    ) -> Result<(Tensor, Nanos), ProgramError> {
        let from_pl = self.tp_placements(from)?;
        let to_pl = self.tp_placements(to)?;
        let global = [t.shape()[0], width];
        let dt = DTensor::from_local(chip, &self.plan.mesh, t, &from_pl, &global)?;
        let issued = self.tl.begin(chip, Stream::Tensor, overlap);
        let out = dt.redistribute(chip, &to_pl).await?;
        let ready = self.tl.end(chip, issued);
        Ok((out.into_local(), ready))
    }

    /// This chip's piece of a replicated vector of `width` features when layer `l`'s output
    /// is sharded over tensor parallelism (a row-parallel layer's bias), else the vector.
    async fn tp_piece(
        &mut self,
        chip: &mut Chip,
        l: usize,
        v: Tensor,
        width: usize,
    ) -> Result<Tensor, ProgramError> {
        if !self.sharded_output(l) {
            return Ok(v);
        }
        let from = self.tp_placements(Placement::Replicate)?;
        let to = self.tp_placements(Placement::Shard(0))?;
        let dt = DTensor::from_local(chip, &self.plan.mesh, v, &from, &[width])?;
        Ok(dt.redistribute(chip, &to).await?.into_local())
    }

    /// The layers gathered together with layer `l` (its FSDP unit): its transformer block, or
    /// `l` alone. XLA and FSDP2 gather a decoder block's weights as one unit, so the whole of
    /// the next block is in flight while the current one computes; prefetching layer by layer
    /// would leave the block's first gather exposed behind its rematerialisation.
    fn unit(&self, l: usize) -> std::ops::Range<usize> {
        let Some(b) = self.layers[l].block else {
            return l..l + 1;
        };
        let same = |m: &usize| self.layers[*m].block == Some(b);
        let first = (0..=l).rev().take_while(same).last().unwrap_or(l);
        let last = (l..self.layers.len()).take_while(same).last().unwrap_or(l);
        first..last + 1
    }

    /// Prefetches, ahead of need, the layers of layer `l`'s unit that fit in HBM beside
    /// `reserve` bytes the work before them will still allocate. A gather that does not fit
    /// waits: it is tried again before the next layer and issued on demand at the latest.
    /// XLA's scheduler and FSDP's all-gather limit hold prefetches back under memory pressure
    /// in the same way, so a job that fits without the overlap runs, with its gathers exposed,
    /// instead of running out of memory.
    async fn prefetch_ahead(
        &mut self,
        chip: &mut Chip,
        l: usize,
        reserve: u64,
    ) -> Result<(), ProgramError> {
        for m in self.unit(l) {
            if self.working[m].is_some() {
                continue;
            }
            let need = self.gathered_bytes(chip, m);
            if self.hbm.in_use() + need + reserve > self.hbm.capacity() {
                break;
            }
            self.prefetch(chip, m).await?;
        }
        Ok(())
    }

    /// HBM of layer `l`'s parameters in their unsharded compute layout: its gathered working
    /// copy, and its unsharded gradients.
    fn gathered_bytes(&self, chip: &Chip, l: usize) -> u64 {
        (0..2)
            .map(|which| {
                let shape = self.compute_shape(chip, l, which);
                self.elem * shape.iter().product::<usize>() as u64
            })
            .sum()
    }

    /// HBM layer `l`'s working copy will take when it is gathered on demand (nothing when it
    /// is gathered already).
    fn on_demand_bytes(&self, chip: &Chip, l: usize) -> u64 {
        if self.working[l].is_some() {
            0
        } else {
            self.gathered_bytes(chip, l)
        }
    }

    /// The most layer `l`'s forward on `rows` rows keeps in HBM: its output and the input of
    /// the op after it, each at most as wide as the layer's output here (weights are
    /// `[out, in]`, the embedding's included).
    fn kept_at_most(&self, chip: &Chip, l: usize, rows: usize) -> u64 {
        let out = self.compute_shape(chip, l, 0)[0];
        self.elem * (rows * 2 * out) as u64
    }

    /// Gathers layer `l`'s parameters over the shard dimension (on the gather stream in fused
    /// mode: compute waits only when it needs them).
    async fn prefetch(&mut self, chip: &mut Chip, l: usize) -> Result<(), ProgramError> {
        let Some(dim) = self.plan.shard_dim() else {
            return Ok(());
        };
        if self.working[l].is_some() {
            return Ok(());
        }
        let bytes = self.gathered_bytes(chip, l);
        self.hbm.alloc(MemKind::Transient, bytes, || {
            format!("gathered parameters of layer {l}")
        })?;
        let issued = self.tl.begin(chip, Stream::Gather, self.overlapped());
        let [w, b] = [&self.params[2 * l].stored, &self.params[2 * l + 1].stored];
        let tensors = if self.overlapped() {
            let mut g = dtensor::gather_shards(chip, &[w, b], dim)
                .await?
                .into_iter()
                .map(DTensor::into_local);
            let (Some(w), Some(b)) = (g.next(), g.next()) else {
                return Err(ProgramError::Internal(
                    "a coalesced gather lost a tensor".into(),
                ));
            };
            [w, b]
        } else {
            let w = w
                .redistribute(chip, &self.plan.compute(l, 0))
                .await?
                .into_local();
            // A layer without a bias has nothing to gather for it.
            let b = if !self.layers[l].bias {
                b.local().clone()
            } else {
                b.redistribute(chip, &self.plan.compute(l, 1))
                    .await?
                    .into_local()
            };
            [w, b]
        };
        let ready = self.tl.end(chip, issued);
        self.working[l] = Some(Working {
            tensors,
            bytes,
            ready,
        });
        Ok(())
    }

    fn compute_shape(&self, chip: &Chip, l: usize, which: usize) -> Vec<usize> {
        let p = &self.params[2 * l + which].stored;
        let coords = self.plan.mesh.coords(chip);
        let mut shape = p.shape().to_vec();
        for (i, pl) in self.plan.compute(l, which).iter().enumerate() {
            if let Placement::Shard(d) = pl {
                shape[*d] = crate::train::tensor::chunk_len(
                    shape[*d],
                    self.plan.mesh.dims()[i].size,
                    coords[i],
                );
            }
        }
        shape
    }

    /// Makes layer `l`'s working copy available to compute.
    async fn unshard(&mut self, chip: &mut Chip, l: usize) -> Result<(), ProgramError> {
        if !self.sharded {
            return Ok(());
        }
        self.prefetch(chip, l).await?;
        if let Some(w) = &self.working[l] {
            Timeline::wait(chip, w.ready);
        }
        Ok(())
    }

    fn release(&mut self, l: usize) {
        if let Some(w) = self.working[l].take() {
            self.hbm.free(MemKind::Transient, w.bytes);
        }
    }

    /// The layers whose gradients are reduced once layer `l`'s backward is done: `l`'s own, or
    /// under `GradReduce::PerUnit` (fused mode, a sharded strategy) its unit's once the unit's
    /// first layer, the last the backward reaches, is done.
    fn reduced_after(&self, l: usize) -> Option<Range<usize>> {
        if self.per_unit_reduction() {
            let unit = self.unit(l);
            (unit.start == l).then_some(unit)
        } else {
            Some(l..l + 1)
        }
    }

    /// Whether layer `l` keeps its gathered parameters from its forward to its backward:
    /// under PyTorch FSDP2 (`GradReduce::PerUnit`) the layers of a transformer outside its
    /// blocks (embedding, final norm, output) belong to the root module, which FSDP2 does
    /// not reshard after forward, since backward would gather them again at once.
    fn root_keeps(&self, l: usize) -> bool {
        self.per_unit_reduction()
            && self.layers[l].block.is_none()
            && self.layers.iter().any(|layer| layer.block.is_some())
    }

    fn per_unit_reduction(&self) -> bool {
        self.spec.grad_reduce == GradReduce::PerUnit
            && self.overlapped()
            && self.plan.shard_dim().is_some()
    }

    /// What the backward of layer `l`'s unit will still allocate from `l` on, which a prefetch
    /// of the unit before it must leave room for: the unsharded gradients, the working copies
    /// not gathered yet (released a layer at a time: the largest), and the reduce-scatter
    /// input of FSDP2's copy-in (less the one it replaces, freed first). Reduced a layer at a
    /// time, one layer's gradients and input at most; per unit, the unit's gradients add up
    /// and its input joins them at its end.
    fn backward_reserve(&self, chip: &Chip, l: usize) -> u64 {
        let unit = self.unit(l);
        let copies_in = self.copies_into_reduce_input();
        let input = |m: usize| {
            if copies_in {
                self.reduce_input_bytes(chip, m)
            } else {
                0
            }
        };
        let layers = unit.start..=l;
        if self.per_unit_reduction() {
            let grads: u64 = layers.clone().map(|m| self.gathered_bytes(chip, m)).sum();
            let gathers = layers.map(|m| self.on_demand_bytes(chip, m)).max();
            let whole: u64 = unit.map(input).sum();
            grads + gathers.unwrap_or(0) + whole.saturating_sub(self.reduce_input)
        } else {
            layers
                .map(|m| {
                    self.gathered_bytes(chip, m)
                        + self.on_demand_bytes(chip, m)
                        + input(m).saturating_sub(self.reduce_input)
                })
                .max()
                .unwrap_or(0)
        }
    }

    /// Gradients go through FSDP2's copy-in: reduced per unit, or in a dtype other than the
    /// compute dtype.
    fn copies_into_reduce_input(&self) -> bool {
        let compute = self.spec.model.dtype();
        self.spec.grad_reduce == GradReduce::PerUnit
            || self.spec.reduce_dtype.is_some_and(|d| d != compute)
    }

    /// Bytes layer `l`'s gradients take in a flat reduce-scatter input: each padded to whole
    /// pieces of the shard group, in the reduce dtype.
    fn reduce_input_bytes(&self, chip: &Chip, l: usize) -> u64 {
        let Some(dim) = self.plan.shard_dim() else {
            return 0;
        };
        let n = self.plan.mesh.dims()[dim].size;
        let reduce = self.spec.reduce_dtype.unwrap_or(self.spec.model.dtype());
        (0..2)
            .map(|which| {
                let shape = self.compute_shape(chip, l, which);
                let rest: usize = shape.iter().skip(1).product();
                let rows = shape.first().map_or(1, |r| r.div_ceil(n) * n);
                (rows * rest * reduce.size()) as u64
            })
            .sum()
    }

    /// Gradient sync of the parameters of `layers` once their backward is done.
    async fn sync_layers(
        &mut self,
        chip: &mut Chip,
        layers: Range<usize>,
    ) -> Result<(), ProgramError> {
        // The layers' backward is done for the step: their gradients are taken, not copied.
        let indices: Vec<usize> = layers.clone().flat_map(|l| [2 * l, 2 * l + 1]).collect();
        let grads: Vec<DTensor> = indices
            .iter()
            .map(|&index| {
                let p = &mut self.params[index];
                let g = p
                    .grad
                    .take()
                    .unwrap_or_else(|| Tensor::zeros(p.stored.local().shape(), self.spec.meta));
                p.stored
                    .with_local(g, &self.plan.gradient(index / 2, index % 2))
            })
            .collect();
        let synced: Vec<Tensor> = if !self.overlapped() {
            // As written: one collective (or one chain of them) per parameter, bias first
            // (reverse parameter order, as DDP sees them become ready).
            let mut out = Vec::with_capacity(grads.len());
            for (&index, g) in indices.iter().zip(&grads).rev() {
                if index % 2 == 1 && !self.layers[index / 2].bias {
                    // The bias of a layer without one: nothing to reduce.
                    out.push(g.local().clone());
                    continue;
                }
                let issued = self.tl.begin(chip, Stream::Reduce, false);
                let g = g
                    .redistribute(chip, &self.plan.stored(index / 2, index % 2))
                    .await?;
                self.tl.end(chip, issued);
                out.push(g.into_local());
            }
            out.reverse();
            out
        } else if let Some(dim) = self.plan.shard_dim() {
            // FSDP: the layers' gradients in one reduce-scatter (then HSDP's all-reduce).
            let grads = self.copy_into_reduce_input(chip, layers, &indices, grads)?;
            let issued = self.tl.begin(chip, Stream::Reduce, true);
            let items: Vec<&DTensor> = grads.iter().collect();
            let mut g = dtensor::reduce_scatter(chip, &items, dim, ReduceOp::Avg, 0).await?;
            let replicas = self.plan.replicate_dim();
            let later = self.spec.replica_sync == ReplicaSync::AfterBackward;
            if let (Some(rep), false) = (replicas, later) {
                g = dtensor::all_reduce(chip, g, rep, ReduceOp::Avg).await?;
            }
            self.tl.end(chip, issued);
            if replicas.is_some() && later {
                for (&index, g) in indices.iter().zip(g) {
                    self.free_unsharded_grad(index);
                    self.unsynced.push((index, g));
                }
                return Ok(());
            }
            g.into_iter().map(DTensor::into_local).collect()
        } else if self.plan.replicate_dim().is_some() {
            // DDP: the gradients wait in their buckets.
            for (&index, g) in indices.iter().zip(grads) {
                self.params[index].synced = Some(g.into_local().into_payload());
            }
            return self.issue_ready_buckets(chip).await;
        } else {
            grads.into_iter().map(DTensor::into_local).collect()
        };
        for (&index, g) in indices.iter().zip(synced) {
            self.finish_grad(index, g);
        }
        Ok(())
    }

    /// FSDP2's copy-in, under `GradReduce::PerUnit` or a `reduce_dtype` other than the compute
    /// dtype: `grads` (of `layers`, parameters `indices`) are copied into one flat
    /// reduce-scatter input in the reduce dtype and their buffers freed; the input is held
    /// until the next copy-in, or the backward's end. Otherwise they are reduced where they
    /// are, in the compute dtype.
    fn copy_into_reduce_input(
        &mut self,
        chip: &mut Chip,
        layers: Range<usize>,
        indices: &[usize],
        grads: Vec<DTensor>,
    ) -> Result<Vec<DTensor>, ProgramError> {
        let compute = self.spec.model.dtype();
        let reduce = self.spec.reduce_dtype.unwrap_or(compute);
        if !self.copies_into_reduce_input() {
            return Ok(grads);
        }
        let bytes: u64 = layers
            .clone()
            .map(|l| self.reduce_input_bytes(chip, l))
            .sum();
        // One pass: the gradients read in the compute dtype, the input written in the reduce's.
        let elems = (bytes / reduce.size() as u64) as usize;
        let written = reduce.size() as f64 / compute.size() as f64;
        let what = || {
            format!(
                "reduce-scatter input of layers {}..{}",
                layers.start, layers.end
            )
        };
        self.tl.compute(
            chip,
            Cost::elementwise_rw(elems, 0.0, 1.0, written),
            self.hbm.in_use(),
            what,
        );
        // FSDP2 frees the previous input once this post-backward has waited on its
        // reduce-scatter, before it allocates the next.
        self.hbm
            .free(MemKind::Transient, std::mem::take(&mut self.reduce_input));
        self.hbm.alloc(MemKind::Transient, bytes, what)?;
        self.reduce_input = bytes;
        for &index in indices {
            self.free_unsharded_grad(index);
        }
        Ok(grads.into_iter().map(|g| g.in_dtype(reduce)).collect())
    }

    fn finish_grad(&mut self, index: usize, g: Tensor) {
        self.finish_synced(index, g.into_payload());
    }

    /// Parameter `index`'s gradient is synced: it waits for the optimizer.
    fn finish_synced(&mut self, index: usize, g: Payload) {
        self.free_unsharded_grad(index);
        self.params[index].synced = Some(g);
    }

    /// Parameter `index`'s whole gradient is reduced to this chip's piece: its HBM is free.
    fn free_unsharded_grad(&mut self, index: usize) {
        let bytes = std::mem::take(&mut self.params[index].unsharded_grad_bytes);
        self.hbm.free(MemKind::Transient, bytes);
    }

    /// `ReplicaSync::AfterBackward`: every layer's reduce-scattered gradients in one
    /// all-reduce over the replicas, on the reduction stream behind the last reduce-scatter.
    async fn sync_replicas(&mut self, chip: &mut Chip) -> Result<(), ProgramError> {
        let Some(rep) = self.plan.replicate_dim() else {
            return Ok(());
        };
        if self.unsynced.is_empty() {
            return Ok(());
        }
        let (indices, grads): (Vec<usize>, Vec<DTensor>) =
            std::mem::take(&mut self.unsynced).into_iter().unzip();
        let issued = self.tl.begin(chip, Stream::Reduce, true);
        let reduced = dtensor::all_reduce(chip, grads, rep, ReduceOp::Avg).await?;
        self.tl.end(chip, issued);
        for (i, g) in indices.into_iter().zip(reduced) {
            self.finish_grad(i, g.into_local());
        }
        Ok(())
    }

    /// Fused DDP: all-reduces, in bucket order, every bucket whose gradients are all ready.
    async fn issue_ready_buckets(&mut self, chip: &mut Chip) -> Result<(), ProgramError> {
        let Some(dim) = self.plan.replicate_dim() else {
            return Ok(());
        };
        while let Some(bucket) = self.buckets.get(self.next_bucket) {
            if bucket.iter().any(|&i| self.params[i].synced.is_none()) {
                return Ok(());
            }
            let bucket = bucket.clone();
            // Taken, not cloned: the reduced gradients take their place below.
            let grads: Vec<DTensor> = bucket
                .iter()
                .map(|&i| {
                    let p = &mut self.params[i];
                    let shape = p.stored.local().shape();
                    let g = match p.synced.take() {
                        // The backward's own buffer: made a tensor again without a copy.
                        Some(g) => Tensor::from_payload(g, shape)?,
                        None => Tensor::zeros(shape, true),
                    };
                    Ok(p.stored
                        .with_local(g, &self.plan.gradient(p.layer, p.which)))
                })
                .collect::<Result<_, ProgramError>>()?;
            let issued = self.tl.begin(chip, Stream::Reduce, true);
            let reduced = dtensor::all_reduce_in_place(chip, grads, dim, ReduceOp::Avg).await?;
            self.tl.end(chip, issued);
            for (&i, g) in bucket.iter().zip(reduced) {
                self.finish_synced(i, g);
            }
            self.next_bucket += 1;
        }
        Ok(())
    }

    fn optimizer_step(&mut self, chip: &mut Chip) -> Result<(), ProgramError> {
        let spec: &OptimizerSpec = &self.spec.optimizer;
        let weight = self.spec.model.weight_dtype().size() as u64;
        let (reads, writes) = update_traffic(self.elem, weight, spec.state_per_param());
        for p in &mut self.params {
            let g = p.synced.take().ok_or_else(|| {
                ProgramError::Internal(format!(
                    "no synced gradient for {} at the optimizer step",
                    p.name
                ))
            })?;
            let n = p.stored.local().numel();
            let g = g.resolve();
            if g.len() != n {
                return Err(ProgramError::Internal(format!(
                    "a synced gradient of {} elements for {} of {n}",
                    g.len(),
                    p.name
                )));
            }
            chip.recorder().compute_started();
            if let (Some(param), Some(g)) = (p.stored.local_mut().values_mut(), g.as_rope()) {
                p.state.step(spec, param, g);
            }
            let name = &p.name;
            if n > 0 {
                self.tl.compute(
                    chip,
                    Cost::elementwise_rw(n, spec.flops_per_param(), reads, writes),
                    self.hbm.in_use(),
                    || format!("optimizer {name}"),
                );
            }
            p.grad = None;
        }
        self.next_bucket = 0;
        Ok(())
    }

    /// Debug mode: chips that hold the same piece of a parameter must hold the same values.
    async fn check_replicas(&mut self, chip: &mut Chip, step: u32) -> Result<(), ProgramError> {
        // Group parameters by the mesh dimensions that replicate them, one exchange of
        // hashes per dimension: equal within every replicating dimension is equal across
        // all of them (any two replicas are joined by a chain of one-dimension steps), and a
        // dimension's group is exact even where it spans only a part of a torus axis.
        let mut groups: Vec<(Group, Vec<usize>)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            for (d, pl) in p.stored.placements().iter().enumerate() {
                let g = self.plan.mesh.dims()[d].group;
                if *pl != Placement::Replicate || g.size(chip.pod()) < 2 {
                    continue;
                }
                match groups.iter_mut().find(|(h, _)| *h == g) {
                    Some((_, v)) => v.push(i),
                    None => groups.push((g, vec![i])),
                }
            }
        }
        for (group, members) in groups {
            let hashes: Vec<u64> = members
                .iter()
                .map(|&i| bits_hash(self.params[i].stored.local()))
                .collect();
            let comm = Comm::new(group, self.spec.algo).verified(true);
            if let Some((peer, k)) = first_mismatch(chip, &comm, &hashes).await? {
                return Err(ProgramError::Diverged {
                    step: u64::from(step),
                    detail: format!(
                        "chips {} and {peer} hold different values of {}",
                        chip.id(),
                        self.params[members[k]].name
                    ),
                });
            }
        }
        Ok(())
    }

    /// The chip's training state for a checkpoint: per parameter its values, the number of
    /// optimizer tensors (as bits) and those tensors.
    /// This chip's parameter pieces and their optimizer state, named as the checkpoint
    /// module describes.
    fn save(&self) -> checkpoint::Checkpoint {
        let mut c = checkpoint::Checkpoint::default();
        let saved = |name: String, a: &ndarray::ArrayD<f32>| checkpoint::Saved {
            name,
            shape: a.shape().to_vec(),
            values: a.iter().copied().collect(),
        };
        for p in &self.params {
            if let Some(values) = p.stored.local().values() {
                c.tensors.push(saved(p.name.clone(), values));
            }
            for (i, b) in p.state.buffers().iter().enumerate() {
                c.tensors
                    .push(saved(format!("{}.optimizer.{i}", p.name), b));
            }
            c.metadata.insert(
                format!("{}.optimizer_step", p.name),
                p.state.steps().to_string(),
            );
        }
        c
    }

    fn restore(&mut self, saved: &checkpoint::Checkpoint) -> Result<(), ProgramError> {
        let bad = |why: String| {
            ProgramError::Invalid(format!("a checkpoint that does not fit this job: {why}"))
        };
        let fitting = |name: &str, shape: &[usize]| {
            let t = saved
                .tensor(name)
                .ok_or_else(|| bad(format!("no tensor {name}")))?;
            if t.shape != shape {
                return Err(bad(format!("{name} is {:?}, not {shape:?}", t.shape)));
            }
            Ok(t.values.clone())
        };
        for p in &mut self.params {
            let shape = p.stored.local().shape().to_vec();
            *p.stored.local_mut() = Tensor::from_vec(&shape, fitting(&p.name, &shape)?)?;
            let step: u32 = saved
                .metadata
                .get(&format!("{}.optimizer_step", p.name))
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad(format!("no optimizer step for {}", p.name)))?;
            let mut buffers = Vec::new();
            while saved
                .tensor(&format!("{}.optimizer.{}", p.name, buffers.len()))
                .is_some()
            {
                let values = fitting(&format!("{}.optimizer.{}", p.name, buffers.len()), &shape)?;
                buffers.push(
                    ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&shape), values)
                        .map_err(|e| bad(e.to_string()))?,
                );
            }
            p.state = ParamState::from_parts(step, buffers);
        }
        Ok(())
    }

    /// Every parameter, whole, on every chip (weight and bias of each layer in order).
    async fn full_parameters(&mut self, chip: &mut Chip) -> Result<Vec<Tensor>, ProgramError> {
        let mut out = Vec::with_capacity(self.params.len());
        for p in &self.params {
            out.push(p.stored.full_tensor(chip).await?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::update_traffic;

    #[test]
    fn an_optimizer_update_moves_its_weights_and_state_both_ways() {
        // AdamW, f32 master weights, bf16 compute: the bf16 gradient in; master, m and v in
        // and out (12 bytes each way); the bf16 working copy out. 28 bytes a parameter.
        let (reads, writes) = update_traffic(2, 4, 2);
        assert_eq!((reads, writes), (7.0, 7.0));
        assert_eq!(2.0 * (reads + writes), 28.0);
        // AdamW with bf16 weights: 2 + 6 in, 6 out; no separate working copy.
        assert_eq!(update_traffic(2, 2, 2), (4.0, 3.0));
        // Plain SGD in f32: gradient and weight in, weight out.
        assert_eq!(update_traffic(4, 4, 0), (2.0, 1.0));
    }
}
