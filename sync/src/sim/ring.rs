//! The simulator's ring rounds: the protocol's attempt binding and round reducers, their frames
//! carried over simulated links, one message delay a hop.
//!
//! - Set-up: an attempt sends its [`Opener`]'s hello to its right neighbour and takes hellos
//!   from its queue; its [`Acceptor`] decides on each, and its opener on the answer, by the
//!   protocol's binding rule (`murmur_protocol::ring::binding`): only attempts of the same
//!   round and number bind, and a later attempt supersedes an earlier one. A hello of an
//!   attempt that ended is skipped (its stream is found closed); one that binds joins the two
//!   attempts with a link.
//! - Held links: after a round completes, each member keeps its two links for the next round of
//!   the same membership, and a member starts that round on its own clock (when its trainer
//!   hands over), as the real ring does.
//! - Data: an attempt with both links runs the protocol's [`Reducer`], as the engine's does,
//!   and its frames are the engine's bytes (the protocol's [`RoundHeader`] and
//!   [`SubChunkHeader`], then the values): it writes the round's header and its own chunk to
//!   the right (the first write succeeds even on a link the reader closed: it lands in the
//!   kernel's buffer), takes in each sub-chunk that arrives on its left link (checked, added or
//!   gathered into its buffer) and forwards what the reducer says, one message delay per hop.
//!   Another round's header fails the reader. Once every sub-chunk is in, its buffer holds the
//!   round's sum, made the mean as the engine makes it.
//! - Failure: an attempt that ends closes its links; a member reading one of them reads what was
//!   sent before, then the end, one message delay later. Attempts time out after the ring
//!   timeout.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::mix;
use murmur_protocol::ring::binding::{Acceptor, OnHello, Opener};
use murmur_protocol::ring::{
    Attempt as Numbered, Control, DataPlane, Passed, Phase, Reducer, RingError, RingMembers,
    RingSchedule, RoundHeader, SUB_CHUNK_HEADER_BYTES, SubChunkHeader, checksum, into_mean,
};
use murmur_protocol::trust::TrustList;

use crate::policy::Input;
use crate::replica::ExchangeEnd;

use super::{Event, Sim};

/// A hello on the way to a member's queue: from which attempt of which peer, and the message
/// its opener wrote.
#[derive(Clone, Debug)]
pub(super) struct Hello {
    attempt: usize,
    from: PeerId,
    message: Control,
}

/// What the model schedules for itself.
#[derive(Clone, Debug)]
pub(super) enum RingEvent {
    /// The answer to `attempt`'s hello reached it; `link` is its right link if the hello
    /// bound.
    Answered {
        attempt: usize,
        answer: Control,
        link: Option<usize>,
    },
    Timeout {
        attempt: usize,
    },
    /// `attempt` reads the end of its left link.
    ReadClosed {
        attempt: usize,
    },
    /// A frame written to `link` arrived.
    Arrived {
        link: usize,
    },
}

/// What the simulator is to do.
#[derive(Debug)]
pub(super) enum Output {
    Schedule {
        after: Duration,
        event: RingEvent,
    },
    Send {
        from: usize,
        to: usize,
        after: Duration,
        hello: Hello,
    },
    /// An attempt of `peer` at `round` ended: the round's mean, or why not.
    Ended {
        peer: usize,
        round: u64,
        result: Result<Vec<f32>, RingError>,
    },
}

#[derive(Debug)]
struct Attempt {
    peer: usize,
    /// How many members the ring has.
    size: usize,
    /// The right neighbour.
    right_id: PeerId,
    opener: Opener,
    acceptor: Acceptor,
    reducer: Reducer,
    /// The member's values, where the round's sum forms.
    buffer: Vec<f32>,
    /// The sequence number of the next sub-chunk it writes.
    sent: u32,
    left: Option<usize>,
    right: Option<usize>,
    alive: bool,
    /// Whether it wrote to its right link yet (the first write never fails).
    wrote: bool,
}

/// A data connection from one member to its right neighbour.
#[derive(Debug)]
struct Link {
    /// The member that reads it.
    to: usize,
    open: bool,
    /// The frames written to it and not read yet, as they go on the wire (a round's header,
    /// then sub-chunks), oldest first; the first `arrived` of them have arrived.
    frames: VecDeque<Vec<u8>>,
    arrived: usize,
}

/// Every attempt and link of a simulation, and each member's queue of hellos.
#[derive(Debug)]
pub(super) struct RingModel {
    run_id: String,
    /// Every simulated peer trusts the others.
    trust: TrustList,
    /// One-way delay of a message.
    latency: Duration,
    ring_timeout: Duration,
    /// Values per sub-chunk.
    sub_chunk: usize,
    attempts: Vec<Attempt>,
    links: Vec<Link>,
    queues: Vec<VecDeque<Hello>>,
    current: Vec<Option<usize>>,
    /// The links kept after a completed round, for the next round of the same membership:
    /// (membership, left, right).
    held: Vec<Option<(u64, usize, usize)>>,
}

impl RingModel {
    pub(super) fn new(
        run_id: &str,
        trust: TrustList,
        peers: usize,
        latency: Duration,
        ring_timeout: Duration,
        sub_chunk: usize,
    ) -> Self {
        RingModel {
            run_id: run_id.to_owned(),
            trust,
            latency,
            ring_timeout,
            sub_chunk,
            attempts: Vec::new(),
            links: Vec::new(),
            queues: vec![VecDeque::new(); peers],
            current: vec![None; peers],
            held: vec![None; peers],
        }
    }

    /// `peer` (`id`) starts `attempt` at the ring of `members` (`order`: their indices in ring
    /// order) with `snapshot`.
    pub(super) fn start(
        &mut self,
        (peer, id): (usize, PeerId),
        attempt: Numbered,
        members: &RingMembers,
        order: &[usize],
        snapshot: Vec<f32>,
    ) -> Vec<Output> {
        let round = attempt.round;
        let mut out = Vec::new();
        if let Some(old) = self.current[peer] {
            self.fail(old, RingError::Closed, &mut out);
        }
        let acceptor = match Acceptor::new(&self.run_id, members, &id, DataPlane::Libp2p, attempt) {
            Ok(acceptor) if members.len() > 1 => acceptor,
            _ => {
                self.drop_held(peer, &mut out);
                out.push(Output::Ended {
                    peer,
                    round,
                    result: Ok(snapshot),
                });
                return out;
            }
        };
        let (size, membership) = (members.len(), members.hash());
        let rank = members.rank_of(&id).unwrap_or_default();
        let right_peer = order[(rank + 1) % size];
        let index = self.attempts.len();
        self.attempts.push(Attempt {
            peer,
            size,
            right_id: members.right_of(rank),
            opener: Opener::new(&self.run_id, members, DataPlane::Libp2p, attempt),
            acceptor,
            reducer: Reducer::new(
                RingSchedule::new(rank, size, snapshot.len(), self.sub_chunk),
                round,
                membership,
            ),
            buffer: snapshot,
            sent: 0,
            left: None,
            right: None,
            alive: true,
            wrote: false,
        });
        self.current[peer] = Some(index);
        out.push(Output::Schedule {
            after: self.ring_timeout,
            event: RingEvent::Timeout { attempt: index },
        });
        match self.held[peer] {
            // The last round's connections, for the same members: no set-up.
            Some((held, left, right)) if held == membership => {
                let attempt = &mut self.attempts[index];
                attempt.left = Some(left);
                attempt.right = Some(right);
                self.run(index, &mut out);
            }
            _ => {
                self.drop_held(peer, &mut out);
                let hello = Hello {
                    attempt: index,
                    from: id,
                    message: self.attempts[index].opener.hello(),
                };
                out.push(Output::Send {
                    from: peer,
                    to: right_peer,
                    after: self.latency,
                    hello,
                });
                self.take_hellos(peer, &mut out);
            }
        }
        out
    }

    /// A hello reached `peer`'s queue.
    pub(super) fn hello(&mut self, peer: usize, hello: Hello) -> Vec<Output> {
        let mut out = Vec::new();
        self.queues[peer].push_back(hello);
        self.take_hellos(peer, &mut out);
        out
    }

    /// `peer`'s current attempt, if it still looks for its left link, takes hellos off the
    /// queue until one binds or ends it.
    fn take_hellos(&mut self, peer: usize, out: &mut Vec<Output>) {
        let Some(own) = self.current[peer] else {
            return;
        };
        if !self.attempts[own].alive || self.attempts[own].left.is_some() {
            return;
        }
        while let Some(hello) = self.queues[peer].pop_front() {
            if !self.attempts[hello.attempt].alive {
                // The stream of an attempt its opener gave up on: found closed, skipped.
                continue;
            }
            let Control::Hello(message) = &hello.message else {
                // A stream that does not open with a hello: the engine skips it too.
                continue;
            };
            let verdict = self.attempts[own]
                .acceptor
                .on_hello(&hello.from, message, &self.trust);
            let opener = hello.attempt;
            let answer = |answer, link| Output::Schedule {
                after: self.latency,
                event: RingEvent::Answered {
                    attempt: opener,
                    answer,
                    link,
                },
            };
            match verdict {
                OnHello::Bind => {
                    let link = self.links.len();
                    out.push(answer(Control::Accept, Some(link)));
                    self.links.push(Link {
                        to: peer,
                        open: true,
                        frames: VecDeque::new(),
                        arrived: 0,
                    });
                    self.attempts[own].left = Some(link);
                    self.run(own, out);
                    return;
                }
                OnHello::Skip { answer: refusal } => out.push(answer(refusal, None)),
                OnHello::Fail {
                    answer: refusal,
                    error,
                } => {
                    out.push(answer(refusal, None));
                    self.fail(own, error, out);
                    return;
                }
                OnHello::Superseded { by } => {
                    // Kept for the attempt that follows this one.
                    self.queues[peer].push_front(hello);
                    self.fail(own, RingError::Superseded { by }, out);
                    return;
                }
            }
        }
    }

    pub(super) fn handle(&mut self, event: RingEvent) -> Vec<Output> {
        let mut out = Vec::new();
        match event {
            RingEvent::Answered {
                attempt,
                answer,
                link,
            } => {
                if !self.attempts[attempt].alive {
                    return out;
                }
                let a = &self.attempts[attempt];
                match (a.opener.answered(&a.right_id, answer), link) {
                    (Ok(_), Some(link)) if self.links[link].open => {
                        self.attempts[attempt].right = Some(link);
                        self.run(attempt, &mut out);
                    }
                    // The acceptor's attempt ended before the answer arrived: its stream is
                    // closed, as the opener finds when it writes.
                    (Ok(_), _) => {}
                    (Err(error), _) => self.fail(attempt, error, &mut out),
                }
            }
            RingEvent::Timeout { attempt } => {
                let timeout = self.ring_timeout;
                self.fail(attempt, RingError::Timeout(timeout), &mut out);
            }
            RingEvent::ReadClosed { attempt } => self.read(attempt, &mut out),
            RingEvent::Arrived { link } => {
                self.links[link].arrived += 1;
                if let Some(reader) = self.reader(link) {
                    self.read(reader, &mut out);
                }
            }
        }
        out
    }

    fn running(&self, attempt: usize) -> bool {
        let a = &self.attempts[attempt];
        a.alive && a.left.is_some() && a.right.is_some()
    }

    /// The attempt reading `link`, if it runs on it.
    fn reader(&self, link: usize) -> Option<usize> {
        let reader = self.current[self.links[link].to]?;
        (self.attempts[reader].left == Some(link) && self.running(reader)).then_some(reader)
    }

    /// `attempt` has both links: it writes the round's header and its own chunk to the right,
    /// and reads what arrived on its left.
    fn run(&mut self, attempt: usize, out: &mut Vec<Output>) {
        if !self.running(attempt) {
            return;
        }
        let a = &self.attempts[attempt];
        let header = a.reducer.header().encode().to_vec();
        let first: Vec<_> = a.reducer.first().collect();
        if !self.write(attempt, header, out) {
            return;
        }
        for range in first {
            let checksum = checksum(&self.attempts[attempt].buffer[range.clone()]);
            if !self.write_piece(attempt, range, checksum, out) {
                return;
            }
        }
        self.read(attempt, out);
    }

    /// `attempt` writes its next sub-chunk, the values `range` of its buffer; whether it still
    /// runs.
    fn write_piece(
        &mut self,
        attempt: usize,
        range: Range<usize>,
        checksum: u32,
        out: &mut Vec<Output>,
    ) -> bool {
        let a = &mut self.attempts[attempt];
        let values = &a.buffer[range];
        let header = SubChunkHeader {
            seq: a.sent,
            bytes: (values.len() * 4) as u32,
            checksum,
        };
        a.sent += 1;
        let mut frame = header.encode().to_vec();
        frame.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        self.write(attempt, frame, out)
    }

    /// `attempt` writes `frame` to its right link, where it arrives one message delay later. A
    /// link its reader closed takes the first write (into the kernel's buffer) and fails a
    /// later one. Whether the attempt still runs.
    fn write(&mut self, attempt: usize, frame: Vec<u8>, out: &mut Vec<Output>) -> bool {
        let Some(link) = self.attempts[attempt].right else {
            return false;
        };
        let wrote = std::mem::replace(&mut self.attempts[attempt].wrote, true);
        if !self.links[link].open {
            if wrote {
                self.fail(attempt, RingError::Closed, out);
                return false;
            }
            return true;
        }
        self.links[link].frames.push_back(frame);
        out.push(Output::Schedule {
            after: self.latency,
            event: RingEvent::Arrived { link },
        });
        true
    }

    /// `attempt` takes in what arrived on its left link, as long as it runs; a link closed with
    /// nothing left on it ends the attempt.
    fn read(&mut self, attempt: usize, out: &mut Vec<Output>) {
        let Some(left) = self.attempts[attempt].left else {
            return;
        };
        while self.running(attempt) && self.links[left].arrived > 0 {
            let link = &mut self.links[left];
            link.arrived -= 1;
            let Some(frame) = link.frames.pop_front() else {
                break;
            };
            if let Err(error) = self.take_in(attempt, frame, out) {
                self.fail(attempt, error, out);
            }
        }
        let link = &self.links[left];
        if self.running(attempt) && !link.open && link.frames.is_empty() {
            self.fail(attempt, RingError::Closed, out);
        }
    }

    /// `attempt` takes in one frame from its left neighbour, decoded and checked as the engine
    /// reads it off the wire: first the round's header, then each sub-chunk, added or gathered
    /// into its buffer and forwarded as its reducer has it; once the round is all in, the
    /// attempt completes.
    fn take_in(
        &mut self,
        attempt: usize,
        frame: Vec<u8>,
        out: &mut Vec<Output>,
    ) -> Result<(), RingError> {
        let a = &mut self.attempts[attempt];
        if a.reducer.awaits_header() {
            let header = frame.as_slice().try_into().map_err(|_| {
                RingError::Malformed(format!("a round header of {} bytes", frame.len()))
            })?;
            return a.reducer.on_header(RoundHeader::decode(header)?);
        }
        let (header, values) = frame
            .split_first_chunk::<SUB_CHUNK_HEADER_BYTES>()
            .ok_or_else(|| RingError::Malformed("a sub-chunk cut short".into()))?;
        let SubChunkHeader {
            seq,
            bytes,
            checksum: sent,
        } = SubChunkHeader::decode(header);
        let due = (a.reducer.due().cloned())
            .ok_or_else(|| RingError::Malformed("a sub-chunk that is not due".into()))?;
        due.check(seq, bytes)?;
        let values: Vec<f32> = (values.chunks_exact(4))
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let local = &mut a.buffer[due.range.clone()];
        let passed = match due.phase {
            Phase::ReduceScatter => a.reducer.added(sent, &values, local)?,
            Phase::AllGather => {
                local.copy_from_slice(&values);
                a.reducer.gathered(sent, local)?
            }
        };
        if let Passed::Forward { checksum } = passed
            && !self.write_piece(attempt, due.range, checksum, out)
        {
            return Ok(());
        }
        if self.attempts[attempt].reducer.is_done() {
            self.complete(attempt, out);
        }
        Ok(())
    }

    /// Every sub-chunk of `attempt`'s round is in: its sum made the mean, as the engine makes
    /// it, and its links kept for the next round of the same members.
    fn complete(&mut self, attempt: usize, out: &mut Vec<Output>) {
        let a = &mut self.attempts[attempt];
        let mut mean = std::mem::take(&mut a.buffer);
        if let Err(error) = into_mean(&mut mean, a.size) {
            return self.fail(attempt, error, out);
        }
        a.alive = false;
        let header = a.reducer.header();
        let (peer, round, membership) = (a.peer, header.round, header.membership);
        let (left, right) = (a.left.unwrap_or(0), a.right.unwrap_or(0));
        if self.current[peer] == Some(attempt) {
            self.current[peer] = None;
        }
        self.held[peer] = Some((membership, left, right));
        out.push(Output::Ended {
            peer,
            round,
            result: Ok(mean),
        });
    }

    /// `peer` drops the connections it kept from its last round.
    fn drop_held(&mut self, peer: usize, out: &mut Vec<Output>) {
        if let Some((_, left, right)) = self.held[peer].take() {
            self.close(left, out);
            self.close(right, out);
        }
    }

    /// Closes `link`; a member reading it sees the end one message delay later.
    fn close(&mut self, link: usize, out: &mut Vec<Output>) {
        if !std::mem::replace(&mut self.links[link].open, false) {
            return;
        }
        if let Some(reader) = self.current[self.links[link].to]
            && self.attempts[reader].left == Some(link)
        {
            out.push(Output::Schedule {
                after: self.latency,
                event: RingEvent::ReadClosed { attempt: reader },
            });
        }
    }

    /// `attempt` aborts with `error`, closing its links.
    fn fail(&mut self, attempt: usize, error: RingError, out: &mut Vec<Output>) {
        if !self.attempts[attempt].alive {
            return;
        }
        let a = &mut self.attempts[attempt];
        a.alive = false;
        let (peer, round, left, right) = (a.peer, a.reducer.header().round, a.left, a.right);
        if self.current[peer] == Some(attempt) {
            self.current[peer] = None;
        }
        // Held links are among them; the next attempt connects afresh.
        self.held[peer] = None;
        out.push(Output::Ended {
            peer,
            round,
            result: Err(error),
        });
        for link in [left, right].into_iter().flatten() {
            self.close(link, out);
        }
    }

    /// `peer` dies: its attempt ends, its connections close.
    pub(super) fn kill(&mut self, peer: usize) -> Vec<Output> {
        let mut out = Vec::new();
        self.queues[peer].clear();
        self.drop_held(peer, &mut out);
        if let Some(attempt) = self.current[peer] {
            self.fail(attempt, RingError::Closed, &mut out);
        }
        // The dead peer's own abort is not reported to it.
        out.retain(|o| !matches!(o, Output::Ended { peer: p, .. } if *p == peer));
        out
    }
}

impl Sim {
    pub(super) fn ring_events(&mut self, events: Vec<Output>) {
        for event in events {
            match event {
                Output::Schedule { after, event } => {
                    self.schedule(after, Event::Ring(Box::new(event)))
                }
                Output::Send {
                    from,
                    to,
                    after,
                    hello,
                } => {
                    let hello = Box::new(hello);
                    self.send((from, to), after, Event::Hello { to, hello });
                }
                Output::Ended {
                    peer,
                    round,
                    result,
                } => self.round_ended(peer, round, result),
            }
        }
    }

    /// A ring attempt of `i` ended: with the round's mean, or aborted.
    pub(super) fn round_ended(
        &mut self,
        i: usize,
        round: u64,
        result: Result<Vec<f32>, RingError>,
    ) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, round, ok = result.is_ok(), "ring attempt ended");
        if !self.peers[i].alive {
            return;
        }
        match result {
            Ok(mean) => {
                self.peers[i].stats.exchanges += 1;
                let step = self.peers[i].step;
                self.due_mixed(i, ExchangeEnd::Reduced { step: round, mean });
                // `every = 1`: the replica steps with the round's mean move, as the real one
                // steps with the mean gradient.
                let p = &mut self.peers[i];
                if let Some(mean) = p.trainer.rules.take_mean_gradient(step) {
                    mix::add(&mut p.replica, &mean);
                    self.count_step(i);
                }
                self.input(
                    i,
                    Input::RoundEnded {
                        round,
                        result: Ok(()),
                    },
                );
                self.announce_if_moved(i);
                self.due_ended(i);
            }
            Err(error) => {
                self.peers[i].stats.aborted_rounds += 1;
                self.input(
                    i,
                    Input::RoundEnded {
                        round,
                        result: Err(error),
                    },
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    enum Due {
        Event(RingEvent),
        Hello(usize, Hello),
    }

    type Ended = Vec<(usize, Result<Vec<f32>, RingError>)>;

    /// Carries the model's outputs in time order until none is left (hellos to their member,
    /// events back to the model); returns every attempt's end, in order.
    fn settle(model: &mut RingModel, outputs: Vec<Output>) -> Ended {
        let mut queue = std::collections::BTreeMap::new();
        let mut ended = Vec::new();
        let mut seq = 0u64;
        let mut carry = |queue: &mut std::collections::BTreeMap<_, _>, now, outputs| {
            for output in outputs {
                let (after, due) = match output {
                    Output::Schedule { after, event } => (after, Due::Event(event)),
                    Output::Send {
                        to, after, hello, ..
                    } => (after, Due::Hello(to, hello)),
                    Output::Ended { peer, result, .. } => {
                        ended.push((peer, result));
                        continue;
                    }
                };
                seq += 1;
                queue.insert((now + after, seq), due);
            }
        };
        carry(&mut queue, Duration::ZERO, outputs);
        while let Some(((now, _), due)) = queue.pop_first() {
            let outputs = match due {
                // Left out: every round here ends well before its attempt's timeout.
                Due::Event(RingEvent::Timeout { .. }) => continue,
                Due::Event(event) => model.handle(event),
                Due::Hello(to, hello) => model.hello(to, hello),
            };
            carry(&mut queue, now, outputs);
        }
        ended
    }

    /// `size` simulated members of one ring (their ids in the model's order), with buffers of
    /// `len` values cut into sub-chunks of `sub_chunk`.
    fn ring(size: usize, sub_chunk: usize) -> (RingModel, Vec<PeerId>, RingMembers, Vec<usize>) {
        let ids: Vec<PeerId> = (0..size).map(|_| PeerId::random()).collect();
        let members = RingMembers::new("sim", ids.clone());
        let order = (members.peers().iter())
            .map(|id| ids.iter().position(|p| p == id).unwrap())
            .collect();
        let trust = TrustList::new(ids.iter().copied());
        let (latency, timeout) = (Duration::from_millis(1), Duration::from_secs(5));
        let model = RingModel::new("sim", trust, size, latency, timeout, sub_chunk);
        (model, ids, members, order)
    }

    /// Every member starts `round` with its `values`.
    fn start_round(
        (model, ids, members, order): &mut (RingModel, Vec<PeerId>, RingMembers, Vec<usize>),
        round: u64,
        values: impl Fn(usize) -> Vec<f32>,
    ) -> Vec<Output> {
        let mut outputs = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let attempt = Numbered::first(round);
            outputs.extend(model.start((i, *id), attempt, members, order, values(i)));
        }
        outputs
    }

    /// Three members with buffers of 7 values in sub-chunks of 2: their reducers' frames go
    /// round hop by hop, and every member ends with the mean, the same bits everywhere (every
    /// sum is formed in one order, the ring's); the next round runs on the links they kept.
    #[test]
    fn a_round_carries_the_reducers_frames_and_ends_with_one_mean() {
        let mut ring = ring(3, 2);
        let values = |i: usize| -> Vec<f32> { (0..7).map(|k| 0.1 * (i * 7 + k) as f32).collect() };
        let outputs = start_round(&mut ring, 4, values);
        let ended = settle(&mut ring.0, outputs);
        let means: Vec<Vec<f32>> = (ended.into_iter())
            .map(|(_, result)| result.expect("the round completes"))
            .collect();
        assert_eq!(means.len(), 3);
        assert!(means.windows(2).all(|w| w[0] == w[1]), "{means:?}");
        for (k, mean) in means[0].iter().enumerate() {
            let expected = (0..3).map(|i| values(i)[k]).sum::<f32>() / 3.0;
            assert!(
                (mean - expected).abs() < 1e-6,
                "{k}: {mean} against {expected}"
            );
        }
        let outputs = start_round(&mut ring, 5, values);
        assert!(
            !outputs.iter().any(|o| matches!(o, Output::Send { .. })),
            "no hellos: the links were kept"
        );
        let ended = settle(&mut ring.0, outputs);
        assert_eq!(
            ended.iter().filter(|(_, r)| r.is_ok()).count(),
            3,
            "{ended:?}"
        );
    }

    /// Two members on the links they kept, one at round 2, the other at round 3: each reads
    /// the other's header and fails by the reducer's rule (the engine's), not one of the
    /// simulator's own.
    #[test]
    fn a_header_of_another_round_fails_the_reader() {
        let mut ring = ring(2, 1);
        let outputs = start_round(&mut ring, 1, |_| vec![1.0; 4]);
        assert_eq!(settle(&mut ring.0, outputs).len(), 2);
        let (model, ids, members, order) = &mut ring;
        let mut outputs = Vec::new();
        for (i, round) in [(0, 2), (1, 3)] {
            let attempt = Numbered::first(round);
            outputs.extend(model.start((i, ids[i]), attempt, members, order, vec![1.0; 4]));
        }
        let ended = settle(model, outputs);
        assert!(
            (ended.iter()).all(|(_, r)| matches!(r, Err(RingError::Mismatch { .. }))),
            "{ended:?}"
        );
        assert!(!ended.is_empty());
    }

    /// Two members that see different memberships at the same attempt: the right one fails
    /// its attempt at its left neighbour's hello, as the engine's does, rather than skip the
    /// hello and wait out the ring timeout.
    #[test]
    fn a_hello_of_another_membership_from_the_left_fails_the_attempt_at_once() {
        let ids: Vec<PeerId> = (0..3).map(|_| PeerId::random()).collect();
        let index = |id: &PeerId| ids.iter().position(|p| p == id).unwrap();
        let all = RingMembers::new("sim", ids.clone());
        let order: Vec<usize> = all.peers().iter().map(index).collect();
        // `left` sees all three; its right neighbour sees only the two of them.
        let left = all.peers()[0];
        let right = all.right_of(0);
        let pair = RingMembers::new("sim", vec![left, right]);
        let pair_order: Vec<usize> = pair.peers().iter().map(index).collect();

        let timeout = Duration::from_secs(5);
        let mut model = RingModel::new(
            "sim",
            TrustList::new(ids.iter().copied()),
            3,
            Duration::from_millis(1),
            timeout,
            1,
        );
        let attempt = Numbered::first(1);
        let (l, r) = (index(&left), index(&right));
        model.start((r, right), attempt, &pair, &pair_order, vec![0.0]);
        let hello = model
            .start((l, left), attempt, &all, &order, vec![1.0])
            .into_iter()
            .find_map(|output| match output {
                Output::Send { to, hello, .. } if to == r => Some(hello),
                _ => None,
            })
            .expect("the left member says hello to its right neighbour");
        let ended = model
            .hello(r, hello)
            .into_iter()
            .find_map(|output| match output {
                Output::Ended { peer, result, .. } if peer == r => Some(result),
                _ => None,
            });
        match ended {
            Some(Err(RingError::Setup(reason))) => {
                assert!(reason.contains("membership"), "{reason}")
            }
            other => panic!("the right member's attempt fails on the hello at once: {other:?}"),
        }
    }
}
