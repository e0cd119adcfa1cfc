//! `nodectl`'s global allocator: the system's, with a count of the bytes the process holds.
//!
//! Resident memory mixes two things: what the daemon holds, and pages the allocator keeps
//! (freed blocks it has not given back, pages pinned by a few live blocks). glibc's own count
//! (`mallinfo2`, [`crate::report::memory`]) also calls "in use" the freed blocks its per-thread
//! caches keep. This count is exact: it adds every block handed out and subtracts every block
//! freed, so a daemon whose count stays level over hours holds no more than it did, whatever its
//! resident size does (docs/operations.md, Soak).
//!
//! Freed blocks of 32 MiB or more are kept for the next request of about their size (decision
//! 0086): the model-sized buffers of one exchange serve the next without faulting their pages
//! in again.
//!
//! [`tune`] sets glibc's allocator up for a process that runs for days (decision 0060): with its
//! defaults, what it keeps creeps up long after the daemon's own count has levelled off.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
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

/// Blocks this large are model-sized buffers (a snapshot, a difference, a decoded payload).
const HUGE_BLOCK: usize = 32 << 20;

/// Asks the kernel to back a large block with 2 MiB pages where it can: each model-sized
/// buffer is mapped afresh, and faulting it in 4 KiB pages took about 40 % of an exchange.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn huge_pages(block: *mut u8, size: usize) {
    const HUGE_PAGE: usize = 2 << 20;
    if size < HUGE_BLOCK {
        return;
    }
    let start = (block as usize).next_multiple_of(HUGE_PAGE);
    let end = (block as usize + size) / HUGE_PAGE * HUGE_PAGE;
    if end > start {
        // SAFETY: the range lies inside a block just handed out; the advice changes how pages
        // are backed, not what they hold, and a kernel that refuses it leaves them as they are.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Other systems: pages as the kernel backs them.
#[cfg(not(target_os = "linux"))]
fn huge_pages(_: *mut u8, _: usize) {}

/// A freed model-sized block, kept for the next request of about its size.
#[derive(Clone, Copy, Debug)]
struct Spare {
    /// The block's address (a pointer as a number: the slots live in a static).
    block: usize,
    /// The layout it was last handed out with (the system's block may be larger).
    layout: Layout,
}

/// Model-sized blocks kept at most: an exchange's snapshot, received values and encoded
/// difference, and one more.
const SPARE_SLOTS: usize = 4;

/// The freed model-sized blocks kept for reuse (decision 0086). Every exchange takes a
/// snapshot, receives a model and encodes a difference, and frees them once it lands; the
/// system gives such blocks back to the kernel at once, so the next exchange faults every page
/// in again, and with huge pages the kernel may stall that fault to compact memory (0.6 s for a
/// 340 MB snapshot, against 0.03 s to copy into a kept block). Kept blocks stay resident, but
/// the model-sized blocks never take more than they would without: a request that no kept
/// block fits gives them all back before the system maps a new one, so between such misses
/// they take what they took at the last of them. A std mutex (a futex: it allocates nothing),
/// taken only for blocks of [`HUGE_BLOCK`] or more.
static SPARES: Mutex<[Option<Spare>; SPARE_SLOTS]> = Mutex::new([None; SPARE_SLOTS]);

/// Bytes in freed blocks kept for reuse.
#[cfg(test)]
fn spare_bytes() -> usize {
    spares()
        .iter()
        .flatten()
        .map(|spare| spare.layout.size())
        .sum()
}

fn spares() -> std::sync::MutexGuard<'static, [Option<Spare>; SPARE_SLOTS]> {
    SPARES.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `layout` is a block the spares take and give: model-sized, at most the alignment
/// the system's `malloc` gives every block (so a kept block suits any such request).
fn spare_sized(layout: Layout) -> bool {
    layout.size() >= HUGE_BLOCK && layout.align() <= 16
}

/// A kept block for `layout`: the smallest of those as large as it and at most a quarter
/// larger. `None` where none fits; then every kept block goes back to the system first.
#[allow(unsafe_code)]
fn take_spare(layout: Layout) -> Option<*mut u8> {
    let size = layout.size();
    let mut slots = spares();
    let fits = |spare: &Spare| (size..=size + size / 4).contains(&spare.layout.size());
    let best = slots
        .iter_mut()
        .filter(|slot| slot.as_ref().is_some_and(fits))
        .min_by_key(|slot| slot.map_or(usize::MAX, |spare| spare.layout.size()));
    if let Some(slot) = best {
        return slot.take().map(|spare| spare.block as *mut u8);
    }
    let returned = std::mem::replace(&mut *slots, [None; SPARE_SLOTS]);
    drop(slots);
    for spare in returned.into_iter().flatten() {
        // SAFETY: a block `System` handed out, kept since it was freed with this layout.
        unsafe { System.dealloc(spare.block as *mut u8, spare.layout) };
    }
    None
}

/// Keeps a freed block where a slot is free; `false`: the caller gives it back.
fn keep_spare(block: *mut u8, layout: Layout) -> bool {
    let mut slots = spares();
    match slots.iter_mut().find(|slot| slot.is_none()) {
        Some(slot) => {
            *slot = Some(Spare {
                block: block as usize,
                layout,
            });
            true
        }
        None => false,
    }
}

// SAFETY: every call goes to `System` with the caller's own arguments, and what `System` returns
// is returned unchanged, or a block `System` handed out earlier for a layout of the same
// alignment class and at least the size asked, which was freed and not handed out since (the
// spares); `System` is `malloc`, whose `free` and `realloc` need no size. The count only reads
// the layouts. So `Counting` keeps every promise `System` makes.
#[allow(unsafe_code)]
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let spare = spare_sized(layout).then(|| take_spare(layout)).flatten();
        // SAFETY: the caller's contract for `alloc` is `System::alloc`'s.
        let block = spare.unwrap_or_else(|| unsafe { System.alloc(layout) });
        if !block.is_null() {
            added(layout.size());
            if spare.is_none() {
                huge_pages(block, layout.size());
            }
        }
        block
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if spare_sized(layout)
            && let Some(block) = take_spare(layout)
        {
            // SAFETY: a kept block of at least `layout.size()` bytes that nothing else holds.
            unsafe { block.write_bytes(0, layout.size()) };
            added(layout.size());
            return block;
        }
        // SAFETY: as `alloc`.
        let block = unsafe { System.alloc_zeroed(layout) };
        if !block.is_null() {
            added(layout.size());
            huge_pages(block, layout.size());
        }
        block
    }

    unsafe fn dealloc(&self, block: *mut u8, layout: Layout) {
        removed(layout.size());
        if spare_sized(layout) && keep_spare(block, layout) {
            return;
        }
        // SAFETY: the caller passes a block this allocator (that is, `System`) handed out, with
        // its layout.
        unsafe { System.dealloc(block, layout) };
    }

    unsafe fn realloc(&self, block: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, and `new_size` is the caller's valid size.
        let moved = unsafe { System.realloc(block, layout, new_size) };
        // On failure the old block stays allocated, as it was.
        if !moved.is_null() {
            added(new_size);
            removed(layout.size());
            huge_pages(moved, new_size);
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

    /// The tests that allocate through [`Counting`] take turns: they share its count and its
    /// spares.
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// Gives back the blocks another test left kept: a request no kept block fits.
    fn no_spares() {
        assert!(take_spare(Layout::from_size_align(HUGE_BLOCK * 7 + 1, 8).unwrap()).is_none());
        assert_eq!(spare_bytes(), 0);
    }

    /// The count follows blocks through allocation, growth and freeing. The test calls the
    /// allocator directly: the test binary's global allocator is the plain system one.
    #[test]
    #[allow(unsafe_code)]
    fn the_count_follows_every_block() {
        let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
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

    /// A model-sized block is advised to the kernel for 2 MiB pages (`hg` among its mapping's
    /// flags in `/proc/self/smaps`); a small one is not. Skipped where the kernel has no
    /// transparent huge pages.
    #[test]
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    fn model_sized_blocks_ask_for_huge_pages() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            return;
        }
        let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
        no_spares();
        let counting = Counting;
        for (size, advised) in [(HUGE_BLOCK * 2, true), (1 << 20, false)] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            // SAFETY: a non-zero layout, freed with it below.
            let block = unsafe { counting.alloc(layout) };
            assert!(!block.is_null());
            let inside = (block as usize).next_multiple_of(2 << 20);
            assert_eq!(
                mapping_flags(inside).contains(&"hg".to_owned()),
                advised,
                "{size}"
            );
            // SAFETY: the block from above, with its layout.
            unsafe { counting.dealloc(block, layout) };
        }
    }

    /// A freed model-sized block is kept and handed out again for a request of about its size,
    /// its pages still in place (no page faults); a request that no kept block fits gives the
    /// kept ones back first, so that the process never holds more than before.
    #[test]
    #[cfg(target_os = "linux")]
    #[allow(unsafe_code)]
    fn freed_model_sized_blocks_are_kept_for_the_next_and_given_back_on_a_miss() {
        let _alone = ALONE.lock().unwrap_or_else(|e| e.into_inner());
        no_spares();
        let counting = Counting;
        let before = HELD.load(Ordering::Relaxed);
        let model = Layout::from_size_align(HUGE_BLOCK * 2, 8).unwrap();
        let faults = |touch: &dyn Fn()| {
            let count = || {
                // SAFETY: getrusage writes the struct it is given.
                let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
                unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
                usage.ru_minflt
            };
            let start = count();
            touch();
            count() - start
        };
        // SAFETY: non-zero layouts; every block is written within its size and freed with
        // its layout.
        unsafe {
            let first = counting.alloc(model);
            let fresh = faults(&|| first.write_bytes(1, model.size()));
            counting.dealloc(first, model);
            assert_eq!(spare_bytes(), model.size());
            assert_eq!(HELD.load(Ordering::Relaxed), before);

            // A little smaller: the kept block, its pages already there.
            let smaller = Layout::from_size_align(model.size() - 4096, 8).unwrap();
            let again = counting.alloc(smaller);
            assert_eq!(again, first);
            assert_eq!(HELD.load(Ordering::Relaxed) - before, smaller.size() as u64);
            let kept = faults(&|| again.write_bytes(2, smaller.size()));
            assert!(
                kept < 4 && fresh >= 16,
                "faults: {kept} kept, {fresh} fresh"
            );
            counting.dealloc(again, smaller);

            // Zeroed, from a kept block.
            let zeroed = counting.alloc_zeroed(smaller);
            assert_eq!(zeroed, first);
            assert_eq!(*zeroed.add(12345), 0);
            counting.dealloc(zeroed, smaller);

            // Half the size fits no kept block: they all go back, then a new block.
            let half = Layout::from_size_align(model.size() / 2, 8).unwrap();
            let other = counting.alloc(half);
            assert!(!other.is_null());
            assert_eq!(spare_bytes(), 0);
            counting.dealloc(other, half);
            assert_eq!(spare_bytes(), half.size());
        }
        assert_eq!(HELD.load(Ordering::Relaxed), before);
        no_spares();
    }

    /// The `VmFlags` of the mapping that holds `address`.
    #[cfg(target_os = "linux")]
    fn mapping_flags(address: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or_default();
            if let Some((start, end)) = range.split_once('-')
                && let (Ok(start), Ok(end)) = (
                    usize::from_str_radix(start, 16),
                    usize::from_str_radix(end, 16),
                )
            {
                inside = (start..end).contains(&address);
            } else if inside && let Some(flags) = line.strip_prefix("VmFlags:") {
                return flags.split_whitespace().map(str::to_owned).collect();
            }
        }
        panic!("no mapping holds {address:#x}");
    }
}
