//! The sync engine: the actor that keeps this replica close to the others.
//!
//! Its decisions are the sans-IO [`Policy`]; this module is the I/O around it. The
//! actor's loop waits on the replica's due snapshots, the peer table, inbound streams, the ends
//! of the exchanges it runs (each a task in its [`JoinSet`]), a heartbeat tick and the
//! policy's own wake-up time; turns each into a [`Input`]; and carries out the
//! [`Action`]s that come back. No exchange runs in the loop itself, so the engine
//! always answers: a slow partner holds up one task, not the node.
//!
//! - `pairwise`: the initiator's side of a gossip (or elastic gossip) exchange.
//! - `elastic`: a worker's request to the elastic center, and the center variable.
//! - `serve`: the responder's side of every stream protocol.
//! - `state_sync`: taking over a peer's state.
//! - `ring`: `allreduce` rounds over a ring of trusted peers.
//!
//! The decisions are the sync crate's `Policy`, the checks of what is received its `screen`, and
//! its simulator (feature `sim`) runs many policies in virtual time.

mod copies;
mod elastic;
mod ends;
mod io;
mod pairwise;
mod ring;
mod serve;
mod state_sync;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use murmur_protocol::network::{
    Client, ConnectionKind, Incoming, Over, PeerId, Stream, StreamProtocol,
};
use murmur_protocol::{PARAMS_PROTOCOL, RING_PROTOCOL, STATE_PROTOCOL};
use murmur_sync::copies::BookFigures;
use murmur_sync::policy::{Action, Answer, EngineView, Input, Policy, View};
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::settings::{SyncSettings, Timeouts};
use murmur_sync::sides::{Side, Sides};
use murmur_sync::table::PeerTable;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::{AbortHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::clock;
use crate::model::ModelDescription;
use crate::node::messages::{Due, PeerNote, ToReplica};
use crate::readout::{Count, Progress, Readout};
use crate::store;

use copies::PairCopies;
use ends::Done;
use io::{ExchangeContext, Traced, stream_outcome, within};
pub use ring::mean_in_ring;
use state_sync::Transfers;

/// Where the center variable goes: at every epoch's end while this node holds it, and when it
/// leaves.
#[derive(Clone, Debug)]
pub struct CenterFile {
    pub path: PathBuf,
    /// The replica's model: the center's tensors.
    pub model: ModelDescription,
}

/// Everything the engine works with.
#[derive(Debug)]
pub struct EngineSetup {
    pub readout: Readout,
    pub sync: SyncSettings,
    pub timeouts: Timeouts,
    pub client: Client,
    pub replica: mpsc::Sender<ToReplica>,
    pub due: mpsc::Receiver<Due>,
    pub peers: watch::Receiver<PeerTable>,
    pub progress: watch::Receiver<Progress>,
    pub view: watch::Sender<EngineView>,
    /// Where the pair copies' figures go.
    pub pair_copies: watch::Sender<BookFigures>,
    /// The pair copies' budget in bytes (`[memory]`).
    pub pair_copies_budget: u64,
    /// The partners the policy found on slow links, for the membership actor to put in the
    /// peer table (where the staleness gate sees them) and for answering them without pausing.
    pub slow: watch::Sender<BTreeSet<PeerId>>,
    pub notes: mpsc::Sender<PeerNote>,
    pub center_file: CenterFile,
}

/// The engine's state around the policy.
struct Engine {
    policy: Policy,
    io: Arc<ExchangeContext>,
    peers: watch::Receiver<PeerTable>,
    view: watch::Sender<EngineView>,
    /// The replica's snapshot while its exchange lasts, and where its end goes. A pairwise
    /// offer takes the snapshot and hands it back unless its exchange let it go (decision
    /// 0091): the slot is empty meanwhile.
    due: Option<(Option<Arc<Snapshot>>, oneshot::Sender<ExchangeEnd>)>,
    tasks: JoinSet<Done>,
    /// The running tasks' sides of their streams (the node's own work filed under itself).
    sides: Sides<tokio::task::Id>,
    aborts: HashMap<tokio::task::Id, AbortHandle>,
    /// The inbound stream whose request the policy is deciding on.
    request: Option<(PeerId, serve::Inbound)>,
    /// The ring's connections between rounds (`None` while a round task holds them).
    ring: Option<Box<ring::RingIo>>,
    /// A center received by state sync, to seed from if this node becomes the center.
    inherited_center: Option<Vec<f32>>,
    center_file: CenterFile,
    center_saves: CenterSaves,
}

/// The center's saves while this node holds it: a crash loses one epoch of it at most.
#[derive(Debug, Default)]
struct CenterSaves {
    /// The epoch whose end the center was last saved at.
    epoch: u64,
    /// The save under way, if any: one at a time.
    under_way: Option<tokio::task::JoinHandle<()>>,
}

/// Runs the engine until `leave` is cancelled; then saves the center it holds.
pub async fn run(setup: EngineSetup, leave: CancellationToken) -> anyhow::Result<()> {
    let EngineSetup {
        readout,
        sync,
        timeouts,
        client,
        replica,
        mut due,
        peers,
        progress,
        view,
        pair_copies,
        pair_copies_budget,
        slow,
        notes,
        center_file,
    } = setup;
    let accept = |protocol: &'static str| {
        client
            .accept(StreamProtocol::new(protocol))
            .map_err(|e| anyhow::anyhow!("cannot accept `{protocol}` streams: {e}"))
    };
    // Parameters and state cross relays only where the run allows it (decision 0066).
    let tensors_over = if sync.relayed_exchanges {
        Over::Any
    } else {
        Over::Direct
    };
    let accept_tensors = |protocol: &'static str| {
        client
            .accept_over(StreamProtocol::new(protocol), tensors_over)
            .map_err(|e| anyhow::anyhow!("cannot accept `{protocol}` streams: {e}"))
    };
    let mut params_in = accept_tensors(PARAMS_PROTOCOL)?;
    let mut state_in = accept_tensors(STATE_PROTOCOL)?;
    let (mut ring_in, ring_queue, ring) = match sync.mode.ring() {
        Some(settings) => {
            let (queue, io) = ring::RingIo::start(settings.clone(), sync.trust.clone()).await?;
            (
                Some(accept(RING_PROTOCOL)?),
                Some(queue),
                Some(Box::new(io)),
            )
        }
        None => (None, None, None),
    };
    let me = readout.identity().peer_id;
    let policy = Policy::new(
        me,
        &readout.identity().run_id,
        sync.clone(),
        timeouts,
        clock::now(),
    );
    view.send_replace(policy.view());
    let io = Arc::new(ExchangeContext {
        readout,
        sync,
        timeouts,
        client,
        replica,
        notes,
        progress,
        slow,
        center: Mutex::new(None),
        pairs: Arc::new(PairCopies::within(pair_copies_budget, pair_copies)),
        transfers: Transfers::default(),
    });
    let mut engine = Engine {
        policy,
        io,
        peers,
        view,
        due: None,
        tasks: JoinSet::new(),
        sides: Sides::default(),
        aborts: HashMap::new(),
        request: None,
        ring,
        inherited_center: None,
        center_file,
        center_saves: CenterSaves::default(),
    };
    let mut tick = tokio::time::interval(timeouts.heartbeat);
    loop {
        let wake = engine.policy.next_wake();
        tokio::select! {
            biased;
            () = leave.cancelled() => break,
            Some(done) = engine.tasks.join_next_with_id(), if !engine.tasks.is_empty() => {
                engine.on_done(done);
            }
            Some(snapshot) = due.recv() => engine.on_due(snapshot),
            Ok(()) = engine.peers.changed() => engine.input(Input::PeersChanged),
            Some((peer, stream)) = params_in.next() => engine.on_stream(peer, stream, PARAMS_PROTOCOL),
            Some((peer, stream)) = state_in.next() => engine.on_stream(peer, stream, STATE_PROTOCOL),
            Some((peer, stream)) = next_stream(&mut ring_in) => {
                if let Some(queue) = &ring_queue {
                    ring::admit(queue, peer, stream, &engine.io.sync.trust);
                }
            }
            _ = tick.tick() => {
                engine.input(Input::Tick);
                engine.io.transfers.expire(tokio::time::Instant::now());
                engine.save_center_at_epoch_end();
            }
            () = sleep_until(wake), if wake.is_some() => engine.input(Input::Wake),
        }
    }
    engine.tasks.shutdown().await;
    if let Some(saving) = engine.center_saves.under_way.take() {
        let _ = saving.await;
    }
    let center = engine
        .io
        .center
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    if let Some(center) = center {
        save_center(&engine.io, &engine.center_file, center)?;
        info!(path = %engine.center_file.path.display(), "elastic center saved");
    }
    Ok(())
}

/// The next ring stream, or never when this node runs no rings.
async fn next_stream(incoming: &mut Option<Incoming>) -> Option<(PeerId, Stream)> {
    match incoming {
        Some(incoming) => incoming.next().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

fn save_center(io: &ExchangeContext, file: &CenterFile, params: Vec<f32>) -> anyhow::Result<()> {
    let progress = io.progress.borrow().figures();
    store::save_center(
        &file.path,
        &file.model,
        progress.step,
        progress.epoch,
        params,
    )?;
    debug!(path = %file.path.display(), step = progress.step, "elastic center saved");
    Ok(())
}

impl Engine {
    /// Saves the center this node holds once per epoch, off the engine's task, one save at a
    /// time.
    fn save_center_at_epoch_end(&mut self) {
        let epoch = self.io.progress.borrow().epoch;
        let saves = &mut self.center_saves;
        if epoch <= saves.epoch || saves.under_way.as_ref().is_some_and(|s| !s.is_finished()) {
            return;
        }
        let center = self
            .io
            .center
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(center) = center else {
            return;
        };
        saves.epoch = epoch;
        let (io, file) = (Arc::clone(&self.io), self.center_file.clone());
        saves.under_way = Some(tokio::task::spawn_blocking(move || {
            if let Err(e) = save_center(&io, &file, center) {
                warn!("cannot save the elastic center: {e:#}");
            }
        }));
    }

    /// Asks the policy about `input` and carries out what it decides.
    fn input(&mut self, input: Input) {
        let actions = {
            let table = self.peers.borrow_and_update();
            let view = View {
                now: clock::now(),
                own_step: self.io.own_step(),
                peers: &table,
            };
            self.policy.handle(input, &view)
        };
        for action in actions {
            self.execute(action);
        }
    }

    fn spawn(
        &mut self,
        peer: PeerId,
        side: Side,
        task: impl std::future::Future<Output = Done> + Send + 'static,
    ) {
        let relayed = self.peers.borrow().connection(&peer) == Some(ConnectionKind::Relayed);
        let abort = self.tasks.spawn(io::THROUGH_RELAY.scope(relayed, task));
        self.sides.open(abort.id(), peer, side);
        self.aborts.insert(abort.id(), abort);
    }

    fn due_snapshot(&self) -> Option<Arc<Snapshot>> {
        self.due.as_ref().and_then(|(snapshot, _)| snapshot.clone())
    }

    /// The due snapshot, out of its slot, for an exchange that may let it go.
    fn take_due_snapshot(&mut self) -> Option<Arc<Snapshot>> {
        self.due.as_mut().and_then(|(snapshot, _)| snapshot.take())
    }

    /// An offer of the due snapshot ended and handed it back (`Some`), or let it go: then the
    /// policy hears that it is spent, should the exchange have ended without a mix.
    fn offered_back(&mut self, back: Option<Arc<Snapshot>>) {
        let Some((slot, _)) = self.due.as_mut() else {
            return;
        };
        match back {
            Some(snapshot) => *slot = Some(snapshot),
            None if slot.is_none() => self.input(Input::SnapshotSpent),
            None => {}
        }
    }

    /// Gives the replica the end of its due exchange.
    fn deliver(&mut self, end: ExchangeEnd) {
        if let Some((_, sender)) = self.due.take() {
            let _ = sender.send(end);
        }
    }

    fn on_due(&mut self, due: Due) {
        let step = due.snapshot.step;
        self.due = Some((Some(Arc::new(due.snapshot)), due.end));
        self.input(Input::Due {
            step,
            step_secs: due.step_secs,
        });
    }

    /// An inbound stream: its first frame is read in a task of its own, unless too many are.
    fn on_stream(&mut self, peer: PeerId, stream: Stream, protocol: &'static str) {
        if self.peers.borrow().is_blocked(&peer) {
            return;
        }
        if !self.sides.admits(&peer) {
            self.io.readout.counters().count(Count::InboundDropped);
            debug!(peer = %peer, "too many inbound streams; dropping one");
            return;
        }
        let io = Arc::clone(&self.io);
        self.spawn(peer, Side::Request, async move {
            Done::Request {
                peer,
                read: serve::read_request(&io, peer, protocol, stream)
                    .await
                    .map(Box::new),
            }
        });
    }

    fn execute(&mut self, action: Action) {
        match action {
            Action::Offer {
                peer,
                codec,
                weight,
                screen,
            } => {
                let Some(snapshot) = self.take_due_snapshot() else {
                    return;
                };
                let io = Arc::clone(&self.io);
                self.spawn(peer, Side::Exchange, async move {
                    let started = clock::now();
                    let (outcome, end, back) =
                        pairwise::offer(&io, peer, snapshot, codec, weight, screen).await;
                    Done::Exchanged {
                        peer,
                        outcome,
                        end,
                        started,
                        back,
                    }
                });
            }
            Action::AskCenter { peer, screen } => {
                let Some(snapshot) = self.due_snapshot() else {
                    return;
                };
                let io = Arc::clone(&self.io);
                self.spawn(peer, Side::Exchange, async move {
                    let started = clock::now();
                    let (outcome, end) = elastic::ask_center(&io, peer, snapshot, screen).await;
                    Done::Exchanged {
                        peer,
                        outcome,
                        end,
                        started,
                        // The engine kept the snapshot: the center's answer never spends it.
                        back: None,
                    }
                });
            }
            Action::StepOwnCenter { alpha } => {
                let Some(snapshot) = self.due_snapshot() else {
                    return;
                };
                if let Some(delta) = elastic::step_center(&self.io, &snapshot.params, alpha) {
                    self.deliver(ExchangeEnd::Subtract(delta));
                    self.io.readout.counters().count(Count::Exchange);
                }
                self.due = None;
            }
            Action::Release => self.due = None,
            Action::Serve { peer, answer } => self.serve(peer, answer),
            Action::PullState { peer, announced } => {
                let io = Arc::clone(&self.io);
                self.spawn(peer, Side::Pull, async move {
                    Done::StateSynced {
                        peer,
                        result: state_sync::pull(&io, peer, announced).await,
                    }
                });
            }
            Action::Round {
                round,
                members,
                attempt,
            } => {
                let (Some(ring), Some(snapshot)) = (self.ring.take(), self.due_snapshot()) else {
                    return;
                };
                let io = Arc::clone(&self.io);
                let me = io.readout.identity().peer_id;
                self.spawn(me, Side::Own, async move {
                    let started = clock::now();
                    let peers = members.len();
                    let (ring, result) =
                        ring::attempt(&io, ring, round, attempt, members, snapshot).await;
                    Done::Round {
                        ring,
                        round,
                        peers,
                        result,
                        started,
                    }
                });
            }
            Action::Cancel { peer } => {
                for key in self.sides.with(&peer) {
                    if let Some(abort) = self.aborts.get(&key) {
                        abort.abort();
                    }
                }
            }
            Action::Offence { peer, rejection } => {
                self.io.readout.counters().count(Count::Rejected);
                debug!(peer = %peer, reason = %rejection, "offence");
                // A full queue means the membership actor is busy with offences already.
                let _ = self
                    .io
                    .notes
                    .try_send(PeerNote::Offence { peer, rejection });
            }
            Action::Publish(view) => {
                self.view.send_replace(view);
            }
            Action::SeedCenter => {
                let inherited = self.inherited_center.take();
                let io = Arc::clone(&self.io);
                let me = io.readout.identity().peer_id;
                self.spawn(me, Side::Own, async move {
                    let seed = match inherited {
                        Some(center) => Some(center),
                        None => io.ask_replica(ToReplica::Snapshot).await.map(|s| s.params),
                    };
                    Done::CenterSeeded(seed)
                });
            }
            Action::DropCenter => {
                *self.io.center.lock().unwrap_or_else(|p| p.into_inner()) = None;
            }
            Action::SlowLinks(peers) => {
                debug!(peers = ?peers, "partners on slow links");
                self.io.slow.send_replace(peers);
            }
        }
    }

    /// Answers the request the policy just decided on.
    fn serve(&mut self, peer: PeerId, answer: Answer) {
        let Some((from, inbound)) = self.request.take() else {
            return;
        };
        if from != peer {
            return;
        }
        let io = Arc::clone(&self.io);
        let pairwise = matches!(answer, Answer::Exchange { .. });
        self.spawn(peer, Side::Serve { pairwise }, async move {
            let outcome = serve::answer(&io, peer, inbound, answer).await;
            Done::Served { peer, outcome }
        });
    }
}
