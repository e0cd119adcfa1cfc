//! A fork-join pool for the short parallel sections of a training step.
//!
//! A batch-64 MLP step is a dozen kernels of 5-300 µs each. A general-purpose pool (rayon)
//! parks its workers within microseconds of running dry, and waking one costs tens of
//! microseconds, which ate most of the gain of splitting those kernels. Here workers spin for
//! a while after each section before they park, the calling thread always runs part 0 itself,
//! and a section costs about a microsecond when the workers are awake.
//!
//! Sections come from one caller at a time; a concurrent caller runs its parts inline.

use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, TryLockError};
use std::thread::JoinHandle;

/// Spin iterations a worker makes waiting for the next section before it parks (0.1-1 ms).
const SPIN_BEFORE_PARK: u32 = 1 << 16;

/// A section's work, with its borrow's lifetime erased while workers may call it.
type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped to publish a new section.
    generation: AtomicU64,
    /// The current section's work and part count; see the `Sync` impl for who touches it when.
    job: UnsafeCell<Option<(*const Job, usize)>>,
    /// Workers that have not yet finished the current section.
    remaining: AtomicUsize,
    /// Whether a worker panicked in the current section.
    panicked: AtomicBool,
    stop: AtomicBool,
    /// Workers parked (or about to park) on `wake`.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is the only field that is not Sync. The caller writes it only between
// sections (after every worker decremented `remaining` for the previous one) and before
// publishing the next generation with SeqCst; workers read it only after observing that
// generation and before decrementing `remaining`. So reads and writes never overlap.
#[allow(unsafe_code)]
unsafe impl Sync for Shared {}
// SAFETY: the raw pointer in `job` is only dereferenced under the protocol above.
#[allow(unsafe_code)]
unsafe impl Send for Shared {}

/// A pool of `threads - 1` spinning workers plus the calling thread.
pub(crate) struct ForkJoin {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises callers: a section's parts must all finish before the next is published.
    caller: Mutex<()>,
}

impl std::fmt::Debug for ForkJoin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForkJoin")
            .field("threads", &self.threads())
            .finish()
    }
}

impl ForkJoin {
    /// Starts `threads - 1` workers.
    pub(crate) fn new(threads: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            job: UnsafeCell::new(None),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut pool = ForkJoin {
            shared: Arc::clone(&shared),
            workers: Vec::new(),
            caller: Mutex::new(()),
        };
        for index in 1..threads.max(1) {
            let shared = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("murmur-cpu-{index}"))
                .spawn(move || worker(&shared, index))?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Threads that run a section, the caller's included.
    pub(crate) fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `work(i)` for every `i` in `0..parts` (`parts <= threads()`), part 0 on the calling
    /// thread, and returns when all are done. A panic in any part is re-raised here.
    pub(crate) fn run(&self, parts: usize, work: &(dyn Fn(usize) + Sync)) {
        assert!(
            parts <= self.threads(),
            "invariant: at most one part per thread"
        );
        let _caller = match self.caller.try_lock() {
            Ok(guard) => guard,
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            // Another thread is using the pool: do this section alone rather than wait.
            Err(TryLockError::WouldBlock) => {
                (0..parts).for_each(work);
                return;
            }
        };
        if parts <= 1 || self.workers.is_empty() {
            (0..parts).for_each(work);
            return;
        }
        let shared = &*self.shared;
        #[allow(unsafe_code)]
        // SAFETY: no worker reads `job` now (all finished the previous section before the last
        // `run` returned). Erasing the lifetime is sound because we do not return before every
        // worker has finished calling `work` (the wait on `remaining` below).
        unsafe {
            let erased = std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(work);
            *shared.job.get() = Some((erased as *const Job, parts));
        }
        shared.panicked.store(false, Ordering::Relaxed);
        shared
            .remaining
            .store(self.workers.len(), Ordering::Relaxed);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = shared.park.lock().unwrap_or_else(|p| p.into_inner());
            shared.wake.notify_all();
        }
        let mine = panic::catch_unwind(AssertUnwindSafe(|| work(0)));
        while shared.remaining.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
        }
        if let Err(payload) = mine {
            panic::resume_unwind(payload);
        }
        assert!(
            !shared.panicked.load(Ordering::Relaxed),
            "a compute thread panicked"
        );
    }
}

fn worker(shared: &Shared, index: usize) {
    let mut seen = 0;
    loop {
        let mut spins = 0u32;
        loop {
            let generation = shared.generation.load(Ordering::SeqCst);
            if generation != seen {
                seen = generation;
                break;
            }
            if shared.stop.load(Ordering::Acquire) {
                return;
            }
            if spins < SPIN_BEFORE_PARK {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            // Park. `sleepers` is raised before the generation is checked again (both SeqCst),
            // so either we see the new generation or the caller sees a sleeper and notifies,
            // and it can only notify once we wait (it takes `park` first).
            let mut lock = shared.park.lock().unwrap_or_else(|p| p.into_inner());
            shared.sleepers.fetch_add(1, Ordering::SeqCst);
            while shared.generation.load(Ordering::SeqCst) == seen
                && !shared.stop.load(Ordering::SeqCst)
            {
                lock = shared.wake.wait(lock).unwrap_or_else(|p| p.into_inner());
            }
            shared.sleepers.fetch_sub(1, Ordering::SeqCst);
            spins = 0;
        }
        #[allow(unsafe_code)]
        // SAFETY: the caller wrote `job` before publishing this generation and keeps the work
        // alive until `remaining` reaches zero, which needs our decrement below.
        let job = unsafe { *shared.job.get() };
        if let Some((job, _)) = job.filter(|&(_, parts)| index < parts) {
            #[allow(unsafe_code)]
            // SAFETY: as above; `job` points to the caller's live `work`.
            let work = unsafe { &*job };
            if panic::catch_unwind(AssertUnwindSafe(|| work(index))).is_err() {
                shared.panicked.store(true, Ordering::Relaxed);
            }
        }
        shared.remaining.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ForkJoin {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _lock = self.shared.park.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;
    use std::time::{Duration, Instant};

    #[test]
    fn every_part_runs_once_per_section() {
        let pool = ForkJoin::new(3).unwrap();
        let counts: Vec<AtomicU32> = (0..3).map(|_| AtomicU32::new(0)).collect();
        for _ in 0..1000 {
            pool.run(3, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        pool.run(2, &|i| {
            counts[i].fetch_add(1, Ordering::Relaxed);
        });
        let counts: Vec<u32> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(counts, [1001, 1001, 1000]);
    }

    #[test]
    fn parked_workers_wake_up() {
        let pool = ForkJoin::new(2).unwrap();
        let hits = AtomicU32::new(0);
        for _ in 0..3 {
            // Wait (with a deadline) until the worker has spun out and parked.
            let deadline = Instant::now() + Duration::from_secs(10);
            while pool.shared.sleepers.load(Ordering::SeqCst) == 0 {
                assert!(Instant::now() < deadline, "worker never parked");
                std::thread::yield_now();
            }
            pool.run(2, &|_| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn a_panicking_part_is_reported_to_the_caller() {
        let pool = ForkJoin::new(2).unwrap();
        let result = panic::catch_unwind(AssertUnwindSafe(|| {
            pool.run(2, &|i| assert!(i == 0, "part {i} fails"));
        }));
        assert!(result.is_err());
        // The pool still works afterwards.
        let hits = AtomicU32::new(0);
        pool.run(2, &|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }
}
