//! One round of the ring all-reduce over a member's two data connections.

use std::collections::BTreeMap;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::frame::{
    ROUND_HEADER_BYTES, SUB_CHUNK_HEADER_BYTES, SubChunkHeader, checksum, read_piece,
};
use super::reducer::{Passed, Reducer};
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
    let reducer = Reducer::new(schedule, round, membership);

    let mut pieces = Pieces::split(&schedule, buffer);
    // The first step sends this member's own chunk; later ones forward what the receiver
    // finished, handed over in the order it finished them.
    let first: Vec<Piece<'_>> = reducer
        .first()
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
        reducer.header(),
        first,
        forwarded,
        hand_back,
        schedule.frames_sent(),
    );
    let receiving = receive_round(
        reducer,
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
        let frame_header = SubChunkHeader {
            seq: seq as u32,
            bytes: data.len() as u32,
            checksum: piece.checksum.unwrap_or_else(|| checksum(piece.values)),
        };
        to_right.write_all(&frame_header.encode()).await?;
        to_right.write_all(data).await?;
        bytes += (SUB_CHUNK_HEADER_BYTES + data.len()) as u64;
        payload += data.len() as u64;
        // The receiver may be done with the round already; the loan then simply ends.
        let _ = hand_back.try_send((piece.start, piece.values));
    }
    to_right.flush().await?;
    Ok((bytes, payload))
}

/// The receiving half of a round: the header, then each sub-chunk due, read and taken in as
/// the [`Reducer`] has it (added to this member's values in reduce-scatter, read in place in
/// all-gather) and forwarded with its checksum.
async fn receive_round<'a, R: AsyncRead + Unpin>(
    mut reducer: Reducer,
    mut pieces: Pieces<'a>,
    mut handed_back: mpsc::Receiver<(usize, &'a mut [f32])>,
    from_left: &mut R,
    forward: mpsc::Sender<Piece<'a>>,
    scratch: &mut Vec<f32>,
) -> Result<u64, RingError> {
    let mut header = [0u8; ROUND_HEADER_BYTES];
    from_left.read_exact(&mut header).await?;
    reducer.on_header(RoundHeader::decode(&header)?)?;
    let mut bytes = ROUND_HEADER_BYTES as u64;
    while let Some(due) = reducer.due().cloned() {
        let local = pieces.take(due.range.start, &mut handed_back).await?;
        let passed = match due.phase {
            Phase::ReduceScatter => {
                scratch.resize(due.range.len(), 0.0);
                let sent = read_piece(from_left, &due, scratch).await?;
                reducer.added(sent, scratch, local)?
            }
            Phase::AllGather => {
                let sent = read_piece(from_left, &due, local).await?;
                reducer.gathered(sent, local)?
            }
        };
        bytes += (SUB_CHUNK_HEADER_BYTES + 4 * due.range.len()) as u64;
        if let Passed::Forward { checksum } = passed {
            let piece = Piece {
                start: due.range.start,
                values: local,
                checksum: Some(checksum),
            };
            // The channel holds a whole round, so it is never full: the sender ended, so it
            // failed, and its error is the one reported.
            forward.try_send(piece).map_err(|_| RingError::Closed)?;
        }
    }
    Ok(bytes)
}
