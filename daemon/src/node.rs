//! A running peer: the network task, the trainer thread, the heartbeat and membership loop,
//! and the control API, wired together by [`run`].
//!
//! Threads and tasks: the trainer owns a dedicated OS thread (training never runs on a tokio
//! worker); the swarm task, the API server and the heartbeat loop are tokio tasks. They share
//! [`NodeState`] (short `Mutex` sections, never held across an await) and one shutdown flag.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role};
use murmur_protocol::membership::{Change, Membership};
use murmur_protocol::network::{self, Client, Multiaddr, NetworkConfig, NetworkEvent, PeerId};
use murmur_protocol::scoring::{PeerScores, Verdict};
use murmur_trainer::{Backend, checkpoint};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::api::{self, HistoryReport, PeerReport, StatusReport};
use crate::store::{DataDir, Store};
use crate::sync::{self, CenterFile, SyncSettings, SyncStats};
use crate::worker::{self, ToTrainer, TrainerJob, TrainerLinks};
use crate::{events, metrics};

/// How often a node publishes its heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// How often the clock is checked for an early heartbeat.
const CLOCK_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Offences within [`OFFENCE_WINDOW`] after which a peer is blocked.
const BLOCK_AFTER_OFFENCES: u32 = 3;
const OFFENCE_WINDOW: Duration = Duration::from_secs(60);
/// Capacity of the channel that carries offences from stream handlers to the main loop.
const OFFENCE_QUEUE: usize = 64;
/// Capacity of the sync engine's queue to the trainer thread.
const TRAINER_QUEUE: usize = 16;

/// What the trainer thread reports.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub test_accuracy: Option<f64>,
    /// Every evaluation: when, at which step, how accurate.
    pub history: Vec<AccuracyPoint>,
    /// The training loss over the run, thinned to a bounded number of points.
    pub loss_curve: LossCurve,
    pub finished: bool,
}

impl Progress {
    /// The figures without the run's curves: what readers that only need the latest values
    /// copy out from under the lock.
    pub fn figures(&self) -> Progress {
        Progress {
            history: Vec::new(),
            loss_curve: LossCurve::default(),
            ..*self
        }
    }
}

/// The loss (moving average) at one step.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossPoint {
    pub step: u64,
    pub loss: f32,
}

/// The training loss of a whole run in at most [`LossCurve::CAPACITY`] points: every
/// `stride`-th step, the stride doubling (and every other point dropped) whenever the curve is
/// full, so a long run costs as little memory as a short one.
#[derive(Clone, Debug, PartialEq)]
pub struct LossCurve {
    points: Vec<LossPoint>,
    stride: u64,
}

impl Default for LossCurve {
    fn default() -> Self {
        LossCurve {
            points: Vec::new(),
            stride: 1,
        }
    }
}

impl LossCurve {
    pub const CAPACITY: usize = 1024;

    pub fn record(&mut self, step: u64, loss: f32) {
        if !step.is_multiple_of(self.stride) {
            return;
        }
        self.points.push(LossPoint { step, loss });
        if self.points.len() > Self::CAPACITY {
            self.stride *= 2;
            let stride = self.stride;
            self.points.retain(|p| p.step.is_multiple_of(stride));
        }
    }

    pub fn points(&self) -> &[LossPoint] {
        &self.points
    }
}

/// One test evaluation of the replica.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AccuracyPoint {
    /// Seconds since the Unix epoch.
    pub unix_s: f64,
    pub step: u64,
    pub test_accuracy: f64,
}

/// State shared by the node's tasks and read by the control API.
#[derive(Debug)]
pub struct NodeState {
    pub peer_id: PeerId,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    pub device: String,
    pub epochs: u64,
    pub sync: SyncSettings,
    started: Instant,
    started_unix_s: f64,
    pub(crate) progress: Mutex<Progress>,
    pub(crate) membership: Mutex<Membership<PeerId>>,
    listen: Mutex<Vec<Multiaddr>>,
    rejected: AtomicU64,
    pub(crate) blocked: Mutex<BTreeSet<PeerId>>,
    /// Tensor bytes received in valid frames.
    pub(crate) bytes_in: AtomicU64,
    /// Values in this model's flat parameter buffer.
    pub(crate) param_count: usize,
    /// State buffers of the run's optimizer, each `param_count` long (sent in a state sync).
    pub(crate) optimizer_buffers: usize,
    /// What this node announces in its heartbeat.
    pub(crate) role: Mutex<Role>,
    /// The elastic center as this node sees it.
    pub(crate) center: Mutex<Option<PeerId>>,
    /// The trainer waits at the staleness gate (heartbeats should wake it).
    pub(crate) gated: AtomicBool,
    /// Exchanges of this replica under way: the one the trainer handed over and one this node
    /// answers. The trainer pauses while there are any, unless `sync.overlap`.
    pub(crate) exchanges_in_flight: AtomicU32,
    pub(crate) sync_stats: SyncStats,
    /// Signalled when a peer joins (a joiner decides on state sync at once).
    pub(crate) peer_joined: tokio::sync::Notify,
    shutdown: watch::Sender<bool>,
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Locks a mutex, carrying on with the data if a panicking thread poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a node is: who it is and which run and model it trains.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    pub peer_id: PeerId,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    /// The device the replica trains on, as its backend names it.
    pub device: String,
    pub epochs: u64,
    /// Values in the model's flat parameter buffer.
    pub param_count: usize,
    /// State buffers of the run's optimizer (one for SGD, two for AdamW).
    pub optimizer_buffers: usize,
}

impl NodeState {
    pub fn new(identity: NodeIdentity, peer_timeout: Duration, sync: SyncSettings) -> Self {
        let NodeIdentity {
            peer_id,
            run_id,
            fingerprint,
            model,
            device,
            epochs,
            param_count,
            optimizer_buffers,
        } = identity;
        NodeState {
            peer_id,
            run_id,
            fingerprint,
            model,
            device,
            epochs,
            sync,
            started: Instant::now(),
            started_unix_s: unix_now(),
            progress: Mutex::new(Progress::default()),
            membership: Mutex::new(Membership::new(peer_timeout)),
            listen: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            blocked: Mutex::new(BTreeSet::new()),
            bytes_in: AtomicU64::new(0),
            param_count,
            optimizer_buffers,
            role: Mutex::new(Role::Worker),
            center: Mutex::new(None),
            gated: AtomicBool::new(false),
            exchanges_in_flight: AtomicU32::new(0),
            sync_stats: SyncStats::default(),
            peer_joined: tokio::sync::Notify::new(),
            shutdown: watch::channel(false).0,
        }
    }

    /// Messages from peers refused by validation.
    pub(crate) fn rejected_messages(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Time since this node started.
    pub(crate) fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    pub fn request_shutdown(&self) {
        self.shutdown.send_replace(true);
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown.borrow()
    }

    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown.subscribe()
    }

    pub fn status(&self) -> StatusReport {
        let (p, history) = {
            let p = lock(&self.progress);
            (p.figures(), p.history.clone())
        };
        // Before the report: a lock guard taken inside its expression would be held to its end.
        let peers = self.peers();
        let state = if self.is_shutting_down() {
            "leaving"
        } else if p.finished {
            "finished"
        } else {
            "training"
        };
        StatusReport {
            peer_id: self.peer_id.to_string(),
            run_id: self.run_id.clone(),
            fingerprint: self.fingerprint.clone(),
            model: self.model.clone(),
            device: self.device.clone(),
            state: state.to_owned(),
            step: p.step,
            epoch: p.epoch,
            epochs: self.epochs,
            loss_ema: p.loss_ema,
            test_accuracy: p.test_accuracy,
            samples_seen: p.samples_seen,
            live_peers: peers.len(),
            peers,
            listen: lock(&self.listen).iter().map(ToString::to_string).collect(),
            rejected_messages: self.rejected_messages(),
            tensor_bytes_in: self.bytes_in.load(Ordering::Relaxed),
            blocked_peers: lock(&self.blocked).len(),
            uptime_s: self.uptime().as_secs_f64(),
            started_unix_s: self.started_unix_s,
            history,
            sync: self
                .sync_stats
                .report(&self.sync, *lock(&self.role), *lock(&self.center)),
        }
    }

    pub fn history(&self) -> HistoryReport {
        let p = lock(&self.progress);
        HistoryReport {
            loss: p.loss_curve.points().to_vec(),
            accuracy: p.history.clone(),
        }
    }

    pub fn peers(&self) -> Vec<PeerReport> {
        let now = Instant::now();
        let ours = lock(&self.progress).step;
        lock(&self.membership)
            .peers()
            .map(|(peer, v)| PeerReport {
                peer_id: peer.to_string(),
                step: v.step,
                epoch: v.epoch,
                loss_ema: v.loss_ema,
                samples_seen: v.samples_seen,
                mode: format!("{:?}", v.mode).to_lowercase(),
                role: format!("{:?}", v.role).to_lowercase(),
                last_seen_ms: now.saturating_duration_since(v.last_seen).as_millis() as u64,
                staleness: ours as i64 - v.step as i64,
            })
            .collect()
    }

    fn heartbeat(&self, leaving: bool) -> Heartbeat {
        let p = lock(&self.progress).figures();
        Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: self.run_id.clone(),
            fingerprint: self.fingerprint.clone(),
            step: p.step,
            epoch: p.epoch,
            loss_ema: p.loss_ema,
            samples_seen: p.samples_seen,
            mode: self.sync.mode,
            role: *lock(&self.role),
            leaving,
            finished: p.finished,
        }
    }
}

/// How a node joins.
#[derive(Debug)]
pub struct NodeSetup<B: Backend> {
    pub data: DataDir,
    pub store: Store,
    pub network: NetworkConfig,
    pub api_addr: String,
    pub job: TrainerJob<B>,
    pub state: Arc<NodeState>,
    /// The config path, for the line that tells others how to join.
    pub config_path: PathBuf,
}

/// Runs the node until SIGINT, SIGTERM or `POST /leave`; then drains and returns.
pub async fn run<B: Backend>(setup: NodeSetup<B>) -> Result<()> {
    let NodeSetup {
        data,
        store,
        network: net_config,
        api_addr,
        job,
        state,
        config_path,
    } = setup;
    let store = Arc::new(store);
    println!("peer id: {}", state.peer_id);

    let mut registry = metrics::registry(&state);
    // Read at each OTLP export while the node runs (no-ops when nothing is exported).
    let _instruments = crate::telemetry::observe(&state);
    let (client, mut events, event_loop) = network::with_metrics(net_config, &mut registry)?;
    // The network outlives the shutdown signal until the goodbye heartbeat and the last
    // exchanges are out; it stops when this sender is used or dropped (on any early return).
    let (stop_network, network_stopped) = tokio::sync::oneshot::channel::<()>();
    let net_task = tokio::spawn(event_loop.run(async move {
        let _ = network_stopped.await;
    }));

    let listener = api::bind(&api_addr).await?;
    let api_addr = listener.local_addr()?.to_string();
    checkpoint::write_atomic(&data.api_path(), api_addr.as_bytes())
        .with_context(|| format!("cannot write `{}`", data.api_path().display()))?;
    let api_task = tokio::spawn(api::serve(listener, Arc::clone(&state), registry));

    let layout = job.trainer.network().architecture().layout().clone();
    let center_file = CenterFile {
        dir: job.checkpoint_dir.clone(),
        layout,
        config_hash: job.config_hash.clone(),
    };
    let (to_trainer, inbox) = std::sync::mpsc::sync_channel(TRAINER_QUEUE);
    let (due_tx, due) = tokio::sync::mpsc::channel(1);
    let trainer = {
        let (state, store) = (Arc::clone(&state), Arc::clone(&store));
        let links = TrainerLinks { inbox, due: due_tx };
        std::thread::Builder::new()
            .name("murmur-trainer".into())
            .spawn(move || {
                let result = worker::run(job, &state, &store, &state.sync, links);
                if let Err(e) = &result {
                    warn!(event = events::TRAINING_STOPPED, error = %format!("{e:#}"), "training stopped");
                }
                result
            })?
    };
    tokio::spawn(watch_signals(Arc::clone(&state)));
    let (offence_tx, mut offences) = tokio::sync::mpsc::channel(OFFENCE_QUEUE);
    let engine = tokio::spawn(sync::run(
        state.sync.clone(),
        Arc::clone(&state),
        client.clone(),
        to_trainer.clone(),
        due,
        offence_tx,
        center_file,
    ));

    let mut scores = PeerScores::new(BLOCK_AFTER_OFFENCES, OFFENCE_WINDOW);
    let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
    let mut clock_tick = tokio::time::interval(CLOCK_CHECK_INTERVAL);
    let mut stop = state.shutdown_signal();
    let mut announced = false;
    let mut published_step = 0;
    // With a staleness bound, peers gate on the clocks in heartbeats: a clock that moved by
    // half the bound is announced at once rather than at the next second, or fast peers would
    // wait on stale clocks.
    let clock_step = state.sync.max_staleness.map(|s| (s / 2).max(1));
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            _ = clock_tick.tick() => {
                let step = lock(&state.progress).step;
                if clock_step.is_some_and(|every| step >= published_step + every) {
                    published_step = step;
                    let _ = client.publish_heartbeat(&state.heartbeat(false)).await;
                }
            }
            // At the moment a peer times out, so that a dead peer holds the staleness gate for
            // the peer timeout and not a check period longer.
            () = sleep_until_expiry(&state) => {
                for change in lock(&state.membership).expire(Instant::now()) {
                    if let Change::TimedOut(peer) = change {
                        info!(event = events::PEER_TIMED_OUT, peer = %peer, "peer timed out");
                        wake_trainer(&state, &to_trainer);
                    }
                }
            }
            _ = tick.tick() => {
                // Publishing fails while no peer is subscribed yet; the next tick retries.
                published_step = lock(&state.progress).step;
                let _ = client.publish_heartbeat(&state.heartbeat(false)).await;
                if !announced && !lock(&state.listen).is_empty() {
                    announce(&state, &api_addr, &config_path);
                    announced = true;
                }
            }
            Some(event) = events.recv() => {
                on_event(event, &state, &store, &client, &mut scores).await;
                wake_trainer(&state, &to_trainer);
            }
            Some((peer, reason)) = offences.recv() => {
                let event = NetworkEvent::Rejected { peer, reason };
                on_event(event, &state, &store, &client, &mut scores).await;
            }
        }
    }

    info!(
        event = events::LEAVING,
        "leaving: saving a checkpoint and saying goodbye"
    );
    let _ = client.publish_heartbeat(&state.heartbeat(true)).await;
    match tokio::time::timeout(Duration::from_secs(10), engine).await {
        Ok(Ok(Err(e))) => warn!(error = %format!("{e:#}"), "sync engine"),
        Ok(Err(_)) => warn!("the sync engine panicked"),
        _ => {}
    }
    drop(to_trainer);
    let trained = tokio::task::spawn_blocking(move || trainer.join())
        .await
        .context("trainer thread")?;
    let _ = std::fs::remove_file(data.api_path());
    // The last status stays behind for scripts and operators (`nodectl evaluate` reads it).
    let last = serde_json::to_vec_pretty(&state.status())?;
    if let Err(e) = checkpoint::write_atomic(&data.last_status_path(), &last) {
        warn!(error = %e, "cannot write the last status");
    }
    let _ = stop_network.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), net_task).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), api_task).await;
    match trained {
        Ok(result) => result,
        Err(_) => anyhow::bail!("the trainer thread panicked"),
    }
}

/// Prints how to reach this node and the stable `ready` line scripts wait for.
fn announce(state: &NodeState, api_addr: &str, config_path: &std::path::Path) {
    let listen = lock(&state.listen).clone();
    for addr in &listen {
        println!("listening on {addr}");
    }
    let tcp = listen
        .iter()
        .find(|a| a.to_string().contains("/tcp/"))
        .or(listen.first());
    if let Some(addr) = tcp {
        println!(
            "to join this node: nodectl join --config {} --bootstrap {addr}",
            config_path.display()
        );
    }
    println!("ready peer_id={} api={api_addr}", state.peer_id);
    info!(event = events::READY, peer_id = %state.peer_id, api = %api_addr, "ready");
}

async fn on_event(
    event: NetworkEvent,
    state: &NodeState,
    store: &Store,
    client: &Client,
    scores: &mut PeerScores<PeerId>,
) {
    match event {
        NetworkEvent::Listening(addr) => lock(&state.listen).push(addr),
        NetworkEvent::Connected(peer) => info!(peer = %peer, "connected"),
        NetworkEvent::Disconnected(peer) => info!(peer = %peer, "disconnected"),
        NetworkEvent::Identified { peer, addrs } => {
            let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
            if let Err(e) = store.remember_peer(&peer.to_string(), &addrs) {
                warn!(error = %e, "cannot update the peer book");
            }
        }
        NetworkEvent::Heartbeat { peer, heartbeat } => {
            let change = lock(&state.membership).observe(peer, &heartbeat, Instant::now());
            match change {
                Some(Change::Joined(peer)) => {
                    info!(event = events::PEER_JOINED, peer = %peer, step = heartbeat.step, "peer joined");
                    state.peer_joined.notify_one();
                }
                Some(Change::Left(peer)) => {
                    info!(event = events::PEER_LEFT, peer = %peer, "peer left");
                }
                _ => {}
            }
        }
        NetworkEvent::Rejected { peer, reason } => {
            state.rejected.fetch_add(1, Ordering::Relaxed);
            match scores.offence(&peer, Instant::now()) {
                Verdict::Warned { offences } => {
                    warn!(peer = %peer, %reason, offences, "invalid message");
                }
                Verdict::Block => {
                    warn!(event = events::PEER_BLOCKED, peer = %peer, %reason, "blocking peer after repeated invalid messages");
                    lock(&state.membership).remove(&peer);
                    lock(&state.blocked).insert(peer);
                    let _ = client.block(peer).await;
                }
            }
        }
    }
}

/// Sleeps until the first live peer would time out (forever while there are none; the select
/// loop re-arms it on every turn, so a new peer is picked up).
async fn sleep_until_expiry(state: &NodeState) {
    let next = lock(&state.membership).next_expiry();
    match next {
        // Past the deadline by a hair, so that `expire` sees the peer as silent for longer
        // than the timeout.
        Some(at) => tokio::time::sleep_until((at + Duration::from_millis(1)).into()).await,
        None => std::future::pending().await,
    }
}

/// Lets a trainer waiting at the staleness gate look again.
fn wake_trainer(state: &NodeState, trainer: &std::sync::mpsc::SyncSender<ToTrainer>) {
    if state.gated.load(Ordering::Relaxed) {
        let _ = trainer.try_send(ToTrainer::Wake);
    }
}

async fn watch_signals(state: Arc<NodeState>) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("interrupted"),
        () = terminate => info!("terminated"),
    }
    state.request_shutdown();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loss_curve_stays_bounded_and_spans_the_whole_run() {
        let mut curve = LossCurve::default();
        for step in 1..=100_000 {
            curve.record(step, 1.0 / step as f32);
        }
        let points = curve.points();
        assert!(points.len() <= LossCurve::CAPACITY, "{}", points.len());
        assert!(points.len() > LossCurve::CAPACITY / 2, "{}", points.len());
        let first = points.first().map(|p| p.step).unwrap_or_default();
        let last = points.last().map(|p| p.step).unwrap_or_default();
        assert!(first <= 128 && last > 99_800, "{first}..{last}");
        assert!(points.windows(2).all(|w| w[0].step < w[1].step));
    }
}
