//! A deterministic simulator of the sync engine's decisions: N peers, each a real [`Policy`]
//! with its own [`PeerTable`] (which scores offences) and a model trainer, in virtual time,
//! over a network that can drop, delay, cut and isolate (raft-rs's test network is the model).
//!
//! Nothing moves but small messages: a replica is a vector of a few values that drifts as it
//! trains and moves toward its partners as it mixes, enough to give the policy's distance
//! checks something to judge. A ring round is the protocol crate's binding and
//! [`Reducer`](murmur_protocol::ring::Reducer)s, whose frames (the round's header and its
//! sub-chunks) the `ring` module carries hop by hop. Each simulated trainer takes a step every
//! `step_time` and follows the daemon's own replica rules ([`ReplicaLoop`]): when a snapshot
//! falls due, when it pauses for its exchanges or waits at the staleness gate (with its
//! coupling, decision 0039), and how a mix, an elastic delta or a ring's mean lands on it.
//! Exchanges and state syncs are the sync crate's protocol machines ([`crate::machines`]), whose
//! frames the simulator carries; a compressed exchange runs on the pair's copies (the sync
//! crate's [`CopyBook`] lends them to one exchange per pair at a time, as in the daemon), in the
//! share of the transfer time its codec's bytes take. A run is reproducible from its seed.
//!
//! It drives the shared machines with drivers of its own (exchanges, rings, the trainer's loop),
//! which carry, time and book but decide nothing: decision 0079 says why it does not run the
//! engine itself.
//!
//! Built with the crate's `sim` feature only, so a release build of nodectl leaves it out.
//! Scenarios are in `sync/tests/simulation.rs`; `nodectl bench sim`, in a nodectl built with its
//! `sim` feature, times a large run.

mod controls;
mod exchange;
mod net;
mod peer;
mod ring;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use libp2p_identity::{Keypair, PeerId};
use murmur_protocol::heartbeat::{Heartbeat, SendClock, SyncMode};
use murmur_protocol::mix;
use murmur_protocol::ring::Attempt;
use murmur_protocol::trust::TrustList;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use crate::announce::Announcer;
use crate::copies::CopyBook;
use crate::policy::{Action, Input, Policy, View};
use crate::replica::{ExchangeEnd, ExchangeId, LoopSettings, ReplicaLoop};
use crate::screen::Screen;
use crate::settings::{ElasticSettings, Mode, RingSettings, SyncSettings, Timeouts};
use crate::sides::Sides;
use crate::table::{Offence, PeerMap, PeerTable};
use exchange::Exchange;
pub use net::Net;

/// What a simulated run is made of.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub peers: usize,
    /// Every peer's sync settings, as a node resolves them from its config. Their seed is the
    /// run's (the peers' keys, shards and jitter come from it too); their trust list is set
    /// to the simulated peers, each trusting the others.
    pub sync: SyncSettings,
    /// Time of one local step (each peer's is this times its speed).
    pub step_time: Duration,
    pub latency: Duration,
    /// Time to move one replica; a compressed exchange takes the share its codec's bytes
    /// take.
    pub transfer: Duration,
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
}

impl SimConfig {
    /// `peers` gossiping every 8 steps within a bound of 16, on a LAN-like network.
    pub fn gossip(peers: usize) -> Self {
        SimConfig {
            peers,
            sync: SyncSettings {
                seed: 1,
                ..SyncSettings::for_tests(SyncMode::Gossip)
            },
            step_time: Duration::from_millis(5),
            latency: Duration::from_micros(200),
            transfer: Duration::from_millis(2),
            timeouts: Timeouts::default(),
            dim: 8,
            pull: 0.001,
            noise: 0.0005,
            steps: None,
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
            min_peers: peers,
            sub_chunk: 1,
            ..RingSettings::for_tests()
        });
        config.sync.interval = 1;
        config.sync.max_staleness = Some(256);
        config.step_time = Duration::from_millis(50);
        config
    }

    /// The sync mode's name.
    fn mode(&self) -> SyncMode {
        self.sync.mode.name()
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
    /// Exchanges (started or answered) mixed through the sparse codec of a slow link
    /// (`sync.adapt_codec`).
    pub sparse: u64,
    /// Ring rounds that aborted.
    pub aborted_rounds: u64,
    /// Times the staleness gate stopped waiting for a peer that held it past its patience.
    pub uncoupled: u64,
    /// The most local steps between a snapshot and its mix.
    pub max_merge_lag: u64,
}

impl PeerStats {
    fn merged(&mut self, lag: u64) {
        self.max_merge_lag = self.max_merge_lag.max(lag);
    }
}

/// The trainer of a simulated peer: the real replica rules, and what it waits for.
#[derive(Debug)]
struct ModelTrainer {
    /// What the replica does next, and how exchanges land on it: the daemon's own rules
    /// (pace, held exchanges, the coupling gate, outer steps).
    rules: ReplicaLoop,
    /// The snapshot handed over, while its exchange lasts.
    due: Option<DueSnapshot>,
    /// Since when the replica waits for its exchanges.
    paused_since: Option<Duration>,
    gated_since: Option<Duration>,
    /// When the gate is asked again though no clock moved, once scheduled.
    gate_check_at: Option<Duration>,
    step_scheduled: bool,
    /// How long the step under way takes.
    step_took: Duration,
    /// The step last announced in a heartbeat, and when to announce the next early.
    announcer: Announcer,
}

/// What a replica handed over: its parameters at `step` (in `allreduce` with `every = 1`, the
/// step's move instead, as the real replica hands over its gradient).
#[derive(Clone, Debug)]
struct DueSnapshot {
    id: ExchangeId,
    step: u64,
    params: Vec<f32>,
}

#[derive(Debug)]
struct SimPeer {
    id: PeerId,
    alive: bool,
    /// Bumped at every restart, so that events of an earlier life are ignored.
    life: u32,
    policy: Policy,
    table: PeerTable,
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
    /// Stamps its heartbeats, by the simulated clock.
    sent: SendClock,
    /// The copies of compressed exchanges, per partner, each lent to one exchange at a time.
    copies: CopyBook,
    /// Its open sides of exchanges, by exchange id.
    sides: Sides<u64>,
    stats: PeerStats,
}

#[derive(Clone, Debug)]
enum Event {
    /// An event of one peer's life: ignored once that life ended (it died or restarted).
    Peer {
        peer: usize,
        life: u32,
        event: PeerEvent,
    },
    /// A heartbeat `from` published reaches `to`: one goes to every peer, shared, not copied
    /// for each.
    Heartbeat {
        from: usize,
        to: usize,
        heartbeat: Arc<Heartbeat>,
    },
    /// Frames of exchange `xid`'s stream (pairwise, elastic or state sync) reach `to`, as the
    /// machine of `from`'s side wrote them; `ended`: `from`'s side of the stream ended after
    /// them.
    Stream {
        from: usize,
        to: usize,
        xid: u64,
        frames: Vec<crate::machines::Frame>,
        ended: bool,
    },
    /// A ring hello reaches `to`'s queue. Boxed: rare, and large beside the others.
    Hello {
        to: usize,
        hello: Box<ring::Hello>,
    },
    ExchangeTimeout(u64),
    /// Boxed: rare, and every event is as large as the largest.
    Ring(Box<ring::RingEvent>),
}

#[derive(Clone, Debug)]
enum PeerEvent {
    /// The step under way is done.
    Step,
    /// A heartbeat is due (and silent peers are timed out).
    Heartbeat,
    /// The policy's tick, once a heartbeat period.
    Tick,
    /// The wake-up the policy asked for.
    Wake,
    /// The staleness gate is asked again: a peer's patience may have run out.
    GateCheck,
    /// The peer table changed outside a heartbeat (a clock seen in a frame): the policy and
    /// the trainer hear of it after the event that changed it.
    TableChanged,
    /// An answer to an offer that waits for the pair's copies.
    AnswerOffer {
        from: usize,
        xid: u64,
        weight: f32,
        screen: Box<Screen>,
        until: Duration,
    },
}

/// The simulation.
#[derive(Debug)]
pub struct Sim {
    config: SimConfig,
    /// Virtual time zero.
    t0: Instant,
    now: Duration,
    /// The events to come, by when they are due, then in the order scheduled.
    queue: BTreeMap<(Duration, u64), Event>,
    seq: u64,
    peers: Vec<SimPeer>,
    index: PeerMap<usize>,
    pub net: Net,
    /// By id: ordered, so that a peer's exchanges end in the same order in every run of a
    /// seed.
    exchanges: BTreeMap<u64, Exchange>,
    next_xid: u64,
    ring: ring::RingModel,
}

const RUN_ID: &str = "sim";

impl Sim {
    pub fn new(config: SimConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(config.sync.seed);
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
        let mut config = config;
        config.sync.trust = TrustList::new(ids.iter().copied());
        // The origin of virtual time: nothing reads the real clock after it.
        let t0 = Instant::now();
        let mut sim = Sim {
            net: Net::new(config.latency, config.transfer, config.sync.seed ^ 0x5eed),
            ring: ring::RingModel::new(
                RUN_ID,
                config.sync.trust.clone(),
                config.peers,
                config.latency,
                config
                    .sync
                    .mode
                    .ring()
                    .map_or(Duration::ZERO, |ring| ring.timeout),
                config.sync.mode.ring().map_or(1, |ring| ring.sub_chunk),
            ),
            index: ids.iter().enumerate().map(|(i, id)| (*id, i)).collect(),
            peers: Vec::new(),
            config,
            t0,
            now: Duration::ZERO,
            queue: BTreeMap::new(),
            seq: 0,
            exchanges: BTreeMap::new(),
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
        let rules = self.rules_at(0, &replica);
        let mut rng =
            ChaCha8Rng::seed_from_u64(self.config.sync.seed.wrapping_mul(31).wrapping_add(salt));
        let target = (0..self.config.dim)
            .map(|_| rng.random_range(0.5..1.5))
            .collect();
        SimPeer {
            id,
            alive: true,
            life: 0,
            sent: SendClock::default(),
            copies: CopyBook::default(),
            sides: Sides::default(),
            policy: Policy::new(
                id,
                RUN_ID,
                self.config.sync.clone(),
                self.config.timeouts,
                self.instant(),
            ),
            table: PeerTable::new(self.config.timeouts.peer),
            step: 0,
            checkpoint: (0, replica.clone()),
            replica,
            target,
            center: None,
            inherited_center: None,
            trainer: ModelTrainer {
                rules,
                due: None,
                paused_since: None,
                gated_since: None,
                gate_check_at: None,
                step_scheduled: false,
                step_took: Duration::ZERO,
                announcer: Announcer::new(self.config.sync.max_staleness),
            },
            slowness: 1.0,
            poison: None,
            rng,
            request: None,
            wake_at: None,
            stats: PeerStats::default(),
        }
    }

    /// The real replica rules of a replica at `step` with `params`.
    fn rules_at(&self, step: u64, params: &[f32]) -> ReplicaLoop {
        ReplicaLoop::new(LoopSettings::of(&self.config.sync), step, || {
            Ok::<_, std::convert::Infallible>(params.to_vec())
        })
        .unwrap_or_else(|never| match never {})
    }

    /// Schedules a peer's first heartbeat, tick and step, at a random phase within a period.
    fn start_peer(&mut self, i: usize) {
        let phase = Duration::from_micros(
            self.peers[i]
                .rng
                .random_range(0..self.config.timeouts.heartbeat.as_micros() as u64),
        );
        self.schedule_for(i, phase, PeerEvent::Heartbeat);
        self.schedule_for(i, phase, PeerEvent::Tick);
        self.try_step(i);
    }

    fn instant(&self) -> Instant {
        self.t0 + self.now
    }

    fn schedule(&mut self, after: Duration, event: Event) {
        self.seq += 1;
        self.queue.insert((self.now + after, self.seq), event);
    }

    /// Schedules `event` of peer `i`'s current life.
    fn schedule_for(&mut self, i: usize, after: Duration, event: PeerEvent) {
        let life = self.peers[i].life;
        self.schedule(
            after,
            Event::Peer {
                peer: i,
                life,
                event,
            },
        );
    }

    // ---- events ----

    fn handle(&mut self, event: Event) {
        match event {
            Event::Peer { peer, life, event } if self.current(peer, life) => {
                self.handle_for(peer, event);
            }
            Event::Heartbeat {
                from,
                to,
                heartbeat,
            } if self.peers[to].alive => self.heard(from, to, &heartbeat),
            Event::Stream {
                from,
                to,
                xid,
                frames,
                ended,
            } if self.peers[to].alive => self.on_stream(xid, from, to, frames, ended),
            Event::Hello { to, hello } if self.peers[to].alive => {
                let events = self.ring.hello(to, *hello);
                self.ring_events(events);
            }
            Event::ExchangeTimeout(xid) => self.exchange_timeout(xid),
            Event::Ring(event) => {
                let events = self.ring.handle(*event);
                self.ring_events(events);
            }
            _ => {}
        }
    }

    /// An event of live peer `i`.
    fn handle_for(&mut self, i: usize, event: PeerEvent) {
        match event {
            PeerEvent::Step => self.on_step(i),
            PeerEvent::Heartbeat => self.on_heartbeat(i),
            PeerEvent::Tick => {
                self.input(i, Input::Tick);
                self.schedule_for(i, self.config.timeouts.heartbeat, PeerEvent::Tick);
            }
            PeerEvent::Wake => {
                self.peers[i].wake_at = None;
                let due = self.peers[i].policy.next_wake();
                if due.is_some_and(|at| at <= self.instant()) {
                    self.input(i, Input::Wake);
                } else {
                    self.schedule_wake(i);
                }
            }
            PeerEvent::AnswerOffer {
                from,
                xid,
                weight,
                screen,
                until,
            } => self.answer_offer(i, from, xid, weight, *screen, until),
            PeerEvent::GateCheck => {
                self.peers[i].trainer.gate_check_at = None;
                self.try_step(i);
            }
            PeerEvent::TableChanged => self.table_changed(i),
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

    /// Carries out an action of peer `i`'s policy, as the daemon's engine does.
    fn execute(&mut self, i: usize, action: Action) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, ?action, "action");
        match action {
            Action::Offer {
                peer,
                codec,
                weight,
                screen,
            } => self.offer(i, peer, codec, weight, screen),
            Action::AskCenter { peer, screen } => self.ask_center(i, peer, screen),
            Action::StepOwnCenter { alpha } => {
                let peer = &mut self.peers[i];
                if let (Some(center), Some(due)) = (peer.center.as_mut(), peer.trainer.due.as_ref())
                {
                    let delta = mix::elastic_step(center, &due.params, alpha);
                    peer.stats.exchanges += 1;
                    self.due_mixed(i, ExchangeEnd::Subtract(delta));
                }
                self.due_ended(i);
            }
            Action::Release => self.due_ended(i),
            Action::Serve { peer, answer } => self.serve(i, peer, answer),
            Action::PullState { peer, announced } => self.pull_state(i, peer, announced),
            Action::Round {
                round,
                members,
                attempt,
            } => {
                let snapshot = self.peers[i]
                    .trainer
                    .due
                    .as_ref()
                    .map(|due| due.params.clone())
                    .unwrap_or_default();
                let index = &self.index;
                let order: Vec<usize> = members
                    .peers()
                    .iter()
                    .filter_map(|p| index.get(p).copied())
                    .collect();
                let me = (i, self.peers[i].id);
                let attempt = Attempt {
                    round,
                    number: attempt,
                };
                let events = self.ring.start(me, attempt, &members, &order, snapshot);
                self.ring_events(events);
            }
            Action::Cancel { peer } => self.cancel(i, peer),
            Action::Offence { peer, .. } => {
                let now = self.instant();
                let p = &mut self.peers[i];
                if let Offence::Blocked { .. } = p.table.offence(peer, now)
                    && let Some(&j) = self.index.get(&peer)
                {
                    p.stats.blocked.push(j);
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
            Action::SlowLinks(peers) => {
                self.peers[i].table.set_slow(peers);
            }
        }
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
        self.schedule_for(i, at.saturating_sub(self.now), PeerEvent::Wake);
    }

    /// Sends `event`, a message from `from` to `to`, to arrive `after`: unless one of them
    /// blocked the other, `to` is dead, or the network loses it.
    fn send(&mut self, (from, to): (usize, usize), after: Duration, event: Event) {
        let blocked = self.peers[to].table.is_blocked(&self.peers[from].id)
            || self.peers[from].table.is_blocked(&self.peers[to].id);
        if self.peers[to].alive && !blocked && self.net.delivers(from, to) {
            self.schedule(after, event);
        }
    }

    /// Sends `frames` of exchange `xid`'s stream from `from` to `to`, to arrive `after`;
    /// `ended`: `from`'s side of the stream ends after them.
    fn send_frames(
        &mut self,
        (from, to): (usize, usize),
        after: Duration,
        xid: u64,
        frames: Vec<crate::machines::Frame>,
        ended: bool,
    ) {
        let stream = Event::Stream {
            from,
            to,
            xid,
            frames,
            ended,
        };
        self.send((from, to), after, stream);
    }
}
