//! What this node answers peers within: state requests (a request is a few bytes, its answer
//! the whole model two or three times over) and exchanges (each a replica both ways and a
//! pause of training). Without budgets, any peer could turn a trickle of requests into this
//! node's whole upload.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use libp2p_identity::PeerId;

use super::MAX_STATE_SYNC_TRIES;

/// The window the budgets count answers in.
pub const STATE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
/// State answers to one peer per window: a joiner's tries (`MAX_STATE_SYNC_TRIES`).
pub const STATE_ANSWERS_PER_PEER: usize = MAX_STATE_SYNC_TRIES as usize;
/// State answers to all peers together per window: a few joiners at once.
pub const STATE_ANSWERS: usize = 12;

/// When this node began its recent state answers, per peer and in all.
#[derive(Debug, Default)]
pub(super) struct StateBudget {
    per_peer: HashMap<PeerId, VecDeque<Instant>>,
    all: VecDeque<Instant>,
}

impl StateBudget {
    /// Whether `peer` may have another state answer at `now`; if so, it is counted.
    pub(super) fn take(&mut self, peer: PeerId, now: Instant) -> bool {
        let recent = |at: &Instant| now.saturating_duration_since(*at) < STATE_WINDOW;
        self.all.retain(recent);
        // Every entry holds an answer within the window, so there are at most
        // `STATE_ANSWERS` of them.
        self.per_peer.retain(|_, answers| {
            answers.retain(recent);
            !answers.is_empty()
        });
        let answers = self.per_peer.get(&peer).map_or(0, VecDeque::len);
        if self.all.len() >= STATE_ANSWERS || answers >= STATE_ANSWERS_PER_PEER {
            return false;
        }
        self.all.push_back(now);
        self.per_peer.entry(peer).or_default().push_back(now);
        true
    }
}

/// The window answered exchanges are counted in.
pub const SHARE_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);
/// Exchanges answered to one peer per window before its share is looked at: a small or quiet
/// swarm never holds a partner back.
pub const SHARE_FREE: usize = 16;
/// A peer is answered at most this many times an even share of the exchanges this node
/// answered in the window (their number over its live peers).
pub const SHARE_FACTOR: usize = 3;
/// Answers remembered at most, the oldest forgotten first: a bound on memory whatever the
/// rate (a busy node of a tiny model answers some 30 a second).
const SHARE_MEMORY: usize = 4096;

/// Who this node answered exchanges (and elastic workers) for lately. Every answer costs a
/// replica each way and a pause of training: without a share, one peer offering back to back
/// would take this node's whole upload and keep its trainer waiting.
#[derive(Debug, Default)]
pub(super) struct ExchangeShare {
    answered: VecDeque<(Instant, PeerId)>,
}

impl ExchangeShare {
    /// Whether `peer` may be answered another exchange at `now`, among `live` peers of this
    /// node; if so, it is counted.
    pub(super) fn take(&mut self, peer: PeerId, live: usize, now: Instant) -> bool {
        while self
            .answered
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= SHARE_WINDOW)
        {
            self.answered.pop_front();
        }
        let theirs = self.answered.iter().filter(|(_, p)| *p == peer).count();
        let share = (SHARE_FACTOR * self.answered.len()).div_ceil(live.max(1));
        if theirs >= share.max(SHARE_FREE) {
            return false;
        }
        if self.answered.len() == SHARE_MEMORY {
            self.answered.pop_front();
        }
        self.answered.push_back((now, peer));
        true
    }
}
