//! Scenarios of the sync engine in the simulator (`murmur_daemon::sim`): many nodes, each the
//! node's own membership actor, engine and replica driver, in virtual time over a network that
//! delays, throttles, loses heartbeats, cuts and isolates.

use std::time::Duration;

use murmur_daemon::sim::{Sim, SimConfig};
use murmur_protocol::codec::Codec;
use murmur_sync::copies::Copies;
use murmur_sync::replica::GATE_PATIENCE;
use murmur_sync::settings::{ElasticSettings, ElasticTopology, Mode, Outer};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn sim(config: SimConfig) -> Sim {
    Sim::new(config).expect("the simulator starts")
}

/// Every live peer's step, for messages.
fn steps(sim: &Sim) -> Vec<u64> {
    (0..sim.peers()).map(|i| sim.step_of(i)).collect()
}

/// The smallest step among live peers.
fn slowest(sim: &Sim) -> u64 {
    (0..sim.peers())
        .filter(|&i| sim.is_alive(i))
        .map(|i| sim.step_of(i))
        .min()
        .unwrap_or(0)
}

/// The consensus distance the peers of `config` reach in `duration` when they never mix: the
/// yardstick of how close mixing keeps them.
fn spread_without_mixing(config: SimConfig, duration: Duration) -> f64 {
    let mut config = config;
    config.sync.mode = Mode::Solo;
    let mut sim = sim(config);
    sim.run_for(duration);
    sim.consensus_distance()
}

/// Runs the peers of `config` for 10 s and checks they end at most a fifth as far apart as
/// when they never mix (`what` names the run in the message); the simulation, for more checks.
fn stays_together_for_10s(config: SimConfig, what: &str) -> Sim {
    let apart = spread_without_mixing(config.clone(), secs(10));
    let mut sim = sim(config);
    sim.run_for(secs(10));
    let distance = sim.consensus_distance();
    assert!(
        distance < apart / 5.0,
        "{what}: consensus distance {distance:.4}; replicas that never mix: {apart:.4}"
    );
    sim
}

// ---- gossip ----

#[test]
fn gossip_peers_converge_without_long_gate_waits_or_false_timeouts() {
    let mut sim = sim(SimConfig::gossip(8));
    assert!(sim.run_until_steps(4_000, secs(120)), "{:?}", steps(&sim));
    let distance = sim.consensus_distance();
    assert!(distance < 1e-2, "consensus distance {distance:e}");
    let longest = sim.longest_gate_wait();
    assert!(
        longest < Duration::from_secs(1),
        "a gate wait of {longest:?}"
    );
    assert_eq!(sim.live_peers_timed_out(), 0);
    for i in 0..sim.peers() {
        assert!(
            sim.stats(i).exchanges + sim.stats(i).served > 100,
            "peer {i}: {:?}",
            sim.stats(i)
        );
    }
}

#[test]
fn the_same_seed_gives_the_same_run_and_another_seed_another() {
    let run = |seed| {
        let mut config = SimConfig::gossip(6);
        config.sync.seed = seed;
        let mut sim = sim(config);
        sim.run_for(secs(10));
        (
            steps(&sim),
            sim.stats(0).exchanges,
            sim.consensus_distance(),
        )
    };
    assert_eq!(run(3), run(3));
    assert_ne!(run(3), run(4));
}

#[test]
fn sixteen_peers_stay_together_through_a_thousand_exchanges_each() {
    let mut sim = sim(SimConfig::gossip(16));
    assert!(sim.run_until_steps(8_000, secs(300)), "{:?}", steps(&sim));
    assert!(sim.consensus_distance() < 1e-2);
    assert_eq!(sim.live_peers_timed_out(), 0);
    assert!(sim.blocks().is_empty(), "{:?}", sim.blocks());
}

#[test]
fn a_slow_peer_holds_the_others_within_the_bound_but_never_stops_them() {
    let mut config = SimConfig::gossip(4);
    config.sync.max_staleness = Some(16);
    let mut sim = sim(config);
    sim.slow_down(3, 3.0);
    sim.run_for(secs(30));
    let lead = steps(&sim).iter().max().unwrap() - sim.step_of(3);
    // The bound, plus what a clock moves between two announcements.
    assert!(lead <= 16 + 8, "lead {lead}: {:?}", steps(&sim));
    assert!(sim.step_of(0) > 1_000, "{:?}", steps(&sim));
    assert!(
        sim.longest_gate_wait() < Duration::from_secs(1),
        "{:?}",
        sim.longest_gate_wait()
    );
}

/// The coupling gate (decision 0039): a live peer whose clock stays behind, however honestly,
/// holds the others at the bound for about the gate's patience, and then no longer.
#[test]
fn a_peer_that_cannot_keep_up_holds_the_gate_for_its_patience_and_no_longer() {
    let config = SimConfig::gossip(4);
    let (patience, bound) = (GATE_PATIENCE, config.sync.max_staleness.unwrap_or(0));
    let mut sim = sim(config);
    // Coupled first: a peer that was never within the bound of the others holds no one.
    sim.run_for(secs(5));
    sim.slow_down(3, 50.0);
    let slowed = sim.elapsed();
    // Held while the lead stays within the bound (plus a clock's move between announcements).
    let tick = Duration::from_millis(250);
    while sim.step_of(0) <= sim.step_of(3) + bound + bound / 2 {
        assert!(
            sim.elapsed() - slowed < patience * 3,
            "still held after {:?}: {:?}",
            sim.elapsed() - slowed,
            steps(&sim)
        );
        sim.run_for(tick);
    }
    let held = sim.elapsed() - slowed;
    assert!(
        held >= patience / 2 && held <= patience + secs(2),
        "held for {held:?}, the patience is {patience:?}"
    );
    sim.run_for(secs(30));
    let lead = sim.step_of(0) - sim.step_of(3);
    assert!(
        lead > 1_000,
        "the others were held again: {:?}",
        steps(&sim)
    );
    for i in 0..3 {
        assert!(sim.stats(i).uncoupled >= 1, "peer {i}: {:?}", sim.stats(i));
    }
    assert_eq!(sim.live_peers_timed_out(), 0);
}

#[test]
fn a_dead_peer_holds_the_gate_for_the_peer_timeout_and_no_longer() {
    let mut sim = sim(SimConfig::gossip(4));
    sim.run_for(secs(5));
    sim.kill(2);
    sim.run_for(secs(30));
    let longest = sim.longest_gate_wait();
    let timeout = SimConfig::gossip(4).timeouts.peer;
    assert!(longest <= timeout + secs(1), "{longest:?}");
    assert!(
        slowest(&sim) > 3_000,
        "the survivors go on: {:?}",
        steps(&sim)
    );
    for i in [0, 1, 3] {
        assert_eq!(sim.live_peers_of(i), 2, "peer {i}");
    }
}

#[test]
fn a_restarted_peer_catches_up_by_state_sync_and_mixes_again() {
    let mut sim = sim(SimConfig::gossip(4));
    sim.run_for(secs(10));
    sim.kill(1);
    sim.run_for(secs(20));
    sim.restart(1).expect("the peer restarts");
    sim.run_for(secs(10));
    assert!(!sim.is_joining(1));
    assert!(sim.stats(1).state_syncs >= 1, "{:?}", sim.stats(1));
    let behind = steps(&sim).iter().max().unwrap() - sim.step_of(1);
    assert!(behind <= 32, "{:?}", steps(&sim));
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
}

#[test]
fn a_cut_link_does_not_split_the_swarm() {
    let mut sim = sim(SimConfig::gossip(4));
    sim.cut(0, 1);
    sim.run_for(secs(30));
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
    // They never hear each other, so each goes on without the other's clock.
    assert_eq!(sim.live_peers_of(0), 2);
    assert!(slowest(&sim) > 3_000, "{:?}", steps(&sim));
}

#[test]
fn heartbeats_lost_at_random_never_time_out_a_live_peer() {
    let mut sim = sim(SimConfig::gossip(6));
    sim.lose_heartbeats(0.2);
    sim.run_for(secs(60));
    assert_eq!(sim.live_peers_timed_out(), 0);
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
}

#[test]
fn overlapped_exchanges_keep_the_swarm_together_too() {
    let mut config = SimConfig::gossip(6);
    config.sync.overlap = true;
    let mut sim = sim(config);
    sim.run_for(secs(30));
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
}

#[test]
fn slow_links_pause_the_trainers_but_the_swarm_goes_on() {
    let mut config = SimConfig::gossip(4);
    config.latency = Duration::from_millis(30);
    config.transfer = Duration::from_millis(80);
    let mut sim = sim(config);
    sim.run_for(secs(60));
    assert!(slowest(&sim) > 1_000, "{:?}", steps(&sim));
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
    assert_eq!(sim.live_peers_timed_out(), 0);
}

/// Decision 0021: with 25 ms of latency an offer is in flight for most of an interval, so a
/// node that answered `Busy` whenever it was offering left most due snapshots unmixed (about
/// 0.7 mixes per due snapshot here). Answering one offer beside its own mixes them all.
#[test]
fn on_a_slow_link_offers_crossing_in_flight_still_mix() {
    let mut config = SimConfig::gossip(4);
    config.latency = Duration::from_millis(25);
    config.transfer = Duration::from_millis(80);
    let mut sim = sim(config);
    sim.run_for(secs(60));
    for i in 0..4 {
        let stats = sim.stats(i);
        let dues = stats.steps / 8;
        let mixes = stats.exchanges + stats.served;
        assert!(
            mixes >= dues,
            "peer {i}: {mixes} mixes for {dues} due snapshots ({stats:?})"
        );
    }
    assert!(
        sim.consensus_distance() < 1e-2,
        "{}",
        sim.consensus_distance()
    );
}

/// Decision 0021: with `overlap`, a snapshot that falls due while the previous exchange is
/// in flight waits for it without pausing the trainer, so on a slow link the peers train at
/// full speed, the interval stretches to the link's pace, and no mix lands later than
/// `max_merge_lag` steps after its snapshot.
#[test]
fn with_overlap_a_slow_link_stretches_the_interval_and_bounds_the_merge_lag() {
    let lan = {
        let mut sim = sim(SimConfig::gossip(4));
        sim.run_for(secs(20));
        slowest(&sim)
    };
    let mut config = SimConfig::gossip(4);
    config.latency = Duration::from_millis(25);
    config.transfer = Duration::from_millis(80);
    config.sync.overlap = true;
    config.sync.max_merge_lag = 40;
    let apart = spread_without_mixing(config.clone(), secs(20));
    let mut sim = sim(config);
    sim.run_for(secs(20));
    assert!(
        slowest(&sim) * 10 >= lan * 9,
        "overlapped steps {:?}, on a LAN {lan}",
        steps(&sim)
    );
    for i in 0..4 {
        let stats = sim.stats(i);
        assert!(stats.exchanges + stats.served >= 40, "peer {i}: {stats:?}");
        assert!(stats.max_merge_lag <= 40, "peer {i}: {stats:?}");
        assert!(stats.max_merge_lag >= 8, "mixes land late: {stats:?}");
    }
    // Rarer mixes keep the replicas less close than on a LAN, but close.
    let distance = sim.consensus_distance();
    assert!(
        distance < apart / 10.0,
        "consensus distance {distance:e}; replicas that never mix: {apart:e}"
    );
}

/// Four gossip peers 25 ms apart, exchanging every 32 steps within a bound of 256: the WAN
/// config's swarm.
fn four_peers_on_wan_links() -> SimConfig {
    let mut config = SimConfig {
        latency: Duration::from_millis(25),
        transfer: Duration::from_millis(20),
        ..SimConfig::gossip(4)
    };
    config.sync.interval = 32;
    config.sync.max_staleness = Some(256);
    config
}

/// `config` run for 30 s, with peer 3's link `slow_link` times slower if given.
fn ran_for_30s(config: SimConfig, slow_link: Option<f64>) -> Sim {
    let mut sim = sim(config);
    if let Some(factor) = slow_link {
        sim.slow_link(3, factor);
    }
    sim.run_for(secs(30));
    sim
}

/// The steps of the slowest of peers 0-2 (the fast ones beside peer 3).
fn slowest_of_three(sim: &Sim) -> u64 {
    (0..3).map(|i| sim.step_of(i)).min().expect("three peers")
}

/// Decision 0022: one peer on a link 8 times slower (a home uplink) must not set the pace of
/// three fast ones. The fast ones stop offering to it (it offers to them), and with
/// `adapt_interval` it exchanges as often as its link allows instead of pausing for long
/// exchanges every 32 steps and holding the others at the staleness gate.
///
/// How close the swarm stays varies with the seed, so it is judged by the median of seven.
/// This check was a fifth of the spread of replicas that never mix, met by seed 1 alone: over
/// seeds 1-7 the median was 0.20 (0.10 to 0.28) before the simulated trainers ran the real
/// replica rules, and is 0.22 (0.16 to 0.29) with them. The bound is a quarter.
#[test]
fn a_peer_on_a_slow_link_does_not_set_the_pace_of_the_fast_ones() {
    let mut closeness = Vec::new();
    for seed in 1..=7 {
        let mut config = four_peers_on_wan_links();
        config.sync.adapt_interval = true;
        config.sync.seed = seed;
        let all_fast = slowest_of_three(&ran_for_30s(config.clone(), None));
        let apart = spread_without_mixing(config.clone(), secs(30));
        let sim = ran_for_30s(config, Some(8.0));
        let fast = slowest_of_three(&sim);
        assert!(
            fast * 10 >= all_fast * 8,
            "seed {seed}: fast peers took {fast} steps beside a slow one, {all_fast} without: {:?}",
            steps(&sim)
        );
        let slow = sim.stats(3);
        assert!(
            slow.exchanges >= 10,
            "seed {seed}: the slow peer still mixes: {slow:?}"
        );
        closeness.push(sim.consensus_distance() / apart);
    }
    closeness.sort_by(f64::total_cmp);
    let median = closeness[closeness.len() / 2];
    assert!(
        median < 0.25,
        "the median consensus distance is {median:.3} of the spread of replicas that never mix \
         (each seed: {closeness:.3?})"
    );
}

/// The gossip defect of decision 0014: a live peer unheard for a while drifts from the others;
/// when it is heard again, it finds every peer an outlier. It must not block them (nor they
/// it): it takes the swarm's parameters again and the run goes on together.
#[test]
fn a_peer_back_from_isolation_trusts_the_swarm_again_and_no_one_is_blocked() {
    let mut sim = sim(SimConfig::gossip(6));
    sim.run_for(secs(20));
    sim.isolate(0);
    sim.run_for(secs(15));
    sim.recover();
    sim.run_for(secs(30));
    assert!(
        sim.blocks().is_empty(),
        "blocked (blocker, blocked): {:?}",
        sim.blocks()
    );
    let distance = sim.consensus_distance();
    assert!(distance < 1e-2, "consensus distance {distance:e}");
}

/// The other side of the isolation scenario: a hostile peer whose parameters stay far from
/// everyone's is declined by every peer, and the honest ones never take its distances for
/// their own (it is one peer of six, not most of them): they stay together, far from it.
#[test]
fn a_peer_whose_parameters_stay_far_off_is_never_mixed_in() {
    let mut sim = sim(SimConfig::gossip(6));
    sim.run_for(secs(10));
    sim.poison(5, 50.0);
    sim.run_for(secs(30));
    let honest = [0, 1, 2, 3, 4];
    let distance = sim.consensus_distance_of(&honest);
    assert!(
        distance < 1e-2,
        "the honest peers drifted apart: {distance:e}"
    );
    // Shards' optima lie between 0.5 and 1.5: a replica that mixed in 50 would be far out.
    for i in honest {
        let replica = sim.replica(i);
        assert!(
            replica.iter().all(|v| (0.4..1.6).contains(v)),
            "peer {i} moved toward the hostile one: {replica:?}"
        );
    }
}

// ---- elastic ----

#[test]
fn elastic_peers_follow_one_center_and_stay_close() {
    let mut sim = sim(SimConfig::elastic(5));
    sim.run_for(secs(30));
    let center = sim.center_of(0).expect("a center");
    for i in 0..sim.peers() {
        assert_eq!(sim.center_of(i), Some(center), "peer {i}");
    }
    assert!(sim.stats(center).served > 100, "{:?}", sim.stats(center));
    assert!(
        sim.consensus_distance() < 5e-2,
        "{}",
        sim.consensus_distance()
    );
}

#[test]
fn when_the_center_dies_the_survivors_elect_and_use_another() {
    let mut sim = sim(SimConfig::elastic(4));
    sim.run_for(secs(10));
    let center = sim.center_of(0).unwrap();
    sim.kill(center);
    sim.run_for(secs(20));
    let survivors: Vec<usize> = (0..4).filter(|&i| i != center).collect();
    let next = sim.center_of(survivors[0]).expect("a new center");
    assert_ne!(next, center);
    for &i in &survivors {
        assert_eq!(sim.center_of(i), Some(next));
    }
    let served = sim.stats(next).served;
    sim.run_for(secs(5));
    assert!(
        sim.stats(next).served > served,
        "the new center serves workers"
    );
}

#[test]
fn elastic_gossip_without_a_center_converges() {
    let mut config = SimConfig::elastic(5);
    config.sync.mode = Mode::Elastic(ElasticSettings {
        topology: ElasticTopology::Gossip,
        ..ElasticSettings::default()
    });
    let mut sim = sim(config);
    sim.run_for(secs(30));
    assert!(
        sim.consensus_distance() < 5e-2,
        "{}",
        sim.consensus_distance()
    );
    assert!(sim.center_of(0).is_none());
}

// ---- allreduce ----

#[test]
fn ring_members_round_in_lockstep_and_end_identical() {
    let mut sim = sim(SimConfig::allreduce(4));
    assert!(sim.run_until_steps(200, secs(60)), "{:?}", steps(&sim));
    let s = steps(&sim);
    assert!(
        s.iter().max().unwrap() - s.iter().min().unwrap() <= 1,
        "{s:?}"
    );
    assert!(
        sim.consensus_distance() < 1e-6,
        "{}",
        sim.consensus_distance()
    );
}

/// A trusted member whose values turn NaN cannot make the others' replicas NaN: every member
/// refuses the round's mean (the ring's rule, `ring::into_mean`, as in the engine), and none
/// lands it.
#[test]
fn a_member_that_sends_nan_aborts_the_rounds_and_the_others_stay_finite() {
    let mut sim = sim(SimConfig::allreduce(4));
    sim.run_for(secs(5));
    sim.poison(3, f32::NAN);
    sim.run_for(secs(5));
    for i in 0..3 {
        let replica = sim.replica(i);
        assert!(replica.iter().all(|v| v.is_finite()), "{i}: {replica:?}");
        assert!(sim.stats(i).failed > 0, "{i}: {:?}", sim.stats(i));
    }
}

#[test]
fn the_first_round_waits_for_min_peers() {
    let mut sim = sim(SimConfig::allreduce(3));
    sim.kill(2);
    sim.run_for(secs(10));
    assert_eq!(
        slowest(&sim),
        0,
        "no round without the third: {:?}",
        steps(&sim)
    );
    sim.restart(2).expect("the peer restarts");
    assert!(sim.run_until_steps(50, secs(30)), "{:?}", steps(&sim));
}

#[test]
fn a_killed_ring_member_is_left_out_and_the_rest_go_on() {
    let mut sim = sim(SimConfig::allreduce(4));
    sim.run_for(secs(10));
    let before = slowest(&sim);
    sim.kill(3);
    sim.run_for(secs(10));
    assert!(slowest(&sim) > before + 50, "{:?}", steps(&sim));
}

/// Decision 0078: a killed member is out of the rings after one settle, though its heartbeat
/// times out only 10 s later; with a tight staleness bound it must not hold the others at the
/// gate meanwhile (they stood still until it timed out).
#[test]
fn a_killed_ring_member_holds_no_one_at_the_staleness_gate() {
    let mut config = SimConfig::allreduce(4);
    config.sync.max_staleness = Some(16);
    let mut sim = sim(config);
    sim.run_for(secs(10));
    let before = slowest(&sim);
    sim.kill(3);
    // 5 s: a settle of 1.5 s, then about 70 rounds of 50 ms; well inside the peer timeout.
    sim.run_for(secs(5));
    assert!(slowest(&sim) > before + 40, "{:?}", steps(&sim));
}

#[test]
fn a_killed_member_that_comes_back_catches_up_and_rounds_again() {
    let mut sim = sim(SimConfig::allreduce(4));
    sim.run_for(secs(10));
    sim.kill(1);
    sim.run_for(secs(5));
    sim.restart(1).expect("the peer restarts");
    sim.run_for(secs(15));
    assert!(sim.stats(1).state_syncs >= 1, "{:?}", sim.stats(1));
    let s = steps(&sim);
    assert!(
        s.iter().max().unwrap() - s.iter().min().unwrap() <= 1,
        "{s:?}"
    );
    let before = sim.step_of(1);
    sim.run_for(secs(5));
    assert!(
        sim.step_of(1) > before + 20,
        "it rounds again: {:?}",
        steps(&sim)
    );
}

/// The allreduce defect of decision 0017: after kills and restarts the members agree on the
/// ring, yet every attempt aborts ("a neighbour closed the ring connection"), one member after
/// another a second apart, for good. As `testnet/chaos.sh` does, a peer is killed at a random
/// moment and restarted seconds later; rounds must resume after every restart.
#[test]
fn repeated_kills_and_restarts_never_stop_the_ring() {
    for seed in [10, 18, 31] {
        let mut config = SimConfig::allreduce(4);
        config.sync.seed = seed;
        let mut sim = sim(config);
        sim.run_for(secs(20));
        for kill in 0..7u64 {
            let victim = ((seed * 7 + kill * 13) % 4) as usize;
            sim.run_for(Duration::from_millis((seed * 37 + kill * 101) % 1000));
            sim.kill(victim);
            sim.run_for(secs(3 + (seed + kill) % 8));
            sim.restart(victim).expect("the peer restarts");
            let at = slowest(&sim);
            sim.run_for(secs(35));
            let progress = slowest(&sim) - at;
            assert!(
                progress > 100,
                "seed {seed}: after kill {} (of peer {victim}) the ring made {progress} rounds in 35 s: {:?}",
                kill + 1,
                steps(&sim)
            );
        }
    }
}

#[test]
fn the_first_peer_of_a_run_rounds_alone_and_the_next_takes_over_its_state() {
    let mut config = SimConfig::allreduce(2);
    let Mode::Allreduce(ring) = &mut config.sync.mode else {
        unreachable!("an allreduce run")
    };
    ring.min_peers = 1;
    let mut sim = sim(config);
    sim.kill(1);
    sim.run_for(secs(10));
    assert!(sim.step_of(0) > 100, "alone: {:?}", steps(&sim));
    sim.restart(1).expect("the peer restarts");
    sim.run_for(secs(10));
    assert!(sim.stats(1).state_syncs >= 1);
    let s = steps(&sim);
    assert!(s[0].abs_diff(s[1]) <= 1, "{s:?}");
}

#[test]
fn a_member_unheard_for_a_while_is_left_out_until_heard_again() {
    let mut sim = sim(SimConfig::allreduce(4));
    sim.run_for(secs(5));
    sim.isolate(2);
    sim.run_for(secs(8));
    let others = [0, 1, 3].map(|i| sim.step_of(i));
    sim.recover();
    sim.run_for(secs(20));
    let s = steps(&sim);
    assert!(s[0] > others[0] + 100, "{s:?}");
    assert!(
        s.iter().max().unwrap() - s.iter().min().unwrap() <= 1,
        "all four together: {s:?}"
    );
}

/// Decision 0029: the fast peers leave a peer on a link 8 times slower out of their staleness
/// gate and train on while they answer it, so beside it they keep the pace of a swarm without
/// it; the slow peer still mixes, and follows them.
#[test]
fn fast_peers_keep_their_pace_beside_a_peer_on_a_slow_link() {
    let config = four_peers_on_wan_links();
    let all_fast = slowest_of_three(&ran_for_30s(config.clone(), None));
    let sim = ran_for_30s(config, Some(8.0));
    let fast = slowest_of_three(&sim);
    // Before decision 0029 they kept the slow peer's pace: 1,287 steps against 3,424.
    assert!(
        fast * 100 >= all_fast * 95,
        "fast peers took {fast} steps beside a slow one, {all_fast} without: {:?}",
        steps(&sim)
    );
    let slow = sim.stats(3);
    assert!(slow.exchanges >= 10, "the slow peer still mixes: {slow:?}");
}

/// Decision 0030 (`sync.outer = "nesterov"`): whenever a replica's parameters are taken for an
/// exchange, its own progress since its anchor goes through the DiLoCo outer step, and the
/// replica takes that move when the exchange ends, with the mix. The outer momentum carries
/// the swarm toward its optimum faster than averaging alone, and the mixes keep it together.
#[test]
fn outer_steps_carry_the_swarm_to_its_optimum_faster_and_it_stays_together() {
    let nesterov = Outer::Nesterov {
        lr: 0.7,
        momentum: 0.9,
    };
    let ran_for_2s = |outer| {
        let mut config = SimConfig::gossip(4);
        config.sync.outer = outer;
        let mut sim = sim(config);
        sim.run_for(secs(2));
        sim
    };
    let plain = ran_for_2s(Outer::Average).distance_to_optimum();
    let mut sim = ran_for_2s(nesterov);
    let outer = sim.distance_to_optimum();
    assert!(
        outer < plain / 2.0,
        "after 2 s the swarm is {outer:.4} from its optimum with outer steps, {plain:.4} without"
    );
    let apart = spread_without_mixing(SimConfig::gossip(4), secs(10));
    let mut farthest: f64 = 0.0;
    for _ in 0..8 {
        sim.run_for(secs(1));
        farthest = farthest.max(sim.consensus_distance());
    }
    assert!(
        farthest < apart / 3.0,
        "consensus distance up to {farthest:.4}; replicas that never mix: {apart:.4}"
    );
}

// ---- compressed exchanges ----

/// Decisions 0020 and 0024: a compressed exchange sends the difference between the replica and
/// the pair's copy of it, through int8 or top-k, and both sides add what was sent to the copies;
/// what the codec drops stays in the next difference. Eight peers on int8 or top-k stay about
/// as close as on raw parameters.
#[test]
fn compressed_exchanges_keep_the_swarm_together() {
    for codec in [Codec::INT8, Codec::TOP_K] {
        let mut config = SimConfig {
            dim: 64,
            ..SimConfig::gossip(8)
        };
        config.sync.codec = codec;
        let sim = stays_together_for_10s(config, &format!("{codec:?}"));
        for i in 0..sim.peers() {
            let stats = sim.stats(i);
            assert!(
                stats.exchanges + stats.served > 100,
                "{codec:?}, peer {i}: {stats:?}"
            );
        }
    }
}

/// Decision 0081 (`[memory]`): a node keeps the pair copies of the partners it exchanged with
/// last, within its budget, and drops the others, whose pairs start again from zero copies.
/// Eight peers on int8 whose nodes have room for two partners' copies of seven hold no more,
/// drop pairs all along, and stay about as close as with every partner's copies kept.
#[test]
fn a_node_keeps_pair_copies_within_its_budget_and_the_swarm_stays_together() {
    let mut config = SimConfig {
        dim: 64,
        pair_copies: Some(2),
        ..SimConfig::gossip(8)
    };
    config.sync.codec = Codec::INT8;
    let sim = stays_together_for_10s(config, "two partners' copies kept");
    let pair = Copies::bytes_for(64);
    for i in 0..sim.peers() {
        let stats = sim.stats(i);
        // The copies of the exchanges under way are kept whatever the budget.
        let bound = (2 * pair).max(stats.pair_copies_lent * pair);
        assert!(
            stats.pair_copies_bytes <= bound && stats.pairs_dropped > 10,
            "peer {i}: {} bytes of copies (at most {bound}), {} pairs dropped",
            stats.pair_copies_bytes,
            stats.pairs_dropped
        );
        assert!(stats.exchanges + stats.served > 100, "peer {i}: {stats:?}");
    }
}

/// Decision 0025 (`sync.adapt_codec`): a partner whose exchanges through `sync.codec` take
/// many intervals' compute gets top-k instead (but for one pick in a few, which measures
/// `sync.codec` again). A peer on a link 20 times slower exchanges through it, which takes a
/// tenth of the time of raw parameters.
#[test]
fn a_peer_on_a_slow_link_exchanges_through_top_k_with_adapt_codec() {
    let mut config = four_peers_on_wan_links();
    config.sync.sparse_codec = Some(Codec::TOP_K);
    config.sync.adapt_interval = true;
    let sim = ran_for_30s(config, Some(20.0));
    let slow = sim.stats(3);
    assert!(
        slow.exchanges >= 5 && slow.sparse * 2 > slow.exchanges + slow.served,
        "most of the slow peer's mixes go through top-k: {slow:?}"
    );
    let fast = sim.stats(0);
    assert!(
        fast.sparse * 10 <= fast.exchanges + fast.served,
        "the fast peers exchange raw parameters with each other: {fast:?}"
    );
}

/// A run of `config`'s peers whose first peer trains alone for 1.2 s (about 240 steps) before
/// the others start.
fn first_peer_alone(config: SimConfig) -> Sim {
    let peers = config.peers;
    let mut sim = sim(config);
    for i in 1..peers {
        sim.kill(i);
    }
    sim.run_for(Duration::from_millis(1_200));
    sim
}

/// The other peers start together, the links `cut` cut for their first 0.5 s; then 30 s.
fn the_rest_start_cut_off(sim: &mut Sim, cut: &[(usize, usize)]) {
    for &(a, b) in cut {
        sim.cut(a, b);
    }
    for i in 1..sim.peers() {
        sim.restart(i).expect("the peer restarts");
    }
    sim.run_for(Duration::from_millis(500));
    sim.recover();
    sim.run_for(secs(30));
}

/// The start-up race of the main job (decision 0033, second amendment): the first peer trains
/// alone for a while, and the next three start together and hear one another before they hear
/// it. By the median clock (decision 0042) the three young ones are the run; the first peer
/// takes over the run's state rather than stay ahead of it, alone. Before, it stayed 267 steps
/// ahead with 45 exchanges to their 630, at a consensus distance of 0.24 (theirs 0.0024).
#[test]
fn a_first_peer_left_ahead_of_a_run_that_started_without_it_rejoins_the_run() {
    let mut sim = first_peer_alone(SimConfig::gossip(4));
    assert!(sim.step_of(0) > 200, "alone: {:?}", steps(&sim));
    let cut: Vec<(usize, usize)> = (1..4).map(|i| (0, i)).collect();
    the_rest_start_cut_off(&mut sim, &cut);
    let s = steps(&sim);
    let (young, all) = (
        sim.consensus_distance_of(&[1, 2, 3]),
        sim.consensus_distance(),
    );
    assert!(
        all < 1e-2,
        "the first peer stayed apart: {all:e} (the others {young:e}), steps {s:?}, {:?}",
        sim.stats(0)
    );
    assert_eq!(sim.stats(0).state_syncs, 1, "{:?}", sim.stats(0));
    let behind = s.iter().max().unwrap() - s.iter().min().unwrap();
    assert!(behind <= 32, "{s:?}");
}

/// The same race among eight: the first peer trains alone; of the seven that start together,
/// four hear it and take over its state, and three hear only one another and join on one
/// another, a minority of the run. They mixed with peers in step, but they are young members
/// (decision 0033, third amendment): once they hear the run, each takes over its state, and
/// the run goes on as one, on one clock. Before that rule they kept their clocks, about 320
/// steps behind, and mixed with the run as often as anyone.
#[test]
fn newcomers_that_joined_on_one_another_behind_the_run_take_over_its_state() {
    let mut sim = first_peer_alone(SimConfig::gossip(8));
    let cut: Vec<(usize, usize)> = (1..4)
        .flat_map(|i| [0, 4, 5, 6, 7].map(|j| (i, j)))
        .collect();
    the_rest_start_cut_off(&mut sim, &cut);
    let all = sim.consensus_distance();
    assert!(
        all < 1e-2,
        "the swarm split: {all:e}, steps {:?}",
        steps(&sim)
    );
    let fewest = (0..8).map(|i| sim.stats(i).exchanges).min().unwrap();
    assert!(fewest > 400, "a peer mixed {fewest} times in 30 s");
    let s = steps(&sim);
    let behind = s.iter().max().unwrap() - s.iter().min().unwrap();
    assert!(behind <= 32, "the run is on two clocks: {s:?}");
}

/// The start-up race in an elastic run with a center, which decision 0033's rule for a member
/// far ahead leaves out: the first peer trains alone; the other five start together, cut off
/// from it for 0.5 s. Once they hear it, they all follow it as the center, and each newcomer
/// takes over its state (a joiner's source in such a run is the elected center), so the run
/// goes on as one, on one clock. With the source taken at the median member instead, the
/// newcomers never take over a state nor mix with the first peer.
#[test]
fn elastic_newcomers_cut_off_from_a_center_far_ahead_take_over_its_state() {
    let peers = 6;
    let mut sim = first_peer_alone(SimConfig::elastic(peers));
    let alone = sim.step_of(0);
    assert!(alone > 200, "alone: {:?}", steps(&sim));
    let cut: Vec<(usize, usize)> = (1..peers).map(|i| (0, i)).collect();
    the_rest_start_cut_off(&mut sim, &cut);
    let s = steps(&sim);
    for i in 0..peers {
        assert_eq!(sim.center_of(i), Some(0), "peer {i}'s center, steps {s:?}");
    }
    for i in 1..peers {
        assert!(
            sim.stats(i).state_syncs >= 1,
            "peer {i} never took over the center's state: {:?}",
            sim.stats(i)
        );
    }
    let behind = s.iter().max().unwrap() - s.iter().min().unwrap();
    assert!(behind <= 32, "the run is on two clocks: {s:?}");
    let all = sim.consensus_distance();
    assert!(all < 2e-2, "the swarm split: {all:e}, steps {s:?}");
}

/// The start-up race of the main job as it was seen split two against two (decision 0033, third
/// amendment): the first peer trains alone; of the three that start together, one hears it
/// first and takes over its state, and two hear only each other and join on each other. Each
/// pair mixed in step, and by the median clock each takes the other for the run. The two behind
/// are young members, and take over the run's state. Before: the pairs ended about 190 steps
/// apart at a consensus distance of 0.18 (each pair within 1.4e-3).
#[test]
fn newcomers_split_two_against_two_at_the_start_end_as_one_model() {
    let mut sim = first_peer_alone(SimConfig::gossip(4));
    let cut = [(1, 0), (1, 3), (2, 0), (2, 3)];
    the_rest_start_cut_off(&mut sim, &cut);
    let s = steps(&sim);
    let all = sim.consensus_distance();
    let pairs = (
        sim.consensus_distance_of(&[0, 3]),
        sim.consensus_distance_of(&[1, 2]),
    );
    let stats: Vec<_> = (0..4).map(|i| sim.stats(i)).collect();
    assert!(
        all < 1e-2,
        "the swarm split: {all:e} (pairs {pairs:?}), steps {s:?}, {stats:#?}"
    );
    let behind = s.iter().max().unwrap() - s.iter().min().unwrap();
    assert!(behind <= 32, "the run is on two clocks: {s:?}");
}
