//! What the node's actors tell each other. Plain data; the channels that carry them are made in
//! `node::run`:
//!
//! - replica driver -> engine: [`Due`], a snapshot to exchange (one at a time); its
//!   [`ExchangeEnd`] comes back on the oneshot it carries, or the sender is dropped (no mix).
//! - engine -> replica driver: [`ToReplica`], requests answered between two steps.
//! - engine -> membership: [`PeerNote`], offences to score and clocks seen in frames.

use murmur_protocol::network::PeerId;
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::{ExchangeEnd, OuterState, Snapshot};
use tokio::sync::oneshot;

use crate::node::replica::ReplicaState;

/// The replica's snapshot due for an exchange (or a ring round), and where the exchange's end
/// goes. Dropping `end` without sending ends the exchange with no mix.
#[derive(Debug)]
pub struct Due {
    pub snapshot: Snapshot,
    pub end: oneshot::Sender<ExchangeEnd>,
    /// Seconds a local step computes, as the replica's pace measures them, once measured.
    pub step_secs: Option<f64>,
}

/// Everything a state sync hands over: a peer that adopts it steps exactly like this replica
/// (its optimizer state, when both run the same optimizer).
#[derive(Clone, Debug)]
pub struct SyncState {
    pub replica: ReplicaState,
    /// The outer loop's anchor and velocity (`allreduce` with `every > 1`, or `sync.outer`).
    pub outer: Option<OuterState>,
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
