//! The training loop end to end on synthetic data, on every device here: it learns, it is
//! deterministic, and a run resumed from a checkpoint is bit-identical to one that never stopped.
//! On a GPU machine the CUDA loss curve must also follow the CPU's.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use murmur_trainer::checkpoint;
use murmur_trainer::data::Samples;
use murmur_trainer::model::ModelSpec;
use murmur_trainer::optim::ScheduleKind;
use murmur_trainer::{Backend, CpuBackend, Dataset, OptimizerSpec, TrainSpec, Trainer};

fn spec(model: ModelSpec, optimizer: OptimizerSpec) -> TrainSpec {
    TrainSpec {
        model,
        optimizer,
        batch_size: 32,
        epochs: 3,
        seed: 11,
        epoch_samples: None,
    }
}

/// Synthetic images as training samples.
fn images(len: usize, seed: u64) -> Samples {
    Samples::Images(Dataset::synthetic(len, seed))
}

fn small_cnn() -> ModelSpec {
    ModelSpec {
        hidden: Some(vec![16]),
        channels: Some(vec![4, 8]),
        ..ModelSpec::cnn()
    }
}

fn train_steps<B: Backend>(trainer: &mut Trainer<B>, data: &Samples, steps: u64) {
    for _ in 0..steps {
        trainer.train_step(data).unwrap();
    }
}

#[test]
fn mlp_and_cnn_learn_the_synthetic_task() {
    common::on_every_device!(mlp_and_cnn_learn);
}

fn mlp_and_cnn_learn<B: Backend>(new: fn() -> B) {
    let (train, test) = (images(600, 1), images(200, 2));
    // Random-noise class patterns have no spatial structure, so the CNN needs more epochs.
    for (model, epochs) in [(ModelSpec::mlp(), 3), (small_cnn(), 10)] {
        let mut s = spec(model.clone(), OptimizerSpec::sgd(0.05, 0.9));
        s.epochs = epochs;
        let mut trainer = Trainer::new(new(), s, &train).unwrap();
        let before = trainer.evaluate(&test).unwrap();
        while !trainer.is_finished() {
            trainer.train_step(&train).unwrap();
        }
        let after = trainer.evaluate(&test).unwrap();
        assert_eq!(trainer.epochs_done(), epochs);
        let device = trainer.backend().name();
        assert!(
            before.accuracy < 0.3,
            "{device} {model:?} starts at {before:?}"
        );
        assert!(after.accuracy > 0.9, "{device} {model:?} ends at {after:?}");
        assert!(after.loss < before.loss);
    }
}

#[test]
fn adamw_with_warmup_cosine_learns_too() {
    common::on_every_device!(adamw_with_warmup_cosine_learns);
}

fn adamw_with_warmup_cosine_learns<B: Backend>(new: fn() -> B) {
    let (train, test) = (images(600, 1), images(200, 2));
    let optimizer = OptimizerSpec {
        schedule: ScheduleKind::WarmupCosine,
        warmup_steps: 10,
        ..OptimizerSpec::adamw(2e-3)
    };
    let mut trainer = Trainer::new(new(), spec(ModelSpec::mlp(), optimizer), &train).unwrap();
    while !trainer.is_finished() {
        trainer.train_step(&train).unwrap();
    }
    assert!(trainer.evaluate(&test).unwrap().accuracy > 0.9);
}

#[test]
fn same_seed_gives_bitwise_identical_parameters() {
    common::on_every_device!(same_seed_gives_identical_parameters);
}

fn same_seed_gives_identical_parameters<B: Backend>(new: fn() -> B) {
    let train = images(300, 1);
    let run = |seed| {
        let mut s = spec(small_cnn(), OptimizerSpec::sgd(0.05, 0.9));
        s.seed = seed;
        let mut trainer = Trainer::new(new(), s, &train).unwrap();
        train_steps(&mut trainer, &train, 25);
        trainer.params().unwrap()
    };
    let a = run(5);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&run(5)));
    assert_ne!(bits(&a), bits(&run(6)));
}

#[test]
fn thread_count_does_not_change_the_result() {
    let train = images(300, 1);
    let run = |backend: CpuBackend, model: ModelSpec| {
        let mut trainer =
            Trainer::new(backend, spec(model, OptimizerSpec::sgd(0.05, 0.9)), &train).unwrap();
        train_steps(&mut trainer, &train, 15);
        trainer
            .params()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect::<Vec<_>>()
    };
    for model in [ModelSpec::mlp(), small_cnn()] {
        let single = run(CpuBackend::new(), model.clone());
        assert_eq!(
            single,
            run(CpuBackend::with_threads(2).unwrap(), model.clone())
        );
        assert_eq!(single, run(CpuBackend::with_threads(3).unwrap(), model));
    }
}

#[test]
fn resuming_from_a_checkpoint_file_is_bit_exact() {
    common::on_every_device!(resuming_is_bit_exact);
}

fn resuming_is_bit_exact<B: Backend>(new: fn() -> B) {
    let train = images(300, 1);
    for optimizer in [OptimizerSpec::sgd(0.05, 0.9), OptimizerSpec::adamw(1e-3)] {
        let s = spec(ModelSpec::mlp(), optimizer);
        // 10 steps per epoch: stop mid-epoch at step 13, resume, go to 25.
        let mut straight = Trainer::new(new(), s.clone(), &train).unwrap();
        train_steps(&mut straight, &train, 25);

        let mut first = Trainer::new(new(), s.clone(), &train).unwrap();
        train_steps(&mut first, &train, 13);
        let dir = tempfile::tempdir().unwrap();
        let layout = first.layout().clone();
        let fingerprint = first.fingerprint().to_owned();
        let path =
            checkpoint::save(dir.path(), &first.checkpoint("h").unwrap(), &layout, 2).unwrap();
        drop(first);

        let mut resumed = Trainer::new(new(), s, &train).unwrap();
        resumed
            .restore(&checkpoint::load(&path, &layout, &fingerprint).unwrap())
            .unwrap();
        assert_eq!(resumed.step_count(), 13);
        train_steps(&mut resumed, &train, 12);
        let bits = |t: &Trainer<B>| {
            t.params()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&straight), bits(&resumed));
    }
}

#[test]
fn restoring_another_optimizers_state_is_refused() {
    let train = images(64, 1);
    let sgd = Trainer::new(
        CpuBackend::new(),
        spec(ModelSpec::mlp(), OptimizerSpec::sgd(0.05, 0.9)),
        &train,
    )
    .unwrap();
    let mut adam = Trainer::new(
        CpuBackend::new(),
        spec(ModelSpec::mlp(), OptimizerSpec::adamw(1e-3)),
        &train,
    )
    .unwrap();
    let err = adam.restore(&sgd.checkpoint("h").unwrap()).unwrap_err();
    assert!(err.to_string().contains("optimizer"), "{err}");
}

#[test]
fn a_diverging_run_stops_with_advice() {
    common::on_every_device!(a_diverging_run_stops);
}

fn a_diverging_run_stops<B: Backend>(new: fn() -> B) {
    let train = images(256, 1);
    let mut trainer = Trainer::new(
        new(),
        spec(ModelSpec::mlp(), OptimizerSpec::sgd(1e6, 0.9)),
        &train,
    )
    .unwrap();
    let err = (0..50)
        .find_map(|_| trainer.train_step(&train).err())
        .expect("a learning rate of 1e6 must diverge");
    assert!(err.to_string().contains("lower optimizer.lr"), "{err}");
}

/// The bar for the GPU: the same loss curve as the CPU, within 1e-3 relative, for 100 steps of
/// the MLP and the CNN (default sizes, batch 256). Runs where a GPU answers.
///
/// The curves must be compared where training is well conditioned. At lr 0.05 the CNN passes
/// through a phase (steps 40-60 here) that amplifies rounding: flipping the last bit of one
/// initial parameter in 97 moves the CPU's own curve by 1e-3 at step 44 and by 90 % later, so
/// no correct device could follow it. The CNN therefore trains at lr 0.01 (its loss falls from
/// 2.30 to 2.05), and a control run on the CPU with that one-bit nudge must stay within 1e-4,
/// so the comparison cannot drift back into a regime where only bit-identical arithmetic passes.
#[test]
fn cuda_and_cpu_give_the_same_loss_curve() {
    if let Err(reason) = common::gpu_here() {
        eprintln!("no GPU to compare with the CPU: {reason}");
        return;
    }
    let train = images(2560, 5);
    for (model, lr) in [(ModelSpec::mlp(), 0.05), (ModelSpec::cnn(), 0.01)] {
        let mut s = spec(model.clone(), OptimizerSpec::sgd(lr, 0.9));
        s.batch_size = 256;
        s.epochs = 10;
        let cpu = loss_curve(
            Trainer::new(CpuBackend::new(), s.clone(), &train).unwrap(),
            &train,
        );
        let mut nudged = Trainer::new(CpuBackend::new(), s.clone(), &train).unwrap();
        let mut params = nudged.params().unwrap();
        for p in params.iter_mut().step_by(97) {
            *p = f32::from_bits(p.to_bits() ^ 1);
        }
        nudged.set_params(&params).unwrap();
        let control = loss_curve(nudged, &train);
        let cuda = loss_curve(
            Trainer::new(common::cuda_zero(), s, &train).unwrap(),
            &train,
        );

        let worst = |other: &[f32]| {
            let rel = |(a, b): (&f32, &f32)| (a - b).abs() / a.abs().max(b.abs());
            cpu.iter()
                .zip(other)
                .map(rel)
                .enumerate()
                .fold((0, 0.0), |w, (step, r)| if r > w.1 { (step, r) } else { w })
        };
        let (control_step, control_worst) = worst(&control);
        let (cuda_step, cuda_worst) = worst(&cuda);
        eprintln!(
            "{:?} lr {lr}: loss {} -> {}; cuda within {cuda_worst:.2e} (step {cuda_step}), \
             one-bit control within {control_worst:.2e} (step {control_step})",
            model.kind, cpu[0], cpu[99]
        );
        assert!(
            control_worst <= 1e-4,
            "{:?}: a one-bit nudge moves the CPU's curve by {control_worst:.2e} at step \
             {control_step}; the comparison is ill-conditioned, lower the learning rate",
            model.kind
        );
        assert!(
            cuda_worst <= 1e-3,
            "{:?} step {cuda_step}: cpu loss {}, cuda loss {}",
            model.kind,
            cpu[cuda_step],
            cuda[cuda_step]
        );
    }
}

fn loss_curve<B: Backend>(mut trainer: Trainer<B>, data: &Samples) -> Vec<f32> {
    (0..100)
        .map(|_| trainer.train_step(data).unwrap().loss)
        .collect()
}

/// A small GPT trained with AdamW on the Hamlet and Sonnets sample: its loss on held-out text
/// falls from uniform guessing (ln 256 = 5.55) well below the 3.21 nats of the sample's
/// letter frequencies alone, so it has learnt which letters follow which.
fn gpt_learns<B: Backend>(new: fn() -> B) {
    use murmur_trainer::data::text::{Corpus, Windows};
    use murmur_trainer::data::{Samples, TextSamples};

    let model = ModelSpec {
        layers: Some(1),
        heads: Some(2),
        width: Some(32),
        context: Some(32),
        ..ModelSpec::gpt()
    };
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/shakespeare");
    let corpus = std::sync::Arc::new(Corpus::load(&dir).unwrap());
    let window = 33;
    let train = Samples::Text(TextSamples::new(
        corpus.clone(),
        Windows::every_token(corpus.train_ranges(0.1), window),
    ));
    let held_out = Samples::Text(TextSamples::of_windows(
        corpus.clone(),
        Windows::held_out(corpus.validation_ranges(0.1), window, 16),
        window,
    ));
    let spec = TrainSpec {
        model,
        optimizer: OptimizerSpec {
            weight_decay: Some(0.1),
            grad_clip: Some(1.0),
            ..OptimizerSpec::adamw(1e-2)
        },
        batch_size: 8,
        epochs: 1,
        epoch_samples: Some(8 * 400),
        seed: 1,
    };
    let mut trainer = Trainer::new(new(), spec, &train).unwrap();
    let before = trainer.evaluate(&held_out).unwrap().loss;
    assert!((before - 5.545).abs() < 0.1, "untrained loss {before}");
    while !trainer.is_finished() {
        trainer.train_step(&train).unwrap();
    }
    let after = trainer.evaluate(&held_out).unwrap().loss;
    eprintln!("held-out loss {before} -> {after}");
    assert!(after < 2.8, "held-out loss {before} -> {after}");
}

#[test]
fn a_gpt_learns_the_sample_text() {
    common::on_every_device!(gpt_learns);
}
