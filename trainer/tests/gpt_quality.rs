//! The GPT on the whole Shakespeare corpus with nanoGPT's CPU recipe: one node must reach a
//! held-out loss of 1.9 or lower within 2,000 steps of 12 sequences of 64 tokens.
//!
//! It needs the corpus (`data/fetch-shakespeare.sh`; another place through
//! `MURMUR_SHAKESPEARE=DIR`) and some minutes, so it is not part of the suite:
//!
//! ```sh
//! cargo test --release -p murmur-trainer --test gpt_quality -- --ignored --nocapture
//! ```

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::path::PathBuf;
use std::time::Instant;

use std::sync::Arc;

use murmur_trainer::data::text::{self, Corpus, DEFAULT_VALIDATION_SHARE, Windows};
use murmur_trainer::data::{Samples, TextSamples};
use murmur_trainer::optim::ScheduleKind;
use murmur_trainer::{CpuBackend, ModelSpec, OptimizerSpec, TrainSpec, Trainer};

fn corpus_dir() -> PathBuf {
    std::env::var_os("MURMUR_SHAKESPEARE").map_or_else(text::default_corpus_dir, PathBuf::from)
}

#[test]
#[ignore = "needs the Shakespeare corpus (data/fetch-shakespeare.sh) and a minute or more: run by hand with --release --ignored, as docs/language-model.md says"]
fn one_node_reaches_a_held_out_loss_of_1_9_with_nanogpts_cpu_recipe() {
    let dir = corpus_dir();
    let corpus = Arc::new(Corpus::load(&dir).unwrap_or_else(|e| panic!("{e}")));
    // nanoGPT's CPU configuration: 4 layers, 4 heads, width 128, context 64.
    let model = ModelSpec::gpt();
    let window = 65;
    let steps = 2_000;
    // nanoGPT's `train_shakespeare_char` on a CPU: AdamW at 1e-3 with betas (0.9, 0.99) and
    // weight decay 0.1, 100 warm-up steps, cosine to 1e-4, gradients clipped at 1.0.
    let optimizer = OptimizerSpec {
        betas: Some([0.9, 0.99]),
        weight_decay: Some(0.1),
        schedule: ScheduleKind::WarmupCosine,
        warmup_steps: 100,
        min_lr: 1e-4,
        grad_clip: Some(1.0),
        ..OptimizerSpec::adamw(1e-3)
    };
    // Eight epochs of 250 steps of 12 windows; the held-out loss is taken after each.
    let spec = TrainSpec {
        model,
        optimizer,
        batch_size: 12,
        epochs: 8,
        epoch_samples: Some(12 * 250),
        seed: 1337,
    };
    let train = Samples::Text(TextSamples::new(
        corpus.clone(),
        Windows::every_token(corpus.train_ranges(DEFAULT_VALIDATION_SHARE), window),
    ));
    let held_out = Samples::Text(TextSamples::of_windows(
        corpus.clone(),
        Windows::held_out(
            corpus.validation_ranges(DEFAULT_VALIDATION_SHARE),
            window,
            512,
        ),
        window,
    ));
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let backend = CpuBackend::with_threads(threads).unwrap();
    let mut trainer = Trainer::new(backend, spec, &train).unwrap();
    let start = Instant::now();
    let mut last = f64::NAN;
    while !trainer.is_finished() {
        let outcome = trainer.train_step(&train).unwrap();
        if outcome.step.is_multiple_of(250) {
            last = trainer.evaluate(&held_out).unwrap().loss;
            eprintln!(
                "step {:>5}: train loss {:.4}, held-out loss {last:.4} ({:.0} s)",
                outcome.step,
                outcome.loss,
                start.elapsed().as_secs_f64()
            );
        }
    }
    println!(
        "{{\"steps\": {steps}, \"held_out_loss\": {last:.4}, \"seconds\": {:.1}, \"threads\": {threads}}}",
        start.elapsed().as_secs_f64()
    );
    assert!(last <= 1.9, "held-out loss {last} after {steps} steps");
}
