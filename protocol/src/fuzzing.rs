//! Byte-level entry points to the decoders that sit inside a stream protocol, for the fuzz
//! targets in `fuzz/` (frames, heartbeats and codecs have public decoders of their own).
//!
//! Each takes the bytes a peer could send and returns what the node would make of them; none
//! may panic, allocate beyond its cap or loop, whatever the bytes.

use futures::executor::block_on;

use crate::ring::{self, ROUND_HEADER_BYTES, RingError, RoundHeader, SUB_CHUNK_HEADER_BYTES};

/// Decodes a ring round header (the first bytes of a ring data connection).
pub fn ring_round_header(bytes: &[u8]) -> Result<RoundHeader, RingError> {
    let header: &[u8; ROUND_HEADER_BYTES] = bytes
        .get(..ROUND_HEADER_BYTES)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| RingError::Malformed("shorter than a round header".into()))?;
    RoundHeader::decode(header)
}

/// Reads ring sub-chunks 0, 1, ... of `values` values each off `bytes` until one is refused
/// or the bytes end; returns how many were read and the sender's checksums matched.
pub fn ring_pieces(mut bytes: &[u8], values: usize) -> (u32, Result<(), RingError>) {
    let mut buffer = vec![0.0f32; values];
    let mut seq = 0;
    while bytes.len() >= SUB_CHUNK_HEADER_BYTES {
        let due = ring::Due::all_gather(seq, 0..values);
        let sent = match block_on(ring::frame::read_piece(&mut bytes, &due, &mut buffer)) {
            Ok(sent) => sent,
            Err(e) => return (seq, Err(e)),
        };
        let found = crc32fast::hash(bytemuck::cast_slice(&buffer));
        if sent != found {
            let expected = sent;
            return (
                seq,
                Err(RingError::Checksum {
                    seq,
                    expected,
                    found,
                }),
            );
        }
        seq += 1;
    }
    (seq, Ok(()))
}

/// Reads the control messages a ring stream opens with (hello, accept, connect, refuse) off
/// `bytes` until one is refused or the bytes end; returns how many were read.
pub fn ring_control(mut bytes: &[u8]) -> (usize, Result<(), RingError>) {
    let mut read = 0;
    while !bytes.is_empty() {
        if let Err(e) = block_on(ring::control::read_control(&mut bytes)) {
            return (read, Err(e));
        }
        read += 1;
    }
    (read, Ok(()))
}

/// A well-formed round header, for a fuzzer's first corpus.
pub fn sample_ring_round_header() -> Vec<u8> {
    let header = RoundHeader {
        round: 7,
        membership: 0x1234,
        sender: 1,
        len: 1000,
        sub_chunk: 256,
    };
    header.encode().to_vec()
}

/// `values` as a left neighbour sends them, in sub-chunks of `per_piece` values, for a
/// fuzzer's first corpus.
pub fn sample_ring_pieces(values: &[f32], per_piece: usize) -> Vec<u8> {
    let mut stream = Vec::new();
    for (seq, piece) in values.chunks(per_piece.max(1)).enumerate() {
        let data: &[u8] = bytemuck::cast_slice(piece);
        stream.extend((seq as u32).to_le_bytes());
        stream.extend((data.len() as u32).to_le_bytes());
        stream.extend(crc32fast::hash(data).to_le_bytes());
        stream.extend(data);
    }
    stream
}

/// One control message of each kind, for a fuzzer's first corpus.
pub fn sample_ring_control() -> Vec<u8> {
    ring::control::sample_controls()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_samples_decode() {
        let header = ring_round_header(&sample_ring_round_header()).unwrap();
        assert_eq!((header.round, header.len), (7, 1000));
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let (pieces, result) = ring_pieces(&sample_ring_pieces(&values, 4), 4);
        assert_eq!(pieces, 3);
        result.unwrap();
        let (messages, result) = ring_control(&sample_ring_control());
        assert_eq!(messages, 4);
        result.unwrap();
    }

    #[test]
    fn damaged_samples_are_refused() {
        let mut header = sample_ring_round_header();
        header[0] ^= 1;
        assert!(ring_round_header(&header).is_err());
        let values = [1.0f32, 2.0, 3.0, 4.0];
        let mut pieces = sample_ring_pieces(&values, 2);
        *pieces.last_mut().unwrap() ^= 1;
        assert!(matches!(
            ring_pieces(&pieces, 2),
            (1, Err(RingError::Checksum { seq: 1, .. }))
        ));
        let control = sample_ring_control();
        assert!(matches!(
            ring_control(&control[..control.len() - 1]),
            (3, Err(_))
        ));
    }
}
