//! Benchmarks of the real training path, for `nodectl bench`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::backend::{Backend, Gemm, whole, whole_mut};
use crate::data::text::{Corpus, Document, Windows};
use crate::data::{Dataset, Samples, TextSamples};
use crate::model::{Model, ModelSpec};
use crate::optim::OptimizerSpec;
use crate::train::{TrainError, TrainSpec, Trainer};

/// How long and how often to measure.
#[derive(Clone, Copy, Debug)]
pub struct BenchPlan {
    pub warmup_steps: u32,
    pub trials: u32,
    pub trial_time: Duration,
}

/// Throughput of the training step (forward, backward, optimizer) on one fixed batch.
#[derive(Clone, Debug, Serialize)]
pub struct StepBenchmark {
    pub batch: usize,
    pub params: usize,
    /// Median over trials.
    pub samples_per_sec: f64,
    pub samples_per_sec_trials: Vec<f64>,
    pub step_ms: f64,
    /// GEMM flops of one step.
    pub flops_per_step: u64,
    /// `flops_per_step` over the median step time.
    pub gflops: f64,
}

/// Times training steps of `model` on one fixed synthetic batch of `batch` samples, as
/// PyTorch's reference micro-benchmarks do, so the two compare directly: SGD with momentum
/// 0.9 for the image models; AdamW for a GPT, whose samples are windows of its full context
/// (tokens are `context` times as many).
pub fn train_step<B: Backend>(
    backend: B,
    model: ModelSpec,
    batch: usize,
    plan: BenchPlan,
) -> Result<StepBenchmark, TrainError> {
    // One batch of data, visited every step: steps_per_epoch is 1.
    let (data, optimizer) = match model.expand()? {
        Model::Gpt(spec) => (
            synthetic_text(spec.context + 1, spec.vocab, batch),
            OptimizerSpec::adamw(1e-3),
        ),
        Model::Layers(_) => (
            Samples::Images(Dataset::synthetic(batch, 1)),
            OptimizerSpec::sgd(0.01, 0.9),
        ),
    };
    let spec = TrainSpec {
        model,
        optimizer,
        batch_size: batch,
        epochs: u64::MAX / 2,
        epoch_samples: None,
        seed: 0,
    };
    let mut trainer = Trainer::new(backend, spec, &data)?;
    for _ in 0..plan.warmup_steps {
        trainer.train_step(&data)?;
    }
    trainer.backend().synchronize()?;
    let mut rates = Vec::with_capacity(plan.trials as usize);
    for _ in 0..plan.trials.max(1) {
        let start = Instant::now();
        let mut steps = 0u64;
        while start.elapsed() < plan.trial_time {
            // Steps in tens, so that a fast device is not timed on its synchronisation.
            for _ in 0..10 {
                trainer.train_step(&data)?;
            }
            trainer.backend().synchronize()?;
            steps += 10;
        }
        rates.push((steps * batch as u64) as f64 / start.elapsed().as_secs_f64());
    }
    let samples_per_sec = median(&rates);
    let flops_per_step = trainer.step_flops();
    let step_secs = batch as f64 / samples_per_sec;
    Ok(StepBenchmark {
        batch,
        params: trainer.param_count(),
        samples_per_sec,
        samples_per_sec_trials: rates,
        step_ms: step_secs * 1e3,
        flops_per_step,
        gflops: flops_per_step as f64 / step_secs / 1e9,
    })
}

/// `count` windows of `window` tokens, back to back in one made-up document.
fn synthetic_text(window: usize, vocab: usize, count: usize) -> Samples {
    let tokens: Vec<u8> = (0..count * window)
        .map(|i| ((i * 7_919) % vocab) as u8)
        .collect();
    let corpus = Corpus::from_documents(vec![Document {
        name: "synthetic".to_owned(),
        tokens,
    }]);
    let windows = Windows::new(corpus.train_ranges(0.0), window, window);
    Samples::Text(TextSamples::new(Arc::new(corpus), windows))
}

/// Sustained GFLOP/s of a large square GEMM: the practical peak of the machine's sgemm.
pub fn sgemm_peak_gflops<B: Backend>(
    backend: &B,
    size: usize,
    trials: u32,
) -> Result<f64, TrainError> {
    let a = backend.zeros(size * size)?;
    let mut b = backend.zeros(size * size)?;
    backend.fill(whole_mut::<B>(&mut b), 0.5)?;
    let mut c = backend.zeros(size * size)?;
    let gemm = Gemm::new(size, size, size);
    backend.gemm(gemm, whole::<B>(&a), whole::<B>(&b), whole_mut::<B>(&mut c))?;
    backend.synchronize()?;
    // Enough GEMMs per trial (about 20 GFLOP) that a fast device is not timed on its launch
    // overhead alone.
    let reps = (20e9 / gemm.flops().max(1) as f64).ceil().max(1.0) as u32;
    let mut rates = Vec::new();
    for _ in 0..trials.max(1) {
        let start = Instant::now();
        for _ in 0..reps {
            backend.gemm(gemm, whole::<B>(&a), whole::<B>(&b), whole_mut::<B>(&mut c))?;
        }
        backend.synchronize()?;
        let secs = start.elapsed().as_secs_f64();
        rates.push(gemm.flops() as f64 * f64::from(reps) / secs / 1e9);
    }
    Ok(median(&rates))
}

/// Median of a non-empty slice (0 for an empty one).
pub fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}
