//! One member's side of a round's data, without I/O: the header it opens its right link with and
//! expects on its left, the sub-chunks it sends first, and for every sub-chunk that comes in the
//! checks it must pass, what it does to the member's buffer and whether it goes on to the right.
//! [`all_reduce`](super::all_reduce) drives it over two byte streams, the simulator over its
//! links: the round's rules are written once.

use std::ops::Range;

use super::frame::checksum;
use super::schedule::Phase;
use super::{RingError, RingSchedule, RoundHeader};

/// A member's side of one round's data.
#[derive(Clone, Debug)]
pub struct Reducer {
    schedule: RingSchedule,
    ours: RoundHeader,
    expected: RoundHeader,
    header_read: bool,
    /// Every sub-chunk that comes in, in order.
    receives: Vec<Due>,
    /// How many of them came in.
    received: usize,
}

/// The sub-chunk that comes in next: its sequence number, its phase and where its values lie in
/// the buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    pub seq: u32,
    pub phase: Phase,
    pub range: Range<usize>,
    /// Whether it goes on to the right once taken in: all but the last all-gather step's, which
    /// has come round to its owner's left neighbour, the end of its journey.
    forward: bool,
}

impl Due {
    /// All-gather sub-chunk `seq`, of the values `range`, forwarded once taken in (what the
    /// fuzzing entry reads sub-chunks as).
    pub(crate) fn all_gather(seq: u32, range: Range<usize>) -> Self {
        Due {
            seq,
            phase: Phase::AllGather,
            range,
            forward: true,
        }
    }

    /// Checks a sub-chunk's sequence number and length in bytes, as its header gives them,
    /// before its values are read.
    pub fn check(&self, seq: u32, bytes: u32) -> Result<(), RingError> {
        if seq != self.seq {
            return Err(RingError::OutOfOrder {
                expected: self.seq,
                found: seq,
            });
        }
        let expected = (self.range.len() * 4) as u32;
        if bytes != expected {
            return Err(RingError::WrongSize {
                seq,
                expected,
                found: bytes,
            });
        }
        Ok(())
    }

    /// A sub-chunk's checksum as `sent` against what it `found`; what goes on carries `onward`.
    fn judge(&self, sent: u32, found: u32, onward: u32) -> Result<Passed, RingError> {
        if found != sent {
            return Err(RingError::Checksum {
                seq: self.seq,
                expected: sent,
                found,
            });
        }
        if self.forward {
            Ok(Passed::Forward { checksum: onward })
        } else {
            Ok(Passed::Kept)
        }
    }
}

/// What becomes of a sub-chunk once taken in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passed {
    /// It goes on to the right neighbour, with this checksum.
    Forward { checksum: u32 },
    /// It stays: it has been everywhere.
    Kept,
}

impl Reducer {
    /// Member `schedule.rank()`'s side of round `round` of the ring whose membership hashes to
    /// `membership`.
    pub fn new(schedule: RingSchedule, round: u64, membership: u64) -> Self {
        let header = |sender: usize| RoundHeader {
            round,
            membership,
            sender: sender as u32,
            len: schedule.len() as u64,
            sub_chunk: u32::try_from(schedule.sub_chunk()).unwrap_or(u32::MAX),
        };
        let left = (schedule.rank() + schedule.size() - 1) % schedule.size();
        let last_step = schedule.steps().saturating_sub(1);
        let receives = schedule
            .receives()
            .enumerate()
            .map(|(seq, (phase, step, range))| Due {
                seq: seq as u32,
                phase,
                range,
                forward: !(phase == Phase::AllGather && step == last_step),
            })
            .collect();
        Reducer {
            schedule,
            ours: header(schedule.rank()),
            expected: header(left),
            header_read: false,
            receives,
            received: 0,
        }
    }

    /// The header this member opens its right link with.
    pub fn header(&self) -> RoundHeader {
        self.ours
    }

    /// The sub-chunks this member sends before anything came in: its own chunk's.
    pub fn first(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let schedule = self.schedule;
        schedule.pieces(schedule.chunk(schedule.send_chunk(Phase::ReduceScatter, 0)))
    }

    /// Checks the header that opens the left link: the same round, membership, buffer and
    /// sub-chunks, from the left neighbour.
    pub fn on_header(&mut self, found: RoundHeader) -> Result<(), RingError> {
        if found != self.expected {
            return Err(RingError::Mismatch {
                expected: self.expected,
                found,
            });
        }
        self.header_read = true;
        Ok(())
    }

    /// Whether the header that opens the left link is still to come: what comes in first is
    /// read as one.
    pub fn awaits_header(&self) -> bool {
        !self.header_read
    }

    /// The sub-chunk due next, once the header was read; `None` when the round is all in.
    pub fn due(&self) -> Option<&Due> {
        self.header_read
            .then(|| self.receives.get(self.received))
            .flatten()
    }

    /// Whether every sub-chunk came in: the buffer holds the round's sum.
    pub fn is_done(&self) -> bool {
        self.received == self.receives.len()
    }

    /// A reduce-scatter sub-chunk came in: `received`, sent with checksum `sent`, is added to
    /// `local`, this member's values of the range due, where the partial sum forms.
    pub fn added(
        &mut self,
        sent: u32,
        received: &[f32],
        local: &mut [f32],
    ) -> Result<Passed, RingError> {
        let due = self.take(Phase::ReduceScatter)?;
        let (found, sum) = add_checked(received, local);
        due.judge(sent, found, sum)
    }

    /// An all-gather sub-chunk came in, read in place into `local` (the range due): a finished
    /// sum, forwarded unchanged, so the sender's checksum still holds.
    pub fn gathered(&mut self, sent: u32, local: &[f32]) -> Result<Passed, RingError> {
        let due = self.take(Phase::AllGather)?;
        let found = checksum(local);
        due.judge(sent, found, sent)
    }

    fn take(&mut self, phase: Phase) -> Result<Due, RingError> {
        let due = self
            .due()
            .cloned()
            .ok_or_else(|| RingError::Malformed("a sub-chunk after the round was all in".into()))?;
        debug_assert_eq!(due.phase, phase, "the caller takes in the phase due");
        self.received += 1;
        Ok(due)
    }
}

/// The round's sum made the members' mean: divided by the ring's size, and refused (on every
/// member alike, as every member holds the same sum) unless finite.
pub fn into_mean(sum: &mut [f32], size: usize) -> Result<(), RingError> {
    crate::mix::scale(sum, 1.0 / size as f32);
    if sum.iter().all(|v| v.is_finite()) {
        Ok(())
    } else {
        Err(RingError::NotFinite)
    }
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

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// Runs one round of `buffers.len()` members' reducers by hand, as a driver without I/O
    /// does (the simulator): frames go round link by link, one frame per member in turn.
    /// Returns the buffers, each member's frames sent, and how many sub-chunks stayed put.
    pub(in crate::ring) fn reduce_by_hand(
        mut buffers: Vec<Vec<f32>>,
        sub_chunk: usize,
    ) -> (Vec<Vec<f32>>, Vec<u64>, usize) {
        let size = buffers.len();
        let len = buffers[0].len();
        let mut reducers: Vec<Reducer> = (0..size)
            .map(|rank| Reducer::new(RingSchedule::new(rank, size, len, sub_chunk), 5, 9))
            .collect();
        // Each link's frames in flight, oldest first: (seq, values, checksum).
        let mut links: Vec<std::collections::VecDeque<(u32, Vec<f32>, u32)>> =
            vec![Default::default(); size];
        let mut sent = vec![0u32; size];
        for (rank, reducer) in reducers.iter().enumerate() {
            for range in reducer.first() {
                let values = buffers[rank][range].to_vec();
                let sum = checksum(&values);
                links[rank].push_back((sent[rank], values, sum));
                sent[rank] += 1;
            }
        }
        for rank in 0..size {
            let header = reducers[(rank + size - 1) % size].header();
            reducers[rank].on_header(header).unwrap();
        }
        let mut kept = 0;
        while reducers.iter().any(|r| !r.is_done()) {
            for rank in 0..size {
                let left = (rank + size - 1) % size;
                let Some((seq, values, sum)) = links[left].pop_front() else {
                    continue;
                };
                let due = reducers[rank].due().unwrap().clone();
                due.check(seq, (values.len() * 4) as u32).unwrap();
                let local = &mut buffers[rank][due.range.clone()];
                let passed = match due.phase {
                    Phase::ReduceScatter => reducers[rank].added(sum, &values, local),
                    Phase::AllGather => {
                        local.copy_from_slice(&values);
                        reducers[rank].gathered(sum, local)
                    }
                }
                .unwrap();
                match passed {
                    Passed::Forward { checksum } => {
                        links[rank].push_back((sent[rank], local.to_vec(), checksum));
                        sent[rank] += 1;
                    }
                    Passed::Kept => kept += 1,
                }
            }
        }
        assert!(links.iter().all(|l| l.is_empty()), "nothing left in flight");
        (buffers, sent.into_iter().map(u64::from).collect(), kept)
    }

    /// Three members' reducers passing their sub-chunks round by hand: each ends with the
    /// sum, sends what its schedule says, and each sub-chunk stays put at one member at the
    /// end of its journey.
    #[test]
    fn three_reducers_passing_sub_chunks_by_hand_end_with_the_sum() {
        let buffers: Vec<Vec<f32>> = (0..3).map(|k| vec![k as f32 + 1.0; 7]).collect();
        let (buffers, sent, kept) = reduce_by_hand(buffers, 2);
        assert!(buffers.iter().all(|b| b.iter().all(|&v| v == 6.0)));
        for (rank, sent) in sent.into_iter().enumerate() {
            let schedule = RingSchedule::new(rank, 3, 7, 2);
            assert_eq!(sent, schedule.frames_sent());
        }
        let schedule = RingSchedule::new(0, 3, 7, 2);
        let pieces: usize = (0..3)
            .map(|k| schedule.pieces(schedule.chunk(k)).count())
            .sum();
        assert_eq!(
            kept, pieces,
            "each sub-chunk ends its journey at one member"
        );
    }

    #[test]
    fn a_header_of_another_round_or_sender_is_refused() {
        let schedule = RingSchedule::new(1, 3, 10, 4);
        let mut reducer = Reducer::new(schedule, 2, 7);
        let left = Reducer::new(RingSchedule::new(0, 3, 10, 4), 2, 7).header();
        let other_round = Reducer::new(RingSchedule::new(0, 3, 10, 4), 3, 7).header();
        let other_sender = Reducer::new(RingSchedule::new(2, 3, 10, 4), 2, 7).header();
        for wrong in [other_round, other_sender] {
            let error = reducer.on_header(wrong).unwrap_err();
            assert!(matches!(error, RingError::Mismatch { .. }), "{error}");
        }
        assert_eq!(reducer.due(), None, "nothing is due before the header");
        reducer.on_header(left).unwrap();
        assert_eq!(reducer.due().map(|due| due.seq), Some(0));
    }

    #[test]
    fn a_sub_chunk_out_of_order_of_the_wrong_size_or_checksum_is_refused() {
        let mut reducer = Reducer::new(RingSchedule::new(0, 2, 8, 4), 0, 1);
        let header = Reducer::new(RingSchedule::new(1, 2, 8, 4), 0, 1).header();
        reducer.on_header(header).unwrap();
        let due = reducer.due().unwrap().clone();
        assert!(matches!(
            due.check(1, 16),
            Err(RingError::OutOfOrder {
                expected: 0,
                found: 1
            })
        ));
        assert!(matches!(
            due.check(0, 20),
            Err(RingError::WrongSize {
                expected: 16,
                found: 20,
                ..
            })
        ));
        let values = [1.0f32; 4];
        let wrong = checksum(&values) ^ 1;
        let error = reducer.added(wrong, &values, &mut [0.0; 4]).unwrap_err();
        assert!(
            matches!(error, RingError::Checksum { seq: 0, .. }),
            "{error}"
        );
    }

    #[test]
    fn a_mean_that_is_not_finite_is_refused() {
        let mut sum = [2.0, 4.0];
        into_mean(&mut sum, 2).unwrap();
        assert_eq!(sum, [1.0, 2.0]);
        let error = into_mean(&mut [f32::NAN, 1.0], 2).unwrap_err();
        assert!(matches!(error, RingError::NotFinite));
    }
}
