//! The trainer contract: what a node needs of the replica it keeps in sync, whoever trains it
//! (decision 0070).
//!
//! A node trains nothing itself. It drives a [`Replica`]: Murmur's own trainer ([`native`],
//! the only module of the node that knows it), or a trainer in another language (the Python
//! package in `python/` implements it over a PyTorch model). The replica owns its parameters
//! and its optimizer, on whatever device and in whatever dtype; the node sees the parameters
//! as one flat `f32` buffer laid out as the replica's [`ModelDescription`] says, and the
//! optimizer's state as named buffers of that layout, opaque to it.
//!
//! When to step, when to hand the parameters over, when to wait and how a mix lands are the
//! node's rules, one copy for every trainer: the sync crate's [`ReplicaLoop`](murmur_sync::replica::ReplicaLoop) (sans-IO) says
//! what to do next, and the [`driver`] does it, against a replica and the node's channels, on
//! the thread that trains (its own, or the caller's):
//!
//! ```text
//!   ReplicaDriver ──next()──> ReplicaLoop ──> Step | HandOver | Wait | SynchronousStep
//!        │                      ^   exchange ends, requests, the gate's peers, time
//!        └── Replica: step, params, add, state, adopt, evaluate, checkpoint ...
//! ```

pub mod driver;
pub mod native;

use std::path::PathBuf;

// Where a replica stands is the sync rules' notion; the contract hands it over as is.
pub use murmur_sync::replica::{Clock, NamedBuffer, OptimizerBuffers, ReplicaState, StepLanding};

use crate::model::ModelDescription;

/// What a replica is: its model, where it trains and what its optimizer keeps.
#[derive(Clone, Debug)]
pub struct ReplicaInfo {
    /// What the flat parameter buffer holds; its fingerprint is the run's model fingerprint.
    pub model: ModelDescription,
    /// A short name of the trainer's model for status pages: `mlp`, `cnn`, `gpt`, `pytorch`.
    pub kind: String,
    /// The device the replica trains on, as its trainer names it.
    pub device: String,
    /// The names of the optimizer's state buffers, each of the parameters' layout: what a
    /// state sync hands a peer that runs the same optimizer. Empty: none to hand over.
    pub optimizer_buffers: Vec<String>,
    /// Local steps in an epoch: the replica is evaluated and checkpointed at each epoch's end.
    /// `None`: the trainer keeps no epochs.
    pub steps_per_epoch: Option<u64>,
}

impl ReplicaInfo {
    pub fn fingerprint(&self) -> String {
        self.model.fingerprint()
    }

    pub fn param_count(&self) -> usize {
        self.model.param_count()
    }

    /// Epochs done at `step`.
    pub fn epochs_at(&self, step: u64) -> u64 {
        self.steps_per_epoch.map_or(0, |n| step / n.max(1))
    }

    /// Whether `step` ends an epoch.
    pub fn ends_epoch(&self, step: u64) -> bool {
        self.steps_per_epoch
            .is_some_and(|n| n > 0 && step > 0 && step.is_multiple_of(n))
    }
}

/// What one local step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Steps taken, this one included.
    pub step: u64,
    /// The step's training loss, where the trainer says it.
    pub loss: Option<f32>,
    /// Samples the step trained on.
    pub samples: u64,
}

/// How a replica took over a peer's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// Parameters, clock and optimizer state.
    Whole,
    /// Parameters and clock; the optimizer keeps its own state (none came, from a peer of
    /// another optimizer).
    ParametersOnly,
    /// The state is one no replica of this trainer could hold (an optimizer state out of its
    /// bounds): the replica is unchanged, and the peer that sent it is scored.
    Refused(String),
}

/// A replica's figures on its evaluation data.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Evaluation {
    /// The share of right answers (for a language model, of next-token guesses).
    pub accuracy: f64,
    pub loss: Option<f64>,
}

/// A checkpoint a replica wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    pub step: u64,
    pub path: PathBuf,
    pub bytes: u64,
}

/// The error a replica returns from [`Replica::step`] when training diverged (a loss that is
/// not finite): the node stops, and keeps the last checkpoint rather than save this replica.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Diverged(pub String);

/// What a node needs of the replica it keeps in sync. Every method is called between two
/// steps, from one thread; none is called while another runs.
///
/// The flat buffers (`params`, deltas, gradients) hold `ReplicaInfo::model`'s tensors in order,
/// as `f32`. A replica keeps its own dtype: it converts what it hands over and what it is given.
pub trait Replica: Send {
    /// The replica's model, device and optimizer; the same for its whole life.
    fn describe(&self) -> &ReplicaInfo;

    /// Where its training stands.
    fn clock(&self) -> Clock;

    /// Takes one local step. `None` when no step was taken (the replica finished meanwhile). A
    /// trainer whose loop is its own steps by itself and reports its steps to the driver
    /// (`ReplicaDriver::stepped`): it is never asked.
    fn step(&mut self) -> anyhow::Result<Option<StepReport>>;

    /// Computes the gradient of this step's batch without applying it, for rings that step
    /// together (`allreduce` with `every = 1`): the step it is for, and the gradient.
    fn gradient(&mut self) -> anyhow::Result<(u64, Vec<f32>)>;

    /// Steps with the ring's mean of every replica's gradient of the last
    /// [`gradient`](Self::gradient).
    fn apply_mean_gradient(&mut self, mean: &[f32]) -> anyhow::Result<StepReport>;

    /// A copy of the parameters.
    fn params(&mut self) -> anyhow::Result<Vec<f32>>;

    /// Replaces the parameters (a ring's outer average); the optimizer state and the clock stay.
    /// The buffer is the replica's to keep (a trainer in another language reads it in place).
    fn set_params(&mut self, params: Vec<f32>) -> anyhow::Result<()>;

    /// Adds `delta` to the parameters as they are now. `mixed_over`: the delta is a mix with
    /// peers, about one every that many steps (quasi-global momentum counts it at a share);
    /// `None`: the node's own move (the outer step's). The buffer is the replica's to keep.
    fn add(&mut self, delta: Vec<f32>, mixed_over: Option<u64>) -> anyhow::Result<()>;

    /// Adds a compressed exchange's mix, read off the pair's copies (decision 0094). By
    /// default through a buffer of its values, as [`add`](Self::add); a replica that can add
    /// a run at a time needs no model-sized buffer for it.
    fn add_step(&mut self, landing: StepLanding) -> anyhow::Result<()> {
        let mixed_over = landing.mixed_over;
        self.add(landing.values(), mixed_over)
    }

    /// The clock, parameters and optimizer state, for a peer that takes this replica over.
    fn state(&mut self) -> anyhow::Result<ReplicaState>;

    /// Continues from a peer's state (state sync). Its lengths and values are checked; the
    /// optimizer's buffers, when there are any, are this replica's own names in order.
    fn adopt(&mut self, state: ReplicaState) -> anyhow::Result<Adoption>;

    /// Evaluates the replica, where its trainer can (`None`: it cannot).
    fn evaluate(&mut self) -> anyhow::Result<Option<Evaluation>>;

    /// Saves a checkpoint to resume from, where its trainer keeps them (`None`: it does not).
    fn checkpoint(&mut self) -> anyhow::Result<Option<Saved>>;
}
