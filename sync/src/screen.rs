//! The checks of everything received, each failing with a typed [`Rejection`]: a whole buffer
//! of this model, finite values, and (for parameters and deltas) the policy's [`Screen`]: a
//! distance within the limit its running median sets, and a difference clipped to its radius
//! before the mix (decisions 0041, 0045).
//!
//! The screen's sequence is the same for every exchange, on either side, and is written once:
//! [`Screen::admit`] declines an outlier (the exchange ends without a mix, and the partner is
//! told so), and the [`Admitted`] parameters it lets through are clipped within the radius,
//! which gives the outcome the policy learns from ([`Admitted::clip_mix`] for a dense pairwise
//! mix, [`Admitted::clip_step`] for a compressed one, [`Admitted::clip`] for a worker at the
//! center, [`Admitted::clip_delta`] for an elastic delta). Nothing else can make a mix's
//! outcome.

use murmur_protocol::codec::all_finite;
use murmur_protocol::mix::{self, Radial, radial_sums, sum_over};
use murmur_protocol::sync::{ClipRule, RADIUS_GROWTH};

use crate::copies::{ConsensusStep, Copies, STEP_RUN};
use crate::policy::Outcome;
use crate::rejection::Rejection;

/// Distances below this share of a replica's norm are never outliers: once replicas agree, the
/// median gets tiny and ordinary drift would otherwise look like an outlier.
const OUTLIER_FLOOR: f64 = 0.05;

/// Below this share of its own norm a replica with no known peer distance clips what it
/// mixes: a fresh start (or restart) has no baseline, and accepting anything until it had
/// one would be the warm-up an attacker waits for. The radius grows from there by the clip
/// factor per exchange as honest peers' distances come in.
pub const COLD_CLIP_SHARE: f64 = 0.01;

/// What received parameters (or an elastic delta) are held to, as the policy set it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Screen {
    /// Farther than this from the replica (and past the floor) is an outlier, declined;
    /// `None` while the policy has no baseline.
    pub limit: Option<f64>,
    /// The clip radius (see `ClipRadius`); `None` while no peer distance is known.
    pub radius: Option<f64>,
    /// Past this many radii, parameters move the mix the less the farther they lie (see
    /// `ClipRule`).
    pub knee: f64,
    /// The share of the radius that the part of a difference along the replica may take (see
    /// `ClipRule`).
    pub radial: f64,
}

impl Default for Screen {
    /// No baseline yet, and the gentler knee.
    fn default() -> Self {
        Screen {
            limit: None,
            radius: None,
            knee: ClipRule::CENTER.knee,
            radial: ClipRule::CENTER.radial,
        }
    }
}

/// Received parameters (or an elastic delta) that the screen did not decline: they are
/// clipped before the mix, and only then make an outcome.
#[derive(Debug)]
#[must_use = "admitted parameters are clipped before they are mixed"]
pub struct Admitted {
    screen: Screen,
    distance: f64,
}

/// Admitted parameters, clipped: what the mix reports.
#[derive(Debug, PartialEq)]
pub struct Cleared {
    /// [`Outcome::Mixed`], with the distance and the share of it the policy is credited.
    pub outcome: Outcome,
    /// They lay past the radius and were moved within it (the node counts it).
    pub clipped: bool,
}

impl Screen {
    /// The first step for what a partner sent: parameters `distance` from the replica `own`
    /// (or an elastic delta of that length) past the limit are an outlier, declined with
    /// [`Outcome::Outlier`]; others are admitted, to be clipped.
    pub fn admit(self, distance: f64, own: &[f32]) -> Result<Admitted, Outcome> {
        self.admit_by(distance, || mix::norm(own))
    }

    /// [`Screen::admit`] for a replica known by its norm, `own_norm` (a compressed exchange
    /// lets its snapshot go once its difference is made, decision 0090).
    pub fn admit_by_norm(self, distance: f64, own_norm: f64) -> Result<Admitted, Outcome> {
        self.admit_by(distance, || own_norm)
    }

    /// `own_norm` is read only where the distance is past the limit.
    fn admit_by(self, distance: f64, own_norm: impl FnOnce() -> f64) -> Result<Admitted, Outcome> {
        if is_outlier(distance, self.limit, own_norm) {
            return Err(Outcome::Outlier { distance });
        }
        Ok(Admitted {
            screen: self,
            distance,
        })
    }

    /// The radius to clip to around `own`: the policy's, or a small share of `own`'s norm.
    pub fn radius(&self, own: &[f32]) -> f64 {
        self.radius.unwrap_or_else(|| cold_radius(own))
    }

    /// The distance the clip radius learns from a mix at `distance` from `own`: at most
    /// [`RADIUS_GROWTH`] times the radius it was clipped to, or times the cold radius where
    /// that is larger. Honest distances that grow (as learning rates warm up) widen the radius
    /// by up to that factor per exchange, and a peer alone in this replica's memory cannot
    /// widen it faster however far it lies. The cold radius is the base because a radius
    /// learnt from a distance of zero (a worker that has just taken the center's state lies
    /// exactly on it) would otherwise be zero for good: every later mix clipped to nothing,
    /// and credited as nothing.
    fn credited(&self, distance: f64, cold: f64) -> f64 {
        distance.min(RADIUS_GROWTH * self.radius.map_or(cold, |radius| radius.max(cold)))
    }

    /// Moves `other`, `distance` from `own`, within the radius, counted the less the farther
    /// past the knee it lies, after holding the part of the difference along `own` (toward
    /// the origin or away from it) to the rule's share of the radius; whether it was clipped.
    fn clip(&self, other: &mut [f32], own: &[f32], distance: f64, cold: f64) -> bool {
        let radius = self.radius.unwrap_or(cold);
        // `distance` may be a multiple of the difference's length (a compressed exchange's
        // gap, of which the difference is a share): the cap is set on the same scale.
        let shortened = (self.radial.is_finite() && distance > 0.0)
            .then(|| mix::clip_radial(other, own, self.radial * radius / distance))
            .flatten();
        let distance = distance * shortened.unwrap_or(1.0);
        mix::clip_toward(other, own, distance, radius, self.knee) < distance || shortened.is_some()
    }

    /// Scales the elastic `delta`, of norm `length`, within the radius (around the replica
    /// `own`); whether it was clipped.
    fn clip_delta(&self, delta: &mut [f32], length: f64, cold: f64) -> bool {
        mix::clip_norm(delta, length, self.radius.unwrap_or(cold)) < length
    }
}

impl Admitted {
    /// The distance it was admitted at.
    pub fn distance(&self) -> f64 {
        self.distance
    }

    /// Moves the parameters `other` within the radius around `own` (see the rule of
    /// [`ClipRule`]) before they are mixed. The distance may be a multiple of `other - own`'s
    /// length (a compressed exchange's gap between the pair's copies): the radius is held on
    /// the same scale.
    pub fn clip(self, other: &mut [f32], own: &[f32]) -> Cleared {
        // The replica's norm, a pass over the model, is read once.
        let cold = cold_radius(own);
        let clipped = self.screen.clip(other, own, self.distance, cold);
        self.cleared(cold, clipped)
    }

    /// Shortens a dense pairwise mix's `delta` (the partner's parameters less this side's
    /// snapshot `own`, of norm `own_norm`) as [`Admitted::clip`] moves parameters within the
    /// radius around the replica: the part along the replica first, then the whole.
    pub fn clip_mix(self, delta: &mut [f32], own: &[f32], own_norm: f64) -> Cleared {
        let (clip, cleared) = self.mix_clip(own_norm, || {
            let mut sums = [0.0; 3];
            for (delta, own) in delta.chunks(STEP_RUN).zip(own.chunks(STEP_RUN)) {
                add_sums(&mut sums, sum_over(delta, own, radial_sums));
            }
            sums
        });
        if let Some(excess) = clip.excess {
            let values = delta.iter_mut().zip(own);
            values.for_each(|(d, x)| *d -= excess * x);
        }
        if let Some(shrink) = clip.shrink {
            mix::scale(delta, shrink);
        }
        cleared
    }

    /// The same clip for a compressed exchange's mix, CHOCO's consensus step of `scale` over
    /// the pair's `copies` as the exchange left them: the step to read off them when it
    /// lands (decision 0092). This side's copy, the replica as the partner knows it, tracks
    /// the snapshot within what the codec loses and stands for its direction (decision 0090);
    /// `own_norm` is the snapshot's.
    pub fn clip_step(self, copies: &Copies, scale: f32, own_norm: f64) -> (ConsensusStep, Cleared) {
        let (clip, cleared) = self.mix_clip(own_norm, || {
            let mut sums = [0.0; 3];
            copies.consensus_runs(scale, |_, step, own| {
                add_sums(&mut sums, sum_over(step, own, radial_sums));
            });
            sums
        });
        let step = ConsensusStep {
            scale,
            excess: clip.excess,
            shrink: clip.shrink,
        };
        (step, cleared)
    }

    /// The clip of a pairwise mix's delta whose [`radial_sums`] along the replica (of norm
    /// `own_norm`) `sums` adds up, only where the radial rule needs them: the radial share
    /// first, then the radius and its knee (as in `Screen::clip`).
    fn mix_clip(self, own_norm: f64, sums: impl FnOnce() -> [f64; 3]) -> (MixClip, Cleared) {
        let cold = COLD_CLIP_SHARE * own_norm;
        let screen = self.screen;
        let radius = screen.radius.unwrap_or(cold);
        let distance = self.distance;
        // As in `Screen::clip`: the distance may be a multiple of the delta's length.
        let radial = (screen.radial.is_finite() && distance > 0.0)
            .then(|| Radial::of(sums(), screen.radial * radius / distance))
            .flatten();
        let before = distance * radial.map_or(1.0, |radial| radial.ratio);
        let after = mix::clipped_distance(before, radius, screen.knee);
        let clip = MixClip {
            excess: radial.map(|radial| radial.excess),
            shrink: (after < before).then_some((after / before) as f32),
        };
        let clipped = clip.shrink.is_some() || clip.excess.is_some();
        (clip, self.cleared(cold, clipped))
    }

    /// Scales the elastic delta within the radius around the replica `own`.
    pub fn clip_delta(self, delta: &mut [f32], own: &[f32]) -> Cleared {
        let cold = cold_radius(own);
        let clipped = self.screen.clip_delta(delta, self.distance, cold);
        self.cleared(cold, clipped)
    }

    /// `cold`: the cold radius of the replica it was cleared around ([`cold_radius`]).
    fn cleared(&self, cold: f64, clipped: bool) -> Cleared {
        Cleared {
            outcome: Outcome::Mixed {
                distance: self.distance,
                credited: self.screen.credited(self.distance, cold),
            },
            clipped,
        }
    }
}

/// How a pairwise mix's delta is shortened ([`Admitted::mix_clip`]): less `excess` times the
/// replica (the radial share), then times `shrink` (the radius).
#[derive(Clone, Copy, Debug)]
struct MixClip {
    excess: Option<f32>,
    shrink: Option<f32>,
}

fn add_sums(sums: &mut [f64; 3], part: [f64; 3]) {
    sums.iter_mut()
        .zip(part)
        .for_each(|(sum, part)| *sum += part);
}

/// The radius of a replica `own` that knows no peer's distance.
fn cold_radius(own: &[f32]) -> f64 {
    COLD_CLIP_SHARE * mix::norm(own)
}

/// Checks that `values` is a whole buffer of `count` values; the rejection names `what`.
pub fn whole(values: &[f32], count: usize, what: &'static str) -> Result<(), Rejection> {
    if values.len() != count {
        return Err(Rejection::WrongLength {
            what,
            found: values.len(),
            expected: count,
        });
    }
    Ok(())
}

/// Checks that `values` is a whole buffer of `count` finite values; the rejection names `what`.
pub fn full_and_finite(values: &[f32], count: usize, what: &'static str) -> Result<(), Rejection> {
    whole(values, count, what)?;
    if !all_finite(values) {
        return Err(Rejection::NotFinite { what });
    }
    Ok(())
}

/// Whether `distance` from the replica of norm `own_norm` is past `limit` (the policy's; `None`
/// while it has no baseline) and past the floor.
fn is_outlier(distance: f64, limit: Option<f64>, own_norm: impl FnOnce() -> f64) -> bool {
    !distance.is_finite()
        || limit.is_some_and(|limit| distance > limit && distance > OUTLIER_FLOOR * own_norm())
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use murmur_protocol::sync::ClipRadius;

    use super::*;

    #[test]
    fn buffers_of_another_length_or_with_nan_are_rejected_by_name() {
        assert_eq!(full_and_finite(&[1.0, 2.0], 2, "parameters"), Ok(()));
        assert_eq!(
            full_and_finite(&[1.0], 2, "parameters"),
            Err(Rejection::WrongLength {
                what: "parameters",
                found: 1,
                expected: 2
            })
        );
        let error = full_and_finite(&[1.0, f32::NAN], 2, "center").unwrap_err();
        assert_eq!(error.to_string(), "center contain NaN or infinite values");
    }

    #[test]
    fn outliers_are_past_both_the_limit_and_the_floor() {
        let own = [3.0f32, 4.0]; // norm 5: the floor is 0.25
        // (distance, limit, outlier)
        let table = [
            (0.1, None, false),
            (100.0, None, false),
            (0.2, Some(0.1), false), // under the floor
            (0.3, Some(0.1), true),
            (0.3, Some(1.0), false),
            (f64::NAN, None, true),
        ];
        for (distance, limit, outlier) in table {
            assert_eq!(
                Screen {
                    limit,
                    ..Screen::default()
                }
                .admit(distance, &own)
                .is_err(),
                outlier,
                "{distance} {limit:?}"
            );
        }
    }

    /// The sequence every exchange goes through: an outlier is declined with its distance;
    /// anything else is moved within the radius, and the policy is credited with at most
    /// [`RADIUS_GROWTH`] radii of its distance.
    #[test]
    fn what_is_admitted_is_clipped_and_credited_and_an_outlier_is_declined() {
        let own = [0.0f32, 10.0];
        let screen = Screen {
            limit: Some(20.0),
            radius: Some(1.0),
            ..Screen::default()
        };
        let mut far = [0.0f32, 40.0];
        assert_eq!(
            screen.admit(mix::distance(&far, &own), &own).unwrap_err(),
            Outcome::Outlier { distance: 30.0 }
        );
        let mut near = [0.0f32, 16.0];
        let admitted = screen.admit(mix::distance(&near, &own), &own).unwrap();
        let cleared = admitted.clip(&mut near, &own);
        assert!(cleared.clipped);
        assert!(mix::distance(&near, &own) <= 1.0 + 1e-6, "{near:?}");
        assert_eq!(
            cleared.outcome,
            Outcome::Mixed {
                distance: 6.0,
                credited: RADIUS_GROWTH * 1.0
            }
        );
        let mut delta = [3.0f32, 4.0];
        let admitted = screen.admit(mix::norm(&delta), &own).unwrap();
        let cleared = admitted.clip_delta(&mut delta, &own);
        assert!(cleared.clipped && (mix::norm(&delta) - 1.0).abs() < 1e-6);
        far = [0.0, 10.5];
        let cleared = screen.admit(0.5, &own).unwrap().clip(&mut far, &own);
        assert!(!cleared.clipped);
        assert_eq!(
            cleared.outcome,
            Outcome::Mixed {
                distance: 0.5,
                credited: 0.5
            }
        );
    }

    #[test]
    fn with_no_peer_distance_the_radius_is_a_share_of_the_own_norm() {
        let own = [30.0f32, 40.0]; // norm 50
        let cold = Screen::default();
        assert!((cold.radius(&own) - 0.5).abs() < 1e-12);
        let known = Screen {
            radius: Some(3.0),
            ..Screen::default()
        };
        assert_eq!(known.radius(&own), 3.0);
        // The policy learns a far mix as four times the radius, a near one as it is.
        assert_eq!(known.credited(100.0, cold_radius(&own)), 12.0);
        assert_eq!(known.credited(1.0, cold_radius(&own)), 1.0);
        // Below the cold radius, it grows from the cold radius.
        let tiny = Screen {
            radius: Some(0.01),
            ..Screen::default()
        };
        assert!((tiny.credited(100.0, cold_radius(&own)) - 2.0).abs() < 1e-12);
    }

    /// Shrinking a replica within the radius passed the clip whole; the pairwise rule holds
    /// the part along the replica to a quarter of the radius and leaves the rest.
    #[test]
    fn a_pairwise_screen_holds_a_push_toward_the_origin_to_a_share_of_the_radius() {
        let own = [4.0f32, 0.0];
        let screen = Screen {
            radius: Some(2.0),
            knee: ClipRule::PAIRWISE.knee,
            radial: ClipRule::PAIRWISE.radial,
            ..Screen::default()
        };
        // 1.5 toward the origin and 1 across: within the radius, but held to 0.5 along.
        let mut shrunk = [2.5f32, 1.0];
        let distance = mix::distance(&shrunk, &own);
        assert!(screen.clip(&mut shrunk, &own, distance, cold_radius(&own)));
        assert_eq!(shrunk, [3.5, 1.0]);
        // A compressed exchange's distance is its gap, here twice the difference: the cap,
        // a quarter of the radius (0.5) on the gap's scale, is 0.25 on the difference's.
        let mut sparse = [3.25f32, 0.5];
        let gap = 2.0 * mix::distance(&sparse, &own);
        assert!(screen.clip(&mut sparse, &own, gap, cold_radius(&own)));
        assert!(
            (sparse[0] - 3.75).abs() < 1e-6 && sparse[1] == 0.5,
            "{sparse:?}"
        );
        // Across only: as before.
        let mut across = [4.0f32, 1.5];
        assert!(!screen.clip(&mut across, &own, 1.5, cold_radius(&own)));
        // The center's rule has no such share.
        let mut center_side = [2.5f32, 1.0];
        let center = Screen {
            radius: Some(2.0),
            ..Screen::default()
        };
        assert!(!center.clip(&mut center_side, &own, distance, cold_radius(&own)));
    }

    /// A pairwise mix's delta is clipped as the parameters it stands for would be around the
    /// replica (the radial share, then the radius and its knee), to the values' rounding; a
    /// compressed exchange's step, read off the pair's copies, by the same rule.
    #[test]
    fn a_delta_is_clipped_as_the_parameters_it_stands_for() {
        let n = 3 * (1 << 16) + 500;
        let own: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.01).sin()).collect();
        let screen = Screen {
            radius: Some(0.1),
            knee: ClipRule::PAIRWISE.knee,
            radial: ClipRule::PAIRWISE.radial,
            ..Screen::default()
        };
        // Toward the origin and across, several radii off: both clips bite.
        let delta: Vec<f32> = (0..n)
            .map(|i| -0.002 * own[i] + 0.001 * (i as f32 * 0.3).cos())
            .collect();
        let distance = mix::norm(&delta);
        assert!(distance > 0.4, "{distance}");
        let other: Vec<f32> = own.iter().zip(&delta).map(|(x, d)| x + d).collect();
        let mut clipped_other = other.clone();
        let cleared = screen
            .admit(distance, &own)
            .unwrap()
            .clip(&mut clipped_other, &own);
        assert!(cleared.clipped);
        let expected: Vec<f32> = clipped_other.iter().zip(&own).map(|(o, x)| o - x).collect();
        let length = mix::norm(&expected);
        assert!(length < 0.5 * distance, "{length}");

        let own_norm = mix::norm(&own);
        let mut clipped = delta.clone();
        let admitted = screen.admit_by_norm(distance, own_norm).unwrap();
        assert_eq!(admitted.clip_mix(&mut clipped, &own, own_norm), cleared);
        let off = mix::distance(&clipped, &expected);
        assert!(off < 1e-3 * length, "{off} off {length}");

        // The same rule read off a pair's copies (decision 0092): the step of a compressed
        // exchange is, value for value, the dense clip of the delta the copies hold along
        // this side's copy.
        let copies = Copies::holding(1, &own, &other);
        let (held_own, theirs) = (copies.own().to_vec(), copies.theirs().to_vec());
        let mut held: Vec<f32> = theirs.iter().zip(&held_own).map(|(t, o)| t - o).collect();
        let admit = || screen.admit_by_norm(distance, own_norm).unwrap();
        let (step, stepped) = admit().clip_step(&copies, 1.0, own_norm);
        assert_eq!(stepped, cleared);
        assert_eq!(admit().clip_mix(&mut held, &held_own, own_norm), cleared);
        assert_eq!(step.values(&copies, 1.0), held);
        // Within the radius and across: left as it is.
        let small: Vec<f32> = (0..n).map(|i| 1e-5 * (i as f32 * 0.3).cos()).collect();
        let beside: Vec<f32> = own.iter().zip(&small).map(|(x, d)| x + d).collect();
        let copies = Copies::holding(1, &own, &beside);
        let admitted = screen.admit_by_norm(mix::norm(&small), own_norm).unwrap();
        let (step, cleared) = admitted.clip_step(&copies, 1.0, own_norm);
        assert!(!cleared.clipped);
        assert_eq!((step.excess, step.shrink), (None, None));
    }

    /// On fresh copies as coarse as int4 makes them (a pair's first exchange, or the first
    /// after its copies were dropped), this side's copy still tells a push toward the origin
    /// from a difference across: the push is held to the radial share, the difference across
    /// is left whole.
    #[test]
    fn fresh_int4_copies_tell_a_push_toward_the_origin_from_a_difference_across() {
        let n = 3 * (1 << 16) + 500;
        let codec = murmur_protocol::codec::Codec::INT4;
        let coarse = |values: &[f32]| codec.decode(&codec.encode(values), values.len()).unwrap();
        let x: Vec<f32> = (0..n).map(|i| 1.0 + (i as f32 * 0.01).sin()).collect();
        let dot = |a: &[f32], b: &[f32]| sum_over(a, b, |a, b| [f64::from(a) * f64::from(b)])[0];
        let unit = mix::norm(&x);
        let along_x = |d: &[f32]| dot(d, &x) / unit;
        let mut across: Vec<f32> = (0..n).map(|i| 0.5 * (i as f32 * 0.3).cos()).collect();
        let share = dot(&across, &x) / (unit * unit);
        across
            .iter_mut()
            .zip(&x)
            .for_each(|(a, x)| *a -= share as f32 * x);
        let shrunk: Vec<f32> = x.iter().map(|x| 0.9 * x).collect();
        let beside: Vec<f32> = x.iter().zip(&across).map(|(x, a)| x + a).collect();
        for (partner, pushed) in [(shrunk, true), (beside, false)] {
            let copies = Copies::holding(1, &coarse(&x), &coarse(&partner));
            let (own, theirs) = (copies.own().to_vec(), copies.theirs().to_vec());
            let delta: Vec<f32> = theirs.iter().zip(&own).map(|(t, o)| t - o).collect();
            let length = mix::norm(&delta);
            // A radius past the delta: the radial share alone clips, a quarter of the radius.
            let screen = Screen {
                radius: Some(2.0 * length),
                radial: ClipRule::PAIRWISE.radial,
                ..Screen::default()
            };
            let before = along_x(&delta);
            let admitted = screen.admit_by_norm(length, unit).unwrap();
            let (step, cleared) = admitted.clip_step(&copies, 1.0, unit);
            let after = along_x(&step.values(&copies, 1.0));
            assert_eq!(cleared.clipped, pushed, "{before} {after}");
            let cap = ClipRule::PAIRWISE.radial * 2.0 * length;
            if pushed {
                assert!(before < -1.5 * cap, "{before} {cap}");
                assert!((after + cap).abs() < 0.02 * cap, "{after} {cap}");
            } else {
                // What int4 lost of the two replicas, and no more.
                assert!(before.abs() < 0.1 * cap, "{before} {cap}");
                assert_eq!(after, before);
            }
        }
    }

    /// A worker that has just taken the center's state lies exactly on it. Learnt as it is,
    /// that zero left the center's radius at zero for good: with one worker, the center
    /// clipped every later mix to nothing (a node test caught it about once in ten runs).
    #[test]
    fn a_zero_distance_shuts_the_radius_for_one_mix_at_most() {
        let own = [30.0f32, 40.0]; // norm 50: the cold radius is 0.5
        let mut memory = ClipRadius::new(ClipRule::CENTER.factor);
        let now = Instant::now();
        memory.record(&"worker", 0.0, now);
        let mut clipped = 0;
        for _ in 0..10 {
            let screen = Screen {
                radius: memory.radius(now),
                ..Screen::default()
            };
            let distance = 3.0;
            if distance > screen.radius(&own) {
                clipped += 1;
            }
            memory.record(&"worker", screen.credited(distance, cold_radius(&own)), now);
        }
        assert_eq!(clipped, 1);
    }
}
