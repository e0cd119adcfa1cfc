//! Synchronous SGD over the ring (`allreduce` with `every = 1`) against one process on the
//! global batch: the ring's mean of Murmur's own trainers' gradients, over in-memory pipes.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use murmur_daemon::node::engine::mean_in_ring;
use murmur_protocol::mix;
use murmur_protocol::ring::{RingLinks, RingSchedule};
use murmur_trainer::data::{Dataset, Samples};
use murmur_trainer::optim::OptimizerSpec;
use murmur_trainer::train::TrainSpec;
use murmur_trainer::{CpuBackend, ModelSpec, Trainer};
use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

type Pipe = Compat<tokio::io::DuplexStream>;

/// `size` ring links over in-memory pipes: link `i` runs from member `i` to `i + 1`.
fn ring_links(size: usize) -> Vec<RingLinks<Pipe, Pipe>> {
    let (mut writers, mut readers) = (Vec::new(), Vec::new());
    for _ in 0..size {
        let (a, b) = tokio::io::duplex(1 << 16);
        writers.push(Some(a.compat()));
        readers.push(Some(b.compat()));
    }
    (0..size)
        .map(|rank| {
            let left = (rank + size - 1) % size;
            RingLinks::new(readers[left].take().unwrap(), writers[rank].take().unwrap())
        })
        .collect()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap()
}

fn spec(batch_size: usize, steps: u64) -> TrainSpec {
    TrainSpec {
        model: ModelSpec::mlp(),
        optimizer: OptimizerSpec::sgd(0.05, 0.9),
        batch_size,
        epochs: steps,
        seed: 11,
        // One step per epoch: the whole shard is the batch.
        epoch_samples: Some(batch_size),
    }
}

fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
    mix::distance(a, b) / mix::norm(b)
}

/// The acceptance test of `every = 1`: p replicas, each on its own shard, averaging their
/// gradients through the ring every step, end where one process training on the union
/// of the shards (the global batch) ends, and bitwise equal to one another.
#[test]
fn synchronous_sgd_over_the_ring_matches_one_process_on_the_global_batch() {
    const STEPS: u64 = 100;
    const BATCH: usize = 8;
    let rt = runtime();
    for p in [2usize, 3, 4] {
        let images = Dataset::synthetic(p * BATCH, 5);
        let shards: Vec<Samples> = (0..p)
            .map(|i| {
                let part = (i * BATCH..(i + 1) * BATCH).collect::<Vec<_>>();
                Samples::Images(images.subset(&part))
            })
            .collect();
        let global = Samples::Images(images);
        let mut single = Trainer::new(CpuBackend::new(), spec(p * BATCH, STEPS), &global).unwrap();
        for _ in 0..STEPS {
            single.train_step(&global).unwrap();
        }

        let mut replicas: Vec<_> = shards
            .iter()
            .map(|s| Trainer::new(CpuBackend::new(), spec(BATCH, STEPS), s).unwrap())
            .collect();
        let mut links: Vec<_> = ring_links(p).into_iter().map(Some).collect();
        for step in 0..STEPS {
            let pending: Vec<_> = replicas
                .iter_mut()
                .zip(&shards)
                .map(|(t, s)| t.compute_gradients(s).unwrap())
                .collect();
            let grads: Vec<Vec<f32>> = replicas.iter().map(|t| t.gradients().unwrap()).collect();
            let rounds = (0..p).map(|rank| {
                let schedule = RingSchedule::new(rank, p, grads[rank].len(), 1000);
                let held = links[rank].take().unwrap();
                mean_in_ring(schedule, step, 7, &grads[rank], held)
            });
            let results = rt.block_on(futures::future::join_all(rounds));
            for (rank, result) in results.into_iter().enumerate() {
                let (mean, _, held) = result.unwrap();
                links[rank] = Some(held);
                replicas[rank]
                    .apply_gradients(pending[rank], Some(&mean))
                    .unwrap();
            }
        }
        let reference = single.params().unwrap();
        let first = replicas[0].params().unwrap();
        for replica in &replicas[1..] {
            assert_eq!(replica.params().unwrap(), first, "p = {p}: replicas differ");
        }
        let gap = relative_distance(&first, &reference);
        eprintln!("p = {p}: relative distance to the global-batch run {gap:e}");
        assert!(gap < 1e-5, "p = {p}: {gap:e} from the global-batch run");
        let start = Trainer::new(CpuBackend::new(), spec(BATCH, STEPS), &shards[0])
            .unwrap()
            .params()
            .unwrap();
        assert!(
            relative_distance(&start, &reference) > 1e-2,
            "p = {p}: nothing trained"
        );
    }
}
