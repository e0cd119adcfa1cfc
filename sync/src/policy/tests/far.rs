//! Replicas that lie far from this one (decisions 0016, 0046): who drifted, and how long a
//! far peer is left alone.

use super::*;

/// (partners, outliers since the last accepted distance as peer indexes, rebased)
#[test]
fn a_replica_far_from_most_of_its_peers_rebases_and_one_far_peer_does_not() {
    let peers: Vec<PeerId> = (0..6).map(|_| PeerId::random()).collect();
    let table: [(usize, &[usize], bool); 6] = [
        (5, &[0], false),       // one peer far: it, not this replica
        (5, &[0, 0, 0], false), // the same peer again and again
        (5, &[0, 1], false),    // two of five
        (5, &[0, 1, 2], true),  // most of them
        (2, &[0, 1], true),     // both
        (1, &[0, 0], true),     // the only peer, twice
    ];
    let now = Instant::now();
    let limit_of = |judge: &Judge| judge.screen(now).limit;
    for (partners, outliers, rebased) in table {
        let mut judge = Judge::new(ClipRule::PAIRWISE);
        for _ in 0..8 {
            judge.accepted(peers[5], 0.1, 0.1, now);
        }
        let limit = limit_of(&judge);
        assert!((limit.unwrap() - 1.0).abs() < 1e-9, "{limit:?}");
        for (n, &i) in outliers.iter().enumerate() {
            judge.outlier(peers[i], 5.0 + n as f64, partners);
        }
        let moved = limit_of(&judge) != limit;
        assert_eq!(moved, rebased, "{partners} partners, outliers {outliers:?}");
        if rebased {
            // The far distances are the baseline now: they would be accepted.
            assert!(limit_of(&judge).unwrap() > 5.0 + outliers.len() as f64);
        }
    }
    // An accepted distance between outliers clears them: they were not "most of the peers".
    let mut judge = Judge::new(ClipRule::PAIRWISE);
    for _ in 0..8 {
        judge.accepted(peers[5], 0.1, 0.1, now);
    }
    judge.outlier(peers[0], 5.0, 3);
    judge.accepted(peers[5], 0.1, 0.1, now);
    judge.outlier(peers[1], 5.0, 3);
    assert!((limit_of(&judge).unwrap() - 1.0).abs() < 1e-9);
}

/// An outlier is declined, not an offence, and its peer is left alone for the failure
/// back-off: offered to by no one, its offers answered busy, until the time is up or this
/// replica finds that it is the one that drifted.
#[test]
fn an_outlier_partner_is_declined_not_an_offence_and_left_alone_for_a_while() {
    let mut node = Node::new(settings(SyncMode::Gossip)).joined();
    let [a, b, c] = [(); 3].map(|_| PeerId::random());
    for peer in [a, b, c] {
        node.heard(peer, 8, SyncMode::Gossip, Role::Worker);
    }
    for _ in 0..8 {
        node.policy.params.accepted(c, 0.1, 0.1, node.now);
    }
    let due = |node: &mut Node| node.due(8);
    let far = offered_to(&due(&mut node)).unwrap();
    let outlier = |peer| Input::Exchanged {
        peer,
        outcome: Outcome::Outlier { distance: 5.0 },
    };
    assert_eq!(node.handle(outlier(far)), [Action::Release]);
    // For the back-off, the far peer is neither offered to nor answered.
    let back_off = Timeouts::default().failure_backoff.as_millis() as u64;
    node.at(back_off - 1);
    for _ in 0..20 {
        let partner = offered_to(&due(&mut node));
        assert!(partner.is_some() && partner != Some(far), "{partner:?}");
        node.handle(Input::Exchanged {
            peer: partner.unwrap(),
            outcome: Outcome::Stale,
        });
    }
    assert_eq!(answered(node.handle(offer(far))), Answer::Busy);
    // An offer of `peer` is answered with an exchange that ends with `outcome`.
    let exchanged = |node: &mut Node, peer, outcome| {
        let answer = answered(node.handle(offer(peer)));
        assert!(
            matches!(answer, Answer::Exchange { .. }),
            "{peer}: {answer:?}"
        );
        node.handle(Input::Served { peer, outcome });
    };
    let too_far = || Outcome::Outlier { distance: 5.0 };
    // Then it is again.
    exchanged(node.at(back_off), far, too_far());
    assert_eq!(answered(node.handle(offer(far))), Answer::Busy);
    // A second partner far too: two of three are most of them, so it is this replica that
    // drifted, and every peer is asked again.
    let other = if far == a { b } else { a };
    exchanged(&mut node, other, too_far());
    for peer in [a, b, c] {
        exchanged(&mut node, peer, Outcome::Stale);
    }
}
