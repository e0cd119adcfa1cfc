//! The peer table: the live peers of the run as this node sees them (built from their
//! heartbeats by the membership rules of the protocol crate), how it is connected to each,
//! and the offences it counted and whom it blocked for them. The membership actor alone
//! changes it, through the rules written here once;
//! the sync engine and the staleness gate decide on the copies it publishes.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::{Heartbeat, Role, SyncMode};
use murmur_protocol::membership::{Change, ConnectionKind, Membership, PeerView};
use murmur_protocol::scoring::{BlockList, PeerScores, Verdict};

/// A map keyed by peer ids that the rules consult for every partner at every exchange or
/// step. The standard library's SipHash on peer ids was a sixth of a simulated swarm's time;
/// foldhash is seeded per map, so identities a stranger grinds cannot be aimed at one bucket.
pub(crate) type PeerMap<V> = HashMap<PeerId, V, foldhash::fast::RandomState>;

/// Offences within [`OFFENCE_WINDOW`] after which a peer is blocked.
pub const BLOCK_AFTER_OFFENCES: u32 = 3;
pub const OFFENCE_WINDOW: Duration = Duration::from_secs(60);

/// A moving average: `new` alone at first, then `old + weight (new - old)`.
pub fn moving_average(old: Option<f64>, new: f64, weight: f64) -> f64 {
    old.map_or(new, |old| old + weight * (new - old))
}

/// What became of a heartbeat the table heard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Heard {
    /// From a blocked peer: ignored, however it reached this node.
    Blocked,
    /// Taken by the membership rules; what it changed, if anything worth a line.
    Taken(Option<Change<PeerId>>),
}

/// What an offence did to the peer that committed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offence {
    /// Counted: `offences` within [`OFFENCE_WINDOW`], fewer than [`BLOCK_AFTER_OFFENCES`].
    Warned { offences: u32 },
    /// Blocked: forgotten and refused from now on. `let_back_in` is the peer blocked longest
    /// ago, forgotten because the block list was full (`scoring::MAX_BLOCKED`).
    Blocked { let_back_in: Option<PeerId> },
}

/// The live peers of the run as this node sees them, how it is connected to each, and the
/// peers it blocked: what the membership actor publishes, and what the staleness gate and the
/// sync engine decide on.
#[derive(Clone, Debug)]
pub struct PeerTable {
    members: Membership<PeerId>,
    /// Offences per peer: blocked after [`BLOCK_AFTER_OFFENCES`] within [`OFFENCE_WINDOW`].
    scores: PeerScores<PeerId>,
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
            scores: PeerScores::new(BLOCK_AFTER_OFFENCES, OFFENCE_WINDOW),
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

    /// For the membership actor: `peer`'s heartbeat, delivered at `now`, taken by the
    /// membership rules unless `peer` is blocked.
    pub fn heard(&mut self, peer: PeerId, heartbeat: &Heartbeat, now: Instant) -> Heard {
        if self.is_blocked(&peer) {
            return Heard::Blocked;
        }
        Heard::Taken(self.members.observe(peer, heartbeat, now))
    }

    /// For the membership actor: `peer` committed an offence at `now` (sent something
    /// invalid, or timed out an exchange it held). At the limit it is blocked.
    pub fn offence(&mut self, peer: PeerId, now: Instant) -> Offence {
        match self.scores.offence(&peer, now) {
            Verdict::Warned { offences } => Offence::Warned { offences },
            Verdict::Block => {
                self.members.remove(&peer);
                let let_back_in = self.blocked.block(peer);
                Offence::Blocked { let_back_in }
            }
        }
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

    /// A heartbeat of the run at `step`, its send time `sent_ms` (its sequence number).
    fn beat(step: u64, sent_ms: u64) -> Heartbeat {
        Heartbeat {
            sent_ms,
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
        }
    }

    #[test]
    fn the_gate_candidates_leave_out_peers_on_slow_links() {
        let mut table = PeerTable::new(Duration::from_secs(10));
        let (fast, slow) = (PeerId::random(), PeerId::random());
        let now = Instant::now();
        table.heard(fast, &beat(500, 1), now);
        table.heard(slow, &beat(100, 2), now);
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

    #[test]
    fn a_peer_is_blocked_at_its_third_offence_within_the_window_and_its_heartbeats_ignored() {
        let mut table = PeerTable::new(Duration::from_secs(10));
        let (offender, honest) = (PeerId::random(), PeerId::random());
        let t0 = Instant::now();
        assert_eq!(
            table.heard(offender, &beat(10, 1), t0),
            Heard::Taken(Some(Change::Joined(offender)))
        );
        table.heard(honest, &beat(10, 2), t0);
        // Offences further apart than the window do not add up.
        assert_eq!(table.offence(offender, t0), Offence::Warned { offences: 1 });
        let later = t0 + OFFENCE_WINDOW + Duration::from_secs(1);
        assert_eq!(
            table.offence(offender, later),
            Offence::Warned { offences: 1 }
        );
        assert_eq!(
            table.offence(offender, later),
            Offence::Warned { offences: 2 }
        );
        assert!(table.get(&offender).is_some(), "warned, still a member");
        assert_eq!(
            table.offence(offender, later),
            Offence::Blocked { let_back_in: None }
        );
        assert!(table.is_blocked(&offender));
        assert!(
            table.get(&offender).is_none(),
            "a blocked peer is forgotten"
        );
        assert_eq!(table.heard(offender, &beat(11, 3), later), Heard::Blocked);
        assert!(table.get(&offender).is_none(), "and stays out");
        assert_eq!(
            table.offence(honest, later),
            Offence::Warned { offences: 1 }
        );
        assert_eq!(table.heard(honest, &beat(11, 4), later), Heard::Taken(None));
        assert_eq!(table.blocked_count(), 1);
    }

    #[test]
    fn a_full_block_list_lets_the_peer_blocked_longest_ago_back_in() {
        let mut table = PeerTable::new(Duration::from_secs(10));
        let now = Instant::now();
        let block = |table: &mut PeerTable, peer| {
            (0..BLOCK_AFTER_OFFENCES)
                .map(|_| table.offence(peer, now))
                .last()
        };
        let first = PeerId::random();
        assert_eq!(
            block(&mut table, first),
            Some(Offence::Blocked { let_back_in: None })
        );
        for _ in 1..murmur_protocol::scoring::MAX_BLOCKED {
            block(&mut table, PeerId::random());
        }
        assert!(table.is_blocked(&first));
        assert_eq!(
            block(&mut table, PeerId::random()),
            Some(Offence::Blocked {
                let_back_in: Some(first)
            })
        );
        assert!(!table.is_blocked(&first));
    }
}
