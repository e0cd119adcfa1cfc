//! The GPT's forward and backward passes on a backend, with the activations the backward pass
//! needs kept in device buffers sized for a batch of up to `capacity` sequences.
//!
//! Layouts: the residual stream and every per-token tensor is `[tokens, values]` with the
//! tokens of a sequence consecutive (`tokens = sequences * len`). Attention works per head on
//! `[sequences * heads, len, head_dim]`, so that one batched GEMM covers every head of every
//! sequence; `swap_middle_axes` moves between the two.

use std::ops::Range;

use super::{GptSpec, LAYER_NORM_EPS};
use crate::backend::{Backend, BackendResult, CausalShape, ChannelLayout, Gemm, LayerNormShape};

/// Where one block's tensors sit in the flat parameter buffer.
#[derive(Clone, Debug)]
struct BlockParams {
    ln_1: [Range<usize>; 2],
    /// `c_attn`'s weight and bias, each split into the query, key and value parts.
    qkv_weight: [Range<usize>; 3],
    qkv_bias: [Range<usize>; 3],
    attn_proj: [Range<usize>; 2],
    ln_2: [Range<usize>; 2],
    fc: [Range<usize>; 2],
    mlp_proj: [Range<usize>; 2],
}

/// One block's activations, for `capacity` sequences of the full context.
struct BlockActivations<B: Backend> {
    /// The block's input (the residual stream before it).
    input: B::Buffer,
    ln_1: B::Buffer,
    ln_1_stats: B::Buffer,
    /// Queries, keys and values per head, `[sequences * heads, len, head_dim]`.
    qkv: [B::Buffer; 3],
    /// Attention weights, `[sequences * heads, len, len]`.
    probs: B::Buffer,
    /// The heads' outputs merged back to `[tokens, width]`: `c_proj`'s input.
    attended: B::Buffer,
    /// The residual stream after attention.
    middle: B::Buffer,
    ln_2: B::Buffer,
    ln_2_stats: B::Buffer,
    /// The MLP's hidden layer before and after the GELU.
    fc: B::Buffer,
    gelu: B::Buffer,
}

/// Forward and backward passes of one [`GptSpec`], with their activations.
pub struct GptPass<B: Backend> {
    spec: GptSpec,
    capacity: usize,
    wte: Range<usize>,
    wpe: Range<usize>,
    ln_f: [Range<usize>; 2],
    blocks: Vec<BlockParams>,
    activations: Vec<BlockActivations<B>>,
    /// The residual stream after the last block, the final LayerNorm's output and stats.
    last: B::Buffer,
    ln_f_out: B::Buffer,
    ln_f_stats: B::Buffer,
    logits: B::Buffer,
    dlogits: B::Buffer,
    /// Per-token scratch: the gradient flowing down the residual stream, and two more of the
    /// same size (the forward pass uses the first for queries, keys and values in turn).
    grad: [B::Buffer; 3],
    /// A per-token tensor in the per-head layout (or, going backwards, a LayerNorm's input
    /// gradient being gathered).
    heads: B::Buffer,
    /// Attention scores (going backwards, the weights' gradient) and the scores' gradient.
    scores: B::Buffer,
    dscores: B::Buffer,
    /// The MLP hidden layer's gradient, after and before the GELU.
    hidden_grad: [B::Buffer; 2],
    /// Tokens and sequence length of the last forward pass.
    tokens: Vec<u32>,
    len: usize,
}

impl<B: Backend> std::fmt::Debug for GptPass<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GptPass")
            .field("spec", &self.spec)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

fn pair(layout: &crate::params::ParamLayout, prefix: &str, a: &str, b: &str) -> [Range<usize>; 2] {
    [a, b].map(|t| {
        layout
            .get(&format!("{prefix}{t}"))
            .expect("invariant: the layout names every tensor")
            .range()
    })
}

/// `range` cut into three equal consecutive pieces.
fn thirds(range: Range<usize>) -> [Range<usize>; 3] {
    let third = range.len() / 3;
    [0, 1, 2].map(|i| range.start + i * third..range.start + (i + 1) * third)
}

impl<B: Backend> GptPass<B> {
    /// Buffers for batches of up to `capacity` sequences of up to `spec.context` tokens.
    pub fn new(backend: &B, spec: GptSpec, capacity: usize) -> BackendResult<Self> {
        let layout = spec.layout();
        let capacity = capacity.max(1);
        let (c, t, heads) = (spec.width, spec.context, spec.heads);
        let tokens = capacity * t;
        let per_token = || backend.zeros(tokens * c);
        let stats = || backend.zeros(2 * tokens);
        let blocks = (0..spec.layers)
            .map(|i| {
                let prefix = format!("transformer.h.{i}.");
                let [qkv_w, qkv_b] =
                    pair(&layout, &prefix, "attn.c_attn.weight", "attn.c_attn.bias");
                BlockParams {
                    ln_1: pair(&layout, &prefix, "ln_1.weight", "ln_1.bias"),
                    qkv_weight: thirds(qkv_w),
                    qkv_bias: thirds(qkv_b),
                    attn_proj: pair(&layout, &prefix, "attn.c_proj.weight", "attn.c_proj.bias"),
                    ln_2: pair(&layout, &prefix, "ln_2.weight", "ln_2.bias"),
                    fc: pair(&layout, &prefix, "mlp.c_fc.weight", "mlp.c_fc.bias"),
                    mlp_proj: pair(&layout, &prefix, "mlp.c_proj.weight", "mlp.c_proj.bias"),
                }
            })
            .collect();
        let activations = (0..spec.layers)
            .map(|_| {
                Ok(BlockActivations {
                    input: per_token()?,
                    ln_1: per_token()?,
                    ln_1_stats: stats()?,
                    qkv: [per_token()?, per_token()?, per_token()?],
                    probs: backend.zeros(capacity * heads * t * t)?,
                    attended: per_token()?,
                    middle: per_token()?,
                    ln_2: per_token()?,
                    ln_2_stats: stats()?,
                    fc: backend.zeros(tokens * spec.hidden())?,
                    gelu: backend.zeros(tokens * spec.hidden())?,
                })
            })
            .collect::<BackendResult<_>>()?;
        let entry = |name: &str| {
            layout
                .get(name)
                .expect("invariant: the layout names every tensor")
                .range()
        };
        Ok(GptPass {
            wte: entry("transformer.wte.weight"),
            wpe: entry("transformer.wpe.weight"),
            ln_f: pair(&layout, "transformer.", "ln_f.weight", "ln_f.bias"),
            blocks,
            activations,
            last: per_token()?,
            ln_f_out: per_token()?,
            ln_f_stats: stats()?,
            logits: backend.zeros(tokens * spec.vocab)?,
            dlogits: backend.zeros(tokens * spec.vocab)?,
            grad: [per_token()?, per_token()?, per_token()?],
            heads: per_token()?,
            scores: backend.zeros(capacity * heads * t * t)?,
            dscores: backend.zeros(capacity * heads * t * t)?,
            hidden_grad: [
                backend.zeros(tokens * spec.hidden())?,
                backend.zeros(tokens * spec.hidden())?,
            ],
            tokens: Vec::new(),
            len: 0,
            spec,
            capacity,
        })
    }

    /// Largest batch the buffers hold, in sequences.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The logits of the last forward pass, `[tokens, vocab]` (the first `tokens * vocab`
    /// values of the buffer).
    pub fn logits(&self) -> &B::Buffer {
        &self.logits
    }

    /// Runs the model on `tokens`, sequences of `len` tokens back to back (`len` at most the
    /// context, at most `capacity` sequences), keeping what the backward pass needs.
    pub fn forward(
        &mut self,
        backend: &B,
        params: &B::Buffer,
        tokens: &[u32],
        len: usize,
    ) -> BackendResult {
        let spec = self.spec;
        assert!(
            (1..=spec.context).contains(&len) && tokens.len().is_multiple_of(len),
            "{} tokens in sequences of {len} (context {})",
            tokens.len(),
            spec.context
        );
        let sequences = tokens.len() / len;
        assert!(
            sequences <= self.capacity,
            "{sequences} sequences, room for {}",
            self.capacity
        );
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.len = len;
        let (c, n) = (spec.width, tokens.len());
        let p = |r: &Range<usize>| B::view(params, r.clone());

        // The residual stream starts as token plus position embeddings.
        let stream = self
            .activations
            .first_mut()
            .map_or(&mut self.last, |a| &mut a.input);
        backend.embed(c, tokens, p(&self.wte), B::view_mut(stream, 0..n * c))?;
        let positions = ChannelLayout {
            outer: sequences,
            channels: len * c,
            inner: 1,
        };
        let wpe = self.wpe.start..self.wpe.start + len * c;
        backend.add_bias(positions, p(&wpe), B::view_mut(stream, 0..n * c))?;

        for i in 0..spec.layers {
            self.block_forward(backend, params, i, sequences)?;
        }

        backend.layer_norm(
            norm_shape(n, c),
            B::view(&self.last, 0..n * c),
            p(&self.ln_f[0]),
            p(&self.ln_f[1]),
            B::view_mut(&mut self.ln_f_out, 0..n * c),
            B::view_mut(&mut self.ln_f_stats, 0..2 * n),
        )?;
        // The head is the token embedding: logits = x wte^T.
        backend.gemm(
            Gemm::new(n, spec.vocab, c).transpose_b(),
            B::view(&self.ln_f_out, 0..n * c),
            p(&self.wte),
            B::view_mut(&mut self.logits, 0..n * spec.vocab),
        )
    }

    /// Block `i`'s forward pass: from its input to the next block's (or `last`).
    fn block_forward(
        &mut self,
        backend: &B,
        params: &B::Buffer,
        i: usize,
        sequences: usize,
    ) -> BackendResult {
        let spec = self.spec;
        let (c, len, heads, d) = (spec.width, self.len, spec.heads, spec.head_dim());
        let n = sequences * len;
        let block = &self.blocks[i];
        let (done, rest) = self.activations.split_at_mut(i + 1);
        let act = &mut done[i];
        let next = rest.first_mut().map_or(&mut self.last, |a| &mut a.input);
        let p = |r: &Range<usize>| B::view(params, r.clone());
        // The first `n` tokens' values of a per-token buffer.
        macro_rules! tok {
            ($buffer:expr) => {
                B::view($buffer, 0..n * c)
            };
        }
        let norm = norm_shape(n, c);
        let bias = |channels| ChannelLayout {
            outer: n,
            channels,
            inner: 1,
        };

        backend.layer_norm(
            norm,
            tok!(&act.input),
            p(&block.ln_1[0]),
            p(&block.ln_1[1]),
            B::view_mut(&mut act.ln_1, 0..n * c),
            B::view_mut(&mut act.ln_1_stats, 0..2 * n),
        )?;
        // Queries, keys and values: three GEMMs with the thirds of c_attn, each moved to the
        // per-head layout.
        let scratch = &mut self.grad[0];
        for (k, qkv) in act.qkv.iter_mut().enumerate() {
            backend.gemm(
                Gemm::new(n, c, c).transpose_b().split_columns(),
                tok!(&act.ln_1),
                p(&block.qkv_weight[k]),
                B::view_mut(scratch, 0..n * c),
            )?;
            backend.add_bias(
                bias(c),
                p(&block.qkv_bias[k]),
                B::view_mut(scratch, 0..n * c),
            )?;
            backend.swap_middle_axes(
                [sequences, len, heads, d],
                tok!(scratch),
                B::view_mut(qkv, 0..n * c),
            )?;
        }
        let matrices = sequences * heads;
        let causal = CausalShape { matrices, len };
        let scores = &mut self.scores;
        backend.gemm_batched(
            Gemm::new(len, len, d).transpose_b(),
            matrices,
            tok!(&act.qkv[0]),
            tok!(&act.qkv[1]),
            B::view_mut(scores, 0..causal.values()),
        )?;
        backend.causal_softmax(
            causal,
            1.0 / (d as f32).sqrt(),
            B::view(scores, 0..causal.values()),
            B::view_mut(&mut act.probs, 0..causal.values()),
        )?;
        let heads_out = &mut self.heads;
        backend.gemm_batched(
            Gemm::new(len, d, len),
            matrices,
            B::view(&act.probs, 0..causal.values()),
            tok!(&act.qkv[2]),
            B::view_mut(heads_out, 0..n * c),
        )?;
        backend.swap_middle_axes(
            [sequences, heads, len, d],
            tok!(heads_out),
            B::view_mut(&mut act.attended, 0..n * c),
        )?;
        // middle = input + attended c_proj^T + bias
        backend.copy(tok!(&act.input), B::view_mut(&mut act.middle, 0..n * c))?;
        backend.gemm(
            Gemm {
                beta: 1.0,
                ..Gemm::new(n, c, c).transpose_b().split_columns()
            },
            tok!(&act.attended),
            p(&block.attn_proj[0]),
            B::view_mut(&mut act.middle, 0..n * c),
        )?;
        backend.add_bias(
            bias(c),
            p(&block.attn_proj[1]),
            B::view_mut(&mut act.middle, 0..n * c),
        )?;

        backend.layer_norm(
            norm,
            tok!(&act.middle),
            p(&block.ln_2[0]),
            p(&block.ln_2[1]),
            B::view_mut(&mut act.ln_2, 0..n * c),
            B::view_mut(&mut act.ln_2_stats, 0..2 * n),
        )?;
        let h = spec.hidden();
        backend.gemm(
            Gemm::new(n, h, c).transpose_b().split_columns(),
            tok!(&act.ln_2),
            p(&block.fc[0]),
            B::view_mut(&mut act.fc, 0..n * h),
        )?;
        backend.add_bias(bias(h), p(&block.fc[1]), B::view_mut(&mut act.fc, 0..n * h))?;
        backend.gelu(
            B::view(&act.fc, 0..n * h),
            B::view_mut(&mut act.gelu, 0..n * h),
        )?;
        // next = middle + gelu c_proj^T + bias
        backend.copy(tok!(&act.middle), B::view_mut(next, 0..n * c))?;
        backend.gemm(
            Gemm {
                beta: 1.0,
                ..Gemm::new(n, c, h).transpose_b().split_columns()
            },
            B::view(&act.gelu, 0..n * h),
            p(&block.mlp_proj[0]),
            B::view_mut(next, 0..n * c),
        )?;
        backend.add_bias(bias(c), p(&block.mlp_proj[1]), B::view_mut(next, 0..n * c))
    }

    /// The mean cross-entropy of the last forward pass's logits against `targets` (one per
    /// token), without the gradients.
    pub fn loss(&mut self, backend: &B, targets: &[u32]) -> BackendResult<f32> {
        let n = self.tokens.len();
        assert_eq!(targets.len(), n, "one target per token of the forward pass");
        let v = self.spec.vocab;
        backend.softmax_cross_entropy(
            v,
            B::view(&self.logits, 0..n * v),
            targets,
            B::view_mut(&mut self.dlogits, 0..n * v),
        )
    }

    /// The mean cross-entropy of the last forward pass's logits against `targets` (one per
    /// token), and its gradient with respect to every parameter, written into `grads`.
    pub fn backward(
        &mut self,
        backend: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        targets: &[u32],
    ) -> BackendResult<f32> {
        let spec = self.spec;
        let (c, v, len) = (spec.width, spec.vocab, self.len);
        let n = self.tokens.len();
        let sequences = n / len;
        // The loss writes its gradient with respect to the logits into `dlogits`.
        let loss = self.loss(backend, targets)?;
        let p = |r: &Range<usize>| B::view(params, r.clone());
        // The head's share of the token embedding's gradient (the embedding adds its own at
        // the end), and the gradient into the final LayerNorm.
        backend.gemm(
            Gemm::new(v, c, n).transpose_a().split_rows(),
            B::view(&self.dlogits, 0..n * v),
            B::view(&self.ln_f_out, 0..n * c),
            B::view_mut(grads, self.wte.clone()),
        )?;
        let [stream, spare, _] = &mut self.grad;
        backend.gemm(
            Gemm::new(n, c, v),
            B::view(&self.dlogits, 0..n * v),
            p(&self.wte),
            B::view_mut(spare, 0..n * c),
        )?;
        backend.layer_norm_backward(
            norm_shape(n, c),
            B::view(&self.last, 0..n * c),
            p(&self.ln_f[0]),
            B::view(&self.ln_f_stats, 0..2 * n),
            B::view(spare, 0..n * c),
            B::view_mut(stream, 0..n * c),
            B::view_mut(grads, both(&self.ln_f)),
        )?;

        for i in (0..spec.layers).rev() {
            self.block_backward(backend, params, grads, i, sequences)?;
        }

        // The embeddings: positions summed over the sequences, tokens added to the head's.
        let stream = &self.grad[0];
        let positions = ChannelLayout {
            outer: sequences,
            channels: len * c,
            inner: 1,
        };
        let used = self.wpe.start..self.wpe.start + len * c;
        backend.fill(B::view_mut(grads, used.end..self.wpe.end), 0.0)?;
        backend.bias_grad(
            positions,
            B::view(stream, 0..n * c),
            B::view_mut(grads, used),
        )?;
        backend.embed_backward(
            c,
            &self.tokens,
            B::view(stream, 0..n * c),
            B::view_mut(grads, self.wte.clone()),
        )?;
        Ok(loss)
    }

    /// Block `i`'s backward pass: `grad[0]` holds the gradient of its output on entry and of
    /// its input on return; its parameters' gradients go into `grads`.
    fn block_backward(
        &mut self,
        backend: &B,
        params: &B::Buffer,
        grads: &mut B::Buffer,
        i: usize,
        sequences: usize,
    ) -> BackendResult {
        let spec = self.spec;
        let (c, len, heads, d, h) = (
            spec.width,
            self.len,
            spec.heads,
            spec.head_dim(),
            spec.hidden(),
        );
        let n = sequences * len;
        let GptPass {
            blocks,
            activations,
            grad: [stream, grad_1, grad_2],
            heads: head_layout,
            scores,
            dscores,
            hidden_grad: [dgelu, dfc],
            ..
        } = self;
        let (block, act) = (&blocks[i], &activations[i]);
        let p = |r: &Range<usize>| B::view(params, r.clone());
        // The first `n` tokens' values of a per-token buffer.
        macro_rules! tok {
            ($buffer:expr) => {
                B::view($buffer, 0..n * c)
            };
        }
        macro_rules! hid {
            ($buffer:expr) => {
                B::view($buffer, 0..n * h)
            };
        }

        // The MLP. `stream` holds d(output), which is also d(middle) through the residual.
        linear_backward(
            backend,
            grads,
            &block.mlp_proj,
            [n, c, h],
            tok!(stream),
            hid!(&act.gelu),
        )?;
        backend.gemm(
            Gemm::new(n, h, c),
            tok!(stream),
            p(&block.mlp_proj[0]),
            B::view_mut(dgelu, 0..n * h),
        )?;
        backend.gelu_backward(hid!(&act.fc), hid!(dgelu), B::view_mut(dfc, 0..n * h))?;
        linear_backward(
            backend,
            grads,
            &block.fc,
            [n, h, c],
            hid!(dfc),
            tok!(&act.ln_2),
        )?;
        backend.gemm(
            Gemm::new(n, c, h),
            hid!(dfc),
            p(&block.fc[0]),
            B::view_mut(grad_1, 0..n * c),
        )?;
        backend.layer_norm_backward(
            norm_shape(n, c),
            tok!(&act.middle),
            p(&block.ln_2[0]),
            B::view(&act.ln_2_stats, 0..2 * n),
            tok!(grad_1),
            B::view_mut(grad_2, 0..n * c),
            B::view_mut(grads, both(&block.ln_2)),
        )?;
        backend.axpy(1.0, tok!(grad_2), B::view_mut(stream, 0..n * c))?;

        // Attention. `stream` now holds d(middle), which is also d(input) through the residual.
        linear_backward(
            backend,
            grads,
            &block.attn_proj,
            [n, c, c],
            tok!(stream),
            tok!(&act.attended),
        )?;
        backend.gemm(
            Gemm::new(n, c, c),
            tok!(stream),
            p(&block.attn_proj[0]),
            B::view_mut(grad_1, 0..n * c),
        )?;
        // d(heads' outputs) in the per-head layout.
        backend.swap_middle_axes(
            [sequences, len, heads, d],
            tok!(grad_1),
            B::view_mut(head_layout, 0..n * c),
        )?;
        let matrices = sequences * heads;
        let causal = CausalShape { matrices, len };
        let square = 0..causal.values();
        // d(probs) = d(out) v^T and d(v) = probs^T d(out), per head.
        backend.gemm_batched(
            Gemm::new(len, len, d).transpose_b(),
            matrices,
            tok!(head_layout),
            tok!(&act.qkv[2]),
            B::view_mut(scores, square.clone()),
        )?;
        backend.gemm_batched(
            Gemm::new(len, d, len).transpose_a(),
            matrices,
            B::view(&act.probs, square.clone()),
            tok!(head_layout),
            B::view_mut(grad_1, 0..n * c),
        )?;
        backend.causal_softmax_backward(
            causal,
            1.0 / (d as f32).sqrt(),
            B::view(&act.probs, square.clone()),
            B::view(scores, square.clone()),
            B::view_mut(dscores, square.clone()),
        )?;
        // d(v) is in grad_1; d(q) = d(scores) k and d(k) = d(scores)^T q follow in turn. Each
        // goes back to the token layout (grad_2) for c_attn's gradients and the gradient into
        // the LayerNorm, which `head_layout` gathers over the three.
        for (step, part) in [2, 0, 1].into_iter().enumerate() {
            match part {
                0 => backend.gemm_batched(
                    Gemm::new(len, d, len),
                    matrices,
                    B::view(dscores, square.clone()),
                    tok!(&act.qkv[1]),
                    B::view_mut(grad_1, 0..n * c),
                )?,
                1 => backend.gemm_batched(
                    Gemm::new(len, d, len).transpose_a(),
                    matrices,
                    B::view(dscores, square.clone()),
                    tok!(&act.qkv[0]),
                    B::view_mut(grad_1, 0..n * c),
                )?,
                _ => {}
            }
            backend.swap_middle_axes(
                [sequences, heads, len, d],
                tok!(grad_1),
                B::view_mut(grad_2, 0..n * c),
            )?;
            let ranges = [block.qkv_weight[part].clone(), block.qkv_bias[part].clone()];
            linear_backward(
                backend,
                grads,
                &ranges,
                [n, c, c],
                tok!(grad_2),
                tok!(&act.ln_1),
            )?;
            let beta = if step == 0 { 0.0 } else { 1.0 };
            backend.gemm(
                Gemm {
                    beta,
                    ..Gemm::new(n, c, c)
                },
                tok!(grad_2),
                p(&ranges[0]),
                B::view_mut(head_layout, 0..n * c),
            )?;
        }
        backend.layer_norm_backward(
            norm_shape(n, c),
            tok!(&act.input),
            p(&block.ln_1[0]),
            B::view(&act.ln_1_stats, 0..2 * n),
            tok!(head_layout),
            B::view_mut(grad_2, 0..n * c),
            B::view_mut(grads, both(&block.ln_1)),
        )?;
        backend.axpy(1.0, tok!(grad_2), B::view_mut(stream, 0..n * c))
    }
}

fn norm_shape(rows: usize, cols: usize) -> LayerNormShape {
    LayerNormShape {
        rows,
        cols,
        eps: LAYER_NORM_EPS,
    }
}

/// A LayerNorm's gain and shift, which lie side by side, as one range.
fn both(ranges: &[Range<usize>; 2]) -> Range<usize> {
    debug_assert_eq!(ranges[0].end, ranges[1].start);
    ranges[0].start..ranges[1].end
}

/// A linear layer's parameter gradients: `dW = dy^T x` and `db = sum of dy` for `dy [n, out]`
/// and `x [n, in]` (`shape` is `[n, out, in]`), into `ranges` (weight, bias) of `grads`.
fn linear_backward<B: Backend>(
    backend: &B,
    grads: &mut B::Buffer,
    ranges: &[Range<usize>; 2],
    [n, out, inputs]: [usize; 3],
    dy: B::View<'_>,
    x: B::View<'_>,
) -> BackendResult {
    backend.gemm(
        Gemm::new(out, inputs, n).transpose_a().split_rows(),
        dy,
        x,
        B::view_mut(grads, ranges[0].clone()),
    )?;
    let layout = ChannelLayout {
        outer: n,
        channels: out,
        inner: 1,
    };
    backend.bias_grad(layout, dy, B::view_mut(grads, ranges[1].clone()))
}
