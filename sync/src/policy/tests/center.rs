//! Who may hold the elastic center (decisions 0047, 0052): unless the run opts into an open
//! election, only trusted peers, this node and the configured center stand for it.

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

/// The identity of secret key `seed`: the same in every run. With random identities, about one
/// run in 5,000 drew a peer so far ahead in the election that no identity of 10,000 beat it.
fn identity(seed: u64) -> PeerId {
    let mut secret = [7u8; 32];
    secret[..8].copy_from_slice(&seed.to_le_bytes());
    libp2p_identity::Keypair::ed25519_from_bytes(secret)
        .expect("invariant: 32 bytes are an ed25519 secret key")
        .public()
        .to_peer_id()
}

/// What a stranger does: mint identities until one wins the open election among `peers`.
fn ground_identity(peers: &[PeerId]) -> PeerId {
    (1_000..11_000)
        .map(identity)
        .find(|g| open_election(&[peers, &[*g]].concat()) == Some(*g))
        .expect("one identity in 10,000 wins among a few")
}

/// An elastic run's settings with the given election and trust list, and no pinned center.
fn elastic(election: Election, trust: &[PeerId]) -> SyncSettings {
    pinned(None, election, trust)
}

/// An elastic run's settings with `center` pinned, the given election and trust list.
fn pinned(center: Option<PeerId>, election: Election, trust: &[PeerId]) -> SyncSettings {
    SyncSettings {
        mode: Mode::Elastic(ElasticSettings {
            center,
            election,
            ..ElasticSettings::default()
        }),
        trust: TrustList::new(trust.iter().copied()),
        ..settings(SyncMode::Elastic)
    }
}

#[test]
fn a_ground_identity_wins_the_open_election_but_not_among_trusted_peers() {
    let (me, friend) = (identity(1), identity(2));
    let grinder = ground_identity(&[me, friend]);

    assert_eq!(
        elected_by(me, elastic(Election::Open, &[friend]), friend, grinder),
        Some(grinder),
        "an open election is won by the ground identity, trust list or not"
    );
    assert_eq!(
        elected_by(me, elastic(Election::Trusted, &[friend]), friend, grinder),
        open_election(&[me, friend]),
        "otherwise the center is a trusted peer or this node"
    );
    // A center pinned in the run config stands although nobody listed it.
    let pinned = pinned(Some(grinder), Election::Trusted, &[friend]);
    assert_eq!(elected_by(me, pinned, friend, grinder), Some(grinder));
}

#[test]
fn a_node_whose_trusted_peers_are_gone_holds_the_center_itself_not_a_stranger() {
    let (me, friend) = (identity(1), identity(2));
    let grinder = ground_identity(&[me, friend]);
    let mut node = Node::with_id(me, elastic(Election::Trusted, &[friend])).joined();
    node.heard(friend, 0, SyncMode::Elastic, Role::Worker);
    node.heard(grinder, 0, SyncMode::Elastic, Role::Worker);
    node.handle(Input::Tick);
    node.table.members_mut().remove(&friend);
    // The election is followed once a heartbeat period.
    let actions = node.handle(Input::Tick);
    assert_eq!(node.policy.view().center, Some(me), "{actions:?}");
    // Its due snapshot steps its own center; nothing goes to the stranger.
    node.handle(Input::CenterSeeded { ok: true });
    let due = node.due(4);
    assert!(
        !due.iter()
            .any(|a| matches!(a, Action::AskCenter { peer, .. } if *peer == grinder)),
        "{due:?}"
    );
}

/// A node with no trust list follows its pinned center; when that one is gone, the election
/// falls to this node alone, not to every peer live (where the stranger's identity wins).
#[test]
fn a_node_whose_pinned_center_is_gone_holds_the_center_itself_not_a_stranger() {
    let (me, pinned) = (identity(1), identity(2));
    let grinder = ground_identity(&[me, pinned]);
    let sync = self::pinned(Some(pinned), Election::Trusted, &[]);
    let mut node = Node::with_id(me, sync).joined();
    node.heard(pinned, 0, SyncMode::Elastic, Role::Center);
    node.heard(grinder, 0, SyncMode::Elastic, Role::Worker);
    node.handle(Input::Tick);
    assert_eq!(node.policy.view().center, Some(pinned));
    node.table.members_mut().remove(&pinned);
    let actions = node.handle(Input::Tick);
    assert_eq!(node.policy.view().center, Some(me), "{actions:?}");
}
