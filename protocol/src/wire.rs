//! Tensor messages on the stream protocols (`/murmur/params/3`, `/murmur/state/4`).
//!
//! A frame is `version: u16 LE | header_len: u32 LE | header (CBOR) | payload`, where the
//! payload is the raw little-endian bytes of a flat `f32` buffer, written straight from the
//! sender's buffer and read straight into the receiver's (never a CBOR array of floats), or the
//! same values compressed by a [`Codec`]. The version comes first so that a future header layout
//! is refused with a clear reason, and every length is checked against a cap before anything is
//! allocated.
//!
//! Version 2 adds to the header the payload's codec, the version of the pair's shared copy a
//! compressed difference is taken against, and (in an offer) the codecs the sender accepts. A
//! frame that uses none of them is written as version 1, which every node reads.

use std::io;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::{Deserialize, Serialize};

pub use crate::codec::Codec;

/// The newest frame version this node speaks; it reads every version from 1 on.
pub const WIRE_VERSION: u16 = 2;
/// Largest CBOR header accepted; a real one is about 150 bytes.
pub const MAX_HEADER_BYTES: u32 = 4 * 1024;
/// Values read into a payload buffer at a time (1 MiB of `f32`s).
const READ_CHUNK_VALUES: usize = 256 * 1024;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MessageKind {
    /// Pairwise exchange: asks a peer for one (no payload); answered with `Params` or `Busy`.
    Offer,
    /// Parameters for a pairwise exchange, or a worker's parameters sent to the elastic center.
    Params,
    /// The elastic center's answer to a worker: the difference `d` the worker subtracts.
    Delta,
    /// State sync: a request (no payload) or a peer's parameters for a late joiner.
    State,
    /// State sync: one of the optimizer's state buffers, sent after `State`, one frame per
    /// buffer; its `step` is the optimizer's own update count (AdamW's bias correction).
    Optimizer,
    /// State sync (`allreduce`, `every > 1`): the anchor of the outer loop, after the
    /// optimizer's state; its `step` is the step of the average that gave it (the sender
    /// waits on the round at its own step when that is a round's step and the anchor is older).
    Anchor,
    /// State sync: the DiLoCo outer velocity, after the anchor (none before the first outer
    /// step).
    Velocity,
    /// State sync: the elastic center variable, sent last by the peer that holds it.
    Center,
    /// "Busy in another exchange, or not the one to ask": no payload.
    Busy,
}

/// Element type of the payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
        }
    }
}

/// The CBOR header of a frame.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorHeader {
    pub kind: MessageKind,
    pub run_id: String,
    /// Model fingerprint: buffers of different architectures never mix.
    pub fingerprint: String,
    /// The sender's local step when it took the snapshot.
    pub step: u64,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Payload length in bytes.
    pub byte_len: u64,
    /// CRC-32 of the payload.
    pub checksum: u32,
    /// How the payload's values are encoded (version 2).
    #[serde(default, skip_serializing_if = "is_f32")]
    pub codec: Codec,
    /// A compressed difference: the version of the pair's shared copies it is taken against
    /// (`Some(0)`: fresh copies, all zeros). `None`: the values themselves (version 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<u64>,
    /// In an offer: the codecs the sender can take, preferred first (version 2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub accept: Vec<Codec>,
    /// Optimizer state buffers, by name (version 2, `/murmur/state/3`): in a state request,
    /// those the requester's optimizer keeps, which the answer carries when the sender's
    /// optimizer keeps the same; in an `Optimizer` frame, the one buffer it carries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buffers: Vec<String>,
    /// State sync (version 2, `/murmur/state/4`): in an answer's frame, the index in its buffer
    /// of the first value it carries (a buffer travels in chunks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    /// State sync (version 2, `/murmur/state/4`): in a request, the part of a state that a
    /// transfer cut off left with the requester, to go on from; in the first frame of an
    /// answer, the state it sends and where it starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume: Option<Resume>,
}

/// A place in a state transfer: the state (an id its source gave it when it first sent it)
/// and how many of its values, counted in the order of the answer's frames, come before.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resume {
    pub state: u64,
    pub at: u64,
}

fn is_f32(codec: &Codec) -> bool {
    *codec == Codec::F32
}

/// What a receiver accepts.
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    pub run_id: &'a str,
    pub fingerprint: &'a str,
    pub max_payload_bytes: u64,
}

/// Why a frame was refused. Every variant names what was wrong; none panics.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("unsupported wire version {found} (this node speaks {supported})")]
    UnknownVersion { found: u16, supported: u16 },
    #[error("header of {len} bytes is over the {max}-byte cap")]
    HeaderTooLarge { len: u32, max: u32 },
    #[error("payload of {len} bytes is over the {max}-byte cap")]
    PayloadTooLarge { len: u64, max: u64 },
    #[error("malformed header: {0}")]
    Malformed(String),
    #[error("message is for run `{found}`, this node is in run `{expected}`")]
    WrongRun { expected: String, found: String },
    #[error("model fingerprint `{found}` does not match ours (`{expected}`)")]
    WrongFingerprint { expected: String, found: String },
    #[error("header declares {byte_len} bytes, but shape {shape:?} of {dtype:?} needs {needed}")]
    ShapeMismatch {
        byte_len: u64,
        shape: Vec<u64>,
        dtype: Dtype,
        needed: u64,
    },
    #[error("payload checksum {found:08x} does not match the header's {expected:08x}")]
    Checksum { expected: u32, found: u32 },
    #[error("stream ended in the middle of a frame")]
    Truncated,
    /// The stream ended before the first byte of a frame: the peer went away or gave up,
    /// which is not a malformed message.
    #[error("stream ended before a frame")]
    Empty,
    #[error("stream error: {0}")]
    Io(io::Error),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            WireError::Truncated
        } else {
            WireError::Io(e)
        }
    }
}

impl TensorHeader {
    /// A header for `payload`, with its length and checksum filled in.
    pub fn for_payload(
        kind: MessageKind,
        run_id: &str,
        fingerprint: &str,
        step: u64,
        payload: &[f32],
    ) -> Self {
        let bytes = payload_bytes(payload);
        Self::for_encoded(
            kind,
            run_id,
            fingerprint,
            step,
            Codec::F32,
            payload.len(),
            &bytes,
        )
    }

    /// A header for `values` values encoded by `codec` as `encoded`.
    pub fn for_encoded(
        kind: MessageKind,
        run_id: &str,
        fingerprint: &str,
        step: u64,
        codec: Codec,
        values: usize,
        encoded: &[u8],
    ) -> Self {
        TensorHeader {
            kind,
            run_id: run_id.to_owned(),
            fingerprint: fingerprint.to_owned(),
            step,
            dtype: Dtype::F32,
            shape: vec![values as u64],
            byte_len: encoded.len() as u64,
            checksum: crc32fast::hash(encoded),
            codec,
            reference: None,
            accept: Vec::new(),
            buffers: Vec::new(),
            offset: None,
            resume: None,
        }
    }

    /// The oldest version that carries this header.
    fn version(&self) -> u16 {
        if self.codec == Codec::F32
            && self.reference.is_none()
            && self.accept.is_empty()
            && self.buffers.is_empty()
            && self.offset.is_none()
            && self.resume.is_none()
        {
            1
        } else {
            2
        }
    }

    /// The number of values the payload holds.
    pub fn values(&self) -> u64 {
        self.shape.iter().product()
    }

    fn check(&self, expect: &Expect<'_>) -> Result<(), WireError> {
        if self.run_id != expect.run_id {
            return Err(WireError::WrongRun {
                expected: expect.run_id.to_owned(),
                found: self.run_id.clone(),
            });
        }
        if self.fingerprint != expect.fingerprint {
            return Err(WireError::WrongFingerprint {
                expected: expect.fingerprint.to_owned(),
                found: self.fingerprint.clone(),
            });
        }
        if self.byte_len > expect.max_payload_bytes {
            return Err(WireError::PayloadTooLarge {
                len: self.byte_len,
                max: expect.max_payload_bytes,
            });
        }
        let needed = self
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|values| usize::try_from(values).ok())
            .and_then(|values| self.codec.encoded_len(values))
            .map(|bytes| bytes as u64);
        if needed != Some(self.byte_len) {
            return Err(WireError::ShapeMismatch {
                byte_len: self.byte_len,
                shape: self.shape.clone(),
                dtype: self.dtype,
                needed: needed.unwrap_or(u64::MAX),
            });
        }
        Ok(())
    }
}

/// The payload's little-endian bytes: a view of the buffer itself on little-endian machines.
fn payload_bytes(payload: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(payload))
    } else {
        std::borrow::Cow::Owned(payload.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Writes one frame: `header` (from [`TensorHeader::for_payload`]) and `payload`; returns the
/// bytes written.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut W,
    header: &TensorHeader,
    payload: &[f32],
) -> Result<u64, WireError> {
    write_encoded(writer, header, &payload_bytes(payload)).await
}

/// Writes one frame whose payload is already encoded (see [`TensorHeader::for_encoded`]);
/// returns the bytes written.
pub async fn write_encoded<W: AsyncWrite + Unpin>(
    writer: &mut W,
    header: &TensorHeader,
    payload: &[u8],
) -> Result<u64, WireError> {
    let mut encoded = Vec::with_capacity(256);
    ciborium::into_writer(header, &mut encoded).map_err(|e| WireError::Malformed(e.to_string()))?;
    let header_len = u32::try_from(encoded.len())
        .ok()
        .filter(|&len| len <= MAX_HEADER_BYTES)
        .ok_or(WireError::HeaderTooLarge {
            len: u32::try_from(encoded.len()).unwrap_or(u32::MAX),
            max: MAX_HEADER_BYTES,
        })?;
    writer.write_all(&header.version().to_le_bytes()).await?;
    writer.write_all(&header_len.to_le_bytes()).await?;
    writer.write_all(&encoded).await?;
    writer.write_all(payload).await?;
    writer.flush().await?;
    Ok(6 + u64::from(header_len) + payload.len() as u64)
}

/// Reads and checks a frame's version and header; the payload follows on the stream.
pub async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    expect: &Expect<'_>,
) -> Result<TensorHeader, WireError> {
    let mut version = [0u8; 2];
    if reader.read(&mut version[..1]).await? == 0 {
        return Err(WireError::Empty);
    }
    reader.read_exact(&mut version[1..]).await?;
    let version = u16::from_le_bytes(version);
    if !(1..=WIRE_VERSION).contains(&version) {
        return Err(WireError::UnknownVersion {
            found: version,
            supported: WIRE_VERSION,
        });
    }
    let mut len = [0u8; 4];
    reader.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(WireError::HeaderTooLarge {
            len,
            max: MAX_HEADER_BYTES,
        });
    }
    let mut encoded = vec![0u8; len as usize];
    reader.read_exact(&mut encoded).await?;
    let header: TensorHeader = ciborium::from_reader(encoded.as_slice())
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if header.version() > version {
        return Err(WireError::Malformed(format!(
            "a version {version} frame with version {} fields",
            header.version()
        )));
    }
    header.check(expect)?;
    Ok(header)
}

/// Reads the payload that `header` announced into `buffer` (resized to fit, reused across
/// messages: no other copy is made) and verifies its checksum. The payload is read, checked
/// and decoded a piece at a time as it arrives (256 Ki values, 1 MiB of `f32`; whole blocks of
/// a block codec): memory follows the bytes that arrive, not the length the header announces; a
/// compressed payload is never held encoded whole beside its values; and each piece's bytes
/// are hashed and decoded while they are in cache. A bad checksum is reported before a piece
/// that did not decode: a payload damaged on the way is named as such. Compressed payloads
/// decode to finite values ([`Codec::decode_runs`]); `f32` payloads are taken as they are.
pub async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &TensorHeader,
    buffer: &mut Vec<f32>,
) -> Result<(), WireError> {
    read_payload_watched(reader, header, buffer, |_, _| {}).await
}

/// [`read_payload`], handing `watch` each piece's offset and values as soon as they are
/// decoded (a compressed payload's pieces, whole blocks, in order; `f32` pieces as read; a
/// top-k payload once, whole), so that a pass over the values runs while the rest comes in.
/// A piece that did not decode, and what comes after it, is not watched; the checksum is
/// checked once all came, so what `watch` saw counts only if the read succeeds.
pub async fn read_payload_watched<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &TensorHeader,
    buffer: &mut Vec<f32>,
    mut watch: impl FnMut(usize, &[f32]),
) -> Result<(), WireError> {
    // `check` made byte_len the encoded size of the shape and below the receiver's cap.
    let values = usize::try_from(header.values())
        .map_err(|_| WireError::Malformed("payload does not fit in memory".into()))?;
    let mut checksum = crc32fast::Hasher::new();
    let mut undecoded = None;
    buffer.clear();
    if header.codec == Codec::F32 {
        while buffer.len() < values {
            let start = buffer.len();
            let end = values.min(start + READ_CHUNK_VALUES);
            if start > 0 {
                make_room(buffer, values);
            }
            buffer.resize(end, 0.0);
            let piece = bytemuck::cast_slice_mut(&mut buffer[start..end]);
            reader.read_exact(piece).await?;
            checksum.update(piece);
            if cfg!(target_endian = "little") {
                watch(start, &buffer[start..end]);
            }
        }
    } else if let Some(piece) = header.codec.piece(READ_CHUNK_VALUES) {
        let mut bytes = Vec::new();
        let mut done = 0;
        while done < values {
            let count = piece.min(values - done);
            let len = header.codec.encoded_len(count).ok_or(WireError::Malformed(
                "a payload piece longer than memory".into(),
            ))?;
            bytes.resize(len, 0);
            reader.read_exact(&mut bytes).await?;
            checksum.update(&bytes);
            if undecoded.is_none() {
                make_room(buffer, values);
                let decoded = header.codec.decode_runs(&bytes, count, |_, run| {
                    buffer.extend_from_slice(run);
                });
                undecoded = decoded.err();
                if undecoded.is_none() {
                    watch(done, &buffer[done..]);
                }
            }
            done += count;
        }
    } else {
        // Top-k: its indices span the whole payload.
        let mut bytes = Vec::new();
        (&mut *reader)
            .take(header.byte_len)
            .read_to_end(&mut bytes)
            .await?;
        if (bytes.len() as u64) < header.byte_len {
            return Err(WireError::Truncated);
        }
        checksum.update(&bytes);
        match header.codec.decode(&bytes, values) {
            Ok(decoded) => {
                *buffer = decoded;
                watch(0, buffer);
            }
            Err(e) => undecoded = Some(e),
        }
    }
    let found = checksum.finalize();
    if found != header.checksum {
        return Err(WireError::Checksum {
            expected: header.checksum,
            found,
        });
    }
    if let Some(e) = undecoded {
        return Err(WireError::Malformed(e.to_string()));
    }
    if cfg!(target_endian = "big") && header.codec == Codec::F32 {
        for v in buffer.iter_mut() {
            *v = f32::from_le_bytes(v.to_ne_bytes());
        }
    }
    Ok(())
}

/// Makes room in `buffer` for the whole payload of `values` once its first piece came: a
/// sender must send bytes before this node sets memory aside for the rest (and memory set
/// aside is only held once written), and the rest then lands in place, where a buffer grown
/// as a vector grows would be moved several times and end larger than its values.
fn make_room(buffer: &mut Vec<f32>, values: usize) {
    buffer.reserve_exact(values.saturating_sub(buffer.len()));
}

/// Reads a whole frame: [`read_header`], then [`read_payload`] into `buffer`.
pub async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    expect: &Expect<'_>,
    buffer: &mut Vec<f32>,
) -> Result<TensorHeader, WireError> {
    let header = read_header(reader, expect).await?;
    read_payload(reader, &header, buffer).await?;
    Ok(header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::executor::block_on;
    use futures::io::Cursor;
    use proptest::prelude::*;

    const EXPECT: Expect<'static> = Expect {
        run_id: "run-1",
        fingerprint: "abcd",
        max_payload_bytes: 1 << 20,
    };

    fn frame(header: &TensorHeader, payload: &[f32]) -> Vec<u8> {
        let mut out = Cursor::new(Vec::new());
        block_on(write_frame(&mut out, header, payload)).unwrap();
        out.into_inner()
    }

    fn read(bytes: &[u8], expect: &Expect<'_>) -> Result<(TensorHeader, Vec<f32>), WireError> {
        let mut reader = Cursor::new(bytes);
        let mut buffer = Vec::new();
        let header = block_on(read_frame(&mut reader, expect, &mut buffer))?;
        Ok((header, buffer))
    }

    fn params(values: &[f32]) -> TensorHeader {
        TensorHeader::for_payload(MessageKind::Params, "run-1", "abcd", 7, values)
    }

    #[test]
    fn a_frame_round_trips() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32 * 0.25 - 3.0).collect();
        let bytes = frame(&params(&values), &values);
        // Raw f32 bytes: the frame is the payload plus a small header.
        assert!(bytes.len() < values.len() * 4 + 200, "{}", bytes.len());
        let (header, back) = read(&bytes, &EXPECT).unwrap();
        assert_eq!(header.step, 7);
        assert_eq!(back, values);
    }

    /// A sender cannot make this node allocate a model-sized buffer with a few header bytes.
    #[test]
    fn a_header_alone_costs_one_chunk_whatever_payload_it_announces() {
        let expect = Expect {
            max_payload_bytes: 1 << 32,
            ..EXPECT
        };
        let values = 1usize << 30;
        for codec in [Codec::F32, Codec::Bf16, Codec::INT8, Codec::INT4] {
            let mut header = TensorHeader::for_encoded(
                MessageKind::Params,
                "run-1",
                "abcd",
                1,
                codec,
                values,
                &[],
            );
            header.byte_len = codec.encoded_len(values).unwrap() as u64;
            let mut bytes = frame(&header, &[]);
            bytes.extend([0u8; 64]);
            let mut buffer = Vec::new();
            let read = block_on(read_frame(&mut bytes.as_slice(), &expect, &mut buffer));
            assert!(matches!(read, Err(WireError::Truncated)), "{read:?}");
            assert!(
                buffer.capacity() <= READ_CHUNK_VALUES,
                "{codec:?}: {}",
                buffer.capacity()
            );
        }
    }

    /// An encoded frame of `values` through `codec`, and the values its whole payload decodes
    /// to.
    fn encoded_frame(codec: Codec, values: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let encoded = codec.encode(values);
        let header = TensorHeader::for_encoded(
            MessageKind::Params,
            "run-1",
            "abcd",
            7,
            codec,
            values.len(),
            &encoded,
        );
        let mut out = Cursor::new(Vec::new());
        block_on(write_encoded(&mut out, &header, &encoded)).unwrap();
        (
            out.into_inner(),
            codec.decode(&encoded, values.len()).unwrap(),
        )
    }

    /// A compressed payload is read and decoded a piece at a time: the values are those of the
    /// whole payload decoded at once, for every codec, over several pieces and a last short
    /// block, in a buffer no larger than they are.
    #[test]
    fn a_compressed_payload_read_in_pieces_is_the_whole_decoding() {
        let expect = Expect {
            max_payload_bytes: 1 << 30,
            ..EXPECT
        };
        let count = 2 * READ_CHUNK_VALUES + 1000;
        let values: Vec<f32> = (0..count).map(|i| (i as f32 * 0.37).sin()).collect();
        let codecs = [
            Codec::Bf16,
            Codec::INT8,
            Codec::INT4,
            Codec::Int4 { block: 100 },
            Codec::TOP_K,
        ];
        for codec in codecs {
            let (bytes, whole) = encoded_frame(codec, &values);
            let (_, read) = read(&bytes, &expect).unwrap();
            assert!(read == whole, "{codec:?}: the pieces differ from the whole");
            assert_eq!(
                read.capacity(),
                count,
                "{codec:?}: a buffer larger than its values"
            );
        }
    }

    /// A payload damaged on the way is named by its checksum, whatever its values decode to;
    /// one whose checksum holds but whose values are not finite is malformed.
    #[test]
    fn a_damaged_compressed_payload_is_named_by_its_checksum() {
        let expect = Expect {
            max_payload_bytes: 1 << 30,
            ..EXPECT
        };
        let values: Vec<f32> = (0..2 * READ_CHUNK_VALUES).map(|i| i as f32).collect();
        let (bytes, _) = encoded_frame(Codec::INT8, &values);
        // The scale of the fifth block (of 256 values after a 4-byte scale) made a NaN.
        let (header, rest) = {
            let mut reader = bytes.as_slice();
            let header = block_on(read_header(&mut reader, &expect)).unwrap();
            (header, bytes.len() - reader.len())
        };
        let mut damaged = bytes.clone();
        damaged[rest + 4 * 260..rest + 4 * 260 + 4].copy_from_slice(&f32::NAN.to_le_bytes());
        assert!(matches!(
            read(&damaged, &expect),
            Err(WireError::Checksum { .. })
        ));
        let mut resealed = header.clone();
        resealed.checksum = crc32fast::hash(&damaged[rest..]);
        let mut out = Cursor::new(Vec::new());
        block_on(write_encoded(&mut out, &resealed, &damaged[rest..])).unwrap();
        let read = read(&out.into_inner(), &expect);
        assert!(
            matches!(&read, Err(WireError::Malformed(e)) if e.contains("NaN")),
            "{read:?}"
        );
    }

    #[test]
    fn each_kind_of_bad_frame_is_named() {
        let values = vec![1.0f32; 16];
        let good = frame(&params(&values), &values);

        let mut version = good.clone();
        version[0] = 9;
        assert!(matches!(
            read(&version, &EXPECT),
            Err(WireError::UnknownVersion { found: 9, .. })
        ));

        let mut huge = good.clone();
        huge[2..6].copy_from_slice(&(MAX_HEADER_BYTES + 1).to_le_bytes());
        assert!(matches!(
            read(&huge, &EXPECT),
            Err(WireError::HeaderTooLarge { .. })
        ));

        let truncated = &good[..good.len() - 5];
        assert!(matches!(
            read(truncated, &EXPECT),
            Err(WireError::Truncated)
        ));
        assert!(matches!(
            read(&good[..3], &EXPECT),
            Err(WireError::Truncated)
        ));
        assert!(matches!(read(&[], &EXPECT), Err(WireError::Empty)));
        assert!(matches!(
            read(&good[..1], &EXPECT),
            Err(WireError::Truncated)
        ));

        let wrong_run = Expect {
            run_id: "other",
            ..EXPECT
        };
        assert!(matches!(
            read(&good, &wrong_run),
            Err(WireError::WrongRun { .. })
        ));
        let wrong_model = Expect {
            fingerprint: "ffff",
            ..EXPECT
        };
        let err = read(&good, &wrong_model).unwrap_err();
        assert!(err.to_string().contains("fingerprint `abcd`"), "{err}");

        let small_cap = Expect {
            max_payload_bytes: 8,
            ..EXPECT
        };
        assert!(matches!(
            read(&good, &small_cap),
            Err(WireError::PayloadTooLarge { .. })
        ));

        let mut flipped = good.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0x40;
        assert!(matches!(
            read(&flipped, &EXPECT),
            Err(WireError::Checksum { .. })
        ));

        let mut lying = params(&values);
        lying.shape = vec![1_000_000];
        let bytes = frame(&lying, &values);
        assert!(matches!(
            read(&bytes, &EXPECT),
            Err(WireError::ShapeMismatch { .. })
        ));
    }

    /// A state request names the optimizer buffers its sender keeps, and each `Optimizer`
    /// frame the one it carries: a version 2 header that round-trips.
    #[test]
    fn named_optimizer_buffers_travel_in_a_version_2_header() {
        let values = [0.5f32, -1.0];
        let mut header =
            TensorHeader::for_payload(MessageKind::Optimizer, "run-1", "abcd", 3, &values);
        header.buffers = vec!["exp_avg".into()];
        let mut out = Cursor::new(Vec::new());
        block_on(write_frame(&mut out, &header, &values)).unwrap();
        let bytes = out.into_inner();
        assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), 2);
        let (back, payload) = read(&bytes, &EXPECT).unwrap();
        assert_eq!(back.buffers, ["exp_avg"]);
        assert_eq!(payload, values);
    }

    #[test]
    fn compressed_frames_are_version_2_and_plain_ones_stay_version_1() {
        let values: Vec<f32> = (0..700).map(|i| (i as f32 * 0.37).sin()).collect();
        let plain = frame(&params(&values), &values);
        assert_eq!(u16::from_le_bytes([plain[0], plain[1]]), 1);

        let encoded = Codec::INT8.encode(&values);
        let mut header = TensorHeader::for_encoded(
            MessageKind::Params,
            "run-1",
            "abcd",
            7,
            Codec::INT8,
            values.len(),
            &encoded,
        );
        header.reference = Some(3);
        let mut out = Cursor::new(Vec::new());
        block_on(write_encoded(&mut out, &header, &encoded)).unwrap();
        let bytes = out.into_inner();
        assert_eq!(u16::from_le_bytes([bytes[0], bytes[1]]), 2);
        // About a quarter of the f32 frame.
        assert!(
            bytes.len() < plain.len() / 3,
            "{} of {}",
            bytes.len(),
            plain.len()
        );
        let (back_header, back) = read(&bytes, &EXPECT).unwrap();
        assert_eq!(back_header.reference, Some(3));
        assert_eq!(back_header.codec, Codec::INT8);
        let worst = values
            .iter()
            .zip(&back)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst < 1.0 / 200.0, "{worst}");

        // A version-1 frame cannot carry version-2 fields.
        let mut downgraded = bytes.clone();
        downgraded[0] = 1;
        assert!(matches!(
            read(&downgraded, &EXPECT),
            Err(WireError::Malformed(_))
        ));
        // A header whose length does not match its codec's is refused before the payload.
        let mut lying = header.clone();
        lying.byte_len = values.len() as u64 * 4;
        let mut out = Cursor::new(Vec::new());
        block_on(write_encoded(&mut out, &lying, &encoded)).unwrap();
        assert!(matches!(
            read(&out.into_inner(), &EXPECT),
            Err(WireError::ShapeMismatch { .. })
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = read(&bytes, &EXPECT);
        }

        #[test]
        fn random_payloads_round_trip(values in proptest::collection::vec(-1e6f32..1e6, 0..500)) {
            let bytes = frame(&params(&values), &values);
            prop_assert_eq!(read(&bytes, &EXPECT).unwrap().1, values);
        }
    }
}
