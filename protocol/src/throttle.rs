//! Warning lines that peers can cause, kept to a few a minute: a stranger (or a crowd of fresh
//! identities) that sends garbage must not fill the operator's disk or bury other lines.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a throttle counts its lines for.
pub const LOG_WINDOW: Duration = Duration::from_secs(60);
/// Lines a minute of each kind of warning that peers can cause.
pub const LOG_LINES: u32 = 30;

/// Lets a log line through at most `per_window` times per [`LOG_WINDOW`], and says how many it
/// held back since the last one it let through. One per call site, usually a `static`.
#[derive(Debug)]
pub struct LogThrottle {
    per_window: u32,
    state: Mutex<Window>,
}

#[derive(Debug)]
struct Window {
    started: Option<Instant>,
    said: u32,
    held: u64,
}

impl LogThrottle {
    pub const fn new(per_window: u32) -> Self {
        LogThrottle {
            per_window,
            state: Mutex::new(Window {
                started: None,
                said: 0,
                held: 0,
            }),
        }
    }

    /// `Some(lines held back before this one)` if a line may be said now, `None` if not.
    pub fn allow(&self) -> Option<u64> {
        self.allow_at(Instant::now())
    }

    /// [`allow`](Self::allow) at `now`.
    pub fn allow_at(&self, now: Instant) -> Option<u64> {
        let mut window = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let expired = window
            .started
            .is_none_or(|started| now.saturating_duration_since(started) >= LOG_WINDOW);
        if expired {
            window.started = Some(now);
            window.said = 0;
        }
        if window.said >= self.per_window {
            window.held += 1;
            return None;
        }
        window.said += 1;
        Some(std::mem::take(&mut window.held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_few_lines_a_window_then_silence_then_the_count_of_what_was_held() {
        let throttle = LogThrottle::new(3);
        let t0 = Instant::now();
        let said: Vec<Option<u64>> = (0..10).map(|_| throttle.allow_at(t0)).collect();
        assert_eq!(said[..3], [Some(0); 3]);
        assert!(said[3..].iter().all(Option::is_none));
        let later = t0 + LOG_WINDOW;
        assert_eq!(
            throttle.allow_at(later),
            Some(7),
            "the next window says what was held"
        );
        assert_eq!(throttle.allow_at(later), Some(0));
    }
}
