//! What a scenario does to a simulated run (run, kill, restart, poison, slow down) and what it
//! reads of it.

use std::time::Duration;

use murmur_protocol::mix;

use super::{PeerStats, Sim, SimPeer};

impl Sim {
    /// Runs the events of the next `duration` of virtual time.
    pub fn run_for(&mut self, duration: Duration) {
        let end = self.now + duration;
        while let Some(next) = self.queue.first_entry() {
            if next.key().0 > end {
                break;
            }
            let ((at, _), event) = next.remove_entry();
            self.now = at;
            self.handle(event);
        }
        self.now = end;
    }

    /// Runs until every peer took `steps` steps (or `limit` of virtual time passed); returns
    /// whether they did.
    pub fn run_until_steps(&mut self, steps: u64, limit: Duration) -> bool {
        let end = self.now + limit;
        while self.now < end {
            if self.peers.iter().all(|p| !p.alive || p.step >= steps) {
                return true;
            }
            self.run_for(Duration::from_millis(100).min(end - self.now));
        }
        self.peers.iter().all(|p| !p.alive || p.step >= steps)
    }

    /// The peer's process dies: no goodbye, its connections go silent.
    pub fn kill(&mut self, i: usize) {
        let peer = &mut self.peers[i];
        peer.alive = false;
        peer.life += 1;
        // A dead side's machine and copies die with it, as its whole copy book does.
        for x in self.exchanges.values_mut() {
            if x.a == i {
                x.opener = None;
            }
            if x.b == i {
                x.answerer.take_answering();
            }
        }
        let events = self.ring.kill(i);
        self.ring_events(events);
    }

    /// The peer starts again from its last checkpoint, with a fresh engine.
    pub fn restart(&mut self, i: usize) {
        let old = &self.peers[i];
        let (id, life) = (old.id, old.life + 1);
        let mut peer = self.fresh_peer(id, i as u64 + u64::from(life) * 1000);
        let old = &self.peers[i];
        peer.life = life;
        peer.step = old.checkpoint.0;
        peer.replica = old.checkpoint.1.clone();
        peer.trainer.rules = self.rules_at(peer.step, &peer.replica);
        peer.checkpoint = old.checkpoint.clone();
        peer.slowness = old.slowness;
        peer.stats = old.stats.clone();
        // The same shard as before.
        peer.target = old.target.clone();
        self.peers[i] = peer;
        self.start_peer(i);
    }

    /// Makes peer `i` hostile: its replica is held at `value` in every coordinate, far from
    /// the others, whatever it trains or mixes, so that every peer it exchanges with gets it.
    pub fn poison(&mut self, i: usize, value: f32) {
        self.peers[i].poison = Some(value);
        self.peers[i].replica.fill(value);
    }

    /// Peer `i`'s replica.
    pub fn replica(&self, i: usize) -> &[f32] {
        &self.peers[i].replica
    }

    /// [`Sim::consensus_distance`] over the peers `which`.
    pub fn consensus_distance_of(&self, which: &[usize]) -> f64 {
        let replicas: Vec<&[f32]> = which
            .iter()
            .map(|&i| self.peers[i].replica.as_slice())
            .collect();
        mix::consensus_distance(&replicas).unwrap_or(0.0)
    }

    /// Makes peer `i` `factor` times slower.
    pub fn slow_down(&mut self, i: usize, factor: f64) {
        self.peers[i].slowness = factor;
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        self.now
    }

    pub fn step_of(&self, i: usize) -> u64 {
        self.peers[i].step
    }

    pub fn is_alive(&self, i: usize) -> bool {
        self.peers[i].alive
    }

    pub fn stats(&self, i: usize) -> &PeerStats {
        &self.peers[i].stats
    }

    /// Live peers in `i`'s table.
    pub fn live_peers_of(&self, i: usize) -> usize {
        self.peers[i].table.len()
    }

    /// Whether `i` is joining the run.
    pub fn is_joining(&self, i: usize) -> bool {
        self.peers[i].policy.is_joining()
    }

    /// The elastic center as `i` sees it.
    pub fn center_of(&self, i: usize) -> Option<usize> {
        let center = self.peers[i].policy.view().center?;
        self.index.get(&center).copied()
    }

    /// `max_i ||x_i - mean|| / ||mean||` over the live peers' replicas.
    pub fn consensus_distance(&self) -> f64 {
        let replicas: Vec<&[f32]> = self
            .peers
            .iter()
            .filter(|p| p.alive)
            .map(|p| p.replica.as_slice())
            .collect();
        mix::consensus_distance(&replicas).unwrap_or(0.0)
    }

    /// How far the live peers' mean replica is from the swarm's optimum (the mean of their
    /// shards' optima), relative to the optimum's norm: how far training has to go.
    pub fn distance_to_optimum(&self) -> f64 {
        let live: Vec<&SimPeer> = self.peers.iter().filter(|p| p.alive).collect();
        let mean = |of: &dyn Fn(&SimPeer) -> &[f32]| {
            let mut sum = vec![0.0f32; self.config.dim];
            for peer in &live {
                mix::add(&mut sum, of(peer));
            }
            mix::scale(&mut sum, 1.0 / live.len().max(1) as f32);
            sum
        };
        let optimum = mean(&|p| &p.target);
        mix::distance(&mean(&|p| &p.replica), &optimum) / mix::norm(&optimum)
    }

    /// Every (blocker, blocked) pair so far.
    pub fn blocks(&self) -> Vec<(usize, usize)> {
        self.peers
            .iter()
            .enumerate()
            .flat_map(|(i, p)| p.stats.blocked.iter().map(move |&j| (i, j)))
            .collect()
    }

    /// The longest gate wait of any peer.
    pub fn longest_gate_wait(&self) -> Duration {
        self.peers
            .iter()
            .map(|p| p.stats.longest_gate_wait)
            .max()
            .unwrap_or_default()
    }

    /// Timeouts of peers that were alive and linked, over all peers.
    pub fn live_peers_timed_out(&self) -> u64 {
        self.peers
            .iter()
            .map(|p| p.stats.live_peers_timed_out)
            .sum()
    }
}
