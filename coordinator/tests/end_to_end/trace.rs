//! `--trace` and `report.html` through the real binary: the trace parses back, its slices nest,
//! its collectives lie within their steps and its times are the report's; the page is
//! well-formed HTML that references nothing outside itself.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use crate::support::{podsim, report, run_bounded, temp_dir};
use serde_json::Value;

fn config(name: &str) -> String {
    format!("{}/../configs/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn launch(cfg: &str, dir: &Path, extra: &[&str]) -> std::process::Output {
    let mut cmd = podsim();
    cmd.arg("launch")
        .arg(config(cfg))
        .arg("--out")
        .arg(dir)
        .arg("--trace")
        .arg(dir.join("trace.json"))
        .args(extra);
    run_bounded(cmd, Duration::from_secs(240))
}

fn events(dir: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(dir.join("trace.json")).expect("trace.json");
    let trace: Value = serde_json::from_str(&text).expect("the trace is JSON");
    trace["traceEvents"]
        .as_array()
        .expect("traceEvents")
        .clone()
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap()
}

/// Complete slices of the virtual-time process, by track.
fn slices_by_track(events: &[Value]) -> BTreeMap<u64, Vec<&Value>> {
    let mut by: BTreeMap<u64, Vec<&Value>> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X" && e["pid"] == 1) {
        by.entry(e["tid"].as_u64().unwrap()).or_default().push(e);
    }
    by
}

/// Tolerance for times written as decimal microseconds.
const EPS_US: f64 = 1e-6;

/// Every slice nests inside the slice that encloses its start on its track.
fn assert_slices_nest(ev: &[Value]) {
    let by_track = slices_by_track(ev);
    assert!(
        by_track.len() >= 8 * 3,
        "steps, compute and streams for 8 chips"
    );
    for (tid, slices) in &by_track {
        let mut s: Vec<(f64, f64, &str)> = slices
            .iter()
            .map(|e| {
                (
                    f(&e["ts"]),
                    f(&e["ts"]) + f(&e["dur"]),
                    e["name"].as_str().unwrap(),
                )
            })
            .collect();
        s.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut open: Vec<(f64, f64, &str)> = Vec::new();
        for slice in s {
            while open.last().is_some_and(|p| p.1 <= slice.0 + EPS_US) {
                open.pop();
            }
            if let Some(parent) = open.last() {
                assert!(
                    slice.1 <= parent.1 + EPS_US,
                    "track {tid}: {slice:?} overlaps {parent:?} without nesting in it"
                );
            }
            open.push(slice);
        }
    }
}

#[test]
fn an_fsdp_trace_nests_and_agrees_with_the_report() {
    let dir = temp_dir("trace-fsdp");
    let out = launch("fsdp.toml", &dir, &["--trace-flows", "--trace-wall"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("trace: "), "{stdout}");
    let ev = events(&dir);
    let r = report(&dir);

    assert_slices_nest(&ev);

    // Every collective lies within a step of its chip.
    let chip_of = |e: &Value| e["tid"].as_u64().unwrap() / 64;
    let steps: Vec<&Value> = ev
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "step" && e["pid"] == 1)
        .collect();
    let collectives: Vec<&Value> = ev
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "collective" && e["pid"] == 1)
        .collect();
    assert!(!collectives.is_empty());
    for c in &collectives {
        let (a, b) = (f(&c["ts"]), f(&c["ts"]) + f(&c["dur"]));
        assert!(
            steps.iter().any(|s| chip_of(s) == chip_of(c)
                && f(&s["ts"]) <= a + EPS_US
                && b <= f(&s["ts"]) + f(&s["dur"]) + EPS_US),
            "collective {c} lies in no step of chip {}",
            chip_of(c)
        );
    }

    // Each step's longest chip is the report's step time.
    let training = &r["training"]["steps"];
    for st in training.as_array().unwrap() {
        let name = format!("step {}", st["step"]);
        let longest = steps
            .iter()
            .filter(|s| s["name"] == name.as_str())
            .map(|s| f(&s["dur"]))
            .fold(0.0, f64::max);
        let want_us = f(&st["virtual_ms"]) * 1e3;
        assert!(
            (longest - want_us).abs() <= 1e-9 * want_us.max(1.0),
            "{name}: trace {longest} us, report {want_us} us"
        );
    }

    // Flow arrows come in pairs; the wall clock is there; HBM is counted.
    let starts = ev.iter().filter(|e| e["ph"] == "s").count();
    assert!(starts > 0);
    assert_eq!(starts, ev.iter().filter(|e| e["ph"] == "f").count());
    assert!(
        ev.iter().any(|e| e["ph"] == "X" && e["pid"] == 3),
        "wall-clock slices"
    );
    assert!(
        ev.iter()
            .any(|e| e["ph"] == "C" && e["name"].as_str().unwrap().ends_with("HBM in use"))
    );
    assert!(
        ev.iter()
            .any(|e| e["ph"] == "C" && e["name"].as_str().unwrap().contains("links in use"))
    );

    // The report carries chip 0's median step, slice by slice.
    let tl = &r["timelines"][0];
    assert_eq!(tl["chip"], 0);
    assert!(!tl["slices"].as_array().unwrap().is_empty());
    check_page(&dir.join("report.html"));
}

#[test]
fn a_hung_run_leaves_its_step_and_collective_open_with_the_diagnosis() {
    let dir = temp_dir("trace-stall");
    let out = launch("faults/stall.toml", &dir, &[]);
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = events(&dir);
    let open: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "B").collect();
    assert!(
        open.iter().any(|e| e["cat"] == "collective"),
        "the collective the waiting chips were inside stays open"
    );
    assert!(
        open.iter().any(|e| e["cat"] == "step"),
        "the hung step stays open"
    );
    let marks: Vec<&Value> = ev.iter().filter(|e| e["ph"] == "i").collect();
    assert_eq!(marks.len(), 1);
    assert!(
        marks[0]["name"]
            .as_str()
            .unwrap()
            .contains("STALLED_CHIP: chip 5")
    );
    let page = check_page(&dir.join("report.html"));
    assert!(
        page.contains("STALLED_CHIP"),
        "the diagnosis is on the page"
    );
    assert!(
        page.contains("<title>chip 5 (1, 0, 1)</title>"),
        "the torus shows the culprit"
    );
}

#[test]
fn podsim_report_redraws_the_same_page_from_report_json() {
    let dir = temp_dir("trace-redraw");
    let mut cmd = podsim();
    cmd.args(["launch", &config("quickstart.toml"), "--out"])
        .arg(&dir);
    let out = run_bounded(cmd, Duration::from_secs(240));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let first = check_page(&dir.join("report.html"));
    std::fs::remove_file(dir.join("report.html")).unwrap();
    let mut cmd = podsim();
    cmd.arg("report").arg(&dir);
    let out = run_bounded(cmd, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(check_page(&dir.join("report.html")), first);

    let empty = temp_dir("trace-redraw-empty");
    let mut cmd = podsim();
    cmd.arg("report").arg(&empty);
    let out = run_bounded(cmd, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("neither report.json nor results.csv"));
    // No such folder, or a file where the folder should be: said as such.
    let file = crate::support::write(&empty, "results.csv", "point\n");
    for (target, want) in [
        (empty.join("absent"), "No such file or directory"),
        (file, "not a folder"),
    ] {
        let mut cmd = podsim();
        cmd.arg("report").arg(&target);
        let out = run_bounded(cmd, Duration::from_secs(60));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn bench_traces_each_size_one_after_another() {
    let dir = temp_dir("trace-bench");
    let file = dir.join("bench.json");
    let mut cmd = podsim();
    cmd.args([
        "bench",
        "--topology",
        "2x2",
        "--sizes",
        "4KiB,64KiB",
        "--iters",
        "2",
        "--trace",
    ])
    .arg(&file)
    .args(["--trace-chips", "0,3"]);
    let out = run_bounded(cmd, Duration::from_secs(120));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let trace: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let ev = trace["traceEvents"].as_array().unwrap();
    let cases: Vec<(f64, f64)> = ev
        .iter()
        .filter(|e| e["ph"] == "X" && e["cat"] == "step" && e["tid"] == 0)
        .map(|e| (f(&e["ts"]), f(&e["ts"]) + f(&e["dur"])))
        .collect();
    assert_eq!(cases.len(), 2, "one case per size on chip 0");
    assert!(
        cases[0].1 <= cases[1].0 + EPS_US,
        "sizes laid one after another: {cases:?}"
    );
    let chips: std::collections::BTreeSet<u64> = ev
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| e["tid"].as_u64().unwrap() / 64)
        .collect();
    assert_eq!(chips.into_iter().collect::<Vec<_>>(), vec![0, 3]);

    let mut cmd = podsim();
    cmd.args(["bench", "--topology", "2x2", "--trace"])
        .arg(&file)
        .args(["--trace-chips", "9"]);
    let out = run_bounded(cmd, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("chip 9 is not in the pod"));
}

/// Reads a page, checks it is well-formed (every element closed in order, nothing but
/// text between tags) and self-contained (no script, nothing loaded from elsewhere); returns it.
fn check_page(path: &Path) -> String {
    let page = std::fs::read_to_string(path).expect("report.html");
    assert!(page.starts_with("<!DOCTYPE html>"));
    const VOID: [&str; 6] = ["meta", "br", "hr", "img", "input", "link"];
    let mut stack: Vec<String> = Vec::new();
    let mut rest = page.as_str();
    while let Some(i) = rest.find('<') {
        let text = &rest[..i];
        assert!(!text.contains('>'), "a stray '>' in text: {text:?}");
        let end = rest[i..].find('>').expect("an unclosed tag") + i;
        let tag = &rest[i + 1..end];
        rest = &rest[end + 1..];
        if tag.starts_with('!') {
            continue;
        }
        let name: String = tag
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect();
        if let Some(closing) = tag.strip_prefix('/') {
            let closing = closing.trim();
            assert_eq!(
                stack.pop().as_deref(),
                Some(closing),
                "</{closing}> closes the wrong element"
            );
        } else if !tag.ends_with('/') && !VOID.contains(&name.as_str()) {
            stack.push(name);
        }
    }
    assert!(stack.is_empty(), "unclosed: {stack:?}");
    for banned in ["<script", "src=", "href=", "@import", "url(", "https://"] {
        assert!(!page.contains(banned), "{banned} in the page");
    }
    // The only address is SVG's namespace name, which nothing fetches.
    assert_eq!(
        page.matches("http://").count(),
        page.matches("xmlns=\"http://www.w3.org/2000/svg\"").count()
    );
    page
}
