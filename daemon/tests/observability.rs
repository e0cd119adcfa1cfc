//! What operators see of real `nodectl join` processes: `GET /metrics` as Prometheus text with
//! Murmur's and libp2p's metrics, accepted by `promtool`, or as OpenMetrics for a Prometheus
//! server; `nodectl status` with its peer table, once and with `--watch`; JSON logs with stable
//! event names; OTLP metrics and spans received by a real OTLP receiver.
//!
//! Tools from Debian (`promtool` from `prometheus`) are used where installed; with
//! `MURMUR_REQUIRE_TOOLS=1` (as CI sets it) a missing tool fails the test instead of skipping
//! that check.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use common::{Daemon, wait_until};
use opentelemetry_proto::tonic::collector::metrics::v1::ExportMetricsServiceRequest;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::metrics::v1::metric;
use serde_json::Value;

fn gossip_run() -> tempfile::TempDir {
    common::endless_mlp_run("gossip", "")
}

/// `GET <path>` of the control API of the daemon of `dir`, accepting `accept`: content type
/// and body.
fn get(dir: &Path, path: &str, accept: &str) -> (String, String) {
    let addr = std::fs::read_to_string(dir.join("api")).unwrap();
    let response = reqwest::blocking::Client::new()
        .get(format!("http://{}{path}", addr.trim()))
        .header("accept", accept)
        .send()
        .unwrap()
        .error_for_status()
        .unwrap();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (content_type, response.text().unwrap())
}

/// The value of the sample `line_start` (a metric name with its labels) in `text`.
fn sample(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no `{line_start}` sample in:\n{text}"))
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Whether `tool` can be run; fails when it cannot and `MURMUR_REQUIRE_TOOLS` is set.
fn tool_here(tool: &str, package: &str) -> bool {
    let found = Command::new(tool)
        .arg("--version")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .is_ok_and(|child| {
            common::finish_within(child, &format!("`{tool} --version`"))
                .status
                .success()
        });
    if !found {
        assert!(
            std::env::var_os("MURMUR_REQUIRE_TOOLS").is_none(),
            "`{tool}` is required: install the Debian package `{package}`"
        );
        eprintln!("`{tool}` not installed (Debian `{package}`): that check is skipped");
    }
    found
}

/// The per-thread arena heaps of glibc's allocator in process `pid`: anonymous mappings that
/// start at a 64 MiB boundary and, with the inaccessible rest of their reservation right after,
/// span exactly 64 MiB.
fn thread_arena_heaps(pid: u32) -> Vec<String> {
    const HEAP_MAX: u64 = 64 << 20;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let mappings: Vec<(u64, u64, &str, &str)> = maps
        .lines()
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (start, end) = fields[0].split_once('-').unwrap();
            let address = |hex| u64::from_str_radix(hex, 16).unwrap();
            (address(start), address(end), fields[1], line)
        })
        .collect();
    mappings
        .windows(2)
        .filter(|pair| {
            let ((start, end, perms, _), (next_start, next_end, next_perms, _)) =
                (pair[0], pair[1]);
            start % HEAP_MAX == 0
                && perms == "rw-p"
                && next_start == end
                && next_perms == "---p"
                && next_end - start == HEAP_MAX
        })
        .map(|pair| pair[0].3.to_owned())
        .collect()
}

#[test]
fn metrics_are_prometheus_text_with_murmur_and_libp2p_metrics() {
    let work = gossip_run();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &a.join_address()]);
    let status = wait_until(&a_dir, "a finished exchanges", |s: &Value| {
        s["sync"]["exchanges"].as_u64().unwrap() >= 3
    });
    // b's link as a measures it: pings for the round trip, b's parameters for the throughput.
    let measured = wait_until(&a_dir, "a measured its link to b", |s: &Value| {
        s["peers"][0]["rtt_ms"].is_f64() && s["peers"][0]["throughput_mbit_s"].is_f64()
    });
    let b_id = measured["peers"][0]["peer_id"].as_str().unwrap().to_owned();

    let (content_type, text) = get(&a_dir, "/metrics", "text/plain");
    assert!(content_type.starts_with("text/plain"), "{content_type}");
    // Counters only grow: the scrape comes after the status above.
    assert!(sample(&text, "murmur_steps_total") >= status["step"].as_f64().unwrap());
    assert!(sample(&text, "murmur_samples_total") > 0.0);
    assert!(sample(&text, "murmur_exchanges_total{outcome=\"ok\"}") >= 3.0);
    for outcome in ["busy", "stale", "rejected", "failed"] {
        sample(
            &text,
            &format!("murmur_exchanges_total{{outcome=\"{outcome}\"}}"),
        );
    }
    assert!(sample(&text, "murmur_sent_bytes_total") > 0.0);
    assert!(sample(&text, "murmur_received_bytes_total") > 0.0);
    assert_eq!(sample(&text, "murmur_live_peers"), 1.0);
    assert!(sample(&text, "murmur_loss") > 0.0);
    sample(&text, "murmur_staleness_gate_wait_seconds_total");
    assert!(sample(&text, "murmur_exchange_latency_seconds_count") >= 3.0);
    sample(&text, "murmur_exchange_latency_seconds_bucket{le=\"+Inf\"}");
    sample(&text, "murmur_ring_round_seconds_count");
    let rtt = sample(
        &text,
        &format!("murmur_peer_rtt_seconds{{peer=\"{b_id}\"}}"),
    );
    assert!(rtt > 0.0 && rtt < 1.0, "loopback round trip {rtt} s");
    let throughput = sample(
        &text,
        &format!("murmur_peer_throughput_bytes_per_second{{peer=\"{b_id}\"}}"),
    );
    assert!(throughput > 1e5, "loopback throughput {throughput} bytes/s");
    // The daemon's memory, as the status has it too (this is Linux with glibc).
    let resident = sample(&text, "murmur_resident_memory_bytes");
    let heap = sample(&text, "murmur_heap_in_use_bytes");
    assert!(
        heap > 1e6 && resident > 1e6,
        "heap {heap}, resident {resident}"
    );
    sample(&text, "murmur_heap_free_bytes");
    // The network task's dropped events are counted where operators look, as 0 on a quiet
    // node, in the metrics and in the status.
    let dropped = sample(&text, "murmur_network_events_dropped_total");
    assert_eq!(
        Some(dropped as u64),
        status["network_events_dropped"].as_u64(),
        "{status}"
    );
    let inbound_dropped = sample(&text, "murmur_inbound_streams_dropped_total");
    assert_eq!(
        Some(inbound_dropped as u64),
        status["inbound_streams_dropped"].as_u64(),
        "{status}"
    );
    // nodectl's own count of the blocks it holds: a small model's daemon holds some MB (a
    // count that was never installed reads as absent, one that went wrong as near 2^64).
    let allocated = sample(&text, "murmur_allocated_bytes");
    assert!(
        allocated > 1e6 && allocated < 1e9,
        "allocated {allocated} bytes"
    );
    let memory = &status["memory"];
    assert!(
        memory["anonymous_bytes"].as_u64().unwrap() <= memory["resident_bytes"].as_u64().unwrap()
    );
    assert!(
        memory["heap_in_use_bytes"].as_u64().unwrap() > 1_000_000,
        "{memory}"
    );
    assert!(
        memory["allocated_bytes"].as_u64().unwrap() > 1_000_000,
        "{memory}"
    );
    // The most it held: at least what the same scrape read it held a moment before.
    let peak_allocated = sample(&text, "murmur_peak_allocated_bytes");
    assert!(
        peak_allocated >= allocated && peak_allocated < 1e9,
        "peak allocated {peak_allocated} bytes, allocated {allocated}"
    );
    assert!(
        memory["peak_allocated_bytes"].as_u64().unwrap() >= 1_000_000,
        "{memory}"
    );
    // One allocator arena (decision 0060): none of glibc's per-thread heaps, each a 64 MiB
    // reservation at a 64 MiB boundary (its used part read-write, the rest inaccessible).
    let heaps = thread_arena_heaps(a.child.id());
    assert!(heaps.is_empty(), "per-thread arena heaps: {heaps:?}");
    // libp2p's own: a connection to b was established.
    assert!(
        text.lines()
            .any(|l| l.starts_with("libp2p_swarm_connections_established_total")),
        "no libp2p connection metrics in:\n{text}"
    );
    // Every Murmur metric is in the operator's table.
    let docs = include_str!("../../docs/operations.md");
    for line in text.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE murmur_")
            .and_then(|rest| rest.split(' ').next())
        {
            assert!(
                docs.contains(&format!("`murmur_{name}")),
                "murmur_{name} is not documented in docs/operations.md (Metrics)"
            );
        }
    }

    // A Prometheus server asks for OpenMetrics, and gets it.
    let (content_type, openmetrics) = get(
        &a_dir,
        "/metrics",
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
    );
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");

    if tool_here("promtool", "prometheus") {
        let mut check = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        check
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = common::finish_within(check, "`promtool check metrics`");
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    b.leave(&b_dir);
    a.leave(&a_dir);
}

#[test]
fn json_logs_carry_stable_event_names() {
    let work = gossip_run();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let json_logs = ["--log-format", "json", "--log", "info"];
    let a = Daemon::start(work.path(), "a", &json_logs);
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &a.join_address()]);
    let b_id = common::json(&["id", "--data-dir", b_dir.to_str().unwrap(), "--json"]);
    a.wait_for_log(&["\"event\":\"peer_joined\""]);
    // Once they exchange, b's goodbye heartbeat has a gossip route to a.
    wait_until(&a_dir, "a exchanged with b", |s: &Value| {
        s["sync"]["exchanges"].as_u64().unwrap() >= 2
    });
    b.leave(&b_dir);
    a.wait_for_log(&["\"event\":\"peer_left\""]);
    let log = a.log.clone();
    a.leave(&a_dir);

    // Standard error is all JSON objects; standard output has the `ready` line and addresses.
    let text = std::fs::read_to_string(&log).unwrap();
    let events: Vec<Value> = text
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .filter(|v: &Value| v.get("event").is_some())
        .collect();
    let find = |name: &str| {
        events
            .iter()
            .find(|e| e["event"] == name)
            .unwrap_or_else(|| panic!("no `{name}` event in:\n{text}"))
    };
    assert_eq!(find("ready")["level"], "INFO");
    assert_eq!(find("peer_joined")["peer"], b_id["peer_id"]);
    assert!(find("peer_joined")["step"].is_u64());
    assert_eq!(find("peer_left")["peer"], b_id["peer_id"]);
    find("leaving");
    assert!(find("checkpoint_saved")["step"].is_u64());
}

#[test]
fn status_shows_device_mode_bytes_and_the_peer_table_and_watch_refreshes() {
    let work = gossip_run();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &a.join_address()]);
    let s = wait_until(&a_dir, "a sees b and exchanged", |s: &Value| {
        s["peers"].as_array().unwrap().len() == 1 && s["sync"]["exchanges"].as_u64().unwrap() >= 1
    });
    assert_eq!(s["device"], "cpu");
    assert_eq!(s["sync"]["mode"], "gossip");
    let peer = &s["peers"][0];
    let b_id = common::json(&["id", "--data-dir", b_dir.to_str().unwrap(), "--json"]);
    assert_eq!(peer["peer_id"], b_id["peer_id"]);
    // Staleness is our step minus theirs, from the same report.
    assert_eq!(
        peer["staleness"].as_i64().unwrap(),
        s["step"].as_i64().unwrap() - peer["step"].as_i64().unwrap()
    );

    let out = common::run(&["status", "--data-dir", a_dir.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    for words in [
        "mode gossip",
        "device cpu",
        "bytes out ",
        "staleness gate",
        "staleness",
        " resident, ",
        " allocated (heap: ",
        "; peak ",
        b_id["peer_id"].as_str().unwrap(),
    ] {
        assert!(text.contains(words), "no `{words}` in:\n{text}");
    }

    // --watch --json: a fresh report per refresh, steps never going back.
    let mut watch = common::nodectl()
        .args([
            "status",
            "--watch",
            "--interval",
            "0.2",
            "--json",
            "--data-dir",
        ])
        .arg(&a_dir)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut steps = Vec::new();
    for _ in 0..3 {
        let report: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
        steps.push(report["step"].as_u64().unwrap());
    }
    watch.kill().unwrap();
    watch.wait().unwrap();
    assert!(steps.windows(2).all(|w| w[0] <= w[1]), "{steps:?}");
    b.leave(&b_dir);
    a.leave(&a_dir);
}

/// An OTLP/HTTP receiver on loopback: it decodes every export with OpenTelemetry's own protobuf
/// definitions (`opentelemetry-proto`), as a collector does, and keeps what it received.
struct OtlpReceiver {
    url: String,
    spans: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
    metrics: Arc<Mutex<Vec<ExportMetricsServiceRequest>>>,
    _runtime: tokio::runtime::Runtime,
}

impl OtlpReceiver {
    fn start() -> OtlpReceiver {
        use axum::routing::post;

        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let metrics = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .route("/v1/traces", post(keep_export(Arc::clone(&spans))))
            .route("/v1/metrics", post(keep_export(Arc::clone(&metrics))));
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        runtime.spawn(async move { axum::serve(listener, app).await });
        OtlpReceiver {
            url,
            spans,
            metrics,
            _runtime: runtime,
        }
    }

    /// Every span received: its name and attributes, with the resource's attributes.
    fn spans(&self) -> Vec<(String, Attributes, Attributes)> {
        let mut out = Vec::new();
        for request in self.spans.lock().unwrap().iter() {
            for resource_spans in &request.resource_spans {
                let resource = attributes(
                    resource_spans
                        .resource
                        .as_ref()
                        .map_or(&[][..], |r| &r.attributes),
                );
                for scope in &resource_spans.scope_spans {
                    for span in &scope.spans {
                        out.push((
                            span.name.clone(),
                            attributes(&span.attributes),
                            resource.clone(),
                        ));
                    }
                }
            }
        }
        out
    }

    /// Every metric received: its name and data.
    fn metrics(&self) -> Vec<(String, Option<metric::Data>)> {
        let mut out = Vec::new();
        for request in self.metrics.lock().unwrap().iter() {
            for resource_metrics in &request.resource_metrics {
                for scope in &resource_metrics.scope_metrics {
                    for metric in &scope.metrics {
                        out.push((metric.name.clone(), metric.data.clone()));
                    }
                }
            }
        }
        out
    }
}

/// An OTLP/HTTP handler that decodes each export as an `M` and keeps it in `into`; 400 for
/// anything that is not one.
fn keep_export<M: prost::Message + Default + Send + 'static>(
    into: Arc<Mutex<Vec<M>>>,
) -> impl Fn(axum::body::Bytes) -> std::future::Ready<axum::http::StatusCode> + Clone {
    move |body| {
        std::future::ready(match M::decode(body) {
            Ok(request) => {
                into.lock().unwrap().push(request);
                axum::http::StatusCode::OK
            }
            Err(_) => axum::http::StatusCode::BAD_REQUEST,
        })
    }
}

type Attributes = BTreeMap<String, String>;

/// OTLP attributes as text (`"12"` for an integer, the string itself for a string).
fn attributes(list: &[KeyValue]) -> Attributes {
    list.iter()
        .map(|kv| {
            let value = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(any_value::Value::StringValue(s)) => s.clone(),
                Some(any_value::Value::IntValue(i)) => i.to_string(),
                Some(any_value::Value::DoubleValue(d)) => d.to_string(),
                Some(any_value::Value::BoolValue(b)) => b.to_string(),
                other => format!("{other:?}"),
            };
            (kv.key.clone(), value)
        })
        .collect()
}

/// The data points of a sum or gauge as (attributes, value).
fn points(data: &metric::Data) -> Vec<(Attributes, f64)> {
    use opentelemetry_proto::tonic::metrics::v1::number_data_point::Value as Number;
    let numbers = match data {
        metric::Data::Sum(sum) => &sum.data_points,
        metric::Data::Gauge(gauge) => &gauge.data_points,
        _ => return Vec::new(),
    };
    numbers
        .iter()
        .map(|p| {
            let value = match p.value {
                Some(Number::AsDouble(v)) => v,
                Some(Number::AsInt(v)) => v as f64,
                None => f64::NAN,
            };
            (attributes(&p.attributes), value)
        })
        .collect()
}

#[test]
fn a_real_otlp_receiver_gets_the_nodes_metrics_and_spans_flushed_at_shutdown() {
    let receiver = OtlpReceiver::start();
    let work = gossip_run();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    // Periodic exports an hour apart: whatever arrives was flushed when the node left.
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url.as_str()),
        ("OTEL_METRIC_EXPORT_INTERVAL", "3600000"),
        ("OTEL_BSP_SCHEDULE_DELAY", "3600000"),
    ];
    let a = Daemon::start_with_env(work.path(), "a", &[], &env);
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &a.join_address()]);
    let status = wait_until(&a_dir, "a finished exchanges", |s: &Value| {
        s["sync"]["exchanges"].as_u64().unwrap() >= 3
    });
    let (a_id, b_id) = (
        status["peer_id"].as_str().unwrap().to_owned(),
        status["peers"][0]["peer_id"].as_str().unwrap().to_owned(),
    );
    b.leave(&b_dir);
    a.leave(&a_dir);

    let spans = receiver.spans();
    assert!(!spans.is_empty(), "no spans received");
    for (_, _, resource) in &spans {
        assert_eq!(resource["service.name"], "murmur");
        assert_eq!(resource["service.instance.id"], a_id);
    }
    let exchanges: Vec<_> = spans
        .iter()
        .filter(|(name, attrs, _)| name == "exchange" && attrs["outcome"] == "ok")
        .map(|(_, attrs, _)| attrs)
        .collect();
    assert!(exchanges.len() >= 3, "ok exchange spans: {spans:?}");
    for attrs in &exchanges {
        assert_eq!(attrs["peer"], b_id, "{attrs:?}");
        assert!(attrs["step"].parse::<u64>().unwrap() > 0, "{attrs:?}");
        assert!(attrs["bytes_sent"].parse::<u64>().unwrap() > 0, "{attrs:?}");
        assert_eq!(attrs["bytes_sent"], attrs["bytes_received"], "{attrs:?}");
    }
    // The checkpoint saved on the way out: the last span of the run reached the receiver.
    let last_checkpoint = spans
        .iter()
        .filter(|(name, _, _)| name == "checkpoint")
        .map(|(_, attrs, _)| attrs)
        .max_by_key(|attrs| attrs["step"].parse::<u64>().unwrap())
        .unwrap_or_else(|| panic!("no checkpoint span in {spans:?}"));
    assert!(last_checkpoint["bytes"].parse::<u64>().unwrap() > 0);
    assert!(
        last_checkpoint["step"].parse::<u64>().unwrap() >= status["step"].as_u64().unwrap(),
        "{last_checkpoint:?}"
    );

    let metrics = receiver.metrics();
    let names: BTreeSet<&str> = metrics.iter().map(|(name, _)| name.as_str()).collect();
    for expected in [
        "murmur.steps",
        "murmur.samples",
        "murmur.loss",
        "murmur.exchanges",
        "murmur.sent_bytes",
        "murmur.received_bytes",
        "murmur.exchange_latency_seconds",
        "murmur.staleness_gate_wait_seconds",
        "murmur.live_peers",
    ] {
        assert!(names.contains(expected), "no {expected} in {names:?}");
    }
    let data = |name: &str| {
        metrics
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .and_then(|(_, data)| data.clone())
            .unwrap()
    };
    let steps = points(&data("murmur.steps"));
    assert!(
        steps[0].1 >= status["step"].as_u64().unwrap() as f64,
        "{steps:?}"
    );
    let exchanges = points(&data("murmur.exchanges"));
    let ok = exchanges
        .iter()
        .find(|(attrs, _)| attrs.get("outcome").is_some_and(|o| o == "ok"))
        .unwrap_or_else(|| panic!("{exchanges:?}"));
    assert!(ok.1 >= 3.0, "{exchanges:?}");
    match data("murmur.exchange_latency_seconds") {
        metric::Data::Histogram(h) => assert!(h.data_points[0].count >= 3, "{h:?}"),
        other => panic!("exchange latency is not a histogram: {other:?}"),
    }
}

/// Headless Chromium as the probe of this machine starts it: no sandbox (tests may run as
/// root), no GPU, no background traffic, a fresh profile.
fn chromium(profile: &Path) -> Command {
    let mut cmd = Command::new("chromium");
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        // Long enough for the page to fetch and draw twice.
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    cmd
}

/// The value of `data-<name>` on the page's `<body>` in `dom`.
fn body_data(dom: &str, name: &str) -> u64 {
    let key = format!("data-{name}=\"");
    let start = dom
        .find(&key)
        .unwrap_or_else(|| panic!("no {key} in the page:\n{dom}"))
        + key.len();
    dom[start..].split('"').next().unwrap().parse().unwrap()
}

#[test]
fn the_status_page_draws_the_curves_and_the_peer_table_in_headless_chromium() {
    if !tool_here("chromium", "chromium") {
        return;
    }
    let work = gossip_run();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &a.join_address()]);
    let status = wait_until(&a_dir, "two evaluations and a peer", |s: &Value| {
        s["history"].as_array().unwrap().len() >= 2 && s["live_peers"].as_u64().unwrap() == 1
    });
    let b_id = status["peers"][0]["peer_id"].as_str().unwrap();
    let url = format!(
        "http://{}/",
        std::fs::read_to_string(a_dir.join("api")).unwrap().trim()
    );

    // Served from the binary: no asset is fetched from anywhere but this node.
    let (content_type, page) = get(&a_dir, "/", "text/html");
    assert!(content_type.starts_with("text/html"), "{content_type}");
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"));

    let profile = tempfile::tempdir().unwrap();
    let out = common::output_within(
        chromium(profile.path()).arg("--dump-dom").arg(&url),
        "headless chromium dumping the status page",
    );
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(body_data(&dom, "loss-points") >= 2, "{dom}");
    assert!(body_data(&dom, "accuracy-points") >= 2, "{dom}");
    // The curves' own colours cover pixels of the canvases: they were drawn.
    assert!(body_data(&dom, "loss-ink") > 50, "{dom}");
    assert!(body_data(&dom, "accuracy-ink") > 50, "{dom}");
    assert_eq!(body_data(&dom, "peers"), 1, "{dom}");
    assert!(dom.contains(&format!("data-peer=\"{b_id}\"")), "{dom}");

    // The screenshot is kept with the build's test artifacts.
    let artifacts = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .unwrap()
        .join("test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let shot = artifacts.join("status-page.png");
    let _ = std::fs::remove_file(&shot);
    let out = common::output_within(
        chromium(profile.path())
            .arg(format!("--screenshot={}", shot.display()))
            .arg("--window-size=1200,900")
            .arg(&url),
        "headless chromium taking a screenshot of the status page",
    );
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{}",
        png.len()
    );
    eprintln!("status page screenshot: {}", shot.display());
    b.leave(&b_dir);
    a.leave(&a_dir);
}
