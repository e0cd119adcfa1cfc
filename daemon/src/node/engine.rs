//! The sync engine: the async task that keeps this replica close to the others. It decides
//! when and with whom to exchange (with the sans-IO rules of `murmur_protocol::sync`), runs the
//! exchanges over `/murmur/params/1` and `/murmur/state/2`, validates everything it receives,
//! and hands mixes to the trainer thread.
//!
//! - `gossip`: every `interval` steps the trainer hands over a snapshot; the engine sends it to
//!   a random live peer that is not busy and mixes in the snapshot that comes back
//!   (push-pull, `w = 0.5`). A node in an exchange answers others with `Busy`.
//! - `elastic`: workers send their snapshot to the elected center, which moves its center
//!   variable by `d = alpha (x_i - center)` and answers with `d`; with
//!   `elastic.topology = "gossip"` the exchange is pairwise with weight `alpha`.
//! - state sync: a node that starts far behind the run (late join, restart without a recent
//!   checkpoint) takes over the parameters, clock and optimizer state of the most advanced peer.
//!
//! `serve` answers other peers' streams; `state_sync` takes over a peer's state; `stats` holds
//! the counters behind `GET /status`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::AsyncWriteExt;
use murmur_protocol::heartbeat::{Role, SyncMode};
use murmur_protocol::network::{Client, PeerId, Stream, StreamProtocol};
use murmur_protocol::sync::{
    CenterTracker, DistanceFilter, choose_partner, elect_center, mix_weight,
};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader, WireError};
use murmur_protocol::{PARAMS_PROTOCOL, STATE_PROTOCOL};
use murmur_trainer::averaging;
use murmur_trainer::checkpoint::{self, Checkpoint};
use murmur_trainer::params::ParamLayout;
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tracing::{Instrument, debug, info, warn};

use crate::node::messages::{Snapshot, ToTrainer, TrainerState};
use crate::readout::{NodeState, SyncStats, lock};
use crate::settings::{HEARTBEAT_INTERVAL, SyncSettings};

mod ring;
mod serve;
mod state_sync;

pub use ring::mean_in_ring;

/// Longest a whole exchange (both frames) may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest the trainer may take to answer a snapshot request (one step, normally).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30);
/// How often an exchange looks whether its partner is still live.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(100);
/// Partner attempts per due exchange before giving up until the next interval.
const MAX_PARTNER_TRIES: usize = 6;
/// How long a peer that answered `Busy` is left alone: about one exchange of the default MLP on
/// loopback (~12 ms), so that it is asked again as soon as it is likely to be free.
const BUSY_BACKOFF: Duration = Duration::from_millis(20);
/// How long a peer whose exchange failed (gone, timed out, reset) is left alone.
const FAILURE_BACKOFF: Duration = Duration::from_secs(1);
/// Inbound tensor streams served at once; more are dropped (bounds receive memory).
const MAX_INBOUND: usize = 4;
/// State-sync attempts before a joiner gives up and trains from where it is.
const MAX_STATE_SYNC_TRIES: u32 = 3;

/// One exchange of this replica under way, counted in `NodeState::exchanges_in_flight` (the
/// trainer waits on that count); dropping it, on any path out of the exchange, counts it out and
/// wakes the trainer.
struct InFlight<'a>(&'a Context);

impl<'a> InFlight<'a> {
    /// Counts an exchange in (one this node answers).
    fn begin(ctx: &'a Context) -> Self {
        ctx.state.exchanges_in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(ctx)
    }

    /// Takes over an exchange the trainer already counted in (one it handed over).
    fn adopt(ctx: &'a Context) -> Self {
        InFlight(ctx)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0
            .state
            .exchanges_in_flight
            .fetch_sub(1, Ordering::AcqRel);
        // Queued after any mix of this exchange, so the trainer applies that first.
        let _ = self.0.trainer.try_send(ToTrainer::Wake);
    }
}

/// How a gossip offer ended without failing.
enum Offered {
    /// The partner answered with its snapshot and has ours: mix `other` with `weight`.
    Accepted { other: Vec<f32>, weight: f32 },
    /// The partner is in another exchange.
    Busy,
    /// The partner's snapshot is too old to mix; declined.
    Stale,
}

/// Why an exchange did not produce a mix.
enum Failure {
    /// The peer sent something invalid: it is scored down.
    Offence(String),
    /// The stream failed (peer gone, connection reset): no one's fault.
    Io(String),
    /// The exchange took longer than [`EXCHANGE_TIMEOUT`].
    TimedOut,
}

impl Failure {
    /// The outcome a span records, as the `murmur_exchanges_total` label names it.
    fn outcome(&self) -> &'static str {
        match self {
            Failure::Offence(_) => "rejected",
            Failure::Io(_) | Failure::TimedOut => "failed",
        }
    }
}

/// The span of one exchange with `peer` (an OTLP span when telemetry is exported); its outcome
/// and bytes are recorded when it ends.
fn exchange_span(peer: PeerId, step: u64) -> tracing::Span {
    tracing::info_span!(
        "exchange",
        peer = %peer,
        step,
        outcome = tracing::field::Empty,
        bytes_sent = tracing::field::Empty,
        bytes_received = tracing::field::Empty,
    )
}

fn param_bytes(values: usize) -> u64 {
    (values * std::mem::size_of::<f32>()) as u64
}

/// What an exchange came to, on its span: its outcome and the values sent and received.
fn record_exchange(span: &tracing::Span, outcome: &str, sent: usize, received: usize) {
    span.record("outcome", outcome);
    span.record("bytes_sent", param_bytes(sent));
    span.record("bytes_received", param_bytes(received));
}

/// Runs one exchange (or state sync) under [`EXCHANGE_TIMEOUT`].
async fn within<T>(
    exchange: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::time::timeout(EXCHANGE_TIMEOUT, exchange)
        .await
        .unwrap_or(Err(Failure::TimedOut))
}

/// [`within`], and given up as soon as `peer`, live when the exchange began, times out or
/// leaves: a killed peer's stream may never end (QUIC sends nothing when a process dies), and a
/// trainer that pauses for its exchanges must not wait longer than the peer timeout.
async fn while_live<T>(
    ctx: &Context,
    peer: PeerId,
    exchange: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    let is_live = || lock(&ctx.state.membership).get(&peer).is_some();
    if !is_live() {
        return within(exchange).await;
    }
    let gone = async {
        let mut check = tokio::time::interval(PEER_CHECK_INTERVAL);
        while is_live() {
            check.tick().await;
        }
    };
    tokio::select! {
        outcome = within(exchange) => outcome,
        () = gone => Err(Failure::Io("the peer left during the exchange".into())),
    }
}

/// Checks that `values` is a whole parameter buffer of `count` finite values; the error names
/// `what` was wrong.
fn full_and_finite(values: &[f32], count: usize, what: &str) -> Result<(), String> {
    if values.len() != count {
        return Err(format!(
            "{what}: {} values, this model has {count}",
            values.len()
        ));
    }
    if !values.iter().all(|v| v.is_finite()) {
        return Err(format!("{what} contain NaN or infinite values"));
    }
    Ok(())
}

impl From<WireError> for Failure {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Truncated | WireError::Empty | WireError::Io(_) => {
                Failure::Io(e.to_string())
            }
            other => Failure::Offence(other.to_string()),
        }
    }
}

/// Distances below this share of a replica's norm are never outliers (see [`DistanceFilter`]).
const OUTLIER_FLOOR: f64 = 0.05;

fn outlier_floor(own: &[f32]) -> f64 {
    OUTLIER_FLOOR * averaging::norm(own)
}

/// Where the center variable goes when its holder leaves.
#[derive(Clone, Debug)]
pub struct CenterFile {
    pub path: std::path::PathBuf,
    pub layout: ParamLayout,
    pub config_hash: String,
}

/// What the engine and the stream handlers share.
struct Context {
    settings: SyncSettings,
    state: Arc<NodeState>,
    trainer: SyncSender<ToTrainer>,
    offences: mpsc::Sender<(PeerId, String)>,
    /// Set while this node is in a pairwise exchange, as initiator or responder.
    exchanging: AtomicBool,
    /// Distances `||x_other - x_own||` of recent accepted exchanges.
    distances: Mutex<DistanceFilter>,
    /// Norms of recent elastic deltas received from the center.
    deltas: Mutex<DistanceFilter>,
    /// The elastic center variable, while this node holds it.
    center: Mutex<Option<Vec<f32>>>,
    /// A center received by state sync, to seed from if this node becomes the center.
    inherited_center: Mutex<Option<Vec<f32>>>,
    inbound: Arc<Semaphore>,
    joining: AtomicBool,
}

/// Releases the exchange claim when an exchange ends, however it ends.
struct Claim<'a>(&'a AtomicBool);

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Context {
    fn param_bytes(&self) -> u64 {
        self.state.param_count as u64 * 4
    }

    fn expect(&self) -> Expect<'_> {
        Expect {
            run_id: &self.state.run_id,
            fingerprint: &self.state.fingerprint,
            max_payload_bytes: self.param_bytes(),
        }
    }

    fn stats(&self) -> &SyncStats {
        &self.state.sync_stats
    }

    fn own_step(&self) -> u64 {
        lock(&self.state.progress).step
    }

    /// Claims this node for one pairwise exchange; `None` if it is in one already.
    fn claim(&self) -> Option<Claim<'_>> {
        self.exchanging
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| Claim(&self.exchanging))
    }

    /// Asks the trainer thread for a snapshot; it answers at its next step boundary.
    async fn snapshot(&self) -> Option<Snapshot> {
        self.ask_trainer(ToTrainer::Snapshot).await
    }

    /// Asks the trainer thread for its whole state (to serve a state sync).
    async fn trainer_state(&self) -> Option<TrainerState> {
        self.ask_trainer(ToTrainer::State).await
    }

    /// Sends the trainer thread the request `ask` makes of a reply channel, and waits up to
    /// [`SNAPSHOT_TIMEOUT`] for the answer.
    async fn ask_trainer<T>(&self, ask: impl FnOnce(oneshot::Sender<T>) -> ToTrainer) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.trainer.try_send(ask(tx)).ok()?;
        tokio::time::timeout(SNAPSHOT_TIMEOUT, rx).await.ok()?.ok()
    }

    fn to_trainer(&self, msg: ToTrainer) -> bool {
        self.trainer.try_send(msg).is_ok()
    }

    /// Counts an exchange that failed on the way (no one's fault) and says why.
    fn failed(&self, peer: PeerId, failure: &Failure) {
        SyncStats::bump(&self.stats().failed);
        match failure {
            Failure::TimedOut => warn!(peer = %peer, "exchange timed out"),
            Failure::Io(reason) | Failure::Offence(reason) => {
                debug!(peer = %peer, %reason, "exchange failed");
            }
        }
    }

    fn offence(&self, peer: PeerId, reason: String) {
        SyncStats::bump(&self.stats().rejected);
        debug!(peer = %peer, %reason, "offence");
        // A full queue means the main loop is already busy with offences; dropping one is fine.
        let _ = self.offences.try_send((peer, reason));
    }

    async fn send(
        &self,
        stream: &mut Stream,
        kind: MessageKind,
        step: u64,
        payload: &[f32],
    ) -> Result<(), WireError> {
        let header = TensorHeader::for_payload(
            kind,
            &self.state.run_id,
            &self.state.fingerprint,
            step,
            payload,
        );
        let bytes = wire::write_frame(stream, &header, payload).await?;
        self.stats().bytes_out.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Answers `Busy` (not now, or declined) and ends the stream.
    async fn busy(&self, stream: &mut Stream) -> Result<(), Failure> {
        self.send(stream, MessageKind::Busy, self.own_step(), &[])
            .await?;
        let _ = stream.close().await;
        Ok(())
    }

    /// Reads one frame; a full frame counts as tensor bytes in.
    async fn receive(
        &self,
        stream: &mut Stream,
        into: &mut Vec<f32>,
    ) -> Result<TensorHeader, WireError> {
        let header = wire::read_frame(stream, &self.expect(), into).await?;
        self.state
            .bytes_in
            .fetch_add(header.byte_len, Ordering::Relaxed);
        Ok(header)
    }

    /// Checks received parameters against this node's `own`: the full length, finite, and not
    /// an outlier in distance. Returns the reason when they must not be mixed.
    fn validate_params(&self, values: &[f32], own: &[f32]) -> Result<(), String> {
        full_and_finite(values, own.len(), "parameters")?;
        self.check_distance(values, own)
    }

    /// The distance part of [`Context::validate_params`], for parameters already checked.
    fn check_distance(&self, values: &[f32], own: &[f32]) -> Result<(), String> {
        lock(&self.distances).check(averaging::distance(values, own), outlier_floor(own))
    }

    /// The weight to mix parameters stamped `theirs` into a replica at `own`, or `None` (and
    /// counted) when they are too stale.
    fn weight(&self, own: u64, theirs: u64, base: f32) -> Option<f32> {
        let weight = mix_weight(
            own,
            theirs,
            self.settings.max_staleness,
            base,
            self.settings.age_weighting,
        );
        if weight.is_none() {
            SyncStats::bump(&self.stats().stale);
        }
        weight
    }

    /// `p`: the live peers this one is coupled to, this one included.
    fn live_count(&self) -> usize {
        self.coupled_peers().len() + 1
    }

    /// Live peers this one is coupled to (same mode, not joining), this node not counted.
    fn coupled_peers(&self) -> Vec<(PeerId, Role)> {
        lock(&self.state.membership)
            .peers()
            .filter(|(_, v)| v.mode == self.settings.mode && v.role != Role::Joining)
            .map(|(p, v)| (*p, v.role))
            .collect()
    }
}

/// Starts the engine and the stream handlers; returns when the node shuts down.
pub async fn run(
    settings: SyncSettings,
    state: Arc<NodeState>,
    client: Client,
    trainer: SyncSender<ToTrainer>,
    mut due: mpsc::Receiver<Snapshot>,
    offences: mpsc::Sender<(PeerId, String)>,
    center_file: CenterFile,
) -> anyhow::Result<()> {
    let seed = {
        let digest = Sha256::digest(state.peer_id.to_bytes());
        settings.seed ^ u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
    };
    let joining = settings.mode != SyncMode::Solo;
    if joining {
        *lock(&state.role) = Role::Joining;
    }
    let ctx = Arc::new(Context {
        settings,
        state: Arc::clone(&state),
        trainer,
        offences,
        exchanging: AtomicBool::new(false),
        distances: Mutex::new(DistanceFilter::default()),
        deltas: Mutex::new(DistanceFilter::default()),
        center: Mutex::new(None),
        inherited_center: Mutex::new(None),
        inbound: Arc::new(Semaphore::new(MAX_INBOUND)),
        joining: AtomicBool::new(joining),
    });
    for protocol in [PARAMS_PROTOCOL, STATE_PROTOCOL] {
        let incoming = client
            .stream_control()
            .accept(StreamProtocol::new(protocol))
            .map_err(|e| anyhow::anyhow!("cannot accept `{protocol}` streams: {e}"))?;
        tokio::spawn(serve::accept(Arc::clone(&ctx), incoming, protocol));
    }
    let ring = match ctx.settings.ring.clone() {
        Some(settings) => Some(ring::RingState::start(settings, &client).await?),
        None => None,
    };
    let mut engine = Engine {
        ring,
        ctx: Arc::clone(&ctx),
        client,
        rng: ChaCha8Rng::seed_from_u64(seed),
        backoff: HashMap::new(),
        join_tries: 0,
        tracker: CenterTracker::default(),
    };
    let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
    let mut stop = state.shutdown_signal();
    let stopped = async move {
        let _ = stop.wait_for(|stop| *stop).await;
    };
    tokio::pin!(stopped);
    loop {
        tokio::select! {
            () = &mut stopped => break,
            _ = tick.tick() => engine.maintain().await,
            () = state.peer_joined.notified(), if ctx.joining.load(Ordering::Relaxed) => {
                engine.maintain().await;
            }
            Some(snapshot) = due.recv() => {
                // The trainer counted this exchange in when it handed the snapshot over.
                let _in_flight = InFlight::adopt(&ctx);
                engine.exchange(snapshot).await;
            }
        }
    }
    let center = lock(&ctx.center).take();
    if let Some(center) = center {
        save_center(&ctx, &center_file, center)?;
    }
    Ok(())
}

fn save_center(ctx: &Context, file: &CenterFile, params: Vec<f32>) -> anyhow::Result<()> {
    let step = ctx.own_step();
    let ckpt = Checkpoint {
        step,
        epoch: lock(&ctx.state.progress).epoch,
        config_hash: file.config_hash.clone(),
        fingerprint: ctx.state.fingerprint.clone(),
        params,
        optimizer_state: Vec::new(),
        optimizer_state_names: Vec::new(),
        optimizer_updates: 0,
    };
    let bytes = ckpt.to_bytes(&file.layout)?;
    if let Some(dir) = file.path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    checkpoint::write_atomic(&file.path, &bytes)?;
    info!(path = %file.path.display(), step, "elastic center saved");
    Ok(())
}

struct Engine {
    ctx: Arc<Context>,
    client: Client,
    rng: ChaCha8Rng,
    /// Peers to leave alone until the given time (they were busy or failed).
    backoff: HashMap<PeerId, Instant>,
    join_tries: u32,
    tracker: CenterTracker<PeerId>,
    /// `allreduce` mode: this node's side of the rings.
    ring: Option<ring::RingState>,
}

impl Engine {
    /// Once a heartbeat period: finish joining, and (elastic) follow the center election.
    async fn maintain(&mut self) {
        if self.ctx.joining.load(Ordering::Relaxed) {
            self.try_join().await;
        }
        if self.ctx.settings.centered() {
            self.elect().await;
        }
    }

    /// A snapshot is due: exchange it according to the mode.
    async fn exchange(&mut self, snapshot: Snapshot) {
        if self.ring.is_some() {
            // A ring round finishes joining first: the trainer waits for its mean.
            self.ring_round(snapshot).await;
            return;
        }
        if self.ctx.joining.load(Ordering::Relaxed) {
            return;
        }
        if self.ctx.settings.pairwise() {
            self.push_pull(snapshot).await;
        } else if self.ctx.settings.centered() {
            self.elastic(snapshot).await;
        }
    }

    /// Elastic: follows the deterministic election; a node that becomes the center seeds the
    /// center variable from the center it inherited, else from its own parameters.
    async fn elect(&mut self) {
        let ctx = Arc::clone(&self.ctx);
        let me = ctx.state.peer_id;
        let mut live: Vec<(PeerId, Vec<u8>)> = ctx
            .coupled_peers()
            .into_iter()
            .map(|(p, _)| (p, p.to_bytes()))
            .collect();
        if !ctx.joining.load(Ordering::Relaxed) {
            live.push((me, me.to_bytes()));
        }
        let configured = ctx.settings.center.map(|p| p.to_bytes());
        let elected = elect_center(&live, &ctx.state.run_id, configured.as_deref());
        if let Some(version) = self.tracker.update(elected) {
            ctx.stats().center_version.store(version, Ordering::Relaxed);
            *lock(&ctx.state.center) = elected;
            if elected != Some(me) {
                *lock(&ctx.center) = None;
                let mut role = lock(&ctx.state.role);
                if *role == Role::Center {
                    *role = Role::Worker;
                }
                match elected {
                    Some(center) => info!(center = %center, version, "elastic center elected"),
                    None => info!(version, "no elastic center while alone"),
                }
            }
        }
        if elected == Some(me) && lock(&ctx.center).is_none() {
            let inherited = lock(&ctx.inherited_center).take();
            let seed = match inherited {
                Some(center) => Some(center),
                None => ctx.snapshot().await.map(|s| s.params),
            };
            if let Some(seed) = seed {
                *lock(&ctx.center) = Some(seed);
                *lock(&ctx.state.role) = Role::Center;
                info!(
                    version = self.tracker.version(),
                    "this node holds the elastic center"
                );
            }
        }
    }

    /// A random live partner that is not backing off; else, when every live partner is only
    /// briefly busy, the time at which the first of them may be asked again.
    fn pick_partner(&mut self) -> Result<PeerId, Option<Instant>> {
        let live: Vec<PeerId> = self
            .ctx
            .coupled_peers()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        let now = Instant::now();
        self.backoff.retain(|_, until| *until > now);
        let busy = self.backoff.keys().copied().collect();
        if let Some(peer) = choose_partner(&live, &busy, &mut self.rng) {
            return Ok(peer);
        }
        Err(live
            .iter()
            .filter_map(|p| self.backoff.get(p).copied())
            .filter(|until| *until <= now + BUSY_BACKOFF)
            .min())
    }

    /// Gossip: offer an exchange to a partner, pull its snapshot, push ours, mix.
    async fn push_pull(&mut self, snapshot: Snapshot) {
        let ctx = Arc::clone(&self.ctx);
        // Answering another peer right now: that is this interval's mix.
        let Some(_claim) = ctx.claim() else {
            return;
        };
        for _ in 0..MAX_PARTNER_TRIES {
            let peer = match self.pick_partner() {
                Ok(peer) => peer,
                // Every partner is in another exchange: ask again when the first may be free.
                Err(Some(free_at)) => {
                    tokio::time::sleep_until(free_at.into()).await;
                    continue;
                }
                Err(None) => return,
            };
            let started = Instant::now();
            let span = exchange_span(peer, snapshot.step);
            let offered = while_live(&ctx, peer, self.offer(peer, &snapshot))
                .instrument(span.clone())
                .await;
            let (outcome, sent, received) = match &offered {
                Ok(Offered::Accepted { other, .. }) => ("ok", snapshot.params.len(), other.len()),
                Ok(Offered::Busy) => ("busy", 0, 0),
                Ok(Offered::Stale) => ("stale", 0, 0),
                Err(failure) => (failure.outcome(), 0, 0),
            };
            record_exchange(&span, outcome, sent, received);
            match offered {
                Ok(Offered::Accepted { other, weight }) => {
                    if ctx.to_trainer(ToTrainer::Mix {
                        other,
                        base: snapshot.params,
                        weight,
                    }) {
                        SyncStats::bump(&ctx.stats().exchanges);
                        ctx.stats().timings.exchange_done(started.elapsed());
                        debug!(peer = %peer, ms = started.elapsed().as_millis() as u64, "exchange done");
                    }
                    return;
                }
                Ok(Offered::Busy) => {
                    SyncStats::bump(&ctx.stats().busy);
                    self.backoff.insert(peer, Instant::now() + BUSY_BACKOFF);
                }
                Ok(Offered::Stale) => return,
                Err(Failure::Offence(reason)) => {
                    ctx.offence(peer, reason);
                    return;
                }
                Err(failure) => {
                    ctx.failed(peer, &failure);
                    self.backoff.insert(peer, Instant::now() + FAILURE_BACKOFF);
                }
            }
        }
    }

    /// The initiator's side of a pairwise exchange on `/murmur/params/1`: `Offer`, then the
    /// partner's `Params` (or `Busy`), then ours. Nothing large is sent to a busy partner.
    /// Returns what to mix once our half is sent, so both sides mix or neither.
    async fn offer(&self, peer: PeerId, snapshot: &Snapshot) -> Result<Offered, Failure> {
        let ctx = &self.ctx;
        let mut stream = self.open(peer, PARAMS_PROTOCOL).await?;
        ctx.send(&mut stream, MessageKind::Offer, snapshot.step, &[])
            .await?;
        let mut other = Vec::new();
        let header = ctx.receive(&mut stream, &mut other).await?;
        match header.kind {
            MessageKind::Params => {}
            MessageKind::Busy => {
                let _ = stream.close().await;
                return Ok(Offered::Busy);
            }
            kind => {
                return Err(Failure::Offence(format!(
                    "answered an exchange offer with {kind:?}"
                )));
            }
        }
        lock(&ctx.state.membership).saw_step(&peer, header.step);
        // Declining (`Busy`) tells the partner not to mix either.
        if let Err(reason) = ctx.validate_params(&other, &snapshot.params) {
            ctx.busy(&mut stream).await?;
            return Err(Failure::Offence(reason));
        }
        let base = ctx.settings.pair_weight(ctx.live_count());
        let Some(weight) = ctx.weight(snapshot.step, header.step, base) else {
            ctx.busy(&mut stream).await?;
            return Ok(Offered::Stale);
        };
        ctx.send(
            &mut stream,
            MessageKind::Params,
            snapshot.step,
            &snapshot.params,
        )
        .await?;
        let _ = stream.close().await;
        Ok(Offered::Accepted { other, weight })
    }

    async fn open(&self, peer: PeerId, protocol: &'static str) -> Result<Stream, Failure> {
        self.client
            .stream_control()
            .open_stream(peer, StreamProtocol::new(protocol))
            .await
            .map_err(|e| Failure::Io(e.to_string()))
    }

    /// Elastic worker: sends the snapshot to the center (or applies it locally when this node
    /// is the center) and subtracts the returned delta.
    async fn elastic(&mut self, snapshot: Snapshot) {
        let ctx = Arc::clone(&self.ctx);
        let Some(center) = self.tracker.center().copied() else {
            return;
        };
        if center == ctx.state.peer_id {
            let p = ctx.live_count();
            let delta = {
                let mut held = lock(&ctx.center);
                let Some(variable) = held.as_mut() else {
                    return;
                };
                averaging::elastic_step(variable, &snapshot.params, ctx.settings.alpha(p))
            };
            if ctx.to_trainer(ToTrainer::Subtract(delta)) {
                SyncStats::bump(&ctx.stats().exchanges);
            }
            return;
        }
        let started = Instant::now();
        let span = exchange_span(center, snapshot.step);
        let outcome = while_live(&ctx, center, self.request(center, &snapshot))
            .instrument(span.clone())
            .await;
        let (result, received) = match &outcome {
            Ok(Some((_, delta))) => ("ok", delta.len()),
            Ok(None) => ("busy", 0),
            Err(failure) => (failure.outcome(), 0),
        };
        record_exchange(&span, result, snapshot.params.len(), received);
        match outcome {
            Ok(Some((header, delta))) => {
                lock(&ctx.state.membership).saw_step(&center, header.step);
                if !delta.iter().all(|v| v.is_finite()) {
                    ctx.offence(
                        center,
                        "elastic delta contains NaN or infinite values".into(),
                    );
                    return;
                }
                let floor = outlier_floor(&snapshot.params);
                if let Err(reason) = lock(&ctx.deltas).check(averaging::norm(&delta), floor) {
                    ctx.offence(center, format!("elastic delta: {reason}"));
                    return;
                }
                if ctx.weight(snapshot.step, header.step, 1.0).is_none() {
                    return;
                }
                if ctx.to_trainer(ToTrainer::Subtract(delta)) {
                    SyncStats::bump(&ctx.stats().exchanges);
                    ctx.stats().timings.exchange_done(started.elapsed());
                }
            }
            Ok(None) => SyncStats::bump(&ctx.stats().busy),
            Err(Failure::Offence(reason)) => ctx.offence(center, reason),
            Err(failure) => ctx.failed(center, &failure),
        }
    }

    /// Elastic: sends `snapshot` to the center `peer` on `/murmur/params/1` and reads the
    /// answer: `Some` with its `Delta`, `None` for `Busy`.
    async fn request(
        &self,
        peer: PeerId,
        snapshot: &Snapshot,
    ) -> Result<Option<(TensorHeader, Vec<f32>)>, Failure> {
        let ctx = &self.ctx;
        let mut stream = self.open(peer, PARAMS_PROTOCOL).await?;
        ctx.send(
            &mut stream,
            MessageKind::Params,
            snapshot.step,
            &snapshot.params,
        )
        .await?;
        let mut answer = Vec::new();
        let header = ctx.receive(&mut stream, &mut answer).await?;
        let _ = stream.close().await;
        if header.kind == MessageKind::Busy {
            return Ok(None);
        }
        if header.kind != MessageKind::Delta {
            return Err(Failure::Offence(format!(
                "answered an elastic exchange with {:?}",
                header.kind
            )));
        }
        if answer.len() != ctx.state.param_count {
            return Err(Failure::Offence(format!(
                "{} values, this model has {}",
                answer.len(),
                ctx.state.param_count
            )));
        }
        Ok(Some((header, answer)))
    }
}
