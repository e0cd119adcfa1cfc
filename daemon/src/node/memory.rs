//! Handing freed heap memory back to the system (`crate::report::memory` says how much there
//! is).
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

    /// Resident memory of this process, from the kernel's own count.
    fn resident_bytes() -> u64 {
        crate::report::memory()
            .expect("Linux has /proc/self/status")
            .resident_bytes
    }

    /// Small blocks freed under one still in use stay resident (glibc gives back only the top
    /// of a heap on its own) until the arenas are trimmed.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn trimming_gives_freed_small_blocks_back() {
        const MIB: u64 = 1 << 20;
        let _turn = crate::report::MEASURING
            .lock()
            .unwrap_or_else(|e| e.into_inner());
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
