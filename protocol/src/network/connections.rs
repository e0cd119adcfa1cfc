//! Which connections a node keeps to each peer, when it connects to a peer afresh, and which
//! side dials: the connection rules (docs/connections.md) as a state machine that does no I/O.
//!
//! The event loop tells the [`ConnectionTracker`] what the swarm reported (a connection
//! established or closed, a ping answered or failed, a member found in the DHT) and what time
//! it is; the tracker answers with [`ConnectionAction`]s, which the event loop carries out, and
//! it is asked again on a timer ([`ConnectionTracker::tick`]). The rules, in short:
//!
//! - **One connection per pair** (decision 0067). Two peers that dial each other at once, or
//!   redial after a restart, can end with a connection each way, or one per transport. Once
//!   every one of them is older than a dial race and has answered a ping since the newest came
//!   up, the side with the smaller id keeps one: a hole-punched one, else the oldest, on which
//!   gossipsub introduced the topics; the other side takes those closes for no failure, though
//!   it may have seen the connections come up in another order. A relayed connection closes once
//!   a direct one is up, and an AutoNAT dial-back once its test is done (decision 0065).
//! - **A failed connection starts a reconnect** (decisions 0015, 0032): every connection to the
//!   peer is closed, and once they are, the side with the smaller id dials at once and the
//!   other after a grace if still unconnected. A killed process's connection may be the failed
//!   one, with its restart connected beside it: gossipsub introduces topics only on a peer's
//!   first connection, so only a session started afresh carries the restarted peer's
//!   heartbeats. A connection younger than a dial race, or one whose close says nothing of the
//!   peer (relayed, a dial-back, a spare closed beside an older one), starts none.
//! - **One side dials** a member found in the DHT: the smaller id at once, the larger after the
//!   same grace, so that two members that find each other in one lookup do not cross dials.
//! - **A dial that fails at every address looks the peer up by id** in the DHT, at most once a
//!   [`LOOKUP_PAUSE`] per peer and [`LOOKUPS_PER_PAUSE`] times a pause in all: a restarted peer
//!   listens at a new port, and the addresses this node holds for it (its peer book's, a
//!   provider record's) are its last life's. They are dropped, and the lookup dials the peer at
//!   the addresses that the peers connected to it give.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use tracing::{debug, info};

use crate::membership::ConnectionKind;

/// The age under which a connection that fails does not start a reconnect: a dead peer's
/// connection is found dead no sooner than QUIC's idle timeout or two failed pings after it was
/// established (5 s or more), and the spare connections of a redial race close within round
/// trips (decision 0032).
pub(super) const YOUNGER_THAN_A_DEAD_ONE: Duration = Duration::from_secs(3);

/// The longest an AutoNAT dial-back connection is kept: its test takes a round trip or two.
pub(super) const DIAL_BACK_LIFETIME: Duration = Duration::from_secs(10);

/// How long the peer with the greater id waits, after its connections to a peer closed for a
/// reconnect (or after both found each other in the DHT), before it dials that peer itself:
/// the other side dials at once, and two dials that cross leave two connections.
pub(super) const REDIAL_GRACE: Duration = Duration::from_secs(2);

/// The least time between two lookups by id of one peer whose dials failed: a peer that is gone
/// for good is not looked up at every dial.
pub(super) const LOOKUP_PAUSE: Duration = Duration::from_secs(5);

/// The most lookups by id started within one [`LOOKUP_PAUSE`], whatever the peers: the DHT's
/// own queries dial the peers others name, the dead among them, and each failure is no reason
/// for a query more.
pub(super) const LOOKUPS_PER_PAUSE: usize = 8;

/// What the event loop is to do with the swarm.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum ConnectionAction {
    /// Close this one connection; the peer's others stay open.
    Close(ConnectionId),
    /// Close every connection to the peer, to connect afresh once they are all closed.
    Disconnect(PeerId),
    /// Dial the peer by id unless it is connected, even while another dial to it is pending.
    Dial(PeerId),
    /// Look the peer up in the DHT by id, and dial it at the addresses found.
    LookUp(PeerId),
}

/// A connection the swarm established, as the event loop saw it.
#[derive(Clone, Debug)]
pub(super) struct NewConnection {
    pub(super) peer: PeerId,
    /// The peer's address on the connection (a relayed one's shows the relay's circuit).
    pub(super) remote: Multiaddr,
    /// This node's address the peer dialled, on a connection the peer opened.
    pub(super) dialled_here: Option<Multiaddr>,
    pub(super) kind: ConnectionKind,
    /// Opened by this node's AutoNAT server to test an address of the peer's.
    pub(super) dial_back: bool,
}

/// An open connection: to whom, since when, the peer's address on it, and how it was made.
#[derive(Debug)]
pub(super) struct Open {
    pub(super) peer: PeerId,
    pub(super) at: Instant,
    pub(super) remote: Multiaddr,
    pub(super) dialled_here: Option<Multiaddr>,
    pub(super) kind: ConnectionKind,
    pub(super) dial_back: bool,
    /// When the peer last answered a ping on this connection.
    answered: Option<Instant>,
}

impl Open {
    /// Whether the connection is one of the pair's own: direct from this node's socket,
    /// neither through a relay nor a dial-back (which come and go on their own).
    pub(super) fn is_own(&self) -> bool {
        self.kind != ConnectionKind::Relayed && !self.dial_back
    }
}

/// The open connections of one node and the reconnects under way; see the module doc.
#[derive(Debug)]
pub(super) struct ConnectionTracker {
    local: PeerId,
    open: HashMap<ConnectionId, Open>,
    /// Peers being disconnected in order to be dialled afresh once their last connection
    /// closed (see [`Self::reconnect`]).
    reconnecting: HashSet<PeerId>,
    /// Peers this node dials once their grace is over, unless they connected first.
    redial_at: HashMap<PeerId, Instant>,
    /// When each peer whose dials failed was looked up by id, within the last
    /// [`LOOKUP_PAUSE`] (older entries are dropped when the next failure comes).
    looked_up: HashMap<PeerId, Instant>,
}

impl ConnectionTracker {
    pub(super) fn new(local: PeerId) -> Self {
        ConnectionTracker {
            local,
            open: HashMap::new(),
            reconnecting: HashSet::new(),
            redial_at: HashMap::new(),
            looked_up: HashMap::new(),
        }
    }

    /// The connection `id`, while it is open.
    pub(super) fn get(&self, id: ConnectionId) -> Option<&Open> {
        self.open.get(&id)
    }

    /// The open connections to `peer`.
    pub(super) fn to(&self, peer: PeerId) -> impl Iterator<Item = &Open> {
        self.open.values().filter(move |o| o.peer == peer)
    }

    /// Every open connection.
    pub(super) fn all(&self) -> impl Iterator<Item = &Open> {
        self.open.values()
    }

    /// Whether any connection to `peer` is open.
    pub(super) fn is_connected(&self, peer: PeerId) -> bool {
        self.to(peer).next().is_some()
    }

    /// How this node is best connected to `peer`, dial-backs left out: hole-punched, then
    /// direct, then relayed.
    pub(super) fn link(&self, peer: PeerId) -> Option<ConnectionKind> {
        let rank = |kind: ConnectionKind| match kind {
            ConnectionKind::HolePunched => 0,
            ConnectionKind::Direct => 1,
            ConnectionKind::Relayed => 2,
        };
        self.to(peer)
            .filter(|o| !o.dial_back)
            .map(|o| o.kind)
            .min_by_key(|kind| rank(*kind))
    }

    /// The swarm established connection `id`. One that comes up while the peer is being
    /// reconnected beside another is closed: it would join a session both sides are tearing
    /// down, in which gossipsub introduces no topics; the peer is dialled afresh once the others
    /// closed.
    pub(super) fn on_established(
        &mut self,
        now: Instant,
        id: ConnectionId,
        connection: NewConnection,
    ) -> Vec<ConnectionAction> {
        let peer = connection.peer;
        let mut actions = Vec::new();
        if self.reconnecting.contains(&peer) && self.is_connected(peer) {
            debug!(%peer, "a connection while reconnecting: closed");
            actions.push(ConnectionAction::Close(id));
        }
        let open = Open {
            peer,
            at: now,
            remote: connection.remote,
            dialled_here: connection.dialled_here,
            kind: connection.kind,
            dial_back: connection.dial_back,
            answered: None,
        };
        self.open.insert(id, open);
        self.redial_at.remove(&peer);
        actions
    }

    /// The swarm closed connection `id` to `peer`; `failed` when it broke (an I/O error), not
    /// when it was closed on purpose or for idleness. The last connection of a peer being
    /// reconnected is followed by a dial, at once from the side with the smaller id and after
    /// [`REDIAL_GRACE`] from the other (the first may be gone for good). One that broke while
    /// others to the peer are up starts a reconnect unless its close says nothing of the peer:
    /// a relay closes a circuit at its limits, a dial-back has done its work, and a pair drops
    /// its spares keeping a hole-punched connection or the oldest (the peer's oldest, which
    /// may not be this side's: [`Self::pruned_by_the_peer`]).
    pub(super) fn on_closed(
        &mut self,
        now: Instant,
        id: ConnectionId,
        peer: PeerId,
        failed: bool,
    ) -> Vec<ConnectionAction> {
        let closed = self.open.remove(&id);
        if !self.is_connected(peer) {
            if self.reconnecting.remove(&peer) {
                if self.local < peer {
                    return vec![ConnectionAction::Dial(peer)];
                }
                self.redial_at.insert(peer, now + REDIAL_GRACE);
            }
            return Vec::new();
        }
        let incidental = closed.as_ref().is_some_and(|o| {
            o.kind != ConnectionKind::Direct
                || o.dial_back
                || self.closed_beside_an_older(o)
                || self.pruned_by_the_peer(o)
        }) || self.hole_punched(peer);
        if !failed || incidental {
            return Vec::new();
        }
        debug!(%peer, "one of several connections failed");
        self.reconnect(now, peer, closed.map(|o| o.at))
    }

    /// The peer answered a ping on connection `id`.
    pub(super) fn on_pong(&mut self, now: Instant, id: ConnectionId) {
        if let Some(open) = self.open.get_mut(&id) {
            open.answered = Some(now);
        }
    }

    /// A ping to `peer` on connection `id` failed. A relay that stopped carrying a circuit, or
    /// a dial-back, says nothing of the peer: that connection alone is closed. Any other starts
    /// a reconnect.
    pub(super) fn on_ping_failed(
        &mut self,
        now: Instant,
        id: ConnectionId,
        peer: PeerId,
    ) -> Vec<ConnectionAction> {
        match self.open.get(&id) {
            Some(open) if open.kind == ConnectionKind::Relayed || open.dial_back => {
                vec![ConnectionAction::Close(id)]
            }
            open => {
                let established = open.map(|o| o.at);
                self.reconnect(now, peer, established)
            }
        }
    }

    /// A DHT lookup found `peer` among the run's members. Of two members that find each other
    /// in the same lookup, the one with the smaller id dials at once and the other after
    /// [`REDIAL_GRACE`] if still unconnected; else they would dial each other and keep a spare,
    /// lookup after lookup. The dial goes out even while another to the peer is pending: that
    /// one may be the DHT's, to an address behind the peer's router that a QUIC handshake gives
    /// up on only after seconds, and one after another such dials kept out this one, the only
    /// one that holds the lookup's addresses (a relayed one among them).
    pub(super) fn on_found(&mut self, now: Instant, peer: PeerId) -> Vec<ConnectionAction> {
        if peer == self.local || self.is_connected(peer) {
            return Vec::new();
        }
        debug!(%peer, "a member found in the DHT");
        if self.local < peer {
            return vec![ConnectionAction::Dial(peer)];
        }
        self.redial_at.entry(peer).or_insert(now + REDIAL_GRACE);
        Vec::new()
    }

    /// A dial of `peer` failed at every address it was given (or had none): they may be those
    /// of the peer's last life, so the peer is looked up by id, unless it is connected, was
    /// looked up less than [`LOOKUP_PAUSE`] ago, or [`LOOKUPS_PER_PAUSE`] lookups started
    /// within the last pause.
    pub(super) fn on_dial_failed(&mut self, now: Instant, peer: PeerId) -> Vec<ConnectionAction> {
        if peer == self.local || self.is_connected(peer) {
            return Vec::new();
        }
        self.looked_up.retain(|_, at| now < *at + LOOKUP_PAUSE);
        if self.looked_up.contains_key(&peer) || self.looked_up.len() >= LOOKUPS_PER_PAUSE {
            return Vec::new();
        }
        self.looked_up.insert(peer, now);
        debug!(%peer, "no address of the peer answered: looking it up");
        vec![ConnectionAction::LookUp(peer)]
    }

    /// A hole punch made connection `id`, which this node keeps over the pair's others.
    pub(super) fn on_hole_punched(&mut self, id: ConnectionId) {
        if let Some(open) = self.open.get_mut(&id) {
            open.kind = ConnectionKind::HolePunched;
        }
    }

    /// This node's AutoNAT server reported its test of an address of `peer`'s: the dial-back
    /// connections to the peer have done their work. Left open, each would be a spare
    /// connection to a peer this node is already connected to.
    pub(super) fn on_dial_back_done(&self, peer: PeerId) -> Vec<ConnectionAction> {
        self.close_dial_backs(|open| open.peer == peer)
    }

    /// What is due at `now`: the dials of peers whose grace is over and that did not connect
    /// first, and the closes of spare connections (see [`Self::prune_spares`]).
    pub(super) fn tick(&mut self, now: Instant) -> Vec<ConnectionAction> {
        let mut actions: Vec<ConnectionAction> = self
            .redial_at
            .extract_if(|_, at| *at <= now)
            .map(|(peer, _)| ConnectionAction::Dial(peer))
            .collect();
        actions.extend(self.prune_spares(now));
        actions
    }

    /// Drops every connection to `peer`, one of which (established at `established`) failed.
    ///
    /// A connection younger than [`YOUNGER_THAN_A_DEAD_ONE`] is let be: no dead peer is found
    /// that soon, and such a one is most likely a redial's spare. The peer sees our disconnect
    /// as failures and reconnects too, and each redial may open a connection per transport and
    /// close those that lost the race; were those closes taken for failures, each side would
    /// tear down the other's new connections in turn, and both could end with none.
    fn reconnect(
        &mut self,
        now: Instant,
        peer: PeerId,
        established: Option<Instant>,
    ) -> Vec<ConnectionAction> {
        if established.is_some_and(|at| now.saturating_duration_since(at) < YOUNGER_THAN_A_DEAD_ONE)
        {
            debug!(%peer, "a young connection to the peer closed: let be");
            return Vec::new();
        }
        if self.is_connected(peer) && self.reconnecting.insert(peer) {
            info!(%peer, "a connection to the peer failed: connecting afresh");
            return vec![ConnectionAction::Disconnect(peer)];
        }
        Vec::new()
    }

    /// Keeps one connection per peer. Two peers that dial each other at once, or redial after
    /// a restart, can end with a connection each way (or one per transport), and nothing
    /// closes the spare: each holds buffers and streams for as long as both processes live, so
    /// a node's memory grew with the churn it had seen. A pair whose connections are all older
    /// than a dial race ([`YOUNGER_THAN_A_DEAD_ONE`]) and have all answered a ping since the
    /// newest came up ([`Self::all_answered_since`]) keeps one ([`Self::keep_one`]); only the
    /// side with the smaller id decides, so the two never tear down each other's choice.
    fn prune_spares(&self, now: Instant) -> Vec<ConnectionAction> {
        // A relayed connection has done its work once a direct one is up (a hole punch, or a
        // dial the other way): exchanges go direct, and the relay's circuit limits are spared.
        let direct: HashSet<PeerId> = self
            .open
            .values()
            .filter(|o| o.kind != ConnectionKind::Relayed)
            .map(|o| o.peer)
            .collect();
        let mut actions: Vec<ConnectionAction> = self
            .open
            .iter()
            .filter(|(_, o)| o.kind == ConnectionKind::Relayed && direct.contains(&o.peer))
            .map(|(id, _)| {
                debug!(connection = ?id, "a relayed connection beside a direct one: closed");
                ConnectionAction::Close(*id)
            })
            .collect();
        // A dial-back closes once AutoNAT's server reported its test; this catches one whose
        // report never came.
        actions.extend(
            self.close_dial_backs(|open| {
                now.saturating_duration_since(open.at) >= DIAL_BACK_LIFETIME
            }),
        );
        for (peer, (count, newest)) in self.per_peer() {
            if count <= 1
                || self.local > peer
                || now.saturating_duration_since(newest) < YOUNGER_THAN_A_DEAD_ONE
                || !self.all_answered_since(peer, newest)
                || self.reconnecting.contains(&peer)
            {
                continue;
            }
            info!(%peer, connections = count, "spare connections to the peer: keeping one");
            actions.extend(self.keep_one(peer));
        }
        actions
    }

    /// Whether a direct connection to the peer of `closed`, older than it, is still open: the
    /// pair's session (the first connection, on which gossipsub introduced the topics) goes on,
    /// and the close was a spare's, which the side with the smaller id prunes. A restarted
    /// peer's new connection is younger than the old one that failed.
    fn closed_beside_an_older(&self, closed: &Open) -> bool {
        self.to(closed.peer).any(|o| o.at < closed.at && o.is_own())
    }

    /// Whether the close of `closed` is what the peer's pruning of a spare looks like from here:
    /// the peer has the smaller id (the side that keeps one connection of the pair), and every
    /// connection of the pair, the closed one included, answered a ping since the newest came
    /// up, as the pruning side requires (see [`Self::all_answered_since`]). Crossed dials come
    /// up on each side in its own order, so the spare the peer closed may be the oldest here;
    /// taken for a failure, it tore the pair's last connection down. A dead connection beside
    /// a restarted peer's new one never answered since the new one came up: its failure still
    /// starts a reconnect.
    fn pruned_by_the_peer(&self, closed: &Open) -> bool {
        let peer = closed.peer;
        if self.local < peer || !self.to(peer).any(Open::is_own) {
            return false;
        }
        let newest = self
            .to(peer)
            .filter(|o| o.is_own())
            .map(|o| o.at)
            .fold(closed.at, Instant::max);
        closed.answered.is_some_and(|at| at > newest) && self.all_answered_since(peer, newest)
    }

    /// Whether one of the connections open to `peer` was made by a hole punch.
    fn hole_punched(&self, peer: PeerId) -> bool {
        self.to(peer).any(|o| o.kind == ConnectionKind::HolePunched)
    }

    /// Closes every direct connection to `peer` but one: the oldest made by a hole punch, else
    /// the oldest. Gossipsub introduced the topics on the oldest and keeps them while it
    /// stays open; the peer takes the close of a younger one for no failure (see
    /// [`Self::closed_beside_an_older`]). A pair connected afresh instead, and the side that
    /// had not decided it could dial back at once: in a busy swarm (a lookup in flight), a
    /// pair crossed its dials after every reconnect and never settled (decision 0067).
    fn keep_one(&self, peer: PeerId) -> Vec<ConnectionAction> {
        let mut own: Vec<(ConnectionId, bool, Instant)> = self
            .open
            .iter()
            .filter(|(_, o)| o.peer == peer && o.is_own())
            .map(|(id, o)| (*id, o.kind == ConnectionKind::HolePunched, o.at))
            .collect();
        // Hole-punched first, then oldest first: the one kept.
        own.sort_by_key(|&(_, punched, at)| (!punched, at));
        own.into_iter()
            .skip(1)
            .map(|(connection, _, _)| {
                debug!(%peer, ?connection, "a spare connection: closed");
                ConnectionAction::Close(connection)
            })
            .collect()
    }

    /// Closes the connections this node opened to test a peer's address for it (AutoNAT's
    /// dial-backs) that `which` picks. Left open, each would hold a second connection to a
    /// peer this node is already connected to, for nothing.
    fn close_dial_backs(&self, which: impl Fn(&Open) -> bool) -> Vec<ConnectionAction> {
        self.open
            .iter()
            .filter(|(_, o)| o.dial_back && which(o))
            .map(|(id, _)| ConnectionAction::Close(*id))
            .collect()
    }

    /// Whether every connection of the pair's own to `peer` answered a ping after `since` (when
    /// the newest was established). A killed process leaves its QUIC connection open on this
    /// side until the idle timeout, and its restart connects beside it: that old connection
    /// is dead, not a spare. Kept as the oldest, it would close the live one, and the pair
    /// would be left with nothing once it timed out. Left alone, it fails, and the pair
    /// connects afresh ([`Self::reconnect`]).
    fn all_answered_since(&self, peer: PeerId, since: Instant) -> bool {
        self.to(peer)
            .filter(|o| o.is_own())
            .all(|o| o.answered.is_some_and(|at| at > since))
    }

    /// Each connected peer with its open connections that count as its own (neither relayed
    /// nor a dial-back): how many, and when the newest was established.
    fn per_peer(&self) -> HashMap<PeerId, (usize, Instant)> {
        let mut peers: HashMap<PeerId, (usize, Instant)> = HashMap::new();
        for &Open { peer, at, .. } in self.open.values().filter(|o| o.is_own()) {
            let (count, newest) = peers.entry(peer).or_insert((0, at));
            *count += 1;
            *newest = (*newest).max(at);
        }
        peers
    }
}

#[cfg(test)]
mod tests;
