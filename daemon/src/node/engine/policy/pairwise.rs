//! Pairwise exchanges (gossip, elastic gossip): partner choice with back-off, offers, requests
//! and their ends.

use super::*;

impl Policy {
    /// A random live partner that is not backing off; else, when every live partner is only
    /// briefly busy, the time at which the first of them may be asked again.
    pub(super) fn pick_partner(&mut self, view: &View<'_>) -> Result<PeerId, Option<Instant>> {
        let live = self.coupled(view);
        let now = view.now;
        self.backoff.retain(|_, until| *until > now);
        let busy = self.backoff.keys().copied().collect();
        if let Some(peer) = choose_partner(&live, &busy, &mut self.rng) {
            return Ok(peer);
        }
        Err(live
            .iter()
            .filter_map(|p| self.backoff.get(p).copied())
            .filter(|until| *until <= now + self.timeouts.busy_backoff)
            .min())
    }

    /// Offers the due snapshot to the next partner, waits for a busy one, or gives up.
    pub(super) fn offer_next(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(mut due) = self.due else {
            return Vec::new();
        };
        if due.tries >= MAX_PARTNER_TRIES {
            return self.release();
        }
        due.tries += 1;
        due.retry_at = None;
        match self.pick_partner(view) {
            Ok(peer) => {
                self.due = Some(due);
                self.slot = Slot::Offering {
                    partner: Some(peer),
                };
                let weight = self.sync.pair_weight(self.live_count(view));
                vec![Action::Offer {
                    peer,
                    weight,
                    limit: self.params.limit(),
                }]
            }
            // Every partner is in another exchange: ask again when the first may be free.
            Err(Some(free_at)) => {
                due.retry_at = Some(free_at);
                self.due = Some(due);
                self.slot = Slot::Offering { partner: None };
                Vec::new()
            }
            Err(None) => self.release(),
        }
    }

    pub(super) fn on_exchanged(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        if self.due.and_then(|due| due.asking).is_some() {
            return self.on_center_answer(peer, outcome);
        }
        if self.slot
            != (Slot::Offering {
                partner: Some(peer),
            })
        {
            return Vec::new();
        }
        self.slot = Slot::Offering { partner: None };
        match outcome {
            Outcome::Mixed { distance } => {
                self.params.accepted(distance);
                // The engine gave the trainer the mix.
                self.due = None;
                self.slot = Slot::Free;
                Vec::new()
            }
            Outcome::Busy => {
                self.backoff
                    .insert(peer, view.now + self.timeouts.busy_backoff);
                self.offer_next(view)
            }
            Outcome::Stale => self.release(),
            Outcome::Outlier { distance } => {
                let partners = self.coupled(view).len();
                self.params.outlier(peer, distance, partners);
                self.release()
            }
            Outcome::Rejected(rejection) => {
                let mut actions = vec![Action::Offence { peer, rejection }];
                actions.extend(self.release());
                actions
            }
            Outcome::Failed(failure) => {
                debug!(peer = %peer, %failure, "exchange failed");
                self.backoff
                    .insert(peer, view.now + self.timeouts.failure_backoff);
                self.offer_next(view)
            }
            Outcome::StateSent => Vec::new(),
        }
    }

    pub(super) fn on_request(
        &mut self,
        peer: PeerId,
        request: Request,
        view: &View<'_>,
    ) -> Vec<Action> {
        let answer = match request {
            Request::Offer { .. } => {
                if self.joining || !self.sync.pairwise() || self.slot != Slot::Free {
                    Answer::Busy
                } else {
                    self.slot = Slot::Serving(peer);
                    Answer::Exchange {
                        weight: self.sync.pair_weight(self.live_count(view)),
                        limit: self.params.limit(),
                    }
                }
            }
            Request::Params { .. } => {
                if !self.joining && self.sync.centered() && self.holds_center {
                    Answer::Center {
                        alpha: self.sync.alpha(self.live_count(view)),
                        limit: self.params.limit(),
                    }
                } else {
                    Answer::Busy
                }
            }
            // Answered even while joining: the first node of a run is alone (joining) exactly
            // when the second one needs its state.
            Request::State => Answer::State,
        };
        vec![Action::Serve { peer, answer }]
    }

    pub(super) fn on_served(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        if self.slot == Slot::Serving(peer) {
            self.slot = Slot::Free;
        }
        match outcome {
            Outcome::Mixed { distance } => {
                self.params.accepted(distance);
                Vec::new()
            }
            Outcome::Outlier { distance } => {
                let partners = self.coupled(view).len();
                self.params.outlier(peer, distance, partners);
                Vec::new()
            }
            Outcome::Rejected(rejection) => vec![Action::Offence { peer, rejection }],
            // A peer that opens an exchange and never completes it is misbehaving.
            Outcome::Failed(Failure::TimedOut) => vec![Action::Offence {
                peer,
                rejection: Rejection::Stalled,
            }],
            Outcome::Busy | Outcome::Stale | Outcome::Failed(_) | Outcome::StateSent => Vec::new(),
        }
    }
}
