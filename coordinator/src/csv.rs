//! CSV as studies write it and comparisons read it: one field quoted when it must be, one
//! line, the records of a text (a quoted cell may hold line breaks), and the cells of a record
//! back.

/// One CSV field, quoted when it holds a comma, a quote, a line break or edge spaces.
pub fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r'])
        || s.starts_with(char::is_whitespace)
        || s.ends_with(char::is_whitespace)
    {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// The cells of one CSV line as [`csv_line`] writes them (double-quoted cells may hold commas
/// and `""`).
pub fn csv_cells(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cell = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cell)),
            (c, _) => cell.push(c),
        }
    }
    out.push(cell);
    out
}

/// The records of a CSV text, each with the line it starts on (from 1): a record whose quotes
/// leave one open goes on over the next line, as a quoted cell may hold line breaks (the last
/// record keeps its quote open when nothing closes it: its odd count of `"` tells). Lines end
/// with `\n`, `\r\n`, or a lone `\r` (old spreadsheets). With `comments`, blank lines and lines
/// starting with `#` between records are skipped.
pub fn csv_records(text: &str, comments: bool) -> Vec<(usize, String)> {
    let text = match text.contains('\n') {
        true => std::borrow::Cow::Borrowed(text),
        false => std::borrow::Cow::Owned(text.replace('\r', "\n")),
    };
    let mut records = Vec::new();
    let mut open: Option<(usize, String)> = None;
    for (i, line) in text.lines().enumerate() {
        match open.take() {
            Some((start, mut record)) => {
                record.push('\n');
                record.push_str(line);
                open = Some((start, record));
            }
            None if comments && (line.trim().is_empty() || line.starts_with('#')) => continue,
            None => open = Some((i + 1, line.to_string())),
        }
        if let Some((_, record)) = &open
            && record.matches('"').count() % 2 == 0
        {
            records.extend(open.take());
        }
    }
    records.extend(open);
    records
}

pub fn csv_line(fields: &[String]) -> String {
    let mut line = fields
        .iter()
        .map(|f| csv_field(f))
        .collect::<Vec<_>>()
        .join(",");
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quoting() {
        assert_eq!(csv_field("plain"), "plain");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_field("two\nlines"), "\"two\nlines\"");
        assert_eq!(csv_field(" edge"), "\" edge\"");
        assert_eq!(csv_field(""), "");
        assert_eq!(
            csv_line(&["1".into(), "x,y".into(), String::new()]),
            "1,\"x,y\",\n"
        );
    }

    #[test]
    fn a_quoted_line_break_stays_in_its_record() {
        let text = "id,note\n# a comment\n\nr1,\"two\nlines\"\nr2,\"open\n";
        let records = csv_records(text, true);
        let starts: Vec<usize> = records.iter().map(|r| r.0).collect();
        assert_eq!(starts, [1, 4, 6]);
        assert_eq!(csv_cells(&records[1].1), ["r1", "two\nlines"]);
        // Never closed: the last record keeps its odd quote for the reader to name.
        assert_eq!(records[2].1.matches('"').count(), 1);
        // Without comments, a `#` line is a record; a lone `\r` ends lines.
        assert_eq!(csv_records("#a,b\n", false).len(), 1);
        assert_eq!(csv_records("a,b\r1,2\r", false).len(), 2);
    }

    #[test]
    fn csv_cells_read_back_what_csv_line_writes() {
        let fields: Vec<String> = ["1", "x,y", "", "say \"hi\"", " edge"]
            .map(String::from)
            .to_vec();
        assert_eq!(csv_cells(csv_line(&fields).trim_end_matches('\n')), fields);
    }
}
