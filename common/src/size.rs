//! Human sizes such as `512G`, `2T`, `4MiB`, `1.5G` (binary multiples).

/// Parses a size: a number (decimal point allowed) and an optional unit
/// `K`, `M`, `G`, `T`, `P` (optionally followed by `i`, `B` or `iB`, any
/// case). Units are powers of 1024; a bare number is bytes.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("invalid size {s:?}: expected a number such as 512G"));
    }
    let unit = unit.trim().to_ascii_lowercase();
    let unit = unit.trim_end_matches('b').trim_end_matches('i');
    let mult: u64 = match unit {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        "p" => 1 << 50,
        _ => return Err(format!("invalid size {s:?}: unknown unit (use K, M, G, T or P)")),
    };
    let value: f64 = num.parse().map_err(|_| format!("invalid size {s:?}: bad number"))?;
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("invalid size {s:?}: too large"));
    }
    Ok(bytes as u64)
}

/// Formats bytes with a binary unit and one decimal: `1.5 GiB`.
pub fn format_size(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_size("512G").unwrap(), 512 << 30);
        assert_eq!(parse_size("2T").unwrap(), 2 << 40);
        assert_eq!(parse_size("4MiB").unwrap(), 4 << 20);
        assert_eq!(parse_size("1.5g").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size(" 64 KB ").unwrap(), 64 << 10);
        assert!(parse_size("").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("G").is_err());
        assert!(parse_size("99999999999P").is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
    }
}
