//! A running peer: the network task, the trainer thread, the heartbeat and membership loop,
//! and the control API, wired together by [`run`].
//!
//! Threads and tasks: the trainer owns a dedicated OS thread (training never runs on a tokio
//! worker); the swarm task, the API server and the heartbeat loop are tokio tasks. They share
//! [`NodeState`] (short `Mutex` sections, never held across an await) and one shutdown flag.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use futures::StreamExt;
use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode};
use murmur_protocol::membership::{Change, Membership};
use murmur_protocol::network::{
    self, Client, Multiaddr, NetworkConfig, NetworkEvent, PeerId, StreamProtocol,
};
use murmur_protocol::scoring::{PeerScores, Verdict};
use murmur_protocol::wire::{self, Expect};
use murmur_protocol::{PARAMS_PROTOCOL, STATE_PROTOCOL};
use murmur_trainer::checkpoint;
use murmur_trainer::data::Dataset;
use murmur_trainer::{CpuBackend, Trainer};
use tokio::sync::watch;
use tracing::{info, warn};

use crate::api::{self, PeerReport, StatusReport};
use crate::store::{DataDir, Store};

/// How often a node publishes its heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Offences within [`OFFENCE_WINDOW`] after which a peer is blocked.
const BLOCK_AFTER_OFFENCES: u32 = 3;
const OFFENCE_WINDOW: Duration = Duration::from_secs(60);
/// Longest a peer may take to send one tensor frame.
const STREAM_TIMEOUT: Duration = Duration::from_secs(60);
/// Capacity of the channel that carries offences from stream handlers to the main loop.
const OFFENCE_QUEUE: usize = 64;

/// What the trainer thread reports.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub test_accuracy: Option<f64>,
    pub finished: bool,
}

/// State shared by the node's tasks and read by the control API.
#[derive(Debug)]
pub struct NodeState {
    pub peer_id: PeerId,
    pub run_id: String,
    pub fingerprint: String,
    pub model: String,
    pub epochs: u64,
    started: Instant,
    progress: Mutex<Progress>,
    membership: Mutex<Membership<PeerId>>,
    listen: Mutex<Vec<Multiaddr>>,
    rejected: AtomicU64,
    blocked: Mutex<BTreeSet<PeerId>>,
    /// Tensor bytes received in valid frames.
    bytes_in: AtomicU64,
    /// Values in this model's flat parameter buffer.
    param_count: usize,
    shutdown: watch::Sender<bool>,
}

/// Locks a mutex, carrying on with the data if a panicking thread poisoned it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl NodeState {
    pub fn new(
        peer_id: PeerId,
        run_id: &str,
        fingerprint: &str,
        model: &str,
        epochs: u64,
        param_count: usize,
        peer_timeout: Duration,
    ) -> Self {
        NodeState {
            peer_id,
            run_id: run_id.to_owned(),
            fingerprint: fingerprint.to_owned(),
            model: model.to_owned(),
            epochs,
            started: Instant::now(),
            progress: Mutex::new(Progress::default()),
            membership: Mutex::new(Membership::new(peer_timeout)),
            listen: Mutex::new(Vec::new()),
            rejected: AtomicU64::new(0),
            blocked: Mutex::new(BTreeSet::new()),
            bytes_in: AtomicU64::new(0),
            param_count,
            shutdown: watch::channel(false).0,
        }
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
        let p = lock(&self.progress).clone();
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
            state: state.to_owned(),
            step: p.step,
            epoch: p.epoch,
            epochs: self.epochs,
            loss_ema: p.loss_ema,
            test_accuracy: p.test_accuracy,
            samples_seen: p.samples_seen,
            live_peers: lock(&self.membership).len(),
            listen: lock(&self.listen).iter().map(ToString::to_string).collect(),
            rejected_messages: self.rejected.load(Ordering::Relaxed),
            tensor_bytes_in: self.bytes_in.load(Ordering::Relaxed),
            blocked_peers: lock(&self.blocked).len(),
            uptime_s: self.started.elapsed().as_secs_f64(),
        }
    }

    pub fn peers(&self) -> Vec<PeerReport> {
        let now = Instant::now();
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
            })
            .collect()
    }

    fn heartbeat(&self, leaving: bool) -> Heartbeat {
        let p = lock(&self.progress).clone();
        Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: self.run_id.clone(),
            fingerprint: self.fingerprint.clone(),
            step: p.step,
            epoch: p.epoch,
            loss_ema: p.loss_ema,
            samples_seen: p.samples_seen,
            mode: SyncMode::Solo,
            role: Role::Worker,
            leaving,
        }
    }
}

/// Everything the trainer thread needs.
#[derive(Debug)]
pub struct TrainerJob {
    pub trainer: Trainer<CpuBackend>,
    pub train: Dataset,
    pub test: Dataset,
    pub checkpoint_dir: PathBuf,
    pub config_hash: String,
    pub keep: usize,
}

/// Trains until the run's epochs are done or the node shuts down, reporting progress and
/// checkpointing at every epoch and on the way out.
fn run_trainer(mut job: TrainerJob, state: &NodeState, store: &Store) -> Result<()> {
    let layout = job.trainer.network().architecture().layout().clone();
    let per_epoch = job.trainer.steps_per_epoch();
    let mut saved_step = job.trainer.step_count();
    {
        let mut p = lock(&state.progress);
        p.step = saved_step;
        p.epoch = job.trainer.epochs_done();
    }
    let save = |trainer: &Trainer<CpuBackend>| -> Result<()> {
        let ckpt = trainer.checkpoint(&job.config_hash)?;
        let path = checkpoint::save(&job.checkpoint_dir, &ckpt, &layout, job.keep)?;
        store.record_checkpoint(ckpt.step, &path)?;
        store.set_progress(&state.run_id, ckpt.step, ckpt.epoch)?;
        info!(path = %path.display(), step = ckpt.step, "checkpoint saved");
        Ok(())
    };
    while !job.trainer.is_finished() && !state.is_shutting_down() {
        let outcome = job.trainer.train_step(&job.train)?;
        {
            let mut p = lock(&state.progress);
            p.step = outcome.step;
            p.epoch = job.trainer.epochs_done();
            p.samples_seen += outcome.samples as u64;
            p.loss_ema = if p.loss_ema == 0.0 {
                outcome.loss
            } else {
                0.98 * p.loss_ema + 0.02 * outcome.loss
            };
        }
        if outcome.step % per_epoch == 0 {
            let eval = job.trainer.evaluate(&job.test)?;
            lock(&state.progress).test_accuracy = Some(eval.accuracy);
            info!(
                epoch = job.trainer.epochs_done(),
                test_accuracy = eval.accuracy,
                "epoch done"
            );
            save(&job.trainer)?;
            saved_step = outcome.step;
        }
    }
    if job.trainer.step_count() != saved_step {
        save(&job.trainer)?;
    }
    lock(&state.progress).finished = job.trainer.is_finished();
    Ok(())
}

/// How a node joins.
#[derive(Debug)]
pub struct NodeSetup {
    pub data: DataDir,
    pub store: Store,
    pub network: NetworkConfig,
    pub api_addr: String,
    pub job: TrainerJob,
    pub state: Arc<NodeState>,
    /// The config path, for the line that tells others how to join.
    pub config_path: PathBuf,
}

/// Runs the node until SIGINT, SIGTERM or `POST /leave`; then drains and returns.
pub async fn run(setup: NodeSetup) -> Result<()> {
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

    let (client, mut events, event_loop) = network::new(net_config)?;
    let mut net_stop = state.shutdown_signal();
    let net_task = tokio::spawn(event_loop.run(async move {
        let _ = net_stop.wait_for(|stop| *stop).await;
    }));

    let listener = api::bind(&api_addr).await?;
    let api_addr = listener.local_addr()?.to_string();
    checkpoint::write_atomic(&data.api_path(), api_addr.as_bytes())
        .with_context(|| format!("cannot write `{}`", data.api_path().display()))?;
    let api_task = tokio::spawn(api::serve(listener, Arc::clone(&state)));

    let trainer = {
        let (state, store) = (Arc::clone(&state), Arc::clone(&store));
        std::thread::Builder::new()
            .name("murmur-trainer".into())
            .spawn(move || {
                let result = run_trainer(job, &state, &store);
                if let Err(e) = &result {
                    warn!(error = %format!("{e:#}"), "training stopped");
                }
                result
            })?
    };
    tokio::spawn(watch_signals(Arc::clone(&state)));
    let (offence_tx, mut offences) = tokio::sync::mpsc::channel(OFFENCE_QUEUE);
    for protocol in [PARAMS_PROTOCOL, STATE_PROTOCOL] {
        let incoming = client
            .stream_control()
            .accept(StreamProtocol::new(protocol))
            .context("cannot accept tensor streams")?;
        tokio::spawn(accept_tensors(
            incoming,
            Arc::clone(&state),
            offence_tx.clone(),
        ));
    }

    let mut scores = PeerScores::new(BLOCK_AFTER_OFFENCES, OFFENCE_WINDOW);
    let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
    let mut stop = state.shutdown_signal();
    let mut announced = false;
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            _ = tick.tick() => {
                // Publishing fails while no peer is subscribed yet; the next tick retries.
                let _ = client.publish_heartbeat(&state.heartbeat(false)).await;
                for change in lock(&state.membership).expire(Instant::now()) {
                    if let Change::TimedOut(peer) = change {
                        info!(peer = %peer, "peer timed out");
                    }
                }
                if !announced && !lock(&state.listen).is_empty() {
                    announce(&state, &api_addr, &config_path);
                    announced = true;
                }
            }
            Some(event) = events.recv() => {
                on_event(event, &state, &store, &client, &mut scores).await;
            }
            Some((peer, reason)) = offences.recv() => {
                let event = NetworkEvent::Rejected { peer, reason };
                on_event(event, &state, &store, &client, &mut scores).await;
            }
        }
    }

    info!("leaving: saving a checkpoint and saying goodbye");
    let _ = client.publish_heartbeat(&state.heartbeat(true)).await;
    let trained = tokio::task::spawn_blocking(move || trainer.join())
        .await
        .context("trainer thread")?;
    let _ = std::fs::remove_file(data.api_path());
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
                    info!(peer = %peer, step = heartbeat.step, "peer joined")
                }
                Some(Change::Left(peer)) => info!(peer = %peer, "peer left"),
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
                    warn!(peer = %peer, %reason, "blocking peer after repeated invalid messages");
                    lock(&state.membership).remove(&peer);
                    lock(&state.blocked).insert(peer);
                    let _ = client.block(peer).await;
                }
            }
        }
    }
}

/// Reads tensor frames that peers send on one protocol, one at a time into one reused buffer
/// (so a receiver holds at most one extra copy of the parameters). Anything invalid is
/// reported as an offence of the sending peer; nothing a peer sends can stop this loop.
async fn accept_tensors(
    mut incoming: libp2p_stream::IncomingStreams,
    state: Arc<NodeState>,
    offences: tokio::sync::mpsc::Sender<(PeerId, String)>,
) {
    let mut buffer: Vec<f32> = Vec::new();
    let expected_bytes = state.param_count as u64 * 4;
    while let Some((peer, mut stream)) = incoming.next().await {
        if lock(&state.blocked).contains(&peer) {
            continue;
        }
        let expect = Expect {
            run_id: &state.run_id,
            fingerprint: &state.fingerprint,
            max_payload_bytes: expected_bytes,
        };
        let received = tokio::time::timeout(STREAM_TIMEOUT, async {
            let header = wire::read_header(&mut stream, &expect).await?;
            if header.byte_len != expected_bytes {
                return Err(wire::WireError::Malformed(format!(
                    "{} payload bytes, this model has {expected_bytes}",
                    header.byte_len
                )));
            }
            wire::read_payload(&mut stream, &header, &mut buffer).await?;
            Ok(header)
        })
        .await;
        let reason = match received {
            Ok(Ok(header)) => {
                if buffer.iter().all(|v| v.is_finite()) {
                    state.bytes_in.fetch_add(header.byte_len, Ordering::Relaxed);
                    info!(peer = %peer, step = header.step, bytes = header.byte_len, "tensor received");
                    continue;
                }
                "parameters contain NaN or infinite values".to_owned()
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no complete frame within {}s", STREAM_TIMEOUT.as_secs()),
        };
        // A full queue means the main loop is already busy with offences; dropping one is fine.
        let _ = offences.try_send((peer, reason));
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
