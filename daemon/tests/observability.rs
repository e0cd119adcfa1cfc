//! What operators see of real `nodectl join` processes: `GET /metrics` as Prometheus text with
//! Murmur's and libp2p's metrics, accepted by `promtool`, or as OpenMetrics for a Prometheus
//! server; `nodectl status` with its peer table, once and with `--watch`; JSON logs with stable
//! event names.
//!
//! Tools from Debian (`promtool` from `prometheus`) are used where installed; with
//! `MURMUR_REQUIRE_TOOLS=1` (as CI sets it) a missing tool fails the test instead of skipping
//! that check.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use common::{Daemon, wait_until};
use serde_json::Value;

fn gossip_run() -> tempfile::TempDir {
    common::endless_mlp_run("gossip", "")
}

/// `GET <path>` of the control API of the daemon of `dir`, accepting `accept`: content type
/// and body.
fn get(dir: &Path, path: &str, accept: &str) -> (String, String) {
    let addr = std::fs::read_to_string(dir.join("api")).unwrap();
    let mut response = ureq::get(format!("http://{}{path}", addr.trim()))
        .header("accept", accept)
        .call()
        .unwrap();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (content_type, response.body_mut().read_to_string().unwrap())
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
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("MURMUR_REQUIRE_TOOLS").is_none(),
            "`{tool}` is required: install the Debian package `{package}`"
        );
        eprintln!("`{tool}` not installed (Debian `{package}`): that check is skipped");
    }
    found
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
        let out = check.wait_with_output().unwrap();
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
