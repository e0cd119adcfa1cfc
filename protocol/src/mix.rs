//! The averaging math of the sync modes, on flat host buffers. The daemon moves the buffers;
//! this module only says what to do with them.

/// Push-pull gossip: `x <- x + w (other - base)`, where `base` is the snapshot this replica
/// sent (or answered with). Both sides applying it with the same `w` preserves the mean of
/// the two snapshots, whatever the replicas did while the exchange was in flight.
pub fn mix_toward(x: &mut [f32], other: &[f32], base: &[f32], weight: f32) {
    assert_eq!(x.len(), other.len(), "mix of buffers of different length");
    assert_eq!(x.len(), base.len(), "mix of buffers of different length");
    for ((x, o), b) in x.iter_mut().zip(other).zip(base) {
        *x += weight * (o - b);
    }
}

/// [`mix_toward`]'s move alone, computed in place: the partner's parameters `other` become the
/// delta `w (other - base)` that the mix adds, with no buffer of its own (a mix of a large
/// model then costs one pass over two buffers).
pub fn into_delta(other: &mut [f32], base: &[f32], weight: f32) {
    assert_eq!(
        other.len(),
        base.len(),
        "mix of buffers of different length"
    );
    for (o, b) in other.iter_mut().zip(base) {
        *o = weight * (*o - b);
    }
}

/// One elastic-averaging (EASGD) exchange at the center: `d = alpha (worker - center)`, the
/// center moves by `+d`, and `d` is returned for the worker to subtract.
pub fn elastic_step(center: &mut [f32], worker: &[f32], alpha: f32) -> Vec<f32> {
    assert_eq!(
        center.len(),
        worker.len(),
        "elastic step on different lengths"
    );
    center
        .iter_mut()
        .zip(worker)
        .map(|(c, w)| {
            let d = alpha * (w - *c);
            *c += d;
            d
        })
        .collect()
}

/// Moves `other` toward `own` when it lies farther than `radius` from it, keeping the
/// direction of `other - own` (of length `distance`): up to `knee` radii off it ends `radius`
/// away (clipped); farther off it ends `knee * radius^2 / distance` away, so that it counts the
/// less the farther it lies (a redescending influence: with a knee of 2, parameters twenty
/// radii off move the mix a tenth of a radius). Returns the distance after.
pub fn clip_toward(other: &mut [f32], own: &[f32], distance: f64, radius: f64, knee: f64) -> f64 {
    assert_eq!(
        other.len(),
        own.len(),
        "clip of buffers of different length"
    );
    let after = clipped_distance(distance, radius, knee);
    if after < distance {
        let factor = (after / distance) as f32;
        for (o, x) in other.iter_mut().zip(own) {
            *o = x + factor * (*o - x);
        }
    }
    after
}

/// How far [`clip_toward`] leaves parameters that lay `distance` off: `distance` within
/// `radius`, `radius` up to `knee` radii, `knee * radius^2 / distance` past them.
pub fn clipped_distance(distance: f64, radius: f64, knee: f64) -> f64 {
    if distance <= radius || distance == 0.0 {
        distance
    } else if distance <= knee * radius {
        radius
    } else {
        knee * radius * radius / distance
    }
}

/// Shortens the part of `other - own` that lies along `own` (toward the origin or away from
/// it) to at most `share` of the difference's length, leaving the rest of the difference as
/// it is. Returns the ratio of the difference's length after to before, or `None` when it
/// was left as it was.
pub fn clip_radial(other: &mut [f32], own: &[f32], share: f64) -> Option<f64> {
    assert_eq!(
        other.len(),
        own.len(),
        "radial clip of buffers of different length"
    );
    let sums = sum_over(other, own, |o, x| radial_sums(o - x, x));
    let radial = Radial::of(sums, share)?;
    for (o, x) in other.iter_mut().zip(own) {
        *o -= radial.excess * x;
    }
    Some(radial.ratio)
}

/// The three sums [`clip_radial`] decides by, for one value of a difference `d` and of the
/// replica `x`: `d x`, `d^2` and `x^2`.
#[inline]
pub fn radial_sums(d: f32, x: f32) -> [f64; 3] {
    let (d, x) = (f64::from(d), f64::from(x));
    [d * x, d * d, x * x]
}

/// How much of the replica a radial clip takes off a difference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Radial {
    /// The difference less `excess` times the replica is held to the share.
    pub excess: f32,
    /// The difference's length after, to before.
    pub ratio: f64,
}

impl Radial {
    /// The clip of a difference whose [`radial_sums`] add up to `sums`, whose part along the
    /// replica may take `share` of its length; `None` where it is left as it is.
    pub fn of([along, length2, own2]: [f64; 3], share: f64) -> Option<Radial> {
        if own2 == 0.0 || length2 == 0.0 {
            return None;
        }
        let own_norm = own2.sqrt();
        let along = along / own_norm;
        let cap = share * length2.sqrt();
        if along.abs() <= cap {
            return None;
        }
        let excess = ((along - cap.copysign(along)) / own_norm) as f32;
        let after2 = length2 - along * along + cap * cap;
        Some(Radial {
            excess,
            ratio: (after2 / length2).sqrt(),
        })
    }
}

/// Scales `d` down to a norm of `radius` when its norm, `length`, is longer. Returns the norm
/// after clipping.
pub fn clip_norm(d: &mut [f32], length: f64, radius: f64) -> f64 {
    if length <= radius || length == 0.0 {
        return length;
    }
    scale(d, (radius / length) as f32);
    radius
}

/// `x <- x - d`: the worker's half of an elastic exchange.
pub fn subtract(x: &mut [f32], d: &[f32]) {
    assert_eq!(x.len(), d.len(), "subtract of buffers of different length");
    for (x, d) in x.iter_mut().zip(d) {
        *x -= d;
    }
}

/// `x <- x + d`: a move computed elsewhere (a mix's or an outer step's), added as it came.
pub fn add(x: &mut [f32], d: &[f32]) {
    assert_eq!(x.len(), d.len(), "add of buffers of different length");
    for (x, d) in x.iter_mut().zip(d) {
        *x += d;
    }
}

/// `x <- x * factor`: a sum of `p` replicas' buffers into their mean.
pub fn scale(x: &mut [f32], factor: f32) {
    for v in x {
        *v *= factor;
    }
}

/// The DiLoCo outer optimizer: Nesterov momentum on the "outer gradient" `anchor - average`,
/// where `anchor` is the parameters every replica started the last `H` local steps from and
/// `average` their all-reduced mean after them. Every replica holds the same anchor and
/// velocity, so every replica computes the same new parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct OuterNesterov {
    lr: f32,
    momentum: f32,
    velocity: Vec<f32>,
}

impl OuterNesterov {
    pub fn new(lr: f32, momentum: f32) -> Self {
        OuterNesterov {
            lr,
            momentum,
            velocity: Vec::new(),
        }
    }

    /// Moves `anchor` to the new parameters: `g = anchor - average`, `v <- mu v + g`,
    /// `anchor <- anchor - lr (g + mu v)`. With `lr = 1` and `mu = 0` that is plain averaging.
    pub fn step(&mut self, anchor: &mut [f32], average: &[f32]) {
        assert_eq!(
            anchor.len(),
            average.len(),
            "outer step on different lengths"
        );
        if self.velocity.len() != anchor.len() {
            self.velocity = vec![0.0; anchor.len()];
        }
        let (lr, mu) = (self.lr, self.momentum);
        for ((a, &m), v) in anchor.iter_mut().zip(average).zip(&mut self.velocity) {
            let g = *a - m;
            *v = mu * *v + g;
            *a -= lr * (g + mu * *v);
        }
    }

    /// The velocity; empty before the first outer step.
    pub fn velocity(&self) -> &[f32] {
        &self.velocity
    }

    /// Takes over another replica's velocity (state sync); an empty one starts from zero.
    pub fn set_velocity(&mut self, velocity: Vec<f32>) {
        self.velocity = velocity;
    }
}

/// Euclidean norm, accumulated in f64.
pub fn norm(x: &[f32]) -> f64 {
    let [sum] = sum_over(x, x, |v, _| {
        let v = f64::from(v);
        [v * v]
    });
    sum.sqrt()
}

/// `||a - b||`, accumulated in f64.
pub fn distance(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "distance of buffers of different length");
    let [sum] = sum_over(a, b, |a, b| {
        let d = f64::from(a) - f64::from(b);
        [d * d]
    });
    sum.sqrt()
}

/// Running sums a reduction keeps side by side.
const LANES: usize = 8;

/// The sums of `term` over the pairs of `a` and `b` (of one length), `K` sums at once,
/// accumulated in f64. A single running sum waits on each add (some four cycles a value,
/// several times what reading the value costs); eight independent ones, added up at the
/// end, let the processor and the compiler's vector code overlap them. The order of the
/// additions is fixed by the length alone, so a sum is the same on every run and on both sides
/// of a pair.
pub fn sum_over<const K: usize>(
    a: &[f32],
    b: &[f32],
    term: impl Fn(f32, f32) -> [f64; K],
) -> [f64; K] {
    let mut lanes = [[0.0f64; K]; LANES];
    let (mut a_blocks, mut b_blocks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    for (x, y) in (&mut a_blocks).zip(&mut b_blocks) {
        for (lane, (&x, &y)) in lanes.iter_mut().zip(x.iter().zip(y)) {
            for (sum, t) in lane.iter_mut().zip(term(x, y)) {
                *sum += t;
            }
        }
    }
    let mut total = [0.0f64; K];
    let rest = a_blocks.remainder().iter().zip(b_blocks.remainder());
    for terms in lanes.into_iter().chain(rest.map(|(&x, &y)| term(x, y))) {
        for (sum, t) in total.iter_mut().zip(terms) {
            *sum += t;
        }
    }
    total
}

/// The element-wise mean of replicas, accumulated in f64 (`None` without replicas or when
/// their lengths differ).
fn mean_f64(replicas: &[&[f32]]) -> Option<Vec<f64>> {
    let first = replicas.first()?;
    if replicas.iter().any(|r| r.len() != first.len()) {
        return None;
    }
    let n = replicas.len() as f64;
    let mut mean = vec![0f64; first.len()];
    for r in replicas {
        for (m, &v) in mean.iter_mut().zip(r.iter()) {
            *m += f64::from(v) / n;
        }
    }
    Some(mean)
}

/// The element-wise mean of replicas: the model that perfect averaging would give (`None`
/// without replicas or when their lengths differ).
pub fn mean(replicas: &[&[f32]]) -> Option<Vec<f32>> {
    Some(mean_f64(replicas)?.into_iter().map(|m| m as f32).collect())
}

/// The consensus distance of replicas: `max_i ||x_i - mean|| / ||mean||` (0 for identical
/// replicas; `None` without replicas or when their lengths differ).
pub fn consensus_distance(replicas: &[&[f32]]) -> Option<f64> {
    let mean = mean_f64(replicas)?;
    let mean_norm = mean.iter().map(|m| m * m).sum::<f64>().sqrt();
    let worst = replicas
        .iter()
        .map(|r| {
            r.iter()
                .zip(&mean)
                .map(|(&v, m)| (f64::from(v) - m).powi(2))
                .sum::<f64>()
                .sqrt()
        })
        .fold(0.0, f64::max);
    Some(if mean_norm > 0.0 {
        worst / mean_norm
    } else {
        worst
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outer_nesterov_without_momentum_at_lr_one_is_plain_averaging() {
        let mut anchor = vec![1.0f32, -2.0];
        OuterNesterov::new(1.0, 0.0).step(&mut anchor, &[0.5, 4.0]);
        assert_eq!(anchor, vec![0.5, 4.0]);
    }

    #[test]
    fn outer_nesterov_follows_the_formula_over_two_rounds() {
        let mut outer = OuterNesterov::new(0.5, 0.9);
        let mut anchor = vec![1.0f32];
        // g = 1 - 0.8 = 0.2, v = 0.2, anchor = 1 - 0.5 (0.2 + 0.18) = 0.81
        outer.step(&mut anchor, &[0.8]);
        assert!((anchor[0] - 0.81).abs() < 1e-6, "{anchor:?}");
        // g = 0.81 - 0.61 = 0.2, v = 0.18 + 0.2 = 0.38, anchor = 0.81 - 0.5 (0.2 + 0.342) = 0.539
        outer.step(&mut anchor, &[0.61]);
        assert!((anchor[0] - 0.539).abs() < 1e-6, "{anchor:?}");
        assert!((outer.velocity()[0] - 0.38).abs() < 1e-6);
        outer.set_velocity(Vec::new());
        // A fresh velocity: g = 0.539 - 0.339 = 0.2, v = 0.2, anchor = 0.539 - 0.5 * 0.38
        outer.step(&mut anchor, &[0.339]);
        assert!((anchor[0] - 0.349).abs() < 1e-6, "{anchor:?}");
    }

    #[test]
    fn push_pull_preserves_the_mean_of_the_snapshots() {
        let (a0, b0) = (vec![1.0f32, 2.0, 3.0], vec![3.0f32, 0.0, -1.0]);
        // Each replica moved on (trained) while the exchange was in flight.
        let mut a = vec![1.5f32, 2.0, 3.0];
        let mut b = vec![3.0f32, 0.5, -1.0];
        mix_toward(&mut a, &b0, &a0, 0.5);
        mix_toward(&mut b, &a0, &b0, 0.5);
        assert_eq!(a, vec![2.5, 1.0, 1.0]);
        assert_eq!(b, vec![2.0, 1.5, 1.0]);
        // Without local progress both land exactly on the mean.
        let (mut a, mut b) = (a0.clone(), b0.clone());
        mix_toward(&mut a, &b0, &a0, 0.5);
        mix_toward(&mut b, &a0, &b0, 0.5);
        assert_eq!(a, b);
        assert_eq!(a, vec![2.0, 1.0, 1.0]);
    }

    #[test]
    fn the_delta_in_place_is_the_move_of_the_mix() {
        let (base, other) = (vec![1.0f32, 2.0, -3.5], vec![3.0f32, 0.25, 1.0]);
        let mut moved = vec![0.0f32; 3];
        mix_toward(&mut moved, &other, &base, 0.5);
        let mut delta = other.clone();
        into_delta(&mut delta, &base, 0.5);
        assert_eq!(delta, moved);
    }

    #[test]
    fn elastic_step_moves_center_and_worker_toward_each_other() {
        let mut center = vec![0.0f32, 0.0];
        let mut worker = vec![1.0f32, -2.0];
        let d = elastic_step(&mut center, &worker, 0.25);
        subtract(&mut worker, &d);
        assert_eq!(d, vec![0.25, -0.5]);
        assert_eq!(center, vec![0.25, -0.5]);
        assert_eq!(worker, vec![0.75, -1.5]);
        // The sum of center and worker is conserved.
        assert_eq!(center[0] + worker[0], 1.0);
    }

    #[test]
    fn consensus_distance_is_relative_to_the_mean() {
        let a = [1.0f32, 0.0];
        let b = [3.0f32, 0.0];
        // mean (2, 0), each 1 away: 1/2.
        assert_eq!(consensus_distance(&[&a, &b]), Some(0.5));
        assert_eq!(consensus_distance(&[&a, &a]), Some(0.0));
        assert_eq!(consensus_distance(&[]), None);
        assert_eq!(consensus_distance(&[&a, &[1.0f32][..]]), None);
        assert_eq!(distance(&a, &b), 2.0);
        assert_eq!(norm(&b), 3.0);
    }

    #[test]
    fn clipping_keeps_the_direction_and_counts_far_differences_less() {
        let own = [1.0f32, 1.0];
        let mut far = [4.0f32, 5.0]; // 5 away: two radii, clipped to one below a knee of 2
        assert_eq!(clip_toward(&mut far, &own, 5.0, 2.5, 2.0), 2.5);
        assert_eq!(far, [2.5, 3.0]);
        let mut farther = [7.0f32, 9.0]; // 10 away: eight radii, a quarter of a radius
        assert_eq!(clip_toward(&mut farther, &own, 10.0, 1.25, 2.0), 0.3125);
        assert_eq!(farther, [1.1875, 1.25]);
        let mut far = [4.0f32, 5.0]; // two radii past a knee of 1: half a radius
        assert_eq!(clip_toward(&mut far, &own, 5.0, 2.5, 1.0), 1.25);
        assert_eq!(far, [1.75, 2.0]);
        let mut near = [2.0f32, 1.0];
        assert_eq!(clip_toward(&mut near, &own, 1.0, 2.5, 1.0), 1.0);
        assert_eq!(near, [2.0, 1.0]);
        let mut delta = [3.0f32, -4.0];
        assert_eq!(clip_norm(&mut delta, 5.0, 1.0), 1.0);
        assert_eq!(delta, [0.6, -0.8]);
    }

    #[test]
    fn the_radial_clip_shortens_only_the_part_along_the_replica() {
        let own = [3.0f32, 0.0];
        // 2 toward the origin and 1.5 across (2.5 long): held to 0.2 of the length, 0.5.
        let mut shrunk = [1.0f32, 1.5];
        let ratio = clip_radial(&mut shrunk, &own, 0.2).unwrap();
        assert_eq!(shrunk, [2.5, 1.5]);
        assert!((ratio - 2.5f64.sqrt() / 2.5).abs() < 1e-12, "{ratio}");
        // Away from the origin the same: 4 along and 3 across, held to 0.2 of 5.
        let mut scaled = [6.0f32, -3.0];
        assert!(clip_radial(&mut scaled, &[2.0, 0.0], 0.2).is_some());
        assert_eq!(scaled, [3.0, -3.0]);
        // Across, or within the share: untouched.
        let mut across = [3.2f32, 5.0];
        assert_eq!(clip_radial(&mut across, &own, 0.2), None);
        assert_eq!(across, [3.2, 5.0]);
        let mut from_zero = [1.0f32, 1.0];
        assert_eq!(clip_radial(&mut from_zero, &[0.0, 0.0], 0.1), None);
    }
}
