//! The training loop of one replica: batches in a seeded order, forward and backward, optimizer
//! step, evaluation, and checkpoint capture and restore.
//!
//! Every model trains here: the image classifiers on labelled images, a GPT on windows of
//! text (a window is one sample).
//!
//! Samples are drawn from an endless stream of passes over the training set, each pass a
//! permutation fixed by `(seed, pass)`. An epoch is `epoch_samples` consecutive positions of
//! that stream (one pass unless the spec says otherwise), cut into batches; so the batch of step
//! `s` is fixed by `(seed, s)` alone, which is what makes a resumed run identical to an
//! uninterrupted one.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::backend::{Backend, BackendError, BackendResult};
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::data::{Dataset, Samples, epoch_order};
use crate::gpt::{GptReplica, GptSpec};
use crate::model::{IMAGE_SIDE, Model, ModelError, ModelSpec};
use crate::optim::{
    LrSchedule, Optimizer, OptimizerError, OptimizerSpec, OptimizerState, clip_global_norm,
};
use crate::params::ParamLayout;
use crate::replica::{Replica, Weights};

/// What to train and how: the parts of a run config the trainer needs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    pub model: ModelSpec,
    pub optimizer: OptimizerSpec,
    pub batch_size: usize,
    pub epochs: u64,
    pub seed: u64,
    /// Samples in one epoch; `None`: one pass over the training set. Peers whose shards differ
    /// in size set the same value so that they all take the same number of steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch_samples: Option<usize>,
}

impl TrainSpec {
    /// A short hash of everything that changes the trained parameters (model, optimizer,
    /// batch size, epochs, seed, epoch length): a checkpoint resumes only a run with the same hash.
    pub fn config_hash(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("invariant: a train spec serialises");
        let digest = Sha256::digest(&canonical);
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// Why training stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Optimizer(#[from] OptimizerError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error("training.batch_size must be at least 1")]
    ZeroBatch,
    #[error(
        "the dataset's images are {rows}x{cols}, but the models take {side}x{side} \
         Fashion-MNIST images; point `--data` at Fashion-MNIST",
        side = IMAGE_SIDE
    )]
    ImageShape { rows: usize, cols: usize },
    #[error("the training set is empty: check `--data` or the shard")]
    EmptyDataset,
    #[error(
        "{model} model cannot read {data}: image models train on Fashion-MNIST, a `gpt` on a \
         directory of text; point `--data` at the data the model reads"
    )]
    WrongData {
        model: &'static str,
        data: &'static str,
    },
    #[error(
        "the text has no window of {len} tokens (the context plus one): the documents are \
         shorter than `model.context`; use longer texts or a shorter context"
    )]
    TextTooShort { len: usize },
    #[error("training.epoch_samples must be at least 1 (leave it out for one pass per epoch)")]
    ZeroEpochSamples,

    #[error("the training set changed size ({expected} samples at start, {actual} now)")]
    DatasetChanged { expected: usize, actual: usize },
    #[error(
        "training diverged: the loss became {loss} at step {step}; lower optimizer.lr \
         (now {lr}) or add warmup"
    )]
    Diverged { step: u64, loss: f32, lr: f32 },
    #[error("a gradient computed at step {pending} cannot be applied at step {step}")]
    StalePending { pending: u64, step: u64 },
    #[error(
        "optimizer state of buffers {found:?} does not fit this run's optimizer \
         ({expected} buffers of {len} values): the peer runs another optimizer"
    )]
    ForeignOptimizerState {
        expected: usize,
        len: usize,
        found: Vec<usize>,
    },
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// Steps taken, this one included.
    pub step: u64,
    pub loss: f32,
    pub samples: usize,
    pub lr: f32,
}

/// A step whose gradient is computed but not yet applied (see [`Trainer::compute_gradients`]).
#[derive(Clone, Copy, Debug, PartialEq)]
#[must_use = "a pending step does nothing until it is applied"]
pub struct PendingStep {
    /// The step the gradient was computed at (steps taken before it).
    pub step: u64,
    pub loss: f32,
    pub samples: usize,
}

/// Accuracy and mean loss over a dataset. For a language model the accuracy is that of its
/// next-token guesses, and the loss the mean cross-entropy per token.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Evaluation {
    pub accuracy: f64,
    pub loss: f64,
    pub samples: usize,
}

/// The replica of the model being trained: a stack of layers, or a GPT.
#[derive(Debug)]
enum Net<B: Backend> {
    Layers(Replica<B>),
    Gpt(GptReplica<B>),
}

impl<B: Backend> Net<B> {
    fn new(backend: &B, network: Model, capacity: usize, params: &[f32]) -> BackendResult<Self> {
        Ok(match network {
            Model::Layers(arch) => Net::Layers(Replica::new(backend, arch, capacity, params)?),
            Model::Gpt(spec) => Net::Gpt(GptReplica::new(backend, spec, capacity, params)?),
        })
    }

    fn capacity(&self) -> usize {
        match self {
            Net::Layers(r) => r.capacity(),
            Net::Gpt(r) => r.capacity(),
        }
    }

    /// The flat parameter and gradient buffers.
    fn weights(&self) -> &Weights<B> {
        match self {
            Net::Layers(r) => r.weights(),
            Net::Gpt(r) => r.weights(),
        }
    }

    fn weights_mut(&mut self) -> &mut Weights<B> {
        match self {
            Net::Layers(r) => r.weights_mut(),
            Net::Gpt(r) => r.weights_mut(),
        }
    }
}

/// One replica being trained on one device.
#[derive(Debug)]
pub struct Trainer<B: Backend> {
    backend: B,
    spec: TrainSpec,
    net: Net<B>,
    layout: ParamLayout,
    fingerprint: String,
    /// Multiply-adds of one step of a full batch, times two.
    step_flops: u64,
    optimizer: Optimizer<B>,
    schedule: LrSchedule,
    train_len: usize,
    /// Positions of the sample stream per epoch (see the module docs).
    epoch_samples: usize,
    step: u64,
    /// Sample order of the current pass over the training set, cached with its pass number.
    order: Option<(u64, Vec<u32>)>,
    batch_indices: Vec<u32>,
    batch_images: Vec<f32>,
    batch_labels: Vec<u32>,
    predictions: Vec<u32>,
}

impl<B: Backend> Trainer<B> {
    /// A fresh replica, parameters initialised from `spec.seed`, for a training set of
    /// `train` samples.
    pub fn new(backend: B, spec: TrainSpec, train: &Samples) -> Result<Self, TrainError> {
        if spec.batch_size == 0 {
            return Err(TrainError::ZeroBatch);
        }
        let network = spec.model.expand()?;
        check_samples(&network, train)?;
        if train.is_empty() {
            return Err(TrainError::EmptyDataset);
        }
        let epoch_samples = spec.epoch_samples.unwrap_or(train.len());
        if epoch_samples == 0 {
            return Err(TrainError::ZeroEpochSamples);
        }

        spec.optimizer.validate()?;
        let layout = network.layout();
        let params = network.init_params(spec.seed);
        let optimizer = match network {
            // nanoGPT decays the matrices only, not the biases and LayerNorm gains.
            Model::Gpt(_) => Optimizer::with_decay_filter(
                &backend,
                spec.optimizer.clone(),
                &layout,
                GptSpec::decays,
            )?,
            Model::Layers(_) => Optimizer::new(&backend, spec.optimizer.clone(), &layout)?,
        };
        let fingerprint = network.fingerprint();
        let step_flops = network.train_step_flops(spec.batch_size);
        let net = Net::new(&backend, network, spec.batch_size, &params)?;
        let steps_per_epoch = epoch_samples.div_ceil(spec.batch_size) as u64;
        let schedule = LrSchedule::new(&spec.optimizer, steps_per_epoch * spec.epochs);
        Ok(Trainer {
            backend,
            net,
            layout,
            fingerprint,
            step_flops,
            optimizer,
            schedule,
            train_len: train.len(),
            epoch_samples,
            step: 0,
            order: None,
            batch_indices: Vec::new(),
            batch_images: Vec::new(),
            batch_labels: Vec::new(),
            predictions: Vec::new(),
            spec,
        })
    }

    pub fn spec(&self) -> &TrainSpec {
        &self.spec
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Every tensor's name, shape and place in the flat parameter buffer.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Values in the flat parameter buffer.
    pub fn param_count(&self) -> usize {
        self.layout.len()
    }

    /// A short hash of the model's shape: peers average only with matching fingerprints.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Floating-point operations of one step on a full batch, counting GEMMs only.
    pub fn step_flops(&self) -> u64 {
        self.step_flops
    }

    pub fn steps_per_epoch(&self) -> u64 {
        self.epoch_samples.div_ceil(self.spec.batch_size) as u64
    }

    /// Samples in one epoch of this run.
    pub fn epoch_samples(&self) -> usize {
        self.epoch_samples
    }

    pub fn total_steps(&self) -> u64 {
        self.steps_per_epoch() * self.spec.epochs
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Epochs completed so far.
    pub fn epochs_done(&self) -> u64 {
        self.step / self.steps_per_epoch()
    }

    pub fn is_finished(&self) -> bool {
        self.step >= self.total_steps()
    }

    /// Trains on the next batch of `train` (the samples given to [`Trainer::new`]).
    pub fn train_step(&mut self, train: &Samples) -> Result<StepOutcome, TrainError> {
        let pending = self.compute_gradients(train)?;
        self.apply_gradients(pending, None)
    }

    /// The first half of a step: forward and backward on the next batch of `train`, leaving
    /// the gradient in place. Finish the step with [`Trainer::apply_gradients`]; in between,
    /// [`Trainer::gradients`] reads the gradient (synchronous data-parallel training averages
    /// it across replicas there).
    pub fn compute_gradients(&mut self, train: &Samples) -> Result<PendingStep, TrainError> {
        if train.len() != self.train_len {
            return Err(TrainError::DatasetChanged {
                expected: self.train_len,
                actual: train.len(),
            });
        }
        self.fill_batch_indices();
        let indices = std::mem::take(&mut self.batch_indices);
        let result = self.compute_gradients_on(train, &indices);
        self.batch_indices = indices;
        result
    }

    /// [`Trainer::compute_gradients`] on the samples `indices` of `data` (at most a batch of
    /// them) rather than on the step's own batch.
    pub fn compute_gradients_on(
        &mut self,
        data: &Samples,
        indices: &[u32],
    ) -> Result<PendingStep, TrainError> {
        let backend = &self.backend;
        let loss = match (&mut self.net, data) {
            (Net::Layers(replica), Samples::Images(images)) => {
                images.fill_batch(indices, &mut self.batch_images, &mut self.batch_labels);
                replica.compute_gradients(backend, &self.batch_images, &self.batch_labels)?
            }
            (Net::Gpt(replica), Samples::Text(text)) => replica
                .compute_gradients(backend, indices.iter().map(|&i| text.window(i as usize)))?,
            (net, data) => return Err(wrong_data(net, data)),
        };
        if !loss.is_finite() {
            return Err(TrainError::Diverged {
                step: self.step,
                loss,
                lr: self.schedule.lr(self.step),
            });
        }
        Ok(PendingStep {
            step: self.step,
            loss,
            samples: indices.len(),
        })
    }

    /// The gradient of the pending step, copied to the host.
    pub fn gradients(&self) -> Result<Vec<f32>, TrainError> {
        Ok(self.net.weights().download_grads(&self.backend)?)
    }

    /// The second half of a step: the optimizer update with the gradient left by
    /// [`Trainer::compute_gradients`], or with `replacement` (the same length) instead.
    pub fn apply_gradients(
        &mut self,
        pending: PendingStep,
        replacement: Option<&[f32]>,
    ) -> Result<StepOutcome, TrainError> {
        if pending.step != self.step {
            return Err(TrainError::StalePending {
                pending: pending.step,
                step: self.step,
            });
        }
        if let Some(grads) = replacement {
            self.net.weights_mut().set_grads(&self.backend, grads)?;
        }
        let lr = self.schedule.lr(self.step);
        let weights = self.net.weights_mut();
        if let Some(max_norm) = self.spec.optimizer.grad_clip {
            clip_global_norm(&self.backend, &mut weights.grads, max_norm)?;
        }
        self.optimizer
            .step(&self.backend, &mut weights.params, &weights.grads, lr)?;
        self.step += 1;
        Ok(StepOutcome {
            step: self.step,
            loss: pending.loss,
            samples: pending.samples,
            lr,
        })
    }

    /// The sample indices of the current step: positions `start..end` of the sample stream,
    /// where the epoch's batches start at `epoch * epoch_samples`, and position `q` is sample
    /// `order(pass = q / len)[q % len]`.
    fn fill_batch_indices(&mut self) {
        let per_epoch = self.steps_per_epoch();
        let (epoch, position) = (self.step / per_epoch, self.step % per_epoch);
        let epoch_start = epoch * self.epoch_samples as u64;
        let start = epoch_start + position * self.spec.batch_size as u64;
        let end =
            (start + self.spec.batch_size as u64).min(epoch_start + self.epoch_samples as u64);
        let len = self.train_len as u64;
        self.batch_indices.clear();
        for q in start..end {
            let pass = q / len;
            if self.order.as_ref().is_none_or(|(p, _)| *p != pass) {
                self.order = Some((pass, epoch_order(self.train_len, self.spec.seed, pass)));
            }
            let (_, order) = self.order.as_ref().expect("invariant: order was just set");
            self.batch_indices.push(order[(q % len) as usize]);
        }
    }

    /// Accuracy and mean loss of the current parameters on `data`.
    pub fn evaluate(&mut self, data: &Samples) -> Result<Evaluation, TrainError> {
        if let Samples::Images(images) = data {
            check_images(images)?;
        }
        let chunk = self.net.capacity();
        let backend = &self.backend;
        // Correct guesses out of how many, and the loss summed over the batches' samples.
        let (mut correct, mut guesses, mut loss_sum) = (0usize, 0usize, 0.0f64);
        let all: Vec<u32> = (0..data.len() as u32).collect();
        for indices in all.chunks(chunk) {
            let (loss, right, out_of) = match (&mut self.net, data) {
                (Net::Layers(replica), Samples::Images(images)) => {
                    images.fill_batch(indices, &mut self.batch_images, &mut self.batch_labels);
                    let (loss, right) = replica.evaluate_batch(
                        backend,
                        &self.batch_images,
                        &self.batch_labels,
                        &mut self.predictions,
                    )?;
                    (loss, right, indices.len())
                }
                (Net::Gpt(replica), Samples::Text(text)) => replica
                    .evaluate_batch(backend, indices.iter().map(|&i| text.window(i as usize)))?,
                (net, data) => return Err(wrong_data(net, data)),
            };
            correct += right;
            guesses += out_of;
            loss_sum += f64::from(loss) * indices.len() as f64;
        }
        Ok(Evaluation {
            accuracy: correct as f64 / guesses.max(1) as f64,
            loss: loss_sum / data.len().max(1) as f64,
            samples: data.len(),
        })
    }

    /// The parameters, copied to the host.
    pub fn params(&self) -> Result<Vec<f32>, TrainError> {
        Ok(self.net.weights().download_params(&self.backend)?)
    }

    /// Replaces the parameters (a mix from peers); the optimizer state and the clock stay.
    pub fn set_params(&mut self, params: &[f32]) -> Result<(), TrainError> {
        Ok(self.net.weights_mut().set_params(&self.backend, params)?)
    }

    /// Adds `delta` (of the model's length) to the parameters: a mix lands without a copy of
    /// the model on the host.
    pub fn add_to_params(&mut self, delta: &[f32]) -> Result<(), TrainError> {
        Ok(self.net.weights_mut().add_to_params(&self.backend, delta)?)
    }

    /// [`Trainer::add_to_params`] for the values from `at` on.
    pub fn add_to_params_at(&mut self, at: usize, delta: &[f32]) -> Result<(), TrainError> {
        Ok(self
            .net
            .weights_mut()
            .add_to_params_at(&self.backend, at, delta)?)
    }

    /// Whether [`Trainer::mixed`] needs a mix's delta: its optimizer keeps quasi-global
    /// momentum, which counts a mix at a share (decision 0035).
    pub fn counts_mixes(&self) -> bool {
        self.optimizer.counts_mixes()
    }

    /// A mix with peers moved the parameters by `delta`, one mix about every `interval`
    /// steps (after [`Trainer::add_to_params`]); see [`crate::optim::Optimizer::mixed`].
    pub fn mixed(&mut self, delta: &[f32], interval: u64) -> Result<(), TrainError> {
        Ok(self.optimizer.mixed(&self.backend, delta, interval)?)
    }

    /// The optimizer's state, copied to the host (for a peer that takes over this replica).
    pub fn optimizer_state(&self) -> Result<OptimizerState, TrainError> {
        Ok(OptimizerState {
            buffers: self.optimizer.download_state(&self.backend)?,
            updates: self.optimizer.updates(),
        })
    }

    /// Takes over a peer's replica (state sync): its parameters, clock and optimizer state.
    /// Training continues at `step` on this replica's own data, stepping exactly as the peer
    /// would have.
    pub fn adopt(
        &mut self,
        params: &[f32],
        step: u64,
        optimizer: &OptimizerState,
    ) -> Result<(), TrainError> {
        let expected = self.spec.optimizer.state_names().len();
        let len = self.param_count();
        if optimizer.buffers.len() != expected || optimizer.buffers.iter().any(|b| b.len() != len) {
            return Err(TrainError::ForeignOptimizerState {
                expected,
                len,
                found: optimizer.buffers.iter().map(Vec::len).collect(),
            });
        }
        self.set_params(params)?;
        self.optimizer.restore_state(
            &self.backend,
            &optimizer.buffers,
            optimizer.updates,
            self.last_lr(step),
        )?;
        self.step = step.min(self.total_steps());
        self.order = None;
        Ok(())
    }

    /// Accuracy and loss of other parameters of this model (say, the elastic center) on `data`;
    /// this replica's own parameters are put back afterwards.
    pub fn evaluate_params(
        &mut self,
        params: &[f32],
        data: &Samples,
    ) -> Result<Evaluation, TrainError> {
        let own = self.params()?;
        self.set_params(params)?;
        let result = self.evaluate(data);
        self.set_params(&own)?;
        result
    }

    /// Captures everything needed to resume from this exact step.
    pub fn checkpoint(&self, config_hash: &str) -> Result<Checkpoint, TrainError> {
        Ok(Checkpoint {
            step: self.step,
            epoch: self.epochs_done(),
            config_hash: config_hash.to_owned(),
            fingerprint: self.fingerprint.clone(),
            params: self.params()?,
            optimizer_state: self.optimizer.download_state(&self.backend)?,
            optimizer_state_names: self
                .spec
                .optimizer
                .state_names()
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            optimizer_updates: self.optimizer.updates(),
        })
    }

    /// The learning rate of the update before step `step`, if there was one.
    fn last_lr(&self, step: u64) -> Option<f32> {
        step.checked_sub(1).map(|last| self.schedule.lr(last))
    }

    /// Continues from `checkpoint`, which must come from the same model and optimizer.
    pub fn restore(&mut self, checkpoint: &Checkpoint) -> Result<(), TrainError> {
        let names = self.spec.optimizer.state_names();
        if checkpoint.optimizer_state_names != names {
            return Err(CheckpointError::Mismatch {
                path: "(in memory)".into(),
                what: "optimizer",
                expected: names.join(","),
                found: checkpoint.optimizer_state_names.join(","),
            }
            .into());
        }
        self.net
            .weights_mut()
            .set_params(&self.backend, &checkpoint.params)?;
        self.optimizer.restore_state(
            &self.backend,
            &checkpoint.optimizer_state,
            checkpoint.optimizer_updates,
            self.last_lr(checkpoint.step),
        )?;
        self.step = checkpoint.step;
        self.order = None;
        Ok(())
    }
}

/// Checks that `data` is what `network` reads: 28x28 images for the classifiers, text with
/// at least one window for a GPT.
fn check_samples(model: &Model, data: &Samples) -> Result<(), TrainError> {
    match (model, data) {
        (Model::Layers(_), Samples::Images(images)) => check_images(images),
        (Model::Gpt(spec), Samples::Text(text)) => {
            let len = spec.context + 1;
            if text.windows().window_len() != len || text.is_empty() {
                return Err(TrainError::TextTooShort { len });
            }
            Ok(())
        }
        (model, data) => Err(TrainError::WrongData {
            model: model_kind(matches!(model, Model::Gpt(_))),
            data: data.describe(),
        }),
    }
}

fn wrong_data<B: Backend>(net: &Net<B>, data: &Samples) -> TrainError {
    TrainError::WrongData {
        model: model_kind(matches!(net, Net::Gpt(_))),
        data: data.describe(),
    }
}

/// The kind of model, for messages.
fn model_kind(gpt: bool) -> &'static str {
    if gpt { "a `gpt`" } else { "an image" }
}

fn check_images(data: &Dataset) -> Result<(), TrainError> {
    let (rows, cols) = data.image_shape();
    if (rows, cols) != (IMAGE_SIDE, IMAGE_SIDE) {
        return Err(TrainError::ImageShape { rows, cols });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;

    fn images(len: usize) -> Samples {
        Samples::Images(Dataset::synthetic(len, 1))
    }

    fn trainer(len: usize, batch_size: usize, epoch_samples: Option<usize>) -> Trainer<CpuBackend> {
        let spec = TrainSpec {
            model: ModelSpec::mlp(),
            optimizer: crate::optim::OptimizerSpec::sgd(0.01, 0.0),
            batch_size,
            epochs: 4,
            seed: 3,
            epoch_samples,
        };
        Trainer::new(CpuBackend::new(), spec, &images(len)).unwrap()
    }

    /// The indices of every step of the run, one `Vec` per step.
    fn batches(trainer: &mut Trainer<CpuBackend>) -> Vec<Vec<u32>> {
        (0..trainer.total_steps())
            .map(|step| {
                trainer.step = step;
                trainer.fill_batch_indices();
                trainer.batch_indices.clone()
            })
            .collect()
    }

    fn visits(batches: &[Vec<u32>], len: usize) -> Vec<usize> {
        let mut counts = vec![0; len];
        for i in batches.iter().flatten() {
            counts[*i as usize] += 1;
        }
        counts
    }

    /// Values added from an offset land there and nowhere else; a run past the parameters'
    /// end is refused, and leaves them as they were.
    #[test]
    fn values_added_from_an_offset_land_there_and_a_run_past_the_end_is_refused() {
        let mut t = trainer(10, 4, None);
        let before = t.params().unwrap();
        let n = before.len();
        t.add_to_params_at(n - 3, &[1.0, 2.0, 3.0]).unwrap();
        let after = t.params().unwrap();
        assert_eq!(after[..n - 3], before[..n - 3]);
        let added: Vec<f32> = (0..3)
            .map(|i| after[n - 3 + i] - before[n - 3 + i])
            .collect();
        assert!(
            added
                .iter()
                .zip([1.0, 2.0, 3.0])
                .all(|(a, b)| (a - b).abs() < 1e-6),
            "{added:?}"
        );
        assert!(t.add_to_params_at(n - 2, &[1.0, 2.0, 3.0]).is_err());
        assert!(t.add_to_params_at(usize::MAX, &[1.0]).is_err());
        assert_eq!(t.params().unwrap(), after);
    }

    #[test]
    fn an_epoch_of_the_training_set_size_is_one_pass() {
        let mut by_default = trainer(10, 4, None);
        let mut explicit = trainer(10, 4, Some(10));
        assert_eq!(by_default.steps_per_epoch(), 3);
        let steps = batches(&mut by_default);
        assert_eq!(steps, batches(&mut explicit));
        // The last batch of each epoch is short, and every epoch visits every sample once.
        assert_eq!(
            steps.iter().map(Vec::len).collect::<Vec<_>>()[..3],
            [4, 4, 2]
        );
        for epoch in steps.chunks(3) {
            assert_eq!(visits(epoch, 10), vec![1; 10]);
        }
    }

    #[test]
    fn a_longer_epoch_cycles_through_a_small_shard() {
        let mut t = trainer(10, 4, Some(25));
        assert_eq!(t.steps_per_epoch(), 7);
        let steps = batches(&mut t);
        let first_epoch = &steps[..7];
        assert_eq!(first_epoch.iter().map(Vec::len).sum::<usize>(), 25);
        let counts = visits(first_epoch, 10);
        assert!(counts.iter().all(|&c| c == 2 || c == 3), "{counts:?}");
        // Four epochs of 25 are exactly ten passes.
        assert_eq!(visits(&steps, 10), vec![10; 10]);
    }

    #[test]
    fn a_shorter_epoch_continues_the_pass_where_the_last_one_stopped() {
        let mut t = trainer(10, 4, Some(6));
        assert_eq!(t.steps_per_epoch(), 2);
        let steps = batches(&mut t);
        assert_eq!(
            steps.iter().map(Vec::len).collect::<Vec<_>>(),
            [4, 2, 4, 2, 4, 2, 4, 2]
        );
        // Epochs 0 and 1 hold positions 0..12: the whole first pass and two of the second.
        let counts = visits(&steps[..4], 10);
        assert_eq!(counts.iter().sum::<usize>(), 12);
        assert!(counts.iter().all(|&c| c >= 1), "{counts:?}");
    }

    /// A replica that adopts another's state steps exactly like it from then on: the
    /// parameters alone would not do, the momentum (or AdamW's moments and count) must travel.
    #[test]
    fn an_adopted_replica_steps_bitwise_like_its_source() {
        let data = images(64);
        for optimizer in [
            crate::optim::OptimizerSpec::sgd(0.05, 0.9),
            crate::optim::OptimizerSpec {
                quasi_global: Some(true),
                ..crate::optim::OptimizerSpec::sgd(0.05, 0.9)
            },
            crate::optim::OptimizerSpec {
                kind: crate::optim::OptimizerKind::Adamw,
                momentum: None,
                ..crate::optim::OptimizerSpec::sgd(0.01, 0.0)
            },
        ] {
            let spec = TrainSpec {
                optimizer,
                ..trainer(64, 8, None).spec
            };
            let new = || Trainer::new(CpuBackend::new(), spec.clone(), &data).unwrap();
            let (mut source, mut adopter) = (new(), new());
            for _ in 0..5 {
                source.train_step(&data).unwrap();
            }
            for _ in 0..2 {
                adopter.train_step(&data).unwrap();
            }
            let state = source.optimizer_state().unwrap();
            adopter
                .adopt(&source.params().unwrap(), source.step_count(), &state)
                .unwrap();
            for _ in 0..3 {
                source.train_step(&data).unwrap();
                adopter.train_step(&data).unwrap();
            }
            assert_eq!(adopter.step_count(), source.step_count());
            let bits = |t: &Trainer<CpuBackend>| -> Vec<u32> {
                t.params().unwrap().iter().map(|v| v.to_bits()).collect()
            };
            assert!(bits(&adopter) == bits(&source), "{:?}", spec.optimizer.kind);
        }
    }

    #[test]
    fn optimizer_state_of_another_optimizer_is_refused() {
        let mut sgd = trainer(16, 4, None);
        let params = sgd.params().unwrap();
        let adam_like = OptimizerState {
            buffers: vec![vec![0.0; params.len()]; 2],
            updates: 3,
        };
        let err = sgd.adopt(&params, 1, &adam_like).unwrap_err();
        assert!(err.to_string().contains("another optimizer"), "{err}");
        assert_eq!(sgd.step_count(), 0, "nothing taken over");
    }

    #[test]
    fn a_zero_epoch_is_refused() {
        let spec = TrainSpec {
            epoch_samples: Some(0),
            ..trainer(10, 4, None).spec
        };
        let err = Trainer::new(CpuBackend::new(), spec, &images(10)).unwrap_err();
        assert!(err.to_string().contains("epoch_samples"), "{err}");
    }
}
