//! The policy's actions carried out, and the messages of exchanges, elastic requests and state
//! syncs between simulated peers, message by message as the real protocols go.

use std::sync::Arc;

use murmur_protocol::membership::ConnectionKind;

use super::*;

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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ExchangeKind {
    Pairwise,
    Elastic,
    State,
}

impl Sim {
    pub(super) fn execute(&mut self, i: usize, action: Action) {
        tracing::trace!(target: "murmur_sim", at = ?self.now, peer = i, ?action, "action");
        match action {
            // The simulated exchange moves whole replicas whatever the codec.
            Action::Offer {
                peer,
                weight,
                screen,
                ..
            } => self.start_exchange(i, peer, ExchangeKind::Pairwise, weight, screen),
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
            },
        );
        let (latency, transfer) = self.net.between(a, b);
        let msg = match kind {
            ExchangeKind::Pairwise => Msg::Offer { xid, step: a_step },
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
                    _ => Msg::Answer { xid, params: None },
                };
                self.send(i, from, latency, msg);
            }
            Answer::Exchange { weight, screen } => {
                let snapshot = self.peers[i].replica.clone();
                // As the real trainer: answering a partner on a slow link does not pause.
                let slow_partner = self.peers[i].table.is_slow(&self.peers[from].id);
                let Some(x) = self.exchanges.get_mut(&xid) else {
                    return;
                };
                let id = self.peers[i]
                    .trainer
                    .rules
                    .answered(step, &snapshot, slow_partner);
                x.b_open = true;
                x.b_id = Some(id);
                x.b_snapshot = snapshot.clone();
                x.b_step = step;
                x.b_weight = weight;
                x.b_screen = screen;
                self.send(
                    i,
                    from,
                    latency + transfer,
                    Msg::Answer {
                        xid,
                        params: Some((snapshot, step)),
                    },
                );
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
            Msg::Answer { xid, params } => self.on_answer(xid, from, to, params),
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
        let Some((mut theirs, their_step)) = params else {
            self.end_side(xid, a, Outcome::Busy);
            return;
        };
        let weight = self.partner_weight(x.a_step, their_step, x.a_weight);
        let outcome = match x
            .a_screen
            .admit(mix::distance(&theirs, &x.a_snapshot), &x.a_snapshot)
        {
            Ok(admitted) => admitted.clip(&mut theirs, &x.a_snapshot).outcome,
            Err(outlier) => outlier,
        };
        if let Outcome::Mixed { .. } = outcome {
            // The initiator's parameters went out while the responder's came in (from the
            // answer's header on), so they and the verdict arrive one latency after these.
            self.send(
                a,
                b,
                latency,
                Msg::Final {
                    xid,
                    params: Some((x.a_snapshot.clone(), x.a_step)),
                },
            );
            self.peers[a].stats.exchanges += 1;
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
        let Some((mut theirs, their_step)) = params else {
            self.end_side(xid, b, Outcome::Busy);
            return;
        };
        let outcome = match x
            .b_screen
            .admit(mix::distance(&theirs, &x.b_snapshot), &x.b_snapshot)
        {
            Ok(admitted) => admitted.clip(&mut theirs, &x.b_snapshot).outcome,
            Err(outlier) => outlier,
        };
        if let (Outcome::Mixed { .. }, Some(id)) = (&outcome, x.b_id) {
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
