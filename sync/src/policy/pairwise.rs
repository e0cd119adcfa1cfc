//! Pairwise exchanges (gossip, elastic gossip): partner choice with back-off, offers, requests
//! and their ends.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use libp2p_identity::PeerId;
use murmur_protocol::codec::Codec;
use murmur_protocol::sync::choose_partner;
use rand::RngExt;
use tracing::debug;

use super::{
    Action, Answer, DENSE_PROBE_PICKS, EXCHANGE_TIME_WEIGHT, Failure, LINK_SAMPLES,
    MAX_PARTNER_TRIES, Offering, Outcome, Policy, Request, SLOW_PARTNER_FACTOR, SLOW_PARTNER_PICKS,
    SPARSE_FACTOR, View,
};
use crate::rejection::Rejection;
use crate::settings::Timeouts;
use crate::table::{PeerMap, moving_average};

/// How many times in a row a busy partner's back-off doubles: 20 ms becomes at most 320 ms.
const BUSY_DOUBLINGS: u32 = 4;

/// The pairwise side of a node: `Some` in gossip runs and in elastic runs with the gossip
/// topology, `None` in the others, which neither offer nor answer offers. All it holds is per
/// exchange or per partner: the offer under way and the exchange answered, who is left alone
/// and until when, and how long the exchanges with each partner take.
#[derive(Debug, Default)]
pub(super) struct PairwisePolicy {
    /// The exchange this node started for its due snapshot.
    pub(super) offering: Offering,
    /// The peer whose offer this node is answering: one at a time, beside its own offer.
    pub(super) serving: Option<PeerId>,
    /// When this node began answering `serving`: answered exchanges measure links too.
    serving_since: Option<Instant>,
    /// Seconds a local step computes, as the replica last reported it. Not the time between
    /// two turns: that holds the waits at the staleness gate, and a node held there by a
    /// laggard would take every link to be faster than its compute (decisions 0025, 0029).
    step_secs: Option<f64>,
    /// Seconds the last [`LINK_SAMPLES`] mixed exchanges with each partner took (offered or
    /// answered), newest last.
    exchange_secs: PeerMap<VecDeque<f64>>,
    /// The partners last published as on slow links.
    slow_links: BTreeSet<PeerId>,
    /// A moving average of the seconds each partner's mixed exchanges took through
    /// `sync.codec` only (with `sync.adapt_codec`, others go sparse).
    dense_secs: PeerMap<f64>,
    /// Peers left alone until the given time (they were busy, or failed).
    pub(super) backoff: PeerMap<Instant>,
    /// Busy answers in a row from each partner since its last mix: each doubles how long
    /// it is left alone (see [`busy_backoff`]).
    busy_streak: PeerMap<u32>,
    /// Peers whose parameters were declined as too far, left alone until the given time: not
    /// offered to, and their offers answered busy (see [`Policy::declined_far`]).
    far: PeerMap<Instant>,
}

impl PairwisePolicy {
    /// Whether no pairwise exchange is under way: none offered, none answered.
    pub(super) fn idle(&self) -> bool {
        self.serving.is_none() && self.offering == Offering::Idle
    }

    /// The replica reported the seconds a local step computes.
    pub(super) fn step_took(&mut self, step_secs: Option<f64>) {
        if step_secs.is_some() {
            self.step_secs = step_secs;
        }
    }

    /// Those of `live` whose exchanges took [`SLOW_PARTNER_FACTOR`] times the fastest one's,
    /// and longer than the compute of an interval of `interval` steps: exchanges that fit
    /// behind the compute hold no one back, however they compare (on a LAN, milliseconds
    /// apart). Each partner counts with the quickest of its recent exchanges
    /// ([`LINK_SAMPLES`]).
    fn slow_partners(&self, live: &[PeerId], interval: u64) -> Vec<PeerId> {
        // Each partner's link looked up once: this runs before every offer and after every
        // exchange.
        let timed: Vec<(&PeerId, f64)> = live
            .iter()
            .filter_map(|peer| Some((peer, self.link_secs(peer)?)))
            .collect();
        let Some(fastest) = timed.iter().map(|(_, secs)| *secs).reduce(f64::min) else {
            return Vec::new();
        };
        let compute = self.step_secs.map_or(0.0, |secs| secs * interval as f64);
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

    /// Whether `peer` was declined as too far lately (see [`Policy::declined_far`]).
    fn left_alone_as_far(&self, peer: PeerId, now: Instant) -> bool {
        self.far.get(&peer).is_some_and(|until| *until > now)
    }
}

/// How long a partner that answered `Busy` `streak` times in a row is left alone:
/// `timeouts.busy_backoff`, doubled for each busy answer after the first, up to
/// [`BUSY_DOUBLINGS`] times. A partner busy once is asked again as soon as it is likely free;
/// one busy again and again (slow exchanges, a loaded machine) is not asked dozens of times a
/// second, each ask a stream and a frame. Only the first back-off holds a due snapshot (see
/// [`Policy::pick_partner`]): a longer one sends it back to the trainer, which trains on rather
/// than wait for a partner that stays busy.
fn busy_backoff(timeouts: &Timeouts, streak: u32) -> Duration {
    timeouts.busy_backoff * (1 << streak.clamp(1, BUSY_DOUBLINGS + 1).saturating_sub(1))
}

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
        let Some(pairs) = self.pairwise.as_mut() else {
            return Err(None);
        };
        let now = view.now;
        pairs.backoff.retain(|_, until| *until > now);
        pairs.busy_streak.retain(|peer, _| live.contains(peer));
        pairs.far.retain(|_, until| *until > now);
        // The peer this node is answering is already mixing with it.
        let mut busy: BTreeSet<PeerId> = (pairs.backoff.keys().chain(pairs.far.keys()))
            .copied()
            .chain(pairs.serving)
            .collect();
        // Partners on slow links are left to offer to us, but for a pick now and then.
        if self.rng.random_range(0..SLOW_PARTNER_PICKS) != 0 {
            busy.extend(pairs.slow_partners(&live, self.sync.interval));
        }
        if let Some(peer) = choose_partner(&live, &busy, &mut self.rng) {
            return Ok(peer);
        }
        Err(live
            .iter()
            .filter_map(|p| pairs.backoff.get(p).copied())
            .filter(|until| *until <= now + self.timeouts.busy_backoff)
            .min())
    }

    /// The slow-link partners, when they are not those published last.
    fn publish_slow_links(&mut self, view: &View<'_>) -> Vec<Action> {
        let live = self.coupled(view);
        let Some(pairs) = self.pairwise.as_mut() else {
            return Vec::new();
        };
        let slow: BTreeSet<PeerId> = pairs
            .slow_partners(&live, self.sync.interval)
            .into_iter()
            .collect();
        if slow == pairs.slow_links {
            return Vec::new();
        }
        pairs.slow_links = slow.clone();
        vec![Action::SlowLinks(slow)]
    }

    /// The codec to offer `peer`: `sync.codec`, or with `sync.adapt_codec` the sparse one when
    /// an exchange through `sync.codec` with `peer` takes [`SPARSE_FACTOR`] times the compute
    /// of one interval (`sync.interval`, not the stretched one: stretching follows the
    /// exchanges' length and would hide a slow link). A partner not measured yet is taken to
    /// be as fast as the fastest one measured: if that one is slow, the slow link is ours.
    fn codec_for(&mut self, peer: PeerId) -> Codec {
        let dense = self.sync.codec;
        let Some(pairs) = self.pairwise.as_ref() else {
            return dense;
        };
        let fastest = || pairs.dense_secs.values().copied().reduce(f64::min);
        let secs = pairs.dense_secs.get(&peer).copied().or_else(fastest);
        let (Some(sparse), Some(step_secs), Some(secs)) =
            (self.sync.sparse_codec, pairs.step_secs, secs)
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

    /// The peer whose offer this node is answering (in a pairwise mode).
    fn serving(&self) -> Option<PeerId> {
        self.pairwise.as_ref().and_then(|pairs| pairs.serving)
    }

    /// Sets the pairwise offer's state (in a pairwise mode).
    pub(super) fn set_offering(&mut self, offering: Offering) {
        if let Some(pairs) = self.pairwise.as_mut() {
            pairs.offering = offering;
        }
    }

    /// Offers the due snapshot to the next partner, waits for a busy one, or gives up (as it
    /// does once an exchange spent the snapshot).
    pub(super) fn offer_next(&mut self, view: &View<'_>) -> Vec<Action> {
        let Some(mut due) = self.due else {
            return Vec::new();
        };
        if due.tries >= MAX_PARTNER_TRIES || due.spent {
            return self.release();
        }
        due.tries += 1;
        due.retry_at = None;
        match self.pick_partner(view) {
            Ok(peer) => {
                self.due = Some(due);
                let codec = self.codec_for(peer);
                self.set_offering(Offering::To {
                    peer,
                    codec,
                    at: view.now,
                });
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
                self.set_offering(Offering::Choosing);
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
        let in_step = self.in_step_with(peer, view);
        let Some(pairs) = self.pairwise.as_mut() else {
            return Vec::new();
        };
        let Offering::To {
            peer: partner,
            codec,
            at,
        } = pairs.offering
        else {
            return Vec::new();
        };
        if partner != peer {
            return Vec::new();
        }
        pairs.offering = Offering::Choosing;
        match outcome {
            Outcome::Mixed { distance, credited } => {
                self.params.accepted(peer, distance, credited, view.now);
                self.mixed |= in_step;
                pairs.busy_streak.remove(&peer);
                let took = view.now.saturating_duration_since(at).as_secs_f64();
                pairs.record_exchange(peer, took);
                if codec == self.sync.codec {
                    let secs = pairs.dense_secs.get(&peer).copied();
                    pairs
                        .dense_secs
                        .insert(peer, moving_average(secs, took, EXCHANGE_TIME_WEIGHT));
                }
                // The engine gave the trainer the mix.
                self.due = None;
                pairs.offering = Offering::Idle;
                self.publish_slow_links(view)
            }
            Outcome::Busy => {
                let streak = pairs
                    .busy_streak
                    .get(&peer)
                    .map_or(1, |s| s.saturating_add(1));
                pairs.busy_streak.insert(peer, streak);
                let wait = busy_backoff(&self.timeouts, streak);
                pairs.backoff.insert(peer, view.now + wait);
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
                pairs
                    .backoff
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
        let rebased = self.params.outlier(peer, distance, partners);
        // Only a pairwise node picks partners and answers offers: at an elastic center the
        // judge's learning is all there is to it.
        let Some(pairs) = self.pairwise.as_mut() else {
            return;
        };
        pairs.far.retain(|_, until| *until > view.now);
        pairs
            .far
            .insert(peer, view.now + self.timeouts.failure_backoff);
        for rebased_on in rebased {
            pairs.far.remove(&rebased_on);
        }
    }

    /// After a partner that did not mix: the next one, unless the exchange this node is
    /// answering already is this interval's mix.
    fn next_partner(&mut self, view: &View<'_>) -> Vec<Action> {
        if self.serving().is_some() {
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
                let free = self.pairwise.as_ref().is_some_and(|pairs| {
                    let crossing = pairs.offering.partner() == Some(peer) && self.me > peer;
                    !self.joining
                        && pairs.serving.is_none()
                        && !crossing
                        && !pairs.left_alone_as_far(peer, view.now)
                });
                if free && self.take_share(peer, view) {
                    let answer = Answer::Exchange {
                        weight: self.sync.pair_weight(self.live_count(view)),
                        screen: self.params.screen(view.now),
                    };
                    if let Some(pairs) = self.pairwise.as_mut() {
                        pairs.serving = Some(peer);
                        pairs.serving_since = Some(view.now);
                    }
                    answer
                } else {
                    Answer::Busy
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

    /// The exchange this node answered in its pairwise slot ended: the slot is free, and the
    /// outcome is judged as any answered request's.
    pub(super) fn on_served(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        let mut actions = Vec::new();
        if self.serving() == Some(peer) {
            actions = self.end_serving(peer, &outcome, view);
            self.mixed |= matches!(outcome, Outcome::Mixed { .. }) && self.in_step_with(peer, view);
        }
        actions.extend(self.on_answered(peer, outcome, view));
        actions
    }

    /// A request this node answered ended, in or outside its pairwise slot (outside: an
    /// elastic worker's parameters mixed into the center, a state sent). What the peer sent is
    /// judged: a mixed distance teaches the clip radius (the center's too, decision 0041), a
    /// far one the outlier filter, and a wrong or stalled request counts as an offence.
    pub(super) fn on_answered(
        &mut self,
        peer: PeerId,
        outcome: Outcome,
        view: &View<'_>,
    ) -> Vec<Action> {
        match outcome {
            Outcome::Mixed { distance, credited } => {
                self.params.accepted(peer, distance, credited, view.now);
                Vec::new()
            }
            Outcome::Outlier { distance } => {
                self.declined_far(peer, distance, view);
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

    /// The exchange this node answered for `peer` ended with `outcome`: the link is measured,
    /// and a due snapshot still looking for a partner had its mix.
    fn end_serving(&mut self, peer: PeerId, outcome: &Outcome, view: &View<'_>) -> Vec<Action> {
        let Some(pairs) = self.pairwise.as_mut() else {
            return Vec::new();
        };
        pairs.serving = None;
        let since = pairs.serving_since.take();
        let choosing = pairs.offering == Offering::Choosing;
        let mixed = matches!(outcome, Outcome::Mixed { .. });
        let mut actions = Vec::new();
        if let (Some(at), true) = (since, mixed) {
            pairs.record_exchange(peer, view.now.saturating_duration_since(at).as_secs_f64());
            actions.extend(self.publish_slow_links(view));
        }
        if mixed && choosing && self.due.is_some_and(|due| due.asking.is_none()) {
            actions.extend(self.release());
        }
        actions
    }
}
