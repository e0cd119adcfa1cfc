//! The trainer thread: the OS thread that owns the replica (training never runs on a tokio
//! worker). It takes local steps, waits at the staleness gate, hands a snapshot to the sync
//! engine every `interval` steps, and applies what comes back (mixes, elastic deltas, ring
//! means, a peer's state) between steps, so that a replica is never changed mid-step.
//!
//! It waits on messages only: the gate on the peer table's `watch` (a change after the check
//! wakes it, whenever it comes), an exchange on the oneshot its end arrives on, requests on its
//! inbox, and leaving on the node's token. Between steps it never blocks.

mod outer;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use murmur_protocol::coupling::Coupling;
use murmur_protocol::heartbeat::SyncMode;
use murmur_protocol::network::PeerId;
use murmur_protocol::sync::{Gate, StalenessGate};
use murmur_trainer::averaging;
use murmur_trainer::checkpoint;
use murmur_trainer::data::Samples;
use murmur_trainer::train::{StepOutcome, TrainError};
use murmur_trainer::{Backend, Trainer};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::types::AccuracyPoint;
use crate::events;
use crate::node::messages::{Due, ExchangeEnd, Snapshot, ToTrainer, TrainerState};
use crate::node::pace::Pace;
use crate::readout::{Count, PeerTable, Progress, Readout, record_accuracy, unix_now};
use crate::settings::{Outer, SyncSettings};
use crate::store::Store;
use outer::OuterLoop;

/// How long, net, the staleness gate waits for peers that lag before it stops waiting for
/// them (decision 0039): a peer that claims an old step cannot hold this node for longer.
const GATE_PATIENCE: Duration = Duration::from_secs(10);

/// Everything the trainer thread trains with.
#[derive(Debug)]
pub struct TrainerJob<B: Backend> {
    pub trainer: Trainer<B>,
    pub train: Samples,
    pub test: Samples,
    pub checkpoint_dir: PathBuf,
    pub config_hash: String,
    pub keep: usize,
}

/// The trainer thread's ends of the node's channels.
#[derive(Debug)]
pub struct TrainerLinks {
    pub inbox: mpsc::Receiver<ToTrainer>,
    /// Snapshots due for an exchange, one at a time.
    pub due: mpsc::Sender<Due>,
    pub peers: watch::Receiver<PeerTable>,
    pub progress: watch::Sender<Progress>,
    pub leave: CancellationToken,
}

/// What ended a wait.
enum Woken {
    Message(ToTrainer),
    End(Ended),
    PeersChanged,
    /// The deadline of the wait passed.
    Deadline,
    /// The node leaves, or the engine is gone.
    Leaving,
}

/// An exchange of this replica under way: the end of the snapshot it handed over (`due`) or of
/// one it answered, the step of that snapshot (how late the mix lands is measured from it),
/// and the outer step's move owed since it (decision 0030).
struct Pending {
    due: bool,
    step: u64,
    owed: Option<Vec<f32>>,
    end: oneshot::Receiver<ExchangeEnd>,
}

/// An exchange under way, by the step of its snapshot.
#[derive(Clone, Copy, Debug, PartialEq)]
struct InFlight {
    /// The snapshot handed over (not one answered).
    due: bool,
    step: u64,
    /// Training goes on meanwhile: `sync.overlap`, or an answered partner on a slow link
    /// (decision 0029).
    overlapped: bool,
}

/// A [`Pending`] exchange that ended; an end that never came (the engine dropped its sender)
/// is an `Err`.
struct Ended {
    due: bool,
    step: u64,
    owed: Option<Vec<f32>>,
    end: Result<ExchangeEnd, oneshot::error::RecvError>,
}

impl std::future::Future for Pending {
    type Output = Ended;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Ended> {
        let this = self.get_mut();
        std::pin::Pin::new(&mut this.end).poll(cx).map(|end| Ended {
            due: this.due,
            step: this.step,
            owed: this.owed.take(),
            end,
        })
    }
}

struct Worker<'a, B: Backend> {
    job: TrainerJob<B>,
    readout: &'a Readout,
    store: &'a Store,
    sync: &'a SyncSettings,
    links: TrainerLinks,
    /// Ends of this replica's exchanges under way: the one handed over, and those answered.
    pending: FuturesUnordered<Pending>,
    /// The exchanges under way.
    in_flight: Vec<InFlight>,
    /// A snapshot fell due while the previous one was still in flight (with `overlap`): it
    /// is handed over as soon as that one ends.
    snapshot_owed: bool,
    /// When snapshots fall due.
    pace: Pace,
    /// Parameters changed by peers since the last checkpoint.
    mixed: bool,
    saved_step: u64,
    /// `allreduce`, `every = 1`: the ring's mean gradient, once it is back.
    reduced_gradient: Option<(u64, Vec<f32>)>,
    /// `allreduce`, `every > 1`.
    outer: Option<OuterLoop>,
    /// This replica took over the state of a peer that waits on the round at the adopted
    /// step: it owes that round before it trains on.
    owes_round: bool,
}

/// Trains until the run's epochs are done, then keeps answering the sync engine (a finished
/// replica still answers exchanges) until the node leaves. Checkpoints at every epoch and on
/// the way out, even after an error, so that a restart loses nothing it need not; but never a
/// diverged replica, so that a restart resumes from the last good one.
pub fn run<B: Backend>(
    job: TrainerJob<B>,
    readout: &Readout,
    store: &Store,
    sync: &SyncSettings,
    links: TrainerLinks,
) -> Result<()> {
    let mut worker = Worker::new(job, readout, store, sync, links)?;
    worker.publish_clock();
    let result = worker.train();
    let diverged = result
        .as_ref()
        .err()
        .and_then(|e| e.downcast_ref::<TrainError>())
        .is_some_and(|e| matches!(e, TrainError::Diverged { .. }));
    let step = worker.job.trainer.step_count();
    if !diverged && (step != worker.saved_step || worker.mixed) {
        let saved = worker.save();
        // The error that stopped training matters more than the checkpoint it left behind.
        if result.is_ok() {
            saved?;
        } else if let Err(e) = saved {
            warn!(error = %format!("{e:#}"), "cannot save a checkpoint on the way out");
        }
    }
    result
}

impl<'a, B: Backend> Worker<'a, B> {
    fn new(
        job: TrainerJob<B>,
        readout: &'a Readout,
        store: &'a Store,
        sync: &'a SyncSettings,
        links: TrainerLinks,
    ) -> Result<Self> {
        let saved_step = job.trainer.step_count();
        // A ring averaging parameters keeps an outer loop (plain local SGD too); pairwise
        // modes keep one for the outer step only.
        let outer = match sync.ring.as_ref() {
            Some(ring) => (!ring.averages_gradients()).then_some(ring.outer),
            None => (sync.outer != Outer::Average).then_some(sync.outer),
        };
        let outer = match outer {
            Some(outer) => Some(OuterLoop::new(job.trainer.params()?, saved_step, outer)),
            None => None,
        };
        Ok(Worker {
            job,
            readout,
            store,
            sync,
            links,
            pending: FuturesUnordered::new(),
            in_flight: Vec::new(),
            snapshot_owed: false,
            pace: Pace::new(sync.interval, sync.adapt_interval, saved_step),
            mixed: false,
            saved_step,
            reduced_gradient: None,
            outer,
            owes_round: false,
        })
    }

    /// The clock the staleness gate compares against at `step`, and when to ask again while
    /// it is closed even if no clock moves. Peers on slow links are not waited for (decision
    /// 0029), nor peers that have not caught up or that held the gate too long (decision 0039).
    fn gate_clock(
        &mut self,
        coupling: &mut Option<Coupling<PeerId>>,
        step: u64,
    ) -> (Option<u64>, Option<Instant>) {
        let Some(coupling) = coupling
            .as_mut()
            .filter(|_| self.sync.mode != SyncMode::Solo)
        else {
            return (None, None);
        };
        let links = self.readout.links();
        let clock = {
            // Marks the table seen: a change from here on ends the wait at the gate.
            let table = self.links.peers.borrow_and_update();
            let candidates = table.gate_candidates(self.sync.mode, links);
            coupling.gate_clock(step, candidates, Instant::now())
        };
        for (peer, their_step) in &clock.uncoupled {
            warn!(
                event = events::PEER_UNCOUPLED,
                peer = %peer,
                step,
                their_step,
                "a peer held the staleness gate too long; not waiting for it until it catches up"
            );
            self.readout.counters().count(Count::PeerUncoupled);
        }
        (clock.slowest, clock.decide_at)
    }

    fn leaving(&self) -> bool {
        self.links.leave.is_cancelled()
    }

    fn train(&mut self) -> Result<()> {
        let gate = StalenessGate::new(self.sync.max_staleness);
        let mut coupling = self
            .sync
            .max_staleness
            .map(|bound| Coupling::new(bound, GATE_PATIENCE));
        let per_epoch = self.job.trainer.steps_per_epoch();
        let mut announced_finish = false;
        // When the last step ended: the pause before the next one is a stall (gate, exchange).
        let mut last_step_end: Option<Instant> = None;
        while !self.leaving() {
            self.take_what_arrived()?;
            if std::mem::take(&mut self.owes_round) {
                self.hand_over_snapshot()?;
                continue;
            }
            if self.job.trainer.is_finished() {
                if !announced_finish {
                    self.links.progress.send_modify(|p| p.finished = true);
                    announced_finish = true;
                    info!(
                        event = events::TRAINING_FINISHED,
                        step = self.job.trainer.step_count(),
                        "training finished; still answering peers"
                    );
                }
                self.wait(false)?;
                continue;
            }
            if self.held() {
                // Mixes land at the step they were taken for (decision 0008).
                self.wait_for_exchanges_while(Self::held)?;
                continue;
            }
            let step = self.job.trainer.step_count();
            // With `overlap`, a mix lands at most `max_merge_lag` steps after its snapshot.
            if let Some(oldest) = self.in_flight.iter().map(|x| x.step).min()
                && step.saturating_sub(oldest) >= self.sync.max_merge_lag
            {
                let waited = Instant::now();
                self.wait(false)?;
                self.exchange_waited(waited.elapsed());
                continue;
            }
            let (slowest, decide_at) = self.gate_clock(&mut coupling, step);
            // The step about to be taken may not put this node more than the bound ahead.
            if let Gate::Closed { .. } = gate.check(step + 1, slowest) {
                let waited = Instant::now();
                self.wait_until(true, decide_at)?;
                self.readout.counters().gate_wait(waited.elapsed());
                continue;
            }
            if let Some(slowest) = slowest {
                self.readout
                    .counters()
                    .lead((step + 1).saturating_sub(slowest));
            }

            let started = Instant::now();
            if let Some(end) = last_step_end {
                self.readout.counters().stall(started - end);
            }
            let outcome = if self.sync.averages_gradients() {
                match self.synchronous_step()? {
                    Some(outcome) => outcome,
                    // This replica took over a peer's state instead, or the node leaves.
                    None => continue,
                }
            } else {
                self.job.trainer.train_step(&self.job.train)?
            };
            let epoch = self.job.trainer.epochs_done();
            self.links.progress.send_modify(|p| {
                p.step = outcome.step;
                p.epoch = epoch;
                p.samples_seen += outcome.samples as u64;
                p.loss_ema = if p.loss_ema == 0.0 {
                    outcome.loss
                } else {
                    0.98 * p.loss_ema + 0.02 * outcome.loss
                };
                let loss = p.loss_ema;
                p.loss_curve.record(outcome.step, loss);
            });
            last_step_end = Some(Instant::now());
            if self.sync.slowdown > 1.0 {
                // The testing knob: stand in for a slower machine by idling after each step.
                std::thread::sleep(started.elapsed().mul_f64(self.sync.slowdown - 1.0));
            }
            self.pace.stepped(started.elapsed());
            if self.sync.mode != SyncMode::Solo
                && !self.sync.averages_gradients()
                && self.pace.is_due(outcome.step)
            {
                self.snapshot_owed = true;
                let interval = self.pace.interval();
                self.links.progress.send_modify(|p| p.interval = interval);
            }
            // With `overlap` a due snapshot waits for the previous one's exchange without
            // pausing the trainer: on a link slower than `interval` steps of compute, the
            // interval stretches to the link's pace (decision 0021).
            if self.snapshot_owed && !(self.sync.overlap && self.due_in_flight()) {
                self.snapshot_owed = false;
                self.hand_over_snapshot()?;
            }
            if outcome.step % per_epoch == 0 {
                self.evaluate(outcome.step)?;
                self.save()?;
            }
        }
        Ok(())
    }

    fn evaluate(&mut self, step: u64) -> Result<()> {
        let eval = self.job.trainer.evaluate(&self.job.test)?;
        self.links.progress.send_modify(|p| {
            p.test_accuracy = Some(eval.accuracy);
            p.test_loss = Some(eval.loss);
            let point = AccuracyPoint {
                unix_s: unix_now(),
                step,
                test_accuracy: eval.accuracy,
                test_loss: Some(eval.loss),
            };
            record_accuracy(&mut p.history, point);
        });
        info!(
            event = events::EPOCH_DONE,
            epoch = self.job.trainer.epochs_done(),
            step,
            test_accuracy = eval.accuracy,
            test_loss = eval.loss,
            "epoch done"
        );
        Ok(())
    }

    /// One step of synchronous data-parallel SGD: the gradient of this replica's batch goes
    /// to the ring, and the optimizer steps with the mean of every replica's gradient. `None`
    /// when no mean came back (this replica took over a peer's state, or the node leaves).
    fn synchronous_step(&mut self) -> Result<Option<StepOutcome>> {
        let trainer = &mut self.job.trainer;
        let pending = trainer.compute_gradients(&self.job.train)?;
        let snapshot = Snapshot {
            step: pending.step,
            params: trainer.gradients()?,
        };
        self.reduced_gradient = None;
        self.hand_over(snapshot, None)?;
        self.wait_for_exchanges()?;
        match self.reduced_gradient.take() {
            Some((step, mean)) if step == pending.step && step == self.job.trainer.step_count() => {
                Ok(Some(
                    self.job.trainer.apply_gradients(pending, Some(&mean))?,
                ))
            }
            _ => Ok(None),
        }
    }

    /// Gives the engine this step's snapshot to exchange. Without `sync.overlap` no exchange
    /// is under way here (the trainer paused for them); with it, answered ones may be.
    fn hand_over_snapshot(&mut self) -> Result<()> {
        self.wait_for_exchanges_while(Self::due_in_flight)?;
        let snapshot = Snapshot {
            step: self.job.trainer.step_count(),
            params: self.job.trainer.params()?,
        };
        let owed = self.outer_step_at(&snapshot);
        self.hand_over(snapshot, owed)
    }

    /// The outer step (`sync.outer`) of a pairwise or elastic replica whose parameters were
    /// just taken for an exchange: the move it owes once the exchange ends (decision 0030).
    /// The progress it steps on runs to the point the replica stands at once the moves still
    /// owed to the exchanges under way are paid.
    fn outer_step_at(&mut self, snapshot: &Snapshot) -> Option<Vec<f32>> {
        if self.sync.ring.is_some() || self.outer.is_none() {
            return None;
        }
        let at = self.owed_paid(snapshot.params.clone());
        self.outer.as_mut()?.snapshot_taken(snapshot.step, &at)
    }

    /// `params` moved by every outer move still owed to the exchanges under way: where the
    /// replica stands once they are paid.
    fn owed_paid(&self, mut params: Vec<f32>) -> Vec<f32> {
        for owed in self.pending.iter().filter_map(|p| p.owed.as_ref()) {
            averaging::add(&mut params, owed);
        }
        params
    }

    /// Hands `snapshot` to the engine and waits for its end among the pending ones; `owed`
    /// goes with it (see [`merge`](Self::merge)).
    fn hand_over(&mut self, snapshot: Snapshot, owed: Option<Vec<f32>>) -> Result<()> {
        let (end, ended) = oneshot::channel();
        let step = snapshot.step;
        // Fails only when the engine is gone (the node leaves): nothing is then in flight.
        if self.links.due.try_send(Due { snapshot, end }).is_err() {
            return self.merge(owed, None, 0);
        }
        self.in_flight.push(InFlight {
            due: true,
            step,
            overlapped: self.overlaps(),
        });
        self.pending.push(Pending {
            due: true,
            step,
            owed,
            end: ended,
        });
        Ok(())
    }

    /// Whether the exchange of the snapshot handed over is under way.
    fn due_in_flight(&self) -> bool {
        self.in_flight.iter().any(|x| x.due)
    }

    /// Whether exchanges go on while training does: `sync.overlap`, but for ring rounds
    /// (synchronous whatever it says).
    fn overlaps(&self) -> bool {
        self.sync.overlap && self.sync.ring.is_none()
    }

    /// Whether an exchange under way holds training until its mix is in.
    fn held(&self) -> bool {
        self.in_flight.iter().any(|x| !x.overlapped)
    }

    /// Waits for exchanges while `under_way` says so (or until the node leaves), answering
    /// requests meanwhile; the wait is counted as an exchange wait.
    fn wait_for_exchanges_while(&mut self, under_way: fn(&Self) -> bool) -> Result<()> {
        let waited = Instant::now();
        while under_way(self) && !self.leaving() {
            self.wait(false)?;
        }
        self.exchange_waited(waited.elapsed());
        Ok(())
    }

    /// The trainer waited `took` for exchanges: counted, and told to the pace.
    fn exchange_waited(&mut self, took: std::time::Duration) {
        self.readout.counters().exchange_wait(took);
        self.pace.paused(took);
    }

    /// Waits until no exchange of this replica is under way, answering requests meanwhile.
    fn wait_for_exchanges(&mut self) -> Result<()> {
        let waited = Instant::now();
        while !self.pending.is_empty() && !self.leaving() {
            self.wait(false)?;
        }
        self.exchange_waited(waited.elapsed());
        Ok(())
    }

    /// Applies the requests and exchange ends that arrived, without waiting.
    fn take_what_arrived(&mut self) -> Result<()> {
        while let Ok(msg) = self.links.inbox.try_recv() {
            self.handle(msg)?;
        }
        while let Some(Some(end)) = self.pending.next().now_or_never() {
            self.apply(end)?;
        }
        Ok(())
    }

    /// Blocks until a request arrives, an exchange ends, the node leaves, or (`on_peers`) the
    /// peer table changes; then acts on it.
    fn wait(&mut self, on_peers: bool) -> Result<()> {
        self.wait_until(on_peers, None)
    }

    /// [`Worker::wait`], or until `deadline` when there is one.
    fn wait_until(&mut self, on_peers: bool, deadline: Option<Instant>) -> Result<()> {
        let woken = {
            let links = &mut self.links;
            let pending = &mut self.pending;
            futures::executor::block_on(async {
                tokio::select! {
                    biased;
                    () = links.leave.cancelled() => Woken::Leaving,
                    msg = links.inbox.recv() => msg.map_or(Woken::Leaving, Woken::Message),
                    Some(end) = pending.next(), if !pending.is_empty() => Woken::End(end),
                    changed = links.peers.changed(), if on_peers => {
                        changed.map_or(Woken::Leaving, |()| Woken::PeersChanged)
                    }
                    // Built only when polled: without a deadline no timer (nor runtime) is needed.
                    () = async {
                        match deadline {
                            Some(at) => tokio::time::sleep_until(at.into()).await,
                            None => std::future::pending().await,
                        }
                    } => Woken::Deadline,
                }
            })
        };
        match woken {
            Woken::Message(msg) => self.handle(msg),
            Woken::End(end) => self.apply(end),
            Woken::PeersChanged | Woken::Deadline => Ok(()),
            Woken::Leaving => {
                // The engine is gone: the node is leaving.
                self.links.leave.cancel();
                Ok(())
            }
        }
    }

    /// Applies how an exchange ended; an end that never came (the sender was dropped) changes
    /// nothing.
    fn apply(&mut self, ended: Ended) -> Result<()> {
        if let Some(at) = self
            .in_flight
            .iter()
            .position(|x| x.due == ended.due && x.step == ended.step)
        {
            self.in_flight.swap_remove(at);
        }
        let Ok(end) = ended.end else {
            // No mix; the outer step taken at the snapshot still moves the replica.
            return self.merge(ended.owed, None, 0);
        };
        let trainer = &mut self.job.trainer;
        let lag = trainer.step_count().saturating_sub(ended.step);
        match end {
            ExchangeEnd::Mix {
                other,
                base,
                weight,
            } => {
                let mut delta = vec![0.0; other.len()];
                averaging::mix_toward(&mut delta, &other, &base.params, weight);
                self.merge(ended.owed, Some(delta), lag)?;
            }
            ExchangeEnd::Subtract(delta) => {
                let minus = delta.iter().map(|d| -d).collect();
                self.merge(ended.owed, Some(minus), lag)?;
            }
            ExchangeEnd::Reduced { step, mean } => {
                if step != trainer.step_count() {
                    // Not for this replica's current step (it took over a peer's state).
                } else if let Some(outer) = self.outer.as_mut() {
                    trainer.set_params(outer.averaged(step, mean))?;
                    self.mixed = true;
                } else {
                    self.reduced_gradient = Some((step, mean));
                }
            }
        }
        Ok(())
    }

    /// Adds to the parameters as they are now, whatever steps were taken since the snapshot
    /// (the delta rule): the outer step's move `owed` since the snapshot (`sync.outer`), and
    /// a mix or an elastic delta `mix` that lands `lag` steps after it. Both were computed
    /// from the snapshot alone, so a late mix adds what a paused one would have (decision 0030).
    fn merge(&mut self, owed: Option<Vec<f32>>, mix: Option<Vec<f32>>, lag: u64) -> Result<()> {
        if owed.is_none() && mix.is_none() {
            return Ok(());
        }
        let trainer = &mut self.job.trainer;
        let mut x = trainer.params()?;
        for delta in owed.iter().chain(&mix) {
            averaging::add(&mut x, delta);
        }
        trainer.set_params(&x)?;
        self.mixed = true;
        if let Some(mix) = &mix {
            // Quasi-global momentum counts a rare mix at a share of it (decision 0035).
            trainer.mixed(mix, self.pace.interval())?;
            if let Some(outer) = self.outer.as_mut() {
                outer.mixed(mix);
            }
            self.readout.counters().merged(lag);
        }
        Ok(())
    }

    fn handle(&mut self, msg: ToTrainer) -> Result<()> {
        let trainer = &mut self.job.trainer;
        match msg {
            ToTrainer::Snapshot(reply) => {
                let _ = reply.send(Snapshot {
                    step: trainer.step_count(),
                    params: trainer.params()?,
                });
            }
            ToTrainer::Serve {
                reply,
                end,
                overlap,
            } => {
                let snapshot = Snapshot {
                    step: trainer.step_count(),
                    params: trainer.params()?,
                };
                let step = snapshot.step;
                let owed = self.outer_step_at(&snapshot);
                if reply.send(snapshot).is_ok() {
                    self.in_flight.push(InFlight {
                        due: false,
                        step,
                        overlapped: overlap || self.overlaps(),
                    });
                    self.pending.push(Pending {
                        due: false,
                        step,
                        owed,
                        end,
                    });
                } else {
                    self.merge(owed, None, 0)?;
                }
            }
            ToTrainer::State(reply) => {
                // The replica as it stands once the outer moves it owes are paid: where its
                // anchor is measured from.
                let (step, params) = (trainer.step_count(), trainer.params()?);
                let params = self.owed_paid(params);
                let trainer = &mut self.job.trainer;
                let _ = reply.send(TrainerState {
                    step,
                    params,
                    optimizer: trainer.optimizer_state()?,
                    outer: self.outer.as_ref().map(OuterLoop::state),
                });
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
                // The outer moves owed to exchanges under way belong to the state left behind.
                for pending in self.pending.iter_mut() {
                    pending.owed = None;
                }
                if let Some(outer) = self.outer.as_mut() {
                    let owes =
                        outer.adopt(state.outer, &state.params, state.step, self.sync.interval);
                    // Only a ring member waits in a round; gossip has none to owe.
                    self.owes_round = owes && self.sync.ring.is_some();
                }
                let to = trainer.step_count();
                self.pace.restart_at(to);
                self.mixed = true;
                self.publish_clock();
                let _ = adopted.send(());
                info!(from, to, "continuing from a peer's state");
            }
        }
        Ok(())
    }

    /// Tells the rest of the node where the clock stands (at start and after a state sync).
    fn publish_clock(&self) {
        let trainer = &self.job.trainer;
        let (step, epoch) = (trainer.step_count(), trainer.epochs_done());
        let finished = trainer.is_finished();
        self.links.progress.send_modify(|p| {
            p.step = step;
            p.epoch = epoch;
            p.finished = finished && p.finished;
        });
    }

    fn save(&mut self) -> Result<()> {
        let trainer = &self.job.trainer;
        let span = tracing::info_span!(
            "checkpoint",
            step = trainer.step_count(),
            bytes = tracing::field::Empty,
        )
        .entered();
        let layout = trainer.layout();
        let ckpt = trainer.checkpoint(&self.job.config_hash)?;
        if !ckpt.is_finite() {
            anyhow::bail!(
                "not saving the replica at step {}: it holds values that are not finite \
                 (training diverged); the newest checkpoint is the last good one",
                ckpt.step
            );
        }
        let path = checkpoint::save(&self.job.checkpoint_dir, &ckpt, layout, self.job.keep)?;
        if let Ok(written) = std::fs::metadata(&path) {
            span.record("bytes", written.len());
        }
        self.store
            .set_progress(&self.readout.identity().run_id, ckpt.step, ckpt.epoch)?;
        info!(event = events::CHECKPOINT_SAVED, path = %path.display(), step = ckpt.step, "checkpoint saved");
        self.saved_step = ckpt.step;
        self.mixed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
