//! `nodectl bench sim`: a simulated swarm (nodes of the engine itself on a simulated network in
//! virtual time, `crate::sim`) and the wall time it takes. Only in a nodectl built with the
//! `sim` feature: a release build leaves the simulator out.

use anyhow::{Result, bail};

use crate::cli::BenchSimArgs;

#[cfg(not(feature = "sim"))]
pub(super) fn run(_: &BenchSimArgs) -> Result<()> {
    bail!(
        "this nodectl was built without the simulator: build it with `cargo build --release -p \
         murmur-daemon --features sim` and run `target/release/nodectl bench sim` again"
    )
}

#[cfg(feature = "sim")]
pub(super) fn run(args: &BenchSimArgs) -> Result<()> {
    use std::time::{Duration, Instant};

    use serde_json::json;

    use crate::report::round;
    use crate::sim::{Sim, SimConfig};

    if args.peers < 2 || args.steps == 0 {
        bail!("--peers must be 2 or more and --steps positive");
    }
    let mut config = match args.mode.as_str() {
        "gossip" => SimConfig::gossip(args.peers),
        "elastic" => SimConfig::elastic(args.peers),
        "allreduce" => SimConfig::allreduce(args.peers),
        other => bail!("--mode `{other}`: use gossip, elastic or allreduce"),
    };
    config.sync.seed = args.seed;
    config.steps = Some(args.steps);
    let started = Instant::now();
    // The simulated peers' own log lines (one "joined the run" each, ...) are not this
    // command's output.
    let (sim, done) =
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
            let mut sim = Sim::new(config.clone())?;
            // Long enough for every peer to reach the end even when gates and exchanges hold it up.
            let limit =
                config.step_time.mul_f64(args.steps as f64 * 20.0) + Duration::from_secs(60);
            let done = sim.run_until_steps(args.steps, limit);
            anyhow::Ok((sim, done))
        })?;
    let wall = started.elapsed().as_secs_f64();
    let virtual_s = sim.elapsed().as_secs_f64();
    let exchanges: u64 = (0..sim.peers()).map(|i| sim.stats(i).exchanges).sum();
    let longest_gate = sim.longest_gate_wait().as_secs_f64();
    if args.json {
        println!(
            "{}",
            json!({
                "bench": "sim",
                "mode": args.mode,
                "peers": args.peers,
                "steps": args.steps,
                "completed": done,
                "wall_s": round(wall, 3),
                "virtual_s": round(virtual_s, 3),
                "exchanges": exchanges,
                "longest_gate_wait_s": round(longest_gate, 3),
                "live_peers_timed_out": sim.live_peers_timed_out(),
                "consensus_distance": sim.consensus_distance(),
            })
        );
    } else {
        println!(
            "{} {} nodes x {} steps: {wall:.2} s of wall time for {virtual_s:.1} s simulated; \
             {exchanges} exchanges; longest gate wait {longest_gate:.3} s{}",
            args.peers,
            args.mode,
            args.steps,
            if done {
                ""
            } else {
                " (not every peer reached the end)"
            }
        );
    }
    Ok(())
}
