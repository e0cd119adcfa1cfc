//! The peer table: the live peers of the run as this node sees them (built from their
//! heartbeats by the membership rules of the protocol crate), how it is connected to each,
//! and whom it blocked. The membership actor alone changes it; the sync engine and the
//! staleness gate decide on the copies it publishes.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::{Role, SyncMode};
use murmur_protocol::membership::{ConnectionKind, Membership, PeerView};
use murmur_protocol::scoring::{BlockList, PeerScores};

/// A map keyed by peer ids that the rules consult for every partner at every exchange or
/// step. The standard library's SipHash on peer ids was a sixth of the simulator's time;
/// foldhash is seeded per map, so identities a stranger grinds cannot be aimed at one bucket.
pub(crate) type PeerMap<V> = HashMap<PeerId, V, foldhash::fast::RandomState>;

/// Offences within [`OFFENCE_WINDOW`] after which a peer is blocked.
pub const BLOCK_AFTER_OFFENCES: u32 = 3;
pub const OFFENCE_WINDOW: Duration = Duration::from_secs(60);

/// The offence scores a node keeps of its peers: blocked after [`BLOCK_AFTER_OFFENCES`]
/// within [`OFFENCE_WINDOW`].
pub fn offence_scores() -> PeerScores<PeerId> {
    PeerScores::new(BLOCK_AFTER_OFFENCES, OFFENCE_WINDOW)
}

/// A moving average: `new` alone at first, then `old + weight (new - old)`.
pub fn moving_average(old: Option<f64>, new: f64, weight: f64) -> f64 {
    old.map_or(new, |old| old + weight * (new - old))
}

/// The live peers of the run as this node sees them, how it is connected to each, and the
/// peers it blocked: what the membership actor publishes, and what the staleness gate and the
/// sync engine decide on.
#[derive(Clone, Debug)]
pub struct PeerTable {
    members: Membership<PeerId>,
    blocked: BlockList<PeerId>,
    /// How this node is connected to each connected peer (members or not).
    connections: PeerMap<ConnectionKind>,
    /// This node runs as a client (decision 0066): it cannot accept connections.
    client: bool,
    /// The peers the sync engine found on slow links (decision 0029): the staleness gate does
    /// not wait for them. Kept here, in the table the gate waits on, so that a change wakes it.
    slow: BTreeSet<PeerId>,
}

impl PeerTable {
    /// An empty table whose peers time out after `peer_timeout` without a heartbeat.
    pub fn new(peer_timeout: Duration) -> Self {
        PeerTable {
            members: Membership::new(peer_timeout),
            blocked: BlockList::default(),
            connections: PeerMap::default(),
            client: false,
            slow: BTreeSet::new(),
        }
    }

    /// How this node is connected to `peer`, if it is.
    pub fn connection(&self, peer: &PeerId) -> Option<ConnectionKind> {
        self.connections.get(peer).copied()
    }

    /// For the membership actor: `peer` is now connected this way (`None`: not at all).
    pub fn set_connection(&mut self, peer: PeerId, kind: Option<ConnectionKind>) {
        match kind {
            Some(kind) => self.connections.insert(peer, kind),
            None => self.connections.remove(&peer),
        };
    }

    /// Whether parameters and state may go to and come from `peer` now: over a direct
    /// connection (hole-punched or dialled), or through a relay where the run allows it
    /// (`relayed_ok`). A peer known only from its heartbeats is not connected at all: a
    /// stream opened to it would dial it, through a relay if that is where it listens.
    pub fn exchanges_with(&self, peer: &PeerId, relayed_ok: bool) -> bool {
        match self.connection(peer) {
            Some(ConnectionKind::Direct | ConnectionKind::HolePunched) => true,
            Some(ConnectionKind::Relayed) => relayed_ok,
            None => false,
        }
    }

    /// For the membership actor: the peers on slow links are `slow`, and no others. Returns
    /// whether that changed anything.
    pub fn set_slow(&mut self, slow: BTreeSet<PeerId>) -> bool {
        let changed = self.slow != slow;
        self.slow = slow;
        changed
    }

    /// Whether the sync engine found `peer` on a slow link.
    pub fn is_slow(&self, peer: &PeerId) -> bool {
        self.slow.contains(peer)
    }

    /// Whether this node runs as a client.
    pub fn is_client(&self) -> bool {
        self.client
    }

    /// For the membership actor: this node runs as a client from now on, or not.
    pub fn set_client(&mut self, client: bool) {
        self.client = client;
    }

    pub fn members(&self) -> &Membership<PeerId> {
        &self.members
    }

    /// For the membership actor, which alone changes the table.
    pub fn members_mut(&mut self) -> &mut Membership<PeerId> {
        &mut self.members
    }

    pub fn get(&self, peer: &PeerId) -> Option<&PeerView> {
        self.members.get(peer)
    }

    /// Live peers in id order.
    pub fn peers(&self) -> impl Iterator<Item = (&PeerId, &PeerView)> {
        self.members.peers()
    }

    /// The clocks of the live peers, as last heard.
    pub fn clocks(&self) -> Vec<u64> {
        self.peers().map(|(_, view)| view.step).collect()
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Live peers coupled to a node in `mode`: the same mode, done joining.
    pub fn coupled(&self, mode: SyncMode) -> impl Iterator<Item = (&PeerId, &PeerView)> {
        self.peers()
            .filter(move |(_, v)| v.mode == mode && v.role != Role::Joining)
    }

    /// The smallest clock among the live peers the staleness gate of a node in `mode` waits on.
    pub fn min_coupled_step(&self, mode: SyncMode) -> Option<u64> {
        self.members.min_coupled_step(mode)
    }

    /// The peers the staleness gate of a node in `mode` may wait for, with their clocks: the
    /// coupled peers that have not finished, leaving out those on slow links (decision 0029).
    /// Which of them it waits for is the replica loop's `Coupling` (decision 0039).
    pub fn gate_candidates(&self, mode: SyncMode) -> impl Iterator<Item = (PeerId, u64)> + '_ {
        self.coupled(mode)
            .filter(|(peer, view)| !view.finished && !self.is_slow(peer))
            .map(|(peer, view)| (*peer, view.step))
    }

    /// Forgets `peer` and refuses it from now on. Returns the peer blocked longest ago when
    /// the block list was full: forgotten, it is to be let back in (`scoring::MAX_BLOCKED`).
    pub fn block(&mut self, peer: PeerId) -> Option<PeerId> {
        self.members.remove(&peer);
        self.blocked.block(peer)
    }

    pub fn is_blocked(&self, peer: &PeerId) -> bool {
        self.blocked.contains(peer)
    }

    pub fn blocked_count(&self) -> usize {
        self.blocked.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_candidates_leave_out_peers_on_slow_links() {
        let mut table = PeerTable::new(Duration::from_secs(10));
        let (fast, slow) = (PeerId::random(), PeerId::random());
        let sent = std::sync::atomic::AtomicU64::new(1);
        let beat = |step| murmur_protocol::heartbeat::Heartbeat {
            sent_ms: sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            version: murmur_protocol::heartbeat::HEARTBEAT_VERSION,
            run_id: "run".into(),
            fingerprint: "f".into(),
            step,
            epoch: 0,
            loss_ema: 1.0,
            samples_seen: 0,
            mode: SyncMode::Gossip,
            role: Role::Worker,
            leaving: false,
            finished: false,
            client: false,
        };
        let now = std::time::Instant::now();
        table.members_mut().observe(fast, &beat(500), now);
        table.members_mut().observe(slow, &beat(100), now);
        let gate_clock = |table: &PeerTable| {
            table
                .gate_candidates(SyncMode::Gossip)
                .map(|(_, step)| step)
                .min()
        };
        assert_eq!(gate_clock(&table), Some(100));
        assert!(table.set_slow(BTreeSet::from([slow])));
        assert_eq!(gate_clock(&table), Some(500));
        assert!(!table.set_slow(BTreeSet::from([slow])), "no change");
        assert!(table.set_slow(BTreeSet::from([slow, fast])));
        assert_eq!(gate_clock(&table), None);
        assert!(table.set_slow(BTreeSet::new()));
        assert_eq!(gate_clock(&table), Some(100));
    }
}
