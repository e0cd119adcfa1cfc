//! The simulator's replica: a vector of a few values that drifts toward the optimum of its own
//! shard as it trains, with a minibatch's noise, and moves toward its partners as it mixes;
//! enough to give the node's distance checks something to judge. It implements the trainer
//! contract, so that the node's own replica driver drives it.

use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::Result;
use murmur_protocol::mix::add;
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use crate::model::{ModelDescription, ParamDtype, TensorSpec};
use crate::node::replica::{
    Adoption, Clock, Evaluation, Replica, ReplicaInfo, ReplicaState, Saved, StepReport,
};

/// Steps between two checkpoints: what a restarted peer resumes from.
const CHECKPOINT_EVERY: u64 = 100;

/// What a simulated replica shares with the simulator, which reads it and steers it.
#[derive(Debug)]
pub(super) struct Trained {
    pub(super) params: Vec<f32>,
    pub(super) step: u64,
    /// The last checkpoint: the step and the parameters.
    pub(super) checkpoint: (u64, Vec<f32>),
    /// A hostile replica is held at this value in every coordinate, whatever it trains or
    /// mixes.
    pub(super) poison: Option<f32>,
    /// How many times slower than the run's step time its steps are.
    pub(super) slowness: f64,
}

pub(super) type Shared = Arc<Mutex<Trained>>;

pub(super) fn lock(shared: &Shared) -> MutexGuard<'_, Trained> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The model of a simulated replica of `dim` values.
pub(super) fn model(dim: usize) -> ModelDescription {
    ModelDescription::new(vec![TensorSpec {
        name: "x".into(),
        shape: vec![dim],
        dtype: ParamDtype::F32,
    }])
    .expect("invariant: one tensor is a model")
}

pub(super) struct SimReplica {
    info: ReplicaInfo,
    shared: Shared,
    /// The optimum of this peer's shard.
    optimum: Vec<f32>,
    pull: f32,
    noise: f32,
    /// Steps it trains; `None`: for ever.
    steps: Option<u64>,
    rng: ChaCha8Rng,
    /// The move of the last gradient handed to a ring, not applied yet.
    gradient: Vec<f32>,
}

impl SimReplica {
    pub(super) fn new(
        shared: Shared,
        optimum: Vec<f32>,
        (pull, noise): (f32, f32),
        steps: Option<u64>,
        seed: u64,
    ) -> Self {
        let dim = optimum.len();
        SimReplica {
            info: ReplicaInfo {
                model: model(dim),
                kind: "sim".into(),
                device: "cpu".into(),
                optimizer_buffers: Vec::new(),
                steps_per_epoch: Some(CHECKPOINT_EVERY),
            },
            shared,
            optimum,
            pull,
            noise,
            steps,
            rng: ChaCha8Rng::seed_from_u64(seed),
            gradient: Vec::new(),
        }
    }

    fn trained(&self) -> MutexGuard<'_, Trained> {
        lock(&self.shared)
    }

    /// The step's move: toward the optimum of this peer's shard, with a minibatch's noise.
    fn update(&mut self) -> Vec<f32> {
        let params = self.trained().params.clone();
        let (pull, noise, rng) = (self.pull, self.noise, &mut self.rng);
        params
            .iter()
            .zip(&self.optimum)
            .map(|(value, optimum)| pull * (optimum - value) + rng.random_range(-noise..=noise))
            .collect()
    }

    /// Changes the parameters by `change`; a poisoned replica stays where it is held.
    fn change(&self, change: impl FnOnce(&mut Vec<f32>)) {
        let mut trained = self.trained();
        change(&mut trained.params);
        if let Some(value) = trained.poison {
            trained.params.fill(value);
        }
    }

    fn stepped(&self) -> StepReport {
        let mut trained = self.trained();
        trained.step += 1;
        StepReport {
            step: trained.step,
            loss: None,
            samples: 1,
        }
    }
}

impl Replica for SimReplica {
    fn describe(&self) -> &ReplicaInfo {
        &self.info
    }

    fn clock(&self) -> Clock {
        let step = self.trained().step;
        Clock {
            step,
            finished: self.steps.is_some_and(|steps| step >= steps),
        }
    }

    fn step(&mut self) -> Result<Option<StepReport>> {
        if self.clock().finished {
            return Ok(None);
        }
        let update = self.update();
        self.change(|params| add(params, &update));
        Ok(Some(self.stepped()))
    }

    fn gradient(&mut self) -> Result<(u64, Vec<f32>)> {
        self.gradient = self.update();
        Ok((self.clock().step, self.gradient.clone()))
    }

    fn apply_mean_gradient(&mut self, mean: &[f32]) -> Result<StepReport> {
        self.change(|params| add(params, mean));
        Ok(self.stepped())
    }

    fn params(&mut self) -> Result<Vec<f32>> {
        Ok(self.trained().params.clone())
    }

    fn set_params(&mut self, params: Vec<f32>) -> Result<()> {
        self.change(|mine| *mine = params);
        Ok(())
    }

    fn add(&mut self, delta: Vec<f32>, _mixed_over: Option<u64>) -> Result<()> {
        self.change(|params| add(params, &delta));
        Ok(())
    }

    fn state(&mut self) -> Result<ReplicaState> {
        let trained = self.trained();
        Ok(ReplicaState {
            step: trained.step,
            params: trained.params.clone(),
            optimizer: None,
        })
    }

    fn adopt(&mut self, state: ReplicaState) -> Result<Adoption> {
        if state.params.len() != self.optimum.len() {
            return Ok(Adoption::Refused("a state of another size".into()));
        }
        self.change(|params| *params = state.params);
        self.trained().step = state.step;
        Ok(Adoption::ParametersOnly)
    }

    fn evaluate(&mut self) -> Result<Option<Evaluation>> {
        Ok(None)
    }

    /// Keeps the checkpoint in memory, for the simulator's restarts; writes nothing.
    fn checkpoint(&mut self) -> Result<Option<Saved>> {
        let mut trained = self.trained();
        trained.checkpoint = (trained.step, trained.params.clone());
        Ok(None)
    }
}
