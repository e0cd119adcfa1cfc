//! When a node's heartbeat goes out besides its period: with a staleness bound, peers gate on
//! the clocks in heartbeats, so a clock that moved by half the bound since it was last
//! announced is announced at once; waiting for the next period would hold fast peers at the
//! gate on a stale clock.

/// The clock last announced, and how far it may move before it is announced again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Announcer {
    /// Half the staleness bound (at least one step); `None` without a bound.
    every: Option<u64>,
    announced: u64,
}

impl Announcer {
    /// The announcer of a run with `max_staleness` (`sync.max_staleness`).
    pub fn new(max_staleness: Option<u64>) -> Self {
        Announcer {
            every: max_staleness.map(|bound| (bound / 2).max(1)),
            announced: 0,
        }
    }

    /// A heartbeat announcing the clock `step` went out.
    pub fn announced(&mut self, step: u64) {
        self.announced = step;
    }

    /// Whether the clock at `step` is to be announced now rather than at the next period: it
    /// moved on by half the bound, or back (a member far ahead took over the run's state).
    pub fn moved(&self, step: u64) -> bool {
        self.every.is_some_and(|every| {
            step < self.announced || step >= self.announced.saturating_add(every)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_is_announced_early_once_it_moved_by_half_the_bound() {
        let mut announcer = Announcer::new(Some(16));
        assert!(!announcer.moved(7));
        assert!(announcer.moved(8));
        announcer.announced(9);
        assert!(!announcer.moved(16));
        assert!(announcer.moved(17));
        assert!(announcer.moved(3), "a clock moved back");
        // A bound of one: every step is announced.
        let announcer = Announcer::new(Some(1));
        assert!(announcer.moved(1));
        // Without a bound no one gates on clocks: the period is enough.
        assert!(!Announcer::new(None).moved(u64::MAX));
    }
}
