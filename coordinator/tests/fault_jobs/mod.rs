//! The job the fault tests inject into, and how they launch it (shared by `faults.rs` and
//! `stragglers.rs`).
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use crate::support::*;

/// A DDP training job on a 4x4 torus (16 chips, 4 workers of one row each: chip
/// `4y + x` is on worker `y`), with `fault` as its `[[faults]]` entry.
pub fn config(dir: &std::path::Path, steps: u32, fault: &str) -> std::path::PathBuf {
    let text = format!(
        r#"name = "faults"

[topology]
shape = "4x4"
hardware = "v5e"

[launch]
workers = 4

[job]
kind = "train"
strategy = "ddp"
eager = "fused"
steps = {steps}
batch = 8
check = false

[job.model]
widths = [16, 32, 10]

{fault}

[output]
dir = "{}"
"#,
        dir.display()
    );
    write(dir, "job.toml", &text)
}

pub fn launch(tag: &str, steps: u32, fault: &str) -> (i32, serde_json::Value) {
    let dir = temp_dir(&format!("fault-{tag}"));
    let path = config(&dir, steps, fault);
    let mut c = podsim();
    c.arg("launch").arg(&path);
    let out = run_bounded(c, Duration::from_secs(90));
    let r = report(&dir);
    for w in r["workers"].as_array().unwrap() {
        assert!(
            !alive(w["pid"].as_u64().unwrap() as u32),
            "{tag}: worker left behind"
        );
    }
    (out.status.code().unwrap_or(-1), r)
}
