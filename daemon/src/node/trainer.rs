//! The trainer worker: the OS thread that owns the replica. It takes local steps, waits at the
//! staleness gate, hands a snapshot to the sync engine every `interval` steps, and applies
//! what the engine sends back (mixes, elastic deltas, a peer's state) between steps, so that a
//! replica is never changed in the middle of a step.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Instant;

use anyhow::Result;
use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::sync::{Gate, StalenessGate};
use murmur_trainer::averaging::{self, OuterNesterov};
use murmur_trainer::checkpoint;
use murmur_trainer::data::Dataset;
use murmur_trainer::train::{StepOutcome, TrainError};
use murmur_trainer::{Backend, Trainer};
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::api::types::AccuracyPoint;
use crate::events;
use crate::node::messages::{OuterState, Snapshot, ToTrainer, TrainerState};
use crate::readout::{NodeState, lock, unix_now};
use crate::settings::{HEARTBEAT_INTERVAL, Outer, SyncSettings};
use crate::store::Store;

/// Everything the trainer thread needs.
#[derive(Debug)]
pub struct TrainerJob<B: Backend> {
    pub trainer: Trainer<B>,
    pub train: Dataset,
    pub test: Dataset,
    pub checkpoint_dir: PathBuf,
    pub config_hash: String,
    pub keep: usize,
}

/// The trainer thread's ends of its channels to the sync engine.
#[derive(Debug)]
pub struct TrainerLinks {
    pub inbox: Receiver<ToTrainer>,
    /// Snapshots due for an exchange, one at a time (see `NodeState::exchanges_in_flight`).
    pub due: mpsc::Sender<Snapshot>,
}

struct Worker<'a, B: Backend> {
    job: TrainerJob<B>,
    state: &'a NodeState,
    store: &'a Store,
    sync: &'a SyncSettings,
    /// Parameters changed by peers since the last checkpoint.
    mixed: bool,
    saved_step: u64,
    /// `allreduce`, `every = 1`: the ring's mean gradient, once it is back.
    reduced_gradient: Option<(u64, Vec<f32>)>,
    /// `allreduce`, `every > 1`: the parameters every replica started the current `H` local
    /// steps from, and the outer optimizer that moves them.
    anchor: Vec<f32>,
    /// The step the anchor is from: the last completed average, or where training started.
    anchor_step: u64,
    outer: Option<OuterNesterov>,
    /// This replica took over the state of a peer that waits on the round at the adopted
    /// step: it owes that round before it trains on.
    owes_round: bool,
}

/// Trains until the run's epochs are done, then keeps serving the sync engine (a finished
/// replica still answers exchanges) until the node shuts down. Checkpoints at every epoch and
/// on the way out.
pub fn run<B: Backend>(
    job: TrainerJob<B>,
    state: &NodeState,
    store: &Store,
    sync: &SyncSettings,
    links: TrainerLinks,
) -> Result<()> {
    let mut worker = Worker::new(job, state, store, sync)?;
    worker.publish_clock();
    let result = worker.train(&links);
    // Save what there is, even after an error, so that a restart loses nothing it need not.
    let step = worker.job.trainer.step_count();
    if step != worker.saved_step || worker.mixed {
        worker.save()?;
    }
    result
}

impl<'a, B: Backend> Worker<'a, B> {
    fn new(
        job: TrainerJob<B>,
        state: &'a NodeState,
        store: &'a Store,
        sync: &'a SyncSettings,
    ) -> Result<Self> {
        let saved_step = job.trainer.step_count();
        let averages_params = sync.ring.as_ref().is_some_and(|r| !r.averages_gradients());
        let anchor = if averages_params {
            job.trainer.params()?
        } else {
            Vec::new()
        };
        let outer = match sync.ring.as_ref().map(|r| r.outer) {
            Some(Outer::Nesterov { lr, momentum }) => Some(OuterNesterov::new(lr, momentum)),
            _ => None,
        };
        Ok(Worker {
            job,
            state,
            store,
            sync,
            mixed: false,
            saved_step,
            reduced_gradient: None,
            anchor,
            anchor_step: saved_step,
            outer,
            owes_round: false,
        })
    }

    fn train(&mut self, links: &TrainerLinks) -> Result<()> {
        let gate = StalenessGate::new(self.sync.max_staleness);
        let per_epoch = self.job.trainer.steps_per_epoch();
        let mut announced_finish = false;
        // When the last step ended: the pause before the next one is a stall (gate, exchange).
        let mut last_step_end: Option<Instant> = None;
        while !self.state.is_shutting_down() {
            while let Ok(msg) = links.inbox.try_recv() {
                self.handle(msg)?;
            }
            if std::mem::take(&mut self.owes_round) {
                self.hand_over_snapshot(links)?;
                continue;
            }
            if self.job.trainer.is_finished() {
                if !announced_finish {
                    lock(&self.state.progress).finished = true;
                    announced_finish = true;
                    info!(
                        event = events::TRAINING_FINISHED,
                        step = self.job.trainer.step_count(),
                        "training finished; still answering peers"
                    );
                }
                self.wait_for_message(&links.inbox)?;
                continue;
            }
            // Ring rounds are synchronous whatever `overlap` says.
            let wait = !self.sync.overlap || self.sync.ring.is_some();
            if wait && self.state.exchanges_in_flight.load(Ordering::Acquire) > 0 {
                // Mixes land at the step they were taken for (decision 0008).
                self.wait_for_exchanges(links)?;
                continue;
            }
            let step = self.job.trainer.step_count();
            let slowest = if self.sync.mode == SyncMode::Solo {
                None
            } else {
                lock(&self.state.membership).min_coupled_step(self.sync.mode)
            };
            // The step about to be taken may not put this node more than the bound ahead.
            if let Gate::Closed { .. } = gate.check(step + 1, slowest) {
                let waited = Instant::now();
                self.state.gated.store(true, Ordering::Relaxed);
                self.wait_for_message(&links.inbox)?;
                self.state.gated.store(false, Ordering::Relaxed);
                self.state.sync_stats.add_gate_wait(waited.elapsed());
                continue;
            }
            if let Some(slowest) = slowest {
                self.state
                    .sync_stats
                    .observe_lead((step + 1).saturating_sub(slowest));
            }

            let started = Instant::now();
            if let Some(end) = last_step_end {
                self.state.sync_stats.observe_stall(started - end);
            }
            let outcome = if self.averages_gradients() {
                match self.synchronous_step(links)? {
                    Some(outcome) => outcome,
                    // This replica took over a peer's state instead, or the node stops.
                    None => continue,
                }
            } else {
                self.job.trainer.train_step(&self.job.train)?
            };
            {
                let mut p = lock(&self.state.progress);
                p.step = outcome.step;
                p.epoch = self.job.trainer.epochs_done();
                p.samples_seen += outcome.samples as u64;
                p.loss_ema = if p.loss_ema == 0.0 {
                    outcome.loss
                } else {
                    0.98 * p.loss_ema + 0.02 * outcome.loss
                };
                let loss = p.loss_ema;
                p.loss_curve.record(outcome.step, loss);
            }
            last_step_end = Some(Instant::now());
            if self.sync.slowdown > 1.0 {
                // The testing knob: stand in for a slower machine by idling after each step.
                std::thread::sleep(started.elapsed().mul_f64(self.sync.slowdown - 1.0));
            }
            if self.sync.mode != SyncMode::Solo
                && !self.averages_gradients()
                && outcome.step % self.sync.interval == 0
            {
                self.hand_over_snapshot(links)?;
            }
            if outcome.step % per_epoch == 0 {
                let eval = self.job.trainer.evaluate(&self.job.test)?;
                {
                    let mut p = lock(&self.state.progress);
                    p.test_accuracy = Some(eval.accuracy);
                    p.history.push(AccuracyPoint {
                        unix_s: unix_now(),
                        step: outcome.step,
                        test_accuracy: eval.accuracy,
                    });
                }
                info!(
                    event = events::EPOCH_DONE,
                    epoch = self.job.trainer.epochs_done(),
                    step = outcome.step,
                    test_accuracy = eval.accuracy,
                    "epoch done"
                );
                self.save()?;
            }
        }
        Ok(())
    }

    /// `allreduce` with `every = 1`.
    fn averages_gradients(&self) -> bool {
        self.sync
            .ring
            .as_ref()
            .is_some_and(|r| r.averages_gradients())
    }

    /// One step of synchronous data-parallel SGD: the gradient of this replica's batch goes
    /// to the ring, and the optimizer steps with the mean of every replica's gradient. `None`
    /// when no mean came back (this replica took over a peer's state, or the node stops).
    fn synchronous_step(&mut self, links: &TrainerLinks) -> Result<Option<StepOutcome>> {
        let trainer = &mut self.job.trainer;
        let pending = trainer.compute_gradients(&self.job.train)?;
        let snapshot = Snapshot {
            step: pending.step,
            params: trainer.gradients()?,
        };
        self.reduced_gradient = None;
        self.hand_over(links, snapshot);
        self.wait_for_exchanges(links)?;
        match self.reduced_gradient.take() {
            Some((step, mean)) if step == pending.step && step == self.job.trainer.step_count() => {
                Ok(Some(
                    self.job.trainer.apply_gradients(pending, Some(&mean))?,
                ))
            }
            _ => Ok(None),
        }
    }

    /// Gives the engine this step's snapshot to exchange. The previous exchange must have
    /// ended first (with `sync.overlap` it may still be under way until now), so replicas mix
    /// every `interval` steps as configured even when an exchange takes longer than that.
    fn hand_over_snapshot(&mut self, links: &TrainerLinks) -> Result<()> {
        self.wait_for_exchanges(links)?;
        let snapshot = Snapshot {
            step: self.job.trainer.step_count(),
            params: self.job.trainer.params()?,
        };
        self.hand_over(links, snapshot);
        Ok(())
    }

    /// Counts an exchange in and hands `snapshot` to the engine.
    fn hand_over(&self, links: &TrainerLinks, snapshot: Snapshot) {
        self.state
            .exchanges_in_flight
            .fetch_add(1, Ordering::AcqRel);
        if links.due.try_send(snapshot).is_err() {
            // The engine is gone (shutting down): nothing is in flight.
            self.state
                .exchanges_in_flight
                .fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Waits until no exchange of this replica is under way, applying what the engine sends
    /// meanwhile (snapshot requests, the mix).
    fn wait_for_exchanges(&mut self, links: &TrainerLinks) -> Result<()> {
        let waited = Instant::now();
        while self.state.exchanges_in_flight.load(Ordering::Acquire) > 0 {
            if self.state.is_shutting_down() {
                break;
            }
            self.wait_for_message(&links.inbox)?;
        }
        // The mix is queued before the exchange counts out.
        while let Ok(msg) = links.inbox.try_recv() {
            self.handle(msg)?;
        }
        self.state.sync_stats.add_exchange_wait(waited.elapsed());
        Ok(())
    }

    /// Blocks until the engine sends something (or a heartbeat period passes, so that a
    /// shutdown or a peer timing out is noticed), then applies it.
    fn wait_for_message(&mut self, inbox: &Receiver<ToTrainer>) -> Result<()> {
        match inbox.recv_timeout(HEARTBEAT_INTERVAL) {
            Ok(msg) => self.handle(msg),
            Err(RecvTimeoutError::Timeout) => Ok(()),
            // The engine is gone: the node is shutting down.
            Err(RecvTimeoutError::Disconnected) => {
                self.state.request_shutdown();
                Ok(())
            }
        }
    }

    fn handle(&mut self, msg: ToTrainer) -> Result<()> {
        let averages_gradients = self.averages_gradients();
        let trainer = &mut self.job.trainer;
        match msg {
            ToTrainer::Snapshot(reply) => {
                let _ = reply.send(Snapshot {
                    step: trainer.step_count(),
                    params: trainer.params()?,
                });
            }
            ToTrainer::State(reply) => {
                let _ = reply.send(TrainerState {
                    step: trainer.step_count(),
                    params: trainer.params()?,
                    optimizer: trainer.optimizer_state()?,
                    outer: (!self.anchor.is_empty()).then(|| OuterState {
                        anchor: self.anchor.clone(),
                        anchor_step: self.anchor_step,
                        velocity: self
                            .outer
                            .as_ref()
                            .map(|o| o.velocity().to_vec())
                            .unwrap_or_default(),
                    }),
                });
            }
            ToTrainer::Mix {
                other,
                base,
                weight,
            } => {
                let mut x = trainer.params()?;
                averaging::mix_toward(&mut x, &other, &base, weight);
                trainer.set_params(&x)?;
                self.mixed = true;
            }
            ToTrainer::Subtract(delta) => {
                let mut x = trainer.params()?;
                averaging::subtract(&mut x, &delta);
                trainer.set_params(&x)?;
                self.mixed = true;
            }
            ToTrainer::Reduced { step, mean } => {
                if step != trainer.step_count() {
                    // Not for this replica's current step (it took over a peer's state).
                } else if averages_gradients {
                    self.reduced_gradient = Some((step, mean));
                } else {
                    match self.outer.as_mut() {
                        Some(outer) => outer.step(&mut self.anchor, &mean),
                        None => self.anchor = mean,
                    }
                    trainer.set_params(&self.anchor)?;
                    self.anchor_step = step;
                    self.mixed = true;
                }
            }
            ToTrainer::Adopt { state, adopted } => {
                let from = trainer.step_count();
                match trainer.adopt(&state.params, state.step, &state.optimizer) {
                    // The sync engine checks the sizes first; should one slip through, the
                    // replica keeps its own state and the engine hears nothing back.
                    Err(e @ TrainError::ForeignOptimizerState { .. }) => {
                        warn!(error = %e, "not taking over the peer's state");
                        return Ok(());
                    }
                    result => result?,
                }
                if !self.anchor.is_empty() {
                    // A peer in another mode has no outer state: start the outer loop afresh
                    // from the adopted parameters.
                    let outer_state = state.outer.unwrap_or_else(|| OuterState {
                        anchor: state.params,
                        anchor_step: state.step,
                        velocity: Vec::new(),
                    });
                    // The peer stands at a round's step without that round's average: it waits
                    // in that round, and so must this replica.
                    self.owes_round = outer_state.anchor_step < state.step
                        && state.step.is_multiple_of(self.sync.interval);
                    self.anchor = outer_state.anchor;
                    self.anchor_step = outer_state.anchor_step;
                    if let Some(outer) = self.outer.as_mut() {
                        outer.set_velocity(outer_state.velocity);
                    }
                }
                let to = trainer.step_count();
                self.mixed = true;
                self.publish_clock();
                let _ = adopted.send(());
                info!(from, to, "continuing from a peer's state");
            }
            ToTrainer::Wake => {}
        }
        Ok(())
    }

    /// Tells the rest of the node where the clock stands (at start and after a state sync).
    fn publish_clock(&self) {
        let mut p = lock(&self.state.progress);
        p.step = self.job.trainer.step_count();
        p.epoch = self.job.trainer.epochs_done();
        p.finished = self.job.trainer.is_finished() && p.finished;
    }

    fn save(&mut self) -> Result<()> {
        let trainer = &self.job.trainer;
        let span = tracing::info_span!(
            "checkpoint",
            step = trainer.step_count(),
            bytes = tracing::field::Empty,
        )
        .entered();
        let layout = trainer.network().architecture().layout();
        let ckpt = trainer.checkpoint(&self.job.config_hash)?;
        let path = checkpoint::save(&self.job.checkpoint_dir, &ckpt, layout, self.job.keep)?;
        if let Ok(written) = std::fs::metadata(&path) {
            span.record("bytes", written.len());
        }
        self.store.record_checkpoint(ckpt.step, &path)?;
        self.store
            .set_progress(&self.state.run_id, ckpt.step, ckpt.epoch)?;
        info!(event = events::CHECKPOINT_SAVED, path = %path.display(), step = ckpt.step, "checkpoint saved");
        self.saved_step = ckpt.step;
        self.mixed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use murmur_protocol::network::Keypair;
    use murmur_protocol::ring::TrustList;
    use murmur_protocol::ring::data_plane::DataPlane;
    use murmur_trainer::optim::OptimizerSpec;
    use murmur_trainer::train::TrainSpec;
    use murmur_trainer::{CpuBackend, ModelSpec};

    use tokio::sync::oneshot;

    use super::*;
    use crate::config::ElasticTopology;
    use crate::settings::{Identity, RingSettings};

    const EVERY: u64 = 4;

    /// What one replica's worker borrows, for `allreduce` with `every = 4` and the DiLoCo step.
    struct Parts {
        _dir: tempfile::TempDir,
        state: NodeState,
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
            slowdown: 1.0,
            alpha: None,
            topology: ElasticTopology::Center,
            center: None,
            seed: 1,
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
                trust: TrustList::new([peer_id]),
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
            optimizer_buffers: 1,
        };
        let state = NodeState::new(identity, Duration::from_secs(10), sync.clone());
        Parts {
            state,
            store,
            sync,
            _dir: dir,
        }
    }

    fn job(dir: &std::path::Path) -> TrainerJob<CpuBackend> {
        let train = Dataset::synthetic(64, 1);
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
            test: Dataset::synthetic(16, 2),
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
                worker.handle(ToTrainer::Reduced { step, mean }).unwrap();
            }
        }
    }

    fn bits(worker: &Worker<'_, CpuBackend>) -> Vec<u32> {
        let params = worker.job.trainer.params().unwrap();
        params.iter().map(|v| v.to_bits()).collect()
    }

    /// A replica that takes over a peer waiting on a round owes that round, and with the
    /// peer's momentum, anchor and outer velocity it averages and trains on bitwise like it.
    #[test]
    fn an_adopted_state_averages_and_trains_like_its_source() {
        let (a_parts, b_parts) = (parts(), parts());
        let mut a = Worker::new(
            job(a_parts._dir.path()),
            &a_parts.state,
            &a_parts.store,
            &a_parts.sync,
        )
        .unwrap();
        let mut b = Worker::new(
            job(b_parts._dir.path()),
            &b_parts.state,
            &b_parts.store,
            &b_parts.sync,
        )
        .unwrap();
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
            worker
                .handle(ToTrainer::Reduced {
                    step: 12,
                    mean: mean.clone(),
                })
                .unwrap();
        }
        assert!(bits(&a) == bits(&b), "after the shared round");
        train_alone(&mut a, 8);
        train_alone(&mut b, 8);
        assert!(bits(&a) == bits(&b), "after two more rounds");
    }
}
