//! What the node's actors tell each other. Plain data; the channels that carry them are made in
//! `node::run`:
//!
//! - replica driver -> engine: [`Due`], a snapshot to exchange (one at a time); its
//!   [`ExchangeEnd`] comes back on the oneshot it carries, or the sender is dropped (no mix).
//! - engine -> replica driver: [`ToReplica`], requests answered between two steps.
//! - engine -> membership: [`PeerNote`], offences to score and clocks seen in frames.

use std::sync::Arc;

use murmur_protocol::network::PeerId;
use murmur_sync::rejection::Rejection;
use tokio::sync::oneshot;

use crate::node::replica::ReplicaState;

/// The replica's parameters at one step (in `allreduce` mode with `every = 1`: the gradient
/// computed at that step, not yet applied).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub step: u64,
    pub params: Vec<f32>,
}

/// The replica's snapshot due for an exchange (or a ring round), and where the exchange's end
/// goes. Dropping `end` without sending ends the exchange with no mix.
#[derive(Debug)]
pub struct Due {
    pub snapshot: Snapshot,
    pub end: oneshot::Sender<ExchangeEnd>,
}

/// How an exchange of the replica ended: what lands on it between two steps.
#[derive(Debug)]
pub enum ExchangeEnd {
    /// Push-pull mix: `x <- x + weight (other - base)`, `base` the snapshot this node sent.
    Mix {
        other: Vec<f32>,
        base: Arc<Snapshot>,
        weight: f32,
    },
    /// Elastic worker update: `x <- x - delta`.
    Subtract(Vec<f32>),
    /// `allreduce`: the ring's mean of what this replica handed over at `step` (its gradient
    /// with `every = 1`, else its parameters).
    Reduced { step: u64, mean: Vec<f32> },
}

/// Everything a state sync hands over: a peer that adopts it steps exactly like this replica
/// (its optimizer state, when both run the same optimizer).
#[derive(Clone, Debug)]
pub struct SyncState {
    pub replica: ReplicaState,
    /// The outer loop's anchor and velocity (`allreduce` with `every > 1`, or `sync.outer`).
    pub outer: Option<OuterState>,
}

/// The state of an outer loop: `allreduce`'s (`every > 1`), the same on every replica, or a
/// pairwise replica's own (`sync.outer`).
#[derive(Clone, Debug, Default)]
pub struct OuterState {
    /// The parameters the current `H` local steps started from.
    pub anchor: Vec<f32>,
    /// The step of the average that gave the anchor (or of the start).
    pub anchor_step: u64,
    /// The DiLoCo outer velocity; empty with `outer = "none"` or before the first outer step.
    pub velocity: Vec<f32>,
}

/// What the sync engine asks of the replica driver. Everything is answered between steps.
#[derive(Debug)]
pub enum ToReplica {
    /// Answer with a snapshot of the parameters (to seed the elastic center).
    Snapshot(oneshot::Sender<Snapshot>),
    /// Answer a peer's exchange: a snapshot now, and the exchange's end later on `end` (the
    /// replica pauses for it, unless `sync.overlap` or `overlap`).
    Serve {
        reply: oneshot::Sender<Snapshot>,
        end: oneshot::Receiver<ExchangeEnd>,
        /// The partner is on a slow link: train on while its exchange is under way, and mix
        /// by the delta rule when it ends (decision 0029).
        overlap: bool,
    },
    /// Answer with this replica's whole state (a state sync's serving side); `optimizer`:
    /// the optimizer buffers the peer holds, which are sent when this replica's are the same.
    State {
        optimizer: Vec<String>,
        reply: oneshot::Sender<SyncState>,
    },
    /// State sync: continue from a peer's parameters, clock and optimizer state.
    Adopt {
        state: SyncState,
        /// Answered once the replica continues from `state`; or with why it cannot hold it
        /// (an optimizer state out of its bounds: the peer is scored).
        adopted: oneshot::Sender<Result<(), String>>,
    },
}

/// What the engine tells the membership actor.
#[derive(Debug)]
pub enum PeerNote {
    /// `peer` sent something it should not have: score it (repeat offenders are blocked).
    Offence { peer: PeerId, rejection: Rejection },
    /// A frame from `peer` was stamped `step`: fresher than its last heartbeat.
    SawStep { peer: PeerId, step: u64 },
}
