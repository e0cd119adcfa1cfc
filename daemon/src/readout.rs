//! The read side of a running node: what observers (the control API, `/metrics`, the
//! OpenTelemetry exporter) read. [`NodeState`] holds the node's identity, its progress, its
//! view of the run and the sync engine's counters; [`Timings`] the latency histograms. The
//! reports of [`crate::api::types`] are built here, so every observer reports the same figures.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role};
use murmur_protocol::membership::Membership;
use murmur_protocol::network::{Multiaddr, PeerId};
use murmur_protocol::ring;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::watch;

use crate::api::types::{
    AccuracyPoint, HistoryReport, LossPoint, PeerReport, StatusReport, SyncReport,
};
use crate::settings::{Identity, SyncSettings};

/// The instrumentation scope of every OpenTelemetry span and metric.
pub const SCOPE: &str = "murmur";

/// The OpenTelemetry name of a reading: `murmur.` and the Prometheus name without `_total`
/// (`exchanges_total` is `murmur.exchanges`, a counter).
pub fn otel_name(reading: &str) -> String {
    format!("{SCOPE}.{}", reading.trim_end_matches("_total"))
}

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
    pub(crate) listen: Mutex<Vec<Multiaddr>>,
    pub(crate) rejected: AtomicU64,
    /// Peers that went silent for the peer timeout.
    pub(crate) peers_timed_out: AtomicU64,
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

impl NodeState {
    pub fn new(identity: Identity, peer_timeout: Duration, sync: SyncSettings) -> Self {
        let Identity {
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
            peers_timed_out: AtomicU64::new(0),
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
            peers_timed_out: self.peers_timed_out.load(Ordering::Relaxed),
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

    pub(crate) fn heartbeat(&self, leaving: bool) -> Heartbeat {
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

/// Counters of the sync engine and the staleness gate, read by `GET /status`.
#[derive(Debug, Default)]
pub struct SyncStats {
    pub(crate) exchanges: AtomicU64,
    pub(crate) served: AtomicU64,
    pub(crate) busy: AtomicU64,
    pub(crate) stale: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) gate_wait_us: AtomicU64,
    pub(crate) longest_gate_wait_us: AtomicU64,
    pub(crate) exchange_wait_us: AtomicU64,
    pub(crate) longest_stall_us: AtomicU64,
    pub(crate) max_lead: AtomicU64,
    pub(crate) state_syncs: AtomicU64,
    pub(crate) center_version: AtomicU64,
    /// Latencies, for `/metrics`.
    pub(crate) timings: Timings,
}

impl SyncStats {
    /// One wait at the staleness gate: counted in the total and in the longest.
    pub fn add_gate_wait(&self, waited: Duration) {
        let us = waited.as_micros() as u64;
        self.gate_wait_us.fetch_add(us, Ordering::Relaxed);
        self.longest_gate_wait_us.fetch_max(us, Ordering::Relaxed);
    }

    pub fn add_exchange_wait(&self, waited: Duration) {
        self.exchange_wait_us
            .fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn observe_stall(&self, stalled: Duration) {
        self.longest_stall_us
            .fetch_max(stalled.as_micros() as u64, Ordering::Relaxed);
    }

    pub fn observe_lead(&self, lead: u64) {
        self.max_lead.fetch_max(lead, Ordering::Relaxed);
    }

    pub(crate) fn bump(counter: &AtomicU64) {
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
            longest_gate_wait_s: get(&self.longest_gate_wait_us) as f64 / 1e6,
            exchange_wait_s: get(&self.exchange_wait_us) as f64 / 1e6,
            longest_stall_s: get(&self.longest_stall_us) as f64 / 1e6,
            max_lead: get(&self.max_lead),
            state_syncs: get(&self.state_syncs),
            center: center.map(|c| c.to_string()),
            center_version: get(&self.center_version),
        }
    }
}

pub(crate) const EXCHANGE_LATENCY_HELP: &str = "Time from offer to mix of a parameter exchange";
pub(crate) const RING_ROUND_HELP: &str = "Time of a successful ring all-reduce round";

/// The sync engine's latencies, observed as they happen.
#[derive(Debug)]
pub struct Timings {
    /// From offer to mix of a pairwise exchange, or a request to the elastic center.
    pub exchange: Histogram,
    /// A successful ring all-reduce round.
    pub ring_round: Histogram,
    /// Bus bandwidth of the last successful ring round (bytes per second), as NCCL defines it.
    pub ring_bus_bandwidth: Gauge<f64, AtomicU64>,
    /// The same two latencies for OpenTelemetry (no-ops unless an exporter is set up).
    otel_exchange: opentelemetry::metrics::Histogram<f64>,
    otel_ring_round: opentelemetry::metrics::Histogram<f64>,
}

impl Default for Timings {
    fn default() -> Self {
        // 1 ms to about 33 s in powers of two.
        let buckets = || exponential_buckets(0.001, 2.0, 16);
        let meter = opentelemetry::global::meter(SCOPE);
        let histogram = |name: &'static str, help: &'static str| {
            meter
                .f64_histogram(otel_name(name))
                .with_description(help)
                .with_unit("s")
                .with_boundaries(buckets().collect())
                .build()
        };
        Timings {
            exchange: Histogram::new(buckets()),
            ring_round: Histogram::new(buckets()),
            ring_bus_bandwidth: Gauge::default(),
            otel_exchange: histogram("exchange_latency_seconds", EXCHANGE_LATENCY_HELP),
            otel_ring_round: histogram("ring_round_seconds", RING_ROUND_HELP),
        }
    }
}

impl Timings {
    pub fn exchange_done(&self, took: Duration) {
        self.exchange.observe(took.as_secs_f64());
        self.otel_exchange.record(took.as_secs_f64(), &[]);
    }

    /// A ring round of `values` f32 over `peers` peers that took `took`.
    pub fn ring_round_done(&self, took: Duration, values: usize, peers: usize) {
        let secs = took.as_secs_f64();
        self.ring_round.observe(secs);
        self.otel_ring_round.record(secs, &[]);
        if secs > 0.0 && peers > 0 {
            let algbw = (values * 4) as f64 / secs;
            self.ring_bus_bandwidth.set(algbw * ring::bus_factor(peers));
        }
    }
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
