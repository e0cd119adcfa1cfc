//! Peer scoring: every invalid message a peer sends is an offence; a peer with too many
//! offences within a window is blocked. Sans-IO like the rest of the sync logic.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What to do with a peer after an offence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Counted; `offences` within the window so far.
    Warned { offences: u32 },
    /// Too many offences: disconnect and refuse the peer.
    Block,
}

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
        if offences >= self.block_after {
            Verdict::Block
        } else {
            Verdict::Warned { offences }
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
}
