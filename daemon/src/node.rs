//! A running peer: the network task, the trainer thread, the heartbeat and membership loop,
//! and the control API, wired together by [`run`].
//!
//! Threads and tasks: the trainer owns a dedicated OS thread (training never runs on a tokio
//! worker); the swarm task, the API server and the heartbeat loop are tokio tasks. They share
//! [`NodeState`] (short `Mutex` sections, never held across an await) and one shutdown flag.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use murmur_protocol::membership::Change;
use murmur_protocol::network::{self, Client, NetworkConfig, NetworkEvent, PeerId};
use murmur_protocol::scoring::{PeerScores, Verdict};
use murmur_trainer::{Backend, checkpoint};
use tracing::{info, warn};

use crate::api::server as api;
use crate::readout::{NodeState, lock};
use crate::settings::HEARTBEAT_INTERVAL;
use crate::store::{DataDir, Store};
use crate::{events, metrics};

pub mod engine;
pub mod messages;
pub mod trainer;

use engine::CenterFile;
use messages::ToTrainer;
use trainer::{TrainerJob, TrainerLinks};
/// How often the clock is checked for an early heartbeat.
const CLOCK_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Offences within [`OFFENCE_WINDOW`] after which a peer is blocked.
const BLOCK_AFTER_OFFENCES: u32 = 3;
const OFFENCE_WINDOW: Duration = Duration::from_secs(60);
/// Capacity of the channel that carries offences from stream handlers to the main loop.
const OFFENCE_QUEUE: usize = 64;
/// Capacity of the sync engine's queue to the trainer thread.
const TRAINER_QUEUE: usize = 16;

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
        path: data.center_path(),
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
                let result = trainer::run(job, &state, &store, &state.sync, links);
                if let Err(e) = &result {
                    warn!(event = events::TRAINING_STOPPED, error = %format!("{e:#}"), "training stopped");
                }
                result
            })?
    };
    tokio::spawn(watch_signals(Arc::clone(&state)));
    let (offence_tx, mut offences) = tokio::sync::mpsc::channel(OFFENCE_QUEUE);
    let engine = tokio::spawn(engine::run(
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
