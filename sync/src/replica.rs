//! The sync-side rules of a replica, sans IO: [`ReplicaLoop`] says what the replica does next
//! (step, hand its parameters over, wait) and how what comes back lands on it. It reads no
//! clock and touches no channel; the daemon's replica driver feeds it what happens and does
//! what it says, for every trainer alike. The types that cross between a replica and the sync
//! engine are here too: the [`Snapshot`] it hands over, the [`ExchangeEnd`] that lands on it,
//! its [`Clock`] and its outer loop's [`OuterState`].
//!
//! The rules:
//!
//! - **Pace.** A snapshot falls due every `interval` steps, or with `adapt_interval` as many
//!   as one interval's exchange pauses last ([`Pace`], decision 0022). A gossip replica that
//!   has no peer lets it pass: alone, it trains as it would without Murmur.
//! - **Held exchanges.** Without `overlap` a replica waits for the exchange of the snapshot it
//!   handed over, and for those it answered, before its next step: a mix lands at the step it
//!   was taken for (decision 0008). With `overlap` it trains on, and a mix lands at most
//!   `max_merge_lag` steps after its snapshot; a partner on a slow link is answered that way
//!   too (decision 0029). A snapshot that falls due while the last one is in flight waits for
//!   it (decision 0021).
//! - **The staleness gate.** A step may not put the replica more than `max_staleness` steps
//!   ahead of the slowest live peer it is coupled to; which peers those are is [`Coupling`]'s
//!   (decision 0039): no clock can hold the gate shut for longer than its patience. Ring
//!   members have no gate: the rounds keep them in step (decision 0078).
//! - **The delta rule.** A mix or an elastic delta is computed from the snapshot alone and
//!   added to the parameters as they are when it lands; so is the outer step's move owed since
//!   the snapshot (decisions 0030, 0035).
//! - **Rings.** With `every = 1` the replica hands over its gradient and steps with the mean;
//!   with `every > 1` its parameters, and continues from the outer loop's average. A replica
//!   that took over a peer waiting on a round owes that round before it trains on.

use std::time::{Duration, Instant};

use libp2p_identity::PeerId;
use murmur_protocol::coupling::Coupling;
use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::mix;
use murmur_protocol::sync::{Gate, StalenessGate};
use outer::OuterLoop;

use crate::copies::{ConsensusStep, HoldsCopies};
use crate::pace::Pace;
use crate::settings::{Outer, SyncSettings};

mod outer;

/// Where a replica's training stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    /// Local steps taken (the replica's clock, which peers compare).
    pub step: u64,
    /// The replica has trained to its end: it takes no more steps, and answers peers.
    pub finished: bool,
}

/// The replica's parameters at one step (in `allreduce` mode with `every = 1`: the gradient
/// computed at that step, not yet applied).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub step: u64,
    pub params: Vec<f32>,
}

/// An optimizer's state, as named buffers of the parameters' layout: opaque to the node, which
/// only checks their lengths and values and hands them to a peer of the same optimizer.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerBuffers {
    pub buffers: Vec<NamedBuffer>,
    /// Updates the optimizer has applied (AdamW's bias correction depends on it).
    pub updates: u64,
}

impl OptimizerBuffers {
    pub fn names(&self) -> Vec<String> {
        self.buffers.iter().map(|b| b.name.clone()).collect()
    }
}

/// One buffer of an optimizer's state.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedBuffer {
    pub name: String,
    pub values: Vec<f32>,
}

/// Everything a peer needs to continue exactly where this replica stands.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplicaState {
    pub step: u64,
    pub params: Vec<f32>,
    /// The optimizer's state; `None` when a peer's optimizer differs (parameters only).
    pub optimizer: Option<OptimizerBuffers>,
}

/// How an exchange of the replica ended: what lands on it between two steps.
#[derive(Debug)]
pub enum ExchangeEnd {
    /// Push-pull mix: `x <- x + weight delta`.
    Mix { delta: Delta, weight: f32 },
    /// Elastic worker update: `x <- x - delta`.
    Subtract(Vec<f32>),
    /// `allreduce`: the ring's mean of what this replica handed over at `step` (its gradient
    /// with `every = 1`, else its parameters).
    Reduced { step: u64, mean: Vec<f32> },
}

impl ExchangeEnd {
    /// The end with a compressed mix's copies held by `held` until it lands (decision 0092);
    /// any other end lets `held` go at once.
    pub fn holding(self, held: Option<impl HoldsCopies + 'static>) -> ExchangeEnd {
        match self {
            ExchangeEnd::Mix {
                delta: Delta::Step { step, copies: None },
                weight,
            } => ExchangeEnd::Mix {
                delta: Delta::Step {
                    step,
                    copies: held.map(|held| Box::new(held) as Box<dyn HoldsCopies>),
                },
                weight,
            },
            end => end,
        }
    }
}

/// What a pairwise mix moves the replica by, before its weight.
#[derive(Debug)]
pub enum Delta {
    /// The values: the partner's parameters less the snapshot this node sent, clipped.
    Values(Vec<f32>),
    /// A compressed exchange's consensus step, read off the pair's copies as it lands
    /// (decision 0092), so that no model-sized delta waits for the trainer. The copies are
    /// held, and the pair's next exchange waits for them, until then; the machine that judged
    /// the exchange leaves them to its driver, which holds them ([`ExchangeEnd::holding`]).
    Step {
        step: ConsensusStep,
        copies: Option<Box<dyn HoldsCopies>>,
    },
}

impl Delta {
    /// The delta's values, read off the copies for a step (which lets them go); `None` for
    /// a step whose copies nothing held, which cannot land.
    pub fn into_values(self) -> Option<Vec<f32>> {
        match self {
            Delta::Values(values) => Some(values),
            Delta::Step { step, copies } => {
                debug_assert!(copies.is_some(), "a consensus step lands with its copies");
                copies.map(|held| step.values(held.copies(), 1.0))
            }
        }
    }
}

/// The state of an outer loop: `allreduce`'s (`every > 1`), the same on every replica, or a
/// pairwise replica's own (`sync.outer`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OuterState {
    /// The parameters the current `H` local steps started from.
    pub anchor: Vec<f32>,
    /// The step of the average that gave the anchor (or of the start).
    pub anchor_step: u64,
    /// The DiLoCo outer velocity; empty with `outer = "none"` or before the first outer step.
    pub velocity: Vec<f32>,
}

/// How long, net, the staleness gate waits for peers that lag before it stops waiting for
/// them (decision 0039): a peer that claims an old step cannot hold this node for longer.
pub const GATE_PATIENCE: Duration = Duration::from_secs(10);

/// The settings the rules follow, from the run's `[sync]`.
#[derive(Clone, Debug)]
pub struct LoopSettings {
    pub mode: SyncMode,
    /// Train on while this replica's exchanges are in flight.
    pub overlap: bool,
    pub max_merge_lag: u64,
    pub interval: u64,
    pub adapt_interval: bool,
    pub max_staleness: Option<u64>,
    /// `allreduce`: exchanges are ring rounds, which never overlap training.
    pub ring: bool,
    /// `allreduce` with `every = 1`: gradients are handed over, not parameters.
    pub averages_gradients: bool,
    /// The outer loop: a ring averaging parameters keeps one (plain local SGD too), pairwise
    /// and elastic replicas only for the outer step.
    pub outer: Option<Outer>,
}

impl LoopSettings {
    pub fn of(sync: &SyncSettings) -> Self {
        let outer = match sync.mode.ring() {
            Some(ring) => (!ring.averages_gradients()).then_some(ring.outer),
            None => (sync.outer != Outer::Average).then_some(sync.outer),
        };
        LoopSettings {
            mode: sync.mode.name(),
            overlap: sync.overlap,
            max_merge_lag: sync.max_merge_lag,
            interval: sync.interval,
            adapt_interval: sync.adapt_interval,
            max_staleness: sync.max_staleness,
            ring: sync.mode.ring().is_some(),
            averages_gradients: sync.averages_gradients(),
            outer,
        }
    }
}

/// An exchange of this replica under way, as the rules know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExchangeId(u64);

#[derive(Debug)]
struct Exchange {
    id: ExchangeId,
    /// The snapshot this replica handed over (not one it answered with).
    due: bool,
    /// The step of the snapshot: how late the mix lands is measured from it.
    step: u64,
    /// Training goes on meanwhile.
    overlapped: bool,
    /// The outer step's move owed since the snapshot (decision 0030).
    owed: Option<Vec<f32>>,
}

/// What the replica does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Next {
    /// Take a snapshot of the parameters and hand it over ([`ReplicaLoop::handed_over`]).
    HandOver,
    /// Take one local step, then tell [`ReplicaLoop::stepped`].
    Step,
    /// `allreduce` with `every = 1`: compute the step's gradient, hand it to the ring, and
    /// step with the mean once it is back.
    SynchronousStep,
    /// Nothing to do until something happens.
    Wait(Wait),
}

/// A wait: for what, and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wait {
    pub why: WaitFor,
    /// A change of the peer table ends the wait too (the gate may open).
    pub on_peers: bool,
    /// When to ask again even if nothing happens.
    pub until: Option<Instant>,
}

/// Why the replica waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitFor {
    /// For its exchanges: a mix to land before the next step.
    Exchanges,
    /// At the staleness gate, for peers that lag.
    Gate,
    /// It finished training; it answers peers until the node leaves.
    Finished,
}

/// What the rules decided, with what observers are told of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub next: Next,
    /// Peers the gate stopped waiting for, with their clocks (decision 0039).
    pub uncoupled: Vec<(PeerId, u64)>,
    /// Before a step: how far ahead of the slowest coupled peer it puts the replica.
    pub lead: Option<u64>,
}

impl Decision {
    fn just(next: Next) -> Self {
        Decision {
            next,
            uncoupled: Vec::new(),
            lead: None,
        }
    }
}

/// What follows a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AfterStep {
    /// Hand a snapshot over now.
    pub hand_over: bool,
    /// A snapshot fell due: the interval now in use.
    pub due_with_interval: Option<u64>,
}

/// How an ended exchange lands on the replica, in order.
#[derive(Debug, PartialEq)]
pub enum Landing {
    /// Add to the parameters; `mixed_over` for a mix with peers (the daemon's `Replica::add`
    /// says what a trainer does with it), `None` for the outer step's own move.
    Add {
        delta: Vec<f32>,
        mixed_over: Option<u64>,
    },
    /// Add a compressed mix, read off the pair's copies a run at a time (decision 0094).
    AddStep(StepLanding),
    /// Continue from these parameters (a ring's outer average).
    Set(Vec<f32>),
}

/// A compressed mix to add to the parameters: `weight` times its consensus step, read off the
/// pair's copies, which it holds until it is dropped (decision 0094). A mix with peers, about
/// one every `mixed_over` steps (as [`Landing::Add`]'s).
#[derive(Debug)]
pub struct StepLanding {
    step: ConsensusStep,
    weight: f32,
    copies: Box<dyn HoldsCopies>,
    pub mixed_over: Option<u64>,
}

impl StepLanding {
    /// The mix's values, handed to `each` a run at a time with their offset.
    pub fn runs(&self, each: impl FnMut(usize, &[f32])) {
        self.step.runs(self.copies.copies(), self.weight, each);
    }

    /// The mix's values as one buffer, for a replica that takes no runs.
    pub fn values(&self) -> Vec<f32> {
        self.step.values(self.copies.copies(), self.weight)
    }
}

impl PartialEq for StepLanding {
    /// The same mix: the same step and weight over copies that hold the same.
    fn eq(&self, other: &Self) -> bool {
        (self.step, self.weight, self.mixed_over) == (other.step, other.weight, other.mixed_over)
            && self.copies.copies() == other.copies.copies()
    }
}

/// What an ended exchange changes.
#[derive(Debug, Default, PartialEq)]
pub struct Landed {
    pub landings: Vec<Landing>,
    /// A mix landed this many steps after its snapshot.
    pub lag: Option<u64>,
}

/// The sync-side state of one replica: its exchanges under way, its pace, the gate, the
/// outer loop.
#[derive(Debug)]
pub struct ReplicaLoop {
    settings: LoopSettings,
    pace: Pace,
    gate: StalenessGate,
    coupling: Option<Coupling<PeerId>>,
    exchanges: Vec<Exchange>,
    next_id: u64,
    /// A snapshot fell due while the previous one was still in flight (with `overlap`): it
    /// is handed over after the next step once that one ended.
    snapshot_owed: bool,
    /// This replica took over the state of a peer that waits on the round at the adopted
    /// step: it owes that round before it trains on.
    owes_round: bool,
    outer: Option<OuterLoop>,
    /// `allreduce`, `every = 1`: the ring's mean gradient and its step, once it is back.
    reduced_gradient: Option<(u64, Vec<f32>)>,
}

impl ReplicaLoop {
    /// The rules of a replica at `step` whose parameters are `params` (read only when an
    /// outer loop needs them).
    pub fn new<E>(
        settings: LoopSettings,
        step: u64,
        params: impl FnOnce() -> Result<Vec<f32>, E>,
    ) -> Result<Self, E> {
        let outer = match settings.outer {
            Some(outer) => Some(OuterLoop::new(params()?, step, outer)),
            None => None,
        };
        // Ring members are held in step by the rounds themselves: none completes a round
        // without all the others. Whoever is out of the rings (killed, left out after an
        // abort, joining) must not hold the members at a gate until its heartbeat times out.
        let gate_bound = settings.max_staleness.filter(|_| !settings.ring);
        Ok(ReplicaLoop {
            pace: Pace::new(settings.interval, settings.adapt_interval, step),
            gate: StalenessGate::new(gate_bound),
            coupling: gate_bound.map(|bound| Coupling::new(bound, GATE_PATIENCE)),
            settings,
            exchanges: Vec::new(),
            next_id: 0,
            snapshot_owed: false,
            owes_round: false,
            outer,
            reduced_gradient: None,
        })
    }

    /// What to do next, for a replica at `clock`. `candidates` lists the peers the gate may
    /// wait for, with their clocks; it is asked only when the gate is checked.
    pub fn next(
        &mut self,
        clock: Clock,
        now: Instant,
        candidates: impl FnOnce() -> Vec<(PeerId, u64)>,
    ) -> Decision {
        if self.owes_round {
            if self.due_in_flight() {
                return Decision::just(Next::Wait(self.exchange_wait()));
            }
            self.owes_round = false;
            return Decision::just(Next::HandOver);
        }
        if clock.finished {
            return Decision::just(Next::Wait(Wait {
                why: WaitFor::Finished,
                on_peers: false,
                until: None,
            }));
        }
        if self.held() || self.past_merge_lag(clock.step) {
            return Decision::just(Next::Wait(self.exchange_wait()));
        }
        let (slowest, decide_at, uncoupled) = match self.coupling.as_mut() {
            Some(coupling) if self.settings.mode != SyncMode::Solo => {
                let clock = coupling.gate_clock(clock.step, candidates(), now);
                (clock.slowest, clock.decide_at, clock.uncoupled)
            }
            _ => (None, None, Vec::new()),
        };
        // The step about to be taken may not put this node more than the bound ahead.
        if let Gate::Closed { .. } = self.gate.check(clock.step + 1, slowest) {
            return Decision {
                next: Next::Wait(Wait {
                    why: WaitFor::Gate,
                    on_peers: true,
                    until: decide_at,
                }),
                uncoupled,
                lead: None,
            };
        }
        Decision {
            next: if self.settings.averages_gradients {
                Next::SynchronousStep
            } else {
                Next::Step
            },
            uncoupled,
            lead: slowest.map(|slowest| (clock.step + 1).saturating_sub(slowest)),
        }
    }

    fn exchange_wait(&self) -> Wait {
        Wait {
            why: WaitFor::Exchanges,
            on_peers: false,
            until: None,
        }
    }

    /// With `overlap`, a mix lands at most `max_merge_lag` steps after its snapshot.
    fn past_merge_lag(&self, step: u64) -> bool {
        self.exchanges
            .iter()
            .map(|x| x.step)
            .min()
            .is_some_and(|oldest| step.saturating_sub(oldest) >= self.settings.max_merge_lag)
    }

    /// A local step reached `step` in `took`: whether a snapshot falls due, and whether to
    /// hand it over now. `alone` is asked when one falls due: whether the peer table holds no
    /// peer this replica could mix with.
    pub fn stepped(
        &mut self,
        step: u64,
        took: Duration,
        alone: impl FnOnce() -> bool,
    ) -> AfterStep {
        self.pace.stepped(took);
        let mut due_with_interval = None;
        if self.settings.mode != SyncMode::Solo
            && !self.settings.averages_gradients
            && self.pace.is_due(step)
        {
            due_with_interval = Some(self.pace.interval());
            // A gossip replica with no peer lets the snapshot pass: nobody would take it, and
            // taking it costs a copy of the parameters and, without `overlap`, a pause. An
            // elastic replica still hands it over (it may hold the center itself), and so does
            // one with an outer step (the step is taken at the snapshot).
            let nobody_takes_it =
                self.settings.mode == SyncMode::Gossip && self.outer.is_none() && alone();
            if !nobody_takes_it {
                self.snapshot_owed = true;
            }
        }
        // With `overlap` a due snapshot waits for the previous one's exchange without pausing
        // the trainer: on a link slower than `interval` steps of compute, the interval
        // stretches to the link's pace (decision 0021).
        let hand_over = self.snapshot_owed && !(self.settings.overlap && self.due_in_flight());
        if hand_over {
            self.snapshot_owed = false;
        }
        AfterStep {
            hand_over,
            due_with_interval,
        }
    }

    /// Seconds a local step of this replica computes, as its pace measures them (the time
    /// it waits at the gate or for exchanges is not compute), once measured.
    pub fn step_secs(&self) -> Option<f64> {
        self.pace.step_secs()
    }

    /// The replica waited `took` for its exchanges: told to the pace.
    pub fn exchange_waited(&mut self, took: Duration) {
        self.pace.paused(took);
    }

    /// The snapshot of `params` at `step` was taken to hand over: the outer step is taken
    /// on the progress up to it, and the exchange is under way until [`ended`](Self::ended).
    pub fn handed_over(&mut self, step: u64, params: &[f32]) -> ExchangeId {
        let owed = self.outer_step_at(step, params);
        let overlapped = self.overlaps();
        self.track(true, step, overlapped, owed)
    }

    /// `allreduce`, `every = 1`: the gradient of `step` was handed to the ring.
    pub fn gradient_handed_over(&mut self, step: u64) -> ExchangeId {
        self.reduced_gradient = None;
        self.track(true, step, false, None)
    }

    /// The snapshot of `params` at `step` answers a peer's exchange; `slow_partner`: the
    /// partner is on a slow link, and training goes on meanwhile (decision 0029).
    pub fn answered(&mut self, step: u64, params: &[f32], slow_partner: bool) -> ExchangeId {
        let owed = self.outer_step_at(step, params);
        let overlapped = slow_partner || self.overlaps();
        self.track(false, step, overlapped, owed)
    }

    fn track(
        &mut self,
        due: bool,
        step: u64,
        overlapped: bool,
        owed: Option<Vec<f32>>,
    ) -> ExchangeId {
        let id = ExchangeId(self.next_id);
        self.next_id += 1;
        self.exchanges.push(Exchange {
            id,
            due,
            step,
            overlapped,
            owed,
        });
        id
    }

    /// The exchange `id` ended, with `end` (`None`: no mix), while the replica is at `step`:
    /// what lands on the replica. The outer step's move owed since its snapshot lands with or
    /// without a mix.
    pub fn ended(&mut self, id: ExchangeId, end: Option<ExchangeEnd>, step: u64) -> Landed {
        let Some(at) = self.exchanges.iter().position(|x| x.id == id) else {
            return Landed::default();
        };
        let exchange = self.exchanges.swap_remove(at);
        let mut landed = Landed::default();
        if let Some(owed) = exchange.owed {
            landed.landings.push(Landing::Add {
                delta: owed,
                mixed_over: None,
            });
        }
        // A compressed mix lands a run at a time, unless an outer loop needs its values whole.
        let end = match end {
            Some(ExchangeEnd::Mix {
                delta:
                    Delta::Step {
                        step: consensus,
                        copies: Some(copies),
                    },
                weight,
            }) if self.outer.is_none() => {
                landed.lag = Some(step.saturating_sub(exchange.step));
                landed.landings.push(Landing::AddStep(StepLanding {
                    step: consensus,
                    weight,
                    copies,
                    mixed_over: Some(self.pace.interval()),
                }));
                return landed;
            }
            end => end,
        };
        let mix = match end {
            None => None,
            Some(ExchangeEnd::Mix { delta, weight }) => {
                // Read off the copies only now, between two steps (decision 0092).
                delta.into_values().map(|mut delta| {
                    mix::scale(&mut delta, weight);
                    delta
                })
            }
            Some(ExchangeEnd::Subtract(mut delta)) => {
                mix::scale(&mut delta, -1.0);
                Some(delta)
            }
            Some(ExchangeEnd::Reduced { step: round, mean }) => {
                if round != step {
                    // Not for this replica's current step (it took over a peer's state).
                } else if let Some(outer) = self.outer.as_mut() {
                    landed
                        .landings
                        .push(Landing::Set(outer.averaged(round, mean).to_vec()));
                } else {
                    self.reduced_gradient = Some((round, mean));
                }
                None
            }
        };
        if let Some(delta) = mix {
            if let Some(outer) = self.outer.as_mut() {
                outer.mixed(&delta);
            }
            landed.lag = Some(step.saturating_sub(exchange.step));
            landed.landings.push(Landing::Add {
                delta,
                mixed_over: Some(self.pace.interval()),
            });
        }
        landed
    }

    /// `allreduce`, `every = 1`: the ring's mean of the gradients of `step`, if it came back.
    pub fn take_mean_gradient(&mut self, step: u64) -> Option<Vec<f32>> {
        match self.reduced_gradient.take() {
            Some((round, mean)) if round == step => Some(mean),
            _ => None,
        }
    }

    /// Parameters `params` as they stand once the outer moves still owed are paid, and the
    /// outer loop's state: what a state sync hands a peer.
    pub fn state_of(&self, mut params: Vec<f32>) -> (Vec<f32>, Option<OuterState>) {
        self.pay_owed(&mut params);
        (params, self.outer.as_ref().map(OuterLoop::state))
    }

    /// The replica took over a peer's state at `step` with `params` (and the peer's outer
    /// loop, when it had one): the moves owed to exchanges under way belong to the state left
    /// behind, and the pace starts again from `step`.
    pub fn adopted(&mut self, step: u64, params: &[f32], outer: Option<OuterState>) {
        for exchange in &mut self.exchanges {
            exchange.owed = None;
        }
        if let Some(loop_) = self.outer.as_mut() {
            let owes = loop_.adopt(outer, params, step, self.settings.interval);
            // Only a ring member waits in a round; gossip has none to owe.
            self.owes_round = owes && self.settings.ring;
        }
        self.pace.restart_at(step);
    }

    /// Whether an outer loop is kept: [`adopted`](Self::adopted) then needs the adopted
    /// parameters.
    pub fn keeps_outer(&self) -> bool {
        self.outer.is_some()
    }

    /// Exchanges under way.
    pub fn in_flight(&self) -> usize {
        self.exchanges.len()
    }

    /// Whether the exchange of the snapshot handed over is under way.
    pub fn due_in_flight(&self) -> bool {
        self.exchanges.iter().any(|x| x.due)
    }

    /// Whether an exchange under way holds training until its mix is in.
    pub fn held(&self) -> bool {
        self.exchanges.iter().any(|x| !x.overlapped)
    }

    /// Whether exchanges go on while training does: `sync.overlap`, but for ring rounds
    /// (synchronous whatever it says).
    fn overlaps(&self) -> bool {
        self.settings.overlap && !self.settings.ring
    }

    /// The outer step of a pairwise or elastic replica whose parameters were just taken for
    /// an exchange: the move it owes once the exchange ends (decision 0030). The progress it
    /// steps on runs to the point the replica stands at once the moves still owed to the
    /// exchanges under way are paid.
    fn outer_step_at(&mut self, step: u64, params: &[f32]) -> Option<Vec<f32>> {
        if self.settings.ring || self.outer.is_none() {
            return None;
        }
        let mut at = params.to_vec();
        self.pay_owed(&mut at);
        self.outer.as_mut()?.snapshot_taken(step, &at)
    }

    fn pay_owed(&self, params: &mut [f32]) {
        for owed in self.exchanges.iter().filter_map(|x| x.owed.as_ref()) {
            mix::add(params, owed);
        }
    }

    /// The interval in use.
    pub fn interval(&self) -> u64 {
        self.pace.interval()
    }
}

#[cfg(test)]
mod tests;
