//! `nodectl bench train`: samples per second of the real training step.

use std::time::Duration;

use anyhow::{Result, bail};
use murmur_trainer::Backend;
use murmur_trainer::bench::{self, BenchPlan};
use murmur_trainer::model::ModelSpec;
use serde_json::json;

use crate::cli::{BenchModel, BenchTrainArgs};
use crate::device::{on_backend, select_backend};
use crate::report::{peak_rss_mb, round};

pub(super) fn run(args: BenchTrainArgs) -> Result<()> {
    if args.batch == 0
        || args.trials == 0
        || !(args.trial_secs.is_finite() && args.trial_secs > 0.0)
    {
        bail!("--batch, --trials and --trial-secs must be positive");
    }
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from));
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    let backend = select_backend(args.device, threads)?;
    on_backend!(backend, backend => bench_on(&args, threads, backend))
}

/// Times training steps and the sgemm peak on `backend`.
fn bench_on<B: Backend>(args: &BenchTrainArgs, threads: usize, backend: B) -> Result<()> {
    let device = backend.name();
    // The GPT is nanoGPT's configuration for a CPU (its `shakespeare_char` on a laptop).
    let (name, model) = match args.model {
        BenchModel::Mlp => ("mlp", ModelSpec::mlp()),
        BenchModel::Cnn => ("cnn", ModelSpec::cnn()),
        BenchModel::Gpt => ("gpt", ModelSpec::gpt()),
    };
    // A GPT's samples are windows; its figure that compares is tokens.
    let context = model.expand()?.context();
    let plan = BenchPlan {
        warmup_steps: args.warmup,
        trials: args.trials,
        trial_time: Duration::from_secs_f64(args.trial_secs),
    };
    let peak = if args.peak_size > 0 {
        eprintln!("measuring sgemm peak ({0}x{0}x{0})", args.peak_size);
        Some(bench::sgemm_peak_gflops(&backend, args.peak_size, 5)?)
    } else {
        None
    };
    eprintln!(
        "timing {name} training steps at batch {} on {device} ({threads} CPU threads): {} trials \
         of {}s",
        args.batch, args.trials, args.trial_secs
    );
    let step = bench::train_step(backend, model, args.batch, plan)?;
    let tokens_per_sec = context.map(|tokens| step.samples_per_sec * tokens as f64);
    let fraction = peak.map(|p| step.gflops / p);
    if args.json {
        println!(
            "{}",
            json!({
                "bench": "train",
                "model": name,
                "batch": step.batch,
                "device": device,
                "threads": threads,
                "params": step.params,
                "samples_per_sec": round(step.samples_per_sec, 1),
                "tokens_per_sec": tokens_per_sec.map(|t| round(t, 1)),
                "samples_per_sec_trials": step.samples_per_sec_trials.iter().map(|v| round(*v, 1)).collect::<Vec<_>>(),
                "step_ms": round(step.step_ms, 4),
                "flops_per_step": step.flops_per_step,
                "gflops": round(step.gflops, 2),
                "sgemm_peak_gflops": peak.map(|p| round(p, 2)),
                "fraction_of_sgemm_peak": fraction.map(|f| round(f, 3)),
                "peak_rss_mb": peak_rss_mb().map(|m| round(m, 1)),
            })
        );
    } else {
        println!(
            "{name} batch {} on {device}: {:.0} samples/s ({:.3} ms/step, {:.1} GFLOP/s)",
            step.batch, step.samples_per_sec, step.step_ms, step.gflops
        );
        if let Some(tokens) = tokens_per_sec {
            println!("{tokens:.0} tokens/s");
        }
        if let (Some(p), Some(f)) = (peak, fraction) {
            println!(
                "sgemm peak {p:.1} GFLOP/s: the step reaches {:.0}% of it",
                f * 100.0
            );
        }
    }
    Ok(())
}
