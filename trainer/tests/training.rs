//! The training loop end to end on synthetic data, on every device here: it learns, it is
//! deterministic, and a run resumed from a checkpoint is bit-identical to one that never stopped.
//! On a GPU machine the CUDA loss curve must also follow the CPU's.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use murmur_trainer::checkpoint;
use murmur_trainer::model::{ModelKind, ModelSpec};
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

fn small_cnn() -> ModelSpec {
    ModelSpec {
        kind: ModelKind::Cnn,
        hidden: Some(vec![16]),
        channels: Some(vec![4, 8]),
    }
}

fn train_steps<B: Backend>(trainer: &mut Trainer<B>, data: &Dataset, steps: u64) {
    for _ in 0..steps {
        trainer.train_step(data).unwrap();
    }
}

#[test]
fn mlp_and_cnn_learn_the_synthetic_task() {
    common::on_every_device!(mlp_and_cnn_learn);
}

fn mlp_and_cnn_learn<B: Backend>(new: fn() -> B) {
    let (train, test) = (Dataset::synthetic(600, 1), Dataset::synthetic(200, 2));
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
    let (train, test) = (Dataset::synthetic(600, 1), Dataset::synthetic(200, 2));
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
    let train = Dataset::synthetic(300, 1);
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
    let train = Dataset::synthetic(300, 1);
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
    let train = Dataset::synthetic(300, 1);
    for optimizer in [OptimizerSpec::sgd(0.05, 0.9), OptimizerSpec::adamw(1e-3)] {
        let s = spec(ModelSpec::mlp(), optimizer);
        // 10 steps per epoch: stop mid-epoch at step 13, resume, go to 25.
        let mut straight = Trainer::new(new(), s.clone(), &train).unwrap();
        train_steps(&mut straight, &train, 25);

        let mut first = Trainer::new(new(), s.clone(), &train).unwrap();
        train_steps(&mut first, &train, 13);
        let dir = tempfile::tempdir().unwrap();
        let layout = first.replica().architecture().layout().clone();
        let fingerprint = first.replica().architecture().fingerprint();
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
    let train = Dataset::synthetic(64, 1);
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
    let train = Dataset::synthetic(256, 1);
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

/// The bar for the GPU: the same loss curve as the CPU, within 1e-3 relative, for 100
/// steps of the MLP and the CNN (default sizes, batch 256). Runs where a GPU answers.
#[test]
fn cuda_and_cpu_give_the_same_loss_curve() {
    if let Err(reason) = common::gpu_here() {
        eprintln!("no GPU to compare with the CPU: {reason}");
        return;
    }
    let train = Dataset::synthetic(2560, 5);
    for model in [ModelSpec::mlp(), ModelSpec::cnn()] {
        let mut s = spec(model.clone(), OptimizerSpec::sgd(0.05, 0.9));
        s.batch_size = 256;
        s.epochs = 10;
        let mut cpu = Trainer::new(CpuBackend::new(), s.clone(), &train).unwrap();
        let mut gpu = Trainer::new(common::cuda_zero(), s, &train).unwrap();
        for step in 0..100 {
            let (a, b) = (
                cpu.train_step(&train).unwrap().loss,
                gpu.train_step(&train).unwrap().loss,
            );
            assert!(
                (a - b).abs() <= 1e-3 * a.abs().max(b.abs()),
                "{:?} step {step}: cpu loss {a}, cuda loss {b}",
                model.kind
            );
        }
    }
}
