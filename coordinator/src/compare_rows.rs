//! A compared file's rows by column name and the summary of their errors, shared by the
//! comparison of training runs (`compare`) and of collective timings (`compare_collectives`).

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::csv::{csv_cells, csv_records};
use crate::outdir::read_text;

/// The largest file `podsim compare` reads: thousands of times its tables' size.
const MOST_BYTES: u64 = 16 << 20;

/// A compared file, read and checked: its header (each name once) and its rows (each with one
/// cell per column, each `id` once). Blank lines and lines starting with `#` are comments.
#[derive(Debug)]
pub(crate) struct Table {
    pub header: Vec<String>,
    /// (line number, cells) of each row.
    pub rows: Vec<(usize, Vec<String>)>,
}

impl Table {
    /// Reads and checks `path`; every problem names the file and, where there is one, the row.
    pub(crate) fn read(path: &Path) -> Result<Table, String> {
        let at = |why: String| format!("{}: {why}", path.display());
        let text = read_text(path, MOST_BYTES).map_err(at)?;
        // A spreadsheet's UTF-8 export starts with a byte-order mark, which would make the
        // first column `\u{feff}id` and the file "missing column id".
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let mut lines = csv_records(text, true).into_iter();
        let (_, first) = lines.next().ok_or_else(|| at("empty file".into()))?;
        let header: Vec<String> = csv_cells(&first)
            .into_iter()
            .map(|c| c.trim().to_string())
            .collect();
        let mut seen = HashMap::new();
        for (i, name) in header.iter().enumerate() {
            if let Some(before) = seen.insert(name.as_str(), i) {
                return Err(at(format!(
                    "column {name:?} appears twice in the header (columns {} and {})",
                    before + 1,
                    i + 1
                )));
            }
        }
        let mut rows = Vec::new();
        for (line, raw) in lines {
            let cells = csv_cells(&raw);
            // A quote left open swallows the rest of the file into one cell.
            if raw.matches('"').count() % 2 == 1 {
                let column = header.get(cells.len() - 1).map_or("?", String::as_str);
                return Err(at(format!(
                    "row {line}, column {column}: a quote opened there is never closed"
                )));
            }
            if cells.len() != header.len() {
                return Err(at(cell_count_error(line, cells.len(), &header)));
            }
            rows.push((line, cells));
        }
        let id = header.iter().position(|h| h == "id");
        let mut ids: HashMap<&str, usize> = HashMap::new();
        for (line, cells) in &rows {
            let Some(id) = id.map(|i| cells[i].trim()) else {
                continue;
            };
            if let Some(first) = ids.insert(id, *line) {
                return Err(at(format!(
                    "row {line}: id {id:?} is also row {first}'s (each row needs its own)"
                )));
            }
        }
        if rows.is_empty() {
            return Err(at("no rows".into()));
        }
        Ok(Table { header, rows })
    }

    /// Its rows by column name.
    pub(crate) fn rows(&self) -> impl Iterator<Item = Row<'_>> {
        self.rows.iter().map(|(line, cells)| Row {
            line: *line,
            header: &self.header,
            cells: cells.clone(),
        })
    }
}

/// Why a row's cells do not match the header: the row, both counts, and the first column left
/// without a cell when there are too few.
fn cell_count_error(line: usize, cells: usize, header: &[String]) -> String {
    let detail = match header.get(cells) {
        Some(column) => format!("no cell for column {column} or those after it"),
        None => format!("{} more than there are columns", cells - header.len()),
    };
    format!(
        "row {line} has {cells} cells, the header {}: {detail}",
        header.len()
    )
}

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

    /// A measured time in `lo..=hi` of `unit` (a time outside that was not measured: a typo
    /// or a unit mixed up, whose error would print as a number of hundreds of digits).
    pub(crate) fn measured(
        &self,
        column: &str,
        (lo, hi): (f64, f64),
        unit: &str,
    ) -> Result<f64, String> {
        match self.get(column).parse::<f64>() {
            Ok(v) if (lo..=hi).contains(&v) => Ok(v),
            _ => Err(self.bad(
                column,
                &format!("must be a time from {lo:e} to {hi:e} {unit}"),
            )),
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
/// Checks a header against the columns a kind of file reads: every `required` one present,
/// and no other column so close to one it reads (`required` or `optional`) that it must be a
/// misspelling - such a column would be ignored, and its rows run without what it says.
/// Columns far from all of them (`note`, `source`) are the file's own and left alone.
pub(crate) fn require_columns(
    path: &Path,
    header: &[String],
    required: &[&str],
    optional: &[&str],
) -> Result<(), String> {
    let missing: Vec<&str> = required
        .iter()
        .filter(|c| !header.iter().any(|h| h == *c))
        .copied()
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{}: missing column{} {}",
            path.display(),
            if missing.len() > 1 { "s" } else { "" },
            missing.join(", ")
        ));
    }
    let read: Vec<&str> = required.iter().chain(optional).copied().collect();
    for name in header.iter().filter(|h| !read.contains(&h.as_str())) {
        if let Some(meant) = read.iter().find(|c| misspelt(name, c)) {
            return Err(format!(
                "{}: column {name:?} is not one podsim reads: did you mean {meant}? (as it is, \
                 it would be ignored)",
                path.display()
            ));
        }
    }
    Ok(())
}

/// Whether `name` reads as a misspelling of `column`: the same but for case and separators
/// (`Weight-Dtype`), or at most two edits away (one for names of four letters or fewer).
fn misspelt(name: &str, column: &str) -> bool {
    let plain = |s: &str| -> String {
        s.chars()
            .filter(|c| c.is_alphanumeric())
            .flat_map(char::to_lowercase)
            .collect()
    };
    let (a, b) = (plain(name), plain(column));
    let most = if b.len() <= 4 { 1 } else { 2 };
    a == b || edit_distance(&a, &b) <= most
}

/// Levenshtein distance between two short strings.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `Table::read` of a file holding `text`, or its error.
    fn read(name: &str, text: &[u8]) -> Result<Table, String> {
        let dir = std::env::temp_dir().join(format!("podsim-table-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.csv");
        std::fs::write(&path, text).unwrap();
        let got = Table::read(&path);
        std::fs::remove_dir_all(&dir).unwrap();
        got
    }

    #[test]
    fn a_good_file_reads_with_its_comments_blank_lines_and_quoted_commas() {
        let t = read("good", b"# a note\nid,a,b\n\nr1,1,\"x, y\"\r\nr2,2,z\n").unwrap();
        assert_eq!(t.header, ["id", "a", "b"]);
        let rows: Vec<_> = t.rows().map(|r| (r.line, r.get("b").to_string())).collect();
        assert_eq!(rows, [(4, "x, y".to_string()), (5, "z".to_string())]);
        let marked = read("bom", b"\xef\xbb\xbfid,a\nr,1\n").unwrap();
        assert_eq!(marked.header, ["id", "a"]);
        // A quoted cell over two lines (a spreadsheet's note), and lone-CR line ends.
        let t = read("multiline", b"id,note,a\nr1,\"two\nlines\",1\nr2,x,2\n").unwrap();
        let rows: Vec<_> = t.rows().map(|r| (r.line, r.get("a").to_string())).collect();
        assert_eq!(rows, [(2, "1".to_string()), (4, "2".to_string())]);
        let old_mac = read("cr", b"id,a\rr,1\rs,2\r").unwrap();
        assert_eq!(old_mac.rows.len(), 2);
    }

    #[test]
    fn a_misspelt_column_is_refused_and_a_files_own_is_kept() {
        let header = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let check = |names: &[&str]| {
            require_columns(
                Path::new("t.csv"),
                &header(names),
                &["id", "seq"],
                &["weight_dtype"],
            )
        };
        assert!(
            check(&[
                "id",
                "seq",
                "weight_dtype",
                "note",
                "source",
                "measured_tokens"
            ])
            .is_ok()
        );
        for (bad, meant) in [
            ("weight_dtyp", "weight_dtype"),
            ("Weight-DType", "weight_dtype"),
            ("sq", "seq"),
        ] {
            let err = check(&["id", "seq", bad]).unwrap_err();
            assert!(
                err.contains(&format!("{bad:?}")) && err.contains(meant),
                "{err}"
            );
        }
        assert!(check(&["id"]).unwrap_err().contains("missing column seq"));
    }

    #[test]
    fn every_malformed_table_is_refused_naming_where() {
        let cases: [(&str, &[u8], &str); 8] = [
            (
                "dup-column",
                b"id,a,a\nr,1,2\n",
                "column \"a\" appears twice",
            ),
            (
                "extra",
                b"id,a\nr,1,2\n",
                "row 2 has 3 cells, the header 2: 1 more",
            ),
            (
                "fewer",
                b"id,a,b,c\nr,1\n",
                "row 2 has 2 cells, the header 4: no cell for column b",
            ),
            (
                "quote",
                b"id,a,b\nr,\"1,2\n",
                "row 2, column a: a quote opened there is never closed",
            ),
            (
                "dup-id",
                b"id,a\nr,1\ns,2\nr,3\n",
                "row 4: id \"r\" is also row 2's",
            ),
            ("empty", b"# only a comment\n\n", "empty file"),
            ("header", b"id,a\n", "no rows"),
            (
                "binary",
                b"id,a\n\xff\xfe,1\n",
                "not UTF-8 text: line 2, column 1",
            ),
        ];
        for (name, text, want) in cases {
            let err = read(name, text).unwrap_err();
            assert!(
                err.contains("t.csv: ") && err.contains(want),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn a_directory_a_device_or_a_huge_file_is_not_read() {
        let dir = std::env::temp_dir().join(format!("podsim-table-{}-huge", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let huge = dir.join("huge.csv");
        // Sparse: its length says more than the bound, and nothing is written.
        std::fs::File::create(&huge)
            .unwrap()
            .set_len(MOST_BYTES + 1)
            .unwrap();
        let errors = [
            Table::read(&dir).unwrap_err(),
            Table::read(Path::new("/dev/zero")).unwrap_err(),
            Table::read(&huge).unwrap_err(),
            Table::read(&dir.join("absent.csv")).unwrap_err(),
        ];
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(errors[0].ends_with("not a file"), "{}", errors[0]);
        assert!(errors[1].ends_with("not a file"), "{}", errors[1]);
        assert!(errors[2].contains("larger than 16384 KiB"), "{}", errors[2]);
        assert!(
            errors[3].contains("absent.csv: cannot read it"),
            "{}",
            errors[3]
        );
    }
}
