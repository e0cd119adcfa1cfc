//! The sync engine: the async task that keeps this replica close to the others. It decides
//! when and with whom to exchange (with the sans-IO rules of `murmur_protocol::sync`), runs the
//! exchanges over `/murmur/params/1` and `/murmur/state/1`, validates everything it receives,
//! and hands mixes to the trainer thread.
//!
//! - `gossip`: every `interval` steps the trainer hands over a snapshot; the engine sends it to
//!   a random live peer that is not busy and mixes in the snapshot that comes back
//!   (push-pull, `w = 0.5`). A node in an exchange answers others with `Busy`.
//! - `elastic`: workers send their snapshot to the elected center, which moves its center
//!   variable by `d = alpha (x_i - center)` and answers with `d`; with
//!   `elastic.topology = "gossip"` the exchange is pairwise with weight `alpha`.
//! - state sync: a node that starts far behind the run (late join, restart without a recent
//!   checkpoint) takes over the parameters and clock of the most advanced peer.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{AsyncWriteExt, StreamExt};
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
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tracing::{debug, info, warn};

use crate::config::ElasticTopology;
use crate::node::{NodeState, lock};
use crate::worker::{Snapshot, ToTrainer};

/// Longest a whole exchange (both frames) may take.
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest the trainer may take to answer a snapshot request (one step, normally).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(30);
/// Partners tried per due exchange before giving up until the next interval.
const MAX_PARTNER_TRIES: usize = 3;
/// How long a peer that answered `Busy` (or failed) is left alone.
const BUSY_BACKOFF: Duration = Duration::from_millis(500);
/// Inbound tensor streams served at once; more are dropped (bounds receive memory).
const MAX_INBOUND: usize = 4;
/// State-sync attempts before a joiner gives up and trains from where it is.
const MAX_STATE_SYNC_TRIES: u32 = 3;
/// The file the elastic center is saved to when its holder leaves.
pub const CENTER_FILE: &str = "center.safetensors";

/// The `[sync]` settings of a run, resolved for this node.
#[derive(Clone, Debug)]
pub struct SyncSettings {
    pub mode: SyncMode,
    pub interval: u64,
    pub max_staleness: Option<u64>,
    pub age_weighting: bool,
    pub slowdown: f64,
    pub alpha: Option<f32>,
    pub topology: ElasticTopology,
    /// A configured elastic center.
    pub center: Option<PeerId>,
    /// Run seed: with the peer id, seeds partner choice.
    pub seed: u64,
}

impl SyncSettings {
    /// Exchanges are pairwise (gossip, or elastic gossip).
    fn pairwise(&self) -> bool {
        self.mode == SyncMode::Gossip
            || (self.mode == SyncMode::Elastic && self.topology == ElasticTopology::Gossip)
    }

    /// One peer holds a center variable (elastic with the default topology).
    fn centered(&self) -> bool {
        self.mode == SyncMode::Elastic && self.topology == ElasticTopology::Center
    }

    /// The elastic `alpha` for `p` live peers (this one included): configured, else `0.9 / p`.
    fn alpha(&self, p: usize) -> f32 {
        self.alpha.unwrap_or(0.9 / p.max(1) as f32)
    }

    /// The weight of a pairwise mix before age weighting.
    fn pair_weight(&self, p: usize) -> f32 {
        if self.mode == SyncMode::Elastic {
            self.alpha(p)
        } else {
            0.5
        }
    }
}

/// Counters of the sync engine and the staleness gate, read by `GET /status`.
#[derive(Debug, Default)]
pub struct SyncStats {
    exchanges: AtomicU64,
    served: AtomicU64,
    busy: AtomicU64,
    stale: AtomicU64,
    rejected: AtomicU64,
    failed: AtomicU64,
    bytes_out: AtomicU64,
    gate_wait_us: AtomicU64,
    max_lead: AtomicU64,
    state_syncs: AtomicU64,
    center_version: AtomicU64,
}

/// The sync part of `GET /status`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SyncReport {
    pub mode: String,
    pub role: String,
    pub interval: u64,
    /// `None`: the staleness bound is off.
    pub max_staleness: Option<u64>,
    /// Exchanges this node started that ended in a mix.
    pub exchanges: u64,
    /// Exchanges this node answered.
    pub served: u64,
    /// Partners that answered `Busy`.
    pub busy: u64,
    /// Received parameters dropped as older than the bound.
    pub stale: u64,
    /// Received parameters that failed validation.
    pub rejected: u64,
    /// Exchanges that failed on the way (peer gone, timeout).
    pub failed: u64,
    /// Tensor bytes sent (frames of every stream protocol).
    pub bytes_out: u64,
    /// Time spent waiting at the staleness gate.
    pub gate_wait_s: f64,
    /// Largest lead over the slowest coupled peer with which a step was taken.
    pub max_lead: u64,
    pub state_syncs: u64,
    /// The elastic center, as this node sees it.
    pub center: Option<String>,
    pub center_version: u64,
}

impl SyncStats {
    pub fn add_gate_wait(&self, waited: Duration) {
        self.gate_wait_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn observe_lead(&self, lead: u64) {
        self.max_lead.fetch_max(lead, Ordering::Relaxed);
    }

    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub fn report(
        &self,
        settings: &SyncSettings,
        role: Role,
        center: Option<PeerId>,
    ) -> SyncReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SyncReport {
            mode: format!("{:?}", settings.mode).to_lowercase(),
            role: format!("{role:?}").to_lowercase(),
            interval: settings.interval,
            max_staleness: settings.max_staleness,
            exchanges: get(&self.exchanges),
            served: get(&self.served),
            busy: get(&self.busy),
            stale: get(&self.stale),
            rejected: get(&self.rejected),
            failed: get(&self.failed),
            bytes_out: get(&self.bytes_out),
            gate_wait_s: get(&self.gate_wait_us) as f64 / 1e6,
            max_lead: get(&self.max_lead),
            state_syncs: get(&self.state_syncs),
            center: center.map(|c| c.to_string()),
            center_version: get(&self.center_version),
        }
    }
}

/// Why an exchange did not produce a mix.
enum Failure {
    /// The peer sent something invalid: it is scored down.
    Offence(String),
    /// The stream failed (peer gone, connection reset): no one's fault.
    Io(String),
}

impl From<WireError> for Failure {
    fn from(e: WireError) -> Self {
        match e {
            WireError::Truncated | WireError::Io(_) => Failure::Io(e.to_string()),
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
    pub dir: std::path::PathBuf,
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
        let (tx, rx) = oneshot::channel();
        self.trainer.try_send(ToTrainer::Snapshot(tx)).ok()?;
        tokio::time::timeout(SNAPSHOT_TIMEOUT, rx).await.ok()?.ok()
    }

    fn to_trainer(&self, msg: ToTrainer) -> bool {
        self.trainer.try_send(msg).is_ok()
    }

    fn offence(&self, peer: PeerId, reason: String) {
        SyncStats::bump(&self.stats().rejected);
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
        if values.len() != own.len() {
            return Err(format!(
                "{} values, this model has {}",
                values.len(),
                own.len()
            ));
        }
        if !values.iter().all(|v| v.is_finite()) {
            return Err("parameters contain NaN or infinite values".to_owned());
        }
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
        tokio::spawn(accept(Arc::clone(&ctx), incoming, protocol));
    }
    let mut engine = Engine {
        ctx: Arc::clone(&ctx),
        client,
        rng: ChaCha8Rng::seed_from_u64(seed),
        backoff: HashMap::new(),
        join_tries: 0,
        tracker: CenterTracker::default(),
    };
    let mut tick = tokio::time::interval(crate::node::HEARTBEAT_INTERVAL);
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
            Some(snapshot) = due.recv() => engine.exchange(snapshot).await,
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
    std::fs::create_dir_all(&file.dir)?;
    let path = file.dir.join(CENTER_FILE);
    checkpoint::write_atomic(&path, &bytes)?;
    info!(path = %path.display(), step, "elastic center saved");
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
}

impl Engine {
    /// Once a heartbeat period: finish joining, and (elastic) follow the center election.
    async fn maintain(&mut self) {
        let now = Instant::now();
        self.backoff.retain(|_, until| *until > now);
        if self.ctx.joining.load(Ordering::Relaxed) {
            self.try_join().await;
        }
        if self.ctx.settings.centered() {
            self.elect().await;
        }
    }

    /// A snapshot is due: exchange it according to the mode.
    async fn exchange(&mut self, snapshot: Snapshot) {
        if self.ctx.joining.load(Ordering::Relaxed) {
            return;
        }
        if self.ctx.settings.pairwise() {
            self.push_pull(snapshot).await;
        } else if self.ctx.settings.centered() {
            self.elastic(snapshot).await;
        }
    }

    /// Decides whether this node is far enough behind the run to take over a peer's state,
    /// does so, and then counts as joined.
    async fn try_join(&mut self) {
        let ctx = Arc::clone(&self.ctx);
        let own = ctx.own_step();
        let source = {
            let members = lock(&ctx.state.membership);
            // In elastic the center's holder is asked first: it has the center to hand over.
            let holder = members
                .peers()
                .find(|(_, v)| v.role == Role::Center)
                .map(|(p, v)| (*p, v.step));
            holder.or_else(|| members.most_advanced().map(|(p, s)| (*p, s)))
        };
        // Alone: nothing to catch up with yet.
        let Some((peer, their_step)) = source else {
            return;
        };
        let behind_limit = ctx
            .settings
            .max_staleness
            .unwrap_or(4 * ctx.settings.interval);
        if their_step > own + behind_limit && self.join_tries < MAX_STATE_SYNC_TRIES {
            self.join_tries += 1;
            match tokio::time::timeout(EXCHANGE_TIMEOUT, self.pull_state(peer)).await {
                Ok(Ok(step)) => {
                    SyncStats::bump(&ctx.stats().state_syncs);
                    info!(peer = %peer, from = own, to = step, "state sync done");
                }
                Ok(Err(Failure::Offence(reason))) => {
                    ctx.offence(peer, reason);
                    return;
                }
                Ok(Err(Failure::Io(reason))) => {
                    warn!(peer = %peer, %reason, "state sync failed; retrying");
                    return;
                }
                Err(_) => {
                    warn!(peer = %peer, "state sync timed out; retrying");
                    return;
                }
            }
        }
        ctx.joining.store(false, Ordering::Relaxed);
        let mut role = lock(&ctx.state.role);
        if *role == Role::Joining {
            *role = Role::Worker;
        }
        info!(step = ctx.own_step(), "joined the run");
    }

    /// Downloads a peer's parameters (and center) and hands them to the trainer.
    async fn pull_state(&mut self, peer: PeerId) -> Result<u64, Failure> {
        let ctx = Arc::clone(&self.ctx);
        let mut stream = self
            .client
            .stream_control()
            .open_stream(peer, StreamProtocol::new(STATE_PROTOCOL))
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
        ctx.send(&mut stream, MessageKind::State, ctx.own_step(), &[])
            .await?;
        let mut params = Vec::new();
        let header = ctx.receive(&mut stream, &mut params).await?;
        match header.kind {
            MessageKind::State => {}
            MessageKind::Busy => return Err(Failure::Io("the peer is not ready to share".into())),
            other => {
                return Err(Failure::Offence(format!(
                    "answered a state request with {other:?}"
                )));
            }
        }
        if params.len() != ctx.state.param_count || !params.iter().all(|v| v.is_finite()) {
            return Err(Failure::Offence(
                "state is not a full, finite parameter buffer".into(),
            ));
        }
        let mut center = Vec::new();
        match ctx.receive(&mut stream, &mut center).await {
            Ok(h) if h.kind == MessageKind::Center => {
                if center.len() != ctx.state.param_count || !center.iter().all(|v| v.is_finite()) {
                    return Err(Failure::Offence(
                        "center is not a full, finite parameter buffer".into(),
                    ));
                }
                *lock(&ctx.inherited_center) = Some(center);
            }
            Ok(h) => {
                return Err(Failure::Offence(format!(
                    "unexpected {:?} after the state",
                    h.kind
                )));
            }
            // No center follows: the stream just ends.
            Err(WireError::Truncated) => {}
            Err(e) => return Err(e.into()),
        }
        lock(&ctx.state.membership).saw_step(&peer, header.step);
        let step = header.step;
        if !ctx.to_trainer(ToTrainer::Adopt(Snapshot { step, params })) {
            return Err(Failure::Io("the trainer is not taking messages".into()));
        }
        Ok(step)
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

    /// A random live partner that is not backing off.
    fn pick_partner(&mut self) -> Option<PeerId> {
        let live: Vec<PeerId> = self
            .ctx
            .coupled_peers()
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        let busy = self.backoff.keys().copied().collect();
        choose_partner(&live, &busy, &mut self.rng)
    }

    /// Gossip: push this snapshot to a partner, pull its snapshot back, mix.
    async fn push_pull(&mut self, snapshot: Snapshot) {
        let ctx = Arc::clone(&self.ctx);
        // Answering another peer right now: skip this interval rather than wait.
        let Some(_claim) = ctx.claim() else {
            return;
        };
        for _ in 0..MAX_PARTNER_TRIES {
            let Some(peer) = self.pick_partner() else {
                return;
            };
            let started = Instant::now();
            let outcome = tokio::time::timeout(
                EXCHANGE_TIMEOUT,
                self.request(peer, &snapshot, MessageKind::Params),
            )
            .await;
            match outcome {
                Ok(Ok(Some((header, other)))) => {
                    lock(&ctx.state.membership).saw_step(&peer, header.step);
                    if let Err(reason) = ctx.validate_params(&other, &snapshot.params) {
                        ctx.offence(peer, reason);
                        return;
                    }
                    let p = ctx.coupled_peers().len() + 1;
                    let base = ctx.settings.pair_weight(p);
                    let Some(weight) = ctx.weight(snapshot.step, header.step, base) else {
                        return;
                    };
                    if ctx.to_trainer(ToTrainer::Mix {
                        other,
                        base: snapshot.params,
                        weight,
                    }) {
                        SyncStats::bump(&ctx.stats().exchanges);
                        debug!(peer = %peer, ms = started.elapsed().as_millis() as u64, "exchange done");
                    }
                    return;
                }
                Ok(Ok(None)) => {
                    SyncStats::bump(&ctx.stats().busy);
                    self.backoff.insert(peer, Instant::now() + BUSY_BACKOFF);
                }
                Ok(Err(Failure::Offence(reason))) => {
                    ctx.offence(peer, reason);
                    return;
                }
                Ok(Err(Failure::Io(reason))) => {
                    SyncStats::bump(&ctx.stats().failed);
                    debug!(peer = %peer, %reason, "exchange failed");
                    self.backoff.insert(peer, Instant::now() + BUSY_BACKOFF);
                }
                Err(_) => {
                    SyncStats::bump(&ctx.stats().failed);
                    warn!(peer = %peer, "exchange timed out");
                    self.backoff.insert(peer, Instant::now() + BUSY_BACKOFF);
                }
            }
        }
    }

    /// Elastic worker: sends the snapshot to the center (or applies it locally when this node
    /// is the center) and subtracts the returned delta.
    async fn elastic(&mut self, snapshot: Snapshot) {
        let ctx = Arc::clone(&self.ctx);
        let Some(center) = self.tracker.center().copied() else {
            return;
        };
        if center == ctx.state.peer_id {
            let p = ctx.coupled_peers().len() + 1;
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
        let outcome = tokio::time::timeout(
            EXCHANGE_TIMEOUT,
            self.request(center, &snapshot, MessageKind::Delta),
        )
        .await;
        match outcome {
            Ok(Ok(Some((header, delta)))) => {
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
                }
            }
            Ok(Ok(None)) => SyncStats::bump(&ctx.stats().busy),
            Ok(Err(Failure::Offence(reason))) => ctx.offence(center, reason),
            Ok(Err(Failure::Io(reason))) => {
                SyncStats::bump(&ctx.stats().failed);
                debug!(center = %center, %reason, "elastic exchange failed");
            }
            Err(_) => {
                SyncStats::bump(&ctx.stats().failed);
                warn!(center = %center, "elastic exchange timed out");
            }
        }
    }

    /// Sends `snapshot` to `peer` on `/murmur/params/1` and reads the answer: `Some` with a
    /// frame of kind `expected`, `None` for `Busy`.
    async fn request(
        &self,
        peer: PeerId,
        snapshot: &Snapshot,
        expected: MessageKind,
    ) -> Result<Option<(TensorHeader, Vec<f32>)>, Failure> {
        let ctx = &self.ctx;
        let mut stream = self
            .client
            .stream_control()
            .open_stream(peer, StreamProtocol::new(PARAMS_PROTOCOL))
            .await
            .map_err(|e| Failure::Io(e.to_string()))?;
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
        if header.kind != expected {
            return Err(Failure::Offence(format!(
                "answered an exchange with {:?}, expected {expected:?}",
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

/// Serves the inbound streams of one protocol, each in its own task, at most
/// [`MAX_INBOUND`] at once (so a receiver holds a bounded number of extra parameter copies).
/// Nothing a peer sends can stop this loop.
async fn accept(
    ctx: Arc<Context>,
    mut incoming: libp2p_stream::IncomingStreams,
    protocol: &'static str,
) {
    while let Some((peer, stream)) = incoming.next().await {
        if lock(&ctx.state.blocked).contains(&peer) {
            continue;
        }
        let Ok(permit) = Arc::clone(&ctx.inbound).try_acquire_owned() else {
            debug!(peer = %peer, "too many inbound streams; dropping one");
            continue;
        };
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            let _permit = permit;
            let served = tokio::time::timeout(EXCHANGE_TIMEOUT, async {
                if protocol == STATE_PROTOCOL {
                    serve_state(&ctx, peer, stream).await
                } else {
                    serve_params(&ctx, peer, stream).await
                }
            })
            .await;
            match served {
                Ok(Ok(())) => {}
                Ok(Err(Failure::Offence(reason))) => ctx.offence(peer, reason),
                Ok(Err(Failure::Io(reason))) => {
                    SyncStats::bump(&ctx.stats().failed);
                    debug!(peer = %peer, %reason, "inbound stream failed");
                }
                Err(_) => ctx.offence(
                    peer,
                    format!(
                        "no complete exchange within {}s",
                        EXCHANGE_TIMEOUT.as_secs()
                    ),
                ),
            }
        });
    }
}

/// Answers a peer's snapshot: with ours and a mix (pairwise), with a delta (the elastic
/// center), or with `Busy`. A request that is not a valid frame is an offence, a truncated
/// one included: a peer that dies mid-frame is scored once, a peer that keeps doing it is
/// blocked.
async fn serve_params(ctx: &Context, peer: PeerId, mut stream: Stream) -> Result<(), Failure> {
    let mut other = Vec::new();
    let header = ctx
        .receive(&mut stream, &mut other)
        .await
        .map_err(|e| Failure::Offence(e.to_string()))?;
    if header.kind != MessageKind::Params {
        return Err(Failure::Offence(format!(
            "sent {:?} on the params protocol",
            header.kind
        )));
    }
    if other.len() != ctx.state.param_count {
        return Err(Failure::Offence(format!(
            "{} payload bytes, this model has {}",
            header.byte_len,
            ctx.param_bytes()
        )));
    }
    if !other.iter().all(|v| v.is_finite()) {
        return Err(Failure::Offence(
            "parameters contain NaN or infinite values".into(),
        ));
    }
    lock(&ctx.state.membership).saw_step(&peer, header.step);
    debug!(peer = %peer, step = header.step, bytes = header.byte_len, "tensor received");
    let settings = &ctx.settings;
    if ctx.joining.load(Ordering::Relaxed) || !(settings.pairwise() || settings.centered()) {
        return busy(ctx, &mut stream).await;
    }
    if settings.centered() {
        return serve_center(ctx, &mut stream, header, other).await;
    }
    let Some(_claim) = ctx.claim() else {
        return busy(ctx, &mut stream).await;
    };
    let Some(snapshot) = ctx.snapshot().await else {
        return busy(ctx, &mut stream).await;
    };
    ctx.validate_params(&other, &snapshot.params)
        .map_err(Failure::Offence)?;
    let p = ctx.coupled_peers().len() + 1;
    let Some(weight) = ctx.weight(snapshot.step, header.step, settings.pair_weight(p)) else {
        return busy(ctx, &mut stream).await;
    };
    ctx.send(
        &mut stream,
        MessageKind::Params,
        snapshot.step,
        &snapshot.params,
    )
    .await?;
    let _ = stream.close().await;
    // Mix only once the peer has our half, so both sides apply the exchange or neither.
    if ctx.to_trainer(ToTrainer::Mix {
        other,
        base: snapshot.params,
        weight,
    }) {
        SyncStats::bump(&ctx.stats().served);
    }
    Ok(())
}

/// The center's side of an elastic exchange.
async fn serve_center(
    ctx: &Context,
    stream: &mut Stream,
    header: TensorHeader,
    worker: Vec<f32>,
) -> Result<(), Failure> {
    let own = ctx.own_step();
    let Some(weight) = ctx.weight(own, header.step, 1.0) else {
        return busy(ctx, stream).await;
    };
    let p = ctx.coupled_peers().len() + 1;
    let delta = match lock(&ctx.center).as_mut() {
        Some(center) => {
            lock(&ctx.distances)
                .check(averaging::distance(&worker, center), outlier_floor(center))
                .map_err(Failure::Offence)?;
            Some(averaging::elastic_step(
                center,
                &worker,
                ctx.settings.alpha(p) * weight,
            ))
        }
        // Not (or no longer) the center.
        None => None,
    };
    let Some(delta) = delta else {
        return busy(ctx, stream).await;
    };
    ctx.send(stream, MessageKind::Delta, own, &delta).await?;
    let _ = stream.close().await;
    SyncStats::bump(&ctx.stats().served);
    Ok(())
}

async fn busy(ctx: &Context, stream: &mut Stream) -> Result<(), Failure> {
    ctx.send(stream, MessageKind::Busy, ctx.own_step(), &[])
        .await?;
    let _ = stream.close().await;
    Ok(())
}

/// Answers a state request with this node's parameters and clock, then the center if this
/// node holds it.
async fn serve_state(ctx: &Context, _peer: PeerId, mut stream: Stream) -> Result<(), Failure> {
    let mut empty = Vec::new();
    let header = ctx
        .receive(&mut stream, &mut empty)
        .await
        .map_err(|e| Failure::Offence(e.to_string()))?;
    if header.kind != MessageKind::State || header.byte_len != 0 {
        return Err(Failure::Offence(format!(
            "sent {:?} with {} bytes on the state protocol",
            header.kind, header.byte_len
        )));
    }
    // Answered even while this node is still joining: the first node of a run is alone
    // (joining) exactly when the second one needs its state.
    let Some(snapshot) = ctx.snapshot().await else {
        return busy(ctx, &mut stream).await;
    };
    ctx.send(
        &mut stream,
        MessageKind::State,
        snapshot.step,
        &snapshot.params,
    )
    .await?;
    let center = lock(&ctx.center).clone();
    if let Some(center) = center {
        ctx.send(&mut stream, MessageKind::Center, snapshot.step, &center)
            .await?;
    }
    let _ = stream.close().await;
    Ok(())
}
