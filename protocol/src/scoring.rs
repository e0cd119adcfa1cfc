//! Peer scoring: every invalid message a peer sends is an offence; a peer with too many
//! offences within a window is blocked. Sans-IO like the rest of the sync logic.
//!
//! Identities cost nothing, so neither the offences remembered nor the peers blocked may grow
//! with the number of identities an attacker mints: both are bounded, forgetting the oldest.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

/// What to do with a peer after an offence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Counted; `offences` within the window so far.
    Warned { offences: u32 },
    /// Too many offences: disconnect and refuse the peer.
    Block,
}

/// Peers whose offences are remembered at most; past it, the peer whose last offence is the
/// oldest is forgotten.
pub const MAX_OFFENDERS: usize = 1024;
/// Peers blocked at most; past it, the peer blocked longest ago is let back in (it can come
/// back under a new identity anyway).
pub const MAX_BLOCKED: usize = 1024;

/// Offence counts per peer within a sliding window.
#[derive(Clone, Debug)]
pub struct PeerScores<P> {
    block_after: u32,
    window: Duration,
    offences: BTreeMap<P, Vec<Instant>>,
}

impl<P: Ord + Clone> PeerScores<P> {
    /// Blocks a peer at its `block_after`-th offence within `window`.
    pub fn new(block_after: u32, window: Duration) -> Self {
        PeerScores {
            block_after: block_after.max(1),
            window,
            offences: BTreeMap::new(),
        }
    }

    /// Records one offence of `peer` at `now`.
    pub fn offence(&mut self, peer: &P, now: Instant) -> Verdict {
        let window = self.window;
        let times = self.offences.entry(peer.clone()).or_default();
        times.retain(|&t| now.saturating_duration_since(t) <= window);
        times.push(now);
        let offences = u32::try_from(times.len()).unwrap_or(u32::MAX);
        if self.offences.len() > MAX_OFFENDERS {
            self.forget_one(peer);
        }
        if offences >= self.block_after {
            Verdict::Block
        } else {
            Verdict::Warned { offences }
        }
    }

    /// Forgets the peer other than `keep` whose last offence is the oldest.
    fn forget_one(&mut self, keep: &P) {
        let oldest = self
            .offences
            .iter()
            .filter(|(peer, _)| *peer != keep)
            .min_by_key(|(_, times)| times.last().copied())
            .map(|(peer, _)| peer.clone());
        if let Some(oldest) = oldest {
            self.offences.remove(&oldest);
        }
    }

    /// Offences of `peer` still within the window at `now`.
    pub fn offences(&self, peer: &P, now: Instant) -> u32 {
        self.offences.get(peer).map_or(0, |times| {
            let n = times
                .iter()
                .filter(|&&t| now.saturating_duration_since(t) <= self.window)
                .count();
            u32::try_from(n).unwrap_or(u32::MAX)
        })
    }
}

/// The peers blocked, at most [`MAX_BLOCKED`] of them.
#[derive(Clone, Debug)]
pub struct BlockList<P> {
    /// Oldest first.
    order: VecDeque<P>,
    members: BTreeSet<P>,
}

impl<P> Default for BlockList<P> {
    fn default() -> Self {
        BlockList {
            order: VecDeque::new(),
            members: BTreeSet::new(),
        }
    }
}

impl<P: Ord + Clone> BlockList<P> {
    /// Blocks `peer`. Returns the peer blocked longest ago if the list was full: it is
    /// forgotten, and must be let back in wherever it was refused.
    pub fn block(&mut self, peer: P) -> Option<P> {
        if !self.members.insert(peer.clone()) {
            return None;
        }
        self.order.push_back(peer);
        if self.order.len() <= MAX_BLOCKED {
            return None;
        }
        let oldest = self.order.pop_front()?;
        self.members.remove(&oldest);
        Some(oldest)
    }

    pub fn contains(&self, peer: &P) -> bool {
        self.members.contains(peer)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_offences_within_the_window_block() {
        let t0 = Instant::now();
        let s = |secs: u64| t0 + Duration::from_secs(secs);
        let mut scores = PeerScores::new(3, Duration::from_secs(60));
        let table = [
            (0, "a", Verdict::Warned { offences: 1 }),
            (10, "a", Verdict::Warned { offences: 2 }),
            (20, "b", Verdict::Warned { offences: 1 }),
            // a's first offence (t=0) has left the 60 s window by t=65.
            (65, "a", Verdict::Warned { offences: 2 }),
            (66, "a", Verdict::Block),
        ];
        for (at, peer, expected) in table {
            assert_eq!(scores.offence(&peer, s(at)), expected, "t={at} {peer}");
        }
        assert_eq!(scores.offences(&"b", s(21)), 1);
        assert_eq!(scores.offences(&"b", s(200)), 0);
    }

    #[test]
    fn offenders_and_blocked_peers_stay_bounded_however_many_identities_offend() {
        let t0 = Instant::now();
        let mut scores = PeerScores::new(3, Duration::from_secs(60));
        for peer in 0..3 * MAX_OFFENDERS as u64 {
            scores.offence(&peer, t0 + Duration::from_millis(peer));
        }
        assert_eq!(scores.offences.len(), MAX_OFFENDERS);
        // The newest are remembered; the oldest were forgotten first.
        let newest = 3 * MAX_OFFENDERS as u64 - 1;
        assert_eq!(scores.offences(&newest, t0), 1);
        assert_eq!(scores.offences(&0, t0), 0);
        // A peer offending again is not the one forgotten, however old its first offence.
        let mut scores = PeerScores::new(3, Duration::from_secs(60));
        for peer in 0..MAX_OFFENDERS as u64 {
            scores.offence(&peer, t0 + Duration::from_millis(peer));
        }
        let later = t0 + Duration::from_secs(1);
        assert_eq!(scores.offence(&0, later), Verdict::Warned { offences: 2 });
        scores.offence(&(MAX_OFFENDERS as u64), later);
        assert_eq!(
            scores.offences(&1, later),
            0,
            "the oldest last offence is forgotten"
        );
        assert_eq!(scores.offence(&0, later), Verdict::Block);

        let mut blocked = BlockList::default();
        for peer in 0..MAX_BLOCKED as u64 {
            assert_eq!(blocked.block(peer), None);
        }
        assert_eq!(blocked.block(0), None, "blocked already");
        assert_eq!(
            blocked.block(MAX_BLOCKED as u64),
            Some(0),
            "the oldest goes"
        );
        assert_eq!(blocked.len(), MAX_BLOCKED);
        assert!(!blocked.contains(&0));
        assert!(blocked.contains(&1) && blocked.contains(&(MAX_BLOCKED as u64)));
    }
}
