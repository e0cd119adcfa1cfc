//! A GPT's training loop on one peer's text: batches of windows drawn at random (as nanoGPT
//! draws them), AdamW with matrices-only weight decay, global-norm clipping and a learning-rate
//! schedule; and its loss on held-out windows.

use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};

use super::{GptPass, GptSpec};
use crate::backend::{Backend, BackendResult, whole_mut};
use crate::data::text::{Corpus, TokenRange, Windows};
use crate::optim::{LrSchedule, Optimizer, OptimizerSpec, clip_global_norm};

/// What a GPT trains with.
#[derive(Clone, Debug, PartialEq)]
pub struct GptTrainSpec {
    pub model: GptSpec,
    pub optimizer: OptimizerSpec,
    /// Sequences of `model.context` tokens per step.
    pub sequences: usize,
    /// Steps the schedule spans.
    pub steps: u64,
    /// The largest global gradient norm; larger gradients are scaled down to it.
    pub grad_clip: Option<f32>,
    /// Seeds the initial parameters and the draw of windows.
    pub seed: u64,
}

/// One replica of a GPT and its optimizer, training on windows of a corpus.
pub struct GptTrainer<B: Backend> {
    backend: B,
    spec: GptTrainSpec,
    pass: GptPass<B>,
    params: B::Buffer,
    grads: B::Buffer,
    optimizer: Optimizer<B>,
    schedule: LrSchedule,
    windows: Windows,
    rng: ChaCha8Rng,
    step: u64,
    /// The batch being assembled: inputs and next-token targets.
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl<B: Backend> std::fmt::Debug for GptTrainer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptTrainer")
            .field("spec", &self.spec)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> GptTrainer<B> {
    /// A replica at its initial parameters, drawing its batches from `windows` (each
    /// `model.context + 1` tokens long).
    pub fn new(backend: B, spec: GptTrainSpec, windows: Windows) -> BackendResult<Self> {
        let initial = spec.model.init_params(spec.seed);
        Self::with_params(backend, spec, windows, &initial)
    }

    /// As [`GptTrainer::new`], starting from `params` (in the model's layout).
    pub fn with_params(
        backend: B,
        spec: GptTrainSpec,
        windows: Windows,
        params: &[f32],
    ) -> BackendResult<Self> {
        assert_eq!(
            windows.window_len(),
            spec.model.context + 1,
            "windows of the context plus the next token"
        );
        let layout = spec.model.layout();
        let pass = GptPass::new(&backend, spec.model, spec.sequences)?;
        assert_eq!(
            params.len(),
            layout.len(),
            "parameters in the model's layout"
        );
        let initial = params;
        let mut params = backend.zeros(layout.len())?;
        backend.upload(initial, whole_mut::<B>(&mut params))?;
        let grads = backend.zeros(layout.len())?;
        let optimizer = Optimizer::with_decay_filter(
            &backend,
            spec.optimizer.clone(),
            &layout,
            GptSpec::decays,
        )?;
        Ok(GptTrainer {
            schedule: LrSchedule::new(&spec.optimizer, spec.steps),
            rng: ChaCha8Rng::seed_from_u64(spec.seed ^ 0x005e_ed0f_d474),
            pass,
            params,
            grads,
            optimizer,
            windows,
            step: 0,
            inputs: Vec::new(),
            targets: Vec::new(),
            backend,
            spec,
        })
    }

    /// Waits for the device to finish the queued work (timing needs it).
    pub fn synchronize(&self) -> BackendResult {
        self.backend.synchronize()
    }

    /// One step on a fresh random batch; returns its loss.
    pub fn train_step(&mut self, corpus: &Corpus) -> BackendResult<f32> {
        let count = self.windows.count();
        assert!(count > 0, "no window of the training text fits the context");
        let picks: Vec<TokenRange> = (0..self.spec.sequences)
            .map(|_| self.windows.get(self.rng.random_range(0..count)))
            .collect();
        self.train_step_on(corpus, &picks)
    }

    /// One step on the batch of `windows` given (at most `sequences` of them); returns its
    /// loss.
    pub fn train_step_on(&mut self, corpus: &Corpus, windows: &[TokenRange]) -> BackendResult<f32> {
        self.load_batch(corpus, windows);
        let backend = &self.backend;
        let context = self.spec.model.context;
        self.pass
            .forward(backend, &self.params, &self.inputs, context)?;
        let loss = self
            .pass
            .backward(backend, &self.params, &mut self.grads, &self.targets)?;
        if let Some(max_norm) = self.spec.grad_clip {
            clip_global_norm(backend, &mut self.grads, max_norm)?;
        }
        let lr = self.schedule.lr(self.step);
        self.optimizer
            .step(backend, &mut self.params, &self.grads, lr)?;
        self.step += 1;
        Ok(loss)
    }

    /// The mean loss over `windows` (held-out text), in batches of the step's size.
    pub fn evaluate(&mut self, corpus: &Corpus, windows: &[TokenRange]) -> BackendResult<f32> {
        let mut total = 0.0f64;
        for batch in windows.chunks(self.spec.sequences) {
            self.load_batch(corpus, batch);
            let backend = &self.backend;
            self.pass
                .forward(backend, &self.params, &self.inputs, self.spec.model.context)?;
            let loss = self.pass.loss(backend, &self.targets)?;
            total += f64::from(loss) * batch.len() as f64;
        }
        Ok((total / windows.len().max(1) as f64) as f32)
    }

    fn load_batch(&mut self, corpus: &Corpus, windows: &[TokenRange]) {
        self.inputs.clear();
        self.targets.clear();
        for &window in windows {
            // A window is the context plus the token after it: inputs, then each one's next.
            let tokens = corpus.tokens(window);
            let (inputs, targets) = (&tokens[..tokens.len() - 1], &tokens[1..]);
            self.inputs.extend(inputs.iter().map(|&t| u32::from(t)));
            self.targets.extend(targets.iter().map(|&t| u32::from(t)));
        }
    }
}
