//! End-to-end check of the loss and every parameter gradient against PyTorch 2.15 (CPU), on
//! every device here: the MLP and the CNN against the summaries below, and the GPT against
//! every gradient PyTorch wrote for it (`bench/torch_gpt.py fixture`) and against its loss at
//! each of 100 training steps (`bench/torch_gpt.py curve`).
//!
//! The expected values were produced by this snippet (parameters and inputs are exact in f32):
//!
//! ```python
//! import torch, torch.nn as nn
//! def make(kind):
//!     if kind == "mlp":
//!         return nn.Sequential(nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
//!                              nn.Linear(8, 10))
//!     return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
//!                          nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
//!                          nn.Flatten(), nn.Linear(4*7*7, 6), nn.ReLU(), nn.Linear(6, 10))
//! for kind in ["mlp", "cnn"]:
//!     m = make(kind); i = 0
//!     with torch.no_grad():
//!         for p in m.parameters():
//!             idx = torch.arange(i, i + p.numel())
//!             p.copy_((((idx * 37) % 101) - 50).float().reshape(p.shape) / 256.0)
//!             i += p.numel()
//!     b = torch.arange(4).reshape(4, 1); j = torch.arange(784).reshape(1, 784)
//!     x = ((b * 131 + j * 17) % 256).float() / 256.0
//!     if kind == "cnn": x = x.reshape(4, 1, 28, 28)
//!     loss = nn.functional.cross_entropy(m(x), torch.tensor([3, 7, 0, 9]))
//!     loss.backward()
//!     print(kind, "loss", repr(loss.item()))
//!     for name, p in m.named_parameters():
//!         g = p.grad.flatten()
//!         print(name, g.sum().item(), g.abs().sum().item(), g[0].item(), g[-1].item())
//! ```

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use murmur_trainer::Backend;
use murmur_trainer::model::ModelSpec;
use murmur_trainer::replica::Replica;

/// (tensor, sum of gradient, sum of |gradient|, first element, last element)
type Expected = (&'static str, f64, f64, f64, f64);

const MLP_LOSS: f64 = 2.282853603363037;
const MLP: [Expected; 6] = [
    (
        "fc1.weight",
        6.272573471069336,
        37.61167907714844,
        0.0,
        0.004200298339128494,
    ),
    (
        "fc1.bias",
        0.016064375638961792,
        0.09557222574949265,
        0.0,
        0.008024584501981735,
    ),
    (
        "fc2.weight",
        -0.04903569445014,
        1.1420068740844727,
        0.0,
        -0.01654059626162052,
    ),
    (
        "fc2.bias",
        -0.02225065417587757,
        0.19259536266326904,
        -0.019824441522359848,
        -0.05001748353242874,
    ),
    (
        "fc3.weight",
        3.818422555923462e-08,
        0.9771676063537598,
        0.0031456046272069216,
        0.012583097442984581,
    ),
    (
        "fc3.bias",
        2.9802322387695312e-08,
        1.1708309650421143,
        -0.15169160068035126,
        -0.14413923025131226,
    ),
];

const CNN_LOSS: f64 = 2.386976957321167;
const CNN: [Expected; 8] = [
    (
        "conv1.weight",
        0.005620267707854509,
        0.18750706315040588,
        0.0007662433199584484,
        0.00686848908662796,
    ),
    (
        "conv1.bias",
        -0.012081881985068321,
        0.025002771988511086,
        0.0040884497575461864,
        0.002371994312852621,
    ),
    (
        "conv2.weight",
        0.04272368922829628,
        0.12893345952033997,
        0.003533637849614024,
        0.0007079257629811764,
    ),
    (
        "conv2.bias",
        0.016245007514953613,
        0.019565630704164505,
        -0.000865441164933145,
        0.009309275075793266,
    ),
    (
        "fc1.weight",
        -1.7361938953399658,
        1.749894380569458,
        -0.0007686316384933889,
        -0.0028324585873633623,
    ),
    (
        "fc1.bias",
        -0.0930260494351387,
        0.0930260494351387,
        -0.01562357135117054,
        -0.03873203694820404,
    ),
    (
        "fc2.weight",
        1.6763806343078613e-08,
        0.38395291566848755,
        -0.019903432577848434,
        0.0009870317298918962,
    ),
    (
        "fc2.bias",
        2.9802322387695312e-08,
        1.2612560987472534,
        -0.1700698733329773,
        -0.15239392220973969,
    ),
];

fn close(what: &str, ours: f64, theirs: f64, scale: f64) {
    let tol = 1e-4 * scale.max(theirs.abs()) + 1e-6;
    assert!(
        (ours - theirs).abs() <= tol,
        "{what}: ours {ours}, PyTorch {theirs}"
    );
}

/// Checks `spec`'s loss and gradients on every device here against PyTorch's.
fn check(spec: ModelSpec, expected_loss: f64, expected: &[Expected]) {
    check_on(
        &murmur_trainer::CpuBackend::new(),
        &spec,
        expected_loss,
        expected,
    );
    match common::gpu_here() {
        Ok(()) => check_on(&common::cuda_zero(), &spec, expected_loss, expected),
        Err(reason) => eprintln!("{:?}: cpu only ({reason})", spec.kind),
    }
}

fn check_on<B: Backend>(backend: &B, spec: &ModelSpec, expected_loss: f64, expected: &[Expected]) {
    let device = backend.name();
    let arch = spec.build().unwrap();
    let params: Vec<f32> = (0..arch.param_count() as i64)
        .map(|i| (((i * 37) % 101) - 50) as f32 / 256.0)
        .collect();
    let images: Vec<f32> = (0..4i64)
        .flat_map(|b| (0..784i64).map(move |j| ((b * 131 + j * 17) % 256) as f32 / 256.0))
        .collect();
    let layout = arch.layout().clone();
    let mut net = Replica::new(backend, arch, 4, &params).unwrap();
    let loss = net
        .compute_gradients(backend, &images, &[3, 7, 0, 9])
        .unwrap();
    close(
        &format!("{device} loss"),
        f64::from(loss),
        expected_loss,
        1.0,
    );

    let grads = net.weights().download_grads(backend).unwrap();
    assert_eq!(grads.len(), layout.len());
    assert_eq!(layout.entries().len(), expected.len());
    for (&(name, sum, abs_sum, first, last), entry) in expected.iter().zip(layout.entries()) {
        assert_eq!(entry.name, name);
        let g = &grads[entry.range()];
        let ours_sum: f64 = g.iter().map(|&v| f64::from(v)).sum();
        let ours_abs: f64 = g.iter().map(|&v| f64::from(v).abs()).sum();
        close(&format!("{device} {name} sum"), ours_sum, sum, abs_sum);
        close(
            &format!("{device} {name} |sum|"),
            ours_abs,
            abs_sum,
            abs_sum,
        );
        close(&format!("{name}[0]"), f64::from(g[0]), first, abs_sum);
        close(
            &format!("{name}[-1]"),
            f64::from(g[g.len() - 1]),
            last,
            abs_sum,
        );
    }
}

#[test]
fn mlp_loss_and_gradients_match_pytorch() {
    let spec = ModelSpec {
        hidden: Some(vec![16, 8]),
        ..ModelSpec::mlp()
    };
    check(spec, MLP_LOSS, &MLP);
}

#[test]
fn cnn_loss_and_gradients_match_pytorch() {
    let spec = ModelSpec {
        hidden: Some(vec![6]),
        channels: Some(vec![3, 4]),
        ..ModelSpec::cnn()
    };
    check(spec, CNN_LOSS, &CNN);
}

/// The f32 values of tensor `name` of a safetensors file.
fn tensor_values(file: &safetensors::SafeTensors<'_>, name: &str) -> Vec<f32> {
    let view = file.tensor(name).unwrap();
    assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// One step of a small GPT (2 blocks, 2 heads, width 16, context 8, the byte vocabulary) on 3
/// sequences, from the parameters and batch of `bench/torch_gpt.py fixture`, against the loss
/// and every gradient PyTorch computed for it (`testdata/gpt-parity/torch-step.safetensors`,
/// written by that command with torch 2.15.0).
fn gpt_matches_pytorch<B: Backend>(new: fn() -> B) {
    use murmur_trainer::gpt::{GptPass, GptSpec};

    let backend = &new();
    let spec = GptSpec {
        layers: 2,
        heads: 2,
        width: 16,
        context: 8,
        vocab: 256,
    };
    let layout = spec.layout();
    let params: Vec<f32> = (0..layout.len())
        .map(|i| ((i * 37) % 101) as f32 - 50.0)
        .map(|v| v / 256.0)
        .collect();
    let sequences = 3;
    let batch = |a: usize, b: usize, c: usize| -> Vec<u32> {
        (0..sequences)
            .flat_map(|s| (0..spec.context).map(move |t| ((s * a + t * b + c) % 256) as u32))
            .collect()
    };
    let (tokens, targets) = (batch(131, 17, 0), batch(71, 29, 3));
    let mut pass = GptPass::new(backend, spec, sequences).unwrap();
    let device_params = common::to_device(backend, &params);
    let mut device_grads = backend.zeros(layout.len()).unwrap();
    pass.forward(backend, &device_params, &tokens, spec.context)
        .unwrap();
    let loss = pass
        .backward(backend, &device_params, &mut device_grads, &targets)
        .unwrap();
    let grads = common::to_host(backend, &device_grads);

    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("testdata/gpt-parity/torch-step.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let torch = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let torch_loss = tensor_values(&torch, "loss")[0];
    let device = backend.name();
    assert!(
        (loss - torch_loss).abs() <= 1e-5 * torch_loss.abs(),
        "{device}: loss {loss} vs PyTorch's {torch_loss}"
    );
    // Every gradient within 1e-4 of PyTorch's, relative to the larger of its own size and a
    // hundredth of its tensor's largest: a gradient near zero is a sum of terms that cancel,
    // and its last bits are rounding in either program.
    let mut worst = (0.0f32, String::new());
    for entry in layout.entries() {
        let theirs = tensor_values(&torch, &format!("grad.{}", entry.name));
        let ours = &grads[entry.range()];
        assert_eq!(ours.len(), theirs.len(), "{}", entry.name);
        let largest = theirs.iter().fold(0.0f32, |m, g| m.max(g.abs()));
        for (i, (&a, &b)) in ours.iter().zip(&theirs).enumerate() {
            let relative = (a - b).abs() / b.abs().max(1e-2 * largest).max(f32::MIN_POSITIVE);
            assert!(
                relative <= 1e-4,
                "{device}: {}[{i}]: {a} vs PyTorch's {b} ({relative:.2e} relative)",
                entry.name
            );
            if relative > worst.0 {
                worst = (relative, format!("{}[{i}]", entry.name));
            }
        }
    }
    eprintln!(
        "{device}: loss {loss} vs {torch_loss}; largest gradient difference {:.2e} relative, at {}",
        worst.0, worst.1
    );
}

#[test]
fn gpt_loss_and_every_gradient_match_pytorch() {
    common::on_every_device!(gpt_matches_pytorch);
}

/// 100 training steps of a small GPT (2 blocks, 2 heads, width 32, context 16; 4 sequences a
/// step) on the sample text, from the parameters and batches of `bench/torch_gpt.py curve`,
/// with its AdamW, matrices-only decay, warm-up and cosine, and clipping: every step's loss
/// within 1e-3 of PyTorch's (`testdata/gpt-parity/torch-curve.json`, torch 2.15.0).
fn gpt_curve_matches_pytorch<B: Backend>(new: fn() -> B) {
    use murmur_trainer::data::text::{Corpus, Windows};
    use murmur_trainer::data::{Samples, TextSamples};
    use murmur_trainer::optim::ScheduleKind;
    use murmur_trainer::{ModelSpec, OptimizerSpec, TrainSpec, Trainer};

    let model = ModelSpec {
        layers: Some(2),
        heads: Some(2),
        width: Some(32),
        context: Some(16),
        ..ModelSpec::gpt()
    };
    let (sequences, steps) = (4, 100);
    let layout = model.expand().unwrap().layout();
    let mut params = vec![0.0f32; layout.len()];
    for entry in layout.entries() {
        let gain = entry.name.contains(".ln_") && entry.name.ends_with(".weight");
        for i in entry.range() {
            params[i] = if gain {
                1.0
            } else {
                (((i * 37) % 101) as f32 - 50.0) / 2560.0
            };
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let corpus = Corpus::load(&root.join("testdata/shakespeare")).unwrap();
    let windows = Windows::every_token(corpus.train_ranges(0.1), 17);
    let spec = TrainSpec {
        model,
        optimizer: OptimizerSpec {
            betas: Some([0.9, 0.99]),
            weight_decay: Some(0.1),
            schedule: ScheduleKind::WarmupCosine,
            warmup_steps: 10,
            min_lr: 3e-4,
            grad_clip: Some(1.0),
            ..OptimizerSpec::adamw(3e-3)
        },
        batch_size: sequences,
        // One epoch per step, so that the schedule spans the 100 steps.
        epochs: steps,
        epoch_samples: Some(sequences),
        seed: 0,
    };
    let count = windows.count();
    let picks: Vec<Vec<u32>> = (0..steps as usize)
        .map(|step| {
            (0..sequences)
                .map(|j| ((step * sequences + j) * 7919 % count) as u32)
                .collect()
        })
        .collect();
    let data = Samples::Text(TextSamples::new(std::sync::Arc::new(corpus), windows));
    let backend = new();
    let device = backend.name();
    let mut trainer = Trainer::new(backend, spec, &data).unwrap();
    trainer.set_params(&params).unwrap();

    let text = std::fs::read_to_string(root.join("testdata/gpt-parity/torch-curve.json")).unwrap();
    let torch: serde_json::Value = serde_json::from_str(&text).unwrap();
    let theirs: Vec<f64> = torch["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(theirs.len(), steps as usize);
    let mut worst = (0.0f64, 0);
    for (step, batch) in picks.iter().enumerate() {
        let pending = trainer.compute_gradients_on(&data, batch).unwrap();
        let ours = f64::from(trainer.apply_gradients(pending, None).unwrap().loss);
        let relative = (ours - theirs[step]).abs() / theirs[step];
        assert!(
            relative <= 1e-3,
            "{device}: step {step}: loss {ours} vs PyTorch's {} ({relative:.2e} relative)",
            theirs[step]
        );
        if relative > worst.0 {
            worst = (relative, step);
        }
    }
    eprintln!(
        "{device}: PyTorch's loss {:.6} -> {:.6}; largest difference {:.2e} relative, at step {}",
        theirs[0],
        theirs[steps as usize - 1],
        worst.0,
        worst.1
    );
}

#[test]
fn gpt_loss_curve_matches_pytorch_over_100_steps() {
    common::on_every_device!(gpt_curve_matches_pytorch);
}
