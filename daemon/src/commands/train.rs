//! `nodectl train`: one replica, from a run config to a trained, checkpointed model.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use murmur_trainer::checkpoint::{self, CheckpointError};
use murmur_trainer::train::Evaluation;
use murmur_trainer::{Backend, Trainer};
use serde::Serialize;
use tracing::{info, warn};

use crate::cli::TrainArgs;
use crate::config::RunConfig;
use crate::device::{on_backend, select_backend};
use crate::report::{peak_rss_mb, round};

/// One row of the per-epoch history.
#[derive(Debug, Serialize)]
struct EpochRecord {
    epoch: u64,
    train_loss: f64,
    test_accuracy: f64,
    test_loss: f64,
    samples_per_sec: f64,
    /// Seconds since the command started.
    wall_s: f64,
}

/// The final `--json` object.
#[derive(Debug, Serialize)]
struct TrainReport {
    name: String,
    model: String,
    params: usize,
    device: String,
    threads: usize,
    test_accuracy: f64,
    test_loss: f64,
    epochs: u64,
    steps: u64,
    /// Samples trained on by this invocation (0 when it only resumed a finished run).
    samples: u64,
    /// Training throughput of this invocation, evaluation excluded.
    samples_per_sec: f64,
    train_s: f64,
    wall_s: f64,
    resumed_from_step: Option<u64>,
    checkpoint: Option<PathBuf>,
    config_hash: String,
    peak_rss_mb: Option<f64>,
    history: Vec<EpochRecord>,
}

fn load_config(args: &TrainArgs) -> Result<RunConfig> {
    let mut config = RunConfig::load(&args.config)?;
    config.apply_overrides(args.data.as_deref(), args.shard.as_deref(), args.threads)?;
    if let Some(epochs) = args.epochs {
        if epochs == 0 {
            bail!("--epochs must be at least 1");
        }
        config.training.epochs = epochs;
    }
    if let Some(seed) = args.seed {
        config.run.seed = seed;
    }
    if let Some(dir) = &args.checkpoint_dir {
        config.checkpoint.dir = Some(dir.clone());
    }
    Ok(config)
}

pub(super) fn run(args: TrainArgs) -> Result<()> {
    let started = Instant::now();
    let config = load_config(&args)?;
    let backend = select_backend(config.training.device, config.threads())?;
    on_backend!(backend, backend => train(&args, &config, backend, started))
}

/// Trains on `backend`.
fn train<B: Backend>(
    args: &TrainArgs,
    config: &RunConfig,
    backend: B,
    started: Instant,
) -> Result<()> {
    let threads = config.threads();

    let train_dir = config.data.shard.as_ref().unwrap_or(&config.data.dir);
    let (train, test) = super::samples::load(config)?;
    info!(
        train = train.len(),
        test = test.len(),
        dir = %train_dir.display(),
        "data loaded"
    );

    let spec = config.train_spec_for(train_dir)?;
    let config_hash = spec.config_hash();
    let mut trainer = Trainer::new(backend, spec, &train)?;
    let checkpoint_dir = config.checkpoint_dir();
    let resumed_from_step =
        prepare_checkpoints(&mut trainer, &checkpoint_dir, &config_hash, args.fresh)?;

    let (params, layout) = (trainer.param_count(), trainer.layout().clone());
    info!(
        run = config.name(),
        model = ?trainer.spec().model.kind,
        params,
        device = %trainer.backend().name(),
        threads,
        epochs = config.training.epochs,
        epoch_samples = trainer.epoch_samples(),
        batch = config.training.batch_size,
        "training"
    );

    let show_bar = std::io::stderr().is_terminal();
    let mut history = Vec::new();
    let mut train_time = Duration::ZERO;
    let mut samples = 0u64;
    let mut last_checkpoint = checkpoint::latest(&checkpoint_dir)?;
    while !trainer.is_finished() {
        let epoch = trainer.epochs_done() + 1;
        let bar = epoch_bar(show_bar, &trainer, epoch);
        let epoch_start = Instant::now();
        let (mut loss_sum, mut steps, mut epoch_samples) = (0.0f64, 0u64, 0u64);
        loop {
            let outcome = trainer.train_step(&train)?;
            loss_sum += f64::from(outcome.loss);
            steps += 1;
            epoch_samples += outcome.samples as u64;
            if steps % 16 == 0 {
                bar.set_position(steps);
                bar.set_message(format!("loss {:.4}", loss_sum / steps as f64));
            }
            if outcome.step % trainer.steps_per_epoch() == 0 {
                break;
            }
        }
        let epoch_time = epoch_start.elapsed();
        train_time += epoch_time;
        samples += epoch_samples;
        bar.finish_and_clear();

        let eval = trainer.evaluate(&test)?;
        let record = EpochRecord {
            epoch,
            train_loss: round(loss_sum / steps as f64, 5),
            test_accuracy: round(eval.accuracy, 5),
            test_loss: round(eval.loss, 5),
            samples_per_sec: round(epoch_samples as f64 / epoch_time.as_secs_f64(), 1),
            wall_s: round(started.elapsed().as_secs_f64(), 3),
        };
        info!(
            epoch,
            epochs = config.training.epochs,
            train_loss = record.train_loss,
            test_accuracy = record.test_accuracy,
            test_loss = record.test_loss,
            samples_per_sec = record.samples_per_sec,
            "epoch done"
        );
        history.push(record);

        let every = config.checkpoint.every_epochs;
        if trainer.is_finished() || (every > 0 && epoch % every == 0) {
            let saved = checkpoint::save(
                &checkpoint_dir,
                &trainer.checkpoint(&config_hash)?,
                &layout,
                config.checkpoint.keep,
            )?;
            info!(path = %saved.display(), step = trainer.step_count(), "checkpoint saved");
            last_checkpoint = Some(saved);
        }
    }

    let final_eval = match history.last() {
        Some(last) => Evaluation {
            accuracy: last.test_accuracy,
            loss: last.test_loss,
            samples: test.len(),
        },
        None => {
            info!("the run was already complete; evaluating its checkpoint");
            trainer.evaluate(&test)?
        }
    };
    let report = TrainReport {
        name: config.name().to_owned(),
        model: format!("{:?}", trainer.spec().model.kind).to_lowercase(),
        params,
        device: trainer.backend().name(),
        threads,
        test_accuracy: round(final_eval.accuracy, 5),
        test_loss: round(final_eval.loss, 5),
        epochs: trainer.epochs_done(),
        steps: trainer.step_count(),
        samples,
        samples_per_sec: if train_time.is_zero() {
            0.0
        } else {
            round(samples as f64 / train_time.as_secs_f64(), 1)
        },
        train_s: round(train_time.as_secs_f64(), 3),
        wall_s: round(started.elapsed().as_secs_f64(), 3),
        resumed_from_step,
        checkpoint: last_checkpoint,
        config_hash,
        peak_rss_mb: peak_rss_mb().map(|m| round(m, 1)),
        history,
    };
    print_report(&report, args.json)
}

/// Resumes from the newest usable checkpoint unless `fresh`; with `fresh`, deletes old
/// checkpoints so that they cannot be mistaken for this run's. Returns the step resumed from.
///
/// A checkpoint that cannot be read (cut short by a crash, damaged on disk) or that holds
/// values that are not finite is skipped with a warning, and left where it is, for the next
/// older one (decision 0037); if none is usable, the error says so and names `--fresh`.
pub(super) fn prepare_checkpoints<B: Backend>(
    trainer: &mut Trainer<B>,
    dir: &std::path::Path,
    config_hash: &str,
    fresh: bool,
) -> Result<Option<u64>> {
    if fresh {
        for (_, path) in checkpoint::list(dir)? {
            std::fs::remove_file(&path)
                .with_context(|| format!("removing old checkpoint `{}`", path.display()))?;
        }
        return Ok(None);
    }
    let found = checkpoint::list(dir)?;
    let mut usable = None;
    for (_, path) in found.iter().rev() {
        match checkpoint::load(path, trainer.layout(), trainer.fingerprint()) {
            Ok(saved) if saved.is_finite() => {
                usable = Some((path, saved));
                break;
            }
            Ok(_) => warn!(
                path = %path.display(),
                "skipping a checkpoint that holds values that are not finite; trying an older one"
            ),
            Err(e @ (CheckpointError::Format { .. } | CheckpointError::Io { .. })) => {
                warn!(error = %e, "skipping a checkpoint that cannot be read; trying an older one");
            }
            Err(e) => return Err(e.into()),
        }
    }
    let Some((path, saved)) = usable else {
        if found.is_empty() {
            return Ok(None);
        }
        bail!(
            "none of the {} checkpoints in `{}` can be resumed from (see the warnings above): \
             move them elsewhere to start over (`nodectl train --fresh` deletes them)",
            found.len(),
            dir.display()
        );
    };
    if saved.config_hash != config_hash {
        bail!(
            "checkpoint `{}` was written by a different config (hash {}, this config {}): \
             pass `--fresh` to start over, or `--checkpoint-dir` to keep both",
            path.display(),
            saved.config_hash,
            config_hash
        );
    }
    trainer.restore(&saved)?;
    info!(path = %path.display(), step = saved.step, "resumed from checkpoint");
    Ok(Some(saved.step))
}

fn epoch_bar<B: Backend>(show: bool, trainer: &Trainer<B>, epoch: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let per_epoch = trainer.steps_per_epoch();
    let bar = ProgressBar::new(per_epoch);
    bar.set_style(
        ProgressStyle::with_template(
            "epoch {prefix} [{bar:30}] {pos}/{len} steps {msg} ({per_sec}, eta {eta})",
        )
        .expect("invariant: the progress template is valid")
        .progress_chars("=> "),
    );
    bar.set_prefix(format!("{epoch}/{}", trainer.spec().epochs));
    bar.set_position(trainer.step_count() % per_epoch);
    bar
}

fn print_report(report: &TrainReport, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
        return Ok(());
    }
    println!(
        "{}: {} epochs, {} steps, test accuracy {:.2}% (loss {:.4})",
        report.name,
        report.epochs,
        report.steps,
        report.test_accuracy * 100.0,
        report.test_loss
    );
    if report.samples > 0 {
        println!(
            "trained {} samples at {:.0} samples/s on {} ({} threads); wall {:.1}s",
            report.samples, report.samples_per_sec, report.device, report.threads, report.wall_s
        );
    }
    if let Some(path) = &report.checkpoint {
        println!("checkpoint: {}", path.display());
    }
    Ok(())
}
