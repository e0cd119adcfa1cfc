//! The budgets a node answers peers within: state requests and exchanges.

use super::*;

/// A state request costs a few bytes and its answer the whole model: each peer gets a joiner's
/// tries per window, and all peers together a few joiners' worth.
#[test]
fn state_requests_are_answered_within_a_budget_per_peer_and_in_all() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let state = |node: &mut Node, peer: PeerId| {
        answered(node.handle(Input::Request {
            peer,
            request: Request::State,
        }))
    };
    let greedy = PeerId::random();
    for _ in 0..STATE_ANSWERS_PER_PEER {
        assert_eq!(state(&mut node, greedy), Answer::State);
    }
    assert_eq!(
        state(&mut node, greedy),
        Answer::Busy,
        "over the peer's budget"
    );
    let others: Vec<PeerId> = (0..STATE_ANSWERS).map(|_| PeerId::random()).collect();
    let answers: Vec<Answer> = others.iter().map(|p| state(&mut node, *p)).collect();
    let given = answers.iter().filter(|a| **a == Answer::State).count();
    assert_eq!(
        given,
        STATE_ANSWERS - STATE_ANSWERS_PER_PEER,
        "the budget of all"
    );
    // A window later, both budgets are there again.
    node.at(STATE_WINDOW.as_millis() as u64 + 1);
    assert_eq!(state(&mut node, greedy), Answer::State);
    assert_eq!(state(&mut node, others[STATE_ANSWERS - 1]), Answer::State);
}

/// Each answered exchange costs a replica both ways and a pause of training: a peer offering
/// back to back is answered up to its share of the window (three times an even share, and
/// never fewer than a few), while the others are answered as before.
#[test]
fn a_peer_offering_back_to_back_is_answered_its_share_and_the_others_theirs() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let greedy = PeerId::random();
    let others: Vec<PeerId> = (0..7).map(|_| PeerId::random()).collect();
    for peer in others.iter().chain([&greedy]) {
        node.heard(*peer, 8, SyncMode::Gossip, Role::Worker);
    }
    // Whether `peer`'s offer is answered (and, if so, the exchange is over).
    let offered = |node: &mut Node, peer: PeerId| {
        let answer = answered(node.handle(offer(peer)));
        if matches!(answer, Answer::Exchange { .. }) {
            node.handle(Input::Served {
                peer,
                outcome: Outcome::Mixed {
                    distance: 0.1,
                    credited: 0.1,
                },
            });
            true
        } else {
            assert_eq!(answer, Answer::Busy);
            false
        }
    };
    // Offers of the greedy peer at `ms` until one is refused (a few hundred at most); how many
    // were answered.
    let greedy_offers = |node: &mut Node, ms: u64| {
        (0..500)
            .take_while(|_| offered(node.at(ms), greedy))
            .count()
    };
    let mut ms = 0;
    let mut answered_greedy = greedy_offers(&mut node, ms);
    assert_eq!(
        answered_greedy, SHARE_FREE,
        "alone, a peer has the free answers"
    );
    // The others offer as honest gossip partners do, now and then: every one is answered,
    // and the share of the greedy peer grows with theirs, to three times an even share.
    for round in 0..8 {
        for peer in &others {
            ms += 10;
            assert!(
                offered(node.at(ms), *peer),
                "round {round}: an honest offer"
            );
        }
        answered_greedy += greedy_offers(&mut node, ms);
    }
    let honest = 8 * others.len();
    let share = (SHARE_FACTOR * (honest + answered_greedy)).div_ceil(8);
    assert_eq!(answered_greedy, share, "{honest} honest answers");
    // A window later the greedy peer starts over.
    node.at(ms + SHARE_WINDOW.as_millis() as u64);
    assert!(offered(&mut node, greedy));
}
