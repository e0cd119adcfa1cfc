//! The replica's rules as tables: what it is told, and what it says to do.

use std::time::{Duration, Instant};

use super::*;
use crate::copies::Copies;

fn gossip() -> LoopSettings {
    LoopSettings {
        mode: SyncMode::Gossip,
        overlap: false,
        max_merge_lag: 4,
        interval: 2,
        adapt_interval: false,
        max_staleness: Some(8),
        ring: false,
        averages_gradients: false,
        outer: None,
    }
}

fn overlapping() -> LoopSettings {
    LoopSettings {
        overlap: true,
        ..gossip()
    }
}

fn nesterov() -> LoopSettings {
    LoopSettings {
        outer: Some(Outer::Nesterov {
            lr: 1.0,
            momentum: 0.5,
        }),
        ..overlapping()
    }
}

fn ring(every: u64, outer: Option<Outer>) -> LoopSettings {
    LoopSettings {
        mode: SyncMode::Allreduce,
        interval: every,
        max_staleness: None,
        ring: true,
        averages_gradients: every == 1,
        outer,
        ..gossip()
    }
}

fn rules(settings: LoopSettings) -> ReplicaLoop {
    ReplicaLoop::new(settings, 0, || Ok::<_, std::convert::Infallible>(vec![0.0])).unwrap()
}

fn at(step: u64) -> Clock {
    Clock {
        step,
        finished: false,
    }
}

/// What the rules say at `step`, alone (no peer for the gate to wait for).
fn next(rules: &mut ReplicaLoop, step: u64) -> Next {
    rules.next(at(step), Instant::now(), Vec::new).next
}

fn waits_for(why: WaitFor) -> Next {
    Next::Wait(Wait {
        why,
        on_peers: false,
        until: None,
    })
}

/// Steps `from..=to` with peers to mix with, saying after each whether a snapshot is to be
/// handed over.
fn step_through(rules: &mut ReplicaLoop, steps: std::ops::RangeInclusive<u64>) -> Vec<(u64, bool)> {
    step_through_alone(rules, steps, false)
}

/// Steps `from..=to`, the peer table holding no partner when `alone`.
fn step_through_alone(
    rules: &mut ReplicaLoop,
    steps: std::ops::RangeInclusive<u64>,
    alone: bool,
) -> Vec<(u64, bool)> {
    steps
        .map(|step| {
            let after = rules.stepped(step, Duration::from_millis(5), || alone);
            (step, after.hand_over)
        })
        .collect()
}

/// A push-pull mix toward `other` of the snapshot `base`.
fn mix(base: &[f32], other: &[f32]) -> ExchangeEnd {
    ExchangeEnd::Mix {
        delta: Delta::Values(other.iter().zip(base).map(|(o, b)| o - b).collect()),
        weight: 0.5,
    }
}

fn add(delta: &[f32], mixed_over: Option<u64>) -> Landing {
    Landing::Add {
        delta: delta.to_vec(),
        mixed_over,
    }
}

#[test]
fn a_snapshot_falls_due_every_interval_and_holds_training_until_its_mix_lands() {
    let mut r = rules(gossip());
    assert_eq!(next(&mut r, 0), Next::Step);
    assert_eq!(step_through(&mut r, 1..=2), [(1, false), (2, true)]);
    let id = r.handed_over(2, &[1.0]);
    // Without overlap the mix lands at the step it was taken for (decision 0008).
    assert_eq!(next(&mut r, 2), waits_for(WaitFor::Exchanges));
    let landed = r.ended(id, Some(mix(&[1.0], &[3.0])), 2);
    assert_eq!(landed.landings, [add(&[1.0], Some(2))]);
    assert_eq!(landed.lag, Some(0));
    assert_eq!(next(&mut r, 2), Next::Step);
    assert_eq!(step_through(&mut r, 3..=4), [(3, false), (4, true)]);
}

#[test]
fn with_overlap_training_goes_on_and_a_mix_lands_by_the_delta_rule() {
    let mut r = rules(overlapping());
    step_through(&mut r, 1..=2);
    let id = r.handed_over(2, &[1.0]);
    for step in 2..=5 {
        assert_eq!(next(&mut r, step), Next::Step, "step {step}");
    }
    // The mix is computed from the snapshot alone, and lands three steps late.
    let landed = r.ended(id, Some(mix(&[1.0], &[3.0])), 5);
    assert_eq!(landed.landings, [add(&[1.0], Some(2))]);
    assert_eq!(landed.lag, Some(3));
}

/// Pair copies held for a consensus step, which tell when they are let go: `_alive` counts
/// one more holder of its token while they are held.
#[derive(Debug)]
struct Held {
    copies: Copies,
    _alive: std::sync::Arc<()>,
}

impl HoldsCopies for Held {
    fn copies(&self) -> &Copies {
        &self.copies
    }
}

/// A compressed exchange's mix is read off the pair's copies only as it lands (decision
/// 0092), a run at a time (decision 0094), and lets them go once it has.
#[test]
fn a_compressed_mix_lands_as_its_step_read_off_the_copies_then_lets_them_go() {
    let mut r = rules(overlapping());
    step_through(&mut r, 1..=2);
    let id = r.handed_over(2, &[1.0, 2.0]);
    let copies = Copies::holding(1, &[1.0, 2.0], &[3.0, 0.5]);
    let (own, theirs) = (copies.own().to_vec(), copies.theirs().to_vec());
    let token = std::sync::Arc::new(());
    let step = ConsensusStep {
        scale: 0.5,
        excess: None,
        shrink: None,
    };
    let end = ExchangeEnd::Mix {
        delta: Delta::Step { step, copies: None },
        weight: 0.5,
    }
    .holding(Some(Held {
        copies,
        _alive: std::sync::Arc::clone(&token),
    }));
    assert_eq!(
        std::sync::Arc::strong_count(&token),
        2,
        "held until it lands"
    );
    let mut landed = r.ended(id, Some(end), 3);
    assert_eq!(landed.lag, Some(1));
    let Some(Landing::AddStep(landing)) = landed.landings.pop() else {
        panic!("a compressed mix lands a run at a time (decision 0094): {landed:?}")
    };
    assert!(landed.landings.is_empty());
    assert_eq!(landing.mixed_over, Some(2));
    let moved: Vec<f32> = (0..2).map(|i| 0.5 * (theirs[i] - own[i]) * 0.5).collect();
    assert_eq!(landing.values(), moved);
    let mut runs = Vec::new();
    landing.runs(|at, run| runs.push((at, run.to_vec())));
    assert_eq!(runs, [(0, moved)]);
    let holders = std::sync::Arc::strong_count(&token);
    assert_eq!(holders, 2, "held until added");
    drop(landing);
    let holders = std::sync::Arc::strong_count(&token);
    assert_eq!(holders, 1, "let go once added");
}

#[test]
fn a_mix_lands_at_most_max_merge_lag_steps_after_its_snapshot() {
    let mut r = rules(overlapping());
    step_through(&mut r, 1..=2);
    r.handed_over(2, &[1.0]);
    let table = [
        (3, Next::Step),
        (5, Next::Step),
        (6, waits_for(WaitFor::Exchanges)),
    ];
    for (step, expected) in table {
        assert_eq!(next(&mut r, step), expected, "step {step}");
    }
}

/// On a link slower than `interval` steps of compute, the interval stretches to the link's
/// pace (decision 0021): a snapshot due while the last one is in flight waits for it.
#[test]
fn a_snapshot_due_while_the_last_is_in_flight_waits_for_its_end() {
    let mut r = rules(overlapping());
    step_through(&mut r, 1..=2);
    let id = r.handed_over(2, &[1.0]);
    assert_eq!(step_through(&mut r, 3..=4), [(3, false), (4, false)]);
    r.ended(id, None, 4);
    assert_eq!(step_through(&mut r, 5..=6), [(5, true), (6, true)]);
}

#[test]
fn an_answered_exchange_holds_training_unless_the_partner_is_slow() {
    let mut r = rules(gossip());
    let id = r.answered(3, &[1.0], false);
    assert_eq!(next(&mut r, 3), waits_for(WaitFor::Exchanges));
    r.ended(id, None, 3);
    assert_eq!(next(&mut r, 3), Next::Step);
    // A partner on a slow link is answered while training goes on (decision 0029).
    let slow = r.answered(3, &[1.0], true);
    assert_eq!(next(&mut r, 3), Next::Step);
    assert!(!r.held());
    assert_eq!(r.ended(slow, None, 4), Landed::default());
}

#[test]
fn the_gate_waits_for_the_slowest_coupled_peer_and_for_changes_of_the_peer_table() {
    let mut r = rules(gossip());
    let peer = PeerId::random();
    let now = Instant::now();
    // (own step, the peer's clock, what the rules say, the lead of the step)
    let table = [
        (5, 1, Next::Step, Some(5)),
        (
            10,
            1,
            Next::Wait(Wait {
                why: WaitFor::Gate,
                on_peers: true,
                until: Some(now + GATE_PATIENCE),
            }),
            None,
        ),
        (10, 3, Next::Step, Some(8)),
    ];
    for (step, theirs, expected, lead) in table {
        let decision = r.next(at(step), now, || vec![(peer, theirs)]);
        assert_eq!(
            decision.next, expected,
            "at {step} with the peer at {theirs}"
        );
        assert_eq!(decision.lead, lead, "at {step} with the peer at {theirs}");
    }
}

/// No clock can hold the gate shut for longer than its patience (decision 0039).
#[test]
fn a_peer_that_holds_the_gate_past_its_patience_is_no_longer_waited_for() {
    let mut r = rules(gossip());
    let peer = PeerId::random();
    let start = Instant::now();
    let candidates = || vec![(peer, 1)];
    assert_eq!(r.next(at(5), start, candidates).next, Next::Step);
    let closed = r.next(at(10), start, candidates);
    assert!(matches!(
        closed.next,
        Next::Wait(Wait {
            why: WaitFor::Gate,
            ..
        })
    ));
    let later = start + GATE_PATIENCE + Duration::from_secs(1);
    let decision = r.next(at(10), later, candidates);
    assert_eq!(decision.next, Next::Step);
    assert_eq!(decision.uncoupled, [(peer, 1)]);
}

#[test]
fn a_solo_replica_never_hands_over_nor_waits_at_the_gate() {
    let mut r = rules(LoopSettings {
        mode: SyncMode::Solo,
        ..gossip()
    });
    let peer = PeerId::random();
    let decision = r.next(at(100), Instant::now(), || vec![(peer, 0)]);
    assert_eq!(decision.next, Next::Step);
    assert!(step_through(&mut r, 1..=8).iter().all(|(_, due)| !due));
}

#[test]
fn a_gossip_replica_with_no_peer_lets_its_snapshots_pass() {
    let mut r = rules(gossip());
    let alone = step_through_alone(&mut r, 1..=4, true);
    assert_eq!(alone, [(1, false), (2, false), (3, false), (4, false)]);
    // Nothing was handed over: nothing holds the next step.
    assert_eq!(next(&mut r, 4), Next::Step);
    // Once a peer is there, the next due snapshot is handed over.
    assert_eq!(step_through(&mut r, 5..=6), [(5, false), (6, true)]);
}

#[test]
fn alone_an_elastic_replica_or_one_with_an_outer_step_still_hands_over() {
    // An elastic replica may hold the center itself; the outer step is taken at the snapshot.
    let elastic = LoopSettings {
        mode: SyncMode::Elastic,
        ..gossip()
    };
    for settings in [elastic, nesterov()] {
        let mut r = rules(settings.clone());
        let steps = step_through_alone(&mut r, 1..=2, true);
        assert_eq!(steps, [(1, false), (2, true)], "{settings:?}");
    }
}

#[test]
fn a_finished_replica_waits_to_answer_its_peers() {
    let mut r = rules(gossip());
    let finished = Clock {
        step: 40,
        finished: true,
    };
    let decision = r.next(finished, Instant::now(), Vec::new);
    assert_eq!(decision.next, waits_for(WaitFor::Finished));
}

/// With the outer step, a replica owes the outer move computed at its snapshot (decision
/// 0030); it lands when the exchange ends, with or without a mix, and the mix moves the
/// anchor, not the outer momentum.
#[test]
fn the_outer_step_is_owed_at_the_snapshot_and_lands_with_or_without_a_mix() {
    let mut r = rules(nesterov());
    // Progress 1 from the anchor 0: the anchor moves to 1.5, the replica at 1 owes 0.5.
    let id = r.handed_over(8, &[1.0]);
    let landed = r.ended(id, None, 8);
    assert_eq!(landed.landings, [add(&[0.5], None)]);
    assert_eq!(landed.lag, None);
    // The replica (at 1.5) progresses 1 again: v = -1.5, the anchor 1.5 + 1.75, so 0.75
    // owed; the owed move comes first, then the mix.
    let id = r.handed_over(16, &[2.5]);
    let landed = r.ended(id, Some(mix(&[2.5], &[4.5])), 17);
    assert_eq!(landed.landings, [add(&[0.75], None), add(&[1.0], Some(2))]);
    assert_eq!(landed.lag, Some(1));
}

/// A snapshot taken while an earlier exchange still owes its move steps from the point the
/// replica stands at once it is paid, and a state handed to a peer includes it.
#[test]
fn moves_still_owed_count_where_the_replica_stands() {
    let mut r = rules(nesterov());
    let first = r.handed_over(8, &[1.0]);
    let (params, outer) = r.state_of(vec![1.0]);
    assert_eq!(params, [1.5]);
    assert_eq!(outer.map(|o| o.anchor), Some(vec![1.5]));
    // Taken where the replica stands once the first move is paid (1.5): no progress, and
    // the momentum alone moves the anchor on by 0.25.
    let second = r.handed_over(10, &[1.0]);
    assert_eq!(r.ended(second, None, 10).landings, [add(&[0.25], None)]);
    assert_eq!(r.ended(first, None, 10).landings, [add(&[0.5], None)]);
}

#[test]
fn adopting_a_state_drops_the_moves_owed_to_the_state_left_behind() {
    let mut r = rules(nesterov());
    let id = r.handed_over(8, &[1.0]);
    r.adopted(20, &[7.0], None);
    assert_eq!(r.ended(id, None, 20), Landed::default());
    // The anchor starts again from the adopted parameters.
    let (_, outer) = r.state_of(vec![7.0]);
    assert_eq!(
        outer.map(|o| (o.anchor, o.anchor_step)),
        Some((vec![7.0], 20))
    );
}

#[test]
fn a_rings_average_is_continued_from_and_a_round_of_another_step_is_ignored() {
    let mut r = rules(ring(4, Some(Outer::Average)));
    assert_eq!(
        step_through(&mut r, 1..=4),
        [(1, false), (2, false), (3, false), (4, true)]
    );
    let id = r.handed_over(4, &[2.0]);
    assert!(r.held(), "ring rounds never overlap training");
    let round = |step| ExchangeEnd::Reduced {
        step,
        mean: vec![3.0],
    };
    assert_eq!(
        r.ended(id, Some(round(4)), 4).landings,
        [Landing::Set(vec![3.0])]
    );
    let stale = r.handed_over(8, &[3.0]);
    // This replica took over a peer's state at another step meanwhile.
    assert_eq!(r.ended(stale, Some(round(8)), 9), Landed::default());
}

#[test]
fn synchronous_rings_step_with_the_mean_of_the_gradients() {
    let mut r = rules(ring(1, None));
    assert_eq!(next(&mut r, 3), Next::SynchronousStep);
    let id = r.gradient_handed_over(3);
    let mean = vec![0.25];
    let landed = r.ended(
        id,
        Some(ExchangeEnd::Reduced {
            step: 3,
            mean: mean.clone(),
        }),
        3,
    );
    assert_eq!(landed, Landed::default());
    assert_eq!(r.take_mean_gradient(3), Some(mean));
    assert_eq!(r.take_mean_gradient(3), None);
    assert!(
        step_through(&mut r, 4..=6).iter().all(|(_, due)| !due),
        "gradients go over with the step, not as due snapshots"
    );
}

/// The rounds hold ring members in step; a member that left the rings (here at step 3, its
/// heartbeat not yet timed out) must not hold the others at a staleness gate (decision 0078).
#[test]
fn ring_members_are_not_held_at_the_gate_by_a_peer_out_of_the_rings() {
    for (every, expected) in [(1, Next::SynchronousStep), (4, Next::Step)] {
        let mut r = rules(LoopSettings {
            max_staleness: Some(8),
            ..ring(every, None)
        });
        let peer = PeerId::random();
        let now = Instant::now();
        // In step with the member at first (coupled, for a gate), then it stops at step 3.
        r.next(at(3), now, || vec![(peer, 3)]);
        let decision = r.next(at(100), now, || vec![(peer, 3)]);
        assert_eq!(decision.next, expected, "every = {every}");
        assert_eq!(decision.lead, None, "every = {every}");
    }
}

/// A replica that takes over a peer waiting on the round at the adopted step owes that round
/// before it trains on.
#[test]
fn a_replica_that_adopted_a_peer_waiting_on_a_round_owes_it_first() {
    let mut r = rules(ring(4, Some(Outer::Average)));
    let waiting = OuterState {
        anchor: vec![1.0],
        anchor_step: 8,
        velocity: Vec::new(),
    };
    r.adopted(12, &[2.0], Some(waiting));
    assert_eq!(next(&mut r, 12), Next::HandOver);
    let id = r.handed_over(12, &[2.0]);
    assert_eq!(next(&mut r, 12), waits_for(WaitFor::Exchanges));
    r.ended(id, None, 12);
    assert_eq!(next(&mut r, 12), Next::Step);
    // Gossip has no round to owe.
    let mut g = rules(nesterov());
    g.adopted(12, &[2.0], None);
    assert_eq!(next(&mut g, 12), Next::Step);
}
