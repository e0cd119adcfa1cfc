//! How a tensor's values are written on the wire: `f32` as is, or compressed. Compressed
//! exchanges send the difference between a replica and a copy of it that both sides of a pair
//! hold (CHOCO-gossip): what the codec loses stays in the difference and goes out in the next
//! exchange (error feedback), so the pair's copies converge to the replicas.
//!
//! Every decoder checks the length against the header's shape and refuses non-finite values, so
//! that nothing a peer sends is used before it is known to be a tensor of this model.

use serde::{Deserialize, Serialize};

/// A payload's encoding.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "kind")]
pub enum Codec {
    /// Raw little-endian `f32`: 4 bytes a value.
    #[default]
    F32,
    /// bfloat16 (the top half of an `f32`, rounded to nearest even): 2 bytes a value.
    Bf16,
    /// Blockwise int8: each block of `block` values is one `f32` scale (its largest magnitude /
    /// 127) and one signed byte a value, rounded to nearest: about 1 byte a value.
    Int8 { block: u32 },
    /// Blockwise int4: each block of `block` values is one `f32` scale (its largest magnitude /
    /// 7) and one signed nibble a value (-7 to 7), rounded to nearest and packed two to a byte,
    /// the first value in the low nibble: about half a byte a value, for links on which int8's
    /// exchanges are still too few.
    Int4 { block: u32 },
    /// Sparse top-k: the `per_mille` thousandths of the values largest in magnitude (at least
    /// one), the `u32` indices in increasing order then their `f32` values; every other value
    /// decodes to 0. 8 bytes a kept value: at 50 per mille, 0.4 bytes a value.
    TopK { per_mille: u32 },
}

/// Why a payload does not decode.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("{codec:?} payload of {found} bytes for {values} values (expected {expected})")]
    Length {
        codec: Codec,
        values: usize,
        found: usize,
        expected: usize,
    },
    #[error("{0:?} payload decodes to a NaN or infinite value")]
    NotFinite(Codec),
    #[error("int8 or int4 block size {0} is out of range (1 to 65536)")]
    Block(u32),
    #[error("top-k fraction of {0} per mille is out of range (1 to 1000)")]
    Fraction(u32),
    #[error("top-k payload's indices are not increasing and below {values}")]
    Indices { values: usize },
}

impl Codec {
    /// The int8 codec with the block size the daemon uses.
    pub const INT8: Codec = Codec::Int8 { block: 256 };
    /// The int4 codec with the block size the daemon uses.
    pub const INT4: Codec = Codec::Int4 { block: 256 };
    /// The top-k codec with the fraction the daemon uses: 5 % of the values.
    pub const TOP_K: Codec = Codec::TopK { per_mille: 50 };

    /// How far a mix through this codec's copies may go, as a share of the mix weight.
    /// CHOCO-gossip converges only with a consensus step no larger than about the share of the
    /// difference a message carries: top-k's copies fall behind by the values it leaves out, and
    /// a full step on them overshoots for ever (two replicas mixing at 0.5 through 10 % top-k
    /// never meet). A step of the kept fraction (with the pairwise weight of 0.5, a scale of
    /// twice the fraction) converged in tests; twice that already crawled.
    pub fn consensus_scale(self) -> f32 {
        match self {
            Codec::F32 | Codec::Bf16 | Codec::Int8 { .. } | Codec::Int4 { .. } => 1.0,
            Codec::TopK { per_mille } => (2.0 * per_mille as f32 / 1000.0).min(1.0),
        }
    }

    /// How many values top-k keeps out of `values` (at least one of any), or `None` for a bad
    /// fraction.
    fn kept(per_mille: u32, values: usize) -> Option<usize> {
        let per_mille = usize::try_from(per_mille)
            .ok()
            .filter(|p| (1..=1000).contains(p))?;
        Some(
            values
                .checked_mul(per_mille)?
                .div_ceil(1000)
                .clamp(values.min(1), values),
        )
    }

    /// A block size in range, or `None`.
    fn block_size(block: u32) -> Option<usize> {
        usize::try_from(block)
            .ok()
            .filter(|b| (1..=65536).contains(b))
    }

    /// Bytes that `values` values take in this encoding, or `None` for a bad block size.
    pub fn encoded_len(self, values: usize) -> Option<usize> {
        match self {
            Codec::F32 => values.checked_mul(4),
            Codec::Bf16 => values.checked_mul(2),
            Codec::Int8 { block } => {
                let block = Codec::block_size(block)?;
                values.checked_add(values.div_ceil(block).checked_mul(4)?)
            }
            Codec::Int4 { block } => {
                // Each block starts on a byte of its own: a whole block is its scale and half
                // its values rounded up, and so is the last, shorter one.
                let block = Codec::block_size(block)?;
                let (whole, rest) = (values / block, values % block);
                let last = if rest > 0 { 4 + rest.div_ceil(2) } else { 0 };
                whole.checked_mul(4 + block.div_ceil(2))?.checked_add(last)
            }
            Codec::TopK { per_mille } => Codec::kept(per_mille, values)?.checked_mul(8),
        }
    }

    /// Values in a piece of about `about` values that encodes and decodes on its own, the
    /// same bytes and the same runs ([`Codec::decode_runs`]) as within the whole payload
    /// (whole blocks of a block codec, whole runs of [`DECODED_RUN`] values of the others), so
    /// that a payload can be read and decoded a piece at a time, and a sum over its runs taken
    /// piece by piece is the sum over the whole; `None` for top-k, whose indices span the
    /// whole payload (or a bad block size).
    pub fn piece(self, about: usize) -> Option<usize> {
        match self {
            Codec::F32 | Codec::Bf16 => Some(about.max(1).next_multiple_of(DECODED_RUN)),
            Codec::Int8 { block } | Codec::Int4 { block } => {
                Some(about.max(1).next_multiple_of(Codec::block_size(block)?))
            }
            Codec::TopK { .. } => None,
        }
    }

    /// Encodes `values` (which the caller checked to be finite).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.encoded_len(values.len()).unwrap_or(0));
        self.encode_into(values, &mut bytes);
        bytes
    }

    /// Appends the encoding of `values` (which the caller checked to be finite) to `bytes`:
    /// a large buffer encoded a piece at a time, into one payload.
    pub fn encode_into(self, values: &[f32], bytes: &mut Vec<u8>) {
        match self {
            Codec::F32 => bytes.extend(values.iter().flat_map(|v| v.to_le_bytes())),
            Codec::Bf16 => bytes.extend(values.iter().flat_map(|&v| to_bf16(v).to_le_bytes())),
            Codec::Int8 { block } => {
                let pack = |levels: &[i8], out: &mut Vec<u8>| {
                    out.extend(levels.iter().map(|&q| q as u8));
                };
                encode_blocks(values, block, 127.0, bytes, pack);
            }
            Codec::Int4 { block } => {
                let pack = |levels: &[i8], out: &mut Vec<u8>| {
                    let nibble = |q: i8| q as u8 & 0x0f;
                    out.extend(levels.chunks(2).map(|pair| {
                        let high = pair.get(1).map_or(0, |&q| nibble(q));
                        nibble(pair[0]) | high << 4
                    }));
                };
                encode_blocks(values, block, 7.0, bytes, pack);
            }
            Codec::TopK { per_mille } => {
                let k = Codec::kept(per_mille, values.len()).unwrap_or(0);
                if k == 0 {
                    return;
                }
                let mut order: Vec<u32> = (0..values.len() as u32).collect();
                let magnitude = |i: &u32| values[*i as usize].abs();
                order.select_nth_unstable_by(k - 1, |a, b| magnitude(b).total_cmp(&magnitude(a)));
                let kept = &mut order[..k];
                kept.sort_unstable();
                bytes.reserve(k * 8);
                bytes.extend(kept.iter().flat_map(|i| i.to_le_bytes()));
                bytes.extend(kept.iter().flat_map(|&i| values[i as usize].to_le_bytes()));
            }
        }
    }

    /// Decodes `bytes` into `values` values, checking the length and that every value is
    /// finite.
    pub fn decode(self, bytes: &[u8], values: usize) -> Result<Vec<f32>, CodecError> {
        let mut out = Vec::with_capacity(values);
        self.decode_runs(bytes, values, |_, run| out.extend_from_slice(run))?;
        Ok(out)
    }

    /// Decodes `bytes` into `values` values a run at a time: `each` is given each run's offset
    /// and values, in order (a block of a block codec, at most [`DECODED_RUN`] values of the
    /// others), so that a pass over the values needs no buffer of them all. The length, and a
    /// top-k payload's indices, are checked before the first run; a run that is not finite
    /// ends the decoding with an error, after `each` saw the runs before it: a caller that must
    /// not use any value of a bad payload decodes it whole first ([`Codec::decode`]).
    pub fn decode_runs(
        self,
        bytes: &[u8],
        values: usize,
        mut each: impl FnMut(usize, &[f32]),
    ) -> Result<(), CodecError> {
        let expected = self.encoded_len(values).ok_or(match self {
            Codec::Int8 { block } | Codec::Int4 { block } => CodecError::Block(block),
            Codec::TopK { per_mille } => CodecError::Fraction(per_mille),
            _ => CodecError::Length {
                codec: self,
                values,
                found: bytes.len(),
                expected: usize::MAX,
            },
        })?;
        if bytes.len() != expected {
            return Err(CodecError::Length {
                codec: self,
                values,
                found: bytes.len(),
                expected,
            });
        }
        let mut run = Vec::with_capacity(DECODED_RUN.min(values));
        let mut at = 0;
        let mut emit = |run: &mut Vec<f32>| {
            if !all_finite(run) {
                return Err(CodecError::NotFinite(self));
            }
            each(at, run);
            at += run.len();
            run.clear();
            Ok(())
        };
        match self {
            Codec::F32 => {
                for words in bytes.chunks(4 * DECODED_RUN) {
                    let words = words.chunks_exact(4);
                    run.extend(words.map(|b| f32::from_le_bytes(word(b))));
                    emit(&mut run)?;
                }
            }
            Codec::Bf16 => {
                for halves in bytes.chunks(2 * DECODED_RUN) {
                    let halves = halves.chunks_exact(2);
                    run.extend(halves.map(|b| from_bf16(u16::from_le_bytes([b[0], b[1]]))));
                    emit(&mut run)?;
                }
            }
            Codec::Int8 { block } => {
                let unpack = |packed: &[u8], n: usize, scale: f32, out: &mut Vec<f32>| {
                    out.extend(packed[..n].iter().map(|&q| f32::from(q as i8) * scale));
                };
                decode_blocks(self, bytes, values, block, |n| n, unpack, emit)?;
            }
            Codec::Int4 { block } => {
                // A nibble's sign is its top bit: shifted to the top of a byte and back.
                let signed = |nibble: u8| f32::from(((nibble << 4) as i8) >> 4);
                let unpack = |packed: &[u8], n: usize, scale: f32, out: &mut Vec<f32>| {
                    out.extend(
                        packed
                            .iter()
                            .flat_map(|&b| [signed(b & 0x0f), signed(b >> 4)])
                            .take(n)
                            .map(|q| q * scale),
                    );
                };
                let packed_len = |n: usize| n.div_ceil(2);
                decode_blocks(self, bytes, values, block, packed_len, unpack, emit)?;
            }
            Codec::TopK { .. } => {
                let (indices, kept) = bytes.split_at(bytes.len() / 2);
                let index = |b: &[u8]| u32::from_le_bytes(word(b)) as usize;
                let mut next = 0usize;
                for i in indices.chunks_exact(4).map(index) {
                    if i < next || i >= values {
                        return Err(CodecError::Indices { values });
                    }
                    next = i + 1;
                }
                let mut pairs = indices
                    .chunks_exact(4)
                    .map(index)
                    .zip(kept.chunks_exact(4).map(|v| f32::from_le_bytes(word(v))))
                    .peekable();
                for start in (0..values).step_by(DECODED_RUN) {
                    let end = values.min(start + DECODED_RUN);
                    run.resize(end - start, 0.0);
                    while let Some((i, v)) = pairs.next_if(|&(i, _)| i < end) {
                        run[i - start] = v;
                    }
                    emit(&mut run)?;
                }
            }
        }
        Ok(())
    }
}

/// Values a decoder hands on at a time where the encoding has no blocks of its own: a run
/// stays in the first level of cache.
pub const DECODED_RUN: usize = 1024;

/// Reads `values` values of `codec`, a blockwise encoding (int8, int4) whose length was checked: each
/// block of at most `block` values is a finite `f32` scale, then `packed_len(n)` bytes from
/// which `unpack` appends the block's `n` values, scaled, to a run that `emit` then takes.
fn decode_blocks(
    codec: Codec,
    bytes: &[u8],
    values: usize,
    block: u32,
    packed_len: impl Fn(usize) -> usize,
    unpack: impl Fn(&[u8], usize, f32, &mut Vec<f32>),
    mut emit: impl FnMut(&mut Vec<f32>) -> Result<(), CodecError>,
) -> Result<(), CodecError> {
    let block = block as usize;
    let mut run = Vec::with_capacity(block.min(values));
    let mut rest = bytes;
    let mut done = 0;
    while done < values {
        let n = block.min(values - done);
        let (scale, tail) = rest.split_at(4);
        let scale = f32::from_le_bytes(word(scale));
        if !scale.is_finite() {
            return Err(CodecError::NotFinite(codec));
        }
        let (packed, tail) = tail.split_at(packed_len(n));
        unpack(packed, n, scale, &mut run);
        emit(&mut run)?;
        done += n;
        rest = tail;
    }
    Ok(())
}

/// Whether every value in `values` is finite. Each run of a few thousand values is checked
/// without stopping at the first bad one, which lets the compiler check several at once: a
/// check a value at a time that stops early costs more than reading the values.
pub fn all_finite(values: &[f32]) -> bool {
    values
        .chunks(4096)
        .all(|run| run.iter().fold(true, |finite, v| finite & v.is_finite()))
}

/// Appends `values` in a blockwise encoding (int8, int4) to `out`: each block of at most
/// `block` values is its `f32` scale (the largest magnitude / `levels`), then what `pack`
/// appends from the block's values rounded to its levels (see [`Rounding`]).
fn encode_blocks(
    values: &[f32],
    block: u32,
    levels: f32,
    out: &mut Vec<u8>,
    pack: impl Fn(&[i8], &mut Vec<u8>),
) {
    let block = block.clamp(1, 65536) as usize;
    let mut rounded: Vec<i8> = Vec::with_capacity(block.min(values.len()));
    for chunk in values.chunks(block) {
        let scale = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / levels;
        out.extend_from_slice(&scale.to_le_bytes());
        let rounding = Rounding {
            inverse: if scale > 0.0 { 1.0 / scale } else { 0.0 },
            levels,
        };
        rounded.clear();
        rounded.extend(chunk.iter().map(|&v| rounding.level(v)));
        pack(&rounded, out);
    }
}

/// How a block's values round to its levels.
#[derive(Clone, Copy)]
struct Rounding {
    /// 1 / the block's scale (0 for a block of zeros).
    inverse: f32,
    /// The largest level either side of 0.
    levels: f32,
}

impl Rounding {
    /// `v` as the nearest level, from `-levels` to `levels` (a tie to the even one).
    fn level(self, v: f32) -> i8 {
        nearest_integer((v * self.inverse).clamp(-self.levels, self.levels)) as i8
    }
}

/// `x` (of magnitude below 2^22) rounded to the nearest integer, a tie to the even one.
/// Adding 1.5 x 2^23 rounds to an integer in the FPU's default mode and leaves that integer in
/// the sum's low bits: plain adds and integer arithmetic, which the compiler vectorises, where
/// `round` is a call per value and a float-to-integer cast a check per value.
#[inline]
pub fn nearest_integer(x: f32) -> i32 {
    const ROUND: f32 = 12_582_912.0;
    (x + ROUND).to_bits() as i32 - ROUND.to_bits() as i32
}

/// The first four bytes of `b` (a chunk of at least four).
fn word(b: &[u8]) -> [u8; 4] {
    [b[0], b[1], b[2], b[3]]
}

/// Round to nearest even on the 16 bits dropped; NaN stays NaN.
fn to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) | 0x40) as u16;
    }
    let rounding = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(rounding) >> 16) as u16
}

fn from_bf16(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Every encoding, a block codec with a block that does not divide the tests' lengths too.
    const EVERY_CODEC: [Codec; 6] = [
        Codec::F32,
        Codec::Bf16,
        Codec::INT8,
        Codec::INT4,
        Codec::Int4 { block: 3 },
        Codec::TOP_K,
    ];

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect()
    }

    #[test]
    fn sizes_are_what_the_header_promises() {
        assert_eq!(Codec::F32.encoded_len(10), Some(40));
        assert_eq!(Codec::Bf16.encoded_len(10), Some(20));
        // 600 values in blocks of 256: three scales.
        assert_eq!(Codec::INT8.encoded_len(600), Some(612));
        assert_eq!(Codec::Int8 { block: 0 }.encoded_len(10), None);
        // 600 values in blocks of 256: two whole blocks of 4 + 128 bytes, then 4 + 44.
        assert_eq!(Codec::INT4.encoded_len(600), Some(312));
        // An odd block takes half a byte of padding each.
        assert_eq!(
            Codec::Int4 { block: 3 }.encoded_len(7),
            Some(3 * 4 + 2 + 2 + 1)
        );
        assert_eq!(Codec::Int4 { block: 0 }.encoded_len(10), None);
        // 5 % of 1000 values: 50 kept, 8 bytes each; never fewer than one.
        assert_eq!(Codec::TOP_K.encoded_len(1000), Some(400));
        assert_eq!(Codec::TOP_K.encoded_len(3), Some(8));
        assert_eq!(Codec::TopK { per_mille: 0 }.encoded_len(10), None);
        assert_eq!(Codec::TopK { per_mille: 1001 }.encoded_len(10), None);
        for codec in EVERY_CODEC {
            for n in [0, 1, 999, 1000] {
                let v = ramp(n);
                assert_eq!(
                    Some(codec.encode(&v).len()),
                    codec.encoded_len(n),
                    "{codec:?}"
                );
            }
        }
    }

    #[test]
    fn a_value_rounds_to_the_nearest_level_a_tie_to_the_even_one() {
        let rounding = Rounding {
            inverse: 1.0,
            levels: 7.0,
        };
        let levels: Vec<i8> = [
            0.49999997, 0.5, 1.5, 2.5, -2.5, 3.7, -6.6, 7.5, 100.0, -1e30,
        ]
        .iter()
        .map(|&v| rounding.level(v))
        .collect();
        assert_eq!(levels, [0, 0, 2, 2, -2, 4, -7, 7, 7, -7]);
    }

    #[test]
    fn each_codec_round_trips_within_its_precision() {
        let v = ramp(5000);
        let max = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        for (codec, tolerance) in [
            (Codec::F32, 0.0),
            (Codec::Bf16, max / 256.0),
            (Codec::INT8, max / 254.0 + 1e-7),
            (Codec::INT4, max / 14.0 + 1e-7),
            (Codec::Int4 { block: 3 }, max / 14.0 + 1e-7),
        ] {
            let back = codec.decode(&codec.encode(&v), v.len()).unwrap();
            let worst = v
                .iter()
                .zip(&back)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= tolerance,
                "{codec:?}: error {worst} over {tolerance}"
            );
        }
    }

    /// A payload encoded a piece at a time is the one encoded whole, and a decoding by runs
    /// hands on every value once, in order, as the whole decoding.
    #[test]
    fn pieces_and_runs_are_the_whole_encoding_and_decoding() {
        let v = ramp(5000);
        for codec in EVERY_CODEC {
            let bytes = codec.encode(&v);
            if !matches!(codec, Codec::TopK { .. }) {
                let mut pieces = Vec::new();
                for piece in v.chunks(768) {
                    codec.encode_into(piece, &mut pieces);
                }
                assert!(pieces == bytes, "{codec:?}: other bytes");
            }
            let decoded = codec.decode(&bytes, v.len()).unwrap();
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            let mut runs = Vec::new();
            codec
                .decode_runs(&bytes, v.len(), |at, run| {
                    assert_eq!(at, runs.len(), "{codec:?}: a run out of order");
                    runs.extend_from_slice(run);
                })
                .unwrap();
            assert_eq!(bits(&runs), bits(&decoded), "{codec:?}");

            // Pieces decode in the runs of the whole, at the same places.
            let Some(piece) = codec.piece(700) else {
                continue;
            };
            let whole_runs = |bytes: &[u8], count: usize, start: usize| {
                let mut runs = Vec::new();
                codec
                    .decode_runs(bytes, count, |at, run| runs.push((start + at, run.len())))
                    .unwrap();
                runs
            };
            let mut by_pieces = Vec::new();
            for start in (0..v.len()).step_by(piece) {
                let end = (start + piece).min(v.len());
                let range = codec.encoded_len(start).unwrap()..codec.encoded_len(end).unwrap();
                by_pieces.extend(whole_runs(&bytes[range], end - start, start));
            }
            assert_eq!(by_pieces, whole_runs(&bytes, v.len(), 0), "{codec:?}");
        }
    }

    #[test]
    fn bad_payloads_are_named() {
        let v = ramp(300);
        let bytes = Codec::INT8.encode(&v);
        assert!(matches!(
            Codec::INT8.decode(&bytes[1..], 300),
            Err(CodecError::Length { .. })
        ));
        let mut nan_scale = bytes.clone();
        nan_scale[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(
            Codec::INT8.decode(&nan_scale, 300),
            Err(CodecError::NotFinite(Codec::INT8))
        );
        let inf = Codec::Bf16.encode(&[1.0, f32::INFINITY]);
        assert_eq!(
            Codec::Bf16.decode(&inf, 2),
            Err(CodecError::NotFinite(Codec::Bf16))
        );
        assert_eq!(
            Codec::Int8 { block: 0 }.decode(&[], 0),
            Err(CodecError::Block(0))
        );
        let bytes = Codec::INT4.encode(&v);
        assert!(matches!(
            Codec::INT4.decode(&bytes[..bytes.len() - 1], 300),
            Err(CodecError::Length { .. })
        ));
        let mut nan_scale = bytes;
        let second_block = 4 + 128;
        nan_scale[second_block..second_block + 4].copy_from_slice(&f32::INFINITY.to_le_bytes());
        assert_eq!(
            Codec::INT4.decode(&nan_scale, 300),
            Err(CodecError::NotFinite(Codec::INT4))
        );
    }

    #[test]
    fn top_k_keeps_the_largest_values_and_zeroes_the_rest() {
        let mut v = ramp(1000);
        v[17] = 9.0;
        v[503] = -8.0;
        let codec = Codec::TopK { per_mille: 2 };
        let back = codec.decode(&codec.encode(&v), v.len()).unwrap();
        for (i, b) in back.iter().enumerate() {
            let expected = if i == 17 || i == 503 { v[i] } else { 0.0 };
            assert_eq!(*b, expected, "value {i}");
        }
    }

    #[test]
    fn top_k_payloads_with_bad_indices_are_refused() {
        let v = ramp(300);
        let codec = Codec::TopK { per_mille: 10 };
        let bytes = codec.encode(&v); // 3 kept values
        let mut repeated = bytes.clone();
        repeated.copy_within(0..4, 4);
        let mut beyond = bytes.clone();
        beyond[8..12].copy_from_slice(&300u32.to_le_bytes());
        for bad in [repeated, beyond] {
            assert_eq!(
                codec.decode(&bad, 300),
                Err(CodecError::Indices { values: 300 })
            );
        }
        let mut nan = bytes;
        nan[12..16].copy_from_slice(&f32::NAN.to_le_bytes());
        assert_eq!(codec.decode(&nan, 300), Err(CodecError::NotFinite(codec)));
    }

    #[test]
    fn error_feedback_carries_what_top_k_left_into_the_next_messages() {
        // A copy updated only by decoded top-k differences reaches a fixed target: each round
        // sends the largest of what is still missing.
        let target = ramp(2000);
        let mut copy = vec![0.0f32; target.len()];
        let codec = Codec::TopK { per_mille: 100 };
        for _ in 0..10 {
            let diff: Vec<f32> = target.iter().zip(&copy).map(|(t, c)| t - c).collect();
            let q = codec.decode(&codec.encode(&diff), diff.len()).unwrap();
            copy.iter_mut().zip(&q).for_each(|(c, d)| *c += d);
        }
        assert_eq!(copy, target, "ten rounds of 10 % carry every value");
    }

    #[test]
    fn error_feedback_carries_what_int8_and_int4_lost_into_the_next_message() {
        // A copy updated only by decoded differences approaches a fixed target: the residual
        // shrinks by about the codec's resolution each round (127 steps a side for int8, 7 for
        // int4).
        for (codec, shrink, rounds) in [(Codec::INT8, 50.0, 4), (Codec::INT4, 5.0, 8)] {
            let target = ramp(2048);
            let mut copy = vec![0.0f32; target.len()];
            let mut residual = f32::MAX;
            for _ in 0..rounds {
                let diff: Vec<f32> = target.iter().zip(&copy).map(|(t, c)| t - c).collect();
                let q = codec.decode(&codec.encode(&diff), diff.len()).unwrap();
                copy.iter_mut().zip(&q).for_each(|(c, d)| *c += d);
                let now = target
                    .iter()
                    .zip(&copy)
                    .fold(0.0f32, |m, (t, c)| m.max((t - c).abs()));
                assert!(
                    now < residual / shrink || now < 1e-6,
                    "{codec:?}: {now} after {residual}"
                );
                residual = now;
            }
        }
    }

    #[test]
    fn int4_packs_two_signed_values_a_byte_low_nibble_first() {
        // Scale 1 (largest magnitude 7): 7, -7, 3 and -1 as nibbles 0x7, 0x9, 0x3, 0xf.
        let bytes = Codec::Int4 { block: 4 }.encode(&[7.0, -7.0, 3.0, -1.0]);
        assert_eq!(
            bytes,
            [1f32.to_le_bytes().as_slice(), &[0x97, 0xf3]].concat()
        );
        // Nibble 0x8 (-8) is never written but decodes to -8 scales, finite and bounded.
        let back = Codec::Int4 { block: 4 }
            .decode(&[1f32.to_le_bytes().as_slice(), &[0x88, 0x00]].concat(), 4);
        assert_eq!(back, Ok(vec![-8.0, -8.0, 0.0, 0.0]));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600), n in 0usize..300) {
            for codec in [Codec::F32, Codec::Bf16, Codec::INT8, Codec::Int8 { block: 7 }, Codec::INT4, Codec::Int4 { block: 7 }, Codec::TOP_K] {
                let _ = codec.decode(&bytes, n);
            }
        }
    }
}
