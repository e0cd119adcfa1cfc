//! How many state requests this node answers. A request is a few bytes; its answer is the whole
//! model two or three times over (parameters, optimizer state, center): without a budget, any
//! peer could turn a trickle of requests into this node's whole upload.

use super::*;

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
