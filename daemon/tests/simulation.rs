//! Scenarios of the sync engine in the simulator (`murmur_daemon::sim`): many nodes in virtual
//! time over a network that drops, delays, cuts and isolates.

use std::time::Duration;

use murmur_daemon::sim::{Sim, SimConfig};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Every live peer's step, for messages.
fn steps(sim: &Sim) -> Vec<u64> {
    (0..sim.peers()).map(|i| sim.step_of(i)).collect()
}

#[test]
fn gossip_peers_converge_without_long_gate_waits_or_false_timeouts() {
    let mut sim = Sim::new(SimConfig::gossip(8)).unwrap();
    let started = std::time::Instant::now();
    assert!(sim.run_until_steps(4_000, secs(120)), "{:?}", steps(&sim));
    eprintln!(
        "wall {:?} virtual {:?} {:?} {}",
        started.elapsed(),
        sim.elapsed(),
        sim.stats(0),
        sim.consensus_distance()
    );
    let distance = sim.consensus_distance();
    assert!(distance < 1e-2, "consensus distance {distance:e}");
    let longest = sim.longest_gate_wait();
    assert!(
        longest < Duration::from_secs(1),
        "a gate wait of {longest:?}"
    );
    assert_eq!(sim.live_peers_missing(), 0);
    for i in 0..sim.peers() {
        assert!(
            sim.stats(i).exchanges + sim.stats(i).served > 100,
            "peer {i}: {:?}",
            sim.stats(i)
        );
    }
}
