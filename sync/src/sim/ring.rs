//! The simulator's model of ring rounds: how attempts connect and how data flows, with the
//! timing of the real data plane.
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
//! - Data: an attempt with both links runs: it reads its left link (a closed one ends it at
//!   once) and writes its first chunk to the right, which succeeds even on a link the reader
//!   closed (it lands in the kernel's buffer). Data then flows member to member while each runs
//!   the same round (another round is a header mismatch); a member whose right link is closed
//!   finds out when it writes again. When data has gone round every member the round completes.
//! - Failure: an attempt that ends closes its links; a member reading one of them sees the end
//!   one message delay later. Attempts time out after the ring timeout.

use std::collections::VecDeque;
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::mix;
use murmur_protocol::ring::binding::{Acceptor, OnHello, Opener};
use murmur_protocol::ring::{Attempt as Numbered, Control, DataPlane, RingError, RingMembers};
use murmur_protocol::trust::TrustList;

use crate::policy::Input;
use crate::replica::ExchangeEnd;

use super::{Event, Msg, Sim};

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
    /// The data of `attempt`'s round has gone round the ring.
    Complete {
        attempt: usize,
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
    round: u64,
    /// How many members the ring has.
    size: usize,
    membership: u64,
    /// The right neighbour.
    right_id: PeerId,
    opener: Opener,
    acceptor: Acceptor,
    snapshot: Vec<f32>,
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
    /// The attempt that writes to it now.
    writer: Option<usize>,
    open: bool,
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
    ) -> Self {
        RingModel {
            run_id: run_id.to_owned(),
            trust,
            latency,
            ring_timeout,
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
            round,
            size,
            membership,
            right_id: members.right_of(rank),
            opener: Opener::new(&self.run_id, members, DataPlane::Libp2p, attempt),
            acceptor,
            snapshot,
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
                self.links[right].writer = Some(index);
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
                        writer: Some(opener),
                        open: true,
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
            RingEvent::ReadClosed { attempt } => {
                if self.running(attempt) {
                    self.fail(attempt, RingError::Closed, &mut out);
                }
            }
            RingEvent::Complete { attempt } => self.complete(attempt, &mut out),
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

    /// `attempt` has both links: it reads its left link and writes its first chunk; data then
    /// flows right as far as the members run.
    fn run(&mut self, attempt: usize, out: &mut Vec<Output>) {
        if !self.running(attempt) {
            return;
        }
        let left = self.attempts[attempt].left.unwrap_or(0);
        if !self.links[left].open {
            self.fail(attempt, RingError::Closed, out);
            return;
        }
        // Whoever writes to this attempt already may have data waiting: it flows from there.
        let start = self.writer_of(attempt).unwrap_or(attempt);
        self.flow(start, out);
    }

    /// The running attempt that writes into `attempt`'s left link, if any.
    fn writer_of(&self, attempt: usize) -> Option<usize> {
        let left = self.attempts[attempt].left?;
        let writer = self.links[left].writer?;
        (self.attempts[writer].right == Some(left) && self.running(writer)).then_some(writer)
    }

    /// Data leaves `from` and moves right while members run the same round.
    fn flow(&mut self, from: usize, out: &mut Vec<Output>) {
        let size = self.attempts[from].size;
        let round = self.attempts[from].round;
        let mut writer = from;
        for _ in 0..=size {
            let link = self.attempts[writer].right.unwrap_or(0);
            if !self.links[link].open {
                if self.attempts[writer].wrote {
                    self.fail(writer, RingError::Closed, out);
                    return;
                }
                // The first write lands in the buffer; the writer learns later.
                self.attempts[writer].wrote = true;
                return;
            }
            self.attempts[writer].wrote = true;
            let Some(reader) = self.reader(link) else {
                return;
            };
            if self.attempts[reader].round != round {
                self.fail(
                    reader,
                    RingError::Setup("round header mismatch".into()),
                    out,
                );
                return;
            }
            if reader == from {
                out.push(Output::Schedule {
                    after: Duration::from_millis(1),
                    event: RingEvent::Complete { attempt: from },
                });
                return;
            }
            writer = reader;
        }
    }

    fn complete(&mut self, attempt: usize, out: &mut Vec<Output>) {
        if !self.running(attempt) {
            return;
        }
        // The members of the cycle, found along the right links.
        let size = self.attempts[attempt].size;
        let mut cycle = vec![attempt];
        let mut at = attempt;
        loop {
            let Some(next) = self.attempts[at].right.and_then(|link| self.reader(link)) else {
                return;
            };
            if next == attempt {
                break;
            }
            if cycle.len() >= size {
                return;
            }
            cycle.push(next);
            at = next;
        }
        let snapshots: Vec<&[f32]> = cycle
            .iter()
            .map(|&a| self.attempts[a].snapshot.as_slice())
            .collect();
        let mean = mix::mean(&snapshots).unwrap_or_default();
        for a in cycle {
            let attempt = &mut self.attempts[a];
            attempt.alive = false;
            let (peer, round, membership) = (attempt.peer, attempt.round, attempt.membership);
            let (left, right) = (attempt.left.unwrap_or(0), attempt.right.unwrap_or(0));
            if self.current[peer] == Some(a) {
                self.current[peer] = None;
            }
            self.held[peer] = Some((membership, left, right));
            out.push(Output::Ended {
                peer,
                round,
                result: Ok(mean.clone()),
            });
        }
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
        let (peer, round, left, right) = (a.peer, a.round, a.left, a.right);
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
                } => self.send(from, to, after, Msg::Ring(Box::new(hello))),
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
