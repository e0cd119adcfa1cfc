//! What a node measures, for operators: Murmur's metrics, read from the node's state at each
//! scrape, and libp2p's own, which the network task records. `GET /metrics` serves both as
//! Prometheus text.
//!
//! [`readings`] is the one list of Murmur's counters and gauges (names, help, values), so every
//! exporter reports the same thing. Latencies are histograms that the sync engine fills as it
//! goes ([`crate::readout::Timings`]).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use murmur_protocol::network::{ConnectionKind, Reachability};

use crate::api::types::{PeerReport, SyncReport};
use crate::readout::{
    Count, Counters, EXCHANGE_LATENCY_HELP, Progress, RING_ROUND_HELP, Readout, connection_name,
};

/// Prefix of every Murmur metric (`murmur_steps_total`, ...).
pub const PREFIX: &str = "murmur";

/// The two text formats `/metrics` speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// What a Prometheus server asks for.
    OpenMetrics,
    /// The classic text format (0.0.4), for `curl`, `promtool` and older scrapers.
    Prometheus,
}

impl Format {
    /// The format a client's `Accept` header asks for: OpenMetrics only when it names it.
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(accept) if accept.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Prometheus,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Whether a reading only grows (a counter) or goes up and down (a gauge).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One value a node reports: `murmur_<name>{<label>}` = `value`.
#[derive(Clone, Debug, PartialEq)]
pub struct Reading {
    /// Without the prefix; counters end in `_total`.
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
    /// At most one label, such as an exchange's outcome or a peer.
    pub label: Option<(&'static str, String)>,
    /// `None` while there is nothing to report yet (the test accuracy before the first
    /// evaluation); every exporter leaves such a reading out.
    pub value: Option<f64>,
}

impl Reading {
    fn counter(name: &'static str, help: &'static str, value: impl Into<f64>) -> Self {
        Reading {
            name,
            help,
            kind: Kind::Counter,
            label: None,
            value: Some(value.into()),
        }
    }

    fn gauge(name: &'static str, help: &'static str, value: impl Into<f64>) -> Self {
        Reading {
            kind: Kind::Gauge,
            ..Reading::counter(name, help, value)
        }
    }

    fn labelled(self, key: &'static str, value: impl Into<String>) -> Self {
        Reading {
            label: Some((key, value.into())),
            ..self
        }
    }
}

/// One figure of a peer's link, if measured.
type PeerFigure = fn(&PeerReport) -> Option<f64>;

const PEER_RTT_HELP: &str = "Round-trip time to a peer (moving average of pings)";
const PEER_THROUGHPUT_HELP: &str =
    "Throughput of the parameter payloads a peer sent (moving average)";

/// Murmur's counters and gauges as they stand now. Readings of one name are adjacent.
pub fn readings(node: &Readout) -> Vec<Reading> {
    let progress = node.progress();
    let sync = node.sync_report();
    let counters = node.counters();
    let mut readings = training_readings(&progress);
    readings.extend(counter_readings(counters));
    readings.extend(peak_readings(&sync));
    readings.extend(peer_readings(node));
    readings.extend(network_readings(node));
    readings.extend(evaluation_and_memory_readings(&progress));
    readings
}

/// What the replica reports of its training.
fn training_readings(progress: &Progress) -> Vec<Reading> {
    vec![
        Reading::counter(
            "steps_total",
            "Local training steps taken",
            progress.step as f64,
        ),
        Reading::counter(
            "samples_total",
            "Training samples processed",
            progress.samples_seen as f64,
        ),
        Reading::gauge(
            "epoch",
            "Epochs of the local shard completed",
            progress.epoch as f64,
        ),
        Reading::gauge(
            "loss",
            "Training loss (exponential moving average)",
            progress.loss_ema,
        ),
    ]
}

/// Every counter of the node's table ([`Count`]), as the table declares it.
fn counter_readings(counters: &Counters) -> Vec<Reading> {
    Count::ALL
        .into_iter()
        .map(|what| {
            let metric = what.metric();
            let reading = Reading::counter(metric.name, metric.help, counters.value(what));
            match metric.label {
                Some((key, value)) => reading.labelled(key, value),
                None => reading,
            }
        })
        .collect()
}

/// The peaks of the trainer's waits and of its mixes.
fn peak_readings(sync: &SyncReport) -> Vec<Reading> {
    vec![
        Reading::gauge(
            "merge_lag_max_steps",
            "The largest number of local steps between a snapshot and its mix",
            sync.max_merge_lag as f64,
        ),
        Reading::gauge(
            "staleness_gate_longest_wait_seconds",
            "The longest single wait of the trainer at the staleness gate",
            sync.longest_gate_wait_s,
        ),
        Reading::gauge(
            "max_lead_steps",
            "Largest lead over the slowest coupled peer with which a step was taken",
            sync.max_lead as f64,
        ),
    ]
}

/// The peers: dropped network events, the live and blocked ones, and the node's own uptime.
fn peer_readings(node: &Readout) -> Vec<Reading> {
    vec![
        Reading::counter(
            "network_events_dropped_total",
            "Network events (heartbeats, news of connections) dropped because the node did not take them in time",
            node.network_events_dropped() as f64,
        ),
        Reading::gauge(
            "live_peers",
            "Peers heard from within the peer timeout",
            node.live_peers() as f64,
        ),
        Reading::gauge(
            "blocked_peers",
            "Peers blocked for repeated offences",
            node.blocked_peers() as f64,
        ),
        Reading::gauge(
            "uptime_seconds",
            "Time since the daemon started",
            node.uptime().as_secs_f64(),
        ),
    ]
}

/// How peers reach this node: reachability, hole punches, connections and each peer's link.
fn network_readings(node: &Readout) -> Vec<Reading> {
    let mut readings = Vec::new();
    // One reading per state, 1 for the node's, so that a dashboard can count the private ones.
    let reachability = node.reach().reachability;
    for state in [
        Reachability::Public,
        Reachability::Private,
        Reachability::Unknown,
    ] {
        readings.push(
            Reading::gauge(
                "reachability",
                "Whether peers can dial this node (AutoNAT): 1 for its state, 0 for the others",
                f64::from(u8::from(state == reachability)),
            )
            .labelled("state", state.to_string()),
        );
    }
    let reach = node.reach();
    let punches = "Hole punches this node took part in, by result";
    readings.extend([
        Reading::counter(
            "hole_punches_total",
            punches,
            reach.punches.succeeded as f64,
        )
        .labelled("result", "direct"),
        Reading::counter("hole_punches_total", punches, reach.punches.failed as f64)
            .labelled("result", "failed"),
        Reading::gauge(
            "client",
            "1 when the node runs as a client: it cannot accept connections and exchanges \
             only with peers it dialled",
            f64::from(u8::from(node.is_client())),
        ),
    ]);
    // Per peer, once measured; readings of one name stay adjacent. With no peer yet, a
    // reading with no value still names the family (OpenTelemetry registers it at start).
    let peers = node.peers();
    for kind in [
        ConnectionKind::Direct,
        ConnectionKind::HolePunched,
        ConnectionKind::Relayed,
    ] {
        let name = connection_name(kind);
        let count = peers
            .iter()
            .filter(|p| p.connection.as_deref() == Some(name))
            .count();
        readings.push(
            Reading::gauge(
                "peer_connections",
                "Live peers by how this node is connected to them",
                count as f64,
            )
            .labelled("connection", name),
        );
    }
    let per_peer: [(&str, &str, PeerFigure); 2] = [
        ("peer_rtt_seconds", PEER_RTT_HELP, |p| {
            p.rtt_ms.map(|ms| ms / 1e3)
        }),
        (
            "peer_throughput_bytes_per_second",
            PEER_THROUGHPUT_HELP,
            |p| p.throughput_mbit_s.map(|mbit_s| mbit_s * 1e6 / 8.0),
        ),
    ];
    for (name, help, value) in per_peer {
        if peers.is_empty() {
            readings.push(Reading {
                value: None,
                ..Reading::gauge(name, help, 0.0)
            });
        }
        for peer in &peers {
            readings.push(Reading {
                value: value(peer),
                ..Reading::gauge(name, help, 0.0).labelled("peer", peer.peer_id.clone())
            });
        }
    }
    readings
}

/// The last evaluation, and the process's memory.
fn evaluation_and_memory_readings(progress: &Progress) -> Vec<Reading> {
    let mut readings = Vec::new();
    readings.push(Reading {
        value: progress.test_accuracy,
        ..Reading::gauge(
            "test_accuracy",
            "Accuracy of the replica on the test set at the last evaluation (0 to 1)",
            0.0,
        )
    });
    readings.push(Reading {
        value: progress.test_loss,
        ..Reading::gauge(
            "test_loss",
            "Mean loss of the replica on the test set at the last evaluation (for a language \
             model, the validation cross-entropy per token)",
            0.0,
        )
    });
    let memory = crate::report::memory();
    let memory_readings: [(&str, &str, Option<u64>); 5] = [
        (
            "resident_memory_bytes",
            "Resident memory of the daemon",
            memory.map(|m| m.resident_bytes),
        ),
        (
            "heap_in_use_bytes",
            "Heap the daemon holds (glibc only)",
            memory.and_then(|m| m.heap_in_use_bytes),
        ),
        (
            "heap_free_bytes",
            "Freed heap the allocator keeps for reuse (glibc only)",
            memory.and_then(|m| m.heap_free_bytes),
        ),
        (
            "allocated_bytes",
            "Bytes in the blocks the daemon holds, by its own exact count",
            memory.and_then(|m| m.allocated_bytes),
        ),
        (
            "peak_allocated_bytes",
            "The most bytes the daemon has held in its blocks, by the same count",
            memory.and_then(|m| m.peak_allocated_bytes),
        ),
    ];
    for (name, help, bytes) in memory_readings {
        readings.push(Reading {
            value: bytes.map(|b| b as f64),
            ..Reading::gauge(name, help, 0.0)
        });
    }
    readings
}

/// Reads [`readings`] at each scrape.
#[derive(Debug)]
struct NodeCollector(Readout);

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> std::fmt::Result {
        let readings = readings(&self.0);
        for family in readings.chunk_by(|a, b| a.name == b.name) {
            let first = &family[0];
            if family.iter().all(|reading| reading.value.is_none()) {
                continue;
            }
            // The descriptor takes the name without `_total`; the encoder adds it to counters.
            let (name, metric_type) = match first.kind {
                Kind::Counter => (first.name.trim_end_matches("_total"), MetricType::Counter),
                Kind::Gauge => (first.name, MetricType::Gauge),
            };
            let mut metric = encoder.encode_descriptor(name, first.help, None, metric_type)?;
            if first.label.is_none() {
                encode_value(first, metric)?;
                continue;
            }
            for reading in family.iter().filter(|reading| reading.value.is_some()) {
                encode_value(reading, metric.encode_family(&reading.label.as_slice())?)?;
            }
        }
        Ok(())
    }
}

fn encode_value(
    reading: &Reading,
    encoder: prometheus_client::encoding::MetricEncoder<'_>,
) -> std::fmt::Result {
    let value = reading.value.unwrap_or_default();
    match reading.kind {
        Kind::Counter => ConstCounter::new(value).encode(encoder),
        Kind::Gauge => ConstGauge::new(value).encode(encoder),
    }
}

/// Adds to `registry` everything `/metrics` serves for the node `node` reads; the network task
/// records libp2p's metrics into the same registry.
pub fn register(registry: &mut Registry, node: &Readout) {
    let murmur = registry.sub_registry_with_prefix(PREFIX);
    murmur.register_collector(Box::new(NodeCollector(node.clone())));
    let timings = node.timings();
    murmur.register(
        "exchange_latency_seconds",
        EXCHANGE_LATENCY_HELP,
        timings.exchange.clone(),
    );
    murmur.register(
        "ring_round_seconds",
        RING_ROUND_HELP,
        timings.ring_round.clone(),
    );
    murmur.register(
        "ring_bus_bandwidth_bytes_per_second",
        "Bus bandwidth of the last ring all-reduce round: algorithm bandwidth times 2(p-1)/p",
        timings.ring_bus_bandwidth.clone(),
    );
}

/// The registry as text in `format`, as `GET /metrics` serves it.
pub fn encode(registry: &Registry, format: Format) -> String {
    let mut text = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut text, registry);
    match format {
        Format::OpenMetrics => text,
        Format::Prometheus => to_prometheus_text(&text),
    }
}

/// The classic Prometheus text of an OpenMetrics text. The samples are the same; the metadata
/// differs: a counter's HELP and TYPE name it with its `_total` suffix, `unknown` is
/// `untyped`, an `info` metric is a gauge named `_info`, and there are no `# UNIT` or `# EOF`
/// lines.
fn to_prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // HELP comes before TYPE, whose type decides the name HELP must use.
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            help = Some(rest.split_once(' ').map_or("", |(_, text)| text));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let (name, kind) = match kind {
                "counter" if !name.ends_with("_total") => (format!("{name}_total"), kind),
                "info" => (format!("{name}_info"), "gauge"),
                "unknown" => (name.to_owned(), "untyped"),
                _ => (name.to_owned(), kind),
            };
            if let Some(text) = help.take() {
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        } else if line != "# EOF" && !line.starts_with("# UNIT ") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use murmur_protocol::network::PeerId;
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::node::testing::{gossip, readout};
    use crate::readout::Unit;

    #[test]
    fn every_counter_reaches_the_readings_once_under_its_name_and_label() {
        let me = PeerId::random();
        let (node, _feeds) = readout(me, &gossip(me, 1), &CancellationToken::new());
        for (i, what) in Count::ALL.into_iter().enumerate() {
            node.counters().add(what, 1_000_000 * (i as u64 + 1));
        }
        let readings = readings(&node);
        for (i, what) in Count::ALL.into_iter().enumerate() {
            let metric = what.metric();
            let found: Vec<&Reading> = readings
                .iter()
                .filter(|r| {
                    r.name == metric.name
                        && r.label.as_ref().map(|(k, v)| (*k, v.as_str())) == metric.label
                })
                .collect();
            assert_eq!(found.len(), 1, "{what:?}: {found:?}");
            let raw = 1_000_000.0 * (i + 1) as f64;
            let expected = if metric.unit == Unit::Seconds {
                raw / 1e6
            } else {
                raw
            };
            assert_eq!(found[0].value, Some(expected), "{what:?}");
            assert_eq!(found[0].kind, Kind::Counter, "{what:?}");
        }
    }

    #[test]
    fn openmetrics_counters_get_their_total_names_in_prometheus_text() {
        let openmetrics = "# HELP a_steps Steps.\n# TYPE a_steps counter\n# UNIT a_steps steps\n\
                           a_steps_total 3\n# HELP b Build.\n# TYPE b info\nb_info{v=\"1\"} 1\n\
                           # HELP c Loss.\n# TYPE c gauge\nc 0.5\n# EOF\n";
        assert_eq!(
            to_prometheus_text(openmetrics),
            "# HELP a_steps_total Steps.\n# TYPE a_steps_total counter\na_steps_total 3\n\
             # HELP b_info Build.\n# TYPE b_info gauge\nb_info{v=\"1\"} 1\n\
             # HELP c Loss.\n# TYPE c gauge\nc 0.5\n"
        );
    }

    #[test]
    fn only_a_client_that_names_openmetrics_gets_it() {
        let prometheus_server = "application/openmetrics-text;version=1.0.0,\
                                 text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(
            Format::negotiate(Some(prometheus_server)),
            Format::OpenMetrics
        );
        assert_eq!(Format::negotiate(Some("*/*")), Format::Prometheus);
        assert_eq!(Format::negotiate(None), Format::Prometheus);
    }
}
