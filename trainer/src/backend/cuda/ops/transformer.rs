//! The CUDA launches of a transformer's kernels besides GEMM (`kernels.cu`): embeddings, the
//! heads' layout, the GELU, LayerNorm and causal softmax, forward and backward, each after the
//! checks of its lengths (and of the tokens, as the CPU's).

use cudarc::driver::PushKernelArg;

use super::super::{CudaBackend, DeviceView, DeviceViewMut, device_error};
use super::n;
use crate::backend::{BackendResult, CausalShape, LayerNormShape, check, check_tokens};

pub(super) fn gelu(
    backend: &CudaBackend,
    x: DeviceView<'_>,
    mut y: DeviceViewMut<'_>,
) -> BackendResult {
    check("gelu", "y", x.len, y.len)?;
    if x.len == 0 {
        return Ok(());
    }
    launch!(
        backend,
        "gelu",
        gelu,
        CudaBackend::grid(x.len),
        [&x.slice(), &mut y.slice(), &n(x.len)]
    )
}

pub(super) fn gelu_backward(
    backend: &CudaBackend,
    x: DeviceView<'_>,
    dy: DeviceView<'_>,
    mut dx: DeviceViewMut<'_>,
) -> BackendResult {
    check("gelu_backward", "dy", x.len, dy.len)?;
    check("gelu_backward", "dx", x.len, dx.len)?;
    if x.len == 0 {
        return Ok(());
    }
    launch!(
        backend,
        "gelu_backward",
        gelu_backward,
        CudaBackend::grid(x.len),
        [&x.slice(), &dy.slice(), &mut dx.slice(), &n(x.len)]
    )
}

pub(super) fn causal_softmax(
    backend: &CudaBackend,
    shape: CausalShape,
    scale: f32,
    scores: DeviceView<'_>,
    mut probs: DeviceViewMut<'_>,
) -> BackendResult {
    check("causal_softmax", "scores", shape.values(), scores.len)?;
    check("causal_softmax", "probs", shape.values(), probs.len)?;
    if shape.values() == 0 {
        return Ok(());
    }
    let rows = shape.matrices * shape.len;
    launch!(
        backend,
        "causal_softmax",
        causal_softmax,
        CudaBackend::per_row(rows),
        [
            &scores.slice(),
            &mut probs.slice(),
            &n(rows),
            &n(shape.len),
            &scale
        ]
    )
}

pub(super) fn causal_softmax_backward(
    backend: &CudaBackend,
    shape: CausalShape,
    scale: f32,
    probs: DeviceView<'_>,
    dprobs: DeviceView<'_>,
    mut dscores: DeviceViewMut<'_>,
) -> BackendResult {
    let op = "causal_softmax_backward";
    check(op, "probs", shape.values(), probs.len)?;
    check(op, "dprobs", shape.values(), dprobs.len)?;
    check(op, "dscores", shape.values(), dscores.len)?;
    if shape.values() == 0 {
        return Ok(());
    }
    let rows = shape.matrices * shape.len;
    launch!(
        backend,
        "causal_softmax_backward",
        causal_softmax_backward,
        CudaBackend::per_row(rows),
        [
            &probs.slice(),
            &dprobs.slice(),
            &mut dscores.slice(),
            &n(rows),
            &n(shape.len),
            &scale
        ]
    )
}

pub(super) fn layer_norm(
    backend: &CudaBackend,
    shape: LayerNormShape,
    x: DeviceView<'_>,
    gamma: DeviceView<'_>,
    beta: DeviceView<'_>,
    mut y: DeviceViewMut<'_>,
    mut stats: DeviceViewMut<'_>,
) -> BackendResult {
    check("layer_norm", "x", shape.len(), x.len)?;
    check("layer_norm", "y", shape.len(), y.len)?;
    check("layer_norm", "gamma", shape.cols, gamma.len)?;
    check("layer_norm", "beta", shape.cols, beta.len)?;
    check("layer_norm", "stats", 2 * shape.rows, stats.len)?;
    if shape.is_empty() {
        return Ok(());
    }
    launch!(
        backend,
        "layer_norm",
        layer_norm,
        CudaBackend::per_row(shape.rows),
        [
            &x.slice(),
            &gamma.slice(),
            &beta.slice(),
            &mut y.slice(),
            &mut stats.slice(),
            &n(shape.rows),
            &n(shape.cols),
            &shape.eps
        ]
    )
}

#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(super) fn layer_norm_backward(
    backend: &CudaBackend,
    shape: LayerNormShape,
    x: DeviceView<'_>,
    gamma: DeviceView<'_>,
    stats: DeviceView<'_>,
    dy: DeviceView<'_>,
    mut dx: DeviceViewMut<'_>,
    mut dparams: DeviceViewMut<'_>,
) -> BackendResult {
    let op = "layer_norm_backward";
    check(op, "x", shape.len(), x.len)?;
    check(op, "dy", shape.len(), dy.len)?;
    check(op, "dx", shape.len(), dx.len)?;
    check(op, "gamma", shape.cols, gamma.len)?;
    check(op, "dparams", 2 * shape.cols, dparams.len)?;
    check(op, "stats", 2 * shape.rows, stats.len)?;
    if shape.cols == 0 {
        return Ok(());
    }
    if shape.rows > 0 {
        launch!(
            backend,
            "layer_norm_backward",
            layer_norm_backward,
            CudaBackend::per_row(shape.rows),
            [
                &x.slice(),
                &gamma.slice(),
                &stats.slice(),
                &dy.slice(),
                &mut dx.slice(),
                &n(shape.rows),
                &n(shape.cols)
            ]
        )?;
    }
    // With no rows the sums are zero, which the kernel writes too.
    launch!(
        backend,
        "layer_norm_param_grads",
        layer_norm_param_grads,
        CudaBackend::grid(shape.cols),
        [
            &x.slice(),
            &stats.slice(),
            &dy.slice(),
            &mut dparams.slice(),
            &n(shape.rows),
            &n(shape.cols)
        ]
    )
}

pub(super) fn swap_middle_axes(
    backend: &CudaBackend,
    dims: [usize; 4],
    src: DeviceView<'_>,
    mut dst: DeviceViewMut<'_>,
) -> BackendResult {
    let [a, b, c, inner] = dims;
    let len = a * b * c * inner;
    check("swap_middle_axes", "src", len, src.len)?;
    check("swap_middle_axes", "dst", len, dst.len)?;
    if len == 0 {
        return Ok(());
    }
    launch!(
        backend,
        "swap_middle_axes",
        swap_middle_axes,
        CudaBackend::grid(len),
        [
            &src.slice(),
            &mut dst.slice(),
            &n(a),
            &n(b),
            &n(c),
            &n(inner)
        ]
    )
}

pub(super) fn embed(
    backend: &CudaBackend,
    width: usize,
    tokens: &[u32],
    table: DeviceView<'_>,
    mut y: DeviceViewMut<'_>,
) -> BackendResult {
    check_tokens("embed", width, tokens, table.len)?;
    check("embed", "y", tokens.len() * width, y.len)?;
    if y.len == 0 {
        return Ok(());
    }
    let device_tokens = backend.upload_u32(tokens)?;
    let values = y.len;
    launch!(
        backend,
        "embed",
        embed,
        CudaBackend::grid(values),
        [
            &table.slice(),
            &device_tokens,
            &mut y.slice(),
            &n(tokens.len()),
            &n(width)
        ]
    )
}

pub(super) fn embed_backward(
    backend: &CudaBackend,
    width: usize,
    tokens: &[u32],
    dy: DeviceView<'_>,
    mut dtable: DeviceViewMut<'_>,
) -> BackendResult {
    let rows = check_tokens("embed_backward", width, tokens, dtable.len)?;
    check("embed_backward", "dy", tokens.len() * width, dy.len)?;
    if tokens.is_empty() || dtable.len == 0 {
        return Ok(());
    }
    let device_tokens = backend.upload_u32(tokens)?;
    let values = dtable.len;
    launch!(
        backend,
        "embed_backward",
        embed_backward,
        CudaBackend::grid(values),
        [
            &device_tokens,
            &dy.slice(),
            &mut dtable.slice(),
            &n(tokens.len()),
            &n(rows),
            &n(width)
        ]
    )
}
