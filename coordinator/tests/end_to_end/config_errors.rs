//! Bad configs: one test per kind of mistake, each with its message (file, line, field,
//! reason), exit code 2, and nothing started.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::support::*;

fn validate(name: &str, text: &str) -> (i32, String) {
    validate_with(name, text, &[])
}

/// `podsim validate` with environment variables set (`PODSIM_MEM_AVAILABLE`: the memory the
/// host is taken to have).
fn validate_with(name: &str, text: &str, env: &[(&str, &str)]) -> (i32, String) {
    let dir = temp_dir(&format!("cfg-{name}"));
    let path = write(&dir, "job.toml", text);
    let out = run_bounded(
        {
            let mut c = podsim();
            c.arg("validate").arg(&path);
            c.envs(env.iter().copied());
            c
        },
        Duration::from_secs(30),
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn base() -> String {
    job_config(std::path::Path::new("/tmp/unused"), 2, 1, "")
}

fn expect_error(name: &str, text: &str, needles: &[&str]) {
    let (code, err) = validate(name, text);
    assert_eq!(code, 2, "{name}: {err}");
    for n in needles {
        assert!(err.contains(n), "{name}: expected {n:?} in:\n{err}");
    }
}

#[test]
fn good_config_validates() {
    let (code, err) = validate("good", &base());
    assert_eq!(code, 0, "{err}");
}

#[test]
fn unknown_key_names_file_line_and_field() {
    let text = base().replace("workers = 2", "workers = 2\nworkerz = 3");
    expect_error(
        "unknown",
        &text,
        &["job.toml:9: launch.workerz: unknown key"],
    );
}

#[test]
fn a_value_of_the_wrong_type_names_its_key_and_line() {
    // toml reads a section whole and names no key; podsim finds the one at fault, nested
    // tables and arrays of tables included.
    let text = train_config("steps = \"many\"", "widths = [8, 16, 4]\nbias = \"yes\"");
    let steps = text.lines().position(|l| l.starts_with("steps")).unwrap() + 1;
    expect_error(
        "wrong-type",
        &text,
        &[&format!(
            "job.toml:{steps}: job.steps: expected a whole number, 0 or more, found the string \"many\""
        )],
    );
    let nested = train_config("", "widths = \"wide\"");
    let widths = nested
        .lines()
        .position(|l| l.starts_with("widths"))
        .unwrap()
        + 1;
    expect_error(
        "wrong-type-nested",
        &nested,
        &[&format!(
            "job.toml:{widths}: job.model.widths: expected a list [...], found the string \"wide\""
        )],
    );
    // Every value of the wrong type in one run; in an array of tables, the entry; a missing
    // key, the table that lacks it.
    let text = base().replace(
        "op = \"all-to-all\"",
        "op = \"all-to-all\"\nroot = \"zero\"",
    );
    expect_error(
        "wrong-type-entry",
        &text.replace("iterations = ", "iterations = \"x\"\n#"),
        &[
            "job.collectives[1].root: expected a whole number, 0 or more, found the string \"zero\"",
            "job.iterations: expected a whole number, 0 or more, found the string \"x\"",
        ],
    );
    expect_error(
        "missing-in-entry",
        &base().replacen("op = \"all-to-all\"", "", 1),
        &["job.collectives[1]: missing key op"],
    );
}

#[test]
fn unknown_key_in_a_collective_entry() {
    let text = base().replace(
        "op = \"all-to-all\"",
        "op = \"all-to-all\"\nreduction = \"sum\"",
    );
    expect_error(
        "unknown-entry",
        &text,
        &["job.collectives[1].reduction: unknown key"],
    );
}

#[test]
fn wrong_type() {
    let text = base().replace("workers = 2", "workers = \"two\"");
    expect_error(
        "type",
        &text,
        &["launch.workers: expected a whole number, 0 or more, found the string \"two\""],
    );
}

#[test]
fn bad_shape() {
    let text = base().replace("shape = \"2x2x2\"", "shape = \"2x0x2\"");
    expect_error("shape", &text, &["job.toml:4: topology.shape", "size 0"]);
}

#[test]
fn more_workers_than_chips() {
    let text = base().replace("workers = 2", "workers = 9");
    expect_error(
        "workers",
        &text,
        &["launch.workers", "more workers than chips"],
    );
}

#[test]
fn unknown_collective_and_size() {
    let text = base()
        .replace("op = \"all-reduce\"", "op = \"all-scatter\"")
        .replace("size = \"64KiB\"\nalgo", "size = \"64 parsecs\"\nalgo");
    expect_error(
        "op",
        &text,
        &[
            "job.collectives[0].op",
            "unknown collective",
            "job.collectives[1].size",
        ],
    );
}

#[test]
fn axis_the_torus_lacks() {
    let text = base().replace("shape = \"2x2x2\"", "shape = \"4x2\"");
    expect_error("axis", &text, &["job.collectives[2].group", "no axis z"]);
}

#[test]
fn unknown_hardware_and_bad_override() {
    let text = base().replace("hardware = \"v5p\"", "hardware = \"h100\"");
    expect_error(
        "hw",
        &text,
        &["topology.hardware", "unknown hardware preset"],
    );
    let text = format!("{}\n[hardware]\nici_bandwidth = -5.0\n", base());
    expect_error("hw-override", &text, &["hardware", "ici_bandwidth"]);
}

#[test]
fn syntax_error_has_a_line() {
    let text = base().replace("[launch]", "[launch");
    expect_error("syntax", &text, &["job.toml:", "syntax"]);
}

#[test]
fn every_problem_at_once() {
    let text = base()
        .replace("workers = 2", "workers = 9\nbogus = 1")
        .replace("op = \"all-reduce\"", "op = \"all-scatter\"");
    let (code, err) = validate("many", &text);
    assert_eq!(code, 2);
    for n in [
        "launch.bogus",
        "launch.workers",
        "job.collectives[0].op",
        "3 problems",
    ] {
        assert!(err.contains(n), "missing {n:?} in:\n{err}");
    }
}

#[test]
fn launch_refuses_a_bad_config_without_starting_anything() {
    let dir = temp_dir("cfg-launch-bad");
    let out_dir = dir.join("out");
    let text = job_config(&out_dir, 2, 1, "").replace("workers = 2", "workers = 100");
    let path = write(&dir, "job.toml", &text);
    let out = run_bounded(
        {
            let mut c = podsim();
            c.arg("launch").arg(&path);
            c
        },
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        !out_dir.exists(),
        "nothing may be started or written for a bad config"
    );
}

fn train_config(extra_job: &str, model: &str) -> String {
    format!(
        "name = \"t\"\n\n[topology]\nshape = \"2x2x2\"\n\n[launch]\nworkers = 2\n\n[job]\nkind = \"train\"\nstrategy = \"fsdp+tp\"\n{extra_job}\n[job.model]\n{model}\n\n[job.optimizer]\nkind = \"sgd\"\nlr = 0.1\n"
    )
}

#[test]
fn shipped_configs_validate() {
    let main = [
        "quickstart",
        "collectives",
        "ddp",
        "fsdp",
        "hsdp",
        "tp",
        "fsdp_tp",
        "ddp_small_layers",
        "ddp_mlp_bench",
        "gpt2_fsdp_meta",
    ];
    let faults = [
        "stall",
        "crash",
        "freeze",
        "drop",
        "delay",
        "slow",
        "desync",
        "corrupt",
        "partition",
        "recovery",
    ];
    let names = main
        .into_iter()
        .map(String::from)
        .chain(faults.iter().map(|f| format!("faults/{f}")));
    for name in names {
        let path = format!("{}/../configs/{name}.toml", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        let (code, err) = validate(&name.replace('/', "-"), &text);
        assert_eq!(code, 0, "{name}: {err}");
    }
}

#[test]
fn train_job_problems_are_all_reported() {
    let (code, err) = validate("train-good", &train_config("tp = 4", "widths = [8, 16, 4]"));
    assert_eq!(code, 0, "{err}");
    // A strategy that does not exist, an unknown key in [job.model], a key of another kind.
    let text = train_config(
        "iterations = 3\nverify = true\neager = \"lazy\"\nreplica_sync = \"never\"\ntp_activations = \"split\"",
        "widths = [8, 16, 4]\ndepth = 3",
    )
    .replace("strategy = \"fsdp+tp\"", "strategy = \"zero3\"");
    expect_error(
        "train-bad",
        &text,
        &[
            "job.model.depth: unknown key",
            "job.iterations: applies to kind = \"collectives\" jobs only",
            "job.verify: applies to kind = \"collectives\" jobs only",
            "job.strategy: unknown strategy \"zero3\"",
            "job.eager: unknown eager mode \"lazy\"",
            "job.replica_sync: unknown replica sync \"never\" (expected one of per_layer, after_backward)",
            "job.tp_activations: unknown tp_activations layout \"split\"",
        ],
    );
    // A replica sync where there are no replicas.
    expect_error(
        "train-sync",
        &train_config("replica_sync = \"after_backward\"", "widths = [8, 16, 4]"),
        &["job.replica_sync: applies to hsdp, and to fsdp+tp with replicas > 1, only"],
    );
    // FSDP2's gradient reduction: unknown values, and a strategy that reduce-scatters nothing.
    expect_error(
        "train-reduce",
        &train_config(
            "grad_reduce = \"per_block\"\nreduce_dtype = \"f16\"",
            "widths = [8, 16, 4]",
        ),
        &[
            "job.grad_reduce: unknown gradient reduction \"per_block\" (expected one of per_layer, per_unit)",
            "job.reduce_dtype: unknown dtype \"f16\"",
        ],
    );
    expect_error(
        "train-reduce-ddp",
        &train_config("grad_reduce = \"per_unit\"", "widths = [8, 16, 4]")
            .replace("strategy = \"fsdp+tp\"", "strategy = \"ddp\""),
        &["job.grad_reduce: applies to fsdp, hsdp and fsdp+tp only"],
    );
    // Where they would be ignored: strict mode reduces each parameter as written, data mode
    // moves f32 values.
    expect_error(
        "train-reduce-strict",
        &train_config(
            "eager = \"strict\"\ngrad_reduce = \"per_unit\"",
            "widths = [8, 16, 4]",
        ),
        &["job.grad_reduce: applies to eager = \"fused\" only"],
    );
    expect_error(
        "train-reduce-data",
        &train_config("reduce_dtype = \"f32\"", "widths = [8, 16, 4]"),
        &["job.reduce_dtype: applies in meta mode only"],
    );
    // A tensor-parallel degree that does not factor the torus, and a model without layers.
    expect_error(
        "train-tp",
        &train_config("tp = 3", "widths = [8, 16, 4]"),
        &["job.tp: ", "tp = 3"],
    );
    expect_error(
        "train-model",
        &train_config("", "widths = [8]"),
        &["job.model.widths: needs at least two widths"],
    );
}

#[test]
fn transformer_and_symmetric_problems_are_all_reported() {
    let shape = "kind = \"transformer\"\nlayers = 2\nd_model = 64\nheads = 4\nffn = 128\nvocab = 100\nseq = 16";
    let good = train_config("mode = \"meta\"", shape);
    let (code, err) = validate("transformer-good", &good);
    assert_eq!(code, 0, "{err}");
    // Data mode, a key of the MLP, a missing field, heads that do not divide d_model.
    let bad = train_config(
        "",
        &shape
            .replace("heads = 4", "heads = 5\nwidths = [1, 2]")
            .replace("seq = 16", ""),
    );
    expect_error(
        "transformer-bad",
        &bad,
        &[
            "job.model.widths: not a field of a transformer model",
            "job.model.seq: missing (a transformer needs it)",
            "job.mode: a transformer model runs in meta mode only",
        ],
    );
    expect_error(
        "transformer-heads",
        &train_config("mode = \"meta\"", &shape.replace("heads = 4", "heads = 5")),
        &["d_model = 64 is not a multiple of heads = 5"],
    );
    // The mirror fabric needs one worker; a torus without wraparound only costs it more
    // chips (every position along such an axis).
    let unwrapped = train_config("mode = \"meta\"\nsymmetric = true", shape)
        .replace("shape = \"2x2x2\"", "shape = \"2x2x2\"\nwraparound = false");
    expect_error(
        "symmetric",
        &unwrapped,
        &["job.symmetric: the mirror fabric runs in one process: launch.workers must be 1, not 2"],
    );
    let (code, err) = validate(
        "symmetric-unwrapped",
        &unwrapped.replace("workers = 2", "workers = 1"),
    );
    assert_eq!(code, 0, "{err}");
}

#[test]
fn fault_entries_are_checked() {
    let text = format!(
        "{}\n[[faults]]\nkind = \"melt\"\nchip = 3\n\n[[faults]]\nkind = \"drop\"\nlink = \"0:+w\"\n\n[[faults]]\nkind = \"stall\"\nchip = 99\nwhen = 3\n\n[[faults]]\nkind = \"partition\"\ngroups = [[0], [7]]\n\n[[faults]]\nkind = \"partition\"\nchip_groups = [[0], [8]]\n\n[[faults]]\nkind = \"partition\"\ngroups = [[0], [1]]\nchip_groups = [[0], [1]]\n",
        base()
    );
    expect_error(
        "faults",
        &text,
        &[
            "faults[0].kind: unknown fault \"melt\"",
            "faults[1].link: \"+w\" is not a link",
            "faults[2].when: unknown key",
            "faults[2].chip: chip 99 is outside the pod's 8 chips",
            "faults[3].groups: worker 7 is outside the job's 2 workers",
            "faults[4].chip_groups: chip 8 is outside the pod's 8 chips",
            "faults[5]: a partition fault needs either groups",
        ],
    );
}

#[test]
fn verify_needs_payloads() {
    let good = base().replace("iterations = 1", "iterations = 1\nverify = true");
    let (code, err) = validate("verify-good", &good);
    assert_eq!(code, 0, "{err}");
    let meta = good.replace("mode = \"data\"", "mode = \"meta\"");
    expect_error(
        "verify-meta",
        &meta,
        &["job.verify: checksums need payloads: verify applies to mode = \"data\" only"],
    );
}

#[test]
fn nonsense_numbers_are_refused_with_their_range() {
    // A chip slowed 1e300 times (a panic converting the wait before).
    let slow = format!(
        "{}\n[[faults]]\nkind = \"slow\"\nchip = 3\nfactor = 1e300\n",
        base()
    );
    expect_error(
        "slow-1e300",
        &slow,
        &["job.toml:35: faults[0].factor: 1e300 is out of range (allowed: from 1.0 to 1000.0)"],
    );
    // A layer 2^63 - 1 wide (capacity overflow before).
    expect_error(
        "width-2-63",
        &train_config("", "widths = [8, 9223372036854775807, 4]"),
        &["job.model.widths: 9223372036854775807 is out of range (allowed: from 1 to 16777216)"],
    );
    // A learning rate that is not a number (an h2 protocol error at the end of the run before).
    for (name, lr, shown) in [("lr-nan", "nan", "NaN"), ("lr-inf", "inf", "inf")] {
        let text =
            train_config("", "widths = [8, 16, 4]").replace("lr = 0.1", &format!("lr = {lr}"));
        expect_error(
            name,
            &text,
            &[&format!(
                "job.toml:18: job.optimizer.lr: {shown} is out of range (allowed: from 0.0 to 100.0)"
            )],
        );
    }
}

#[test]
fn a_delay_the_watchdog_could_not_diagnose_is_refused() {
    let delay = |ms: &str| {
        format!(
            "{}\n[[faults]]\nkind = \"delay\"\nlink = \"1:+x\"\ndelay_ms = {ms}\n",
            base()
        )
    };
    expect_error(
        "delay-30s",
        &delay("30000"),
        &[
            "job.toml:35: faults[0].delay_ms: 30000 ms is not below the watchdog's timeout (2000 ms)",
            "kind = \"stall\"",
        ],
    );
    expect_error(
        "delay-1e11",
        &delay("1e11"),
        &[
            "job.toml:35: faults[0].delay_ms: 100000000000.0 is out of range (allowed: from 0.0 to 60000.0)",
        ],
    );
    let (code, err) = validate("delay-short", &delay("20"));
    assert_eq!(code, 0, "{err}");
}

#[test]
fn data_mode_beyond_the_host_memory_is_refused_with_meta_suggested() {
    let env = [("PODSIM_MEM_AVAILABLE", "1GiB")];
    let big = base().replace("size = \"256KiB\"", "size = \"1GiB\"");
    let (code, err) = validate_with("mem-collectives", &big, &env);
    assert_eq!(code, 2, "{err}");
    for needle in [
        "job.toml:17: job.collectives[0].size: in data mode this job holds at least 16 GiB on this host (8 chips x 2 GiB of input and output buffers), more than the 1 GiB it has available",
        "mode = \"meta\"",
    ] {
        assert!(err.contains(needle), "expected {needle:?} in:\n{err}");
    }
    let meta = big.replace("mode = \"data\"", "mode = \"meta\"");
    let (code, err) = validate_with("mem-collectives-meta", &meta, &env);
    assert_eq!(code, 0, "meta mode holds no payloads: {err}");
    // But it holds its chips: 256x256x256 grew until the host ran out.
    let shape = |text: &str| text.replace("shape = \"2x2x2\"", "shape = \"256x256x256\"");
    let (code, err) = validate_with("mem-meta-pod", &shape(&meta), &env);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("topology.shape: 16777216 chips simulated one by one hold at least 256 GiB"),
        "{err}"
    );
    // A training job: each replica's parameters, gradients and optimizer state.
    let (code, err) = validate_with(
        "mem-train",
        &train_config("", "widths = [65536, 65536, 10]"),
        &env,
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("job.model.widths: in data mode this job holds at least")
            && err.contains("mode = \"meta\""),
        "{err}"
    );
}
