//! `podsim study`: scaling studies. A study config names a base job config, the job fields to
//! sweep (a cartesian product, times an optional list of explicit points), extra metrics to
//! read from each run's `report.json`, and plots. Every point runs as a normal job in a child
//! `podsim launch` (its memory is freed when it exits, a crash or an OOM of one point leaves the
//! others running, and points can run side by side); the study gathers `results.csv`,
//! `study.json` and SVG plots in its output folder, rewritten after every finished point so
//! an interrupted study keeps what it had.

use crate::toml_lines;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Deserialize;
use serde_json::Value as Json;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::{self, ConfigError, ConfigErrors};
use crate::csv::csv_line;
use crate::outdir::{LOCK_FILE, MOST_OUTPUT_BYTES, OutputLock, read_text};
use crate::{CliError, JobStatus};

mod plot;
mod rank_server;

/// Options of `podsim study`.
#[derive(Debug, Clone, Args)]
pub struct StudyArgs {
    /// The study config (TOML): a base job config, the fields to sweep, metrics and plots.
    pub config: PathBuf,
    /// Output folder (default: the study's `out`, else `runs/<name>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Points to run at once (default: the study's `parallel`, else 1).
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Print the points and validate each one's job config; run nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// Columns every results.csv has after the swept keys, before the `[metrics]` ones (`error`
/// comes last, after them).
pub const BUILTIN_COLUMNS: [&str; 7] = [
    "status",
    "exit_code",
    "chips",
    "slices",
    "virtual_s",
    "wall_s",
    "peak_rss_mib",
];

/// The columns of results.csv, in order: `point`, the swept keys, the built-in columns, the
/// metrics, `error`. The one definition of the order: header and rows both follow it.
fn column_order(keys: Vec<String>, metrics: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut cols = vec!["point".to_string()];
    cols.extend(keys);
    cols.extend(BUILTIN_COLUMNS.iter().map(|c| c.to_string()));
    cols.extend(metrics);
    cols.push("error".into());
    cols
}

/// A study config, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Study {
    pub name: String,
    /// The study file.
    pub file: PathBuf,
    /// The base job config, resolved against the study file's folder.
    pub base: PathBuf,
    /// Output folder (relative paths are relative to the working directory, as job outputs).
    pub out: PathBuf,
    pub parallel: usize,
    pub timeout: Option<Duration>,
    /// Swept fields in the order written, each with its values.
    pub sweep: Vec<(String, Vec<toml::Value>)>,
    /// Explicit points, each a list of field overrides in the order written.
    pub points: Vec<Vec<(String, toml::Value)>>,
    /// Extra columns: name and dotted path into report.json, in the order written.
    pub metrics: Vec<(String, String)>,
    pub plots: Vec<Plot>,
}

/// One `[[plot]]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plot {
    pub file: String,
    pub title: String,
    pub x: String,
    pub y: String,
    pub series: Option<String>,
    pub log_x: bool,
    pub log_y: bool,
    pub x_label: String,
    pub y_label: String,
}

/// One run of the base config with some fields overridden.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub index: usize,
    pub overrides: Vec<(String, toml::Value)>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStudy {
    name: Option<String>,
    base: String,
    out: Option<String>,
    parallel: Option<i64>,
    timeout_s: Option<f64>,
    #[serde(default)]
    sweep: toml::Table,
    #[serde(default)]
    points: Vec<toml::Table>,
    #[serde(default)]
    metrics: toml::Table,
    #[serde(default)]
    plot: Vec<RawPlot>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPlot {
    file: String,
    title: Option<String>,
    x: String,
    y: String,
    series: Option<String>,
    #[serde(default)]
    log_x: bool,
    #[serde(default)]
    log_y: bool,
    x_label: Option<String>,
    y_label: Option<String>,
}

/// The most points a study runs: each is a `podsim launch` (and a row rewritten into
/// study.json after every point), so a million-point sweep - hours of launches, quadratic
/// rewriting - is a mistake to refuse at once.
const MOST_POINTS: usize = 100_000;
/// The most points run at once.
const MOST_PARALLEL: usize = 1024;

impl Study {
    /// Reads and checks a study file.
    pub fn load(path: &Path) -> Result<Study, ConfigErrors> {
        let text = config::read_config_text(path)?;
        Study::parse(path, &text)
    }

    /// Checks a study given as text; `path` names it in errors and anchors `base`.
    pub fn parse(path: &Path, text: &str) -> Result<Study, ConfigErrors> {
        let mut found = Found {
            file: path.display().to_string(),
            list: Vec::new(),
        };
        let raw: RawStudy = match toml::from_str(text) {
            Ok(raw) => raw,
            Err(e) => {
                let (line, field, message) = syntax_problem(text, &e);
                found.add(line, &field, message);
                return Err(ConfigErrors(found.list));
            }
        };
        // Key order as written: toml's tables are sorted, so take it from the spans.
        let at = &Written::new(text);
        let name = raw.name.clone().unwrap_or_else(|| {
            path.file_stem()
                .map_or("study".into(), |s| s.to_string_lossy().into_owned())
        });
        if name.trim().is_empty() {
            found.add(at.line("name"), "name", "must not be empty".into());
        } else if let Some(why) = crate::outdir::folder_name_problem(&name) {
            found.add(at.line("name"), "name", why.into());
        }
        let base = base_of(&mut found, path, &raw.base, at.line("base"));
        let out = raw
            .out
            .as_deref()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("runs").join(&name));
        let parallel = raw.parallel.unwrap_or(1);
        if !(1..=MOST_PARALLEL as i64).contains(&parallel) {
            found.add(
                at.line("parallel"),
                "parallel",
                format!("{parallel}: must be 1 to {MOST_PARALLEL}"),
            );
        }
        let timeout = timeout_of(&mut found, raw.timeout_s, at.line("timeout_s"));
        let sweep = sweep_of(&mut found, &raw.sweep, at);
        let swept: BTreeSet<String> = sweep.iter().map(|(k, _)| k.clone()).collect();
        let points = points_of(&mut found, &raw.points, at, &swept);
        check_point_count(&mut found, &sweep, points.len(), at.line("sweep"));
        let mut keys: Vec<String> = sweep.iter().map(|(k, _)| k.clone()).collect();
        for (k, _) in points.iter().flatten() {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
        let mut columns = column_order(keys, []);
        let metrics = metrics_of(&mut found, &raw.metrics, at, &mut columns);
        let plots = plots_of(&mut found, raw.plot, at, &columns);
        if !found.list.is_empty() {
            return Err(ConfigErrors(found.list));
        }
        Ok(Study {
            name,
            file: path.to_path_buf(),
            base,
            out,
            parallel: usize::try_from(parallel).unwrap_or(1),
            timeout,
            sweep,
            points,
            metrics,
            plots,
        })
    }

    /// Every point: the sweep's cartesian product (first key slowest) times the explicit
    /// points (innermost). With neither, one point: the base config itself.
    pub fn expand(&self) -> Vec<Point> {
        let mut combos: Vec<Vec<(String, toml::Value)>> = vec![Vec::new()];
        for (key, values) in &self.sweep {
            combos = combos
                .into_iter()
                .flat_map(|c| {
                    values.iter().map(move |v| {
                        let mut c = c.clone();
                        c.push((key.clone(), v.clone()));
                        c
                    })
                })
                .collect();
        }
        let explicit: Vec<Vec<(String, toml::Value)>> = if self.points.is_empty() {
            vec![Vec::new()]
        } else {
            self.points.clone()
        };
        combos
            .iter()
            .flat_map(|c| {
                explicit.iter().map(move |p| {
                    let mut o = c.clone();
                    o.extend(p.iter().cloned());
                    o
                })
            })
            .enumerate()
            .map(|(index, overrides)| Point { index, overrides })
            .collect()
    }

    /// The overridden fields, one column each: swept keys, then the points' keys.
    pub fn keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.sweep.iter().map(|(k, _)| k.clone()).collect();
        for (k, _) in self.points.iter().flatten() {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
        keys
    }

    /// Every column of results.csv, in order.
    pub fn columns(&self) -> Vec<String> {
        column_order(self.keys(), self.metrics.iter().map(|(n, _)| n.clone()))
    }
}

fn bad_override_key(key: &str) -> Option<String> {
    if !key.split('.').all(config::is_field_name) {
        Some("is not a dotted config field such as topology.shape (letters, digits, _ and - between the dots)".into())
    } else if key == "output" || key.starts_with("output.") {
        Some("the study sets each point's output folder itself".into())
    } else {
        None
    }
}

/// A table flattened to dotted keys (`topology.shape = 8` written unquoted is a nested table
/// to TOML; both spellings mean the same field).
fn flatten(table: &toml::Table) -> Vec<(String, toml::Value)> {
    let mut out = Vec::new();
    for (k, v) in table {
        match v {
            toml::Value::Table(t) => {
                for (sk, sv) in flatten(t) {
                    out.push((format!("{k}.{sk}"), sv));
                }
            }
            _ => out.push((k.clone(), v.clone())),
        }
    }
    out
}

/// One key of `[sweep]`, `[metrics]` or a `[[points]]` table, with where a problem with it
/// is reported.
struct Entry {
    key: String,
    value: toml::Value,
    line: Option<usize>,
    /// The key as a problem names it, e.g. `points[2]."job.steps"`.
    field: String,
}

/// A study file's text and where each of its keys is written.
struct Written<'a> {
    text: &'a str,
    lines: toml_lines::Lines,
    /// Byte offsets, as `key_positions` keys them.
    order: BTreeMap<String, usize>,
}

impl<'a> Written<'a> {
    fn new(text: &'a str) -> Self {
        Written {
            text,
            lines: toml_lines::Lines::new(text),
            order: key_positions(text),
        }
    }

    /// The line of `key` (as `key_positions` names it).
    fn line(&self, key: &str) -> Option<usize> {
        self.order.get(key).map(|&pos| self.lines.line_at(pos))
    }

    /// A table's keys in the order written (`scope` as `key_positions` keys them), each
    /// named under `shown`.
    fn entries(&self, items: Vec<(String, toml::Value)>, scope: &str, shown: &str) -> Vec<Entry> {
        let mut entries: Vec<(Option<usize>, Entry)> = items
            .into_iter()
            .map(|(key, value)| {
                let position = self.order.get(&format!("{scope}\u{0}{key}")).copied();
                let entry = Entry {
                    field: format!("{shown}.{}", quote_key(&key)),
                    line: position.map(|pos| self.lines.line_at(pos)),
                    key,
                    value,
                };
                (position, entry)
            })
            .collect();
        entries.sort_by_key(|(position, _)| position.unwrap_or(usize::MAX));
        entries.into_iter().map(|(_, e)| e).collect()
    }

    /// The config overrides of a `[sweep]` or `[[points]]` table (dotted keys flattened), in
    /// the order written; a key that cannot be overridden is reported and left out.
    fn overrides(
        &self,
        found: &mut Found,
        table: &toml::Table,
        scope: &str,
        shown: &str,
    ) -> Vec<Entry> {
        let mut kept = self.entries(flatten(table), scope, shown);
        let mut seen = BTreeSet::new();
        kept.retain(|e| match bad_override_key(&e.key) {
            Some(reason) => {
                found.add(e.line, &e.field, reason);
                false
            }
            // `"topology.shape"` and `topology.shape` (a nested table) name one field.
            None if !seen.insert(e.key.clone()) => {
                found.add(
                    e.line,
                    &e.field,
                    "is given twice (one field, two spellings)".into(),
                );
                false
            }
            None => true,
        });
        kept
    }
}

/// Byte offset of every key as written, keyed `scope NUL dotted.key` for the keys of
/// `[sweep]`, `[metrics]` and each `[[points]]` (`points#i`), and by name for top-level keys.
fn key_positions(text: &str) -> BTreeMap<String, usize> {
    fn walk(
        table: &toml::de::DeTable<'_>,
        scope: &str,
        prefix: &str,
        out: &mut BTreeMap<String, usize>,
    ) {
        for (k, v) in table.iter() {
            let key = if prefix.is_empty() {
                k.get_ref().to_string()
            } else {
                format!("{prefix}.{}", k.get_ref())
            };
            match v.get_ref().as_table() {
                Some(t) => walk(t, scope, &key, out),
                None => {
                    out.insert(format!("{scope}\u{0}{key}"), k.span().start);
                }
            }
        }
    }
    let mut out = BTreeMap::new();
    let Ok(doc) = toml::de::DeTable::parse(text) else {
        return out;
    };
    for (k, v) in doc.get_ref().iter() {
        let name = k.get_ref().to_string();
        out.insert(name.clone(), k.span().start);
        match (name.as_str(), v.get_ref()) {
            ("sweep" | "metrics", value) => {
                if let Some(t) = value.as_table() {
                    walk(t, &name, "", &mut out);
                }
            }
            ("points" | "plot", value) => {
                for (i, entry) in value
                    .as_array()
                    .into_iter()
                    .flat_map(|a| a.iter())
                    .enumerate()
                {
                    if let Some(t) = entry.get_ref().as_table() {
                        walk(t, &format!("{name}#{i}"), "", &mut out);
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Lines of every occurrence of a table header such as `[[plot]]`.
fn header_lines(text: &str, header: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| l.trim().replace(' ', "") == header)
        .map(|(i, _)| i + 1)
        .collect()
}

fn quote_key(key: &str) -> String {
    if key.contains('.') {
        format!("{key:?}")
    } else {
        key.to_string()
    }
}

/// A TOML literal, as `--set` reads it.
pub fn literal(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => {
            let mut out = String::from("\"");
            for c in s.chars() {
                match c {
                    '"' => out.push_str("\\\""),
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\t' => out.push_str("\\t"),
                    '\r' => out.push_str("\\r"),
                    c if c.is_control() => {
                        let _ = write!(out, "\\u{:04X}", u32::from(c));
                    }
                    c => out.push(c),
                }
            }
            out.push('"');
            out
        }
        toml::Value::Integer(i) => i.to_string(),
        toml::Value::Float(f) if f.is_nan() => "nan".into(),
        toml::Value::Float(f) if f.is_infinite() => if *f > 0.0 { "inf" } else { "-inf" }.into(),
        toml::Value::Float(f) => {
            let s = format!("{f:?}");
            if s.contains(['.', 'e', 'E']) {
                s
            } else {
                format!("{s}.0")
            }
        }
        toml::Value::Boolean(b) => b.to_string(),
        toml::Value::Datetime(d) => d.to_string(),
        toml::Value::Array(a) => {
            format!("[{}]", a.iter().map(literal).collect::<Vec<_>>().join(", "))
        }
        toml::Value::Table(t) => format!(
            "{{{}}}",
            t.iter()
                .map(|(k, v)| format!(
                    "{} = {}",
                    literal(&toml::Value::String(k.clone())),
                    literal(v)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// A value as a CSV cell: strings bare, everything else as TOML writes it.
pub fn cell(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => literal(other),
    }
}

fn json_of(v: &toml::Value) -> Json {
    match v {
        toml::Value::String(s) => Json::String(s.clone()),
        toml::Value::Integer(i) => Json::from(*i),
        toml::Value::Float(f) => Json::from(*f),
        toml::Value::Boolean(b) => Json::Bool(*b),
        toml::Value::Datetime(d) => Json::String(d.to_string()),
        toml::Value::Array(a) => Json::Array(a.iter().map(json_of).collect()),
        toml::Value::Table(t) => {
            Json::Object(t.iter().map(|(k, v)| (k.clone(), json_of(v))).collect())
        }
    }
}

/// The `--set` arguments of a point (its overrides, then its output folder).
pub fn point_sets(point: &Point, dir: &Path) -> Vec<String> {
    let mut sets: Vec<String> = point
        .overrides
        .iter()
        .map(|(k, v)| format!("{k}={}", literal(v)))
        .collect();
    sets.push(format!(
        "output.dir={}",
        literal(&toml::Value::String(dir.display().to_string()))
    ));
    sets
}

fn describe(point: &Point) -> String {
    if point.overrides.is_empty() {
        return "(base config)".into();
    }
    point
        .overrides
        .iter()
        .map(|(k, v)| format!("{k}={}", literal(v)))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Follows a dotted path (`collectives.0.virtual_busbw_gbps`) into a JSON value; numeric
/// segments index arrays.
pub fn lookup<'a>(v: &'a Json, path: &str) -> Option<&'a Json> {
    path.split('.').try_fold(v, |v, seg| match v {
        Json::Object(m) => m.get(seg),
        Json::Array(a) => seg.parse::<usize>().ok().and_then(|i| a.get(i)),
        _ => None,
    })
}

/// A JSON value as a CSV cell; null and missing are empty.
pub fn json_cell(v: Option<&Json>) -> String {
    match v {
        None | Some(Json::Null) => String::new(),
        Some(Json::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The end of one point's child process.
#[derive(Debug, Clone)]
pub struct PointOutcome {
    pub status: JobStatus,
    pub exit_code: Option<i32>,
    /// Why, when the child's report cannot say (a timeout, a signal, no report).
    pub reason: Option<String>,
    pub elapsed: Duration,
}

/// What the study knows of a point before it runs (from validating its config).
#[derive(Debug, Clone, Copy, Default)]
pub struct Expected {
    pub chips: Option<u32>,
    pub slices: Option<u32>,
}

/// The CSV row of a finished point. `report` is its report.json, if it wrote one.
pub fn row(
    study: &Study,
    point: &Point,
    outcome: &PointOutcome,
    expected: Expected,
    report: Option<&Json>,
) -> Vec<String> {
    // Cells by column name; the row follows `study.columns()`, the one order.
    let mut cells: BTreeMap<String, String> = BTreeMap::new();
    cells.insert("point".into(), point.index.to_string());
    for (key, value) in &point.overrides {
        cells.insert(key.clone(), cell(value));
    }
    let get = |path: &str| report.and_then(|r| lookup(r, path));
    let ran_ok = report.and_then(|r| r.get("status")).and_then(Json::as_str) == Some("ok");
    // A failed job's report carries zeros where it measured nothing: leave those empty.
    let measured = |path: &str| {
        let v = get(path);
        if !ran_ok && v.and_then(Json::as_f64) == Some(0.0) {
            String::new()
        } else {
            json_cell(v)
        }
    };
    let or_expected = |path: &str, fallback: Option<u32>| match get(path) {
        Some(v) => json_cell(Some(v)),
        None => fallback.map(|n| n.to_string()).unwrap_or_default(),
    };
    let rss = get("workers")
        .and_then(Json::as_array)
        .and_then(|ws| ws.iter().filter_map(|w| w["peak_rss_bytes"].as_u64()).max())
        .filter(|&b| b > 0)
        .map_or(String::new(), |b| {
            format!("{:.1}", b as f64 / (1u64 << 20) as f64)
        });
    let error = match get("error").and_then(Json::as_str) {
        Some(e) if outcome.status != JobStatus::Timeout => e.to_string(),
        _ => outcome.reason.clone().unwrap_or_default(),
    };
    let builtin = [
        ("status", outcome.status.name().to_string()),
        (
            "exit_code",
            outcome.exit_code.map(|c| c.to_string()).unwrap_or_default(),
        ),
        ("chips", or_expected("topology.chips", expected.chips)),
        ("slices", or_expected("topology.slices", expected.slices)),
        ("virtual_s", measured("virtual_s")),
        ("wall_s", measured("wall_s")),
        ("peak_rss_mib", rss),
        ("error", error),
    ];
    for (name, value) in builtin {
        cells.insert(name.into(), value);
    }
    for (name, path) in &study.metrics {
        cells.insert(name.clone(), json_cell(get(path)));
    }
    study
        .columns()
        .iter()
        .map(|c| cells.remove(c).unwrap_or_default())
        .collect()
}

/// Points that set the same values as an earlier one (a sweep value or a `[[points]]` entry
/// given twice): each with the first it repeats.
fn repeated_points(points: &[Point]) -> Vec<(usize, usize)> {
    let key = |p: &Point| {
        let mut sets: Vec<String> = p
            .overrides
            .iter()
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect();
        sets.sort();
        sets
    };
    let mut first: std::collections::HashMap<Vec<String>, usize> = Default::default();
    let mut out = Vec::new();
    for p in points {
        match first.get(&key(p)) {
            Some(&earlier) => out.push((p.index, earlier)),
            None => {
                first.insert(key(p), p.index);
            }
        }
    }
    out
}

/// Every point's job config checked in-process, as the child will read it. Returns the
/// expected sizes, or a message naming every bad point.
pub fn validate(study: &Study, points: &[Point]) -> Result<Vec<Expected>, String> {
    let mut expected = Vec::new();
    let mut bad = String::new();
    let mut count = 0;
    for p in points {
        let dir = point_dir(study, p.index, points.len());
        match config::load(&study.base, &point_sets(p, &dir)) {
            Ok(cfg) => expected.push(Expected {
                chips: Some(cfg.pod.chips()),
                slices: Some(cfg.pod.slices()),
            }),
            Err(errors) => {
                count += 1;
                let _ = writeln!(
                    bad,
                    "  {} ({}):",
                    point_name(p.index, points.len()),
                    describe(p)
                );
                for mut e in errors.0 {
                    // A value this point sets is the study file's, not the base's line.
                    if p.overrides.iter().any(|(key, _)| *key == e.field) {
                        e.file = study.file.display().to_string();
                        e.line = None;
                        e.field = format!("{} (this point's value)", e.field);
                    }
                    let _ = writeln!(bad, "    {e}");
                }
            }
        }
    }
    if count == 0 {
        Ok(expected)
    } else {
        Err(format!(
            "{count} of {} points of {} have a bad job config:\n{}",
            points.len(),
            study.file.display(),
            bad.trim_end()
        ))
    }
}

/// `point-007`: zero-padded so the folders sort in point order.
pub fn point_name(index: usize, total: usize) -> String {
    let width = total.saturating_sub(1).to_string().len().max(3);
    format!("point-{index:0width$}")
}

fn point_dir(study: &Study, index: usize, total: usize) -> PathBuf {
    study.out.join(point_name(index, total))
}

/// How a point ended: its exit code, and for exit 1 (`error` or `wrong_results`) the status
/// its report.json names.
fn point_status(code: Option<i32>, dir: &Path) -> JobStatus {
    let by_code = JobStatus::from_exit_code(code);
    if code != Some(1) {
        return by_code;
    }
    crate::report::read(&dir.join("report.json")).map_or(by_code, |r| r.status)
}

/// `podsim launch BASE --set ...` for one point, in a cleared folder `dir`, its output and
/// errors going to `dir/launch.log` (returned beside the command).
fn point_command(
    exe: &Path,
    base: &Path,
    sets: &[String],
    dir: &Path,
) -> Result<(tokio::process::Command, PathBuf), String> {
    clear_point_folder(dir)?;
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let log_path = dir.join("launch.log");
    let log = std::fs::File::create(&log_path)
        .map_err(|e| format!("cannot create {}: {e}", log_path.display()))?;
    let log2 = log
        .try_clone()
        .map_err(|e| format!("cannot open {}: {e}", log_path.display()))?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("launch").arg(base);
    for s in sets {
        cmd.arg("--set").arg(s);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .kill_on_drop(true);
    // A study killed outright (SIGKILL, or a signal it does not handle) takes its points with
    // it; they kept running as orphans, writing into its folder. Spawned from the study's one
    // runtime thread, which lives as long as the study.
    podsim_links::procs::killed_with_parent(cmd.as_std_mut());
    Ok((cmd, log_path))
}

/// Empties a point's folder for its run, if it is one: a folder an earlier run of a point left
/// (its `launch.log` is there) or an empty one, and no job holding it. Anything else - a
/// user's files, a job running there - is refused, not deleted.
fn clear_point_folder(dir: &Path) -> Result<(), String> {
    let names = match folder_entries(dir) {
        Ok(names) => names,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot read {}: {e}", dir.display())),
    };
    let held = OutputLock::acquire(dir, "podsim study, clearing a point's folder")?;
    if !names.is_empty() && !names.iter().any(|n| n == "launch.log") {
        return Err(format!(
            "{} holds files no study's point wrote ({}): move them, or give the study another \
             folder (out = ... or --out)",
            dir.display(),
            listed(&names)
        ));
    }
    std::fs::remove_dir_all(dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    drop(held);
    Ok(())
}

/// A study's own folder: new, empty, or one an earlier study wrote (its `study.json`). Its
/// points' folders are emptied and its files rewritten, so a folder of other files is refused.
fn check_study_folder(dir: &Path) -> Result<(), String> {
    let names = folder_entries(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if names.is_empty() || names.iter().any(|n| n == "study.json") {
        return Ok(());
    }
    Err(format!(
        "the output folder {} holds files no study wrote ({}): give the study a new or empty \
         folder (out = ... or --out), or one an earlier study wrote",
        dir.display(),
        listed(&names)
    ))
}

/// The names in `dir` but its lock file.
fn folder_entries(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name != LOCK_FILE {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// The first few of `names`, for a message.
fn listed(names: &[String]) -> String {
    let shown: Vec<&str> = names.iter().take(3).map(String::as_str).collect();
    match names.len() {
        n if n > 3 => format!("{}, and {} more", shown.join(", "), n - 3),
        _ => shown.join(", "),
    }
}

/// One point's `podsim launch`: the binary, the base config, the point's `--set`s, its
/// folder, its time bound and the shared rank server its ranks fork from, if any.
struct PointRun {
    exe: PathBuf,
    base: PathBuf,
    sets: Vec<String>,
    dir: PathBuf,
    timeout: Option<Duration>,
    server: Option<String>,
}

impl PointRun {
    /// Point `p` of `total`, in its folder of the study's output.
    fn of(study: &Study, p: &Point, total: usize, exe: &Path, server: Option<&str>) -> PointRun {
        let dir = point_dir(study, p.index, total);
        PointRun {
            exe: exe.to_path_buf(),
            base: study.base.clone(),
            sets: point_sets(p, &dir),
            dir,
            timeout: study.timeout,
            server: server.map(String::from),
        }
    }
}

/// Runs one point as `podsim launch`, output to `dir/launch.log`. Stops (killing the child)
/// on `timeout` or when `cancel` turns true.
async fn run_point(
    point: PointRun,
    mut cancel: watch::Receiver<bool>,
) -> Result<Option<PointOutcome>, String> {
    let PointRun {
        exe,
        base,
        sets,
        dir,
        timeout,
        server,
    } = point;
    let (mut cmd, log_path) = point_command(&exe, &base, &sets, &dir)?;
    if let Some(server) = server {
        cmd.env("PODSIM_RANK_SERVER", server);
    }
    let started = Instant::now();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
    let deadline = async {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending().await,
        }
    };
    let cancelled = async {
        loop {
            if *cancel.borrow_and_update() {
                return;
            }
            if cancel.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        status = child.wait() => {
            let status = status.map_err(|e| format!("cannot wait for a point: {e}"))?;
            let code = status.code();
            let reason = match code {
                Some(c) => (c != 0).then(|| last_line(&log_path, c)),
                None => Some(signal_reason(&status)),
            };
            Ok(Some(PointOutcome {
                status: point_status(code, &dir),
                exit_code: code,
                reason,
                elapsed: started.elapsed(),
            }))
        }
        () = deadline => {
            let _ = child.kill().await;
            Ok(Some(PointOutcome {
                status: JobStatus::Timeout,
                exit_code: None,
                reason: Some(format!(
                    "timed out after {} s (timeout_s); killed",
                    timeout.map_or(0.0, |t| t.as_secs_f64())
                )),
                elapsed: started.elapsed(),
            }))
        }
        () = cancelled => {
            let _ = child.kill().await;
            Ok(None)
        }
    }
}

#[cfg(unix)]
fn signal_reason(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(s) => format!("killed by signal {s} without a report"),
        None => "ended without an exit code".into(),
    }
}

#[cfg(not(unix))]
fn signal_reason(_status: &std::process::ExitStatus) -> String {
    "ended without an exit code".into()
}

/// The child's own last word (`podsim: ...`), for points that end without a usable report.
fn last_line(log: &Path, code: i32) -> String {
    // The end of the log holds the last word; a log may be large.
    let text = crate::outdir::read_tail(log, 64 << 10).unwrap_or_default();
    let line = text
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with("podsim:"))
        .or_else(|| text.lines().rev().map(str::trim).find(|l| !l.is_empty()));
    match line {
        Some(l) => l.chars().take(300).collect(),
        None => format!("exit code {code}, nothing in launch.log"),
    }
}

/// Results so far, written after every point.
struct Results<'a> {
    study: &'a Study,
    points: &'a [Point],
    columns: Vec<String>,
    rows: BTreeMap<usize, Vec<String>>,
    outcomes: BTreeMap<usize, PointOutcome>,
}

impl<'a> Results<'a> {
    /// The results of a study about to run: its folder made, files of an earlier run that
    /// could pass for results of this one removed, empty results.csv and study.json written.
    fn start(study: &'a Study, points: &'a [Point]) -> Result<Results<'a>, String> {
        std::fs::create_dir_all(&study.out)
            .map_err(|e| format!("cannot create {}: {e}", study.out.display()))?;
        for p in &study.plots {
            let _ = std::fs::remove_file(study.out.join(&p.file));
        }
        let results = Results {
            study,
            points,
            columns: study.columns(),
            rows: BTreeMap::new(),
            outcomes: BTreeMap::new(),
        };
        results.write_csv()?;
        results.write_json()?;
        Ok(results)
    }

    /// A point finished: its row from its report, a progress line, and every file rewritten.
    fn record(
        &mut self,
        index: usize,
        outcome: PointOutcome,
        expected: Expected,
        progress: &Progress,
        running: &BTreeSet<usize>,
    ) -> Result<(), String> {
        let (study, total) = (self.study, self.points.len());
        let p = &self.points[index];
        let dir = point_dir(study, index, total);
        let report = read_text(&dir.join("report.json"), MOST_OUTPUT_BYTES)
            .ok()
            .and_then(|t| serde_json::from_str::<Json>(&t).ok());
        let cells = row(study, p, &outcome, expected, report.as_ref());
        let error = cells.last().cloned().unwrap_or_default();
        progress.finished(
            &format!(
                "[{}/{total}] {} {} in {:.1} s  {}{}",
                self.rows.len() + 1,
                point_name(index, total),
                outcome.status.name(),
                outcome.elapsed.as_secs_f64(),
                describe(p),
                if error.is_empty() {
                    String::new()
                } else {
                    format!("  ({error})")
                }
            ),
            running,
            total,
        );
        self.rows.insert(index, cells);
        self.outcomes.insert(index, outcome);
        self.write_csv()
            .and_then(|_| self.write_json())
            .and_then(|_| self.write_plots())
            .map(|_| ())
    }

    /// The closing lines: how the points ended, and the files written.
    fn print_summary(&self, elapsed: Duration, plots: &[PathBuf], page: &Path) {
        let (study, total) = (self.study, self.points.len());
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for o in self.outcomes.values() {
            *counts.entry(o.status.name()).or_insert(0) += 1;
        }
        let counts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
        println!(
            "study {}: {total} points ran in {:.1} s: {}",
            study.name,
            elapsed.as_secs_f64(),
            counts.join(", ")
        );
        println!("results: {}", study.out.join("results.csv").display());
        for p in plots {
            println!("plot: {}", p.display());
        }
        println!("page: {}", page.display());
        for warning in self.empty_outputs() {
            eprintln!("podsim: study {}: {warning}", study.name);
        }
    }

    /// Metrics and plots that came out empty although points ran `ok`: a metric whose path
    /// no report holds, a plot whose columns hold no numbers (`y = "status"`). Said, as an
    /// empty column or plot looks like a result.
    fn empty_outputs(&self) -> Vec<String> {
        let ok = self.outcomes.values().any(|o| o.status == JobStatus::Ok);
        if !ok {
            return Vec::new();
        }
        let rows: Vec<&Vec<String>> = self.rows.values().collect();
        let mut out = Vec::new();
        for (name, path) in &self.study.metrics {
            let at = self.columns.iter().position(|c| c == name);
            let empty =
                at.is_some_and(|i| rows.iter().all(|r| r.get(i).is_none_or(String::is_empty)));
            if empty {
                out.push(format!(
                    "metric {name} is empty in every point: no report.json holds {path:?}"
                ));
            }
        }
        for p in &self.study.plots {
            if plot::series(p, &self.columns, &rows).is_empty() {
                out.push(format!(
                    "plot {} has no points: no point that ran ok has numbers in both {} and {}",
                    p.file, p.x, p.y
                ));
            }
        }
        out
    }

    fn write_csv(&self) -> Result<PathBuf, String> {
        let mut text = csv_line(&self.columns);
        for r in self.rows.values() {
            text.push_str(&csv_line(r));
        }
        write_atomic(&self.study.out.join("results.csv"), &text)
    }

    fn write_json(&self) -> Result<PathBuf, String> {
        let total = self.points.len();
        let points: Vec<Json> = self
            .points
            .iter()
            .map(|p| {
                let name = point_name(p.index, total);
                let o = self.outcomes.get(&p.index);
                serde_json::json!({
                    "point": p.index,
                    "dir": name,
                    "overrides": Json::Object(
                        p.overrides.iter().map(|(k, v)| (k.clone(), json_of(v))).collect()
                    ),
                    "sets": point_sets(p, &point_dir(self.study, p.index, total)),
                    "report": format!("{name}/report.json"),
                    "log": format!("{name}/launch.log"),
                    "status": o.map_or("pending", |o| o.status.name()),
                    "exit_code": o.and_then(|o| o.exit_code),
                    "elapsed_s": o.map(|o| o.elapsed.as_secs_f64()),
                })
            })
            .collect();
        let s = self.study;
        let doc = serde_json::json!({
            "name": s.name,
            "config": s.file.display().to_string(),
            "base": s.base.display().to_string(),
            "out": s.out.display().to_string(),
            "parallel": s.parallel,
            "timeout_s": s.timeout.map(|t| t.as_secs_f64()),
            "sweep": Json::Array(s.sweep.iter().map(|(k, vs)| serde_json::json!({
                "key": k,
                "values": Json::Array(vs.iter().map(json_of).collect()),
            })).collect()),
            "metrics": Json::Array(s.metrics.iter().map(|(n, p)| serde_json::json!({
                "name": n, "path": p,
            })).collect()),
            "columns": self.columns,
            "plots": s.plots.iter().map(|p| p.file.clone()).collect::<Vec<_>>(),
            "points": points,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        write_atomic(&s.out.join("study.json"), &text)
    }

    fn write_plots(&self) -> Result<Vec<PathBuf>, String> {
        let rows: Vec<&Vec<String>> = self.rows.values().collect();
        let mut written = Vec::new();
        for p in &self.study.plots {
            let svg = plot::render(p, &self.columns, &rows)?;
            written.push(write_atomic(&self.study.out.join(&p.file), &svg)?);
        }
        Ok(written)
    }
}

fn write_atomic(path: &Path, text: &str) -> Result<PathBuf, String> {
    crate::outdir::write_atomic(path, text.as_bytes())
}

/// A bar on a terminal (stderr), plain lines on stdout otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    fn new(total: usize) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} points  {msg}",
            ) {
                bar.set_style(style);
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress { bar }
    }

    fn line(&self, text: &str) {
        match &self.bar {
            Some(bar) => bar.println(text),
            None => println!("{text}"),
        }
    }

    fn started(&self, name: &str, what: &str, running: &BTreeSet<usize>, total: usize) {
        match &self.bar {
            Some(bar) => bar.set_message(running_message(running, total)),
            None => println!("{name}: started ({what})"),
        }
    }

    fn finished(&self, text: &str, running: &BTreeSet<usize>, total: usize) {
        self.line(text);
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(running_message(running, total));
        }
    }

    fn done(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

fn running_message(running: &BTreeSet<usize>, total: usize) -> String {
    let names: Vec<String> = running.iter().map(|&i| point_name(i, total)).collect();
    if names.is_empty() {
        String::new()
    } else {
        format!("running {}", names.join(", "))
    }
}

/// Runs `podsim study`. Ok once every point ran, whatever their results.
pub fn main(args: &StudyArgs) -> Result<JobStatus, CliError> {
    let mut study = Study::load(&args.config)
        .map_err(|e| CliError::Usage(e.to_string().trim_end().to_string()))?;
    if let Some(out) = &args.out {
        study.out = out.clone();
    }
    if let Some(jobs) = args.jobs {
        if !(1..=MOST_PARALLEL).contains(&jobs) {
            return Err(CliError::Usage(format!(
                "--jobs must be 1 to {MOST_PARALLEL}"
            )));
        }
        study.parallel = jobs;
    }
    let points = study.expand();
    let total = points.len();
    println!(
        "study {}: {total} point{} of {}, {} at a time, into {}",
        study.name,
        if total == 1 { "" } else { "s" },
        study.base.display(),
        study.parallel.min(total),
        study.out.display()
    );
    if args.dry_run {
        for p in &points {
            println!("  {}  {}", point_name(p.index, total), describe(p));
        }
    }
    for (again, first) in repeated_points(&points) {
        // Allowed (a repeat measures the host's spread), but rarely meant.
        eprintln!(
            "podsim: study {}: {} is the same job as {} ({}): it runs twice",
            study.name,
            point_name(again, total),
            point_name(first, total),
            describe(&points[first])
        );
    }
    let expected = validate(&study, &points).map_err(CliError::Usage)?;
    if args.dry_run {
        println!("every point's config is valid (dry run: nothing was run)");
        return Ok(JobStatus::Ok);
    }
    let _lock =
        OutputLock::acquire(&study.out, &crate::outdir::this_command()).map_err(CliError::Usage)?;
    check_study_folder(&study.out).map_err(CliError::Usage)?;
    let server = rank_server::SharedRankServer::for_rows(&study.base, &study.keys());
    if let Some(server) = &server {
        println!(
            "the points' ranks fork from one rank server ({})",
            server.name
        );
    }
    run(
        &study,
        &points,
        &expected,
        server.as_ref().map(|s| s.name.as_str()),
    )
}

/// Runs every point, `study.parallel` at a time, their ranks forked from `rank_server` when
/// one is named.
fn run(
    study: &Study,
    points: &[Point],
    expected: &[Expected],
    rank_server: Option<&str>,
) -> Result<JobStatus, CliError> {
    let job = |e: String| CliError::Job(e);
    let exe =
        std::env::current_exe().map_err(|e| job(format!("cannot find the podsim binary: {e}")))?;
    let total = points.len();
    let mut results = Results::start(study, points).map_err(job)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| job(format!("cannot start the runtime: {e}")))?;
    let progress = Progress::new(total);
    let started = Instant::now();
    let outcome = rt.block_on(async {
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let mut tasks: JoinSet<(usize, Result<Option<PointOutcome>, String>)> = JoinSet::new();
        let mut running = BTreeSet::new();
        let mut next = 0;
        let interrupted = crate::interrupted();
        tokio::pin!(interrupted);
        let failure = loop {
            while running.len() < study.parallel && next < total {
                let p = &points[next];
                running.insert(p.index);
                progress.started(&point_name(p.index, total), &describe(p), &running, total);
                let point = PointRun::of(study, p, total, &exe, rank_server);
                let (index, cancel) = (p.index, cancel_rx.clone());
                tasks.spawn(async move { (index, run_point(point, cancel).await) });
                next += 1;
            }
            let joined = tokio::select! {
                joined = tasks.join_next() => joined,
                _ = &mut interrupted => break Some("interrupted: the running points were stopped".to_string()),
            };
            let Some(joined) = joined else { break None };
            let (index, result) = match joined {
                Ok(r) => r,
                Err(e) => break Some(format!("a point's task failed: {e}")),
            };
            running.remove(&index);
            let outcome = match result {
                Ok(Some(o)) => o,
                Ok(None) => continue,
                Err(e) => break Some(e),
            };
            let expected = expected.get(index).copied().unwrap_or_default();
            if let Err(e) = results.record(index, outcome, expected, &progress, &running) {
                break Some(e);
            }
        };
        if failure.is_some() {
            // Stop every running point, and wait for each child to be killed and reaped.
            let _ = cancel_tx.send(true);
            while tasks.join_next().await.is_some() {}
        }
        failure
    });
    progress.done();
    if let Some(e) = outcome {
        return Err(job(format!(
            "study {}: {e} ({} of {total} points finished; results so far in {})",
            study.name,
            results.rows.len(),
            study.out.join("results.csv").display()
        )));
    }
    let plots = results.write_plots().map_err(job)?;
    let page = write_html(&study.out).map_err(job)?;
    results.print_summary(started.elapsed(), &plots, &page);
    Ok(JobStatus::Ok)
}

/// Writes `study.html` into a study's output folder: its plots (as listed in `study.json`, else
/// every SVG there) and `results.csv` as a table. A plot is a plain `.svg` file of the folder
/// holding an SVG and no script: a listed name reaching elsewhere (`../`, `/etc/...`) or a file
/// that is no such SVG is left out, saying so, as the page inlines what it shows.
pub fn write_html(dir: &Path) -> Result<PathBuf, String> {
    let read =
        |p: &Path| read_text(p, MOST_OUTPUT_BYTES).map_err(|e| format!("{}: {e}", p.display()));
    let csv = read(&dir.join("results.csv"))?;
    let meta: serde_json::Value = read(&dir.join("study.json"))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_default();
    let files: Vec<String> = match meta["plots"].as_array() {
        // The study's own list, even empty: an earlier study's SVGs left here are not its.
        Some(listed) => listed
            .iter()
            .filter_map(|f| f.as_str().map(String::from))
            .collect(),
        None => {
            let mut found: Vec<String> = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.ends_with(".svg"))
                .collect();
            found.sort();
            found
        }
    };
    let plots: Vec<(String, String)> = files
        .into_iter()
        .filter_map(|f| match plot_text(dir, &f) {
            Ok(svg) => Some((f, svg)),
            Err(why) => {
                eprintln!(
                    "podsim: {}: plot {f:?} left out of study.html: {why}",
                    dir.display()
                );
                None
            }
        })
        .collect();
    let name = meta["name"].as_str().map(String::from).unwrap_or_else(|| {
        dir.file_name()
            .map_or_else(|| "study".into(), |n| n.to_string_lossy().into_owned())
    });
    write_atomic(
        &dir.join("study.html"),
        &crate::html::render_study(&name, &plots, &csv),
    )
}

/// The SVG of plot `file` of the study folder `dir`, or why it is not one the page may inline.
fn plot_text(dir: &Path, file: &str) -> Result<String, String> {
    let plain = Path::new(file).file_name().is_some_and(|n| n == file) && !file.starts_with('.');
    if !plain || !file.ends_with(".svg") {
        return Err("not the name of a .svg file in the study's folder".into());
    }
    let text = read_text(&dir.join(file), MOST_OUTPUT_BYTES)?;
    let lower = text.to_ascii_lowercase();
    let body = lower.find("<svg").map(|i| &lower[..i]);
    let prologue_only = body.is_some_and(|head| {
        let head = head.trim();
        head.is_empty() || (head.starts_with("<?xml") && head.ends_with("?>"))
    });
    if !prologue_only
        || ["<script", "javascript:", "<foreignobject"]
            .iter()
            .any(|w| lower.contains(w))
    {
        return Err("not an SVG drawing without scripts".into());
    }
    Ok(text)
}

/// Problems found in a study file, each with its line.
struct Found {
    file: String,
    list: Vec<ConfigError>,
}

impl Found {
    fn add(&mut self, line: Option<usize>, field: &str, reason: String) {
        self.list.push(ConfigError {
            file: self.file.clone(),
            line,
            field: field.to_string(),
            reason,
        });
    }
}

/// Where a study file fails to parse: line, field and message (a missing field is named
/// inside its table).
fn syntax_problem(text: &str, e: &toml::de::Error) -> (Option<usize>, String, String) {
    let (line, mut field) = match e.span() {
        Some(span) => {
            let (line, field) = toml_lines::field_at(text, span.start);
            (Some(line), field)
        }
        None => (None, String::new()),
    };
    let message = e.message().trim().to_string();
    let mut line = line;
    if let Some(missing) = message
        .strip_prefix("missing field `")
        .and_then(|m| m.split('`').next())
    {
        // The span is the table that lacks the field: its header, or the whole
        // document for a top-level field (no line worth naming then).
        let header = line
            .and_then(|l| text.lines().nth(l - 1))
            .is_some_and(|t| t.trim_start().starts_with('['));
        if header && !field.is_empty() {
            field = format!("{field}.{missing}");
        } else {
            field = missing.to_string();
            line = None;
        }
    }
    if field.is_empty() {
        field = "syntax".into();
    }
    (line, field, message)
}

/// The study's base job config, relative to the study file: it must exist.
fn base_of(found: &mut Found, path: &Path, base: &str, line: Option<usize>) -> PathBuf {
    let full = path.parent().unwrap_or(Path::new("")).join(base);
    if base.trim().is_empty() {
        found.add(line, "base", "must name a job config".into());
    } else if !full.is_file() {
        found.add(
            line,
            "base",
            format!("{} is not a readable file", full.display()),
        );
    }
    full
}

/// `timeout_s`: a positive number of seconds, when given.
fn timeout_of(found: &mut Found, seconds: Option<f64>, line: Option<usize>) -> Option<Duration> {
    match seconds {
        None => None,
        Some(t) if t.is_finite() && t > 0.0 && t < 1e9 => Some(Duration::from_secs_f64(t)),
        Some(t) => {
            found.add(
                line,
                "timeout_s",
                format!(
                    "{}: must be a positive number of seconds, below 1e9 (31 years)",
                    // 1e300 in full is a line of digits.
                    if t.abs() < 1e15 {
                        format!("{t}")
                    } else {
                        format!("{t:e}")
                    }
                ),
            );
            None
        }
    }
}

/// A study of more than [`MOST_POINTS`] points (the sweep's product times the explicit
/// points) is refused.
fn check_point_count(
    found: &mut Found,
    sweep: &[(String, Vec<toml::Value>)],
    explicit: usize,
    line: Option<usize>,
) {
    let count = sweep
        .iter()
        .map(|(_, values)| values.len())
        .chain([explicit.max(1)])
        .try_fold(1usize, usize::checked_mul);
    if count.is_none_or(|n| n > MOST_POINTS) {
        found.add(
            line,
            "sweep",
            format!(
                "{} points, more than a study runs ({MOST_POINTS}): split it into studies",
                count.map_or("too many".to_string(), |n| n.to_string())
            ),
        );
    }
}

/// `[sweep]`: each key with its list of values, in the order written.
fn sweep_of(
    found: &mut Found,
    raw: &toml::Table,
    at: &Written<'_>,
) -> Vec<(String, Vec<toml::Value>)> {
    let mut sweep = Vec::new();
    for Entry {
        key,
        value,
        line,
        field,
    } in at.overrides(found, raw, "sweep", "sweep")
    {
        match value {
            toml::Value::Array(values) if !values.is_empty() => sweep.push((key, values)),
            toml::Value::Array(_) => found.add(line, &field, "the list of values is empty".into()),
            other => found.add(
                line,
                &field,
                format!(
                    "expected a list of values, found a {} (write [{}])",
                    other.type_str(),
                    literal(&other)
                ),
            ),
        }
    }
    sweep
}

/// `[[points]]`: each point's keys (none of them swept).
fn points_of(
    found: &mut Found,
    raw: &[toml::Table],
    at: &Written<'_>,
    swept: &BTreeSet<String>,
) -> Vec<Vec<(String, toml::Value)>> {
    let mut points = Vec::new();
    for (i, table) in raw.iter().enumerate() {
        let mut point = Vec::new();
        let shown = format!("points[{i}]");
        for Entry {
            key,
            value,
            line,
            field,
        } in at.overrides(found, table, &format!("points#{i}"), &shown)
        {
            if swept.contains(&key) {
                found.add(line, &field, "is also swept in [sweep]".into());
            } else {
                point.push((key, value));
            }
        }
        points.push(point);
    }

    points
}

/// `[metrics]`: each column's dotted path into report.json, its column added to `columns`.
fn metrics_of(
    found: &mut Found,
    raw: &toml::Table,
    at: &Written<'_>,
    columns: &mut Vec<String>,
) -> Vec<(String, String)> {
    let mut metrics = Vec::new();
    let items = raw.clone().into_iter().collect();
    for Entry {
        key: name,
        value,
        line,
        field,
    } in at.entries(items, "metrics", "metrics")
    {
        let Some(path) = value.as_str() else {
            found.add(
                line,
                &field,
                format!(
                    "expected a dotted path into report.json (a string), found a {}",
                    value.type_str()
                ),
            );
            continue;
        };
        if path.split('.').any(|s| s.trim().is_empty()) {
            found.add(
                line,
                &field,
                format!(
                    "{path:?} is not a dotted path such as \"collectives.0.virtual_busbw_gbps\""
                ),
            );
        } else if columns.contains(&name) {
            found.add(line, &field, "a column of that name already exists".into());
        } else {
            // Metric columns go before `error`, which stays last.
            columns.insert(columns.len() - 1, name.clone());
            metrics.push((name, path.to_string()));
        }
    }

    metrics
}

/// `[[plot]]`s: files and columns checked.
fn plots_of(
    found: &mut Found,
    raw: Vec<RawPlot>,
    at: &Written<'_>,
    columns: &[String],
) -> Vec<Plot> {
    let mut plots = Vec::new();
    let mut files = BTreeSet::new();
    let plot_lines = header_lines(at.text, "[[plot]]");
    for (i, p) in raw.into_iter().enumerate() {
        let mut bad = |key: &str, reason: String| {
            let line = at
                .line(&format!("plot#{i}\u{0}{key}"))
                .or(plot_lines.get(i).copied());
            found.add(line, &format!("plot[{i}].{key}"), reason);
        };
        let plain =
            !p.file.is_empty() && !p.file.contains(['/', '\\']) && p.file != "." && p.file != "..";
        if !plain || !p.file.ends_with(".svg") {
            bad(
                "file",
                format!("{:?}: expected a file name ending in .svg", p.file),
            );
        } else if !files.insert(p.file.clone()) {
            bad("file", format!("{:?} is written by another plot", p.file));
        } else if p.file == "results.csv" || p.file == "study.json" {
            bad("file", format!("{:?} is reserved", p.file));
        }
        for (key, col) in [
            ("x", Some(&p.x)),
            ("y", Some(&p.y)),
            ("series", p.series.as_ref()),
        ] {
            if let Some(col) = col
                && !columns.contains(col)
            {
                bad(
                    key,
                    format!("{col:?} is not a column (columns: {})", columns.join(", ")),
                );
            }
        }
        plots.push(Plot {
            title: p.title.unwrap_or_else(|| format!("{} vs {}", p.y, p.x)),
            x_label: p.x_label.unwrap_or_else(|| p.x.clone()),
            y_label: p.y_label.unwrap_or_else(|| p.y.clone()),
            file: p.file,
            x: p.x,
            y: p.y,
            series: p.series,
            log_x: p.log_x,
            log_y: p.log_y,
        });
    }
    plots
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_point_given_twice_is_found_whatever_the_order_of_its_keys() {
        let point = |index: usize, sets: &[(&str, i64)]| Point {
            index,
            overrides: sets
                .iter()
                .map(|(k, v)| (k.to_string(), toml::Value::Integer(*v)))
                .collect(),
        };
        let points = [
            point(0, &[("a", 1), ("b", 2)]),
            point(1, &[("a", 1), ("b", 3)]),
            point(2, &[("b", 2), ("a", 1)]),
            point(3, &[("a", 1), ("b", 3)]),
        ];
        assert_eq!(repeated_points(&points), [(2, 0), (3, 1)]);
    }

    #[test]
    fn the_study_page_inlines_only_its_own_plots_and_keeps_multiline_cells() {
        let dir = study_dir("page");
        let secret = dir.join("secret.txt");
        std::fs::write(&secret, "do-not-show").unwrap();
        std::fs::write(
            dir.join("good.svg"),
            "<?xml version=\"1.0\"?>\n<svg>good-plot</svg>",
        )
        .unwrap();
        std::fs::write(dir.join("evil.svg"), "<svg><script>alert(1)</script></svg>").unwrap();
        std::fs::write(dir.join("old.svg"), "<svg>earlier-study</svg>").unwrap();
        let listed = [
            "good.svg",
            "evil.svg",
            "../secret.txt",
            secret.to_str().unwrap(),
            "secret.txt",
        ];
        let meta = serde_json::json!({"name": "s", "plots": listed});
        std::fs::write(dir.join("study.json"), meta.to_string()).unwrap();
        std::fs::write(
            dir.join("results.csv"),
            "point,name\n0,\"two\nlines\"\n1,x\n",
        )
        .unwrap();
        let page = std::fs::read_to_string(write_html(&dir).unwrap()).unwrap();
        assert!(page.contains("good-plot"), "{page}");
        for absent in ["alert(1)", "do-not-show", "earlier-study"] {
            assert!(!page.contains(absent), "{absent}: {page}");
        }
        // The header and two points: the quoted line break stays in its cell.
        assert_eq!(page.matches("<tr>").count(), 3, "{page}");
        // A study listing no plots shows none of the folder's SVGs.
        std::fs::write(dir.join("study.json"), r#"{"name":"s","plots":[]}"#).unwrap();
        let page = std::fs::read_to_string(write_html(&dir).unwrap()).unwrap();
        assert!(!page.contains("good-plot") && !page.contains("earlier-study"));
    }

    fn study_dir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("podsim-study-unit-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("base.toml"), "name = \"x\"\n").unwrap();
        dir
    }

    /// `text` parsed as a study in a folder of its own beside a base config, the folder
    /// removed after.
    fn parse(name: &str, text: &str) -> Result<Study, ConfigErrors> {
        let dir = study_dir(name);
        let parsed = Study::parse(&dir.join("study.toml"), text);
        let _ = std::fs::remove_dir_all(&dir);
        parsed
    }

    fn errors(name: &str, text: &str) -> String {
        match parse(name, text) {
            Ok(_) => panic!("{name}: expected an error"),
            Err(e) => e.to_string(),
        }
    }

    const GOOD: &str = r#"
name = "s"
base = "base.toml"
[sweep]
"topology.wraparound" = [true, false]
job.iterations = [1, 2, 3]
[[points]]
"topology.shape" = "8"
[[points]]
"topology.shape" = "4x4"
"launch.workers" = 2
[metrics]
zeta = "collectives.0.virtual_busbw_gbps"
alpha = "training.step_ms"
[[plot]]
file = "a.svg"
x = "chips"
y = "zeta"
series = "topology.wraparound"
"#;

    #[test]
    fn sweep_times_points_in_order() {
        let s = parse("order", GOOD).unwrap();
        // Keys keep the order written (not toml's sorted order), dotted spellings flattened.
        assert_eq!(
            s.keys(),
            [
                "topology.wraparound",
                "job.iterations",
                "topology.shape",
                "launch.workers"
            ]
        );
        let pts = s.expand();
        assert_eq!(pts.len(), 2 * 3 * 2);
        for (i, expected) in [
            (
                0,
                "topology.wraparound=true job.iterations=1 topology.shape=\"8\"",
            ),
            (
                1,
                "topology.wraparound=true job.iterations=1 topology.shape=\"4x4\" launch.workers=2",
            ),
            (
                2,
                "topology.wraparound=true job.iterations=2 topology.shape=\"8\"",
            ),
            (
                11,
                "topology.wraparound=false job.iterations=3 topology.shape=\"4x4\" launch.workers=2",
            ),
        ] {
            assert_eq!(describe(&pts[i]), expected, "point {i}");
        }
        assert!(pts.iter().enumerate().all(|(i, p)| p.index == i));
        // The point, the swept keys as written, the built-in columns, the metrics as
        // written, the error last.
        let swept = [
            "point",
            "topology.wraparound",
            "job.iterations",
            "topology.shape",
            "launch.workers",
        ];
        let expected: Vec<&str> = swept
            .into_iter()
            .chain(BUILTIN_COLUMNS)
            .chain(["zeta", "alpha", "error"])
            .collect();
        assert_eq!(s.columns(), expected);
    }

    #[test]
    fn no_sweep_and_no_points_is_the_base_alone() {
        let s = parse("single", "base = \"base.toml\"\n").unwrap();
        let pts = s.expand();
        assert_eq!(pts.len(), 1);
        assert!(pts[0].overrides.is_empty());
        assert_eq!(s.out, PathBuf::from("runs/study"));
        let only_points = parse(
            "only-points",
            "base = \"base.toml\"\n[[points]]\nx = 1\n[[points]]\nx = 2\n",
        )
        .unwrap();
        assert_eq!(only_points.expand().len(), 2);
    }

    #[test]
    fn sets_are_toml_literals() {
        let p = Point {
            index: 0,
            overrides: vec![
                ("a".into(), toml::Value::String("q\"\\\n".into())),
                ("b".into(), toml::Value::Float(2.0)),
                (
                    "c".into(),
                    toml::Value::Array(vec![true.into(), false.into()]),
                ),
            ],
        };
        let sets = point_sets(&p, Path::new("out/point-000"));
        assert_eq!(
            sets,
            [
                "a=\"q\\\"\\\\\\n\"",
                "b=2.0",
                "c=[true, false]",
                "output.dir=\"out/point-000\""
            ]
        );
        // What `--set` reads back is the value written.
        let mut t = toml::Table::new();
        config::apply_overrides(&mut t, &sets).unwrap();
        assert_eq!(t["a"], toml::Value::String("q\"\\\n".into()));
        assert_eq!(t["b"], toml::Value::Float(2.0));
        assert_eq!(cell(&t["c"]), "[true, false]");
    }

    #[test]
    fn metric_paths() {
        let r: Json = serde_json::json!({
            "topology": {"chips": 8},
            "collectives": [{"virtual_busbw_gbps": 12.5}, {"op": "all-gather"}],
            "error": null,
            "ok": true,
        });
        assert_eq!(json_cell(lookup(&r, "topology.chips")), "8");
        assert_eq!(
            json_cell(lookup(&r, "collectives.0.virtual_busbw_gbps")),
            "12.5"
        );
        assert_eq!(json_cell(lookup(&r, "collectives.1.op")), "all-gather");
        assert_eq!(json_cell(lookup(&r, "ok")), "true");
        for missing in [
            "collectives.2.op",
            "collectives.x",
            "topology.chips.more",
            "nope",
            "error",
            "collectives.0.virtual_algbw_gbps",
        ] {
            assert_eq!(json_cell(lookup(&r, missing)), "", "{missing}");
        }
        assert_eq!(
            json_cell(lookup(&r, "collectives.1")),
            "{\"op\":\"all-gather\"}"
        );
    }

    #[test]
    fn rows_leave_what_was_not_measured_empty() {
        let s = parse("rows", GOOD).unwrap();
        let p = &s.expand()[1];
        let ok = PointOutcome {
            status: JobStatus::Ok,
            exit_code: Some(0),
            reason: None,
            elapsed: Duration::ZERO,
        };
        let report = serde_json::json!({
            "status": "ok", "error": null, "topology": {"chips": 16, "slices": 1},
            "virtual_s": 0.5, "wall_s": 1.25,
            "workers": [{"peak_rss_bytes": 1048576}, {"peak_rss_bytes": 3145728}],
            "collectives": [{"virtual_busbw_gbps": 99.5}],
        });
        let r = row(&s, p, &ok, Expected::default(), Some(&report));
        assert_eq!(
            r,
            [
                "1", "true", "1", "4x4", "2", "ok", "0", "16", "1", "0.5", "1.25", "3.0", "99.5",
                "", ""
            ]
        );
        let timeout = PointOutcome {
            status: JobStatus::Timeout,
            exit_code: None,
            reason: Some("timed out".into()),
            elapsed: Duration::ZERO,
        };
        let expected = Expected {
            chips: Some(16),
            slices: Some(1),
        };
        let r = row(&s, p, &timeout, expected, None);
        assert_eq!(r.join(","), "1,true,1,4x4,2,timeout,,16,1,,,,,,timed out");
        let failed = serde_json::json!({
            "status": "error", "error": "chip 3 out of HBM", "topology": {"chips": 16, "slices": 1},
            "virtual_s": 0.0, "wall_s": 0.0, "workers": [{"peak_rss_bytes": 0}],
        });
        let err = PointOutcome {
            status: JobStatus::Error,
            exit_code: Some(1),
            reason: None,
            elapsed: Duration::ZERO,
        };
        let r = row(&s, p, &err, expected, Some(&failed));
        assert_eq!(r[5..].join(","), "error,1,16,1,,,,,,chip 3 out of HBM");
    }

    #[test]
    fn status_from_exit_code() {
        let names: Vec<&str> = [Some(0), Some(1), Some(2), Some(3), Some(4), Some(101), None]
            .into_iter()
            .map(|c| JobStatus::from_exit_code(c).name())
            .collect();
        assert_eq!(
            names,
            [
                "ok",
                "error",
                "bad_config",
                "hang",
                "desync",
                "error",
                "error"
            ]
        );
    }

    #[test]
    fn unknown_field_is_named_with_its_line() {
        let e = errors("unknown", "base = \"base.toml\"\nparalel = 2\n");
        assert!(
            e.contains("study.toml:2: paralel: unknown field `paralel`"),
            "{e}"
        );
        let e = errors(
            "unknown-plot",
            "base = \"base.toml\"\n[[plot]]\nfile = \"a.svg\"\nx = \"chips\"\ny = \"wall_s\"\ncolour = \"red\"\n",
        );
        assert!(
            e.contains(":6: plot[0].colour: unknown field `colour`"),
            "{e}"
        );
    }

    #[test]
    fn missing_or_unreadable_base() {
        let e = errors("no-base", "name = \"s\"\n");
        assert!(e.contains("study.toml: base: missing field `base`"), "{e}");
        let e = errors(
            "no-plot-y",
            "base = \"base.toml\"\n[[plot]]\nfile = \"a.svg\"\nx = \"chips\"\n",
        );
        assert!(
            e.contains("study.toml:2: plot[0].y: missing field `y`"),
            "{e}"
        );
        let e = errors("bad-base", "name = \"s\"\nbase = \"nope.toml\"\n");
        assert!(e.contains("study.toml:2: base: "), "{e}");
        assert!(e.contains("nope.toml is not a readable file"), "{e}");
    }

    #[test]
    fn sweep_values_must_be_non_empty_lists() {
        let e = errors(
            "sweep-lists",
            "base = \"base.toml\"\n[sweep]\n\"topology.shape\" = []\njob.iterations = 3\n\"output.dir\" = [\"x\"]\n[[points]]\n\"output.dir\" = \"y\"\n",
        );
        assert!(
            e.contains(":3: sweep.\"topology.shape\": the list of values is empty"),
            "{e}"
        );
        assert!(e.contains(":4: sweep.\"job.iterations\": expected a list of values, found a integer (write [3])"), "{e}");
        assert!(
            e.contains(":5: sweep.\"output.dir\": the study sets"),
            "{e}"
        );
        assert!(
            e.contains(":7: points[0].\"output.dir\": the study sets"),
            "{e}"
        );
        assert!(e.starts_with("4 problems"), "{e}");
    }

    #[test]
    fn plots_must_name_columns() {
        let text = GOOD
            .replace("y = \"zeta\"", "y = \"busbw\"")
            .replace("series = \"topology.wraparound\"", "series = \"wrap\"");
        let e = errors("plot-columns", &text);
        assert!(
            e.contains(
                ":18: plot[0].y: \"busbw\" is not a column (columns: point, topology.wraparound"
            ),
            "{e}"
        );
        assert!(
            e.contains(":19: plot[0].series: \"wrap\" is not a column"),
            "{e}"
        );
        let e = errors(
            "plot-file",
            &GOOD.replace("file = \"a.svg\"", "file = \"../a.png\""),
        );
        assert!(
            e.contains("plot[0].file: \"../a.png\": expected a file name ending in .svg"),
            "{e}"
        );
    }

    #[test]
    fn a_study_of_more_points_than_it_runs_is_refused() {
        let values: Vec<String> = (1..=400).map(|i| i.to_string()).collect();
        let list = values.join(", ");
        let text = format!(
            "base = \"base.toml\"\n[sweep]\njob.iterations = [{list}]\njob.warmup = [{list}]\n"
        );
        let e = errors("huge", &text);
        assert!(
            e.contains("160000 points, more than a study runs (100000)"),
            "{e}"
        );
        let e = errors("wide", "base = \"base.toml\"\nparallel = 99999999999\n");
        assert!(
            e.contains("parallel: 99999999999: must be 1 to 1024"),
            "{e}"
        );
    }

    #[test]
    fn other_bad_fields() {
        let e = errors(
            "others",
            "base = \"base.toml\"\nparallel = 0\ntimeout_s = -1\n[sweep]\nx = [1]\n[[points]]\nx = 2\n[metrics]\nstatus = \"a.b\"\nm = \"a..b\"\n",
        );
        for want in [
            ":2: parallel: 0: must be 1 to 1024",
            ":3: timeout_s: -1: must be a positive",
            ":7: points[0].x: is also swept",
            ":9: metrics.status: a column of that name already exists",
            ":10: metrics.m: \"a..b\" is not a dotted path",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        let e = errors("type", "base = \"base.toml\"\nparallel = \"two\"\n");
        assert!(e.contains(":2: parallel: invalid type"), "{e}");
    }

    #[test]
    fn point_names_sort() {
        assert_eq!(point_name(7, 12), "point-007");
        assert_eq!(point_name(7, 1001), "point-0007");
    }
}
