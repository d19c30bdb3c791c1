//! `podsim compare FILE.csv`: predicts the step time of measured training runs and says how
//! far off each prediction is (a file of measured collectives goes to
//! [`crate::compare_collectives`]).
//!
//! Each row describes one run (hardware, slice torus, slices, decoder shape, batch,
//! parallelism, remat policy) and its measured seconds per step. The row becomes a meta-mode
//! training job (`job_toml`: FSDP within a slice, tensor parallelism with activations
//! sharded between regions, data parallelism across slices; AdamW with f32 master weights and
//! state unless the row says `weight_dtype = bf16`), validated like any config, and runs in
//! this process on the mirror fabric: one chip standing for all where the job is symmetric
//! under every translation of the torus, one chip per class of chips alike where it is not
//! (a device mesh that takes a two-chip segment of a torus axis: two chips; a torus without
//! wraparound: every position along that axis). MFU counts model flops: 6 per weight per
//! token (the LM head included, the embedding lookup not) plus causal attention.
//!
//! Optional columns, read where the file has them (an empty cell is the default):
//! `weight_dtype` (`f32`, the default, or `bf16`: weights and optimizer state kept in bf16,
//! MaxText's `weight_dtype`); `attention` (`flash`, the default, or `dot_product`: scores
//! materialised in HBM, as MaxText ran attention before its flash kernel); `bias` (`true`, the
//! default the constants were calibrated with: every matmul adds a bias; `false`: none);
//! `replica_sync`
//! (`after_backward`, the default: the slices' gradient all-reduce once the backward is done,
//! as XLA compiles MaxText's scanned layers; or `per_layer`); `dcn_fsdp` (1, the default;
//! else MaxText's `dcn_fsdp_parallelism`: the parameters are sharded across that many slices
//! too, `dcn_dp x dcn_fsdp` being the slice count).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use clap::Args;
use podsim_programs::ProgramError;
use podsim_programs::job::Program;
use podsim_programs::run_program;
use podsim_programs::train::{AttentionKind, ChipTrainReport, ReplicaSync, TrainSpec};
use podsim_topology::{Hardware, Pod};
use serde::Serialize;

use crate::compare_collectives::{self, CollectiveComparison};
use crate::compare_rows::{Row, Table, require_columns};
pub use crate::compare_rows::{Summary, summarise_errors};
use crate::config;
use crate::{CliError, JobStatus};

/// Columns a row must have (others are ignored, unless they read as a misspelling of one
/// podsim reads).
pub const COLUMNS: [&str; 23] = [
    "id",
    "hardware",
    "topology",
    "wraparound",
    "slices",
    "layers",
    "d_model",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "mlp",
    "block",
    "vocab",
    "tied_embeddings",
    "seq",
    "batch_per_chip",
    "ici_fsdp",
    "ici_tp",
    "dcn_dp",
    "remat",
    "measured_step_s",
    "source",
];

/// Columns a row may have, each read when present.
pub const OPTIONAL_COLUMNS: [&str; 5] = [
    "weight_dtype",
    "attention",
    "bias",
    "dcn_fsdp",
    "replica_sync",
];

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// Measured runs, one per row, with the columns of configs/validation/published.csv.
    pub file: PathBuf,
    /// One JSON object per row, then a summary object.
    #[arg(long)]
    pub json: bool,
    /// Exit 1 when a row's |error| exceeds this many percent.
    #[arg(long, value_name = "PCT")]
    pub max_error: Option<f64>,
    /// Override a field of every row's job, e.g. `--set hardware.attention_efficiency=0.5`
    /// (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

/// One row's prediction against its measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub id: String,
    pub predicted_step_s: f64,
    pub measured_step_s: f64,
    pub error_pct: f64,
    /// Of the predicted step: time the compute stream was busy (kernels, recomputation).
    pub compute_s: f64,
    /// Of the predicted step: communication compute waited for (not hidden under kernels).
    pub exposed_comm_s: f64,
    /// Of `compute_s`: what kernels lost waiting for HBM that communication in flight took.
    pub hbm_wait_s: f64,
    pub mfu: f64,
    pub peak_hbm_bytes: u64,
    pub hbm_capacity_bytes: u64,
    pub fits: bool,
    /// Offloaded activations held in host memory per chip (remat policies that offload).
    pub host_activations_bytes: u64,
    /// 1 when one mirrored chip stood for all; every chip of the pod otherwise.
    pub simulated_chips: u32,
}

/// The most chips a row may need simulated one by one (see `predict`).
const MOST_SIMULATED_CHIPS: u32 = 1024;

/// The meta-mode job of one row, as config text. One step: in meta mode nothing warms up
/// (no caches, no compilation), so the first step is already the steady one.
fn job_toml(row: &Row<'_>) -> Result<String, String> {
    let hardware = row.get("hardware");
    let topology = row.get("topology");
    let dims: Vec<u64> = topology
        .split('x')
        .map(|d| match d.parse() {
            Ok(0) | Err(_) => Err(row.bad("topology", "not a torus like 4x4x4")),
            Ok(n) => Ok(n),
        })
        .collect::<Result<_, _>>()?;
    let per_slice = dims
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .ok_or_else(|| row.bad("topology", "more chips than can be counted"))?;
    let wrap = wraparound(row, dims.len())?;
    let slices = row.positive("slices")?;
    let (tp, dp) = parallelism(row, per_slice, slices)?;
    let strategy = strategy_keys(row, tp, dp)?;
    let batch = sequences_per_group(row, tp)?;
    let (mut model, tied) = model_keys(row)?;
    match row.optional("weight_dtype") {
        None => {}
        Some(w @ ("f32" | "bf16")) => model.push_str(&format!("weight_dtype = {w:?}\n")),
        Some(_) => return Err(row.bad("weight_dtype", "expected f32 or bf16")),
    }
    if let Some(a) = row.optional("attention") {
        a.parse::<AttentionKind>()
            .map_err(|why| row.bad("attention", &why))?;
        model.push_str(&format!("attention = {}\n", toml_string(a)));
    }
    match row.optional("bias") {
        None => {}
        Some(b @ ("true" | "false")) => model.push_str(&format!("bias = {b}\n")),
        Some(_) => return Err(row.bad("bias", "expected true or false")),
    }
    Ok(format!(
        r#"name = {name}
[topology]
shape = {topology}
wraparound = {wrap}
slices = {slices}
hardware = {hardware}
[launch]
workers = 1
[job]
kind = "train"
mode = "meta"
{strategy}
eager = "fused"
steps = 1
batch = {batch}
remat = {remat}
[job.model]
kind = "transformer"
{model}tied_embeddings = {tied}
dtype = "bf16"
[job.optimizer]
kind = "adamw"
"#,
        // Not the id: a name is a folder name, and an id may hold a `/`.
        name = toml_string(&format!("compare-row-{}", row.line)),
        topology = toml_string(topology),
        hardware = toml_string(hardware),
        remat = toml_string(row.get("remat")),
    ))
}

/// A row's job refused by the config's checks, told by the row's columns: the config's
/// fields (and the generated job's line numbers) mean nothing to whoever wrote the CSV.
/// Problems of a field a `--set` gave are the flag's; of a field no column sets, the
/// config's words.
fn config_problems(row: &Row<'_>, errors: &config::ConfigErrors, sets: &[String]) -> String {
    let set_here = |field: &str| {
        sets.iter().any(|s| {
            s.split_once('=')
                .is_some_and(|(key, _)| key.trim() == field)
        })
    };
    let told: Vec<String> = errors
        .0
        .iter()
        .map(|e| match column_of(&e.field) {
            // A `--set` replaced the row's value: the problem is the flag's, on every row.
            _ if set_here(&e.field) => format!("--set {}: {}", e.field, e.reason),
            Some(column) => row.bad(column, &e.reason),
            None => format!(
                "row {} ({}): {}: {}",
                row.line,
                row.get("id"),
                e.field,
                e.reason
            ),
        })
        .collect();
    told.join("\n")
}

/// The column of a compared row that sets config field `field` (see [`job_toml`]).
fn column_of(field: &str) -> Option<&'static str> {
    // `[job.model]` keys are named as their columns (`model_keys`, the optional ones).
    const OPTIONAL_MODEL: [&str; 3] = ["attention", "bias", "weight_dtype"];
    if let Some(key) = field.strip_prefix("job.model.") {
        return COLUMNS
            .iter()
            .chain(&OPTIONAL_MODEL)
            .copied()
            .find(|c| *c == key);
    }
    Some(match field {
        "topology.hardware" => "hardware",
        "topology.shape" => "topology",
        "topology.wraparound" => "wraparound",
        "topology.slices" => "slices",
        "job.batch" => "batch_per_chip",
        "job.remat" => "remat",
        "job.tp" => "ici_tp",
        "job.replicas" => "dcn_dp",
        "job.replica_sync" => "replica_sync",
        _ => return None,
    })
}

/// `s` as a TOML basic string: a cell's text stays one value whatever it holds (a quote or a
/// `#` ended the value early and the rest was read as TOML).
fn toml_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A row's tensor-parallel and data-parallel degrees, after checking its parallelism covers
/// the pod: `ici_fsdp x ici_tp` the chips of a slice, `dcn_dp x dcn_fsdp` the slices.
fn parallelism(row: &Row<'_>, per_slice: u64, slices: u64) -> Result<(u64, u64), String> {
    let (fsdp, tp, dp) = (
        row.positive("ici_fsdp")?,
        row.positive("ici_tp")?,
        row.positive("dcn_dp")?,
    );
    let dcn_fsdp = match row.optional("dcn_fsdp") {
        None => 1,
        Some(_) => row.positive("dcn_fsdp")?,
    };
    // Each pair of degrees must multiply to what it divides: a slice's chips, the slices.
    let covers = |column: &str, other: &str, (a, b): (u64, u64), count: u64, whole: &str| match a
        .checked_mul(b)
    {
        Some(product) if product == count => Ok(()),
        Some(product) => Err(row.bad(
            column,
            &format!("{column} x {other} = {product} but {whole}"),
        )),
        None => Err(row.bad(
            column,
            &format!("{column} x {other} is more than can be counted; {whole}"),
        )),
    };
    let chips = format!("the slice has {per_slice} chips");
    covers("ici_fsdp", "ici_tp", (fsdp, tp), per_slice, &chips)?;
    let all_slices = format!("there are {slices} slices");
    covers("dcn_dp", "dcn_fsdp", (dp, dcn_fsdp), slices, &all_slices)?;
    if dp > 1 && dcn_fsdp > 1 {
        // The mesh puts replicas on the outermost axis, DCN, which is never split.
        return Err(row.bad(
            "dcn_fsdp",
            "sharding across some slices and replicating across others is not modelled",
        ));
    }
    Ok((tp, dp))
}

/// The `[job]` keys of a row's parallelism: FSDP within a slice (and across slices with
/// `dcn_fsdp`, MaxText's `dcn_fsdp_parallelism`: the shards then span the pod, so every
/// gather and reduce-scatter crosses DCN), tensor parallelism with activations sharded between
/// regions, data parallelism across slices. These are XLA runs of a scanned layer loop: the
/// slices' all-reduce follows the backward (`ReplicaSync::AfterBackward`), unless the row's
/// `replica_sync` says otherwise.
fn strategy_keys(row: &Row<'_>, tp: u64, dp: u64) -> Result<String, String> {
    let sync = row.optional("replica_sync").unwrap_or("after_backward");
    sync.parse::<ReplicaSync>()
        .map_err(|why| row.bad("replica_sync", &why))?;
    let sync = if dp > 1 {
        format!("\nreplica_sync = {sync:?}")
    } else {
        String::new()
    };
    Ok(match (tp, dp) {
        (1, 1) => "strategy = \"fsdp\"".to_string(),
        (1, _) => format!("strategy = \"hsdp\"\nreplicas = {dp}{sync}"),
        _ => format!(
            "strategy = \"fsdp+tp\"\ntp = {tp}\nreplicas = {dp}\ntp_activations = \"sharded\"{sync}"
        ),
    })
}

/// Sequences a tensor-parallel group works on per step: `batch_per_chip` x `ici_tp`.
/// `batch_per_chip` may be a fraction (MaxText's `per_device_batch_size = 0.25` with 4-way
/// tensor parallelism: one sequence a group, the group's chips sharing it), as long as the
/// group's share is a whole number of sequences.
fn sequences_per_group(row: &Row<'_>, tp: u64) -> Result<u64, String> {
    // The config's bound on a batch, far above any real one.
    const MOST: f64 = config::WIDTH as f64;
    let per_chip: f64 = row.number("batch_per_chip")?;
    let per_group = per_chip * tp as f64;
    let whole = per_group.round();
    // A fraction written in decimal (0.1 x 10) lands within rounding of a whole number.
    if !per_group.is_finite() || !(1.0..=MOST).contains(&whole) || (per_group - whole).abs() > 1e-6
    {
        let group = if tp == 1 {
            "a chip".to_string()
        } else {
            format!("tensor-parallel group of {tp} chips")
        };
        return Err(row.bad(
            "batch_per_chip",
            &format!("must make a whole number of sequences (1 to 2^24) per {group}"),
        ));
    }
    Ok(whole as u64)
}

/// A row's `wraparound`: true, false, or one of them per axis joined by `+`.
fn wraparound(row: &Row<'_>, axes: usize) -> Result<String, String> {
    Ok(match row.get("wraparound") {
        "true" => "true".to_string(),
        "false" => "false".to_string(),
        per_axis => {
            let list: Vec<&str> = per_axis.split('+').collect();
            if list.len() != axes || list.iter().any(|a| *a != "true" && *a != "false") {
                return Err(row.bad(
                    "wraparound",
                    "expected true, false or one of them per axis joined by +",
                ));
            }
            format!("[{}]", list.join(", "))
        }
    })
}

/// A row's model shape as `[job.model]` lines, and `tied_embeddings`.
fn model_keys(row: &Row<'_>) -> Result<(String, &'static str), String> {
    let mut model = String::new();
    for column in [
        "layers", "d_model", "heads", "kv_heads", "head_dim", "ffn", "vocab", "seq",
    ] {
        model.push_str(&format!("{column} = {}\n", row.positive(column)?));
    }
    for column in ["mlp", "block"] {
        model.push_str(&format!("{column} = {}\n", toml_string(row.get(column))));
    }
    let tied = match row.get("tied_embeddings") {
        "true" => "true",
        "false" => "false",
        _ => return Err(row.bad("tied_embeddings", "expected true or false")),
    };
    Ok((model, tied))
}

/// Predicts one row.
fn predict(
    row: &Row<'_>,
    sets: &[String],
    rt: &tokio::runtime::Runtime,
) -> Result<Comparison, String> {
    // A microsecond to eleven days.
    let measured = row.measured("measured_step_s", (1e-6, 1e6), "seconds")?;
    let text = job_toml(row)?;
    let cfg = config::from_text(
        &format!("row {} ({})", row.line, row.get("id")),
        &text,
        sets,
    )
    .map_err(|e| config_problems(row, &e, sets))?;
    let Program::Train(spec) = &cfg.program else {
        return Err(format!("row {}: not a training job", row.line));
    };
    // A mirror chip stands for every chip alike; without wraparound each position along an
    // axis is its own, and a large such pod would take minutes to hours a row.
    let simulated = spec.symmetry(&cfg.pod).classes();
    if simulated > MOST_SIMULATED_CHIPS {
        return Err(row.bad(
            "wraparound",
            &format!(
                "without wraparound this pod's chips are {simulated} different cases, more than \
                 compare simulates ({MOST_SIMULATED_CHIPS}; slices without wraparound have at \
                 most 256 chips)"
            ),
        ));
    }
    let failed = |e: ProgramError| format!("row {} ({}): {e}", row.line, row.get("id"));
    let reports = rt
        .block_on(simulate(&cfg.pod, &cfg.hardware, spec))
        .map_err(failed)?;
    // The step of the chip that finished last. On wraparound tori every chip is alike under
    // the mirror; without wraparound chips at different positions compute for different
    // times and wait for each other, so the step is the pod's and its split this chip's.
    let last_step = |r: &ChipTrainReport| r.steps.last().cloned();
    let step = reports
        .iter()
        .filter_map(last_step)
        .max_by(|a, b| a.virtual_ns.total_cmp(&b.virtual_ns))
        .ok_or_else(|| format!("row {}: no step ran", row.line))?;
    let peak = reports
        .iter()
        .max_by_key(|r| r.hbm.peak_bytes)
        .map(|r| r.hbm.clone())
        .ok_or_else(|| format!("row {}: no chip ran", row.line))?;
    let predicted = step.virtual_ns / 1e9;
    let global_batch = crate::report::global_batch(&cfg.pod, spec);
    let model_flops = spec.model.step_flops(global_batch as f64);
    let mfu = model_flops / (f64::from(cfg.pod.chips()) * cfg.hardware.peak_flops * predicted);
    Ok(Comparison {
        id: row.get("id").to_string(),
        predicted_step_s: predicted,
        measured_step_s: measured,
        error_pct: (predicted / measured - 1.0) * 100.0,
        compute_s: step.compute_ns / 1e9,
        exposed_comm_s: step.exposed_ns / 1e9,
        hbm_wait_s: step.hbm_wait_ns / 1e9,
        mfu,
        peak_hbm_bytes: peak.peak_bytes,
        hbm_capacity_bytes: peak.capacity_bytes,
        fits: reports.iter().all(|r| r.hbm.oom.is_none()),
        host_activations_bytes: step.host_activations_bytes,
        simulated_chips: reports.len() as u32,
    })
}

/// Runs one step's job on one chip per class of chips alike under the job's symmetry: one
/// chip standing for all when every torus axis wraps and the device mesh lays each dimension
/// on whole axes or on parts that close into rings; a few when a dimension takes a segment of
/// an axis (two when the segment is two chips long), every position along an axis that does
/// not wrap (`podsim_collectives::mirror`).
async fn simulate(
    pod: &Pod,
    hardware: &Hardware,
    spec: &TrainSpec,
) -> Result<Vec<ChipTrainReport>, ProgramError> {
    let symmetry = spec.symmetry(pod);
    let spec = TrainSpec {
        symmetric: true,
        ..spec.clone()
    };
    let chips = podsim_collectives::mirror_chips(pod.clone(), hardware.clone(), &symmetry);
    let done = Arc::new(AtomicU64::new(0));
    Ok(run_program(chips, &Program::Train(spec), done).await?.train)
}

/// What a file's rows became: training runs or collectives, by its header.
#[derive(Debug)]
pub enum Compared {
    Training(Vec<Comparison>),
    Collectives(Vec<CollectiveComparison>),
}

/// Reads `path` and predicts every row (stops at the first bad row): a file of collective
/// timings when its header has their columns (`compare_collectives`), of training runs
/// otherwise.
pub fn compare_file(path: &Path, sets: &[String]) -> Result<Compared, String> {
    let table = Table::read(path)?;
    if compare_collectives::recognises(&table.header) {
        let overrides = config::hardware_from_sets(sets)?;
        return compare_collectives::compare_rows(path, &table, &overrides)
            .map(Compared::Collectives);
    }
    compare_training(path, &table, sets).map(Compared::Training)
}

fn compare_training(
    path: &Path,
    table: &Table,
    sets: &[String],
) -> Result<Vec<Comparison>, String> {
    require_columns(path, &table.header, &COLUMNS, &OPTIONAL_COLUMNS)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    let mut out = Vec::new();
    for row in table.rows() {
        for column in COLUMNS {
            if row.get(column).is_empty() {
                return Err(format!(
                    "{}: {}",
                    path.display(),
                    row.bad(column, "missing value")
                ));
            }
        }
        out.push(predict(&row, sets, &rt).map_err(|e| format!("{}: {e}", path.display()))?);
    }
    Ok(out)
}

/// Median and largest |error| over the rows.
pub fn summarise(rows: &[Comparison]) -> Summary {
    let out_of_memory = rows.iter().filter(|r| !r.fits).count();
    summarise_errors(
        rows.iter().map(|r| (r.id.as_str(), r.error_pct)),
        out_of_memory,
    )
}

fn table(rows: &[Comparison], s: &Summary) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    let id = rows.iter().map(|r| r.id.len()).max().unwrap_or(0).max(8);
    let mut out = format!(
        "{:<id$} {:>12} {:>11} {:>8} {:>7} {:>21} {:>5}\n",
        "id", "predicted s", "measured s", "error", "MFU", "peak HBM / capacity", "fits"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<id$} {:>12.2} {:>11.2} {:>+7.1}% {:>6.1}% {:>9.1} / {:>5.1} GiB {:>5}\n",
            r.id,
            r.predicted_step_s,
            r.measured_step_s,
            r.error_pct,
            100.0 * r.mfu,
            r.peak_hbm_bytes as f64 / GIB,
            r.hbm_capacity_bytes as f64 / GIB,
            if r.fits { "yes" } else { "NO" }
        ));
    }
    out.push_str(&format!(
        "{} rows: median |error| {:.1}%, largest {:.1}% ({}); {} out of memory\n\
         MFU: model flops (6 per weight per token, LM head included, plus causal attention) \
         over the predicted step\n",
        s.rows, s.median_abs_error_pct, s.max_abs_error_pct, s.worst, s.out_of_memory
    ));
    out
}

pub fn main(args: &CompareArgs) -> Result<JobStatus, CliError> {
    if let Some(max) = args.max_error
        && !(max >= 0.0 && max.is_finite())
    {
        return Err(CliError::Usage(format!(
            "--max-error {max}: must be a finite percentage of at least 0"
        )));
    }
    let compared = compare_file(&args.file, &args.sets).map_err(CliError::Usage)?;
    let summary = match &compared {
        Compared::Training(rows) => print_rows(rows, summarise(rows), args.json, table),
        Compared::Collectives(rows) => print_rows(
            rows,
            compare_collectives::summarise(rows),
            args.json,
            compare_collectives::table,
        ),
    };
    match args.max_error {
        Some(max) if summary.max_abs_error_pct > max => Err(CliError::Job(format!(
            "row {} is off by {:.1}%, more than --max-error {max}%",
            summary.worst, summary.max_abs_error_pct
        ))),
        _ => Ok(JobStatus::Ok),
    }
}

/// Prints the rows and their summary (one JSON object each, or the table); returns the
/// summary.
fn print_rows<R: Serialize>(
    rows: &[R],
    summary: Summary,
    json: bool,
    table: fn(&[R], &Summary) -> String,
) -> Summary {
    if json {
        for r in rows {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        }
        println!("{}", serde_json::to_string(&summary).unwrap_or_default());
    } else {
        print!("{}", table(rows, &summary));
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_split_on_commas_outside_quotes() {
        assert_eq!(
            crate::csv::csv_cells("a,\"b, c\",\"d\"\"\""),
            vec!["a", "b, c", "d\""]
        );
        assert_eq!(crate::csv::csv_cells("x,,y"), vec!["x", "", "y"]);
    }

    #[test]
    fn a_file_saved_with_a_byte_order_mark_and_crlf_reads_as_without() {
        let published =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/published.csv");
        let text = std::fs::read_to_string(&published).unwrap();
        let first_rows: Vec<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .take(2)
            .collect();
        let dir = std::env::temp_dir().join(format!("podsim-compare-bom-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("plain.csv");
        let marked = dir.join("marked.csv");
        std::fs::write(&plain, first_rows.join("\n")).unwrap();
        std::fs::write(&marked, format!("\u{feff}{}\r\n", first_rows.join("\r\n"))).unwrap();
        let step = |path: &Path| match compare_file(path, &[]) {
            Ok(Compared::Training(rows)) => rows.iter().map(|r| r.predicted_step_s).collect(),
            other => panic!("{other:?}"),
        };
        let (a, b): (Vec<f64>, Vec<f64>) = (step(&plain), step(&marked));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(a.len(), 1);
        assert_eq!(a, b);
    }

    #[test]
    fn a_cell_is_one_toml_value_whatever_it_holds() {
        for s in [
            "v5p",
            "v5p\" #x",
            "a\\b",
            "tab\there",
            "\u{1b}[31m",
            "é \u{85}",
        ] {
            let doc: toml::Table = toml::from_str(&format!("k = {}", toml_string(s))).unwrap();
            assert_eq!(doc["k"].as_str(), Some(s));
        }
    }

    #[test]
    fn absurd_shapes_are_refused_naming_their_column_before_any_simulation() {
        let published =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs/validation/published.csv");
        let text = std::fs::read_to_string(&published).unwrap();
        let mut lines = text.lines().filter(|l| !l.starts_with('#'));
        let header = lines.next().unwrap();
        let a1 = lines.next().unwrap();
        let column = |name: &str| header.split(',').position(|h| h == name).unwrap();
        let dir =
            std::env::temp_dir().join(format!("podsim-compare-absurd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases: [(&[(&str, &str)], &str); 6] = [
            (
                &[("topology", "4294967296x4294967296x2")],
                "column topology",
            ),
            (
                &[("ici_fsdp", "9223372036854775808"), ("ici_tp", "2")],
                "column ici_fsdp",
            ),
            // 4,096 chips without wraparound: each its own case (minutes a row before).
            (
                &[
                    ("topology", "64x64"),
                    ("wraparound", "false"),
                    ("ici_fsdp", "4096"),
                    ("ici_tp", "1"),
                ],
                "column wraparound",
            ),
            // CSV-quoted: the cell is `v5p" #x`, once accepted as v5p (the rest a comment).
            (
                &[("hardware", "\"v5p\"\" #x\"")],
                "row 2 (A1), column hardware: unknown",
            ),
            // The config's own checks, told by the row's column (they named the generated
            // job's line and field: `row 2 (A1):13: job.model.mlp`).
            (&[("mlp", "gelu2")], "row 2 (A1), column mlp: unknown mlp"),
            (
                &[("batch_per_chip", "500000000")],
                "row 2 (A1), column batch_per_chip",
            ),
        ];
        for (i, (set, want)) in cases.iter().enumerate() {
            let mut cells: Vec<&str> = a1.split(',').collect();
            for (name, value) in set.iter() {
                cells[column(name)] = value;
            }
            let path = dir.join(format!("{i}.csv"));
            std::fs::write(&path, format!("{header}\n{}\n", cells.join(","))).unwrap();
            let err = compare_file(&path, &[]).unwrap_err();
            assert!(err.contains(want), "{want}: {err}");
        }
        // A `--set`'s bad value is the flag's, not the row's column it replaced.
        let path = dir.join("a1.csv");
        std::fs::write(&path, format!("{header}\n{a1}\n")).unwrap();
        for (set, want) in [
            ("job.remat=bogus", "--set job.remat: unknown remat policy"),
            (
                "hardware.matmul_efficiency=7",
                "--set hardware.matmul_efficiency: 7.0 is out of range",
            ),
        ] {
            let err = compare_file(&path, &[set.to_string()]).unwrap_err();
            assert!(
                err.contains(want) && !err.contains("column"),
                "{set}: {err}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        let row = |id: &str, e: f64| Comparison {
            id: id.into(),
            predicted_step_s: 1.0,
            measured_step_s: 1.0,
            error_pct: e,
            compute_s: 1.0,
            exposed_comm_s: 0.0,
            hbm_wait_s: 0.0,
            mfu: 0.5,
            peak_hbm_bytes: 1,
            hbm_capacity_bytes: 2,
            fits: true,
            host_activations_bytes: 0,
            simulated_chips: 1,
        };
        let s = summarise(&[row("a", -4.0), row("b", 2.0), row("c", 8.0), row("d", 1.0)]);
        assert_eq!(s.median_abs_error_pct, 3.0);
        assert_eq!((s.max_abs_error_pct, s.worst.as_str()), (8.0, "c"));
    }

    #[test]
    fn a_fractional_batch_per_chip_is_whole_sequences_per_tensor_parallel_group() {
        let header: Vec<String> = ["id", "batch_per_chip"].map(String::from).to_vec();
        let row = |per_chip: &str| Row {
            line: 2,
            header: &header,
            cells: vec!["r".into(), per_chip.into()],
        };
        assert_eq!(sequences_per_group(&row("0.25"), 4), Ok(1));
        assert_eq!(sequences_per_group(&row("0.1"), 10), Ok(1));
        assert_eq!(sequences_per_group(&row("3"), 16), Ok(48));
        for bad in ["0.3", "0", "-2", "0.25e-9", "inf", "NaN", "x", "1e30"] {
            let err = sequences_per_group(&row(bad), 4).unwrap_err();
            assert!(
                err.contains("row 2 (r), column batch_per_chip"),
                "{bad}: {err}"
            );
        }
    }
}
