//! A simulated swarm: the sync engine's real policy and replica rules for many peers in virtual
//! time, and the wall time their decisions take (decision 0018).
//!
//! ```text
//! cargo bench -p murmur-sync --features sim --bench sim -- --peers 64 --steps 10000 --json
//! ```
//!
//! Flags: `--peers N` (default 64), `--steps N` (10,000), `--mode gossip|elastic|allreduce`
//! (gossip), `--seed N` (1), `--json` (one JSON object instead of a sentence).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use murmur_sync::sim::{Sim, SimConfig};
use serde_json::json;

struct Args {
    peers: usize,
    steps: u64,
    mode: String,
    seed: u64,
    json: bool,
}

fn parse(mut words: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = Args {
        peers: 64,
        steps: 10_000,
        mode: "gossip".to_owned(),
        seed: 1,
        json: false,
    };
    while let Some(flag) = words.next() {
        let mut value = || words.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| {
            text.parse::<u64>()
                .map_err(|_| format!("{flag} takes a whole number, not `{text}`"))
        };
        match flag.as_str() {
            "--peers" => args.peers = number(value()?)? as usize,
            "--steps" => args.steps = number(value()?)?,
            "--seed" => args.seed = number(value()?)?,
            "--mode" => args.mode = value()?,
            "--json" => args.json = true,
            // `cargo bench` passes this to every harness.
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown flag `{other}`: the flags are --peers, --steps, --mode, --seed, --json"
                ));
            }
        }
    }
    if args.peers < 2 || args.steps == 0 {
        return Err("--peers must be 2 or more and --steps positive".to_owned());
    }
    Ok(args)
}

fn main() -> ExitCode {
    let args = match parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::FAILURE;
        }
    };
    let mut config = match args.mode.as_str() {
        "gossip" => SimConfig::gossip(args.peers),
        "elastic" => SimConfig::elastic(args.peers),
        "allreduce" => SimConfig::allreduce(args.peers),
        other => {
            eprintln!("error: --mode `{other}`: use gossip, elastic or allreduce");
            return ExitCode::FAILURE;
        }
    };
    config.seed = args.seed;
    config.steps = Some(args.steps);
    let started = Instant::now();
    let mut sim = Sim::new(config.clone());
    // Long enough for every peer to reach the end even when gates and exchanges hold it up.
    let limit = config.step_time.mul_f64(args.steps as f64 * 20.0) + Duration::from_secs(60);
    let done = sim.run_until_steps(args.steps, limit);
    let wall = started.elapsed().as_secs_f64();
    let virtual_s = sim.elapsed().as_secs_f64();
    let exchanges: u64 = (0..sim.peers()).map(|i| sim.stats(i).exchanges).sum();
    let longest_gate = sim.longest_gate_wait().as_secs_f64();
    let round = |x: f64| (x * 1000.0).round() / 1000.0;
    if args.json {
        println!(
            "{}",
            json!({
                "bench": "sim",
                "mode": args.mode,
                "peers": args.peers,
                "steps": args.steps,
                "completed": done,
                "wall_s": round(wall),
                "virtual_s": round(virtual_s),
                "exchanges": exchanges,
                "longest_gate_wait_s": round(longest_gate),
                "live_peers_timed_out": sim.live_peers_timed_out(),
                "consensus_distance": sim.consensus_distance(),
            })
        );
    } else {
        println!(
            "{} peers x {} steps of {} decisions: {wall:.2} s of wall time for {virtual_s:.1} s \
             simulated; {exchanges} exchanges; longest gate wait {longest_gate:.3} s{}",
            args.peers,
            args.steps,
            args.mode,
            if done {
                ""
            } else {
                " (not every peer reached the end)"
            }
        );
    }
    ExitCode::SUCCESS
}
