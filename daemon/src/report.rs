//! Small helpers for what commands print: process memory, rounding, byte counts.

use crate::api::types::MemoryReport;

/// Peak resident memory of this process in MB (Linux `VmHWM`); `None` elsewhere.
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// This process's memory now: resident and anonymous from `/proc/self/status`, the heap from
/// the allocator. `None` where there is no `/proc` to read.
pub fn memory() -> Option<MemoryReport> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    let (heap_in_use_bytes, heap_free_bytes) = match heap() {
        Some((in_use, free)) => (Some(in_use), Some(free)),
        None => (None, None),
    };
    Some(MemoryReport {
        resident_bytes: kib("VmRSS:")?,
        anonymous_bytes: kib("RssAnon:")?,
        heap_in_use_bytes,
        heap_free_bytes,
        allocated_bytes: crate::allocator::held_bytes(),
        peak_resident_bytes: kib("VmHWM:"),
        peak_allocated_bytes: crate::allocator::peak_bytes(),
    })
}

/// glibc's heap: bytes in blocks handed out (its arenas' and the ones mapped on their own), and
/// bytes free in its arenas.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
fn heap() -> Option<(u64, u64)> {
    // SAFETY: mallinfo2 takes no pointer and returns a struct by value; it walks glibc's arenas
    // under their locks, so any thread may call it at any time.
    let info = unsafe { libc::mallinfo2() };
    let in_use = info.uordblks.checked_add(info.hblkhd)?;
    Some((in_use as u64, info.fordblks as u64))
}

/// Other C libraries have no `mallinfo2`.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn heap() -> Option<(u64, u64)> {
    None
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

/// The tests that measure the process's memory take turns: each would see the other's tens of
/// MB come and go.
#[cfg(test)]
pub(crate) static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks held count as in use, and once freed, as the allocator's.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_memory_report_tells_the_heap_held_from_the_heap_kept() {
        const MIB: u64 = 1 << 20;
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        let before = memory().unwrap();
        let blocks: Vec<Vec<u8>> = (0..48 * 1024).map(|_| vec![1u8; 1000]).collect();
        let held = memory().unwrap();
        assert!(held.anonymous_bytes <= held.resident_bytes, "{held:?}");
        // Other tests of this binary allocate and free too, by far less than the margin.
        let grown = held.heap_in_use_bytes.unwrap() - before.heap_in_use_bytes.unwrap();
        assert!(grown >= 24 * MIB, "{before:?} then {held:?}");
        let pin = vec![1u8; 1000];
        drop(blocks);
        let kept = memory().unwrap();
        assert!(
            kept.heap_free_bytes.unwrap() >= held.heap_free_bytes.unwrap() + 24 * MIB,
            "{held:?} then {kept:?}"
        );
        drop(pin);
    }

    #[test]
    fn bytes_read_like_people_write_them() {
        assert_eq!(super::bytes(512), "512 B");
        assert_eq!(super::bytes(1_500), "1.5 kB");
        assert_eq!(super::bytes(12_345_678), "12.3 MB");
        assert_eq!(super::bytes(4_000_000_000_000_000), "4000.0 TB");
    }
}
