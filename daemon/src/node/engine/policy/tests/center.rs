//! Who may hold the elastic center (decision 0047): with a trust list, only trusted peers,
//! this node and the configured center stand for the election.

use super::*;

/// The center that `me` elects in a run of `sync` with `friend` and `grinder` live.
fn elected_by(me: PeerId, sync: SyncSettings, friend: PeerId, grinder: PeerId) -> Option<PeerId> {
    let mut node = Node::with_id(me, sync).joined();
    node.heard(friend, 0, SyncMode::Elastic, Role::Worker);
    // The stranger also claims the role: a claim counts for nothing.
    node.heard(grinder, 0, SyncMode::Elastic, Role::Center);
    node.handle(Input::Tick);
    node.policy.view().center
}

fn open_election(peers: &[PeerId]) -> Option<PeerId> {
    let live: Vec<(PeerId, Vec<u8>)> = peers.iter().map(|p| (*p, p.to_bytes())).collect();
    elect_center(&live, "run", None)
}

/// What a stranger does: mint identities until one wins the open election among `peers`.
fn ground_identity(peers: &[PeerId]) -> PeerId {
    std::iter::repeat_with(PeerId::random)
        .take(10_000)
        .find(|g| open_election(&[peers, &[*g]].concat()) == Some(*g))
        .expect("one identity in 10,000 wins among a few")
}

#[test]
fn a_ground_identity_wins_the_open_election_but_not_among_trusted_peers() {
    let (me, friend) = (PeerId::random(), PeerId::random());
    let grinder = ground_identity(&[me, friend]);
    let elastic = || settings(SyncMode::Elastic);

    assert_eq!(
        elected_by(me, elastic(), friend, grinder),
        Some(grinder),
        "without a trust list the election is open, and the ground identity wins it"
    );
    let trusting = || SyncSettings {
        trust: TrustList::new([friend]),
        ..elastic()
    };
    assert_eq!(
        elected_by(me, trusting(), friend, grinder),
        open_election(&[me, friend]),
        "with a trust list the center is a trusted peer or this node"
    );
    // A center pinned in the run config stands although nobody listed it.
    let pinned = SyncSettings {
        center: Some(grinder),
        ..trusting()
    };
    assert_eq!(elected_by(me, pinned, friend, grinder), Some(grinder));
}

#[test]
fn a_node_whose_trusted_peers_are_gone_holds_the_center_itself_not_a_stranger() {
    let (me, friend) = (PeerId::random(), PeerId::random());
    let grinder = ground_identity(&[me, friend]);
    let sync = SyncSettings {
        trust: TrustList::new([friend]),
        ..settings(SyncMode::Elastic)
    };
    let mut node = Node::with_id(me, sync).joined();
    node.heard(friend, 0, SyncMode::Elastic, Role::Worker);
    node.heard(grinder, 0, SyncMode::Elastic, Role::Worker);
    node.handle(Input::Tick);
    node.table.members_mut().remove(&friend);
    // The election is followed once a heartbeat period.
    let actions = node.handle(Input::Tick);
    assert_eq!(node.policy.view().center, Some(me), "{actions:?}");
    // Its due snapshot steps its own center; nothing goes to the stranger.
    node.handle(Input::CenterSeeded { ok: true });
    let due = node.handle(Input::Due { step: 4 });
    assert!(
        !due.iter()
            .any(|a| matches!(a, Action::AskCenter { peer, .. } if *peer == grinder)),
        "{due:?}"
    );
}
