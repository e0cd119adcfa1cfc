//! The compute interface every layer and optimizer is written against.
//!
//! A [`Backend`] owns device memory ([`Backend::Buffer`]) and runs the handful of kernels that
//! training needs. Layers never touch host slices directly: they borrow windows of device buffers
//! as [`Backend::View`] / [`Backend::ViewMut`], so a CUDA backend (whose views are device
//! pointers) drops in without changing a layer. Host data crosses only through
//! [`Backend::upload`] and [`Backend::download`].
//!
//! All matrices are row-major and contiguous; shapes are passed explicitly and checked.

pub mod cpu;
pub mod cuda;

use std::ops::Range;

pub use cpu::CpuBackend;
pub use cuda::CudaBackend;

/// Why a backend call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// A view was shorter or longer than the shape passed with it: a bug in the caller.
    #[error("{op}: `{operand}` holds {actual} values but the shape needs {expected}")]
    Shape {
        op: &'static str,
        operand: &'static str,
        expected: usize,
        actual: usize,
    },
    /// A label was not a valid class index.
    #[error("{op}: label {label} is out of range for {classes} classes")]
    Label {
        op: &'static str,
        label: u32,
        classes: usize,
    },
    /// The device refused an allocation or a kernel launch.
    #[error("device error in {op}: {message}")]
    Device { op: &'static str, message: String },
}

/// Result of a backend call.
pub type BackendResult<T = ()> = Result<T, BackendError>;

/// One GEMM: `C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C`, where `op(X)` is `X`
/// or `X^T` as stored row-major. With `transpose_a`, `A` is stored `[k x m]`; with
/// `transpose_b`, `B` is stored `[n x k]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub alpha: f32,
    pub beta: f32,
    /// Which side of `C` a multi-threaded backend divides between its threads.
    pub split: GemmSplit,
}

/// How a multi-threaded backend divides one GEMM. Layers ask for the split that keeps each
/// weight row (output feature) with the same thread in the forward pass, the weight gradient
/// and the optimizer update, so that the weights never move between cores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemmSplit {
    /// Divide the longer side.
    #[default]
    Auto,
    /// Divide the rows of `C` (`m`).
    Rows,
    /// Divide the columns of `C` (`n`).
    Columns,
}

impl Gemm {
    /// `C = op(A) op(B)` (overwrites `C`).
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Gemm {
            m,
            n,
            k,
            transpose_a: false,
            transpose_b: false,
            alpha: 1.0,
            beta: 0.0,
            split: GemmSplit::Auto,
        }
    }

    /// Asks a multi-threaded backend to divide the rows of `C` between threads.
    pub fn split_rows(self) -> Self {
        Gemm {
            split: GemmSplit::Rows,
            ..self
        }
    }

    /// Asks a multi-threaded backend to divide the columns of `C` between threads.
    pub fn split_columns(self) -> Self {
        Gemm {
            split: GemmSplit::Columns,
            ..self
        }
    }

    pub fn transpose_a(self) -> Self {
        Gemm {
            transpose_a: true,
            ..self
        }
    }

    pub fn transpose_b(self) -> Self {
        Gemm {
            transpose_b: true,
            ..self
        }
    }

    /// Floating-point operations of this GEMM (a multiply-add counts as two).
    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n * self.k) as u64
    }
}

/// A tensor seen as `[outer, channels, inner]`, with one bias value per channel.
/// A linear layer's output is `[batch, features, 1]`; a convolution's pre-permute output is
/// `[1, out_channels, batch * pixels]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelLayout {
    pub outer: usize,
    pub channels: usize,
    pub inner: usize,
}

impl ChannelLayout {
    pub fn len(&self) -> usize {
        self.outer * self.channels * self.inner
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Geometry of a square 2-D convolution over one image `[channels, height, width]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ConvGeometry {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl ConvGeometry {
    pub fn out_height(&self) -> usize {
        (self.height + 2 * self.padding - self.kernel) / self.stride + 1
    }

    pub fn out_width(&self) -> usize {
        (self.width + 2 * self.padding - self.kernel) / self.stride + 1
    }

    /// Output pixels per image and channel.
    pub fn out_pixels(&self) -> usize {
        self.out_height() * self.out_width()
    }

    /// Rows of the im2col matrix: one per (channel, kernel row, kernel column).
    pub fn patch_len(&self) -> usize {
        self.channels * self.kernel * self.kernel
    }

    pub fn image_len(&self) -> usize {
        self.channels * self.height * self.width
    }
}

/// Shape of a LayerNorm: each of `rows` rows of `cols` values is normalised on its own, with
/// `eps` added to its (biased) variance as PyTorch does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerNormShape {
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

impl LayerNormShape {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Shape of causal attention scores: `matrices` square `[len, len]` matrices back to back (one
/// per sequence and head), in which row `t` attends to columns `0..=t` only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CausalShape {
    pub matrices: usize,
    pub len: usize,
}

impl CausalShape {
    pub fn values(&self) -> usize {
        self.matrices * self.len * self.len
    }
}

/// Geometry of a max-pool over `planes` independent `[height, width]` planes, with a square
/// window equal to its stride (no overlap, no padding; a ragged edge is dropped).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PoolGeometry {
    pub height: usize,
    pub width: usize,
    pub window: usize,
}

impl PoolGeometry {
    pub fn out_height(&self) -> usize {
        self.height / self.window
    }

    pub fn out_width(&self) -> usize {
        self.width / self.window
    }
}

/// Hyper-parameters of one SGD update (PyTorch semantics, no dampening).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdUpdate {
    pub lr: f32,
    pub momentum: f32,
    pub nesterov: bool,
    pub weight_decay: f32,
}

/// Hyper-parameters of one AdamW update; `step` counts from 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWUpdate {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    pub step: u64,
}

/// A compute device: memory plus the kernels of training.
///
/// Every kernel takes views of device memory and explicit shapes, checks that the two agree,
/// and returns [`BackendError`] instead of panicking. Kernels that write a `ViewMut` overwrite
/// it unless their doc says they accumulate.
pub trait Backend: Send + std::fmt::Debug + 'static {
    /// Owned device memory holding `f32` values.
    type Buffer: Send;
    /// A read-only window into a buffer.
    type View<'a>: Copy
    where
        Self: 'a;
    /// A writable window into a buffer.
    type ViewMut<'a>
    where
        Self: 'a;

    /// Short name for logs and reports (`cpu`, `cuda:0`).
    fn name(&self) -> String;

    /// Waits until every call made so far has run. Kernels of a GPU backend run after their
    /// call returns; anything that times them, or reads the clock after them, waits here first.
    /// Calls that hand values to the host wait by themselves.
    fn synchronize(&self) -> BackendResult {
        Ok(())
    }

    /// A buffer of `len` zeros.
    fn zeros(&self, len: usize) -> BackendResult<Self::Buffer>;
    /// Number of values in a buffer.
    fn buffer_len(buffer: &Self::Buffer) -> usize;
    /// Borrows `range` of a buffer. Panics if the range is out of bounds, like slicing.
    fn view(buffer: &Self::Buffer, range: Range<usize>) -> Self::View<'_>;
    /// Mutably borrows `range` of a buffer. Panics if the range is out of bounds.
    fn view_mut(buffer: &mut Self::Buffer, range: Range<usize>) -> Self::ViewMut<'_>;

    /// Shortens a mutable view's borrow so it can be passed to one kernel and used again after.
    fn reborrow_mut<'s, 'a: 's>(view: &'s mut Self::ViewMut<'a>) -> Self::ViewMut<'s>;

    /// Copies host values into device memory; lengths must match.
    fn upload(&self, src: &[f32], dst: Self::ViewMut<'_>) -> BackendResult;
    /// Copies device memory to the host; lengths must match.
    fn download(&self, src: Self::View<'_>, dst: &mut [f32]) -> BackendResult;
    /// Device-to-device copy; lengths must match.
    fn copy(&self, src: Self::View<'_>, dst: Self::ViewMut<'_>) -> BackendResult;
    /// Sets every value of `dst` to `value`.
    fn fill(&self, dst: Self::ViewMut<'_>, value: f32) -> BackendResult;
    /// `y += alpha * x`: the one operation parameter averaging needs.
    fn axpy(&self, alpha: f32, x: Self::View<'_>, y: Self::ViewMut<'_>) -> BackendResult;
    /// `dst += src` for host values `src` (a mix's delta landing on the parameters); lengths
    /// must match. By default through device scratch memory; a backend whose memory is the
    /// host's adds in place, with no copy of the buffer.
    fn add_host(&self, src: &[f32], dst: Self::ViewMut<'_>) -> BackendResult
    where
        Self: Sized,
    {
        let mut scratch = self.zeros(src.len())?;
        self.upload(src, whole_mut::<Self>(&mut scratch))?;
        self.axpy(1.0, whole::<Self>(&scratch), dst)
    }

    /// `y *= alpha`.
    fn scale(&self, alpha: f32, y: Self::ViewMut<'_>) -> BackendResult;
    /// The sum of the squares of `x` (its squared L2 norm), accumulated in a fixed order and
    /// returned in `f64`.
    fn sum_squares(&self, x: Self::View<'_>) -> BackendResult<f64>;

    /// General matrix multiply, see [`Gemm`].
    fn gemm(
        &self,
        gemm: Gemm,
        a: Self::View<'_>,
        b: Self::View<'_>,
        c: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// `count` independent GEMMs of the same shape, each operand `count` matrices back to back:
    /// `C_i = alpha op(A_i) op(B_i) + beta C_i`. A multi-threaded backend gives each thread whole
    /// GEMMs (attention's heads), ignoring `gemm.split`.
    fn gemm_batched(
        &self,
        gemm: Gemm,
        count: usize,
        a: Self::View<'_>,
        b: Self::View<'_>,
        c: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// `y[o, c, i] += bias[c]`.
    fn add_bias(
        &self,
        layout: ChannelLayout,
        bias: Self::View<'_>,
        y: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// `dbias[c] = sum over o, i of dy[o, c, i]`.
    fn bias_grad(
        &self,
        layout: ChannelLayout,
        dy: Self::View<'_>,
        dbias: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// `y = max(x, 0)`.
    fn relu(&self, x: Self::View<'_>, y: Self::ViewMut<'_>) -> BackendResult;
    /// `dx = dy` where the ReLU output `y > 0`, else 0.
    fn relu_backward(
        &self,
        y: Self::View<'_>,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// `y = GELU(x)` in its tanh form, `x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, as
    /// PyTorch's `gelu(approximate="tanh")`.
    fn gelu(&self, x: Self::View<'_>, y: Self::ViewMut<'_>) -> BackendResult;
    /// `dx = dy * GELU'(x)`, from the GELU's input.
    fn gelu_backward(
        &self,
        x: Self::View<'_>,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// LayerNorm of each row of `x`: `y = (x - mean) / sqrt(var + eps) * gamma + beta`, with
    /// `gamma` and `beta` of one row's length. Writes each row's mean and `1 / sqrt(var + eps)`
    /// into `stats` (`[rows, 2]`) for the backward pass.
    fn layer_norm(
        &self,
        shape: LayerNormShape,
        x: Self::View<'_>,
        gamma: Self::View<'_>,
        beta: Self::View<'_>,
        y: Self::ViewMut<'_>,
        stats: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// The gradients of [`Backend::layer_norm`] from its input, `gamma` and `stats`: `dx`, and
    /// into `dparams` (`[2, cols]`: a LayerNorm's gain and shift lie side by side) `dgamma`
    /// then `dbeta`, summed over the rows (overwritten, as [`Backend::bias_grad`]).
    #[allow(clippy::too_many_arguments)] // one per tensor of the formula
    fn layer_norm_backward(
        &self,
        shape: LayerNormShape,
        x: Self::View<'_>,
        gamma: Self::View<'_>,
        stats: Self::View<'_>,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
        dparams: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// `probs` = the softmax of `scale * scores` along each row of each matrix over the
    /// columns the row may attend to; the columns it may not are 0.
    fn causal_softmax(
        &self,
        shape: CausalShape,
        scale: f32,
        scores: Self::View<'_>,
        probs: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// The gradient of [`Backend::causal_softmax`] from its output:
    /// `dscores = scale * probs * (dprobs - sum over the row of dprobs * probs)`.
    fn causal_softmax_backward(
        &self,
        shape: CausalShape,
        scale: f32,
        probs: Self::View<'_>,
        dprobs: Self::View<'_>,
        dscores: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// Unfolds `batch` images `[batch, C, H, W]` into patches
    /// `[C * kernel * kernel, batch * out_pixels]` (zero padding), so a convolution is one GEMM.
    fn im2col(
        &self,
        geometry: ConvGeometry,
        batch: usize,
        images: Self::View<'_>,
        patches: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// The adjoint of [`Backend::im2col`]: sums patch gradients back into image gradients.
    fn col2im(
        &self,
        geometry: ConvGeometry,
        batch: usize,
        patches: Self::View<'_>,
        images: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// Swaps the two outer axes: `src[a, b, inner]` becomes `dst[b, a, inner]`.
    fn swap_outer_axes(
        &self,
        dims: [usize; 3],
        src: Self::View<'_>,
        dst: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// Swaps the two middle axes: `src[a, b, c, inner]` becomes `dst[a, c, b, inner]` (a
    /// sequence's `[tokens, heads, head_dim]` to `[heads, tokens, head_dim]`, and back).
    fn swap_middle_axes(
        &self,
        dims: [usize; 4],
        src: Self::View<'_>,
        dst: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// `y[n] = table[tokens[n]]`, rows of `width` values: an embedding lookup.
    fn embed(
        &self,
        width: usize,
        tokens: &[u32],
        table: Self::View<'_>,
        y: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// `dtable[v] += dy[n]` for every `n` with `tokens[n] == v`, in order of `n`: the gradient
    /// of [`Backend::embed`], added to what `dtable` holds (an embedding tied to an output
    /// head gets that head's gradient too).
    fn embed_backward(
        &self,
        width: usize,
        tokens: &[u32],
        dy: Self::View<'_>,
        dtable: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// Max-pools `planes` planes of `x` into `y`.
    fn max_pool(
        &self,
        geometry: PoolGeometry,
        planes: usize,
        x: Self::View<'_>,
        y: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// Routes each window's gradient to the first input that attained the maximum.
    fn max_pool_backward(
        &self,
        geometry: PoolGeometry,
        planes: usize,
        x: Self::View<'_>,
        y: Self::View<'_>,
        dy: Self::View<'_>,
        dx: Self::ViewMut<'_>,
    ) -> BackendResult;

    /// Mean softmax cross-entropy of `logits [rows, classes]` against `labels`, writing the
    /// gradient of that mean into `dlogits`. Returns the mean loss.
    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: Self::View<'_>,
        labels: &[u32],
        dlogits: Self::ViewMut<'_>,
    ) -> BackendResult<f32>;
    /// Index of the largest logit of each row, written to `predictions` on the host.
    fn argmax_rows(
        &self,
        classes: usize,
        logits: Self::View<'_>,
        predictions: &mut [u32],
    ) -> BackendResult;

    /// One SGD step in place over the whole flat parameter buffer.
    fn sgd_update(
        &self,
        update: SgdUpdate,
        params: Self::ViewMut<'_>,
        grads: Self::View<'_>,
        velocity: Self::ViewMut<'_>,
    ) -> BackendResult;
    /// One AdamW step in place over the whole flat parameter buffer.
    fn adamw_update(
        &self,
        update: AdamWUpdate,
        params: Self::ViewMut<'_>,
        grads: Self::View<'_>,
        first_moment: Self::ViewMut<'_>,
        second_moment: Self::ViewMut<'_>,
    ) -> BackendResult;
}

/// Fails with [`BackendError::Shape`] unless `actual == expected`: every kernel's first check.
pub(crate) fn check(
    op: &'static str,
    operand: &'static str,
    expected: usize,
    actual: usize,
) -> BackendResult {
    if expected == actual {
        Ok(())
    } else {
        Err(BackendError::Shape {
            op,
            operand,
            expected,
            actual,
        })
    }
}

/// Checks that every token indexes a row of a table of `table_len` values, and returns the
/// table's row count.
pub(crate) fn check_tokens(
    op: &'static str,
    width: usize,
    tokens: &[u32],
    table_len: usize,
) -> BackendResult<usize> {
    let rows = table_len.checked_div(width).unwrap_or(0);
    check(op, "table", rows * width, table_len)?;
    match tokens.iter().find(|&&t| t as usize >= rows) {
        Some(&label) => Err(BackendError::Label {
            op,
            label,
            classes: rows,
        }),
        None => Ok(rows),
    }
}

/// Views a whole buffer.
pub fn whole<B: Backend>(buffer: &B::Buffer) -> B::View<'_> {
    B::view(buffer, 0..B::buffer_len(buffer))
}

/// Mutably views a whole buffer.
pub fn whole_mut<B: Backend>(buffer: &mut B::Buffer) -> B::ViewMut<'_> {
    let len = B::buffer_len(buffer);
    B::view_mut(buffer, 0..len)
}
