//! The training loop of one chip: forward, backward and optimizer step of the MLP under a
//! strategy, with the collectives it needs, on two clocks.
//!
//! Virtual time has a compute stream (the chip's clock, advanced by every kernel) and two
//! communication streams (parameter gathers and gradient reductions). In `strict` and
//! `debug` mode every collective starts when the compute stream reaches it and compute
//! waits for it. In `fused` mode gradient reductions and FSDP gathers are issued on their
//! stream when their inputs are ready and compute goes on; compute waits only where it needs
//! the result (a gathered layer, the optimizer step). Links stay shared, so overlapped
//! traffic still contends. A step's time splits into compute, communication (the sum of its
//! collectives' durations) and exposed communication (step time minus compute: what overlap
//! did not hide).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use podsim_collectives::bits::{fnv1a_f32, word_to_f32s};
use podsim_collectives::{Algo, Chip, Comm, Nanos, Payload, ReduceOp};
use podsim_topology::Group;
use serde::{Deserialize, Serialize};

use crate::error::WorkerError;
use crate::train::dtensor::{self, DTensor, Placement};
use crate::train::memory::{Hbm, HbmReport, MemKind};
use crate::train::mlp::{self, Cost, Dataset};
use crate::train::model::{self, After, LayerKind, LayerSpec, ModelSpec};
use crate::train::optim::{OptimizerSpec, ParamState};
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
}

/// DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`).
const FIRST_BUCKET_BYTES: u64 = 1 << 20;

/// One chip's account of one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u32,
    /// Mean loss of this chip's samples (none in meta mode).
    pub loss: Option<f64>,
    pub virtual_ns: f64,
    pub compute_ns: f64,
    pub comm_ns: f64,
    pub exposed_ns: f64,
    pub wall_ns: u64,
    /// Flops of every kernel the step charged (matrix products, element-wise work, the
    /// optimizer), on this chip.
    #[serde(default)]
    pub flops: f64,
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
    /// FNV-1a of every final full parameter's f32 bits (data mode), to compare runs.
    #[serde(default)]
    pub params_hash: Option<String>,
}

#[derive(Debug, Clone, Copy)]
enum Stream {
    Gather = 0,
    Reduce = 1,
    /// Tensor-parallel activations: on the critical path, never queued behind gradients.
    Tensor = 2,
}

/// The clocks of a step (see the module docs).
#[derive(Debug, Default)]
struct Timeline {
    stream_free: [Nanos; 3],
    /// Kernel costs count bytes of f32; elements of the model's dtype take this share of them.
    bytes_scale: f64,
    compute_ns: f64,
    flops: f64,
    comm_ns: f64,
    /// When the last overlapped collective finishes.
    outstanding: Nanos,
}

/// A collective in flight on a stream: the compute clock when it was issued and its start.
struct Issued {
    issued_at: Nanos,
    start: Nanos,
    overlap: bool,
    stream: Stream,
}

impl Timeline {
    fn compute(&mut self, chip: &mut Chip, cost: Cost) {
        self.compute_ns += chip.compute(cost.flops, cost.bytes * self.bytes_scale);
        self.flops += cost.flops;
    }

    /// Moves the chip's clock to when `stream` can start a collective issued now.
    fn begin(&self, chip: &mut Chip, stream: Stream, overlap: bool) -> Issued {
        let issued_at = chip.clock();
        let start = issued_at.max(self.stream_free[stream as usize]);
        chip.set_clock(start);
        Issued {
            issued_at,
            start,
            overlap,
            stream,
        }
    }

    /// Closes a collective: returns when its result is ready. Overlapped collectives put the
    /// clock back to the compute stream.
    fn end(&mut self, chip: &mut Chip, issued: Issued) -> Nanos {
        let done = chip.clock();
        self.stream_free[issued.stream as usize] = done;
        self.comm_ns += done - issued.start;
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
    /// The synced gradient, in the stored layout.
    synced: Option<Tensor>,
    state: ParamState,
}

/// A layer's unsharded working copy (FSDP) and when it is ready.
struct Working {
    tensors: [Tensor; 2],
    bytes: u64,
    ready: Nanos,
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
    working: Vec<Option<Working>>,
    /// The working copy differs from the stored piece (a data-parallel dimension shards).
    sharded: bool,
    /// Activation bytes saved inside each layer's trailing op (freed in its backward).
    saved: Vec<u64>,
}

/// Trains on one chip; `done` counts finished steps.
pub async fn train_chip(
    chip: &mut Chip,
    spec: &TrainSpec,
    done: Arc<AtomicU64>,
) -> Result<ChipTrainReport, WorkerError> {
    Ok(train_chip_with_parameters(chip, spec, done).await?.0)
}

/// [`train_chip`], also returning the final parameters, whole (weight and bias of each layer).
pub async fn train_chip_with_parameters(
    chip: &mut Chip,
    spec: &TrainSpec,
    done: Arc<AtomicU64>,
) -> Result<(ChipTrainReport, Vec<Tensor>), WorkerError> {
    let mut t = Trainer::new(chip, spec).await?;
    let dir = spec.checkpoint_dir.as_deref().map(std::path::Path::new);
    let first = match (spec.resume_from, dir) {
        (Some(step), Some(dir)) if !spec.meta => {
            t.restore(&checkpoint::read(dir, step, chip.id())?)?;
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
            checkpoint::write(dir, finished, chip.id(), &t.save())?;
        }
    }
    // Verification below is not part of the modelled job: it costs no virtual time.
    let time = chip.time_snapshot();
    let full = t.full_parameters(chip).await?;
    let replicas_identical = if spec.meta {
        None
    } else {
        Some(identical_everywhere(chip, spec.algo, &full).await?)
    };
    let (max_abs_diff, max_rel_diff) = if spec.check && !spec.meta && chip.id() == 0 {
        let reference = reference::train(spec, t.dp.0)?;
        let (abs, rel) = reference::compare(&full, &reference);
        (Some(abs), Some(rel))
    } else {
        (None, None)
    };
    chip.restore_time(time);
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
        params_hash,
    };
    Ok((report, full))
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
) -> Result<Option<(u32, usize)>, WorkerError> {
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
) -> Result<bool, WorkerError> {
    let world = Comm::new(Group::world(chip.pod()), algo);
    let hashes: Vec<u64> = full.iter().map(bits_hash).collect();
    Ok(first_mismatch(chip, &world, &hashes).await?.is_none())
}

impl<'a> Trainer<'a> {
    async fn new(chip: &mut Chip, spec: &'a TrainSpec) -> Result<Trainer<'a>, WorkerError> {
        let lowered = spec.model.lower();
        let layers = lowered.len();
        let dtype = spec.model.dtype();
        let elem = dtype.size() as u64;
        let mut plan = Plan::new(
            chip.pod(),
            spec.strategy,
            &spec.model.tp_styles(),
            spec.tp,
            spec.replicas,
            spec.algo,
            spec.eager == Eager::Debug,
        )?;
        plan.mesh = plan.mesh.with_dtype(dtype);
        let coords = plan.mesh.coords(chip);
        let dp = plan.data_parallel(&coords);
        // Meta mode predicts: a model that does not fit gets a verdict, not an abort.
        let mut hbm = Hbm::new(chip.id(), chip.hardware().hbm_bytes as u64).lenient(spec.meta);
        // Optimizer state is f32; below f32 the optimizer also keeps an f32 master copy
        // (mixed precision).
        let state_bytes =
            4 * spec.optimizer.state_per_param() as u64 + if elem < 4 { 4 } else { 0 };
        // DDP: every rank draws its own initial weights and rank 0's are broadcast, as
        // DistributedDataParallel does at construction. Other strategies start from one seed.
        let stream = if spec.strategy == Strategy::Ddp {
            dp.1 as u64
        } else {
            0
        };
        let mut params = Vec::with_capacity(2 * layers);
        for (l, layer) in lowered.iter().enumerate() {
            let full = match spec.model.mlp() {
                Some(mlp) => mlp.init_layer(l, spec.seed, stream, spec.meta),
                None => layer.meta_params(),
            };
            for (which, full) in full.iter().enumerate() {
                let stored = DTensor::distribute(chip, &plan.mesh, full, &plan.stored(l, which))?;
                let numel = stored.local().numel() as u64;
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
                    synced: None,
                    state: ParamState::new(),
                });
            }
        }
        let param_bytes: Vec<u64> = params
            .iter()
            .map(|p| p.stored.local().bytes(elem))
            .collect();
        let cap = (spec.bucket_cap_mb * (1u64 << 20) as f64) as u64;
        let data = match (spec.meta, spec.model.mlp()) {
            (true, _) => None,
            (false, Some(mlp)) => Some(Dataset::new(mlp, spec.seed)),
            (false, None) => {
                return Err(WorkerError::Invalid(
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
            working: (0..layers).map(|_| None).collect(),
            saved: vec![0; layers],
        };
        if spec.strategy == Strategy::Ddp && !spec.symmetric {
            t.broadcast_parameters(chip).await?;
        }
        Ok(t)
    }

    /// Rank 0's parameters to every data-parallel replica (one coalesced broadcast).
    async fn broadcast_parameters(&mut self, chip: &mut Chip) -> Result<(), WorkerError> {
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

    async fn step(&mut self, chip: &mut Chip, step: u32) -> Result<StepRecord, WorkerError> {
        let wall = Instant::now();
        let t0 = chip.clock();
        self.tl = Timeline {
            stream_free: [t0; 3],
            bytes_scale: self.elem as f64 / 4.0,
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
        Ok(StepRecord {
            step,
            loss,
            virtual_ns,
            compute_ns: self.tl.compute_ns,
            comm_ns: self.tl.comm_ns,
            exposed_ns: (virtual_ns - self.tl.compute_ns).max(0.0),
            wall_ns: wall.elapsed().as_nanos() as u64,
            flops: self.tl.flops,
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
    ) -> Result<Option<f64>, WorkerError> {
        let layers = self.layers.len();
        let elem = self.elem;
        self.hbm.alloc(MemKind::Activations, x.bytes(elem), || {
            "the input batch".into()
        })?;
        let mut acts = vec![x];
        for l in 0..layers {
            self.unshard(chip, l).await?;
            if self.overlapped() && l + 1 < layers {
                self.prefetch(chip, l + 1).await?;
            }
            let z = self.layer_forward(chip, l, &acts[l]).await?;
            self.hbm.alloc(MemKind::Activations, z.bytes(elem), || {
                format!("activations of layer {l}")
            })?;
            acts.push(z);
            if self.spec.reshard_after_forward {
                self.release(l);
            }
        }
        chip.recorder().compute_started();
        let (loss, mut dz, cost) =
            mlp::cross_entropy(&acts[layers], labels, 1.0 / micro_batches as f32)?;
        self.tl.compute(chip, cost);
        for l in (0..layers).rev() {
            self.unshard(chip, l).await?;
            if self.overlapped() && l > 0 && self.spec.reshard_after_forward {
                self.prefetch(chip, l - 1).await?;
            }
            let cost = match self.layers[l].after {
                After::None => Cost::default(),
                After::Relu => mlp::relu_backward(&mut dz, &acts[l + 1]),
                after => {
                    let width = self.compute_shape(chip, l, 0)[0];
                    model::after_backward(after, &mut dz, width)
                }
            };
            self.tl.compute(chip, cost);
            let dx = self.layer_backward(chip, l, &acts[l], &dz).await?;
            let freed = acts.pop().map_or(0, |a| a.bytes(elem)) + self.saved[l];
            self.saved[l] = 0;
            self.hbm.free(MemKind::Activations, freed);
            self.release(l);
            if sync {
                self.sync_layer(chip, l).await?;
            }
            if let Some(dx) = dx {
                dz = dx;
            }
        }
        let freed = acts.pop().map_or(0, |a| a.bytes(elem));
        self.hbm.free(MemKind::Activations, freed);
        Ok(loss)
    }

    async fn layer_forward(
        &mut self,
        chip: &mut Chip,
        l: usize,
        x: &Tensor,
    ) -> Result<Tensor, WorkerError> {
        let style = self.plan.styles[l];
        let [w, b] = working(&self.working, &self.params, l);
        let bias = (style != Style::Row).then_some(b);
        // The watchdog sees a chip inside a kernel as computing, not as stuck.
        chip.recorder().compute_started();
        let (mut z, cost) = match self.layers[l].kind {
            LayerKind::Linear => mlp::linear(x, w, bias)?,
            LayerKind::Embedding => model::embedding(x, w)?,
        };
        self.tl.compute(chip, cost);
        if style == Style::Row {
            // Each chip holds a partial sum over its slice of the input features.
            z = self.tp_all_reduce(chip, z).await?;
            let [_, b] = working(&self.working, &self.params, l);
            let cost = mlp::add_bias(&mut z, b)?;
            self.tl.compute(chip, cost);
        }
        let cost = match self.layers[l].after {
            After::None => Cost::default(),
            After::Relu => mlp::relu(&mut z),
            after => {
                // Ops that narrow the width (attention, SwiGLU) hand the next layer what it
                // takes on this chip; their input is saved for backward as well.
                let width = match after {
                    After::Attention { .. } | After::SwiGlu => {
                        let saved = z.bytes(self.elem);
                        self.hbm.alloc(MemKind::Activations, saved, || {
                            format!("saved input of the op after layer {l}")
                        })?;
                        self.saved[l] = saved;
                        self.compute_shape(chip, l + 1, 0)[1]
                    }
                    _ => z.shape()[1],
                };
                model::after_forward(after, &mut z, width)
            }
        };
        self.tl.compute(chip, cost);
        Ok(z)
    }

    /// Backward of layer `l`: accumulates its gradients, returns the input gradient.
    async fn layer_backward(
        &mut self,
        chip: &mut Chip,
        l: usize,
        x: &Tensor,
        dz: &Tensor,
    ) -> Result<Option<Tensor>, WorkerError> {
        let [w, _] = working(&self.working, &self.params, l);
        chip.recorder().compute_started();
        let (dw, db, dx, cost) = match self.layers[l].kind {
            LayerKind::Linear => mlp::linear_backward(x, w, dz, l > 0)?,
            LayerKind::Embedding => {
                let (dw, db, cost) = model::embedding_backward(x, w);
                (dw, db, None, cost)
            }
        };
        self.tl.compute(chip, cost);
        let dx = match (dx, self.plan.styles[l]) {
            // Column-parallel: each chip's input gradient covers only its output features.
            (Some(dx), Style::Column) => Some(self.tp_all_reduce(chip, dx).await?),
            (dx, _) => dx,
        };
        for (which, g) in [dw, db].into_iter().enumerate() {
            let name = self.params[2 * l + which].name.clone();
            let p = &mut self.params[2 * l + which];
            match (&mut p.grad, g) {
                (Some(Tensor::Data(acc)), Tensor::Data(g)) => *acc += &g,
                (Some(_), _) => {}
                (slot @ None, g) => {
                    if self.sharded {
                        self.hbm.alloc(MemKind::Transient, g.bytes(self.elem), || {
                            format!("unsharded gradient of {name}")
                        })?;
                    }
                    *slot = Some(g);
                }
            }
        }
        Ok(dx)
    }

    async fn tp_all_reduce(&mut self, chip: &mut Chip, t: Tensor) -> Result<Tensor, WorkerError> {
        let Some(dim) = self.plan.tp_dim() else {
            return Err(WorkerError::Internal(
                "a tensor-parallel layer without a tp dimension".into(),
            ));
        };
        let issued = self.tl.begin(chip, Stream::Tensor, false);
        let out = chip
            .all_reduce(&self.plan.mesh.comm(dim), &t.to_payload(), ReduceOp::Sum)
            .await?;
        self.tl.end(chip, issued);
        Tensor::from_payload(out, t.shape())
    }

    /// Gathers layer `l`'s parameters over the shard dimension (on the gather stream in fused
    /// mode: compute waits only when it needs them).
    async fn prefetch(&mut self, chip: &mut Chip, l: usize) -> Result<(), WorkerError> {
        let Some(dim) = self.plan.shard_dim() else {
            return Ok(());
        };
        if self.working[l].is_some() {
            return Ok(());
        }
        let bytes: u64 = (0..2)
            .map(|which| {
                let shape = self.compute_shape(chip, l, which);
                self.elem * shape.iter().product::<usize>() as u64
            })
            .sum();
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
                return Err(WorkerError::Internal(
                    "a coalesced gather lost a tensor".into(),
                ));
            };
            [w, b]
        } else {
            let w = w
                .redistribute(chip, &self.plan.compute(l, 0))
                .await?
                .into_local();
            let b = b
                .redistribute(chip, &self.plan.compute(l, 1))
                .await?
                .into_local();
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
    async fn unshard(&mut self, chip: &mut Chip, l: usize) -> Result<(), WorkerError> {
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

    /// Gradient sync of layer `l`'s parameters once its backward is done.
    async fn sync_layer(&mut self, chip: &mut Chip, l: usize) -> Result<(), WorkerError> {
        let grads: Vec<DTensor> = (0..2)
            .map(|which| {
                let p = &self.params[2 * l + which];
                let g = p
                    .grad
                    .clone()
                    .unwrap_or_else(|| Tensor::zeros(p.stored.local().shape(), self.spec.meta));
                p.stored.with_local(g, &self.plan.gradient(l, which))
            })
            .collect();
        let synced: Vec<Tensor> = if !self.overlapped() {
            // As written: one collective (or one chain of them) per parameter, bias first
            // (reverse parameter order, as DDP sees them become ready).
            let mut out = vec![None, None];
            for which in [1, 0] {
                let issued = self.tl.begin(chip, Stream::Reduce, false);
                let g = grads[which]
                    .redistribute(chip, &self.plan.stored(l, which))
                    .await?;
                self.tl.end(chip, issued);
                out[which] = Some(g.into_local());
            }
            out.into_iter().flatten().collect()
        } else if let Some(dim) = self.plan.shard_dim() {
            // FSDP: the layer's gradients in one reduce-scatter (then HSDP's all-reduce).
            let issued = self.tl.begin(chip, Stream::Reduce, true);
            let mut g =
                dtensor::reduce_scatter(chip, &[&grads[0], &grads[1]], dim, ReduceOp::Avg, 0)
                    .await?;
            if let Some(rep) = self.plan.replicate_dim() {
                g = dtensor::all_reduce(chip, &[&g[0], &g[1]], rep, ReduceOp::Avg).await?;
            }
            self.tl.end(chip, issued);
            g.into_iter().map(DTensor::into_local).collect()
        } else if self.plan.replicate_dim().is_some() {
            // DDP: the gradients wait in their buckets.
            for (which, g) in grads.into_iter().enumerate() {
                self.params[2 * l + which].synced = Some(g.into_local());
            }
            return self.issue_ready_buckets(chip).await;
        } else {
            grads.into_iter().map(DTensor::into_local).collect()
        };
        for (which, g) in synced.into_iter().enumerate() {
            self.finish_grad(2 * l + which, g);
        }
        Ok(())
    }

    fn finish_grad(&mut self, index: usize, g: Tensor) {
        let p = &mut self.params[index];
        if let Some(unsharded) = p.grad.take()
            && self.sharded
        {
            self.hbm
                .free(MemKind::Transient, unsharded.bytes(self.elem));
        }
        p.synced = Some(g);
    }

    /// Fused DDP: all-reduces, in bucket order, every bucket whose gradients are all ready.
    async fn issue_ready_buckets(&mut self, chip: &mut Chip) -> Result<(), WorkerError> {
        let Some(dim) = self.plan.replicate_dim() else {
            return Ok(());
        };
        while let Some(bucket) = self.buckets.get(self.next_bucket) {
            if bucket.iter().any(|&i| self.params[i].synced.is_none()) {
                return Ok(());
            }
            let bucket = bucket.clone();
            let grads: Vec<DTensor> = bucket
                .iter()
                .map(|&i| {
                    let p = &self.params[i];
                    let g = p
                        .synced
                        .clone()
                        .unwrap_or_else(|| Tensor::zeros(p.stored.local().shape(), true));
                    p.stored
                        .with_local(g, &self.plan.gradient(p.layer, p.which))
                })
                .collect();
            let refs: Vec<&DTensor> = grads.iter().collect();
            let issued = self.tl.begin(chip, Stream::Reduce, true);
            let reduced = dtensor::all_reduce(chip, &refs, dim, ReduceOp::Avg).await?;
            self.tl.end(chip, issued);
            for (&i, g) in bucket.iter().zip(reduced) {
                self.finish_grad(i, g.into_local());
            }
            self.next_bucket += 1;
        }
        Ok(())
    }

    fn optimizer_step(&mut self, chip: &mut Chip) -> Result<(), WorkerError> {
        let spec: &OptimizerSpec = &self.spec.optimizer;
        for p in &mut self.params {
            let g = p.synced.take().ok_or_else(|| {
                WorkerError::Internal(format!(
                    "no synced gradient for {} at the optimizer step",
                    p.name
                ))
            })?;
            let n = p.stored.local().numel();
            let reads = 2.0 + spec.state_per_param() as f64;
            chip.recorder().compute_started();
            if let (Some(param), Some(g)) = (p.stored.local_mut().values_mut(), g.values()) {
                p.state.step(spec, param, g);
            }
            self.tl
                .compute(chip, Cost::elementwise(n, spec.flops_per_param(), reads));
            p.grad = None;
        }
        self.next_bucket = 0;
        Ok(())
    }

    /// Debug mode: chips that hold the same piece of a parameter must hold the same values.
    async fn check_replicas(&mut self, chip: &mut Chip, step: u32) -> Result<(), WorkerError> {
        // Group parameters by the chips that replicate them (mesh dimensions where they are
        // Replicate), one exchange of hashes per group.
        let mut groups: Vec<(Group, Vec<usize>)> = Vec::new();
        for (i, p) in self.params.iter().enumerate() {
            let mut g = Group::of(&[]);
            for (d, pl) in p.stored.placements().iter().enumerate() {
                if *pl == Placement::Replicate {
                    for a in self.plan.mesh.dims()[d].group.axes(chip.pod()) {
                        g = g.with(a);
                    }
                }
            }
            if g.size(chip.pod()) < 2 {
                continue;
            }
            match groups.iter_mut().find(|(h, _)| *h == g) {
                Some((_, v)) => v.push(i),
                None => groups.push((g, vec![i])),
            }
        }
        for (group, members) in groups {
            let hashes: Vec<u64> = members
                .iter()
                .map(|&i| bits_hash(self.params[i].stored.local()))
                .collect();
            let comm = Comm::new(group, self.spec.algo).verified(true);
            if let Some((peer, k)) = first_mismatch(chip, &comm, &hashes).await? {
                return Err(WorkerError::Diverged {
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
    fn save(&self) -> Vec<Vec<f32>> {
        let mut out = Vec::new();
        for p in &self.params {
            out.push(
                p.stored
                    .local()
                    .values()
                    .map(|v| v.iter().copied().collect())
                    .unwrap_or_default(),
            );
            let state = p.state.save();
            out.push(vec![f32::from_bits(state.len() as u32)]);
            out.extend(state);
        }
        out
    }

    fn restore(&mut self, saved: &[Vec<f32>]) -> Result<(), WorkerError> {
        let bad = || WorkerError::Invalid("a checkpoint that does not fit this job".into());
        let mut it = saved.iter();
        for p in &mut self.params {
            let shape = p.stored.local().shape().to_vec();
            let values = it.next().ok_or_else(bad)?;
            *p.stored.local_mut() = Tensor::from_vec(&shape, values.clone())?;
            let n = it.next().and_then(|c| c.first()).ok_or_else(bad)?.to_bits() as usize;
            let state: Vec<Vec<f32>> = it.by_ref().take(n).cloned().collect();
            p.state = ParamState::load(&state, &shape).ok_or_else(bad)?;
        }
        Ok(())
    }

    /// Every parameter, whole, on every chip (weight and bias of each layer in order).
    async fn full_parameters(&mut self, chip: &mut Chip) -> Result<Vec<Tensor>, WorkerError> {
        let mut out = Vec::with_capacity(self.params.len());
        for p in &self.params {
            out.push(p.stored.full_tensor(chip).await?);
        }
        Ok(out)
    }
}
