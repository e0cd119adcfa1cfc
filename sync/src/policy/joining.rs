//! Joining: taking over a peer's state when too far behind (the source: `state_source`), then
//! counting as joined; and catching up the same way as a member that has not mixed yet.

use libp2p_identity::PeerId;
use murmur_protocol::heartbeat::Role;
use tracing::info;

use super::{
    AHEAD_GRACE_PERIODS, Action, Adopted, MAX_STATE_SYNC_TRIES, Outcome, PairwisePolicy, Policy,
    Pull, RingPhase, TRANSFER_SLACK, View, YOUNG_MEMBER_PERIODS,
};

impl Policy {
    /// Decides whether this node is far enough behind the run to take over a peer's state; if
    /// not (or after too many tries), it counts as joined.
    ///
    /// A member that has not mixed yet, with no exchange under way, still catches up this way:
    /// peers are heard one by one, so a node may join on hearing a peer as new as itself and
    /// hear the one far ahead a moment later. Mixing its way over that gap moves the replica
    /// by a large step at once, which momentum (quasi-global momentum above all) carries on and
    /// overshoots: a run of the main job that started so ended 2 pp low. A catch-up that
    /// fails is tried again even if a mix landed meanwhile: the member is still far behind.
    ///
    /// A young member (joined within [`YOUNG_MEMBER_PERIODS`] heartbeat periods without taking
    /// over a state, in gossip) that finds the run far ahead catches up the same way though it
    /// mixed in step: newcomers that joined on one another and mixed before they heard the run
    /// are as far behind it as those that had not mixed yet, and two such pairs, one on each
    /// side of the gap, each took the other for the run (decision 0033, third amendment).
    pub(super) fn try_join(&mut self, view: &View<'_>) -> Vec<Action> {
        let idle = self.pairwise.as_ref().is_none_or(PairwisePolicy::idle);
        let unmixed_member = !self.joining && (!self.mixed || self.catching_up) && idle;
        let young_member = !self.joining && idle && self.is_young(view);
        if !(self.joining || unmixed_member || young_member) || self.pulling.is_some() {
            return Vec::new();
        }
        let source = self.state_source(view);
        // Alone: nothing to catch up with yet.
        let Some((peer, their_step)) = source else {
            return Vec::new();
        };
        // Ring members all sit at the same step: any lag is caught up on at once.
        let behind_limit = if self.ring.is_some() {
            0
        } else {
            self.behind_limit()
        };
        if their_step > view.own_step.saturating_add(behind_limit)
            && self.join_tries < MAX_STATE_SYNC_TRIES
        {
            self.join_tries += 1;
            self.pulling = Some(Pull {
                peer,
                step: view.own_step,
            });
            self.catching_up = !self.joining;
            return vec![Action::PullState {
                peer,
                announced: their_step,
            }];
        }
        self.catching_up = false;
        if self.joining {
            return self.mark_joined(view);
        }
        // A member that mixed in step is not sent back for being ahead.
        if !unmixed_member {
            return Vec::new();
        }
        self.rejoin_from_ahead(view).into_iter().collect()
    }

    /// Whether this node joined a gossip run within the last [`YOUNG_MEMBER_PERIODS`]
    /// heartbeat periods, and has not taken over a state since it started. Later, a member
    /// behind the run is one on a slow link or a slow machine, and a whole state downloaded
    /// over that link would not keep it in step (decision 0033); one that took over a state
    /// lags by the transfer, which its mixes make up (`transfer_allowance`).
    fn is_young(&self, view: &View<'_>) -> bool {
        let window = self.timeouts.heartbeat * YOUNG_MEMBER_PERIODS;
        self.pairwise.is_some()
            && self.center.is_none()
            && self
                .joined_at
                .is_some_and(|at| view.now.saturating_duration_since(at) < window)
    }

    /// A member that has not mixed with a peer in step, far *ahead* of the run, takes over the
    /// run's state (decision 0033, second amendment). The first node of a run trains alone
    /// until the others start; when the next ones start together and hear one another before
    /// it, they join on one another, and by the median clock (decision 0042) they are the run.
    /// Nothing ever closes that gap: the first node's clock stays ahead, its replica far from
    /// theirs, their outlier screens decline it, and it trains alone to the end. The run is
    /// the members' median clock, among two members at least (with one, nothing tells which
    /// side is the run), peers still joining not counted; the gap must last
    /// [`AHEAD_GRACE_PERIODS`] heartbeat periods, so that newcomers still taking over this
    /// node's own state (members at a young clock for the length of a transfer) are not taken
    /// for the run.
    fn rejoin_from_ahead(&mut self, view: &View<'_>) -> Option<Action> {
        let run = (self.pairwise.is_some() && self.center.is_none())
            .then(|| self.median_member(view))
            .flatten()
            .filter(|&(_, step)| view.own_step > step.saturating_add(self.behind_limit()));
        let Some((peer, step)) = run else {
            self.ahead_since = None;
            return None;
        };
        let since = *self.ahead_since.get_or_insert(view.now);
        let grace = self.timeouts.heartbeat * AHEAD_GRACE_PERIODS;
        if view.now.saturating_duration_since(since) < grace
            || self.join_tries >= MAX_STATE_SYNC_TRIES
        {
            return None;
        }
        info!(
            step = view.own_step,
            run = step,
            "far ahead of the run, which started without this node: taking over its state"
        );
        self.ahead_since = None;
        self.join_tries += 1;
        self.catching_up = true;
        self.pulling = Some(Pull {
            peer,
            step: view.own_step,
        });
        Some(Action::PullState {
            peer,
            announced: step,
        })
    }

    /// The member at the run's median clock (the later of two) and its clock: among members
    /// this node may take a state from, two at least.
    fn median_member(&self, view: &View<'_>) -> Option<(PeerId, u64)> {
        let clocks: Vec<(PeerId, u64)> = view
            .peers
            .peers()
            .filter(|(peer, v)| {
                v.role != Role::Joining
                    && view.peers.exchanges_with(peer, self.sync.relayed_exchanges)
            })
            .map(|(peer, v)| (*peer, v.step))
            .collect();
        if clocks.len() < 2 {
            return None;
        }
        at_median(clocks)
    }

    /// How far behind a peer's clock a member may be and still count as in step with it: the
    /// staleness bound (`4 x interval` with the bound off), and after a state sync the steps
    /// the run may have made while it ran (`transfer_allowance`).
    fn behind_limit(&self) -> u64 {
        let bound = self.sync.max_staleness.unwrap_or(4 * self.sync.interval);
        bound.saturating_add(self.transfer_allowance)
    }

    /// Whether a mix with `peer` makes this replica's first mix (decision 0033): `peer`'s
    /// clock lies within the behind limit of this node's, either way. A member that joined on
    /// a peer as new as itself, or took over the state of one that had not caught up with the
    /// run itself, may mix with a peer far ahead before it could catch up; such a mix leaves
    /// it as far behind, and it still takes over a state. A member far ahead of its partner
    /// may be ahead of the whole run (`rejoin_from_ahead`).
    pub(super) fn in_step_with(&self, peer: PeerId, view: &View<'_>) -> bool {
        let theirs = view.peers.get(&peer).map_or(0, |v| v.step);
        let limit = self.behind_limit();
        theirs <= view.own_step.saturating_add(limit)
            && view.own_step <= theirs.saturating_add(limit)
    }

    /// The peer whose state to take over, and its clock (decision 0042). In elastic, the
    /// center this node elected, which has the center to hand over (any peer can claim the
    /// role in its heartbeats; only the elected one is believed). Otherwise the peer at the
    /// median clock (the later of two): among three peers or more, one announcing a clock far
    /// ahead of the others is never picked (the most advanced was). In `allreduce`, trusted
    /// peers only: the
    /// state a ring member continues from is the ring's, and the ring is the trusted peers'.
    fn state_source(&self, view: &View<'_>) -> Option<(PeerId, u64)> {
        // A whole model does not cross a relay the run did not open to exchanges.
        let eligible = |peer: &PeerId| {
            (self.ring.is_none() || self.sync.trust.contains(peer))
                && view.peers.exchanges_with(peer, self.sync.relayed_exchanges)
        };
        let center = self
            .center
            .is_some()
            .then(|| self.elected(view))
            .flatten()
            .filter(|c| *c != self.me && eligible(c));
        if let Some((peer, v)) = center.and_then(|c| view.peers.get(&c).map(|v| (c, v)))
            && v.role == Role::Center
        {
            return Some((peer, v.step));
        }
        at_median(
            view.peers
                .peers()
                .filter(|(peer, _)| eligible(peer))
                .map(|(peer, v)| (*peer, v.step))
                .collect(),
        )
    }

    /// From now on this node is a member: a partner, counted by gates, in rings.
    pub(super) fn mark_joined(&mut self, view: &View<'_>) -> Vec<Action> {
        self.joining = false;
        self.joined_at = Some(view.now);
        if self.role == Role::Joining {
            self.role = Role::Worker;
        }
        info!(step = view.own_step, "joined the run");
        vec![Action::Publish(self.view())]
    }

    pub(super) fn on_state_synced(
        &mut self,
        peer: PeerId,
        result: Result<Adopted, Outcome>,
        view: &View<'_>,
    ) -> Vec<Action> {
        let pull = self.pulling.take_if(|pull| pull.peer == peer);
        let mut actions = Vec::new();
        match result {
            Ok(Adopted { from, .. }) => {
                self.catching_up = false;
                self.ahead_since = None;
                // The run moved on while the state crossed, about as far as this replica did.
                if let Some(pull) = pull {
                    self.transfer_allowance = TRANSFER_SLACK * from.saturating_sub(pull.step);
                }
                if let Some(ring) = self.ring.as_mut() {
                    ring.started = true;
                    ring.phase = RingPhase::Idle;
                }
                if self.joining {
                    actions.extend(self.mark_joined(view));
                }
                self.joined_at = None;
                // The snapshot handed over is of the replica left behind: its round is over.
                if self.due.is_some() {
                    actions.extend(self.release());
                }
            }
            Err(outcome) => {
                if let Outcome::Rejected(rejection) = outcome {
                    actions.push(Action::Offence { peer, rejection });
                }
                if let Some(ring) = self.ring.as_mut()
                    && ring.phase == RingPhase::CatchingUp
                {
                    ring.phase = RingPhase::Settling {
                        failed_at: view.now,
                    };
                }
                // A joiner tries again at the next tick.
            }
        }
        if self.ring.is_some() {
            actions.extend(self.ring_advance(view));
        }
        actions
    }
}

/// The peer at the median of `clocks` and its clock: the later of the two middle ones, so that
/// among three peers or more no one clock, however far off, is the one picked (decision 0042).
fn at_median(mut clocks: Vec<(PeerId, u64)>) -> Option<(PeerId, u64)> {
    clocks.sort_unstable_by_key(|&(peer, step)| (step, peer));
    clocks.get(clocks.len() / 2).copied()
}
