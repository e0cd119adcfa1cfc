//! When a replica's snapshot falls due: every `sync.interval` local steps, or, with
//! `sync.adapt_interval`, as many steps as one interval's exchange pauses last (decision 0022).
//! A peer on a slow link then exchanges less often rather than fall behind and hold the
//! others at the staleness gate, and a peer on a fast link keeps the configured interval.
//!
//! The replica's rules ([`crate::replica::ReplicaLoop`]) follow it, for every trainer.

use std::time::Duration;

use crate::table::moving_average;

/// Weight of the newest interval in the moving averages.
const NEW: f64 = 0.3;

/// The longest adapted interval, in multiples of the configured one.
pub const MAX_STRETCH: u64 = 8;

/// The due steps of one replica.
#[derive(Clone, Debug)]
pub struct Pace {
    floor: u64,
    adapt: bool,
    /// The step the next snapshot falls due at.
    next: u64,
    /// Since the last due step: compute time, steps, and time paused for exchanges.
    computing: Duration,
    steps: u64,
    paused: Duration,
    /// Moving averages: seconds a step computes, seconds of pauses per interval.
    step_secs: Option<f64>,
    pause_secs: Option<f64>,
}

impl Pace {
    /// Snapshots every `interval` steps from `step` on, adapted to the pauses if `adapt`.
    pub fn new(interval: u64, adapt: bool, step: u64) -> Self {
        Pace {
            floor: interval,
            adapt,
            next: (step / interval + 1) * interval,
            computing: Duration::ZERO,
            steps: 0,
            paused: Duration::ZERO,
            step_secs: None,
            pause_secs: None,
        }
    }

    /// A local step computed in `took`.
    pub fn stepped(&mut self, took: Duration) {
        self.computing += took;
        self.steps += 1;
    }

    /// The trainer waited `took` for exchanges.
    pub fn paused(&mut self, took: Duration) {
        self.paused += took;
    }

    /// Seconds a local step computes (moving average over intervals), once measured: waits
    /// at the gate and for exchanges left out.
    pub fn step_secs(&self) -> Option<f64> {
        self.step_secs
    }

    /// The interval now in use.
    pub fn interval(&self) -> u64 {
        match (self.adapt, self.step_secs, self.pause_secs) {
            (true, Some(step), Some(pause)) if step > 0.0 => {
                let fits = (pause / step).ceil() as u64;
                fits.clamp(self.floor, self.floor * MAX_STRETCH)
            }
            _ => self.floor,
        }
    }

    /// Whether the snapshot of `step` (just taken) is due; if so, the next due step is set.
    pub fn is_due(&mut self, step: u64) -> bool {
        if step < self.next {
            return false;
        }
        if self.steps > 0 {
            let step_secs = self.computing.as_secs_f64() / self.steps as f64;
            let pause_secs = self.paused.as_secs_f64();
            self.step_secs = Some(moving_average(self.step_secs, step_secs, NEW));
            self.pause_secs = Some(moving_average(self.pause_secs, pause_secs, NEW));
        }
        (self.computing, self.steps, self.paused) = (Duration::ZERO, 0, Duration::ZERO);
        self.next = step + self.interval();
        true
    }

    /// The replica jumped to `step` (it took over a peer's state). A fixed pace keeps its
    /// multiples of the interval (ring rounds are numbered by them).
    pub fn restart_at(&mut self, step: u64) {
        self.next = if self.adapt {
            step + self.interval()
        } else {
            (step / self.floor + 1) * self.floor
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(pace: &mut Pace, steps: std::ops::Range<u64>, pause_per_due: Duration) -> Vec<u64> {
        let mut dues = Vec::new();
        for step in steps {
            pace.stepped(Duration::from_millis(4));
            if pace.is_due(step) {
                dues.push(step);
                pace.paused(pause_per_due);
            }
        }
        dues
    }

    #[test]
    fn a_fixed_pace_is_every_interval_steps() {
        let mut pace = Pace::new(8, false, 0);
        let dues = run(&mut pace, 1..41, Duration::from_secs(1));
        assert_eq!(dues, [8, 16, 24, 32, 40]);
        // After a state sync to step 100, the next snapshot is at the next multiple.
        pace.restart_at(100);
        assert_eq!(run(&mut pace, 101..110, Duration::ZERO), [104]);
    }

    #[test]
    fn an_adapted_pace_stretches_to_the_pauses_and_comes_back() {
        let mut pace = Pace::new(32, true, 0);
        // Pauses of 1 s against steps of 4 ms: 250 steps of compute per pause.
        run(&mut pace, 1..3_000, Duration::from_secs(1));
        let stretched = pace.interval();
        assert!((245..=250).contains(&stretched), "{stretched}");
        // Short pauses: back to the configured interval, never below it.
        run(&mut pace, 3_000..10_000, Duration::from_millis(10));
        assert_eq!(pace.interval(), 32);
        // And never beyond the stretch limit.
        run(&mut pace, 10_000..40_000, Duration::from_secs(60));
        assert_eq!(pace.interval(), 32 * MAX_STRETCH);
    }
}
