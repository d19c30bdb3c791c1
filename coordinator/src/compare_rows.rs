//! A compared file's rows by column name and the summary of their errors, shared by the
//! comparison of training runs (`compare`) and of collective timings (`compare_collectives`).

use std::path::Path;

use serde::Serialize;

/// The whole file's agreement.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub rows: usize,
    pub median_abs_error_pct: f64,
    pub max_abs_error_pct: f64,
    pub worst: String,
    pub out_of_memory: usize,
}

/// A row of a compared file by column name; every problem names the row and the column.
#[derive(Debug)]
pub(crate) struct Row<'a> {
    pub line: usize,
    pub header: &'a [String],
    pub cells: Vec<String>,
}

impl Row<'_> {
    /// The cell of a required column (every row has one: the header was checked).
    pub(crate) fn get(&self, column: &str) -> &str {
        self.optional(column).unwrap_or("")
    }

    /// The cell of a column the file may lack; `None` also for an empty cell.
    pub(crate) fn optional(&self, column: &str) -> Option<&str> {
        let i = self.header.iter().position(|h| h == column)?;
        self.cells
            .get(i)
            .map(|c| c.trim())
            .filter(|c| !c.is_empty())
    }

    pub(crate) fn bad(&self, column: &str, why: &str) -> String {
        format!(
            "row {} ({}), column {column}: {why} (got {:?})",
            self.line,
            self.get("id"),
            self.get(column)
        )
    }

    pub(crate) fn number<T: std::str::FromStr>(&self, column: &str) -> Result<T, String> {
        self.get(column)
            .parse()
            .map_err(|_| self.bad(column, "not a valid number"))
    }

    /// The first word of a cell, in lower case (words from a source may follow it).
    pub(crate) fn first_word(&self, column: &str) -> String {
        self.get(column)
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_ascii_lowercase()
    }

    /// A cell that must be a positive, finite number.
    pub(crate) fn positive_number(&self, column: &str) -> Result<f64, String> {
        match self.get(column).parse::<f64>() {
            Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
            _ => Err(self.bad(column, "must be a positive number")),
        }
    }

    pub(crate) fn positive(&self, column: &str) -> Result<u64, String> {
        match self.number::<u64>(column)? {
            0 => Err(self.bad(column, "must be at least 1")),
            v => Ok(v),
        }
    }
}

/// Every column of `required` is in `header`, or an error naming the missing ones.
pub(crate) fn require_columns(
    path: &Path,
    header: &[String],
    required: &[&str],
) -> Result<(), String> {
    let missing: Vec<&str> = required
        .iter()
        .filter(|c| !header.iter().any(|h| h == *c))
        .copied()
        .collect();
    match missing.len() {
        0 => Ok(()),
        n => Err(format!(
            "{}: missing column{} {}",
            path.display(),
            if n > 1 { "s" } else { "" },
            missing.join(", ")
        )),
    }
}

/// Median and largest |error| of `(id, error %)` pairs.
pub fn summarise_errors<'a>(
    rows: impl Iterator<Item = (&'a str, f64)>,
    out_of_memory: usize,
) -> Summary {
    let rows: Vec<(&str, f64)> = rows.collect();
    let mut errors: Vec<f64> = rows.iter().map(|(_, e)| e.abs()).collect();
    errors.sort_by(f64::total_cmp);
    let n = errors.len();
    let median = match n {
        0 => 0.0,
        _ if n % 2 == 1 => errors[n / 2],
        _ => (errors[n / 2 - 1] + errors[n / 2]) / 2.0,
    };
    let worst = rows
        .iter()
        .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
        .map_or(String::new(), |(id, _)| id.to_string());
    Summary {
        rows: n,
        median_abs_error_pct: median,
        max_abs_error_pct: errors.last().copied().unwrap_or(0.0),
        worst,
        out_of_memory,
    }
}
