//! The policy's actions carried out, and the messages of exchanges, elastic requests and state
//! syncs between simulated peers, message by message as the real protocols go.

use std::sync::Arc;

use murmur_protocol::codec::Codec;
use murmur_protocol::membership::ConnectionKind;

use crate::copies::{CROSSING_WAIT, Copies, mixed_other};

use super::*;

/// Which side of an exchange judges what came in.
#[derive(Clone, Copy, Debug)]
enum Side {
    Initiator,
    Responder,
}

/// The side of an exchange that started it (`a`) and that answers it (`b`).
#[derive(Clone, Debug)]
pub(super) struct Exchange {
    pub(super) kind: ExchangeKind,
    pub(super) a: usize,
    pub(super) b: usize,
    pub(super) a_open: bool,
    pub(super) b_open: bool,
    /// The responder's replica's exchange, once it answered.
    pub(super) b_id: Option<ExchangeId>,
    pub(super) a_snapshot: Vec<f32>,
    pub(super) a_step: u64,
    pub(super) a_weight: f32,
    pub(super) a_screen: Screen,
    pub(super) b_snapshot: Vec<f32>,
    pub(super) b_step: u64,
    pub(super) b_weight: f32,
    pub(super) b_screen: Screen,
    /// Compressed: the version of the initiator's copies of the pair when it offered.
    pub(super) a_version: Option<u64>,
    /// Compressed: which sides hold the pair's copies (one exchange per pair at a time).
    pub(super) a_holds_copies: bool,
    pub(super) b_holds_copies: bool,
    /// Compressed: the responder's difference, sent with its answer.
    pub(super) b_sent: Vec<f32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExchangeKind {
    /// Through this codec.
    Pairwise(Codec),
    Elastic,
    State,
}

impl ExchangeKind {
    /// A pairwise exchange through a compressed codec: differences against the pair's copies.
    fn compressed(self) -> Option<Codec> {
        match self {
            ExchangeKind::Pairwise(codec) if codec != Codec::F32 => Some(codec),
            _ => None,
        }
    }
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
            Action::PullState { peer, .. } => {
                self.start_exchange(i, peer, ExchangeKind::State, 0.0, Screen::default())
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

                let events = self
                    .ring
                    .start(i, round, attempt, &order, members.hash(), snapshot);
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
            ExchangeKind::State => (self.peers[a].step, Vec::new()),
            _ => match &self.peers[a].trainer.due {
                Some(due) => (due.step, due.params.clone()),
                None => (self.peers[a].step, self.peers[a].replica.clone()),
            },
        };
        let xid = self.next_xid;
        self.next_xid += 1;
        self.exchanges.insert(
            xid,
            Exchange {
                kind,
                a,
                b,
                a_open: true,
                b_open: false,
                b_id: None,
                a_snapshot: a_snapshot.clone(),
                a_step,
                a_weight: weight,
                a_screen: screen,
                b_snapshot: Vec::new(),
                b_step: 0,
                b_weight: 0.0,
                b_screen: Screen::default(),
                a_version: None,
                a_holds_copies: false,
                b_holds_copies: false,
                b_sent: Vec::new(),
            },
        );
        if kind.compressed().is_some() {
            let len = a_snapshot.len();
            let p = &mut self.peers[a];
            if !p.lent.insert(peer) {
                // An exchange with this partner (it asked us) holds the copies: as the real
                // engine, the offer ends `Busy` before anything is sent.
                let busy = Msg::Answer {
                    xid,
                    params: None,
                    reference: None,
                };
                self.schedule(
                    Duration::ZERO,
                    Event::Deliver {
                        from: b,
                        to: a,
                        msg: busy,
                    },
                );
                return;
            }
            let version = p
                .copies
                .entry(peer)
                .or_insert_with(|| Copies::fresh(len))
                .version;
            if let Some(x) = self.exchanges.get_mut(&xid) {
                x.a_version = Some(version);
                x.a_holds_copies = true;
            }
        }
        let (latency, transfer) = self.net.between(a, b);
        let msg = match kind {
            ExchangeKind::Pairwise(_) => Msg::Offer { xid, step: a_step },
            ExchangeKind::Elastic => Msg::CenterRequest { xid, step: a_step },
            ExchangeKind::State => Msg::StateRequest { xid },
        };
        let after = if kind == ExchangeKind::Elastic {
            latency + transfer
        } else {
            latency
        };
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
                let msg = match self.exchanges.get(&xid).map(|x| x.kind) {
                    Some(ExchangeKind::Elastic) => Msg::CenterAnswer { xid, delta: None },
                    Some(ExchangeKind::State) => Msg::StateAnswer { xid, state: None },
                    _ => Msg::Answer {
                        xid,
                        params: None,
                        reference: None,
                    },
                };
                self.send(i, from, latency, msg);
            }
            Answer::Exchange { weight, screen } => {
                let until = self.now + CROSSING_WAIT;
                self.answer_offer(i, from, xid, weight, screen, until);
            }
            Answer::Center { alpha, screen } => {
                let Some(x) = self.exchanges.get(&xid).cloned() else {
                    return;
                };
                let weight = mix_weight(step, x.a_step, self.sync.mix_bound(), 1.0, false);
                let mut worker = x.a_snapshot.clone();
                let peer = &mut self.peers[i];
                let outcome = match (peer.center.as_mut(), weight) {
                    (Some(center), Some(weight)) => screen
                        .admit(mix::distance(&worker, center), center)
                        .map(|admitted| {
                            let cleared = admitted.clip(&mut worker, center);
                            let delta = mix::elastic_step(center, &worker, alpha * weight);
                            (cleared.outcome, delta)
                        }),
                    (Some(_), None) => Err(Outcome::Stale),
                    (None, _) => Err(Outcome::Busy),
                };
                match outcome {
                    Ok((outcome, delta)) => {
                        peer.stats.served += 1;
                        self.send(
                            i,
                            from,
                            latency + transfer,
                            Msg::CenterAnswer {
                                xid,
                                delta: Some((delta, step)),
                            },
                        );
                        self.input(
                            i,
                            Input::Served {
                                peer: self.peers[from].id,
                                outcome,
                            },
                        );
                    }
                    Err(outcome) => {
                        self.send(i, from, latency, Msg::CenterAnswer { xid, delta: None });
                        if matches!(outcome, Outcome::Outlier { .. }) {
                            self.input(
                                i,
                                Input::Served {
                                    peer: self.peers[from].id,
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
                let state = Box::new(PeerState {
                    step: p.step,
                    params,
                    outer,
                    center: p.center.clone(),
                });
                self.send(
                    i,
                    from,
                    latency + transfer,
                    Msg::StateAnswer {
                        xid,
                        state: Some(state),
                    },
                );
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
        let snapshot = self.peers[i].replica.clone();
        let partner = self.peers[from].id;
        // As the real trainer: answering a partner on a slow link does not pause.
        let slow_partner = self.peers[i].table.is_slow(&partner);
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        // Compressed: our difference against the copies of the offer's version (or zero
        // copies where the versions disagree).
        let (mut payload, mut reference, mut share) = (snapshot.clone(), None, 1.0);
        if let Some(codec) = x.kind.compressed() {
            let p = &mut self.peers[i];
            if !p.lent.insert(partner) {
                if self.now < until {
                    let life = p.life;
                    let retry = Event::AnswerOffer {
                        peer: i,
                        life,
                        from,
                        xid,
                        weight,
                        screen,
                        until,
                    };
                    self.schedule(latency, retry);
                    return;
                }
                let busy = Msg::Answer {
                    xid,
                    params: None,
                    reference: None,
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
            let len = snapshot.len();
            let copies = p
                .copies
                .entry(partner)
                .or_insert_with(|| Copies::fresh(len));
            reference = Some(copies.agree(x.a_version));
            payload = copies.difference(codec, &snapshot).1;
            x.b_sent = payload.clone();
            x.b_holds_copies = true;
            share = bytes_share(codec);
        }
        let id = self.peers[i]
            .trainer
            .rules
            .answered(step, &snapshot, slow_partner);
        x.b_open = true;
        x.b_id = Some(id);
        x.b_snapshot = snapshot;
        x.b_step = step;
        x.b_weight = weight;
        x.b_screen = screen;
        self.send(
            i,
            from,
            latency + transfer.mul_f64(share),
            Msg::Answer {
                xid,
                params: Some((payload, step)),
                reference,
            },
        );
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
                ExchangeKind::State => self.input(
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

    /// Side `i` of a pairwise exchange judges what its partner sent (`received`): the
    /// screen's outcome and, unless declined, the parameters to mix. A compressed exchange
    /// works on the pair's copies: `received` and `sent` are the two differences, the exchange
    /// is judged by the gap between the copies once they are added, and a mix commits them.
    fn judge(
        &mut self,
        i: usize,
        partner: PeerId,
        x: &Exchange,
        received: Vec<f32>,
        sent: &[f32],
        side: Side,
    ) -> (Outcome, Option<Vec<f32>>) {
        let (snapshot, screen) = match side {
            Side::Initiator => (&x.a_snapshot, x.a_screen),
            Side::Responder => (&x.b_snapshot, x.b_screen),
        };
        let Some(codec) = x.kind.compressed() else {
            let mut theirs = received;
            return match screen.admit(mix::distance(&theirs, snapshot), snapshot) {
                Ok(admitted) => (admitted.clip(&mut theirs, snapshot).outcome, Some(theirs)),
                Err(outlier) => (outlier, None),
            };
        };
        let copies = self.copies_with(i, partner, snapshot.len());
        let theirs = copies.theirs_after(&received);
        match screen.admit(copies.gap_after(sent, &theirs), snapshot) {
            Ok(admitted) => {
                copies.commit(sent, theirs);
                if Some(codec) == self.sync.sparse_codec {
                    self.peers[i].stats.sparse += 1;
                }
                let copies = self.copies_with(i, partner, snapshot.len());
                let mut other = mixed_other(codec, &copies.theirs, &copies.own, snapshot);
                (admitted.clip(&mut other, snapshot).outcome, Some(other))
            }
            Err(outlier) => (outlier, None),
        }
    }

    /// Peer `i`'s copies of its pair with `partner` (zero copies of `len` values at first).
    fn copies_with(&mut self, i: usize, partner: PeerId, len: usize) -> &mut Copies {
        self.peers[i]
            .copies
            .entry(partner)
            .or_insert_with(|| Copies::fresh(len))
    }

    /// Side `i` of exchange `xid` is done with the pair's copies: another exchange of the pair
    /// may take them.
    fn return_copies(&mut self, xid: u64, i: usize) {
        let Some(x) = self.exchanges.get_mut(&xid) else {
            return;
        };
        let (holds, partner) = if i == x.a {
            (&mut x.a_holds_copies, x.b)
        } else {
            (&mut x.b_holds_copies, x.a)
        };
        if std::mem::take(holds) {
            let partner = self.peers[partner].id;
            self.peers[i].lent.remove(&partner);
        }
    }

    /// The weight a side at `own` mixes a partner's parameters at `theirs` with, as the real
    /// engine's (decision 0029).
    fn partner_weight(&self, own: u64, theirs: u64, base: f32) -> f32 {
        partner_mix_weight(own, theirs, self.sync.mix_bound(), base, false)
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
            Msg::Offer { xid, step } => self.on_request(from, to, xid, Request::Offer { step }),
            Msg::CenterRequest { xid, step, .. } => {
                self.on_request(from, to, xid, Request::Params { step });
            }
            Msg::StateRequest { xid } => self.on_request(from, to, xid, Request::State),
            Msg::Answer {
                xid,
                params,
                reference,
            } => self.on_answer(xid, from, to, params, reference),
            Msg::Final { xid, params } => self.on_final(xid, to, params),
            Msg::CenterAnswer { xid, delta } => self.on_center_answer(xid, to, delta),
            Msg::StateAnswer { xid, state } => self.on_state_answer(xid, from, to, state),
            Msg::Ring(hello) => {
                let events = self.ring.hello(to, hello);
                self.ring_events(events);
            }
        }
    }

    /// The initiator reads the partner's snapshot (or `Busy`), declines or sends its own, mixes.
    pub(super) fn on_answer(
        &mut self,
        xid: u64,
        b: usize,
        a: usize,
        params: Option<(Vec<f32>, u64)>,
        reference: Option<u64>,
    ) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        let (latency, _) = self.net.between(a, b);
        if !x.a_open {
            // The initiator gave up: the responder's stream ends.
            self.send(a, b, latency, Msg::Final { xid, params: None });
            return;
        }
        let Some((received, their_step)) = params else {
            self.end_side(xid, a, Outcome::Busy);
            return;
        };
        let weight = self.partner_weight(x.a_step, their_step, x.a_weight);
        // Compressed: our difference against the copies of the version the partner answered
        // against (zero copies where it started them again).
        let partner = self.peers[b].id;
        let (sent, sent_out) = match x.kind.compressed() {
            Some(codec) => {
                let copies = self.copies_with(a, partner, x.a_snapshot.len());
                copies.agree(reference);
                let sent = copies.difference(codec, &x.a_snapshot).1;
                (sent.clone(), sent)
            }
            None => (Vec::new(), x.a_snapshot.clone()),
        };
        let (outcome, theirs) = self.judge(a, partner, &x, received, &sent, Side::Initiator);
        if let (Outcome::Mixed { .. }, Some(theirs)) = (&outcome, theirs) {
            // The initiator's parameters went out while the responder's came in (from the
            // answer's header on), so they and the verdict arrive one latency after these.
            self.send(
                a,
                b,
                latency,
                Msg::Final {
                    xid,
                    params: Some((sent_out, x.a_step)),
                },
            );
            self.peers[a].stats.exchanges += 1;
            self.return_copies(xid, a);
            let end = ExchangeEnd::Mix {
                other: theirs,
                base: Arc::new(Snapshot {
                    step: x.a_step,
                    params: x.a_snapshot,
                }),
                weight,
            };
            self.due_mixed(a, end);
            if let Some(x) = self.exchanges.get_mut(&xid) {
                x.a_open = false;
            }
            self.forget_if_closed(xid);
            self.input(
                a,
                Input::Exchanged {
                    peer: self.peers[b].id,
                    outcome,
                },
            );
            self.due_ended(a);
        } else {
            self.send(a, b, latency, Msg::Final { xid, params: None });
            self.end_side(xid, a, outcome);
        }
    }

    /// The responder reads the initiator's snapshot (or its refusal) and mixes.
    pub(super) fn on_final(&mut self, xid: u64, b: usize, params: Option<(Vec<f32>, u64)>) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.b_open {
            return;
        }
        let Some((received, their_step)) = params else {
            self.end_side(xid, b, Outcome::Busy);
            return;
        };
        let partner = self.peers[x.a].id;
        let (outcome, theirs) = self.judge(b, partner, &x, received, &x.b_sent, Side::Responder);
        if let (Outcome::Mixed { .. }, Some(id), Some(theirs)) = (&outcome, x.b_id, theirs) {
            let weight = self.partner_weight(x.b_step, their_step, x.b_weight);
            self.peers[b].stats.served += 1;
            let end = ExchangeEnd::Mix {
                other: theirs,
                base: Arc::new(Snapshot {
                    step: x.b_step,
                    params: x.b_snapshot,
                }),
                weight,
            };
            self.land(b, id, Some(end));
        }
        self.end_side(xid, b, outcome);
    }

    pub(super) fn on_center_answer(&mut self, xid: u64, w: usize, delta: Option<(Vec<f32>, u64)>) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.a_open {
            return;
        }
        let Some((mut delta, center_step)) = delta else {
            self.end_side(xid, w, Outcome::Busy);
            return;
        };
        let stale = mix_weight(x.a_step, center_step, self.sync.mix_bound(), 1.0, false).is_none();
        let outcome = match x.a_screen.admit(mix::norm(&delta), &x.a_snapshot) {
            Err(outlier) => outlier,
            Ok(_) if stale => Outcome::Stale,
            Ok(admitted) => admitted.clip_delta(&mut delta, &x.a_snapshot).outcome,
        };
        if matches!(outcome, Outcome::Mixed { .. }) {
            self.peers[w].stats.exchanges += 1;
            self.due_mixed(w, ExchangeEnd::Subtract(delta));
            if let Some(x) = self.exchanges.get_mut(&xid) {
                x.a_open = false;
            }
            self.forget_if_closed(xid);
            self.input(
                w,
                Input::Exchanged {
                    peer: self.peers[x.b].id,
                    outcome,
                },
            );
            self.due_ended(w);
        } else {
            self.end_side(xid, w, outcome);
        }
    }

    pub(super) fn on_state_answer(
        &mut self,
        xid: u64,
        source: usize,
        j: usize,
        state: Option<Box<PeerState>>,
    ) {
        let Some(x) = self.exchanges.get(&xid).cloned() else {
            return;
        };
        if !x.a_open {
            return;
        }
        let Some(state) = state else {
            self.end_side(xid, j, Outcome::Failed(Failure::Stream("busy".into())));
            return;
        };
        if let Some(x) = self.exchanges.get_mut(&xid) {
            x.a_open = false;
        }
        self.forget_if_closed(xid);
        let PeerState {
            step,
            params,
            outer,
            center,
        } = *state;
        let p = &mut self.peers[j];
        p.step = step;
        p.trainer.rules.adopted(step, &params, outer);
        p.replica = params;
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

/// The share of a dense replica's transfer time that one through `codec` takes: its bytes per
/// value against `f32`'s four, for a model of a million values.
fn bytes_share(codec: Codec) -> f64 {
    const VALUES: usize = 1 << 20;
    let bytes = codec.encoded_len(VALUES).unwrap_or(4 * VALUES);
    bytes as f64 / (4 * VALUES) as f64
}
