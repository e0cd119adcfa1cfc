//! The live-peer view of a run, built from heartbeats: who is alive, how far each has got, and
//! who left or went silent; and how this node is connected to a peer ([`ConnectionKind`]).
//! Sans-IO: callers pass the time in, so tests are plain tables.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::heartbeat::{Heartbeat, Role, SyncMode};

/// Live peers a node keeps at most: heartbeats of further new peers are ignored until some
/// leave or time out, so that fresh identities cannot grow the table (and every loop over it)
/// without bound.
pub const MAX_MEMBERS: usize = 512;

/// What this node knows of one live peer.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerView {
    pub step: u64,
    pub epoch: u64,
    pub loss_ema: f32,
    pub samples_seen: u64,
    pub mode: SyncMode,
    pub role: Role,
    pub finished: bool,
    /// The peer cannot accept connections (client mode).
    pub client: bool,
    pub last_seen: Instant,
}

/// A change in membership.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change<P> {
    Joined(P),
    /// Said goodbye (a heartbeat with `leaving`).
    Left(P),
    /// Not heard from within the peer timeout.
    TimedOut(P),
    /// A new peer's heartbeat was ignored: the table holds [`MAX_MEMBERS`] peers.
    Full(P),
    /// A heartbeat not newer than the last taken from the peer (a replay) was ignored.
    Replayed(P),
}

/// How long the last send time of a peer that left or went silent is kept: longer than the
/// clock window, so that a replay of its heartbeats is refused by one or the other.
const SENT_MEMORY: Duration = Duration::from_secs(600);

/// Live members of one run, keyed by peer id `P`.
#[derive(Clone, Debug)]
pub struct Membership<P> {
    peer_timeout: Duration,
    max_members: usize,
    peers: BTreeMap<P, PeerView>,
    /// Each peer's last heartbeat send time taken, and when it was taken (members and, for
    /// [`SENT_MEMORY`], peers gone).
    last_sent: BTreeMap<P, (u64, Instant)>,
}

impl<P: Ord + Clone> Membership<P> {
    pub fn new(peer_timeout: Duration) -> Self {
        Membership {
            peer_timeout,
            max_members: MAX_MEMBERS,
            peers: BTreeMap::new(),
            last_sent: BTreeMap::new(),
        }
    }

    /// At most `max_members` live peers instead of [`MAX_MEMBERS`].
    pub fn with_max_members(mut self, max_members: usize) -> Self {
        self.max_members = max_members;
        self
    }

    /// Records a heartbeat (already checked for run and model) from `peer` at `now`.
    pub fn observe(&mut self, peer: P, hb: &Heartbeat, now: Instant) -> Option<Change<P>> {
        let full = self.peers.len() >= self.max_members;
        // Bounded like the table: one entry per member, and gone peers only for a while.
        let crowded = self.last_sent.len() >= 4 * self.max_members;
        match self.last_sent.get_mut(&peer) {
            Some((last, _)) if hb.sent_ms <= *last => return Some(Change::Replayed(peer)),
            // A known sender's next heartbeat, the common case: its time is overwritten in
            // place, with no second lookup and no copy of its id (the simulator's 64 peers
            // spent a tenth of their time in this method).
            Some(sent) if !full && !crowded => *sent = (hb.sent_ms, now),
            _ => {
                if full && !self.peers.contains_key(&peer) {
                    return Some(Change::Full(peer));
                }
                if crowded {
                    self.forget_old_send_times(now);
                }
                self.last_sent.insert(peer.clone(), (hb.sent_ms, now));
            }
        }
        if hb.leaving {
            return self.peers.remove(&peer).map(|_| Change::Left(peer));
        }
        let view = PeerView {
            step: hb.step,
            epoch: hb.epoch,
            loss_ema: hb.loss_ema,
            samples_seen: hb.samples_seen,
            mode: hb.mode,
            role: hb.role,
            finished: hb.finished,
            client: hb.client,
            last_seen: now,
        };
        match self.peers.get_mut(&peer) {
            Some(member) => {
                *member = view;
                None
            }
            None => {
                self.peers.insert(peer.clone(), view);
                Some(Change::Joined(peer))
            }
        }
    }

    /// Forgets the send times of peers gone for longer than [`SENT_MEMORY`] (the oldest
    /// first, down to the members' own, if there are too many).
    fn forget_old_send_times(&mut self, now: Instant) {
        let peers = &self.peers;
        self.last_sent.retain(|p, (_, taken)| {
            peers.contains_key(p) || now.saturating_duration_since(*taken) <= SENT_MEMORY
        });
        while self.last_sent.len() >= 4 * self.max_members {
            let oldest = self
                .last_sent
                .iter()
                .filter(|(p, _)| !self.peers.contains_key(p))
                .min_by_key(|(_, (_, taken))| *taken)
                .map(|(p, _)| p.clone());
            match oldest {
                Some(p) => self.last_sent.remove(&p),
                None => break,
            };
        }
    }

    /// Forgets peers not heard from within the timeout, and says who they were.
    pub fn expire(&mut self, now: Instant) -> Vec<Change<P>> {
        self.forget_old_send_times(now);
        let timeout = self.peer_timeout;
        let silent: Vec<P> = self
            .peers
            .iter()
            .filter(|(_, v)| now.saturating_duration_since(v.last_seen) > timeout)
            .map(|(p, _)| p.clone())
            .collect();
        for peer in &silent {
            self.peers.remove(peer);
        }
        silent.into_iter().map(Change::TimedOut).collect()
    }

    /// When the first live peer times out if it stays silent: the moment to call
    /// [`Membership::expire`] next.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.peers
            .values()
            .map(|v| v.last_seen + self.peer_timeout)
            .min()
    }

    /// Removes a peer at once (a dropped connection to a blocked peer, say).
    pub fn remove(&mut self, peer: &P) -> Option<PeerView> {
        self.peers.remove(peer)
    }

    pub fn get(&self, peer: &P) -> Option<&PeerView> {
        self.peers.get(peer)
    }

    /// Live peers in id order.
    pub fn peers(&self) -> impl Iterator<Item = (&P, &PeerView)> {
        self.peers.iter()
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The smallest clock among live peers: what the staleness gate compares against.
    pub fn min_step(&self) -> Option<u64> {
        self.peers.values().map(|v| v.step).min()
    }

    /// The smallest clock among live peers that are coupled to this one: same sync mode, not
    /// still joining (a joiner catches up by state sync, not by holding others back) and not
    /// finished (its clock has stopped for good).
    pub fn min_coupled_step(&self, mode: SyncMode) -> Option<u64> {
        self.min_coupled_step_except(mode, |_| false)
    }

    /// [`min_coupled_step`](Self::min_coupled_step) leaving out the peers `uncoupled` says
    /// are not waited for (those on slow links, decision 0029).
    pub fn min_coupled_step_except(
        &self,
        mode: SyncMode,
        uncoupled: impl Fn(&P) -> bool,
    ) -> Option<u64> {
        self.peers
            .iter()
            .filter(|(peer, v)| {
                v.mode == mode && v.role != Role::Joining && !v.finished && !uncoupled(peer)
            })
            .map(|(_, v)| v.step)
            .min()
    }

    /// Records a clock seen in a tensor frame, fresher than the last heartbeat; whether the
    /// peer's clock moved.
    pub fn saw_step(&mut self, peer: &P, step: u64) -> bool {
        match self.peers.get_mut(peer) {
            Some(view) if step > view.step => {
                view.step = step;
                true
            }
            _ => false,
        }
    }
}

/// How this node is connected to a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnectionKind {
    /// Dialled directly, one way or the other.
    Direct,
    /// Direct, made by a hole punch over a relayed connection (DCUtR).
    HolePunched,
    /// Through a relay.
    Relayed,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::heartbeat::HEARTBEAT_VERSION;

    /// A heartbeat sent later than every one before it.
    fn hb(step: u64, leaving: bool) -> Heartbeat {
        static SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Heartbeat {
            sent_ms: SENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            version: HEARTBEAT_VERSION,
            run_id: "r".into(),
            fingerprint: "f".into(),
            step,
            epoch: 0,
            loss_ema: 1.0,
            samples_seen: step * 64,
            mode: SyncMode::Solo,
            role: Role::Worker,
            leaving,
            finished: false,
            client: false,
        }
    }

    #[test]
    fn heartbeats_drive_joins_updates_leaves_and_timeouts() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut m = Membership::new(Duration::from_secs(5));
        // (time, peer, step, leaving, expected change)
        type Row = (u64, &'static str, u64, bool, Option<Change<&'static str>>);
        let table: [Row; 6] = [
            (0, "a", 10, false, Some(Change::Joined("a"))),
            (1, "b", 4, false, Some(Change::Joined("b"))),
            (2, "a", 12, false, None),
            (3, "c", 9, false, Some(Change::Joined("c"))),
            (4, "c", 9, true, Some(Change::Left("c"))),
            (5, "c", 9, true, None),
        ];
        for (at, peer, step, leaving, expected) in table {
            assert_eq!(
                m.observe(peer, &hb(step, leaving), s(at)),
                expected,
                "t={at} {peer}"
            );
        }
        assert_eq!(m.len(), 2);
        assert_eq!(m.get(&"a").unwrap().step, 12);
        assert_eq!(m.min_step(), Some(4));
        // b was last heard at t=1: still live at t=6, gone at t=7; a (t=2) goes at t=8.
        assert_eq!(m.next_expiry(), Some(s(6)));
        assert!(m.expire(s(6)).is_empty());
        assert_eq!(m.expire(s(7)), [Change::TimedOut("b")]);
        assert_eq!(m.min_step(), Some(12));
        assert_eq!(m.next_expiry(), Some(s(7)));
        assert_eq!(m.expire(s(8)), [Change::TimedOut("a")]);
        assert!(m.is_empty());
        assert_eq!(m.next_expiry(), None);
        assert_eq!(m.min_step(), None);
    }

    #[test]
    fn replayed_heartbeats_and_goodbyes_change_nothing() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(5));
        let sent = |hb: Heartbeat, sent_ms| Heartbeat { sent_ms, ..hb };
        assert_eq!(
            m.observe("a", &sent(hb(10, false), 100), t0),
            Some(Change::Joined("a"))
        );
        // A replay of that heartbeat, or an older one, changes neither the clock nor the time
        // the peer was last heard.
        let later = t0 + Duration::from_secs(3);
        assert_eq!(
            m.observe("a", &sent(hb(10, false), 100), later),
            Some(Change::Replayed("a"))
        );
        assert_eq!(
            m.observe("a", &sent(hb(2, false), 50), later),
            Some(Change::Replayed("a"))
        );
        assert_eq!(m.get(&"a").map(|v| (v.step, v.last_seen)), Some((10, t0)));
        // "a" leaves and comes back; its old goodbye, replayed, does not make it leave again.
        let goodbye = sent(hb(12, true), 200);
        assert_eq!(m.observe("a", &goodbye, later), Some(Change::Left("a")));
        assert_eq!(
            m.observe("a", &sent(hb(0, false), 300), later),
            Some(Change::Joined("a"))
        );
        assert_eq!(m.observe("a", &goodbye, later), Some(Change::Replayed("a")));
        assert_eq!(m.len(), 1);
        // Gone and timed out: its old heartbeats do not bring back a ghost while remembered.
        assert_eq!(
            m.expire(later + Duration::from_secs(10)),
            [Change::TimedOut("a")]
        );
        let ghost = sent(hb(0, false), 300);
        assert_eq!(
            m.observe("a", &ghost, later + Duration::from_secs(11)),
            Some(Change::Replayed("a"))
        );
        assert!(m.is_empty());
    }

    #[test]
    fn a_full_table_ignores_new_peers_and_keeps_hearing_its_members() {
        let now = Instant::now();
        let mut m = Membership::new(Duration::from_secs(5)).with_max_members(2);
        assert_eq!(m.observe(1, &hb(5, false), now), Some(Change::Joined(1)));
        assert_eq!(m.observe(2, &hb(5, false), now), Some(Change::Joined(2)));
        assert_eq!(m.observe(3, &hb(5, false), now), Some(Change::Full(3)));
        assert_eq!(
            m.observe(2, &hb(6, false), now),
            None,
            "members are still heard"
        );
        assert_eq!(m.len(), 2);
        m.observe(1, &hb(5, true), now);
        assert_eq!(m.observe(3, &hb(5, false), now), Some(Change::Joined(3)));
    }

    #[test]
    fn joiners_and_other_modes_do_not_hold_back_the_gate() {
        let now = Instant::now();
        let mut m = Membership::new(Duration::from_secs(5));
        let beat = |step, mode, role| Heartbeat {
            mode,
            role,
            ..hb(step, false)
        };
        assert_eq!(m.min_coupled_step(SyncMode::Gossip), None);
        m.observe("a", &beat(50, SyncMode::Gossip, Role::Worker), now);
        m.observe("b", &beat(0, SyncMode::Gossip, Role::Joining), now);
        m.observe("c", &beat(3, SyncMode::Solo, Role::Worker), now);
        m.observe("d", &beat(70, SyncMode::Gossip, Role::Center), now);
        let done = Heartbeat {
            finished: true,
            client: false,
            ..beat(20, SyncMode::Gossip, Role::Worker)
        };
        m.observe("e", &done, now);
        assert_eq!(m.min_coupled_step(SyncMode::Gossip), Some(50));
        // A peer left out (on a slow link) holds no one back.
        assert_eq!(
            m.min_coupled_step_except(SyncMode::Gossip, |p| *p == "a"),
            Some(70)
        );
        assert_eq!(m.min_step(), Some(0));
        m.remove(&"e");
        // A frame stamped with a newer step moves the clock forward, never back.
        assert!(m.saw_step(&"a", 60));
        assert!(!m.saw_step(&"a", 55), "no move back");
        assert!(!m.saw_step(&"z", 90), "an unknown peer");
        assert_eq!(m.get(&"a").map(|v| v.step), Some(60));
    }
}
