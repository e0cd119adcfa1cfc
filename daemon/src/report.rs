//! Small helpers for what commands print: process memory, rounding, byte counts.

/// Peak resident memory of this process in MB (Linux `VmHWM`); `None` elsewhere.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Rounds to `digits` decimals, for stable, readable JSON.
pub fn round(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// `bytes` for people: `512 B`, `1.5 kB`, `12.3 MB`, `4.0 GB` (powers of 1000).
pub fn bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn bytes_read_like_people_write_them() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(1_500), "1.5 kB");
        assert_eq!(super::bytes(12_345_678), "12.3 MB");
        assert_eq!(super::bytes(4_000_000_000_000_000), "4000.0 TB");
    }
}
