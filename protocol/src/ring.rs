//! Ring all-reduce for trusted peers (`allreduce` mode).
//!
//! The `p` members of a round, sorted by peer id, form a ring: each sends to its right
//! neighbour and receives from its left one. The flat buffer is cut into `p` chunks
//! ([`RingSchedule`]); in `p - 1` reduce-scatter steps every chunk travels once round the ring
//! picking up each member's contribution, and in `p - 1` all-gather steps the finished chunks
//! travel round again so that everyone has all of them. Each member sends `2 (p - 1) / p` of the
//! buffer, the lower bound for any all-reduce.
//!
//! Chunks move in sub-chunks so that sending, receiving and adding overlap: a member forwards
//! sub-chunk `j` as soon as it has added its own values to it, while sub-chunk `j + 1` is still on
//! the wire ([`all_reduce`]). Every sum is formed in the same order (a chunk starts at its owner
//! and picks up the members in ring order), and the all-gather copies the finished chunks
//! verbatim, so every member ends with bitwise-identical values.
//!
//! The data connections are plain byte streams: a libp2p stream (encrypted) or a TCP connection
//! admitted with a one-time token ([`data_plane`]). Each round opens with a [`RoundHeader`]
//! naming the round and the hash of its membership on every connection; a sub-chunk carries its
//! sequence number, length and CRC-32. Any mismatch ends the round with a [`RingError`], and the
//! member drops its connections, so that its neighbours fail too and the abort travels round the
//! ring. Callers run the round on a copy of their buffer: an aborted round changes nothing.

pub mod data_plane;

use std::collections::BTreeMap;
use std::io;
use std::ops::Range;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::PeerId;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

/// `2 (p - 1) / p`: the share of the buffer each of `peers` members sends in a round, and so
/// the factor from algorithm bandwidth (bytes / time) to bus bandwidth, as NCCL defines it.
pub fn bus_factor(peers: usize) -> f64 {
    let p = peers as f64;
    2.0 * (p - 1.0) / p
}

/// Default sub-chunk size: large enough that per-frame costs vanish (1 MiB measured 10–15 %
/// faster than 256 KiB at p = 4 on loopback), small enough that a chunk of a few MB is split
/// into pieces that overlap.
pub const DEFAULT_SUB_CHUNK_BYTES: usize = 1024 * 1024;
/// Magic number that opens every round header ("MRNG").
const ROUND_MAGIC: u32 = u32::from_le_bytes(*b"MRNG");
/// Version of the ring data frames.
pub const RING_WIRE_VERSION: u16 = 1;
/// Bytes in a [`RoundHeader`] on the wire.
pub const ROUND_HEADER_BYTES: usize = 40;
/// Bytes in a sub-chunk header on the wire: sequence number, length, CRC-32.
pub const SUB_CHUNK_HEADER_BYTES: usize = 12;

/// The peers this node lets into its rings: a ring is formed from trusted live members only, and
/// a ring stream from anyone else is refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustList(std::collections::BTreeSet<PeerId>);

impl TrustList {
    pub fn new(peers: impl IntoIterator<Item = PeerId>) -> Self {
        TrustList(peers.into_iter().collect())
    }

    pub fn contains(&self, peer: &PeerId) -> bool {
        self.0.contains(peer)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Trusted peers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The ring of a round: this node and the trusted ones among `live`.
    pub fn ring(
        &self,
        run_id: &str,
        me: PeerId,
        live: impl IntoIterator<Item = PeerId>,
    ) -> RingMembers {
        let members = live
            .into_iter()
            .filter(|peer| self.contains(peer))
            .chain(std::iter::once(me))
            .collect();
        RingMembers::new(run_id, members)
    }
}

/// The members of one ring, sorted by peer id, and the hash that names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingMembers {
    peers: Vec<PeerId>,
    hash: u64,
}

impl RingMembers {
    /// The ring of `peers` (any order, duplicates ignored) in run `run_id`.
    pub fn new(run_id: &str, mut peers: Vec<PeerId>) -> Self {
        peers.sort_by_key(|peer| peer.to_bytes());
        peers.dedup();
        let mut hasher = Sha256::new();
        hasher.update(run_id.as_bytes());
        for peer in &peers {
            let bytes = peer.to_bytes();
            hasher.update((bytes.len() as u32).to_le_bytes());
            hasher.update(&bytes);
        }
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        RingMembers {
            peers,
            hash: u64::from_le_bytes(first),
        }
    }

    pub fn peers(&self) -> &[PeerId] {
        &self.peers
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The hash every data connection of this ring carries.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// `peer`'s position in the ring.
    pub fn rank_of(&self, peer: &PeerId) -> Option<usize> {
        self.peers.iter().position(|p| p == peer)
    }

    /// The member `rank` sends to.
    pub fn right_of(&self, rank: usize) -> PeerId {
        self.peers[(rank + 1) % self.peers.len()]
    }

    /// The member `rank` receives from.
    pub fn left_of(&self, rank: usize) -> PeerId {
        self.peers[(rank + self.peers.len() - 1) % self.peers.len()]
    }
}

/// Which chunk a member sends and receives at each step of a round, and where chunks lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingSchedule {
    rank: usize,
    size: usize,
    len: usize,
    sub_chunk: usize,
}

/// The two phases of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    ReduceScatter,
    AllGather,
}

impl RingSchedule {
    /// The schedule of member `rank` of `size` for a buffer of `len` values, moved in sub-chunks
    /// of at most `sub_chunk` values.
    ///
    /// # Panics
    /// If `size` is zero, `rank >= size` or `sub_chunk` is zero: callers build these from a
    /// membership that contains them.
    pub fn new(rank: usize, size: usize, len: usize, sub_chunk: usize) -> Self {
        assert!(
            size > 0 && rank < size && sub_chunk > 0,
            "bad ring schedule"
        );
        RingSchedule {
            rank,
            size,
            len,
            sub_chunk,
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn sub_chunk(&self) -> usize {
        self.sub_chunk
    }

    /// The values of chunk `k`: the first `len % size` chunks hold one value more.
    pub fn chunk(&self, k: usize) -> Range<usize> {
        let base = self.len / self.size;
        let extra = self.len % self.size;
        let start = k * base + k.min(extra);
        let end = start + base + usize::from(k < extra);
        start..end
    }

    /// Steps per phase.
    pub fn steps(&self) -> usize {
        self.size - 1
    }

    /// The chunk this member sends at `step` of `phase`.
    pub fn send_chunk(&self, phase: Phase, step: usize) -> usize {
        let p = self.size;
        match phase {
            Phase::ReduceScatter => (self.rank + p - step % p) % p,
            Phase::AllGather => (self.rank + 1 + p - step % p) % p,
        }
    }

    /// The chunk this member receives at `step` of `phase`.
    pub fn recv_chunk(&self, phase: Phase, step: usize) -> usize {
        let p = self.size;
        match phase {
            Phase::ReduceScatter => (self.rank + 2 * p - 1 - step % p) % p,
            Phase::AllGather => (self.rank + p - step % p) % p,
        }
    }

    /// The sub-chunks of `range`, in order.
    pub fn pieces(&self, range: Range<usize>) -> impl Iterator<Item = Range<usize>> + use<> {
        let sub = self.sub_chunk;
        let end = range.end;
        (range.start..end)
            .step_by(sub)
            .map(move |start| start..(start + sub).min(end))
    }

    /// Everything this member receives in a round, in order: phase, step and values. Values
    /// travel in the sender's native byte order (little-endian on every supported target).
    fn receives(&self) -> impl Iterator<Item = (Phase, usize, Range<usize>)> + '_ {
        [Phase::ReduceScatter, Phase::AllGather]
            .into_iter()
            .flat_map(move |phase| (0..self.steps()).map(move |step| (phase, step)))
            .flat_map(move |(phase, step)| {
                self.pieces(self.chunk(self.recv_chunk(phase, step)))
                    .map(move |range| (phase, step, range))
            })
    }

    /// Payload bytes this member sends in a round: [`bus_factor`] of the buffer, give or take
    /// the one-value difference between chunks.
    pub fn payload_bytes_sent(&self) -> u64 {
        let mut values = 0;
        for phase in [Phase::ReduceScatter, Phase::AllGather] {
            for step in 0..self.steps() {
                values += self.chunk(self.send_chunk(phase, step)).len();
            }
        }
        values as u64 * 4
    }

    /// Sub-chunks this member sends in a round.
    pub fn frames_sent(&self) -> u64 {
        let mut frames = 0;
        for phase in [Phase::ReduceScatter, Phase::AllGather] {
            for step in 0..self.steps() {
                frames += self
                    .pieces(self.chunk(self.send_chunk(phase, step)))
                    .count();
            }
        }
        frames as u64
    }
}

/// Names a round on the wire; both ends of a connection must agree on every field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoundHeader {
    pub round: u64,
    pub membership: u64,
    /// Rank of the sender in the membership.
    pub sender: u32,
    /// Values in the whole buffer.
    pub len: u64,
    /// Values per sub-chunk.
    pub sub_chunk: u32,
}

impl RoundHeader {
    pub(crate) fn encode(&self) -> [u8; ROUND_HEADER_BYTES] {
        let mut out = [0u8; ROUND_HEADER_BYTES];
        out[0..4].copy_from_slice(&ROUND_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&RING_WIRE_VERSION.to_le_bytes());
        // 6..8 reserved (zero).
        out[8..16].copy_from_slice(&self.round.to_le_bytes());
        out[16..24].copy_from_slice(&self.membership.to_le_bytes());
        out[24..28].copy_from_slice(&self.sender.to_le_bytes());
        out[28..36].copy_from_slice(&self.len.to_le_bytes());
        out[36..40].copy_from_slice(&self.sub_chunk.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8; ROUND_HEADER_BYTES]) -> Result<Self, RingError> {
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i..i + 8]);
            u64::from_le_bytes(b)
        };
        if u32_at(0) != ROUND_MAGIC {
            return Err(RingError::Malformed("not a ring round header".into()));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != RING_WIRE_VERSION {
            return Err(RingError::Malformed(format!(
                "ring wire version {version} (this node speaks {RING_WIRE_VERSION})"
            )));
        }
        Ok(RoundHeader {
            round: u64_at(8),
            membership: u64_at(16),
            sender: u32_at(24),
            len: u64_at(28),
            sub_chunk: u32_at(36),
        })
    }
}

/// Why a round was aborted. None of these panics, and none leaves a half-reduced result behind:
/// the caller throws its working copy away.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    #[error("round header mismatch: expected {expected:?}, received {found:?}")]
    Mismatch {
        expected: RoundHeader,
        found: RoundHeader,
    },
    #[error("sub-chunk {seq} has {found} bytes, expected {expected}")]
    WrongSize { seq: u32, expected: u32, found: u32 },
    #[error("sub-chunk {found} arrived where {expected} was due")]
    OutOfOrder { expected: u32, found: u32 },
    #[error("sub-chunk {seq}: checksum {found:08x} does not match the sender's {expected:08x}")]
    Checksum { seq: u32, expected: u32, found: u32 },
    #[error("malformed ring frame: {0}")]
    Malformed(String),
    #[error("a neighbour closed the ring connection mid-round")]
    Closed,
    #[error("the round did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("ring connection: {0}")]
    Io(io::Error),
    #[error("ring set-up: {0}")]
    Setup(String),
    #[error("peer {0} is not in this node's trust list")]
    Untrusted(String),
    /// The reduced sum holds NaN or infinite values: some member sent them. Every member
    /// reduces the same sum, so every member refuses the round; which member it was cannot be
    /// told, so it is no one's offence.
    #[error("the ring's mean holds NaN or infinite values: a member sent them")]
    NotFinite,
    /// A member is at a later attempt (or round) than this one: this attempt is over, and the
    /// next is that one.
    #[error("a member is at attempt {} of round {}: this attempt is superseded", .by.number, .by.round)]
    Superseded { by: data_plane::Attempt },
}

impl From<io::Error> for RingError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            // A stream the other side reset or closed: yamux says so with `WriteZero`.
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::WriteZero
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted => RingError::Closed,
            _ => RingError::Io(e),
        }
    }
}

impl RingError {
    /// Whether the peer on the other end sent something it should not have (as opposed to going
    /// away or timing out).
    pub fn is_offence(&self) -> bool {
        matches!(
            self,
            RingError::Mismatch { .. }
                | RingError::WrongSize { .. }
                | RingError::OutOfOrder { .. }
                | RingError::Checksum { .. }
                | RingError::Malformed(_)
        )
    }
}

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
    let ((bytes_sent, payload_sent), bytes_received) = futures::try_join!(sending, receiving)?;
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

/// The checksum of a sub-chunk: CRC-32, which crc32fast computes with carry-less multiplies at
/// memory speed.
fn checksum(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// Reads sub-chunk `seq` into `values` (already sized to what is due); returns the checksum the
/// sender put on it, for the caller to check.
pub(crate) async fn read_piece<R: AsyncRead + Unpin>(
    from_left: &mut R,
    seq: u32,
    values: &mut [f32],
) -> Result<u32, RingError> {
    let mut header = [0u8; SUB_CHUNK_HEADER_BYTES];
    from_left.read_exact(&mut header).await?;
    let field =
        |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let (found_seq, len, sent_checksum) = (field(0), field(4), field(8));
    if found_seq != seq {
        return Err(RingError::OutOfOrder {
            expected: seq,
            found: found_seq,
        });
    }
    let expected_len = (values.len() * 4) as u32;
    if len != expected_len {
        return Err(RingError::WrongSize {
            seq,
            expected: expected_len,
            found: len,
        });
    }
    from_left
        .read_exact(bytemuck::cast_slice_mut(values))
        .await?;
    Ok(sent_checksum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

    type Pipe = Compat<tokio::io::DuplexStream>;

    /// `size` ring links: link `i` runs from member `i` to member `i + 1`.
    fn ring_links(size: usize) -> Vec<RingLinks<Pipe, Pipe>> {
        let (mut writers, mut readers) = (Vec::new(), Vec::new());
        for _ in 0..size {
            let (a, b) = tokio::io::duplex(64 * 1024);
            writers.push(Some(a.compat()));
            readers.push(Some(b.compat()));
        }
        (0..size)
            .map(|rank| {
                RingLinks::new(
                    readers[(rank + size - 1) % size].take().expect("once"),
                    writers[rank].take().expect("once"),
                )
            })
            .collect()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .expect("runtime")
    }

    /// Runs rounds over in-memory pipes; returns every member's buffers after each round.
    fn run_ring(buffers: Vec<Vec<f32>>, sub_chunk: usize, rounds: u64) -> Vec<Vec<f32>> {
        let size = buffers.len();
        runtime().block_on(async move {
            let tasks: Vec<_> = ring_links(size)
                .into_iter()
                .zip(buffers)
                .enumerate()
                .map(|(rank, (mut links, mut buffer))| {
                    tokio::spawn(async move {
                        let schedule = RingSchedule::new(rank, size, buffer.len(), sub_chunk);
                        for round in 0..rounds {
                            let (traffic, kept) =
                                all_reduce(schedule, round, 7, &mut buffer, links)
                                    .await
                                    .expect("round");
                            assert_eq!(traffic.payload_sent, schedule.payload_bytes_sent());
                            links = kept;
                        }
                        buffer
                    })
                })
                .collect();
            let mut out = Vec::new();
            for task in tasks {
                out.push(task.await.expect("member"));
            }
            out
        })
    }

    #[test]
    fn chunks_cover_the_buffer_and_differ_by_at_most_one() {
        for (len, size) in [(10, 3), (2, 4), (0, 2), (1_000_003, 4)] {
            let s = RingSchedule::new(0, size, len, 7);
            let sizes: Vec<usize> = (0..size).map(|k| s.chunk(k).len()).collect();
            assert_eq!(s.chunk(0).start, 0);
            assert_eq!(s.chunk(size - 1).end, len);
            for k in 1..size {
                assert_eq!(s.chunk(k - 1).end, s.chunk(k).start);
            }
            let (min, max) = (sizes.iter().min(), sizes.iter().max());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "{sizes:?}");
        }
    }

    #[test]
    fn each_member_sends_two_p_minus_one_over_p_of_the_buffer() {
        for size in 2..=4 {
            let len = 1200;
            let s = RingSchedule::new(1, size, len, 64);
            let expected = 2 * (size - 1) * len * 4 / size;
            assert_eq!(s.payload_bytes_sent(), expected as u64);
        }
    }

    #[test]
    fn the_receiver_gets_what_its_left_neighbour_sends() {
        for size in 2..=5 {
            for rank in 0..size {
                let me = RingSchedule::new(rank, size, 100, 10);
                let left = RingSchedule::new((rank + size - 1) % size, size, 100, 10);
                for phase in [Phase::ReduceScatter, Phase::AllGather] {
                    for step in 0..me.steps() {
                        assert_eq!(me.recv_chunk(phase, step), left.send_chunk(phase, step));
                    }
                }
                // After the reduce-scatter this member owns chunk rank + 1, which it sends first
                // in the all-gather.
                assert_eq!(
                    me.recv_chunk(Phase::ReduceScatter, me.steps() - 1),
                    me.send_chunk(Phase::AllGather, 0)
                );
            }
        }
    }

    #[test]
    fn a_ring_holds_only_trusted_live_members() {
        let [me, a, b, stranger] = [(); 4].map(|()| PeerId::random());
        let trust = TrustList::new([a, b]);
        let ring = trust.ring("r", me, [a, stranger]);
        let mut expected = vec![me, a];
        expected.sort_by_key(|p| p.to_bytes());
        assert_eq!(ring.peers(), expected.as_slice());
        assert!(ring.rank_of(&stranger).is_none());
    }

    #[test]
    fn membership_hash_ignores_order_and_names_the_run() {
        let peers: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let a = RingMembers::new("r", peers.clone());
        let reversed = RingMembers::new("r", peers.iter().rev().copied().collect());
        assert_eq!(a, reversed);
        assert_ne!(a.hash(), RingMembers::new("other", peers.clone()).hash());
        assert_ne!(a.hash(), RingMembers::new("r", peers[..2].to_vec()).hash());
        let rank = a.rank_of(&peers[1]).expect("member");
        assert_eq!(
            a.left_of(a.rank_of(&a.right_of(rank)).expect("member")),
            peers[1]
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]

        /// Every member ends with the same values, bit for bit, and they are the exact sum.
        #[test]
        fn all_reduce_sums_for_any_length(
            size in 2usize..=4,
            len in 0usize..3000,
            sub_chunk in 1usize..400,
            seed in any::<u64>(),
        ) {
            let buffers: Vec<Vec<f32>> = (0..size)
                .map(|rank| {
                    (0..len)
                        .map(|i| {
                            let x = (seed ^ (rank as u64 * 7919 + i as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                        })
                        .collect()
                })
                .collect();
            let exact: Vec<f64> = (0..len)
                .map(|i| buffers.iter().map(|b| f64::from(b[i])).sum())
                .collect();
            let out = run_ring(buffers, sub_chunk, 1);
            for member in &out {
                prop_assert_eq!(
                    bytemuck::cast_slice::<f32, u32>(member),
                    bytemuck::cast_slice::<f32, u32>(&out[0])
                );
            }
            for (got, want) in out[0].iter().zip(&exact) {
                prop_assert!((f64::from(*got) - want).abs() <= 1e-6 * (1.0 + want.abs()), "{got} vs {want}");
            }
        }
    }

    #[test]
    fn links_carry_several_rounds() {
        let buffers = vec![vec![1.0f32; 1001], vec![2.0; 1001], vec![3.0; 1001]];
        // Each round sums the previous sums: 6, then 18, then 54.
        let out = run_ring(buffers, 100, 3);
        assert!(out.iter().all(|b| b.iter().all(|&v| v == 54.0)));
    }

    /// A left neighbour that sends `frame` after a correct round header; returns what the
    /// receiving member (rank 1 of 2) reports, and its buffer.
    fn receive_from_forger(forge: impl FnOnce(&mut Vec<u8>)) -> (RingError, Vec<f32>) {
        runtime().block_on(async move {
            let schedule = RingSchedule::new(1, 2, 8, 4);
            let (left_end, from_left) = tokio::io::duplex(1 << 16);
            let (to_right, right_end) = tokio::io::duplex(1 << 16);
            let header = RoundHeader {
                round: 3,
                membership: 9,
                sender: 0,
                len: 8,
                sub_chunk: 4,
            };
            let mut bytes = header.encode().to_vec();
            forge(&mut bytes);
            let mut left_end = left_end.compat();
            left_end.write_all(&bytes).await.expect("write");
            // Keep the other ends open: the receiver must fail on what it read, not on a close.
            let _keep = (left_end, right_end);
            let mut buffer = vec![1.0f32; 8];
            let links = RingLinks::new(from_left.compat(), to_right.compat());
            let error = all_reduce(schedule, 3, 9, &mut buffer, links)
                .await
                .expect_err("the round must fail");
            (error, buffer)
        })
    }

    fn sub_chunk(seq: u32, values: &[f32], checksum_delta: u32) -> Vec<u8> {
        let data: &[u8] = bytemuck::cast_slice(values);
        let mut out = Vec::new();
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&(data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(checksum(data) ^ checksum_delta).to_le_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn a_wrong_size_checksum_or_header_aborts_the_round() {
        let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(0, &[1.0; 5], 0)));
        assert!(
            matches!(
                error,
                RingError::WrongSize {
                    expected: 16,
                    found: 20,
                    ..
                }
            ),
            "{error}"
        );
        let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(0, &[1.0; 4], 1)));
        assert!(
            matches!(error, RingError::Checksum { seq: 0, .. }),
            "{error}"
        );
        let (error, _) = receive_from_forger(|b| b.extend(sub_chunk(1, &[1.0; 4], 0)));
        assert!(
            matches!(
                error,
                RingError::OutOfOrder {
                    expected: 0,
                    found: 1
                }
            ),
            "{error}"
        );
        // Another membership hash.
        let (error, _) = receive_from_forger(|b| b[16] ^= 1);
        assert!(matches!(error, RingError::Mismatch { .. }), "{error}");
        assert!(error.is_offence());
        // Another round.
        let (error, _) = receive_from_forger(|b| b[8] ^= 1);
        assert!(matches!(error, RingError::Mismatch { .. }), "{error}");
        let (error, _) = receive_from_forger(|b| b[0] = b'X');
        assert!(matches!(error, RingError::Malformed(_)), "{error}");
    }

    #[test]
    fn a_vanished_neighbour_is_not_an_offence() {
        let error = runtime().block_on(async {
            let schedule = RingSchedule::new(0, 2, 8, 4);
            let (left_end, from_left) = tokio::io::duplex(1 << 16);
            let (to_right, _right_end) = tokio::io::duplex(1 << 16);
            drop(left_end);
            let links = RingLinks::new(from_left.compat(), to_right.compat());
            all_reduce(schedule, 0, 1, &mut [0.0; 8], links).await.err()
        });
        let error = error.expect("the round must fail");
        assert!(matches!(error, RingError::Closed), "{error}");
        assert!(!error.is_offence());
    }
}
