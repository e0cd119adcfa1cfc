//! The policy's actions carried out, and the messages of exchanges, elastic requests and state
//! syncs between simulated peers, message by message as the real protocols go. A pairwise
//! exchange is the sync crate's two machines ([`Initiator`], [`Responder`]): the simulator
//! carries their frames over its links and keeps only who holds the pair's copies.

use std::sync::Arc;

use murmur_protocol::codec::Codec;
use murmur_protocol::membership::ConnectionKind;
use murmur_protocol::wire::MessageKind;

use crate::copies::{CROSSING_WAIT, Copies};
use crate::machines::elastic::{Worker, answer_worker};
use crate::machines::pairwise::{Initiator, Responder};
use crate::machines::state::{Requester, Taken, run_clock, state_frames};
use crate::machines::{Head, Mixed, Payload};
use crate::replica::ReplicaState;

use super::*;

/// The side of an exchange that started it (`a`) and that answers it (`b`).
#[derive(Debug)]
pub(super) struct Exchange {
    pub(super) kind: ExchangeKind,
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) a_open: bool,
    pub(super) b_open: bool,
    /// The responder's replica's exchange, once it answered.
    pub(super) b_id: Option<ExchangeId>,
    /// The request (an offer, a worker's parameters) as the responder read it, until it
    /// answers.
    pub(super) request: Option<Frame>,
    /// An elastic request: the worker's machine.
    pub(super) worker: Option<Worker>,
    /// A state sync: the requester's machine.
    pub(super) requester: Option<Requester>,
    /// A pairwise exchange: the two sides' machines.
    pub(super) initiator: Option<Initiator>,
    pub(super) responder: Option<Responder>,
    /// Compressed: the pair's copies each side holds, lent by its
    /// [`CopyBook`](crate::copies::CopyBook) (one exchange per pair at a time).
    pub(super) a_copies: Option<Copies>,
    pub(super) b_copies: Option<Copies>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExchangeKind {
    /// Through this codec.
    Pairwise(Codec),
    Elastic,
    /// Of a source chosen for the clock it announced.
    State {
        announced: u64,
    },
}

impl Sim {
    pub(super) fn execute(&mut self, i: usize, action: Action) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, ?action, "action");
        match action {
            Action::Offer {
                peer,
                codec,
                weight,
                screen,
            } => self.start_exchange(i, peer, ExchangeKind::Pairwise(codec), weight, screen),
            Action::AskCenter { peer, screen } => {
                self.start_exchange(i, peer, ExchangeKind::Elastic, 1.0, screen);
            }
            Action::StepOwnCenter { alpha } => {
                let peer = &mut self.peers[i];
                if let (Some(center), Some(due)) = (peer.center.as_mut(), peer.trainer.due.as_ref())
                {
                    let delta = mix::elastic_step(center, &due.params, alpha);
                    peer.stats.exchanges += 1;
                    self.due_mixed(i, ExchangeEnd::Subtract(delta));
                }
                self.due_ended(i);
            }
            Action::Release => self.due_ended(i),
            Action::Serve { peer, answer } => self.serve(i, peer, answer),
            Action::PullState { peer, announced } => {
                let kind = ExchangeKind::State { announced };
                self.start_exchange(i, peer, kind, 0.0, Screen::default());
            }
            Action::Round {
                round,
                members,
                attempt,
            } => {
                let snapshot = self.peers[i]
                    .trainer
                    .due
                    .as_ref()
                    .map(|due| due.params.clone())
                    .unwrap_or_default();
                let index = &self.index;
                let order: Vec<usize> = members
                    .peers()
                    .iter()
                    .filter_map(|p| index.get(p).copied())
                    .collect();
                let me = (i, self.peers[i].id);
                let attempt = Attempt {
                    round,
                    number: attempt,
                };
                let events = self.ring.start(me, attempt, &members, &order, snapshot);
                self.ring_events(events);
            }
            Action::Cancel { peer } => self.cancel(i, peer),
            Action::Offence { peer, .. } => {
                let now = self.instant();
                let p = &mut self.peers[i];
                if p.scores.offence(&peer, now) == Verdict::Block {
                    p.table.block(peer);
                    if let Some(&j) = self.index.get(&peer) {
                        p.stats.blocked.push(j);
                    }
                }
            }
            Action::Publish(_) => {}
            Action::SeedCenter => {
                let p = &mut self.peers[i];
                p.center = Some(
                    p.inherited_center
                        .take()
                        .unwrap_or_else(|| p.replica.clone()),
                );
                self.input(i, Input::CenterSeeded { ok: true });
            }
            Action::DropCenter => self.peers[i].center = None,
            Action::SlowLinks(peers) => {
                self.peers[i].table.set_slow(peers);
            }
        }
    }

    pub(super) fn start_exchange(
        &mut self,
        a: usize,
        peer: PeerId,
        kind: ExchangeKind,
        weight: f32,
        screen: Screen,
    ) {
        let Some(&b) = self.index.get(&peer) else {
            return;
        };
        let (a_step, a_snapshot) = match kind {
            ExchangeKind::State { .. } => (self.peers[a].step, Vec::new()),
            _ => match &self.peers[a].trainer.due {
                Some(due) => (due.step, due.params.clone()),
                None => (self.peers[a].step, self.peers[a].replica.clone()),
            },
        };
        let xid = self.next_xid;
        self.next_xid += 1;
        let mut exchange = Exchange {
            kind,
            a,
            b,
            a_open: true,
            b_open: false,
            b_id: None,
            request: None,
            worker: None,
            requester: None,
            initiator: None,
            responder: None,
            a_copies: None,
            b_copies: None,
        };
        let (latency, transfer) = self.net.between(a, b);
        let (msg, after) = match kind {
            ExchangeKind::Pairwise(codec) => {
                let len = a_snapshot.len();
                let snapshot = Arc::new(Snapshot {
                    step: a_step,
                    params: a_snapshot,
                });
                if codec != Codec::F32 {
                    exchange.a_copies = self.peers[a].copies.lend(peer, len);
                    if exchange.a_copies.is_none() {
                        // An exchange with this partner (it asked us) holds the copies: as the
                        // real engine, the offer ends `Busy` before anything is sent.
                        self.exchanges.insert(xid, exchange);
                        let busy = busy_frame(a_step);
                        let msg = Msg::Stream { xid, frames: busy };
                        let deliver = Event::Deliver {
                            from: b,
                            to: a,
                            msg,
                        };
                        self.schedule(Duration::ZERO, deliver);
                        return;
                    }
                }
                let copies = exchange.a_copies.as_ref();
                let initiator = Initiator::new(&self.sync, snapshot, codec, weight, screen, copies);
                let offer = (initiator.offer(), Vec::new());
                exchange.initiator = Some(initiator);
                let msg = Msg::Stream {
                    xid,
                    frames: vec![offer],
                };
                (msg, latency)
            }
            ExchangeKind::Elastic => {
                let snapshot = Arc::new(Snapshot {
                    step: a_step,
                    params: a_snapshot,
                });
                let worker = Worker::new(&self.sync, snapshot, screen);
                let frames = vec![carried(worker.request())];
                exchange.worker = Some(worker);
                (Msg::Stream { xid, frames }, latency + transfer)
            }
            ExchangeKind::State { .. } => {
                let count = self.peers[a].replica.len();
                let requester = Requester::new(a_step, self.sync.max_staleness, Vec::new(), count);
                let frames = vec![(requester.request(), Vec::new())];
                exchange.requester = Some(requester);
                (Msg::Stream { xid, frames }, latency)
            }
        };
        self.exchanges.insert(xid, exchange);
        self.send(a, b, after, msg);
        self.schedule(self.config.timeouts.exchange, Event::ExchangeTimeout(xid));
    }

    /// Answers the request `i`'s policy decided on.
    pub(super) fn serve(&mut self, i: usize, peer: PeerId, answer: Answer) {
        let Some((from, xid)) = self.peers[i].request.take() else {
            return;
        };
        if self.peers[from].id != peer {
            return;
        }
        let (latency, transfer) = self.net.between(i, from);
        let step = self.peers[i].step;
        match answer {
            Answer::Busy => {
                let msg = Msg::Stream {
                    xid,
                    frames: busy_frame(step),
                };
                self.send(i, from, latency, msg);
            }
            Answer::Exchange { weight, screen } => {
                let until = self.now + CROSSING_WAIT;
                self.answer_offer(i, from, xid, weight, screen, until);
            }
            Answer::Center { alpha, screen } => {
                let request = self.exchanges.get_mut(&xid).and_then(|x| x.request.take());
                let Some((head, worker)) = request else {
                    return;
                };
                let peer = &mut self.peers[i];
                let answered = match peer.center.as_mut() {
                    Some(center) => {
                        let worker = (head.step, worker);
                        answer_worker(&self.sync, center, step, worker, alpha, screen)
                    }
                    None => Err(Outcome::Busy),
                };
                let partner = self.peers[from].id;
                match answered {
                    Ok(answered) => {
                        self.peers[i].stats.served += 1;
                        let frames = vec![carried(answered.frame(step))];
                        self.send(i, from, latency + transfer, Msg::Stream { xid, frames });
                        let outcome = answered.outcome;
                        self.input(
                            i,
                            Input::Served {
                                peer: partner,
                                outcome,
                            },
                        );
                    }
                    Err(outcome) => {
                        let frames = busy_frame(step);
                        self.send(i, from, latency, Msg::Stream { xid, frames });
                        if matches!(outcome, Outcome::Outlier { .. }) {
                            self.input(
                                i,
                                Input::Served {
                                    peer: partner,
                                    outcome,
                                },
                            );
                        }
                    }
                }
            }
            Answer::State => {
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
                self.send(i, from, latency + transfer, Msg::Stream { xid, frames });
            }
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
        let Some((offer, _)) = x.request.as_ref() else {
            return;
        };
        let codec = Responder::codec(&self.sync, offer);
        let p = &mut self.peers[i];
        let len = p.replica.len();
        let copies = codec.and_then(|_| p.copies.lend(partner, len));
        if codec.is_some() && copies.is_none() {
            if self.now < until {
                let life = p.life;
                let retry = Event::AnswerOffer {
                    peer: i,
                    life,
                    from,
                    xid,
                    weight,
                    screen: Box::new(screen),
                    until,
                };
                self.schedule(latency, retry);
                return;
            }
            let busy = Msg::Stream {
                xid,
                frames: busy_frame(step),
            };
            self.send(i, from, latency, busy);
            let outcome = Outcome::Busy;
            self.input(
                i,
                Input::Served {
                    peer: partner,
                    outcome,
                },
            );
            return;
        }
        let snapshot = Arc::new(Snapshot {
            step,
            params: p.replica.clone(),
        });
        x.b_copies = copies;
        let copies = x.b_copies.as_mut();
        let responder = Responder::new(&self.sync, offer, snapshot, weight, screen, copies);
        let frame = carried(responder.answer());
        let id = p
            .trainer
            .rules
            .answered(step, &responder.snapshot().params, slow_partner);
        x.b_open = true;
        x.b_id = Some(id);
        x.responder = Some(responder);
        let share = codec.map_or(1.0, bytes_share);
        let msg = Msg::Stream {
            xid,
            frames: vec![frame],
        };
        self.send(i, from, latency + transfer.mul_f64(share), msg);
    }

    /// Gives up `i`'s exchanges with `peer`, which left.
    pub(super) fn cancel(&mut self, i: usize, peer: PeerId) {
        let Some(&j) = self.index.get(&peer) else {
            return;
        };
        let involved: Vec<u64> = self
            .exchanges
            .iter()
            .filter(|(_, x)| {
                (x.a == i && x.b == j && x.a_open) || (x.b == i && x.a == j && x.b_open)
            })
            .map(|(xid, _)| *xid)
            .collect();
        for xid in involved {
            self.end_side(xid, i, Outcome::Failed(Failure::PeerLeft));
        }
    }

    /// Ends `i`'s side of exchange `xid` with `outcome`, as a failure would.
    pub(super) fn end_side(&mut self, xid: u64, i: usize, outcome: Outcome) {
        self.return_copies(xid, i);
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (kind, a, b) = (x.kind, x.a, x.b);
        if a == i && x.a_open {
            x.a_open = false;
            let peer = self.peers[b].id;
            match kind {
                ExchangeKind::State { .. } => self.input(
                    i,
                    Input::StateSynced {
                        peer,
                        result: Err(outcome),
                    },
                ),
                _ => self.input(i, Input::Exchanged { peer, outcome }),
            }
        } else if b == i && x.b_open {
            x.b_open = false;
            let (peer, id) = (self.peers[a].id, x.b_id);
            self.serve_ended(i, id);
            self.input(i, Input::Served { peer, outcome });
        }
        self.forget_if_closed(xid);
    }

    /// Side `i` of exchange `xid` is done with the pair's copies: another exchange of the pair
    /// may take them.
    fn return_copies(&mut self, xid: u64, i: usize) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (held, partner) = if i == x.a {
            (x.a_copies.take(), x.b)
        } else {
            (x.b_copies.take(), x.a)
        };
        if let Some(copies) = held {
            let partner = self.peers[partner].id;
            self.peers[i].copies.give_back(partner, copies);
        }
    }

    pub(super) fn forget_if_closed(&mut self, xid: u64) {
        if self
            .exchanges
            .get(&xid)
            .is_some_and(|x| !x.a_open && !x.b_open)
        {
            self.exchanges.remove(&xid);
        }
    }

    pub(super) fn exchange_timeout(&mut self, xid: u64) {
        let Some(x) = self.exchanges.get(&xid) else {
            return;
        };
        let (a, b, a_open, b_open) = (x.a, x.b, x.a_open, x.b_open);
        if a_open {
            self.end_side(xid, a, Outcome::Failed(Failure::TimedOut));
        }
        if b_open {
            self.end_side(xid, b, Outcome::Failed(Failure::TimedOut));
        }
        // An exchange whose responder never answered is forgotten too.
        if let Some(x) = self.exchanges.get(&xid)
            && !x.a_open
        {
            self.exchanges.remove(&xid);
        }
    }

    // ---- messages ----

    /// Hands `to`'s policy a request from `from` in exchange `xid`; what it answers goes to
    /// that exchange.
    fn on_request(&mut self, from: usize, to: usize, xid: u64, request: Request) {
        let peer = self.peers[from].id;
        self.peers[to].request = Some((from, xid));
        self.input(to, Input::Request { peer, request });
        self.peers[to].request = None;
    }

    pub(super) fn deliver(&mut self, from: usize, to: usize, msg: Msg) {
        let peer = self.peers[from].id;
        match msg {
            Msg::Heartbeat(heartbeat) => {
                let now = self.instant();
                let p = &mut self.peers[to];
                if p.table.is_blocked(&peer) {
                    return;
                }
                p.table.members_mut().observe(peer, &heartbeat, now);
                p.table.set_connection(peer, Some(ConnectionKind::Direct));
                self.input(to, Input::PeersChanged);
                self.try_step(to);
            }
            Msg::Stream { xid, frames } => self.on_stream(xid, from, to, frames),
            Msg::Ring(hello) => {
                let events = self.ring.hello(to, *hello);
                self.ring_events(events);
            }
        }
    }

    /// Frames of exchange `xid` from `from` reach `to`: the request (an offer, a worker's
    /// parameters: the responder's policy decides), the answer (the initiator judges it) or a
    /// pairwise initiator's parameters and verdict (the responder judges them).
    fn on_stream(&mut self, xid: u64, from: usize, to: usize, frames: Vec<Frame>) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        if to == x.a && x.kind == ExchangeKind::Elastic {
            self.on_center_answer(xid, frames);
        } else if to == x.a && x.requester.is_some() {
            self.on_state_answer(xid, from, frames);
        } else if to == x.a {
            self.on_answer(xid, frames);
        } else if x.responder.is_some() {
            self.on_final(xid, frames);
        } else if let Some(request) = frames.into_iter().next() {
            let step = request.0.step;
            x.request = Some(request);
            let request = match x.kind {
                ExchangeKind::Elastic => Request::Params { step },
                ExchangeKind::State { .. } => Request::State,
                ExchangeKind::Pairwise(_) => Request::Offer { step },
            };
            self.on_request(from, to, xid, request);
        }
    }

    /// The initiator reads the partner's answer, sends its own parameters, judges theirs, and
    /// mixes or declines.
    fn on_answer(&mut self, xid: u64, frames: Vec<Frame>) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (a, b) = (x.a, x.b);
        let (latency, _) = self.net.between(a, b);
        let partner = self.peers[b].id;
        let initiator = x.initiator.as_mut().filter(|_| x.a_open);
        let (Some(initiator), Some((answer, received))) = (initiator, frames.into_iter().next())
        else {
            // The initiator gave up: its stream ends.
            let msg = Msg::Stream {
                xid,
                frames: Vec::new(),
            };
            self.send(a, b, latency, msg);
            return;
        };
        let step = initiator.snapshot().step;
        let ours = match initiator.on_answer(&answer, x.a_copies.as_mut()) {
            Ok(ours) => carried(ours),
            Err(outcome) => {
                if outcome != Outcome::Busy {
                    let msg = Msg::Stream {
                        xid,
                        frames: Vec::new(),
                    };
                    self.send(a, b, latency, msg);
                }
                self.end_side(xid, a, outcome);
                return;
            }
        };
        let judged = initiator.judge(received, x.a_copies.as_mut());
        // The initiator's parameters went out while the responder's came in (from the
        // answer's head on), so they and the verdict arrive one latency after these.
        let mut frames = vec![ours];
        let mixed = match judged {
            Ok(mixed) => mixed,
            Err(outcome) => {
                frames.extend(busy_frame(step));
                self.send(a, b, latency, Msg::Stream { xid, frames });
                self.end_side(xid, a, outcome);
                return;
            }
        };
        self.send(a, b, latency, Msg::Stream { xid, frames });
        self.return_copies(xid, a);
        self.initiator_mixed(xid, partner, mixed);
    }

    /// The responder reads the initiator's parameters and verdict, judges them, and mixes.
    fn on_final(&mut self, xid: u64, frames: Vec<Frame>) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (b, id) = (x.b, x.b_id);
        let Some(responder) = x.responder.as_mut().filter(|_| x.b_open) else {
            return;
        };
        let mut frames = frames.into_iter();
        let judged = match frames.next() {
            // The initiator gave up, or failed, before its parameters.
            None => Err(Outcome::Failed(Failure::Stream(
                "the stream ended before the initiator's parameters".into(),
            ))),
            Some((head, received)) => {
                let verdict = frames.next().map(|(head, _)| head);
                responder
                    .on_params(&head)
                    .and_then(|()| responder.on_verdict(verdict.as_ref()))
                    .and_then(|()| responder.judge(received, x.b_copies.as_mut()))
            }
        };
        let outcome = match (judged, id) {
            (Ok(mixed), Some(id)) => {
                let stats = &mut self.peers[b].stats;
                stats.served += 1;
                stats.sparse += u64::from(mixed.sparse);
                self.land(b, id, Some(mixed.end));
                mixed.outcome
            }
            (Ok(mixed), None) => mixed.outcome,
            (Err(outcome), _) => outcome,
        };
        self.end_side(xid, b, outcome);
    }

    /// The worker judges the center's answer, and subtracts its delta or gives up.
    fn on_center_answer(&mut self, xid: u64, frames: Vec<Frame>) {
        let Some(x) = self.exchanges.get_mut(&xid).filter(|x| x.a_open) else {
            return;
        };
        let (w, center) = (x.a, self.peers[x.b].id);
        let Some(worker) = x.worker.as_ref() else {
            return;
        };
        let judged = match frames.into_iter().next() {
            Some((head, delta)) => worker.judge(&head, delta),
            None => Err(Outcome::Failed(Failure::Stream(
                "the stream ended before the center's answer".into(),
            ))),
        };
        let mixed = match judged {
            Ok(mixed) => mixed,
            Err(outcome) => {
                self.end_side(xid, w, outcome);
                return;
            }
        };
        self.initiator_mixed(xid, center, mixed);
    }

    /// The side that started exchange `xid` with `partner` completed it: the mix lands on its
    /// replica, the side closes, and its policy learns the outcome.
    fn initiator_mixed(&mut self, xid: u64, partner: PeerId, mixed: Mixed) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        x.a_open = false;
        let a = x.a;
        let stats = &mut self.peers[a].stats;
        stats.exchanges += 1;
        stats.sparse += u64::from(mixed.sparse);
        self.due_mixed(a, mixed.end);
        self.forget_if_closed(xid);
        let outcome = mixed.outcome;
        self.input(
            a,
            Input::Exchanged {
                peer: partner,
                outcome,
            },
        );
        self.due_ended(a);
    }

    /// The requester takes over the source's state, frame by frame, or gives up.
    fn on_state_answer(&mut self, xid: u64, source: usize, frames: Vec<Frame>) {
        let Some(x) = self.exchanges.get_mut(&xid).filter(|x| x.a_open) else {
            return;
        };
        let (j, kind) = (x.a, x.kind);
        let Some(requester) = x.requester.take() else {
            return;
        };
        let ExchangeKind::State { announced } = kind else {
            return;
        };
        let heard = self.peers[j].table.peers().map(|(_, view)| view.step);
        let reference = run_clock(announced, heard);
        let taken = match take_state(requester, reference, frames) {
            Ok(taken) => taken,
            Err(outcome) => {
                self.end_side(xid, j, outcome);
                return;
            }
        };
        x.a_open = false;
        self.forget_if_closed(xid);
        let Taken {
            replica,
            outer,
            center,
        } = taken;
        let step = replica.step;
        let p = &mut self.peers[j];
        p.step = step;
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
                result: Ok(step),
            },
        );
        self.try_step(j);
    }
}

/// A state sync's frames fed to its requester, as the engine's stream feeds them.
fn take_state(
    mut requester: Requester,
    reference: u64,
    frames: Vec<Frame>,
) -> Result<Taken, Outcome> {
    let mut frames = frames.into_iter();
    if let Some((head, params)) = frames.next() {
        requester.on_answer(&head, reference)?;
        requester.on_params(params)?;
    }
    for (head, values) in frames {
        requester.on_frame(&head, values)?;
    }
    requester.finish()
}

/// The share of a dense replica's transfer time that one through `codec` takes: its bytes per
/// value against `f32`'s four, for a model of a million values.
fn bytes_share(codec: Codec) -> f64 {
    const VALUES: usize = 1 << 20;
    let bytes = codec.encoded_len(VALUES).unwrap_or(4 * VALUES);
    bytes as f64 / (4 * VALUES) as f64
}

/// A frame of a pairwise exchange as it travels: its head, and its values as the receiver's
/// wire decodes them.
pub(super) type Frame = (Head, Vec<f32>);

/// `Busy`, alone: not now, or declined.
fn busy_frame(step: u64) -> Vec<Frame> {
    vec![(Head::new(MessageKind::Busy, step), Vec::new())]
}

/// A machine's frame as it travels: its head, and its values as the receiver's wire decodes
/// them (a machine's own encoding always decodes).
fn carried((head, payload): (Head, Payload<'_>)) -> Frame {
    let values = payload.decoded(head.codec).unwrap_or_default();
    (head, values)
}
