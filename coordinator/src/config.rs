//! Job configs: TOML read into validated types. `validate` reports every problem it can find
//! at once, each as `file:line: field: reason`: unknown keys anywhere, wrong types per section,
//! then every semantic problem (a shape that does not parse, more workers than chips, an axis
//! the torus lacks...). Nothing is started from a config that has a problem.

use crate::toml_lines;
use std::fmt;
use std::path::{Path, PathBuf};

use podsim_collectives::{Algo, DType, OpKind, ReduceOp};
use podsim_topology::{
    Group, HARDWARE_KEYS, Hardware, HardwareOverrides, Link, Placement, Pod, Torus,
};
use podsim_worker::protocol::TorchSpec;
use podsim_worker::protocol::{CollectiveStep, JobSpec, Program, Transport};
use podsim_worker::protocol::{DesyncMode, FaultKind, FaultSpec};
use podsim_worker::tls::{Tls, TlsFiles};
use podsim_worker::train::strategy::Plan;
use podsim_worker::train::{
    AttentionKind, BlockKind, Eager, MlpKind, MlpSpec, ModelSpec, OptimizerSpec, Remat, Strategy,
    TpActivations, TrainSpec, TransformerSpec,
};
use serde::Deserialize;

use crate::units::parse_size;

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
            symmetric: self.symmetric,
            trace: None,
            transport: self.transport,
        }
    }

    pub fn mode(&self) -> &'static str {
        match &self.program {
            Program::Collectives { meta: true, .. } => "meta",
            Program::Train(spec) if spec.meta => "meta",
            _ => "data",
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
/// unknown key be reported at once, where serde stops at the first).
macro_rules! table {
    ($(#[$m:meta])* struct $name:ident {
        $($field:ident: $ty:ty $([$($kind:ident),+])?),* $(,)?
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
        }
    };
}

table! {
    struct RawTopology {
        shape: Shape,
        wraparound: Option<Wrap>,
        slices: Option<u32>,
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
        workers: Option<u32>,
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
        iterations: Option<u32> [collectives],
        collectives: Option<Vec<RawCollective>> [collectives],
        verify: Option<bool> [collectives],
        strategy: Option<String> [train],
        eager: Option<String> [train],
        steps: Option<u32> [train],
        batch: Option<usize> [train],
        grad_accum: Option<u32> [train],
        seed: Option<u64> [train],
        bucket_cap_mb: Option<f64> [train],
        reshard_after_forward: Option<bool> [train],
        tp: Option<u32> [train],
        replicas: Option<u32> [train],
        algo: Option<String> [train, torch],
        check: Option<bool> [train],
        symmetric: Option<bool>,
        remat: Option<String>,
        tp_activations: Option<String>,
        model: Option<RawModel> [train],
        optimizer: Option<RawOptimizer> [train],
        program: Option<String> [torch],
        args: Option<Vec<String>> [torch],
    }
}

table! {
    struct RawModel {
        kind: Option<String>,
        widths: Option<Vec<usize>> [mlp],
        layers: Option<usize> [transformer],
        d_model: Option<usize> [transformer],
        heads: Option<usize> [transformer],
        kv_heads: Option<usize> [transformer],
        ffn: Option<usize> [transformer],
        vocab: Option<usize> [transformer],
        seq: Option<usize> [transformer],
        gated: Option<bool> [transformer],
        head_dim: Option<usize> [transformer],
        mlp: Option<String> [transformer],
        block: Option<String> [transformer],
        attention: Option<String> [transformer],
        tied_embeddings: Option<bool> [transformer],
        dtype: Option<String> [transformer],
        weight_dtype: Option<String> [transformer],
    }
}

table! {
    #[derive(Default)]
    struct RawOptimizer {
        kind: Option<String>,
        lr: Option<f32>,
        momentum: Option<f32>,
        weight_decay: Option<f32>,
        beta1: Option<f32>,
        beta2: Option<f32>,
        eps: Option<f32>,
    }
}

table! {
    struct RawCollective {
        op: String,
        size: String,
        algo: Option<String>,
        group: Option<String>,
        reduce: Option<String>,
        root: Option<u32>,
        dtype: Option<String>,
    }
}

table! {
    struct RawFault {
        kind: String,
        chip: Option<u32>,
        worker: Option<u32>,
        link: Option<String>,
        groups: Option<Vec<Vec<u32>>>,
        chip_groups: Option<Vec<Vec<u32>>>,
        at_step: Option<u64>,
        at_seq: Option<u64>,
        after_ms: Option<u64>,
        mode: Option<String>,
        delay_ms: Option<f64>,
        factor: Option<f64>,
    }
}

table! {
    #[derive(Default)]
    struct RawRecovery {
        checkpoint_every: Option<u32>,
        max_restarts: Option<u32>,
    }
}

table! {
    #[derive(Default)]
    struct RawWatchdog {
        timeout_ms: Option<u64>,
        heartbeat_ms: Option<u64>,
        recorder_entries: Option<usize>,
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

/// The line of `key` in `table` (`job.collectives#2` for the third entry of an array of
/// tables), for error messages.
fn locate(text: &str, table: &str, key: Option<&str>) -> Option<usize> {
    let (name, entry) = match table.split_once('#') {
        Some((n, i)) => (n, i.parse::<usize>().ok()),
        None => (table, None),
    };
    toml_lines::line_of(text, name, entry, key)
}

struct Problems<'a> {
    file: String,
    text: &'a str,
    list: Vec<ConfigError>,
}

impl Problems<'_> {
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
        self.list.push(ConfigError {
            file: self.file.clone(),
            line: locate(self.text, table, key),
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
    if p.list.len() == before {
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
        (Some(name), None) => MlpKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .unwrap_or_else(|| {
                p.add(
                    "job.model",
                    Some("mlp"),
                    format!("{name:?} is not relu, gelu, swiglu or geglu"),
                );
                MlpKind::Gelu
            }),
        (None, Some(true)) => MlpKind::Swiglu,
        (None, _) => MlpKind::Gelu,
    };
    let block = match m.block.as_deref().unwrap_or("sequential") {
        "sequential" => BlockKind::Sequential,
        "parallel" => BlockKind::Parallel,
        other => {
            p.add(
                "job.model",
                Some("block"),
                format!("{other:?} is not sequential or parallel"),
            );
            BlockKind::Sequential
        }
    };
    (mlp, block)
}

/// `[job.model] attention`: flash (the default) or dot_product.
fn transformer_attention(p: &mut Problems<'_>, m: &RawModel) -> AttentionKind {
    let name = m.attention.as_deref().unwrap_or("flash");
    AttentionKind::parse(name).unwrap_or_else(|why| {
        p.add("job.model", Some("attention"), why);
        AttentionKind::Flash
    })
}

/// Default heartbeat interval and hang timeout, ms, for a worker hosting `chips_per_worker`
/// chips.
pub fn watchdog_defaults(chips_per_worker: u32) -> (u64, u64) {
    // A heartbeat is a bounded summary, but building it reads every chip's recorder: one
    // every 100 ms up to 10,000 chips a worker, then less often (500 ms at 50,000).
    let heartbeat = (u64::from(chips_per_worker) / 100).clamp(100, 500);
    // The worker excuses waits on live local work itself (a chip waiting on a neighbour that
    // moves is not quiet in that sense), so the timeout need not grow with chips either.
    (heartbeat, 2000)
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
    let text = std::fs::read_to_string(path).map_err(|e| one(None, "file", e.to_string()))?;
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
        Some(toml::Value::String(s)) if !s.trim().is_empty() => Some(s.clone()),
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
    let mut p = Problems {
        file: file.to_string(),
        text,
        list: Vec::new(),
    };
    // 1. Unknown keys, everywhere, reported and dropped (so that the rest of each section is
    //    still checked). 2. Types, section by section. 3. Meaning.
    let mut table = table;
    drop_unknown_keys(&mut p, &mut table);
    let name = job_name(&mut p, &table);
    let topology: Option<RawTopology> = required(&mut p, &table, "topology");
    let job: Option<RawJob> = required(&mut p, &table, "job");
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
    let faults = faults_of(&mut p, &table, pod.as_ref(), workers);
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
    let symmetric = job.as_ref().and_then(|j| j.symmetric).unwrap_or(false);
    if symmetric {
        symmetric_problems(&mut p, program.as_mut(), workers, &faults);
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
fn section<T: for<'de> Deserialize<'de> + Default>(
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

/// A section that must be present.
fn required<T: for<'de> Deserialize<'de>>(
    p: &mut Problems<'_>,
    table: &toml::Table,
    name: &str,
) -> Option<T> {
    let Some(v) = table.get(name) else {
        p.add(name, None, format!("missing [{name}] table"));
        return None;
    };
    v.clone()
        .try_into()
        .map_err(|e: toml::de::Error| p.add(name, None, e.message().to_string()))
        .ok()
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
    let (heartbeat_ms, timeout_ms) = watchdog_defaults(per_worker);
    let heartbeat_ms = watchdog.heartbeat_ms.unwrap_or(heartbeat_ms);
    let wd = Watchdog {
        timeout_ms: watchdog
            .timeout_ms
            // A few heartbeats at least, when a heartbeat is set long.
            .unwrap_or(timeout_ms.max(4 * heartbeat_ms)),
        heartbeat_ms,
        recorder_entries: watchdog.recorder_entries.unwrap_or(2000),
    };
    if wd.recorder_entries == 0 {
        p.add("watchdog", Some("recorder_entries"), "must be at least 1");
    }
    if wd.heartbeat_ms == 0 {
        p.add("watchdog", Some("heartbeat_ms"), "must be at least 1");
    }
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
    if iterations == 0 {
        p.add("job", Some("iterations"), "must be at least 1");
    }
    let list = j.collectives.as_deref().unwrap_or(&[]);
    if list.is_empty() {
        p.add(
            "job",
            Some("collectives"),
            "a collectives job needs at least one [[job.collectives]] entry",
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
    match dtype.unwrap_or("f32") {
        "f32" => Some(DType::F32),
        "bf16" if meta => Some(DType::Bf16),
        "bf16" => {
            p.add(
                table,
                Some("dtype"),
                "bf16 needs mode = \"meta\" (data mode moves f32)",
            );
            None
        }
        other => {
            p.add(
                table,
                Some("dtype"),
                format!("{other:?} is not f32 or bf16"),
            );
            None
        }
    }
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
    if meta {
        p.add(
            "job",
            Some("mode"),
            "a PyTorch program moves real tensors: mode = \"data\" only",
        );
    }
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
    Some(TorchSpec {
        command,
        cwd: None,
        topology: pod.map_or(String::new(), |p| p.torus().to_string()),
        algo,
    })
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
    let mut at_least_one = |key: &str, v: u64| {
        if v == 0 {
            p.add("job", Some(key), "must be at least 1");
        }
    };
    let steps = j.steps.unwrap_or(20);
    at_least_one("steps", u64::from(steps));
    let batch = j.batch.unwrap_or(32);
    at_least_one("batch", batch as u64);
    let grad_accum = j.grad_accum.unwrap_or(1);
    at_least_one("grad_accum", u64::from(grad_accum));
    let bucket_cap_mb = j.bucket_cap_mb.unwrap_or(25.0);
    if !(bucket_cap_mb > 0.0 && bucket_cap_mb.is_finite()) {
        p.add(
            "job",
            Some("bucket_cap_mb"),
            "must be a positive number of MiB",
        );
    }
    let model = match &j.model {
        Some(m) => model_spec(p, m, meta),
        None => missing_model(p),
    };
    let optimizer = optimizer_spec(p, j.optimizer.as_ref());
    let (tp, replicas) = mesh_sizes(p, j, strategy, pod);
    let remat: Option<Remat> = job_value(p, "remat", j.remat.as_deref(), "none");
    let tp_activations = tp_activations(p, j.tp_activations.as_deref());
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

/// `[job] model` is required for training.
fn missing_model(p: &mut Problems<'_>) -> Option<ModelSpec> {
    p.add(
        "job",
        Some("model"),
        "missing: [job.model] widths = [inputs, hidden..., classes], or kind = \"transformer\" with its shape",
    );
    None
}

/// `[job] tp_activations`: replicated (Megatron) or sharded (MaxText) between TP regions.
fn tp_activations(p: &mut Problems<'_>, value: Option<&str>) -> Option<TpActivations> {
    match value.unwrap_or("replicated") {
        "replicated" => Some(TpActivations::Replicated),
        "sharded" => Some(TpActivations::Sharded),
        other => {
            p.add(
                "job",
                Some("tp_activations"),
                format!("{other:?} is not replicated or sharded"),
            );
            None
        }
    }
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
    (tp, replicas)
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
            podsim_worker::WorkerError::Invalid(m) => m,
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
) -> Vec<FaultSpec> {
    let raw: Vec<RawFault> = match table.get("faults") {
        None => Vec::new(),
        Some(v) => v
            .clone()
            .try_into()
            .map_err(|e: toml::de::Error| p.add("faults", None, e.message().to_string()))
            .unwrap_or_default(),
    };
    raw.iter()
        .enumerate()
        .filter_map(|(i, f)| fault(p, &format!("faults#{i}"), f, pod, workers))
        .collect()
}

/// One `[[faults]]` entry.
fn fault(
    p: &mut Problems<'_>,
    table: &str,
    f: &RawFault,
    pod: Option<&Pod>,
    workers: u32,
) -> Option<FaultSpec> {
    let before = p.list.len();
    let kind = FaultKind::ALL.into_iter().find(|k| k.name() == f.kind);
    if kind.is_none() {
        let names: Vec<_> = FaultKind::ALL.iter().map(|k| k.name()).collect();
        p.add(
            table,
            Some("kind"),
            format!(
                "unknown fault {:?} (expected one of {})",
                f.kind,
                names.join(", ")
            ),
        );
    }
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
    let factor = f.factor.unwrap_or(10.0);
    if kind == Some(FaultKind::Slow) && !(factor >= 1.0 && factor.is_finite()) {
        p.add(table, Some("factor"), "must be at least 1");
    }
    let delay_ms = f.delay_ms.unwrap_or(50.0);
    if !(delay_ms >= 0.0 && delay_ms.is_finite()) {
        p.add(
            table,
            Some("delay_ms"),
            "must be a non-negative number of ms",
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
            f.chip.is_some() || f.worker.is_some(),
            "worker = N or chip = N",
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
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    //! Config loading in-process (`from_text`); `tests/config_errors.rs` checks the same
    //! through the command line.
    use super::*;

    const BASE: &str = "name = \"t\"\n[topology]\nshape = \"2x2x2\"\nhardware = \"v5p\"\n[launch]\nworkers = 2\n[job]\nkind = \"collectives\"\nmode = \"data\"\niterations = 2\n[[job.collectives]]\nop = \"all-reduce\"\nsize = \"1MiB\"\n";

    fn load(text: &str, sets: &[&str]) -> Result<JobConfig, ConfigErrors> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        from_text("test.toml", text, &sets)
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
}
