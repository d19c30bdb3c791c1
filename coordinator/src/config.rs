//! Job configs: TOML read into validated types. `validate` reports every problem it can find
//! at once, each as `file:line: field: reason`: unknown keys anywhere, wrong types per section,
//! then every semantic problem (a shape that does not parse, more workers than chips, an axis
//! the torus lacks...). Nothing is started from a config that has a problem.

use crate::toml_lines;
use std::cell::OnceCell;
use std::collections::HashSet;
use std::fmt;
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};

use podsim_collectives::{Algo, DType, OpKind, ReduceOp};
use podsim_job::CollectiveStep;
use podsim_job::{Count, TorchSpec};
use podsim_job::{DesyncMode, FaultKind, FaultSpec};
use podsim_programs::job::{JobSpec, Program, Transport};
use podsim_programs::train::strategy::Plan;
use podsim_programs::train::{
    AttentionKind, BlockKind, Eager, GradReduce, MlpKind, MlpSpec, ModelSpec, OptimizerSpec, Remat,
    ReplicaSync, Strategy, TpActivations, TrainSpec, TransformerSpec,
};
use podsim_topology::{
    Group, HARDWARE_KEYS, Hardware, HardwareOverrides, Link, MAX_CHIPS, Placement, Pod, Torus,
};
use podsim_worker::tls::{Tls, TlsFiles};
use serde::Deserialize;

use crate::units::{format_size, parse_size};

/// One problem in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub line: Option<usize>,
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(l) => write!(f, "{}:{l}: {}: {}", self.file, self.field, self.reason),
            None => write!(f, "{}: {}: {}", self.file, self.field, self.reason),
        }
    }
}

/// Every problem found in one config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        writeln!(
            f,
            "{n} problem{} in the config:",
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            writeln!(f, "  {e}")?;
        }
        Ok(())
    }
}

/// Settings of the hang watchdog (used by the hang detector; validated now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Watchdog {
    pub timeout_ms: u64,
    pub heartbeat_ms: u64,
    /// How long a chip may stay busy in its program's own code (a kernel, a PyTorch rank's
    /// Python between calls) while peers wait on it before it is a hang: NCCL's default
    /// timeout, 10 minutes, unless `busy_timeout_s` says otherwise.
    pub busy_ms: u64,
    /// Collectives each chip's flight recorder keeps.
    pub recorder_entries: usize,
}

/// A validated job config.
#[derive(Debug, Clone)]
pub struct JobConfig {
    pub name: String,
    pub source: PathBuf,
    pub pod: Pod,
    pub hardware: Hardware,
    pub workers: u32,
    pub bind: String,
    pub external: bool,
    /// How workers reach each other (`[launch] transport`).
    pub transport: Transport,
    /// Mutual TLS on every TCP connection of the job, gRPC and record links (`[launch.tls]`).
    pub tls: Option<Tls>,
    pub program: Program,
    pub watchdog: Watchdog,
    pub output_dir: PathBuf,
    pub faults: Vec<FaultSpec>,
    /// Restarts allowed after a hang or a dead worker (train jobs with checkpoints).
    pub max_restarts: u32,
    /// Chip 0 alone on a mirror fabric stands for every chip (`[job] symmetric`).
    pub symmetric: bool,
}

impl JobConfig {
    pub fn spec(&self) -> JobSpec {
        JobSpec {
            name: self.name.clone(),
            pod: self.pod.clone(),
            hardware: self.hardware.clone(),
            workers: self.workers,
            program: self.program.clone(),
            faults: self.faults.clone(),
            heartbeat_ms: self.watchdog.heartbeat_ms,
            recorder_entries: self.watchdog.recorder_entries,
            watchdog_ms: self.watchdog.timeout_ms,
            busy_ms: self.watchdog.busy_ms,
            symmetric: self.symmetric,
            trace: None,
            transport: self.transport,
        }
    }

    pub fn mode(&self) -> &'static str {
        if is_meta(&self.program) {
            "meta"
        } else {
            "data"
        }
    }

    pub fn kind(&self) -> &'static str {
        match &self.program {
            Program::Collectives { .. } => "collectives",
            Program::Bench { .. } => "bench",
            Program::Train(_) => "train",
            Program::Torch(_) => "torch",
        }
    }
}

// ---- raw shapes, as written -------------------------------------------------------------

/// Declares a table of the config file as written and the list of its keys from one field
/// list: adding a key is adding a field here (the struct deserialises it; `KEYS` lets every
/// unknown key be reported at once, where serde stops at the first). A numeric key declares
/// the values it takes after its type and kinds, `{1..=1_000_000}` (any `RangeBounds`: `{..}`
/// for every value, [`above`] for an open lower end); a value outside is reported with the
/// range and never reaches the code that reads the key (see [`in_range`]).
macro_rules! table {
    ($(#[$m:meta])* struct $name:ident {
        $($field:ident: $ty:ty $([$($kind:ident),+])? $({$range:expr})?),* $(,)?
    }) => {
        $(#[$m])*
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct $name {
            $($field: $ty),*
        }

        impl $name {
            const KEYS: &'static [&'static str] = &[$(stringify!($field)),*];

            /// The keys only some kinds of job take (`key: Type [kind, ...]` in the
            /// declaration): each with those kinds and whether it is set here.
            #[allow(dead_code)]
            fn kind_keys(&self) -> Vec<(&'static str, &'static [&'static str], bool)> {
                vec![$($(
                    (
                        stringify!($field),
                        &[$(stringify!($kind)),+][..],
                        self.$field.is_some(),
                    ),
                )?)*]
            }

            /// Each field with its declared type and whether it declares a range (for the
            /// test that every numeric key has one).
            #[cfg(test)]
            const FIELDS: &'static [(&'static str, &'static str, bool)] = &[$((
                stringify!($field),
                stringify!($ty),
                false $(|| !stringify!($range).is_empty())?,
            )),*];
        }

        impl Ranges for $name {
            fn check_ranges(&mut self, _p: &mut Problems<'_>, _table: &str) {
                $($(in_range(_p, _table, stringify!($field), &mut self.$field, $range);)?)*
            }
        }
    };
}

/// The tables whose numeric keys are checked against their ranges when they are read.
trait Ranges {
    /// Reports every value outside its key's range and forgets it (`table` as for
    /// [`Problems::add`]).
    fn check_ranges(&mut self, p: &mut Problems<'_>, table: &str);
}

/// A numeric key as read: one value or a list of them.
trait Numeric {
    type Elem: PartialOrd + Copy + fmt::Debug;
    fn values(&self) -> Vec<Self::Elem>;
    /// Drops the value: later checks see the key's default, never a value out of range.
    fn forget(&mut self);
}

macro_rules! numeric {
    ($($t:ty),*) => {$(
        impl Numeric for Option<$t> {
            type Elem = $t;
            fn values(&self) -> Vec<$t> {
                self.iter().copied().collect()
            }
            fn forget(&mut self) {
                *self = None;
            }
        }
        impl Numeric for Option<Vec<$t>> {
            type Elem = $t;
            fn values(&self) -> Vec<$t> {
                self.iter().flatten().copied().collect()
            }
            fn forget(&mut self) {
                *self = None;
            }
        }
        impl Numeric for Option<Vec<Vec<$t>>> {
            type Elem = $t;
            fn values(&self) -> Vec<$t> {
                self.iter().flatten().flatten().copied().collect()
            }
            fn forget(&mut self) {
                *self = None;
            }
        }
    )*};
}

numeric!(u32, u64, usize, f32, f64);

/// Values above `lo` up to `hi` (a range with an open lower end).
fn above<T>(lo: T, hi: T) -> (Bound<T>, Bound<T>) {
    (Bound::Excluded(lo), Bound::Included(hi))
}

/// Chips of the largest pod, as the `u32` chip numbers are.
const CHIPS: u32 = MAX_CHIPS as u32;
/// Widest layer (and longest sequence, largest vocabulary, largest batch): 16M.
pub const WIDTH: usize = 1 << 24;
/// Elements of the largest tensor (and parameters of the largest model) a job may describe,
/// in meta mode too: every product of sizes the trainer forms then fits in a `u64` with room
/// for bytes and flops, and a count converts to `f64` exactly.
const MAX_ELEMENTS: u64 = 1 << 53;

/// Checks the value(s) of `table.key` against `range`: NaN and infinities are outside every
/// range. A value outside is reported with the range allowed, once (later checks of the key,
/// which see its default, do not report it again).
fn in_range<V: Numeric>(
    p: &mut Problems<'_>,
    table: &str,
    key: &str,
    value: &mut V,
    range: impl RangeBounds<V::Elem>,
) {
    let Some(bad) = value.values().into_iter().find(|v| !range.contains(v)) else {
        return;
    };
    let bound = |b: Bound<&V::Elem>| match b {
        Bound::Included(v) | Bound::Excluded(v) => Some(format!("{v:?}")),
        Bound::Unbounded => None,
    };
    let (lo, hi) = (bound(range.start_bound()), bound(range.end_bound()));
    let open = |b: Bound<&V::Elem>| matches!(b, Bound::Excluded(_));
    let allowed = match (lo, hi) {
        (Some(lo), Some(hi)) => format!(
            "{} {lo} {} {hi}",
            if open(range.start_bound()) {
                "above"
            } else {
                "from"
            },
            if open(range.end_bound()) {
                "up to (not including)"
            } else {
                "to"
            },
        ),
        (Some(lo), None) => format!("at least {lo}"),
        (None, Some(hi)) => format!("at most {hi}"),
        (None, None) => "a number".into(),
    };
    p.out_of_range(
        table,
        key,
        format!("{bad:?} is out of range (allowed: {allowed})"),
    );
    value.forget();
}

table! {
    struct RawTopology {
        shape: Shape,
        wraparound: Option<Wrap>,
        slices: Option<u32> {1..=CHIPS},
        hardware: Option<String>,
    }
}

/// `"4x4x4"`, or a bare number for a ring (`shape = 8`, `--set topology.shape=8`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Shape {
    Text(String),
    Ring(u32),
}

impl Shape {
    fn text(&self) -> String {
        match self {
            Shape::Text(t) => t.clone(),
            Shape::Ring(n) => n.to_string(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Wrap {
    All(bool),
    PerAxis(Vec<bool>),
}

table! {
    #[derive(Default)]
    struct RawLaunch {
        workers: Option<u32> {1..=CHIPS},
        bind: Option<String>,
        external: Option<bool>,
        transport: Option<String>,
        tls: Option<RawTls>,
    }
}

table! {
    struct RawTls {
        ca: String,
        cert: String,
        key: String,
        server_name: Option<String>,
    }
}

table! {
    struct RawJob {
        kind: String,
        mode: Option<String>,
        iterations: Option<u32> [collectives] {1..=1_000_000},
        collectives: Option<Vec<RawCollective>> [collectives],
        verify: Option<bool> [collectives],
        strategy: Option<String> [train],
        eager: Option<String> [train, torch],
        count: Option<String> [torch],
        steps: Option<u32> [train] {1..=1_000_000},
        batch: Option<usize> [train] {1..=WIDTH},
        grad_accum: Option<u32> [train] {1..=65_536},
        seed: Option<u64> [train] {..},
        bucket_cap_mb: Option<f64> [train] {above(0.0, 1_048_576.0)},
        reshard_after_forward: Option<bool> [train],
        tp: Option<u32> [train] {1..=CHIPS},
        replicas: Option<u32> [train] {1..=CHIPS},
        algo: Option<String> [train, torch],
        check: Option<bool> [train],
        symmetric: Option<bool>,
        remat: Option<String>,
        tp_activations: Option<String>,
        replica_sync: Option<String> [train],
        grad_reduce: Option<String> [train],
        reduce_dtype: Option<String> [train],
        model: Option<RawModel> [train],
        optimizer: Option<RawOptimizer> [train],
        program: Option<String> [torch],
        args: Option<Vec<String>> [torch],
        connect_timeout_s: Option<u64> [torch] {1..=3600},
        intercept: Option<bool> [torch],
        prefork: Option<bool> [torch],
        verify_ranks: Option<Vec<u32>> [torch] {0..=CHIPS},
        verify_count: Option<u32> [torch] {0..=MAX_VERIFY_RANKS},
    }
}

table! {
    struct RawModel {
        kind: Option<String>,
        widths: Option<Vec<usize>> [mlp] {1..=WIDTH},
        layers: Option<usize> [transformer] {1..=65_536},
        d_model: Option<usize> [transformer] {1..=WIDTH},
        heads: Option<usize> [transformer] {1..=65_536},
        kv_heads: Option<usize> [transformer] {1..=65_536},
        ffn: Option<usize> [transformer] {1..=WIDTH},
        vocab: Option<usize> [transformer] {1..=WIDTH},
        seq: Option<usize> [transformer] {1..=WIDTH},
        gated: Option<bool> [transformer],
        head_dim: Option<usize> [transformer] {1..=WIDTH},
        mlp: Option<String> [transformer],
        block: Option<String> [transformer],
        attention: Option<String> [transformer],
        tied_embeddings: Option<bool> [transformer],
        dtype: Option<String> [transformer],
        weight_dtype: Option<String> [transformer],
        bias: Option<bool> [transformer],
        upcast: Option<bool> [transformer],
    }
}

table! {
    #[derive(Default)]
    struct RawOptimizer {
        kind: Option<String>,
        lr: Option<f32> {0.0..=100.0},
        momentum: Option<f32> {0.0..1.0},
        weight_decay: Option<f32> {0.0..=10.0},
        beta1: Option<f32> {0.0..1.0},
        beta2: Option<f32> {0.0..1.0},
        eps: Option<f32> {above(0.0, 1.0)},
    }
}

table! {
    struct RawCollective {
        op: String,
        size: String,
        algo: Option<String>,
        group: Option<String>,
        reduce: Option<String>,
        root: Option<u32> {0..CHIPS},
        dtype: Option<String>,
    }
}

table! {
    struct RawFault {
        kind: String,
        chip: Option<u32> {0..CHIPS},
        worker: Option<u32> {0..CHIPS},
        link: Option<String>,
        groups: Option<Vec<Vec<u32>>> {0..CHIPS},
        chip_groups: Option<Vec<Vec<u32>>> {0..CHIPS},
        at_step: Option<u64> {0..=u64::from(u32::MAX)},
        at_seq: Option<u64> {0..=u64::from(u32::MAX)},
        // A day: a fault later than the job never fires.
        after_ms: Option<u64> {0..=86_400_000},
        mode: Option<String>,
        // A minute, and below the watchdog's timeout (checked in `fault`).
        delay_ms: Option<f64> {0.0..=60_000.0},
        // Each send waits at most a second more however slow the chip (worker/src/faults.rs).
        factor: Option<f64> {1.0..=1000.0},
    }
}

table! {
    #[derive(Default)]
    struct RawRecovery {
        checkpoint_every: Option<u32> {1..=1_000_000},
        max_restarts: Option<u32> {0..=100},
    }
}

table! {
    #[derive(Default)]
    struct RawWatchdog {
        // An hour, a minute.
        timeout_ms: Option<u64> {1..=3_600_000},
        heartbeat_ms: Option<u64> {1..=60_000},
        // A second, a day.
        busy_timeout_s: Option<u64> {1..=86_400},
        recorder_entries: Option<usize> {1..=1_000_000},
    }
}

table! {
    #[derive(Default)]
    struct RawOutput {
        dir: Option<String>,
    }
}

/// Known keys per table, for reporting every unknown key (serde stops at the first).
const SCHEMA: &[(&str, &[&str])] = &[
    (
        "",
        &[
            "name", "topology", "launch", "job", "watchdog", "output", "hardware", "faults",
            "recovery",
        ],
    ),
    ("topology", RawTopology::KEYS),
    ("launch", RawLaunch::KEYS),
    ("launch.tls", RawTls::KEYS),
    ("job", RawJob::KEYS),
    ("job.model", RawModel::KEYS),
    ("job.optimizer", RawOptimizer::KEYS),
    ("job.collectives", RawCollective::KEYS),
    ("watchdog", RawWatchdog::KEYS),
    ("recovery", RawRecovery::KEYS),
    ("faults", RawFault::KEYS),
    ("output", RawOutput::KEYS),
    ("hardware", HARDWARE_KEYS),
];

/// Each `[hardware]` figure with its range: what a chip could have, with room on either side
/// of every preset (the topology crate checks that each is finite and positive; a figure
/// outside these would make virtual times overflow or mean nothing).
fn hardware_ranges(o: &mut HardwareOverrides) -> [(&'static str, &mut Option<f64>, f64, f64); 20] {
    [
        ("ici_bandwidth", &mut o.ici_bandwidth, 1e3, 1e18),
        ("ici_latency_ns", &mut o.ici_latency_ns, 0.0, 1e12),
        ("dcn_bandwidth", &mut o.dcn_bandwidth, 1e3, 1e18),
        ("dcn_latency_ns", &mut o.dcn_latency_ns, 0.0, 1e12),
        ("peak_flops", &mut o.peak_flops, 1e6, 1e21),
        (
            "hbm_bytes",
            &mut o.hbm_bytes,
            1024.0,
            1_125_899_906_842_624.0,
        ),
        ("hbm_bandwidth", &mut o.hbm_bandwidth, 1e3, 1e18),
        ("mxu_tile", &mut o.mxu_tile, 1.0, 65_536.0),
        ("matmul_efficiency", &mut o.matmul_efficiency, 1e-3, 1.0),
        ("matmul_block", &mut o.matmul_block, 1.0, 1_048_576.0),
        ("hbm_efficiency", &mut o.hbm_efficiency, 1e-3, 1.0),
        (
            "attention_efficiency",
            &mut o.attention_efficiency,
            1e-3,
            1.0,
        ),
        ("attention_block", &mut o.attention_block, 1.0, 1_048_576.0),
        ("kernel_overhead_ns", &mut o.kernel_overhead_ns, 0.0, 1e12),
        ("host_bandwidth", &mut o.host_bandwidth, 1e3, 1e18),
        ("chips_per_host", &mut o.chips_per_host, 1.0, 1024.0),
        ("ici_efficiency", &mut o.ici_efficiency, 1e-3, 1.0),
        (
            "collective_overhead_ns",
            &mut o.collective_overhead_ns,
            0.0,
            1e12,
        ),
        ("dcn_efficiency", &mut o.dcn_efficiency, 1e-3, 1.0),
        (
            "tensorcores_per_chip",
            &mut o.tensorcores_per_chip,
            1.0,
            64.0,
        ),
    ]
}

impl Ranges for HardwareOverrides {
    fn check_ranges(&mut self, p: &mut Problems<'_>, table: &str) {
        for (key, value, lo, hi) in hardware_ranges(self) {
            in_range(p, table, key, value, lo..=hi);
        }
    }
}

struct Problems<'a> {
    file: String,
    text: &'a str,
    /// Where each table and key of `text` sits, read once at the first problem.
    lines: OnceCell<toml_lines::LineIndex<'a>>,
    list: Vec<ConfigError>,
    /// Fields reported out of range: later checks, which see the key's default, do not
    /// report them again.
    out_of_range: HashSet<String>,
}

impl<'a> Problems<'a> {
    fn new(file: &str, text: &'a str) -> Problems<'a> {
        Problems {
            file: file.to_string(),
            text,
            lines: OnceCell::new(),
            list: Vec::new(),
            out_of_range: HashSet::new(),
        }
    }

    /// The line of `key` in `table` (`job.collectives#2` for the third entry of an array of
    /// tables), for error messages.
    fn locate(&self, table: &str, key: Option<&str>) -> Option<usize> {
        let (name, entry) = match table.split_once('#') {
            Some((n, i)) => (n, i.parse::<usize>().ok()),
            None => (table, None),
        };
        self.lines
            .get_or_init(|| toml_lines::LineIndex::new(self.text))
            .line_of(name, entry, key)
    }

    /// Reports a value outside its key's range (see [`in_range`]).
    fn out_of_range(&mut self, table: &str, key: &str, reason: String) {
        self.add(table, Some(key), reason);
        if let Some(e) = self.list.last() {
            self.out_of_range.insert(e.field.clone());
        }
    }

    fn add(&mut self, table: &str, key: Option<&str>, reason: impl Into<String>) {
        let shown_table = table.split('#').next().unwrap_or(table);
        let field = match (shown_table, key) {
            ("", Some(k)) => k.to_string(),
            (t, Some(k)) => format!("{t}.{k}"),
            (t, None) => t.to_string(),
        };
        let field = match table.split_once('#') {
            Some((_, i)) => field.replacen(shown_table, &format!("{shown_table}[{i}]"), 1),
            None => field,
        };
        if key.is_some() && self.out_of_range.contains(&field) {
            return;
        }
        self.list.push(ConfigError {
            file: self.file.clone(),
            line: self.locate(table, key),
            field,
            reason: reason.into(),
        });
    }
}

/// What keeps a `symmetric = true` job off the mirror fabric (one chip standing for all, or
/// one per class of chips alike where the torus or the device mesh has fewer symmetries).
fn symmetric_problems(
    p: &mut Problems<'_>,
    program: Option<&mut Program>,
    workers: u32,
    faults: &[FaultSpec],
) {
    let mut not = |reason: String| p.add("job", Some("symmetric"), reason);
    let (meta, ops) = match &program {
        Some(Program::Collectives { meta, script, .. }) => {
            (*meta, script.iter().map(|s| s.op).collect())
        }
        Some(Program::Train(spec)) => (spec.meta, Vec::new()),
        Some(Program::Bench { .. } | Program::Torch(_)) | None => (true, Vec::new()),
    };
    podsim_collectives::symmetry_obstacles(meta, ops)
        .into_iter()
        .for_each(&mut not);
    if workers != 1 {
        not(format!(
            "the mirror fabric runs in one process: launch.workers must be 1, not {workers}"
        ));
    }
    if !faults.is_empty() {
        not("faults single chips out: they break the symmetry".into());
    }
    if let Some(Program::Train(spec)) = program {
        spec.symmetric = true;
    }
}

/// The `[job.model]` table: an MLP by its widths or a transformer by its shape.
fn model_spec(p: &mut Problems<'_>, m: &RawModel, meta: bool) -> Option<ModelSpec> {
    let kind = m.kind.as_deref().unwrap_or("mlp");
    match kind {
        "mlp" | "transformer" => {}
        other => {
            p.add(
                "job.model",
                Some("kind"),
                format!("{other:?} is not mlp or transformer"),
            );
            return None;
        }
    };
    let before = p.list.len();
    for (key, kinds, set) in m.kind_keys() {
        if set && !kinds.contains(&kind) {
            p.add(
                "job.model",
                Some(key),
                format!("not a field of a {kind} model"),
            );
        }
    }
    if kind == "mlp" {
        let widths = m.widths.clone().unwrap_or_default();
        if widths.len() < 2 || widths.contains(&0) {
            p.add(
                "job.model",
                Some("widths"),
                "needs at least two widths (inputs and classes), each at least 1",
            );
        }
        return (p.list.len() == before).then_some(ModelSpec::Mlp(MlpSpec { widths }));
    }
    let spec = transformer_spec(p, m);
    // A key refused as out of range reads as 0 here: its shape problems would contradict it.
    let refused_key = p.out_of_range.iter().any(|f| f.starts_with("job.model."));
    if p.list.len() == before && !refused_key {
        for problem in spec.problems() {
            p.add("job.model", None, problem);
        }
    }
    if !meta {
        p.add(
            "job",
            Some("mode"),
            "a transformer model runs in meta mode only (mode = \"meta\")",
        );
    }
    (p.list.len() == before).then_some(ModelSpec::Transformer(spec))
}

/// A transformer's shape from `[job.model]`: every missing or inconsistent key reported.
fn transformer_spec(p: &mut Problems<'_>, m: &RawModel) -> TransformerSpec {
    fn need(p: &mut Problems<'_>, key: &str, v: Option<usize>) -> usize {
        if v.is_none() {
            p.add("job.model", Some(key), "missing (a transformer needs it)");
        }
        v.unwrap_or(0)
    }
    let heads = need(p, "heads", m.heads);
    let d_model = need(p, "d_model", m.d_model);
    let head_dim = match m.head_dim {
        Some(h) => h,
        None if heads > 0 && d_model.is_multiple_of(heads) => d_model / heads,
        None => {
            if heads > 0 && d_model > 0 {
                p.add(
                    "job.model",
                    Some("head_dim"),
                    format!(
                        "missing, and d_model = {d_model} is not a multiple of heads = {heads}"
                    ),
                );
            }
            0
        }
    };
    let (mlp, block) = transformer_layers(p, m);
    let (dtype, weight_dtype) = transformer_dtypes(p, m);
    TransformerSpec {
        layers: need(p, "layers", m.layers),
        d_model,
        heads,
        kv_heads: m.kv_heads.unwrap_or(heads),
        head_dim,
        ffn: need(p, "ffn", m.ffn),
        mlp,
        block,
        attention: transformer_attention(p, m),
        vocab: need(p, "vocab", m.vocab),
        tied_embeddings: m.tied_embeddings.unwrap_or(false),
        seq: need(p, "seq", m.seq),
        dtype,
        weight_dtype,
        bias: m.bias.unwrap_or(true),
        upcast: m.upcast.unwrap_or(false),
    }
}

/// `[job.model]` `dtype` and `weight_dtype`: weights are kept at least as wide as they are
/// computed with (f32 master weights under bf16 compute, or bf16 throughout).
fn transformer_dtypes(p: &mut Problems<'_>, m: &RawModel) -> (DType, DType) {
    let mut dtype_of = |key: &str, value: Option<&str>, default: DType| match value {
        None => default,
        Some("bf16") => DType::Bf16,
        Some("f32") => DType::F32,
        Some(other) => {
            p.add(
                "job.model",
                Some(key),
                format!("{other:?} is not bf16 or f32"),
            );
            default
        }
    };
    let dtype = dtype_of("dtype", m.dtype.as_deref(), DType::Bf16);
    let weight_dtype = dtype_of("weight_dtype", m.weight_dtype.as_deref(), DType::F32);
    if weight_dtype.size() < dtype.size() {
        p.add(
            "job.model",
            Some("weight_dtype"),
            format!(
                "{} weights cannot feed {} compute: weight_dtype must be at least as wide as dtype",
                weight_dtype.name(),
                dtype.name()
            ),
        );
    }
    (dtype, weight_dtype)
}

/// A transformer block's MLP kind (`mlp`, or the older `gated`) and its layout (`block`).
fn transformer_layers(p: &mut Problems<'_>, m: &RawModel) -> (MlpKind, BlockKind) {
    let mlp = match (m.mlp.as_deref(), m.gated) {
        (Some(_), Some(_)) => {
            p.add(
                "job.model",
                Some("gated"),
                "give mlp or gated (the older name of mlp = \"swiglu\"), not both",
            );
            MlpKind::Gelu
        }
        (Some(name), None) => name.parse().unwrap_or_else(|why| {
            p.add("job.model", Some("mlp"), why);
            MlpKind::Gelu
        }),
        (None, Some(true)) => MlpKind::Swiglu,
        (None, _) => MlpKind::Gelu,
    };
    let block = m
        .block
        .as_deref()
        .unwrap_or("sequential")
        .parse()
        .unwrap_or_else(|why| {
            p.add("job.model", Some("block"), why);
            BlockKind::Sequential
        });
    (mlp, block)
}

/// `[job.model] attention`: flash (the default) or dot_product.
fn transformer_attention(p: &mut Problems<'_>, m: &RawModel) -> AttentionKind {
    let name = m.attention.as_deref().unwrap_or("flash");
    name.parse().unwrap_or_else(|why| {
        p.add("job.model", Some("attention"), why);
        AttentionKind::Flash
    })
}

/// Applies `key.path=value` overrides (values in TOML syntax; bare words become strings).
pub fn apply_overrides(table: &mut toml::Table, sets: &[String]) -> Result<(), String> {
    for set in sets {
        let (path, value) = set
            .split_once('=')
            .ok_or_else(|| format!("--set {set:?}: expected key=value"))?;
        let value: toml::Value = match format!("v = {value}").parse::<toml::Table>() {
            Ok(mut t) => t
                .remove("v")
                .unwrap_or(toml::Value::String(value.to_string())),
            Err(_) => toml::Value::String(value.trim().to_string()),
        };
        let keys: Vec<&str> = path.trim().split('.').collect();
        // Field names only: a key holding `=`, a space or `#` would be read as part of its
        // value (`job.iterations=7 #=1` set 7).
        if let Some(bad) = keys.iter().find(|k| !is_field_name(k)) {
            return Err(format!(
                "--set {set:?}: {bad:?} is not a config field name (letters, digits, _ and -)"
            ));
        }
        let (last, parents) = keys
            .split_last()
            .ok_or_else(|| format!("--set {set:?}: empty key"))?;
        let mut t = &mut *table;
        for k in parents {
            let entry = t
                .entry(k.to_string())
                .or_insert_with(|| toml::Value::Table(Default::default()));
            t = entry
                .as_table_mut()
                .ok_or_else(|| format!("--set {set:?}: {k} is not a table"))?;
        }
        t.insert(last.to_string(), value);
    }
    Ok(())
}

/// Whether `s` can name a config field (one part of a dotted key).
pub fn is_field_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// `--set hardware.KEY=VALUE` overrides alone (a benchmark's hardware, which has no job):
/// read and range-checked as a config's `[hardware]` table is; any other key is an error.
pub fn hardware_from_sets(sets: &[String]) -> Result<HardwareOverrides, String> {
    let mut table = toml::Table::new();
    apply_overrides(&mut table, sets)?;
    if let Some(other) = table.keys().find(|k| *k != "hardware") {
        return Err(format!(
            "--set {other}...: only hardware.KEY=VALUE applies here"
        ));
    }
    let mut p = Problems::new("--set", "");
    let overrides = section::<HardwareOverrides>(&mut p, &table, "hardware");
    match overrides {
        Some(o) if p.list.is_empty() => Ok(o),
        _ => Err(ConfigErrors(p.list).to_string().trim_end().to_string()),
    }
}

/// The largest config or study file read (a config is a few KiB).
pub const MOST_CONFIG_BYTES: u64 = 1 << 20;

/// The text of a config or study file: a regular file of at most `MOST_CONFIG_BYTES`, or an
/// error naming the file.
pub(crate) fn read_config_text(path: &Path) -> Result<String, ConfigErrors> {
    crate::outdir::read_text(path, MOST_CONFIG_BYTES).map_err(|reason| {
        ConfigErrors(vec![ConfigError {
            file: path.display().to_string(),
            line: None,
            field: "file".into(),
            reason,
        }])
    })
}

/// Reads and validates `path` with command-line overrides applied.
pub fn load(path: &Path, sets: &[String]) -> Result<JobConfig, ConfigErrors> {
    let file = path.display().to_string();
    let one = |line: Option<usize>, field: &str, reason: String| {
        ConfigErrors(vec![ConfigError {
            file: file.clone(),
            line,
            field: field.into(),
            reason,
        }])
    };
    let text = read_config_text(path)?;
    let mut table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let line = e.span().map(|s| toml_lines::line_at(&text, s.start));
        one(line, "syntax", e.message().to_string())
    })?;
    apply_overrides(&mut table, sets).map_err(|e| one(None, "--set", e))?;
    parse(&file, &text, path, table)
}

/// Validates a config given as text with `key=value` overrides; `origin` names it in errors
/// (and stands for its path).
pub fn from_text(origin: &str, text: &str, sets: &[String]) -> Result<JobConfig, ConfigErrors> {
    let one = |field: &str, reason: String| {
        ConfigErrors(vec![ConfigError {
            file: origin.into(),
            line: None,
            field: field.into(),
            reason,
        }])
    };
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| one("syntax", e.message().to_string()))?;
    apply_overrides(&mut table, sets).map_err(|e| one("--set", e))?;
    parse(origin, text, Path::new(origin), table)
}

/// The job's `name`: a non-empty string.
fn job_name(p: &mut Problems<'_>, table: &toml::Table) -> Option<String> {
    match table.get("name") {
        Some(toml::Value::String(s)) if !s.trim().is_empty() => {
            match crate::outdir::folder_name_problem(s) {
                None => Some(s.clone()),
                Some(why) => {
                    p.add("", Some("name"), why);
                    None
                }
            }
        }
        Some(_) => {
            p.add("", Some("name"), "must be a non-empty string");
            None
        }
        None => {
            p.add("", Some("name"), "missing");
            None
        }
    }
}

fn parse(
    file: &str,
    text: &str,
    path: &Path,
    table: toml::Table,
) -> Result<JobConfig, ConfigErrors> {
    let mut p = Problems::new(file, text);
    // 1. Unknown keys, everywhere, reported and dropped (so that the rest of each section is
    //    still checked). 2. Types, section by section. 3. Meaning.
    let mut table = table;
    drop_unknown_keys(&mut p, &mut table);
    let name = job_name(&mut p, &table);
    let topology: Option<RawTopology> = required(&mut p, &table, "topology");
    let mut job: Option<RawJob> = required(&mut p, &table, "job");
    if let Some(j) = &mut job {
        job_ranges(&mut p, j);
    }
    let launch: RawLaunch = section(&mut p, &table, "launch").unwrap_or_default();
    let watchdog: Option<RawWatchdog> = section(&mut p, &table, "watchdog");
    let recovery: Option<RawRecovery> = section(&mut p, &table, "recovery");
    let output: Option<RawOutput> = section(&mut p, &table, "output");
    let overrides: Option<HardwareOverrides> = section(&mut p, &table, "hardware");
    let (pod, hardware) = match &topology {
        Some(t) => pod_and_hardware(&mut p, t, overrides.as_ref()),
        None => (None, None),
    };
    let (workers, transport, bind) = launch_settings(&mut p, &launch, pod.as_ref());
    let tls = launch.tls.as_ref().and_then(|t| tls_settings(&mut p, t));
    let wd = watchdog_settings(&mut p, watchdog.unwrap_or_default(), pod.as_ref(), workers);
    let mut program = job
        .as_ref()
        .and_then(|j| program(&mut p, j, pod.as_ref(), workers));
    let faults = faults_of(&mut p, &table, pod.as_ref(), workers, &wd, program.as_ref());
    let output_dir = output
        .and_then(|o| o.dir)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from("runs").join(name.clone().unwrap_or_else(|| "job".into()))
        });
    let max_restarts = match recovery.filter(|_| table.contains_key("recovery")) {
        Some(r) => recovery_settings(&mut p, r, program.as_mut(), &output_dir),
        None => 0,
    };
    // A PyTorch program in meta mode runs one representative rank unless told otherwise.
    let torch_meta = matches!(&program, Some(Program::Torch(t)) if t.meta);
    let symmetric = job.as_ref().and_then(|j| j.symmetric).unwrap_or(torch_meta);
    if symmetric {
        symmetric_problems(&mut p, program.as_mut(), workers, &faults);
    }
    // Last, on a config right in every other way: this host runs every chip of a job whose
    // workers it spawns.
    if p.list.is_empty()
        && !launch.external.unwrap_or(false)
        && let (Some(pod), Some(program)) = (&pod, &program)
    {
        host_memory(&mut p, pod, program, symmetric, host_available_memory());
    }
    match (name, pod, hardware, program) {
        (Some(name), Some(pod), Some(hardware), Some(program)) if p.list.is_empty() => {
            Ok(JobConfig {
                name,
                source: path.to_path_buf(),
                pod,
                hardware,
                workers,
                bind,
                external: launch.external.unwrap_or(false),
                transport,
                tls,
                program,
                watchdog: wd,
                output_dir,
                faults,
                max_restarts,
                symmetric,
            })
        }
        _ => Err(ConfigErrors(p.list)),
    }
}

/// An optional section: its defaults when absent.
fn section<T: for<'de> Deserialize<'de> + Default + Ranges>(
    p: &mut Problems<'_>,
    table: &toml::Table,
    name: &str,
) -> Option<T> {
    if table.contains_key(name) {
        required(p, table, name)
    } else {
        Some(T::default())
    }
}

/// A section that must be present (its numeric keys checked against their ranges).
fn required<T: for<'de> Deserialize<'de> + Ranges>(
    p: &mut Problems<'_>,
    table: &toml::Table,
    name: &str,
) -> Option<T> {
    let Some(v) = table.get(name) else {
        p.add(name, None, format!("missing [{name}] table"));
        return None;
    };
    let mut section: T = match v.clone().try_into() {
        Ok(section) => section,
        Err(e) => {
            report_type_errors::<T>(p, name, v.clone(), e);
            return None;
        }
    };
    section.check_ranges(p, name);
    Some(section)
}

/// Reports every value of section `name` that does not read as its key's type, each naming
/// its key and line: toml stops at the first (`error`) and names no key when it reads from a
/// `Value`, so each is found ([`error_at`]), reported and taken away in turn; a
/// required key missing is said of the table that lacks it.
fn report_type_errors<T: for<'de> Deserialize<'de>>(
    p: &mut Problems<'_>,
    name: &str,
    mut value: toml::Value,
    error: toml::de::Error,
) {
    // The table `path` names, as [`Problems::add`] spells it.
    fn table_name(name: &str, path: &[String]) -> String {
        let mut table = name.to_string();
        for step in path {
            if step.starts_with('#') {
                table.push_str(step);
            } else {
                table = format!("{table}.{step}");
            }
        }
        table
    }
    // Each costs a few reads of the section: past this many, the rest are left to a later run.
    const SHOWN: usize = 20;
    let mut error = Some(error);
    let mut removed = Vec::new();
    for _ in 0..SHOWN {
        let Some(e) = error.take() else {
            return;
        };
        let missing = e.message().strip_prefix("missing field ");
        if missing.is_some_and(|k| removed.contains(&k.trim_matches('`').to_string())) {
            return; // taken away here
        }
        let Some(mut path) = error_at::<T>(&value, missing.is_none()) else {
            p.add(name, None, plain(e.message()));
            return;
        };
        if missing.is_some() {
            // A required key missing is the fault of the table that lacks it.
            p.add(&table_name(name, &path), None, plain(e.message()));
            return;
        }
        let Some(key) = path.pop() else {
            return;
        };
        p.add(&table_name(name, &path), Some(&key), plain(e.message()));
        let Some(t) = table_at(&mut value, &path) else {
            return;
        };
        t.remove(&key);
        removed.push(key);
        error = value.clone().try_into::<T>().err();
    }
    if let Some(e) = error {
        p.add(
            name,
            None,
            format!(
                "{} (and maybe more after the {SHOWN} above)",
                plain(e.message())
            ),
        );
    }
}

/// A serde message about a value in a config's words: what was expected, then what was
/// found, without Rust's type names (`invalid type: string "x", expected u32` becomes
/// `expected a whole number, found the string "x"`). Other messages stay as they are.
fn plain(message: &str) -> String {
    let found_expected = ["invalid type: ", "invalid value: "]
        .iter()
        .find_map(|p| message.strip_prefix(p))
        .and_then(|rest| rest.rsplit_once(", expected "));
    if let Some((found, expected)) = found_expected {
        return format!(
            "expected {}, found {}",
            plain_type(expected),
            plain_value(found)
        );
    }
    if let Some(key) = message.strip_prefix("missing field ") {
        return format!("missing key {}", key.trim_matches('`'));
    }
    message.to_string()
}

/// An `expected` of serde's in a config's words.
fn plain_type(expected: &str) -> String {
    let unsigned = ["u8", "u16", "u32", "u64", "usize"];
    let signed = ["i8", "i16", "i32", "i64"];
    match expected {
        t if unsigned.contains(&t) => "a whole number, 0 or more".into(),
        t if signed.contains(&t) => "a whole number".into(),
        "f32" | "f64" => "a number".into(),
        "a boolean" => "true or false".into(),
        "a sequence" => "a list [...]".into(),
        "a string" | "a borrowed string" => "a quoted string".into(),
        t if t.starts_with("struct ") || t == "a map" => "a table".into(),
        t => t.into(),
    }
}

/// A `found` value of serde's in a config's words: `integer `7`` as `the number 7`.
fn plain_value(found: &str) -> String {
    let (kind, value) = found.split_once(' ').unwrap_or((found, ""));
    let value = value.trim_matches('`');
    match kind {
        "integer" | "floating" => format!(
            "the number {}",
            value.trim_start_matches("point ").trim_matches('`')
        ),
        "boolean" => format!("the boolean {value}"),
        "string" => format!("the string {value}"),
        "sequence" => "a list".into(),
        "map" => "a table".into(),
        _ => found.into(),
    }
}

/// The table at `path` under `v` (keys, and `#i` for the i-th entry of an array of tables).
fn table_at<'v>(v: &'v mut toml::Value, path: &[String]) -> Option<&'v mut toml::Table> {
    let mut v = v;
    for step in path {
        v = match step.strip_prefix('#') {
            Some(i) => v.as_array_mut()?.get_mut(i.parse::<usize>().ok()?)?,
            None => v.as_table_mut()?.get_mut(step)?,
        };
    }
    v.as_table_mut()
}

/// Where a section's error is, as a path of keys (and `#i` for the i-th entry of an array of
/// tables). A value of the wrong type (`leaves`): the deepest key without which the section
/// reads, or fails with another message - the message is about the first value toml could not
/// read, so taking that one key away changes it, and taking any other away (another bad one
/// included) does not. A missing key (not `leaves`): the deepest table that, taken away,
/// changes the message.
fn error_at<T: for<'de> Deserialize<'de>>(
    value: &toml::Value,
    leaves: bool,
) -> Option<Vec<String>> {
    fn message<T: for<'de> Deserialize<'de>>(v: &toml::Value) -> Option<String> {
        v.clone()
            .try_into::<T>()
            .err()
            .map(|e: toml::de::Error| e.message().to_string())
    }
    fn search<T: for<'de> Deserialize<'de>>(
        root: &toml::Value,
        first: &Option<String>,
        path: Vec<String>,
        leaves: bool,
    ) -> Option<Vec<String>> {
        let mut probe = root.clone();
        let table = table_at(&mut probe, &path)?.clone();
        for (key, v) in &table {
            let tables = v.as_array().filter(|l| l.iter().all(toml::Value::is_table));
            if !leaves && !v.is_table() && tables.is_none() {
                continue;
            }
            let mut without = root.clone();
            table_at(&mut without, &path)?.remove(key);
            if message::<T>(&without) == *first {
                continue;
            }
            let mut inner = [path.clone(), vec![key.clone()]].concat();
            if let Some(list) = tables {
                let entry = first_failing_entry::<T>(root, first, &path, key, list.len());
                inner.push(format!("#{entry}"));
            }
            let here = if leaves {
                [path.clone(), vec![key.clone()]].concat()
            } else {
                inner.clone()
            };
            return search::<T>(root, first, inner, leaves).or(Some(here));
        }
        None
    }
    // The entry of the array of tables `key` (at `path`, `len` entries) the error is about: toml
    // reads entries in order, so the array cut to its first `m` entries still fails so exactly
    // when it holds that entry. Found by bisection: a config of many entries (collectives)
    // costs a few reads, not one per entry.
    fn first_failing_entry<T: for<'de> Deserialize<'de>>(
        root: &toml::Value,
        first: &Option<String>,
        path: &[String],
        key: &str,
        len: usize,
    ) -> usize {
        let fails_within = |m: usize| {
            let mut cut = root.clone();
            if let Some(list) = table_at(&mut cut, path)
                .and_then(|t| t.get_mut(key))
                .and_then(toml::Value::as_array_mut)
            {
                list.truncate(m);
            }
            message::<T>(&cut) == *first
        };
        let (mut lo, mut hi) = (1, len.max(1));
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if fails_within(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo - 1
    }
    search::<T>(value, &message::<T>(value), Vec::new(), leaves)
}

/// The ranges of the tables inside `[job]`: the model, the optimizer, each collective.
fn job_ranges(p: &mut Problems<'_>, job: &mut RawJob) {
    if let Some(m) = &mut job.model {
        m.check_ranges(p, "job.model");
    }
    if let Some(o) = &mut job.optimizer {
        o.check_ranges(p, "job.optimizer");
    }
    for (i, c) in job.collectives.iter_mut().flatten().enumerate() {
        c.check_ranges(p, &format!("job.collectives#{i}"));
    }
}

/// Every table of a job config and its keys (`""`: the top level; `job.collectives` and
/// `faults` are arrays of tables), for tools and tests that generate configs.
pub fn schema() -> &'static [(&'static str, &'static [&'static str])] {
    SCHEMA
}

/// The keys `SCHEMA` declares for the table at `path` (`""` for the top level).
fn known_keys(path: &str) -> &'static [&'static str] {
    SCHEMA
        .iter()
        .find(|(n, _)| *n == path)
        .map(|(_, k)| *k)
        .unwrap_or(&[])
}

/// Reports every key `SCHEMA` does not declare, wherever it is (top level, each table, the
/// nested job tables, each entry of an array of tables), and removes it.
fn drop_unknown_keys(p: &mut Problems<'_>, table: &mut toml::Table) {
    fn check(p: &mut Problems<'_>, path: &str, at: &str, t: &mut toml::Table) {
        let known = known_keys(path);
        let unknown: Vec<String> = t
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .cloned()
            .collect();
        for k in unknown {
            p.add(at, Some(&k), "unknown key");
            t.remove(&k);
        }
    }
    fn each_entry(p: &mut Problems<'_>, path: &str, list: Option<&mut toml::Value>) {
        if let Some(toml::Value::Array(list)) = list {
            for (i, entry) in list.iter_mut().enumerate() {
                if let toml::Value::Table(t) = entry {
                    check(p, path, &format!("{path}#{i}"), t);
                }
            }
        }
    }
    check(p, "", "", table);
    for (name, value) in table.iter_mut() {
        if let toml::Value::Table(t) = value {
            check(p, name, name, t);
        }
    }
    if let Some(toml::Value::Table(job)) = table.get_mut("job") {
        for nested in ["model", "optimizer"] {
            if let Some(toml::Value::Table(t)) = job.get_mut(nested) {
                let path = format!("job.{nested}");
                check(p, &path, &path, t);
            }
        }
        each_entry(p, "job.collectives", job.get_mut("collectives"));
    }
    each_entry(p, "faults", table.get_mut("faults"));
}

/// The pod and hardware of `[topology]` (with `[hardware]` overrides).
fn pod_and_hardware(
    p: &mut Problems<'_>,
    t: &RawTopology,
    overrides: Option<&HardwareOverrides>,
) -> (Option<Pod>, Option<Hardware>) {
    let mut pod = None;
    let mut hardware = None;
    match t.shape.text().parse::<Torus>() {
        Err(e) => p.add("topology", Some("shape"), e.to_string()),
        Ok(torus) => {
            let wrap = match &t.wraparound {
                None => Ok(vec![true; torus.ndims()]),
                Some(Wrap::All(w)) => Ok(vec![*w; torus.ndims()]),
                Some(Wrap::PerAxis(v)) => Ok(v.clone()),
            };
            match wrap.and_then(|w| Torus::with_wrap(torus.dims(), &w)) {
                Err(e) => p.add("topology", Some("wraparound"), e.to_string()),
                Ok(torus) => match Pod::new(torus, t.slices.unwrap_or(1)) {
                    Ok(x) => pod = Some(x),
                    Err(e) => p.add("topology", Some("slices"), e.to_string()),
                },
            }
        }
    }
    let preset = t.hardware.as_deref().unwrap_or("v5p");
    match Hardware::preset(preset) {
        Err(e) => p.add("topology", Some("hardware"), e.to_string()),
        Ok(hw) => match overrides {
            Some(o) => match hw.with_overrides(o) {
                Ok(hw) => hardware = Some(hw),
                Err(e) => p.add("hardware", None, e.to_string()),
            },
            None => hardware = Some(hw),
        },
    }
    (pod, hardware)
}

/// `[launch]`: workers (placement checked), transport and bind address.
fn launch_settings(
    p: &mut Problems<'_>,
    launch: &RawLaunch,
    pod: Option<&Pod>,
) -> (u32, Transport, String) {
    let workers = launch.workers.unwrap_or(1);
    if let Some(pod) = &pod
        && let Err(e) = Placement::new(pod, workers)
    {
        p.add("launch", Some("workers"), e.to_string());
    }
    let transport =
        Transport::choose(launch.transport.as_deref(), "transport").unwrap_or_else(|e| {
            p.add("launch", Some("transport"), e);
            Transport::Auto
        });
    let bind = launch
        .bind
        .clone()
        .unwrap_or_else(|| "127.0.0.1".to_string());
    if bind.trim().is_empty() || bind.contains(char::is_whitespace) {
        p.add(
            "launch",
            Some("bind"),
            format!("{bind:?} is not a host address"),
        );
    }
    (workers, transport, bind)
}

/// `[launch.tls]`: the three PEM files, loaded and checked now (paths relative to the
/// current directory, like every path of a config).
fn tls_settings(p: &mut Problems<'_>, raw: &RawTls) -> Option<Tls> {
    let server_name = raw
        .server_name
        .clone()
        .unwrap_or_else(|| podsim_worker::tls::DEFAULT_SERVER_NAME.to_string());
    if server_name.trim().is_empty() || server_name.contains(char::is_whitespace) {
        p.add(
            "launch.tls",
            Some("server_name"),
            format!("{server_name:?} is not a host name"),
        );
        return None;
    }
    let files = TlsFiles {
        ca: PathBuf::from(&raw.ca),
        cert: PathBuf::from(&raw.cert),
        key: PathBuf::from(&raw.key),
        server_name,
    };
    match Tls::load(&files) {
        Ok(tls) => Some(tls),
        Err(problems) => {
            for (file, why) in problems {
                p.add("launch.tls", Some(file.key()), why);
            }
            None
        }
    }
}

/// `[watchdog]`, with the defaults for the chips per worker.
fn watchdog_settings(
    p: &mut Problems<'_>,
    watchdog: RawWatchdog,
    pod: Option<&Pod>,
    workers: u32,
) -> Watchdog {
    let per_worker = pod
        .as_ref()
        .map_or(1, |pod| pod.chips().div_ceil(workers.max(1)));
    let (heartbeat_ms, timeout_ms) = podsim_job::watchdog_defaults(per_worker);
    let heartbeat_ms = watchdog.heartbeat_ms.unwrap_or(heartbeat_ms);
    let wd = Watchdog {
        timeout_ms: watchdog
            .timeout_ms
            // A few heartbeats at least, when a heartbeat is set long.
            .unwrap_or(timeout_ms.max(4 * heartbeat_ms)),
        heartbeat_ms,
        busy_ms: watchdog
            .busy_timeout_s
            .map_or(podsim_job::DEFAULT_BUSY_MS, |s| s * 1000),
        recorder_entries: watchdog.recorder_entries.unwrap_or(2000),
    };
    if wd.timeout_ms < 2 * wd.heartbeat_ms {
        p.add(
            "watchdog",
            Some("timeout_ms"),
            format!(
                "{} ms must be at least two heartbeats ({} ms)",
                wd.timeout_ms,
                2 * wd.heartbeat_ms
            ),
        );
    }
    wd
}

/// The program of `[job]`, by its kind; keys of another kind are errors.
fn program(p: &mut Problems<'_>, j: &RawJob, pod: Option<&Pod>, workers: u32) -> Option<Program> {
    let meta = match j.mode.as_deref().unwrap_or("data") {
        "data" => false,
        "meta" => true,
        other => {
            p.add(
                "job",
                Some("mode"),
                format!("{other:?} is not data or meta"),
            );
            false
        }
    };
    keys_of_other_kinds(p, j);
    match j.kind.as_str() {
        "collectives" => Some(collectives_program(p, j, pod, meta)),
        "train" => train(p, j, pod, meta).map(Program::Train),
        "torch" => torch(p, j, pod, meta, workers).map(Program::Torch),
        other => {
            p.add(
                "job",
                Some("kind"),
                format!("unknown job kind {other:?} (supported: collectives, train, torch)"),
            );
            None
        }
    }
}

/// Keys set in `[job]` that belong to other kinds of job (the kinds each key takes are
/// declared with the key, in [`RawJob`]).
fn keys_of_other_kinds(p: &mut Problems<'_>, j: &RawJob) {
    for (key, kinds, set) in j.kind_keys() {
        if set && !kinds.contains(&j.kind.as_str()) {
            let kinds: Vec<String> = kinds.iter().map(|k| format!("kind = \"{k}\"")).collect();
            p.add(
                "job",
                Some(key),
                format!("applies to {} jobs only", kinds.join(" or ")),
            );
        }
    }
}

/// A `kind = "collectives"` job: its script of collectives.
fn collectives_program(p: &mut Problems<'_>, j: &RawJob, pod: Option<&Pod>, meta: bool) -> Program {
    let iterations = j.iterations.unwrap_or(1);
    let list = j.collectives.as_deref().unwrap_or(&[]);
    if list.is_empty() {
        p.add(
            "job",
            Some("collectives"),
            "a collectives job needs at least one [[job.collectives]] entry",
        );
    }
    // Calls per chip, times the chips, is what a job counts its progress in.
    let chips = pod.map_or(1, Pod::chips);
    let calls = u64::from(iterations).saturating_mul(wide(list.len()));
    if calls.saturating_mul(u64::from(chips)) > MAX_ELEMENTS {
        p.add(
            "job",
            Some("iterations"),
            format!("{iterations} iterations of {} collectives on {chips} chips are more calls than a job can count (2^53)", list.len()),
        );
    }
    let mut script = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let table = format!("job.collectives#{i}");
        if let Some(step) = collective(p, &table, c, pod, meta) {
            script.push(step);
        }
    }
    let verify = j.verify.unwrap_or(false);
    if verify && meta {
        p.add(
            "job",
            Some("verify"),
            "checksums need payloads: verify applies to mode = \"data\" only",
        );
    }
    Program::Collectives {
        iterations,
        meta,
        script,
        verify,
    }
}

/// `[recovery]` (training jobs only): sets the program's checkpoints; the restarts allowed.
fn recovery_settings(
    p: &mut Problems<'_>,
    recovery: RawRecovery,
    program: Option<&mut Program>,
    output_dir: &Path,
) -> u32 {
    let checkpoint_every = recovery.checkpoint_every.unwrap_or(0);
    match program {
        Some(Program::Train(spec)) => {
            if checkpoint_every == 0 {
                p.add(
                    "recovery",
                    Some("checkpoint_every"),
                    "must be at least 1 (steps between checkpoints)",
                );
            }
            spec.checkpoint_every = checkpoint_every;
            spec.checkpoint_dir = Some(output_dir.join("checkpoints").display().to_string());
        }
        Some(_) => p.add("recovery", None, "applies to kind = \"train\" jobs only"),
        None => {}
    }
    recovery.max_restarts.unwrap_or(0)
}

/// A collective's element type: f32, or bf16 where only sizes move (meta mode).
fn collective_dtype(
    p: &mut Problems<'_>,
    table: &str,
    dtype: Option<&str>,
    meta: bool,
) -> Option<DType> {
    let dtype = match dtype.unwrap_or("f32").parse::<DType>() {
        Ok(dtype) => dtype,
        Err(why) => {
            p.add(table, Some("dtype"), why);
            return None;
        }
    };
    if dtype == DType::Bf16 && !meta {
        p.add(
            table,
            Some("dtype"),
            "bf16 needs mode = \"meta\" (data mode moves f32)",
        );
        return None;
    }
    Some(dtype)
}

fn collective(
    p: &mut Problems<'_>,
    table: &str,
    c: &RawCollective,
    pod: Option<&Pod>,
    meta: bool,
) -> Option<CollectiveStep> {
    let before = p.list.len();
    // Parses one field (or its default), recording a problem under `key` when it is invalid.
    fn field<T>(
        p: &mut Problems<'_>,
        table: &str,
        key: &str,
        text: &str,
        parse: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        parse(text).map_err(|e| p.add(table, Some(key), e)).ok()
    }
    let op = field(p, table, "op", &c.op, |t| t.parse::<OpKind>());
    let bytes = field(p, table, "size", &c.size, parse_size);
    let algo = field(
        p,
        table,
        "algo",
        c.algo.as_deref().unwrap_or("torus"),
        |t| t.parse::<Algo>(),
    );
    let reduce = field(
        p,
        table,
        "reduce",
        c.reduce.as_deref().unwrap_or("sum"),
        |t| t.parse::<ReduceOp>(),
    );
    let dtype = collective_dtype(p, table, c.dtype.as_deref(), meta);
    let group = pod.and_then(|pod| {
        Group::parse(c.group.as_deref().unwrap_or("world"), pod)
            .map_err(|e| p.add(table, Some("group"), e))
            .ok()
    });
    if let (Some(pod), Some(g), Some(root)) = (pod, group, c.root)
        && root >= g.size(pod)
    {
        p.add(
            table,
            Some("root"),
            format!("root {root} is outside a group of {} chips", g.size(pod)),
        );
    }
    if bytes == Some(0) {
        p.add(table, Some("size"), "must be at least one element");
    }
    if p.list.len() > before {
        return None;
    }
    Some(CollectiveStep {
        op: op?,
        bytes: bytes?,
        algo: algo?,
        group: group?,
        reduce: reduce?,
        root: c.root.unwrap_or(0),
        dtype: dtype?,
    })
}

/// A `kind = "torch"` job: the command each rank runs. A program ending in `.py` runs under
/// the Python of `PODSIM_PYTHON`, else `python3`.
fn torch(
    p: &mut Problems<'_>,
    j: &RawJob,
    pod: Option<&Pod>,
    meta: bool,
    workers: u32,
) -> Option<TorchSpec> {
    if workers != 1 {
        p.add(
            "launch",
            Some("workers"),
            format!(
                "a torch job's ranks share one worker's chips: workers must be 1, not {workers}"
            ),
        );
    }
    let algo: Algo = job_value(p, "algo", j.algo.as_deref(), "torus")?;
    let eager: Option<Eager> = job_value(p, "eager", j.eager.as_deref(), "fused");
    let count: Option<Count> = job_value(p, "count", j.count.as_deref(), "steady");
    let Some(program) = j.program.as_deref().filter(|s| !s.trim().is_empty()) else {
        p.add(
            "job",
            Some("program"),
            "missing: the program each rank runs (a script.py, or an executable with args)",
        );
        return None;
    };
    let mut command = Vec::new();
    if program.ends_with(".py") {
        command.push(std::env::var("PODSIM_PYTHON").unwrap_or_else(|_| "python3".into()));
    }
    command.push(program.to_string());
    command.extend(j.args.iter().flatten().cloned());
    // Its range is checked with its declaration.
    let connect_timeout_s = j
        .connect_timeout_s
        .unwrap_or(TorchSpec::DEFAULT_CONNECT_TIMEOUT_S);
    Some(TorchSpec {
        command,
        cwd: None,
        topology: pod.map_or(String::new(), |p| p.torus().to_string()),
        algo,
        connect_timeout_s,
        meta,
        intercept: j.intercept.unwrap_or(true),
        prefork: j.prefork.unwrap_or(true),
        eager: eager?,
        count: count?,
        verify_ranks: verify_ranks(p, j, pod, meta),
        representative_steps: Vec::new(),
    })
}

/// Most ranks `--verify-ranks` runs beside a representative (each is a process on this host).
pub const MAX_VERIFY_RANKS: u32 = 64;
/// Ranks a meta-mode torch job checks its representative against unless told.
pub const DEFAULT_VERIFY_RANKS: u32 = 2;

/// The ranks that run beside a meta-mode representative to check it stands for them: the
/// list given, or a count spread evenly over the pod.
fn verify_ranks(p: &mut Problems<'_>, j: &RawJob, pod: Option<&Pod>, meta: bool) -> Vec<u32> {
    let world = pod.map_or(0, Pod::chips);
    match (&j.verify_ranks, j.verify_count) {
        (Some(_), Some(_)) => {
            p.add(
                "job",
                Some("verify_ranks"),
                "give verify_ranks (which ranks) or verify_count (how many), not both",
            );
            Vec::new()
        }
        (Some(list), None) => {
            if let Some(bad) = list.iter().find(|&&r| r >= world) {
                p.add(
                    "job",
                    Some("verify_ranks"),
                    format!("rank {bad} is outside the pod of {world} chips"),
                );
            }
            list.clone()
        }
        (None, count) => {
            let k = count.unwrap_or(if meta { DEFAULT_VERIFY_RANKS } else { 0 });
            let mut ranks: Vec<u32> = (1..=u64::from(k))
                .map(|i| (i * u64::from(world) / (u64::from(k) + 1)) as u32)
                .filter(|&r| r != 0)
                .collect();
            ranks.dedup();
            ranks
        }
    }
}

/// The training part of a `kind = "train"` job.
fn train(p: &mut Problems<'_>, j: &RawJob, pod: Option<&Pod>, meta: bool) -> Option<TrainSpec> {
    let before = p.list.len();
    let strategy = j
        .strategy
        .as_deref()
        .map(|s| {
            s.parse::<Strategy>()
                .map_err(|e| p.add("job", Some("strategy"), e))
                .ok()
        })
        .unwrap_or_else(|| {
            p.add(
                "job",
                Some("strategy"),
                "missing (ddp, fsdp, hsdp, tp or fsdp+tp)",
            );
            None
        });
    let eager: Option<Eager> = job_value(p, "eager", j.eager.as_deref(), "fused");
    let algo: Option<Algo> = job_value(p, "algo", j.algo.as_deref(), "torus");
    // In range (their declarations in `RawJob`).
    let steps = j.steps.unwrap_or(20);
    let batch = j.batch.unwrap_or(32);
    let grad_accum = j.grad_accum.unwrap_or(1);
    let bucket_cap_mb = j.bucket_cap_mb.unwrap_or(25.0);
    let model = match &j.model {
        Some(m) => model_spec(p, m, meta),
        None => missing_model(p),
    };
    let optimizer = optimizer_spec(p, j.optimizer.as_ref());
    let (tp, replicas) = mesh_sizes(p, j, strategy, pod);
    replica_sync_applies(p, j, strategy, replicas);
    let remat: Option<Remat> = job_value(p, "remat", j.remat.as_deref(), "none");
    let tp_activations: Option<TpActivations> = job_value(
        p,
        "tp_activations",
        j.tp_activations.as_deref(),
        "replicated",
    );
    let replica_sync: Option<ReplicaSync> =
        job_value(p, "replica_sync", j.replica_sync.as_deref(), "per_layer");
    let reduction = sharded_reduction(p, j, (strategy, eager), meta);
    if let (Some(pod), Some(model), true) = (pod, &model, p.list.len() == before) {
        model_sizes(p, model, batch, grad_accum, pod.chips());
    }
    if let (Some(pod), Some(strategy), Some(model), Some(algo), true) =
        (pod, strategy, &model, algo, p.list.len() == before)
    {
        check_plan(p, pod, strategy, model, algo, (tp, replicas));
    }
    if p.list.len() > before {
        return None;
    }
    Some(TrainSpec {
        strategy: strategy?,
        eager: eager?,
        model: model?,
        steps,
        batch,
        grad_accum,
        optimizer: optimizer?,
        seed: j.seed.unwrap_or(0),
        bucket_cap_mb,
        reshard_after_forward: j.reshard_after_forward.unwrap_or(true),
        tp,
        replicas,
        algo: algo?,
        meta,
        check: j.check.unwrap_or(true) && !meta,
        checkpoint_every: 0,
        checkpoint_dir: None,
        resume_from: None,
        symmetric: false,
        remat: remat?,
        tp_activations: tp_activations?,
        replica_sync: replica_sync?,
        grad_reduce: reduction?.0,
        reduce_dtype: reduction?.1,
    })
}

/// `[job.optimizer]`: SGD (the default) or AdamW, with their defaults.
fn optimizer_spec(p: &mut Problems<'_>, o: Option<&RawOptimizer>) -> Option<OptimizerSpec> {
    let get = |f: fn(&RawOptimizer) -> Option<f32>, default: f32| o.and_then(f).unwrap_or(default);
    let weight_decay = get(|o| o.weight_decay, 0.0);
    match o.and_then(|o| o.kind.as_deref()).unwrap_or("sgd") {
        "sgd" => Some(OptimizerSpec::Sgd {
            lr: get(|o| o.lr, 0.05),
            momentum: get(|o| o.momentum, 0.0),
            weight_decay,
        }),
        "adamw" => Some(OptimizerSpec::Adamw {
            lr: get(|o| o.lr, 1e-3),
            beta1: get(|o| o.beta1, 0.9),
            beta2: get(|o| o.beta2, 0.999),
            eps: get(|o| o.eps, 1e-8),
            weight_decay: get(|o| o.weight_decay, 0.01),
        }),
        other => {
            p.add(
                "job.optimizer",
                Some("kind"),
                format!("{other:?} is not sgd or adamw"),
            );
            None
        }
    }
}

/// Memory this host has for a job's workers: `PODSIM_MEM_AVAILABLE` (a size such as `4GiB`,
/// for tests or to leave the host room) or `MemAvailable` of /proc/meminfo; `None` when
/// neither is known (nothing is then checked).
pub fn host_available_memory() -> Option<u64> {
    if let Ok(text) = std::env::var("PODSIM_MEM_AVAILABLE") {
        return parse_size(&text).ok();
    }
    mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// `MemAvailable` of a /proc/meminfo text, bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    meminfo.lines().find_map(|line| {
        let kib = line.strip_prefix("MemAvailable:")?.trim();
        kib.strip_suffix("kB")?
            .trim()
            .parse::<u64>()
            .ok()?
            .checked_mul(1024)
    })
}

/// The bytes a data-mode job holds at the least on this host, the table and key that size
/// it, and what they are: a collectives job every chip's input and output buffers of its
/// largest step (`CollectiveStep::count`, the count the worker allocates); a training job
/// (an MLP: a transformer runs in meta mode only) each replica's parameters, gradients and
/// optimizer state (`OptimizerSpec::state_per_param`), over the replicas of its strategy's
/// mesh (`Plan`), the activations of one micro-batch of every data-parallel rank, and the
/// single-chip check's copy of the parameters. Buffers in flight and the process itself come
/// on top: a job refused by this estimate could never have run.
fn data_mode_bytes(pod: &Pod, program: &Program) -> Option<(u128, String, &'static str, String)> {
    let chips = u128::from(pod.chips());
    match program {
        Program::Collectives {
            meta: false,
            script,
            ..
        } => {
            let per_chip = |s: &CollectiveStep| {
                podsim_job::data_mode_buffers(s.op, s.count(pod), s.dtype, s.group.size(pod))
            };
            let (i, step) = script.iter().enumerate().max_by_key(|(_, s)| per_chip(s))?;
            let bytes = per_chip(step);
            Some((
                chips * bytes,
                format!("job.collectives#{i}"),
                "size",
                format!(
                    "{chips} chips x {} of input and output buffers",
                    format_size(u64::try_from(bytes).unwrap_or(u64::MAX))
                ),
            ))
        }
        Program::Train(spec) if !spec.meta => {
            let ModelSpec::Mlp(mlp) = &spec.model else {
                return None;
            };
            let plan = spec.plan(pod, false).ok()?;
            let (mut replicas, mut data_parallel) = (1u128, 1u128);
            for (role, dim) in plan.roles.iter().zip(plan.mesh.dims()) {
                let size = dim.size as u128;
                if *role != podsim_programs::train::strategy::Role::Tensor {
                    data_parallel *= size;
                }
                if *role == podsim_programs::train::strategy::Role::Replicate {
                    replicas *= size;
                }
            }
            let elem = spec.model.dtype().size() as u128;
            let params = spec.model.parameters() as u128;
            // Weights, gradients and optimizer state.
            let state = params * (2 + spec.optimizer.state_per_param() as u128) * elem;
            let widths: u128 = mlp.widths.iter().map(|&w| w as u128).sum();
            let activations = data_parallel * spec.batch as u128 * widths * elem;
            let check = if spec.check { state } else { 0 };
            Some((
                replicas * state + activations + check,
                "job.model".into(),
                "widths",
                format!(
                    "{} of parameters, gradients and optimizer state in {replicas} {}, {} of activations{}",
                    format_size(u64::try_from(state).unwrap_or(u64::MAX)),
                    if replicas == 1 { "copy" } else { "copies" },
                    format_size(u64::try_from(activations).unwrap_or(u64::MAX)),
                    if spec.check {
                        " and the single-chip check's copy (job.check)"
                    } else {
                        ""
                    }
                ),
            ))
        }
        _ => None,
    }
}

/// The host memory podsim takes at the least for each chip it simulates in meta mode (its
/// state, its links' queues, its flight recorder), bytes: half of what `podsim bench --mode
/// meta --sizes 1MiB --iters 1 --warmup 0` took, its peak resident memory over its chips, at
/// 4,096 chips (16x16x16, 31 KB) and 32,768 (32x32x32, 33 KB), so that a pod refused for it
/// could never have run. A training step or a deeper recorder takes more.
pub const META_HOST_BYTES_PER_CHIP: u64 = 16 << 10;

/// The host memory of `simulated` chips in meta mode, and why it is refused when it is more
/// than the `available` memory: a 4096x4096 pod grew until the host ran out instead.
pub fn meta_mode_problem(simulated: u32, available: u64) -> Option<String> {
    let bytes = u64::from(simulated) * META_HOST_BYTES_PER_CHIP;
    (bytes > available).then(|| {
        format!(
            "{simulated} chips simulated one by one hold at least {} on this host ({} each, in meta mode too), more than the {} it has available: use a smaller pod, or run one chip for all where the job allows (`[job] symmetric = true`, `podsim bench --symmetric`)",
            format_size(bytes),
            format_size(META_HOST_BYTES_PER_CHIP),
            format_size(available),
        )
    })
}

/// Whether `program` moves sizes only.
fn is_meta(program: &Program) -> bool {
    match program {
        Program::Collectives { meta, .. } => *meta,
        Program::Bench { cases } => cases.iter().all(|c| c.meta),
        Program::Train(spec) => spec.meta,
        Program::Torch(t) => t.meta,
    }
}

/// Refuses a job that cannot run on this host: in data mode its buffers, or its ranks' processes,
/// in meta mode the chips it simulates (one standing for all when `symmetric`), beyond the
/// memory `available`.
fn host_memory(
    p: &mut Problems<'_>,
    pod: &Pod,
    program: &Program,
    symmetric: bool,
    available: Option<u64>,
) {
    let Some(available) = available else {
        return;
    };
    let simulated = if symmetric { 1 } else { pod.chips() };
    if is_meta(program) {
        if let Some(why) = meta_mode_problem(simulated, available) {
            p.add("topology", Some("shape"), why);
        }
        return;
    }
    if let (Program::Torch(_), Some(most)) = (program, podsim_links::procs::process_limit()) {
        if u64::from(simulated) > most {
            p.add(
                "topology",
                Some("shape"),
                format!(
                    "{simulated} ranks in data mode are {simulated} processes, more than this host can start ({most}: the kernel's pid_max, or the user's process limit): set mode = \"meta\", where one process stands for the ranks the torus makes alike"
                ),
            );
        }
        return;
    }
    let Some((bytes, table, key, what)) = data_mode_bytes(pod, program) else {
        return;
    };
    if bytes > u128::from(available) {
        p.add(
            &table,
            Some(key),
            format!(
                "in data mode this job holds at least {} on this host ({what}), more than the {} it has available: set mode = \"meta\" to run it with shapes only (times and memory are still computed)",
                format_size(u64::try_from(bytes).unwrap_or(u64::MAX)),
                format_size(available),
            ),
        );
    }
}

/// `[job] model` is required for training.
fn missing_model(p: &mut Problems<'_>) -> Option<ModelSpec> {
    p.add(
        "job",
        Some("model"),
        "missing: [job.model] widths = [inputs, hidden..., classes], or kind = \"transformer\" with its shape",
    );
    None
}

/// `[job] replica_sync` is refused where the job has no replicas (it would be ignored).
fn replica_sync_applies(
    p: &mut Problems<'_>,
    j: &RawJob,
    strategy: Option<Strategy>,
    replicas: u32,
) {
    let has_replicas = match strategy {
        Some(Strategy::Hsdp) => true,
        Some(Strategy::FsdpTp) => replicas > 1,
        _ => false,
    };
    if j.replica_sync.is_some() && strategy.is_some() && !has_replicas {
        p.add(
            "job",
            Some("replica_sync"),
            "applies to hsdp, and to fsdp+tp with replicas > 1, only: this job has no replicas"
                .to_string(),
        );
    }
}

/// `[job] grad_reduce` and `reduce_dtype`; refused where they would be ignored: a strategy
/// that reduce-scatters nothing, an eager mode that reduces each parameter as written, and (for
/// `reduce_dtype`) data mode, whose collectives move f32 values whatever the dtype.
fn sharded_reduction(
    p: &mut Problems<'_>,
    j: &RawJob,
    (strategy, eager): (Option<Strategy>, Option<Eager>),
    meta: bool,
) -> Option<(GradReduce, Option<DType>)> {
    let sharded = matches!(
        strategy,
        Some(Strategy::Fsdp | Strategy::Hsdp | Strategy::FsdpTp)
    );
    for (key, set) in [
        ("grad_reduce", j.grad_reduce.is_some()),
        ("reduce_dtype", j.reduce_dtype.is_some()),
    ] {
        let why = if !set {
            None
        } else if strategy.is_some() && !sharded {
            Some(
                "applies to fsdp, hsdp and fsdp+tp only: this strategy reduce-scatters no gradients",
            )
        } else if eager.is_some_and(|e| e != Eager::Fused) {
            Some(
                "applies to eager = \"fused\" only: strict and debug reduce each parameter as written",
            )
        } else if key == "reduce_dtype" && !meta {
            Some("applies in meta mode only: data mode's collectives move f32 values")
        } else {
            None
        };
        if let Some(why) = why {
            p.add("job", Some(key), why.to_string());
        }
    }
    let grad_reduce = job_value(p, "grad_reduce", j.grad_reduce.as_deref(), "per_layer");
    let reduce_dtype = match j.reduce_dtype.as_deref() {
        None => Some(None),
        Some(text) => job_value(p, "reduce_dtype", Some(text), "").map(Some),
    };
    Some((grad_reduce?, reduce_dtype?))
}

/// `[job] key` parsed from its text (`default` when absent); a bad value is reported.
fn job_value<T: std::str::FromStr<Err = String>>(
    p: &mut Problems<'_>,
    key: &str,
    value: Option<&str>,
    default: &str,
) -> Option<T> {
    value
        .unwrap_or(default)
        .parse::<T>()
        .map_err(|e| p.add("job", Some(key), e))
        .ok()
}

/// Mesh sizes: `tp` for fsdp+tp (default: the torus's first axis), the whole pod for tp;
/// `replicas` for hsdp (default: the pod's outermost axis).
fn mesh_sizes(
    p: &mut Problems<'_>,
    j: &RawJob,
    strategy: Option<Strategy>,
    pod: Option<&Pod>,
) -> (u32, u32) {
    let chips = pod.map_or(1, Pod::chips);
    let first_axis = pod.map_or(1, |pod| pod.torus().dims()[0]);
    let outermost = pod.map_or(1, |pod| {
        Group::world(pod)
            .axes(pod)
            .last()
            .map_or(1, |a| a.size(pod))
    });
    let tp = match strategy {
        Some(Strategy::Tp) => {
            if let Some(t) = j.tp.filter(|t| *t != chips) {
                p.add(
                    "job",
                    Some("tp"),
                    format!("strategy tp spans the whole pod ({chips} chips), not {t}; use fsdp+tp to combine"),
                );
            }
            chips
        }
        _ => j.tp.unwrap_or(first_axis),
    };
    let replicas = match strategy {
        // fsdp+tp: data parallelism across replicas only when asked for.
        Some(Strategy::FsdpTp) => j.replicas.unwrap_or(1),
        _ => j.replicas.unwrap_or(outermost),
    };
    // The mesh multiplies them (in `u32`): more than the chips never lays out anyway.
    if strategy == Some(Strategy::FsdpTp) && u64::from(tp) * u64::from(replicas) > u64::from(chips)
    {
        p.add(
            "job",
            Some("replicas"),
            format!("tp x replicas = {tp} x {replicas} is more than the pod's {chips} chips"),
        );
    }
    (tp, replicas)
}

/// `n` as a `u64` (lossless where `usize` is at most 64 bits; saturating elsewhere).
fn wide(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// The sizes a model and its batch multiply out to (each layer's weights and activations,
/// attention's scores, the samples or tokens of a step, the model's parameters and the terms
/// of its flops count), each formed with checked arithmetic and held to [`MAX_ELEMENTS`]
/// before the trainer forms them with plain arithmetic; the first too large is reported.
fn model_sizes(p: &mut Problems<'_>, model: &ModelSpec, batch: usize, grad_accum: u32, chips: u32) {
    let product = |factors: &[u64]| -> Option<u64> {
        factors
            .iter()
            .try_fold(1u64, |acc, &f| acc.checked_mul(f))
            .filter(|&n| n <= MAX_ELEMENTS)
    };
    let rows = match model {
        ModelSpec::Transformer(t) => wide(t.seq),
        ModelSpec::Mlp(_) => 1,
    };
    let (batch, accum, chips) = (wide(batch), u64::from(grad_accum), u64::from(chips));
    let mut checks: Vec<(String, Vec<u64>)> = vec![(
        "a step's samples x tokens (batch x grad_accum x chips x seq)".into(),
        vec![batch, accum, chips, rows],
    )];
    if let ModelSpec::Transformer(t) = model {
        let (heads, seq) = (wide(t.heads), wide(t.seq));
        checks.push((
            "attention scores (batch x heads x seq x seq)".into(),
            vec![batch, heads, seq, seq],
        ));
        checks.push((
            "attention's flops term (layers x seq x heads x head_dim)".into(),
            vec![wide(t.layers), seq, heads, wide(t.head_dim)],
        ));
    }
    let mut total = Some(0u64);
    for layer in model.lower() {
        let (inputs, outputs) = (wide(layer.inputs), wide(layer.outputs));
        let weights = product(&[outputs, inputs.saturating_add(1)]);
        total = total
            .zip(weights)
            .and_then(|(t, w)| t.checked_add(w))
            .filter(|&t| t <= MAX_ELEMENTS);
        checks.push((
            format!("layer {}'s weights (outputs x (inputs + 1))", layer.name),
            vec![outputs, inputs.saturating_add(1)],
        ));
        checks.push((
            format!("layer {}'s activations (batch x seq x width)", layer.name),
            vec![batch, rows, inputs.max(outputs)],
        ));
        if weights.is_none() || total.is_none() {
            break;
        }
    }
    let too_large = checks
        .into_iter()
        .find(|(_, factors)| product(factors).is_none());
    if let Some((what, factors)) = too_large {
        let shown: Vec<String> = factors.iter().map(u64::to_string).collect();
        p.add(
            "job.model",
            None,
            format!(
                "{what} = {} is more than 2^53 elements, the most a job may describe",
                shown.join(" x ")
            ),
        );
    } else if total.is_none() {
        p.add(
            "job.model",
            None,
            "the layers' weights add up to more than 2^53 parameters, the most a job may describe",
        );
    }
}

/// Whether the strategy's device mesh can be laid on the pod (names the key at fault).
fn check_plan(
    p: &mut Problems<'_>,
    pod: &Pod,
    strategy: Strategy,
    model: &ModelSpec,
    algo: Algo,
    (tp, replicas): (u32, u32),
) {
    if let Err(e) = Plan::new(pod, strategy, &model.tp_styles(), tp, replicas, algo, false) {
        let key = match strategy {
            Strategy::Hsdp => "replicas",
            Strategy::FsdpTp => "tp",
            _ => "strategy",
        };
        let reason = match e {
            podsim_programs::ProgramError::Invalid(m) => m,
            other => other.to_string(),
        };
        p.add("job", Some(key), reason);
    }
}

/// Every `[[faults]]` entry that is right (the others reported).
fn faults_of(
    p: &mut Problems<'_>,
    table: &toml::Table,
    pod: Option<&Pod>,
    workers: u32,
    watchdog: &Watchdog,
    program: Option<&Program>,
) -> Vec<FaultSpec> {
    let mut raw: Vec<RawFault> = match table.get("faults") {
        None => Vec::new(),
        Some(v) => v
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| p.add("faults", None, plain(e.message())))
            .unwrap_or_default(),
    };
    for (i, f) in raw.iter_mut().enumerate() {
        f.check_ranges(p, &format!("faults#{i}"));
    }
    let faults: Vec<FaultSpec> = raw
        .iter()
        .enumerate()
        .filter_map(|(i, f)| fault(p, &format!("faults#{i}"), f, pod, workers, watchdog))
        .collect();
    if let Some(program) = program {
        steps_reached(p, &raw, program);
    }
    faults
}

/// One `[[faults]]` entry.
fn fault(
    p: &mut Problems<'_>,
    table: &str,
    f: &RawFault,
    pod: Option<&Pod>,
    workers: u32,
    watchdog: &Watchdog,
) -> Option<FaultSpec> {
    let before = p.list.len();
    let kind = f.kind.parse::<FaultKind>();
    if let Err(why) = &kind {
        p.add(table, Some("kind"), why.clone());
    }
    let kind = kind.ok();
    let chips = pod.map_or(u32::MAX, Pod::chips);
    if let Some(c) = f.chip.filter(|c| *c >= chips) {
        p.add(
            table,
            Some("chip"),
            format!("chip {c} is outside the pod's {chips} chips"),
        );
    }
    if let Some(w) = f.worker.filter(|w| *w >= workers) {
        p.add(
            table,
            Some("worker"),
            format!("worker {w} is outside the job's {workers} workers"),
        );
    }
    // `link = "5:+x"`: chip 5's link +x.
    let (chip, link) = fault_link(p, table, f, pod);
    required_keys(p, table, f, kind, workers, chips);
    // Both in range (their declarations); a delay also below the watchdog's timeout.
    let factor = f.factor.unwrap_or(10.0);
    let delay_ms = f.delay_ms.unwrap_or(50.0);
    let timeout_ms = watchdog.timeout_ms as f64;
    if kind == Some(FaultKind::Delay) && delay_ms >= timeout_ms {
        // A delayed send keeps its chip busy, and the watchdog excuses a busy chip: a delay
        // as long as the timeout would stall the job on every message with no diagnosis.
        p.add(
            table,
            Some("delay_ms"),
            format!(
                "{delay_ms} ms is not below the watchdog's timeout ({timeout_ms} ms): every message on the link would wait that long with its chip busy, a stall the watchdog cannot diagnose; to model a hang use kind = \"stall\" or \"drop\", or raise watchdog.timeout_ms"
            ),
        );
    }
    let (once, desync) = fault_mode(p, table, kind, f.mode.as_deref());
    if p.list.len() > before {
        return None;
    }
    Some(FaultSpec {
        kind: kind?,
        chip,
        worker: f.worker,
        link,
        groups: f.groups.clone().unwrap_or_default(),
        chip_groups: f.chip_groups.clone().unwrap_or_default(),
        at_step: f.at_step,
        at_seq: f.at_seq,
        after_ms: f.after_ms,
        once,
        delay_ms,
        factor,
        desync,
    })
}

/// A fault's `mode`: whether a drop happens once, and how a desync diverges.
fn fault_mode(
    p: &mut Problems<'_>,
    table: &str,
    kind: Option<FaultKind>,
    mode: Option<&str>,
) -> (bool, DesyncMode) {
    match (kind, mode) {
        (Some(FaultKind::Drop), None | Some("always")) => (false, DesyncMode::Skip),
        (Some(FaultKind::Drop), Some("once")) => (true, DesyncMode::Skip),
        (Some(FaultKind::Desync), None | Some("skip")) => (false, DesyncMode::Skip),
        (Some(FaultKind::Desync), Some("op")) => (false, DesyncMode::Op),
        (Some(FaultKind::Desync), Some("size")) => (false, DesyncMode::Size),
        (_, None) => (false, DesyncMode::Skip),
        (_, Some(m)) => {
            p.add(
                table,
                Some("mode"),
                format!(
                    "{m:?} is not a mode of this fault (drop: once, always; desync: skip, op, size)"
                ),
            );
            (false, DesyncMode::Skip)
        }
    }
}

/// A fault's `link = "chip:link"` (or `link` with `chip`): the sending chip and its link,
/// checked against the topology.
fn fault_link(
    p: &mut Problems<'_>,
    table: &str,
    f: &RawFault,
    pod: Option<&Pod>,
) -> (Option<u32>, Option<Link>) {
    let mut chip = f.chip;
    let link = f.link.as_deref().and_then(|text| {
        let (c, l) = match text.split_once(':') {
            Some((c, l)) => (c.trim().parse::<u32>().ok(), l),
            None => (f.chip, text),
        };
        let parsed = Link::parse(l)
            .map_err(|e| p.add(table, Some("link"), e))
            .ok()?;
        let Some(c) = c else {
            p.add(
                table,
                Some("link"),
                format!("{text:?}: name the sending chip, e.g. \"3:+x\""),
            );
            return None;
        };
        chip = Some(c);
        if let Some(pod) = pod
            && (c >= pod.chips() || pod.peer(c, parsed).is_none())
        {
            p.add(
                table,
                Some("link"),
                format!("chip {c} has no link {parsed} in this topology"),
            );
        }
        Some(parsed)
    });
    (chip, link)
}

/// The keys each kind of fault needs (`chip` for a stall, `link` for a drop, two groups of
/// workers or of chips for a partition, ...).
fn required_keys(
    p: &mut Problems<'_>,
    table: &str,
    f: &RawFault,
    kind: Option<FaultKind>,
    workers: u32,
    chips: u32,
) {
    let needs = |p: &mut Problems<'_>, ok: bool, what: &str| {
        if !ok {
            p.add(table, None, format!("a {} fault needs {what}", f.kind));
        }
    };
    match kind {
        Some(FaultKind::Stall | FaultKind::Slow | FaultKind::Desync) => {
            needs(p, f.chip.is_some(), "chip = N")
        }
        Some(FaultKind::Crash | FaultKind::Freeze) => needs(
            p,
            f.chip.is_some() != f.worker.is_some(),
            "worker = N or chip = N (its worker), one of them",
        ),
        Some(FaultKind::Drop | FaultKind::Delay | FaultKind::Corrupt) => {
            needs(p, f.link.is_some(), "link = \"chip:link\" (e.g. \"3:+x\")")
        }
        Some(FaultKind::Partition) => {
            // Workers cut apart (a network split between processes), or chips (inside one
            // worker too: a torch job's ranks).
            let (key, groups, unit, limit) = match (&f.groups, &f.chip_groups) {
                (Some(g), None) => ("groups", g.clone(), "worker", workers),
                (None, Some(g)) => ("chip_groups", g.clone(), "chip", chips),
                _ => ("groups", Vec::new(), "worker", workers),
            };
            needs(
                p,
                groups.len() == 2 && groups.iter().all(|g| !g.is_empty()),
                "either groups = [[workers...], [workers...]] or chip_groups = [[chips...], [chips...]]",
            );
            if let Some(w) = groups.iter().flatten().find(|w| **w >= limit) {
                let whole = if unit == "chip" { "pod" } else { "job" };
                p.add(
                    table,
                    Some(key),
                    format!("{unit} {w} is outside the {whole}'s {limit} {unit}s"),
                );
            }
            // A member of both sides would be cut from itself, and one named twice on a side
            // is a typo for another.
            let mut seen = std::collections::BTreeSet::new();
            if let Some(w) = groups.iter().flatten().find(|w| !seen.insert(**w)) {
                p.add(
                    table,
                    Some(key),
                    format!("{unit} {w} is named twice: the groups are two sets apart"),
                );
            }
        }
        None => {}
    }
}

/// Refuses a fault whose `at_step` the program never reaches (it would never fire, and the
/// job would end `ok` with the fault untried): a training job runs steps 0 to `steps - 1`, a
/// script iterations 0 to `iterations - 1`. A PyTorch program's steps are its own: its
/// report says which faults never fired.
fn steps_reached(p: &mut Problems<'_>, faults: &[RawFault], program: &Program) {
    let (steps, what) = match program {
        Program::Train(spec) => (u64::from(spec.steps), "job.steps"),
        Program::Collectives { iterations, .. } => (u64::from(*iterations), "job.iterations"),
        _ => return,
    };
    for (i, f) in faults.iter().enumerate() {
        if let Some(at) = f.at_step.filter(|&at| at >= steps) {
            p.add(
                &format!("faults#{i}"),
                Some("at_step"),
                format!(
                    "step {at} is never reached: the job runs steps 0 to {} ({what} = {steps}), so the fault would never fire",
                    steps.saturating_sub(1)
                ),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! Config loading in-process (`from_text`); `tests/end_to_end/config_errors.rs` checks the same
    //! through the command line.
    use super::*;

    const BASE: &str = "name = \"t\"\n[topology]\nshape = \"2x2x2\"\nhardware = \"v5p\"\n[launch]\nworkers = 2\n[job]\nkind = \"collectives\"\nmode = \"data\"\niterations = 2\n[[job.collectives]]\nop = \"all-reduce\"\nsize = \"1MiB\"\n";

    fn load(text: &str, sets: &[&str]) -> Result<JobConfig, ConfigErrors> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        from_text("test.toml", text, &sets)
    }

    #[test]
    fn a_set_key_is_field_names_and_a_name_is_not_a_path() {
        for key in ["job .iterations", "job.iterations #", "job..iterations"] {
            let err = load(BASE, &[&format!("{key}=3")]).unwrap_err().to_string();
            assert!(
                err.contains("is not a config field name") || err.contains("expected key"),
                "{key}: {err}"
            );
        }
        assert!(load(BASE, &["job.iterations=3"]).is_ok());
        for name in ["../..", "a/b", ".", ".."] {
            let text = BASE.replace("name = \"t\"", &format!("name = {name:?}"));
            let err = load(&text, &[]).unwrap_err().to_string();
            assert!(
                err.contains("name: must be a name, not a path"),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn a_collectives_job_loads_with_what_it_says() {
        let cfg = load(BASE, &[]).expect("a good config");
        assert_eq!((cfg.pod.chips(), cfg.workers), (8, 2));
        let Program::Collectives {
            iterations, script, ..
        } = &cfg.program
        else {
            panic!("a collectives program: {:?}", cfg.program);
        };
        assert_eq!(*iterations, 2);
        assert_eq!(script[0].op, OpKind::AllReduce);
        assert_eq!(script[0].bytes, 1 << 20);
        // `--set` reaches every key, and a new table.
        let cfg = load(BASE, &["launch.workers=4", "watchdog.timeout_ms=5000"]).expect("ok");
        assert_eq!((cfg.workers, cfg.watchdog.timeout_ms), (4, 5000));
    }

    #[test]
    fn every_problem_is_reported_at_once_with_its_line() {
        let text = BASE.replace("workers = 2", "workers = 2\ncolour = \"red\"")
            + "[[faults]]\nkind = \"partition\"\nchip_groups = [[0], [8]]\n";
        let errors = load(&text, &["job.iterations=0"]).expect_err("bad").0;
        let found: Vec<(Option<usize>, &str)> =
            errors.iter().map(|e| (e.line, e.field.as_str())).collect();
        assert!(found.contains(&(Some(7), "launch.colour")), "{found:?}");
        assert!(
            found.contains(&(Some(17), "faults[0].chip_groups")),
            "{found:?}"
        );
        // A `--set` value has no line of its own: the key's line in the file.
        assert!(found.contains(&(Some(11), "job.iterations")), "{found:?}");
    }

    #[test]
    fn a_torch_job_takes_its_program_and_keeps_one_worker() {
        let text = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"torch\"\nprogram = \"train.py\"\nargs = [\"--steps\", \"3\"]\n";
        let cfg = load(text, &[]).expect("a torch job");
        assert_eq!(cfg.workers, 1);
        assert!(
            matches!(cfg.program, Program::Torch(_)),
            "{:?}",
            cfg.program
        );
        let errors = load(text, &["launch.workers=2"])
            .expect_err("two workers")
            .0;
        assert!(
            errors.iter().any(|e| e.field.starts_with("launch.workers")),
            "{errors:?}"
        );
    }

    #[test]
    fn weights_are_kept_at_least_as_wide_as_they_are_computed_with() {
        let text = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"train\"\nmode = \"meta\"\nstrategy = \"fsdp\"\n[job.model]\nkind = \"transformer\"\nlayers = 2\nd_model = 64\nheads = 4\nffn = 128\nvocab = 256\nseq = 32\n";
        let weights = |sets: &[&str]| match load(text, sets).expect("a train job").program {
            Program::Train(t) => (t.model.dtype(), t.model.weight_dtype()),
            other => panic!("a train program: {other:?}"),
        };
        assert_eq!(weights(&[]), (DType::Bf16, DType::F32));
        assert_eq!(
            weights(&["job.model.weight_dtype=\"bf16\""]),
            (DType::Bf16, DType::Bf16)
        );
        let errors = load(
            text,
            &["job.model.dtype=\"f32\"", "job.model.weight_dtype=\"bf16\""],
        )
        .expect_err("bf16 weights under f32 compute")
        .0;
        assert!(
            errors.iter().any(|e| e.field == "job.model.weight_dtype"),
            "{errors:?}"
        );
    }

    #[test]
    fn attention_is_flash_unless_the_model_says_dot_product() {
        let text = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"train\"\nmode = \"meta\"\nstrategy = \"fsdp\"\n[job.model]\nkind = \"transformer\"\nlayers = 2\nd_model = 64\nheads = 4\nffn = 128\nvocab = 256\nseq = 32\n";
        let attention = |sets: &[&str]| match load(text, sets).expect("a train job").program {
            Program::Train(t) => match t.model {
                ModelSpec::Transformer(m) => m.attention,
                other => panic!("a transformer: {other:?}"),
            },
            other => panic!("a train program: {other:?}"),
        };
        assert_eq!(attention(&[]), AttentionKind::Flash);
        assert_eq!(
            attention(&["job.model.attention=\"dot_product\""]),
            AttentionKind::DotProduct
        );
        let errors = load(text, &["job.model.attention=\"sdpa\""])
            .expect_err("an unknown attention")
            .0;
        assert!(
            errors
                .iter()
                .any(|e| e.field == "job.model.attention" && e.reason.contains("\"sdpa\"")),
            "{errors:?}"
        );
    }

    /// A table's `FIELDS`: each key, its type and whether it declares a range.
    type Declared = &'static [(&'static str, &'static str, bool)];

    /// The keys of every table, their declared types and whether each declares a range.
    fn declared_fields() -> Vec<(&'static str, &'static str, &'static str, bool)> {
        let tables: [(&str, Declared); 11] = [
            ("topology", RawTopology::FIELDS),
            ("launch", RawLaunch::FIELDS),
            ("launch.tls", RawTls::FIELDS),
            ("job", RawJob::FIELDS),
            ("job.model", RawModel::FIELDS),
            ("job.optimizer", RawOptimizer::FIELDS),
            ("job.collectives", RawCollective::FIELDS),
            ("faults", RawFault::FIELDS),
            ("recovery", RawRecovery::FIELDS),
            ("watchdog", RawWatchdog::FIELDS),
            ("output", RawOutput::FIELDS),
        ];
        tables
            .into_iter()
            .flat_map(|(t, fields)| fields.iter().map(move |&(k, ty, r)| (t, k, ty, r)))
            .collect()
    }

    #[test]
    fn every_numeric_key_declares_its_range() {
        const NUMBERS: [&str; 10] = [
            "u8", "u16", "u32", "u64", "usize", "i32", "i64", "isize", "f32", "f64",
        ];
        for (table, key, ty, ranged) in declared_fields() {
            let numeric = ty
                .split(|c: char| !c.is_alphanumeric())
                .any(|word| NUMBERS.contains(&word));
            assert!(
                ranged || !numeric,
                "{table}.{key}: {ty} declares no range: add `{{lo..=hi}}` after its type in the table! declaration"
            );
        }
        // `[hardware]` is the topology crate's: its ranges are listed here, one per figure.
        let mut o = HardwareOverrides::default();
        let ranged: Vec<&str> = hardware_ranges(&mut o).iter().map(|r| r.0).collect();
        assert_eq!(ranged, HARDWARE_KEYS);
    }

    #[test]
    fn a_model_key_out_of_range_is_the_one_problem_told() {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/gpt2_fsdp_meta.toml"),
        )
        .unwrap();
        let errors = load(&text, &["job.model.layers=1000000000"])
            .expect_err("out of range")
            .0;
        // Not also "layers must be at least 1": the refused value is not read as 0.
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].reason.contains("out of range"), "{errors:?}");
    }

    #[test]
    fn a_value_out_of_range_is_named_with_its_line_and_range_once() {
        let text = BASE.replace("iterations = 2", "iterations = 0")
            + "[watchdog]\nheartbeat_ms = 0\n[hardware]\nmxu_tile = 1e300\nici_bandwidth = nan\n";
        let errors = load(&text, &[]).expect_err("out of range").0;
        let found: Vec<(Option<usize>, &str, &str)> = errors
            .iter()
            .map(|e| (e.line, e.field.as_str(), e.reason.as_str()))
            .collect();
        assert!(
            found.contains(&(
                Some(10),
                "job.iterations",
                "0 is out of range (allowed: from 1 to 1000000)"
            )),
            "{found:?}"
        );
        assert!(
            found.contains(&(
                Some(15),
                "watchdog.heartbeat_ms",
                "0 is out of range (allowed: from 1 to 60000)"
            )),
            "{found:?}"
        );
        assert!(
            found.contains(&(
                Some(17),
                "hardware.mxu_tile",
                "1e300 is out of range (allowed: from 1.0 to 65536.0)"
            )),
            "{found:?}"
        );
        assert!(
            found.contains(&(
                Some(18),
                "hardware.ici_bandwidth",
                "NaN is out of range (allowed: from 1000.0 to 1e18)"
            )),
            "{found:?}"
        );
        // One problem per key: the checks after the range's see the default.
        let mut fields: Vec<&str> = found.iter().map(|f| f.1).collect();
        fields.dedup();
        assert_eq!(fields.len(), found.len(), "{found:?}");
    }

    #[test]
    fn nonsense_numbers_are_refused_before_anything_uses_them() {
        let train = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"train\"\nmode = \"meta\"\nstrategy = \"ddp\"\n[job.model]\nwidths = [8, 16, 4]\n[job.optimizer]\nkind = \"sgd\"\nlr = 0.1\n";
        load(train, &[]).expect("a good train job");
        // Each layer in range, their weights together not.
        let wide_mlp = format!("job.model.widths=[{}]", ["16777216"; 40].join(", "));
        let cases: [(&str, &[&str], &str, &str); 9] = [
            ("lr = nan", &[], "job.optimizer.lr", "NaN is out of range"),
            ("lr = inf", &[], "job.optimizer.lr", "inf is out of range"),
            ("lr = -inf", &[], "job.optimizer.lr", "-inf is out of range"),
            ("lr = 1e300", &[], "job.optimizer.lr", "inf is out of range"),
            (
                "lr = 0.1",
                &["job.optimizer.momentum=1.0"],
                "job.optimizer.momentum",
                "up to (not including) 1.0",
            ),
            (
                "lr = 0.1",
                &["job.model.widths=[8, 9223372036854775807, 4]"],
                "job.model.widths",
                "9223372036854775807 is out of range (allowed: from 1 to 16777216)",
            ),
            (
                "lr = 0.1",
                &["job.batch=9223372036854775807"],
                "job.batch",
                "is out of range",
            ),
            (
                "lr = 0.1",
                &["job.bucket_cap_mb=0"],
                "job.bucket_cap_mb",
                "allowed: above 0.0 to 1048576.0",
            ),
            ("lr = 0.1", &[&wide_mlp], "job.model", "more than 2^53"),
        ];
        for (lr, sets, field, reason) in cases {
            let errors = load(&train.replace("lr = 0.1", lr), sets).expect_err(lr).0;
            assert!(
                errors
                    .iter()
                    .any(|e| e.field == field && e.reason.contains(reason)),
                "{lr} {sets:?}: {errors:?}"
            );
        }
        // A transformer whose products overflow: refused, not lowered into a panic.
        let huge = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"train\"\nmode = \"meta\"\nstrategy = \"fsdp\"\n[job.model]\nkind = \"transformer\"\nlayers = 65536\nd_model = 16777216\nheads = 65536\nffn = 16777216\nvocab = 16777216\nseq = 16777216\nhead_dim = 16777216\n";
        let errors = load(huge, &[]).expect_err("too large").0;
        assert!(
            errors
                .iter()
                .any(|e| e.field == "job.model" && e.reason.contains("2^53")),
            "{errors:?}"
        );
    }

    #[test]
    fn faults_are_bounded_and_a_delay_stays_below_the_watchdog() {
        let fault = |body: &str| format!("{BASE}[[faults]]\n{body}\n");
        let slow = fault("kind = \"slow\"\nchip = 1\nfactor = 1e300");
        let errors = load(&slow, &[]).expect_err("slow 1e300").0;
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].to_string(),
            "test.toml:17: faults[0].factor: 1e300 is out of range (allowed: from 1.0 to 1000.0)"
        );
        for delay in ["30000", "1e11", "2000"] {
            let text = fault(&format!(
                "kind = \"delay\"\nlink = \"1:+x\"\ndelay_ms = {delay}"
            ));
            let errors = load(&text, &[]).expect_err(delay).0;
            assert!(
                errors.iter().any(|e| e.field == "faults[0].delay_ms"
                    && e.line == Some(17)
                    && (e.reason.contains("out of range")
                        || e.reason
                            .contains("not below the watchdog's timeout (2000 ms)"))),
                "{delay}: {errors:?}"
            );
        }
        // Below the timeout, or the timeout raised above it: a straggler, not a hang.
        let delayed = fault("kind = \"delay\"\nlink = \"1:+x\"\ndelay_ms = 30000");
        load(&delayed, &["watchdog.timeout_ms=60000"]).expect("below a longer timeout");
        load(&delayed.replace("30000", "1999"), &[]).expect("below the timeout");
    }

    #[test]
    fn serde_messages_are_told_in_a_configs_words() {
        for (serde, plain_text) in [
            (
                "invalid type: string \"many\", expected u32",
                "expected a whole number, 0 or more, found the string \"many\"",
            ),
            (
                "invalid type: integer `7`, expected a boolean",
                "expected true or false, found the number 7",
            ),
            (
                "invalid type: floating point `1.5`, expected usize",
                "expected a whole number, 0 or more, found the number 1.5",
            ),
            (
                "invalid type: string \"wide\", expected a sequence",
                "expected a list [...], found the string \"wide\"",
            ),
            ("missing field `op`", "missing key op"),
            ("a message of its own", "a message of its own"),
        ] {
            assert_eq!(plain(serde), plain_text);
        }
    }

    #[test]
    fn a_fault_that_could_never_fire_or_means_two_things_is_refused() {
        let fault = |body: &str| format!("{BASE}[[faults]]\n{body}\n");
        let refused = |body: &str, field: &str, why: &str| {
            let errors = load(&fault(body), &[]).expect_err(body).0;
            assert!(
                errors
                    .iter()
                    .any(|e| e.field == field && e.reason.contains(why)),
                "{body}: {errors:?}"
            );
        };
        // BASE runs iterations 0 and 1.
        refused(
            "kind = \"stall\"\nchip = 1\nat_step = 2",
            "faults[0].at_step",
            "step 2 is never reached: the job runs steps 0 to 1 (job.iterations = 2)",
        );
        load(&fault("kind = \"stall\"\nchip = 1\nat_step = 1"), &[]).expect("step 1 runs");
        refused(
            "kind = \"crash\"\nchip = 1\nworker = 0",
            "faults[0]",
            "one of them",
        );
        refused(
            "kind = \"partition\"\ngroups = [[0], [0, 1]]",
            "faults[0].groups",
            "worker 0 is named twice",
        );
        refused(
            "kind = \"partition\"\nchip_groups = [[0, 1, 1], [2]]",
            "faults[0].chip_groups",
            "chip 1 is named twice",
        );
        load(&fault("kind = \"partition\"\ngroups = [[0], [1]]"), &[]).expect("two workers");
    }

    #[test]
    fn data_mode_sizes_are_held_to_the_host_memory() {
        let cfg = load(BASE, &[]).expect("a good config");
        let check = |available: u64| {
            let mut p = Problems::new("test.toml", BASE);
            host_memory(&mut p, &cfg.pod, &cfg.program, false, Some(available));
            p.list
        };
        // 8 chips x (1 MiB in + 1 MiB out) = 16 MiB.
        assert!(check(16 << 20).is_empty());
        let errors = check((16 << 20) - 1);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].line, Some(13));
        assert_eq!(errors[0].field, "job.collectives[0].size");
        assert!(
            errors[0].reason.contains("at least 16 MiB")
                && errors[0].reason.contains("8 chips x 2 MiB")
                && errors[0].reason.contains("mode = \"meta\""),
            "{errors:?}"
        );
        assert_eq!(
            mem_available("MemTotal: 8 kB\nMemAvailable:    2048 kB\n"),
            Some(2 << 20)
        );
        assert_eq!(mem_available("MemTotal: 8 kB\n"), None);
        // A training job: replicas of the state, activations, the check's copy.
        let train = "name = \"t\"\n[topology]\nshape = \"2x2\"\n[job]\nkind = \"train\"\nstrategy = \"ddp\"\nbatch = 1\n[job.model]\nwidths = [1024, 1024, 1024]\n[job.optimizer]\nkind = \"adamw\"\n";
        let cfg = load(train, &[]).expect("a small train job");
        let mut p = Problems::new("test.toml", train);
        host_memory(&mut p, &cfg.pod, &cfg.program, false, Some(1 << 20));
        assert_eq!(p.list.len(), 1, "{:?}", p.list);
        assert_eq!(p.list[0].field, "job.model.widths");
        assert!(p.list[0].reason.contains("in 4 copies"), "{:?}", p.list);
        let meta = load(train, &["job.mode=\"meta\""]).expect("meta");
        let mut p = Problems::new("test.toml", train);
        host_memory(&mut p, &meta.pod, &meta.program, false, Some(64 << 10));
        assert!(
            p.list.is_empty(),
            "meta mode holds no payloads: {:?}",
            p.list
        );
        // But it holds its chips: 4 chips at 16 KiB each do not fit in 64 KiB - 1.
        host_memory(
            &mut p,
            &meta.pod,
            &meta.program,
            false,
            Some((64 << 10) - 1),
        );
        assert_eq!(p.list.len(), 1, "{:?}", p.list);
        assert_eq!(p.list[0].field, "topology.shape");
        assert!(
            p.list[0].reason.contains("4 chips simulated one by one"),
            "{:?}",
            p.list
        );
    }

    #[test]
    fn problems_are_located_from_one_reading_of_the_text() {
        let scans = |unknown: usize| {
            let extra: String = (0..unknown).map(|i| format!("k{i} = {i}\n")).collect();
            let text = BASE.replace("[launch]\n", &format!("[launch]\n{extra}"));
            let before = toml_lines::SCANS.with(|n| n.get());
            let errors = load(&text, &[]).expect_err("unknown keys").0;
            let mut lines: Vec<Option<usize>> = errors.iter().map(|e| e.line).collect();
            lines.sort();
            lines.dedup();
            assert_eq!(lines.len(), unknown, "each on its own line");
            assert_eq!((lines[0], lines[unknown - 1]), (Some(6), Some(5 + unknown)));
            toml_lines::SCANS.with(|n| n.get()) - before
        };
        assert_eq!(scans(1), 1);
        assert_eq!(scans(3000), 1);
    }
}
