//! Layers with explicit forward and backward passes, one match arm per layer kind.
//!
//! A layer holds no memory of its own: its parameters are ranges of the model's flat buffer,
//! its input and output live in the replica's activation buffers, and a convolution's im2col
//! patches live in a [`Scratch`] the replica keeps for it.

use std::ops::Range;

use crate::backend::{Backend, BackendResult, ChannelLayout, ConvGeometry, Gemm, PoolGeometry};

/// One layer of a sequential model. Shapes are per sample; the batch is given at call time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Layer {
    /// `y = x W^T + b`, `W` stored `[outputs, inputs]` like PyTorch.
    Linear {
        inputs: usize,
        outputs: usize,
        weight: Range<usize>,
        bias: Range<usize>,
    },
    /// `y = max(x, 0)`.
    Relu { len: usize },
    /// 2-D convolution over `[C, H, W]` images as im2col + one GEMM; `W` is
    /// `[out_channels, C, k, k]`.
    Conv2d {
        geometry: ConvGeometry,
        out_channels: usize,
        weight: Range<usize>,
        bias: Range<usize>,
    },
    /// Non-overlapping max-pool over each of `channels` planes.
    MaxPool2d {
        channels: usize,
        geometry: PoolGeometry,
    },
    /// `[C, H, W]` to `[C * H * W]`: the values do not move.
    Flatten { len: usize },
}

/// Device memory a layer needs between its forward and backward pass besides its output.
pub struct Scratch<B: Backend> {
    /// im2col patches `[C k k, batch * pixels]`; reused for their gradient in backward.
    patches: B::Buffer,
    /// Convolution output before the batch and channel axes are swapped, `[OC, batch, pixels]`.
    channel_major: B::Buffer,
}

impl<B: Backend> std::fmt::Debug for Scratch<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("patches", &B::buffer_len(&self.patches))
            .field("channel_major", &B::buffer_len(&self.channel_major))
            .finish()
    }
}

impl<B: Backend> Scratch<B> {
    /// Scratch for `layer` at batches of up to `capacity` samples (empty for most layers).
    pub fn new(backend: &B, layer: &Layer, capacity: usize) -> BackendResult<Self> {
        let [patches, channel_major] = layer.scratch_lens(capacity);
        Ok(Scratch {
            patches: backend.zeros(patches)?,
            channel_major: backend.zeros(channel_major)?,
        })
    }
}

/// What a backward pass reads and writes besides the layer's own scratch.
#[derive(Debug)]
pub struct BackwardArgs<'a, B: Backend> {
    pub params: &'a B::Buffer,
    pub grads: &'a mut B::Buffer,
    /// The layer's input from the forward pass.
    pub x: B::View<'a>,
    /// The layer's output from the forward pass.
    pub y: B::View<'a>,
    /// Gradient of the loss with respect to `y`.
    pub dy: B::View<'a>,
    /// Where to write the gradient with respect to `x`; `None` for the first layer.
    pub dx: Option<B::ViewMut<'a>>,
}

impl Layer {
    /// Values per sample this layer reads.
    pub fn input_len(&self) -> usize {
        match self {
            Layer::Linear { inputs, .. } => *inputs,
            Layer::Relu { len } | Layer::Flatten { len } => *len,
            Layer::Conv2d { geometry, .. } => geometry.image_len(),
            Layer::MaxPool2d { channels, geometry } => channels * geometry.height * geometry.width,
        }
    }

    /// Values per sample this layer writes.
    pub fn output_len(&self) -> usize {
        match self {
            Layer::Linear { outputs, .. } => *outputs,
            Layer::Relu { len } | Layer::Flatten { len } => *len,
            Layer::Conv2d {
                geometry,
                out_channels,
                ..
            } => out_channels * geometry.out_pixels(),
            Layer::MaxPool2d { channels, geometry } => {
                channels * geometry.out_height() * geometry.out_width()
            }
        }
    }

    /// Weight range, bias range and fan-in, for layers with parameters.
    pub fn param_ranges(&self) -> Option<(Range<usize>, Range<usize>, usize)> {
        match self {
            Layer::Linear {
                inputs,
                weight,
                bias,
                ..
            } => Some((weight.clone(), bias.clone(), *inputs)),
            Layer::Conv2d {
                geometry,
                weight,
                bias,
                ..
            } => Some((weight.clone(), bias.clone(), geometry.patch_len())),
            _ => None,
        }
    }

    /// Lengths of the two scratch buffers at `batch` samples.
    fn scratch_lens(&self, batch: usize) -> [usize; 2] {
        match self {
            Layer::Conv2d {
                geometry,
                out_channels,
                ..
            } => {
                let columns = batch * geometry.out_pixels();
                [geometry.patch_len() * columns, out_channels * columns]
            }
            _ => [0, 0],
        }
    }

    /// GEMM flops of forward plus backward at `batch` samples.
    pub fn gemm_flops(&self, batch: usize, input_grad: bool) -> u64 {
        let (m, n, k) = match self {
            Layer::Linear {
                inputs, outputs, ..
            } => (batch, *outputs, *inputs),
            Layer::Conv2d {
                geometry,
                out_channels,
                ..
            } => (
                batch * geometry.out_pixels(),
                *out_channels,
                geometry.patch_len(),
            ),
            _ => return 0,
        };
        let one = Gemm::new(m, n, k).flops();
        // forward, weight gradient, and the input gradient unless this is the first layer
        one * if input_grad { 3 } else { 2 }
    }

    /// Computes `y` from `x` for `batch` samples.
    pub fn forward<B: Backend>(
        &self,
        backend: &B,
        batch: usize,
        params: &B::Buffer,
        x: B::View<'_>,
        y: B::ViewMut<'_>,
        scratch: &mut Scratch<B>,
    ) -> BackendResult {
        match self {
            Layer::Linear {
                inputs,
                outputs,
                weight,
                bias,
            } => {
                let mut y = y;
                // Each thread computes the outputs of the weight rows it owns.
                let gemm = Gemm::new(batch, *outputs, *inputs)
                    .transpose_b()
                    .split_columns();
                backend.gemm(
                    gemm,
                    x,
                    B::view(params, weight.clone()),
                    B::reborrow_mut(&mut y),
                )?;
                let layout = ChannelLayout {
                    outer: batch,
                    channels: *outputs,
                    inner: 1,
                };
                backend.add_bias(layout, B::view(params, bias.clone()), y)
            }
            Layer::Relu { .. } => backend.relu(x, y),
            Layer::Conv2d {
                geometry,
                out_channels,
                weight,
                bias,
            } => {
                let [patch_len, cm_len] = self.scratch_lens(batch);
                let pixels = geometry.out_pixels();
                backend.im2col(
                    *geometry,
                    batch,
                    x,
                    B::view_mut(&mut scratch.patches, 0..patch_len),
                )?;
                let gemm = Gemm::new(*out_channels, batch * pixels, geometry.patch_len());
                backend.gemm(
                    gemm,
                    B::view(params, weight.clone()),
                    B::view(&scratch.patches, 0..patch_len),
                    B::view_mut(&mut scratch.channel_major, 0..cm_len),
                )?;
                let layout = ChannelLayout {
                    outer: 1,
                    channels: *out_channels,
                    inner: batch * pixels,
                };
                backend.add_bias(
                    layout,
                    B::view(params, bias.clone()),
                    B::view_mut(&mut scratch.channel_major, 0..cm_len),
                )?;
                backend.swap_outer_axes(
                    [*out_channels, batch, pixels],
                    B::view(&scratch.channel_major, 0..cm_len),
                    y,
                )
            }
            Layer::MaxPool2d { channels, geometry } => {
                backend.max_pool(*geometry, batch * channels, x, y)
            }
            Layer::Flatten { .. } => backend.copy(x, y),
        }
    }

    /// Writes this layer's parameter gradients into `args.grads` and, when asked, the gradient
    /// with respect to its input into `args.dx`.
    pub fn backward<B: Backend>(
        &self,
        backend: &B,
        batch: usize,
        args: BackwardArgs<'_, B>,
        scratch: &mut Scratch<B>,
    ) -> BackendResult {
        let BackwardArgs {
            params,
            grads,
            x,
            y,
            dy,
            dx,
        } = args;
        match self {
            Layer::Linear {
                inputs,
                outputs,
                weight,
                bias,
            } => {
                let dw = Gemm::new(*outputs, *inputs, batch)
                    .transpose_a()
                    .split_rows();
                backend.gemm(dw, dy, x, B::view_mut(grads, weight.clone()))?;
                let layout = ChannelLayout {
                    outer: batch,
                    channels: *outputs,
                    inner: 1,
                };
                backend.bias_grad(layout, dy, B::view_mut(grads, bias.clone()))?;
                if let Some(dx) = dx {
                    let gemm = Gemm::new(batch, *inputs, *outputs);
                    backend.gemm(gemm, dy, B::view(params, weight.clone()), dx)?;
                }
                Ok(())
            }
            Layer::Relu { .. } => match dx {
                Some(dx) => backend.relu_backward(y, dy, dx),
                None => Ok(()),
            },
            Layer::Conv2d {
                geometry,
                out_channels,
                weight,
                bias,
            } => {
                let [patch_len, cm_len] = self.scratch_lens(batch);
                let pixels = geometry.out_pixels();
                let columns = batch * pixels;
                backend.swap_outer_axes(
                    [batch, *out_channels, pixels],
                    dy,
                    B::view_mut(&mut scratch.channel_major, 0..cm_len),
                )?;
                let dcm = B::view(&scratch.channel_major, 0..cm_len);
                let dw = Gemm::new(*out_channels, geometry.patch_len(), columns).transpose_b();
                backend.gemm(
                    dw,
                    dcm,
                    B::view(&scratch.patches, 0..patch_len),
                    B::view_mut(grads, weight.clone()),
                )?;
                let layout = ChannelLayout {
                    outer: 1,
                    channels: *out_channels,
                    inner: columns,
                };
                backend.bias_grad(layout, dcm, B::view_mut(grads, bias.clone()))?;
                if let Some(dx) = dx {
                    // The forward patches are spent; their buffer now takes their gradient.
                    let dpatches =
                        Gemm::new(geometry.patch_len(), columns, *out_channels).transpose_a();
                    backend.gemm(
                        dpatches,
                        B::view(params, weight.clone()),
                        dcm,
                        B::view_mut(&mut scratch.patches, 0..patch_len),
                    )?;
                    backend.col2im(
                        *geometry,
                        batch,
                        B::view(&scratch.patches, 0..patch_len),
                        dx,
                    )?;
                }
                Ok(())
            }
            Layer::MaxPool2d { channels, geometry } => match dx {
                Some(dx) => backend.max_pool_backward(*geometry, batch * channels, x, y, dy, dx),
                None => Ok(()),
            },
            Layer::Flatten { .. } => match dx {
                Some(dx) => backend.copy(dy, dx),
                None => Ok(()),
            },
        }
    }
}
