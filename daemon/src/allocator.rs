//! `nodectl`'s global allocator: the system's, with a count of the bytes the process holds.
//!
//! Resident memory mixes two things: what the daemon holds, and pages the allocator keeps
//! (freed blocks it has not given back, pages pinned by a few live blocks). glibc's own count
//! (`mallinfo2`, [`crate::report::memory`]) also calls "in use" the freed blocks its per-thread
//! caches keep. This count is exact: it adds every block handed out and subtracts every block
//! freed, so a daemon whose count stays level over hours holds no more than it did, whatever its
//! resident size does (docs/operations.md, Soak).
//!
//! [`tune`] sets glibc's allocator up for a process that runs for days (decision 0060): with its
//! defaults, what it keeps creeps up long after the daemon's own count has levelled off.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting the bytes of the blocks it has handed out and not had back.
/// `nodectl` installs it as the global allocator; tests and other binaries need not.
#[derive(Debug)]
pub struct Counting;

/// Bytes in blocks handed out and not yet freed. A relaxed counter is exact here: a block is
/// freed only after it was allocated (the pointer itself carries that ordering), so every
/// subtraction follows its addition.
static HELD: AtomicU64 = AtomicU64::new(0);

/// The most [`HELD`] has been since the last [`reset_peak`]: what a benchmark's stage took at
/// its busiest.
static PEAK: AtomicU64 = AtomicU64::new(0);

/// The bytes the process holds in blocks from [`Counting`], or `None` where [`Counting`] is not
/// the global allocator (then nothing has ever been counted).
pub fn held_bytes() -> Option<u64> {
    match HELD.load(Ordering::Relaxed) {
        0 => None,
        held => Some(held),
    }
}

/// The most bytes the process held in blocks from [`Counting`] since the last
/// [`reset_peak`], or `None` where [`Counting`] is not the global allocator.
pub fn peak_bytes() -> Option<u64> {
    held_bytes().map(|held| PEAK.load(Ordering::Relaxed).max(held))
}

/// Starts a new peak from what the process holds now.
pub fn reset_peak() {
    PEAK.store(HELD.load(Ordering::Relaxed), Ordering::Relaxed);
}

fn added(bytes: usize) {
    let held = HELD.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    // A read first: a new peak is rare once a process runs, so most allocations write nothing
    // more than the count.
    if held > PEAK.load(Ordering::Relaxed) {
        PEAK.fetch_max(held, Ordering::Relaxed);
    }
}

fn removed(bytes: usize) {
    HELD.fetch_sub(bytes as u64, Ordering::Relaxed);
}

// SAFETY: every call goes to `System` with the caller's own arguments, and what `System` returns
// is returned unchanged; the count only reads the layouts. So `Counting` keeps every promise
// `System` makes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is `System::alloc`'s.
        let block = unsafe { System.alloc(layout) };
        if !block.is_null() {
            added(layout.size());
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let block = unsafe { System.alloc_zeroed(layout) };
        if !block.is_null() {
            added(layout.size());
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        // SAFETY: the caller passes a block this allocator (that is, `System`) handed out, with
        // its layout.
        unsafe { System.dealloc(block, layout) };
        removed(layout.size());
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, and `new_size` is the caller's valid size.
        let moved = unsafe { System.realloc(block, layout, new_size) };
        // On failure the old block stays allocated, as it was.
        if !moved.is_null() {
            added(new_size);
            removed(layout.size());
        }
        moved
    }
}

/// Sets glibc's allocator up for a daemon that runs for days; call it first thing in `main`,
/// before any other thread starts. In soaks (docs/operations.md, Soak) glibc's defaults kept
/// more and more of what the daemon had freed, long after the daemon's own count levelled off:
///
/// - one arena, not one per thread: `malloc_trim` gives back the free top of the main arena
///   only, so a thread's arena kept its free top, as high as its busiest moment had taken it,
///   until a large free there happened to trim it;
/// - no fast bins: small freed blocks are merged at once, instead of waiting unmerged (and
///   pinning their pages) until a larger request sweeps them up.
///
/// Neither slows the training step (decision 0060). A setting glibc refuses leaves its default,
/// which only costs memory. Other C libraries have no `mallopt`; there it does nothing.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
pub fn tune() {
    for (setting, value) in [(libc::M_ARENA_MAX, 1), (libc::M_MXFAST, 0)] {
        // SAFETY: mallopt takes two integers and sets glibc's own parameters under its lock.
        unsafe { libc::mallopt(setting, value) };
    }
}

/// Other C libraries have no `mallopt`.
#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn tune() {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count follows blocks through allocation, growth and freeing. The test calls the
    /// allocator directly: the test binary's global allocator is the plain system one.
    #[test]
    #[allow(unsafe_code)]
    fn the_count_follows_every_block() {
        let counting = Counting;
        let before = HELD.load(Ordering::Relaxed);
        let layout = Layout::from_size_align(1000, 8).unwrap();
        // SAFETY: a non-zero layout; every block is freed with its own layout below.
        unsafe {
            let a = counting.alloc(layout);
            let b = counting.alloc_zeroed(layout);
            assert!(!a.is_null() && !b.is_null());
            assert_eq!(*b.add(999), 0);
            assert_eq!(HELD.load(Ordering::Relaxed) - before, 2000);
            let a = counting.realloc(a, layout, 5000);
            assert!(!a.is_null());
            assert_eq!(HELD.load(Ordering::Relaxed) - before, 6000);
            assert_eq!(held_bytes(), Some(before + 6000));
            assert!(peak_bytes().is_some_and(|peak| peak >= before + 6000));
            counting.dealloc(a, Layout::from_size_align(5000, 8).unwrap());
            counting.dealloc(b, layout);
        }
        assert_eq!(HELD.load(Ordering::Relaxed), before);
    }
}
