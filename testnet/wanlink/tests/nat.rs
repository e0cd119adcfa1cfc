//! The NAT testbed's routers behave as the kinds they are named for: testnet/nat.sh builds a
//! public site and three behind routers (two home, one symmetric), and the probes check each
//! router's mapping and which pairs can hole-punch.
//!
//! Needs root (namespaces), iproute2 and nftables. Without them the test says so and passes,
//! unless MURMUR_REQUIRE_TOOLS is set (as CI does), when it fails.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{can_run, command, repo, succeeded};

const PREFIX: &str = "nat-test";
/// Every command the test runs is killed after this long (coreutils `timeout`).
const DEADLINE_S: &str = "120";
/// How much sooner one side of a punch starts than the other.
const HEAD_START: Duration = Duration::from_millis(500);

fn nat_script(args: &[&str]) -> Command {
    let mut script = command(DEADLINE_S, PREFIX, repo().join("testnet/nat.sh"));
    script.args(args);
    script
}

/// The testbed; torn down on drop.
struct Testbed;

impl Testbed {
    fn up(kinds: &[&str]) -> Testbed {
        let mut args = vec!["up"];
        args.extend_from_slice(kinds);
        succeeded(
            "nat.sh up",
            nat_script(&args).output().expect("running nat.sh"),
        );
        Testbed
    }

    /// The namespace site `i`'s peer runs in.
    fn namespace(&self, i: usize) -> String {
        let output = nat_script(&["ns", &i.to_string()])
            .output()
            .expect("running nat.sh");
        String::from_utf8(succeeded("nat.sh ns", output).stdout)
            .expect("a namespace name")
            .trim()
            .to_owned()
    }

    /// `wanlink probe ARGS` in site `i`'s peer namespace, started.
    fn probe(&self, i: usize, args: &[&str]) -> Child {
        Command::new("timeout")
            .args([DEADLINE_S, "ip", "netns", "exec"])
            .arg(self.namespace(i))
            .arg(env!("CARGO_BIN_EXE_wanlink"))
            .arg("probe")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting a probe")
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        let _ = nat_script(&["down"]).status();
    }
}

/// A probe server, killed on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A finished probe's JSON answer.
fn answer(probe: Child) -> serde_json::Value {
    let output = succeeded(
        "a probe",
        probe.wait_with_output().expect("waiting for a probe"),
    );
    serde_json::from_slice(&output.stdout).expect("a probe prints JSON")
}

/// Two peers punching towards each other's public address, `a` starting half a second before
/// `b`; whether each got through. The head start is the case a careless router fails: `a`'s
/// packets reach `b`'s router before `b` has sent anything.
fn punch(testbed: &Testbed, a: usize, b: usize) -> (serde_json::Value, serde_json::Value) {
    let public = |i: usize| format!("10.77.0.{}:6000", i + 1);
    let probe_a = testbed.probe(
        a,
        &["punch", &public(b), "--port", "6000", "--seconds", "4"],
    );
    std::thread::sleep(HEAD_START);
    let probe_b = testbed.probe(
        b,
        &["punch", &public(a), "--port", "6000", "--seconds", "3"],
    );
    (answer(probe_a), answer(probe_b))
}

#[test]
fn home_routers_punch_through_to_each_other_and_a_symmetric_one_does_not() {
    if !can_run("NAT testbed", &["ip", "nft", "timeout"]) {
        return;
    }
    let testbed = Testbed::up(&["public", "home", "symmetric", "home"]);

    // Two probe servers on the public peer, for the mappings; each answers once it is up.
    let servers: Vec<Server> = ["10.77.0.1:7000", "10.77.0.1:7001"]
        .iter()
        .map(|listen| Server(testbed.probe(0, &["serve", listen])))
        .collect();
    let up_by = Instant::now() + Duration::from_secs(10);
    let mapping = |i: usize| loop {
        let probe = testbed.probe(
            i,
            &[
                "mapping",
                "10.77.0.1:7000",
                "10.77.0.1:7001",
                "--port",
                "5000",
            ],
        );
        let output = probe.wait_with_output().expect("waiting for a probe");
        if output.status.success() {
            break serde_json::from_slice::<serde_json::Value>(&output.stdout)
                .expect("a probe prints JSON");
        }
        assert!(
            Instant::now() < up_by,
            "the mapping probe from site {i} still fails after 10 s:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
    };

    let home = mapping(1);
    assert_eq!(
        home["seen_as"],
        serde_json::json!(["10.77.0.2:5000", "10.77.0.2:5000"]),
        "a home router maps a socket to one public address and keeps its port: {home}"
    );
    let symmetric = mapping(2);
    assert_eq!(
        symmetric["endpoint_independent"], false,
        "a symmetric router maps a socket anew for each destination: {symmetric}"
    );
    for seen in symmetric["seen_as"].as_array().expect("a list") {
        let seen = seen.as_str().expect("an address");
        assert!(
            seen.starts_with("10.77.0.3:"),
            "the symmetric router's public address is 10.77.0.3, seen as {seen}"
        );
    }
    drop(servers);

    let (one, three) = punch(&testbed, 1, 3);
    assert!(
        one["reached"] == true && three["reached"] == true,
        "two home routers: both sides get through (site 1: {one}, site 3: {three})"
    );
    let (one, two) = punch(&testbed, 1, 2);
    assert!(
        one["reached"] == false && two["reached"] == false,
        "a home router and a symmetric one: neither gets through (site 1: {one}, site 2: {two})"
    );
}
