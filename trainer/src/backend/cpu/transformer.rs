//! The CPU's kernels of a transformer block besides GEMM: the GELU and LayerNorm, forward and
//! backward. Sums over a row use [`lane_sum`]'s fixed order; sums over rows go row by row, as
//! the CUDA kernels do.

use super::lane_sum;
use crate::backend::LayerNormShape;

/// `sqrt(2 / pi)`, the GELU's tanh-form scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The GELU's tanh-form cubic coefficient.
const GELU_CUBIC: f32 = 0.044_715;

pub(super) fn gelu(x: &[f32], y: &mut [f32]) {
    for (yi, &v) in y.iter_mut().zip(x) {
        let u = SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v * v);
        *yi = 0.5 * v * (1.0 + u.tanh());
    }
}

pub(super) fn gelu_backward(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dxi, &dyi), &v) in dx.iter_mut().zip(dy).zip(x) {
        let v2 = v * v;
        let t = (SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v2)).tanh();
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * v2);
        *dxi = dyi * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du);
    }
}

/// Callers have checked every length against `shape`.
pub(super) fn layer_norm(
    shape: LayerNormShape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    y: &mut [f32],
    stats: &mut [f32],
) {
    let cols = shape.cols;
    if cols == 0 {
        return;
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
}

/// `dx`, then `dgamma` and `dbeta`; callers have checked every length against `shape`.
#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(super) fn layer_norm_backward(
    shape: LayerNormShape,
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    dy: &[f32],
    dx: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    dgamma.fill(0.0);
    dbeta.fill(0.0);
    let cols = shape.cols;
    if cols == 0 {
        return;
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
}
