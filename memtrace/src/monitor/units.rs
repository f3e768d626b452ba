//! Byte sizes and rates: parsing (`10MiB`, `512k`, `1.5G`) and human
//! formatting (`1.2MiB`, `+42.0MiB/h`). Sizes use binary multiples.

/// Parses a size such as `4096`, `64k`, `10MiB`, `1.5GB` into bytes.
///
/// `k`/`KB`/`KiB` all mean 1024, like the kernel's `kB`.
pub fn parse_size(text: &str) -> Result<f64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("invalid size '{text}' (examples: 4096, 64k, 10MiB, 1.5G)"))?;
    let multiplier = unit_multiplier(unit.trim())
        .ok_or_else(|| format!("invalid size unit in '{text}' (use B, k, M, G, T)"))?;
    if value < 0.0 || !value.is_finite() {
        return Err(format!("invalid size '{text}': must be a positive number"));
    }
    Ok(value * multiplier)
}

/// Bytes per unit (`kB`, `MiB`, `G`...), case-insensitive; `None` if unknown.
pub fn unit_multiplier(unit: &str) -> Option<f64> {
    let lower = unit.to_ascii_lowercase();
    let m = match lower.as_str() {
        "" | "b" | "byte" | "bytes" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" | "tib" => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    };
    Some(m)
}

/// Formats bytes without spaces (`512B`, `1.5KiB`, `-2.0MiB`).
pub fn format_bytes(value: f64) -> String {
    let sign = if value < 0.0 { "-" } else { "" };
    let mut v = value.abs();
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut idx = 0;
    while v >= 1024.0 && idx + 1 < units.len() {
        v /= 1024.0;
        idx += 1;
    }
    if idx == 0 {
        format!("{sign}{v:.0}{}", units[idx])
    } else {
        format!("{sign}{v:.1}{}", units[idx])
    }
}

/// Formats a value of the given unit kind.
pub fn format_value(value: f64, bytes: bool) -> String {
    if bytes {
        format_bytes(value)
    } else if value.fract() == 0.0 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// Formats a signed rate per hour (`+1.0MiB/h`, `-3/h`).
pub fn format_rate(per_hour: f64, bytes: bool) -> String {
    let sign = if per_hour > 0.0 { "+" } else { "" };
    format!("{sign}{}/h", format_value(per_hour, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096"), Ok(4096.0));
        assert_eq!(parse_size("64k"), Ok(65536.0));
        assert_eq!(parse_size("10MiB"), Ok(10.0 * 1048576.0));
        assert_eq!(parse_size("1.5G"), Ok(1.5 * 1073741824.0));
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5 parsecs").is_err());
    }

    #[test]
    fn bytes_format_compactly() {
        assert_eq!(format_bytes(512.0), "512B");
        assert_eq!(format_bytes(1536.0), "1.5KiB");
        assert_eq!(format_bytes(-2.0 * 1048576.0), "-2.0MiB");
        assert_eq!(format_rate(1048576.0, true), "+1.0MiB/h");
        assert_eq!(format_rate(-3.0, false), "-3/h");
    }
}
