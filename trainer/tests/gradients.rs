//! Every layer's backward pass against central finite differences of its forward pass.
//!
//! The objective is `L = sum(y * r)` for a fixed random `r`, so `dL/dy = r`; the analytic
//! gradients from `backward` must match `(L(v + h) - L(v - h)) / 2h` for inputs and parameters.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use common::{to_device, to_host};
use murmur_trainer::backend::{
    Backend, CausalShape, ConvGeometry, LayerNormShape, PoolGeometry, whole, whole_mut,
};
use murmur_trainer::gpt::{GptPass, GptSpec};
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

/// One layer on one device, with its inputs given and its results read back on the host.
struct Probe<'a, B: Backend> {
    backend: &'a B,
    layer: &'a Layer,
    batch: usize,
}

impl<B: Backend> Probe<'_, B> {
    /// Runs the forward pass on device buffers; returns `y` and the scratch backward needs.
    fn forward_on_device(&self, params: &B::Buffer, x: &B::Buffer) -> (B::Buffer, Scratch<B>) {
        let mut scratch = Scratch::new(self.backend, self.layer, self.batch).unwrap();
        let mut y = self
            .backend
            .zeros(self.batch * self.layer.output_len())
            .unwrap();
        self.layer
            .forward(
                self.backend,
                self.batch,
                params,
                whole::<B>(x),
                whole_mut::<B>(&mut y),
                &mut scratch,
            )
            .unwrap();
        (y, scratch)
    }

    fn forward(&self, params: &[f32], x: &[f32]) -> Vec<f32> {
        let (params, x) = (to_device(self.backend, params), to_device(self.backend, x));
        let (y, _) = self.forward_on_device(&params, &x);
        to_host(self.backend, &y)
    }

    fn objective(&self, params: &[f32], x: &[f32], r: &[f32]) -> f32 {
        self.forward(params, x)
            .iter()
            .zip(r)
            .map(|(a, b)| a * b)
            .sum()
    }

    /// The analytic gradients for `dL/dy = r`: with respect to the parameters and to `x`.
    fn backward(&self, params: &[f32], x: &[f32], r: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let backend = self.backend;
        let (params, x) = (to_device(backend, params), to_device(backend, x));
        let (y, mut scratch) = self.forward_on_device(&params, &x);
        let dy = to_device(backend, r);
        let mut grads = backend.zeros(B::buffer_len(&params)).unwrap();
        let mut dx = backend.zeros(B::buffer_len(&x)).unwrap();
        let args = BackwardArgs::<B> {
            params: &params,
            grads: &mut grads,
            x: whole::<B>(&x),
            y: whole::<B>(&y),
            dy: whole::<B>(&dy),
            dx: Some(whole_mut::<B>(&mut dx)),
        };
        self.layer
            .backward(backend, self.batch, args, &mut scratch)
            .unwrap();
        (to_host(backend, &grads), to_host(backend, &dx))
    }
}

fn assert_close(what: &str, analytic: f32, numeric: f32) {
    let tol = 2e-2 * numeric.abs().max(analytic.abs()) + 2e-3;
    assert!(
        (analytic - numeric).abs() <= tol,
        "{what}: analytic {analytic} vs finite difference {numeric}"
    );
}

/// Checks `layer`'s backward pass on every device here against finite differences computed on
/// that same device.
fn check(layer: Layer, batch: usize, x: Vec<f32>) {
    check_on(&murmur_trainer::CpuBackend::new(), &layer, batch, &x);
    match common::gpu_here() {
        Ok(()) => check_on(&common::cuda_zero(), &layer, batch, &x),
        Err(reason) => eprintln!("{layer:?}: cpu only ({reason})"),
    }
}

fn check_on<B: Backend>(backend: &B, layer: &Layer, batch: usize, x: &[f32]) {
    let probe = Probe {
        backend,
        layer,
        batch,
    };
    let param_len = layer
        .param_ranges()
        .map_or(0, |(w, b, _)| w.len() + b.len());
    let params = values(param_len, 7, 0.0)
        .iter()
        .map(|v| v * 0.5)
        .collect::<Vec<_>>();
    let r = values(batch * layer.output_len(), 3, 0.0);
    let (grads, dx) = probe.backward(&params, x, &r);
    let device = backend.name();

    // Check a spread of at most ~60 coordinates of each, to keep the test fast.
    let stride = |n: usize| (n / 60).max(1);
    for i in (0..x.len()).step_by(stride(x.len())) {
        let (mut up, mut down) = (x.to_vec(), x.to_vec());
        up[i] += H;
        down[i] -= H;
        let numeric =
            (probe.objective(&params, &up, &r) - probe.objective(&params, &down, &r)) / (2.0 * H);
        assert_close(&format!("{device} {layer:?} dx[{i}]"), dx[i], numeric);
    }
    for i in (0..param_len).step_by(stride(param_len)) {
        let (mut up, mut down) = (params.clone(), params.clone());
        up[i] += H;
        down[i] -= H;
        let numeric = (probe.objective(&up, x, &r) - probe.objective(&down, x, &r)) / (2.0 * H);
        assert_close(
            &format!("{device} {layer:?} dparam[{i}]"),
            grads[i],
            numeric,
        );
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

fn softmax_cross_entropy_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let classes = 4;
    let logits = values(3 * classes, 6, 0.0);
    let labels = [2u32, 0, 3];
    // The loss of `z` and its gradient with respect to `z`.
    let loss_and_grad = |z: &[f32]| {
        let z = to_device(backend, z);
        let mut grad = backend.zeros(B::buffer_len(&z)).unwrap();
        let loss = backend
            .softmax_cross_entropy(classes, whole::<B>(&z), &labels, whole_mut::<B>(&mut grad))
            .unwrap();
        (loss, to_host(backend, &grad))
    };
    let (_, grad) = loss_and_grad(&logits);
    for i in 0..logits.len() {
        let (mut up, mut down) = (logits.clone(), logits.clone());
        up[i] += H;
        down[i] -= H;
        assert_close(
            &format!("{} dlogits[{i}]", backend.name()),
            grad[i],
            (loss_and_grad(&up).0 - loss_and_grad(&down).0) / (2.0 * H),
        );
    }
}

#[test]
fn softmax_cross_entropy_gradient_matches_finite_differences() {
    common::on_every_device!(softmax_cross_entropy_gradient);
}

/// Checks the analytic gradients `grads[k]` of `L = sum(f(inputs) * r)` with respect to each of
/// `inputs[k]` against central finite differences of `f`, at up to ~60 coordinates of each.
fn check_gradients(
    what: &str,
    inputs: &[Vec<f32>],
    r: &[f32],
    f: impl Fn(&[Vec<f32>]) -> Vec<f32>,
    grads: &[Vec<f32>],
) {
    let objective =
        |inputs: &[Vec<f32>]| -> f32 { f(inputs).iter().zip(r).map(|(a, b)| a * b).sum() };
    for (k, grad) in grads.iter().enumerate() {
        let len = inputs[k].len();
        for i in (0..len).step_by((len / 60).max(1)) {
            let (mut up, mut down) = (inputs.to_vec(), inputs.to_vec());
            up[k][i] += H;
            down[k][i] -= H;
            let numeric = (objective(&up) - objective(&down)) / (2.0 * H);
            assert_close(&format!("{what} d(input {k})[{i}]"), grad[i], numeric);
        }
    }
}

fn gelu_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    // Spread over the curved part and both tails.
    let x: Vec<f32> = values(48, 9, 0.0).iter().map(|v| v * 4.0).collect();
    let r = values(48, 4, 0.0);
    let gelu = |inputs: &[Vec<f32>]| {
        let x = to_device(backend, &inputs[0]);
        let mut y = backend.zeros(inputs[0].len()).unwrap();
        backend
            .gelu(whole::<B>(&x), whole_mut::<B>(&mut y))
            .unwrap();
        to_host(backend, &y)
    };
    let (xd, dy) = (to_device(backend, &x), to_device(backend, &r));
    let mut dx = backend.zeros(x.len()).unwrap();
    backend
        .gelu_backward(whole::<B>(&xd), whole::<B>(&dy), whole_mut::<B>(&mut dx))
        .unwrap();
    let what = format!("{} gelu", backend.name());
    check_gradients(&what, &[x], &r, gelu, &[to_host(backend, &dx)]);
}

#[test]
fn gelu_gradient_matches_finite_differences() {
    common::on_every_device!(gelu_gradient);
}

fn layer_norm_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let shape = LayerNormShape {
        rows: 3,
        cols: 10,
        eps: 1e-5,
    };
    let inputs = vec![
        values(shape.len(), 11, 0.0),
        values(shape.cols, 12, 0.0)
            .iter()
            .map(|v| 1.0 + 0.5 * v)
            .collect(),
        values(shape.cols, 13, 0.0),
    ];
    let r = values(shape.len(), 14, 0.0);
    // y and the row statistics for x, gamma, beta.
    let forward = |inputs: &[Vec<f32>]| {
        let [x, gamma, beta] = [0, 1, 2].map(|k| to_device(backend, &inputs[k]));
        let mut y = backend.zeros(shape.len()).unwrap();
        let mut stats = backend.zeros(2 * shape.rows).unwrap();
        backend
            .layer_norm(
                shape,
                whole::<B>(&x),
                whole::<B>(&gamma),
                whole::<B>(&beta),
                whole_mut::<B>(&mut y),
                whole_mut::<B>(&mut stats),
            )
            .unwrap();
        (to_host(backend, &y), stats)
    };
    let [x, gamma] = [0, 1].map(|k| to_device(backend, &inputs[k]));
    let (_, stats) = forward(&inputs);
    let dy = to_device(backend, &r);
    let [mut dx, mut dparams] =
        [shape.len(), 2 * shape.cols].map(|len| backend.zeros(len).unwrap());
    backend
        .layer_norm_backward(
            shape,
            whole::<B>(&x),
            whole::<B>(&gamma),
            whole::<B>(&stats),
            whole::<B>(&dy),
            whole_mut::<B>(&mut dx),
            whole_mut::<B>(&mut dparams),
        )
        .unwrap();
    let dparams = to_host(backend, &dparams);
    let (dgamma, dbeta) = dparams.split_at(shape.cols);
    let grads = [to_host(backend, &dx), dgamma.to_vec(), dbeta.to_vec()];
    let what = format!("{} layer_norm", backend.name());
    check_gradients(&what, &inputs, &r, |i| forward(i).0, &grads);
}

#[test]
fn layer_norm_gradient_matches_finite_differences() {
    common::on_every_device!(layer_norm_gradient);
}

fn causal_softmax_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let shape = CausalShape {
        matrices: 2,
        len: 4,
    };
    let scale = 0.5;
    let scores = values(shape.values(), 15, 0.0)
        .iter()
        .map(|v| 3.0 * v)
        .collect::<Vec<_>>();
    let r = values(shape.values(), 16, 0.0);
    let softmax = |inputs: &[Vec<f32>]| {
        let scores = to_device(backend, &inputs[0]);
        let mut probs = backend.zeros(shape.values()).unwrap();
        backend
            .causal_softmax(
                shape,
                scale,
                whole::<B>(&scores),
                whole_mut::<B>(&mut probs),
            )
            .unwrap();
        probs
    };
    let probs = softmax(std::slice::from_ref(&scores));
    let dprobs = to_device(backend, &r);
    let mut dscores = backend.zeros(shape.values()).unwrap();
    backend
        .causal_softmax_backward(
            shape,
            scale,
            whole::<B>(&probs),
            whole::<B>(&dprobs),
            whole_mut::<B>(&mut dscores),
        )
        .unwrap();
    let what = format!("{} causal_softmax", backend.name());
    check_gradients(
        &what,
        &[scores],
        &r,
        |i| to_host(backend, &softmax(i)),
        &[to_host(backend, &dscores)],
    );
}

#[test]
fn causal_softmax_gradient_matches_finite_differences() {
    common::on_every_device!(causal_softmax_gradient);
}

fn embedding_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let width = 4;
    let tokens = [1u32, 3, 1, 0, 2];
    let table = values(5 * width, 17, 0.0);
    let r = values(tokens.len() * width, 18, 0.0);
    let embed = |inputs: &[Vec<f32>]| {
        let table = to_device(backend, &inputs[0]);
        let mut y = backend.zeros(tokens.len() * width).unwrap();
        backend
            .embed(width, &tokens, whole::<B>(&table), whole_mut::<B>(&mut y))
            .unwrap();
        to_host(backend, &y)
    };
    let dy = to_device(backend, &r);
    let mut dtable = backend.zeros(table.len()).unwrap();
    backend
        .embed_backward(width, &tokens, whole::<B>(&dy), whole_mut::<B>(&mut dtable))
        .unwrap();
    let what = format!("{} embed", backend.name());
    check_gradients(&what, &[table], &r, embed, &[to_host(backend, &dtable)]);
}

#[test]
fn embedding_gradient_matches_finite_differences() {
    common::on_every_device!(embedding_gradient);
}

/// The whole GPT's parameter gradients against finite differences of its loss: two blocks,
/// two heads, sequences shorter than the context, tokens repeated (their embedding rows get
/// two gradients) and a token never seen (its row gets the head's only).
fn gpt_gradient<B: Backend>(new: fn() -> B) {
    let backend = &new();
    let spec = GptSpec {
        layers: 2,
        heads: 2,
        width: 8,
        context: 6,
        vocab: 11,
    };
    let layout = spec.layout();
    // Weights and biases larger than GPT-2's 0.02, so that every path carries a gradient well
    // above rounding; LayerNorm gains near 1.
    let noise = values(layout.len(), 19, 0.0);
    let mut params = vec![0.0; layout.len()];
    for entry in layout.entries() {
        let gain = entry.name.contains(".ln_") && entry.name.ends_with(".weight");
        for i in entry.range() {
            params[i] = if gain {
                1.0 + 0.2 * noise[i]
            } else {
                0.3 * noise[i]
            };
        }
    }
    let (len, inputs) = (4, [1u32, 7, 7, 2, 9, 1, 0, 3]);
    let targets = [7u32, 7, 2, 9, 1, 0, 3, 4];
    let mut pass = GptPass::new(backend, spec, 2).unwrap();
    let mut loss_of = |params: &[f32], grads: Option<&mut Vec<f32>>| {
        let device_params = to_device(backend, params);
        let mut device_grads = backend.zeros(params.len()).unwrap();
        pass.forward(backend, &device_params, &inputs, len).unwrap();
        let loss = pass
            .backward(backend, &device_params, &mut device_grads, &targets)
            .unwrap();
        if let Some(grads) = grads {
            *grads = to_host(backend, &device_grads);
        }
        loss
    };
    let mut grads = Vec::new();
    loss_of(&params, Some(&mut grads));
    // A few coordinates of every tensor.
    // The five-point stencil: its error is of order h^4, so a step large enough to keep the
    // loss's rounding (a few 1e-7) small next to the differences is still accurate.
    let h = 1e-2;
    for entry in layout.entries() {
        let range = entry.range();
        for i in range.clone().step_by((range.len() / 4).max(1)) {
            let mut at = |offset: f32| {
                let mut moved = params.clone();
                moved[i] += offset;
                loss_of(&moved, None)
            };
            let numeric = (8.0 * (at(h) - at(-h)) - (at(2.0 * h) - at(-2.0 * h))) / (12.0 * h);
            let tol = 1e-2 * numeric.abs().max(grads[i].abs()) + 1e-4;
            assert!(
                (grads[i] - numeric).abs() <= tol,
                "{} {}[{}]: analytic {} vs finite difference {numeric}",
                backend.name(),
                entry.name,
                i - range.start,
                grads[i]
            );
        }
    }
    // Positions past the sequence length get no gradient.
    let wpe = layout.get("transformer.wpe.weight").unwrap().range();
    assert!(
        grads[wpe.start + len * spec.width..wpe.end]
            .iter()
            .all(|&g| g == 0.0)
    );
}

#[test]
fn gpt_gradients_match_finite_differences() {
    common::on_every_device!(gpt_gradient);
}
