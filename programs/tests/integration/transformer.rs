#![allow(clippy::unwrap_used)]
//! The transformer cost model in meta mode against hand calculations: flops per step, bytes
//! each strategy moves, persistent memory, the out-of-memory verdict, and the mirror fabric
//! against every chip simulated.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::common::run_on_chips;
use podsim_collectives::{Algo, Chip, DType, LocalFabric, mirror_chips};
use podsim_programs::train::{
    AttentionKind, BlockKind, ChipTrainReport, Eager, GradReduce, MlpKind, ModelSpec,
    OptimizerSpec, Remat, Strategy, TpActivations, TrainSpec, TransformerSpec, train_chip,
};
use podsim_topology::{Hardware, Pod};

/// Every output dimension divides by 16: no `torch.chunk` padding on up to 16 chips.
fn model(d_model: usize, ffn: usize, vocab: usize) -> TransformerSpec {
    TransformerSpec {
        layers: 2,
        d_model,
        heads: 4,
        kv_heads: 4,
        head_dim: d_model / 4,
        ffn,
        mlp: MlpKind::Gelu,
        block: BlockKind::Sequential,
        attention: AttentionKind::Flash,
        vocab,
        tied_embeddings: false,
        seq: 64,
        dtype: DType::Bf16,
        weight_dtype: DType::F32,
        bias: false,
        upcast: false,
    }
}

fn spec(strategy: Strategy, m: &TransformerSpec, steps: u32) -> TrainSpec {
    TrainSpec {
        strategy,
        eager: Eager::Fused,
        model: ModelSpec::Transformer(m.clone()),
        steps,
        batch: 2,
        grad_accum: 1,
        optimizer: OptimizerSpec::Adamw {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        seed: 0,
        bucket_cap_mb: 25.0,
        reshard_after_forward: true,
        tp: 4,
        replicas: 4,
        algo: Algo::Ring,
        meta: true,
        check: false,
        checkpoint_every: 0,
        checkpoint_dir: None,
        resume_from: None,
        symmetric: true,
        remat: Remat::default(),
        tp_activations: TpActivations::Replicated,
        replica_sync: Default::default(),
        grad_reduce: Default::default(),
        reduce_dtype: None,
    }
}

/// Trains on every chip of `shape` (or, on a mirror fabric, on one chip per class of chips
/// alike under the job's symmetry: chip 0 alone when it is symmetric under every translation);
/// each chip's report and the bytes it sent.
fn run(spec: &TrainSpec, shape: &str, hw: Hardware, mirror: bool) -> Vec<(ChipTrainReport, u64)> {
    let pod = Pod::single(shape.parse().unwrap());
    let chips: Vec<Chip> = if mirror {
        let symmetry = spec.symmetry(&pod);
        mirror_chips(pod, hw, &symmetry)
    } else {
        LocalFabric::new(pod, hw).chips()
    };
    let spec = spec.clone();
    run_on_chips(chips, move |mut chip| {
        let spec = spec.clone();
        async move {
            let report = train_chip(&mut chip, &spec, Arc::new(AtomicU64::new(0))).await?;
            let sent = chip.stats().bytes_sent.load(Ordering::Relaxed);
            Ok((report, sent))
        }
    })
    .unwrap()
}

/// `spec` on the mirror fabric gives every step the time of the slowest chip of the full
/// simulation on `shape`, and the same peak HBM (`what` names the case in failures); the
/// mirror simulated this many chips.
fn mirror_matches_every_chip(spec: &TrainSpec, shape: &str, what: &str) -> usize {
    let full = run(spec, shape, v5p(), false);
    let mirror = run(spec, shape, v5p(), true);
    let slowest = |reports: &[(ChipTrainReport, u64)], step: usize| {
        reports
            .iter()
            .map(|(r, _)| r.steps[step].virtual_ns)
            .fold(0.0, f64::max)
    };
    for step in 0..spec.steps as usize {
        let (mirrored, every) = (slowest(&mirror, step), slowest(&full, step));
        assert!(
            (mirrored - every).abs() <= 1e-9 * every,
            "{what} step {step}: mirror {mirrored} ns, every chip {every} ns"
        );
    }
    let peak =
        |reports: &[(ChipTrainReport, u64)]| reports.iter().map(|(r, _)| r.hbm.peak_bytes).max();
    assert_eq!(peak(&mirror), peak(&full), "{what}");
    mirror.len()
}

fn v5p() -> Hardware {
    Hardware::preset("v5p").unwrap()
}

/// Bytes chip 0 sends in one step: two runs, one step apart (the final gather of the
/// parameters for the report is the same in both).
fn bytes_per_step(strategy: Strategy, m: &TransformerSpec, shape: &str) -> f64 {
    let one = run(&spec(strategy, m, 1), shape, v5p(), false)[0].1;
    let two = run(&spec(strategy, m, 2), shape, v5p(), false)[0].1;
    (two - one) as f64
}

#[test]
fn a_dense_step_costs_six_flops_per_weight_per_token_plus_attention() {
    let m = model(256, 1024, 512);
    let s = spec(Strategy::Ddp, &m, 1);
    let reports = run(&s, "4", v5p(), false);
    let tokens = (s.batch * m.seq) as f64;
    // Hand count: weights of the products (the embedding lookup is none) ...
    let d = 256.0;
    let weights = 2.0 * (d * 3.0 * d + d * d + d * 1024.0 + 1024.0 * d) + d * 512.0;
    // ... six flops each per token, and causal attention's 6 * seq * heads * head_dim per
    // token per block (QK^T and AV over half the scores, forward and backward).
    let want = 6.0 * weights * tokens + 6.0 * 2.0 * 64.0 * d * tokens;
    assert_eq!(s.model.step_flops(s.batch as f64), want);
    for (r, _) in &reports {
        let charged = r.steps[0].flops;
        // Charged on top: biases, GELU, norms, softmax, the optimizer (a few percent).
        assert!(
            charged >= want && charged < 1.03 * want,
            "chip {} charged {charged} flops, model {want}",
            r.chip
        );
    }
}

#[test]
fn fsdp_moves_three_times_the_parameters_per_step_and_ddp_twice() {
    let m = model(64, 128, 128);
    let p = ModelSpec::Transformer(m.clone()).parameters() as f64;
    let (n, bf16) = (4.0, 2.0);
    // Ring collectives send (n-1)/n of the buffer per chip: FSDP gathers every layer before
    // forward and again before backward and reduce-scatters its gradients; DDP all-reduces.
    let fsdp = bytes_per_step(Strategy::Fsdp, &m, "4");
    assert_eq!(fsdp, 3.0 * p * bf16 * (n - 1.0) / n);
    let ddp = bytes_per_step(Strategy::Ddp, &m, "4");
    assert_eq!(ddp, 2.0 * p * bf16 * (n - 1.0) / n);
}

#[test]
fn persistent_memory_is_sixteen_bytes_a_parameter_with_adamw_in_bf16() {
    let m = model(64, 128, 128);
    let p = ModelSpec::Transformer(m.clone()).parameters() as u64;
    // bf16 parameter and gradient, f32 master copy and two f32 moments: 2 + 2 + 12.
    let ddp = run(&spec(Strategy::Ddp, &m, 1), "4", v5p(), false);
    assert!(ddp.iter().all(|(r, _)| r.hbm.peak_state_bytes == 16 * p));
    let fsdp = run(&spec(Strategy::Fsdp, &m, 1), "4", v5p(), false);
    assert!(
        fsdp.iter()
            .all(|(r, _)| r.hbm.peak_state_bytes == 16 * p / 4)
    );
    assert!(ddp[0].0.hbm.oom.is_none());
}

#[test]
fn a_model_that_does_not_fit_gets_a_verdict_and_still_a_step_time() {
    let m = model(64, 128, 128);
    let mut hw = v5p();
    hw.hbm_bytes = (1u64 << 20) as f64;
    let out = run(&spec(Strategy::Ddp, &m, 1), "4", hw, false);
    for (r, _) in &out {
        let oom = r.hbm.oom.as_deref().expect("an out-of-memory verdict");
        assert!(oom.contains("out of"), "{oom}");
        assert!(r.hbm.peak_bytes > 1 << 20);
        assert!(r.steps[0].virtual_ns > 0.0);
    }
}

#[test]
fn one_mirrored_chip_predicts_the_step_of_every_chip() {
    let m = model(64, 128, 128);
    for strategy in [
        Strategy::Ddp,
        Strategy::Fsdp,
        Strategy::Hsdp,
        Strategy::Tp,
        Strategy::FsdpTp,
    ] {
        let mut s = spec(strategy, &m, 2);
        s.algo = Algo::Torus;
        s.tp = if strategy == Strategy::Tp { 16 } else { 4 };
        mirror_matches_every_chip(&s, "4x4", &strategy.to_string());
    }
    // Tensor parallelism on the z ring of a 3D torus (the whole-axes mesh layout), the
    // activations between its regions sharded.
    let mut s = spec(Strategy::FsdpTp, &m, 2);
    s.algo = Algo::Torus;
    s.tp = 4;
    s.tp_activations = TpActivations::Sharded;
    assert_eq!(mirror_matches_every_chip(&s, "2x2x4", "fsdp+tp on z"), 1);
    // 8-way tensor parallelism on 4x4 takes x and a pair of neighbours along y: chips at
    // even and odd y differ, and one of each stands for all.
    s.tp = 8;
    s.replicas = 1;
    assert_eq!(
        mirror_matches_every_chip(&s, "4x4", "fsdp+tp on a segment"),
        2
    );
}

/// The report of one step of `m` under DDP on one mirrored chip of a 4-chip ring with
/// `remat`.
fn remat_report(m: &TransformerSpec, remat: &str) -> ChipTrainReport {
    let mut s = spec(Strategy::Ddp, m, 1);
    s.remat = remat.parse().unwrap();
    run(&s, "4", v5p(), true)[0].0.clone()
}

/// That step.
fn remat_step(m: &TransformerSpec, remat: &str) -> podsim_programs::train::StepRecord {
    remat_report(m, remat).steps[0].clone()
}

#[test]
fn full_remat_recomputes_one_forward_of_every_block_but_its_tail() {
    let m = TransformerSpec {
        bias: true,
        ..model(64, 128, 128)
    };
    let (t, d, f, q, qkv, seq, layers) = (128.0, 64.0, 128.0, 64.0, 192.0, 64.0, 2.0);
    // Hand count of one block's forward: the four matmuls, their biases, RoPE on q and k,
    // causal attention (QK^T and PV over half the scores), GELU, two residual + norm passes.
    let matmuls = 2.0 * t * (d * qkv + q * d + d * f + f * d);
    let biases = t * (qkv + d + f + d);
    let rope = 6.0 * t * (4.0 + 4.0) * 16.0;
    let attention = 2.0 * t * seq * q;
    let elementwise = 8.0 * t * f + 2.0 * 8.0 * t * d;
    let block = matmuls + biases + rope + attention + elementwise;
    // Except its tail: the MLP's output projection, its bias and the residual + norm after
    // it make only the block's output, which is kept as the next block's input. Backward
    // reads none of them, so none runs again (XLA drops a recomputation nothing reads).
    let tail = 2.0 * t * f * d + t * d + 8.0 * t * d;
    let none = remat_step(&m, "none");
    let full = remat_step(&m, "full");
    let extra = full.flops - none.flops;
    assert!(
        (extra - layers * (block - tail)).abs() < 1e-9 * extra,
        "recomputed {extra} flops, one forward of the blocks but their tails is {}",
        layers * (block - tail)
    );
    assert!(full.virtual_ns > none.virtual_ns);
    // Full remat keeps each block's input only.
    assert!(full.activations_bytes < none.activations_bytes);
}

#[test]
fn no_policy_runs_a_blocks_last_matmul_again() {
    // The block's last matmul (`wo`; the fused `[out | wo]` of a parallel block) only makes
    // the block's output, which is kept as the next block's input: keeping its output or not
    // must change nothing, for either kind of block, under swiglu as under gelu, and under a
    // policy that keeps other outputs as under `full`. Before, those policies ran it again and
    // cost more than the same policy naming it.
    for (block, mlp, policy, with_last) in [
        (
            BlockKind::Sequential,
            MlpKind::Gelu,
            "full",
            "custom:mlpwo=device",
        ),
        (
            BlockKind::Sequential,
            MlpKind::Swiglu,
            "full",
            "custom:mlpwo=device",
        ),
        (
            BlockKind::Parallel,
            MlpKind::Relu,
            "full",
            "custom:out_proj=device+mlpwo=device",
        ),
        (
            BlockKind::Sequential,
            MlpKind::Gelu,
            "save_qkv_proj",
            "custom:qkv_proj=device+mlpwo=device",
        ),
    ] {
        let mut m = model(64, 128, 128);
        (m.block, m.mlp) = (block, mlp);
        let without = remat_step(&m, policy);
        let with = remat_step(&m, with_last);
        let what = format!("{block:?} {mlp:?} {policy}");
        assert_eq!(without.flops, with.flops, "{what}");
        assert_eq!(without.virtual_ns, with.virtual_ns, "{what}");
        assert_eq!(without.activations_bytes, with.activations_bytes, "{what}");
        assert!(without.flops > remat_step(&m, "none").flops, "{what}");
    }
}

#[test]
fn minimal_remat_keeps_exactly_the_matmul_outputs_backward_reads() {
    let m = model(64, 128, 128);
    let (t, d, f, qkv, vocab) = (128u64, 64u64, 128u64, 192u64, 128u64);
    let bf16 = 2;
    let minimal = remat_step(&m, "minimal");
    // The token ids (one bf16-sized id per token), the embedding's output (block 0's input), per block the outputs of
    // qkv, the attention projection and the MLP's input projection and the block's output
    // (the MLP's output projection only feeds the residual sum that leaves the block), and
    // the logits.
    let ids = t * bf16;
    let per_block = t * (qkv + d + f + d) * bf16;
    let want = ids + t * d * bf16 + 2 * per_block + t * vocab * bf16;
    assert_eq!(minimal.activations_bytes, want);
    // Element-wise ops and attention run again in backward: more flops than no remat,
    // fewer than full.
    let (none, full) = (remat_step(&m, "none"), remat_step(&m, "full"));
    assert!(none.flops < minimal.flops && minimal.flops < full.flops);
    // PyTorch's selective checkpointing of every matmul is the same policy.
    let sac = remat_step(&m, "selective:mm");
    assert_eq!(
        (sac.activations_bytes, sac.flops),
        (minimal.activations_bytes, minimal.flops)
    );
}

#[test]
fn maxtexts_other_policies_keep_what_they_name() {
    let m = model(64, 128, 128);
    let (t, d, f, q, qkv) = (128u64, 64u64, 128u64, 64u64, 192u64);
    let (bf16, blocks) = (2, 2);
    let minimal = remat_step(&m, "minimal");
    // `minimal_offloaded`: the same matmul outputs (qkv, the attention projection, the MLP's
    // input projection) in host memory instead, out in forward and back before backward;
    // the same recomputation.
    let offloaded = remat_step(&m, "minimal_offloaded");
    let per_block = t * (qkv + d + f) * bf16;
    assert_eq!(offloaded.host_activations_bytes, blocks * per_block);
    assert_eq!(offloaded.host_transfer_bytes, 2 * blocks * per_block);
    assert_eq!(
        offloaded.activations_bytes,
        minimal.activations_bytes - blocks * per_block
    );
    assert_eq!(offloaded.flops, minimal.flops);
    // `minimal_with_context`: also the attention output, so attention is not run again.
    let context = remat_step(&m, "minimal_with_context");
    assert_eq!(
        context.activations_bytes,
        minimal.activations_bytes + blocks * t * q * bf16
    );
    assert!(context.flops < minimal.flops);
    // Keeping less recomputes more: the attention projection alone, then q, k, v with it,
    // then `minimal`.
    let out = remat_step(&m, "save_out_proj");
    let except_mlp = remat_step(&m, "save_dot_except_mlp");
    assert!(out.flops > except_mlp.flops && except_mlp.flops > minimal.flops);
    assert!(out.activations_bytes < except_mlp.activations_bytes);
    assert!(except_mlp.activations_bytes < minimal.activations_bytes);
}

#[test]
fn dot_product_attention_materialises_the_whole_score_square() {
    let flash = model(64, 128, 128);
    let dot = TransformerSpec {
        attention: AttentionKind::DotProduct,
        ..flash.clone()
    };
    // 2 sequences of 64 tokens a chip (DDP), 4 heads of 16, 2 blocks.
    let (seqs, heads, seq, head_dim, layers) = (2.0, 4.0, 64.0, 16.0, 2.0);
    let square = seqs * heads * seq * seq;
    // One product over the whole square: 2 flops per score per head dimension.
    let product = 2.0 * square * head_dim;
    // Flash: QK^T and PV forward, QK^T again with dV, dP, dQ and dK backward, each over the
    // causal half. Materialised: QK^T and PV forward, dP, dV, dQ and dK backward, each over
    // the whole square, plus the softmax (5 flops a score) and its backward (4).
    let flash_core = 7.0 * product / 2.0;
    let dot_core = 6.0 * product + 9.0 * square;
    let (f, d) = (remat_step(&flash, "none"), remat_step(&dot, "none"));
    let extra = d.flops - f.flops;
    let want = layers * (dot_core - flash_core);
    assert!((extra - want).abs() < 1e-9 * want, "{extra} against {want}");
    // Without remat each block keeps its probabilities (bf16) for backward.
    let bf16 = 2;
    assert_eq!(
        d.activations_bytes - f.activations_bytes,
        layers as u64 * square as u64 * bf16
    );
    // Under full remat nothing more is kept; the recomputed forward of each block differs by
    // the two forward cores.
    let (ff, df) = (remat_step(&flash, "full"), remat_step(&dot, "full"));
    assert_eq!(df.activations_bytes, ff.activations_bytes);
    let recomputed = (df.flops - d.flops) - (ff.flops - f.flops);
    let want = layers * (2.0 * product + 5.0 * square - product);
    assert!(
        (recomputed - want).abs() < 1e-9 * want,
        "{recomputed} against {want}"
    );
    // A policy that keeps q, k, v and the attention output keeps no probabilities (no policy
    // names them): flash attention does not run again, materialised attention (RoPE, then the
    // forward core) does.
    let policy = "custom:qkv_proj=device+context=device";
    let (fc, dc) = (remat_step(&flash, policy), remat_step(&dot, policy));
    // RoPE: 6 flops per element of q and k (64 wide each) on the chip's 128 tokens.
    let (tokens, q_width, k_width) = (128.0, 64.0, 64.0);
    let rope = 6.0 * tokens * (q_width + k_width);
    let recomputed = (dc.flops - fc.flops) - (d.flops - f.flops);
    let want = layers * (2.0 * product + 5.0 * square + rope);
    assert!(
        (recomputed - want).abs() < 1e-9 * want,
        "{recomputed} against {want}"
    );
}

#[test]
fn materialised_scores_that_do_not_fit_are_out_of_memory() {
    // 8192-token sequences: one head's bf16 score square is 128 MiB, 32 heads 4 GiB a
    // sequence; in 16 GiB of HBM the flash kernel fits and the materialised scores do not.
    let mut flash = model(2048, 8192, 32000);
    flash.seq = 8192;
    flash.heads = 32;
    flash.kv_heads = 32;
    flash.head_dim = 64;
    let dot = TransformerSpec {
        attention: AttentionKind::DotProduct,
        ..flash.clone()
    };
    let hbm = |m: &TransformerSpec| {
        let mut s = spec(Strategy::Fsdp, m, 1);
        s.remat = "full".parse().unwrap();
        let mut hw = v5p();
        hw.hbm_bytes = 16.0 * (1u64 << 30) as f64;
        run(&s, "4", hw, true)[0].0.hbm.clone()
    };
    assert!(hbm(&flash).oom.is_none(), "{:?}", hbm(&flash));
    let oom = hbm(&dot).oom.expect("materialised scores fit");
    assert!(oom.contains("attention scores"), "{oom}");
}

#[test]
fn offloaded_tensors_cross_the_host_link_twice() {
    let m = model(64, 128, 128);
    let (t, d, q, kv) = (128u64, 64u64, 64u64, 64u64);
    let step = remat_step(
        &m,
        "custom:query_proj=offload+key_proj=offload+out_proj=offload",
    );
    // Per block: q and k (t x 64 each) and the attention projection's output (t x 64), out
    // to host in forward and back before backward.
    let per_block = t * (q + kv + d) * 2;
    assert_eq!(step.host_transfer_bytes, 2 * 2 * per_block);
    // Both blocks' tensors are in host memory when the forward ends.
    assert_eq!(step.host_activations_bytes, 2 * per_block);
    assert_eq!(remat_step(&m, "full").host_transfer_bytes, 0);
    assert_eq!(remat_step(&m, "full").host_activations_bytes, 0);
}

#[test]
fn the_mirrored_chip_holds_with_sharded_activations_remat_and_replicas() {
    // What `podsim compare` runs: fsdp x tp within the pod, sharded activations, a remat
    // policy with an offloaded tensor, data parallelism over the outermost axis; and
    // materialised attention, kept (no remat) or recomputed.
    let flash = model(64, 128, 128);
    let dot = TransformerSpec {
        attention: AttentionKind::DotProduct,
        ..flash.clone()
    };
    for (m, remat) in [
        (&flash, "full"),
        (&flash, "save_dot_except_mlpwi"),
        (&flash, "custom:query_proj=offload"),
        (&dot, "none"),
        (&dot, "save_dot_except_mlpwi"),
    ] {
        let mut s = spec(Strategy::FsdpTp, m, 2);
        s.algo = Algo::Torus;
        s.tp = 4;
        s.replicas = 2;
        s.tp_activations = TpActivations::Sharded;
        s.remat = remat.parse().unwrap();
        mirror_matches_every_chip(&s, "4x2x2", remat);
    }
}

#[test]
fn fsdp_gathers_the_next_block_whole_under_the_current_one() {
    // Blocks whose compute far outlasts their gathers: what stays exposed is the first
    // block's gather and the last reduce-scatter, whatever the depth. Gathering layer by layer
    // would leave each block's first gathers exposed behind its rematerialisation.
    let exposed = |layers: usize| {
        let mut m = model(1024, 4096, 1024);
        m.layers = layers;
        m.seq = 2048;
        let mut s = spec(Strategy::Fsdp, &m, 1);
        s.batch = 8;
        s.remat = "full".parse().unwrap();
        let step = run(&s, "16", v5p(), true)[0].0.steps[0].clone();
        assert!(step.comm_ns > 0.0);
        step.virtual_ns - step.compute_ns
    };
    let (shallow, deep) = (exposed(2), exposed(6));
    assert!(
        (deep - shallow).abs() < 0.01 * shallow,
        "exposed communication {shallow} ns with 2 blocks, {deep} ns with 6"
    );
}

#[test]
fn full_remat_gathers_each_regions_input_once_more_than_no_remat() {
    // Tensor parallelism over 4 chips with activations sharded between regions. Without
    // remat each region's backward gathers its input again (forward kept it sharded); full
    // remat's recomputation gathers it and the region's backward reads that very tensor, so
    // the only extra traffic is the recomputed output's reduce-scatter: one pass over the
    // region's activations per recomputed region, not two. The MLP region's output is the
    // block's, kept as the next block's input, so it is not recomputed: one region a block.
    let m = model(64, 128, 128);
    let sent = |remat: &str| {
        let mut s = spec(Strategy::Tp, &m, 1);
        s.tp_activations = TpActivations::Sharded;
        s.remat = remat.parse().unwrap();
        run(&s, "4", v5p(), false)[0].1
    };
    let (tokens, d, bf16, n) = (128u64, 64u64, 2u64, 4u64);
    let recomputed_regions = m.layers as u64;
    let one_pass = tokens * d * bf16 * (n - 1) / n;
    assert_eq!(sent("full") - sent("none"), recomputed_regions * one_pass);
}

#[test]
fn a_prefetch_that_would_not_fit_waits_instead_of_running_out_of_memory() {
    // A vocabulary that 4 chips split unevenly: their shards differ, their ledgers must not.
    let mut m = model(256, 1024, 250);
    m.layers = 4;
    let fsdp = spec(Strategy::Fsdp, &m, 1);
    let strict = TrainSpec {
        eager: Eager::Strict,
        ..fsdp.clone()
    };
    let first = |out: Vec<(ChipTrainReport, u64)>| out.into_iter().next().unwrap().0;
    // Gathering one block ahead costs memory: without the overlap the peak is lower.
    let ahead = first(run(&fsdp, "4", v5p(), true));
    let on_demand = first(run(&strict, "4", v5p(), true));
    let (high, low) = (ahead.hbm.peak_bytes, on_demand.hbm.peak_bytes);
    assert!(high > low, "{high} {low}");
    // On a chip with less memory than the overlap needs, the gathers wait for room: the job
    // fits, and every chip takes the same decisions (their collectives stay in step: a chip
    // gathering while another reduces would never finish).
    let mut small = v5p();
    small.hbm_bytes = ((high + low) / 2) as f64;
    let tight = run(&fsdp, "4", small, false);
    // Shards are charged padded to the largest, as XLA and FSDP2 hold them: every chip's
    // ledger is the same, and so is every decision taken from it.
    let state = |r: &(ChipTrainReport, u64)| r.0.hbm.peak_state_bytes;
    assert!(tight.iter().all(|r| state(r) == state(&tight[0])));
    for (r, _) in &tight {
        assert!(r.hbm.oom.is_none(), "{:?}", r.hbm.oom);
        assert!(r.hbm.peak_bytes <= (high + low) / 2);
        // Some gathers still went ahead where they fit.
        assert!(r.hbm.peak_bytes > low, "{} {low}", r.hbm.peak_bytes);
    }
    // Below what the job needs without any overlap, it is a real out-of-memory verdict.
    let mut smaller = v5p();
    smaller.hbm_bytes = (low - 1) as f64;
    assert!(first(run(&fsdp, "4", smaller, true)).hbm.oom.is_some());
}

#[test]
fn fsdp2_reduces_in_its_reduce_dtype_a_whole_block_at_once() {
    let m = model(64, 128, 128);
    let p = ModelSpec::Transformer(m.clone()).parameters() as f64;
    let (n, bf16, f32) = (4.0, 2.0, 4.0);
    let fsdp2 = |reduce: Option<DType>, per_unit: bool| {
        let mut s = spec(Strategy::Fsdp, &m, 1);
        s.reduce_dtype = reduce;
        if per_unit {
            s.grad_reduce = GradReduce::PerUnit;
        }
        s
    };
    // The gathers (forward and backward) move bf16; the gradients go in f32: every gradient
    // once, whether a layer or a block at a time (no padding on 4 chips).
    let sent = |s: &TrainSpec| {
        let one = run(s, "4", v5p(), false)[0].1;
        let mut two = s.clone();
        two.steps = 2;
        (run(&two, "4", v5p(), false)[0].1 - one) as f64
    };
    let per_layer_sent = sent(&fsdp2(Some(DType::F32), false));
    assert_eq!(per_layer_sent, (2.0 * bf16 + f32) * p * (n - 1.0) / n);
    // FSDP2 does not reshard its root module (the layers outside blocks: embedding, final
    // norm, output) after forward: those are gathered once a step, the blocks twice.
    let one_block = TransformerSpec {
        layers: 1,
        ..m.clone()
    };
    let block = p - ModelSpec::Transformer(one_block).parameters() as f64;
    let root = p - 2.0 * block;
    let f32_reduce = sent(&fsdp2(Some(DType::F32), true));
    assert_eq!(f32_reduce, per_layer_sent - bf16 * root * (n - 1.0) / n);
    // Memory: a block's gradients wait for its end, then its f32 copy (twice their bytes)
    // is held beside the next block's backward.
    let peak = |s: &TrainSpec| run(s, "4", v5p(), true)[0].0.hbm.peak_bytes;
    let (per_layer, per_unit) = (peak(&fsdp2(None, false)), peak(&fsdp2(None, true)));
    let widened = peak(&fsdp2(Some(DType::F32), true));
    assert!(
        per_layer < per_unit && per_unit < widened,
        "{per_layer} {per_unit} {widened}"
    );
    // Prefetches leave room for the copy-in: once a chip holds what the job needs, more
    // memory never makes it run out (a prefetch that forgot the copy-in would go ahead and
    // leave the copy-in no room).
    for (reduce, per_unit) in [
        (Some(DType::F32), false),
        (None, true),
        (Some(DType::F32), true),
    ] {
        let s = fsdp2(reduce, per_unit);
        let fits = |bytes: u64| {
            let mut hw = v5p();
            hw.hbm_bytes = bytes as f64;
            run(&s, "4", hw, true)[0].0.hbm.oom.is_none()
        };
        let high = peak(&s);
        let steps = 40;
        let verdicts: Vec<bool> = (0..=steps)
            .map(|i| fits(high / 2 + high / 2 * i / steps))
            .collect();
        let first = verdicts.iter().position(|f| *f).unwrap();
        assert!(
            verdicts[first..].iter().all(|f| *f),
            "{reduce:?} {per_unit}: {verdicts:?}"
        );
    }
    // The mirror holds with blocks reduced whole, replicas included.
    for strategy in [Strategy::Fsdp, Strategy::Hsdp] {
        let mut s = fsdp2(Some(DType::F32), true);
        s.strategy = strategy;
        s.steps = 2;
        s.algo = Algo::Torus;
        mirror_matches_every_chip(&s, "4x4", &format!("{strategy} per unit"));
    }
}

#[test]
fn torch_checkpoint_holds_what_its_recomputed_block_saves_for_backward() {
    // The same recomputation as `full` (the same time), but the recomputed forward saves what
    // each op's backward reads, as autograd does: q, k, v for attention, the MLP's input to
    // its activation, held together until their backward.
    let m = model(256, 1024, 512);
    let step = |remat: &str| {
        let r = remat_report(&m, remat);
        (r.steps[0].virtual_ns, r.hbm.peak_bytes)
    };
    let ((full_ns, full_peak), (torch_ns, torch_peak)) = (step("full"), step("checkpoint"));
    assert_eq!(full_ns, torch_ns);
    // At least the last block's attention input (q, k, v of 2 x 64 tokens, bf16) on top.
    let qkv = 2 * 64 * 3 * 256 * 2;
    assert!(
        torch_peak >= full_peak + qkv,
        "full {full_peak}, checkpoint {torch_peak}"
    );
}

#[test]
fn a_model_without_biases_has_none_to_store_add_or_move() {
    let plain = model(64, 128, 128);
    let biased = TransformerSpec {
        bias: true,
        ..plain.clone()
    };
    let params = |m: &TransformerSpec| ModelSpec::Transformer(m.clone()).parameters();
    // One bias per product: embedding, 4 per block, LM head, each as wide as its output.
    let outputs = 64 + 2 * (3 * 64 + 64 + 128 + 64) + 128;
    assert_eq!(params(&biased) - params(&plain), outputs);
    for strategy in [Strategy::Ddp, Strategy::Fsdp, Strategy::FsdpTp] {
        for eager in [Eager::Fused, Eager::Strict] {
            let step = |m: &TransformerSpec| {
                let mut s = spec(strategy, m, 1);
                s.eager = eager;
                (s.tp, s.replicas) = (2, 1);
                run(&s, "4", v5p(), false)[0].0.steps[0].clone()
            };
            let (without, with) = (step(&plain), step(&biased));
            // The bias adds (forward) and their gradients (backward) are the difference.
            assert!(without.compute_ns < with.compute_ns, "{strategy} {eager:?}");
            assert!(without.flops < with.flops, "{strategy} {eager:?}");
        }
    }
}

#[test]
fn an_upcast_norm_keeps_its_f32_input_for_backward() {
    // PyTorch's Llama norms compute in f32 (`x.float()`), and autograd keeps that copy: two
    // norms a block, each its (tokens, d_model) input in f32. Memory only: the same step.
    let plain = model(256, 1024, 512);
    let upcast = TransformerSpec {
        upcast: true,
        ..plain.clone()
    };
    let step = |m: &TransformerSpec, remat: &str| {
        let r = remat_report(m, remat);
        (r.steps[0].virtual_ns, r.hbm.peak_by_kind["activations"])
    };
    let copies_per_block = 2 * (2 * 64) * 256 * 4;
    let (ns, kept) = step(&plain, "none");
    let (upcast_ns, upcast_kept) = step(&upcast, "none");
    assert_eq!(ns, upcast_ns);
    // Every block keeps everything (the peak at the end of the forward).
    assert_eq!(upcast_kept - kept, 2 * copies_per_block as u64);
    // Under torch's checkpoint only the recomputed block holds them, until its backward.
    let (_, recomputed) = step(&plain, "checkpoint");
    let (_, upcast_recomputed) = step(&upcast, "checkpoint");
    let extra = upcast_recomputed - recomputed;
    assert!(
        extra > 0 && extra <= copies_per_block as u64,
        "checkpoint: {extra} more bytes"
    );
}

#[test]
fn overlapped_communication_slows_only_kernels_bound_by_hbm() {
    // FSDP in fused mode gathers the next block beside the current one's kernels; in strict
    // mode compute waits for every collective, so nothing is in flight while a kernel runs.
    // The difference in compute is the HBM bandwidth the gathers and reductions took.
    // Each mode's compute, and what its kernels report they waited for HBM.
    let compute = |hw: Hardware, eager: Eager| {
        // 4,096 tokens a chip: matmuls large enough for v5p's MXU to set their time.
        let mut m = model(1024, 4096, 1024);
        m.layers = 4;
        m.seq = 1024;
        let mut s = spec(Strategy::Fsdp, &m, 1);
        s.batch = 4;
        s.eager = eager;
        let step = run(&s, "8", hw, true)[0].0.steps[0].clone();
        (step.compute_ns, step.hbm_wait_ns)
    };
    let slowed = |hw: Hardware| {
        let (fused, waited) = compute(hw.clone(), Eager::Fused);
        let (strict, none) = compute(hw, Eager::Strict);
        assert_eq!(none, 0.0, "strict mode waited for HBM");
        // The step reports the difference as its kernels' wait.
        assert!(
            (fused - strict - waited).abs() <= 1e-9 * fused,
            "fused {fused} ns, strict {strict} ns, waited {waited} ns"
        );
        fused / strict - 1.0
    };
    let v6e = Hardware::preset("v6e").unwrap();
    // v6e's matmuls are at the HBM roofline: they yield what the collectives take.
    let on_v6e = slowed(v6e.clone());
    assert!(
        on_v6e > 0.02,
        "v6e compute {on_v6e:+.4} beside its collectives"
    );
    // v5p's MXU is slower than its HBM at the block size: its matmuls hide the collectives,
    // and only its element-wise passes yield.
    let on_v5p = slowed(v5p());
    assert!(
        on_v5p > 0.0 && on_v5p < on_v6e / 4.0,
        "v5p compute {on_v5p:+.4}, v6e {on_v6e:+.4}"
    );
    // With HBM to spare every kernel hides the communication: the two modes' kernels are
    // the same ones.
    let mut wide = v6e;
    wide.hbm_bandwidth *= 1e3;
    let on_wide = slowed(wide);
    assert!(
        on_wide.abs() < 1e-6,
        "compute {on_wide:+e} with HBM to spare"
    );
}
