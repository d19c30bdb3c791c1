//! Parsing and printing of byte sizes (`4KiB`, `16MiB`, `1GiB`, `4K`, `1000`) and size lists
//! (`A:B` for powers of two from A to B, or `a,b,c`).

/// Parses one size; binary units (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`) and decimal ones
/// (`KB`, `MB`, `GB`); a bare number is bytes.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("size {text:?}: expected a number and a unit like 16MiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        other => {
            return Err(format!(
                "size {text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
            ));
        }
    };
    let bytes = value * mult;
    if !(0.0..=1e15).contains(&bytes) {
        return Err(format!("size {text:?} is out of range"));
    }
    Ok(bytes.round() as u64)
}

/// Parses `A:B` (every power of two from A to B; A is rounded up to one) or `a,b,c`.
pub fn parse_sizes(text: &str) -> Result<Vec<u64>, String> {
    if let Some((a, b)) = text.split_once(':') {
        let (lo, hi) = (parse_size(a)?, parse_size(b)?);
        if lo == 0 || lo > hi {
            return Err(format!("size range {text:?}: need 0 < A <= B"));
        }
        let mut v = Vec::new();
        let mut s = lo.next_power_of_two();
        while s <= hi {
            v.push(s);
            s *= 2;
        }
        if v.is_empty() {
            return Err(format!("size range {text:?} holds no power of two"));
        }
        Ok(v)
    } else {
        text.split(',')
            .map(|one| match parse_size(one)? {
                // It ran as one element, whatever the table then said it moved.
                0 => Err(format!(
                    "size {one:?}: a collective moves at least one byte"
                )),
                n => Ok(n),
            })
            .collect()
    }
}

/// `1.5 KiB`-style rendering for tables.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4KiB").unwrap(), 4096);
        assert_eq!(parse_size("1 MB").unwrap(), 1_000_000);
        assert_eq!(parse_size("7").unwrap(), 7);
        assert!(parse_size("4 parsecs").is_err());
        assert_eq!(parse_sizes("4KiB:16KiB").unwrap(), vec![4096, 8192, 16384]);
        assert_eq!(parse_sizes("1K,3K").unwrap(), vec![1024, 3072]);
        assert!(parse_sizes("16K:4K").is_err());
        assert_eq!(format_size(16 << 20), "16 MiB");
    }
}
