//! A decoder-only transformer language model (GPT-2's architecture, at any size): token and
//! position embeddings, `layers` blocks of causal multi-head self-attention and a GELU MLP,
//! each behind a LayerNorm and added to the residual stream, a final LayerNorm, and an output
//! head tied to the token embedding.
//!
//! [`GptSpec`] gives the shape, the flat parameter layout under PyTorch's (nanoGPT's) names, and
//! the initial parameters; [`GptPass`] runs the forward and backward passes on a backend, and
//! [`GptReplica`] holds a replica's buffers and feeds it windows of text. The
//! [`crate::Trainer`] trains it as it trains every model (`[model] kind = "gpt"`).

mod pass;
mod replica;

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Normal};

use crate::params::ParamLayout;

pub use pass::GptPass;
pub use replica::{GptReplica, Sampling};

/// Standard deviation of the initial weights and embeddings (GPT-2's).
const INIT_STD: f32 = 0.02;
/// LayerNorm's `eps`, PyTorch's default.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// The shape of a GPT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptSpec {
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads per block; they split `width` evenly.
    pub heads: usize,
    /// Values per token in the residual stream.
    pub width: usize,
    /// The longest sequence the model reads (rows of the position embedding).
    pub context: usize,
    /// Tokens the model knows (rows of the token embedding and of the output).
    pub vocab: usize,
}

/// Why a [`GptSpec`] describes no model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model: {0}")]
pub struct GptSpecError(String);

impl GptSpec {
    pub fn validate(&self) -> Result<(), GptSpecError> {
        let bad = |what: String| Err(GptSpecError(what));
        for (name, value) in [
            ("layers", self.layers),
            ("heads", self.heads),
            ("width", self.width),
            ("context", self.context),
            ("vocab", self.vocab),
        ] {
            if value == 0 {
                return bad(format!("`{name}` must be at least 1"));
            }
        }
        if !self.width.is_multiple_of(self.heads) {
            return bad(format!(
                "`width` ({}) must be a multiple of `heads` ({}): each head takes an equal share",
                self.width, self.heads
            ));
        }
        Ok(())
    }

    /// Values per head.
    pub fn head_dim(&self) -> usize {
        self.width / self.heads
    }

    /// Width of the MLP's hidden layer (4x, as GPT-2).
    pub fn hidden(&self) -> usize {
        4 * self.width
    }

    /// Every tensor under nanoGPT's names, in buffer order. The output head is the token
    /// embedding (`transformer.wte.weight`), so it has no tensor of its own.
    pub fn layout(&self) -> ParamLayout {
        let (c, h) = (self.width, self.hidden());
        let mut layout = ParamLayout::default();
        layout.push("transformer.wte.weight", &[self.vocab, c]);
        layout.push("transformer.wpe.weight", &[self.context, c]);
        for i in 0..self.layers {
            let name = |tensor: &str| format!("transformer.h.{i}.{tensor}");
            layout.push(name("ln_1.weight"), &[c]);
            layout.push(name("ln_1.bias"), &[c]);
            layout.push(name("attn.c_attn.weight"), &[3 * c, c]);
            layout.push(name("attn.c_attn.bias"), &[3 * c]);
            layout.push(name("attn.c_proj.weight"), &[c, c]);
            layout.push(name("attn.c_proj.bias"), &[c]);
            layout.push(name("ln_2.weight"), &[c]);
            layout.push(name("ln_2.bias"), &[c]);
            layout.push(name("mlp.c_fc.weight"), &[h, c]);
            layout.push(name("mlp.c_fc.bias"), &[h]);
            layout.push(name("mlp.c_proj.weight"), &[c, h]);
            layout.push(name("mlp.c_proj.bias"), &[c]);
        }
        layout.push("transformer.ln_f.weight", &[c]);
        layout.push("transformer.ln_f.bias", &[c]);
        layout
    }

    /// GPT-2's initialisation: weights and embeddings normal with standard deviation 0.02, the
    /// projections into the residual stream (`c_proj`) 0.02 / sqrt(2 layers), biases 0,
    /// LayerNorm gains 1. The same seed always gives the same values.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let layout = self.layout();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut params = vec![0.0f32; layout.len()];
        let residual_std = INIT_STD / (2.0 * self.layers as f32).sqrt();
        for entry in layout.entries() {
            let values = &mut params[entry.range()];
            let name = entry.name.as_str();
            if name.ends_with(".bias") {
                continue;
            }
            if name.contains(".ln_") {
                values.fill(1.0);
                continue;
            }
            let std = if name.ends_with("c_proj.weight") {
                residual_std
            } else {
                INIT_STD
            };
            let normal = Normal::new(0.0, std).expect("invariant: a positive, finite deviation");
            for v in values {
                *v = normal.sample(&mut rng);
            }
        }
        params
    }

    /// Whether the optimizer's weight decay applies to the tensor `name`: to matrices (the
    /// linear layers' weights and the embeddings), not to biases or LayerNorm gains, as
    /// nanoGPT does.
    pub fn decays(name: &str) -> bool {
        name.ends_with(".weight") && !name.contains(".ln_")
    }

    /// Multiply-adds of one training step (forward and backward) on `sequences` sequences of
    /// the full context, counting GEMMs only, times two (flops).
    pub fn train_step_flops(&self, sequences: usize) -> u64 {
        let (n, c, t, v) = (
            (sequences * self.context) as u64,
            self.width as u64,
            self.context as u64,
            self.vocab as u64,
        );
        let per_layer = n * c * (3 * c + c + 8 * c) + 2 * sequences as u64 * t * t * c;
        // Forward once, backward twice (inputs and weights).
        2 * 3 * (self.layers as u64 * per_layer + n * c * v)
    }
}

#[cfg(test)]
mod tests;
