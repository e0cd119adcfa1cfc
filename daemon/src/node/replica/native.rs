//! Murmur's own trainer as a [`Replica`]: a `murmur_trainer::Trainer` on its backend, its
//! shard and test set, and its checkpoint directory. This is the only module of the node that
//! knows the trainer crate; everything else sees the contract.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use murmur_sync::replica::{Clock, StepLanding};
use murmur_trainer::data::Samples;
use murmur_trainer::train::{PendingStep, StepOutcome, TrainError};
use murmur_trainer::{Backend, OptimizerState, Trainer, checkpoint};

use super::{
    Adoption, Diverged, Evaluation, NamedBuffer, OptimizerBuffers, Replica, ReplicaInfo,
    ReplicaState, Saved, StepReport,
};
use crate::model::ModelDescription;

/// Where a native replica's checkpoints go, and which run they belong to.
#[derive(Clone, Debug)]
pub struct NativeCheckpoints {
    pub dir: PathBuf,
    /// The hash of the run config: a checkpoint resumes only the run that wrote it.
    pub config_hash: String,
    /// How many to keep.
    pub keep: usize,
}

/// A replica of one of Murmur's models, trained by Murmur's trainer.
#[derive(Debug)]
pub struct NativeReplica<B: Backend> {
    trainer: Trainer<B>,
    train: Samples,
    test: Samples,
    checkpoints: NativeCheckpoints,
    info: ReplicaInfo,
    /// `allreduce` with `every = 1`: the step whose gradient went to the ring.
    pending: Option<PendingStep>,
}

impl<B: Backend> NativeReplica<B> {
    /// `trainer` (resumed from its checkpoint, if any) training on `train`, evaluated on `test`.
    pub fn new(
        trainer: Trainer<B>,
        train: Samples,
        test: Samples,
        checkpoints: NativeCheckpoints,
    ) -> Self {
        let spec = trainer.spec();
        let info = ReplicaInfo {
            model: ModelDescription::of_layout(trainer.layout()),
            kind: format!("{:?}", spec.model.kind).to_lowercase(),
            device: trainer.backend().name(),
            optimizer_buffers: spec
                .optimizer
                .state_names()
                .iter()
                .map(|name| (*name).to_owned())
                .collect(),
            steps_per_epoch: Some(trainer.steps_per_epoch()),
        };
        NativeReplica {
            trainer,
            train,
            test,
            checkpoints,
            info,
            pending: None,
        }
    }

    /// The trainer, for tests that look inside.
    pub fn trainer(&self) -> &Trainer<B> {
        &self.trainer
    }

    fn report(outcome: StepOutcome) -> StepReport {
        StepReport {
            step: outcome.step,
            loss: Some(outcome.loss),
            samples: outcome.samples as u64,
        }
    }
}

/// A step's error: divergence as the contract's [`Diverged`], so that the node keeps the last
/// good checkpoint.
fn step_error(e: TrainError) -> anyhow::Error {
    match e {
        TrainError::Diverged { .. } => Diverged(e.to_string()).into(),
        other => other.into(),
    }
}

impl<B: Backend> Replica for NativeReplica<B> {
    fn describe(&self) -> &ReplicaInfo {
        &self.info
    }

    fn clock(&self) -> Clock {
        Clock {
            step: self.trainer.step_count(),
            finished: self.trainer.is_finished(),
        }
    }

    fn step(&mut self) -> Result<Option<StepReport>> {
        let outcome = self.trainer.train_step(&self.train).map_err(step_error)?;
        Ok(Some(Self::report(outcome)))
    }

    fn gradient(&mut self) -> Result<(u64, Vec<f32>)> {
        let pending = self.trainer.compute_gradients(&self.train)?;
        self.pending = Some(pending);
        Ok((pending.step, self.trainer.gradients()?))
    }

    fn apply_mean_gradient(&mut self, mean: &[f32]) -> Result<StepReport> {
        let pending = self
            .pending
            .take()
            .context("a mean gradient came back with no gradient computed")?;
        let outcome = self
            .trainer
            .apply_gradients(pending, Some(mean))
            .map_err(step_error)?;
        Ok(Self::report(outcome))
    }

    fn params(&mut self) -> Result<Vec<f32>> {
        Ok(self.trainer.params()?)
    }

    fn set_params(&mut self, params: Vec<f32>) -> Result<()> {
        Ok(self.trainer.set_params(&params)?)
    }

    fn add(&mut self, delta: Vec<f32>, mixed_over: Option<u64>) -> Result<()> {
        self.trainer.add_to_params(&delta)?;
        if let Some(interval) = mixed_over {
            // Quasi-global momentum counts a rare mix at a share of it (decision 0035).
            self.trainer.mixed(&delta, interval)?;
        }
        Ok(())
    }

    /// A run at a time into the parameters, unless the optimizer counts the mix (quasi-global
    /// momentum takes the whole delta).
    fn add_step(&mut self, landing: StepLanding) -> Result<()> {
        if landing.mixed_over.is_some() && self.trainer.counts_mixes() {
            let mixed_over = landing.mixed_over;
            return self.add(landing.values(), mixed_over);
        }
        let mut added = Ok(());
        landing.runs(|at, run| {
            if added.is_ok() {
                added = self.trainer.add_to_params_at(at, run);
            }
        });
        Ok(added?)
    }

    fn state(&mut self) -> Result<ReplicaState> {
        let optimizer = self.trainer.optimizer_state()?;
        let buffers = (self.info.optimizer_buffers.iter())
            .zip(optimizer.buffers)
            .map(|(name, values)| NamedBuffer {
                name: name.clone(),
                values,
            })
            .collect();
        Ok(ReplicaState {
            step: self.trainer.step_count(),
            params: self.trainer.params()?,
            optimizer: Some(OptimizerBuffers {
                buffers,
                updates: optimizer.updates,
            }),
        })
    }

    fn adopt(&mut self, state: ReplicaState) -> Result<Adoption> {
        let (optimizer, adoption) = match state.optimizer {
            Some(theirs) => {
                let buffers: Vec<Vec<f32>> = theirs.buffers.into_iter().map(|b| b.values).collect();
                if let Err(problem) = self.trainer.spec().optimizer.check_state(&buffers) {
                    return Ok(Adoption::Refused(format!(
                        "sent optimizer state no optimizer holds: {problem}"
                    )));
                }
                let state = OptimizerState {
                    buffers,
                    updates: theirs.updates,
                };
                (state, Adoption::Whole)
            }
            // A peer of another optimizer: the parameters and the clock, and this optimizer's
            // own state.
            None => (self.trainer.optimizer_state()?, Adoption::ParametersOnly),
        };
        match self.trainer.adopt(&state.params, state.step, &optimizer) {
            Err(e @ TrainError::ForeignOptimizerState { .. }) => {
                Ok(Adoption::Refused(e.to_string()))
            }
            result => result.map(|()| adoption).map_err(Into::into),
        }
    }

    fn evaluate(&mut self) -> Result<Option<Evaluation>> {
        let eval = self.trainer.evaluate(&self.test)?;
        Ok(Some(Evaluation {
            accuracy: eval.accuracy,
            loss: Some(eval.loss),
        }))
    }

    fn checkpoint(&mut self) -> Result<Option<Saved>> {
        let NativeCheckpoints {
            dir,
            config_hash,
            keep,
        } = &self.checkpoints;
        let ckpt = self.trainer.checkpoint(config_hash)?;
        if !ckpt.is_finite() {
            bail!(
                "not saving the replica at step {}: it holds values that are not finite \
                 (training diverged); the newest checkpoint is the last good one",
                ckpt.step
            );
        }
        let path = checkpoint::save(dir, &ckpt, self.trainer.layout(), *keep)?;
        let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        Ok(Some(Saved {
            step: ckpt.step,
            path,
            bytes,
        }))
    }
}

#[cfg(test)]
mod tests;
