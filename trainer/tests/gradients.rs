//! Every layer's backward pass against central finite differences of its forward pass.
//!
//! The objective is `L = sum(y * r)` for a fixed random `r`, so `dL/dy = r`; the analytic
//! gradients from `backward` must match `(L(v + h) - L(v - h)) / 2h` for inputs and parameters.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use murmur_trainer::CpuBackend;
use murmur_trainer::backend::{Backend, ConvGeometry, PoolGeometry};
use murmur_trainer::layers::{BackwardArgs, Layer, Scratch};

const H: f32 = 1e-2;

/// Deterministic values in [-1, 1] that keep away from 0 by at least `gap` (ReLU kinks).
fn values(n: usize, salt: u32, gap: f32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let t = ((i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 10_000) as f32;
            let v = t / 5_000.0 - 1.0;
            if v.abs() < gap {
                v.signum() * gap + v
            } else {
                v
            }
        })
        .collect()
}

fn forward(layer: &Layer, batch: usize, params: &Vec<f32>, x: &[f32]) -> Vec<f32> {
    let mut scratch = Scratch::new(&CpuBackend::new(), layer, batch).unwrap();
    let mut y = vec![0.0; batch * layer.output_len()];
    layer
        .forward(&CpuBackend::new(), batch, params, x, &mut y, &mut scratch)
        .unwrap();
    y
}

fn objective(layer: &Layer, batch: usize, params: &Vec<f32>, x: &[f32], r: &[f32]) -> f32 {
    forward(layer, batch, params, x)
        .iter()
        .zip(r)
        .map(|(a, b)| a * b)
        .sum()
}

fn assert_close(what: &str, analytic: f32, numeric: f32) {
    let tol = 2e-2 * numeric.abs().max(analytic.abs()) + 2e-3;
    assert!(
        (analytic - numeric).abs() <= tol,
        "{what}: analytic {analytic} vs finite difference {numeric}"
    );
}

fn check(layer: Layer, batch: usize, x: Vec<f32>) {
    let param_len = layer
        .param_ranges()
        .map_or(0, |(w, b, _)| w.len() + b.len());
    let params = values(param_len, 7, 0.0)
        .iter()
        .map(|v| v * 0.5)
        .collect::<Vec<_>>();
    let y = forward(&layer, batch, &params, &x);
    let r = values(y.len(), 3, 0.0);

    let mut scratch = Scratch::new(&CpuBackend::new(), &layer, batch).unwrap();
    let mut y_again = vec![0.0; y.len()];
    layer
        .forward(
            &CpuBackend::new(),
            batch,
            &params,
            &x,
            &mut y_again,
            &mut scratch,
        )
        .unwrap();
    let mut grads = vec![0.0; param_len];
    let mut dx = vec![0.0; x.len()];
    let args = BackwardArgs::<CpuBackend> {
        params: &params,
        grads: &mut grads,
        x: &x,
        y: &y_again,
        dy: &r,
        dx: Some(&mut dx),
    };
    layer
        .backward(&CpuBackend::new(), batch, args, &mut scratch)
        .unwrap();

    // Check a spread of at most ~60 coordinates of each, to keep the test fast.
    let stride = |n: usize| (n / 60).max(1);
    for i in (0..x.len()).step_by(stride(x.len())) {
        let (mut up, mut down) = (x.clone(), x.clone());
        up[i] += H;
        down[i] -= H;
        let numeric = (objective(&layer, batch, &params, &up, &r)
            - objective(&layer, batch, &params, &down, &r))
            / (2.0 * H);
        assert_close(&format!("{layer:?} dx[{i}]"), dx[i], numeric);
    }
    for i in (0..param_len).step_by(stride(param_len)) {
        let (mut up, mut down) = (params.clone(), params.clone());
        up[i] += H;
        down[i] -= H;
        let numeric = (objective(&layer, batch, &up, &x, &r)
            - objective(&layer, batch, &down, &x, &r))
            / (2.0 * H);
        assert_close(&format!("{layer:?} dparam[{i}]"), grads[i], numeric);
    }
}

#[test]
fn linear_backward_matches_finite_differences() {
    let layer = Layer::Linear {
        inputs: 7,
        outputs: 5,
        weight: 0..35,
        bias: 35..40,
    };
    check(layer, 3, values(21, 1, 0.0));
}

#[test]
fn relu_backward_matches_finite_differences() {
    check(Layer::Relu { len: 10 }, 2, values(20, 2, 0.05));
}

#[test]
fn conv2d_backward_matches_finite_differences() {
    for (stride, padding) in [(1, 1), (2, 0), (2, 1)] {
        let geometry = ConvGeometry {
            channels: 2,
            height: 6,
            width: 5,
            kernel: 3,
            stride,
            padding,
        };
        let weights = 3 * geometry.patch_len();
        let layer = Layer::Conv2d {
            geometry,
            out_channels: 3,
            weight: 0..weights,
            bias: weights..weights + 3,
        };
        check(layer, 2, values(2 * geometry.image_len(), 4, 0.0));
    }
}

#[test]
fn max_pool_backward_matches_finite_differences() {
    // Distinct values, spaced more than 2h apart, so no window has a tie or a kink within h.
    let n = 2 * 3 * 4 * 6;
    let x: Vec<f32> = (0..n).map(|i| ((i * 37) % n) as f32 * 0.05).collect();
    let layer = Layer::MaxPool2d {
        channels: 3,
        geometry: PoolGeometry {
            height: 4,
            width: 6,
            window: 2,
        },
    };
    check(layer, 2, x);
}

#[test]
fn flatten_backward_matches_finite_differences() {
    check(Layer::Flatten { len: 12 }, 2, values(24, 5, 0.0));
}

#[test]
fn softmax_cross_entropy_gradient_matches_finite_differences() {
    let classes = 4;
    let logits = values(3 * classes, 6, 0.0);
    let labels = [2u32, 0, 3];
    let loss = |z: &[f32]| {
        let mut scratch = vec![0.0; z.len()];
        CpuBackend::new()
            .softmax_cross_entropy(classes, z, &labels, &mut scratch)
            .unwrap()
    };
    let mut grad = vec![0.0; logits.len()];
    CpuBackend::new()
        .softmax_cross_entropy(classes, &logits, &labels, &mut grad)
        .unwrap();
    for i in 0..logits.len() {
        let (mut up, mut down) = (logits.clone(), logits.clone());
        up[i] += H;
        down[i] -= H;
        assert_close(
            &format!("dlogits[{i}]"),
            grad[i],
            (loss(&up) - loss(&down)) / (2.0 * H),
        );
    }
}
