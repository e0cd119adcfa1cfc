//! The replica's driver: it does what the [`ReplicaLoop`] says against the [`Replica`] and the
//! node's channels: takes local steps, waits at the staleness gate, hands a snapshot to the
//! sync engine when one falls due, and lands what comes back (mixes, elastic deltas, ring
//! means, a peer's state) between steps, so that a replica is never changed mid-step.
//!
//! It runs on the thread that trains, never on a tokio worker: a thread of its own for Murmur's
//! trainer ([`ReplicaDriver::run`]), or the caller's own thread for a trainer whose loop is its
//! own (a PyTorch script: the node lends it the driver, decision 0071), which asks for its next
//! turn ([`ReplicaDriver::next_turn`]) after each step it took ([`ReplicaDriver::stepped`]).
//! Its waits are futures, which those threads block on; the simulator, whose replicas take no
//! time to step, runs the same driver as a task instead ([`ReplicaDriver::drive`]), so that
//! the runtime's paused clock sees every wait.
//!
//! It waits on messages only: the gate on the peer table's `watch` (a change after the check
//! wakes it, whenever it comes), an exchange on the oneshot its end arrives on, requests on its
//! inbox, and leaving on the node's token. Between steps it never blocks.

use std::sync::Arc;

use anyhow::Result;
use futures::FutureExt;
use futures::stream::{FuturesUnordered, StreamExt};
use murmur_sync::replica::{
    ExchangeEnd, ExchangeId, Landed, Landing, LoopSettings, Next, ReplicaLoop, Snapshot, Wait,
    WaitFor,
};
use murmur_sync::settings::SyncSettings;
use murmur_sync::table::PeerTable;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Adoption, Diverged, Replica, ReplicaState, StepReport};
use crate::api::types::AccuracyPoint;
use crate::clock;
use crate::events;
use crate::node::messages::{Due, SyncState, ToReplica};
use crate::readout::{Count, Progress, Readout, record_accuracy, unix_now};
use crate::store::Store;

/// The driver's ends of the node's channels.
#[derive(Debug)]
pub struct ReplicaPorts {
    pub inbox: mpsc::Receiver<ToReplica>,
    /// Snapshots due for an exchange, one at a time.
    pub due: mpsc::Sender<Due>,
    pub peers: watch::Receiver<PeerTable>,
    pub progress: watch::Sender<Progress>,
    pub leave: CancellationToken,
}

/// What the replica does next, as [`ReplicaDriver::next_turn`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Take one local step, then report it ([`ReplicaDriver::stepped`]).
    Step,
    /// `allreduce` with `every = 1`: the step goes through the ring
    /// ([`ReplicaDriver::synchronous_step`]).
    SynchronousStep,
    /// The wait went past the caller's deadline: ask again (after looking at signals, say).
    Pending,
    /// The node leaves: no more steps.
    Leaving,
}

/// What ended a wait.
enum Woken {
    Message(ToReplica),
    End(Ended),
    PeersChanged,
    /// The deadline of the wait passed.
    Deadline,
    /// The node leaves, or the engine is gone.
    Leaving,
}

/// The end of an exchange of this replica under way: of the snapshot it handed over, or of
/// one it answered.
struct Pending {
    id: ExchangeId,
    end: oneshot::Receiver<ExchangeEnd>,
}

/// A [`Pending`] exchange that ended; an end that never came (the engine dropped its sender)
/// is an `Err`.
struct Ended {
    id: ExchangeId,
    end: Result<ExchangeEnd, oneshot::error::RecvError>,
}

impl std::future::Future for Pending {
    type Output = Ended;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Ended> {
        let this = self.get_mut();
        std::pin::Pin::new(&mut this.end)
            .poll(cx)
            .map(|end| Ended { id: this.id, end })
    }
}

/// One replica's driver: the replica, its rules, and the node's channels.
pub struct ReplicaDriver {
    replica: Box<dyn Replica>,
    rules: ReplicaLoop,
    readout: Readout,
    store: Arc<Store>,
    sync: SyncSettings,
    ports: ReplicaPorts,
    /// Ends of this replica's exchanges under way.
    pending: FuturesUnordered<Pending>,
    /// Parameters changed by peers since the last checkpoint.
    mixed: bool,
    saved_step: u64,
    /// When the last turn to step was given: the step's time runs from it.
    turn_given: Option<Instant>,
    /// When the last step ended: the pause before the next one is a stall (gate, exchange).
    last_step_end: Option<Instant>,
    /// The runtime the driver was built in: its timers end the waits, on whichever thread
    /// drives (the caller's, when the node lends its driver).
    runtime: Option<tokio::runtime::Handle>,
}

impl std::fmt::Debug for ReplicaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaDriver")
            .field("replica", self.replica.describe())
            .field("rules", &self.rules)
            .finish_non_exhaustive()
    }
}

impl ReplicaDriver {
    /// The driver of `replica`, at the clock it stands at, which it tells the rest of the node.
    /// Built inside a multi-threaded runtime, it ends its waits with that runtime's timers;
    /// without one, only waits without an end (`next_turn(None)`) work.
    pub fn new(
        mut replica: Box<dyn Replica>,
        readout: Readout,
        store: Arc<Store>,
        sync: SyncSettings,
        ports: ReplicaPorts,
    ) -> Result<Self> {
        let step = replica.clock().step;
        let rules = ReplicaLoop::new(LoopSettings::of(&sync), step, || replica.params())?;
        let driver = ReplicaDriver {
            replica,
            rules,
            readout,
            store,
            sync,
            ports,
            pending: FuturesUnordered::new(),
            mixed: false,
            saved_step: step,
            turn_given: None,
            last_step_end: None,
            runtime: tokio::runtime::Handle::try_current().ok(),
        };
        driver.publish_clock();
        Ok(driver)
    }

    /// Trains on this thread until the replica is finished, then keeps answering the sync
    /// engine (a finished replica still answers exchanges) until the node leaves; then
    /// [`finish`](Self::finish)es.
    pub fn run(mut self) -> Result<()> {
        let runtime = self.runtime.clone();
        let _timers = runtime.as_ref().map(tokio::runtime::Handle::enter);
        let trained = futures::executor::block_on(self.train(|| Duration::ZERO));
        self.finish(trained)
    }

    /// [`run`](Self::run), as a task of the runtime, for the simulator's replicas: their steps
    /// take no time, so each is made to take `step_time()` of the runtime's (paused) clock.
    pub async fn drive(mut self, step_time: impl FnMut() -> Duration) -> Result<()> {
        let trained = self.train(step_time).await;
        self.finish(trained)
    }

    async fn train(&mut self, mut step_time: impl FnMut() -> Duration) -> Result<()> {
        loop {
            let turn = self.turn(None).await?;
            if matches!(turn, Turn::Step | Turn::SynchronousStep) {
                let took = step_time();
                if !took.is_zero() {
                    tokio::time::sleep(took).await;
                }
            }
            let report = match turn {
                Turn::Leaving => return Ok(()),
                Turn::Pending => continue,
                Turn::Step => self.replica.step()?,
                Turn::SynchronousStep => self.step_through_the_ring().await?,
            };
            // None: this replica took over a peer's state instead, it finished, or the node
            // leaves.
            if let Some(report) = report {
                self.after_step(report).await?;
            }
        }
    }

    /// Blocks this thread on `work`, with the runtime's timers at hand.
    fn block_on<T>(&mut self, work: impl AsyncFnOnce(&mut Self) -> T) -> T {
        let runtime = self.runtime.clone();
        let _timers = runtime.as_ref().map(tokio::runtime::Handle::enter);
        futures::executor::block_on(work(self))
    }

    /// Ends the driving: a last checkpoint, even after an error (`trained`), so that a restart
    /// loses nothing it need not; but never of a replica that diverged, so that a restart
    /// resumes from the last good one. Returns the first error.
    pub fn finish(mut self, trained: Result<()>) -> Result<()> {
        let diverged = trained
            .as_ref()
            .err()
            .is_some_and(|e| e.downcast_ref::<Diverged>().is_some());
        let step = self.replica.clock().step;
        if !diverged && (step != self.saved_step || self.mixed) {
            let saved = self.save();
            // The error that stopped training matters more than the checkpoint it left behind.
            if trained.is_ok() {
                saved?;
            } else if let Err(e) = saved {
                warn!(error = %format!("{e:#}"), "cannot save a checkpoint on the way out");
            }
        }
        trained
    }

    /// The replica, for a caller that drives its steps.
    pub fn replica(&mut self) -> &mut dyn Replica {
        self.replica.as_mut()
    }

    fn leaving(&self) -> bool {
        self.ports.leave.is_cancelled()
    }

    /// Does what the rules say (hand over, wait, answer peers, land mixes) until the replica is
    /// to take a step, or the node leaves, or (with `deadline`) a wait goes past it.
    pub fn next_turn(&mut self, deadline: Option<Instant>) -> Result<Turn> {
        self.block_on(async |driver| driver.turn(deadline).await)
    }

    async fn turn(&mut self, deadline: Option<Instant>) -> Result<Turn> {
        while !self.leaving() {
            self.take_what_arrived()?;
            let clock = self.replica.clock();
            let decision = {
                let (ports, mode) = (&mut self.ports, self.sync.mode.name());
                self.rules.next(clock, clock::now(), || {
                    // Marks the table seen: a change from here on (a clock, or a peer found on
                    // a slow link) ends the wait at the gate.
                    let table = ports.peers.borrow_and_update();
                    table.gate_candidates(mode).collect()
                })
            };
            for (peer, their_step) in &decision.uncoupled {
                warn!(
                    event = events::PEER_UNCOUPLED,
                    peer = %peer,
                    step = clock.step,
                    their_step,
                    "a peer held the staleness gate too long; not waiting for it until it catches up"
                );
                self.readout.counters().count(Count::PeerUncoupled);
            }
            let turn = match decision.next {
                Next::HandOver => {
                    self.hand_over_snapshot().await?;
                    continue;
                }
                Next::Wait(wait) => {
                    if deadline.is_some_and(|d| clock::now() >= d) {
                        return Ok(Turn::Pending);
                    }
                    self.wait_for(wait, deadline).await?;
                    continue;
                }
                Next::Step => Turn::Step,
                Next::SynchronousStep => Turn::SynchronousStep,
            };
            if let Some(lead) = decision.lead {
                self.readout.counters().lead(lead);
            }
            let now = clock::now();
            if let Some(end) = self.last_step_end {
                self.readout.counters().stall(now - end);
            }
            self.turn_given = Some(now);
            return Ok(turn);
        }
        Ok(Turn::Leaving)
    }

    /// The replica took the step its last turn asked for: what the step did, and what follows
    /// (a due snapshot handed over, an epoch's evaluation and checkpoint).
    pub fn stepped(&mut self, report: StepReport) -> Result<()> {
        self.block_on(async |driver| driver.after_step(report).await)
    }

    async fn after_step(&mut self, report: StepReport) -> Result<()> {
        let started = self.turn_given.take().unwrap_or_else(clock::now);
        self.record_step(&report);
        self.last_step_end = Some(clock::now());
        if self.sync.slowdown > 1.0 {
            // The testing knob: stand in for a slower machine by idling after each step.
            tokio::time::sleep(clock::since(started).mul_f64(self.sync.slowdown - 1.0)).await;
        }
        let (peers, mode) = (&self.ports.peers, self.sync.mode.name());
        let after = self.rules.stepped(report.step, clock::since(started), || {
            peers.borrow().coupled(mode).next().is_none()
        });
        if let Some(interval) = after.due_with_interval {
            self.ports.progress.send_modify(|p| p.interval = interval);
        }
        if after.hand_over {
            self.hand_over_snapshot().await?;
        }
        if self.replica.describe().ends_epoch(report.step) {
            self.evaluate(report.step)?;
            self.save()?;
        }
        Ok(())
    }

    fn record_step(&self, report: &StepReport) {
        let epoch = self.replica.describe().epochs_at(report.step);
        self.ports.progress.send_modify(|p| {
            p.step = report.step;
            p.epoch = epoch;
            p.samples_seen += report.samples;
            if let Some(loss) = report.loss {
                p.loss_ema = if p.loss_ema == 0.0 {
                    loss
                } else {
                    0.98 * p.loss_ema + 0.02 * loss
                };
            }
            let loss = p.loss_ema;
            p.loss_curve.record(report.step, loss);
        });
    }

    async fn wait_for(&mut self, wait: Wait, deadline: Option<Instant>) -> Result<()> {
        let waited = clock::now();
        let until = match (wait.until, deadline) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        match wait.why {
            WaitFor::Finished => {
                // Said once per finish: a state taken over behind the end clears `finished`
                // (`publish_clock`), and the replica says it again when it gets there.
                if !self.ports.progress.borrow().finished {
                    self.ports.progress.send_modify(|p| p.finished = true);
                    info!(
                        event = events::TRAINING_FINISHED,
                        step = self.replica.clock().step,
                        "training finished; still answering peers"
                    );
                }
                self.wait_until(false, until).await
            }
            WaitFor::Exchanges => {
                // Mixes land at the step they were taken for (decision 0008), or at most
                // `max_merge_lag` steps after it.
                self.wait_until(false, until).await?;
                self.exchange_waited(waited);
                Ok(())
            }
            WaitFor::Gate => {
                self.wait_until(wait.on_peers, until).await?;
                self.readout.counters().gate_wait(clock::since(waited));
                Ok(())
            }
        }
    }

    fn evaluate(&mut self, step: u64) -> Result<()> {
        let Some(eval) = self.replica.evaluate()? else {
            return Ok(());
        };
        self.ports.progress.send_modify(|p| {
            p.test_accuracy = Some(eval.accuracy);
            p.test_loss = eval.loss;
            let point = AccuracyPoint {
                unix_s: unix_now(),
                step,
                test_accuracy: eval.accuracy,
                test_loss: eval.loss,
            };
            record_accuracy(&mut p.history, point);
        });
        info!(
            event = events::EPOCH_DONE,
            epoch = self.replica.describe().epochs_at(step),
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
    pub fn synchronous_step(&mut self) -> Result<Option<StepReport>> {
        self.block_on(async |driver| driver.step_through_the_ring().await)
    }

    /// [`synchronous_step`](Self::synchronous_step), waiting on futures.
    async fn step_through_the_ring(&mut self) -> Result<Option<StepReport>> {
        let (step, gradient) = self.replica.gradient()?;
        let id = self.rules.gradient_handed_over(step);
        self.send_due(
            id,
            Snapshot {
                step,
                params: gradient,
            },
        )?;
        let waited = clock::now();
        while !self.pending.is_empty() && !self.leaving() {
            self.wait_until(false, None).await?;
        }
        self.exchange_waited(waited);
        match self.rules.take_mean_gradient(step) {
            Some(mean) if step == self.replica.clock().step => {
                Ok(Some(self.replica.apply_mean_gradient(&mean)?))
            }
            _ => Ok(None),
        }
    }

    /// Gives the engine this step's snapshot to exchange, once the last one's exchange ended.
    async fn hand_over_snapshot(&mut self) -> Result<()> {
        let waited = clock::now();
        while self.rules.due_in_flight() && !self.leaving() {
            self.wait_until(false, None).await?;
        }
        self.exchange_waited(waited);
        let step = self.replica.clock().step;
        let params = self.replica.params()?;
        let id = self.rules.handed_over(step, &params);
        self.send_due(id, Snapshot { step, params })
    }

    /// Hands `snapshot` to the engine; its end comes back among the pending ones.
    fn send_due(&mut self, id: ExchangeId, snapshot: Snapshot) -> Result<()> {
        let (end, ended) = oneshot::channel();
        let step = snapshot.step;
        let due = Due {
            snapshot,
            end,
            step_secs: self.rules.step_secs(),
        };
        // Fails only when the engine is gone (the node leaves): nothing is then in flight.
        if self.ports.due.try_send(due).is_err() {
            let landed = self.rules.ended(id, None, step);
            return self.land(landed);
        }
        self.pending.push(Pending { id, end: ended });
        Ok(())
    }

    /// The replica waited since `since` for exchanges: counted, and told to the pace.
    fn exchange_waited(&mut self, since: Instant) {
        let took = clock::since(since);
        self.readout.counters().exchange_wait(took);
        self.rules.exchange_waited(took);
    }

    /// Applies the exchange ends and requests that arrived, without waiting. Ends land first:
    /// a compressed mix is read off the pair's copies into a model-sized buffer as it lands
    /// (decision 0092), let go before a request's snapshot takes another (decision 0093).
    fn take_what_arrived(&mut self) -> Result<()> {
        while let Some(Some(ended)) = self.pending.next().now_or_never() {
            self.apply(ended)?;
        }
        while let Ok(msg) = self.ports.inbox.try_recv() {
            self.handle(msg)?;
        }
        Ok(())
    }

    /// Waits until a request arrives, an exchange ends, the node leaves, `deadline` passes
    /// or (`on_peers`) the peer table changes; then acts on it.
    async fn wait_until(&mut self, on_peers: bool, deadline: Option<Instant>) -> Result<()> {
        let woken = {
            let ports = &mut self.ports;
            let pending = &mut self.pending;
            tokio::select! {
                biased;
                () = ports.leave.cancelled() => Woken::Leaving,
                // Ends before requests, as in `take_what_arrived`.
                Some(end) = pending.next(), if !pending.is_empty() => Woken::End(end),
                msg = ports.inbox.recv() => msg.map_or(Woken::Leaving, Woken::Message),
                changed = ports.peers.changed(), if on_peers => {
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
        };
        match woken {
            Woken::Message(msg) => self.handle(msg),
            Woken::End(end) => self.apply(end),
            Woken::PeersChanged | Woken::Deadline => Ok(()),
            Woken::Leaving => {
                // The engine is gone: the node is leaving.
                self.ports.leave.cancel();
                Ok(())
            }
        }
    }

    /// Lands how an exchange ended; an end that never came (the sender was dropped) brings
    /// no mix.
    fn apply(&mut self, ended: Ended) -> Result<()> {
        let step = self.replica.clock().step;
        let landed = self.rules.ended(ended.id, ended.end.ok(), step);
        self.land(landed)
    }

    fn land(&mut self, landed: Landed) -> Result<()> {
        for landing in landed.landings {
            match landing {
                Landing::Add { delta, mixed_over } => self.replica.add(delta, mixed_over)?,
                Landing::AddStep(landing) => self.replica.add_step(landing)?,
                Landing::Set(params) => self.replica.set_params(params)?,
            }
            self.mixed = true;
        }
        if let Some(lag) = landed.lag {
            self.readout.counters().merged(lag);
        }
        Ok(())
    }

    fn handle(&mut self, msg: ToReplica) -> Result<()> {
        match msg {
            ToReplica::Snapshot(reply) => {
                let step = self.replica.clock().step;
                let params = self.replica.params()?;
                let _ = reply.send(Snapshot { step, params });
            }
            ToReplica::Serve {
                reply,
                end,
                overlap,
            } => {
                let step = self.replica.clock().step;
                let params = self.replica.params()?;
                let id = self.rules.answered(step, &params, overlap);
                if reply.send(Snapshot { step, params }).is_ok() {
                    self.pending.push(Pending { id, end });
                } else {
                    let landed = self.rules.ended(id, None, step);
                    self.land(landed)?;
                }
            }
            ToReplica::State { optimizer, reply } => {
                let state = self.replica.state()?;
                // The replica as it stands once the outer moves it owes are paid: where its
                // anchor is measured from.
                let (params, outer) = self.rules.state_of(state.params);
                let _ = reply.send(SyncState {
                    replica: ReplicaState {
                        step: state.step,
                        params,
                        // Only a peer of the same optimizer can take its state.
                        optimizer: state.optimizer.filter(|o| o.names() == optimizer),
                    },
                    outer,
                });
            }
            ToReplica::Adopt { state, adopted } => self.adopt(state, adopted)?,
        }
        Ok(())
    }

    fn adopt(
        &mut self,
        state: SyncState,
        adopted: oneshot::Sender<Result<(), String>>,
    ) -> Result<()> {
        let from = self.replica.clock().step;
        let SyncState {
            replica: theirs,
            outer,
        } = state;
        let step = theirs.step;
        let whole = theirs.optimizer.is_some();
        // The outer loop starts afresh from the adopted parameters when the peer had none.
        let params = if self.rules.keeps_outer() {
            theirs.params.clone()
        } else {
            Vec::new()
        };
        match self.replica.adopt(theirs)? {
            Adoption::Refused(why) => {
                warn!(error = %why, "not taking over the peer's state");
                let _ = adopted.send(Err(why));
                return Ok(());
            }
            Adoption::Whole | Adoption::ParametersOnly => {}
        }
        self.rules.adopted(step, &params, outer);
        self.mixed = true;
        self.publish_clock();
        let _ = adopted.send(Ok(()));
        let to = self.replica.clock().step;
        info!(
            from,
            to,
            optimizer = whole,
            "continuing from a peer's state"
        );
        Ok(())
    }

    /// Tells the rest of the node where the clock stands (at start and after a state sync).
    fn publish_clock(&self) {
        let clock = self.replica.clock();
        let epoch = self.replica.describe().epochs_at(clock.step);
        self.ports.progress.send_modify(|p| {
            p.step = clock.step;
            p.epoch = epoch;
            p.finished = clock.finished && p.finished;
        });
    }

    fn save(&mut self) -> Result<()> {
        let step = self.replica.clock().step;
        let span =
            tracing::info_span!("checkpoint", step, bytes = tracing::field::Empty,).entered();
        let Some(saved) = self.replica.checkpoint()? else {
            return Ok(());
        };
        span.record("bytes", saved.bytes);
        let epoch = self.replica.describe().epochs_at(saved.step);
        self.store
            .set_progress(&self.readout.identity().run_id, saved.step, epoch)?;
        info!(event = events::CHECKPOINT_SAVED, path = %saved.path.display(), step = saved.step, "checkpoint saved");
        self.saved_step = saved.step;
        self.mixed = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests;
