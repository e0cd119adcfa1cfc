//! A deterministic simulator of the sync engine's decisions: N peers, each a real [`Policy`]
//! with its own [`PeerTable`], offence scores and a model trainer, in virtual time, over a
//! network that can drop, delay, cut and isolate (raft-rs's test network is the model).
//!
//! Nothing moves but small messages: a replica is a vector of a few values that drifts as it
//! trains and moves toward its partners as it mixes, enough to give the policy's distance
//! checks something to judge; a ring round is its set-up and data flow (the `ring` module), not its
//! bytes. The trainer is modelled as the real one behaves: a step every `step_time`, a snapshot
//! every `interval` steps, a pause while its exchanges are in flight, a wait at the staleness
//! gate that ends when a heartbeat opens it. Heartbeats, exchanges and state syncs follow the
//! real protocols message by message. A run is reproducible from its seed.
//!
//! Scenarios are in `daemon/tests/simulation.rs`; `nodectl bench sim` times a large run.

mod net;
mod ring;

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, SyncMode};
use murmur_protocol::membership::Change;
use murmur_protocol::network::{Keypair, PeerId};
use murmur_protocol::ring::data_plane::DataPlane;
use murmur_protocol::ring::{RingError, TrustList};
use murmur_protocol::scoring::{PeerScores, Verdict};
use murmur_protocol::sync::{Gate, StalenessGate, mix_weight};
use murmur_trainer::averaging;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use super::policy::{Action, Answer, Failure, Input, Outcome, Policy, Request, View};
use super::validate::is_outlier;
use crate::config::ElasticTopology;
use crate::readout::PeerTable;
use crate::settings::{Outer, RingSettings, SyncSettings, Timeouts};
pub use net::Net;

/// What a simulated run is made of.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub peers: usize,
    pub mode: SyncMode,
    /// Elastic averaging with the pairwise topology (no center).
    pub elastic_gossip: bool,
    pub interval: u64,
    pub max_staleness: Option<u64>,
    /// Train on while exchanges are in flight.
    pub overlap: bool,
    /// `allreduce`: members the first round waits for.
    pub min_peers: usize,
    pub ring_timeout: Duration,
    /// Time of one local step (each peer's is this times its speed).
    pub step_time: Duration,
    pub latency: Duration,
    /// Time to move one replica.
    pub transfer: Duration,
    /// `allreduce`: the time of a round once the ring is connected.
    pub round_time: Duration,
    pub timeouts: Timeouts,
    /// Values in a model replica.
    pub dim: usize,
    /// How far one step moves a replica toward the optimum of its own shard (each peer's
    /// optimum differs, as shards do): what makes a replica that stops mixing drift away.
    pub pull: f32,
    /// Largest random change of a replica value in one step (the noise of a minibatch).
    pub noise: f32,
    /// Steps each peer trains; `None`: until the simulation ends.
    pub steps: Option<u64>,
    pub seed: u64,
}

impl SimConfig {
    /// `peers` gossiping every 8 steps within a bound of 16, on a LAN-like network.
    pub fn gossip(peers: usize) -> Self {
        SimConfig {
            peers,
            mode: SyncMode::Gossip,
            elastic_gossip: false,
            interval: 8,
            max_staleness: Some(16),
            overlap: false,
            min_peers: 1,
            ring_timeout: Duration::from_secs(5),
            step_time: Duration::from_millis(5),
            latency: Duration::from_micros(200),
            transfer: Duration::from_millis(2),
            round_time: Duration::from_millis(20),
            timeouts: Timeouts::default(),
            dim: 8,
            pull: 0.001,
            noise: 0.0005,
            steps: None,
            seed: 1,
        }
    }

    /// Elastic averaging with an elected center.
    pub fn elastic(peers: usize) -> Self {
        SimConfig {
            mode: SyncMode::Elastic,
            interval: 4,
            ..SimConfig::gossip(peers)
        }
    }

    /// Synchronous SGD over a ring of `peers` trusted peers, all needed for the first round.
    pub fn allreduce(peers: usize) -> Self {
        SimConfig {
            mode: SyncMode::Allreduce,
            interval: 1,
            max_staleness: Some(256),
            min_peers: peers,
            step_time: Duration::from_millis(50),
            ..SimConfig::gossip(peers)
        }
    }
}

/// What happened to one peer over a run.
#[derive(Clone, Debug, Default)]
pub struct PeerStats {
    pub steps: u64,
    /// Exchanges it started that mixed (ring rounds in `allreduce`).
    pub exchanges: u64,
    /// Exchanges it answered that mixed.
    pub served: u64,
    pub state_syncs: u64,
    /// The longest single wait at the staleness gate.
    pub longest_gate_wait: Duration,
    pub gate_wait: Duration,
    /// Peers it timed out while they were alive and linked to it.
    pub live_peers_timed_out: u64,
    /// Peers it blocked.
    pub blocked: Vec<usize>,
    /// Ring rounds that aborted.
    pub aborted_rounds: u64,
}

/// The trainer of a simulated peer: its clock, its replica, and what it waits for.
#[derive(Debug)]
struct ModelTrainer {
    /// Exchanges of the replica in flight: the due one, and those answered.
    pending: u32,
    /// The snapshot handed over and its step, while its exchange lasts.
    due: Option<(u64, Vec<f32>)>,
    gated_since: Option<Duration>,
    step_scheduled: bool,
    /// The step last announced in a heartbeat.
    announced: u64,
}

#[derive(Debug)]
struct SimPeer {
    id: PeerId,
    alive: bool,
    /// Bumped at every restart, so that events of an earlier life are ignored.
    life: u32,
    policy: Policy,
    table: PeerTable,
    scores: PeerScores<PeerId>,
    step: u64,
    replica: Vec<f32>,
    /// The optimum of this peer's shard.
    target: Vec<f32>,
    /// Where a restart resumes from: the last "checkpoint".
    checkpoint: (u64, Vec<f32>),
    center: Option<Vec<f32>>,
    inherited_center: Option<Vec<f32>>,
    trainer: ModelTrainer,
    /// Multiplies the step time: 2.0 is twice as slow.
    slowness: f64,
    /// A hostile peer's replica: held at this value, whatever it trains or mixes.
    poison: Option<f32>,
    rng: ChaCha8Rng,
    /// The request the policy is deciding on: who asked, in which exchange.
    request: Option<(usize, u64)>,
    /// The wake-up asked for, once scheduled.
    wake_at: Option<Duration>,
    stats: PeerStats,
}

/// The side of an exchange that started it (`a`) and that answers it (`b`).
#[derive(Clone, Debug)]
struct Exchange {
    kind: ExchangeKind,
    a: usize,
    b: usize,
    a_open: bool,
    b_open: bool,
    a_snapshot: Vec<f32>,
    a_step: u64,
    a_weight: f32,
    a_limit: Option<f64>,
    b_snapshot: Vec<f32>,
    b_weight: f32,
    b_limit: Option<f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExchangeKind {
    Pairwise,
    Elastic,
    State,
}

/// A message between peers.
#[derive(Clone, Debug)]
enum Msg {
    Heartbeat(Heartbeat),
    Offer {
        xid: u64,
        step: u64,
    },
    /// The partner's snapshot, or `None` for `Busy`.
    Answer {
        xid: u64,
        params: Option<(Vec<f32>, u64)>,
    },
    /// The initiator's snapshot, or `None` when it declined.
    Final {
        xid: u64,
        params: Option<(Vec<f32>, u64)>,
    },
    CenterRequest {
        xid: u64,
        step: u64,
    },
    CenterAnswer {
        xid: u64,
        delta: Option<(Vec<f32>, u64)>,
    },
    StateRequest {
        xid: u64,
    },
    StateAnswer {
        xid: u64,
        state: Option<(u64, Vec<f32>, Option<Vec<f32>>)>,
    },
    Ring(ring::Hello),
}

#[derive(Clone, Debug)]
enum Event {
    Step { peer: usize, life: u32 },
    Heartbeat { peer: usize, life: u32 },
    Tick { peer: usize, life: u32 },
    Wake { peer: usize, life: u32 },
    Deliver { from: usize, to: usize, msg: Msg },
    ExchangeTimeout(u64),
    Ring(ring::RingEvent),
}

/// An event due at a time; the queue pops the earliest, in the order scheduled.
#[derive(Debug)]
struct Scheduled {
    at: Duration,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at, other.seq).cmp(&(self.at, self.seq))
    }
}

/// The simulation.
#[derive(Debug)]
pub struct Sim {
    config: SimConfig,
    sync: SyncSettings,
    /// Virtual time zero.
    t0: Instant,
    now: Duration,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    peers: Vec<SimPeer>,
    index: HashMap<PeerId, usize>,
    pub net: Net,
    exchanges: HashMap<u64, Exchange>,
    next_xid: u64,
    ring: ring::RingModel,
}

const RUN_ID: &str = "sim";

impl Sim {
    pub fn new(config: SimConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        let ids: Vec<PeerId> = (0..config.peers)
            .map(|_| {
                let mut secret = [0u8; 32];
                rng.fill(&mut secret);
                Keypair::ed25519_from_bytes(secret)
                    .expect("invariant: 32 bytes are an ed25519 secret key")
                    .public()
                    .to_peer_id()
            })
            .collect();
        let sync = SyncSettings {
            mode: config.mode,
            interval: config.interval,
            max_staleness: config.max_staleness,
            age_weighting: false,
            overlap: config.overlap,
            slowdown: 1.0,
            alpha: None,
            topology: if config.elastic_gossip {
                ElasticTopology::Gossip
            } else {
                ElasticTopology::Center
            },
            center: None,
            seed: config.seed,
            ring: (config.mode == SyncMode::Allreduce).then(|| RingSettings {
                every: config.interval,
                outer: Outer::Average,
                plane: DataPlane::Libp2p,
                timeout: config.ring_timeout,
                min_peers: config.min_peers,
                sub_chunk: 1,
                trust: TrustList::new(ids.iter().copied()),
                listen: "127.0.0.1:0".parse().expect("invariant: an address"),
            }),
        };
        let t0 = Instant::now();
        let mut sim = Sim {
            net: Net::new(config.latency, config.transfer, config.seed ^ 0x5eed),
            ring: ring::RingModel::new(config.peers, config.latency, config.ring_timeout),
            index: ids.iter().enumerate().map(|(i, id)| (*id, i)).collect(),
            peers: Vec::new(),
            config,
            sync,
            t0,
            now: Duration::ZERO,
            queue: BinaryHeap::new(),
            seq: 0,
            exchanges: HashMap::new(),
            next_xid: 0,
        };
        for (i, id) in ids.into_iter().enumerate() {
            let peer = sim.fresh_peer(id, i as u64);
            sim.peers.push(peer);
            sim.start_peer(i);
        }
        sim
    }

    fn fresh_peer(&self, id: PeerId, salt: u64) -> SimPeer {
        let replica = vec![1.0; self.config.dim];
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.config.seed.wrapping_mul(31).wrapping_add(salt));
        let target = (0..self.config.dim)
            .map(|_| rng.random_range(0.5..1.5))
            .collect();
        SimPeer {
            id,
            alive: true,
            life: 0,
            policy: Policy::new(
                id,
                RUN_ID,
                self.sync.clone(),
                self.config.timeouts,
                self.instant(),
            ),
            table: PeerTable::new(self.config.timeouts.peer),
            scores: PeerScores::new(3, Duration::from_secs(60)),
            step: 0,
            checkpoint: (0, replica.clone()),
            replica,
            target,
            center: None,
            inherited_center: None,
            trainer: ModelTrainer {
                pending: 0,
                due: None,
                gated_since: None,
                step_scheduled: false,
                announced: 0,
            },
            slowness: 1.0,
            poison: None,
            rng,
            request: None,
            wake_at: None,
            stats: PeerStats::default(),
        }
    }

    /// Schedules a peer's first heartbeat, tick and step, at a random phase within a period.
    fn start_peer(&mut self, i: usize) {
        let life = self.peers[i].life;
        let phase = Duration::from_micros(
            self.peers[i]
                .rng
                .random_range(0..self.config.timeouts.heartbeat.as_micros() as u64),
        );
        self.schedule(phase, Event::Heartbeat { peer: i, life });
        self.schedule(phase, Event::Tick { peer: i, life });
        self.try_step(i);
    }

    fn instant(&self) -> Instant {
        self.t0 + self.now
    }

    fn schedule(&mut self, after: Duration, event: Event) {
        self.seq += 1;
        self.queue.push(Scheduled {
            at: self.now + after,
            seq: self.seq,
            event,
        });
    }

    // ---- the scenario's controls ----

    /// Runs the events of the next `duration` of virtual time.
    pub fn run_for(&mut self, duration: Duration) {
        let end = self.now + duration;
        while let Some(next) = self.queue.peek() {
            if next.at > end {
                break;
            }
            let Some(Scheduled { at, event, .. }) = self.queue.pop() else {
                break;
            };
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
        let closed: Vec<u64> = self
            .exchanges
            .iter()
            .filter(|(_, x)| x.a == i || x.b == i)
            .map(|(xid, _)| *xid)
            .collect();
        for xid in closed {
            if let Some(x) = self.exchanges.get_mut(&xid) {
                if x.a == i {
                    x.a_open = false;
                }
                if x.b == i {
                    x.b_open = false;
                }
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
        averaging::consensus_distance(&replicas).unwrap_or(0.0)
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
        averaging::consensus_distance(&replicas).unwrap_or(0.0)
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

    // ---- events ----

    fn handle(&mut self, event: Event) {
        match event {
            Event::Step { peer, life } if self.current(peer, life) => self.on_step(peer),
            Event::Heartbeat { peer, life } if self.current(peer, life) => self.on_heartbeat(peer),
            Event::Tick { peer, life } if self.current(peer, life) => {
                self.input(peer, Input::Tick);
                let life = self.peers[peer].life;
                self.schedule(self.config.timeouts.heartbeat, Event::Tick { peer, life });
            }
            Event::Wake { peer, life } if self.current(peer, life) => {
                self.peers[peer].wake_at = None;
                let due = self.peers[peer].policy.next_wake();
                if due.is_some_and(|at| at <= self.instant()) {
                    self.input(peer, Input::Wake);
                } else {
                    self.schedule_wake(peer);
                }
            }
            Event::Deliver { from, to, msg } if self.peers[to].alive => self.deliver(from, to, msg),
            Event::ExchangeTimeout(xid) => self.exchange_timeout(xid),
            Event::Ring(event) => {
                let events = self.ring.handle(event);
                self.ring_events(events);
            }
            _ => {}
        }
    }

    fn current(&self, i: usize, life: u32) -> bool {
        self.peers[i].alive && self.peers[i].life == life
    }

    /// Asks peer `i`'s policy about `input` and carries out what it decides.
    fn input(&mut self, i: usize, input: Input) {
        let now = self.instant();
        let actions = {
            let peer = &mut self.peers[i];
            let view = View {
                now,
                own_step: peer.step,
                peers: &peer.table,
            };
            peer.policy.handle(input, &view)
        };
        for action in actions {
            self.execute(i, action);
        }
        self.schedule_wake(i);
    }

    fn schedule_wake(&mut self, i: usize) {
        let Some(at) = self.peers[i].policy.next_wake() else {
            return;
        };
        let at = at.saturating_duration_since(self.t0);
        if self.peers[i]
            .wake_at
            .is_some_and(|scheduled| scheduled <= at)
        {
            return;
        }
        self.peers[i].wake_at = Some(at);
        let life = self.peers[i].life;
        self.schedule(at.saturating_sub(self.now), Event::Wake { peer: i, life });
    }

    fn send(&mut self, from: usize, to: usize, after: Duration, msg: Msg) {
        let blocked = self.peers[to].table.is_blocked(&self.peers[from].id)
            || self.peers[from].table.is_blocked(&self.peers[to].id);
        if self.peers[to].alive && !blocked && self.net.delivers(from, to) {
            self.schedule(after, Event::Deliver { from, to, msg });
        }
    }

    // ---- the model trainer ----

    /// Schedules the next step unless the trainer waits (for its exchanges, or at the gate).
    fn try_step(&mut self, i: usize) {
        let ring = self.config.mode == SyncMode::Allreduce;
        let (pause, gate) = {
            let p = &self.peers[i];
            if !p.alive || p.trainer.step_scheduled || self.finished(i) {
                return;
            }
            let pause = p.trainer.pending > 0 && (!self.config.overlap || ring);
            let slowest = p.table.min_coupled_step(self.config.mode);
            let gate = StalenessGate::new(self.config.max_staleness).check(p.step + 1, slowest);
            (pause, gate)
        };
        if pause {
            return;
        }
        let now = self.now;
        let peer = &mut self.peers[i];
        if let Gate::Closed { .. } = gate {
            peer.trainer.gated_since.get_or_insert(now);
            return;
        }
        if let Some(since) = peer.trainer.gated_since.take() {
            let waited = now - since;
            peer.stats.gate_wait += waited;
            peer.stats.longest_gate_wait = peer.stats.longest_gate_wait.max(waited);
        }
        peer.trainer.step_scheduled = true;
        // Real steps vary: without it every peer would reach its due step at the same moment.
        let jitter = peer.rng.random_range(0.8..1.2);
        let after = self.config.step_time.mul_f64(peer.slowness * jitter);
        let life = peer.life;
        self.schedule(after, Event::Step { peer: i, life });
    }

    fn finished(&self, i: usize) -> bool {
        self.config
            .steps
            .is_some_and(|steps| self.peers[i].step >= steps)
    }

    fn on_step(&mut self, i: usize) {
        self.peers[i].trainer.step_scheduled = false;
        if self.config.mode == SyncMode::Allreduce {
            // Synchronous SGD: the round of this step comes before the step's update.
            let peer = &mut self.peers[i];
            let round = peer.step;
            peer.trainer.pending += 1;
            peer.trainer.due = Some((round, peer.replica.clone()));
            self.input(i, Input::Due { step: round });
            return;
        }
        let (step, due) = {
            let peer = &mut self.peers[i];
            peer.step += 1;
            peer.stats.steps += 1;
            let (pull, noise) = (self.config.pull, self.config.noise);
            for (value, target) in peer.replica.iter_mut().zip(&peer.target) {
                *value += pull * (target - *value) + peer.rng.random_range(-noise..=noise);
            }
            if let Some(value) = peer.poison {
                peer.replica.fill(value);
            }
            if peer.step.is_multiple_of(100) {
                peer.checkpoint = (peer.step, peer.replica.clone());
            }
            let due = self.config.mode != SyncMode::Solo
                && peer.step.is_multiple_of(self.config.interval);
            if due {
                peer.trainer.pending += 1;
                peer.trainer.due = Some((peer.step, peer.replica.clone()));
            }
            (peer.step, due)
        };
        self.announce_if_moved(i);
        if due {
            self.input(i, Input::Due { step });
        }
        self.try_step(i);
    }

    /// The trainer's due exchange ended (with or without a mix).
    fn due_ended(&mut self, i: usize) {
        let trainer = &mut self.peers[i].trainer;
        if trainer.due.take().is_some() {
            trainer.pending = trainer.pending.saturating_sub(1);
        }
        self.try_step(i);
    }

    /// An exchange this peer answered ended.
    fn serve_ended(&mut self, i: usize) {
        let trainer = &mut self.peers[i].trainer;
        trainer.pending = trainer.pending.saturating_sub(1);
        self.try_step(i);
    }

    // ---- heartbeats and membership ----

    fn heartbeat(&self, i: usize) -> Heartbeat {
        let p = &self.peers[i];
        Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: RUN_ID.into(),
            fingerprint: "sim".into(),
            step: p.step,
            epoch: 0,
            loss_ema: 0.0,
            samples_seen: 0,
            mode: self.config.mode,
            role: p.policy.role(),
            leaving: false,
            finished: self.finished(i),
        }
    }

    fn publish(&mut self, i: usize) {
        let heartbeat = self.heartbeat(i);
        self.peers[i].trainer.announced = heartbeat.step;
        for j in 0..self.peers.len() {
            if j != i {
                self.send(i, j, self.net.latency, Msg::Heartbeat(heartbeat.clone()));
            }
        }
    }

    /// Peers gate on clocks in heartbeats: one that moved by half the bound goes out at once.
    fn announce_if_moved(&mut self, i: usize) {
        let every = self.config.max_staleness.map(|s| (s / 2).max(1));
        let p = &self.peers[i];
        if every.is_some_and(|every| p.step >= p.trainer.announced + every) {
            self.publish(i);
        }
    }

    fn on_heartbeat(&mut self, i: usize) {
        self.publish(i);
        self.expire(i);
        let life = self.peers[i].life;
        self.schedule(
            self.config.timeouts.heartbeat,
            Event::Heartbeat { peer: i, life },
        );
    }

    /// Times out the peers `i` has not heard from for the peer timeout.
    fn expire(&mut self, i: usize) {
        let now = self.instant();
        let changes = self.peers[i].table.members_mut().expire(now);
        if changes.is_empty() {
            return;
        }
        for change in changes {
            if let Change::TimedOut(peer) = change
                && let Some(&j) = self.index.get(&peer)
                && self.peers[j].alive
                && self.net.linked(i, j)
            {
                self.peers[i].stats.live_peers_timed_out += 1;
            }
        }
        self.input(i, Input::PeersChanged);
        self.try_step(i);
    }

    // ---- the policy's actions ----

    fn execute(&mut self, i: usize, action: Action) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, ?action, "action");
        match action {
            Action::Offer {
                peer,
                weight,
                limit,
            } => self.start_exchange(i, peer, ExchangeKind::Pairwise, weight, limit),
            Action::AskCenter { peer, limit } => {
                self.start_exchange(i, peer, ExchangeKind::Elastic, 1.0, limit);
            }
            Action::StepOwnCenter { alpha } => {
                let peer = &mut self.peers[i];
                if let (Some(center), Some((_, snapshot))) =
                    (peer.center.as_mut(), peer.trainer.due.as_ref())
                {
                    let delta = averaging::elastic_step(center, snapshot, alpha);
                    averaging::subtract(&mut peer.replica, &delta);
                    peer.stats.exchanges += 1;
                }
                self.due_ended(i);
            }
            Action::Release => self.due_ended(i),
            Action::Serve { peer, answer } => self.serve(i, peer, answer),
            Action::PullState { peer } => {
                self.start_exchange(i, peer, ExchangeKind::State, 0.0, None)
            }
            Action::Round {
                round,
                members,
                attempt,
            } => {
                let snapshot = self.peers[i]
                    .trainer
                    .due
                    .as_ref()
                    .map(|(_, s)| s.clone())
                    .unwrap_or_default();
                let index = &self.index;
                let order: Vec<usize> = members
                    .peers()
                    .iter()
                    .filter_map(|p| index.get(p).copied())
                    .collect();

                let events = self
                    .ring
                    .start(i, round, attempt, &order, members.hash(), snapshot);
                self.ring_events(events);
            }
            Action::Cancel { peer } => self.cancel(i, peer),
            Action::Offence { peer, .. } => {
                let now = self.instant();
                let p = &mut self.peers[i];
                if p.scores.offence(&peer, now) == Verdict::Block {
                    p.table.block(peer);
                    if let Some(&j) = self.index.get(&peer) {
                        p.stats.blocked.push(j);
                    }
                }
            }
            Action::Publish(_) => {}
            Action::SeedCenter => {
                let p = &mut self.peers[i];
                p.center = Some(
                    p.inherited_center
                        .take()
                        .unwrap_or_else(|| p.replica.clone()),
                );
                self.input(i, Input::CenterSeeded { ok: true });
            }
            Action::DropCenter => self.peers[i].center = None,
        }
    }

    fn start_exchange(
        &mut self,
        a: usize,
        peer: PeerId,
        kind: ExchangeKind,
        weight: f32,
        limit: Option<f64>,
    ) {
        let Some(&b) = self.index.get(&peer) else {
            return;
        };
        let (a_step, a_snapshot) = match kind {
            ExchangeKind::State => (self.peers[a].step, Vec::new()),
            _ => self.peers[a]
                .trainer
                .due
                .clone()
                .unwrap_or_else(|| (self.peers[a].step, self.peers[a].replica.clone())),
        };
        let xid = self.next_xid;
        self.next_xid += 1;
        self.exchanges.insert(
            xid,
            Exchange {
                kind,
                a,
                b,
                a_open: true,
                b_open: false,
                a_snapshot: a_snapshot.clone(),
                a_step,
                a_weight: weight,
                a_limit: limit,
                b_snapshot: Vec::new(),
                b_weight: 0.0,
                b_limit: None,
            },
        );
        let (latency, transfer) = (self.net.latency, self.net.transfer);
        let msg = match kind {
            ExchangeKind::Pairwise => Msg::Offer { xid, step: a_step },
            ExchangeKind::Elastic => Msg::CenterRequest { xid, step: a_step },
            ExchangeKind::State => Msg::StateRequest { xid },
        };
        let after = if kind == ExchangeKind::Elastic {
            latency + transfer
        } else {
            latency
        };
        self.send(a, b, after, msg);
        self.schedule(self.config.timeouts.exchange, Event::ExchangeTimeout(xid));
    }

    /// Answers the request `i`'s policy decided on.
    fn serve(&mut self, i: usize, peer: PeerId, answer: Answer) {
        let Some((from, xid)) = self.peers[i].request.take() else {
            return;
        };
        if self.peers[from].id != peer {
            return;
        }
        let (latency, transfer) = (self.net.latency, self.net.transfer);
        let step = self.peers[i].step;
        match answer {
            Answer::Busy => {
                let msg = match self.exchanges.get(&xid).map(|x| x.kind) {
                    Some(ExchangeKind::Elastic) => Msg::CenterAnswer { xid, delta: None },
                    Some(ExchangeKind::State) => Msg::StateAnswer { xid, state: None },
                    _ => Msg::Answer { xid, params: None },
                };
                self.send(i, from, latency, msg);
            }
            Answer::Exchange { weight, limit } => {
                let snapshot = self.peers[i].replica.clone();
                if let Some(x) = self.exchanges.get_mut(&xid) {
                    x.b_open = true;
                    x.b_snapshot = snapshot.clone();
                    x.b_weight = weight;
                    x.b_limit = limit;
                }
                self.peers[i].trainer.pending += 1;
                self.send(
                    i,
                    from,
                    latency + transfer,
                    Msg::Answer {
                        xid,
                        params: Some((snapshot, step)),
                    },
                );
            }
            Answer::Center { alpha, limit } => {
                let Some(x) = self.exchanges.get(&xid).cloned() else {
                    return;
                };
                let weight = mix_weight(step, x.a_step, self.config.max_staleness, 1.0, false);
                let worker = &x.a_snapshot;
                let peer = &mut self.peers[i];
                let outcome = match (peer.center.as_mut(), weight) {
                    (Some(center), Some(weight)) => {
                        let distance = averaging::distance(worker, center);
                        if is_outlier(distance, limit, center) {
                            Err(Outcome::Outlier { distance })
                        } else {
                            Ok((
                                distance,
                                averaging::elastic_step(center, worker, alpha * weight),
                            ))
                        }
                    }
                    (Some(_), None) => Err(Outcome::Stale),
                    (None, _) => Err(Outcome::Busy),
                };
                match outcome {
                    Ok((distance, delta)) => {
                        peer.stats.served += 1;
                        self.send(
                            i,
                            from,
                            latency + transfer,
                            Msg::CenterAnswer {
                                xid,
                                delta: Some((delta, step)),
                            },
                        );
                        self.input(
                            i,
                            Input::Served {
                                peer: self.peers[from].id,
                                outcome: Outcome::Mixed { distance },
                            },
                        );
                    }
                    Err(outcome) => {
                        self.send(i, from, latency, Msg::CenterAnswer { xid, delta: None });
                        if matches!(outcome, Outcome::Outlier { .. }) {
                            self.input(
                                i,
                                Input::Served {
                                    peer: self.peers[from].id,
                                    outcome,
                                },
                            );
                        }
                    }
                }
            }
            Answer::State => {
                let p = &self.peers[i];
                let state = (p.step, p.replica.clone(), p.center.clone());
                self.send(
                    i,
                    from,
                    latency + transfer,
                    Msg::StateAnswer {
                        xid,
                        state: Some(state),
                    },
                );
            }
        }
    }

    /// Gives up `i`'s exchanges with `peer`, which left.
    fn cancel(&mut self, i: usize, peer: PeerId) {
        let Some(&j) = self.index.get(&peer) else {
            return;
        };
        let involved: Vec<u64> = self
            .exchanges
            .iter()
            .filter(|(_, x)| {
                (x.a == i && x.b == j && x.a_open) || (x.b == i && x.a == j && x.b_open)
            })
            .map(|(xid, _)| *xid)
            .collect();
        for xid in involved {
            self.end_side(xid, i, Outcome::Failed(Failure::PeerLeft));
        }
    }

    /// Ends `i`'s side of exchange `xid` with `outcome`, as a failure would.
    fn end_side(&mut self, xid: u64, i: usize, outcome: Outcome) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (kind, a, b) = (x.kind, x.a, x.b);
        if a == i && x.a_open {
            x.a_open = false;
            let peer = self.peers[b].id;
            match kind {
                ExchangeKind::State => self.input(
                    i,
                    Input::StateSynced {
                        peer,
                        result: Err(outcome),
                    },
                ),
                _ => self.input(i, Input::Exchanged { peer, outcome }),
            }
        } else if b == i && x.b_open {
            x.b_open = false;
            let peer = self.peers[a].id;
            self.serve_ended(i);
            self.input(i, Input::Served { peer, outcome });
        }
        self.forget_if_closed(xid);
    }

    fn forget_if_closed(&mut self, xid: u64) {
        if self
            .exchanges
            .get(&xid)
            .is_some_and(|x| !x.a_open && !x.b_open)
        {
            self.exchanges.remove(&xid);
        }
    }

    fn exchange_timeout(&mut self, xid: u64) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (a, b, a_open, b_open) = (x.a, x.b, x.a_open, x.b_open);
        if a_open {
            self.end_side(xid, a, Outcome::Failed(Failure::TimedOut));
        }
        if b_open {
            self.end_side(xid, b, Outcome::Failed(Failure::TimedOut));
        }
        // An exchange whose responder never answered is forgotten too.
        if let Some(x) = self.exchanges.get(&xid)
            && !x.a_open
        {
            self.exchanges.remove(&xid);
        }
    }

    // ---- messages ----

    fn deliver(&mut self, from: usize, to: usize, msg: Msg) {
        let peer = self.peers[from].id;
        match msg {
            Msg::Heartbeat(heartbeat) => {
                let now = self.instant();
                let p = &mut self.peers[to];
                if p.table.is_blocked(&peer) {
                    return;
                }
                p.table.members_mut().observe(peer, &heartbeat, now);
                self.input(to, Input::PeersChanged);
                self.try_step(to);
            }
            Msg::Offer { xid, step } => {
                self.peers[to].request = Some((from, xid));
                self.input(
                    to,
                    Input::Request {
                        peer,
                        request: Request::Offer { step },
                    },
                );
                self.peers[to].request = None;
            }
            Msg::CenterRequest { xid, step, .. } => {
                self.peers[to].request = Some((from, xid));
                self.input(
                    to,
                    Input::Request {
                        peer,
                        request: Request::Params { step },
                    },
                );
                self.peers[to].request = None;
            }
            Msg::StateRequest { xid } => {
                self.peers[to].request = Some((from, xid));
                self.input(
                    to,
                    Input::Request {
                        peer,
                        request: Request::State,
                    },
                );
                self.peers[to].request = None;
            }
            Msg::Answer { xid, params } => self.on_answer(xid, from, to, params),
            Msg::Final { xid, params } => self.on_final(xid, from, to, params),
            Msg::CenterAnswer { xid, delta } => self.on_center_answer(xid, to, delta),
            Msg::StateAnswer { xid, state } => self.on_state_answer(xid, from, to, state),
            Msg::Ring(hello) => {
                let events = self.ring.hello(to, hello);
                self.ring_events(events);
            }
        }
    }

    /// The initiator reads the partner's snapshot (or `Busy`), declines or sends its own, mixes.
    fn on_answer(&mut self, xid: u64, b: usize, a: usize, params: Option<(Vec<f32>, u64)>) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        let latency = self.net.latency;
        if !x.a_open {
            // The initiator gave up: the responder's stream ends.
            self.send(a, b, latency, Msg::Final { xid, params: None });
            return;
        }
        let Some((theirs, their_step)) = params else {
            self.end_side(xid, a, Outcome::Busy);
            return;
        };
        let distance = averaging::distance(&theirs, &x.a_snapshot);
        let weight = mix_weight(
            x.a_step,
            their_step,
            self.config.max_staleness,
            x.a_weight,
            false,
        );
        let outcome = if is_outlier(distance, x.a_limit, &x.a_snapshot) {
            Outcome::Outlier { distance }
        } else if weight.is_none() {
            Outcome::Stale
        } else {
            Outcome::Mixed { distance }
        };
        if let (Outcome::Mixed { .. }, Some(weight)) = (&outcome, weight) {
            let transfer = self.net.transfer;
            self.send(
                a,
                b,
                latency + transfer,
                Msg::Final {
                    xid,
                    params: Some((x.a_snapshot.clone(), x.a_step)),
                },
            );
            let p = &mut self.peers[a];
            averaging::mix_toward(&mut p.replica, &theirs, &x.a_snapshot, weight);
            p.stats.exchanges += 1;
            if let Some(x) = self.exchanges.get_mut(&xid) {
                x.a_open = false;
            }
            self.forget_if_closed(xid);
            self.input(
                a,
                Input::Exchanged {
                    peer: self.peers[b].id,
                    outcome,
                },
            );
            self.due_ended(a);
        } else {
            self.send(a, b, latency, Msg::Final { xid, params: None });
            self.end_side(xid, a, outcome);
        }
    }

    /// The responder reads the initiator's snapshot (or its refusal) and mixes.
    fn on_final(&mut self, xid: u64, a: usize, b: usize, params: Option<(Vec<f32>, u64)>) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.b_open {
            return;
        }
        let Some((theirs, _)) = params else {
            self.end_side(xid, b, Outcome::Busy);
            return;
        };
        let distance = averaging::distance(&theirs, &x.b_snapshot);
        let outcome = if is_outlier(distance, x.b_limit, &x.b_snapshot) {
            Outcome::Outlier { distance }
        } else {
            let p = &mut self.peers[b];
            averaging::mix_toward(&mut p.replica, &theirs, &x.b_snapshot, x.b_weight);
            p.stats.served += 1;
            Outcome::Mixed { distance }
        };
        let _ = a;
        self.end_side(xid, b, outcome);
    }

    fn on_center_answer(&mut self, xid: u64, w: usize, delta: Option<(Vec<f32>, u64)>) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.a_open {
            return;
        }
        let Some((delta, center_step)) = delta else {
            self.end_side(xid, w, Outcome::Busy);
            return;
        };
        let norm = averaging::norm(&delta);
        let outcome = if is_outlier(norm, x.a_limit, &x.a_snapshot) {
            Outcome::Outlier { distance: norm }
        } else if mix_weight(x.a_step, center_step, self.config.max_staleness, 1.0, false).is_none()
        {
            Outcome::Stale
        } else {
            Outcome::Mixed { distance: norm }
        };
        if matches!(outcome, Outcome::Mixed { .. }) {
            let p = &mut self.peers[w];
            averaging::subtract(&mut p.replica, &delta);
            p.stats.exchanges += 1;
            if let Some(x) = self.exchanges.get_mut(&xid) {
                x.a_open = false;
            }
            self.forget_if_closed(xid);
            self.input(
                w,
                Input::Exchanged {
                    peer: self.peers[x.b].id,
                    outcome,
                },
            );
            self.due_ended(w);
        } else {
            self.end_side(xid, w, outcome);
        }
    }

    fn on_state_answer(
        &mut self,
        xid: u64,
        source: usize,
        j: usize,
        state: Option<(u64, Vec<f32>, Option<Vec<f32>>)>,
    ) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.a_open {
            return;
        }
        let Some((step, replica, center)) = state else {
            self.end_side(xid, j, Outcome::Failed(Failure::Stream("busy".into())));
            return;
        };
        if let Some(x) = self.exchanges.get_mut(&xid) {
            x.a_open = false;
        }
        self.forget_if_closed(xid);
        let p = &mut self.peers[j];
        p.step = step;
        p.replica = replica;
        if center.is_some() {
            p.inherited_center = center;
        }
        p.stats.state_syncs += 1;
        let peer = self.peers[source].id;
        self.input(
            j,
            Input::StateSynced {
                peer,
                result: Ok(step),
            },
        );
        self.try_step(j);
    }

    // ---- rings ----

    fn ring_events(&mut self, events: Vec<ring::Output>) {
        for event in events {
            match event {
                ring::Output::Schedule { after, event } => self.schedule(after, Event::Ring(event)),
                ring::Output::Send {
                    from,
                    to,
                    after,
                    hello,
                } => self.send(from, to, after, Msg::Ring(hello)),
                ring::Output::Ended {
                    peer,
                    round,
                    result,
                } => self.round_ended(peer, round, result),
            }
        }
    }

    /// A ring attempt of `i` ended: with the round's mean, or aborted.
    fn round_ended(&mut self, i: usize, round: u64, result: Result<Vec<f32>, RingError>) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, round, ok = result.is_ok(), "ring attempt ended");
        if !self.peers[i].alive {
            return;
        }
        match result {
            Ok(mean) => {
                let p = &mut self.peers[i];
                p.replica = mean;
                p.step += 1;
                p.stats.steps += 1;
                p.stats.exchanges += 1;
                if p.step.is_multiple_of(100) {
                    p.checkpoint = (p.step, p.replica.clone());
                }
                self.input(
                    i,
                    Input::RoundEnded {
                        round,
                        result: Ok(()),
                    },
                );
                self.announce_if_moved(i);
                self.due_ended(i);
            }
            Err(error) => {
                self.peers[i].stats.aborted_rounds += 1;
                self.input(
                    i,
                    Input::RoundEnded {
                        round,
                        result: Err(error),
                    },
                );
            }
        }
    }
}
