//! Kernel tests written once and run on every device here: the CPU always, `cuda:0` where a GPU
//! answers. Each checks a kernel against values worked out by hand or a naive loop, so a device
//! passes only if it agrees with the CPU's semantics.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use common::{to_device, to_host};
use murmur_trainer::Backend;
use murmur_trainer::backend::{
    AdamWUpdate, BackendError, CausalShape, ChannelLayout, ConvGeometry, Gemm, LayerNormShape,
    PoolGeometry, SgdUpdate, whole, whole_mut,
};

fn gemm_matches_naive_product<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let (m, n, k) = (3, 4, 5);
    let a: Vec<f32> = (0..m * k).map(|i| i as f32 * 0.5 - 3.0).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i as f32).sin()).collect();
    let naive = |ta: bool, tb: bool| {
        let mut c = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let av = if ta { a[p * m + i] } else { a[i * k + p] };
                    let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                    c[i * n + j] += av * bv;
                }
            }
        }
        c
    };
    let (da, db) = (to_device(backend, &a), to_device(backend, &b));
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::new(m, n, k);
        g.transpose_a = ta;
        g.transpose_b = tb;
        let mut c = to_device(backend, &[0.0; 12]);
        backend
            .gemm(g, whole::<B>(&da), whole::<B>(&db), whole_mut::<B>(&mut c))
            .unwrap();
        for (x, y) in to_host(backend, &c).iter().zip(naive(ta, tb)) {
            assert!((x - y).abs() < 1e-4, "{ta} {tb}: {x} vs {y}");
        }
    }
    // beta = 1 accumulates into C, as the weight gradients do.
    let mut c = to_device(backend, &[1.0; 12]);
    let g = Gemm {
        beta: 1.0,
        ..Gemm::new(m, n, k)
    };
    backend
        .gemm(g, whole::<B>(&da), whole::<B>(&db), whole_mut::<B>(&mut c))
        .unwrap();
    for (x, y) in to_host(backend, &c).iter().zip(naive(false, false)) {
        assert!((x - (y + 1.0)).abs() < 1e-4, "beta: {x} vs {}", y + 1.0);
    }
}

#[test]
fn gemm_matches_naive_product_for_every_transpose() {
    common::on_every_device!(gemm_matches_naive_product);
}

fn gemm_rejects_wrong_lengths_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let (a, b) = (to_device(backend, &[0.0; 4]), to_device(backend, &[0.0; 3]));
    let mut c = to_device(backend, &[0.0; 4]);
    let err = backend
        .gemm(
            Gemm::new(2, 2, 2),
            whole::<B>(&a),
            whole::<B>(&b),
            whole_mut::<B>(&mut c),
        )
        .unwrap_err();
    assert!(
        matches!(err, BackendError::Shape { operand: "b", .. }),
        "{err}"
    );
}

#[test]
fn gemm_rejects_wrong_lengths() {
    common::on_every_device!(gemm_rejects_wrong_lengths_on);
}

fn elementwise_kernels_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let x = to_device(backend, &[-1.0, 2.0, -3.0, 4.0]);
    let mut y = to_device(backend, &[0.0; 4]);
    backend
        .relu(whole::<B>(&x), whole_mut::<B>(&mut y))
        .unwrap();
    assert_eq!(to_host(backend, &y), [0.0, 2.0, 0.0, 4.0]);
    let dy = to_device(backend, &[5.0, 6.0, 7.0, 8.0]);
    let mut dx = to_device(backend, &[9.0; 4]);
    backend
        .relu_backward(whole::<B>(&y), whole::<B>(&dy), whole_mut::<B>(&mut dx))
        .unwrap();
    assert_eq!(to_host(backend, &dx), [0.0, 6.0, 0.0, 8.0]);
    backend
        .axpy(0.5, whole::<B>(&dy), whole_mut::<B>(&mut dx))
        .unwrap();
    assert_eq!(to_host(backend, &dx), [2.5, 9.0, 3.5, 12.0]);
    // A mix's delta from the host lands in place (the CPU) or through scratch memory.
    backend
        .add_host(&[0.5, -1.0, 0.25, 0.0], whole_mut::<B>(&mut dx))
        .unwrap();
    assert_eq!(to_host(backend, &dx), [3.0, 8.0, 3.75, 12.0]);
    assert!(backend.add_host(&[1.0], whole_mut::<B>(&mut dx)).is_err());
    backend.fill(B::view_mut(&mut dx, 1..3), 7.0).unwrap();
    backend
        .copy(B::view(&x, 0..1), B::view_mut(&mut dx, 3..4))
        .unwrap();
    assert_eq!(to_host(backend, &dx), [3.0, 7.0, 7.0, -1.0]);

    // Bias over [outer 2, channels 3, inner 2].
    let layout = ChannelLayout {
        outer: 2,
        channels: 3,
        inner: 2,
    };
    let bias = to_device(backend, &[1.0, 10.0, 100.0]);
    let mut out = to_device(backend, &[0.0; 12]);
    backend
        .add_bias(layout, whole::<B>(&bias), whole_mut::<B>(&mut out))
        .unwrap();
    let expected = [1.0, 1.0, 10.0, 10.0, 100.0, 100.0];
    assert_eq!(to_host(backend, &out), [expected, expected].concat());
    let mut dbias = to_device(backend, &[5.0; 3]);
    backend
        .bias_grad(layout, whole::<B>(&out), whole_mut::<B>(&mut dbias))
        .unwrap();
    assert_eq!(to_host(backend, &dbias), [4.0, 40.0, 400.0]);
}

#[test]
fn elementwise_and_bias_kernels_do_what_they_say() {
    common::on_every_device!(elementwise_kernels_on);
}

/// Bias gradients over a dense layer's rows (one value per channel), over feature maps, and
/// over a convolution's channels as long as a batch of feature maps (the CUDA backend sums
/// those in chunks first). The values are multiples of 1/64, small enough
/// that every partial sum is exact in any order, so the backends must agree exactly.
fn bias_grad_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    for (outer, channels, inner) in [(1000, 3, 1), (7, 5, 300), (2, 3, 10_000)] {
        let layout = ChannelLayout {
            outer,
            channels,
            inner,
        };
        let host: Vec<f32> = (0..layout.len())
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let mut expected = vec![0.0f32; channels];
        for (i, v) in host.iter().enumerate() {
            expected[(i / inner) % channels] += v;
        }
        let dy = to_device(backend, &host);
        let mut dbias = to_device(backend, &vec![9.0; channels]);
        backend
            .bias_grad(layout, whole::<B>(&dy), whole_mut::<B>(&mut dbias))
            .unwrap();
        assert_eq!(to_host(backend, &dbias), expected, "{layout:?}");
    }
}

#[test]
fn bias_gradients_sum_every_row_of_every_channel() {
    common::on_every_device!(bias_grad_on);
}

fn swap_outer_axes_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let host: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let src = to_device(backend, &host);
    let mut once = to_device(backend, &[0.0; 24]);
    let mut twice = to_device(backend, &[0.0; 24]);
    backend
        .swap_outer_axes([2, 3, 4], whole::<B>(&src), whole_mut::<B>(&mut once))
        .unwrap();
    backend
        .swap_outer_axes([3, 2, 4], whole::<B>(&once), whole_mut::<B>(&mut twice))
        .unwrap();
    assert_eq!(to_host(backend, &once)[4..8], host[12..16]);
    assert_eq!(to_host(backend, &twice), host);
}

#[test]
fn swap_outer_axes_is_its_own_inverse() {
    common::on_every_device!(swap_outer_axes_on);
}

fn im2col_col2im_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // <im2col(x), p> == <x, col2im(p)> for any x and p, for stride 1 and 2.
    for stride in [1, 2] {
        let g = ConvGeometry {
            channels: 2,
            height: 5,
            width: 4,
            kernel: 3,
            stride,
            padding: 1,
        };
        let batch = 2;
        let x: Vec<f32> = (0..batch * g.image_len())
            .map(|i| (i as f32 * 0.37).cos())
            .collect();
        let plen = g.patch_len() * batch * g.out_pixels();
        let p: Vec<f32> = (0..plen).map(|i| (i as f32 * 0.11).sin()).collect();
        let (dx, dp) = (to_device(backend, &x), to_device(backend, &p));
        let mut cols = to_device(backend, &vec![0.0; plen]);
        let mut back = to_device(backend, &vec![9.0; x.len()]);
        backend
            .im2col(g, batch, whole::<B>(&dx), whole_mut::<B>(&mut cols))
            .unwrap();
        backend
            .col2im(g, batch, whole::<B>(&dp), whole_mut::<B>(&mut back))
            .unwrap();
        let cols = to_host(backend, &cols);
        let back = to_host(backend, &back);
        let lhs: f32 = cols.iter().zip(&p).map(|(a, b)| a * b).sum();
        let rhs: f32 = x.iter().zip(&back).map(|(a, b)| a * b).sum();
        assert!((lhs - rhs).abs() < 1e-3, "stride {stride}: {lhs} vs {rhs}");
        // The first patch row of the first image reads the top-left neighbour: padding first.
        assert_eq!(cols[0], 0.0);
    }
}

#[test]
fn im2col_and_col2im_are_adjoint() {
    common::on_every_device!(im2col_col2im_on);
}

fn softmax_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let logits = to_device(backend, &[0.0; 8]);
    let mut d = to_device(backend, &[0.0; 8]);
    let loss = backend
        .softmax_cross_entropy(4, whole::<B>(&logits), &[1, 3], whole_mut::<B>(&mut d))
        .unwrap();
    assert!((loss - 4f32.ln()).abs() < 1e-6);
    let d = to_host(backend, &d);
    assert!((d[1] - (0.25 - 1.0) / 2.0).abs() < 1e-7);
    assert!((d.iter().sum::<f32>()).abs() < 1e-6);

    let mut d = to_device(backend, &[0.0; 8]);
    let err = backend
        .softmax_cross_entropy(4, whole::<B>(&logits), &[1, 7], whole_mut::<B>(&mut d))
        .unwrap_err();
    assert!(matches!(err, BackendError::Label { label: 7, .. }), "{err}");

    let scores = to_device(backend, &[0.1, 0.9, 0.3, 0.5, 0.5, 0.2]);
    let mut predictions = [9u32; 2];
    backend
        .argmax_rows(3, whole::<B>(&scores), &mut predictions)
        .unwrap();
    // A tie goes to the first.
    assert_eq!(predictions, [1, 0]);
}

#[test]
fn softmax_cross_entropy_and_argmax() {
    common::on_every_device!(softmax_on);
}

fn sgd_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // PyTorch SGD(lr=0.1, momentum=0.9, weight_decay=0.01), two steps with grad 1.0:
    // d1 = 1 + 0.01*1 = 1.01, v1 = 1.01, p1 = 1 - 0.101 = 0.899
    // d2 = 1 + 0.00899 = 1.00899, v2 = 0.909 + 1.00899 = 1.91799, p2 = 0.899 - 0.191799
    let u = SgdUpdate {
        lr: 0.1,
        momentum: 0.9,
        nesterov: false,
        weight_decay: 0.01,
    };
    let grads = to_device(backend, &[1.0]);
    let (mut p, mut v) = (to_device(backend, &[1.0]), to_device(backend, &[0.0]));
    for _ in 0..2 {
        backend
            .sgd_update(
                u,
                whole_mut::<B>(&mut p),
                whole::<B>(&grads),
                whole_mut::<B>(&mut v),
            )
            .unwrap();
    }
    let p1 = to_host(backend, &p)[0];
    assert!((p1 - (0.899 - 0.191_799)).abs() < 1e-6, "{p1}");

    // Nesterov: step = d + mu * v; first step d = 1, v = 1, step = 1.9.
    let n = SgdUpdate {
        nesterov: true,
        weight_decay: 0.0,
        ..u
    };
    let (mut p, mut v) = (to_device(backend, &[1.0]), to_device(backend, &[0.0]));
    backend
        .sgd_update(
            n,
            whole_mut::<B>(&mut p),
            whole::<B>(&grads),
            whole_mut::<B>(&mut v),
        )
        .unwrap();
    assert!((to_host(backend, &p)[0] - 0.81).abs() < 1e-6);
}

#[test]
fn sgd_matches_hand_computed_steps() {
    common::on_every_device!(sgd_on);
}

fn adamw_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // With bias correction the first Adam step is lr * g / (|g| + eps') = lr * sign(g),
    // after decoupled decay p * (1 - lr * wd).
    let u = AdamWUpdate {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 1,
    };
    let grads = to_device(backend, &[0.5, -3.0]);
    let mut p = to_device(backend, &[2.0, 2.0]);
    let (mut m, mut v) = (to_device(backend, &[0.0; 2]), to_device(backend, &[0.0; 2]));
    backend
        .adamw_update(
            u,
            whole_mut::<B>(&mut p),
            whole::<B>(&grads),
            whole_mut::<B>(&mut m),
            whole_mut::<B>(&mut v),
        )
        .unwrap();
    let p = to_host(backend, &p);
    let decayed = 2.0 * (1.0 - 0.01 * 0.1);
    assert!((p[0] - (decayed - 0.01)).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] - (decayed + 0.01)).abs() < 1e-6, "{}", p[1]);
}

#[test]
fn adamw_first_step_moves_by_lr() {
    common::on_every_device!(adamw_on);
}

fn max_pool_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let g = PoolGeometry {
        height: 2,
        width: 4,
        window: 2,
    };
    let x = to_device(backend, &[1.0, 5.0, 0.0, 0.0, 2.0, 3.0, 0.0, 7.0]);
    let mut y = to_device(backend, &[0.0; 2]);
    backend
        .max_pool(g, 1, whole::<B>(&x), whole_mut::<B>(&mut y))
        .unwrap();
    assert_eq!(to_host(backend, &y), [5.0, 7.0]);
    let dy = to_device(backend, &[1.0, 2.0]);
    let mut dx = to_device(backend, &[9.0; 8]);
    backend
        .max_pool_backward(
            g,
            1,
            whole::<B>(&x),
            whole::<B>(&y),
            whole::<B>(&dy),
            whole_mut::<B>(&mut dx),
        )
        .unwrap();
    assert_eq!(
        to_host(backend, &dx),
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    );
}

#[test]
fn max_pool_routes_gradient_to_the_maximum() {
    common::on_every_device!(max_pool_on);
}

fn assert_near(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w}"
        );
    }
}

fn gelu_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let x: Vec<f32> = (0..41).map(|i| i as f32 * 0.25 - 5.0).collect();
    let gelu = |v: f64| {
        let u = (2.0 / std::f64::consts::PI).sqrt() * (v + 0.044_715 * v.powi(3));
        0.5 * v * (1.0 + u.tanh())
    };
    // The derivative of the same formula, by hand.
    let gelu_grad = |v: f64| {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let t = (c * (v + 0.044_715 * v.powi(3))).tanh();
        0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044_715 * v * v)
    };
    let xd = to_device(backend, &x);
    let mut y = backend.zeros(x.len()).unwrap();
    backend
        .gelu(whole::<B>(&xd), whole_mut::<B>(&mut y))
        .unwrap();
    let want: Vec<f64> = x.iter().map(|&v| gelu(f64::from(v))).collect();
    assert_near("gelu", &to_host(backend, &y), &want, 1e-6);
    // PyTorch's gelu(approximate="tanh") at 1 and -1.
    assert!((want[24] - 0.841_192).abs() < 1e-6 && (want[16] + 0.158_808).abs() < 1e-6);

    let dy: Vec<f32> = (0..41).map(|i| 1.0 - i as f32 * 0.05).collect();
    let dyd = to_device(backend, &dy);
    let mut dx = backend.zeros(x.len()).unwrap();
    backend
        .gelu_backward(whole::<B>(&xd), whole::<B>(&dyd), whole_mut::<B>(&mut dx))
        .unwrap();
    let want: Vec<f64> = x
        .iter()
        .zip(&dy)
        .map(|(&v, &d)| f64::from(d) * gelu_grad(f64::from(v)))
        .collect();
    assert_near("gelu_backward", &to_host(backend, &dx), &want, 1e-6);
}

#[test]
fn gelu_and_its_gradient_match_the_tanh_formula() {
    common::on_every_device!(gelu_on);
}

/// LayerNorm of `x` and its gradients for `dy`, in `f64`: `(y, dx, dgamma, dbeta)`.
fn layer_norm_reference(
    shape: LayerNormShape,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    dy: &[f32],
) -> [Vec<f64>; 4] {
    let cols = shape.cols;
    let n = cols as f64;
    let mut y = vec![0.0; x.len()];
    let mut dx = vec![0.0; x.len()];
    let (mut dgamma, mut dbeta) = (vec![0.0; cols], vec![0.0; cols]);
    for r in 0..shape.rows {
        let row =
            |v: &[f32]| -> Vec<f64> { v[r * cols..][..cols].iter().map(|&a| a.into()).collect() };
        let (xr, dyr) = (row(x), row(dy));
        let mean = xr.iter().sum::<f64>() / n;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let rstd = 1.0 / (var + f64::from(shape.eps)).sqrt();
        let xhat: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let g: Vec<f64> = (0..cols).map(|i| dyr[i] * f64::from(gamma[i])).collect();
        let mean_g = g.iter().sum::<f64>() / n;
        let mean_g_xhat = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / n;
        for i in 0..cols {
            y[r * cols + i] = xhat[i] * f64::from(gamma[i]) + f64::from(beta[i]);
            dx[r * cols + i] = rstd * (g[i] - mean_g - xhat[i] * mean_g_xhat);
            dgamma[i] += dyr[i] * xhat[i];
            dbeta[i] += dyr[i];
        }
    }
    [y, dx, dgamma, dbeta]
}

fn layer_norm_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // Rows longer than a CUDA block (256), and a constant row, whose variance is all eps.
    let shape = LayerNormShape {
        rows: 3,
        cols: 300,
        eps: 1e-5,
    };
    let mut x: Vec<f32> = (0..shape.len())
        .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.07)
        .collect();
    x[2 * shape.cols..].fill(4.0);
    let gamma: Vec<f32> = (0..shape.cols)
        .map(|i| 0.5 + (i % 7) as f32 * 0.25)
        .collect();
    let beta: Vec<f32> = (0..shape.cols)
        .map(|i| (i % 5) as f32 * 0.1 - 0.2)
        .collect();
    let dy: Vec<f32> = (0..shape.len())
        .map(|i| ((i * 53 % 89) as f32 - 44.0) * 0.02)
        .collect();
    let [want_y, want_dx, want_dgamma, want_dbeta] =
        layer_norm_reference(shape, &x, &gamma, &beta, &dy);

    let [xd, gd, bd, dyd] = [&x, &gamma, &beta, &dy].map(|v| to_device(backend, v));
    let mut y = backend.zeros(shape.len()).unwrap();
    let mut stats = backend.zeros(2 * shape.rows).unwrap();
    backend
        .layer_norm(
            shape,
            whole::<B>(&xd),
            whole::<B>(&gd),
            whole::<B>(&bd),
            whole_mut::<B>(&mut y),
            whole_mut::<B>(&mut stats),
        )
        .unwrap();
    assert_near("layer_norm y", &to_host(backend, &y), &want_y, 1e-5);
    let stats = to_host(backend, &stats);
    assert_eq!(stats[4], 4.0, "the constant row's mean");
    assert!(
        (stats[5] - 1e-5f32.sqrt().recip()).abs() < 0.01,
        "{}",
        stats[5]
    );

    let stats = to_device(backend, &stats);
    let [mut dx, mut dparams] =
        [shape.len(), 2 * shape.cols].map(|len| to_device(backend, &vec![9.0; len]));
    backend
        .layer_norm_backward(
            shape,
            whole::<B>(&xd),
            whole::<B>(&gd),
            whole::<B>(&stats),
            whole::<B>(&dyd),
            whole_mut::<B>(&mut dx),
            whole_mut::<B>(&mut dparams),
        )
        .unwrap();
    let dparams = to_host(backend, &dparams);
    let (dgamma, dbeta) = dparams.split_at(shape.cols);
    // The constant row's dx is rstd (~316) times a sum of rounding: compare the others.
    let dx = to_host(backend, &dx);
    let live = 2 * shape.cols;
    assert_near("layer_norm dx", &dx[..live], &want_dx[..live], 1e-4);
    assert_near("layer_norm dgamma", dgamma, &want_dgamma, 1e-4);
    assert_near("layer_norm dbeta", dbeta, &want_dbeta, 1e-5);
}

#[test]
fn layer_norm_and_its_gradients_match_a_double_precision_reference() {
    common::on_every_device!(layer_norm_on);
}

fn layer_norm_rejects_wrong_lengths_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let shape = LayerNormShape {
        rows: 2,
        cols: 3,
        eps: 1e-5,
    };
    let [x, gamma, beta] = [6, 3, 2].map(|len| backend.zeros(len).unwrap());
    let [mut y, mut stats] = [6, 4].map(|len| backend.zeros(len).unwrap());
    let err = backend
        .layer_norm(
            shape,
            whole::<B>(&x),
            whole::<B>(&gamma),
            whole::<B>(&beta),
            whole_mut::<B>(&mut y),
            whole_mut::<B>(&mut stats),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            BackendError::Shape {
                operand: "beta",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn layer_norm_rejects_wrong_lengths() {
    common::on_every_device!(layer_norm_rejects_wrong_lengths_on);
}

fn gemm_batched_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let (count, m, n, k) = (3, 2, 4, 5);
    let a: Vec<f32> = (0..count * m * k).map(|i| (i as f32 * 0.7).cos()).collect();
    let b: Vec<f32> = (0..count * k * n).map(|i| (i as f32 * 0.3).sin()).collect();
    let (da, db) = (to_device(backend, &a), to_device(backend, &b));
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let mut g = Gemm::new(m, n, k);
        g.transpose_a = ta;
        g.transpose_b = tb;
        let mut c = to_device(backend, &vec![0.0; count * m * n]);
        backend
            .gemm_batched(
                g,
                count,
                whole::<B>(&da),
                whole::<B>(&db),
                whole_mut::<B>(&mut c),
            )
            .unwrap();
        let c = to_host(backend, &c);
        for h in 0..count {
            let (a, b) = (&a[h * m * k..][..m * k], &b[h * k * n..][..k * n]);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k)
                        .map(|p| {
                            let av = if ta { a[p * m + i] } else { a[i * k + p] };
                            let bv = if tb { b[j * k + p] } else { b[p * n + j] };
                            av * bv
                        })
                        .sum();
                    let got = c[h * m * n + i * n + j];
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{ta} {tb} matrix {h} ({i}, {j}): {got} vs {want}"
                    );
                }
            }
        }
    }
    let mut short = to_device(backend, &vec![0.0; count * m * n - 1]);
    let err = backend
        .gemm_batched(
            Gemm::new(m, n, k),
            count,
            whole::<B>(&da),
            whole::<B>(&db),
            whole_mut::<B>(&mut short),
        )
        .unwrap_err();
    assert!(
        matches!(err, BackendError::Shape { operand: "c", .. }),
        "{err}"
    );
}

#[test]
fn batched_gemm_multiplies_each_pair_of_matrices() {
    common::on_every_device!(gemm_batched_on);
}

/// The causal softmax of `scores` and its gradient for `dprobs`, in `f64`.
fn causal_softmax_reference(
    shape: CausalShape,
    scale: f64,
    scores: &[f32],
    dprobs: &[f32],
) -> (Vec<f64>, Vec<f64>) {
    let len = shape.len;
    let mut probs = vec![0.0; scores.len()];
    let mut dscores = vec![0.0; scores.len()];
    for row in 0..shape.matrices * len {
        let seen = row % len + 1;
        let x: Vec<f64> = scores[row * len..][..seen]
            .iter()
            .map(|&v| scale * f64::from(v))
            .collect();
        let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = x.iter().map(|v| (v - max).exp()).sum();
        for i in 0..seen {
            probs[row * len + i] = (x[i] - max).exp() / sum;
        }
        let dot: f64 = (0..len)
            .map(|i| f64::from(dprobs[row * len + i]) * probs[row * len + i])
            .sum();
        for i in 0..len {
            let p = probs[row * len + i];
            dscores[row * len + i] = scale * p * (f64::from(dprobs[row * len + i]) - dot);
        }
    }
    (probs, dscores)
}

fn causal_softmax_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // Rows longer than a CUDA block (256) in one case; two matrices in the other.
    for shape in [
        CausalShape {
            matrices: 2,
            len: 5,
        },
        CausalShape {
            matrices: 1,
            len: 300,
        },
    ] {
        let scale = 0.125;
        let scores: Vec<f32> = (0..shape.values())
            .map(|i| ((i * 29 % 83) as f32 - 41.0) * 0.9)
            .collect();
        let dprobs: Vec<f32> = (0..shape.values())
            .map(|i| ((i * 17 % 61) as f32 - 30.0) * 0.05)
            .collect();
        let (want_probs, want_dscores) =
            causal_softmax_reference(shape, scale.into(), &scores, &dprobs);
        let (ds, ddp) = (to_device(backend, &scores), to_device(backend, &dprobs));
        let mut probs = to_device(backend, &vec![9.0; shape.values()]);
        backend
            .causal_softmax(shape, scale, whole::<B>(&ds), whole_mut::<B>(&mut probs))
            .unwrap();
        let got = to_host(backend, &probs);
        assert_near("causal_softmax", &got, &want_probs, 1e-6);
        // Row t of each matrix attends to columns 0..=t only, and each row sums to 1.
        assert_eq!(&got[..5], &[1.0, 0.0, 0.0, 0.0, 0.0]);
        for row in got.chunks(shape.len) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        }
        let mut dscores = to_device(backend, &vec![9.0; shape.values()]);
        backend
            .causal_softmax_backward(
                shape,
                scale,
                whole::<B>(&probs),
                whole::<B>(&ddp),
                whole_mut::<B>(&mut dscores),
            )
            .unwrap();
        assert_near(
            "causal_softmax_backward",
            &to_host(backend, &dscores),
            &want_dscores,
            1e-6,
        );
    }
}

#[test]
fn causal_softmax_attends_to_the_past_and_matches_a_double_precision_reference() {
    common::on_every_device!(causal_softmax_on);
}

fn swap_middle_axes_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let dims = [2, 3, 4, 5];
    let [a, b, c, inner] = dims;
    let src: Vec<f32> = (0..a * b * c * inner).map(|i| i as f32).collect();
    let d_src = to_device(backend, &src);
    let mut swapped = backend.zeros(src.len()).unwrap();
    backend
        .swap_middle_axes(dims, whole::<B>(&d_src), whole_mut::<B>(&mut swapped))
        .unwrap();
    let swapped_host = to_host(backend, &swapped);
    for (ai, bi, ci, k) in (0..a).flat_map(|ai| {
        (0..b)
            .flat_map(move |bi| (0..c).flat_map(move |ci| (0..inner).map(move |k| (ai, bi, ci, k))))
    }) {
        assert_eq!(
            swapped_host[((ai * c + ci) * b + bi) * inner + k],
            src[((ai * b + bi) * c + ci) * inner + k],
            "({ai}, {bi}, {ci}, {k})"
        );
    }
    // Swapping back with the middle dimensions exchanged restores the source.
    let mut back = backend.zeros(src.len()).unwrap();
    backend
        .swap_middle_axes(
            [a, c, b, inner],
            whole::<B>(&swapped),
            whole_mut::<B>(&mut back),
        )
        .unwrap();
    assert_eq!(to_host(backend, &back), src);
}

#[test]
fn swapping_the_middle_axes_moves_each_run_and_swaps_back() {
    common::on_every_device!(swap_middle_axes_on);
}

fn embed_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let width = 3;
    let table: Vec<f32> = (0..4 * width).map(|i| i as f32 * 0.5).collect();
    let tokens = [2u32, 0, 2, 3];
    let d_table = to_device(backend, &table);
    let mut y = backend.zeros(tokens.len() * width).unwrap();
    backend
        .embed(width, &tokens, whole::<B>(&d_table), whole_mut::<B>(&mut y))
        .unwrap();
    assert_eq!(
        to_host(backend, &y),
        [3.0, 3.5, 4.0, 0.0, 0.5, 1.0, 3.0, 3.5, 4.0, 4.5, 5.0, 5.5]
    );
    // The gradient adds to what the table's gradient holds; token 2's two rows add up.
    let dy: Vec<f32> = (0..tokens.len() * width).map(|i| (i + 1) as f32).collect();
    let d_dy = to_device(backend, &dy);
    let mut dtable = to_device(backend, &[100.0; 12]);
    backend
        .embed_backward(
            width,
            &tokens,
            whole::<B>(&d_dy),
            whole_mut::<B>(&mut dtable),
        )
        .unwrap();
    assert_eq!(
        to_host(backend, &dtable),
        [
            104.0, 105.0, 106.0, 100.0, 100.0, 100.0, 108.0, 110.0, 112.0, 110.0, 111.0, 112.0
        ]
    );
    let err = backend
        .embed(width, &[4], whole::<B>(&d_table), whole_mut::<B>(&mut y))
        .unwrap_err();
    assert!(
        matches!(
            err,
            BackendError::Label {
                op: "embed",
                label: 4,
                classes: 4
            }
        ),
        "{err}"
    );
}

#[test]
fn embedding_gathers_rows_and_its_gradient_adds_them_back() {
    common::on_every_device!(embed_on);
}

fn scale_and_sum_squares_on<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // Longer than one block of sums (4096), with a ragged last block.
    let x: Vec<f32> = (0..10_000).map(|i| ((i % 7) as f32 - 3.0) * 0.5).collect();
    let exact: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mut d = to_device(backend, &x);
    let sum = backend.sum_squares(whole::<B>(&d)).unwrap();
    assert!((sum - exact).abs() <= 1e-6 * exact, "{sum} vs {exact}");
    backend.scale(-2.0, whole_mut::<B>(&mut d)).unwrap();
    let scaled = to_host(backend, &d);
    assert!(scaled.iter().zip(&x).all(|(s, v)| *s == -2.0 * v));
    assert_eq!(backend.sum_squares(whole::<B>(&d)).unwrap(), 4.0 * sum);
}

#[test]
fn scaling_and_the_sum_of_squares_hold_for_long_buffers() {
    common::on_every_device!(scale_and_sum_squares_on);
}
