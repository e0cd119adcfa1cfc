//! Frames in flight: each is held until its path's delay has passed, or lost on the way. Time is
//! passed in, so that the rules are tested without a clock.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

/// A frame on its way to `port`, due at `due`.
#[derive(Debug, PartialEq, Eq)]
pub struct InFlight {
    pub due: Instant,
    /// Frames due at the same instant leave in the order they came.
    seq: u64,
    pub port: usize,
    pub frame: Vec<u8>,
}

impl Ord for InFlight {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.due, self.seq).cmp(&(other.due, other.seq))
    }
}

impl PartialOrd for InFlight {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

/// The frames in flight, earliest first, with a seeded loss draw.
#[derive(Debug)]
pub struct DelayLine {
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    rng: ChaCha8Rng,
    /// Frames dropped by the loss draw so far.
    pub lost: u64,
}

impl DelayLine {
    pub fn new(seed: u64) -> Self {
        DelayLine {
            queue: BinaryHeap::new(),
            seq: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
            lost: 0,
        }
    }

    /// Puts `frame`, received at `now`, on its way to `port` with `delay`; it is lost instead
    /// with probability `loss`. A path keeps its order: its frames share one delay.
    pub fn send(&mut self, now: Instant, port: usize, frame: Vec<u8>, delay: Duration, loss: f64) {
        if loss > 0.0 && self.rng.random::<f64>() < loss {
            self.lost += 1;
            return;
        }
        self.seq += 1;
        self.queue.push(Reverse(InFlight {
            due: now + delay,
            seq: self.seq,
            port,
            frame,
        }));
    }

    /// When the earliest frame is due, if any is in flight.
    pub fn next_due(&self) -> Option<Instant> {
        self.queue.peek().map(|Reverse(f)| f.due)
    }

    /// The earliest frame, if it is due at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<InFlight> {
        if self.next_due()? <= now {
            self.queue.pop().map(|Reverse(f)| f)
        } else {
            None
        }
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_leave_after_their_delay_in_order() {
        let mut line = DelayLine::new(1);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        line.send(t0, 1, vec![1], ms(30), 0.0);
        line.send(t0, 2, vec![2], ms(10), 0.0);
        line.send(t0 + ms(1), 1, vec![3], ms(30), 0.0);
        line.send(t0 + ms(1), 2, vec![4], ms(9), 0.0);
        assert_eq!(line.next_due(), Some(t0 + ms(10)));
        assert!(line.pop_due(t0 + ms(9)).is_none(), "nothing is early");
        let order: Vec<u8> = std::iter::from_fn(|| line.pop_due(t0 + ms(40)))
            .map(|f| f.frame[0])
            .collect();
        // 2 and 4 are due at 10 ms (2 came first), then 1 at 30 ms, then 3 at 31 ms.
        assert_eq!(order, vec![2, 4, 1, 3]);
        assert!(line.is_empty());
    }

    #[test]
    fn loss_drops_about_its_share_and_is_seeded() {
        let run = |seed| {
            let mut line = DelayLine::new(seed);
            let now = Instant::now();
            for i in 0..20_000u32 {
                line.send(now, 0, i.to_le_bytes().to_vec(), Duration::ZERO, 0.1);
            }
            (line.lost, line.len())
        };
        let (lost, kept) = run(7);
        assert_eq!(lost as usize + kept, 20_000);
        // 10 % of 20 000: 2 000, with a standard deviation of about 42.
        assert!((1_800..2_200).contains(&lost), "lost {lost}");
        assert_eq!(run(7), (lost, kept), "the same seed drops the same frames");
    }
}
