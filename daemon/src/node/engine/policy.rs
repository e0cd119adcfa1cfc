//! The sync engine's decisions, with no I/O (in the manner of raft-rs's `RawNode` and
//! iroh-gossip's `proto::State`): what to do when the trainer hands over a snapshot, when a
//! peer asks for an exchange, when an exchange, a state sync or a ring round ends, and as peers
//! come and go.
//!
//! [`Policy::handle`] takes an [`Input`] and a [`View`] (the time, this replica's step and the
//! peer table) and returns the [`Action`]s the engine carries out; [`Policy::next_wake`] says
//! when it wants to be asked again. Nothing here reads a clock, opens a stream or touches
//! parameters: the exchanges themselves (and the distances they measure) are the engine's, so
//! every decision is a table test, and the simulator (`engine::sim`) runs many policies against
//! a virtual network.
//!
//! - Joining: a node starts as a joiner (not a partner, not counted by gates); it takes over the
//!   state of the most advanced peer (the center's holder first) when it is too far behind,
//!   then counts as joined.
//! - Pairwise (gossip, elastic gossip): a due snapshot goes to a random live partner that is not
//!   backing off; a busy partner is left alone briefly and another tried, a failed one longer.
//!   A node is in one pairwise exchange at a time, as initiator or responder.
//! - Centered (elastic): every peer elects the same center from the live set; the holder
//!   answers workers with deltas.
//! - Ring (allreduce): a due snapshot is a round; an aborted round is retried after the members
//!   settled (those silent since the abort are left out); a member that sees another past the
//!   round takes over its state.

use std::collections::HashMap;
use std::time::Instant;

use murmur_protocol::heartbeat::{Role, SyncMode};
use murmur_protocol::membership::PeerView;
use murmur_protocol::network::PeerId;
use murmur_protocol::ring::{RingError, RingMembers, TrustList};
use murmur_protocol::sync::{CenterTracker, DistanceFilter, choose_partner, elect_center};
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use sha2::{Digest, Sha256};
use tracing::{debug, info, warn};

use crate::node::messages::Rejection;
use crate::readout::{EngineView, PeerTable};
use crate::settings::{SyncSettings, Timeouts};

/// Partner attempts per due exchange before giving up until the next interval.
pub const MAX_PARTNER_TRIES: usize = 6;
/// State-sync attempts before a joiner gives up and trains from where it is.
pub const MAX_STATE_SYNC_TRIES: u32 = 3;

/// What the policy sees when it decides.
#[derive(Debug)]
pub struct View<'a> {
    pub now: Instant,
    /// This replica's clock.
    pub own_step: u64,
    pub peers: &'a PeerTable,
}

/// Something that happened.
#[derive(Debug)]
pub enum Input {
    /// Once a heartbeat period.
    Tick,
    /// The peer table changed: a heartbeat, a join, a leave, a timeout, a block.
    PeersChanged,
    /// The time [`Policy::next_wake`] asked for has come.
    Wake,
    /// The trainer handed over its snapshot of `step` (its gradient, with `allreduce.every = 1`).
    Due { step: u64 },
    /// `peer`'s request, read from an inbound stream.
    Request { peer: PeerId, request: Request },
    /// The exchange this node started with `peer` ended.
    Exchanged { peer: PeerId, outcome: Outcome },
    /// An exchange this node answered ended.
    Served { peer: PeerId, outcome: Outcome },
    /// A state sync from `peer` ended: the step taken over, or why not.
    StateSynced {
        peer: PeerId,
        result: Result<u64, Outcome>,
    },
    /// An attempt at the ring round `round` ended; on success the engine delivered the mean.
    RoundEnded {
        round: u64,
        result: Result<(), RingError>,
    },
    /// The center variable was seeded, or could not be.
    CenterSeeded { ok: bool },
}

/// The first frame of an inbound stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Request {
    /// A pairwise exchange offer from a peer at `step`.
    Offer { step: u64 },
    /// An elastic worker's parameters at `step`, for the center.
    Params { step: u64 },
    /// A state sync.
    State,
}

/// How an exchange ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Both sides mixed. `distance`: between the replicas (pairwise, and at the center), or the
    /// norm of the delta (an elastic worker).
    Mixed { distance: f64 },
    /// The partner was in another exchange, or declined.
    Busy,
    /// The partner's snapshot was too stale to mix: declined.
    Stale,
    /// What the partner sent lies too far from this replica: declined.
    Outlier { distance: f64 },
    /// The partner broke the protocol or sent invalid values.
    Rejected(Rejection),
    /// The stream broke, timed out, or the partner left.
    Failed(Failure),
    /// This node's state went out (a state request answered).
    StateSent,
}

/// Why an exchange failed on the way: no one's fault.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The stream could not be opened, or broke.
    Stream(String),
    /// It took longer than the exchange timeout.
    TimedOut,
    /// The peer left (or timed out) during the exchange.
    PeerLeft,
    /// The trainer thread did not answer.
    Trainer,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Stream(reason) => write!(f, "the stream failed: {reason}"),
            Failure::TimedOut => f.write_str("no complete exchange within the exchange timeout"),
            Failure::PeerLeft => f.write_str("the peer left during the exchange"),
            Failure::Trainer => f.write_str("the trainer did not answer"),
        }
    }
}

/// How to answer a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Not now (or not this mode): answer `Busy`.
    Busy,
    /// Answer the offer with this node's snapshot, and mix what comes back with `weight`
    /// unless it lies farther than `limit`.
    Exchange { weight: f32, limit: Option<f64> },
    /// As the elastic center: move the center toward the worker by `alpha`, answer the delta,
    /// unless the worker lies farther than `limit` from the center.
    Center { alpha: f32, limit: Option<f64> },
    /// Send this node's state.
    State,
}

/// What the engine is to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Offer the due snapshot to `peer` and mix its answer with `weight` (before age
    /// weighting), unless it lies farther than `limit` from this replica.
    Offer {
        peer: PeerId,
        weight: f32,
        limit: Option<f64>,
    },
    /// Send the due snapshot to the elastic center `peer`; refuse a delta whose norm is over
    /// `limit`.
    AskCenter { peer: PeerId, limit: Option<f64> },
    /// This node holds the center: step it toward the due snapshot by `alpha` and give the
    /// trainer the delta.
    StepOwnCenter { alpha: f32 },
    /// The due snapshot's turn is over without a mix: let the trainer go on.
    Release,
    /// Answer `peer`'s request.
    Serve { peer: PeerId, answer: Answer },
    /// Take over `peer`'s state (a state sync).
    PullState { peer: PeerId },
    /// Attempt the ring round `round` among `members`; `attempt` numbers the attempts at a
    /// round, and members connect attempts of the same number only (decision 0017).
    Round {
        round: u64,
        members: RingMembers,
        attempt: u32,
    },
    /// Give up what is under way with `peer`: it left.
    Cancel { peer: PeerId },
    /// `peer` sent something it should not have: score it.
    Offence { peer: PeerId, rejection: Rejection },
    /// This node's role or elastic center changed.
    Publish(EngineView),
    /// This node was elected center: seed the center variable (from the center inherited by
    /// state sync, else from its own parameters).
    SeedCenter,
    /// This node no longer holds the center.
    DropCenter,
}

/// The pairwise exchange this node is in: one at a time, as initiator or responder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    /// Offering the due snapshot, to `partner` once one is chosen.
    Offering {
        partner: Option<PeerId>,
    },
    /// Answering `peer`'s offer.
    Serving(PeerId),
}

/// The snapshot the trainer handed over, while its turn lasts.
#[derive(Clone, Copy, Debug)]
struct Due {
    step: u64,
    /// Partners tried (and waits for a busy one) so far.
    tries: usize,
    /// When to try again: every live partner was briefly busy.
    retry_at: Option<Instant>,
    /// The elastic center asked.
    asking: Option<PeerId>,
}

/// Judges the distances of received parameters: the running median of accepted distances
/// (see [`DistanceFilter`]) gives the limit beyond which a replica is an outlier, and an
/// outlier is declined.
///
/// An outlier is not an offence: a replica that drifted, or a node back from a partition, lies
/// far from the others without meaning harm. When the peers that lie far are most of the peers
/// this replica is coupled to, it is this replica that drifted (decision 0016): the judge takes
/// their distances as its new baseline, so that it mixes again and comes back to the others.
#[derive(Clone, Debug, Default)]
struct Judge {
    filter: DistanceFilter,
    /// Outliers since the last accepted distance: the peer and how far.
    outliers: Vec<(PeerId, f64)>,
}

impl Judge {
    fn limit(&self) -> Option<f64> {
        self.filter.limit()
    }

    fn accepted(&mut self, distance: f64) {
        self.filter.record(distance);
        self.outliers.clear();
    }

    /// An outlier from `peer`, this replica being coupled to `partners` peers.
    fn outlier(&mut self, peer: PeerId, distance: f64, partners: usize) {
        self.outliers.push((peer, distance));
        let mut distinct: Vec<PeerId> = self.outliers.iter().map(|(p, _)| *p).collect();
        distinct.sort();
        distinct.dedup();
        // Most of the peers, and never one alone unless it is the only one (then twice).
        let drifted = if partners <= 1 {
            self.outliers.len() >= 2
        } else {
            distinct.len() >= partners.div_ceil(2).max(2)
        };
        if drifted {
            let distances: Vec<f64> = self.outliers.iter().map(|(_, d)| *d).collect();
            warn!(
                peers = distinct.len(),
                partners,
                "every peer's parameters lie far from this replica's: it is this replica that \
                 drifted; taking their distances as the baseline to mix again"
            );
            self.filter.rebase(&distances);
            self.outliers.clear();
        }
    }
}

/// Where a ring round stands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum RingPhase {
    /// No attempt under way.
    Idle,
    /// Waiting for `min_peers` before the run's first round.
    WaitingForPeers,
    Attempting,
    /// Taking over the state of a member that completed the round.
    CatchingUp,
    /// After an abort at `failed_at`: waiting until the members were heard from since.
    Settling {
        failed_at: Instant,
    },
}

/// The `allreduce` side of the policy.
#[derive(Clone, Debug)]
struct RingPolicy {
    min_peers: usize,
    trust: TrustList,
    /// Whether the run is under way: a round with at least `min_peers` members completed, or
    /// this node took over a peer's state. From then on rounds go on with whoever is live.
    started: bool,
    /// Members left out of rings since the abort at the given time, until heard from again.
    suspects: HashMap<PeerId, Instant>,
    told_waiting: bool,
    /// The number of the current (or next) attempt at the due round, from 1.
    attempt: u32,
    phase: RingPhase,
}

/// The sync engine's state machine; see the module documentation.
#[derive(Debug)]
pub struct Policy {
    me: PeerId,
    run_id: String,
    sync: SyncSettings,
    timeouts: Timeouts,
    started_at: Instant,
    rng: ChaCha8Rng,
    role: Role,
    joining: bool,
    join_tries: u32,
    /// A state sync under way, and whether its source was live when it began.
    pulling: Option<PeerId>,
    slot: Slot,
    due: Option<Due>,
    /// Peers left alone until the given time (they were busy, or failed).
    backoff: HashMap<PeerId, Instant>,
    /// Distances of pairwise partners, and of workers at the center.
    params: Judge,
    /// Norms of elastic deltas from the center.
    deltas: Judge,
    tracker: CenterTracker<PeerId>,
    holds_center: bool,
    seeding: bool,
    ring: Option<RingPolicy>,
}

impl Policy {
    /// The policy of node `me` in run `run_id`, starting at `now`: joining unless `solo`.
    pub fn new(
        me: PeerId,
        run_id: &str,
        sync: SyncSettings,
        timeouts: Timeouts,
        now: Instant,
    ) -> Self {
        // Seeded by the run seed and the peer id: reproducible, and different on every peer.
        let seed = {
            let digest = Sha256::digest(me.to_bytes());
            let mut first = [0u8; 8];
            first.copy_from_slice(&digest[..8]);
            sync.seed ^ u64::from_le_bytes(first)
        };
        let joining = sync.mode != SyncMode::Solo;
        let ring = sync.ring.as_ref().map(|ring| RingPolicy {
            min_peers: ring.min_peers,
            trust: ring.trust.clone(),
            started: false,
            suspects: HashMap::new(),
            told_waiting: false,
            attempt: 1,
            phase: RingPhase::Idle,
        });
        Policy {
            me,
            run_id: run_id.to_owned(),
            sync,
            timeouts,
            started_at: now,
            rng: ChaCha8Rng::seed_from_u64(seed),
            role: if joining { Role::Joining } else { Role::Worker },
            joining,
            join_tries: 0,
            pulling: None,
            slot: Slot::Free,
            due: None,
            backoff: HashMap::new(),
            params: Judge::default(),
            deltas: Judge::default(),
            tracker: CenterTracker::default(),
            holds_center: false,
            seeding: false,
            ring,
        }
    }

    /// What this node announces in its heartbeat.
    pub fn role(&self) -> Role {
        self.role
    }

    pub fn is_joining(&self) -> bool {
        self.joining
    }

    /// Whether the trainer's snapshot is still with the engine.
    pub fn has_due(&self) -> bool {
        self.due.is_some()
    }

    /// What observers see of this node's role and center.
    pub fn view(&self) -> EngineView {
        EngineView {
            role: self.role,
            center: self.tracker.center().copied(),
            center_version: self.tracker.version(),
        }
    }

    /// When the policy wants a [`Input::Wake`], if ever.
    pub fn next_wake(&self) -> Option<Instant> {
        let retry = self.due.and_then(|due| due.retry_at);
        let ring = self.ring.as_ref().and_then(|ring| match ring.phase {
            RingPhase::Settling { failed_at } => Some(failed_at + self.timeouts.ring_settle),
            _ => None,
        });
        // A lone `allreduce` joiner waits out the grace before it takes itself for the first.
        let grace = (self.ring.is_some() && self.joining && self.due.is_some())
            .then(|| self.started_at + self.timeouts.first_peer_grace);
        [retry, ring, grace].into_iter().flatten().min()
    }

    /// Decides what `input` calls for.
    pub fn handle(&mut self, input: Input, view: &View<'_>) -> Vec<Action> {
        match input {
            Input::Tick => self.maintain(view),
            Input::PeersChanged => self.peers_changed(view),
            Input::Wake => self.wake(view),
            Input::Due { step } => self.on_due(step, view),
            Input::Request { peer, request } => self.on_request(peer, request, view),
            Input::Exchanged { peer, outcome } => self.on_exchanged(peer, outcome, view),
            Input::Served { peer, outcome } => self.on_served(peer, outcome, view),
            Input::StateSynced { peer, result } => self.on_state_synced(peer, result, view),
            Input::RoundEnded { round, result } => self.on_round_ended(round, result, view),
            Input::CenterSeeded { ok } => self.on_center_seeded(ok, view),
        }
    }

    // ---- common ----

    /// Once a heartbeat period: finish joining, follow the center election.
    fn maintain(&mut self, view: &View<'_>) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.ring.is_none() {
            actions.extend(self.try_join(view));
        }
        if self.sync.centered() {
            actions.extend(self.elect(view));
        }
        actions
    }

    fn peers_changed(&mut self, view: &View<'_>) -> Vec<Action> {
        let mut actions = self.cancel_departed(view);
        if self.ring.is_some() {
            actions.extend(self.ring_advance(view));
        } else {
            actions.extend(self.try_join(view));
        }
        actions
    }

    fn wake(&mut self, view: &View<'_>) -> Vec<Action> {
        if self.ring.is_some() {
            return self.ring_advance(view);
        }
        match self.due {
            Some(due) if due.retry_at.is_some_and(|at| at <= view.now) => self.offer_next(view),
            _ => Vec::new(),
        }
    }

    /// Exchanges with peers that have since left the table are given up.
    fn cancel_departed(&mut self, view: &View<'_>) -> Vec<Action> {
        let mut gone = Vec::new();
        let mut watch = |peer: Option<PeerId>| {
            if let Some(peer) = peer
                && view.peers.get(&peer).is_none()
            {
                gone.push(Action::Cancel { peer });
            }
        };
        match self.slot {
            Slot::Offering { partner } => watch(partner),
            Slot::Serving(peer) => watch(Some(peer)),
            Slot::Free => {}
        }
        watch(self.due.and_then(|due| due.asking));
        watch(self.pulling);
        gone
    }

    /// The live peers coupled to this one (same mode, done joining).
    fn coupled(&self, view: &View<'_>) -> Vec<PeerId> {
        view.peers
            .coupled(self.sync.mode)
            .map(|(peer, _)| *peer)
            .collect()
    }

    /// `p`: the live peers coupled to this one, this one included.
    fn live_count(&self, view: &View<'_>) -> usize {
        self.coupled(view).len() + 1
    }

    /// The trainer's snapshot goes back without a mix.
    fn release(&mut self) -> Vec<Action> {
        self.due = None;
        if matches!(self.slot, Slot::Offering { .. }) {
            self.slot = Slot::Free;
        }
        vec![Action::Release]
    }

    fn on_due(&mut self, step: u64, view: &View<'_>) -> Vec<Action> {
        self.due = Some(Due {
            step,
            tries: 0,
            retry_at: None,
            asking: None,
        });
        if let Some(ring) = self.ring.as_mut() {
            ring.attempt = 1;
            // A ring round finishes joining first: the trainer waits for its mean.
            return self.ring_advance(view);
        }
        if self.joining {
            return self.release();
        }
        if self.sync.pairwise() {
            // Answering another peer right now: that is this interval's mix.
            if self.slot != Slot::Free {
                return self.release();
            }
            self.slot = Slot::Offering { partner: None };
            return self.offer_next(view);
        }
        if self.sync.centered() {
            return self.ask_center(view);
        }
        self.release()
    }

    // ---- joining ----

    /// Decides whether this node is far enough behind the run to take over a peer's state; if
    /// not (or after too many tries), it counts as joined.
    fn try_join(&mut self, view: &View<'_>) -> Vec<Action> {
        if !self.joining || self.pulling.is_some() {
            return Vec::new();
        }
        // In elastic the center's holder is asked first: it has the center to hand over.
        let source = view
            .peers
            .peers()
            .find(|(_, v)| v.role == Role::Center)
            .map(|(p, v)| (*p, v.step))
            .or_else(|| view.peers.members().most_advanced().map(|(p, s)| (*p, s)));
        // Alone: nothing to catch up with yet.
        let Some((peer, their_step)) = source else {
            return Vec::new();
        };
        // Ring members all sit at the same step: any lag is caught up on at once.
        let behind_limit = if self.ring.is_some() {
            0
        } else {
            self.sync.max_staleness.unwrap_or(4 * self.sync.interval)
        };
        if their_step > view.own_step + behind_limit && self.join_tries < MAX_STATE_SYNC_TRIES {
            self.join_tries += 1;
            self.pulling = Some(peer);
            return vec![Action::PullState { peer }];
        }
        self.mark_joined(view)
    }

    /// From now on this node is a member: a partner, counted by gates, in rings.
    fn mark_joined(&mut self, view: &View<'_>) -> Vec<Action> {
        self.joining = false;
        if self.role == Role::Joining {
            self.role = Role::Worker;
        }
        info!(step = view.own_step, "joined the run");
        vec![Action::Publish(self.view())]
    }

    fn on_state_synced(
        &mut self,
        peer: PeerId,
        result: Result<u64, Outcome>,
        view: &View<'_>,
    ) -> Vec<Action> {
        if self.pulling == Some(peer) {
            self.pulling = None;
        }
        let mut actions = Vec::new();
        match result {
            Ok(step) => {
                if let Some(ring) = self.ring.as_mut() {
                    ring.started = true;
                    ring.phase = RingPhase::Idle;
                }
                if self.joining {
                    actions.extend(self.mark_joined(view));
                }
                // The round of the snapshot handed over is someone else's past now.
                if self.due.is_some_and(|due| due.step < step) {
                    actions.extend(self.release());
                }
            }
            Err(outcome) => {
                if let Outcome::Rejected(rejection) = outcome {
                    actions.push(Action::Offence { peer, rejection });
                }
                if let Some(ring) = self.ring.as_mut()
                    && ring.phase == RingPhase::CatchingUp
                {
                    ring.phase = RingPhase::Settling {
                        failed_at: view.now,
                    };
                }
                // A joiner tries again at the next tick.
            }
        }
        if self.ring.is_some() {
            actions.extend(self.ring_advance(view));
        }
        actions
    }

    // ---- pairwise ----

    /// A random live partner that is not backing off; else, when every live partner is only
    /// briefly busy, the time at which the first of them may be asked again.
    fn pick_partner(&mut self, view: &View<'_>) -> Result<PeerId, Option<Instant>> {
        let live = self.coupled(view);
        let now = view.now;
        self.backoff.retain(|_, until| *until > now);
        let busy = self.backoff.keys().copied().collect();
        if let Some(peer) = choose_partner(&live, &busy, &mut self.rng) {
            return Ok(peer);
        }
        Err(live
            .iter()
            .filter_map(|p| self.backoff.get(p).copied())
            .filter(|until| *until <= now + self.timeouts.busy_backoff)
            .min())
    }

    /// Offers the due snapshot to the next partner, waits for a busy one, or gives up.
    fn offer_next(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(mut due) = self.due else {
            return Vec::new();
        };
        if due.tries >= MAX_PARTNER_TRIES {
            return self.release();
        }
        due.tries += 1;
        due.retry_at = None;
        match self.pick_partner(view) {
            Ok(peer) => {
                self.due = Some(due);
                self.slot = Slot::Offering {
                    partner: Some(peer),
                };
                let weight = self.sync.pair_weight(self.live_count(view));
                vec![Action::Offer {
                    peer,
                    weight,
                    limit: self.params.limit(),
                }]
            }
            // Every partner is in another exchange: ask again when the first may be free.
            Err(Some(free_at)) => {
                due.retry_at = Some(free_at);
                self.due = Some(due);
                self.slot = Slot::Offering { partner: None };
                Vec::new()
            }
            Err(None) => self.release(),
        }
    }

    fn on_exchanged(&mut self, peer: PeerId, outcome: Outcome, view: &View<'_>) -> Vec<Action> {
        if self.due.and_then(|due| due.asking).is_some() {
            return self.on_center_answer(peer, outcome);
        }
        if self.slot
            != (Slot::Offering {
                partner: Some(peer),
            })
        {
            return Vec::new();
        }
        self.slot = Slot::Offering { partner: None };
        match outcome {
            Outcome::Mixed { distance } => {
                self.params.accepted(distance);
                // The engine gave the trainer the mix.
                self.due = None;
                self.slot = Slot::Free;
                Vec::new()
            }
            Outcome::Busy => {
                self.backoff
                    .insert(peer, view.now + self.timeouts.busy_backoff);
                self.offer_next(view)
            }
            Outcome::Stale => self.release(),
            Outcome::Outlier { distance } => {
                let partners = self.coupled(view).len();
                self.params.outlier(peer, distance, partners);
                self.release()
            }
            Outcome::Rejected(rejection) => {
                let mut actions = vec![Action::Offence { peer, rejection }];
                actions.extend(self.release());
                actions
            }
            Outcome::Failed(failure) => {
                debug!(peer = %peer, %failure, "exchange failed");
                self.backoff
                    .insert(peer, view.now + self.timeouts.failure_backoff);
                self.offer_next(view)
            }
            Outcome::StateSent => Vec::new(),
        }
    }

    fn on_request(&mut self, peer: PeerId, request: Request, view: &View<'_>) -> Vec<Action> {
        let answer = match request {
            Request::Offer { .. } => {
                if self.joining || !self.sync.pairwise() || self.slot != Slot::Free {
                    Answer::Busy
                } else {
                    self.slot = Slot::Serving(peer);
                    Answer::Exchange {
                        weight: self.sync.pair_weight(self.live_count(view)),
                        limit: self.params.limit(),
                    }
                }
            }
            Request::Params { .. } => {
                if !self.joining && self.sync.centered() && self.holds_center {
                    Answer::Center {
                        alpha: self.sync.alpha(self.live_count(view)),
                        limit: self.params.limit(),
                    }
                } else {
                    Answer::Busy
                }
            }
            // Answered even while joining: the first node of a run is alone (joining) exactly
            // when the second one needs its state.
            Request::State => Answer::State,
        };
        vec![Action::Serve { peer, answer }]
    }

    fn on_served(&mut self, peer: PeerId, outcome: Outcome, view: &View<'_>) -> Vec<Action> {
        if self.slot == Slot::Serving(peer) {
            self.slot = Slot::Free;
        }
        match outcome {
            Outcome::Mixed { distance } => {
                self.params.accepted(distance);
                Vec::new()
            }
            Outcome::Outlier { distance } => {
                let partners = self.coupled(view).len();
                self.params.outlier(peer, distance, partners);
                Vec::new()
            }
            Outcome::Rejected(rejection) => vec![Action::Offence { peer, rejection }],
            // A peer that opens an exchange and never completes it is misbehaving.
            Outcome::Failed(Failure::TimedOut) => vec![Action::Offence {
                peer,
                rejection: Rejection::Stalled,
            }],
            Outcome::Busy | Outcome::Stale | Outcome::Failed(_) | Outcome::StateSent => Vec::new(),
        }
    }

    // ---- elastic ----

    /// Elastic worker: the due snapshot goes to the center (or, at the center, to its own
    /// center variable).
    fn ask_center(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(center) = self.tracker.center().copied() else {
            return self.release();
        };
        if center == self.me {
            if !self.holds_center {
                return self.release();
            }
            // The engine steps the center and hands the trainer the delta.
            self.due = None;
            return vec![Action::StepOwnCenter {
                alpha: self.sync.alpha(self.live_count(view)),
            }];
        }
        if let Some(due) = self.due.as_mut() {
            due.asking = Some(center);
        }
        vec![Action::AskCenter {
            peer: center,
            limit: self.deltas.limit(),
        }]
    }

    fn on_center_answer(&mut self, peer: PeerId, outcome: Outcome) -> Vec<Action> {
        let mut actions = Vec::new();
        match outcome {
            Outcome::Mixed { distance } => {
                self.deltas.accepted(distance);
                self.due = None;
                return actions;
            }
            // The center is the one source of deltas.
            Outcome::Outlier { distance } => self.deltas.outlier(peer, distance, 1),
            Outcome::Rejected(rejection) => actions.push(Action::Offence { peer, rejection }),
            Outcome::Busy | Outcome::Stale | Outcome::Failed(_) | Outcome::StateSent => {}
        }
        actions.extend(self.release());
        actions
    }

    /// Follows the deterministic election; a node that becomes the center seeds the center
    /// variable.
    fn elect(&mut self, view: &View<'_>) -> Vec<Action> {
        let mut live: Vec<(PeerId, Vec<u8>)> = self
            .coupled(view)
            .into_iter()
            .map(|p| (p, p.to_bytes()))
            .collect();
        if !self.joining {
            live.push((self.me, self.me.to_bytes()));
        }
        let configured = self.sync.center.map(|p| p.to_bytes());
        let elected = elect_center(&live, &self.run_id, configured.as_deref());
        let mut actions = Vec::new();
        if let Some(version) = self.tracker.update(elected) {
            if elected != Some(self.me) {
                if self.holds_center {
                    actions.push(Action::DropCenter);
                }
                self.holds_center = false;
                if self.role == Role::Center {
                    self.role = Role::Worker;
                }
                match elected {
                    Some(center) => info!(center = %center, version, "elastic center elected"),
                    None => info!(version, "no elastic center while alone"),
                }
            }
            actions.push(Action::Publish(self.view()));
        }
        if elected == Some(self.me) && !self.holds_center && !self.seeding {
            self.seeding = true;
            actions.push(Action::SeedCenter);
        }
        actions
    }

    fn on_center_seeded(&mut self, ok: bool, view: &View<'_>) -> Vec<Action> {
        self.seeding = false;
        if !ok || self.tracker.center() != Some(&self.me) {
            return self.elect(view);
        }
        self.holds_center = true;
        self.role = Role::Center;
        info!(
            version = self.tracker.version(),
            "this node holds the elastic center"
        );
        vec![Action::Publish(self.view())]
    }

    // ---- ring (allreduce) ----

    /// Moves the due round on as far as it can go now.
    fn ring_advance(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(due) = self.due else {
            return Vec::new();
        };
        let round = due.step;
        let phase = match self.ring.as_ref() {
            Some(ring) => ring.phase,
            None => return Vec::new(),
        };
        match phase {
            RingPhase::Attempting | RingPhase::CatchingUp => return Vec::new(),
            RingPhase::Settling { failed_at } => {
                if !self.settled(failed_at, view) {
                    return Vec::new();
                }
            }
            RingPhase::Idle | RingPhase::WaitingForPeers => {}
        }
        let mut actions = Vec::new();
        if self.joining {
            if self.pulling.is_some() {
                return actions;
            }
            actions.extend(self.try_join(view));
            if self.pulling.is_some() {
                return actions;
            }
            if self.joining {
                if !self.first_of_the_run(view) {
                    return actions;
                }
                info!("no peer heard of: the first of the run, rounding alone until others come");
                actions.extend(self.mark_joined(view));
            }
        }
        if view.own_step != round {
            // The trainer took over a peer's state: this round is someone else's past.
            actions.extend(self.release());
            return actions;
        }
        let members = self.ring_members(view);
        let Some(ring) = self.ring.as_mut() else {
            return actions;
        };
        if !ring.started && members.len() < ring.min_peers {
            if !ring.told_waiting {
                info!(
                    have = members.len(),
                    need = ring.min_peers,
                    "waiting for trusted peers before the first ring round"
                );
                ring.told_waiting = true;
            }
            ring.phase = RingPhase::WaitingForPeers;
            return actions;
        }
        ring.phase = RingPhase::Attempting;
        actions.push(Action::Round {
            round,
            members,
            attempt: ring.attempt,
        });
        actions
    }

    /// Whether this node, still joining, has heard of no peer for the first-peer grace and
    /// `min_peers` lets it round alone: the first peer of a run trains on (a ring of one), and
    /// whoever comes next takes over its state.
    fn first_of_the_run(&self, view: &View<'_>) -> bool {
        self.ring.as_ref().is_some_and(|ring| ring.min_peers <= 1)
            && view.now >= self.started_at + self.timeouts.first_peer_grace
            && view.peers.is_empty()
    }

    /// The ring of the next attempt: this node and the live trusted members in allreduce mode
    /// that have joined, are still training, and are not suspected since an abort.
    fn ring_members(&mut self, view: &View<'_>) -> RingMembers {
        let me = self.me;
        let Some(ring) = self.ring.as_mut() else {
            return RingMembers::new(&self.run_id, vec![me]);
        };
        // A suspect heard from since it was suspected is back; one that left is forgotten.
        ring.suspects
            .retain(|peer, since| view.peers.get(peer).is_some_and(|v| v.last_seen <= *since));
        let live = view
            .peers
            .peers()
            .filter(|(peer, v)| in_rounds(v) && !v.finished && !ring.suspects.contains_key(*peer))
            .map(|(peer, _)| *peer);
        ring.trust.ring(&self.run_id, me, live)
    }

    /// After an abort at `failed_at`: whether every ring member has been heard from since, or
    /// the settle time has passed, in which case those still silent are suspected until heard
    /// from again.
    fn settled(&mut self, failed_at: Instant, view: &View<'_>) -> bool {
        let members = self.ring_members(view);
        let silent: Vec<PeerId> = members
            .peers()
            .iter()
            .filter(|peer| {
                view.peers
                    .get(peer)
                    .is_some_and(|v| v.last_seen <= failed_at)
            })
            .copied()
            .collect();
        if silent.is_empty() {
            return true;
        }
        if view.now < failed_at + self.timeouts.ring_settle {
            return false;
        }
        if let Some(ring) = self.ring.as_mut() {
            for peer in silent {
                info!(peer = %peer, "no heartbeat since the abort: leaving it out of the ring");
                ring.suspects.insert(peer, failed_at);
            }
        }
        true
    }

    fn on_round_ended(
        &mut self,
        round: u64,
        result: Result<(), RingError>,
        view: &View<'_>,
    ) -> Vec<Action> {
        if self.due.is_none_or(|due| due.step != round) {
            return Vec::new();
        }
        let mut actions = Vec::new();
        match result {
            Ok(()) => {
                if let Some(ring) = self.ring.as_mut() {
                    ring.started = true;
                    ring.phase = RingPhase::Idle;
                }
                // The engine gave the trainer the mean.
                self.due = None;
            }
            // A member is at a later attempt of this round: join it at once. Its number is the
            // one every member converges on, and the members are in the ring already.
            Err(RingError::Superseded { by })
                if by.round == round
                    && self
                        .ring
                        .as_ref()
                        .is_some_and(|ring| by.number > ring.attempt) =>
            {
                if let Some(ring) = self.ring.as_mut() {
                    ring.attempt = by.number;
                    ring.phase = RingPhase::Idle;
                }
                actions.extend(self.ring_advance(view));
            }
            Err(error) => {
                if let Some(ring) = self.ring.as_mut() {
                    ring.attempt += 1;
                }
                actions.extend(self.blame(&error, view));
                if let Some(peer) = self.member_ahead(round, view) {
                    info!(peer = %peer, round, "a ring member completed this round: taking over its state");
                    if let Some(ring) = self.ring.as_mut() {
                        ring.phase = RingPhase::CatchingUp;
                    }
                    self.pulling = Some(peer);
                    actions.push(Action::PullState { peer });
                    return actions;
                }
                if let Some(ring) = self.ring.as_mut() {
                    ring.phase = RingPhase::Settling {
                        failed_at: view.now,
                    };
                }
                actions.extend(self.ring_advance(view));
            }
        }
        actions
    }

    /// A peer that sent something invalid on the ring is scored down; only the left neighbour
    /// sends to this node. Header mismatches are not offences: views of the membership differ
    /// for a moment whenever a peer joins or leaves.
    fn blame(&mut self, error: &RingError, view: &View<'_>) -> Vec<Action> {
        if !error.is_offence() || matches!(error, RingError::Mismatch { .. }) {
            return Vec::new();
        }
        let members = self.ring_members(view);
        match members.rank_of(&self.me) {
            Some(rank) if members.len() > 1 => vec![Action::Offence {
                peer: members.left_of(rank),
                rejection: Rejection::Ring(error.to_string()),
            }],
            _ => Vec::new(),
        }
    }

    /// A trusted member in rounds whose clock is past `round`: it completed the round this node
    /// missed.
    fn member_ahead(&self, round: u64, view: &View<'_>) -> Option<PeerId> {
        let ring = self.ring.as_ref()?;
        view.peers
            .peers()
            .filter(|(peer, v)| in_rounds(v) && v.step > round && ring.trust.contains(peer))
            .max_by_key(|(_, v)| v.step)
            .map(|(peer, _)| *peer)
    }
}

/// Whether a peer takes part in ring rounds: in `allreduce` mode and done joining.
fn in_rounds(view: &PeerView) -> bool {
    view.mode == SyncMode::Allreduce && view.role != Role::Joining
}

#[cfg(test)]
mod tests;
