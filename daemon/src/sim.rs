//! The simulator (feature `sim`): many peers in one process, each the node's own membership
//! actor, sync engine and replica driver, on the protocol crate's simulated network, in the
//! virtual time of a tokio runtime whose clock is paused. The runtime advances the clock to
//! the next timer whenever every task waits, so a minute of a swarm takes as long as its work.
//!
//! Nothing of the protocols is the simulator's: it starts nodes, carries their bytes over
//! links that delay, throttle, lose heartbeats and cut, kills and restarts them, and reads
//! what their read sides say (decision 0080). Its replicas (`sim/replica.rs`) are vectors of
//! a few values, each drawn toward the optimum of its own shard: enough to give the distance
//! checks something to judge. Scenarios are in `daemon/tests/simulation.rs`; `nodectl bench
//! sim`, in a nodectl built with the `sim` feature, times a large run.
//!
//! A run is reproducible from its seed: the runtime polls its tasks in order, and the network
//! iterates ordered maps. Nothing guards against tokio's own randomness (`select!` without
//! `biased`); the same-seed scenario is what would show its loss.

mod replica;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use murmur_protocol::codec::Codec;
use murmur_protocol::heartbeat::Role;
use murmur_protocol::mix;
use murmur_protocol::network::simulated::{Link, SimulatedNetwork};
use murmur_protocol::network::{Keypair, NetworkConfig, PeerId};
use murmur_protocol::ring::DataPlane;
use murmur_protocol::trust::TrustList;
use murmur_protocol::wire::{self, MessageKind, TensorHeader};
use murmur_sync::copies::Copies;
use murmur_sync::settings::{ElasticSettings, Mode, Outer, RingSettings, SyncSettings, Timeouts};
use murmur_sync::table::PeerTable;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use tokio::runtime::Runtime;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::ClientMode;
use crate::node::replica::driver::ReplicaDriver;
use crate::node::{self, Part, book};
use crate::readout::{Count, Readout};
use crate::settings::{Identity, NodeSettings};
use crate::store::{DataDir, Store};
use replica::{SimReplica, Trained};

const RUN_ID: &str = "sim";

/// What a simulated run is made of.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub peers: usize,
    /// Every peer's sync settings, as a node resolves them from its config. Their seed is the
    /// run's (the peers' keys and shards come from it too); their trust list is set to the
    /// simulated peers, each trusting the others.
    pub sync: SyncSettings,
    pub timeouts: Timeouts,
    /// Time of one local step (each peer's is this times its slowness, and varies by a fifth).
    pub step_time: Duration,
    pub latency: Duration,
    /// Time to move one replica over a link (a frame of its values): what sets the links'
    /// rate.
    pub transfer: Duration,
    /// Values in a model replica.
    pub dim: usize,
    /// How far one step moves a replica toward the optimum of its own shard (each peer's
    /// optimum differs, as shards do): what makes a replica that stops mixing drift away.
    pub pull: f32,
    /// Largest random change of a replica value in one step (the noise of a minibatch).
    pub noise: f32,
    /// Steps each peer trains; `None`: until the simulation ends.
    pub steps: Option<u64>,
    /// Partners whose pair copies each node keeps (`[memory]`); `None`: every partner's.
    pub pair_copies: Option<u64>,
}

impl SimConfig {
    /// `peers` gossiping every 8 steps within a bound of 16, on a LAN-like network.
    pub fn gossip(peers: usize) -> Self {
        SimConfig {
            peers,
            sync: SyncSettings {
                mode: Mode::Gossip,
                interval: 8,
                max_staleness: Some(16),
                age_weighting: false,
                overlap: false,
                max_merge_lag: 256,
                adapt_interval: false,
                outer: Outer::Average,
                codec: Codec::F32,
                sparse_codec: None,
                slowdown: 1.0,
                relayed_exchanges: false,
                seed: 1,
                trust: TrustList::default(),
            },
            timeouts: Timeouts::default(),
            step_time: Duration::from_millis(5),
            latency: Duration::from_micros(200),
            transfer: Duration::from_millis(2),
            dim: 8,
            pull: 0.001,
            noise: 0.0005,
            steps: None,
            pair_copies: None,
        }
    }

    /// Elastic averaging with an elected center.
    pub fn elastic(peers: usize) -> Self {
        let mut config = SimConfig::gossip(peers);
        config.sync.mode = Mode::Elastic(ElasticSettings::default());
        config.sync.interval = 4;
        config
    }

    /// Synchronous SGD over a ring of `peers` trusted peers, all needed for the first round.
    pub fn allreduce(peers: usize) -> Self {
        let mut config = SimConfig::gossip(peers);
        config.sync.mode = Mode::Allreduce(RingSettings {
            every: 1,
            outer: Outer::Average,
            plane: DataPlane::Libp2p,
            timeout: Duration::from_secs(5),
            min_peers: peers,
            sub_chunk: 1,
            // Unused: the libp2p plane carries the ring's data.
            listen: ([127, 0, 0, 1], 0).into(),
        });
        config.sync.interval = 1;
        config.sync.max_staleness = Some(256);
        config.step_time = Duration::from_millis(50);
        config
    }
}

/// What one peer did over a run, from its nodes' read sides (every life of it).
#[derive(Clone, Debug, Default)]
pub struct PeerStats {
    pub steps: u64,
    /// Exchanges it started that mixed (ring rounds in `allreduce`).
    pub exchanges: u64,
    /// Exchanges it answered that mixed.
    pub served: u64,
    pub state_syncs: u64,
    /// Exchanges that failed on the way (ring rounds that aborted).
    pub failed: u64,
    /// The longest single wait at the staleness gate.
    pub longest_gate_wait: Duration,
    pub gate_wait: Duration,
    /// Exchanges (started or answered) mixed through the sparse codec of a slow link.
    pub sparse: u64,
    /// Times the staleness gate stopped waiting for a peer that held it past its patience.
    pub uncoupled: u64,
    /// The most local steps between a snapshot and its mix.
    pub max_merge_lag: u64,
    /// Pairs whose copies the node dropped to keep within its budget.
    pub pairs_dropped: u64,
    /// Bytes of pair copies the node holds now (this life's).
    pub pair_copies_bytes: u64,
    /// Of those, the pairs whose copies an exchange holds now.
    pub pair_copies_lent: u64,
}

impl PeerStats {
    fn of(readout: &Readout) -> Self {
        let counters = readout.counters();
        let copies = readout.pair_copies();
        PeerStats {
            steps: readout.progress().step,
            exchanges: counters.get(Count::Exchange),
            served: counters.get(Count::Served),
            state_syncs: counters.get(Count::StateSync),
            failed: counters.get(Count::Failed),
            longest_gate_wait: Duration::from_secs_f64(counters.longest_gate_wait_s()),
            gate_wait: Duration::from_secs_f64(counters.value(Count::GateWait)),
            sparse: counters.get(Count::Sparse),
            uncoupled: counters.get(Count::PeerUncoupled),
            max_merge_lag: counters.max_merge_lag(),
            pairs_dropped: copies.dropped,
            pair_copies_bytes: copies.bytes,
            pair_copies_lent: copies.lent as u64,
        }
    }

    /// This life's figures after those of the lives before.
    fn after(&self, earlier: &PeerStats) -> Self {
        PeerStats {
            steps: self.steps,
            exchanges: earlier.exchanges + self.exchanges,
            served: earlier.served + self.served,
            state_syncs: earlier.state_syncs + self.state_syncs,
            failed: earlier.failed + self.failed,
            longest_gate_wait: earlier.longest_gate_wait.max(self.longest_gate_wait),
            gate_wait: earlier.gate_wait + self.gate_wait,
            sparse: earlier.sparse + self.sparse,
            uncoupled: earlier.uncoupled + self.uncoupled,
            max_merge_lag: earlier.max_merge_lag.max(self.max_merge_lag),
            pairs_dropped: earlier.pairs_dropped + self.pairs_dropped,
            pair_copies_bytes: self.pair_copies_bytes,
            pair_copies_lent: self.pair_copies_lent,
        }
    }
}

/// A simulated run.
pub struct Sim {
    runtime: Runtime,
    network: SimulatedNetwork,
    config: SimConfig,
    started: tokio::time::Instant,
    /// The nodes' data dirs.
    dir: tempfile::TempDir,
    peers: Vec<SimPeer>,
}

struct SimPeer {
    keypair: Keypair,
    id: PeerId,
    /// The optimum of this peer's shard.
    optimum: Vec<f32>,
    trained: replica::Shared,
    /// The running node; `None` once killed.
    node: Option<SimNode>,
    /// Peers its nodes lost from their tables while the peers were alive and connected to
    /// them: timeouts of live peers.
    live_peers_lost: Arc<AtomicU64>,
    lives: u64,
    /// What its earlier lives did.
    earlier: PeerStats,
}

struct SimNode {
    readout: Readout,
    /// Its actors: dropping the set kills them.
    _actors: JoinSet<Result<Part>>,
    /// The simulator's watch on its table.
    _watching: JoinSet<()>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("config", &self.config)
            .field("elapsed", &self.elapsed())
            .finish_non_exhaustive()
    }
}

impl Sim {
    /// Starts `config.peers` nodes, all at once.
    pub fn new(config: SimConfig) -> Result<Sim> {
        let mut config = config;
        let mut rng = ChaCha8Rng::seed_from_u64(config.sync.seed);
        let keys: Vec<Keypair> = (0..config.peers)
            .map(|_| {
                let mut secret = [0u8; 32];
                rng.fill(&mut secret);
                Keypair::ed25519_from_bytes(secret).expect("invariant: 32 bytes are a secret key")
            })
            .collect();
        let ids: Vec<PeerId> = keys.iter().map(|k| k.public().to_peer_id()).collect();
        config.sync.trust = TrustList::new(ids.iter().copied());
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .context("cannot start the simulator's runtime")?;
        let fingerprint = replica::model(config.dim).fingerprint();
        let rate = frame_bytes(config.dim, &fingerprint) as f64 / config.transfer.as_secs_f64();
        let network = SimulatedNetwork::new(
            RUN_ID,
            &fingerprint,
            Link::new(config.latency, rate),
            config.sync.seed ^ 0x5eed,
        );
        let started = runtime.block_on(async { tokio::time::Instant::now() });
        let peers = keys
            .into_iter()
            .map(|keypair| SimPeer {
                id: keypair.public().to_peer_id(),
                keypair,
                optimum: (0..config.dim)
                    .map(|_| rng.random_range(0.5..1.5))
                    .collect(),
                trained: Arc::new(std::sync::Mutex::new(Trained {
                    params: vec![1.0; config.dim],
                    step: 0,
                    checkpoint: (0, vec![1.0; config.dim]),
                    poison: None,
                    slowness: 1.0,
                })),
                node: None,
                live_peers_lost: Arc::default(),
                lives: 0,
                earlier: PeerStats::default(),
            })
            .collect();
        let mut sim = Sim {
            runtime,
            network,
            config,
            started,
            dir: tempfile::tempdir().context("cannot make the simulator's data dir")?,
            peers,
        };
        for i in 0..sim.peers.len() {
            sim.start(i)?;
        }
        Ok(sim)
    }

    /// Starts peer `i`'s node: a new life, from what its replica holds.
    fn start(&mut self, i: usize) -> Result<()> {
        let _runtime = self.runtime.enter();
        let config = &self.config;
        let peer = &mut self.peers[i];
        peer.lives += 1;
        let model = replica::model(config.dim);
        let identity = Identity {
            peer_id: peer.id,
            run_id: RUN_ID.into(),
            fingerprint: model.fingerprint(),
            model: "sim".into(),
            device: "cpu".into(),
            epochs: 0,
            param_count: config.dim,
            optimizer_buffers: Vec::new(),
        };
        let data = DataDir::new(self.dir.path().join(format!("{i}-{}", peer.lives)));
        std::fs::create_dir_all(data.checkpoints()).context("cannot make a node's data dir")?;
        let settings = NodeSettings {
            network: NetworkConfig::new(peer.keypair.clone(), RUN_ID, &identity.fingerprint),
            identity: identity.clone(),
            sync: config.sync.clone(),
            timeouts: config.timeouts,
            api_addr: String::new(),
            data,
            client: ClientMode::Never,
            pair_copies_budget: config.pair_copies.map_or(u64::MAX, |partners| {
                partners * Copies::bytes_for(config.dim)
            }),
        };
        let (client, events) = self.network.join(peer.id);
        let leave = CancellationToken::new();
        let (readout, feeds) = Readout::new(
            identity,
            config.sync.clone(),
            config.timeouts.peer,
            leave.clone(),
            client.dropped_events(),
        );
        let store = Arc::new(Store::open(&settings.data.store_path())?);
        // The peer book's writer is not run: a simulated node has no addresses to remember.
        let (book, _writer) = book::writer(Arc::clone(&store));
        let mut actors = JoinSet::new();
        let ports = node::start_sync(
            &mut actors,
            &settings,
            (client, events),
            (&readout, feeds),
            book,
            model,
            &leave,
        );
        let seed = config.sync.seed ^ ((i as u64) << 16) ^ peer.lives;
        let replica = SimReplica::new(
            Arc::clone(&peer.trained),
            peer.optimum.clone(),
            (config.pull, config.noise),
            config.steps,
            seed,
        );
        let driver = ReplicaDriver::new(
            Box::new(replica),
            readout.clone(),
            store,
            config.sync.clone(),
            ports,
        )?;
        let (step_time, trained) = (config.step_time, Arc::clone(&peer.trained));
        let mut jitter = ChaCha8Rng::seed_from_u64(seed);
        let pace = move || {
            let slowness = replica::lock(&trained).slowness;
            // Real steps vary: without it every peer would reach its due step at once.
            step_time.mul_f64(slowness * jitter.random_range(0.8..1.2))
        };
        actors.spawn(async move { driver.drive(pace).await.map(|()| Part::Replica) });
        let mut watching = JoinSet::new();
        watching.spawn(watch_for_live_peers_lost(
            self.network.clone(),
            peer.id,
            readout.watch_peers(),
            Arc::clone(&peer.live_peers_lost),
        ));
        peer.node = Some(SimNode {
            readout,
            _actors: actors,
            _watching: watching,
        });
        Ok(())
    }

    /// Runs the next `duration` of virtual time.
    pub fn run_for(&mut self, duration: Duration) {
        self.runtime
            .block_on(async move { tokio::time::sleep(duration).await });
    }

    /// Runs until every live peer took `steps` steps (or `limit` of virtual time passed);
    /// returns whether they did.
    pub fn run_until_steps(&mut self, steps: u64, limit: Duration) -> bool {
        let end = self.elapsed() + limit;
        loop {
            let done = (0..self.peers()).all(|i| !self.is_alive(i) || self.step_of(i) >= steps);
            if done || self.elapsed() >= end {
                return done;
            }
            self.run_for(Duration::from_millis(100).min(end - self.elapsed()));
        }
    }

    /// The peer's process dies: no goodbye, its streams break, its links go silent.
    pub fn kill(&mut self, i: usize) {
        let peer = &mut self.peers[i];
        if let Some(node) = peer.node.take() {
            peer.earlier = PeerStats::of(&node.readout).after(&peer.earlier);
            let _runtime = self.runtime.enter();
            drop(node);
        }
        self.network.leave(peer.id);
    }

    /// The peer starts again from its last checkpoint, with a fresh node.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.kill(i);
        {
            let mut trained = replica::lock(&self.peers[i].trained);
            let (step, params) = trained.checkpoint.clone();
            trained.step = step;
            trained.params = params;
        }
        self.start(i)
    }

    /// Makes peer `i` hostile: its replica is held at `value` in every coordinate, far from
    /// the others, whatever it trains or mixes, so that every peer it exchanges with gets it.
    pub fn poison(&mut self, i: usize, value: f32) {
        let mut trained = replica::lock(&self.peers[i].trained);
        trained.poison = Some(value);
        trained.params.fill(value);
    }

    /// Makes peer `i` `factor` times slower.
    pub fn slow_down(&mut self, i: usize, factor: f64) {
        replica::lock(&self.peers[i].trained).slowness = factor;
    }

    /// The link between peers `a` and `b`, to read or change.
    pub fn link(&self, a: usize, b: usize) -> Link {
        self.network.link(self.peers[a].id, self.peers[b].id)
    }

    pub fn set_link(&mut self, a: usize, b: usize, link: Link) {
        self.network
            .set_link(self.peers[a].id, self.peers[b].id, link);
    }

    /// Cuts the link between `a` and `b`.
    pub fn cut(&mut self, a: usize, b: usize) {
        let link = Link {
            up: false,
            ..self.link(a, b)
        };
        self.set_link(a, b, link);
    }

    /// Cuts every link of `a`.
    pub fn isolate(&mut self, a: usize) {
        for b in (0..self.peers()).filter(|&b| b != a) {
            self.cut(a, b);
        }
    }

    /// Sets every link back to the default.
    pub fn recover(&mut self) {
        self.network.reset_links();
    }

    /// Puts `a` on links `factor` times slower than the others (a home uplink): longer
    /// latency, lower rate.
    pub fn slow_link(&mut self, a: usize, factor: f64) {
        for b in (0..self.peers()).filter(|&b| b != a) {
            let link = self.link(a, b);
            let slower = Link {
                latency: link.latency.mul_f64(factor),
                bytes_per_second: link.bytes_per_second / factor,
                ..link
            };
            self.set_link(a, b, slower);
        }
    }

    /// Every link loses this share of heartbeats, at random.
    pub fn lose_heartbeats(&mut self, share: f64) {
        for a in 0..self.peers() {
            for b in a + 1..self.peers() {
                let link = Link {
                    heartbeat_loss: share,
                    ..self.link(a, b)
                };
                self.set_link(a, b, link);
            }
        }
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Virtual time since the start.
    pub fn elapsed(&self) -> Duration {
        let _runtime = self.runtime.enter();
        self.started.elapsed()
    }

    pub fn step_of(&self, i: usize) -> u64 {
        replica::lock(&self.peers[i].trained).step
    }

    pub fn is_alive(&self, i: usize) -> bool {
        self.peers[i].node.is_some()
    }

    /// Peer `i`'s replica.
    pub fn replica(&self, i: usize) -> Vec<f32> {
        replica::lock(&self.peers[i].trained).params.clone()
    }

    pub fn stats(&self, i: usize) -> PeerStats {
        let peer = &self.peers[i];
        match &peer.node {
            Some(node) => PeerStats::of(&node.readout).after(&peer.earlier),
            None => peer.earlier.clone(),
        }
    }

    /// Peer `i`'s read side, while it runs.
    pub fn readout(&self, i: usize) -> Option<&Readout> {
        self.peers[i].node.as_ref().map(|node| &node.readout)
    }

    /// Live peers in `i`'s table.
    pub fn live_peers_of(&self, i: usize) -> usize {
        self.readout(i).map_or(0, Readout::live_peers)
    }

    /// Whether `i` is joining the run.
    pub fn is_joining(&self, i: usize) -> bool {
        self.readout(i)
            .is_some_and(|readout| readout.engine().role == Role::Joining)
    }

    /// The elastic center as `i` sees it.
    pub fn center_of(&self, i: usize) -> Option<usize> {
        let center = self.readout(i)?.engine().center?;
        self.peers.iter().position(|p| p.id == center)
    }

    /// Every (blocker, blocked) pair among the live peers.
    pub fn blocks(&self) -> Vec<(usize, usize)> {
        let mut blocks = Vec::new();
        for (i, peer) in self.peers.iter().enumerate() {
            let Some(node) = &peer.node else { continue };
            let table = node.readout.watch_peers();
            let table = table.borrow();
            for (j, other) in self.peers.iter().enumerate() {
                if table.is_blocked(&other.id) {
                    blocks.push((i, j));
                }
            }
        }
        blocks
    }

    /// The longest gate wait of any peer.
    pub fn longest_gate_wait(&self) -> Duration {
        (0..self.peers())
            .map(|i| self.stats(i).longest_gate_wait)
            .max()
            .unwrap_or_default()
    }

    /// Peers that a node lost from its table while they were alive and connected to it, over
    /// all nodes: timeouts of live peers.
    pub fn live_peers_timed_out(&self) -> u64 {
        self.peers
            .iter()
            .map(|peer| peer.live_peers_lost.load(Ordering::Relaxed))
            .sum()
    }

    /// `max_i ||x_i - mean|| / ||mean||` over the live peers' replicas.
    pub fn consensus_distance(&self) -> f64 {
        let live: Vec<usize> = (0..self.peers()).filter(|&i| self.is_alive(i)).collect();
        self.consensus_distance_of(&live)
    }

    /// [`Sim::consensus_distance`] over the peers `which`.
    pub fn consensus_distance_of(&self, which: &[usize]) -> f64 {
        let replicas: Vec<Vec<f32>> = which.iter().map(|&i| self.replica(i)).collect();
        let replicas: Vec<&[f32]> = replicas.iter().map(Vec::as_slice).collect();
        mix::consensus_distance(&replicas).unwrap_or(0.0)
    }

    /// How far the live peers' mean replica is from the swarm's optimum (the mean of their
    /// shards' optima), relative to the optimum's norm: how far training has to go.
    pub fn distance_to_optimum(&self) -> f64 {
        let live: Vec<usize> = (0..self.peers()).filter(|&i| self.is_alive(i)).collect();
        let mean = |of: &dyn Fn(usize) -> Vec<f32>| {
            let mut sum = vec![0.0f32; self.config.dim];
            for &i in &live {
                mix::add(&mut sum, &of(i));
            }
            mix::scale(&mut sum, 1.0 / live.len().max(1) as f32);
            sum
        };
        let optimum = mean(&|i| self.peers[i].optimum.clone());
        mix::distance(&mean(&|i| self.replica(i)), &optimum) / mix::norm(&optimum)
    }
}

/// Bytes of a frame of a replica's `dim` values (header and payload): what a link carries in
/// the run's transfer time.
fn frame_bytes(dim: usize, fingerprint: &str) -> u64 {
    let values = vec![0.0; dim];
    let header = TensorHeader::for_payload(MessageKind::Params, RUN_ID, fingerprint, 0, &values);
    let mut frame = futures::io::Cursor::new(Vec::new());
    futures::executor::block_on(wire::write_frame(&mut frame, &header, &values))
        .expect("invariant: a frame of a few values is written to memory")
}

/// Counts the peers that leave `me`'s table while the network still connects them to it.
/// Most of the table's changes are a heartbeat's clock: the members are compared only when
/// their number fell (a leave and a join seen in one change are not told apart).
async fn watch_for_live_peers_lost(
    network: SimulatedNetwork,
    me: PeerId,
    mut table: watch::Receiver<PeerTable>,
    lost: Arc<AtomicU64>,
) {
    let members = |table: &PeerTable| -> Vec<PeerId> {
        table.members().peers().map(|(peer, _)| *peer).collect()
    };
    let mut before = members(&table.borrow_and_update());
    while table.changed().await.is_ok() {
        let table = table.borrow_and_update();
        let now = table.members().len();
        if now < before.len() {
            let live = before
                .iter()
                .filter(|peer| table.members().get(peer).is_none())
                .filter(|&&peer| network.connected(me, peer))
                .count();
            lost.fetch_add(live as u64, Ordering::Relaxed);
        }
        if now != before.len() {
            before = members(&table);
        }
    }
}

impl Drop for Sim {
    /// The nodes' tasks end inside the runtime, which their timers and streams belong to.
    fn drop(&mut self) {
        let _runtime = self.runtime.enter();
        for peer in &mut self.peers {
            peer.node = None;
        }
    }
}
