//! Fuzzing of config parsing and validation: generated configs (tables and keys of the real
//! schema, values from a pool of the numbers and strings that break things: NaN, infinities,
//! 2^63, negatives, wrong types; valid configs with keys changed; garbage bytes) must each
//! validate or be refused, never panic.
//!
//! The suite runs `PODSIM_FUZZ_CASES` cases (default 256, a few seconds). For a longer run,
//! `PODSIM_FUZZ_SECS=600` runs until that time has passed (`PODSIM_FUZZ_SEED` picks another
//! sequence):
//!
//! ```sh
//! PODSIM_FUZZ_SECS=600 cargo test --workspace --test fuzz_config -- --nocapture
//! ```
//!
//! A panic prints the case's seed and its config, which `PODSIM_FUZZ_SEED=<seed>
//! PODSIM_FUZZ_CASES=1` runs again alone.
#![allow(clippy::unwrap_used)]

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use podsim_coordinator::config;

/// splitmix64: small, fast and good enough to pick cases; a case is its seed.
#[derive(Debug)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Numbers as TOML writes them: edges of every integer type the config reads, and floats
/// that are not numbers or are out of every range.
const NUMBERS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "7",
    "8",
    "16",
    "64",
    "100",
    "1000",
    "-1",
    "-7",
    "65536",
    "16777216",
    "16777217",
    "4294967295",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "0.0",
    "-0.0",
    "0.5",
    "1.0",
    "10.0",
    "0.999",
    "1e-300",
    "1e300",
    "-1e300",
    "1e11",
    "30000",
    "1999",
    "2000",
    "60000",
    "nan",
    "inf",
    "-inf",
    "+inf",
    "-nan",
    "3.4e38",
    "1.8e308",
];

/// Strings the config's string keys take (and some they do not).
const STRINGS: &[&str] = &[
    "",
    " ",
    "2x2x2",
    "2x2",
    "4",
    "8",
    "4x4",
    "2x0x2",
    "4294967295x2",
    "65536x65536",
    "1x1x1",
    "data",
    "meta",
    "collectives",
    "train",
    "torch",
    "bench",
    "mlp",
    "transformer",
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "broadcast",
    "all-to-all",
    "barrier",
    "send-recv",
    "torus",
    "ring",
    "bidir-ring",
    "world",
    "slice",
    "x",
    "y,z",
    "dcn",
    "x,y,z,dcn",
    "sum",
    "avg",
    "max",
    "min",
    "f32",
    "bf16",
    "1MiB",
    "64KiB",
    "1GiB",
    "64GiB",
    "1e15",
    "1e16",
    "nan",
    "-1",
    "4 parsecs",
    "1:+x",
    "0:+y",
    "3:-z",
    "5:dcn1",
    "+x",
    "dcn0",
    "99999999999:+x",
    "stall",
    "crash",
    "freeze",
    "drop",
    "delay",
    "slow",
    "desync",
    "corrupt",
    "partition",
    "once",
    "always",
    "skip",
    "op",
    "size",
    "sgd",
    "adamw",
    "ddp",
    "fsdp",
    "hsdp",
    "tp",
    "fsdp+tp",
    "zero3",
    "debug",
    "strict",
    "fused",
    "none",
    "full",
    "minimal",
    "custom:mlpwi=device",
    "replicated",
    "sharded",
    "relu",
    "gelu",
    "swiglu",
    "flash",
    "dot_product",
    "sequential",
    "parallel",
    "v4",
    "v5e",
    "v5p",
    "v6e",
    "h100",
    "auto",
    "tcp",
    "uds",
    "shm",
    "grpc",
    "127.0.0.1",
    "0.0.0.0",
    "train.py",
    "runs/fuzz",
    "\u{e9}\u{1f600}",
    "a\\\"b",
];

/// One TOML value, of any type.
fn value(rng: &mut Rng, depth: u32) -> String {
    match rng.below(if depth > 1 { 4 } else { 7 }) {
        0 | 1 => rng.pick(NUMBERS).to_string(),
        2 => format!("\"{}\"", rng.pick(STRINGS)),
        3 => rng.pick(&["true", "false"]).to_string(),
        4 | 5 => {
            let n = rng.pick(&[0, 1, 2, 3, 5, 40]);
            let items: Vec<String> = (0..*n)
                .map(|_| {
                    if rng.chance(70) {
                        rng.pick(NUMBERS).to_string()
                    } else {
                        value(rng, depth + 1)
                    }
                })
                .collect();
            format!("[{}]", items.join(", "))
        }
        _ => {
            let keys = ["a", "kind", "size", "x"];
            let items: Vec<String> = (0..rng.below(3))
                .map(|i| format!("{} = {}", keys[i], value(rng, depth + 1)))
                .collect();
            format!("{{ {} }}", items.join(", "))
        }
    }
}

/// A value for `key`: mostly what such a key takes (a number for a number...), so that the
/// checks behind the type checks are reached too.
fn value_for(rng: &mut Rng, key: &str) -> String {
    if rng.chance(25) {
        return value(rng, 0);
    }
    let list = |rng: &mut Rng, inner: &dyn Fn(&mut Rng) -> String| {
        let items: Vec<String> = (0..rng.below(5)).map(|_| inner(rng)).collect();
        format!("[{}]", items.join(", "))
    };
    match key {
        "widths" => list(rng, &|r| r.pick(NUMBERS).to_string()),
        "groups" | "chip_groups" => list(rng, &|r| list(r, &|r| r.pick(NUMBERS).to_string())),
        "args" => list(rng, &|r| format!("\"{}\"", r.pick(STRINGS))),
        "wraparound" if rng.chance(50) => list(rng, &|r| r.pick(&["true", "false"]).to_string()),
        "shape" if rng.chance(30) => rng.pick(NUMBERS).to_string(),
        "verify"
        | "external"
        | "check"
        | "symmetric"
        | "gated"
        | "tied_embeddings"
        | "reshard_after_forward"
        | "wraparound" => rng.pick(&["true", "false"]).to_string(),
        _ if rng.chance(50) => rng.pick(NUMBERS).to_string(),
        _ => format!("\"{}\"", rng.pick(STRINGS)),
    }
}

/// A config from the schema: some of its tables, each with some of its keys (and now and
/// then a key it does not have).
fn from_schema(rng: &mut Rng) -> String {
    let mut out = String::new();
    let mut top = String::new();
    for &(table, keys) in config::schema() {
        if !table.is_empty() && rng.chance(30) {
            continue;
        }
        let entries = match table {
            "job.collectives" | "faults" => rng.below(4),
            _ => 1,
        };
        for _ in 0..entries {
            let mut body = String::new();
            for key in keys {
                let nested = table.is_empty()
                    || (table == "job" && ["model", "optimizer", "collectives"].contains(key));
                if nested && *key != "name" {
                    continue;
                }
                if rng.chance(55) {
                    body.push_str(&format!("{key} = {}\n", value_for(rng, key)));
                }
            }
            if rng.chance(5) {
                body.push_str(&format!("bogus{} = {}\n", rng.below(3), value(rng, 0)));
            }
            match table {
                "" => top.push_str(&body),
                "job.collectives" | "faults" => out.push_str(&format!("[[{table}]]\n{body}")),
                _ => out.push_str(&format!("[{table}]\n{body}")),
            }
        }
    }
    format!("{top}{out}")
}

/// Valid configs of every kind, to change a few keys of.
const VALID: &[&str] = &[
    "name = \"c\"\n[topology]\nshape = \"2x2x2\"\n[launch]\nworkers = 2\n[job]\nkind = \"collectives\"\nmode = \"data\"\niterations = 2\n[[job.collectives]]\nop = \"all-reduce\"\nsize = \"64KiB\"\n[[job.collectives]]\nop = \"all-gather\"\nsize = \"64KiB\"\ngroup = \"y,z\"\n[[faults]]\nkind = \"delay\"\nlink = \"1:+x\"\ndelay_ms = 20\n",
    "name = \"t\"\n[topology]\nshape = \"2x2x2\"\n[launch]\nworkers = 2\n[job]\nkind = \"train\"\nstrategy = \"fsdp+tp\"\nsteps = 3\nbatch = 8\n[job.model]\nwidths = [8, 16, 4]\n[job.optimizer]\nkind = \"adamw\"\nlr = 0.01\n[recovery]\ncheckpoint_every = 1\nmax_restarts = 1\n[[faults]]\nkind = \"slow\"\nchip = 3\nfactor = 10\n[watchdog]\ntimeout_ms = 3000\nheartbeat_ms = 100\n",
    "name = \"m\"\n[topology]\nshape = \"4x4\"\nslices = 2\n[job]\nkind = \"train\"\nmode = \"meta\"\nstrategy = \"hsdp\"\nremat = \"full\"\n[job.model]\nkind = \"transformer\"\nlayers = 2\nd_model = 64\nheads = 4\nkv_heads = 2\nffn = 128\nvocab = 256\nseq = 32\nmlp = \"swiglu\"\n[hardware]\nici_latency_ns = 0\nhbm_bytes = 1e9\n",
    "name = \"p\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"torch\"\nprogram = \"train.py\"\nargs = [\"--steps\", \"3\"]\n[[faults]]\nkind = \"partition\"\nchip_groups = [[0, 1], [2, 3]]\n",
];

/// A valid config with some keys set to other values (as `--set` overrides, and in the text).
fn mutated(rng: &mut Rng) -> (String, Vec<String>) {
    let text = rng.pick(VALID).to_string();
    let mut sets = Vec::new();
    // Mostly one change, so that what follows the first check of a key is reached too.
    let changes = if rng.chance(60) { 1 } else { 1 + rng.below(4) };
    for _ in 0..changes {
        let &(table, keys) = rng.pick(config::schema());
        let key = rng.pick(keys);
        if table == "job.collectives" || table == "faults" {
            continue;
        }
        let path = if table.is_empty() {
            key.to_string()
        } else {
            format!("{table}.{key}")
        };
        sets.push(format!("{path}={}", value_for(rng, key)));
    }
    // Or a value in the text itself.
    if !sets.is_empty() && rng.chance(60) {
        return (text, sets);
    }
    let lines: Vec<&str> = text.lines().collect();
    let i = rng.below(lines.len());
    let mut lines: Vec<String> = lines.iter().map(|l| l.to_string()).collect();
    if let Some((key, _)) = lines[i].split_once(" = ") {
        let key = key.to_string();
        lines[i] = format!("{key} = {}", value_for(rng, &key));
    }
    (lines.join("\n") + "\n", sets)
}

/// Bytes changed, cut or repeated in a valid config (mostly syntax errors).
fn garbled(rng: &mut Rng) -> String {
    let mut bytes = rng.pick(VALID).as_bytes().to_vec();
    for _ in 0..1 + rng.below(8) {
        let i = rng.below(bytes.len());
        match rng.below(4) {
            0 => bytes[i] = (rng.next() & 0xff) as u8,
            1 => {
                bytes.truncate(i);
            }
            2 => {
                let j = rng.below(bytes.len());
                let piece = bytes[i.min(j)..i.max(j)].to_vec();
                bytes.splice(i..i, piece);
            }
            _ => bytes.insert(i, *rng.pick(b"[]=\"\n#.,{}0x-+e")),
        }
        if bytes.is_empty() {
            break;
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The config of case `seed` and its `--set` overrides.
fn case(seed: u64) -> (String, Vec<String>) {
    let mut rng = Rng(seed);
    match rng.below(10) {
        0..=3 => (from_schema(&mut rng), Vec::new()),
        4..=8 => mutated(&mut rng),
        _ => (garbled(&mut rng), Vec::new()),
    }
}

/// Validates one case (whether it validated); a panic is reported with its seed and config.
fn run(seed: u64) -> bool {
    let (text, sets) = case(seed);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        config::from_text("fuzz.toml", &text, &sets).is_ok()
    }));
    match outcome {
        Ok(valid) => valid,
        Err(_) => panic!(
            "config validation panicked on case {seed} (PODSIM_FUZZ_SEED={seed} PODSIM_FUZZ_CASES=1)\n--set {sets:?}\n{text}"
        ),
    }
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok()?.trim().parse().ok()
}

#[test]
fn config_validation_never_panics() {
    let first: u64 = env("PODSIM_FUZZ_SEED").unwrap_or(0x5EED_0000);
    let budget: Option<u64> = env("PODSIM_FUZZ_SECS");
    let cases: u64 = env("PODSIM_FUZZ_CASES").unwrap_or(256);
    let start = Instant::now();
    let (mut ran, mut valid) = (0u64, 0u64);
    loop {
        let done = match budget {
            Some(secs) => start.elapsed() >= Duration::from_secs(secs),
            None => ran >= cases,
        };
        if done {
            break;
        }
        valid += u64::from(run(first.wrapping_add(ran)));
        ran += 1;
    }
    println!(
        "fuzz_config: {ran} cases from seed {first} in {:.1} s ({valid} valid, {} refused), no panic",
        start.elapsed().as_secs_f64(),
        ran - valid
    );
}

/// The nonsense values of the reliability issue, each refused (not only survived).
#[test]
fn the_issues_nonsense_values_are_refused() {
    let train = VALID[1];
    for (name, text, sets) in [
        (
            "slow 1e300",
            train.replace("factor = 10", "factor = 1e300"),
            vec![],
        ),
        ("lr nan", train.replace("lr = 0.01", "lr = nan"), vec![]),
        ("lr inf", train.replace("lr = 0.01", "lr = inf"), vec![]),
        (
            "2^63 wide",
            train.to_string(),
            vec!["job.model.widths=[8, 9223372036854775807, 4]".to_string()],
        ),
        (
            "delay 30 s",
            VALID[0].replace("delay_ms = 20", "delay_ms = 30000"),
            vec![],
        ),
        (
            "delay 1e11 ms",
            VALID[0].replace("delay_ms = 20", "delay_ms = 1e11"),
            vec![],
        ),
    ] {
        let sets: Vec<String> = sets;
        assert!(
            config::from_text("issue.toml", &text, &sets).is_err(),
            "{name} validated"
        );
    }
}
