//! One round of the ring all-reduce over a member's two data connections.

use std::collections::BTreeMap;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::frame::{ROUND_HEADER_BYTES, SUB_CHUNK_HEADER_BYTES, checksum, read_piece};
use super::schedule::Phase;
use super::{RingError, RingSchedule, RoundHeader};

/// What a round moved through this member.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundTraffic {
    /// Bytes written to the right neighbour, headers included.
    pub bytes_sent: u64,
    /// Bytes read from the left neighbour, headers included.
    pub bytes_received: u64,
    /// Of `bytes_sent`, the values themselves.
    pub payload_sent: u64,
}

/// A ring member's data connections: the stream from the left neighbour and the one to the
/// right. They stay open from round to round while the membership holds, and so does the
/// buffer that incoming sums land in (fresh memory costs a page fault per 4 KiB).
#[derive(Debug)]
pub struct RingLinks<R, W> {
    pub from_left: R,
    pub to_right: W,
    scratch: Vec<f32>,
}

impl<R, W> RingLinks<R, W> {
    pub fn new(from_left: R, to_right: W) -> Self {
        RingLinks {
            from_left,
            to_right,
            scratch: Vec::new(),
        }
    }
}

/// Runs one round: on success `buffer` holds the element-wise sum of every member's buffer and
/// the links are handed back for the next round. On error the links are dropped, which is how
/// the neighbours learn of the abort, and `buffer` holds a mix of partial sums: run the round on
/// a copy.
///
/// Values go to the wire straight from `buffer` and come back into it: partial sums are formed in
/// place, finished chunks are read into place. The sending and receiving halves run side by side
/// in this task and pass sub-chunks of `buffer` between them: the receiver lends a sub-chunk it
/// has finished to the sender, which hands it back once written.
pub async fn all_reduce<R, W>(
    schedule: RingSchedule,
    round: u64,
    membership: u64,
    buffer: &mut [f32],
    links: RingLinks<R, W>,
) -> Result<(RoundTraffic, RingLinks<R, W>), RingError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    assert_eq!(
        schedule.len(),
        buffer.len(),
        "schedule is for another buffer"
    );
    if schedule.size() == 1 {
        return Ok((RoundTraffic::default(), links));
    }
    let RingLinks {
        mut from_left,
        mut to_right,
        mut scratch,
    } = links;
    let header = |sender: usize| RoundHeader {
        round,
        membership,
        sender: sender as u32,
        len: buffer.len() as u64,
        sub_chunk: u32::try_from(schedule.sub_chunk()).unwrap_or(u32::MAX),
    };
    let ours = header(schedule.rank());
    let expected = header((schedule.rank() + schedule.size() - 1) % schedule.size());

    let mut pieces = Pieces::split(&schedule, buffer);
    // The first step sends this member's own chunk; later ones forward what the receiver
    // finished, handed over in the order it finished them.
    let first: Vec<Piece<'_>> = schedule
        .pieces(schedule.chunk(schedule.send_chunk(Phase::ReduceScatter, 0)))
        .map(|range| pieces.take_at_hand(range.start))
        .collect();
    // Each channel holds a whole round's sub-chunks, so a hand-over never waits.
    let capacity = usize::try_from(schedule.frames_sent())
        .unwrap_or(usize::MAX)
        .max(1);
    let (forward, forwarded) = mpsc::channel(capacity);
    let (hand_back, handed_back) = mpsc::channel(capacity);
    let sending = send_round(
        &mut to_right,
        ours,
        first,
        forwarded,
        hand_back,
        schedule.frames_sent(),
    );
    let receiving = receive_round(
        schedule,
        expected,
        pieces,
        handed_back,
        &mut from_left,
        forward,
        &mut scratch,
    );
    // The first error ends the round, and dropping the other half stops it.
    let ((bytes_sent, payload_sent), bytes_received) =
        futures::future::try_join(sending, receiving).await?;
    let traffic = RoundTraffic {
        bytes_sent,
        bytes_received,
        payload_sent,
    };
    Ok((
        traffic,
        RingLinks {
            from_left,
            to_right,
            scratch,
        },
    ))
}

/// A sub-chunk of the caller's buffer, named by where it starts, and the checksum to send with
/// it once it is known.
#[derive(Debug)]
struct Piece<'a> {
    start: usize,
    values: &'a mut [f32],
    checksum: Option<u32>,
}

/// The receiver's view of the buffer: the sub-chunks it holds, and the channel on which the
/// sender hands back those it was lent. Each sub-chunk is lent at most once before the receiver
/// needs it again (a chunk comes back round the ring only after this member sent it on), so a
/// wait for one ends as soon as the sender has written it.
struct Pieces<'a> {
    at_hand: BTreeMap<usize, &'a mut [f32]>,
}

impl<'a> Pieces<'a> {
    /// Cuts `buffer` along `schedule`'s sub-chunks.
    fn split(schedule: &RingSchedule, buffer: &'a mut [f32]) -> Self {
        let mut at_hand = BTreeMap::new();
        let mut rest = buffer;
        for range in (0..schedule.size()).flat_map(|k| schedule.pieces(schedule.chunk(k))) {
            let (piece, tail) = std::mem::take(&mut rest).split_at_mut(range.len());
            at_hand.insert(range.start, piece);
            rest = tail;
        }
        Pieces { at_hand }
    }

    /// The sub-chunk starting at `start`, which has not been lent yet.
    fn take_at_hand(&mut self, start: usize) -> Piece<'a> {
        let values = self
            .at_hand
            .remove(&start)
            .expect("every sub-chunk is cut once and lent at most once before use");
        Piece {
            start,
            values,
            checksum: None,
        }
    }

    /// The sub-chunk starting at `start`, waiting for the sender to hand it back if it is lent.
    async fn take(
        &mut self,
        start: usize,
        handed_back: &mut mpsc::Receiver<(usize, &'a mut [f32])>,
    ) -> Result<&'a mut [f32], RingError> {
        loop {
            if let Some(values) = self.at_hand.remove(&start) {
                return Ok(values);
            }
            // The sender ended, so it failed: its error is the one reported.
            let (at, values) = handed_back.recv().await.ok_or(RingError::Closed)?;
            self.at_hand.insert(at, values);
        }
    }
}

/// The sending half of a round: the header, this member's first chunk, then every sub-chunk
/// the receiver forwards, until `frames` were sent; each is handed back once written. Returns
/// the bytes and the payload bytes sent.
async fn send_round<'a, W: AsyncWrite + Unpin>(
    to_right: &mut W,
    header: RoundHeader,
    first: Vec<Piece<'a>>,
    mut forwarded: mpsc::Receiver<Piece<'a>>,
    hand_back: mpsc::Sender<(usize, &'a mut [f32])>,
    frames: u64,
) -> Result<(u64, u64), RingError> {
    to_right.write_all(&header.encode()).await?;
    let mut bytes = ROUND_HEADER_BYTES as u64;
    let mut payload = 0u64;
    let mut first = first.into_iter();
    for seq in 0..frames {
        let piece = match first.next() {
            Some(piece) => piece,
            // The receiver failed: its error is the one reported.
            None => forwarded.recv().await.ok_or(RingError::Closed)?,
        };
        let data: &[u8] = bytemuck::cast_slice(piece.values);
        let sum = piece.checksum.unwrap_or_else(|| checksum(data));
        let mut frame_header = [0u8; SUB_CHUNK_HEADER_BYTES];
        frame_header[0..4].copy_from_slice(&(seq as u32).to_le_bytes());
        frame_header[4..8].copy_from_slice(&(data.len() as u32).to_le_bytes());
        frame_header[8..12].copy_from_slice(&sum.to_le_bytes());
        to_right.write_all(&frame_header).await?;
        to_right.write_all(data).await?;
        bytes += (SUB_CHUNK_HEADER_BYTES + data.len()) as u64;
        payload += data.len() as u64;
        // The receiver may be done with the round already; the loan then simply ends.
        let _ = hand_back.try_send((piece.start, piece.values));
    }
    to_right.flush().await?;
    Ok((bytes, payload))
}

/// The receiving half of a round: checks the header, then for each sub-chunk adds the received
/// values to this member's (reduce-scatter) or reads the finished values in place (all-gather),
/// and forwards the result with its checksum.
async fn receive_round<'a, R: AsyncRead + Unpin>(
    schedule: RingSchedule,
    expected: RoundHeader,
    mut pieces: Pieces<'a>,
    mut handed_back: mpsc::Receiver<(usize, &'a mut [f32])>,
    from_left: &mut R,
    forward: mpsc::Sender<Piece<'a>>,
    scratch: &mut Vec<f32>,
) -> Result<u64, RingError> {
    let mut header = [0u8; ROUND_HEADER_BYTES];
    from_left.read_exact(&mut header).await?;
    let found = RoundHeader::decode(&header)?;
    if found != expected {
        return Err(RingError::Mismatch { expected, found });
    }
    let mut bytes = ROUND_HEADER_BYTES as u64;
    let last_step = schedule.steps() - 1;
    for (seq, (phase, step, range)) in schedule.receives().enumerate() {
        let seq = seq as u32;
        let local = pieces.take(range.start, &mut handed_back).await?;
        let (sent_checksum, found, checksum) = match phase {
            Phase::ReduceScatter => {
                scratch.resize(range.len(), 0.0);
                let sent = read_piece(from_left, seq, scratch).await?;
                let (found, sum) = add_checked(scratch, local);
                (sent, found, sum)
            }
            // Forwarded unchanged: the sender's checksum still holds.
            Phase::AllGather => {
                let sent = read_piece(from_left, seq, local).await?;
                (sent, checksum(bytemuck::cast_slice(local)), sent)
            }
        };
        bytes += (SUB_CHUNK_HEADER_BYTES + 4 * range.len()) as u64;
        if found != sent_checksum {
            return Err(RingError::Checksum {
                seq,
                expected: sent_checksum,
                found,
            });
        }
        if phase == Phase::AllGather && step == last_step {
            // The chunk has come round to its owner's left neighbour: the end of its journey.
            continue;
        }
        let piece = Piece {
            start: range.start,
            values: local,
            checksum: Some(checksum),
        };
        // The channel holds a whole round, so it is never full: the sender ended, so it failed,
        // and its error is the one reported.
        forward.try_send(piece).map_err(|_| RingError::Closed)?;
    }
    Ok(bytes)
}

/// Values hashed, added and hashed again at a time: 16 KiB, small enough to stay in L1 between
/// passes.
const FUSED_BLOCK: usize = 4096;

/// `local += received`, block by block; returns the checksum of what was received and of the
/// sum, so that each byte is read from memory once for all of it. (IEEE addition commutes, so
/// which side holds the sum changes no bit; what fixes the result is the ring order.)
fn add_checked(received: &[f32], local: &mut [f32]) -> (u32, u32) {
    let mut before = crc32fast::Hasher::new();
    let mut after = crc32fast::Hasher::new();
    for (theirs, own) in received
        .chunks(FUSED_BLOCK)
        .zip(local.chunks_mut(FUSED_BLOCK))
    {
        before.update(bytemuck::cast_slice(theirs));
        for (o, t) in own.iter_mut().zip(theirs) {
            *o += *t;
        }
        after.update(bytemuck::cast_slice(own));
    }
    (before.finalize(), after.finalize())
}
