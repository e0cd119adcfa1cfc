//! A pair copy kept in two bytes a value (decision 0089): blocks of [`BLOCK`] values, each
//! stored as signed 16-bit levels of the block's own scale (its largest magnitude over
//! 32,767), where an `f32` takes four bytes.
//!
//! Both sides of a pair must hold the same copies bit for bit. A block is therefore encoded
//! again only whole, from the same `f32` sums on both sides ([`Scaled::add`] takes whole
//! blocks): what it holds does not depend on how the values were split on their way in.

use murmur_protocol::codec::nearest_integer;

/// Values that share a scale ([`Scaled::BLOCK`]).
const BLOCK: usize = 256;

/// The largest level either side of 0.
const LEVELS: f32 = 32_767.0;

/// A model's values, as signed 16-bit levels of a scale per block of [`Scaled::BLOCK`] values. A
/// value is kept within half a level of its block's largest magnitude over 32,767: 1.5 parts
/// in 100,000 of the block's largest value.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scaled {
    levels: Vec<i16>,
    /// Each block's scale: what one level is worth.
    scales: Vec<f32>,
}

impl Scaled {
    /// Values that share a scale: few enough that a block's largest value says little about
    /// the rest of its layer's, enough that the scales cost 1.6 % of the levels.
    pub const BLOCK: usize = BLOCK;

    /// `len` zeros.
    pub fn zeros(len: usize) -> Self {
        Scaled {
            levels: vec![0; len],
            scales: vec![0.0; len.div_ceil(BLOCK)],
        }
    }

    /// `values` (finite), as a copy keeps them.
    pub fn of(values: &[f32]) -> Self {
        let mut scaled = Scaled::zeros(values.len());
        scaled.add(0, &mut values.to_vec());
        scaled
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.levels.len()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.levels.is_empty()
    }

    /// Bytes a copy of `len` values takes.
    pub fn bytes_for(len: usize) -> u64 {
        (len * std::mem::size_of::<i16>() + len.div_ceil(BLOCK) * std::mem::size_of::<f32>()) as u64
    }

    /// The values from `at` on, into `out` (as many as it holds).
    pub fn read(&self, at: usize, out: &mut [f32]) {
        let mut done = 0;
        while done < out.len() {
            let start = at + done;
            let block = start / BLOCK;
            let n = ((block + 1) * BLOCK - start).min(out.len() - done);
            let scale = self.scales[block];
            let levels = &self.levels[start..start + n];
            for (value, &level) in out[done..done + n].iter_mut().zip(levels) {
                *value = f32::from(level) * scale;
            }
            done += n;
        }
    }

    /// Every value, as a vector of its own: for checks and tests (a whole model).
    pub fn to_vec(&self) -> Vec<f32> {
        let mut values = vec![0.0; self.len()];
        self.read(0, &mut values);
        values
    }

    /// Adds `values` to the copy's from `at` on, and leaves in `values` what the copy holds
    /// there now. Whole blocks (`at` a multiple of [`Scaled::BLOCK`], and `values` a whole number of
    /// blocks or running to the end), each encoded again once from its sums. The sums are the
    /// caller's to keep finite (a commit follows the gap's check, which refuses an exchange
    /// that would make a value that is not).
    ///
    /// # Panics
    ///
    /// Where the values are not whole blocks: the two sides of a pair could then split them
    /// differently and hold different copies.
    pub fn add(&mut self, at: usize, values: &mut [f32]) {
        let end = at + values.len();
        assert!(
            at.is_multiple_of(BLOCK) && (end.is_multiple_of(BLOCK) || end == self.len()),
            "a copy is added to in whole blocks: {at}..{end} of {}",
            self.len()
        );
        let mut held = [0.0f32; BLOCK];
        for (block, sums) in (at / BLOCK..).zip(values.chunks_mut(BLOCK)) {
            let held = &mut held[..sums.len()];
            self.read(block * BLOCK, held);
            sums.iter_mut()
                .zip(held.iter())
                .for_each(|(sum, h)| *sum += h);
            self.encode(block, sums);
        }
    }

    /// Keeps `values` as block `block`'s levels, with the scale that fits the largest, and
    /// leaves in `values` what the block holds.
    fn encode(&mut self, block: usize, values: &mut [f32]) {
        let largest = largest_magnitude(values);
        let (scale, inverse) = if largest > 0.0 && largest.is_finite() {
            (largest / LEVELS, LEVELS / largest)
        } else {
            (0.0, 0.0)
        };
        let start = block * BLOCK;
        let levels = &mut self.levels[start..start + values.len()];
        for (level, v) in levels.iter_mut().zip(values) {
            *level = nearest_integer((*v * inverse).clamp(-LEVELS, LEVELS)) as i16;
            *v = f32::from(*level) * scale;
        }
        self.scales[block] = scale;
    }
}

/// The largest `|v|` of `values` (a NaN counts for nothing), in eight lanes that the compiler
/// vectorises, where a fold through `f32::max` keeps NaN's rules a value at a time.
fn largest_magnitude(values: &[f32]) -> f32 {
    let larger = |m: f32, v: f32| if v > m { v } else { m };
    let mut lanes = [0.0f32; 8];
    let mut runs = values.chunks_exact(lanes.len());
    for run in &mut runs {
        for (lane, v) in lanes.iter_mut().zip(run) {
            *lane = larger(*lane, v.abs());
        }
    }
    let rest = runs.remainder().iter().fold(0.0, |m, v| larger(m, v.abs()));
    lanes.into_iter().fold(rest, larger)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(len: usize, k: f32, amplitude: f32) -> Vec<f32> {
        (0..len).map(|i| (i as f32 * k).sin() * amplitude).collect()
    }

    /// A value comes back within half a level of its block's largest.
    #[test]
    fn values_come_back_within_half_a_level_of_their_block() {
        let values: Vec<f32> = (0..1000)
            .map(|i| (i as f32 * 0.37).sin() * 10f32.powi(i / 250 - 2))
            .collect();
        let scaled = Scaled::of(&values);
        for (block, (kept, given)) in scaled
            .to_vec()
            .chunks(BLOCK)
            .zip(values.chunks(BLOCK))
            .enumerate()
        {
            let largest = given.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (k, g) in kept.iter().zip(given) {
                assert!(
                    (k - g).abs() <= 0.5001 * largest / LEVELS,
                    "block {block}: {k} for {g}"
                );
            }
        }
        assert_eq!(Scaled::of(&[0.0; 300]).to_vec(), vec![0.0; 300]);
    }

    /// Read from anywhere, a range is the same values as read whole.
    #[test]
    fn a_range_read_is_the_range_of_the_whole() {
        let scaled = Scaled::of(&wave(1000, 0.1, 3.0));
        let whole = scaled.to_vec();
        for (at, len) in [
            (0, 1000),
            (3, 10),
            (250, 12),
            (255, 258),
            (700, 300),
            (999, 1),
        ] {
            let mut part = vec![0.0; len];
            scaled.read(at, &mut part);
            assert_eq!(part, whole[at..at + len], "{at}+{len}");
        }
    }

    /// Blocks added one at a time, or several at once, hold the same levels bit for bit: the
    /// two sides of a pair add the same differences in different runs.
    #[test]
    fn the_same_sums_make_the_same_levels_whatever_the_runs() {
        let base = wave(1000, 0.07, 2.0);
        let deltas = wave(1000, 0.13, 0.01);
        let mut whole = Scaled::of(&base);
        let mut kept = deltas.clone();
        whole.add(0, &mut kept);
        assert_eq!(kept, whole.to_vec(), "what is kept is handed back");
        let mut by_block = Scaled::of(&base);
        for at in (0..1000).step_by(BLOCK) {
            let end = (at + BLOCK).min(1000);
            by_block.add(at, &mut deltas[at..end].to_vec());
        }
        assert_eq!(whole, by_block);
        // Adding nothing keeps every level.
        let before = whole.clone();
        whole.add(0, &mut [0.0; 1000]);
        assert_eq!(whole, before);
    }

    #[test]
    #[should_panic(expected = "whole blocks")]
    fn a_part_of_a_block_is_not_added() {
        Scaled::zeros(1000).add(10, &mut [1.0; 10]);
    }

    #[test]
    fn a_copy_takes_two_bytes_a_value_and_a_scale_a_block() {
        assert_eq!(Scaled::bytes_for(1000), 2000 + 4 * 4);
        assert_eq!(Scaled::bytes_for(0), 0);
    }
}
