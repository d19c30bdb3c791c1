//! `podsim compare` end to end: the published TPU step times of
//! `configs/validation/published.csv` are predicted with a median error within 5% and every
//! row within 10%, nothing out of memory; every row of MaxText's tables runs on at
//! most two simulated chips and fits; the rows of tpu-recipes logs have a median error within
//! 6%, and bf16 weights fit where f32 ones do not; bad files are exit 2 naming the row and column;
//! `--max-error` turns a miss into exit 1.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::*;

fn published() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/published.csv")
}

fn compare(args: &[&str]) -> std::process::Output {
    let mut cmd = podsim();
    cmd.arg("compare").args(args);
    run_bounded(cmd, Duration::from_secs(300))
}

/// `podsim compare --json FILE ARGS`: the row objects and the summary.
fn compare_json(path: &Path, args: &[&str]) -> (Vec<serde_json::Value>, serde_json::Value) {
    let mut all = vec![path.to_str().unwrap(), "--json"];
    all.extend(args);
    let out = compare(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut objects: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary = objects.pop().unwrap();
    (objects, summary)
}

#[test]
fn published_rows_are_predicted_within_five_percent_median_and_ten_each() {
    // The calibration's aims, as `--max-error 10` holds them: exit 1 if any row misses by
    // more than 10%. The two kernel constants set against these rows (topology/src/hardware.rs,
    // scripts/calibrate.py) are chosen to meet them, so this is the regression guard on
    // everything else in the model that moves a prediction.
    let path = published();
    let (rows, summary) = compare_json(&path, &["--max-error", "10"]);
    let csv_rows = std::fs::read_to_string(&path).unwrap().lines().count() - 1;
    assert_eq!(rows.len(), csv_rows);
    for r in &rows {
        assert!(r["error_pct"].as_f64().unwrap().abs() <= 10.0, "{r}");
        assert_eq!(r["fits"], true, "{r}");
        let mfu = r["mfu"].as_f64().unwrap();
        assert!(mfu > 0.2 && mfu < 0.9, "{r}");
    }
    assert!(
        summary["median_abs_error_pct"].as_f64().unwrap() <= 5.0,
        "{summary}"
    );
    assert_eq!(summary["out_of_memory"], 0);
}

#[test]
fn every_row_of_maxtexts_tables_runs_on_two_chips_at_most_and_fits() {
    // The out-of-sample set (docs/PERFORMANCE.md reads its errors; no bound is asserted on
    // them here): up to 8192 chips a row, each simulated as one chip per class of chips
    // alike under the job's translations.
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/maxtext_tables.csv");
    let (rows, summary) = compare_json(&path, &[]);
    assert_eq!(rows.len(), 46);
    for r in &rows {
        let chips = r["simulated_chips"].as_u64().unwrap();
        assert!(chips == 1 || chips == 2, "{r}");
        assert_eq!(r["fits"], true, "{r}");
        assert!(r["predicted_step_s"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The 8x8x8 rows with 16-way tensor parallelism split an axis: two chips.
    let split = rows
        .iter()
        .filter(|r| r["simulated_chips"] == 2)
        .map(|r| r["id"].as_str().unwrap())
        .collect::<Vec<_>>();
    assert_eq!(split, ["v5p-512B-1x1024", "v5p-512B-2x1024"]);
    assert_eq!(summary["out_of_memory"], 0);
}

#[test]
fn tpu_recipes_rows_run_within_six_percent_median_and_bf16_weights_fit_where_f32_do_not() {
    // A second out-of-sample set: MaxText's tpu-recipes logs (v6e Llama, Mistral and GPT-3,
    // and Llama-3.1-405B on v5p and across two v6e slices), none of them among the
    // calibration rows. Its median is a
    // regression guard on how the kernel model generalises; docs/PERFORMANCE.md reads each
    // row, the misses included.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/tpu_recipes.csv");
    let (rows, summary) = compare_json(&path, &[]);
    assert_eq!(rows.len(), 15);
    assert!(
        summary["median_abs_error_pct"].as_f64().unwrap() <= 6.0,
        "{summary}"
    );
    // Every recipe ran, so none may be predicted out of memory: GPT-3 175B fits only because
    // its prefetches wait for room instead of overlapping regardless.
    assert_eq!(summary["out_of_memory"], 0, "{summary}");
    // The 70B recipe on 32 v6e chips keeps its weights and Adam moments in bf16 (8 bytes a
    // parameter, 17.5 GB a chip): it fits in 32 GiB only so; in f32 (16 bytes) it cannot.
    let id = "v6e32_llama3.1-70b_s8192_b2";
    let row = |rows: &[serde_json::Value]| rows.iter().find(|r| r["id"] == id).cloned().unwrap();
    assert_eq!(row(&rows)["fits"], true, "{}", row(&rows));
    let text = std::fs::read_to_string(&path).unwrap();
    let f32_weights: Vec<String> = text
        .lines()
        .filter(|l| l.starts_with("id,") || l.starts_with(id))
        .map(|l| l.replace(",bf16,", ",f32,"))
        .collect();
    let dir = temp_dir("compare-weights");
    let file = dir.join("f32.csv");
    std::fs::write(&file, f32_weights.join("\n")).unwrap();
    let (f32_rows, _) = compare_json(&file, &[]);
    assert_eq!(f32_rows[0]["fits"], false, "{}", f32_rows[0]);
    let gib = |r: &serde_json::Value| r["peak_hbm_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
    assert!(gib(&f32_rows[0]) - gib(&row(&rows)) > 10.0);
    // On v6e, whose matmuls sit at the HBM roofline, kernels wait for the HBM that FSDP's
    // collectives take beside them, the more the fewer tokens a chip has to cover them: GPT-3
    // 175B (6,144 tokens a chip) loses a larger share of its compute than Llama-3.1-8B on
    // eight chips (24,576). The wait is part of compute, never more.
    let waited = |id: &str| {
        let r = rows.iter().find(|r| r["id"] == id).unwrap();
        r["hbm_wait_s"].as_f64().unwrap() / r["compute_s"].as_f64().unwrap()
    };
    for r in &rows {
        let wait = r["hbm_wait_s"].as_f64().unwrap();
        assert!(
            wait >= 0.0 && wait <= r["compute_s"].as_f64().unwrap(),
            "{r}"
        );
    }
    let (gpt3, llama8b) = (
        waited("v6e256_gpt3-175b_s2048_b3_bf16"),
        waited("v6e8_llama3.1-8b_s8192_b3"),
    );
    assert!(gpt3 > 0.05 && gpt3 > 2.0 * llama8b, "{gpt3} {llama8b}");
}

#[test]
fn a_tight_max_error_is_exit_one_and_bad_rows_are_exit_two_naming_row_and_column() {
    let path = published();
    let out = compare(&[path.to_str().unwrap(), "--max-error", "0.01"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-error"));

    let dir = temp_dir("compare-bad");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<String> = text.lines().map(String::from).collect();
    // Row 2 (the first data row, A1: 4-way tensor parallelism) with, in turn, a batch that
    // is no number, 0.3 sequences a chip (1.2 a group), a torus axis of 0, and an attention
    // (an optional column) that podsim does not know.
    let header: Vec<String> = lines[0].split(',').map(String::from).collect();
    let first = lines[1].clone();
    for (column, value) in [
        ("batch_per_chip", "eight"),
        ("batch_per_chip", "0.3"),
        ("topology", "4x0x4"),
        ("attention", "sdpa"),
    ] {
        let col = header.iter().position(|h| h == column).unwrap();
        let mut cells: Vec<String> = first.split(',').map(String::from).collect();
        cells[col] = value.into();
        lines[1] = cells.join(",");
        let bad = dir.join("bad.csv");
        std::fs::write(&bad, lines.join("\n")).unwrap();
        let out = compare(&[bad.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("row 2") && err.contains(&format!("column {column}")),
            "{err}"
        );
    }

    // A file without the measured column.
    let missing = dir.join("missing.csv");
    let cut: Vec<String> = text
        .lines()
        .map(|l| {
            let mut c: Vec<&str> = l.split(',').collect();
            c.remove(header.iter().position(|h| *h == "measured_step_s").unwrap());
            c.join(",")
        })
        .collect();
    std::fs::write(&missing, cut.join("\n")).unwrap();
    let out = compare(&[missing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("missing column measured_step_s"));
}

#[test]
fn dcn_fsdp_shards_the_parameters_across_slices_and_bad_splits_name_their_column() {
    // MaxText's 16B on two v5e-256 slices, data parallel across them (the table's row) and
    // again with its parameters sharded across both (`dcn_fsdp_parallelism = 2`): half the
    // parameter, gradient and optimizer bytes a chip, and every layer's gathers cross DCN.
    let tables =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/maxtext_tables.csv");
    let text = std::fs::read_to_string(&tables).unwrap();
    let header = text.lines().find(|l| l.starts_with("id,")).unwrap();
    let row = text
        .lines()
        .find(|l| l.starts_with("v5e-16B-2x256,"))
        .unwrap();
    let dp_col = header.split(',').position(|h| h == "dcn_dp").unwrap();
    let with = |dcn_dp: &str, dcn_fsdp: &str, slices: &str| {
        let mut cells: Vec<String> = row.split(',').map(String::from).collect();
        cells[dp_col] = dcn_dp.into();
        cells[4] = slices.into();
        format!("{header},dcn_fsdp\n{},{dcn_fsdp}\n", cells.join(","))
    };
    let dir = temp_dir("compare-dcn-fsdp");
    let file = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (dp, _) = compare_json(&file("dp.csv", with("2", "1", "2")), &[]);
    let (fsdp, _) = compare_json(&file("fsdp.csv", with("1", "2", "2")), &[]);
    let gib = |r: &serde_json::Value| r["peak_hbm_bytes"].as_f64().unwrap() / (1u64 << 30) as f64;
    // 16B parameters in f32 with two f32 moments, 179 GiB: 0.70 GiB a chip over 256 chips,
    // 0.35 over 512 (and the gradients' share halves too).
    let saved = gib(&dp[0]) - gib(&fsdp[0]);
    assert!(saved > 0.35 && saved < 0.7, "{} {}", dp[0], fsdp[0]);
    assert_ne!(dp[0]["exposed_comm_s"], fsdp[0]["exposed_comm_s"]);
    for (name, text, column) in [
        ("product.csv", with("2", "2", "2"), "dcn_dp"),
        ("mixed.csv", with("2", "2", "4"), "dcn_fsdp"),
        ("zero.csv", with("2", "0", "2"), "dcn_fsdp"),
    ] {
        let out = compare(&[file(name, text).to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(&format!("column {column}")), "{name}: {err}");
    }
}

#[test]
fn published_collectives_are_predicted_within_fifteen_percent_each() {
    // Issue 42's aim on the measured collectives (the link model's three constants are set
    // against these rows by scripts/calibrate_links.py): every row within 15%, the median
    // within 7%; each row names the benchmark it ran.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/collectives.csv");
    let (rows, summary) = compare_json(&path, &["--max-error", "15"]);
    assert_eq!(rows.len(), 9);
    for r in &rows {
        let (p, m) = (
            r["predicted_us"].as_f64().unwrap(),
            r["measured_us"].as_f64().unwrap(),
        );
        assert!(p > 0.0 && (p / m - 1.0).abs() <= 0.15, "{r}");
        assert!(r["bench"].as_str().unwrap().contains("--collective"), "{r}");
    }
    assert!(
        summary["median_abs_error_pct"].as_f64().unwrap() <= 7.0,
        "{summary}"
    );
    // A row podsim cannot express is exit 2 naming it and its column; a training field is
    // not a collective's.
    let dir = temp_dir("compare-collectives-bad");
    let text = std::fs::read_to_string(&path).unwrap();
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, text.replacen(",all_gather,", ",all_shuffle,", 1)).unwrap();
    let out = compare(&[bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("(TPU7X-AG-2x2x1-m64), column op"), "{err}");
    let out = compare(&[path.to_str().unwrap(), "--set", "job.steps=3"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn held_out_collectives_run_and_the_confident_ones_hold_the_calibrations_bound() {
    // Published timings no constant was set on (configs/validation/collectives_holdout.csv):
    // the rows whose notes rate their derivation high must meet the calibration file's bound
    // of 15%; the low-confidence ones only have to run (docs/PERFORMANCE.md reads them).
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/collectives_holdout.csv");
    let (rows, _) = compare_json(&path, &[]);
    let text = std::fs::read_to_string(&path).unwrap();
    let confident: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("[conf=high]"))
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(confident.len(), 5, "{confident:?}");
    assert_eq!(rows.len(), 11);
    for r in &rows {
        assert!(r["predicted_us"].as_f64().unwrap() > 0.0, "{r}");
        if confident.contains(&r["id"].as_str().unwrap()) {
            assert!(r["error_pct"].as_f64().unwrap().abs() <= 15.0, "{r}");
        }
    }
}
