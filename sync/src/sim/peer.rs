//! One simulated peer's trainer (steps, snapshots, the staleness gate) and its heartbeats.

use std::sync::Arc;
use std::time::Duration;

use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, SyncMode};
use murmur_protocol::membership::{Change, ConnectionKind};
use murmur_protocol::mix;
use rand::RngExt;

use super::{DueSnapshot, Event, PeerEvent, RUN_ID, Sim};
use crate::policy::Input;
use crate::replica::{Clock, ExchangeEnd, ExchangeId, Landing, Next, WaitFor};
use crate::table::Heard;

impl Sim {
    /// Asks the replica's rules (the real [`ReplicaLoop`](crate::replica::ReplicaLoop)) what
    /// comes next, and does it: the next step is scheduled, a snapshot handed over, or the
    /// trainer waits (for its exchanges, or at the staleness gate).
    pub(super) fn try_step(&mut self, i: usize) {
        loop {
            let (now, instant, mode) = (self.now, self.instant(), self.config.mode());
            let finished = self.finished(i);
            let peer = &mut self.peers[i];
            if !peer.alive || peer.trainer.step_scheduled || finished {
                return;
            }
            let clock = Clock {
                step: peer.step,
                finished: false,
            };
            let table = &peer.table;
            let decision = peer
                .trainer
                .rules
                .next(clock, instant, || table.gate_candidates(mode).collect());
            peer.stats.uncoupled += decision.uncoupled.len() as u64;
            // A wait ends once the rules give another reason, as the real driver counts it.
            let waiting = match &decision.next {
                Next::Wait(wait) => Some(wait.why),
                _ => None,
            };
            if waiting != Some(WaitFor::Exchanges)
                && let Some(since) = peer.trainer.paused_since.take()
            {
                peer.trainer.rules.exchange_waited(now - since);
            }
            if waiting != Some(WaitFor::Gate)
                && let Some(since) = peer.trainer.gated_since.take()
            {
                let waited = now - since;
                peer.stats.gate_wait += waited;
                peer.stats.longest_gate_wait = peer.stats.longest_gate_wait.max(waited);
            }
            match decision.next {
                Next::Wait(wait) => {
                    match wait.why {
                        WaitFor::Exchanges => {
                            peer.trainer.paused_since.get_or_insert(now);
                        }
                        WaitFor::Gate => {
                            peer.trainer.gated_since.get_or_insert(now);
                        }
                        WaitFor::Finished => {}
                    }
                    if let Some(at) = wait.until {
                        self.schedule_gate_check(i, at.saturating_duration_since(self.t0));
                    }
                    return;
                }
                Next::HandOver => {
                    // A round owed after taking over a peer's state.
                    self.hand_over(i);
                    continue;
                }
                Next::Step | Next::SynchronousStep => {}
            }
            peer.trainer.step_scheduled = true;
            // Real steps vary: without it every peer would reach its due step at once.
            let jitter = peer.rng.random_range(0.8..1.2);
            let after = self.config.step_time.mul_f64(peer.slowness * jitter);
            peer.trainer.step_took = after;
            self.schedule_for(i, after, PeerEvent::Step);
            return;
        }
    }

    /// Asks peer `i`'s gate again at `at` (virtual time), when its patience may run out
    /// though no clock moved; one check is kept scheduled, the earliest.
    fn schedule_gate_check(&mut self, i: usize, at: Duration) {
        let trainer = &mut self.peers[i].trainer;
        if trainer
            .gate_check_at
            .is_some_and(|scheduled| scheduled <= at)
        {
            return;
        }
        trainer.gate_check_at = Some(at);
        self.schedule_for(i, at.saturating_sub(self.now), PeerEvent::GateCheck);
    }

    pub(super) fn finished(&self, i: usize) -> bool {
        self.config
            .steps
            .is_some_and(|steps| self.peers[i].step >= steps)
    }

    pub(super) fn on_step(&mut self, i: usize) {
        self.peers[i].trainer.step_scheduled = false;
        let (pull, noise) = (self.config.pull, self.config.noise);
        let peer = &mut self.peers[i];
        // The step's move: toward the optimum of this peer's shard, with a minibatch's noise.
        let rng = &mut peer.rng;
        let update: Vec<f32> = peer
            .replica
            .iter()
            .zip(&peer.target)
            .map(|(value, target)| pull * (target - value) + rng.random_range(-noise..=noise))
            .collect();
        if self.config.mode() == SyncMode::Allreduce && self.config.sync.averages_gradients() {
            // Synchronous SGD: the step's move goes to the ring, and the replica steps with
            // the mean once it is back.
            let step = peer.step;
            let id = peer.trainer.rules.gradient_handed_over(step);
            let step_secs = peer.trainer.rules.step_secs();
            peer.trainer.due = Some(DueSnapshot {
                id,
                step,
                params: update,
            });
            self.input(i, Input::Due { step, step_secs });
            return;
        }
        mix::add(&mut peer.replica, &update);
        self.stepped(i);
    }

    /// Peer `i`'s replica took a step: counted, and what follows it (a snapshot handed over).
    pub(super) fn stepped(&mut self, i: usize) {
        let hand_over = self.count_step(i);
        self.announce_if_moved(i);
        if hand_over {
            self.hand_over(i);
        }
        self.try_step(i);
    }

    /// Counts a step of peer `i`'s replica and tells its rules; whether a snapshot is to be
    /// handed over now.
    pub(super) fn count_step(&mut self, i: usize) -> bool {
        let mode = self.config.mode();
        let peer = &mut self.peers[i];
        peer.step += 1;
        peer.stats.steps += 1;
        if let Some(value) = peer.poison {
            peer.replica.fill(value);
        }
        if peer.step.is_multiple_of(100) {
            peer.checkpoint = (peer.step, peer.replica.clone());
        }
        let table = &peer.table;
        peer.trainer
            .rules
            .stepped(peer.step, peer.trainer.step_took, || {
                table.coupled(mode).next().is_none()
            })
            .hand_over
    }

    /// Peer `i`'s replica hands its parameters over for an exchange.
    fn hand_over(&mut self, i: usize) {
        let peer = &mut self.peers[i];
        let step = peer.step;
        let id = peer.trainer.rules.handed_over(step, &peer.replica);
        let step_secs = peer.trainer.rules.step_secs();
        peer.trainer.due = Some(DueSnapshot {
            id,
            step,
            params: peer.replica.clone(),
        });
        self.input(i, Input::Due { step, step_secs });
    }

    /// Exchange `id` of peer `i`'s replica ended, with `end` (`None`: no mix): what lands on
    /// the replica, as on the real one.
    pub(super) fn land(&mut self, i: usize, id: ExchangeId, end: Option<ExchangeEnd>) {
        let peer = &mut self.peers[i];
        let landed = peer.trainer.rules.ended(id, end, peer.step);
        for landing in landed.landings {
            match landing {
                Landing::Add { delta, .. } => mix::add(&mut peer.replica, &delta),
                Landing::Set(params) => peer.replica = params,
            }
        }
        if let Some(lag) = landed.lag {
            peer.stats.merged(lag);
        }
    }

    /// The trainer's due exchange mixed: `end` lands on the replica now, before the policy
    /// hears of it; [`due_ended`](Self::due_ended) releases the trainer.
    pub(super) fn due_mixed(&mut self, i: usize, end: ExchangeEnd) {
        if let Some(id) = self.peers[i].trainer.due.as_ref().map(|due| due.id) {
            self.land(i, id, Some(end));
        }
    }

    /// The trainer's due exchange ended (what it mixed landed already).
    pub(super) fn due_ended(&mut self, i: usize) {
        if let Some(due) = self.peers[i].trainer.due.take() {
            self.land(i, due.id, None);
        }
        self.try_step(i);
    }

    /// An exchange this peer answered ended (what it mixed landed already).
    pub(super) fn serve_ended(&mut self, i: usize, id: Option<ExchangeId>) {
        if let Some(id) = id {
            self.land(i, id, None);
        }
        self.try_step(i);
    }

    // ---- heartbeats and membership ----

    pub(super) fn heartbeat(&mut self, i: usize) -> Heartbeat {
        let now_ms = u64::try_from(self.now.as_millis()).unwrap_or(u64::MAX);
        let sent_ms = self.peers[i].sent.stamp(now_ms);
        let p = &self.peers[i];
        Heartbeat {
            sent_ms,
            version: HEARTBEAT_VERSION,
            run_id: RUN_ID.into(),
            fingerprint: "sim".into(),
            step: p.step,
            epoch: 0,
            loss_ema: 0.0,
            samples_seen: 0,
            mode: self.config.mode(),
            role: p.policy.role(),
            leaving: false,
            finished: self.finished(i),
            client: p.table.is_client(),
        }
    }

    pub(super) fn publish(&mut self, i: usize) {
        let heartbeat = Arc::new(self.heartbeat(i));
        self.peers[i].trainer.announcer.announced(heartbeat.step);
        for j in 0..self.peers.len() {
            if j != i {
                let (latency, _) = self.net.between(i, j);
                let heartbeat = Arc::clone(&heartbeat);
                let event = Event::Heartbeat {
                    from: i,
                    to: j,
                    heartbeat,
                };
                self.send((i, j), latency, event);
            }
        }
    }

    /// Peers gate on clocks in heartbeats: one that moved goes out at once
    /// ([`Announcer`](crate::announce::Announcer)).
    pub(super) fn announce_if_moved(&mut self, i: usize) {
        let p = &self.peers[i];
        if p.trainer.announcer.moved(p.step) {
            self.publish(i);
        }
    }

    pub(super) fn on_heartbeat(&mut self, i: usize) {
        self.publish(i);
        self.expire(i);
        self.schedule_for(i, self.config.timeouts.heartbeat, PeerEvent::Heartbeat);
    }

    /// `to` hears `from`'s heartbeat, as the daemon's table hears one from gossip.
    pub(super) fn heard(&mut self, from: usize, to: usize, heartbeat: &Heartbeat) {
        let (peer, now) = (self.peers[from].id, self.instant());
        let table = &mut self.peers[to].table;
        if table.heard(peer, heartbeat, now) == Heard::Blocked {
            return;
        }
        table.set_connection(peer, Some(ConnectionKind::Direct));
        self.table_changed(to);
    }

    /// Peer `i`'s table changed: its policy hears of it, and its gate is asked again.
    pub(super) fn table_changed(&mut self, i: usize) {
        self.input(i, Input::PeersChanged);
        self.try_step(i);
    }

    /// Times out the peers `i` has not heard from for the peer timeout.
    pub(super) fn expire(&mut self, i: usize) {
        let now = self.instant();
        let changes = self.peers[i].table.members_mut().expire(now);
        if changes.is_empty() {
            return;
        }
        for change in changes {
            if let Change::TimedOut(peer) = change
                && let Some(&j) = self.index.get(&peer)
                && self.peers[j].alive
                && self.net.linked(i, j)
            {
                self.peers[i].stats.live_peers_timed_out += 1;
            }
        }
        self.table_changed(i);
    }
}
