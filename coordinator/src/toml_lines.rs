//! Where things sit in a TOML file, for errors that name `file:line: field` (job configs and
//! study files both). The `toml` crate gives byte spans for syntax errors only; problems found
//! later (a value out of range, an unknown key) are located by scanning the text's lines for
//! table headers and `key =` assignments, which is exact for the block style podsim's files
//! are written in (one table header or assignment per line).

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

/// Every line of `text` with its table.
fn lines(text: &str) -> Vec<Line<'_>> {
    let mut out = Vec::new();
    let mut table = "";
    let mut entry = None;
    let mut entries: Vec<(&str, usize)> = Vec::new();
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
            entry = array.then(|| match entries.iter_mut().find(|(n, _)| *n == table) {
                Some((_, seen)) => {
                    *seen += 1;
                    *seen - 1
                }
                None => {
                    entries.push((table, 1));
                    0
                }
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
/// level); the header's line when `key` is `None`.
pub fn line_of(text: &str, table: &str, entry: Option<usize>, key: Option<&str>) -> Option<usize> {
    let mut header = None;
    for line in lines(text) {
        if line.table != table || entry.is_some_and(|e| line.entry != Some(e)) {
            continue;
        }
        if line.header {
            header.get_or_insert(line.number);
            if key.is_none() {
                return header;
            }
        } else if key.is_some() && line.key == key {
            return Some(line.number);
        }
    }
    if table.is_empty() { None } else { header }
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
    fn an_offset_names_its_line_and_field() {
        let at = |needle: &str| TEXT.find(needle).unwrap();
        assert_eq!(field_at(TEXT, at("name")), (1, "name".into()));
        assert_eq!(field_at(TEXT, at("\"train\"")), (3, "job.kind".into()));
        assert_eq!(field_at(TEXT, at("chip")), (9, "faults[1].chip".into()));
        assert_eq!(field_at(TEXT, at("[job]")), (2, "job".into()));
        assert_eq!(line_at(TEXT, 0), 1);
        assert_eq!(line_at(TEXT, TEXT.len() + 10), 10);
    }
}
