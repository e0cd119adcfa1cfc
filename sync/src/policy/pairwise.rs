//! Pairwise exchanges (gossip, elastic gossip): partner choice with back-off, offers, requests
//! and their ends.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::RngExt;

use super::*;

/// How many times in a row a busy partner's back-off doubles: 20 ms becomes at most 320 ms.
const BUSY_DOUBLINGS: u32 = 4;

impl Policy {
    /// A random live partner that is not backing off; else, when every live partner is only
    /// briefly busy, the time at which the first of them may be asked again.
    pub(super) fn pick_partner(&mut self, view: &View<'_>) -> Result<PeerId, Option<Instant>> {
        // Only peers this node is connected to directly (or through a relay, where the run
        // allows it) are partners: a relay's default limits cut parameters off, and its
        // operator did not agree to carry them (decision 0066).
        let live: Vec<PeerId> = self
            .coupled(view)
            .into_iter()
            .filter(|peer| view.peers.exchanges_with(peer, self.sync.relayed_exchanges))
            .collect();
        let now = view.now;
        self.backoff.retain(|_, until| *until > now);
        self.busy_streak.retain(|peer, _| live.contains(peer));
        self.far.retain(|_, until| *until > now);
        // The peer this node is answering is already mixing with it.
        let mut busy: BTreeSet<PeerId> = (self.backoff.keys().chain(self.far.keys()))
            .copied()
            .chain(self.serving)
            .collect();
        // Partners on slow links are left to offer to us, but for a pick now and then.
        if self.rng.random_range(0..SLOW_PARTNER_PICKS) != 0 {
            busy.extend(self.slow_partners(&live));
        }
        if let Some(peer) = choose_partner(&live, &busy, &mut self.rng) {
            return Ok(peer);
        }
        Err(live
            .iter()
            .filter_map(|p| self.backoff.get(p).copied())
            .filter(|until| *until <= now + self.timeouts.busy_backoff)
            .min())
    }

    /// How long a partner that answered `Busy` `streak` times in a row is left alone:
    /// `timeouts.busy_backoff`, doubled for each busy answer after the first, up to
    /// [`BUSY_DOUBLINGS`] times. A partner busy once is asked again as soon as it is likely
    /// free; one busy again and again (slow exchanges, a loaded machine) is not asked dozens
    /// of times a second, each ask a stream and a frame. Only the first back-off holds a due
    /// snapshot (see [`Policy::pick_partner`]): a longer one sends it back to the trainer,
    /// which trains on rather than wait for a partner that stays busy.
    fn busy_backoff(&self, streak: u32) -> Duration {
        self.timeouts.busy_backoff * (1 << streak.clamp(1, BUSY_DOUBLINGS + 1).saturating_sub(1))
    }

    /// Those of `live` whose exchanges took [`SLOW_PARTNER_FACTOR`] times the fastest one's,
    /// and longer than the compute of an interval: exchanges that fit behind the compute hold
    /// no one back, however they compare (on a LAN, milliseconds apart). Each partner counts
    /// with the quickest of its recent exchanges ([`LINK_SAMPLES`]).
    fn slow_partners(&self, live: &[PeerId]) -> Vec<PeerId> {
        // Each partner's link looked up once: this runs before every offer and after every
        // exchange.
        let timed: Vec<(&PeerId, f64)> = live
            .iter()
            .filter_map(|peer| Some((peer, self.link_secs(peer)?)))
            .collect();
        let Some(fastest) = timed.iter().map(|(_, secs)| *secs).reduce(f64::min) else {
            return Vec::new();
        };
        let compute = self
            .step_secs
            .map_or(0.0, |secs| secs * self.sync.interval as f64);
        let slow = |secs: f64| secs > SLOW_PARTNER_FACTOR * fastest && secs > compute;
        timed
            .into_iter()
            .filter(|(_, secs)| slow(*secs))
            .map(|(peer, _)| *peer)
            .collect()
    }

    /// Notes that a mixed exchange with `peer` took `secs`.
    fn record_exchange(&mut self, peer: PeerId, secs: f64) {
        let times = self.exchange_secs.entry(peer).or_default();
        if times.len() == LINK_SAMPLES {
            times.pop_front();
        }
        times.push_back(secs);
    }

    /// How long an exchange with `peer` takes when its link is not in the way of anything
    /// else: the quickest of the last [`LINK_SAMPLES`].
    fn link_secs(&self, peer: &PeerId) -> Option<f64> {
        self.exchange_secs
            .get(peer)?
            .iter()
            .copied()
            .reduce(f64::min)
    }

    /// The slow-link partners, when they are not those published last.
    fn publish_slow_links(&mut self, view: &View<'_>) -> Vec<Action> {
        let slow: BTreeSet<PeerId> = self
            .slow_partners(&self.coupled(view))
            .into_iter()
            .collect();
        if slow == self.slow_links {
            return Vec::new();
        }
        self.slow_links = slow.clone();
        vec![Action::SlowLinks(slow)]
    }

    /// The codec to offer `peer`: `sync.codec`, or with `sync.adapt_codec` the sparse one when
    /// an exchange through `sync.codec` with `peer` takes [`SPARSE_FACTOR`] times the compute
    /// of one interval (`sync.interval`, not the stretched one: stretching follows the
    /// exchanges' length and would hide a slow link). A partner not measured yet is taken to
    /// be as fast as the fastest one measured: if that one is slow, the slow link is ours.
    fn codec_for(&mut self, peer: PeerId) -> Codec {
        let dense = self.sync.codec;
        let fastest = || self.dense_secs.values().copied().reduce(f64::min);
        let secs = self.dense_secs.get(&peer).copied().or_else(fastest);
        let (Some(sparse), Some(step_secs), Some(secs)) =
            (self.sync.sparse_codec, self.step_secs, secs)
        else {
            return dense;
        };
        let compute = step_secs * self.sync.interval as f64;
        let slow = secs > SPARSE_FACTOR * compute;
        debug!(peer = %peer, exchange_s = secs, interval_compute_s = compute, slow, "codec choice");
        if slow && self.rng.random_range(0..DENSE_PROBE_PICKS) != 0 {
            sparse
        } else {
            dense
        }
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
                let codec = self.codec_for(peer);
                self.offering = Offering::To {
                    peer,
                    codec,
                    at: view.now,
                };
                let weight = self.sync.pair_weight(self.live_count(view));
                vec![Action::Offer {
                    peer,
                    codec,
                    weight,
                    screen: self.params.screen(view.now),
                }]
            }
            // Every partner is in another exchange: ask again when the first may be free.
            Err(Some(free_at)) => {
                due.retry_at = Some(free_at);
                self.due = Some(due);
                self.offering = Offering::Choosing;
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
            return self.on_center_answer(peer, outcome, view);
        }
        let Offering::To {
            peer: partner,
            codec,
            at,
        } = self.offering
        else {
            return Vec::new();
        };
        if partner != peer {
            return Vec::new();
        }
        self.offering = Offering::Choosing;
        match outcome {
            Outcome::Mixed { distance, credited } => {
                self.params.accepted(peer, distance, credited, view.now);
                self.mixed = true;
                self.busy_streak.remove(&peer);
                let took = view.now.saturating_duration_since(at).as_secs_f64();
                self.record_exchange(peer, took);
                if codec == self.sync.codec {
                    let secs = self.dense_secs.get(&peer).copied();
                    self.dense_secs
                        .insert(peer, moving_average(secs, took, EXCHANGE_TIME_WEIGHT));
                }
                // The engine gave the trainer the mix.
                self.due = None;
                self.offering = Offering::Idle;
                self.publish_slow_links(view)
            }
            Outcome::Busy => {
                let streak = self
                    .busy_streak
                    .get(&peer)
                    .map_or(1, |s| s.saturating_add(1));
                self.busy_streak.insert(peer, streak);
                let wait = self.busy_backoff(streak);
                self.backoff.insert(peer, view.now + wait);
                self.next_partner(view)
            }
            Outcome::Stale => self.release(),
            Outcome::Outlier { distance } => {
                self.declined_far(peer, distance, view);
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
                self.next_partner(view)
            }
            Outcome::StateSent => Vec::new(),
        }
    }

    /// This replica declined `peer`'s parameters, `distance` away: the judge learns of it, and
    /// `peer` is left alone for the failure back-off. Its parameters will not have come closer
    /// within milliseconds, and each exchange declined costs a model's transfer both ways: left
    /// alone, its offers are answered busy, and this node's next offers go to others, which
    /// lets the judge tell soonest whether it is this replica that drifted. If so, the peers it
    /// took as its baseline are asked again at once.
    fn declined_far(&mut self, peer: PeerId, distance: f64, view: &View<'_>) {
        let partners = self.coupled(view).len();
        // Pruned here too: a node that holds the elastic center never picks partners.
        self.far.retain(|_, until| *until > view.now);
        self.far
            .insert(peer, view.now + self.timeouts.failure_backoff);
        for rebased_on in self.params.outlier(peer, distance, partners) {
            self.far.remove(&rebased_on);
        }
    }

    /// Whether `peer` was declined as too far lately (see [`Policy::declined_far`]).
    fn left_alone_as_far(&self, peer: PeerId, now: Instant) -> bool {
        self.far.get(&peer).is_some_and(|until| *until > now)
    }

    /// After a partner that did not mix: the next one, unless the exchange this node is
    /// answering already is this interval's mix.
    fn next_partner(&mut self, view: &View<'_>) -> Vec<Action> {
        if self.serving.is_some() {
            self.release()
        } else {
            self.offer_next(view)
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
                // Offers that cross (each peer offering to the other) would mix the pair twice
                // from the same snapshots, a swap: the smaller id answers, the other declines.
                let crossing = self.offering.partner() == Some(peer) && self.me > peer;
                if self.joining
                    || !self.sync.pairwise()
                    || self.serving.is_some()
                    || crossing
                    || self.left_alone_as_far(peer, view.now)
                    || !self.take_share(peer, view)
                {
                    Answer::Busy
                } else {
                    self.serving = Some(peer);
                    self.serving_since = Some(view.now);
                    Answer::Exchange {
                        weight: self.sync.pair_weight(self.live_count(view)),
                        screen: self.params.screen(view.now),
                    }
                }
            }
            Request::Params { .. } => {
                if !self.joining
                    && self.center.as_ref().is_some_and(|c| c.holds)
                    && self.take_share(peer, view)
                {
                    Answer::Center {
                        alpha: self.sync.alpha(self.live_count(view)),
                        screen: self.params.screen(view.now),
                    }
                } else {
                    Answer::Busy
                }
            }
            // Answered even while joining: the first node of a run is alone (joining) exactly
            // when the second one needs its state; within the budget only.
            Request::State if self.state_answers.take(peer, view.now) => Answer::State,
            Request::State => {
                debug!(peer = %peer, "state request over the budget");
                Answer::Busy
            }
        };
        vec![Action::Serve { peer, answer }]
    }

    /// Whether `peer` is within its share of the exchanges this node answers (counted if so).
    fn take_share(&mut self, peer: PeerId, view: &View<'_>) -> bool {
        let live = self.coupled(view).len();
        let within = self.exchange_share.take(peer, live, view.now);
        if !within {
            debug!(peer = %peer, "exchange over the peer's share");
        }
        within
    }

    pub(super) fn on_served(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        // Else a worker served at the elastic center: it moved the center, not this replica.
        let pairwise = self.serving == Some(peer);
        if pairwise {
            self.serving = None;
            if let (Some(at), Outcome::Mixed { .. }) = (self.serving_since.take(), &outcome) {
                self.record_exchange(peer, view.now.saturating_duration_since(at).as_secs_f64());
                actions.extend(self.publish_slow_links(view));
            }
            // A due snapshot still looking for a partner had its mix: its turn is over.
            if matches!(outcome, Outcome::Mixed { .. })
                && self.offering == Offering::Choosing
                && self.due.is_some_and(|due| due.asking.is_none())
            {
                actions.extend(self.release());
            }
        }
        match outcome {
            Outcome::Mixed { distance, credited } => {
                self.params.accepted(peer, distance, credited, view.now);
                self.mixed |= pairwise;
                actions
            }
            Outcome::Outlier { distance } => {
                self.declined_far(peer, distance, view);
                actions
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
