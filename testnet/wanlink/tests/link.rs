//! The emulated links hold to their profiles: testnet/netns.sh builds two peers' namespaces with
//! the switch between them, and the probes measure round-trip time, throughput and loss across.
//!
//! Needs root (namespaces, raw sockets) and iproute2. Without them the test says so and passes,
//! unless MURMUR_REQUIRE_TOOLS is set (as CI does), when it fails.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

mod common;
use common::{can_run, command, repo, succeeded};

const PREFIX: &str = "wanlink-test";
/// Every command the test runs is killed after this long (coreutils `timeout`).
const DEADLINE_S: &str = "60";

/// Runs `program args` with the deadline; fails the test with its output if it fails.
fn run(program: &str, args: &[&str]) -> Output {
    let output = command(DEADLINE_S, PREFIX, program)
        .args(args)
        .output()
        .expect("running a command");
    succeeded(&format!("{program} {args:?}"), output)
}

/// Two namespaces with the switch between them; torn down on drop.
struct Link;

impl Link {
    fn up(args: &[&str]) -> Link {
        let script = repo().join("testnet/netns.sh");
        let mut all = vec!["up", "2"];
        all.extend_from_slice(args);
        run(script.to_str().expect("a UTF-8 path"), &all);
        Link
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        let script = repo().join("testnet/netns.sh");
        let _ = Command::new(script)
            .arg("down")
            .env("NETNS_PREFIX", PREFIX)
            .env("WANLINK_STATE", std::env::temp_dir())
            .status();
    }
}

/// The probe server on peer 1, killed on drop.
struct Server(Child);

impl Server {
    fn start() -> Server {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &format!("{PREFIX}-n1"),
                env!("CARGO_BIN_EXE_wanlink"),
            ])
            .args(["probe", "serve", "10.77.0.2:7000"])
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting the probe server");
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the probe server did not start within 10 s");
        assert!(line.starts_with("serving"), "probe server: {line}");
        Server(child)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A probe from peer 0; its JSON answer.
fn probe(args: &[&str]) -> serde_json::Value {
    let mut all = vec![
        "netns",
        "exec",
        "wanlink-test-n0",
        env!("CARGO_BIN_EXE_wanlink"),
        "probe",
    ];
    all.extend_from_slice(args);
    let output = run("ip", &all);
    serde_json::from_slice(&output.stdout).expect("a probe prints JSON")
}

fn number(json: &serde_json::Value, key: &str) -> f64 {
    json[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no {key} in {json}"))
}

/// TCP's payload share of a full 1500-byte frame on the wire (1448 of 1514 bytes).
const GOODPUT_SHARE: f64 = 1448.0 / 1514.0;

#[test]
fn a_link_has_its_profiles_round_trip_rate_and_loss() {
    if !can_run("emulated-link", &["ip", "tc", "timeout"]) {
        return;
    }
    // A mixed path: 20 Mbit/s and 40 ms on one side, 5 Mbit/s and 20 ms on the other: 30 ms
    // one way, the slower rate.
    {
        let _link = Link::up(&["--link", "20mbit,40", "--link-node", "1=5mbit,20"]);
        let _server = Server::start();
        let rtt = probe(&["rtt", "10.77.0.2:7000", "--count", "15"]);
        let median = number(&rtt, "median_ms");
        assert!(
            (59.0..66.0).contains(&median),
            "round trip {median:.1} ms, expected 60: {rtt}"
        );
        let bulk = probe(&["throughput", "10.77.0.2:7000", "--bytes", "2500000"]);
        let rate = number(&bulk, "mbit_per_s");
        let ceiling = 5.0 * GOODPUT_SHARE;
        assert!(
            (0.8 * ceiling..=1.02 * ceiling).contains(&rate),
            "throughput {rate:.2} Mbit/s, expected at most {ceiling:.2}, the slower link's: {bulk}"
        );
    }
    // Loss: 4 % each way, from 3 000 echoed datagrams.
    let _link = Link::up(&["--link", "50mbit,5,4"]);
    let _server = Server::start();
    let loss = probe(&[
        "loss",
        "10.77.0.2:7000",
        "--count",
        "3000",
        "--gap-us",
        "300",
    ]);
    let pct = number(&loss, "one_way_loss_pct");
    assert!(
        (2.8..5.2).contains(&pct),
        "one-way loss {pct:.2} %, expected 4: {loss}"
    );
}
