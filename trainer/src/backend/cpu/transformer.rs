//! The CPU's kernels of a transformer besides GEMM: embeddings, the heads' layout, the GELU,
//! LayerNorm and causal softmax, forward and backward, each after the checks of its lengths.
//! Sums along a row use [`lane_sum`]'s fixed order; sums over rows go row by row, as the CUDA
//! kernels do.
//!
//! The loops of the GELU, LayerNorm and softmax are compiled three times (`multiversion`): for
//! AVX-512, for AVX2, and for the baseline x86-64 the binary targets, and run in the widest the
//! CPU has (decision 0057). Every version computes the same bits: Rust never fuses a multiply
//! and an add on its own, and the sums keep their lane order whatever the vector width.

use multiversion::multiversion;

use super::{CpuBackend, lane_sum};
use crate::backend::{BackendResult, CausalShape, LayerNormShape, check, check_tokens};

/// `sqrt(2 / pi)`, the GELU's tanh-form scale.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The GELU's tanh-form cubic coefficient.
const GELU_CUBIC: f32 = 0.044_715;

/// `e^x` to within about 2 ulp, in straight-line code the compiler vectorises (the library's
/// `exp` and `tanh` are calls, one value at a time, and were most of a GPT step's time). The
/// Cephes method: `x = n ln 2 + r` with `|r| <= ln 2 / 2`, a degree-6 polynomial for `e^r`,
/// and `2^n` built in the exponent bits. Inputs are clamped to where `e^x` is a normal `f32`.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, so that n ln 2 is exact in the first.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a branch.
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2_E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_2e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e_r = p * r * r + r + 1.0;
    e_r * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The GELU's `0.5 (1 + tanh(u))`, which is `1 / (1 + e^(-2u))`, for input `v`; and `du/dv`.
#[inline(always)]
fn gelu_gate(v: f32) -> (f32, f32) {
    let v2 = v * v;
    let u = SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v2);
    let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * v2);
    (1.0 / (1.0 + exp(-2.0 * u)), du)
}

pub(super) fn gelu(backend: &CpuBackend, x: &[f32], y: &mut [f32]) -> BackendResult {
    check("gelu", "y", x.len(), y.len())?;
    let part = backend.part_len(x.len(), 1);
    let parts: Vec<_> = x.chunks(part).zip(y.chunks_mut(part)).collect();
    backend.run_parts(parts, |(x, y)| gelu_part(x, y));
    Ok(())
}

#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn gelu_part(x: &[f32], y: &mut [f32]) {
    for (yi, &v) in y.iter_mut().zip(x) {
        *yi = v * gelu_gate(v).0;
    }
}

pub(super) fn gelu_backward(
    backend: &CpuBackend,
    x: &[f32],
    dy: &[f32],
    dx: &mut [f32],
) -> BackendResult {
    check("gelu_backward", "dy", x.len(), dy.len())?;
    check("gelu_backward", "dx", x.len(), dx.len())?;
    let part = backend.part_len(x.len(), 1);
    let parts: Vec<_> = x
        .chunks(part)
        .zip(dy.chunks(part))
        .zip(dx.chunks_mut(part))
        .collect();
    backend.run_parts(parts, |((x, dy), dx)| gelu_backward_part(x, dy, dx));
    Ok(())
}

#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn gelu_backward_part(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dxi, &dyi), &v) in dx.iter_mut().zip(dy).zip(x) {
        // With s = 0.5 (1 + tanh u): d(v s)/dv = s + v * 2 s (1 - s) du/dv.
        let (s, du) = gelu_gate(v);
        *dxi = dyi * (s + 2.0 * v * s * (1.0 - s) * du);
    }
}

pub(super) fn layer_norm(
    backend: &CpuBackend,
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
    let part = backend.part_len(x.len(), cols);
    let parts: Vec<_> = x
        .chunks(part)
        .zip(y.chunks_mut(part))
        .zip(stats.chunks_mut(2 * part / cols))
        .collect();
    backend.run_parts(parts, |((x, y), stats)| {
        layer_norm_rows(shape.eps, [x, gamma, beta], y, stats)
    });
    Ok(())
}

/// LayerNorm of whole rows of `x` (as long as `gamma`) into `y`, with each row's mean and
/// reciprocal deviation in `stats`.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn layer_norm_rows(eps: f32, [x, gamma, beta]: [&[f32]; 3], y: &mut [f32], stats: &mut [f32]) {
    let cols = gamma.len();
    let rows = x.chunks_exact(cols).zip(y.chunks_exact_mut(cols));
    for ((x, y), stats) in rows.zip(stats.chunks_exact_mut(2)) {
        let mean = lane_sum(x) / cols as f32;
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = (xi - mean) * (xi - mean);
        }
        let rstd = 1.0 / (lane_sum(y) / cols as f32 + eps).sqrt();
        for (((yi, &xi), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
            *yi = (xi - mean) * rstd * g + b;
        }
        stats.copy_from_slice(&[mean, rstd]);
    }
}

#[allow(clippy::too_many_arguments)] // one per tensor of the formula
pub(super) fn layer_norm_backward(
    backend: &CpuBackend,
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
    // dx row by row, in parallel.
    let part = backend.part_len(x.len(), cols);
    let parts: Vec<_> = x
        .chunks(part)
        .zip(dy.chunks(part))
        .zip(dx.chunks_mut(part))
        .zip(stats.chunks(2 * part / cols))
        .collect();
    backend.run_parts(parts, |(((x, dy), dx), stats)| {
        layer_norm_backward_rows([x, gamma, stats, dy], dx)
    });
    // dgamma and dbeta sum over the rows, in row order.
    let rows = x.chunks_exact(cols).zip(dy.chunks_exact(cols));
    for ((x, dy), stats) in rows.zip(stats.chunks_exact(2)) {
        let (mean, rstd) = (stats[0], stats[1]);
        for (((dg, db), &xi), &dyi) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(x).zip(dy) {
            *dg += dyi * (xi - mean) * rstd;
            *db += dyi;
        }
    }
    Ok(())
}

/// The input gradient `dx` of LayerNorm for whole rows of `x` (as long as `gamma`), from the
/// rows' `stats` and output gradient `dy`.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn layer_norm_backward_rows([x, gamma, stats, dy]: [&[f32]; 4], dx: &mut [f32]) {
    let cols = gamma.len();
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
    }
}

pub(super) fn causal_softmax(
    backend: &CpuBackend,
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
    // Whole matrices to each thread: rows repeat 0..len in every matrix, and row t sees
    // columns 0..=t.
    let part = backend.part_len(scores.len(), len * len);
    let parts: Vec<_> = scores.chunks(part).zip(probs.chunks_mut(part)).collect();
    backend.run_parts(parts, |(scores, probs)| {
        causal_softmax_rows(len, scale, scores, probs)
    });
    Ok(())
}

/// The causal softmax of whole `len` x `len` matrices of `scores` into `probs`.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn causal_softmax_rows(len: usize, scale: f32, scores: &[f32], probs: &mut [f32]) {
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
            *p = exp(scale * v - max);
        }
        let sum = lane_sum(visible);
        for p in visible.iter_mut() {
            *p /= sum;
        }
        masked.fill(0.0);
    }
}

pub(super) fn causal_softmax_backward(
    backend: &CpuBackend,
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
    let part = backend.part_len(probs.len(), len);
    let parts: Vec<_> = probs
        .chunks(part)
        .zip(dprobs.chunks(part))
        .zip(dscores.chunks_mut(part))
        .collect();
    backend.run_parts(parts, |((probs, dprobs), dscores)| {
        causal_softmax_backward_rows(len, scale, [probs, dprobs], dscores)
    });
    Ok(())
}

/// The score gradients of the causal softmax for rows of `len` probabilities.
#[multiversion(targets(
    "x86_64+avx512f+avx512vl+avx512bw+avx512dq+avx2+fma",
    "x86_64+avx2+fma"
))]
fn causal_softmax_backward_rows(
    len: usize,
    scale: f32,
    [probs, dprobs]: [&[f32]; 2],
    dscores: &mut [f32],
) {
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
}

pub(super) fn swap_middle_axes(
    backend: &CpuBackend,
    dims: [usize; 4],
    src: &[f32],
    dst: &mut [f32],
) -> BackendResult {
    let [a, b, c, inner] = dims;
    check("swap_middle_axes", "src", a * b * c * inner, src.len())?;
    check("swap_middle_axes", "dst", a * b * c * inner, dst.len())?;
    let block = b * c * inner;
    if block == 0 {
        return Ok(());
    }
    let part = backend.part_len(src.len(), block);
    let parts: Vec<_> = src.chunks(part).zip(dst.chunks_mut(part)).collect();
    backend.run_parts(parts, |(src, dst)| {
        for (src, dst) in src.chunks_exact(block).zip(dst.chunks_exact_mut(block)) {
            for (j, run) in src.chunks_exact(inner).enumerate() {
                let (bi, ci) = (j / c, j % c);
                dst[(ci * b + bi) * inner..][..inner].copy_from_slice(run);
            }
        }
    });
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_exp_is_within_a_few_ulp_of_the_library_one() {
        let mut worst = 0.0f64;
        // Every thousandth inside the clamp.
        for i in -86_999..=87_999 {
            let x = i as f32 * 1e-3;
            let (fast, exact) = (f64::from(exp(x)), f64::from(x).exp());
            worst = worst.max((fast - exact).abs() / exact);
        }
        // 2 ulp of f32 is 2.4e-7 relative.
        assert!(worst < 2.4e-7, "worst relative error {worst:e}");
        // Beyond the clamp, the clamp's values: no infinity, no zero, no NaN.
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert_eq!(exp(1000.0), exp(88.0));
        assert!(exp(88.0).is_finite() && exp(-87.0) > 0.0);
    }

    /// On a CPU with AVX2 or AVX-512 the kernels run their wide versions; each value must be
    /// the bits that one value at a time gives, so that nodes on any x86-64 train alike.
    #[test]
    fn the_wide_kernels_give_the_bits_of_one_value_at_a_time() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.0137).collect();
        let dy: Vec<f32> = x.iter().map(|v| (v * 3.1).sin()).collect();
        let (mut y, mut dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        gelu_part(&x, &mut y);
        gelu_backward_part(&x, &dy, &mut dx);
        for i in 0..x.len() {
            let v = std::hint::black_box(x[i]);
            let (s, du) = gelu_gate(v);
            assert_eq!(y[i].to_bits(), (v * s).to_bits(), "gelu at {v}");
            let d = dy[i] * (s + 2.0 * v * s * (1.0 - s) * du);
            assert_eq!(dx[i].to_bits(), d.to_bits(), "gelu backward at {v}");
        }

        // One 7 x 7 causal softmax: each visible value is exp(scale v - max) / its row's sum.
        let len = 7;
        let scores: Vec<f32> = (0..len * len)
            .map(|i| (i as f32 * 0.71).cos() * 4.0)
            .collect();
        let mut probs = vec![0.0; len * len];
        causal_softmax_rows(len, 0.3, &scores, &mut probs);
        for (row, (s, p)) in scores.chunks(len).zip(probs.chunks(len)).enumerate() {
            let seen = row + 1;
            let max = s[..seen]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &v| m.max(0.3 * v));
            let e: Vec<f32> = s[..seen]
                .iter()
                .map(|&v| exp(std::hint::black_box(0.3 * v - max)))
                .collect();
            let sum = lane_sum(&e);
            for (j, &pj) in p.iter().enumerate() {
                let expected = if j < seen { e[j] / sum } else { 0.0 };
                assert_eq!(pj.to_bits(), expected.to_bits(), "row {row}, column {j}");
            }
        }
    }
}
