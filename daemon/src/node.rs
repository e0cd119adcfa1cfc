//! One running peer (`nodectl join`): [`run`] starts its actors, tells the caller when the node
//! is ready, and returns once the node has left and every actor has finished.
//!
//! The actors, each owned by [`run`]'s `JoinSet`:
//!
//! - the network task (`murmur_protocol::network`): the libp2p swarm;
//! - [`peers`]: network events in, the peer table out; heartbeats; offence scoring;
//! - [`engine`]: the sync engine, around its sans-IO policy;
//! - [`replica`]: the replica driver, which drives whatever trains the replica (Murmur's own
//!   trainer, or a trainer in another language) through the trainer contract, on an OS thread
//!   of its own or, lent ([`Drive::Lend`]), on the training loop's;
//! - the control API (`crate::api::server`), and the peer book's writer ([`book`]).
//!
//! They share nothing but [`messages`] and the read side ([`crate::readout`]): the replica
//! thread publishes its progress, the membership actor the peer table, the engine its view, each on a
//! `watch`; requests and their answers travel on bounded channels. Leaving (the caller's token,
//! or `POST /leave`) ends every actor; the network stops last, once the goodbye heartbeat and
//! the last exchanges are out.

pub mod book;
pub mod engine;
pub mod memory;
pub mod messages;
pub mod peers;
pub mod replica;
#[cfg(test)]
pub(crate) mod testing;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use murmur_protocol::network::{self, Multiaddr, PeerId};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::api::server as api;
use crate::model::ModelDescription;
use crate::readout::{Feeds, Readout};
use crate::settings::NodeSettings;
use crate::store::{self, Store};
use crate::{events, metrics, telemetry};
use engine::{CenterFile, EngineSetup};
use peers::MembershipActor;
use replica::Replica;
use replica::driver::{ReplicaDriver, ReplicaPorts};

/// Requests queued for the replica driver (it answers one per step at most).
const REPLICA_QUEUE: usize = 16;
/// Notes from the engine to the membership actor (offences, clocks seen in frames).
const NOTES_QUEUE: usize = 64;

/// Everything a node starts from.
pub struct NodeSetup {
    pub settings: NodeSettings,
    /// What trains the replica; its model is the one `settings.identity` names.
    pub replica: Box<dyn Replica>,
    /// Who drives it.
    pub drive: Drive,
    pub store: Store,
}

/// Who drives the replica (`node::replica::driver`).
#[derive(Debug)]
pub enum Drive {
    /// The node, on a thread of its own: Murmur's trainer.
    OwnThread,
    /// The caller's own thread: a trainer whose loop is its own (a PyTorch script, decision
    /// 0071). The node lends the driver on this channel once it runs, and runs until the
    /// caller [finishes](LentDriver::finish) it; a driver dropped unfinished makes it leave.
    Lend(oneshot::Sender<LentDriver>),
}

/// The driver a node lent to the thread that trains ([`Drive::Lend`]).
#[derive(Debug)]
pub struct LentDriver {
    driver: Option<ReplicaDriver>,
    /// Tells the node how the driving ended.
    done: Option<oneshot::Sender<Result<(), String>>>,
}

impl LentDriver {
    pub fn driver(&mut self) -> &mut ReplicaDriver {
        self.driver
            .as_mut()
            .expect("invariant: a lent driver is there until it is finished")
    }

    /// Ends the driving ([`ReplicaDriver::finish`]: a last checkpoint) and tells the node,
    /// which then leaves if it was not leaving already. Returns the first error.
    pub fn finish(mut self, trained: Result<()>) -> Result<()> {
        let driver = self
            .driver
            .take()
            .expect("invariant: a lent driver is there until it is finished");
        let finished = driver.finish(trained);
        if let Some(done) = self.done.take() {
            let _ = done.send(finished.as_ref().map(|_| ()).map_err(|e| format!("{e:#}")));
        }
        finished
    }
}

impl Drop for LentDriver {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let _ = done.send(Err(
                "the training loop let go of its replica without finishing it".into(),
            ));
        }
    }
}

impl std::fmt::Debug for NodeSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSetup")
            .field("settings", &self.settings)
            .field("replica", &self.replica.describe())
            .field("drive", &self.drive)
            .field("store", &self.store)
            .finish()
    }
}

/// What a started node tells its caller once its network listens.
#[derive(Clone, Debug)]
pub struct Ready {
    pub peer_id: PeerId,
    /// The control API's address.
    pub api: SocketAddr,
    /// The addresses the network listens on, with the peer id.
    pub listen: Vec<Multiaddr>,
    /// The node's read side: its status, peers, counters.
    pub readout: Readout,
}

/// Which actor ended.
#[derive(Debug)]
pub(crate) enum Part {
    Membership,
    Engine,
    Replica,
    Book,
    Api,
    Memory,
}

/// Runs the node until `shutdown` is cancelled or a `POST /leave` arrives; then it leaves
/// (checkpoint, goodbye heartbeat, last status) and returns the replica driver's result.
/// `ready` is answered once the network listens.
pub async fn run(
    setup: NodeSetup,
    shutdown: CancellationToken,
    ready: oneshot::Sender<Ready>,
) -> Result<()> {
    let NodeSetup {
        settings,
        replica,
        drive,
        store,
    } = setup;
    let store = Arc::new(store);
    let timeouts = settings.timeouts;
    // The node leaves when its caller says so, or when asked over the control API.
    let leave = shutdown.child_token();
    // One registry for `/metrics`: libp2p's metrics, which the network task records, and the
    // node's, read from the readout at each scrape.
    let mut registry = Registry::default();
    let (client, events, event_loop) =
        network::with_metrics(settings.network.clone(), &mut registry)?;
    let (readout, feeds) = Readout::new(
        settings.identity.clone(),
        settings.sync.clone(),
        timeouts.peer,
        leave.clone(),
        client.dropped_events(),
    );
    metrics::register(&mut registry, &readout);
    // Read at each OTLP export while the node runs (no-ops when nothing is exported).
    let _instruments = telemetry::observe(&readout);

    // The network outlives leaving until the goodbye heartbeat and the last exchanges are out.
    let mut network = JoinSet::new();
    let stop_network = CancellationToken::new();
    network.spawn(event_loop.run(stop_network.clone().cancelled_owned()));

    let mut parts: JoinSet<Result<Part>> = JoinSet::new();
    let api_addr = start_api(&mut parts, &settings, &readout, registry, &leave).await?;

    {
        let trimming = memory::trim_periodically(leave.clone());
        parts.spawn(async move {
            trimming.await;
            Ok(Part::Memory)
        });
    }

    let (book, write_book) = book::writer(Arc::clone(&store));
    parts.spawn_blocking(move || {
        write_book();
        Ok(Part::Book)
    });
    let ports = start_sync(
        &mut parts,
        &settings,
        (client, events),
        (&readout, feeds),
        book,
        replica.describe().model.clone(),
        &leave,
    );
    {
        let (readout, store, sync) = (readout.clone(), Arc::clone(&store), settings.sync.clone());
        // Built on a blocking thread: its outer loop may read the replica's parameters.
        let driver = tokio::task::spawn_blocking(move || {
            ReplicaDriver::new(replica, readout, store, sync, ports)
        })
        .await??;
        start_driver(&mut parts, driver, drive);
    }

    announce_ready(&readout, &leave, settings.identity.peer_id, api_addr, ready).await;

    let trained = supervise(&mut parts, &leave).await;
    info!(
        event = events::LEAVING,
        "leaving: saving a checkpoint and saying goodbye"
    );
    let trained = trained.and(drain(&mut parts, timeouts.drain * 3).await);
    let _ = std::fs::remove_file(settings.data.api_path());
    let _ = std::fs::remove_file(settings.data.api_token_path());
    // The last status stays behind for scripts and operators (`nodectl evaluate` reads it).
    let last = serde_json::to_vec_pretty(&readout.status())?;
    if let Err(e) = store::write_atomic(&settings.data.last_status_path(), &last, 0o644) {
        warn!(error = %e, "cannot write the last status");
    }
    stop_network.cancel();
    if tokio::time::timeout(timeouts.drain, network.join_next())
        .await
        .is_err()
    {
        network.abort_all();
    }
    trained
}

/// Starts a node's membership actor and sync engine on `network`, each in `parts`, and
/// returns the replica driver's ends of their channels. The simulator starts its nodes here
/// too, on a simulated network.
pub(crate) fn start_sync(
    parts: &mut JoinSet<Result<Part>>,
    settings: &NodeSettings,
    (client, events): (network::Client, mpsc::Receiver<network::NetworkEvent>),
    (readout, feeds): (&Readout, Feeds),
    book: book::PeerBook,
    model: ModelDescription,
    leave: &CancellationToken,
) -> ReplicaPorts {
    let (to_replica, inbox) = mpsc::channel(REPLICA_QUEUE);
    let (due_tx, due) = mpsc::channel(1);
    let (notes_tx, notes) = mpsc::channel(NOTES_QUEUE);
    let (slow_tx, slow) = watch::channel(BTreeSet::new());
    let membership = MembershipActor {
        client: client.clone(),
        readout: readout.clone(),
        timeouts: settings.timeouts,
        table: feeds.peers,
        listen: feeds.listen,
        reach: feeds.reach,
        client_mode: settings.client,
        events,
        notes,
        progress: readout.watch_progress(),
        engine: readout.watch_engine(),
        slow,
        book,
    };
    let membership = peers::run(membership, leave.clone());
    parts.spawn(async move {
        membership.await;
        Ok(Part::Membership)
    });

    let engine = EngineSetup {
        readout: readout.clone(),
        sync: settings.sync.clone(),
        timeouts: settings.timeouts,
        client,
        replica: to_replica,
        due,
        peers: readout.watch_peers(),
        progress: readout.watch_progress(),
        view: feeds.engine,
        pair_copies: feeds.pair_copies,
        pair_copies_budget: settings.pair_copies_budget,
        slow: slow_tx,
        notes: notes_tx,
        center_file: CenterFile {
            path: settings.data.center_path(),
            model,
        },
    };
    let engine = engine::run(engine, leave.clone());
    parts.spawn(async move { engine.await.map(|()| Part::Engine) });

    ReplicaPorts {
        inbox,
        due: due_tx,
        peers: readout.watch_peers(),
        progress: feeds.progress,
        leave: leave.clone(),
    }
}

/// Starts the control API: binds its address, writes its token and then its address to the
/// data dir (whoever finds the address may rely on the token being there), and serves it
/// until the node leaves. Returns the address it listens on.
async fn start_api(
    parts: &mut JoinSet<Result<Part>>,
    settings: &NodeSettings,
    readout: &Readout,
    registry: Registry,
    leave: &CancellationToken,
) -> Result<SocketAddr> {
    let listener = api::bind(&settings.api_addr).await?;
    let api_addr = listener.local_addr()?;
    let secret = api::new_secret()?;
    store::write_atomic(&settings.data.api_token_path(), secret.as_bytes(), 0o600)?;
    let address = api_addr.to_string();
    store::write_atomic(&settings.data.api_path(), address.as_bytes(), 0o644)?;
    let serving = api::serve(listener, readout.clone(), registry, leave.clone(), secret);
    parts.spawn(async move { serving.await.map(|()| Part::Api) });
    Ok(api_addr)
}

/// Runs the replica driver on a thread of its own, or lends it to the caller's training loop
/// (decision 0071); either way the node's parts learn when it ends.
fn start_driver(parts: &mut JoinSet<Result<Part>>, driver: ReplicaDriver, drive: Drive) {
    match drive {
        Drive::OwnThread => {
            parts.spawn_blocking(move || {
                let result = driver.run();
                if let Err(e) = &result {
                    warn!(event = events::TRAINING_STOPPED, error = %format!("{e:#}"), "training stopped");
                }
                result.map(|()| Part::Replica)
            });
        }
        Drive::Lend(to) => {
            let (done, finished) = oneshot::channel();
            // A caller gone before it took the driver drops it: the node leaves.
            let _ = to.send(LentDriver {
                driver: Some(driver),
                done: Some(done),
            });
            parts.spawn(async move {
                match finished.await {
                    Ok(Ok(())) => Ok(Part::Replica),
                    Ok(Err(why)) => Err(anyhow::anyhow!(why)),
                    Err(_) => Err(anyhow::anyhow!("the training loop's driver is gone")),
                }
            });
        }
    }
}

/// Tells the caller the node is ready, once the network listens (or not at all, if it leaves
/// first).
async fn announce_ready(
    readout: &Readout,
    leave: &CancellationToken,
    peer_id: PeerId,
    api: SocketAddr,
    ready: oneshot::Sender<Ready>,
) {
    let mut listen = readout.watch_listen();
    let listening = tokio::select! {
        listening = listen.wait_for(|addrs| !addrs.is_empty()) => listening.map(|addrs| addrs.clone()).ok(),
        () = leave.cancelled() => None,
    };
    if let Some(listen) = listening {
        info!(event = events::READY, %peer_id, %api, "ready");
        let _ = ready.send(Ready {
            peer_id,
            api,
            listen,
            readout: readout.clone(),
        });
    }
}

/// Waits up to `limit` for the node's parts to finish leaving; the first that failed is the
/// error. Parts still running then are aborted.
async fn drain(parts: &mut JoinSet<Result<Part>>, limit: Duration) -> Result<()> {
    let mut failed = Vec::new();
    let drained = tokio::time::timeout(limit, async {
        while let Some(ended) = parts.join_next().await {
            match ended {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => failed.push(e),
                Err(e) => warn!(error = %e, "a part of the node failed while leaving"),
            }
        }
    })
    .await;
    if drained.is_err() {
        warn!("some parts of the node did not finish in time");
        parts.abort_all();
    }
    match failed.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Watches the node's parts until it leaves: a part that ends before then is a fault, and
/// makes the node leave. A replica driver that failed makes the node leave too: its replica
/// no longer moves, and a node that went on heartbeating its last step would hold every peer at the
/// staleness gate for good. Returns the failure to report, which makes `nodectl join` exit
/// non-zero.
async fn supervise(parts: &mut JoinSet<Result<Part>>, leave: &CancellationToken) -> Result<()> {
    let mut trained: Result<()> = Ok(());
    loop {
        tokio::select! {
            // Leaving first: the actors end because the node leaves, which is no fault.
            biased;
            () = leave.cancelled() => break,
            Some(ended) = parts.join_next() => match ended {
                Ok(Ok(Part::Replica)) | Ok(Ok(Part::Book)) => {}
                Ok(Ok(part)) => {
                    error!(?part, "a part of the node stopped; leaving");
                    trained = trained.and(Err(anyhow::anyhow!("a part of the node ({part:?}) stopped on its own")));
                    leave.cancel();
                }
                Ok(Err(e)) => {
                    // The replica driver's error is logged where it happened and reported at the end,
                    // which makes `nodectl join` exit non-zero.
                    trained = Err(e);
                    leave.cancel();
                }
                Err(e) => {
                    // A panic (of the replica driver, say): the node leaves and exits non-zero,
                    // like a replica driver that returned an error.
                    error!(error = %e, "a part of the node failed; leaving");
                    trained = trained.and(Err(anyhow::anyhow!("a part of the node failed: {e}")));
                    leave.cancel();
                }
            },
        }
    }
    trained
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The node's parts for a test: an engine that runs until the node leaves, and `trainer`.
    fn parts_with(
        leave: &CancellationToken,
        trainer: impl FnOnce() -> Result<Part> + Send + 'static,
    ) -> JoinSet<Result<Part>> {
        let mut parts = JoinSet::new();
        let engine_leaves = leave.clone();
        parts.spawn(async move {
            engine_leaves.cancelled().await;
            Ok(Part::Engine)
        });
        parts.spawn_blocking(trainer);
        parts
    }

    async fn supervised(
        parts: &mut JoinSet<Result<Part>>,
        leave: &CancellationToken,
    ) -> Result<()> {
        tokio::time::timeout(Duration::from_secs(10), supervise(parts, leave))
            .await
            .expect("the supervisor never returned")
    }

    /// A zombie: a trainer thread that panicked (a CUDA error, a bug) left a daemon that
    /// heartbeated its frozen step for ever. The node leaves, and reports the panic.
    #[tokio::test]
    async fn a_trainer_that_panics_makes_the_node_leave_and_fail() {
        let leave = CancellationToken::new();
        let mut parts = parts_with(&leave, || panic!("the trainer thread died"));
        let outcome = supervised(&mut parts, &leave).await;
        assert!(leave.is_cancelled(), "the node did not leave");
        let error = outcome
            .expect_err("a panic reported as success")
            .to_string();
        assert!(error.contains("failed"), "{error}");
        // The other parts end because the node leaves.
        let engine = parts.join_next().await.unwrap().unwrap().unwrap();
        assert!(matches!(engine, Part::Engine));
    }

    #[tokio::test]
    async fn a_trainer_that_fails_makes_the_node_leave_with_its_error() {
        let leave = CancellationToken::new();
        let mut parts = parts_with(&leave, || anyhow::bail!("the disk is full"));
        let outcome = supervised(&mut parts, &leave).await;
        assert!(leave.is_cancelled(), "the node did not leave");
        assert_eq!(outcome.unwrap_err().to_string(), "the disk is full");
    }

    /// An actor that ends while the node runs (the membership, here) is a fault too: the node
    /// leaves rather than run on without it.
    #[tokio::test]
    async fn an_actor_that_stops_on_its_own_makes_the_node_leave() {
        let leave = CancellationToken::new();
        let mut parts = parts_with(&leave, || Ok(Part::Replica));
        parts.spawn(async { Ok(Part::Membership) });
        let error = supervised(&mut parts, &leave)
            .await
            .unwrap_err()
            .to_string();
        assert!(leave.is_cancelled(), "the node did not leave");
        assert!(error.contains("Membership"), "{error}");
    }
}
