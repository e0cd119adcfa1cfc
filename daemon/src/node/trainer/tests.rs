use std::time::Duration;

use murmur_protocol::network::Keypair;
use murmur_protocol::ring::TrustList;
use murmur_protocol::ring::data_plane::DataPlane;
use murmur_trainer::data::Dataset;
use murmur_trainer::optim::OptimizerSpec;
use murmur_trainer::train::TrainSpec;
use murmur_trainer::{CpuBackend, ModelSpec};

use super::*;
use crate::config::{ElasticTopology, Election};
use crate::readout::Feeds;
use crate::settings::{Identity, Outer, RingSettings};

const EVERY: u64 = 4;

/// What one replica's worker borrows, for `allreduce` with `every = 4` and the DiLoCo step.
struct Parts {
    dir: tempfile::TempDir,
    readout: Readout,
    feeds: Feeds,
    store: Store,
    sync: SyncSettings,
}

fn parts() -> Parts {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("node.redb")).unwrap();
    let peer_id = Keypair::generate_ed25519().public().to_peer_id();
    let sync = SyncSettings {
        mode: SyncMode::Allreduce,
        interval: EVERY,
        max_staleness: None,
        age_weighting: false,
        overlap: false,
        max_merge_lag: 256,
        adapt_interval: false,
        outer: Outer::Average,
        codec: murmur_protocol::codec::Codec::F32,
        sparse_codec: None,
        slowdown: 1.0,
        alpha: None,
        topology: ElasticTopology::Center,
        center: None,
        election: Election::Trusted,
        relayed_exchanges: false,
        seed: 1,
        trust: TrustList::new([peer_id]),
        ring: Some(RingSettings {
            every: EVERY,
            outer: Outer::Nesterov {
                lr: 0.7,
                momentum: 0.9,
            },
            plane: DataPlane::Tcp,
            timeout: Duration::from_secs(5),
            min_peers: 1,
            sub_chunk: 1024,
            listen: "127.0.0.1:0".parse().unwrap(),
        }),
    };
    let identity = Identity {
        peer_id,
        run_id: "worker-test".into(),
        fingerprint: "f".into(),
        model: "mlp".into(),
        device: "cpu".into(),
        epochs: 10,
        param_count: 0,
        optimizer: murmur_trainer::OptimizerSpec::sgd(0.1, 0.0),
    };
    let (readout, feeds) = Readout::new(
        identity,
        sync.clone(),
        Duration::from_secs(10),
        CancellationToken::new(),
    );
    Parts {
        dir,
        readout,
        feeds,
        store,
        sync,
    }
}

/// The engine's ends of a worker's channels: kept open so that the worker does not take the
/// engine for gone.
type EngineEnds = (mpsc::Sender<ToTrainer>, mpsc::Receiver<Due>);

fn worker<'a>(
    dir: &std::path::Path,
    readout: &'a Readout,
    store: &'a Store,
    sync: &'a SyncSettings,
    progress: watch::Sender<Progress>,
) -> (Worker<'a, CpuBackend>, EngineEnds) {
    let (to_trainer, inbox) = mpsc::channel(1);
    let (due, engine) = mpsc::channel(1);
    let links = TrainerLinks {
        inbox,
        due,
        peers: readout.watch_peers(),
        progress,
        leave: CancellationToken::new(),
    };
    let worker = Worker::new(job(dir), readout, store, sync, links).unwrap();
    (worker, (to_trainer, engine))
}

fn job(dir: &std::path::Path) -> TrainerJob<CpuBackend> {
    let train = Samples::Images(Dataset::synthetic(64, 1));
    let spec = TrainSpec {
        model: ModelSpec::mlp(),
        optimizer: OptimizerSpec::sgd(0.05, 0.9),
        batch_size: 8,
        epochs: 10,
        seed: 3,
        epoch_samples: None,
    };
    TrainerJob {
        trainer: Trainer::new(CpuBackend::new(), spec, &train).unwrap(),
        test: Samples::Images(Dataset::synthetic(16, 2)),
        train,
        checkpoint_dir: dir.join("checkpoints"),
        config_hash: "h".into(),
        keep: 1,
    }
}

/// Trains `steps` steps, each round's average being this replica alone.
fn train_alone(worker: &mut Worker<'_, CpuBackend>, steps: u64) {
    for _ in 0..steps {
        let step = worker
            .job
            .trainer
            .train_step(&worker.job.train)
            .unwrap()
            .step;
        if step.is_multiple_of(EVERY) {
            let mean = worker.job.trainer.params().unwrap();
            worker.apply(round_end(step, mean)).unwrap();
        }
    }
}

/// The end of the ring round of `step`, as the engine delivers it.
fn round_end(step: u64, mean: Vec<f32>) -> Ended {
    Ended {
        due: true,
        step,
        owed: None,
        end: Ok(ExchangeEnd::Reduced { step, mean }),
    }
}

fn bits(worker: &Worker<'_, CpuBackend>) -> Vec<u32> {
    let params = worker.job.trainer.params().unwrap();
    params.iter().map(|v| v.to_bits()).collect()
}

/// A replica that takes over a peer waiting on a round owes that round, and with the peer's
/// momentum, anchor and outer velocity it averages and trains on bitwise like it.
#[test]
fn an_adopted_state_averages_and_trains_like_its_source() {
    let (pa, pb) = (parts(), parts());
    let (mut a, _a_engine) = worker(
        pa.dir.path(),
        &pa.readout,
        &pa.store,
        &pa.sync,
        pa.feeds.progress,
    );
    let (mut b, _b_engine) = worker(
        pb.dir.path(),
        &pb.readout,
        &pb.store,
        &pb.sync,
        pb.feeds.progress,
    );
    // `a` has had two averages (a velocity) and waits on the third: 12 steps, anchor 8.
    train_alone(&mut a, 11);
    a.job.trainer.train_step(&a.job.train).unwrap();
    train_alone(&mut b, 5);

    let (tx, rx) = oneshot::channel();
    a.handle(ToTrainer::State(tx)).unwrap();
    let state = rx.blocking_recv().unwrap();
    assert_eq!(state.outer.as_ref().map(|o| o.anchor_step), Some(8));
    let (adopted, done) = oneshot::channel();
    b.handle(ToTrainer::Adopt { state, adopted }).unwrap();
    done.blocking_recv().unwrap();
    assert!(b.owes_round, "the round at step 12 is still to come");
    assert_eq!(b.job.trainer.step_count(), 12);

    // Round 12 averages the two; then both train on.
    let mean: Vec<f32> = (a.job.trainer.params().unwrap().iter())
        .zip(&b.job.trainer.params().unwrap())
        .map(|(x, y)| 0.5 * (x + y))
        .collect();
    for worker in [&mut a, &mut b] {
        worker.apply(round_end(12, mean.clone())).unwrap();
    }
    assert!(bits(&a) == bits(&b), "after the shared round");
    train_alone(&mut a, 8);
    train_alone(&mut b, 8);
    assert!(bits(&a) == bits(&b), "after two more rounds");
}

/// A trainer gated on a slow peer wakes as soon as the peer table changes, however soon after
/// its check that happens: the wait is on the table's `watch`, which remembers a change.
#[test]
fn the_gate_wakes_on_a_peer_table_change_made_right_after_the_check() {
    let p = parts();
    let (mut worker, _engine) = worker(
        p.dir.path(),
        &p.readout,
        &p.store,
        &p.sync,
        p.feeds.progress,
    );
    // The check: the worker marks the table seen.
    let _ = worker.links.peers.borrow_and_update().len();
    // A change between the check and the wait (a heartbeat of the slow peer).
    p.feeds.peers.send_modify(|_| {});
    let waited = std::time::Instant::now();
    worker.wait(true).unwrap();
    assert!(
        waited.elapsed() < Duration::from_secs(1),
        "the change was missed"
    );
}

/// [`parts`] for gossip with the outer step, training through its exchanges.
fn gossip_parts() -> Parts {
    let mut parts = parts();
    parts.sync = SyncSettings {
        mode: SyncMode::Gossip,
        overlap: true,
        outer: Outer::Nesterov {
            lr: 1.0,
            momentum: 0.5,
        },
        ring: None,
        ..parts.sync
    };
    parts
}

/// Hands `worker`'s snapshot over and takes it off the engine's end.
fn hand_over(worker: &mut Worker<'_, CpuBackend>, engine: &mut EngineEnds) -> Due {
    worker.hand_over_snapshot().unwrap();
    engine.1.try_recv().expect("the snapshot was handed over")
}

/// How far the mix of `due` toward `other` moves `worker`'s parameters when it lands now.
fn landed_move(worker: &mut Worker<'_, CpuBackend>, due: Due, other: Vec<f32>) -> Vec<f32> {
    let before = worker.job.trainer.params().unwrap();
    let end = ExchangeEnd::Mix {
        other,
        base: std::sync::Arc::new(due.snapshot),
        weight: 0.5,
    };
    due.end.send(end).unwrap();
    worker.take_what_arrived().unwrap();
    let after = worker.job.trainer.params().unwrap();
    after.iter().zip(&before).map(|(a, b)| a - b).collect()
}

/// With the outer step, a mix that lands steps after its snapshot (`overlap`) moves the
/// replica as far as it would have at the snapshot's step: the outer step is taken on the
/// progress up to the snapshot, and the steps taken meanwhile are kept as they are (decision
/// 0030).
#[test]
fn a_late_mix_moves_the_replica_as_far_as_one_at_its_snapshot() {
    let (pa, pb) = (gossip_parts(), gossip_parts());
    let (mut paused, mut paused_engine) = worker(
        pa.dir.path(),
        &pa.readout,
        &pa.store,
        &pa.sync,
        pa.feeds.progress,
    );
    let (mut late, mut late_engine) = worker(
        pb.dir.path(),
        &pb.readout,
        &pb.store,
        &pb.sync,
        pb.feeds.progress,
    );
    let steps = |w: &mut Worker<'_, CpuBackend>, n: usize| {
        for _ in 0..n {
            w.job.trainer.train_step(&w.job.train).unwrap();
        }
    };
    steps(&mut paused, 6);
    steps(&mut late, 6);
    let (due_paused, due_late) = (
        hand_over(&mut paused, &mut paused_engine),
        hand_over(&mut late, &mut late_engine),
    );
    assert_eq!(due_paused.snapshot.params, due_late.snapshot.params);
    let other: Vec<f32> = (due_paused.snapshot.params.iter())
        .enumerate()
        .map(|(i, v)| v + 0.01 * (i % 7) as f32)
        .collect();

    let at_once = landed_move(&mut paused, due_paused, other.clone());
    steps(&mut late, 5);
    let five_late = landed_move(&mut late, due_late, other);

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

/// A trainer like [`job`]'s with quasi-global momentum.
fn quasi_global_trainer(train: &Samples) -> Trainer<CpuBackend> {
    let spec = TrainSpec {
        optimizer: OptimizerSpec {
            quasi_global: Some(true),
            ..OptimizerSpec::sgd(0.05, 0.9)
        },
        ..job(std::path::Path::new(".")).trainer.spec().clone()
    };
    Trainer::new(CpuBackend::new(), spec, train).unwrap()
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
/// the optimizer as one every `interval` steps ([`Trainer::mixed`]) by hand.
fn step_after_a_mix_by_hand(train: &Samples, interval: u64) -> Vec<f32> {
    let mut trainer = quasi_global_trainer(train);
    for _ in 0..3 {
        trainer.train_step(train).unwrap();
    }
    let x = trainer.params().unwrap();
    let mut delta = vec![0.0; x.len()];
    averaging::mix_toward(&mut delta, &a_peer_near(&x), &x, 0.5);
    let mut mixed = x;
    averaging::add(&mut mixed, &delta);
    trainer.set_params(&mixed).unwrap();
    trainer.mixed(&delta, interval).unwrap();
    trainer.train_step(train).unwrap();
    let mut stepped = trainer.params().unwrap();
    averaging::subtract(&mut stepped, &mixed);
    stepped
}

/// A gossip replica with quasi-global momentum hands each mix to its optimizer with the
/// interval in use, so that a mix every 48 steps counts at 8/48 (decision 0035).
#[test]
fn a_mix_reaches_quasi_global_momentum_with_the_interval_in_use() {
    let mut p = gossip_parts();
    p.sync = SyncSettings {
        interval: 48,
        outer: Outer::Average,
        ..p.sync
    };
    let (mut w, mut engine) = worker(
        p.dir.path(),
        &p.readout,
        &p.store,
        &p.sync,
        p.feeds.progress,
    );
    w.job.trainer = quasi_global_trainer(&w.job.train);
    for _ in 0..3 {
        w.job.trainer.train_step(&w.job.train).unwrap();
    }
    let due = hand_over(&mut w, &mut engine);
    let other = a_peer_near(&due.snapshot.params);
    landed_move(&mut w, due, other);
    let before = w.job.trainer.params().unwrap();
    w.job.trainer.train_step(&w.job.train).unwrap();
    let mut stepped = w.job.trainer.params().unwrap();
    averaging::subtract(&mut stepped, &before);

    let far = |a: &[f32], b: &[f32]| {
        (a.iter().zip(b))
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    };
    let (at_a_share, whole) = (
        step_after_a_mix_by_hand(&w.job.train, 48),
        step_after_a_mix_by_hand(&w.job.train, 8),
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
