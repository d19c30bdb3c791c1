//! `podsim compare` on published collective timings: a CSV with the columns of
//! `configs/validation/collectives.csv` (recognised by its header) becomes one benchmark per
//! row - the row's hardware, slice torus and slices, its collective over the chips it names,
//! its bytes per chip - run in meta mode on the mirror fabric, and the virtual time of one
//! iteration is set against `measured_us`.
//!
//! The source columns are words from the publications; each is read by a stated rule, and a
//! cell the rule cannot read is an error naming the row and the column:
//! - `topology`: its first word (`16x16 (v6e-256)` is `16x16`); axes of one chip are dropped;
//! - `wraparound`: its first word, `yes`/`true` or `no`/`false` (`n/a`: the torus wraps);
//! - `op`: its first word, `all_gather` or `all-gather` and the like; `ppermute` (JAX) and
//!   `collective_permute` (XLA) are `send-recv`, each chip sending to the next of its group;
//! - `group`: the DCN axis when it says `dcn`; otherwise the chips it counts (`4 chips`,
//!   `all 256 chips`): every ICI axis when that is the whole slice, else the axis of that many
//!   chips (the one it names, `Y axis`, when the name agrees, else the only one), else the
//!   leading axes that hold that many (`x,y`, a 2x2 face, for 4 chips of a 2x2x2 cube);
//! - `bytes_convention`: `input ...` or `output ...` per chip, or per TensorCore device when
//!   it says so (a chip of the preset's `tensorcores_per_chip` devices moves that many times
//!   the bytes; but when the group holds `both TensorCores` of each chip, an all-reduce or
//!   reduce-scatter first sums the chip's devices locally and moves one device's bytes).

use std::path::Path;

use podsim_collectives::{Algo, Comm, DType, OpKind, ReduceOp};
use podsim_topology::{Group, Hardware, HardwareOverrides, Pod, Torus};
use serde::Serialize;

use crate::bench::{BenchPlan, run_in_process};
use crate::compare_rows::{Row, Summary, Table, require_columns, summarise_errors};

/// Columns that mark a file of collective timings (with `id`, the ones a row must have).
pub const COLUMNS: [&str; 11] = [
    "id",
    "hardware",
    "topology",
    "wraparound",
    "slices",
    "op",
    "group",
    "dtype",
    "bytes_per_chip",
    "bytes_convention",
    "measured_us",
];

/// Whether a header is that of a file of collective timings.
pub fn recognises(header: &[String]) -> bool {
    ["op", "measured_us", "bytes_per_chip"]
        .iter()
        .all(|c| header.iter().any(|h| h == c))
}

/// One row's prediction against its measurement.
#[derive(Debug, Clone, Serialize)]
pub struct CollectiveComparison {
    pub id: String,
    pub predicted_us: f64,
    pub measured_us: f64,
    pub error_pct: f64,
    /// The benchmark the row became, as `podsim bench` flags.
    pub bench: String,
}

/// The benchmark a row describes.
struct Case {
    plan: BenchPlan,
    flags: String,
}

fn torus(row: &Row<'_>) -> Result<Torus, String> {
    let word = row.first_word("topology");
    let dims: Vec<&str> = word.split('x').filter(|d| *d != "1").collect();
    let text = if dims.is_empty() {
        "1".to_string()
    } else {
        dims.join("x")
    };
    let torus: Torus = text
        .parse()
        .map_err(|e| row.bad("topology", &format!("not a torus shape: {e}")))?;
    let wrap = match row.first_word("wraparound").as_str() {
        "yes" | "true" | "n/a" => true,
        "no" | "false" => false,
        _ => return Err(row.bad("wraparound", "must start with yes, no or n/a")),
    };
    Ok(torus.set_wrap_all(wrap))
}

/// The first whole number in `text` followed by `word` (`"4 chips"`), if any.
fn count_before(text: &str, word: &str) -> Option<u32> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words.windows(2).find_map(|w| {
        let trim = |s: &'_ str| s.trim_matches(|c: char| !c.is_alphanumeric()).to_string();
        (trim(w[1]) == word)
            .then(|| trim(w[0]).parse().ok())
            .flatten()
    })
}

/// The pod axes a row's `group` names, as `--group` takes them.
fn group_axes(row: &Row<'_>, torus: &Torus) -> Result<String, String> {
    const NAMES: [&str; 3] = ["x", "y", "z"];
    let text = row.get("group").to_ascii_lowercase();
    if text.contains("dcn") {
        return Ok("dcn".into());
    }
    let dims = torus.dims();
    let chips = count_before(&text, "chips")
        .ok_or_else(|| row.bad("group", "says neither dcn nor how many chips"))?;
    if chips == torus.chips() {
        return Ok(NAMES[..dims.len()].join(","));
    }
    // An axis is named as the publication's topology counts them, axes of one chip included
    // (the Z axis of a 4x1x4 is the torus's second).
    let kept: Vec<usize> = (0..)
        .zip(row.first_word("topology").split('x'))
        .filter(|(_, d)| *d != "1")
        .map(|(i, _)| i)
        .collect();
    let named = NAMES
        .iter()
        .position(|n| text.contains(&format!("{n} axis")))
        .and_then(|a| kept.iter().position(|&k| k == a))
        .filter(|&a| dims.get(a) == Some(&chips));
    let matching: Vec<usize> = (0..dims.len()).filter(|&a| dims[a] == chips).collect();
    match (named, matching.as_slice()) {
        (Some(a), _) | (None, &[a]) => Ok(NAMES[a].to_string()),
        (None, &[]) => leading_axes(dims, chips)
            .map(|n| NAMES[..n].join(","))
            .ok_or_else(|| {
                row.bad(
                    "group",
                    &format!("no axis or leading axes of {chips} chips in a {torus} slice"),
                )
            }),
        _ => Err(row.bad(
            "group",
            &format!("several axes of {chips} chips in a {torus} slice and none named"),
        )),
    }
}

/// How many leading axes of `dims` hold exactly `chips` chips together (a 2x2 face of a
/// 2x2x2 cube: two), if any: a group of chips no single axis holds is taken as a sub-torus.
fn leading_axes(dims: &[u32], chips: u32) -> Option<usize> {
    (2..=dims.len()).find(|&n| dims[..n].iter().product::<u32>() == chips)
}

fn case(row: &Row<'_>, overrides: &HardwareOverrides) -> Result<Case, String> {
    let hardware_name = row.first_word("hardware");
    let hardware = Hardware::preset(&hardware_name)
        .map_err(|e| row.bad("hardware", &e.to_string()))?
        .with_overrides(overrides)
        .map_err(|e| format!("--set: {e}"))?;
    let torus = torus(row)?;
    let slices = row
        .get("slices")
        .parse::<u32>()
        .ok()
        .filter(|&s| s >= 1)
        .ok_or_else(|| row.bad("slices", "must be a whole number of at least 1"))?;
    let wrap = torus.wraps(0);
    let shape = torus.to_string();
    let pod = Pod::new(torus.clone(), slices).map_err(|e| row.bad("slices", &e.to_string()))?;
    let op_name = match row.first_word("op").replace('_', "-").as_str() {
        "ppermute" | "collective-permute" => "send-recv".to_string(),
        name => name.to_string(),
    };
    let op = op_name
        .parse::<OpKind>()
        .map_err(|e| row.bad("op", &e.to_string()))?;
    let dtype: DType = row
        .first_word("dtype")
        .parse()
        .map_err(|e: String| row.bad("dtype", &e))?;
    let axes = group_axes(row, &torus)?;
    let group = Group::parse(&axes, &pod).map_err(|e| row.bad("group", &e.to_string()))?;
    let n = u64::from(group.size(&pod));
    if n < 2 {
        return Err(row.bad("group", "a group of one chip has nothing to communicate"));
    }
    let size = collective_bytes(row, op, dtype, n, &hardware)?;
    let flags = format!(
        "--hardware {hardware_name} --topology {shape}{} --slices {slices} --collective {op_name} \
         --group {axes} --dtype {} --sizes {size} --mode meta",
        if wrap { "" } else { " --no-wrap" },
        row.first_word("dtype"),
    );
    let comm = Comm {
        group,
        algo: Algo::Torus,
        dtype,
        verify: false,
        instance: 0,
    };
    Ok(Case {
        plan: BenchPlan::meta_in_process(pod, hardware, op, comm, ReduceOp::Sum, size),
        flags,
    })
}

/// The bytes of the collective a row describes (`podsim bench --sizes`: an all-gather's output,
/// every other collective's input), from its `bytes_per_chip` read by its `bytes_convention`,
/// for a group of `n` chips.
fn collective_bytes(
    row: &Row<'_>,
    op: OpKind,
    dtype: DType,
    n: u64,
    hardware: &Hardware,
) -> Result<u64, String> {
    let convention = row.get("bytes_convention").to_ascii_lowercase();
    let summed_on_chip = matches!(op, OpKind::AllReduce | OpKind::ReduceScatter)
        && row
            .get("group")
            .to_ascii_lowercase()
            .contains("both tensorcores");
    let devices = if !convention.contains("per tensorcore device") || summed_on_chip {
        1.0
    } else {
        hardware.tensorcores_per_chip
    };
    let bytes = row.positive_number("bytes_per_chip")? * devices;
    let input = match (convention.split_whitespace().next(), op) {
        (Some(w), _) if w.starts_with("input") => bytes,
        (Some(w), OpKind::AllGather) if w.starts_with("output") => bytes / n as f64,
        (Some(w), OpKind::ReduceScatter) if w.starts_with("output") => bytes * n as f64,
        (Some(w), _) if w.starts_with("output") => bytes,
        _ => return Err(row.bad("bytes_convention", "must start with input or output")),
    };
    let size = match op {
        OpKind::AllGather => input * n as f64,
        _ => input,
    };
    // Whole elements only: a fraction was rounded away without a word (32768.9 bytes ran as
    // 32768, 3 bytes of bf16 as 2).
    let element = dtype.size() as f64;
    if (input / element).fract() != 0.0 {
        return Err(row.bad(
            "bytes_per_chip",
            &format!(
                "makes {input} bytes a chip, not a whole number of {}-byte {} elements",
                dtype.size(),
                row.first_word("dtype")
            ),
        ));
    }
    // At least one element a chip; at most what `podsim bench --sizes` takes, 10^15 bytes.
    if input < element || size > 1e15 {
        return Err(row.bad(
            "bytes_per_chip",
            &format!(
                "makes a collective of {input:e} bytes a chip, {size:e} in all: from one \
                 element a chip to 1e15 bytes in all"
            ),
        ));
    }
    Ok(size as u64)
}

/// Predicts every row of a file of collective timings whose header is `header` (stops at the
/// first row it cannot express).
pub(crate) fn compare_rows(
    path: &Path,
    table: &Table,
    overrides: &HardwareOverrides,
) -> Result<Vec<CollectiveComparison>, String> {
    require_columns(path, &table.header, &COLUMNS, &[])?;
    let mut out = Vec::new();
    for row in table.rows() {
        let at = |e: String| format!("{}: {e}", path.display());
        // A nanosecond to eleven days.
        let measured = row
            .measured("measured_us", (1e-3, 1e12), "us")
            .map_err(at)?;
        let case = case(&row, overrides).map_err(at)?;
        let (rows, _) = run_in_process(&case.plan, |_| {})
            .map_err(|e| at(format!("row {} ({}): {e}", row.line, row.get("id"))))?;
        let predicted = rows.first().map_or(0.0, |r| r.virtual_s * 1e6);
        out.push(CollectiveComparison {
            id: row.get("id").to_string(),
            predicted_us: predicted,
            measured_us: measured,
            error_pct: (predicted / measured - 1.0) * 100.0,
            bench: case.flags,
        });
    }
    Ok(out)
}

/// The whole file's agreement.
pub fn summarise(rows: &[CollectiveComparison]) -> Summary {
    summarise_errors(rows.iter().map(|r| (r.id.as_str(), r.error_pct)), 0)
}

/// The table `podsim compare` prints.
pub fn table(rows: &[CollectiveComparison], s: &Summary) -> String {
    let id = rows.iter().map(|r| r.id.len()).max().unwrap_or(0).max(8);
    let mut out = format!(
        "{:<id$} {:>13} {:>12} {:>8}\n",
        "id", "predicted us", "measured us", "error"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<id$} {:>13.2} {:>12.2} {:>+7.1}%\n",
            r.id, r.predicted_us, r.measured_us, r.error_pct
        ));
    }
    out.push_str(&format!(
        "{} rows: median |error| {:.1}%, largest {:.1}% ({})\n\
         Each row ran as `podsim bench --iters 1 --warmup 0` with the flags `--json` gives.\n",
        s.rows, s.median_abs_error_pct, s.max_abs_error_pct, s.worst
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Vec<String> {
        COLUMNS.iter().map(|c| c.to_string()).collect()
    }

    fn row<'a>(header: &'a [String], cells: &[&str]) -> Row<'a> {
        Row {
            line: 3,
            header,
            cells: cells.iter().map(|c| c.to_string()).collect(),
        }
    }

    const GOOD: [&str; 11] = [
        "r",
        "v5e",
        "4x8 (mesh {X:8,Y:4}, 32 chips)",
        "no (no axis of 16)",
        "1",
        "all_gather",
        "Y axis (4 chips, linear chain)",
        "bf16",
        "8388608",
        "input shard per chip",
        "680",
    ];

    #[test]
    fn a_named_axis_is_the_one_of_that_many_chips() {
        let h = header();
        let r = row(&h, &GOOD);
        let t = torus(&r).unwrap();
        assert!(!t.wraps(0));
        assert_eq!(group_axes(&r, &t).unwrap(), "x");
        let c = case(&r, &HardwareOverrides::default()).unwrap();
        // An all-gather's size is its output: four inputs.
        assert_eq!(c.plan.sizes, [4 * 8_388_608]);
    }

    #[test]
    fn the_whole_slice_and_dcn_and_tensorcores() {
        let h = header();
        let mut cells = GOOD;
        cells[1] = "tpu7x";
        cells[2] = "2x2x1";
        cells[6] = "4 devices, one TensorCore on each of 4 chips";
        cells[9] = "input per TensorCore device";
        let r = row(&h, &cells);
        let t = torus(&r).unwrap();
        assert_eq!(t.dims(), &[2, 2]);
        assert_eq!(group_axes(&r, &t).unwrap(), "x,y");
        let c = case(&r, &HardwareOverrides::default()).unwrap();
        assert_eq!(
            c.plan.sizes,
            [2 * 4 * 8_388_608],
            "two TensorCores per chip"
        );
        // Both of a chip's TensorCores in one all-reduce: summed on the chip, then one
        // device's bytes cross the links; an all-gather still brings the chip two outputs.
        cells[6] = "8 devices, both TensorCores of all 4 chips";
        for (op, size) in [("all_reduce", 8_388_608), ("all_gather", 8 * 8_388_608)] {
            cells[5] = op;
            let c = case(&row(&h, &cells), &HardwareOverrides::default()).unwrap();
            assert_eq!(c.plan.sizes, [size], "{op}");
        }
        cells[5] = "all_gather";
        cells[6] = "'dcn' axis: one chip per slice";
        cells[4] = "2";
        let r = row(&h, &cells);
        assert_eq!(group_axes(&r, &torus(&r).unwrap()).unwrap(), "dcn");
    }

    #[test]
    fn chips_no_axis_holds_are_the_leading_axes_that_do() {
        let h = header();
        let mut cells = GOOD;
        cells[6] = "4 devices, one TensorCore on each of 4 chips";
        let axes = |cells: &[&str; 11]| {
            let r = row(&h, cells);
            group_axes(&r, &torus(&r).unwrap())
        };
        cells[2] = "2x2x2";
        assert_eq!(axes(&cells).unwrap(), "x,y", "a 2x2 face of the cube");
        cells[2] = "4x4x4";
        cells[6] = "8 chips";
        let err = axes(&cells).unwrap_err();
        assert!(err.contains("no axis or leading axes of 8 chips"), "{err}");
        cells[2] = "4x4";
        cells[6] = "4 chips";
        let err = axes(&cells).unwrap_err();
        assert!(err.contains("several axes of 4 chips"), "{err}");
        // Named as the publication counts axes, one of one chip among them.
        cells[2] = "4x1x4";
        cells[6] = "Z axis (4 chips)";
        assert_eq!(
            axes(&cells).unwrap(),
            "y",
            "the torus drops the axis of one chip"
        );
        cells[6] = "X axis (4 chips)";
        assert_eq!(axes(&cells).unwrap(), "x");
    }

    #[test]
    fn a_permute_by_its_jax_or_xla_name_is_a_send_to_the_next_chip() {
        let h = header();
        for name in ["ppermute", "collective_permute", "send-recv"] {
            let mut cells = GOOD;
            cells[5] = name;
            let case = case(&row(&h, &cells), &HardwareOverrides::default()).unwrap();
            assert!(
                case.flags.contains("--collective send-recv --group x"),
                "{name}: {}",
                case.flags
            );
        }
    }

    #[test]
    fn a_row_podsim_cannot_express_names_its_row_and_column() {
        let h = header();
        let cases = [
            (1, "h100", "column hardware"),
            (2, "bagel", "column topology"),
            (3, "maybe", "column wraparound"),
            (4, "0", "column slices"),
            (5, "all_shuffle", "column op"),
            (6, "16 chips", "column group"),
            (6, "the whole thing", "column group"),
            (7, "fp8", "column dtype"),
            (8, "-5", "column bytes_per_chip"),
            // Past what a collective is (the size overflowed into a panic), and below an element.
            (8, "1e30", "column bytes_per_chip"),
            (8, "1", "column bytes_per_chip"),
            // Not whole elements of bf16 (the size was rounded without a word).
            (8, "32768.9", "column bytes_per_chip"),
            (8, "3", "column bytes_per_chip"),
            (9, "total", "column bytes_convention"),
        ];
        for (column, value, want) in cases {
            let mut cells = GOOD;
            cells[column] = value;
            let err = match case(&row(&h, &cells), &HardwareOverrides::default()) {
                Err(e) => e,
                Ok(_) => panic!("{value:?} in column {column} was accepted"),
            };
            assert!(err.contains("row 3 (r)") && err.contains(want), "{err}");
        }
        for absurd in ["NaN", "1e-300", "1e300", "-680"] {
            let mut cells = GOOD;
            cells[10] = absurd;
            let err = row(&h, &cells)
                .measured("measured_us", (1e-3, 1e12), "us")
                .unwrap_err();
            assert!(err.contains("column measured_us"), "{err}");
        }
    }
}
