//! The CPU's kernels of a transformer besides GEMM: embeddings, the heads' layout, the GELU,
//! LayerNorm and causal softmax, forward and backward, each after the checks of its lengths. Sums along a row use
//! [`lane_sum`]'s fixed order; sums over rows go row by row, as the CUDA kernels do.

use super::lane_sum;
use crate::backend::{BackendResult, CausalShape, LayerNormShape, check, check_tokens};

/// `sqrt(2 / pi)`, the GELU's tanh-form scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The GELU's tanh-form cubic coefficient.
const GELU_CUBIC: f32 = 0.044_715;

pub(super) fn gelu(x: &[f32], y: &mut [f32]) -> BackendResult {
    check("gelu", "y", x.len(), y.len())?;
    for (yi, &v) in y.iter_mut().zip(x) {
        let u = SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v * v);
        *yi = 0.5 * v * (1.0 + u.tanh());
    }
    Ok(())
}

pub(super) fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) -> BackendResult {
    check("gelu_backward", "dy", x.len(), dy.len())?;
    check("gelu_backward", "dx", x.len(), dx.len())?;
    for ((dxi, &dyi), &v) in dx.iter_mut().zip(dy).zip(x) {
        let v2 = v * v;
        let t = (SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v2)).tanh();
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * v2);
        *dxi = dyi * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
    }
    Ok(())
}

pub(super) fn layer_norm(
    shape: LayerNormShape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    stats: &mut [f32],
) -> BackendResult {
    check("layer_norm", "x", shape.len(), x.len())?;
    check("layer_norm", "y", shape.len(), y.len())?;
    check("layer_norm", "gamma", shape.cols, gamma.len())?;
    check("layer_norm", "beta", shape.cols, beta.len())?;
    check("layer_norm", "stats", 2 * shape.rows, stats.len())?;
    let cols = shape.cols;
    if cols == 0 {
        return Ok(());
    }
    let rows = x.chunks_exact(cols).zip(y.chunks_exact_mut(cols));
    for ((x, y), stats) in rows.zip(stats.chunks_exact_mut(2)) {
        let mean = lane_sum(x) / cols as f32;
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = (xi - mean) * (xi - mean);
        }
        let rstd = 1.0 / (lane_sum(y) / cols as f32 + shape.eps).sqrt();
        for (((yi, &xi), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
            *yi = (xi - mean) * rstd * g + b;
        }
        stats.copy_from_slice(&[mean, rstd]);
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(super) fn layer_norm_backward(
    shape: LayerNormShape,
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dparams: &mut [f32],
) -> BackendResult {
    let op = "layer_norm_backward";
    check(op, "x", shape.len(), x.len())?;
    check(op, "dy", shape.len(), dy.len())?;
    check(op, "dx", shape.len(), dx.len())?;
    check(op, "gamma", shape.cols, gamma.len())?;
    check(op, "dparams", 2 * shape.cols, dparams.len())?;
    check(op, "stats", 2 * shape.rows, stats.len())?;
    dparams.fill(0.0);
    let (dgamma, dbeta) = dparams.split_at_mut(shape.cols);
    let cols = shape.cols;
    if cols == 0 {
        return Ok(());
    }
    let n = cols as f32;
    let rows = x.chunks_exact(cols).zip(dy.chunks_exact(cols));
    for (((x, dy), dx), stats) in rows
        .zip(dx.chunks_exact_mut(cols))
        .zip(stats.chunks_exact(2))
    {
        let (mean, rstd) = (stats[0], stats[1]);
        // dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma: dx holds g, then
        // g xhat for the second mean, then the result.
        for ((d, &dyi), &gi) in dx.iter_mut().zip(dy).zip(gamma) {
            *d = dyi * gi;
        }
        let mean_g = lane_sum(dx) / n;
        for (d, &xi) in dx.iter_mut().zip(x) {
            *d *= (xi - mean) * rstd;
        }
        let mean_g_xhat = lane_sum(dx) / n;
        for (((d, &xi), &dyi), &gi) in dx.iter_mut().zip(x).zip(dy).zip(gamma) {
            let xhat = (xi - mean) * rstd;
            *d = rstd * (dyi * gi - mean_g - xhat * mean_g_xhat);
        }
        for (((dg, db), &xi), &dyi) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(x).zip(dy) {
            *dg += dyi * (xi - mean) * rstd;
            *db += dyi;
        }
    }
    Ok(())
}

pub(super) fn causal_softmax(
    shape: CausalShape,
    scale: f32,
    scores: &[f32],
    probs: &mut [f32],
) -> BackendResult {
    check("causal_softmax", "scores", shape.values(), scores.len())?;
    check("causal_softmax", "probs", shape.values(), probs.len())?;
    let len = shape.len;
    if len == 0 {
        return Ok(());
    }
    // Rows repeat 0..len in every matrix; row t sees columns 0..=t.
    for (row, (scores, probs)) in scores
        .chunks_exact(len)
        .zip(probs.chunks_exact_mut(len))
        .enumerate()
    {
        let seen = row % len + 1;
        let (visible, masked) = probs.split_at_mut(seen);
        let max = scores[..seen]
            .iter()
            .fold(f32::NEG_INFINITY, |m, &v| m.max(scale * v));
        for (p, &v) in visible.iter_mut().zip(scores) {
            *p = (scale * v - max).exp();
        }
        let sum = lane_sum(visible);
        for p in visible.iter_mut() {
            *p /= sum;
        }
        masked.fill(0.0);
    }
    Ok(())
}

pub(super) fn causal_softmax_backward(
    shape: CausalShape,
    scale: f32,
    probs: &[f32],
    dprobs: &[f32],
    dscores: &mut [f32],
) -> BackendResult {
    let op = "causal_softmax_backward";
    check(op, "probs", shape.values(), probs.len())?;
    check(op, "dprobs", shape.values(), dprobs.len())?;
    check(op, "dscores", shape.values(), dscores.len())?;
    let len = shape.len;
    if len == 0 {
        return Ok(());
    }
    let rows = probs.chunks_exact(len).zip(dprobs.chunks_exact(len));
    for ((p, dp), ds) in rows.zip(dscores.chunks_exact_mut(len)) {
        for ((d, &pi), &dpi) in ds.iter_mut().zip(p).zip(dp) {
            *d = dpi * pi;
        }
        let dot = lane_sum(ds);
        for ((d, &pi), &dpi) in ds.iter_mut().zip(p).zip(dp) {
            *d = scale * pi * (dpi - dot);
        }
    }
    Ok(())
}

pub(super) fn swap_middle_axes(dims: [usize; 4], src: &[f32], dst: &mut [f32]) -> BackendResult {
    let [a, b, c, inner] = dims;
    check("swap_middle_axes", "src", a * b * c * inner, src.len())?;
    check("swap_middle_axes", "dst", a * b * c * inner, dst.len())?;
    if inner == 0 || b * c == 0 {
        return Ok(());
    }
    for (src, dst) in src
        .chunks_exact(b * c * inner)
        .zip(dst.chunks_exact_mut(b * c * inner))
    {
        for (j, run) in src.chunks_exact(inner).enumerate() {
            let (bi, ci) = (j / c, j % c);
            dst[(ci * b + bi) * inner..][..inner].copy_from_slice(run);
        }
    }
    Ok(())
}

pub(super) fn embed(width: usize, tokens: &[u32], table: &[f32], y: &mut [f32]) -> BackendResult {
    check_tokens("embed", width, tokens, table.len())?;
    check("embed", "y", tokens.len() * width, y.len())?;
    for (&t, row) in tokens.iter().zip(y.chunks_exact_mut(width.max(1))) {
        row.copy_from_slice(&table[t as usize * width..][..width]);
    }
    Ok(())
}

pub(super) fn embed_backward(
    width: usize,
    tokens: &[u32],
    dy: &[f32],
    dtable: &mut [f32],
) -> BackendResult {
    check_tokens("embed_backward", width, tokens, dtable.len())?;
    check("embed_backward", "dy", tokens.len() * width, dy.len())?;
    for (&t, row) in tokens.iter().zip(dy.chunks_exact(width.max(1))) {
        for (d, &g) in dtable[t as usize * width..][..width].iter_mut().zip(row) {
            *d += g;
        }
    }
    Ok(())
}
