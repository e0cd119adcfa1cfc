//! Murmur's trainer behind the contract, driven by the replica's rules as the replica driver
//! drives it (without the channels): what the rules ask lands on the trainer as it did when
//! the trainer thread called the trainer itself.

use std::time::Duration;

use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::mix;
use murmur_sync::copies::{ConsensusStep, Copies};
use murmur_sync::replica::{
    Delta, ExchangeEnd, ExchangeId, Landed, Landing, LoopSettings, Next, ReplicaLoop,
};
use murmur_sync::settings::Outer;
use murmur_trainer::data::Dataset;
use murmur_trainer::optim::OptimizerSpec;
use murmur_trainer::train::TrainSpec;
use murmur_trainer::{CpuBackend, ModelSpec};

use super::*;

const EVERY: u64 = 4;

fn spec(optimizer: OptimizerSpec) -> TrainSpec {
    TrainSpec {
        model: ModelSpec::mlp(),
        optimizer,
        batch_size: 8,
        epochs: 10,
        seed: 3,
        epoch_samples: None,
    }
}

fn replica_with(spec: TrainSpec, dir: &std::path::Path) -> NativeReplica<CpuBackend> {
    let train = Samples::Images(Dataset::synthetic(64, 1));
    let trainer = Trainer::new(CpuBackend::new(), spec, &train).unwrap();
    let checkpoints = NativeCheckpoints {
        dir: dir.join("checkpoints"),
        config_hash: "h".into(),
        keep: 1,
    };
    NativeReplica::new(
        trainer,
        train,
        Samples::Images(Dataset::synthetic(16, 2)),
        checkpoints,
    )
}

fn replica(dir: &std::path::Path) -> NativeReplica<CpuBackend> {
    replica_with(spec(OptimizerSpec::sgd(0.05, 0.9)), dir)
}

/// The rules of a ring averaging every [`EVERY`] steps with the DiLoCo step.
fn diloco() -> LoopSettings {
    LoopSettings {
        mode: SyncMode::Allreduce,
        overlap: false,
        max_merge_lag: 256,
        interval: EVERY,
        adapt_interval: false,
        max_staleness: None,
        ring: true,
        averages_gradients: false,
        outer: Some(Outer::Nesterov {
            lr: 0.7,
            momentum: 0.9,
        }),
    }
}

/// The rules of gossip through its exchanges with the outer step.
fn gossip_outer() -> LoopSettings {
    LoopSettings {
        mode: SyncMode::Gossip,
        overlap: true,
        outer: Some(Outer::Nesterov {
            lr: 1.0,
            momentum: 0.5,
        }),
        ring: false,
        max_staleness: Some(64),
        ..diloco()
    }
}

fn rules_for(settings: LoopSettings, replica: &mut NativeReplica<CpuBackend>) -> ReplicaLoop {
    let step = replica.clock().step;
    ReplicaLoop::new(settings, step, || replica.params()).unwrap()
}

/// Lands `landed` on `replica`, as the replica driver does.
fn land(replica: &mut NativeReplica<CpuBackend>, landed: Landed) {
    for landing in landed.landings {
        match landing {
            Landing::Add { delta, mixed_over } => replica.add(delta, mixed_over).unwrap(),
            Landing::AddStep(landing) => replica.add_step(landing).unwrap(),
            Landing::Set(params) => replica.set_params(params).unwrap(),
        }
    }
}

/// Trains `steps` steps; each ring round's average is this replica alone.
fn train_alone(replica: &mut NativeReplica<CpuBackend>, rules: &mut ReplicaLoop, steps: u64) {
    for _ in 0..steps {
        let step = replica.step().unwrap().unwrap().step;
        if rules
            .stepped(step, Duration::from_millis(1), || false)
            .hand_over
        {
            let mean = replica.params().unwrap();
            round(replica, rules, step, mean);
        }
    }
}

/// Hands the snapshot at `step` over and lands the ring's `mean` for it.
fn round(
    replica: &mut NativeReplica<CpuBackend>,
    rules: &mut ReplicaLoop,
    step: u64,
    mean: Vec<f32>,
) {
    let params = replica.params().unwrap();
    let id: ExchangeId = rules.handed_over(step, &params);
    let landed = rules.ended(id, Some(ExchangeEnd::Reduced { step, mean }), step);
    land(replica, landed);
}

fn bits(replica: &mut NativeReplica<CpuBackend>) -> Vec<u32> {
    replica
        .params()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn a_native_replica_describes_the_trainers_model() {
    let dir = tempfile::tempdir().unwrap();
    for (model, optimizer, names) in [
        (
            ModelSpec::mlp(),
            OptimizerSpec::sgd(0.05, 0.9),
            vec!["velocity"],
        ),
        (
            ModelSpec::cnn(),
            OptimizerSpec::adamw(1e-3),
            vec!["first_moment", "second_moment"],
        ),
    ] {
        let replica = replica_with(
            TrainSpec {
                model,
                ..spec(optimizer)
            },
            dir.path(),
        );
        let info = replica.describe();
        assert_eq!(info.fingerprint(), replica.trainer().fingerprint());
        assert_eq!(info.param_count(), replica.trainer().param_count());
        assert_eq!(info.optimizer_buffers, names);
        assert_eq!(info.steps_per_epoch, Some(8));
    }
}

/// A replica that takes over a peer waiting on a round owes that round, and with the peer's
/// momentum, anchor and outer velocity it averages and trains on bitwise like it.
#[test]
fn an_adopted_state_averages_and_trains_like_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let (mut a, mut b) = (replica(dir.path()), replica(dir.path()));
    let (mut ra, mut rb) = (rules_for(diloco(), &mut a), rules_for(diloco(), &mut b));
    // `a` has had two averages (a velocity) and waits on the third: 12 steps, anchor 8.
    train_alone(&mut a, &mut ra, 11);
    let step = a.step().unwrap().unwrap().step;
    assert_eq!(step, 12);
    assert!(
        ra.stepped(step, Duration::from_millis(1), || false)
            .hand_over,
        "round 12 is due"
    );
    train_alone(&mut b, &mut rb, 5);

    let state = a.state().unwrap();
    let (params, outer) = ra.state_of(state.params.clone());
    assert_eq!(outer.as_ref().map(|o| o.anchor_step), Some(8));
    let adopted = b
        .adopt(ReplicaState {
            params: params.clone(),
            ..state
        })
        .unwrap();
    assert_eq!(adopted, Adoption::Whole);
    rb.adopted(12, &params, outer);
    assert_eq!(b.clock().step, 12);
    let next = rb.next(b.clock(), std::time::Instant::now(), Vec::new).next;
    assert_eq!(
        next,
        Next::HandOver,
        "the round at step 12 is still to come"
    );

    // Round 12 averages the two; then both train on.
    let mean: Vec<f32> = (a.params().unwrap().iter())
        .zip(&b.params().unwrap())
        .map(|(x, y)| 0.5 * (x + y))
        .collect();
    round(&mut a, &mut ra, 12, mean.clone());
    round(&mut b, &mut rb, 12, mean);
    assert!(bits(&mut a) == bits(&mut b), "after the shared round");
    train_alone(&mut a, &mut ra, 8);
    train_alone(&mut b, &mut rb, 8);
    assert!(bits(&mut a) == bits(&mut b), "after two more rounds");
}

/// How far the mix of the snapshot `id` (of `base`) toward `other` moves `replica` when it
/// lands now.
fn landed_move(
    replica: &mut NativeReplica<CpuBackend>,
    rules: &mut ReplicaLoop,
    id: ExchangeId,
    base: Vec<f32>,
    other: Vec<f32>,
) -> Vec<f32> {
    let before = replica.params().unwrap();
    let delta = other.iter().zip(&base).map(|(o, b)| o - b).collect();
    let end = ExchangeEnd::Mix {
        delta: Delta::Values(delta),
        weight: 0.5,
    };
    let step = replica.clock().step;
    let landed = rules.ended(id, Some(end), step);
    land(replica, landed);
    let after = replica.params().unwrap();
    after.iter().zip(&before).map(|(a, b)| a - b).collect()
}

/// With the outer step, a mix that lands steps after its snapshot (`overlap`) moves the
/// replica as far as it would have at the snapshot's step: the outer step is taken on the
/// progress up to the snapshot, and the steps taken meanwhile are kept as they are (decision
/// 0030).
#[test]
fn a_late_mix_moves_the_replica_as_far_as_one_at_its_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let (mut paused, mut late) = (replica(dir.path()), replica(dir.path()));
    let (mut rp, mut rl) = (
        rules_for(gossip_outer(), &mut paused),
        rules_for(gossip_outer(), &mut late),
    );
    for _ in 0..6 {
        paused.step().unwrap();
        late.step().unwrap();
    }
    let (base_p, base_l) = (paused.params().unwrap(), late.params().unwrap());
    assert_eq!(base_p, base_l);
    let (id_p, id_l) = (rp.handed_over(6, &base_p), rl.handed_over(6, &base_l));
    let other: Vec<f32> = (base_p.iter())
        .enumerate()
        .map(|(i, v)| v + 0.01 * (i % 7) as f32)
        .collect();

    let at_once = landed_move(&mut paused, &mut rp, id_p, base_p, other.clone());
    for _ in 0..5 {
        late.step().unwrap();
    }
    let five_late = landed_move(&mut late, &mut rl, id_l, base_l, other);

    let mix_alone = |i: usize| 0.5 * 0.01 * (i % 7) as f32;
    assert!(
        at_once
            .iter()
            .enumerate()
            .any(|(i, m)| (m - mix_alone(i)).abs() > 1e-4),
        "the outer step moved the replica as well as the mix"
    );
    let worst = (at_once.iter().zip(&five_late))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        worst < 1e-5,
        "the late mix moved the replica otherwise, by up to {worst}"
    );
}

/// A trainer like [`replica`]'s with quasi-global momentum.
fn quasi_global(dir: &std::path::Path) -> NativeReplica<CpuBackend> {
    replica_with(
        spec(OptimizerSpec {
            quasi_global: Some(true),
            ..OptimizerSpec::sgd(0.05, 0.9)
        }),
        dir,
    )
}

/// The parameters of a peer a little away from `params`.
fn a_peer_near(params: &[f32]) -> Vec<f32> {
    let shift = |i: usize| 0.01 * (i % 7) as f32 - 0.03;
    params
        .iter()
        .enumerate()
        .map(|(i, v)| v + shift(i))
        .collect()
}

/// How far the step after a mix moves a quasi-global replica, the mix having gone through
/// the optimizer as one every `interval` steps, by the trainer's own calls.
fn step_after_a_mix_by_hand(dir: &std::path::Path, interval: u64) -> Vec<f32> {
    let mut replica = quasi_global(dir);
    let trainer = &mut replica.trainer;
    for _ in 0..3 {
        trainer.train_step(&replica.train).unwrap();
    }
    let x = trainer.params().unwrap();
    let mut delta = vec![0.0; x.len()];
    mix::mix_toward(&mut delta, &a_peer_near(&x), &x, 0.5);
    let mut mixed = x;
    mix::add(&mut mixed, &delta);
    trainer.set_params(&mixed).unwrap();
    trainer.mixed(&delta, interval).unwrap();
    trainer.train_step(&replica.train).unwrap();
    let mut stepped = trainer.params().unwrap();
    mix::subtract(&mut stepped, &mixed);
    stepped
}

/// A mix lands on a quasi-global replica with the interval in use, so that a mix every 48
/// steps counts at 8/48 (decision 0035).
#[test]
fn a_mix_reaches_quasi_global_momentum_with_the_interval_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let mut replica = quasi_global(dir.path());
    for _ in 0..3 {
        replica.step().unwrap();
    }
    let x = replica.params().unwrap();
    let mut delta = vec![0.0; x.len()];
    mix::mix_toward(&mut delta, &a_peer_near(&x), &x, 0.5);
    replica.add(delta, Some(48)).unwrap();
    let before = replica.params().unwrap();
    replica.step().unwrap();
    let mut stepped = replica.params().unwrap();
    mix::subtract(&mut stepped, &before);

    let far = |a: &[f32], b: &[f32]| {
        (a.iter().zip(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let (at_a_share, whole) = (
        step_after_a_mix_by_hand(dir.path(), 48),
        step_after_a_mix_by_hand(dir.path(), 8),
    );
    assert!(
        far(&at_a_share, &whole) > 1e-4,
        "a whole mix and one at a share should step differently"
    );
    let off = far(&stepped, &at_a_share);
    assert!(
        off < 1e-6,
        "the replica stepped {off} away from a mix counted at 8/48"
    );
}

/// A peer of another optimizer hands over its parameters and clock only: the replica keeps
/// its own optimizer state. A state out of the optimizer's bounds is refused whole.
#[test]
fn a_state_without_this_optimizers_buffers_is_taken_without_them_and_a_bad_one_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut source = replica(dir.path());
    for _ in 0..5 {
        source.step().unwrap();
    }
    let mut taker = replica(dir.path());
    taker.step().unwrap();
    let own = taker.state().unwrap().optimizer;
    let theirs = source.state().unwrap();
    let adoption = taker
        .adopt(ReplicaState {
            optimizer: None,
            ..theirs.clone()
        })
        .unwrap();
    assert_eq!(adoption, Adoption::ParametersOnly);
    let now = taker.state().unwrap();
    assert_eq!((now.step, &now.params), (5, &theirs.params));
    assert_eq!(now.optimizer, own, "the optimizer kept its own state");

    let mut adam = replica_with(spec(OptimizerSpec::adamw(1e-3)), dir.path());
    let mut bad = adam.state().unwrap();
    if let Some(optimizer) = bad.optimizer.as_mut() {
        optimizer.buffers[1].values[0] = -1.0;
    }
    let refused = adam.adopt(bad).unwrap();
    assert!(
        matches!(&refused, Adoption::Refused(why) if why.contains("second_moment")),
        "{refused:?}"
    );
}

/// A diverged replica is never saved: the newest checkpoint stays the last good one.
#[test]
fn a_replica_that_holds_values_that_are_not_finite_is_not_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let mut replica = replica(dir.path());
    replica.step().unwrap();
    let saved = replica.checkpoint().unwrap().unwrap();
    assert_eq!(saved.step, 1);
    let mut params = replica.params().unwrap();
    params[0] = f32::NAN;
    replica.set_params(params).unwrap();
    replica.step().unwrap();
    let error = replica.checkpoint().unwrap_err().to_string();
    assert!(error.contains("not finite"), "{error}");
}

/// A compressed mix added a run at a time (decision 0094) moves the replica exactly as its
/// values added whole would, and the replica trains on from there alike; where the optimizer
/// counts the mix (quasi-global momentum), it goes whole.
#[test]
fn a_compressed_mix_added_a_run_at_a_time_moves_the_replica_as_its_values_added_whole() {
    let dir = tempfile::tempdir().unwrap();
    let gossip = || LoopSettings {
        mode: SyncMode::Gossip,
        overlap: true,
        outer: None,
        ring: false,
        max_staleness: Some(64),
        ..diloco()
    };
    let step = ConsensusStep {
        scale: 0.5,
        excess: Some(0.01),
        shrink: Some(0.9),
    };
    for make in [replica, quasi_global] {
        let (mut by_runs, mut whole) = (make(dir.path()), make(dir.path()));
        let params = by_runs.params().unwrap();
        assert!(params.len() > 1 << 16, "a model of several runs");
        let copies = Copies::holding(2, &params, &a_peer_near(&params));
        let mut rules = rules_for(gossip(), &mut by_runs);
        let id = rules.handed_over(0, &params);
        let end = ExchangeEnd::Mix {
            delta: Delta::Step { step, copies: None },
            weight: 0.5,
        }
        .holding(Some(copies.clone()));
        let landed = rules.ended(id, Some(end), 0);
        let mixed_over = match &landed.landings[..] {
            [Landing::AddStep(landing)] => landing.mixed_over,
            other => panic!("a compressed mix lands as its step: {other:?}"),
        };
        land(&mut by_runs, landed);
        whole.add(step.values(&copies, 0.5), mixed_over).unwrap();
        assert_eq!(bits(&mut by_runs), bits(&mut whole));
        assert_ne!(
            bits(&mut by_runs),
            params.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        let mut rules = rules_for(gossip(), &mut whole);
        train_alone(&mut whole, &mut rules, 2);
        let mut rules = rules_for(gossip(), &mut by_runs);
        train_alone(&mut by_runs, &mut rules, 2);
        assert_eq!(bits(&mut by_runs), bits(&mut whole));
    }
}
