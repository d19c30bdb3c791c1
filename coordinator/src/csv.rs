//! CSV as studies write it and comparisons read it: one field quoted when it must be, one
//! line, and the cells of a line back.

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
    fn csv_cells_read_back_what_csv_line_writes() {
        let fields: Vec<String> = ["1", "x,y", "", "say \"hi\"", " edge"]
            .map(String::from)
            .to_vec();
        assert_eq!(csv_cells(csv_line(&fields).trim_end_matches('\n')), fields);
    }
}
