//! What the node's actors tell each other: the trainer thread's requests and answers. Plain
//! data; the channels that carry them are made in `node::run`.

use murmur_trainer::OptimizerState;
use tokio::sync::oneshot;

/// The replica's parameters at one step (in `allreduce` mode with `every = 1`: the gradient
/// computed at that step, not yet applied).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub step: u64,
    pub params: Vec<f32>,
}

/// Everything a state sync hands over: a peer that adopts it steps exactly like this replica.
#[derive(Clone, Debug)]
pub struct TrainerState {
    pub step: u64,
    pub params: Vec<f32>,
    pub optimizer: OptimizerState,
    /// `allreduce` with `every > 1`: the anchor and the DiLoCo outer velocity.
    pub outer: Option<OuterState>,
}

/// The state of `allreduce`'s outer loop (`every > 1`), the same on every replica.
#[derive(Clone, Debug, Default)]
pub struct OuterState {
    /// The parameters the current `H` local steps started from.
    pub anchor: Vec<f32>,
    /// The step of the average that gave the anchor (or of the start).
    pub anchor_step: u64,
    /// The DiLoCo outer velocity; empty with `outer = "none"` or before the first outer step.
    pub velocity: Vec<f32>,
}

/// What the sync engine asks of the trainer thread. Everything is applied between steps.
#[derive(Debug)]
pub enum ToTrainer {
    /// Answer with a snapshot of the parameters (a responder's side of an exchange).
    Snapshot(oneshot::Sender<Snapshot>),
    /// Push-pull mix: `x <- x + weight (other - base)`, `base` the snapshot this node sent.
    Mix {
        other: Vec<f32>,
        base: Vec<f32>,
        weight: f32,
    },
    /// Elastic worker update: `x <- x - delta`.
    Subtract(Vec<f32>),
    /// Answer with this replica's whole state (a state sync's serving side).
    State(oneshot::Sender<TrainerState>),
    /// State sync: continue from a peer's parameters, clock and optimizer state.
    Adopt {
        state: TrainerState,
        /// Answered once the trainer continues from `state`.
        adopted: oneshot::Sender<()>,
    },
    /// `allreduce`: the ring's mean of what this replica handed over at `step` (its gradient
    /// with `every = 1`, else its parameters).
    Reduced { step: u64, mean: Vec<f32> },
    /// Something the staleness gate waits on changed (a heartbeat arrived, a peer left).
    Wake,
}
