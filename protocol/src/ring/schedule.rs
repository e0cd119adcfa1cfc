//! Which chunk a member sends and receives at each step of a round.

use std::ops::Range;

/// `2 (p - 1) / p`: the share of the buffer each of `peers` members sends in a round, and so
/// the factor from algorithm bandwidth (bytes / time) to bus bandwidth, as NCCL defines it.
pub fn bus_factor(peers: usize) -> f64 {
    let p = peers as f64;
    2.0 * (p - 1.0) / p
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
    pub(super) fn receives(&self) -> impl Iterator<Item = (Phase, usize, Range<usize>)> + '_ {
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
