//! A node's open sides of its streams: with which peer each is and what it is, so that the
//! daemon's engine bounds inbound streams, ends the sides of a peer that left, and tells the
//! policy how each side ended, by rules written once here.
//!
//! The engine keys each side by what it tracks it by (its task's id) and keeps the side's
//! machine and I/O itself; the book keeps only what the rules need.

use std::collections::BTreeMap;

use libp2p_identity::PeerId;

use crate::policy::{Failure, Input, Outcome};

/// Inbound streams a node serves at once; more are dropped (bounds receive memory).
pub const MAX_INBOUND: usize = 4;
/// Inbound streams of one peer served at once: an honest peer has one exchange with a node at
/// a time (and perhaps a state request), so no peer takes the whole budget.
pub const MAX_INBOUND_PER_PEER: usize = 2;

/// What an open side of a stream is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// An inbound stream whose request is being read.
    Request,
    /// An exchange this node started: a pairwise offer, or an elastic worker's request.
    Exchange,
    /// A request this node answers as its policy decided; `pairwise` when the answer took the
    /// policy's pairwise slot (an offer it exchanges with).
    Serve { pairwise: bool },
    /// A state sync this node asked for.
    Pull,
    /// Work of the node's own (a ring round, seeding the center), filed under the node itself:
    /// no peer's leaving ends it.
    Own,
}

impl Side {
    /// Whether the side reads a stream another peer opened.
    pub fn is_inbound(self) -> bool {
        matches!(self, Side::Request | Side::Serve { .. })
    }

    /// What the policy hears when this side, with `peer`, ends with `outcome`. A state sync that took the state over is not an end
    /// this gives (its input carries the state adopted); a node's own work has none.
    pub fn ended(self, peer: PeerId, outcome: Outcome) -> Option<Input> {
        match self {
            Side::Exchange => Some(Input::Exchanged { peer, outcome }),
            Side::Serve { pairwise: true } => Some(Input::Served { peer, outcome }),
            Side::Request | Side::Serve { pairwise: false } => {
                Some(Input::Answered { peer, outcome })
            }
            Side::Pull => Some(Input::StateSynced {
                peer,
                result: Err(outcome),
            }),
            Side::Own => None,
        }
    }

    /// What the policy hears when this side is given up because `peer` left. A request still
    /// being read or answered outside the pairwise slot holds nothing of the policy's, so it
    /// ends silently.
    pub fn cancelled(self, peer: PeerId) -> Option<Input> {
        match self {
            Side::Request | Side::Serve { pairwise: false } => None,
            side => side.ended(peer, Outcome::Failed(Failure::PeerLeft)),
        }
    }
}

/// The open sides, by the driver's key (ordered, so that a simulated run ends a peer's sides
/// in the same order every time).
#[derive(Clone, Debug)]
pub struct Sides<K> {
    open: BTreeMap<K, (PeerId, Side)>,
}

impl<K> Default for Sides<K> {
    fn default() -> Self {
        Sides {
            open: BTreeMap::new(),
        }
    }
}

impl<K: Ord + Copy> Sides<K> {
    /// Files `side`, with `peer`, under `key` (a side filed again under its key is what it
    /// became: a request read becomes the answer to it).
    pub fn open(&mut self, key: K, peer: PeerId, side: Side) {
        self.open.insert(key, (peer, side));
    }

    /// Whether a new inbound stream from `peer` may be read: [`MAX_INBOUND`] in all and
    /// [`MAX_INBOUND_PER_PEER`] of one peer at a time.
    pub fn admits(&self, peer: &PeerId) -> bool {
        let (all, of_peer) = (self.open.values())
            .filter(|(_, side)| side.is_inbound())
            .fold((0, 0), |(all, of_peer), (from, _)| {
                (all + 1, of_peer + usize::from(from == peer))
            });
        all < MAX_INBOUND && of_peer < MAX_INBOUND_PER_PEER
    }

    /// The sides that end when `peer` leaves: every side with it but the node's own work.
    pub fn with(&self, peer: &PeerId) -> Vec<K> {
        self.open
            .iter()
            .filter(|(_, (p, side))| p == peer && *side != Side::Own)
            .map(|(key, _)| *key)
            .collect()
    }

    /// The side filed under `key`, now closed.
    pub fn close(&mut self, key: K) -> Option<(PeerId, Side)> {
        self.open.remove(&key)
    }

    /// Closes the side under `key` and says what the policy hears of its end with `outcome`.
    pub fn ended(&mut self, key: K, outcome: Outcome) -> Option<Input> {
        let (peer, side) = self.close(key)?;
        side.ended(peer, outcome)
    }

    pub fn len(&self) -> usize {
        self.open.len()
    }

    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_INBOUND, MAX_INBOUND_PER_PEER, Side, Sides};
    use crate::policy::{Failure, Input, Outcome};
    use libp2p_identity::PeerId;

    #[test]
    fn each_side_ends_in_the_input_of_its_kind() {
        let peer = PeerId::random();
        let busy = || Outcome::Busy;
        let cases = [
            (Side::Exchange, "Exchanged"),
            (Side::Serve { pairwise: true }, "Served"),
            (Side::Serve { pairwise: false }, "Answered"),
            (Side::Request, "Answered"),
            (Side::Pull, "StateSynced"),
        ];
        for (side, expected) in cases {
            let input = side
                .ended(peer, busy())
                .expect("a side with a peer ends in an input");
            let name = match input {
                Input::Exchanged { outcome, .. } => ("Exchanged", outcome),
                Input::Served { outcome, .. } => ("Served", outcome),
                Input::Answered { outcome, .. } => ("Answered", outcome),
                Input::StateSynced { result, .. } => ("StateSynced", result.unwrap_err()),
                other => panic!("{side:?} ended in {other:?}"),
            };
            assert_eq!(name, (expected, Outcome::Busy), "{side:?}");
        }
        assert!(Side::Own.ended(peer, busy()).is_none());
    }

    #[test]
    fn a_peer_that_leaves_ends_its_sides_and_the_policy_hears_of_those_that_hold_its_slots() {
        let (gone, other) = (PeerId::random(), PeerId::random());
        let mut sides = Sides::default();
        sides.open(1, gone, Side::Exchange);
        sides.open(2, gone, Side::Request);
        sides.open(3, gone, Side::Serve { pairwise: true });
        sides.open(4, other, Side::Exchange);
        sides.open(5, gone, Side::Own);
        sides.open(6, gone, Side::Pull);
        assert_eq!(sides.with(&gone), vec![1, 2, 3, 6]);
        // As a driver gives a side up: closed, then what the policy hears of it.
        let mut cancel = |key| {
            sides
                .close(key)
                .and_then(|(peer, side)| side.cancelled(peer))
        };
        let left = Outcome::Failed(Failure::PeerLeft);
        assert!(matches!(
            cancel(1),
            Some(Input::Exchanged { outcome, .. }) if outcome == left
        ));
        assert!(cancel(2).is_none(), "a request read holds no slot");
        assert!(matches!(cancel(3), Some(Input::Served { .. })));
        assert!(matches!(
            cancel(6),
            Some(Input::StateSynced { result: Err(outcome), .. }) if outcome == left
        ));
        assert!(cancel(1).is_none(), "a side ends once");
        assert_eq!(sides.len(), 2);
    }

    #[test]
    fn inbound_streams_are_bounded_in_all_and_per_peer() {
        let mut sides = Sides::default();
        let greedy = PeerId::random();
        for key in 0..MAX_INBOUND_PER_PEER {
            assert!(sides.admits(&greedy));
            sides.open(key, greedy, Side::Request);
        }
        assert!(!sides.admits(&greedy), "one peer holds at most its share");
        // Outbound sides and the node's own work take no inbound slot.
        sides.open(100, PeerId::random(), Side::Exchange);
        sides.open(101, PeerId::random(), Side::Own);
        let mut key = MAX_INBOUND_PER_PEER;
        while key < MAX_INBOUND {
            let peer = PeerId::random();
            assert!(sides.admits(&peer));
            sides.open(key, peer, Side::Serve { pairwise: true });
            key += 1;
        }
        assert!(
            !sides.admits(&PeerId::random()),
            "at most {MAX_INBOUND} in all"
        );
        sides.close(0);
        assert!(sides.admits(&greedy));
    }
}
