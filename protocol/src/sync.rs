//! The sans-IO decisions of the sync modes: when a peer may step (the staleness gate), which
//! received parameters may be mixed and with what weight (the staleness filter), whom to
//! exchange with (partner choice) and who holds the elastic-averaging center (election).
//!
//! Nothing here reads a clock, a socket or a global RNG: callers pass steps, peer sets and a
//! seeded RNG, so every rule is tested as a table.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use rand::Rng;
use rand::seq::IndexedRandom;
use sha2::{Digest, Sha256};

/// Whether a peer may take its next local step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Open,
    /// Wait: this peer is `lead` steps ahead of the slowest coupled peer, past the bound.
    Closed {
        lead: u64,
    },
}

/// The staleness gate: no peer more than `max_staleness` steps ahead of the slowest live peer
/// it is coupled to. `None` turns the bound off.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StalenessGate {
    max_staleness: Option<u64>,
}

impl StalenessGate {
    pub fn new(max_staleness: Option<u64>) -> Self {
        StalenessGate { max_staleness }
    }

    /// May a peer at clock `own_step` take step `own_step + 1`, given the smallest clock among
    /// the live peers it is coupled to (`None`: it is alone)?
    pub fn check(&self, own_step: u64, slowest_peer: Option<u64>) -> Gate {
        match (self.max_staleness, slowest_peer) {
            (Some(bound), Some(slowest)) => {
                let lead = own_step.saturating_sub(slowest);
                if lead <= bound {
                    Gate::Open
                } else {
                    Gate::Closed { lead }
                }
            }
            _ => Gate::Open,
        }
    }
}

/// The weight with which parameters stamped `their_step` are mixed into a replica at
/// `own_step`, or `None` if they are too stale (`|own - their| > max_staleness`) and must be
/// dropped. With `age_weighting`, the weight is `base / (1 + age)`.
pub fn mix_weight(
    own_step: u64,
    their_step: u64,
    max_staleness: Option<u64>,
    base: f32,
    age_weighting: bool,
) -> Option<f32> {
    let age = own_step.abs_diff(their_step);
    if max_staleness.is_some_and(|bound| age > bound) {
        return None;
    }
    Some(aged(base, age, age_weighting))
}

/// `base`, or with `age_weighting` `base / (1 + age)`.
fn aged(base: f32, age: u64, age_weighting: bool) -> f32 {
    if age_weighting {
        base / (1.0 + age as f32)
    } else {
        base
    }
}

/// The weight with which a pairwise partner's parameters stamped `their_step` are mixed into
/// a replica at `own_step` (decision 0029): [`mix_weight`] within the bound; beyond it, a
/// partner ahead is mixed as one within the bound (a replica that fell behind catches up), and
/// one behind counts the less the older it is (`bound / age` of the weight), so that a peer
/// the gate does not wait for (on a slow link) follows the fast ones rather than pulling them
/// back. It depends on the two steps only, so both sides of an exchange reach the same
/// verdict: neither declines what the other already sends.
pub fn partner_mix_weight(
    own_step: u64,
    their_step: u64,
    max_staleness: Option<u64>,
    base: f32,
    age_weighting: bool,
) -> f32 {
    let age = own_step.abs_diff(their_step);
    let weight = aged(base, age, age_weighting);
    match max_staleness {
        Some(bound) if age > bound && their_step < own_step => weight * bound as f32 / age as f32,
        _ => weight,
    }
}

/// A uniformly random partner among `live` peers that are not `busy`, or `None`.
pub fn choose_partner<P: Ord + Clone, R: Rng + ?Sized>(
    live: &[P],
    busy: &BTreeSet<P>,
    rng: &mut R,
) -> Option<P> {
    let free: Vec<&P> = live.iter().filter(|p| !busy.contains(p)).collect();
    free.choose(rng).map(|p| (*p).clone())
}

/// The elastic-averaging center of a run: the configured peer while it is live, else the live
/// member with the smallest `sha256(peer id bytes, run id)`. Every peer computes the same
/// answer from the same live set.
pub fn elect_center<P: Clone>(
    live: &[(P, Vec<u8>)],
    run_id: &str,
    configured: Option<&[u8]>,
) -> Option<P> {
    let configured_live =
        configured.and_then(|wanted| live.iter().find(|(_, id)| id.as_slice() == wanted));
    if let Some((peer, _)) = configured_live {
        return Some(peer.clone());
    }
    live.iter()
        .min_by_key(|(_, id)| {
            let mut hasher = Sha256::new();
            hasher.update(id);
            hasher.update(run_id.as_bytes());
            hasher.finalize()
        })
        .map(|(peer, _)| peer.clone())
}

/// Tracks the center across membership changes: a new center bumps `center_version`, so that
/// workers can tell a fresh center (seeded from its own parameters) from the old one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CenterTracker<P> {
    current: Option<P>,
    version: u64,
}

impl<P: Clone + PartialEq> Default for CenterTracker<P> {
    fn default() -> Self {
        CenterTracker {
            current: None,
            version: 0,
        }
    }
}

impl<P: Clone + PartialEq> CenterTracker<P> {
    /// Records the center elected from the current live set; returns the new version when the
    /// center changed.
    pub fn update(&mut self, elected: Option<P>) -> Option<u64> {
        if elected == self.current {
            return None;
        }
        self.current = elected;
        self.version += 1;
        Some(self.version)
    }

    pub fn center(&self) -> Option<&P> {
        self.current.as_ref()
    }

    pub fn version(&self) -> u64 {
        self.version
    }
}

/// Flags a received tensor whose distance `||x_other - x_own||` is an outlier: more than
/// `factor` times the median of the last `window` accepted distances. Until `min_samples`
/// distances are known, everything finite is accepted (there is no baseline yet).
#[derive(Clone, Debug)]
pub struct DistanceFilter {
    recent: VecDeque<f64>,
    window: usize,
    min_samples: usize,
    factor: f64,
}

impl Default for DistanceFilter {
    fn default() -> Self {
        DistanceFilter::new(32, 8, 10.0)
    }
}

impl DistanceFilter {
    pub fn new(window: usize, min_samples: usize, factor: f64) -> Self {
        DistanceFilter {
            recent: VecDeque::with_capacity(window),
            window: window.max(1),
            min_samples: min_samples.max(1),
            factor,
        }
    }

    /// The running median, once there are enough samples.
    pub fn median(&self) -> Option<f64> {
        if self.recent.len() < self.min_samples {
            return None;
        }
        let mut sorted: Vec<f64> = self.recent.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        Some(sorted[sorted.len() / 2])
    }

    /// The distance beyond which a received tensor is an outlier: `factor` times the running
    /// median, once there is one.
    pub fn limit(&self) -> Option<f64> {
        self.median().map(|median| self.factor * median)
    }

    /// Remembers an accepted `distance`.
    pub fn record(&mut self, distance: f64) {
        if !distance.is_finite() {
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(distance);
    }

    /// Forgets every distance and takes `distances` as the new baseline (repeated until there
    /// are enough to have a median): for a replica that finds itself far from every peer, so
    /// that what its peers send is normal again and a tensor far beyond it still is not.
    pub fn rebase(&mut self, distances: &[f64]) {
        self.recent.clear();
        let finite: Vec<f64> = distances
            .iter()
            .copied()
            .filter(|d| d.is_finite())
            .collect();
        if finite.is_empty() {
            return;
        }
        while self.recent.len() < self.min_samples.min(self.window) {
            for &d in &finite {
                self.record(d);
            }
        }
    }

    /// Accepts `distance` (and remembers it) unless it is not finite or an outlier; the error
    /// says by how much. Distances up to `floor` are always accepted: once replicas agree, the
    /// median gets tiny and ordinary drift would otherwise look like an outlier.
    pub fn check(&mut self, distance: f64, floor: f64) -> Result<(), String> {
        if !distance.is_finite() {
            return Err(format!("distance {distance} is not finite"));
        }
        if let Some(median) = self.median()
            && distance > self.factor * median
            && distance > floor
        {
            return Err(format!(
                "distance {distance:.4} is over {}x the running median {median:.4}",
                self.factor
            ));
        }
        self.record(distance);
        Ok(())
    }
}

/// How what a node mixes in is clipped (decisions 0041, 0045): the radius as a multiple of the
/// typical distance of a peer ([`ClipRadius`]), and the knee past which parameters move a mix
/// the less the farther they lie (`averaging::clip_toward`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClipRule {
    pub factor: f64,
    pub knee: f64,
    /// The part of a difference along the replica itself (toward the origin or away from it)
    /// is held to this share of the radius: see [`ClipRule::PAIRWISE`].
    pub radial: f64,
}

impl ClipRule {
    /// A pairwise mix (gossip, and elastic gossip): each side moves by half the difference,
    /// so a partner at the radius moves a replica half a radius, the same way every time if it
    /// is an adversary. A radius close to the typical distance, and a knee at one radius, keep
    /// that small; honest replicas lie about the typical distance apart. They differ across
    /// the replica, hardly along it (the part along it was 4 % of the difference in the median
    /// mix of the poisoning bench, 12 % at the 99th percentile), while a partner that shrinks
    /// or inflates the model pushes along it: that part is held to a quarter of the radius
    /// (decision 0051).
    pub const PAIRWISE: ClipRule = ClipRule {
        factor: 1.1,
        knee: 1.0,
        radial: 0.25,
    };
    /// The elastic center taking a worker, and a worker taking the center's delta: the center
    /// must follow workers whose data pull them far (non-IID shards) at the full radius, or
    /// they drift apart (the simulator's non-IID elastic swarm did with a factor of 1.25 or a
    /// knee of 1).
    pub const CENTER: ClipRule = ClipRule {
        factor: 1.5,
        knee: 2.0,
        radial: f64::INFINITY,
    };
}

/// The radius within which received parameters (or an elastic delta) are mixed: a difference
/// from this replica longer than the radius is scaled down to it before the mix (self-centered
/// clipping, as in ClippedGossip). The radius is the rule's factor times the median of the
/// latest distance of each distinct peer whose parameters were mixed (at most [`CLIP_PEERS`],
/// none older than [`CLIP_MEMORY`]), or the smallest while fewer than [`CLIP_QUORUM`] peers
/// are known.
///
/// Why no single peer can move it: a peer is one entry however often it exchanges, the median
/// of three or more entries lies within the others' range, and below three the smallest entry
/// is taken (a peer can only pull it down). With no entry at all (a fresh start) the caller
/// clips to a small share of its own norm: there is no accept-all warm-up; and the caller
/// records a distance at most [`RADIUS_GROWTH`] times the radius it was clipped to (or that
/// small share, where larger: a radius learnt from a distance of zero must not stay zero), so
/// that a peer alone in the memory widens the radius by no more than that factor per exchange. Many identities
/// (Sybils) are many entries: the rule holds while the honest peers are most of those a node
/// has mixed with lately.
#[derive(Clone, Debug)]
pub struct ClipRadius<P> {
    latest: BTreeMap<P, (f64, Instant)>,
    /// The radius is this many times the typical distance of a peer.
    factor: f64,
}

/// A peer's distance is remembered as at most this many times the radius it was clipped to:
/// how fast the radius can follow distances that grow (honest ones do as the learning rate
/// warms up). With 2, honest peers were clipped all through the warm-up, which cost more
/// accuracy with nobody attacking than anything else in the rule (decision 0045).
pub const RADIUS_GROWTH: f64 = 4.0;
/// Distinct peers from which on the median is taken rather than the smallest distance.
pub const CLIP_QUORUM: usize = 3;
/// Peers remembered; the one heard from longest ago is forgotten first.
pub const CLIP_PEERS: usize = 64;
/// A peer's distance is forgotten after this long (a peer that left, or the replicas of long ago).
pub const CLIP_MEMORY: Duration = Duration::from_secs(300);

impl<P: Ord + Clone> ClipRadius<P> {
    /// An empty memory whose radius is `factor` times the typical distance of a peer.
    pub fn new(factor: f64) -> Self {
        ClipRadius {
            latest: BTreeMap::new(),
            factor,
        }
    }

    /// The radius at `now`; `None` while no peer's distance is known.
    pub fn radius(&self, now: Instant) -> Option<f64> {
        let mut recent: Vec<f64> = self
            .latest
            .values()
            .filter(|(_, at)| now.saturating_duration_since(*at) <= CLIP_MEMORY)
            .map(|(distance, _)| *distance)
            .collect();
        recent.sort_by(f64::total_cmp);
        let typical = if recent.len() >= CLIP_QUORUM {
            recent[recent.len() / 2]
        } else {
            *recent.first()?
        };
        Some(self.factor * typical)
    }

    /// Remembers that `peer`'s parameters, `distance` away, were mixed.
    pub fn record(&mut self, peer: &P, distance: f64, now: Instant) {
        if !distance.is_finite() {
            return;
        }
        self.latest.insert(peer.clone(), (distance, now));
        if self.latest.len() > CLIP_PEERS {
            let oldest = self
                .latest
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(peer, _)| peer.clone());
            if let Some(oldest) = oldest {
                self.latest.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::ChaCha8Rng;

    #[test]
    fn the_gate_holds_a_peer_exactly_past_the_bound() {
        // (bound, own step, slowest peer, expected)
        let table = [
            (Some(4), 10, Some(10), Gate::Open),
            (Some(4), 14, Some(10), Gate::Open),
            (Some(4), 15, Some(10), Gate::Closed { lead: 5 }),
            (Some(0), 11, Some(10), Gate::Closed { lead: 1 }),
            (Some(4), 8, Some(10), Gate::Open),
            (Some(4), 100, None, Gate::Open),
            (None, 1_000, Some(0), Gate::Open),
        ];
        for (bound, own, slowest, expected) in table {
            assert_eq!(
                StalenessGate::new(bound).check(own, slowest),
                expected,
                "{bound:?} {own} {slowest:?}"
            );
        }
    }

    #[test]
    fn stale_parameters_are_dropped_and_fresh_ones_weighted() {
        // (own, theirs, bound, age weighting, expected)
        let table = [
            (10, 10, Some(4), false, Some(0.5)),
            (10, 6, Some(4), false, Some(0.5)),
            (10, 5, Some(4), false, None),
            (5, 10, Some(4), false, None),
            (10, 8, Some(4), true, Some(0.5 / 3.0)),
            (10, 1_000, None, false, Some(0.5)),
        ];
        for (own, theirs, bound, aged, expected) in table {
            assert_eq!(
                mix_weight(own, theirs, bound, 0.5, aged),
                expected,
                "{own} {theirs}"
            );
        }
    }

    #[test]
    fn a_partner_ahead_is_mixed_and_one_behind_the_bound_weighted_by_its_age() {
        // (own, theirs, expected), bound 4, base 0.5
        let table = [
            (10, 6, 0.5),
            (10, 2, 0.25),
            (10, 0, 0.2),
            (2, 10, 0.5),
            (0, 1_000, 0.5),
        ];
        for (own, theirs, expected) in table {
            assert_eq!(
                partner_mix_weight(own, theirs, Some(4), 0.5, false),
                expected,
                "{own} {theirs}"
            );
        }
        assert_eq!(partner_mix_weight(10, 0, None, 0.5, false), 0.5);
        // With age weighting, the age's own discount first.
        assert_eq!(partner_mix_weight(10, 8, Some(4), 0.5, true), 0.5 / 3.0);
    }

    #[test]
    fn partners_are_free_live_peers_chosen_uniformly_and_reproducibly() {
        let live = ["a", "b", "c", "d"];
        let busy: BTreeSet<&str> = ["b"].into();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut counts = std::collections::BTreeMap::new();
        for _ in 0..3000 {
            let p = choose_partner(&live, &busy, &mut rng).unwrap();
            *counts.entry(p).or_insert(0) += 1;
        }
        assert!(!counts.contains_key("b"));
        assert!(
            counts.values().all(|&c| (900..1100).contains(&c)),
            "{counts:?}"
        );
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..5)
                .map(|_| choose_partner(&live, &busy, &mut rng))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        let all_busy: BTreeSet<&str> = live.into_iter().collect();
        assert_eq!(choose_partner(&live, &all_busy, &mut rng), None);
    }

    #[test]
    fn every_peer_elects_the_same_center_and_failover_bumps_the_version() {
        let peer = |n: u8| (n, vec![n; 4]);
        let live = vec![peer(1), peer(2), peer(3)];
        let center = elect_center(&live, "run-1", None).unwrap();
        // Order of the live list does not matter.
        let reversed: Vec<_> = live.iter().rev().cloned().collect();
        assert_eq!(elect_center(&reversed, "run-1", None), Some(center));
        // A configured center wins while it is live.
        assert_eq!(elect_center(&live, "run-1", Some(&[3u8; 4])), Some(3));
        assert_eq!(elect_center::<u8>(&[], "run-1", None), None);

        let mut tracker = CenterTracker::default();
        assert_eq!(tracker.update(Some(center)), Some(1));
        assert_eq!(tracker.update(Some(center)), None);
        let survivors: Vec<_> = live.into_iter().filter(|(p, _)| *p != center).collect();
        let next = elect_center(&survivors, "run-1", None).unwrap();
        assert_ne!(next, center);
        assert_eq!(tracker.update(Some(next)), Some(2));
        assert_eq!(tracker.center(), Some(&next));
        assert_eq!(tracker.version(), 2);
    }

    #[test]
    fn outlying_distances_are_refused_against_the_running_median() {
        let mut filter = DistanceFilter::new(8, 4, 10.0);
        // (distance, accepted): no baseline for the first four, then 10x the median is the cap.
        let table = [
            (100.0, true),
            (1.0, true),
            (1.2, true),
            (0.9, true),
            (1.1, true),
            (10.9, true),
            (12.5, false),
            (1e9, false),
            (f64::NAN, false),
            (f64::INFINITY, false),
            (0.8, true),
        ];
        for (distance, accepted) in table {
            assert_eq!(filter.check(distance, 0.0).is_ok(), accepted, "{distance}");
        }
        // Refused distances never move the median.
        assert_eq!(filter.median(), Some(1.1));
        // Under the floor nothing is an outlier.
        assert!(filter.check(12.5, 20.0).is_ok());
        assert!(filter.check(25.0, 20.0).is_err());
    }

    #[test]
    fn no_single_peer_moves_the_clip_radius() {
        let t0 = Instant::now();
        let mut clip = ClipRadius::new(1.5);
        let times = |typical: f64| Some(1.5 * typical);
        assert_eq!(clip.radius(t0), None);
        // Below the quorum the smallest distance counts: a far peer cannot widen it.
        clip.record(&"honest-1", 1.0, t0);
        clip.record(&"liar", 1_000.0, t0);
        assert_eq!(clip.radius(t0), times(1.0));
        // From the quorum on, the median: one peer at either extreme does not move it.
        clip.record(&"honest-2", 1.2, t0);
        clip.record(&"honest-3", 0.8, t0);
        assert_eq!(clip.radius(t0), times(1.2));
        // At either extreme, the liar keeps it within the honest distances' range.
        clip.record(&"liar", 0.0, t0);
        assert_eq!(clip.radius(t0), times(1.0));
        // However often it exchanges, a peer is one entry.
        for _ in 0..100 {
            clip.record(&"liar", 1_000.0, t0);
        }
        assert_eq!(clip.radius(t0), times(1.2));
        // Distances of long ago are forgotten.
        let later = t0 + CLIP_MEMORY + Duration::from_secs(1);
        assert_eq!(clip.radius(later), None);
        clip.record(&"honest-1", 0.5, later);
        assert_eq!(clip.radius(later), times(0.5));
    }

    #[test]
    fn the_clip_radius_remembers_a_bounded_number_of_peers() {
        let t0 = Instant::now();
        let mut clip = ClipRadius::new(1.5);
        for i in 0..(CLIP_PEERS as u64 + 10) {
            clip.record(&i, 1.0, t0 + Duration::from_millis(i));
        }
        assert_eq!(clip.latest.len(), CLIP_PEERS);
        assert!(!clip.latest.contains_key(&0), "the oldest is forgotten");
    }
}
