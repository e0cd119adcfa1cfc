//! The policy's decisions as tables of inputs and the actions expected.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode};
use murmur_protocol::membership::ConnectionKind;
use murmur_protocol::ring::RingError;
use murmur_protocol::sync::elect_center;
use murmur_protocol::trust::TrustList;

use super::*;
use crate::settings::{ElasticSettings, Election, Mode, RingSettings};

mod budgets;
mod center;
mod far;

fn settings(mode: SyncMode) -> SyncSettings {
    SyncSettings::for_tests(mode)
}

fn ring_settings(trust: &[PeerId], min_peers: usize) -> SyncSettings {
    SyncSettings {
        interval: 1,
        trust: TrustList::new(trust.iter().copied()),
        mode: Mode::Allreduce(RingSettings {
            min_peers,
            ..RingSettings::for_tests()
        }),
        ..settings(SyncMode::Allreduce)
    }
}

/// A node under test: its policy, its peer table and its clock.
struct Node {
    me: PeerId,
    policy: Policy,
    table: PeerTable,
    t0: Instant,
    now: Instant,
    step: u64,
}

impl Node {
    fn new(sync: SyncSettings) -> Self {
        Node::with_id(PeerId::random(), sync)
    }

    fn with_id(me: PeerId, sync: SyncSettings) -> Self {
        let t0 = Instant::now();
        Node {
            me,
            policy: Policy::new(me, "run", sync, Timeouts::default(), t0),
            table: PeerTable::new(Duration::from_secs(10)),
            t0,
            now: t0,
            step: 0,
        }
    }

    /// The policy's pairwise side (the node runs a pairwise mode).
    fn pairs(&self) -> &PairwisePolicy {
        self.policy
            .pairwise
            .as_ref()
            .expect("the node runs a pairwise mode")
    }

    fn at(&mut self, ms: u64) -> &mut Self {
        self.now = self.t0 + Duration::from_millis(ms);
        self
    }

    /// A heartbeat from `peer` at `step` in `mode` with `role`, over a direct connection.
    fn heard(&mut self, peer: PeerId, step: u64, mode: SyncMode, role: Role) {
        self.heard_with(peer, step, mode, role, false);
    }

    /// [`Node::heard`] from a peer that runs as a `client` or not.
    fn heard_with(&mut self, peer: PeerId, step: u64, mode: SyncMode, role: Role, client: bool) {
        static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let heartbeat = Heartbeat {
            sent_ms: SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            version: HEARTBEAT_VERSION,
            run_id: "run".into(),
            fingerprint: "f".into(),
            step,
            epoch: 0,
            loss_ema: 1.0,
            samples_seen: 0,
            mode,
            role,
            leaving: false,
            finished: false,
            client,
        };
        self.table.members_mut().observe(peer, &heartbeat, self.now);
        self.table
            .set_connection(peer, Some(ConnectionKind::Direct));
    }

    /// The replica handed over its snapshot of `step`, its step time not measured yet.
    fn due(&mut self, step: u64) -> Vec<Action> {
        self.handle(Input::Due {
            step,
            step_secs: None,
        })
    }

    fn handle(&mut self, input: Input) -> Vec<Action> {
        let view = View {
            now: self.now,
            own_step: self.step,
            peers: &self.table,
        };
        self.policy.handle(input, &view)
    }

    /// Joins the run: alone with no peer to catch up with, a tick marks it joined.
    fn joined(mut self) -> Self {
        let peers: Vec<PeerId> = self.table.peers().map(|(p, _)| *p).collect();
        for peer in &peers {
            self.table.members_mut().remove(peer);
        }
        self.policy.joining = false;
        self.policy.role = Role::Worker;
        self
    }
}

/// `peer`'s offer of a snapshot at step 8.
fn offer(peer: PeerId) -> Input {
    Input::Request {
        peer,
        request: Request::Offer { step: 8 },
    }
}

/// The answer of the one `Serve` action in `actions`.
fn answered(actions: Vec<Action>) -> Answer {
    match actions.as_slice() {
        [Action::Serve { answer, .. }] => answer.clone(),
        other => panic!("{other:?}"),
    }
}

/// Answers `peer`'s offer at `from_ms` and ends the exchange mixed at `to_ms`: the actions
/// of its end.
fn answer_and_mix(node: &mut Node, peer: PeerId, from_ms: u64, to_ms: u64) -> Vec<Action> {
    node.at(from_ms);
    assert!(matches!(
        answered(node.handle(offer(peer))),
        Answer::Exchange { .. }
    ));
    node.at(to_ms);
    node.handle(Input::Served {
        peer,
        outcome: Outcome::Mixed {
            distance: 0.1,
            credited: 0.1,
        },
    })
}

/// A joined gossip node at step 8 that heard two partners at its step.
fn gossip_with_two_partners() -> (Node, PeerId, PeerId) {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let (a, b) = (PeerId::random(), PeerId::random());
    node.heard(a, 8, SyncMode::Gossip, Role::Worker);
    node.heard(b, 8, SyncMode::Gossip, Role::Worker);
    node.step = 8;
    (node, a, b)
}

fn offered_to(actions: &[Action]) -> Option<PeerId> {
    actions.iter().find_map(|a| match a {
        Action::Offer { peer, .. } => Some(*peer),
        _ => None,
    })
}

#[test]
fn a_due_snapshot_goes_to_a_free_partner_and_busy_ones_are_left_alone_briefly() {
    let (mut node, a, b) = gossip_with_two_partners();
    let first = offered_to(&node.due(8)).expect("an offer");
    let other = if first == a { b } else { a };
    // (input, expected) in order: the busy partner is left alone and the other tried; when
    // both are busy the policy waits until the first may be free, and then offers again.
    let busy = |peer| Input::Exchanged {
        peer,
        outcome: Outcome::Busy,
    };
    assert_eq!(offered_to(&node.handle(busy(first))), Some(other));
    assert!(node.handle(busy(other)).is_empty(), "both busy: wait");
    let wake = node.policy.next_wake().expect("a wake-up for the retry");
    assert_eq!(wake, node.now + Timeouts::default().busy_backoff);
    node.now = wake;
    assert!(offered_to(&node.handle(Input::Wake)).is_some());
    // A mix ends the turn; the next due snapshot is offered again.
    let Some(peer) = node.pairs().offering.partner() else {
        panic!("{:?}", node.pairs().offering);
    };
    let mixed = Outcome::Mixed {
        distance: 0.1,
        credited: 0.1,
    };
    assert!(
        node.handle(Input::Exchanged {
            peer,
            outcome: mixed
        })
        .is_empty()
    );
    assert!(!node.policy.has_due());
    assert_eq!(node.pairs().offering, Offering::Idle);
}

/// A snapshot that an exchange let go (a compressed offer the partner took, decision 0091) is
/// not offered again when that exchange ends without a mix: the trainer gets it back, and the
/// partner is left alone as after any decline. The next due snapshot is offered as usual.
#[test]
fn a_spent_snapshot_goes_back_to_the_trainer_rather_than_to_another_partner() {
    let (mut node, _, _) = gossip_with_two_partners();
    let first = offered_to(&node.due(8)).expect("an offer");
    assert!(node.handle(Input::SnapshotSpent).is_empty());
    let busy = Input::Exchanged {
        peer: first,
        outcome: Outcome::Busy,
    };
    assert_eq!(node.handle(busy), [Action::Release]);
    assert!(!node.policy.has_due());
    assert!(node.pairs().backoff.contains_key(&first));
    let second = offered_to(&node.due(16)).expect("an offer");
    assert_ne!(second, first, "the busy partner is left alone");
    assert!(node.handle(Input::SnapshotSpent).is_empty());
    let failed = Input::Exchanged {
        peer: second,
        outcome: Outcome::Failed(Failure::TimedOut),
    };
    assert_eq!(node.handle(failed), [Action::Release]);
}

/// A partner busy again and again is left alone twice as long each time, up to 16 times the
/// first back-off, and as briefly as at first once it has mixed. Only the first back-off holds
/// the due snapshot; a longer one sends it back to the trainer at once.
#[test]
fn a_partner_busy_again_and_again_is_asked_less_and_less_often() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let a = PeerId::random();
    node.heard(a, 8, SyncMode::Gossip, Role::Worker);
    let first = Timeouts::default().busy_backoff;
    let busy = || Input::Exchanged {
        peer: a,
        outcome: Outcome::Busy,
    };
    let due = |node: &mut Node| {
        node.step += 8;
        node.due(node.step)
    };
    // Busy once: the snapshot waits for the first back-off and asks again.
    assert_eq!(offered_to(&due(&mut node)), Some(a));
    assert!(node.handle(busy()).is_empty(), "busy once: wait");
    assert_eq!(node.policy.next_wake(), Some(node.now + first));
    node.now += first;
    assert_eq!(offered_to(&node.handle(Input::Wake)), Some(a));
    for doublings in [1, 2, 3, 4, 4] {
        assert_eq!(node.handle(busy()), [Action::Release], "{doublings}");
        // A snapshot that falls due while the partner is left alone for longer than the
        // first back-off goes back at once; at the end of its back-off it is asked again.
        let left_alone = first * (1 << doublings);
        assert_eq!(due(&mut node), [Action::Release], "{doublings}");
        node.now += left_alone - first - Duration::from_millis(1);
        assert_eq!(due(&mut node), [Action::Release], "{doublings}");
        node.now += first + Duration::from_millis(1);
        assert_eq!(offered_to(&due(&mut node)), Some(a), "{doublings}");
    }
    let mixed = Outcome::Mixed {
        distance: 0.1,
        credited: 0.1,
    };
    node.handle(Input::Exchanged {
        peer: a,
        outcome: mixed,
    });
    assert_eq!(offered_to(&due(&mut node)), Some(a));
    assert!(
        node.handle(busy()).is_empty(),
        "busy once after a mix: wait"
    );
    assert_eq!(node.policy.next_wake(), Some(node.now + first));
}

#[test]
fn a_lone_node_and_a_stale_partner_release_the_trainer() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    assert_eq!(node.due(8), [Action::Release]);
    let a = PeerId::random();
    node.heard(a, 8, SyncMode::Gossip, Role::Worker);
    assert_eq!(offered_to(&node.due(8)), Some(a));
    let stale = Input::Exchanged {
        peer: a,
        outcome: Outcome::Stale,
    };
    assert_eq!(node.handle(stale), [Action::Release]);
}

#[test]
fn a_failed_partner_is_left_alone_longer_and_partners_give_out() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let a = PeerId::random();
    node.heard(a, 8, SyncMode::Gossip, Role::Worker);
    assert_eq!(offered_to(&node.due(8)), Some(a));
    let failed = Input::Exchanged {
        peer: a,
        outcome: Outcome::Failed(Failure::TimedOut),
    };
    // The only partner failed: no one else to try, and no brief wait either.
    assert_eq!(node.handle(failed), [Action::Release]);
    assert_eq!(
        node.pairs().backoff.get(&a).copied(),
        Some(node.now + Timeouts::default().failure_backoff)
    );
}

#[test]
fn offers_are_answered_only_when_free_joined_and_pairwise() {
    let (a, b) = (PeerId::random(), PeerId::random());
    // Joining: busy.
    let mut joining = Node::new(settings(SyncMode::Gossip));
    assert_eq!(answered(joining.handle(offer(a))), Answer::Busy);
    // Joined and free: the exchange; a second offer meanwhile: busy.
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    assert!(matches!(
        answered(node.handle(offer(a))),
        Answer::Exchange { weight, .. } if weight == 0.5
    ));
    assert_eq!(answered(node.handle(offer(b))), Answer::Busy);
    // The exchange ends: free again; the due snapshot that came meanwhile found it busy.
    node.handle(Input::Served {
        peer: a,
        outcome: Outcome::Mixed {
            distance: 0.1,
            credited: 0.1,
        },
    });
    assert!(matches!(
        answered(node.handle(offer(b))),
        Answer::Exchange { .. }
    ));
    assert_eq!(node.due(8), [Action::Release]);
    // State requests are answered even while joining.
    assert_eq!(
        answered(joining.handle(Input::Request {
            peer: a,
            request: Request::State
        })),
        Answer::State
    );
    // Elastic centered mode answers offers busy.
    let mut elastic = Node::new(settings(SyncMode::Elastic)).joined();
    assert_eq!(answered(elastic.handle(offer(a))), Answer::Busy);
    // The pairwise side exists in the modes that exchange in pairs only.
    let elastic_gossip = SyncSettings {
        mode: Mode::Elastic(ElasticSettings {
            topology: crate::settings::ElasticTopology::Gossip,
            ..ElasticSettings::default()
        }),
        ..settings(SyncMode::Elastic)
    };
    for (sync, pairwise) in [
        (settings(SyncMode::Solo), false),
        (settings(SyncMode::Gossip), true),
        (settings(SyncMode::Elastic), false),
        (elastic_gossip, true),
        (ring_settings(&[a], 1), false),
    ] {
        let mode = format!("{:?}", sync.mode);
        assert_eq!(
            Node::new(sync).policy.pairwise.is_some(),
            pairwise,
            "{mode}"
        );
    }
}

/// Decision 0021: on a slow link every peer is nearly always offering, so an offering node
/// still answers one offer; crossing offers between two peers mix once (the smaller id
/// answers), and a served mix is the turn's mix of a due snapshot still without a partner.
#[test]
fn an_offering_node_answers_one_offer_and_crossing_offers_mix_once() {
    let me = PeerId::random();
    let (mut lower, mut higher) = (PeerId::random(), PeerId::random());
    while lower >= me || higher <= me {
        (lower, higher) = (PeerId::random(), PeerId::random());
    }
    let third = PeerId::random();
    let offering_to = |partner| {
        let mut node = Node::with_id(me, settings(SyncMode::Gossip)).joined();
        node.heard(partner, 8, SyncMode::Gossip, Role::Worker);
        node.step = 8;
        assert_eq!(offered_to(&node.due(8)), Some(partner));
        node
    };

    // Crossing with a smaller id: declined. Another peer's offer: answered beside the own
    // offer, but a second one is not.
    let mut node = offering_to(lower);
    assert_eq!(answered(node.handle(offer(lower))), Answer::Busy);
    assert!(matches!(
        answered(node.handle(offer(third))),
        Answer::Exchange { .. }
    ));
    assert_eq!(answered(node.handle(offer(higher))), Answer::Busy);
    // The own offer finds its partner busy: the exchange being answered is this turn's mix.
    let busy = |peer| Input::Exchanged {
        peer,
        outcome: Outcome::Busy,
    };
    assert_eq!(node.handle(busy(lower)), [Action::Release]);

    // Crossing with a larger id: answered.
    let mut node = offering_to(higher);
    assert!(matches!(
        answered(node.handle(offer(higher))),
        Answer::Exchange { .. }
    ));

    // Waiting for a busy partner when an answered exchange mixes: the turn is over.
    let mut node = offering_to(lower);
    assert!(
        node.handle(busy(lower)).is_empty(),
        "waits for the busy one"
    );
    assert!(matches!(
        answered(node.handle(offer(third))),
        Answer::Exchange { .. }
    ));
    assert_eq!(
        node.handle(Input::Served {
            peer: third,
            outcome: Outcome::Mixed {
                distance: 0.1,
                credited: 0.1,
            },
        }),
        [Action::Release]
    );
    assert!(!node.policy.has_due());
}

/// A request answered outside the pairwise slot (an elastic center mixing a worker's
/// parameters, a state sent) may end while the same peer's offer is answered in the slot: the
/// slot stays with that exchange until its own end.
#[test]
fn an_answer_outside_the_pairwise_slot_leaves_the_slot_to_its_exchange() {
    let (a, b) = (PeerId::random(), PeerId::random());
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    assert!(matches!(
        answered(node.handle(offer(a))),
        Answer::Exchange { .. }
    ));
    let mixed = Outcome::Mixed {
        distance: 0.1,
        credited: 0.1,
    };
    node.handle(Input::Answered {
        peer: a,
        outcome: mixed.clone(),
    });
    assert_eq!(
        answered(node.handle(offer(b))),
        Answer::Busy,
        "the slot is still a's exchange's"
    );
    node.handle(Input::Served {
        peer: a,
        outcome: mixed,
    });
    assert!(matches!(
        answered(node.handle(offer(b))),
        Answer::Exchange { .. }
    ));
}

#[test]
fn an_exchange_stalled_by_its_opener_is_an_offence_and_a_departed_partner_is_cancelled() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let a = PeerId::random();
    node.heard(a, 8, SyncMode::Gossip, Role::Worker);
    node.handle(Input::Request {
        peer: a,
        request: Request::Offer { step: 8 },
    });
    let stalled = node.handle(Input::Served {
        peer: a,
        outcome: Outcome::Failed(Failure::TimedOut),
    });
    assert_eq!(
        stalled,
        [Action::Offence {
            peer: a,
            rejection: Rejection::Stalled
        }]
    );
    // An offer in flight to a peer that then times out of the table is given up.
    node.step = 8;
    assert_eq!(offered_to(&node.due(8)), Some(a));
    node.table.members_mut().remove(&a);
    assert_eq!(
        node.handle(Input::PeersChanged),
        [Action::Cancel { peer: a }]
    );
}

#[test]
fn a_joiner_far_behind_takes_over_the_median_state_and_one_close_joins_at_once() {
    const LIAR: u64 = 1_000_000_000;
    // (own step, peers' steps, expected first action)
    let table: [(u64, &[u64], &str); 7] = [
        (0, &[], "stay"),                      // alone: nothing to catch up with yet
        (0, &[10, 12], "join"),                // within the bound of 16
        (0, &[10, 400], "pull 400"),           // of two, the later is the source
        (500, &[400, 410], "join"),            // ahead of everyone
        (0, &[300, 400, 420], "pull 400"),     // the median clock's peer
        (0, &[10, 12, LIAR], "join"),          // one clock far ahead is not believed...
        (0, &[300, 400, LIAR, 2], "pull 400"), // ... nor the source of a state sync
    ];
    for (own, steps, expected) in table {
        let mut node = Node::new(settings(SyncMode::Gossip));
        node.step = own;
        let peers: Vec<PeerId> = steps.iter().map(|_| PeerId::random()).collect();
        for (peer, step) in peers.iter().zip(steps) {
            node.heard(*peer, *step, SyncMode::Gossip, Role::Worker);
        }
        let actions = node.handle(Input::Tick);
        let got = match actions.first() {
            None => "stay".to_owned(),
            Some(Action::Publish(view)) if view.role == Role::Worker => "join".to_owned(),
            Some(Action::PullState { peer, .. }) => {
                let i = peers.iter().position(|p| p == peer).unwrap();
                format!("pull {}", steps[i])
            }
            Some(other) => format!("{other:?}"),
        };
        assert_eq!(got, expected, "own {own}, peers {steps:?}");
    }
}

/// Any peer can claim the center's role in its heartbeats: a joiner takes over the state of
/// the center it elected itself, and never that of a claimant.
#[test]
fn a_joiner_takes_over_the_elected_center_only() {
    let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let live: Vec<(PeerId, Vec<u8>)> = peers.iter().map(|p| (*p, p.to_bytes())).collect();
    let elected = elect_center(&live, "run", None).unwrap();
    let claimant = *peers.iter().find(|&&p| p != elected).unwrap();
    let other = *peers
        .iter()
        .find(|&&p| p != elected && p != claimant)
        .unwrap();

    let mut node = Node::new(settings(SyncMode::Elastic));
    node.heard(elected, 20, SyncMode::Elastic, Role::Center);
    node.heard(claimant, 1_000_000, SyncMode::Elastic, Role::Center);
    node.heard(other, 30, SyncMode::Elastic, Role::Worker);
    let actions = node.handle(Input::Tick);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::PullState { peer, .. } if *peer == elected)),
        "{actions:?}"
    );

    // A claimant that is not elected is no source even as the only center heard.
    let mut node = Node::new(settings(SyncMode::Elastic));
    node.heard(elected, 20, SyncMode::Elastic, Role::Worker);
    node.heard(claimant, 1_000_000, SyncMode::Elastic, Role::Center);
    node.heard(other, 30, SyncMode::Elastic, Role::Worker);
    let actions = node.handle(Input::Tick);
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, Action::PullState { peer, .. } if *peer == claimant)),
        "{actions:?}"
    );
}

#[test]
fn a_ring_member_takes_over_the_state_of_trusted_peers_only() {
    let (me, trusted) = (PeerId::random(), PeerId::random());
    let strangers = [PeerId::random(), PeerId::random()];
    let mut node = Node::with_id(me, ring_settings(&[me, trusted], 2));
    node.heard(trusted, 100, SyncMode::Allreduce, Role::Worker);
    for (stranger, step) in strangers.iter().zip([5_000, 9_000]) {
        node.heard(*stranger, step, SyncMode::Allreduce, Role::Worker);
    }
    let actions = node.due(0);
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::PullState { peer, .. } if *peer == trusted)),
        "{actions:?}"
    );
}

#[test]
fn a_state_sync_ends_joining_and_a_failed_one_is_retried_at_the_next_tick() {
    let mut node = Node::new(settings(SyncMode::Gossip));
    let a = PeerId::random();
    node.heard(a, 1000, SyncMode::Gossip, Role::Worker);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: a,
            announced: 1000
        }]
    );
    // While it runs, neither ticks nor joins start another.
    assert!(node.handle(Input::Tick).is_empty());
    let failed = Input::StateSynced {
        peer: a,
        result: Err(Outcome::Failed(Failure::TimedOut)),
    };
    assert!(node.handle(failed).is_empty());
    assert!(node.policy.is_joining());
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: a,
            announced: 1000
        }]
    );
    node.step = 1000;
    let done = node.handle(Input::StateSynced {
        peer: a,
        result: Ok(Adopted {
            from: 0,
            step: 1000,
        }),
    });
    assert!(matches!(done.as_slice(), [Action::Publish(view)] if view.role == Role::Worker));
    assert!(!node.policy.is_joining());
}

/// Peers are heard one by one: a node joins on hearing one as new as itself and hears the one
/// far ahead a moment later. Until its first mix it catches up by state sync, as a joiner
/// would; once it has mixed, it mixes its way.
#[test]
fn a_member_that_has_not_mixed_yet_takes_over_a_state_far_ahead_and_one_that_has_mixes() {
    let (near, far) = (PeerId::random(), PeerId::random());
    let mut node = Node::new(settings(SyncMode::Gossip));
    node.step = 1;
    node.heard(near, 8, SyncMode::Gossip, Role::Worker);
    let joined = node.handle(Input::Tick);
    assert!(matches!(joined.as_slice(), [Action::Publish(view)] if view.role == Role::Worker));
    node.at(5);
    node.heard(far, 84, SyncMode::Gossip, Role::Worker);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: far,
            announced: 84
        }]
    );
    assert!(
        node.handle(Input::Tick).is_empty(),
        "one state sync at a time"
    );
    node.step = 84;
    let synced = node.handle(Input::StateSynced {
        peer: far,
        result: Ok(Adopted { from: 1, step: 84 }),
    });
    assert!(synced.is_empty(), "already a member: {synced:?}");

    // A catch-up that fails after a mix landed meanwhile is tried again: the member is still
    // far behind (one that stopped trying trained alone and ended 4.4 pp low).
    let mut retrying = Node::new(settings(SyncMode::Gossip)).joined();
    retrying.step = 1;
    retrying.heard(near, 8, SyncMode::Gossip, Role::Worker);
    retrying.heard(far, 84, SyncMode::Gossip, Role::Worker);
    let pull = Action::PullState {
        peer: far,
        announced: 84,
    };
    assert_eq!(retrying.handle(Input::Tick), std::slice::from_ref(&pull));
    answer_and_mix(&mut retrying, near, 0, 10);
    let failed = retrying.handle(Input::StateSynced {
        peer: far,
        result: Err(Outcome::Failed(Failure::TimedOut)),
    });
    assert!(failed.is_empty(), "{failed:?}");
    retrying.at(20);
    assert_eq!(retrying.handle(Input::Tick), [pull]);

    let mut mixed = Node::new(settings(SyncMode::Gossip)).joined();
    mixed.step = 1;
    mixed.heard(near, 8, SyncMode::Gossip, Role::Worker);
    answer_and_mix(&mut mixed, near, 0, 10);
    mixed.at(20);
    mixed.heard(far, 84, SyncMode::Gossip, Role::Worker);
    let actions = mixed.handle(Input::Tick);
    assert!(
        !actions
            .iter()
            .any(|a| matches!(a, Action::PullState { .. })),
        "{actions:?}"
    );
}

/// Decision 0033, amended: a member that joined on a peer as new as itself may mix with one far
/// ahead before it could catch up (an exchange was under way when it heard that one). Such a
/// mix is no first mix: the member is as far behind, and takes over a state still.
#[test]
fn a_mix_with_a_peer_far_ahead_does_not_end_a_members_catch_up() {
    let (near, far) = (PeerId::random(), PeerId::random());
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    node.step = 1;
    node.heard(near, 8, SyncMode::Gossip, Role::Worker);
    node.heard(far, 84, SyncMode::Gossip, Role::Worker);
    answer_and_mix(&mut node, far, 0, 10);
    node.at(20);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: far,
            announced: 84
        }]
    );
}

/// Decision 0033, amended: right after a state sync a member is about as far behind as the run
/// moved on while the state crossed, and mixes its way from there; a member further behind
/// took over the state of a peer that had not caught up with the run itself, and takes over
/// a state again. In a run of the main job that went the second way (a joiner took over a
/// young peer's state at step 29, making 23 steps of its own meanwhile, with the run at 148),
/// the joiner trained alone to the end and finished 2.8 pp below the others.
#[test]
fn a_member_behind_the_run_after_a_state_sync_pulls_again_but_not_for_the_transfers_lag() {
    let bound = settings(SyncMode::Gossip).max_staleness.unwrap();

    // A peer as young as this node: 8 steps of its own while the state crossed allow 16.
    let (young, run) = (PeerId::random(), PeerId::random());
    let mut node = Node::new(settings(SyncMode::Gossip));
    node.step = 2;
    node.heard(young, 28, SyncMode::Gossip, Role::Worker);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: young,
            announced: 28,
        }]
    );
    node.heard(run, 148, SyncMode::Gossip, Role::Worker);
    node.step = 29;
    let joined = node.handle(Input::StateSynced {
        peer: young,
        result: Ok(Adopted { from: 10, step: 29 }),
    });
    assert!(matches!(joined.as_slice(), [Action::Publish(view)] if view.role == Role::Worker));
    assert!(148 > 29 + bound + 16);
    answer_and_mix(&mut node, run, 40, 50);
    node.at(60);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: run,
            announced: 148
        }]
    );

    // The run's own state, 100 steps on when it arrived, 60 steps of this node's meanwhile
    // allow 120: in step, and its mix counts.
    let source = PeerId::random();
    let mut late = Node::new(settings(SyncMode::Gossip));
    late.heard(source, 2_000, SyncMode::Gossip, Role::Worker);
    assert_eq!(
        late.handle(Input::Tick),
        [Action::PullState {
            peer: source,
            announced: 2_000
        }]
    );
    late.heard(source, 2_100, SyncMode::Gossip, Role::Worker);
    late.step = 2_000;
    late.handle(Input::StateSynced {
        peer: source,
        result: Ok(Adopted {
            from: 60,
            step: 2_000,
        }),
    });
    assert!(2_100 > 2_000 + bound);
    answer_and_mix(&mut late, source, 500, 510);
    late.heard(source, 2_400, SyncMode::Gossip, Role::Worker);
    late.at(520);
    assert!(
        late.handle(Input::Tick).is_empty(),
        "a member that mixed in step mixes its way"
    );
}

#[test]
fn every_peer_elects_the_same_center_and_only_its_holder_answers_workers() {
    let ids: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
    let mut nodes: Vec<Node> = ids
        .iter()
        .map(|id| Node::with_id(*id, settings(SyncMode::Elastic)).joined())
        .collect();
    for node in &mut nodes {
        for id in &ids {
            if *id != node.me {
                node.heard(*id, 0, SyncMode::Elastic, Role::Worker);
            }
        }
        node.handle(Input::Tick);
    }
    let centers: Vec<_> = nodes.iter().map(|n| n.policy.view().center).collect();
    assert!(
        centers.iter().all(|c| *c == centers[0] && c.is_some()),
        "{centers:?}"
    );
    let center = centers[0].unwrap();
    let holder = nodes.iter_mut().find(|n| n.me == center).unwrap();
    assert!(
        holder.policy.center.as_ref().is_some_and(|c| c.seeding),
        "the elected one seeds its center"
    );
    assert_eq!(
        holder.handle(Input::CenterSeeded { ok: true }),
        [Action::Publish(EngineView {
            role: Role::Center,
            center: Some(center),
            center_version: 1
        })]
    );
    let worker = ids.iter().find(|id| **id != center).copied().unwrap();
    let request = Input::Request {
        peer: worker,
        request: Request::Params { step: 0 },
    };
    assert!(matches!(
        holder.handle(request).as_slice(),
        [Action::Serve {
            answer: Answer::Center { .. },
            ..
        }]
    ));
    // A worker sends its due snapshot to the center.
    let worker = nodes.iter_mut().find(|n| n.me != center).unwrap();
    assert!(matches!(
        worker.due(4).as_slice(),
        [Action::AskCenter { peer, .. }] if *peer == center
    ));
}

#[test]
fn a_peer_reached_only_through_a_relay_is_no_partner_unless_the_run_allows_it() {
    for relayed_exchanges in [false, true] {
        let sync = SyncSettings {
            relayed_exchanges,
            ..settings(SyncMode::Gossip)
        };
        let mut node = Node::new(sync).joined();
        let (direct, relayed, unconnected) = (PeerId::random(), PeerId::random(), PeerId::random());
        for peer in [direct, relayed, unconnected] {
            node.heard(peer, 8, SyncMode::Gossip, Role::Worker);
        }
        node.table
            .set_connection(relayed, Some(ConnectionKind::Relayed));
        // Heard of through others' gossip only: a stream would dial it, perhaps by a relay.
        node.table.set_connection(unconnected, None);
        node.step = 8;
        // Every partner answers busy in turn, until none is left to offer to.
        let mut offered = BTreeSet::new();
        let mut next = offered_to(&node.due(8));
        while let Some(peer) = next {
            assert!(offered.insert(peer), "offered to {peer} twice");
            next = offered_to(&node.handle(Input::Exchanged {
                peer,
                outcome: Outcome::Busy,
            }));
        }
        let expected: BTreeSet<PeerId> = if relayed_exchanges {
            [direct, relayed].into()
        } else {
            [direct].into()
        };
        assert_eq!(offered, expected, "relayed_exchanges = {relayed_exchanges}");
    }
}

#[test]
fn a_client_is_never_elected_center_not_even_by_itself() {
    let ids: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
    let live: Vec<(PeerId, Vec<u8>)> = ids.iter().map(|p| (*p, p.to_bytes())).collect();
    let winner = elect_center(&live, "run", None).unwrap();
    let centers: Vec<Option<PeerId>> = ids
        .iter()
        .map(|&me| {
            let mut node = Node::with_id(me, settings(SyncMode::Elastic)).joined();
            // The one the election would name runs as a client.
            node.table.set_client(me == winner);
            for &peer in ids.iter().filter(|&&p| p != me) {
                node.heard_with(peer, 0, SyncMode::Elastic, Role::Worker, peer == winner);
            }
            node.handle(Input::Tick);
            node.policy.view().center
        })
        .collect();
    assert!(
        centers
            .iter()
            .all(|c| c.is_some() && *c == centers[0] && *c != Some(winner)),
        "the client won {winner}: {centers:?}"
    );
}

#[test]
fn a_client_is_let_into_no_ring_and_forms_none() {
    let (me, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
    let mut node = Node::with_id(me, ring_settings(&[me, a, b], 1)).joined();
    node.heard(a, 0, SyncMode::Allreduce, Role::Worker);
    node.heard_with(b, 0, SyncMode::Allreduce, Role::Worker, true);
    let members = node.policy.ring_members(&View {
        now: node.now,
        own_step: 0,
        peers: &node.table,
    });
    assert_eq!(members.len(), 2);
    assert!(members.rank_of(&b).is_none(), "the client is in the ring");

    node.table.set_client(true);
    let alone = node.policy.ring_members(&View {
        now: node.now,
        own_step: 0,
        peers: &node.table,
    });
    assert_eq!(alone.len(), 1, "a client forms a ring with others");
}

#[test]
fn the_first_round_waits_for_min_peers_and_later_ones_go_on_with_whoever_is_live() {
    let (me, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
    let mut node = Node::with_id(me, ring_settings(&[me, a, b], 3)).joined();
    node.heard(a, 0, SyncMode::Allreduce, Role::Worker);
    assert!(node.due(0).is_empty(), "2 of 3");
    node.heard(b, 0, SyncMode::Allreduce, Role::Worker);
    let round = node.handle(Input::PeersChanged);
    assert!(
        matches!(round.as_slice(), [Action::Round { round: 0, members, .. }] if members.len() == 3)
    );
    assert!(
        node.handle(Input::RoundEnded {
            round: 0,
            result: Ok(())
        })
        .is_empty()
    );
    // b is gone: the next round goes on without it.
    node.table.members_mut().remove(&b);
    node.step = 1;
    let round = node.due(1);
    assert!(
        matches!(round.as_slice(), [Action::Round { round: 1, members, .. }] if members.len() == 2)
    );
}

#[test]
fn an_aborted_round_settles_and_leaves_silent_members_out_or_catches_up_on_one_ahead() {
    let (me, a, b) = (PeerId::random(), PeerId::random(), PeerId::random());
    let mut node = Node::with_id(me, ring_settings(&[me, a, b], 1)).joined();
    node.heard(a, 5, SyncMode::Allreduce, Role::Worker);
    node.heard(b, 5, SyncMode::Allreduce, Role::Worker);
    node.step = 5;
    assert!(matches!(node.due(5).as_slice(), [Action::Round { .. }]));
    node.at(100);
    let aborted = node.handle(Input::RoundEnded {
        round: 5,
        result: Err(RingError::Closed),
    });
    assert!(aborted.is_empty(), "settling: {aborted:?}");
    // a is heard from since the abort, b is not: at the settle deadline b is left out.
    node.at(600);
    node.heard(a, 5, SyncMode::Allreduce, Role::Worker);
    assert!(node.handle(Input::PeersChanged).is_empty());
    let deadline = node.policy.next_wake().unwrap();
    assert_eq!(
        deadline,
        node.t0 + Duration::from_millis(100) + Timeouts::default().ring_settle
    );
    node.now = deadline;
    let retry = node.handle(Input::Wake);
    assert!(
        matches!(retry.as_slice(), [Action::Round { members, .. }] if members.len() == 2),
        "{retry:?}"
    );
    // That attempt aborts too, and a has completed the round meanwhile: take over its state.
    node.heard(a, 6, SyncMode::Allreduce, Role::Worker);
    let caught = node.handle(Input::RoundEnded {
        round: 5,
        result: Err(RingError::Closed),
    });
    assert_eq!(
        caught,
        [Action::PullState {
            peer: a,
            announced: 6
        }]
    );
    node.step = 6;
    assert_eq!(
        node.handle(Input::StateSynced {
            peer: a,
            result: Ok(Adopted { from: 0, step: 6 })
        }),
        [Action::Release]
    );
}

#[test]
fn a_lone_ring_joiner_rounds_alone_after_the_grace_and_a_late_one_catches_up() {
    let me = PeerId::random();
    let mut node = Node::with_id(me, ring_settings(&[me], 1));
    assert!(node.due(0).is_empty(), "grace");
    let grace = node.policy.next_wake().unwrap();
    node.now = grace;
    let alone = node.handle(Input::Wake);
    assert!(
        matches!(alone.as_slice(), [Action::Publish(_), Action::Round { members, .. }] if members.len() == 1),
        "{alone:?}"
    );

    let a = PeerId::random();
    let mut late = Node::with_id(me, ring_settings(&[me, a], 1));
    late.heard(a, 300, SyncMode::Allreduce, Role::Worker);
    assert_eq!(
        late.due(0),
        [Action::PullState {
            peer: a,
            announced: 300
        }]
    );
}

#[test]
fn a_ring_offence_blames_the_left_neighbour_and_a_mismatch_blames_no_one() {
    let (me, a) = (PeerId::random(), PeerId::random());
    let mut node = Node::with_id(me, ring_settings(&[me, a], 1)).joined();
    node.heard(a, 3, SyncMode::Allreduce, Role::Worker);
    node.step = 3;
    node.due(3);
    let damaged = node.handle(Input::RoundEnded {
        round: 3,
        result: Err(RingError::Checksum {
            seq: 0,
            expected: 1,
            found: 2,
        }),
    });
    assert!(
        matches!(damaged.first(), Some(Action::Offence { peer, .. }) if *peer == a),
        "{damaged:?}"
    );
}

/// Decision 0025: with `sync.adapt_codec`, a partner whose exchanges through `sync.codec` take
/// more than twice the compute of an interval is offered top-k, but for a dense probe now and
/// then; a partner on a fast link keeps `sync.codec`.
#[test]
fn with_adapt_codec_a_partner_slower_than_the_compute_gets_top_k_but_for_probes() {
    use murmur_protocol::codec::Codec;
    let adapt = SyncSettings {
        codec: Codec::INT8,
        sparse_codec: Some(Codec::TOP_K),
        ..settings(SyncMode::Gossip)
    };
    // 64 turns: a due snapshot, an exchange of `dense_ms` (`sparse_ms` through top-k), then
    // 8 steps of 10 ms, so 80 ms of compute an interval, and `held_ms` at the staleness gate.
    // One partner, and a second one from turn 32 on (not measured: taken to be as fast as
    // the first).
    let codecs = |sync: &SyncSettings, dense_ms: u64, sparse_ms: u64, held_ms: u64| {
        let mut node = Node::new(sync.clone()).joined();
        let (first, second) = (PeerId::random(), PeerId::random());
        let (mut ms, mut codecs) = (0, Vec::new());
        for turn in 1..=64 {
            node.step = 8 * turn;
            node.at(ms)
                .heard(first, 8 * turn, SyncMode::Gossip, Role::Worker);
            if turn >= 32 {
                node.heard(second, 8 * turn, SyncMode::Gossip, Role::Worker);
            }
            let actions = node.handle(Input::Due {
                step: node.step,
                step_secs: Some(0.010),
            });
            let Some(&Action::Offer { peer, codec, .. }) = actions.first() else {
                panic!("turn {turn}: {actions:?}");
            };
            codecs.push(codec);
            ms += if codec == Codec::TOP_K {
                sparse_ms
            } else {
                dense_ms
            };
            let mixed = Outcome::Mixed {
                distance: 0.1,
                credited: 0.1,
            };
            node.at(ms);
            let ended = node.handle(Input::Exchanged {
                peer,
                outcome: mixed,
            });
            assert!(ended.is_empty(), "{ended:?}");
            ms += 80 + held_ms;
        }
        codecs
    };
    let sparse = |codecs: &[Codec]| codecs.iter().filter(|&&c| c == Codec::TOP_K).count();
    // 100 ms is under twice the compute (160 ms): int8 throughout.
    assert_eq!(sparse(&codecs(&adapt, 100, 50, 0)), 0);
    // 400 ms is over it: top-k once int8 was measured, with one probe in 16 (about 4 of 63;
    // over 8 nodes' draws, about 31).
    let mut probes = 0;
    for _ in 0..8 {
        let slow = codecs(&adapt, 400, 100, 0);
        assert_eq!(slow[0], Codec::INT8, "nothing measured yet");
        probes += slow.len() - 1 - sparse(&slow);
    }
    assert!(
        (10..=60).contains(&probes),
        "{probes} dense probes in 8 x 63 offers"
    );
    // Waits at the staleness gate are not compute: a node held there for 400 ms an interval
    // by a laggard still sees the slow link (taking the time between turns for compute, it
    // saw 480 ms an interval and sent int8 throughout).
    let held = codecs(&adapt, 400, 100, 400);
    assert!(sparse(&held) > 48, "{} of 64 through top-k", sparse(&held));
    // Without `adapt_codec`, a slow partner still gets `sync.codec`.
    let fixed = SyncSettings {
        sparse_codec: None,
        ..adapt
    };
    assert_eq!(sparse(&codecs(&fixed, 400, 100, 0)), 0);
}

/// Decision 0029: a partner whose exchanges take [`SLOW_PARTNER_FACTOR`] times the fastest
/// one's is published as on a slow link (once, when the set changes) and offered to now and
/// then only.
#[test]
fn a_partner_on_a_slow_link_is_published_and_rarely_offered_to() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let (fast, slow) = (PeerId::random(), PeerId::random());
    let (mut ms, mut published, mut slow_picks) = (0, Vec::new(), Vec::new());
    for turn in 1..=200 {
        node.step = 8 * turn;
        node.at(ms);
        node.heard(fast, 8 * turn, SyncMode::Gossip, Role::Worker);
        node.heard(slow, 8 * turn, SyncMode::Gossip, Role::Worker);
        let actions = node.due(node.step);
        let Some(&Action::Offer { peer, .. }) = actions.first() else {
            panic!("turn {turn}: {actions:?}");
        };
        if peer == slow {
            slow_picks.push(turn);
        }
        ms += if peer == slow { 500 } else { 50 };
        node.at(ms);
        let mixed = Outcome::Mixed {
            distance: 0.1,
            credited: 0.1,
        };
        for action in node.handle(Input::Exchanged {
            peer,
            outcome: mixed,
        }) {
            match action {
                Action::SlowLinks(peers) => published.push((turn, peers)),
                other => panic!("turn {turn}: {other:?}"),
            }
        }
        ms += 80;
    }
    // Published once both partners were measured: at the first exchange with the second of
    // them.
    let (at, peers) = published
        .first()
        .cloned()
        .expect("the slow link was published");
    assert_eq!(published.len(), 1, "{published:?}");
    assert_eq!(peers, BTreeSet::from([slow]));
    // Before that, picks are even; after it, about one in 128 (a pick in 64 is open to both).
    let later = slow_picks.iter().filter(|&&turn| turn > at).count();
    assert!(
        later <= 8,
        "{later} of {} offers went to the slow partner",
        200 - at
    );
}

/// Decision 0029: answering a partner's offers measures its link as offering to it does, so
/// a fast peer learns that a slow one is slow from the slow one's offers, without pausing for
/// an offer of its own to it.
#[test]
fn answered_exchanges_measure_the_link_too() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let (fast, slow) = (PeerId::random(), PeerId::random());
    node.heard(fast, 8, SyncMode::Gossip, Role::Worker);
    node.heard(slow, 8, SyncMode::Gossip, Role::Worker);
    assert_eq!(
        answer_and_mix(&mut node, fast, 0, 60),
        Vec::new(),
        "one link measured"
    );
    assert_eq!(
        answer_and_mix(&mut node, slow, 100, 700),
        vec![Action::SlowLinks(BTreeSet::from([slow]))]
    );
    // An exchange that did not mix measures nothing.
    node.at(800);
    answered(node.handle(offer(fast)));
    node.at(5_000);
    assert_eq!(
        node.handle(Input::Served {
            peer: fast,
            outcome: Outcome::Busy,
        }),
        Vec::new()
    );
    // Exchanges that fit behind the compute of an interval are no slow link.
    node.policy
        .pairwise
        .as_mut()
        .expect("a gossip node")
        .step_took(Some(1.0));
    assert_eq!(
        answer_and_mix(&mut node, fast, 6_000, 6_060),
        vec![Action::SlowLinks(BTreeSet::new())]
    );
}

/// Decision 0029: a partner's link counts with the quickest of its last [`LINK_SAMPLES`]
/// exchanges. One slow exchange (a busy machine, a checkpoint) does not make its link slow;
/// a link that is slow every time does.
#[test]
fn a_link_is_slow_only_when_its_recent_exchanges_all_were() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let (steady, spiky) = (PeerId::random(), PeerId::random());
    node.heard(steady, 8, SyncMode::Gossip, Role::Worker);
    node.heard(spiky, 8, SyncMode::Gossip, Role::Worker);
    let mut ms = 0;
    let mut answer = |node: &mut Node, peer, took_ms| {
        let actions = answer_and_mix(node, peer, ms, ms + took_ms);
        ms += took_ms + 10;
        actions
    };
    answer(&mut node, steady, 50);
    answer(&mut node, spiky, 50);
    let mut published = Vec::new();
    for turn in 1..=LINK_SAMPLES {
        answer(&mut node, steady, 50);
        for action in answer(&mut node, spiky, 1_000) {
            published.push((turn, action));
        }
    }
    // The 50 ms exchange left the window with the last of four slow ones.
    assert_eq!(
        published,
        vec![(LINK_SAMPLES, Action::SlowLinks(BTreeSet::from([spiky])))]
    );
}

/// Decision 0033, third amendment: the first node of a run trained alone; one newcomer took
/// over its state, two others joined on each other and mixed before they heard it. By the
/// median clock each pair takes the other for the run, and both mixed in step. A member that
/// joined within five heartbeat periods takes over the run's state though it mixed in step;
/// one that joined earlier keeps its clock (the lag of a slow link is the gate's business),
/// and a young member ahead of the median is not sent back.
#[test]
fn a_young_member_that_mixed_with_another_newcomer_takes_over_the_state_of_the_run_ahead() {
    let (twin, first, second) = (PeerId::random(), PeerId::random(), PeerId::random());
    let young = |hear_ms: u64| {
        let mut node = Node::new(settings(SyncMode::Gossip));
        node.step = 5;
        node.heard(twin, 8, SyncMode::Gossip, Role::Worker);
        let joined = node.handle(Input::Tick);
        assert!(matches!(joined.as_slice(), [Action::Publish(view)] if view.role == Role::Worker));
        answer_and_mix(&mut node, twin, 10, 20);
        node.at(hear_ms);
        node.heard(twin, 30, SyncMode::Gossip, Role::Worker);
        node.heard(first, 250, SyncMode::Gossip, Role::Worker);
        node.heard(second, 248, SyncMode::Gossip, Role::Worker);
        node.step = 28;
        node.handle(Input::PeersChanged)
    };
    assert_eq!(
        young(1_000),
        [Action::PullState {
            peer: second,
            announced: 248
        }],
        "the member at the median clock"
    );
    assert!(young(5_000).is_empty(), "a member for five periods");

    // The other side of the gap: a young member that mixed in step, ahead of the median.
    let mut ahead = Node::new(settings(SyncMode::Gossip));
    ahead.step = 250;
    ahead.heard(first, 248, SyncMode::Gossip, Role::Worker);
    ahead.handle(Input::Tick);
    answer_and_mix(&mut ahead, first, 10, 20);
    ahead.heard(twin, 8, SyncMode::Gossip, Role::Worker);
    ahead.heard(PeerId::random(), 10, SyncMode::Gossip, Role::Worker);
    for ms in [100, 3_000, 6_000] {
        ahead.at(ms);
        assert!(ahead.handle(Input::Tick).is_empty(), "at {ms} ms");
    }
}

/// Decision 0033, second amendment: the first node of a run trained alone, and the next ones
/// started together and joined on one another. By the median clock they are the run; the
/// first node, which never mixed with a peer in step, takes over their state once the gap has
/// lasted two heartbeat periods. Newcomers at a young clock for the length of a transfer (they
/// are taking over this node's own state), a single member, and peers still joining are not
/// the run; nor does a node that mixed in step give up its state for being ahead.
#[test]
fn a_member_that_never_mixed_in_step_far_ahead_of_the_run_takes_over_the_runs_state() {
    let (a, b, c) = (PeerId::random(), PeerId::random(), PeerId::random());
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    node.step = 300;
    node.heard(a, 20, SyncMode::Gossip, Role::Worker);
    node.heard(b, 30, SyncMode::Gossip, Role::Joining);
    assert!(node.handle(Input::Tick).is_empty(), "one member is no run");
    node.at(3_000);
    assert!(node.handle(Input::Tick).is_empty(), "one member is no run");

    // Two members far behind: the run, once the gap has lasted two heartbeat periods. A
    // mix with a peer far behind does not count as a mix in step.
    node.heard(b, 30, SyncMode::Gossip, Role::Worker);
    node.heard(c, 25, SyncMode::Gossip, Role::Worker);
    assert!(node.handle(Input::Tick).is_empty());
    answer_and_mix(&mut node, a, 3_100, 3_110);
    node.at(4_900);
    assert!(node.handle(Input::Tick).is_empty(), "within the grace");
    node.at(5_000);
    assert_eq!(
        node.handle(Input::Tick),
        [Action::PullState {
            peer: c,
            announced: 25
        }],
        "the member at the median clock"
    );

    // The same node, had its newcomers caught up within the grace: no pull.
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    node.step = 300;
    node.heard(a, 20, SyncMode::Gossip, Role::Worker);
    node.heard(b, 30, SyncMode::Gossip, Role::Worker);
    assert!(node.handle(Input::Tick).is_empty());
    node.at(1_000);
    node.heard(a, 290, SyncMode::Gossip, Role::Worker);
    node.heard(b, 295, SyncMode::Gossip, Role::Worker);
    assert!(node.handle(Input::Tick).is_empty());
    node.at(3_000);
    assert!(node.handle(Input::Tick).is_empty(), "the run caught up");

    // A node that mixed in step keeps its state however far the others fall behind.
    answer_and_mix(&mut node, a, 3_100, 3_110);
    node.heard(c, 30, SyncMode::Gossip, Role::Worker);
    node.heard(PeerId::random(), 30, SyncMode::Gossip, Role::Worker);
    node.heard(PeerId::random(), 30, SyncMode::Gossip, Role::Worker);
    for ms in [4_000, 6_000, 8_000] {
        node.at(ms);
        assert!(node.handle(Input::Tick).is_empty(), "at {ms} ms");
    }
}
