//! A model replica on one device: the flat parameter and gradient buffers ([`Weights`], which
//! a GPT's replica holds too), activation buffers sized for a maximum batch, and the forward
//! and backward passes over the layer list.

use crate::backend::{Backend, BackendError, BackendResult, whole, whole_mut};
use crate::layers::{BackwardArgs, Scratch};
use crate::model::Architecture;

/// A replica's flat parameter buffer and the gradient buffer of the same layout, on the device.
pub struct Weights<B: Backend> {
    pub params: B::Buffer,
    pub grads: B::Buffer,
    len: usize,
}

impl<B: Backend> std::fmt::Debug for Weights<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Weights<B> {
    /// Buffers of `len` values, the parameters set to `initial` (of the same length).
    pub fn new(backend: &B, len: usize, initial: &[f32]) -> BackendResult<Self> {
        let mut weights = Weights {
            params: backend.zeros(len)?,
            grads: backend.zeros(len)?,
            len,
        };
        weights.set_params(backend, initial)?;
        Ok(weights)
    }

    /// Replaces the parameters with host values.
    pub fn set_params(&mut self, backend: &B, params: &[f32]) -> BackendResult {
        backend.upload(params, whole_mut::<B>(&mut self.params))
    }

    /// Adds host values to the parameters (a mix's delta): in place where the backend's memory
    /// is the host's, with no copy of the parameters made.
    pub fn add_to_params(&mut self, backend: &B, delta: &[f32]) -> BackendResult {
        backend.add_host(delta, whole_mut::<B>(&mut self.params))
    }

    /// Adds host values to the parameters from `at` on: a mix added a run at a time, with no
    /// model-sized buffer for it.
    pub fn add_to_params_at(&mut self, backend: &B, at: usize, delta: &[f32]) -> BackendResult {
        let end = at.saturating_add(delta.len());
        if end > self.len {
            return Err(crate::backend::BackendError::Shape {
                op: "add_to_params_at",
                operand: "delta",
                expected: self.len.saturating_sub(at),
                actual: delta.len(),
            });
        }
        backend.add_host(delta, B::view_mut(&mut self.params, at..end))
    }

    /// Replaces the gradients with host values (an all-reduced average, say).
    pub fn set_grads(&mut self, backend: &B, grads: &[f32]) -> BackendResult {
        backend.upload(grads, whole_mut::<B>(&mut self.grads))
    }

    /// Copies the parameters to the host.
    pub fn download_params(&self, backend: &B) -> BackendResult<Vec<f32>> {
        let mut host = vec![0.0; self.len];
        backend.download(whole::<B>(&self.params), &mut host)?;
        Ok(host)
    }

    /// Copies the gradients to the host.
    pub fn download_grads(&self, backend: &B) -> BackendResult<Vec<f32>> {
        let mut host = vec![0.0; self.len];
        backend.download(whole::<B>(&self.grads), &mut host)?;
        Ok(host)
    }
}

/// One replica's device memory and passes.
pub struct Replica<B: Backend> {
    arch: Architecture,
    capacity: usize,
    weights: Weights<B>,
    input: B::Buffer,
    /// Output of each layer, `capacity` samples long.
    activations: Vec<B::Buffer>,
    /// Two buffers that alternate as `dy` and `dx` going backwards through the layers.
    grad_front: B::Buffer,
    grad_back: B::Buffer,
    scratch: Vec<Scratch<B>>,
}

impl<B: Backend> std::fmt::Debug for Replica<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("params", &self.arch.param_count())
            .field("layers", &self.arch.layers().len())
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Replica<B> {
    /// Allocates a replica for batches of up to `capacity` samples, starting from `params`.
    pub fn new(
        backend: &B,
        arch: Architecture,
        capacity: usize,
        params: &[f32],
    ) -> BackendResult<Self> {
        let capacity = capacity.max(1);
        let widest = arch
            .layers()
            .iter()
            .flat_map(|l| [l.input_len(), l.output_len()])
            .max()
            .unwrap_or(0);
        let mut activations = Vec::with_capacity(arch.layers().len());
        let mut scratch = Vec::with_capacity(arch.layers().len());
        for layer in arch.layers() {
            activations.push(backend.zeros(capacity * layer.output_len())?);
            scratch.push(Scratch::new(backend, layer, capacity)?);
        }
        Ok(Replica {
            weights: Weights::new(backend, arch.param_count(), params)?,
            input: backend.zeros(capacity * arch.input_len())?,
            grad_front: backend.zeros(capacity * widest)?,
            grad_back: backend.zeros(capacity * widest)?,
            activations,
            scratch,
            capacity,
            arch,
        })
    }

    pub fn architecture(&self) -> &Architecture {
        &self.arch
    }

    /// Largest batch the buffers hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn weights(&self) -> &Weights<B> {
        &self.weights
    }

    pub fn weights_mut(&mut self) -> &mut Weights<B> {
        &mut self.weights
    }

    fn check_batch(&self, batch: usize, images: &[f32]) -> BackendResult {
        if batch > self.capacity {
            return Err(BackendError::Shape {
                op: "forward",
                operand: "batch",
                expected: self.capacity,
                actual: batch,
            });
        }
        let expected = batch * self.arch.input_len();
        if images.len() != expected {
            return Err(BackendError::Shape {
                op: "forward",
                operand: "images",
                expected,
                actual: images.len(),
            });
        }
        Ok(())
    }

    /// Runs the forward pass on `batch` samples (`images` is `[batch, input_len]` on the host).
    pub fn forward(&mut self, backend: &B, batch: usize, images: &[f32]) -> BackendResult {
        self.check_batch(batch, images)?;
        let input_len = batch * self.arch.input_len();
        backend.upload(images, B::view_mut(&mut self.input, 0..input_len))?;
        for (i, layer) in self.arch.layers().iter().enumerate() {
            let (before, after) = self.activations.split_at_mut(i);
            let x = match before.last() {
                Some(prev) => B::view(prev, 0..batch * layer.input_len()),
                None => B::view(&self.input, 0..input_len),
            };
            let y = B::view_mut(&mut after[0], 0..batch * layer.output_len());
            layer.forward(
                backend,
                batch,
                &self.weights.params,
                x,
                y,
                &mut self.scratch[i],
            )?;
        }
        Ok(())
    }

    /// Forward, loss and backward on one batch: leaves the gradient of the mean loss in the
    /// gradient buffer and returns the mean loss.
    pub fn compute_gradients(
        &mut self,
        backend: &B,
        images: &[f32],
        labels: &[u32],
    ) -> BackendResult<f32> {
        let batch = labels.len();
        self.forward(backend, batch, images)?;
        let classes = self.arch.output_len();
        let loss = {
            let last = self
                .activations
                .last()
                .expect("invariant: a model has at least one layer");
            backend.softmax_cross_entropy(
                classes,
                B::view(last, 0..batch * classes),
                labels,
                B::view_mut(&mut self.grad_front, 0..batch * classes),
            )?
        };
        // `dy` of layer i sits in `grad_front`; its `dx` goes to `grad_back`; then they swap.
        for (i, layer) in self.arch.layers().iter().enumerate().rev() {
            let x = match i {
                0 => B::view(&self.input, 0..batch * layer.input_len()),
                _ => B::view(&self.activations[i - 1], 0..batch * layer.input_len()),
            };
            let args = BackwardArgs {
                params: &self.weights.params,
                grads: &mut self.weights.grads,
                x,
                y: B::view(&self.activations[i], 0..batch * layer.output_len()),
                dy: B::view(&self.grad_front, 0..batch * layer.output_len()),
                dx: (i > 0).then(|| B::view_mut(&mut self.grad_back, 0..batch * layer.input_len())),
            };
            layer.backward(backend, batch, args, &mut self.scratch[i])?;
            std::mem::swap(&mut self.grad_front, &mut self.grad_back);
        }
        Ok(loss)
    }

    /// Mean loss and the number of correct predictions on `batch` samples.
    pub fn evaluate_batch(
        &mut self,
        backend: &B,
        images: &[f32],
        labels: &[u32],
        predictions: &mut Vec<u32>,
    ) -> BackendResult<(f32, usize)> {
        let batch = labels.len();
        self.forward(backend, batch, images)?;
        let classes = self.arch.output_len();
        let last = self
            .activations
            .last()
            .expect("invariant: a model has at least one layer");
        let logits = B::view(last, 0..batch * classes);
        let loss = backend.softmax_cross_entropy(
            classes,
            logits,
            labels,
            B::view_mut(&mut self.grad_front, 0..batch * classes),
        )?;
        predictions.resize(batch, 0);
        backend.argmax_rows(classes, logits, predictions)?;
        let correct = predictions
            .iter()
            .zip(labels)
            .filter(|(p, l)| p == l)
            .count();
        Ok((loss, correct))
    }
}
