//! Ring rounds (`allreduce`): attempts, settling after an abort, suspects, catching up.

use std::collections::HashMap;
use std::time::Instant;

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::{Role, SyncMode};
use murmur_protocol::membership::PeerView;
use murmur_protocol::ring::{RingError, RingMembers};
use tracing::info;

use super::{Action, Policy, Pull, View};
use crate::rejection::Rejection;

/// Where a ring round stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum RingPhase {
    /// No attempt under way.
    Idle,
    /// Waiting for `min_peers` before the run's first round.
    WaitingForPeers,
    Attempting,
    /// Taking over the state of a member that completed the round.
    CatchingUp,
    /// After an abort at `failed_at`: waiting until the members were heard from since.
    Settling {
        failed_at: Instant,
    },
}

/// The `allreduce` side of the policy.
#[derive(Clone, Debug)]
pub(super) struct RingPolicy {
    pub(super) min_peers: usize,
    /// Whether the run is under way: a round with at least `min_peers` members completed, or
    /// this node took over a peer's state. From then on rounds go on with whoever is live.
    pub(super) started: bool,
    /// Members left out of rings since the abort at the given time, until heard from again.
    pub(super) suspects: HashMap<PeerId, Instant>,
    pub(super) told_waiting: bool,
    /// The number of the current (or next) attempt at the due round, from 1.
    pub(super) attempt: u32,
    pub(super) phase: RingPhase,
}

impl Policy {
    /// Moves the due round on as far as it can go now.
    pub(super) fn ring_advance(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(due) = self.due else {
            return Vec::new();
        };
        let round = due.step;
        let phase = match self.ring.as_ref() {
            Some(ring) => ring.phase,
            None => return Vec::new(),
        };
        match phase {
            RingPhase::Attempting | RingPhase::CatchingUp => return Vec::new(),
            RingPhase::Settling { failed_at } => {
                if !self.settled(failed_at, view) {
                    return Vec::new();
                }
            }
            RingPhase::Idle | RingPhase::WaitingForPeers => {}
        }
        let mut actions = Vec::new();
        if self.joining {
            if self.pulling.is_some() {
                return actions;
            }
            actions.extend(self.try_join(view));
            if self.pulling.is_some() {
                return actions;
            }
            if self.joining {
                if !self.first_of_the_run(view) {
                    return actions;
                }
                info!("no peer heard of: the first of the run, rounding alone until others come");
                actions.extend(self.mark_joined(view));
            }
        }
        if view.own_step != round {
            // The trainer took over a peer's state: this round is someone else's past.
            actions.extend(self.release());
            return actions;
        }
        let members = self.ring_members(view);
        let Some(ring) = self.ring.as_mut() else {
            return actions;
        };
        if !ring.started && members.len() < ring.min_peers {
            if !ring.told_waiting {
                info!(
                    have = members.len(),
                    need = ring.min_peers,
                    "waiting for trusted peers before the first ring round"
                );
                ring.told_waiting = true;
            }
            ring.phase = RingPhase::WaitingForPeers;
            return actions;
        }
        ring.phase = RingPhase::Attempting;
        actions.push(Action::Round {
            round,
            members,
            attempt: ring.attempt,
        });
        actions
    }

    /// Whether this node, still joining, has heard of no peer for the first-peer grace and
    /// `min_peers` lets it round alone: the first peer of a run trains on (a ring of one), and
    /// whoever comes next takes over its state.
    pub(super) fn first_of_the_run(&self, view: &View<'_>) -> bool {
        self.ring.as_ref().is_some_and(|ring| ring.min_peers <= 1)
            && view.now >= self.started_at + self.timeouts.first_peer_grace
            && view.peers.is_empty()
    }

    /// The ring of the next attempt: this node and the live trusted members in allreduce mode
    /// that have joined, are still training, and are not suspected since an abort.
    pub(super) fn ring_members(&mut self, view: &View<'_>) -> RingMembers {
        let me = self.me;
        let Some(ring) = self.ring.as_mut() else {
            return RingMembers::new(&self.run_id, vec![me]);
        };
        // A suspect heard from since it was suspected is back; one that left is forgotten.
        ring.suspects
            .retain(|peer, since| view.peers.get(peer).is_some_and(|v| v.last_seen <= *since));
        // A client is in no ring, its own or another's: ring members dial each other
        // (decision 0066).
        if view.peers.is_client() {
            return RingMembers::new(&self.run_id, vec![me]);
        }
        let live = view
            .peers
            .peers()
            .filter(|(peer, v)| {
                in_rounds(v) && !v.finished && !v.client && !ring.suspects.contains_key(*peer)
            })
            .map(|(peer, _)| *peer);
        self.sync.trust.ring(&self.run_id, me, live)
    }

    /// After an abort at `failed_at`: whether every ring member has been heard from since, or
    /// the settle time has passed, in which case those still silent are suspected until heard
    /// from again.
    pub(super) fn settled(&mut self, failed_at: Instant, view: &View<'_>) -> bool {
        let members = self.ring_members(view);
        let silent: Vec<PeerId> = members
            .peers()
            .iter()
            .filter(|peer| {
                view.peers
                    .get(peer)
                    .is_some_and(|v| v.last_seen <= failed_at)
            })
            .copied()
            .collect();
        if silent.is_empty() {
            return true;
        }
        if view.now < failed_at + self.timeouts.ring_settle {
            return false;
        }
        if let Some(ring) = self.ring.as_mut() {
            for peer in silent {
                info!(peer = %peer, "no heartbeat since the abort: leaving it out of the ring");
                ring.suspects.insert(peer, failed_at);
            }
        }
        true
    }

    pub(super) fn on_round_ended(
        &mut self,
        round: u64,
        result: Result<(), RingError>,
        view: &View<'_>,
    ) -> Vec<Action> {
        if self.due.is_none_or(|due| due.step != round) {
            return Vec::new();
        }
        let mut actions = Vec::new();
        match result {
            Ok(()) => {
                if let Some(ring) = self.ring.as_mut() {
                    ring.started = true;
                    ring.phase = RingPhase::Idle;
                }
                // The engine gave the trainer the mean.
                self.due = None;
            }
            // A member is at a later attempt of this round: join it at once. Its number is the
            // one every member converges on, and the members are in the ring already.
            Err(RingError::Superseded { by })
                if by.round == round
                    && self
                        .ring
                        .as_ref()
                        .is_some_and(|ring| by.number > ring.attempt) =>
            {
                if let Some(ring) = self.ring.as_mut() {
                    ring.attempt = by.number;
                    ring.phase = RingPhase::Idle;
                }
                actions.extend(self.ring_advance(view));
            }
            Err(error) => {
                if let Some(ring) = self.ring.as_mut() {
                    ring.attempt += 1;
                }
                actions.extend(self.blame(&error, view));
                if let Some((peer, announced)) = self.member_ahead(round, view) {
                    info!(peer = %peer, round, "a ring member completed this round: taking over its state");
                    if let Some(ring) = self.ring.as_mut() {
                        ring.phase = RingPhase::CatchingUp;
                    }
                    self.pulling = Some(Pull {
                        peer,
                        step: view.own_step,
                    });
                    actions.push(Action::PullState { peer, announced });
                    return actions;
                }
                if let Some(ring) = self.ring.as_mut() {
                    ring.phase = RingPhase::Settling {
                        failed_at: view.now,
                    };
                }
                actions.extend(self.ring_advance(view));
            }
        }
        actions
    }

    /// A peer that sent something invalid on the ring is scored down; only the left neighbour
    /// sends to this node. Header mismatches are not offences: views of the membership differ
    /// for a moment whenever a peer joins or leaves.
    pub(super) fn blame(&mut self, error: &RingError, view: &View<'_>) -> Vec<Action> {
        if !error.is_offence() || matches!(error, RingError::Mismatch { .. }) {
            return Vec::new();
        }
        let members = self.ring_members(view);
        match members.rank_of(&self.me) {
            Some(rank) if members.len() > 1 => vec![Action::Offence {
                peer: members.left_of(rank),
                rejection: Rejection::Ring(error.to_string()),
            }],
            _ => Vec::new(),
        }
    }

    /// A trusted member in rounds whose clock is past `round`, and its clock: it completed the
    /// round this node missed.
    pub(super) fn member_ahead(&self, round: u64, view: &View<'_>) -> Option<(PeerId, u64)> {
        self.ring.as_ref()?; // allreduce mode only
        view.peers
            .peers()
            .filter(|(peer, v)| in_rounds(v) && v.step > round && self.sync.trust.contains(peer))
            .max_by_key(|(_, v)| v.step)
            .map(|(peer, v)| (*peer, v.step))
    }
}

/// Whether a peer takes part in ring rounds: in `allreduce` mode and done joining.
fn in_rounds(view: &PeerView) -> bool {
    view.mode == SyncMode::Allreduce && view.role != Role::Joining
}
