//! The read side of a running node: what observers (the control API, `/metrics`, the
//! OpenTelemetry exporter) read, and nothing they can change.
//!
//! The node's actors publish the latest [`Progress`] (the trainer thread), [`PeerTable`] (the
//! membership actor) and [`EngineView`] (the sync engine) on `watch` channels, and count what
//! happens in [`Counters`] and [`Timings`]. A [`Readout`] holds the receivers and the counters
//! and builds the reports of [`crate::api::types`], so every observer reports the same figures.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use murmur_protocol::network::{ConnectionKind, DroppedEvents, Multiaddr, Reach};
use murmur_protocol::ring;
use murmur_sync::copies::BookFigures;
use murmur_sync::policy::EngineView;
use murmur_sync::settings::SyncSettings;
use murmur_sync::table::PeerTable;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::api::types::{
    AccuracyPoint, HistoryReport, LossPoint, PairCopiesReport, PeerReport, StatusReport, SyncReport,
};
use crate::clock;
use crate::settings::Identity;
pub use counters::{Count, CountMetric, Counters, Unit};
pub use link_table::{LinkFigures, LinkTable};

mod counters;
mod link_table;

/// The instrumentation scope of every OpenTelemetry span and metric.
pub const SCOPE: &str = "murmur";

/// The OpenTelemetry name of a reading: `murmur.` and the Prometheus name without `_total`
/// (`exchanges_total` is `murmur.exchanges`, a counter).
pub fn otel_name(reading: &str) -> String {
    format!("{SCOPE}.{}", reading.trim_end_matches("_total"))
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// What the trainer thread reports.
#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub test_accuracy: Option<f64>,
    pub test_loss: Option<f64>,
    /// Every evaluation: when, at which step, how accurate.
    pub history: Vec<AccuracyPoint>,
    /// The training loss over the run, thinned to a bounded number of points.
    pub loss_curve: LossCurve,
    pub finished: bool,
    /// Local steps between this replica's snapshots now (`sync.adapt_interval` changes it).
    pub interval: u64,
}

impl Progress {
    /// The figures without the run's curves: what readers that only need the latest values
    /// copy out.
    pub fn figures(&self) -> Progress {
        Progress {
            history: Vec::new(),
            loss_curve: LossCurve::default(),
            ..*self
        }
    }
}

/// Points kept of a run's accuracy history before it is thinned.
pub const HISTORY_CAPACITY: usize = 1024;

/// Adds `point` to a run's accuracy history. A run of short epochs evaluates many times a
/// second: when the history is over [`HISTORY_CAPACITY`], every other point is dropped, but
/// never the newest nor the first to reach each tenth of a percentage point, so the time a
/// target such as 0.87 was first reached (`nodectl evaluate --target`) survives the thinning.
/// At most `HISTORY_CAPACITY` + 1,001 points.
pub fn record_accuracy(history: &mut Vec<AccuracyPoint>, point: AccuracyPoint) {
    history.push(point);
    if history.len() <= HISTORY_CAPACITY {
        return;
    }
    let level = |accuracy: f64| (accuracy * 1000.0).floor() as i64;
    let last = history.len() - 1;
    let mut best = i64::MIN;
    let mut index = 0;
    history.retain(|p| {
        let first_at_level = level(p.test_accuracy) > best;
        best = best.max(level(p.test_accuracy));
        let keep = index % 2 == 0 || index == last || first_at_level;
        index += 1;
        keep
    });
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

/// The senders the node's actors publish on; [`Readout::new`] makes them with their receivers.
#[derive(Debug)]
pub struct Feeds {
    /// The replica driver's.
    pub progress: watch::Sender<Progress>,
    /// The membership actor's.
    pub peers: watch::Sender<PeerTable>,
    /// The membership actor's: the addresses the network listens on.
    pub listen: watch::Sender<Vec<Multiaddr>>,
    /// The membership actor's: whether peers can dial this node.
    pub reach: watch::Sender<Reach>,
    /// The sync engine's.
    pub engine: watch::Sender<EngineView>,
    /// The sync engine's: what the pair copies of compressed exchanges hold.
    pub pair_copies: watch::Sender<BookFigures>,
}

/// What observers read of a running node; cheap to clone.
#[derive(Clone, Debug)]
pub struct Readout(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    identity: Identity,
    sync: SyncSettings,
    started: Instant,
    started_unix_s: f64,
    counters: Counters,
    timings: Timings,
    link_table: LinkTable,
    /// The network task's count of the events it could not hand the node.
    network_drops: DroppedEvents,
    progress: watch::Receiver<Progress>,
    peers: watch::Receiver<PeerTable>,
    listen: watch::Receiver<Vec<Multiaddr>>,
    reach: watch::Receiver<Reach>,
    engine: watch::Receiver<EngineView>,
    pair_copies: watch::Receiver<BookFigures>,
    /// Cancelled when the node leaves.
    leaving: CancellationToken,
}

impl Readout {
    /// The read side of a node of `identity`, and the senders its actors publish on. The node
    /// counts as leaving once `leaving` is cancelled; `network_drops` is its network's count of
    /// the events the node did not take in time.
    pub fn new(
        identity: Identity,
        sync: SyncSettings,
        peer_timeout: Duration,
        leaving: CancellationToken,
        network_drops: DroppedEvents,
    ) -> (Readout, Feeds) {
        let (progress_tx, progress) = watch::channel(Progress::default());
        let (peers_tx, peers) = watch::channel(PeerTable::new(peer_timeout));
        let (listen_tx, listen) = watch::channel(Vec::new());
        let (reach_tx, reach) = watch::channel(Reach::default());
        let (engine_tx, engine) = watch::channel(EngineView::default());
        let (pair_copies_tx, pair_copies) = watch::channel(BookFigures::default());
        let shared = Shared {
            identity,
            sync,
            started: clock::now(),
            started_unix_s: unix_now(),
            counters: Counters::default(),
            timings: Timings::default(),
            link_table: LinkTable::default(),
            network_drops,
            progress,
            peers,
            listen,
            reach,
            engine,
            pair_copies,
            leaving,
        };
        let feeds = Feeds {
            progress: progress_tx,
            peers: peers_tx,
            listen: listen_tx,
            reach: reach_tx,
            engine: engine_tx,
            pair_copies: pair_copies_tx,
        };
        (Readout(Arc::new(shared)), feeds)
    }

    pub fn identity(&self) -> &Identity {
        &self.0.identity
    }

    pub fn sync(&self) -> &SyncSettings {
        &self.0.sync
    }

    pub fn counters(&self) -> &Counters {
        &self.0.counters
    }

    pub fn timings(&self) -> &Timings {
        &self.0.timings
    }

    /// Events the network task dropped because the node did not take them in time.
    pub fn network_events_dropped(&self) -> u64 {
        self.0.network_drops.get()
    }

    /// What this node knows of the links to its peers.
    pub fn link_table(&self) -> &LinkTable {
        &self.0.link_table
    }

    /// The latest figures of the trainer (without the curves).
    pub fn progress(&self) -> Progress {
        self.0.progress.borrow().figures()
    }

    /// A receiver of the trainer's progress, for actors that act on it.
    pub fn watch_progress(&self) -> watch::Receiver<Progress> {
        self.0.progress.clone()
    }

    /// A receiver of the peer table, for actors that act on it.
    pub fn watch_peers(&self) -> watch::Receiver<PeerTable> {
        self.0.peers.clone()
    }

    /// A receiver of the addresses the network listens on.
    pub fn watch_listen(&self) -> watch::Receiver<Vec<Multiaddr>> {
        self.0.listen.clone()
    }

    /// A receiver of the engine's view, for actors that act on it.
    pub fn watch_engine(&self) -> watch::Receiver<EngineView> {
        self.0.engine.clone()
    }

    pub fn live_peers(&self) -> usize {
        self.0.peers.borrow().len()
    }

    /// Whether this node runs as a client.
    pub fn is_client(&self) -> bool {
        self.0.peers.borrow().is_client()
    }

    pub fn blocked_peers(&self) -> usize {
        self.0.peers.borrow().blocked_count()
    }

    pub fn engine(&self) -> EngineView {
        *self.0.engine.borrow()
    }

    /// What the pair copies of compressed exchanges hold, against their budget.
    pub fn pair_copies(&self) -> BookFigures {
        *self.0.pair_copies.borrow()
    }

    pub fn listen(&self) -> Vec<Multiaddr> {
        self.0.listen.borrow().clone()
    }

    /// Whether peers can dial this node, and at which addresses.
    pub fn reach(&self) -> Reach {
        self.0.reach.borrow().clone()
    }

    /// Time since this node started.
    pub fn uptime(&self) -> Duration {
        clock::since(self.0.started)
    }

    pub fn is_leaving(&self) -> bool {
        self.0.leaving.is_cancelled()
    }

    pub fn status(&self) -> StatusReport {
        let (p, history) = {
            let progress = self.0.progress.borrow();
            (progress.figures(), progress.history.clone())
        };
        let peers = self.peers();
        let reach = self.reach();
        let client = self.is_client();
        let state = if self.is_leaving() {
            "leaving"
        } else if p.finished {
            "finished"
        } else {
            "training"
        };
        let id = &self.0.identity;
        let counters = &self.0.counters;
        StatusReport {
            peer_id: id.peer_id.to_string(),
            run_id: id.run_id.clone(),
            fingerprint: id.fingerprint.clone(),
            model: id.model.clone(),
            device: id.device.clone(),
            state: state.to_owned(),
            step: p.step,
            epoch: p.epoch,
            epochs: id.epochs,
            loss_ema: p.loss_ema,
            test_accuracy: p.test_accuracy,
            test_loss: p.test_loss,
            samples_seen: p.samples_seen,
            live_peers: peers.len(),
            peers,
            listen: self.listen().iter().map(ToString::to_string).collect(),
            reachability: reach.reachability.to_string(),
            external_addrs: reach.confirmed.iter().map(ToString::to_string).collect(),
            relayed_addrs: reach.relayed.iter().map(ToString::to_string).collect(),
            nat_mapping: reach.mapping.to_string(),
            hole_punches: reach.punches.succeeded,
            hole_punches_failed: reach.punches.failed,
            client,
            rejected_messages: counters.get(Count::RejectedMessage),
            tensor_bytes_in: counters.get(Count::BytesReceived),
            relayed_bytes_in: counters.get(Count::RelayedBytesReceived),
            blocked_peers: self.blocked_peers(),
            peers_timed_out: counters.get(Count::PeerTimedOut),
            peers_uncoupled: counters.get(Count::PeerUncoupled),
            heartbeats_replayed: counters.get(Count::HeartbeatReplayed),
            inbound_streams_dropped: counters.get(Count::InboundDropped),
            network_events_dropped: self.network_events_dropped(),
            uptime_s: self.uptime().as_secs_f64(),
            started_unix_s: self.0.started_unix_s,
            history,
            sync: self.sync_report(),
            memory: crate::report::memory(),
        }
    }

    /// What the pair copies of compressed exchanges hold, as `GET /status` reports it.
    fn pair_copies_report(&self) -> PairCopiesReport {
        let figures = self.pair_copies();
        PairCopiesReport {
            budget_bytes: figures.budget,
            bytes: figures.bytes,
            partners: figures.partners,
            dropped: figures.dropped,
        }
    }

    /// The sync part of `GET /status`.
    pub fn sync_report(&self) -> SyncReport {
        let c = &self.0.counters;
        let settings = &self.0.sync;
        let engine = self.engine();
        SyncReport {
            mode: format!("{:?}", settings.mode.name()).to_lowercase(),
            role: format!("{:?}", engine.role).to_lowercase(),
            interval: settings.interval,
            current_interval: self.0.progress.borrow().interval.max(settings.interval),
            max_staleness: settings.max_staleness,
            exchanges: c.get(Count::Exchange),
            served: c.get(Count::Served),
            busy: c.get(Count::Busy),
            stale: c.get(Count::Stale),
            rejected: c.get(Count::Rejected),
            failed: c.get(Count::Failed),
            bytes_out: c.get(Count::BytesSent),
            relayed_bytes_out: c.get(Count::RelayedBytesSent),
            gate_wait_s: c.value(Count::GateWait),
            longest_gate_wait_s: c.longest_gate_wait_s(),
            exchange_wait_s: c.value(Count::ExchangeWait),
            longest_stall_s: c.longest_stall_s(),
            max_lead: c.max_lead(),
            merges: c.get(Count::Merge),
            merge_lag_steps: c.get(Count::MergeLag),
            max_merge_lag: c.max_merge_lag(),
            state_syncs: c.get(Count::StateSync),
            state_syncs_resumed: c.get(Count::StateSyncResumed),
            state_bytes_received: c.get(Count::StateBytesReceived),
            sparse_exchanges: c.get(Count::Sparse),
            clipped: c.get(Count::Clipped),
            pair_copies: self.pair_copies_report(),
            center: engine.center.map(|c| c.to_string()),
            center_version: engine.center_version,
        }
    }

    pub fn history(&self) -> HistoryReport {
        let p = self.0.progress.borrow();
        HistoryReport {
            loss: p.loss_curve.points().to_vec(),
            accuracy: p.history.clone(),
        }
    }

    /// The clocks of the live peers, as last heard.
    pub fn clocks(&self) -> Vec<u64> {
        self.0.peers.borrow().clocks()
    }

    pub fn peers(&self) -> Vec<PeerReport> {
        let now = clock::now();
        let ours = self.0.progress.borrow().step;
        let table = self.0.peers.borrow();
        table
            .peers()
            .map(|(peer, v)| {
                let link = self.0.link_table.of(peer);
                PeerReport {
                    peer_id: peer.to_string(),
                    step: v.step,
                    epoch: v.epoch,
                    loss_ema: v.loss_ema,
                    samples_seen: v.samples_seen,
                    mode: format!("{:?}", v.mode).to_lowercase(),
                    role: format!("{:?}", v.role).to_lowercase(),
                    last_seen_ms: now.saturating_duration_since(v.last_seen).as_millis() as u64,
                    staleness: steps_behind(ours, v.step),
                    rtt_ms: link.rtt_ms,
                    throughput_mbit_s: link.throughput_mbit_s,
                    slow_link: table.is_slow(peer),
                    connection: table
                        .connection(peer)
                        .map(|kind| connection_name(kind).to_owned()),
                    client: v.client,
                }
            })
            .collect()
    }
}

/// How a connection is named in reports: as in JSON (`direct`, `hole_punched`, `relayed`).
pub fn connection_name(kind: ConnectionKind) -> &'static str {
    match kind {
        ConnectionKind::Direct => "direct",
        ConnectionKind::HolePunched => "hole_punched",
        ConnectionKind::Relayed => "relayed",
    }
}

/// How many steps a peer at `theirs` is behind a node at `ours` (negative: ahead), held within
/// `i64`: a peer can claim any clock, `u64::MAX` included.
fn steps_behind(ours: u64, theirs: u64) -> i64 {
    if ours >= theirs {
        i64::try_from(ours - theirs).unwrap_or(i64::MAX)
    } else {
        i64::try_from(theirs - ours).map_or(i64::MIN, |ahead| -ahead)
    }
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn how_far_behind_holds_any_pair_of_clocks() {
        assert_eq!(steps_behind(10, 3), 7);
        assert_eq!(steps_behind(3, 10), -7);
        assert_eq!(steps_behind(5, 1 << 63), i64::MIN + 5);
        assert_eq!(steps_behind(5, u64::MAX), i64::MIN);
        assert_eq!(steps_behind(u64::MAX, 0), i64::MAX);
    }

    /// The soak found the history of a run of short epochs growing by one point an epoch for
    /// ever (5,360 points, a 340 kB status, after 10 minutes).
    #[test]
    fn the_accuracy_history_stays_bounded_and_keeps_when_each_accuracy_was_first_reached() {
        let mut history = Vec::new();
        let accuracy = |i: usize| {
            (i as f64 / 10_000.0).min(0.5) + if i.is_multiple_of(7) { 0.01 } else { 0.0 }
        };
        for i in 0..100_000 {
            let point = AccuracyPoint {
                unix_s: i as f64,
                step: i as u64,
                test_accuracy: accuracy(i),
                test_loss: None,
            };
            record_accuracy(&mut history, point);
        }
        assert!(
            history.len() <= HISTORY_CAPACITY + 1001,
            "{}",
            history.len()
        );
        assert_eq!(history.last().map(|p| p.step), Some(99_999));
        for target in [0.05, 0.2, 0.37, 0.5] {
            let first = (0..100_000).find(|&i| accuracy(i) >= target).unwrap();
            let kept = history.iter().find(|p| p.test_accuracy >= target).unwrap();
            assert_eq!(kept.step, first as u64, "target {target}");
        }
    }

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
