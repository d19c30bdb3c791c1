//! `podsim study` end to end: a 2 shapes x 2 wraparounds sweep of a small meta-mode
//! all-reduce (results.csv, study.json, an SVG plot), a point that times out, and bad studies
//! (exit 2, nothing run).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::*;

/// A one-all-reduce collectives job; the study overrides its shape.
fn base_config(dir: &Path, mode: &str, size: &str, iterations: u32) -> String {
    format!(
        r#"name = "study-base"
topology = {{ shape = "2x2", hardware = "v5p" }}
launch = {{ workers = 1 }}
output = {{ dir = "{}" }}

[job]
kind = "collectives"
mode = "{mode}"
iterations = {iterations}
collectives = [{{ op = "all-reduce", size = "{size}" }}]
"#,
        dir.join("unused").display()
    )
}

/// A fresh folder holding `base.toml` (see `base_config`), and the study's output folder
/// in it (not created).
fn study_dir(tag: &str, mode: &str, size: &str, iterations: u32) -> (PathBuf, PathBuf) {
    let dir = temp_dir(tag);
    write(
        &dir,
        "base.toml",
        &base_config(&dir, mode, size, iterations),
    );
    let out = dir.join("out");
    (dir, out)
}

fn study(args: &[&str], limit: Duration) -> (i32, String, String) {
    let mut c = podsim();
    c.arg("study").args(args);
    let out = run_bounded(c, limit);
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `podsim study` on a study file of `text` written to `dir/name`, with `args` after it
/// (30 s at most).
fn study_text(dir: &Path, name: &str, text: &str, args: &[&str]) -> (i32, String, String) {
    let file = write(dir, name, text);
    let mut all = vec![file.to_str().unwrap()];
    all.extend(args);
    study(&all, Duration::from_secs(30))
}

/// Rows of a CSV file (RFC 4180 quoting), header first.
fn read_csv(path: &Path) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(path).unwrap();
    let mut rows = Vec::new();
    let (mut row, mut field, mut quoted) = (Vec::new(), String::new(), false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') => quoted = true,
            (false, ',') => row.push(std::mem::take(&mut field)),
            (false, '\n') => {
                row.push(std::mem::take(&mut field));
                rows.push(std::mem::take(&mut row));
            }
            (false, c) => field.push(c),
        }
    }
    rows
}

#[test]
fn sweep_writes_results_and_plot() {
    let (dir, out) = study_dir("study-sweep", "meta", "1MiB", 1);
    let config = write(
        &dir,
        "study.toml",
        &format!(
            r#"name = "allreduce-scaling"
base = "base.toml"
out = "{}"
parallel = 2
timeout_s = 100

[sweep]
"topology.wraparound" = [true, false]

[[points]]
"topology.shape" = "4"
[[points]]
"topology.shape" = "4x4"

[metrics]
busbw_gbps = "collectives.0.virtual_busbw_gbps"
group = "collectives.0.group_size"

[[plot]]
file = "busbw.svg"
title = "All-reduce bus bandwidth"
x = "chips"
y = "busbw_gbps"
series = "topology.wraparound"
log_x = true
y_label = "GB/s"
"#,
            out.display()
        ),
    );
    let (code, stdout, stderr) = study(&[config.to_str().unwrap()], Duration::from_secs(180));
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("4 ok"), "{stdout}");

    let rows = check_sweep_results(&out);
    check_sweep_files(&out, &rows);
}

/// results.csv of the sweep above: its columns, one row per point with what it ran, and
/// the ring with wraparound faster than without.
fn check_sweep_results(out: &Path) -> Vec<Vec<String>> {
    let rows = read_csv(&out.join("results.csv"));
    assert_eq!(
        rows[0].join(","),
        "point,topology.wraparound,topology.shape,status,exit_code,chips,slices,virtual_s,\
         wall_s,peak_rss_mib,busbw_gbps,group,error"
    );
    assert_eq!(rows.len(), 5, "{rows:?}");
    let expect = [
        ("0", "true", "4", "4"),
        ("1", "true", "4x4", "16"),
        ("2", "false", "4", "4"),
        ("3", "false", "4x4", "16"),
    ];
    for (row, (point, wrap, shape, chips)) in rows[1..].iter().zip(expect) {
        assert_eq!(
            row[..7],
            [point, wrap, shape, "ok", "0", chips, "1"],
            "{row:?}"
        );
        assert_eq!(row[11], chips, "group size: {row:?}");
        for numeric in [7, 8, 9, 10] {
            let v: f64 = row[numeric].parse().unwrap_or_else(|_| panic!("{row:?}"));
            assert!(v > 0.0, "column {numeric} of {row:?}");
        }
        assert_eq!(row[12], "", "{row:?}");
        let point_dir = out.join(format!("point-00{point}"));
        assert!(point_dir.join("report.json").is_file());
        assert!(point_dir.join("launch.log").is_file());
    }
    // A ring without its wraparound link is slower than with it.
    let busbw = |i: usize| rows[i][10].parse::<f64>().unwrap();
    assert!(busbw(1) > busbw(3), "{rows:?}");

    rows
}

/// The sweep's plot, study.json and study.html.
fn check_sweep_files(out: &Path, rows: &[Vec<String>]) {
    let svg = std::fs::read_to_string(out.join("busbw.svg")).unwrap();
    assert!(svg.contains("<svg"));
    assert!(svg.contains("All-reduce bus bandwidth"));
    assert!(svg.contains("topology.wraparound = true"), "{svg}");
    assert!(svg.contains("topology.wraparound = false"), "{svg}");
    assert!(svg.contains("GB/s"));

    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("study.json")).unwrap()).unwrap();
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 4);
    assert_eq!(points[3]["overrides"]["topology.shape"], "4x4");
    assert_eq!(points[3]["overrides"]["topology.wraparound"], false);
    assert_eq!(points[3]["report"], "point-003/report.json");
    assert!(points.iter().all(|p| p["status"] == "ok"));

    // study.html: the plot inline and the results as a table, nothing fetched.
    let page = std::fs::read_to_string(out.join("study.html")).unwrap();
    assert!(
        page.contains("All-reduce bus bandwidth"),
        "the plot is inline"
    );
    assert_eq!(
        page.matches("<tr>").count(),
        rows.len(),
        "the header and a row per point"
    );
    assert!(!page.contains("src=") && !page.contains("href=") && !page.contains("<script"));
    assert!(point_dir_page(&out.join("point-000")).contains("<svg"));
}

fn point_dir_page(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("report.html")).expect("each point has its report.html")
}

#[test]
fn metrics_and_plots_that_come_out_empty_are_said() {
    let (dir, out) = study_dir("study-empty", "meta", "1MiB", 1);
    let (code, _, stderr) = study_text(
        &dir,
        "empty.toml",
        "base = \"base.toml\"\n[sweep]\n\"topology.shape\" = [\"4\", \"2x2\"]\n\
         [metrics]\nnothing = \"no.such.path\"\nvirtual = \"virtual_s\"\n\
         [[plot]]\nfile = \"s.svg\"\nx = \"chips\"\ny = \"status\"\n\
         [[plot]]\nfile = \"v.svg\"\nx = \"chips\"\ny = \"virtual\"\n",
        &["--out", out.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains(
            "metric nothing is empty in every point: no report.json holds \"no.such.path\""
        ),
        "{stderr}"
    );
    assert!(stderr.contains("plot s.svg has no points"), "{stderr}");
    // What holds data is not named.
    assert!(
        !stderr.contains("metric virtual") && !stderr.contains("plot v.svg"),
        "{stderr}"
    );
}

#[test]
fn a_point_past_its_timeout_is_killed_and_recorded() {
    // Data mode, 64 MiB a chip, many iterations: far longer than the timeout.
    let (dir, out) = study_dir("study-timeout", "data", "64MiB", 1000);
    let config = write(
        &dir,
        "study.toml",
        &format!(
            "base = \"base.toml\"\nout = \"{}\"\ntimeout_s = 1.5\n[[points]]\n\"launch.workers\" = 2\n",
            out.display()
        ),
    );
    let (code, stdout, stderr) = study(&[config.to_str().unwrap()], Duration::from_secs(60));
    assert_eq!(code, 0, "stdout:\n{stdout}\nstderr:\n{stderr}");
    let rows = read_csv(&out.join("results.csv"));
    assert_eq!(rows.len(), 2, "{rows:?}");
    let col = |name: &str| rows[0].iter().position(|c| c == name).unwrap();
    assert_eq!(rows[1][col("status")], "timeout");
    assert_eq!(rows[1][col("exit_code")], "");
    assert_eq!(rows[1][col("chips")], "4");
    assert_eq!(rows[1][col("virtual_s")], "");
    assert!(rows[1][col("error")].contains("timed out"), "{rows:?}");
}

#[test]
fn bad_studies_exit_2_naming_the_field() {
    let (dir, out) = study_dir("study-bad", "meta", "1MiB", 1);
    let (code, _, stderr) = study_text(
        &dir,
        "unknown.toml",
        "base = \"base.toml\"\n[[plot]]\nfile = \"p.svg\"\nx = \"chips\"\ny = \"busbw\"\n",
        &["--out", out.to_str().unwrap()],
    );
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("unknown.toml:5: plot[0].y: \"busbw\" is not a column"),
        "{stderr}"
    );

    // Every bad point is reported at once, before anything runs.
    let (code, stdout, stderr) = study_text(
        &dir,
        "points.toml",
        "base = \"base.toml\"\n[sweep]\n\"topology.shape\" = [\"4\", \"3x\", \"2x2\", \"5y\"]\n",
        &["--out", out.to_str().unwrap()],
    );
    assert_eq!(code, 2, "{stdout}\n{stderr}");
    assert!(stderr.contains("2 of 4 points"), "{stderr}");
    assert!(
        stderr.contains("point-001 (topology.shape=\"3x\")"),
        "{stderr}"
    );
    assert!(
        stderr.contains("point-003 (topology.shape=\"5y\")"),
        "{stderr}"
    );
    // The bad value is the study's, not a line of the base it replaces.
    assert!(
        stderr.contains("points.toml: topology.shape (this point's value)"),
        "{stderr}"
    );
    assert!(!stderr.contains("base.toml:"), "{stderr}");
    assert!(!out.exists(), "a bad study must run nothing");

    // A dry run lists and validates the points, and runs nothing either.
    let (code, stdout, stderr) = study_text(
        &dir,
        "good.toml",
        "base = \"base.toml\"\n[sweep]\n\"topology.shape\" = [\"4\", \"2x2\"]\n",
        &["--out", out.to_str().unwrap(), "--dry-run"],
    );
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("point-001  topology.shape=\"2x2\""),
        "{stdout}"
    );
    assert!(!out.exists());
}

#[test]
fn a_study_deletes_nothing_it_did_not_write_and_no_folder_a_job_holds() {
    let (dir, out) = study_dir("study-foreign", "meta", "1MiB", 1);
    let sweep = "base = \"base.toml\"\n[sweep]\n\"topology.shape\" = [\"4\", \"2x2\"]\n";
    let run = |out: &Path| study_text(&dir, "s.toml", sweep, &["--out", out.to_str().unwrap()]);

    // A folder of the user's own: refused, every file kept.
    std::fs::create_dir_all(out.join("point-000")).unwrap();
    write(&out.join("point-000"), "notes.txt", "mine");
    write(&out, "results.csv", "mine");
    let (code, _, stderr) = run(&out);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("holds files no study wrote (point-000, results.csv)"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("point-000/notes.txt")).unwrap(),
        "mine"
    );
    assert_eq!(
        std::fs::read_to_string(out.join("results.csv")).unwrap(),
        "mine"
    );

    // A study's folder runs again into itself; but a point folder holding files a point did
    // not write, or one a job holds, is refused and kept.
    let mine = dir.join("mine");
    assert_eq!(run(&mine).0, 0);
    assert_eq!(run(&mine).0, 0, "a study's folder runs again");
    std::fs::remove_file(mine.join("point-001/launch.log")).unwrap();
    write(&mine.join("point-001"), "notes.txt", "mine");
    let (code, _, stderr) = run(&mine);
    assert!(
        code != 0 && stderr.contains("point-001 holds files no study's point wrote"),
        "{stderr}"
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("point-001/notes.txt")).unwrap(),
        "mine"
    );
    std::fs::remove_dir_all(mine.join("point-001")).unwrap();
    let lock = std::fs::File::create(mine.join("point-000/.podsim.lock")).unwrap();
    lock.try_lock().unwrap();
    let (code, _, stderr) = run(&mine);
    assert!(
        code != 0 && stderr.contains("is in use by another job"),
        "{stderr}"
    );
    assert!(
        mine.join("point-000/report.json").exists(),
        "the held point was cleared"
    );
    drop(lock);
}

#[test]
fn a_key_that_is_not_a_field_name_or_is_given_twice_and_a_path_for_a_name_are_refused() {
    let (dir, out) = study_dir("study-keys", "meta", "1MiB", 1);
    let cases = [
        // Once ran 7 iterations, the CSV saying 1.
        (
            "\"job.iterations=7 #\" = [1]",
            "sweep.\"job.iterations=7 #\": is not a dotted config field",
        ),
        (
            "\"topology.shape\" = [\"2x2\"]\ntopology.shape = [\"4\"]",
            "given twice",
        ),
    ];
    for (sweep, want) in cases {
        let text = format!("base = \"base.toml\"\n[sweep]\n{sweep}\n");
        let (code, _, stderr) =
            study_text(&dir, "k.toml", &text, &["--out", out.to_str().unwrap()]);
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains(want), "{want}: {stderr}");
    }
    let text = "name = \"../..\"\nbase = \"base.toml\"\n[sweep]\njob.iterations = [1]\n";
    let (code, _, stderr) = study_text(&dir, "n.toml", text, &["--dry-run"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("name: must be a name, not a path"),
        "{stderr}"
    );
    assert!(!out.exists());
}

#[test]
fn shipped_study_is_valid() {
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../configs/studies/allreduce_scaling.toml"
    );
    let (code, stdout, stderr) = study(&[config, "--dry-run"], Duration::from_secs(30));
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("12 points"), "{stdout}");
    assert!(stdout.contains("point-011  topology.wraparound=false topology.shape=\"64x64\""));
}

#[test]
fn the_ready_studies_in_scripts_are_valid() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/studies");
    for (name, points) in [
        ("allreduce_tori", 30),
        ("fsdp_70b", 16),
        ("ici_vs_dcn", 7),
        ("ici_vs_dcn_train", 7),
    ] {
        let config = format!("{dir}/{name}.toml");
        let (code, stdout, stderr) = study(&[&config, "--dry-run"], Duration::from_secs(30));
        assert_eq!(code, 0, "{name}: {stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("{points} points")),
            "{name}: {stdout}"
        );
    }
}
