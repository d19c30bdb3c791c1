//! Training jobs end to end: every strategy and eager mode on 8 chips (2x2x2) across 4 worker
//! processes ends equal to single-chip training on the global batch with identical replicas
//! and a falling loss; FSDP's persistent memory is about 1/8 of DDP's; fused beats strict;
//! a chip over its HBM budget fails the job naming it.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use crate::support::*;

fn config(name: &str) -> String {
    format!("{}/../configs/{name}.toml", env!("CARGO_MANIFEST_DIR"))
}

/// Launches `configs/<name>.toml` with `--set` overrides; returns the report, exit status and
/// stdout.
fn launch(name: &str, tag: &str, sets: &[&str]) -> (serde_json::Value, std::process::Output) {
    let dir = temp_dir(&format!("train-{tag}"));
    let mut c = podsim();
    c.arg("launch").arg(config(name)).arg("--out").arg(&dir);
    for s in sets {
        c.arg("--set").arg(s);
    }
    let out = run_bounded(c, Duration::from_secs(180));
    let r = report(Path::new(&dir));
    (r, out)
}

fn losses(r: &serde_json::Value) -> Vec<f64> {
    r["training"]["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["loss"].as_f64().unwrap())
        .collect()
}

fn step_virtual_ms(r: &serde_json::Value) -> f64 {
    r["training"]["steps"][1]["virtual_ms"].as_f64().unwrap()
}

fn peak_state(r: &serde_json::Value) -> u64 {
    r["training"]["hbm"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["peak_state_bytes"].as_u64().unwrap())
        .max()
        .unwrap()
}

#[test]
fn every_strategy_and_mode_matches_single_chip_training_across_four_workers() {
    let cases = [
        ("ddp", ""),
        ("fsdp", ""),
        ("fsdp", "job.reshard_after_forward=false"),
        ("hsdp", ""),
        ("tp", ""),
        ("fsdp_tp", ""),
    ];
    for (name, extra) in cases {
        for eager in ["debug", "strict", "fused"] {
            let mode = format!("job.eager={eager}");
            let mut sets = vec![mode.as_str()];
            if !extra.is_empty() {
                sets.push(extra);
            }
            let (r, out) = launch(name, &format!("{name}-{eager}"), &sets);
            let what = format!("{name} {extra} {eager}");
            assert!(
                out.status.success(),
                "{what}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert_eq!(r["status"], "ok", "{what}");
            assert_eq!(r["workers"].as_array().unwrap().len(), 4, "{what}");
            let rel = r["correctness"]["max_rel_diff"].as_f64().unwrap();
            assert!(rel <= 1e-5, "{what}: relative difference {rel}");
            assert_eq!(r["correctness"]["replicas_identical"], true, "{what}");
            let l = losses(&r);
            assert_eq!(l.len(), 20, "{what}");
            assert!(l[19] < 0.85 * l[0], "{what}: loss {l:?}");
        }
    }
}

#[test]
fn a_mesh_that_splits_a_torus_axis_trains_across_workers() {
    // 4x4 on 4 workers (a row of y each) with 8-way tensor parallelism: tp is x and a pair
    // of neighbouring rows, dp every second row, so dp's messages travel two hops, between
    // workers that are not neighbours.
    let sets = ["topology.shape=4x4", "job.tp=8"];
    let (r, out) = launch("fsdp_tp", "split-axis", &sets);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(r["status"], "ok");
    assert_eq!(r["workers"].as_array().unwrap().len(), 4);
    let rel = r["correctness"]["max_rel_diff"].as_f64().unwrap();
    assert!(rel <= 1e-5, "relative difference {rel}");
    assert_eq!(r["correctness"]["replicas_identical"], true);
}

#[test]
fn a_symmetric_job_on_a_split_mesh_runs_two_chips_and_times_every_chip() {
    // The mesh of the test above in meta mode on one worker: chips at even and odd y differ,
    // so the mirror fabric runs one of each, and its step equals that of all 16 chips.
    let sets = |symmetric: &'static str| {
        [
            "topology.shape=4x4",
            "job.tp=8",
            "job.mode=meta",
            "job.steps=2",
            "launch.workers=1",
            symmetric,
        ]
    };
    let (mirror, out) = launch("fsdp_tp", "split-mirror", &sets("job.symmetric=true"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (every, out) = launch("fsdp_tp", "split-every", &sets("job.symmetric=false"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(mirror["training"]["hbm"].as_array().unwrap().len(), 2);
    assert_eq!(every["training"]["hbm"].as_array().unwrap().len(), 16);
    let (a, b) = (step_virtual_ms(&mirror), step_virtual_ms(&every));
    assert!(
        (a - b).abs() <= 1e-9 * b,
        "mirror {a} ms, every chip {b} ms"
    );
    assert_eq!(
        mirror["training"]["peak_hbm_bytes"],
        every["training"]["peak_hbm_bytes"]
    );
}

#[test]
fn fsdp_keeps_an_eighth_of_ddp_persistent_state_per_chip() {
    let (ddp, _) = launch("ddp", "mem-ddp", &[]);
    let (fsdp, _) = launch("fsdp", "mem-fsdp", &[]);
    let ratio = peak_state(&fsdp) as f64 / peak_state(&ddp) as f64;
    // 1/8 plus the padding of uneven shards.
    assert!((0.12..0.135).contains(&ratio), "fsdp/ddp state {ratio}");
}

#[test]
fn fused_ddp_beats_strict_on_many_small_layers() {
    let (strict, _) = launch("ddp_small_layers", "small-strict", &["job.eager=strict"]);
    let (fused, _) = launch("ddp_small_layers", "small-fused", &["job.eager=fused"]);
    let speedup = step_virtual_ms(&strict) / step_virtual_ms(&fused);
    assert!(
        speedup >= 1.3,
        "fused is only {speedup:.2}x faster than strict"
    );
    let steps = fused["training"]["steps"].as_array().unwrap();
    let s = &steps[1];
    let (compute, exposed) = (
        s["compute_ms"].as_f64().unwrap(),
        s["exposed_comm_ms"].as_f64().unwrap(),
    );
    assert!((compute + exposed - s["virtual_ms"].as_f64().unwrap()).abs() < 1e-9);
}

#[test]
fn the_quickstart_prints_a_falling_loss() {
    let (r, out) = launch("quickstart", "quickstart", &[]);
    assert!(out.status.success());
    assert_eq!(r["training"]["strategy"], "ddp");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let l = losses(&r);
    for (step, loss) in [(0, l[0]), (19, l[19])] {
        let line = format!("{step:>6}  {loss:>8.4}");
        assert!(stdout.contains(&line), "missing {line:?} in\n{stdout}");
    }
    assert!(l[19] < l[0]);
}

#[test]
fn a_chip_over_its_hbm_budget_fails_the_job_naming_it() {
    let (r, out) = launch("fsdp", "oom", &["hardware.hbm_bytes=300000"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(r["status"], "error");
    let e = r["error"].as_str().unwrap();
    assert!(e.contains("out of memory: chip"), "{e}");
    assert!(e.contains("300000"), "{e}");
    for w in r["workers"].as_array().unwrap() {
        assert!(
            !alive(w["pid"].as_u64().unwrap() as u32),
            "worker left behind"
        );
    }
}
