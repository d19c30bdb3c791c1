#![allow(clippy::unwrap_used)]
//! Every strategy on 8 chips (2x2x2) against single-chip training on the global batch.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::common::run_on_chips;
use podsim_collectives::{Algo, LocalFabric};
use podsim_programs::ProgramError;
use podsim_programs::train::{
    ChipTrainReport, Eager, MlpSpec, ModelSpec, OptimizerSpec, Remat, ReplicaSync, Strategy,
    Tensor, TpActivations, TrainSpec, train_chip_with_parameters,
};
use podsim_topology::{Hardware, Pod};

fn spec(strategy: Strategy, eager: Eager) -> TrainSpec {
    TrainSpec {
        strategy,
        eager,
        // Uneven widths on purpose: 13 and 10 do not divide by 8 or 4.
        model: ModelSpec::Mlp(MlpSpec {
            widths: vec![16, 13, 24, 10],
        }),
        steps: 20,
        batch: 4,
        grad_accum: 1,
        optimizer: OptimizerSpec::Sgd {
            lr: 0.1,
            momentum: 0.9,
            weight_decay: 0.0,
        },
        seed: 42,
        bucket_cap_mb: 25.0,
        reshard_after_forward: true,
        tp: 4,
        replicas: 2,
        algo: Algo::Torus,
        meta: false,
        check: true,
        checkpoint_every: 0,
        checkpoint_dir: None,
        resume_from: None,
        symmetric: false,
        remat: Remat::default(),
        tp_activations: TpActivations::Replicated,
        replica_sync: Default::default(),
        grad_reduce: Default::default(),
        reduce_dtype: None,
    }
}

fn run(spec: &TrainSpec, shape: &str) -> (Vec<ChipTrainReport>, Vec<Tensor>) {
    let pod = Pod::single(shape.parse().unwrap());
    let fabric = LocalFabric::new(pod, Hardware::preset("v5p").unwrap());
    let spec = spec.clone();
    let out =
        run_on_chips(fabric.chips(), move |mut chip| {
            let spec = spec.clone();
            async move {
                train_chip_with_parameters(&mut chip, &spec, Arc::new(AtomicU64::new(0))).await
            }
        })
        .unwrap();
    let params = out[0].1.clone();
    (out.into_iter().map(|(r, _)| r).collect::<Vec<_>>(), params)
}

fn losses(reports: &[ChipTrainReport]) -> Vec<f64> {
    let steps = reports[0].steps.len();
    (0..steps)
        .map(|s| {
            reports
                .iter()
                .map(|r| r.steps[s].loss.unwrap())
                .sum::<f64>()
                / reports.len() as f64
        })
        .collect()
}

#[test]
fn every_strategy_matches_single_chip_training_in_every_mode() {
    for strategy in Strategy::ALL {
        let mut finals: Vec<Vec<Tensor>> = Vec::new();
        for eager in Eager::ALL {
            let s = spec(strategy, eager);
            let (reports, params) = run(&s, "2x2x2");
            let r0 = &reports[0];
            let rel = r0.max_rel_diff.unwrap();
            println!(
                "{strategy} {}: max_abs_diff {:e} rel {rel:e}",
                eager.name(),
                r0.max_abs_diff.unwrap()
            );
            assert!(
                rel <= 1e-5,
                "{strategy} {}: relative difference {rel}",
                eager.name()
            );
            assert!(
                reports.iter().all(|r| r.replicas_identical == Some(true)),
                "{strategy}"
            );
            let l = losses(&reports);
            assert!(
                l[19] < 0.8 * l[0],
                "{strategy} {}: loss {l:?}",
                eager.name()
            );
            finals.push(params);
        }
        for other in &finals[1..] {
            for (a, b) in finals[0].iter().zip(other) {
                assert!(a.max_abs_diff(b) <= 1e-5, "{strategy}: modes disagree");
            }
        }
    }
}

#[test]
fn fsdp_without_reshard_and_adamw_with_accumulation_match_too() {
    let mut s = spec(Strategy::Fsdp, Eager::Fused);
    s.reshard_after_forward = false;
    let (reports, _) = run(&s, "2x2x2");
    assert!(reports[0].max_rel_diff.unwrap() <= 1e-5);
    let mut s = spec(Strategy::Ddp, Eager::Fused);
    s.grad_accum = 3;
    s.optimizer = OptimizerSpec::Adamw {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let (reports, _) = run(&s, "2x2x2");
    assert!(
        reports[0].max_rel_diff.unwrap() <= 1e-4,
        "{:?}",
        reports[0].max_rel_diff
    );
}

#[test]
fn a_chip_over_its_hbm_budget_fails_naming_it() {
    let pod = Pod::single("2x2x2".parse().unwrap());
    let mut hw = Hardware::preset("v5p").unwrap();
    hw.hbm_bytes = 4000.0;
    let fabric = LocalFabric::new(pod, hw);
    let s = spec(Strategy::Ddp, Eager::Fused);
    let err = run_on_chips(fabric.chips(), move |mut chip| {
        let s = s.clone();
        async move { train_chip_with_parameters(&mut chip, &s, Arc::new(AtomicU64::new(0))).await }
    })
    .unwrap_err();
    let ProgramError::OutOfMemory { what, capacity, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*capacity, 4000);
    assert!(what.contains("layers."), "{err}");
}

#[test]
fn meta_mode_costs_the_same_virtual_time_and_memory_as_data_mode() {
    for strategy in Strategy::ALL {
        let data = spec(strategy, Eager::Fused);
        let meta = TrainSpec {
            meta: true,
            check: false,
            ..data.clone()
        };
        let (d, _) = run(&data, "2x2x2");
        let (m, _) = run(&meta, "2x2x2");
        for (a, b) in d.iter().zip(&m) {
            assert_eq!(a.hbm, b.hbm, "{strategy}");
            for (x, y) in a.steps.iter().zip(&b.steps) {
                assert_eq!(x.virtual_ns.to_bits(), y.virtual_ns.to_bits(), "{strategy}");
                assert_eq!(x.exposed_ns.to_bits(), y.exposed_ns.to_bits(), "{strategy}");
                assert!(y.loss.is_none());
            }
        }
    }
}

#[test]
fn rematerialised_training_recomputes_for_real_and_is_bit_identical() {
    for strategy in [Strategy::Ddp, Strategy::Fsdp, Strategy::FsdpTp] {
        let plain = spec(strategy, Eager::Fused);
        let (base, base_params) = run(&plain, "2x2x2");
        for policy in ["full", "minimal"] {
            let mut s = plain.clone();
            s.remat = policy.parse().unwrap();
            let (reports, params) = run(&s, "2x2x2");
            assert_eq!(
                params, base_params,
                "{strategy} {policy}: parameters differ"
            );
            let (a, b) = (&reports[0].steps[0], &base[0].steps[0]);
            // No more kept in HBM (full: less; the MLP's matmul outputs are as large as the
            // ReLU outputs minimal drops), more flops charged for the recomputation.
            assert!(
                a.activations_bytes <= b.activations_bytes,
                "{strategy} {policy}"
            );
            if policy == "full" {
                assert!(a.activations_bytes < b.activations_bytes, "{strategy}");
            }
            assert!(a.flops > b.flops, "{strategy} {policy}");
        }
    }
}

#[test]
fn sharded_tensor_parallel_activations_train_like_a_single_chip() {
    let mut s = spec(Strategy::FsdpTp, Eager::Fused);
    s.tp_activations = TpActivations::Sharded;
    let (reports, _) = run(&s, "2x2x2");
    let rel = reports[0].max_rel_diff.unwrap();
    assert!(rel <= 1e-5, "relative difference {rel}");
    assert!(reports.iter().all(|r| r.replicas_identical == Some(true)));
}

#[test]
fn replicas_synced_after_the_backward_train_like_one_chip_and_expose_the_all_reduce() {
    for strategy in [Strategy::Hsdp, Strategy::FsdpTp] {
        let per_layer = spec(strategy, Eager::Fused);
        let after = TrainSpec {
            replica_sync: ReplicaSync::AfterBackward,
            grad_accum: 2,
            ..per_layer.clone()
        };
        let (reports, _) = run(&after, "2x2x2");
        let rel = reports[0].max_rel_diff.unwrap();
        assert!(rel <= 1e-5, "{strategy}: relative difference {rel}");
        assert!(reports.iter().all(|r| r.replicas_identical == Some(true)));
        // In meta mode, a model whose all-reduces are bandwidth-bound (on the small one, one
        // all-reduce instead of three saves more fixed cost than it exposes): nothing is left
        // to hide the replicas' all-reduce once the backward is done.
        let meta = |s: &TrainSpec| TrainSpec {
            meta: true,
            check: false,
            grad_accum: 1,
            batch: 256,
            model: ModelSpec::Mlp(MlpSpec {
                widths: vec![1024, 4096, 4096, 1024],
            }),
            ..s.clone()
        };
        let (a, _) = run(&meta(&per_layer), "2x2x2");
        let (b, _) = run(&meta(&after), "2x2x2");
        let (a, b) = (&a[0].steps[0], &b[0].steps[0]);
        assert!(b.exposed_ns > a.exposed_ns, "{strategy}: {a:?} {b:?}");
        assert_eq!(a.flops, b.flops, "{strategy}");
    }
}

#[test]
fn meshes_that_split_a_torus_axis_train_like_one_chip() {
    // 4x4 with 8-way tensor parallelism: tp takes x and a pair of neighbours on y, dp every
    // second y (two hops apart). A ring of 8 with tp = 2: dp takes every second chip. Every
    // chip's parameters must match one chip on the global batch.
    // Debug mode also compares every replicated piece across the chips that replicate it.
    for (shape, tp, eager) in [
        ("4x4", 8, Eager::Fused),
        ("8", 2, Eager::Fused),
        ("4x4", 8, Eager::Debug),
        ("8", 2, Eager::Debug),
    ] {
        let mut s = spec(Strategy::FsdpTp, eager);
        s.tp = tp;
        s.steps = 5;
        let pod = Pod::single(shape.parse().unwrap());
        let parts = s.mesh_parts(&pod).unwrap();
        assert!(parts.iter().any(|p| p.stride > 1), "{shape}: {parts:?}");
        let (reports, _) = run(&s, shape);
        let rel = reports[0].max_rel_diff.unwrap();
        assert!(rel <= 1e-5, "{shape} tp={tp}: {rel}");
        assert_eq!(reports[0].replicas_identical, Some(true), "{shape}");
    }
}
