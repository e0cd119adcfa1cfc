//! A GPT replica on one device: its flat parameter and gradient buffers and the passes, fed
//! windows of tokens. The training loop around it is the [`crate::Trainer`]'s, as for every
//! model.

use rand::Rng;
use rand::distr::{Distribution, weighted::WeightedIndex};

use super::{GptPass, GptSpec};
use crate::backend::{Backend, BackendResult};
use crate::replica::Weights;

/// How [`GptReplica::generate`] picks each next token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Divides the logits: below 1 the likeliest tokens gain, above 1 the rest do.
    pub temperature: f32,
    /// Draws among the `top_k` likeliest tokens only (`None`: among all).
    pub top_k: Option<usize>,
}

/// One replica of a GPT for batches of up to `capacity` windows.
pub struct GptReplica<B: Backend> {
    spec: GptSpec,
    pass: GptPass<B>,
    weights: Weights<B>,
    /// The batch being assembled: inputs and next-token targets.
    inputs: Vec<u32>,
    targets: Vec<u32>,
    predictions: Vec<u32>,
}

impl<B: Backend> std::fmt::Debug for GptReplica<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptReplica")
            .field("spec", &self.spec)
            .field("capacity", &self.pass.capacity())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> GptReplica<B> {
    /// A replica for batches of up to `capacity` windows, starting from `params` (in the
    /// model's layout).
    pub fn new(backend: &B, spec: GptSpec, capacity: usize, params: &[f32]) -> BackendResult<Self> {
        let len = spec.layout().len();
        assert_eq!(params.len(), len, "parameters in the model's layout");
        Ok(GptReplica {
            pass: GptPass::new(backend, spec, capacity)?,
            weights: Weights::new(backend, len, params)?,
            inputs: Vec::new(),
            targets: Vec::new(),
            predictions: Vec::new(),
            spec,
        })
    }

    /// Largest batch the buffers hold, in windows.
    pub fn capacity(&self) -> usize {
        self.pass.capacity()
    }

    pub fn weights(&self) -> &Weights<B> {
        &self.weights
    }

    pub fn weights_mut(&mut self) -> &mut Weights<B> {
        &mut self.weights
    }

    /// Forward, loss and backward on a batch of windows (each the context plus the token
    /// after it): leaves the gradient of the mean loss in the gradient buffer and returns
    /// the mean loss.
    pub fn compute_gradients<'t>(
        &mut self,
        backend: &B,
        windows: impl IntoIterator<Item = &'t [u8]>,
    ) -> BackendResult<f32> {
        self.forward(backend, windows)?;
        self.pass.backward(
            backend,
            &self.weights.params,
            &mut self.weights.grads,
            &self.targets,
        )
    }

    /// The mean loss on a batch of windows, and how many of its next tokens the model ranks
    /// first, out of how many.
    pub fn evaluate_batch<'t>(
        &mut self,
        backend: &B,
        windows: impl IntoIterator<Item = &'t [u8]>,
    ) -> BackendResult<(f32, usize, usize)> {
        self.forward(backend, windows)?;
        let loss = self.pass.loss(backend, &self.targets)?;
        let (tokens, vocab) = (self.targets.len(), self.spec.vocab);
        self.predictions.resize(tokens, 0);
        backend.argmax_rows(
            vocab,
            B::view(self.pass.logits(), 0..tokens * vocab),
            &mut self.predictions,
        )?;
        let correct = self
            .predictions
            .iter()
            .zip(&self.targets)
            .filter(|(p, t)| p == t)
            .count();
        Ok((loss, correct, tokens))
    }

    /// Continues `prompt` by `count` tokens, each drawn from the model's prediction after the
    /// text so far (its last `context` tokens), as nanoGPT's `sample.py` does. An empty prompt
    /// starts from a newline.
    pub fn generate(
        &mut self,
        backend: &B,
        prompt: &[u8],
        count: usize,
        sampling: Sampling,
        rng: &mut impl Rng,
    ) -> BackendResult<Vec<u8>> {
        let vocab = self.spec.vocab;
        let mut text = if prompt.is_empty() {
            vec![b'\n']
        } else {
            prompt.to_vec()
        };
        let mut logits = vec![0.0f32; vocab];
        let mut order: Vec<usize> = Vec::with_capacity(vocab);
        for _ in 0..count {
            let window = &text[text.len().saturating_sub(self.spec.context)..];
            self.inputs.clear();
            self.inputs.extend(window.iter().map(|&t| u32::from(t)));
            let len = window.len();
            self.pass
                .forward(backend, &self.weights.params, &self.inputs, len)?;
            let last = (len - 1) * vocab..len * vocab;
            backend.download(B::view(self.pass.logits(), last), &mut logits)?;
            // The `top_k` likeliest tokens, weighted by their softmax at `temperature`.
            order.clear();
            order.extend(0..vocab);
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            order.truncate(sampling.top_k.unwrap_or(vocab).clamp(1, vocab));
            let top = logits[order[0]];
            let temperature = sampling.temperature.max(1e-6);
            let weights = order
                .iter()
                .map(|&t| f64::from((logits[t] - top) / temperature).exp());
            let pick = WeightedIndex::new(weights).map_or(order[0], |w| order[w.sample(rng)]);
            text.push(pick as u8);
        }
        Ok(text[text.len() - count..].to_vec())
    }

    fn forward<'t>(
        &mut self,
        backend: &B,
        windows: impl IntoIterator<Item = &'t [u8]>,
    ) -> BackendResult {
        self.inputs.clear();
        self.targets.clear();
        for window in windows {
            // A window is the context plus the token after it: inputs, then each one's next.
            let (inputs, targets) = (&window[..window.len() - 1], &window[1..]);
            self.inputs.extend(inputs.iter().map(|&t| u32::from(t)));
            self.targets.extend(targets.iter().map(|&t| u32::from(t)));
        }
        self.pass.forward(
            backend,
            &self.weights.params,
            &self.inputs,
            self.spec.context,
        )
    }
}
