//! The node's clock. The node's actors read the time here rather than from `Instant::now`:
//! it is the tokio runtime's clock, the system's in a real node and a virtual one in the
//! simulator, which pauses and advances it (decision 0080), so that a simulated node's
//! timeouts, waits and rates all count the same time.

use std::time::{Duration, Instant};

/// Now, on the runtime's clock (the system's, outside a runtime).
pub fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// The time since `earlier`, on the runtime's clock.
pub fn since(earlier: Instant) -> Duration {
    now().saturating_duration_since(earlier)
}
