//! The exchanges, elastic requests and state syncs between simulated peers, message by message
//! as the real protocols go, started and answered as the peers' policies decide. Each side of an
//! exchange is a machine of the sync crate (a pairwise [`Initiator`] or [`Responder`], an
//! elastic [`Worker`], a state [`Requester`]); the simulator carries their frames over its
//! links and keeps, per side, its machine and the pair's copies it holds.

use std::sync::Arc;
use std::time::Duration;

use libp2p_identity::PeerId;
use murmur_protocol::codec::Codec;
use murmur_protocol::wire::MessageKind;

use crate::copies::{CROSSING_WAIT, Copies};
use crate::machines::elastic::{Worker, answer_worker};
use crate::machines::pairwise::{Initiator, Responder};
use crate::machines::state::{Requester, Taken, state_frames};
use crate::machines::{self, Fed, Frame, Head, Lent, Machine, Mixed, Protocol, carried, feed};
use crate::policy::{Adopted, Answer, Failure, Input, Outcome};
use crate::replica::{ExchangeId, ReplicaState, Snapshot};
use crate::screen::Screen;
use crate::sides::Side;

use super::{Event, PeerEvent, Sim};

/// An exchange between two simulated peers: the side that started it (`a`) and the side that
/// answers it (`b`), each with its protocol machine while its side is open.
#[derive(Debug)]
pub(super) struct Exchange {
    pub(super) a: usize,
    pub(super) b: usize,
    /// The stream protocol `a` opened.
    protocol: Protocol,
    /// `a`'s machine, until its answer arrives or its side ends otherwise.
    pub(super) opener: Option<Opener>,
    pub(super) answerer: Answerer,
}

/// The side that started an exchange: a machine of the sync crate.
#[derive(Debug)]
pub(super) enum Opener {
    /// A pairwise offer; a compressed one runs on the pair's copies, lent by `a`'s
    /// [`CopyBook`](crate::copies::CopyBook) (one exchange per pair at a time).
    Pairwise {
        machine: Initiator,
        copies: Option<Copies>,
    },
    /// An elastic worker's request to the center.
    Worker(Worker),
    /// A state sync.
    State(Requester),
}

impl Opener {
    /// The stream protocol this side opens.
    fn protocol(&self) -> Protocol {
        match self {
            Opener::Pairwise { .. } | Opener::Worker(_) => Protocol::Params,
            Opener::State(_) => Protocol::State,
        }
    }

    /// What this side is in its peer's book of sides.
    fn side(&self) -> Side {
        match self {
            Opener::Pairwise { .. } | Opener::Worker(_) => Side::Exchange,
            Opener::State(_) => Side::Pull,
        }
    }

    /// Feeds this side's machine what came in, lending it what it works on: the pair's
    /// copies, or (a state sync) the clocks `heard` from the live peers.
    fn feed(
        &mut self,
        frames: Vec<Frame>,
        ended: bool,
        heard: impl FnOnce() -> Vec<u64>,
    ) -> Fed<Verdict> {
        match self {
            Opener::Pairwise { machine, copies } => {
                let mut lent = Lent::copies(copies.as_mut());
                feed(machine, frames, ended, &mut lent).map(Verdict::Mixed)
            }
            Opener::Worker(machine) => {
                feed(machine, frames, ended, &mut Lent::default()).map(Verdict::Mixed)
            }
            Opener::State(machine) => {
                let heard = heard();
                feed(machine, frames, ended, &mut Lent::heard(&heard)).map(Verdict::Taken)
            }
        }
    }

    /// The frames that open the exchange, as the answering side reads them.
    fn start(&self) -> Vec<Frame> {
        let frames = match self {
            Opener::Pairwise { machine, .. } => machine.start(),
            Opener::Worker(machine) => machine.start(),
            Opener::State(machine) => machine.start(),
        };
        frames.into_iter().map(carried).collect()
    }
}

/// What the side that started an exchange came to.
#[derive(Debug)]
enum Verdict {
    Mixed(Mixed),
    Taken(Taken),
}

/// Where the answering side stands.
#[derive(Debug)]
pub(super) enum Answerer {
    /// The request is on its way.
    NotAsked,
    /// The request as `b` read it (an offer, a worker's parameters, a state request), while
    /// its policy decides or its answer waits for the pair's copies.
    Asked(Frame),
    /// A pairwise exchange `b` answered, until the initiator's parameters and verdict are in:
    /// its machine, the pair's copies it holds (compressed), and its replica's exchange.
    Answering {
        machine: Responder,
        copies: Option<Copies>,
        id: ExchangeId,
    },
    /// Answered (a center's delta, a state, `Busy`), or ended.
    Done,
}

impl Exchange {
    /// Neither side open: an answer waiting for the pair's copies keeps it open.
    fn is_closed(&self) -> bool {
        self.opener.is_none() && matches!(self.answerer, Answerer::NotAsked | Answerer::Done)
    }
}

impl Answerer {
    fn is_answering(&self) -> bool {
        matches!(self, Answerer::Answering { .. })
    }

    /// The answering side's responder, copies and replica exchange, taken out (the side is
    /// then done); `None` when it is not answering.
    pub(super) fn take_answering(&mut self) -> Option<(Responder, Option<Copies>, ExchangeId)> {
        match std::mem::replace(self, Answerer::Done) {
            Answerer::Answering {
                machine,
                copies,
                id,
            } => Some((machine, copies, id)),
            other => {
                *self = other;
                None
            }
        }
    }
}

impl Sim {
    /// `a`'s snapshot to exchange: the one its trainer handed over, or its replica now.
    fn snapshot_of(&self, a: usize) -> Arc<Snapshot> {
        let peer = &self.peers[a];
        let (step, params) = match &peer.trainer.due {
            Some(due) => (due.step, due.params.clone()),
            None => (peer.step, peer.replica.clone()),
        };
        Arc::new(Snapshot { step, params })
    }

    /// `a` offers its snapshot to `peer` through `codec`. A compressed offer runs on the
    /// pair's copies, which an exchange of the pair may hold (`peer`'s offer, which `a`
    /// answers): as in the daemon, the offer then ends `Busy` before anything is sent.
    pub(super) fn offer(
        &mut self,
        a: usize,
        peer: PeerId,
        codec: Codec,
        weight: f32,
        screen: Screen,
    ) {
        let Some(&b) = self.index.get(&peer) else {
            return;
        };
        let snapshot = self.snapshot_of(a);
        let (step, len) = (snapshot.step, snapshot.params.len());
        let copies = match codec {
            Codec::F32 => None,
            _ => self.peers[a].copies.lend(peer, len),
        };
        let lent = codec == Codec::F32 || copies.is_some();
        let machine = Initiator::new(
            &self.config.sync,
            snapshot,
            codec,
            weight,
            screen,
            copies.as_ref(),
        );
        let opener = Opener::Pairwise { machine, copies };
        if lent {
            let (latency, _) = self.net.between(a, b);
            return self.open(a, b, opener, latency);
        }
        let xid = self.insert(a, b, opener);
        let busy = Event::Stream {
            from: b,
            to: a,
            xid,
            frames: busy_frame(step),
            ended: true,
        };
        self.schedule(Duration::ZERO, busy);
        self.schedule(self.config.timeouts.exchange, Event::ExchangeTimeout(xid));
    }

    /// `a` sends its snapshot to the elastic center `peer`.
    pub(super) fn ask_center(&mut self, a: usize, peer: PeerId, screen: Screen) {
        let Some(&b) = self.index.get(&peer) else {
            return;
        };
        let worker = Worker::new(&self.config.sync, self.snapshot_of(a), screen);
        let (latency, transfer) = self.net.between(a, b);
        self.open(a, b, Opener::Worker(worker), latency + transfer);
    }

    /// `a` asks `peer`, chosen for the clock it `announced`, for its state.
    pub(super) fn pull_state(&mut self, a: usize, peer: PeerId, announced: u64) {
        let Some(&b) = self.index.get(&peer) else {
            return;
        };
        let p = &self.peers[a];
        let max_staleness = self.config.sync.max_staleness;
        let machine = Requester::new(
            p.step,
            announced,
            max_staleness,
            Vec::new(),
            p.replica.len(),
        );
        let (latency, _) = self.net.between(a, b);
        self.open(a, b, Opener::State(machine), latency);
    }

    /// A new exchange from `a` to `b`: its id.
    fn insert(&mut self, a: usize, b: usize, opener: Opener) -> u64 {
        let xid = self.next_xid;
        self.next_xid += 1;
        let peer = self.peers[b].id;
        self.peers[a].sides.open(xid, peer, opener.side());
        let exchange = Exchange {
            a,
            b,
            protocol: opener.protocol(),
            opener: Some(opener),
            answerer: Answerer::NotAsked,
        };
        self.exchanges.insert(xid, exchange);
        xid
    }

    /// A new exchange from `a` to `b`, its opening frames sent `after` and its timeout set.
    fn open(&mut self, a: usize, b: usize, opener: Opener, after: Duration) {
        let frames = opener.start();
        let xid = self.insert(a, b, opener);
        self.send_frames((a, b), after, xid, frames, false);
        self.schedule(self.config.timeouts.exchange, Event::ExchangeTimeout(xid));
    }

    /// Answers the request `i`'s policy decided on. As in the daemon, the policy hears how
    /// every answer ended; an offer's, once its exchange ends, as its pairwise slot's.
    pub(super) fn serve(&mut self, i: usize, peer: PeerId, answer: Answer) {
        let Some((from, xid)) = self.peers[i].request.take() else {
            return;
        };
        if self.peers[from].id != peer {
            self.peers[i].sides.close(xid);
            return;
        }
        let (latency, transfer) = self.net.between(i, from);
        let step = self.peers[i].step;
        let pairwise = matches!(answer, Answer::Exchange { .. });
        self.peers[i]
            .sides
            .open(xid, peer, Side::Serve { pairwise });
        if let Answer::Exchange { weight, screen } = answer {
            let until = self.now + CROSSING_WAIT;
            return self.answer_offer(i, from, xid, weight, screen, until);
        }
        let asked = (self.exchanges.get_mut(&xid))
            .map(|x| std::mem::replace(&mut x.answerer, Answerer::Done));
        let (frames, outcome, after) = match (answer, asked) {
            (Answer::Center { alpha, screen }, Some(Answerer::Asked((head, worker)))) => {
                let worker = (head.step, worker);
                let p = &mut self.peers[i];
                let answered = match p.center.as_mut() {
                    Some(center) => {
                        answer_worker(&self.config.sync, center, step, worker, alpha, screen)
                    }
                    None => Err(Outcome::Busy),
                };
                match answered {
                    Ok(answered) => {
                        p.stats.served += 1;
                        let frames = vec![carried(answered.frame(step))];
                        (frames, answered.outcome, latency + transfer)
                    }
                    Err(outcome) => (busy_frame(step), outcome, latency),
                }
            }
            (Answer::State, Some(Answerer::Asked(_))) => {
                let p = &self.peers[i];
                let (params, outer) = p.trainer.rules.state_of(p.replica.clone());
                let replica = ReplicaState {
                    step: p.step,
                    params,
                    optimizer: None,
                };
                let frames = state_frames(&replica, outer.as_ref(), p.center.as_deref())
                    .into_iter()
                    .map(carried)
                    .collect();
                (frames, Outcome::StateSent, latency + transfer)
            }
            _ => (busy_frame(step), Outcome::Busy, latency),
        };
        self.send_frames((i, from), after, xid, frames, true);
        self.side_ended(i, xid, outcome);
    }

    /// `i`'s side of exchange `xid` ended with `outcome`: its policy hears of it, as the
    /// sides' rule has it.
    fn side_ended(&mut self, i: usize, xid: u64, outcome: Outcome) {
        if let Some(input) = self.peers[i].sides.ended(xid, outcome) {
            self.input(i, input);
        }
    }

    /// Answers the offer `xid` from `from` with `i`'s parameters, to be mixed with `weight`
    /// as `screen` passes the initiator's. A compressed exchange answers with a difference
    /// against the pair's copies, which an exchange of the pair may hold (our own offer to
    /// `from`, crossing this one): as the real engine, it waits for them until `until`, then
    /// answers `Busy`.
    pub(super) fn answer_offer(
        &mut self,
        i: usize,
        from: usize,
        xid: u64,
        weight: f32,
        screen: Screen,
        until: Duration,
    ) {
        let (latency, transfer) = self.net.between(i, from);
        let step = self.peers[i].step;
        let partner = self.peers[from].id;
        // As the real trainer: answering a partner on a slow link does not pause.
        let slow_partner = self.peers[i].table.is_slow(&partner);
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let Answerer::Asked((offer, _)) = &x.answerer else {
            return;
        };
        let codec = Responder::codec(&self.config.sync, offer);
        let p = &mut self.peers[i];
        let len = p.replica.len();
        let mut copies = codec.and_then(|_| p.copies.lend(partner, len));
        if codec.is_some() && copies.is_none() {
            if self.now < until {
                let retry = PeerEvent::AnswerOffer {
                    from,
                    xid,
                    weight,
                    screen: Box::new(screen),
                    until,
                };
                self.schedule_for(i, latency, retry);
                return;
            }
            self.send_frames((i, from), latency, xid, busy_frame(step), true);
            return self.side_ended(i, xid, Outcome::Busy);
        }
        let snapshot = Arc::new(Snapshot {
            step,
            params: p.replica.clone(),
        });
        let machine = Responder::new(
            &self.config.sync,
            offer,
            snapshot,
            weight,
            screen,
            copies.as_mut(),
        );
        let frames = machine.start().into_iter().map(carried).collect();
        let id = p
            .trainer
            .rules
            .answered(step, &machine.snapshot().params, slow_partner);
        x.answerer = Answerer::Answering {
            machine,
            copies,
            id,
        };
        let share = codec.map_or(1.0, bytes_share);
        let after = latency + transfer.mul_f64(share);
        self.send_frames((i, from), after, xid, frames, false);
    }

    /// Gives up `i`'s exchanges with `peer`, which left.
    pub(super) fn cancel(&mut self, i: usize, peer: PeerId) {
        for xid in self.peers[i].sides.with(&peer) {
            self.end_side(xid, i, Outcome::Failed(Failure::PeerLeft));
        }
    }

    /// Ends `i`'s side of exchange `xid`, if open, with `outcome`, as a failure would.
    pub(super) fn end_side(&mut self, xid: u64, i: usize, outcome: Outcome) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        if i == x.a {
            if let Some(opener) = x.opener.take() {
                self.opener_failed(xid, opener, outcome);
            }
            return;
        }
        match std::mem::replace(&mut x.answerer, Answerer::Done) {
            Answerer::Answering { copies, id, .. } => self.answerer_ended(xid, copies, id, outcome),
            // An answer that waits for the pair's copies is given up.
            Answerer::Asked(_) => {
                self.side_ended(i, xid, outcome);
                self.forget_if_closed(xid);
            }
            other => x.answerer = other,
        }
    }

    /// The side that started exchange `xid` failed with `outcome`, its `opener` taken out:
    /// the pair's copies it held go back, and its policy learns why.
    fn opener_failed(&mut self, xid: u64, opener: Opener, outcome: Outcome) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (a, b) = (x.a, x.b);
        if let Opener::Pairwise { copies, .. } = opener {
            self.give_back(a, b, copies);
        }
        self.side_ended(a, xid, outcome);
        self.forget_if_closed(xid);
    }

    /// The side that answered exchange `xid` ended with `outcome` (what it mixed landed
    /// already): the pair's `copies` go back, its replica's exchange `id` ends, and its policy
    /// learns the outcome.
    fn answerer_ended(
        &mut self,
        xid: u64,
        copies: Option<Copies>,
        id: ExchangeId,
        outcome: Outcome,
    ) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (a, b) = (x.a, x.b);
        self.give_back(b, a, copies);
        self.serve_ended(b, Some(id));
        self.side_ended(b, xid, outcome);
        self.forget_if_closed(xid);
    }

    /// `i` is done with the copies of its pair with `partner`: another exchange of the pair
    /// may take them.
    fn give_back(&mut self, i: usize, partner: usize, copies: Option<Copies>) {
        if let Some(copies) = copies {
            let partner = self.peers[partner].id;
            self.peers[i].copies.give_back(partner, copies);
        }
    }

    fn forget_if_closed(&mut self, xid: u64) {
        if self.exchanges.get(&xid).is_some_and(Exchange::is_closed) {
            self.exchanges.remove(&xid);
        }
    }

    pub(super) fn exchange_timeout(&mut self, xid: u64) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (a, b) = (x.a, x.b);
        self.end_side(xid, a, Outcome::Failed(Failure::TimedOut));
        self.end_side(xid, b, Outcome::Failed(Failure::TimedOut));
        // An exchange whose responder never answered is forgotten too.
        self.exchanges.remove(&xid);
    }

    // ---- messages ----

    /// Frames of exchange `xid` from `from` reach `to`, and the end of `from`'s side of the
    /// stream where it `ended`: the answer (the side that started it reads it), the request (an
    /// offer, a worker's parameters, a state request: the answering side's policy decides), or
    /// a pairwise initiator's parameters and verdict (the responder reads them).
    pub(super) fn on_stream(
        &mut self,
        xid: u64,
        from: usize,
        to: usize,
        frames: Vec<Frame>,
        ended: bool,
    ) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        if to == x.a {
            self.on_answer(xid, frames, ended);
        } else if x.answerer.is_answering() {
            self.on_final(xid, frames, ended);
        } else if matches!(x.answerer, Answerer::NotAsked)
            && let Some(first) = frames.into_iter().next()
        {
            let protocol = x.protocol;
            self.on_request(xid, protocol, from, to, first);
        }
    }

    /// `to` reads the request that opens exchange `xid` from `from`, as the daemon reads one:
    /// the clock it shows, then what it asks ([`machines::request`]), which `to`'s policy
    /// answers. A request that is not one is an offence, and its stream is dropped.
    fn on_request(&mut self, xid: u64, protocol: Protocol, from: usize, to: usize, first: Frame) {
        let peer = self.peers[from].id;
        let (latency, _) = self.net.between(to, from);
        let drop_stream =
            |sim: &mut Sim| sim.send_frames((to, from), latency, xid, Vec::new(), true);
        if !self.peers[to].sides.admits(&peer) {
            return drop_stream(self);
        }
        self.peers[to].sides.open(xid, peer, Side::Request);
        self.saw_step(to, peer, first.0.step);
        let (head, values) = &first;
        let request = match machines::request(protocol, head, values, self.config.dim) {
            Ok(request) => request,
            Err(outcome) => {
                drop_stream(self);
                return self.side_ended(to, xid, outcome);
            }
        };
        if let Some(x) = self.exchanges.get_mut(&xid) {
            x.answerer = Answerer::Asked(first);
        }
        self.peers[to].request = Some((from, xid));
        self.input(to, Input::Request { peer, request });
        // A request the policy did not answer (it never fails to) drops the stream.
        if self.peers[to].request.take().is_some() {
            self.peers[to].sides.close(xid);
        }
    }

    /// `i` saw `peer`'s clock at `step` in a frame: its table takes it if it moved, and its
    /// policy and trainer hear of the change next, as the daemon's hear of a table change.
    fn saw_step(&mut self, i: usize, peer: PeerId, step: u64) {
        if self.peers[i].table.members_mut().saw_step(&peer, step) {
            self.schedule_for(i, Duration::ZERO, PeerEvent::TableChanged);
        }
    }

    /// The answer reaches the side that started exchange `xid`: its machine reads it, and the
    /// side ends with a mix, a state taken over, or the reason it failed.
    fn on_answer(&mut self, xid: u64, frames: Vec<Frame>, ended: bool) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (a, b) = (x.a, x.b);
        let Some(mut opener) = x.opener.take() else {
            // The side gave up: its stream ends.
            let (latency, _) = self.net.between(a, b);
            return self.send_frames((a, b), latency, xid, Vec::new(), true);
        };
        let fed = opener.feed(frames, ended, || self.peers[a].table.clocks());
        match self.pump(xid, a, fed) {
            None => self.reopen(xid, opener),
            Some(Ok(verdict)) => {
                if let Opener::Pairwise { copies, .. } = opener {
                    self.give_back(a, b, copies);
                }
                match verdict {
                    Verdict::Mixed(mixed) => self.initiator_mixed(xid, mixed),
                    Verdict::Taken(taken) => self.state_taken(xid, taken),
                }
            }
            Some(Err(outcome)) => self.opener_failed(xid, opener, outcome),
        }
    }

    /// The side that started exchange `xid` reads on.
    fn reopen(&mut self, xid: u64, opener: Opener) {
        if let Some(x) = self.exchanges.get_mut(&xid) {
            x.opener = Some(opener);
        }
    }

    /// Sends what `i`'s machine, its side of exchange `xid`, wrote while it was `fed`, one
    /// latency later (it writes while it reads, decision 0027), and notes the clock it saw.
    /// Once it is done its side of the stream ends, which the other side hears while it still
    /// reads. Returns what the machine came to.
    fn pump<T>(&mut self, xid: u64, i: usize, fed: Fed<T>) -> Option<Result<T, Outcome>> {
        let Some(x) = self.exchanges.get(&xid) else {
            return fed.end;
        };
        let (other, reading) = if i == x.a {
            (x.b, x.answerer.is_answering())
        } else {
            (x.a, x.opener.is_some())
        };
        if let Some(step) = fed.saw_step {
            self.saw_step(i, self.peers[other].id, step);
        }
        let (frames, ended) = (fed.sent, fed.end.is_some());
        if !frames.is_empty() || (ended && reading) {
            let (latency, _) = self.net.between(i, other);
            self.send_frames((i, other), latency, xid, frames, ended);
        }
        fed.end
    }

    /// The responder reads the initiator's parameters and verdict, judges them, and mixes.
    fn on_final(&mut self, xid: u64, frames: Vec<Frame>, ended: bool) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let b = x.b;
        let Some((mut machine, mut copies, id)) = x.answerer.take_answering() else {
            return;
        };
        let mut lent = Lent::copies(copies.as_mut());
        let fed = feed(&mut machine, frames, ended, &mut lent);
        let outcome = match self.pump(xid, b, fed) {
            None => {
                if let Some(x) = self.exchanges.get_mut(&xid) {
                    x.answerer = Answerer::Answering {
                        machine,
                        copies,
                        id,
                    };
                }
                return;
            }
            Some(Ok(mixed)) => {
                let stats = &mut self.peers[b].stats;
                stats.served += 1;
                stats.sparse += u64::from(mixed.sparse);
                self.land(b, id, Some(mixed.end));
                mixed.outcome
            }
            Some(Err(outcome)) => outcome,
        };
        self.answerer_ended(xid, copies, id, outcome);
    }

    /// The side that started exchange `xid` completed it (its machine is done): the mix
    /// lands on its replica, and its policy learns the outcome.
    fn initiator_mixed(&mut self, xid: u64, mixed: Mixed) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let a = x.a;
        let stats = &mut self.peers[a].stats;
        stats.exchanges += 1;
        stats.sparse += u64::from(mixed.sparse);
        self.due_mixed(a, mixed.end);
        self.forget_if_closed(xid);
        self.side_ended(a, xid, mixed.outcome);
        self.due_ended(a);
    }

    /// The requester of exchange `xid` took over the source's state.
    fn state_taken(&mut self, xid: u64, taken: Taken) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (j, source) = (x.a, x.b);
        self.peers[j].sides.close(xid);
        self.forget_if_closed(xid);
        let Taken {
            replica,
            outer,
            center,
        } = taken;
        let step = replica.step;
        let p = &mut self.peers[j];
        let from = std::mem::replace(&mut p.step, step);
        p.trainer.rules.adopted(step, &replica.params, outer);
        p.replica = replica.params;
        if center.is_some() {
            p.inherited_center = center;
        }
        p.stats.state_syncs += 1;
        let peer = self.peers[source].id;
        self.input(
            j,
            Input::StateSynced {
                peer,
                result: Ok(Adopted { from, step }),
            },
        );
        self.try_step(j);
    }
}

/// The share of a dense replica's transfer time that one through `codec` takes: its bytes per
/// value against `f32`'s four, for a model of a million values.
fn bytes_share(codec: Codec) -> f64 {
    const VALUES: usize = 1 << 20;
    let bytes = codec.encoded_len(VALUES).unwrap_or(4 * VALUES);
    bytes as f64 / (4 * VALUES) as f64
}

/// `Busy`, alone: not now, or declined.
fn busy_frame(step: u64) -> Vec<Frame> {
    vec![(Head::new(MessageKind::Busy, step), Vec::new())]
}
