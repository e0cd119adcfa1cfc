//! The sync engine's decisions, with no I/O (in the manner of raft-rs's `RawNode` and
//! iroh-gossip's `proto::State`): what to do when the replica hands over a snapshot, when a
//! peer asks for an exchange, when an exchange, a state sync or a ring round ends, and as peers
//! come and go.
//!
//! [`Policy::handle`] takes an [`Input`] and a [`View`] (the time, this replica's step and the
//! peer table) and returns the [`Action`]s the engine carries out; [`Policy::next_wake`] says
//! when it wants to be asked again. Nothing here reads a clock, opens a stream or touches
//! parameters: the exchanges themselves (and the distances they measure) are the engine's, so
//! every decision is a table test, and the daemon's simulator runs many nodes' engines, and
//! their policies with them, on a simulated network.
//!
//! - Joining: a node starts as a joiner (not a partner, not counted by gates); it takes over the
//!   state of the peer at the median clock (the elected center in elastic, a trusted peer in
//!   `allreduce`) when it is too far behind, then counts as joined.
//! - Pairwise (gossip, elastic gossip): a due snapshot goes to a random live partner that is not
//!   backing off; a busy partner is left alone briefly and another tried, a failed one longer.
//!   A node is in at most two pairwise exchanges at a time: one it started and one it answers
//!   (decision 0021), so that offers crossing on a slow link do not all end `Busy`. Partners
//!   whose exchanges (offered or answered) take far longer than the fastest one's are on slow
//!   links: offered to now and then only, and not waited for (decision 0029).
//! - Centered (elastic): every peer elects the same center from the live set; the holder
//!   answers workers with deltas.
//! - Ring (allreduce): a due snapshot is a round; an aborted round is retried after the members
//!   settled (those silent since the abort are left out); a member that sees another past the
//!   round takes over its state.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use libp2p_identity::PeerId;
use murmur_protocol::codec::Codec;
use murmur_protocol::heartbeat::Role;
use murmur_protocol::ring::{RingError, RingMembers};
use murmur_protocol::sync::{ClipRadius, ClipRule, DistanceFilter};
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use sha2::{Digest, Sha256};
use tracing::warn;

use crate::rejection::Rejection;
use crate::screen::Screen;
use crate::settings::{Mode, SyncSettings, Timeouts};
use crate::table::PeerTable;

/// Partner attempts per due exchange before giving up until the next interval.
pub const MAX_PARTNER_TRIES: usize = 6;
/// A partner whose exchanges take this many times the fastest partner's is on a slow link:
/// offered to only now and then (one pick in [`SLOW_PARTNER_PICKS`]), so that a slow peer
/// does not set the pace of the fast ones (it still offers to them).
pub const SLOW_PARTNER_FACTOR: f64 = 4.0;
pub const SLOW_PARTNER_PICKS: u32 = 64;
/// Weight of the newest exchange in a partner's moving average of exchange times.
const EXCHANGE_TIME_WEIGHT: f64 = 0.3;
/// A partner's link is judged by the quickest of its last this many exchanges: a slow link is
/// slow every time, while one exchange slowed by a busy machine says nothing of the link.
pub const LINK_SAMPLES: usize = 4;
/// With `sync.adapt_codec`: a partner whose exchanges through `sync.codec` take this many
/// times the compute of one interval gets the sparse codec (decision 0025)...
pub const SPARSE_FACTOR: f64 = 2.0;
/// ... but for one pick in this many, which measures `sync.codec` on its link again.
pub const DENSE_PROBE_PICKS: u32 = 16;
/// State-sync attempts before a joiner gives up and trains from where it is.
pub const MAX_STATE_SYNC_TRIES: u32 = 3;
/// The run may have made this many times the steps this node made while a state sync ran:
/// its peers may step faster than it does (decision 0033).
const TRANSFER_SLACK: u64 = 2;
/// How many heartbeat periods a member that has not mixed in step must find the run far
/// behind it before it takes over the run's state: every live peer's clock is heard again
/// within one, so newcomers taking over this node's own state meanwhile show it by then.
const AHEAD_GRACE_PERIODS: u32 = 2;
/// How many heartbeat periods after joining a member that mixed in step still takes over the
/// run's state when it finds the run far ahead: newcomers hear the run within about one of
/// one another (the start-up race of decision 0033, third amendment).
const YOUNG_MEMBER_PERIODS: u32 = 5;

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
    /// The replica handed over its snapshot of `step` (its gradient, with `allreduce.every = 1`);
    /// `step_secs`: the seconds a local step computes, as the replica's pace measures them
    /// ([`ReplicaLoop::step_secs`](crate::replica::ReplicaLoop::step_secs)), once measured.
    Due { step: u64, step_secs: Option<f64> },
    /// `peer`'s request, read from an inbound stream.
    Request { peer: PeerId, request: Request },
    /// The exchange this node started let the due snapshot go: the partner took its compressed
    /// offer (decision 0091). Should it end without a mix, the snapshot is not offered again.
    SnapshotSpent,
    /// The exchange this node started with `peer` ended.
    Exchanged { peer: PeerId, outcome: Outcome },
    /// The exchange this node answered in its pairwise slot (an [`Answer::Exchange`]) ended.
    Served { peer: PeerId, outcome: Outcome },
    /// A request this node answered outside its pairwise slot ended: an elastic worker's
    /// parameters mixed into the center, a state sent, a request refused or never read whole.
    /// The same peer may be in the pairwise slot meanwhile, which this leaves alone.
    Answered { peer: PeerId, outcome: Outcome },
    /// A state sync from `peer` ended: the state taken over, or why not.
    StateSynced {
        peer: PeerId,
        result: Result<Adopted, Outcome>,
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
    /// norm of the delta (an elastic worker); `credited`: the same as the clip radius learns it
    /// (see `Screen::credited`).
    Mixed { distance: f64, credited: f64 },
    /// The partner was in another exchange, or declined.
    Busy,
    /// An elastic exchange's parameters were too stale to mix: declined (a pairwise partner's
    /// never are, decision 0029).
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
    /// The replica driver did not answer.
    Replica,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Stream(reason) => write!(f, "the stream failed: {reason}"),
            Failure::TimedOut => f.write_str("no complete exchange within the exchange timeout"),
            Failure::PeerLeft => f.write_str("the peer left during the exchange"),
            Failure::Replica => f.write_str("the replica driver did not answer"),
        }
    }
}

/// How to answer a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// Not now (or not this mode): answer `Busy`.
    Busy,
    /// Answer the offer with this node's snapshot, and mix what comes back with `weight`
    /// as `screen` passes it.
    Exchange { weight: f32, screen: Screen },
    /// As the elastic center: move the center toward the worker by `alpha`, answer the delta,
    /// as `screen` passes the worker's distance from the center.
    Center { alpha: f32, screen: Screen },
    /// Send this node's state.
    State,
}

/// What the engine is to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Offer the due snapshot to `peer` through `codec` and mix its answer with `weight`
    /// (before age weighting), as `screen` passes its distance from this replica.
    Offer {
        peer: PeerId,
        codec: Codec,
        weight: f32,
        screen: Screen,
    },
    /// Send the due snapshot to the elastic center `peer`; the delta's norm goes through
    /// `screen`.
    AskCenter { peer: PeerId, screen: Screen },
    /// This node holds the center: step it toward the due snapshot by `alpha` and give the
    /// trainer the delta.
    StepOwnCenter { alpha: f32 },
    /// The due snapshot's turn is over without a mix: let the replica go on.
    Release,
    /// Answer `peer`'s request.
    Serve { peer: PeerId, answer: Answer },
    /// Take over `peer`'s state (a state sync), chosen for the clock `announced` (the state
    /// handed over must be near it: `state_sync::check_clock`).
    PullState { peer: PeerId, announced: u64 },
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
    /// These partners are on slow links (and the others not): the staleness gate does not
    /// wait for them, and answering them does not pause training (decision 0029).
    SlowLinks(BTreeSet<PeerId>),
}

/// The pairwise exchange this node started for its due snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Offering {
    #[default]
    Idle,
    /// Between partners: choosing one, or waiting for a busy one.
    Choosing,
    /// The offer to `peer` through `codec` is under way, since `at`.
    To {
        peer: PeerId,
        codec: Codec,
        at: Instant,
    },
}

impl Offering {
    /// The partner of the offer under way.
    fn partner(self) -> Option<PeerId> {
        match self {
            Offering::To { peer, .. } => Some(peer),
            _ => None,
        }
    }
}

/// The snapshot the replica handed over, while its turn lasts.
#[derive(Clone, Copy, Debug)]
struct Turn {
    step: u64,
    /// Partners tried (and waits for a busy one) so far.
    tries: usize,
    /// When to try again: every live partner was briefly busy.
    retry_at: Option<Instant>,
    /// The elastic center asked.
    asking: Option<PeerId>,
    /// An exchange let the snapshot go ([`Input::SnapshotSpent`]).
    spent: bool,
}

/// A state a state sync took over: its step, and the step this node had reached when it
/// arrived (the replica trains on while the state crosses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Adopted {
    pub from: u64,
    pub step: u64,
}

/// A state sync under way: the peer whose state this node is taking over, and the step this
/// node was at when it began.
#[derive(Clone, Copy, Debug)]
struct Pull {
    peer: PeerId,
    step: u64,
}

/// Judges the distances of received parameters: the running median of accepted distances
/// (see [`DistanceFilter`]) gives the limit beyond which a replica is an outlier, and an
/// outlier is declined; the latest distance of each peer gives the radius a difference is
/// clipped to before the mix (see [`ClipRadius`]): a limit that one peer can stretch (it is
/// one window for all peers) decides only what is declined, never how far a mix moves.
///
/// An outlier is not an offence: a replica that drifted, or a node back from a partition, lies
/// far from the others without meaning harm. When the peers that lie far are most of the peers
/// this replica is coupled to, it is this replica that drifted (decision 0016): the judge takes
/// their distances as its new baseline, so that it mixes again and comes back to the others.
#[derive(Clone, Debug)]
struct Judge {
    filter: DistanceFilter,
    clip: ClipRadius<PeerId>,
    /// The rule the radius, the knee and the cap along the replica follow.
    rule: ClipRule,
    /// Outliers since the last accepted distance: the peer and how far.
    outliers: Vec<(PeerId, f64)>,
}

impl Judge {
    /// A judge that clips by `rule`.
    fn new(rule: ClipRule) -> Self {
        Judge {
            filter: DistanceFilter::default(),
            clip: ClipRadius::new(rule.factor),
            rule,
            outliers: Vec::new(),
        }
    }

    fn screen(&self, now: Instant) -> Screen {
        Screen {
            limit: self.filter.limit(),
            radius: self.clip.radius(now),
            knee: self.rule.knee,
            radial: self.rule.radial,
        }
    }

    /// `peer`'s parameters were mixed, `distance` away (`credited`: as the clip radius learns
    /// it, see [`Screen::credited`]).
    fn accepted(&mut self, peer: PeerId, distance: f64, credited: f64, now: Instant) {
        self.filter.record(distance);
        self.clip.record(&peer, credited, now);
        self.outliers.clear();
    }

    /// An outlier from `peer`, this replica being coupled to `partners` peers. Returns the
    /// peers whose distances became the baseline when it is this replica that drifted.
    fn outlier(&mut self, peer: PeerId, distance: f64, partners: usize) -> Vec<PeerId> {
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
            return distinct;
        }
        Vec::new()
    }
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
    /// When this node counted as joined without taking over a state; `None` once it took one
    /// over (it holds the state of the run's median member then).
    joined_at: Option<Instant>,
    join_tries: u32,
    /// Whether a mix (pairwise, answered or offered, or an elastic delta) has landed on this
    /// replica: until then a member that finds itself far behind catches up as a joiner would.
    mixed: bool,
    /// A member's catch-up by state sync, begun before its first mix, has not succeeded yet:
    /// it is tried again (within the joiner's tries) though a mix landed meanwhile, or the
    /// member would stay far behind for the rest of the run.
    catching_up: bool,
    /// Since when this member, not yet mixed with a peer in step, has found the run's clock
    /// more than the behind limit behind its own (`Policy::rejoin_from_ahead`).
    ahead_since: Option<Instant>,
    /// A state sync under way.
    pulling: Option<Pull>,
    /// Steps the run may have moved on while this node's last state sync ran (decision 0033):
    /// a member that far behind right after taking over a state lags by the transfer, and its
    /// mixes count; one further behind took over a state that was not the run's.
    transfer_allowance: u64,
    /// The pairwise side: `Some` in gossip runs and elastic runs with the gossip topology.
    pairwise: Option<PairwisePolicy>,
    due: Option<Turn>,
    /// Distances of pairwise partners, and of workers at the center.
    params: Judge,
    /// State answers given lately.
    state_answers: StateBudget,
    /// Exchanges answered lately, by peer.
    exchange_share: ExchangeShare,
    /// The elastic center's side: `Some` in elastic runs with a center.
    center: Option<CenterPolicy>,
    /// The ring's side: `Some` in `allreduce` runs.
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
        let joining = !matches!(sync.mode, Mode::Solo);
        let pairwise = sync.pairwise();
        let center = sync.centered().then(CenterPolicy::new);
        let ring = sync.mode.ring().map(|ring| RingPolicy {
            min_peers: ring.min_peers,
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
            joined_at: None,
            join_tries: 0,
            mixed: false,
            catching_up: false,
            ahead_since: None,
            pulling: None,
            transfer_allowance: 0,
            pairwise: pairwise.then(PairwisePolicy::default),
            due: None,
            // Replicas of pairwise partners, or of workers at the center this node may hold.
            params: Judge::new(if pairwise {
                ClipRule::PAIRWISE
            } else {
                ClipRule::CENTER
            }),
            state_answers: StateBudget::default(),
            exchange_share: ExchangeShare::default(),
            center,
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

    /// Whether the replica's snapshot is still with the engine.
    pub fn has_due(&self) -> bool {
        self.due.is_some()
    }

    /// What observers see of this node's role and center.
    pub fn view(&self) -> EngineView {
        EngineView {
            role: self.role,
            center: self.center.as_ref().and_then(CenterPolicy::center),
            center_version: self.center.as_ref().map_or(0, |c| c.tracker.version()),
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
            Input::Due { step, step_secs } => self.on_due(step, step_secs, view),
            Input::Request { peer, request } => self.on_request(peer, request, view),
            Input::SnapshotSpent => self.on_snapshot_spent(),
            Input::Exchanged { peer, outcome } => self.on_exchanged(peer, outcome, view),
            Input::Served { peer, outcome } => self.on_served(peer, outcome, view),
            Input::Answered { peer, outcome } => self.on_answered(peer, outcome, view),
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
        if self.center.is_some() {
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
        if let Some(pairs) = &self.pairwise {
            watch(pairs.offering.partner());
            watch(pairs.serving);
        }
        watch(self.due.and_then(|due| due.asking));
        watch(self.pulling.map(|pull| pull.peer));
        gone
    }

    /// The live peers coupled to this one (same mode, done joining).
    fn coupled(&self, view: &View<'_>) -> Vec<PeerId> {
        view.peers
            .coupled(self.sync.mode.name())
            .map(|(peer, _)| *peer)
            .collect()
    }

    /// `p`: the live peers coupled to this one, this one included.
    fn live_count(&self, view: &View<'_>) -> usize {
        self.coupled(view).len() + 1
    }

    fn on_snapshot_spent(&mut self) -> Vec<Action> {
        if let Some(due) = self.due.as_mut() {
            due.spent = true;
        }
        Vec::new()
    }

    /// The replica's snapshot goes back without a mix.
    fn release(&mut self) -> Vec<Action> {
        self.due = None;
        self.set_offering(Offering::Idle);
        vec![Action::Release]
    }

    fn on_due(&mut self, step: u64, step_secs: Option<f64>, view: &View<'_>) -> Vec<Action> {
        if let Some(pairs) = self.pairwise.as_mut() {
            pairs.step_took(step_secs);
        }
        self.due = Some(Turn {
            step,
            tries: 0,
            retry_at: None,
            asking: None,
            spent: false,
        });
        if let Some(ring) = self.ring.as_mut() {
            ring.attempt = 1;
            // A ring round finishes joining first: the replica waits for its mean.
            return self.ring_advance(view);
        }
        if self.joining {
            return self.release();
        }
        if let Some(pairs) = self.pairwise.as_mut() {
            // Answering another peer right now: that is this interval's mix.
            if pairs.serving.is_some() {
                return self.release();
            }
            pairs.offering = Offering::Choosing;
            return self.offer_next(view);
        }
        if self.center.is_some() {
            return self.ask_center(view);
        }
        self.release()
    }
}

mod budget;
mod elastic;
mod joining;
mod pairwise;
mod ring;
#[cfg(test)]
mod tests;

/// What the sync engine tells observers and peers of this node: its role in the run and the
/// elastic center it follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineView {
    pub role: Role,
    pub center: Option<PeerId>,
    /// Bumped at every change of center.
    pub center_version: u64,
}

impl Default for EngineView {
    fn default() -> Self {
        EngineView {
            role: Role::Worker,
            center: None,
            center_version: 0,
        }
    }
}

use budget::{ExchangeShare, StateBudget};
pub use budget::{
    SHARE_FACTOR, SHARE_FREE, SHARE_WINDOW, STATE_ANSWERS, STATE_ANSWERS_PER_PEER, STATE_WINDOW,
};
use elastic::CenterPolicy;
use pairwise::PairwisePolicy;
use ring::{RingPhase, RingPolicy};
