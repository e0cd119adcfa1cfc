//! One simulated peer's trainer (steps, snapshots, the staleness gate) and its heartbeats.

use super::*;

impl Sim {
    /// Schedules the next step unless the trainer waits (for its exchanges, or at the gate).
    pub(super) fn try_step(&mut self, i: usize) {
        let ring = self.config.mode == SyncMode::Allreduce;
        let (pause, candidates) = {
            let p = &self.peers[i];
            if !p.alive || p.trainer.step_scheduled || self.finished(i) {
                return;
            }
            // As the real trainer: a mix lands at most `max_merge_lag` steps late.
            let answered = self
                .exchanges
                .values()
                .filter(|x| x.b == i && x.b_open)
                .map(|x| x.b_step);
            let oldest = p
                .trainer
                .due
                .iter()
                .map(|(at, _)| *at)
                .chain(answered)
                .min();
            let pause = p.trainer.pending > 0 && (!self.config.overlap || ring)
                || oldest.is_some_and(|at| p.step.saturating_sub(at) >= self.config.max_merge_lag);
            let candidates: Vec<(PeerId, u64)> = if pause {
                Vec::new()
            } else {
                p.table.gate_candidates(self.config.mode).collect()
            };
            (pause, candidates)
        };
        let (now, instant) = (self.now, self.instant());
        let peer = &mut self.peers[i];
        if pause {
            peer.trainer.paused_since.get_or_insert(now);
            return;
        }
        if let Some(since) = peer.trainer.paused_since.take() {
            peer.trainer.pace.paused(now - since);
        }
        // As the real trainer: the gate waits for the coupled peers only (decision 0039).
        let clock = match peer.trainer.coupling.as_mut() {
            Some(coupling) if self.config.mode != SyncMode::Solo => {
                coupling.gate_clock(peer.step, candidates, instant)
            }
            _ => GateClock {
                slowest: None,
                uncoupled: Vec::new(),
                decide_at: None,
            },
        };
        peer.stats.uncoupled += clock.uncoupled.len() as u64;
        let gate =
            StalenessGate::new(self.config.max_staleness).check(peer.step + 1, clock.slowest);
        if let Gate::Closed { .. } = gate {
            peer.trainer.gated_since.get_or_insert(now);
            if let Some(at) = clock.decide_at {
                self.schedule_gate_check(i, at.saturating_duration_since(self.t0));
            }
            return;
        }
        if let Some(since) = peer.trainer.gated_since.take() {
            let waited = now - since;
            peer.stats.gate_wait += waited;
            peer.stats.longest_gate_wait = peer.stats.longest_gate_wait.max(waited);
        }
        peer.trainer.step_scheduled = true;
        // Real steps vary: without it every peer would reach its due step at the same moment.
        let jitter = peer.rng.random_range(0.8..1.2);
        let after = self.config.step_time.mul_f64(peer.slowness * jitter);
        peer.trainer.pace.stepped(after);
        let life = peer.life;
        self.schedule(after, Event::Step { peer: i, life });
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
        let life = self.peers[i].life;
        self.schedule(
            at.saturating_sub(self.now),
            Event::GateCheck { peer: i, life },
        );
    }

    pub(super) fn finished(&self, i: usize) -> bool {
        self.config
            .steps
            .is_some_and(|steps| self.peers[i].step >= steps)
    }

    pub(super) fn on_step(&mut self, i: usize) {
        self.peers[i].trainer.step_scheduled = false;
        if self.config.mode == SyncMode::Allreduce {
            // Synchronous SGD: the round of this step comes before the step's update.
            let peer = &mut self.peers[i];
            let round = peer.step;
            peer.trainer.pending += 1;
            peer.trainer.due = Some((round, peer.replica.clone()));
            self.input(i, Input::Due { step: round });
            return;
        }
        let (step, due) = {
            let peer = &mut self.peers[i];
            peer.step += 1;
            peer.stats.steps += 1;
            let (pull, noise) = (self.config.pull, self.config.noise);
            for (value, target) in peer.replica.iter_mut().zip(&peer.target) {
                *value += pull * (target - *value) + peer.rng.random_range(-noise..=noise);
            }
            if let Some(value) = peer.poison {
                peer.replica.fill(value);
            }
            if peer.step.is_multiple_of(100) {
                peer.checkpoint = (peer.step, peer.replica.clone());
            }
            if self.config.mode != SyncMode::Solo && peer.trainer.pace.is_due(peer.step) {
                peer.trainer.owed = true;
            }
            // As the real trainer: with `overlap` a due snapshot waits for the previous one.
            let due = peer.trainer.owed && peer.trainer.due.is_none();
            if due {
                peer.trainer.owed = false;
                peer.trainer.pending += 1;
                peer.trainer.due = Some((peer.step, peer.replica.clone()));
            }
            (peer.step, due)
        };
        self.announce_if_moved(i);
        if due {
            self.input(i, Input::Due { step });
        }
        self.try_step(i);
    }

    /// The trainer's due exchange ended (with or without a mix).
    pub(super) fn due_ended(&mut self, i: usize) {
        let trainer = &mut self.peers[i].trainer;
        if trainer.due.take().is_some() {
            trainer.pending = trainer.pending.saturating_sub(1);
        }
        self.try_step(i);
    }

    /// An exchange this peer answered ended (`held`: its trainer paused for it).
    pub(super) fn serve_ended(&mut self, i: usize, held: bool) {
        if held {
            let trainer = &mut self.peers[i].trainer;
            trainer.pending = trainer.pending.saturating_sub(1);
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
            mode: self.config.mode,
            role: p.policy.role(),
            leaving: false,
            finished: self.finished(i),
            client: p.table.is_client(),
        }
    }

    pub(super) fn publish(&mut self, i: usize) {
        let heartbeat = self.heartbeat(i);
        self.peers[i].trainer.announced = heartbeat.step;
        for j in 0..self.peers.len() {
            if j != i {
                let (latency, _) = self.net.between(i, j);
                self.send(i, j, latency, Msg::Heartbeat(heartbeat.clone()));
            }
        }
    }

    /// Peers gate on clocks in heartbeats: one that moved by half the bound goes out at once.
    pub(super) fn announce_if_moved(&mut self, i: usize) {
        let every = self.config.max_staleness.map(|s| (s / 2).max(1));
        let p = &self.peers[i];
        if every.is_some_and(|every| p.step >= p.trainer.announced + every) {
            self.publish(i);
        }
    }

    pub(super) fn on_heartbeat(&mut self, i: usize) {
        self.publish(i);
        self.expire(i);
        let life = self.peers[i].life;
        self.schedule(
            self.config.timeouts.heartbeat,
            Event::Heartbeat { peer: i, life },
        );
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
        self.input(i, Input::PeersChanged);
        self.try_step(i);
    }
}
