//! One test per connection rule: the swarm's reports fed in order, at given times, and the
//! actions the tracker answers with.

use std::time::{Duration, Instant};

use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};

use super::ConnectionAction::{Close, Dial, Disconnect, LookUp};
use super::{ConnectionTracker, LOOKUP_PAUSE, LOOKUPS_PER_PAUSE, NewConnection, REDIAL_GRACE};
use crate::membership::ConnectionKind;

/// Two peer ids, the smaller first.
fn pair() -> (PeerId, PeerId) {
    let (a, b) = (PeerId::random(), PeerId::random());
    if a < b { (a, b) } else { (b, a) }
}

/// A tracker on the side of the pair with the smaller id, and the other peer.
fn smaller_side() -> (ConnectionTracker, PeerId) {
    let (local, peer) = pair();
    (ConnectionTracker::new(local), peer)
}

/// A tracker on the side of the pair with the greater id, and the other peer.
fn greater_side() -> (ConnectionTracker, PeerId) {
    let (peer, local) = pair();
    (ConnectionTracker::new(local), peer)
}

fn id(n: usize) -> ConnectionId {
    ConnectionId::new_unchecked(n)
}

/// The clock of a test: `secs` after its start.
struct Clock(Instant);

impl Clock {
    fn new() -> Self {
        Clock(Instant::now())
    }

    fn at(&self, secs: f64) -> Instant {
        self.0 + Duration::from_secs_f64(secs)
    }
}

fn connection(peer: PeerId, kind: ConnectionKind, dial_back: bool) -> NewConnection {
    let remote: Multiaddr = "/ip4/10.0.0.2/tcp/4001".parse().expect("an address");
    NewConnection {
        peer,
        remote,
        dialled_here: None,
        kind,
        dial_back,
    }
}

fn direct(peer: PeerId) -> NewConnection {
    connection(peer, ConnectionKind::Direct, false)
}

fn relayed(peer: PeerId) -> NewConnection {
    connection(peer, ConnectionKind::Relayed, false)
}

fn dial_back(peer: PeerId) -> NewConnection {
    connection(peer, ConnectionKind::Direct, true)
}

#[test]
fn crossed_dials_leave_the_oldest_connection_chosen_by_the_smaller_id() {
    for decides in [true, false] {
        let (mut tracker, peer) = if decides {
            smaller_side()
        } else {
            greater_side()
        };
        let clock = Clock::new();
        assert!(
            tracker
                .on_established(clock.at(0.0), id(1), direct(peer))
                .is_empty()
        );
        assert!(
            tracker
                .on_established(clock.at(0.1), id(2), direct(peer))
                .is_empty()
        );
        tracker.on_pong(clock.at(1.0), id(1));
        tracker.on_pong(clock.at(1.0), id(2));
        assert!(
            tracker.tick(clock.at(2.0)).is_empty(),
            "a spare younger than a dial race is let be"
        );
        let expected = if decides { vec![Close(id(2))] } else { vec![] };
        assert_eq!(tracker.tick(clock.at(4.0)), expected);
    }
}

#[test]
fn a_restarted_peer_behind_a_dead_quic_connection_keeps_its_live_one() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_pong(clock.at(1.0), id(1));
    // The peer's process is killed; its QUIC connection stays open here until it times out.
    // The restarted process connects beside it and answers pings; the dead one does not.
    tracker.on_established(clock.at(20.0), id(2), direct(peer));
    tracker.on_pong(clock.at(21.0), id(2));
    for secs in [24.0, 26.0, 28.0] {
        assert!(
            tracker.tick(clock.at(secs)).is_empty(),
            "kept as the oldest, the dead connection would close the live one"
        );
    }
    // The dead one fails: the pair connects afresh, and this side dials once both are closed.
    assert_eq!(
        tracker.on_ping_failed(clock.at(30.0), id(1), peer),
        vec![Disconnect(peer)]
    );
    assert!(
        tracker
            .on_closed(clock.at(30.1), id(1), peer, true)
            .is_empty()
    );
    assert_eq!(
        tracker.on_closed(clock.at(30.1), id(2), peer, false),
        vec![Dial(peer)]
    );
}

#[test]
fn a_young_connection_that_fails_starts_no_reconnect() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    assert!(
        tracker
            .on_ping_failed(clock.at(2.9), id(1), peer)
            .is_empty(),
        "no dead peer is found within a dial race"
    );
    assert_eq!(
        tracker.on_ping_failed(clock.at(3.0), id(1), peer),
        vec![Disconnect(peer)]
    );
    assert!(
        tracker
            .on_ping_failed(clock.at(4.0), id(1), peer)
            .is_empty(),
        "one reconnect at a time"
    );
}

#[test]
fn a_spare_that_breaks_beside_an_older_one_starts_no_reconnect() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), direct(peer));
    // The other side prunes the spare; this side sees its close as an error.
    assert!(
        tracker
            .on_closed(clock.at(10.0), id(2), peer, true)
            .is_empty()
    );
    assert_eq!(tracker.to(peer).count(), 1);
}

/// Crossed dials come up on each side in its own order: the spare the smaller side closes may be
/// the oldest on this side. Its close is no failure when it looks as a prune does: every
/// connection of the pair, the closed one too, had answered a ping since the newest came up.
#[test]
fn the_oldest_connection_pruned_by_the_smaller_side_starts_no_reconnect() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(0.1), id(2), direct(peer));
    tracker.on_pong(clock.at(2.0), id(1));
    tracker.on_pong(clock.at(2.0), id(2));
    // The smaller side saw connection 2 come up first, kept it and closed 1.
    assert!(
        tracker
            .on_closed(clock.at(4.0), id(1), peer, true)
            .is_empty(),
        "a pruned spare taken for a failure tears down the pair's last connection"
    );
    assert_eq!(tracker.to(peer).count(), 1);
}

/// The greater side's view of a restarted peer: the dead connection never answered once the
/// restart's came up, so its failure is no prune, and the pair connects afresh.
#[test]
fn a_dead_connection_beside_a_restarted_peers_is_no_prune() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_pong(clock.at(1.0), id(1));
    tracker.on_established(clock.at(20.0), id(2), direct(peer));
    tracker.on_pong(clock.at(21.0), id(2));
    assert_eq!(
        tracker.on_closed(clock.at(25.0), id(1), peer, true),
        vec![Disconnect(peer)]
    );
}

#[test]
fn the_oldest_connection_breaking_starts_a_reconnect_that_refuses_newcomers() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), direct(peer));
    assert_eq!(
        tracker.on_closed(clock.at(10.0), id(1), peer, true),
        vec![Disconnect(peer)]
    );
    // A connection that comes up while the pair tears its session down would join it.
    assert_eq!(
        tracker.on_established(clock.at(10.1), id(3), direct(peer)),
        vec![Close(id(3))]
    );
    tracker.on_pong(clock.at(15.0), id(2));
    tracker.on_pong(clock.at(15.0), id(3));
    assert!(
        tracker.tick(clock.at(20.0)).is_empty(),
        "no spares pruned while the pair reconnects"
    );
}

#[test]
fn a_connection_closed_on_purpose_starts_no_reconnect() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), direct(peer));
    assert!(
        tracker
            .on_closed(clock.at(10.0), id(1), peer, false)
            .is_empty()
    );
}

#[test]
fn after_a_reconnect_the_greater_id_dials_only_after_a_grace() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), direct(peer));
    assert_eq!(
        tracker.on_closed(clock.at(10.0), id(1), peer, true),
        vec![Disconnect(peer)]
    );
    assert!(
        tracker
            .on_closed(clock.at(10.0), id(2), peer, true)
            .is_empty()
    );
    let grace = REDIAL_GRACE.as_secs_f64();
    assert!(tracker.tick(clock.at(10.0 + grace / 2.0)).is_empty());
    assert_eq!(tracker.tick(clock.at(10.0 + grace)), vec![Dial(peer)]);
    assert!(tracker.tick(clock.at(20.0 + grace)).is_empty(), "one dial");
}

#[test]
fn a_peer_that_dials_first_within_the_grace_is_not_dialled() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    assert_eq!(
        tracker.on_ping_failed(clock.at(10.0), id(1), peer),
        vec![Disconnect(peer)]
    );
    assert!(
        tracker
            .on_closed(clock.at(10.0), id(1), peer, true)
            .is_empty()
    );
    tracker.on_established(clock.at(10.5), id(2), direct(peer));
    assert!(tracker.tick(clock.at(13.0)).is_empty());
}

#[test]
fn a_member_found_in_the_dht_is_dialled_by_one_side_of_the_pair() {
    let clock = Clock::new();
    let (mut smaller, peer) = smaller_side();
    assert_eq!(smaller.on_found(clock.at(0.0), peer), vec![Dial(peer)]);

    let (mut greater, peer) = greater_side();
    assert!(greater.on_found(clock.at(0.0), peer).is_empty());
    assert!(
        greater.on_found(clock.at(1.5), peer).is_empty(),
        "a second lookup keeps the first grace"
    );
    assert_eq!(greater.tick(clock.at(2.0)), vec![Dial(peer)]);
}

#[test]
fn a_connected_member_or_this_node_found_in_the_dht_is_not_dialled() {
    let clock = Clock::new();
    let (mut tracker, peer) = smaller_side();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    assert!(tracker.on_found(clock.at(1.0), peer).is_empty());
    let local = tracker.local;
    assert!(tracker.on_found(clock.at(1.0), local).is_empty());
}

/// A restarted peer listens at a new port: a node that holds only its last life's addresses
/// finds them all refused, and looks the peer up by id, once a pause, until it is connected.
#[test]
fn a_peer_whose_dials_failed_is_looked_up_by_id_once_a_pause() {
    let clock = Clock::new();
    let (mut tracker, peer) = greater_side();
    assert_eq!(
        tracker.on_dial_failed(clock.at(0.0), peer),
        vec![LookUp(peer)]
    );
    assert!(
        tracker.on_dial_failed(clock.at(1.0), peer).is_empty(),
        "within the pause"
    );
    let after_pause = LOOKUP_PAUSE.as_secs_f64();
    assert_eq!(
        tracker.on_dial_failed(clock.at(after_pause), peer),
        vec![LookUp(peer)]
    );
    tracker.on_established(clock.at(after_pause + 1.0), id(1), direct(peer));
    assert!(
        (tracker.on_dial_failed(clock.at(2.0 * after_pause + 2.0), peer)).is_empty(),
        "a connected peer is not looked up"
    );
    let local = tracker.local;
    assert!(tracker.on_dial_failed(clock.at(0.0), local).is_empty());
}

/// The DHT's own queries dial the peers others name, the dead among them: their failures start
/// no more than a few lookups a pause.
#[test]
fn failed_dials_of_many_peers_start_a_bounded_number_of_lookups() {
    let clock = Clock::new();
    let (mut tracker, _) = smaller_side();
    let peers: Vec<PeerId> = (0..3 * LOOKUPS_PER_PAUSE)
        .map(|_| PeerId::random())
        .collect();
    let started = |tracker: &mut ConnectionTracker, at: f64| {
        (peers.iter())
            .filter(|&&peer| !tracker.on_dial_failed(clock.at(at), peer).is_empty())
            .count()
    };
    assert_eq!(started(&mut tracker, 0.0), LOOKUPS_PER_PAUSE);
    assert_eq!(started(&mut tracker, 1.0), 0, "within the pause");
    let after_pause = LOOKUP_PAUSE.as_secs_f64();
    assert_eq!(started(&mut tracker, after_pause), LOOKUPS_PER_PAUSE);
}

#[test]
fn a_relayed_connection_beside_a_direct_one_is_closed_by_either_side() {
    for (mut tracker, peer) in [smaller_side(), greater_side()] {
        let clock = Clock::new();
        tracker.on_established(clock.at(0.0), id(1), relayed(peer));
        assert!(
            tracker.tick(clock.at(1.0)).is_empty(),
            "the only way to the peer"
        );
        assert_eq!(tracker.link(peer), Some(ConnectionKind::Relayed));
        tracker.on_established(clock.at(2.0), id(2), direct(peer));
        tracker.on_hole_punched(id(2));
        assert_eq!(tracker.link(peer), Some(ConnectionKind::HolePunched));
        assert_eq!(tracker.tick(clock.at(2.5)), vec![Close(id(1))]);
        // The relay's close of its circuit says nothing of the peer.
        assert!(
            tracker
                .on_closed(clock.at(10.0), id(1), peer, true)
                .is_empty()
        );
    }
}

#[test]
fn a_hole_punched_connection_is_kept_over_an_older_direct_one() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), direct(peer));
    tracker.on_hole_punched(id(2));
    tracker.on_pong(clock.at(2.0), id(1));
    tracker.on_pong(clock.at(2.0), id(2));
    assert_eq!(tracker.tick(clock.at(5.0)), vec![Close(id(1))]);
    // A pair with a hole-punched connection takes the close of another for no failure.
    assert!(
        tracker
            .on_closed(clock.at(5.1), id(1), peer, true)
            .is_empty()
    );
}

#[test]
fn a_failed_ping_on_a_relayed_or_dial_back_connection_closes_that_one_alone() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(0.0), id(2), relayed(peer));
    tracker.on_established(clock.at(0.0), id(3), dial_back(peer));
    assert_eq!(
        tracker.on_ping_failed(clock.at(10.0), id(2), peer),
        vec![Close(id(2))]
    );
    assert_eq!(
        tracker.on_ping_failed(clock.at(10.0), id(3), peer),
        vec![Close(id(3))]
    );
    assert!(
        tracker
            .on_closed(clock.at(10.1), id(3), peer, true)
            .is_empty()
    );
}

#[test]
fn a_dial_back_closes_when_its_test_is_reported_or_at_the_latest_after_its_lifetime() {
    let (mut tracker, peer) = greater_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(0.0), id(2), dial_back(peer));
    assert_eq!(tracker.on_dial_back_done(peer), vec![Close(id(2))]);
    assert_eq!(
        tracker.link(peer),
        Some(ConnectionKind::Direct),
        "a dial-back says nothing of how the pair is connected"
    );
    assert!(tracker.tick(clock.at(9.9)).is_empty());
    assert_eq!(tracker.tick(clock.at(10.0)), vec![Close(id(2))]);
}

#[test]
fn a_dial_back_is_no_spare() {
    let (mut tracker, peer) = smaller_side();
    let clock = Clock::new();
    tracker.on_established(clock.at(0.0), id(1), direct(peer));
    tracker.on_established(clock.at(1.0), id(2), dial_back(peer));
    tracker.on_pong(clock.at(2.0), id(1));
    tracker.on_pong(clock.at(2.0), id(2));
    assert!(tracker.tick(clock.at(5.0)).is_empty());
}
