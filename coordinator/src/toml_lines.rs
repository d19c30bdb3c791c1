//! Where things sit in a TOML file, for errors that name `file:line: field` (job configs and
//! study files both). The `toml` crate gives byte spans for syntax errors only; problems found
//! later (a value out of range, an unknown key) are located by scanning the text's lines for
//! table headers and `key =` assignments, which is exact for the block style podsim's files
//! are written in (one table header or assignment per line).

use std::collections::HashMap;

/// One line of a TOML file: the table it is in and the key it assigns.
struct Line<'a> {
    /// 1-based.
    number: usize,
    /// The table the line is in (`""` before the first header).
    table: &'a str,
    /// For an entry of an array of tables (`[[name]]`), its index.
    entry: Option<usize>,
    /// The line is the table's header.
    header: bool,
    /// The key the line assigns (quotes removed), if it assigns one.
    key: Option<&'a str>,
}

#[cfg(test)]
thread_local! {
    /// Texts read by [`lines`] on this thread, for tests that count them.
    pub(crate) static SCANS: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Every line of `text` with its table.
fn lines(text: &str) -> Vec<Line<'_>> {
    #[cfg(test)]
    SCANS.with(|n| n.set(n.get() + 1));
    let mut out = Vec::new();
    let mut table = "";
    let mut entry = None;
    // Entries seen per array of tables: a map, so that a file of many `[[name]]` headers is
    // read in linear time.
    let mut entries: HashMap<&str, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let header = line.starts_with('[');
        if header {
            let array = line.starts_with("[[");
            table = line
                .trim_start_matches('[')
                .split(']')
                .next()
                .unwrap_or("")
                .trim();
            entry = array.then(|| {
                let seen = entries.entry(table).or_insert(0);
                *seen += 1;
                *seen - 1
            });
        }
        let key = (!header && !line.starts_with('#') && line.contains('=')).then(|| {
            line.split('=')
                .next()
                .unwrap_or("")
                .trim()
                .trim_matches('"')
        });
        out.push(Line {
            number: i + 1,
            table,
            entry,
            header,
            key,
        });
    }
    out
}

/// The lines of a text, for many [`line_at`] lookups in it: each one a binary search, where
/// [`line_at`] reads the text up to the offset.
#[derive(Debug, Clone)]
pub struct Lines(Vec<usize>);

impl Lines {
    pub fn new(text: &str) -> Lines {
        Lines(
            text.bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i)
                .collect(),
        )
    }

    /// The 1-based line of byte `offset`, as [`line_at`] says it.
    pub fn line_at(&self, offset: usize) -> usize {
        self.0.partition_point(|&newline| newline < offset) + 1
    }
}

/// The 1-based line of byte `offset` (a span's start).
pub fn line_at(text: &str, offset: usize) -> usize {
    text.as_bytes()
        .iter()
        .take(offset.min(text.len()))
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// The line of `key` in table `table` (entry `entry` of an array of tables, or any entry when
/// `None`), or of the table's header when the key is not written there (`None` at the top
/// level); the header's line when `key` is `None`. One lookup reads the whole text: to locate
/// many keys of one text, build a [`LineIndex`] once.
pub fn line_of(text: &str, table: &str, entry: Option<usize>, key: Option<&str>) -> Option<usize> {
    LineIndex::new(text).line_of(table, entry, key)
}

/// The first header and the first line of each key of one table (or of one entry of an array
/// of tables).
#[derive(Debug, Default)]
struct Place<'a> {
    header: Option<usize>,
    keys: HashMap<&'a str, usize>,
}

impl<'a> Place<'a> {
    fn note(&mut self, line: &Line<'a>) {
        if line.header {
            self.header.get_or_insert(line.number);
        } else if let Some(k) = line.key {
            self.keys.entry(k).or_insert(line.number);
        }
    }
}

/// Where every table and key of a text sits, read once: [`line_of`] for many lookups in
/// time linear in the text and the lookups (a config with thousands of problems would
/// otherwise read the text once per problem).
#[derive(Debug)]
pub struct LineIndex<'a> {
    /// Per table, over all its entries.
    tables: HashMap<&'a str, Place<'a>>,
    /// Per entry of an array of tables.
    entries: HashMap<(&'a str, usize), Place<'a>>,
}

impl<'a> LineIndex<'a> {
    pub fn new(text: &'a str) -> LineIndex<'a> {
        let mut index = LineIndex {
            tables: HashMap::new(),
            entries: HashMap::new(),
        };
        for line in lines(text) {
            index.tables.entry(line.table).or_default().note(&line);
            if let Some(e) = line.entry {
                index
                    .entries
                    .entry((line.table, e))
                    .or_default()
                    .note(&line);
            }
        }
        index
    }

    /// As [`line_of`] on the indexed text.
    pub fn line_of(&self, table: &str, entry: Option<usize>, key: Option<&str>) -> Option<usize> {
        let place = match entry {
            Some(e) => self.entries.get(&(table, e)),
            None => self.tables.get(table),
        }?;
        match key {
            None => place.header,
            Some(k) => {
                place
                    .keys
                    .get(k)
                    .copied()
                    .or(if table.is_empty() { None } else { place.header })
            }
        }
    }
}

/// The line of byte `offset` and the field written there (`table[i].key`, `table.key`, `key`,
/// or the table itself on its header).
pub fn field_at(text: &str, offset: usize) -> (usize, String) {
    let number = line_at(text, offset);
    let field = lines(text)
        .into_iter()
        .find(|l| l.number == number)
        .map(|l| {
            let table = match l.entry {
                Some(i) => format!("{}[{i}]", l.table),
                None => l.table.to_string(),
            };
            match (table.is_empty(), l.key) {
                (_, None) => table,
                (true, Some(k)) => k.to_string(),
                (false, Some(k)) => format!("{table}.{k}"),
            }
        })
        .unwrap_or_default();
    (number, field)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "name = \"x\"\n[job]\nkind = \"train\"\n[[faults]]\nkind = \"drop\"\n\n[[faults]]\n\"kind\" = \"stall\"\nchip = 3\n";

    #[test]
    fn keys_are_found_in_their_table_and_entry() {
        assert_eq!(line_of(TEXT, "", None, Some("name")), Some(1));
        assert_eq!(line_of(TEXT, "job", None, Some("kind")), Some(3));
        assert_eq!(line_of(TEXT, "faults", Some(1), Some("kind")), Some(8));
        assert_eq!(line_of(TEXT, "faults", Some(0), Some("kind")), Some(5));
        // Not written: the entry's header; the table itself: its header.
        assert_eq!(line_of(TEXT, "faults", Some(0), Some("chip")), Some(4));
        assert_eq!(line_of(TEXT, "faults", Some(1), None), Some(7));
        assert_eq!(line_of(TEXT, "", None, Some("missing")), None);
        assert_eq!(line_of(TEXT, "output", None, Some("dir")), None);
    }

    #[test]
    fn the_index_finds_what_a_scan_finds() {
        let index = LineIndex::new(TEXT);
        for table in ["", "job", "faults", "output"] {
            for entry in [None, Some(0), Some(1), Some(2)] {
                for key in [None, Some("name"), Some("kind"), Some("chip"), Some("x")] {
                    assert_eq!(
                        index.line_of(table, entry, key),
                        line_of(TEXT, table, entry, key),
                        "{table} {entry:?} {key:?}"
                    );
                }
            }
        }
        // Many arrays of tables, each entry its own.
        let many: String = (0..500)
            .map(|i| format!("[[t{}]]\nk = {i}\n", i % 7))
            .collect();
        let index = LineIndex::new(&many);
        assert_eq!(
            index.line_of("t3", Some(2), Some("k")),
            Some(2 * (7 * 2 + 3) + 2)
        );
    }

    #[test]
    fn an_offset_names_its_line_and_field() {
        let at = |needle: &str| TEXT.find(needle).unwrap();
        assert_eq!(field_at(TEXT, at("name")), (1, "name".into()));
        assert_eq!(field_at(TEXT, at("\"train\"")), (3, "job.kind".into()));
        assert_eq!(field_at(TEXT, at("chip")), (9, "faults[1].chip".into()));
        assert_eq!(field_at(TEXT, at("[job]")), (2, "job".into()));
        assert_eq!(line_at(TEXT, 0), 1);
        assert_eq!(line_at(TEXT, TEXT.len() + 10), 10);
    }

    #[test]
    fn indexed_lines_agree_with_reading_up_to_the_offset() {
        let text = "a = 1\n\n[job]\nb = 2\nc";
        let lines = Lines::new(text);
        for offset in 0..=text.len() + 2 {
            assert_eq!(lines.line_at(offset), line_at(text, offset), "{offset}");
        }
    }
}
