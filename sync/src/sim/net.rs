//! The simulator's network: whether a message between two peers gets through, and when. Links
//! can be cut between chosen peers, a peer isolated from all, messages dropped at random and
//! delayed (the operations of raft-rs's test network).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

/// The links between the simulated peers, by index.
#[derive(Debug)]
pub struct Net {
    /// One-way delay of every message.
    pub latency: Duration,
    /// Time to move one replica's worth of bytes.
    pub transfer: Duration,
    /// Share of messages lost, 0 to 1.
    pub drop_rate: f64,
    cut: HashSet<(usize, usize)>,
    isolated: HashSet<usize>,
    /// Peers on slower links: their messages' delay and transfer times multiplied.
    slow: HashMap<usize, f64>,
    rng: ChaCha8Rng,
}

impl Net {
    pub fn new(latency: Duration, transfer: Duration, seed: u64) -> Self {
        Net {
            latency,
            transfer,
            drop_rate: 0.0,
            cut: HashSet::new(),
            isolated: HashSet::new(),
            slow: HashMap::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// Cuts the link between `a` and `b`, both ways.
    pub fn cut(&mut self, a: usize, b: usize) {
        self.cut.insert((a.min(b), a.max(b)));
    }

    /// Puts `a` on a link `factor` times slower than the others (a home uplink).
    pub fn slow_link(&mut self, a: usize, factor: f64) {
        self.slow.insert(a, factor);
    }

    /// The one-way delay and the time to move one replica between `a` and `b`: the slower
    /// of their two links.
    pub fn between(&self, a: usize, b: usize) -> (Duration, Duration) {
        let factor = |p| self.slow.get(&p).copied().unwrap_or(1.0);
        let slower = factor(a).max(factor(b));
        (self.latency.mul_f64(slower), self.transfer.mul_f64(slower))
    }

    /// Cuts `a` off from every peer.
    pub fn isolate(&mut self, a: usize) {
        self.isolated.insert(a);
    }

    /// Mends every cut and ends every isolation.
    pub fn recover(&mut self) {
        self.cut.clear();
        self.isolated.clear();
    }

    /// Whether `a` and `b` can reach each other now (before random loss).
    pub fn linked(&self, a: usize, b: usize) -> bool {
        !self.isolated.contains(&a)
            && !self.isolated.contains(&b)
            && !self.cut.contains(&(a.min(b), a.max(b)))
    }

    /// Whether a message from `a` to `b` gets through: linked, and not lost.
    pub fn delivers(&mut self, a: usize, b: usize) -> bool {
        self.linked(a, b) && (self.drop_rate <= 0.0 || self.rng.random::<f64>() >= self.drop_rate)
    }
}
