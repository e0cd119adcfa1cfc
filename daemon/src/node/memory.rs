//! Handing freed heap memory back to the system, and saying how much there is.
//!
//! A daemon that runs for days allocates and frees the same buffers over and over (snapshots,
//! frames, connections that come and go). glibc's allocator keeps what was freed in its arenas
//! for reuse: in a ten-minute soak with churn, what the daemon held grew far less than its
//! resident memory, which crept by about 0.15 MB a minute (docs/operations.md, Soak). Asking
//! glibc to trim its arenas once a minute gives that memory back; other allocators return it
//! on their own, and there the trim does nothing.

use std::time::Duration;

use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use crate::api::types::MemoryReport;

/// How often the arenas are trimmed: a walk over a heap of tens of MB takes well under a
/// millisecond.
pub const TRIM_EVERY: Duration = Duration::from_secs(60);

/// Trims the allocator's arenas every [`TRIM_EVERY`] until `leave` is cancelled.
pub async fn trim_periodically(leave: CancellationToken) {
    let mut tick = tokio::time::interval(TRIM_EVERY);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate: nothing to give back yet
    loop {
        tokio::select! {
            _ = tick.tick() => trim(),
            () = leave.cancelled() => return,
        }
    }
}

/// Gives the free pages of glibc's arenas back to the system.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn trim() {
    // SAFETY: malloc_trim takes no pointer and only walks glibc's own arenas, under their locks;
    // any thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Other C libraries have no `malloc_trim`; their allocators are left as they are.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn trim() {}

/// This process's memory now: resident and anonymous from `/proc/self/status`, the heap from
/// the allocator. `None` where there is no `/proc` to read.
pub fn report() -> Option<MemoryReport> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_trimmer_ends_when_the_node_leaves() {
        let leave = CancellationToken::new();
        let trimmer = tokio::spawn(trim_periodically(leave.clone()));
        leave.cancel();
        tokio::time::timeout(Duration::from_secs(10), trimmer)
            .await
            .expect("the trimmer ended within 10 s of leaving")
            .unwrap();
    }

    /// The tests that measure the process's memory take turns: each would see the other's tens
    /// of MB come and go.
    static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Resident memory of this process, from the kernel's own count.
    fn resident_bytes() -> u64 {
        report()
            .expect("Linux has /proc/self/status")
            .resident_bytes
    }

    /// Blocks held count as in use, and once freed, as the allocator's.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn the_report_tells_the_heap_held_from_the_heap_kept() {
        const MIB: u64 = 1 << 20;
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        let before = report().unwrap();
        let blocks: Vec<Vec<u8>> = (0..48 * 1024).map(|_| vec![1u8; 1000]).collect();
        let held = report().unwrap();
        assert!(held.anonymous_bytes <= held.resident_bytes, "{held:?}");
        // Other tests of this binary allocate and free too, by far less than the margin.
        let grown = held.heap_in_use_bytes.unwrap() - before.heap_in_use_bytes.unwrap();
        assert!(grown >= 24 * MIB, "{before:?} then {held:?}");
        let pin = vec![1u8; 1000];
        drop(blocks);
        let kept = report().unwrap();
        assert!(
            kept.heap_free_bytes.unwrap() >= held.heap_free_bytes.unwrap() + 24 * MIB,
            "{held:?} then {kept:?}"
        );
        drop(pin);
    }

    /// Small blocks freed under one still in use stay resident (glibc gives back only the top
    /// of a heap on its own) until the arenas are trimmed.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn trimming_gives_freed_small_blocks_back() {
        const MIB: u64 = 1 << 20;
        let _turn = MEASURING.lock().unwrap_or_else(|e| e.into_inner());
        let blocks: Vec<Vec<u8>> = (0..48 * 1024).map(|_| vec![1u8; 1000]).collect();
        let pin = vec![1u8; 1000];
        drop(blocks);
        let before = resident_bytes();
        trim();
        let after = resident_bytes();
        assert!(
            before.saturating_sub(after) >= 24 * MIB,
            "resident {} MiB before the trim and {} MiB after",
            before / MIB,
            after / MIB
        );
        drop(pin);
    }
}
