//! The membership actor: network events in, the peer table out.
//!
//! It turns the network's events into the [`PeerTable`] it publishes (joins, leaves, timeouts,
//! blocks, and the peers the sync engine found on slow links) by the table's own rules, which
//! the simulator drives too; hands where peers listen to the peer book; publishes this node's
//! heartbeat every heartbeat period (and at once when the clock moved by half the staleness
//! bound: peers gate on it); and has the table score offences, blocking repeat offenders. It
//! never waits on the network task: heartbeats and blocks are commands that are dropped when
//! the task's queue is full (the next heartbeat follows within a period), so a busy network and
//! a busy membership actor cannot hold each other up.

use std::collections::BTreeSet;
use std::time::Duration;

use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, SendClock, unix_ms_now};
use murmur_protocol::membership::Change;
use murmur_protocol::network::{Client, Multiaddr, NetworkEvent, PeerId, Reach};
use murmur_protocol::throttle::{LOG_LINES, LogThrottle};
use murmur_sync::announce::Announcer;
use murmur_sync::policy::EngineView;
use murmur_sync::rejection::Rejection;
use murmur_sync::settings::Timeouts;
use murmur_sync::table::{Heard, Offence, PeerTable};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::clock;
use crate::config::ClientMode;
use crate::events;
use crate::node::book::PeerBook;
use crate::node::messages::PeerNote;
use crate::readout::{Count, Progress, Readout};

/// Everything the membership actor works with.
#[derive(Debug)]
pub struct MembershipActor {
    pub client: Client,
    pub readout: Readout,
    pub timeouts: Timeouts,
    /// The table it publishes.
    pub table: watch::Sender<PeerTable>,
    /// The addresses it publishes.
    pub listen: watch::Sender<Vec<Multiaddr>>,
    /// Whether peers can dial this node, as it publishes it.
    pub reach: watch::Sender<Reach>,
    /// Whether this node runs as a client: the node config's `client`.
    pub client_mode: ClientMode,
    pub events: mpsc::Receiver<NetworkEvent>,
    pub notes: mpsc::Receiver<PeerNote>,
    pub progress: watch::Receiver<Progress>,
    pub engine: watch::Receiver<EngineView>,
    /// The partners the sync engine found on slow links: put in the table, so that the
    /// staleness gate, which waits on the table, is woken when they change.
    pub slow: watch::Receiver<BTreeSet<PeerId>>,
    pub book: PeerBook,
}

/// Runs until `leave` is cancelled, then publishes the goodbye heartbeat.
pub async fn run(mut actor: MembershipActor, leave: CancellationToken) {
    if actor.client_mode == ClientMode::Always {
        actor.become_client("the node config sets client = \"always\"");
    }
    let mut tick = tokio::time::interval(actor.timeouts.heartbeat);
    // With a staleness bound, peers gate on the clocks in heartbeats: a clock that moved is
    // announced at once rather than at the next period.
    let mut announcer = Announcer::new(actor.readout.sync().max_staleness);
    // Stamps this node's heartbeats: their send time is their sequence number.
    let mut sent = SendClock::default();
    loop {
        let expiry = actor.table.borrow().members().next_expiry();
        tokio::select! {
            biased;
            () = leave.cancelled() => break,
            Some(event) = actor.events.recv() => actor.on_event(event),
            Some(note) = actor.notes.recv() => actor.on_note(note),
            // At the moment a peer times out, so that a dead peer holds the staleness gate for
            // the peer timeout and not a moment longer. Past the deadline by a hair, so that
            // the peer has been silent for longer than the timeout.
            () = tokio::time::sleep_until((expiry.unwrap_or_else(clock::now) + Duration::from_millis(1)).into()), if expiry.is_some() => {
                actor.expire();
            }
            _ = tick.tick() => {
                announcer.announced(actor.progress.borrow().step);
                actor.publish(false, &mut sent);
            }
            Ok(()) = actor.slow.changed() => {
                let slow = actor.slow.borrow_and_update().clone();
                actor.table.send_if_modified(|table| table.set_slow(slow));
            }
            Ok(()) = actor.progress.changed() => {
                let step = actor.progress.borrow_and_update().step;
                if announcer.moved(step) {
                    announcer.announced(step);
                    actor.publish(false, &mut sent);
                }
            }
        }
    }
    // The goodbye is the one heartbeat that is waited for: the network outlives this actor
    // until the node has finished leaving.
    let goodbye = actor.heartbeat(true, &mut sent);
    let sent = tokio::time::timeout(
        actor.timeouts.heartbeat,
        actor.client.publish_heartbeat(&goodbye),
    )
    .await;
    if !matches!(sent, Ok(Ok(()))) {
        debug!("the goodbye heartbeat may not have gone out");
    }
}

impl MembershipActor {
    fn heartbeat(&self, leaving: bool, sent: &mut SendClock) -> Heartbeat {
        let p = self.progress.borrow().figures();
        let id = self.readout.identity();
        Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: id.run_id.clone(),
            fingerprint: id.fingerprint.clone(),
            step: p.step,
            epoch: p.epoch,
            loss_ema: p.loss_ema,
            samples_seen: p.samples_seen,
            mode: self.readout.sync().mode.name(),
            role: self.engine.borrow().role,
            leaving,
            finished: p.finished,
            client: self.table.borrow().is_client(),
            sent_ms: sent.stamp(unix_ms_now()),
        }
    }

    /// Publishes this node's heartbeat, unless the network task is too busy to take it now.
    fn publish(&self, leaving: bool, sent: &mut SendClock) {
        // Publishing fails while no peer is subscribed yet; the next period retries.
        if let Err(e) = self
            .client
            .try_publish_heartbeat(&self.heartbeat(leaving, sent))
        {
            debug!(error = %e, "heartbeat not published");
        }
    }

    fn on_event(&mut self, event: NetworkEvent) {
        match event {
            NetworkEvent::Listening(addrs) => {
                self.listen.send_modify(|listen| listen.extend(addrs))
            }
            NetworkEvent::Reach(reach) => {
                if self.client_mode == ClientMode::Auto && reach.cannot_accept_connections() {
                    self.become_client(
                        "peers cannot dial this node and no hole punch reaches it \
                         (client = \"never\" in the node config keeps it a full peer)",
                    );
                }
                self.reach.send_replace(reach);
            }
            NetworkEvent::Connected(peer) => info!(peer = %peer, "connected"),
            NetworkEvent::Disconnected(peer) => {
                info!(peer = %peer, "disconnected");
                self.table
                    .send_modify(|table| table.set_connection(peer, None));
            }
            NetworkEvent::Link { peer, kind } => {
                info!(peer = %peer, link = ?kind, "connected another way");
                self.table
                    .send_modify(|table| table.set_connection(peer, Some(kind)));
            }
            NetworkEvent::Identified { peer, addrs } => self.book.remember(peer, addrs),
            NetworkEvent::Rtt { peer, rtt } => self.readout.link_table().rtt(peer, rtt),
            NetworkEvent::Heartbeat { peer, heartbeat } => {
                let now = clock::now();
                let mut heard = Heard::Blocked;
                self.table.send_if_modified(|table| {
                    heard = table.heard(peer, &heartbeat, now);
                    heard != Heard::Blocked
                });
                let Heard::Taken(change) = heard else {
                    return;
                };
                match change {
                    Some(Change::Joined(peer)) => {
                        info!(event = events::PEER_JOINED, peer = %peer, step = heartbeat.step, "peer joined");
                    }
                    Some(Change::Left(peer)) => {
                        info!(event = events::PEER_LEFT, peer = %peer, "peer left");
                    }
                    Some(Change::Replayed(peer)) => {
                        self.readout.counters().count(Count::HeartbeatReplayed);
                        debug!(peer = %peer, "a heartbeat not newer than the last is ignored");
                    }
                    Some(Change::Full(peer)) => {
                        debug!(peer = %peer, "peer table full: a new peer's heartbeat is ignored");
                    }
                    _ => {}
                }
            }
            // A heartbeat out of the clock window may be an honest one, replayed: not scored,
            // and said at most once a minute (a peer with a wrong clock sends one a second).
            NetworkEvent::Rejected { peer, reason } if !reason.is_offence() => {
                static IGNORED: LogThrottle = LogThrottle::new(1);
                if let Some(held) = IGNORED.allow() {
                    warn!(peer = %peer, reason = %reason, held, "heartbeats ignored");
                }
            }
            NetworkEvent::Rejected { peer, reason } => {
                self.offence(peer, Rejection::Heartbeat(reason.to_string()));
            }
        }
    }

    fn on_note(&mut self, note: PeerNote) {
        match note {
            PeerNote::Offence { peer, rejection } => self.offence(peer, rejection),
            PeerNote::SawStep { peer, step } => {
                self.table
                    .send_if_modified(|table| table.members_mut().saw_step(&peer, step));
            }
        }
    }

    /// From now on this node runs as a client, for the reason `why`: its heartbeats say so, so
    /// that no peer elects it center or lets it into a ring, and it exchanges only with peers
    /// it reaches directly. A client stays one until it restarts: its NAT does not change.
    fn become_client(&mut self, why: &str) {
        let already = self.table.borrow().is_client();
        if !already {
            info!(
                reason = why,
                "running as a client: exchanging only with peers this node can dial"
            );
            self.table.send_modify(|table| table.set_client(true));
        }
    }

    /// Scores an offence of `peer`; at the limit, the table blocks it, and so does the
    /// network.
    fn offence(&mut self, peer: PeerId, rejection: Rejection) {
        self.readout.counters().count(Count::RejectedMessage);
        let mut offence = Offence::Warned { offences: 0 };
        self.table.send_if_modified(|table| {
            offence = table.offence(peer, clock::now());
            matches!(offence, Offence::Blocked { .. })
        });
        match offence {
            Offence::Warned { offences } => {
                static INVALID: LogThrottle = LogThrottle::new(LOG_LINES);
                if let Some(held) = INVALID.allow() {
                    warn!(peer = %peer, reason = %rejection, offences, held, "invalid message");
                }
            }
            Offence::Blocked { let_back_in } => {
                // Counted in `blocked_peers` whether said or not.
                static BLOCKED: LogThrottle = LogThrottle::new(LOG_LINES);
                if let Some(held) = BLOCKED.allow() {
                    warn!(event = events::PEER_BLOCKED, peer = %peer, reason = %rejection, held, "blocking peer after repeated invalid messages");
                }
                if let Err(e) = self.client.try_block(peer) {
                    warn!(peer = %peer, error = %e, "cannot tell the network to block the peer");
                }
                if let Some(forgotten) = let_back_in {
                    debug!(peer = %forgotten, "block list full: the peer blocked longest ago is let back in");
                    if let Err(e) = self.client.try_unblock(forgotten) {
                        warn!(peer = %forgotten, error = %e, "cannot tell the network to unblock the peer");
                    }
                }
            }
        }
    }

    /// Forgets the peers silent for longer than the peer timeout.
    fn expire(&mut self) {
        let mut timed_out = Vec::new();
        self.table.send_if_modified(|table| {
            timed_out = table.members_mut().expire(clock::now());
            !timed_out.is_empty()
        });
        for change in timed_out {
            if let Change::TimedOut(peer) = change {
                info!(event = events::PEER_TIMED_OUT, peer = %peer, "peer timed out");
                self.readout.counters().count(Count::PeerTimedOut);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use murmur_protocol::network::{self, Keypair, NetworkConfig, TransportKind};

    use super::*;
    use crate::node::{book, testing};
    use crate::store::Store;

    /// The partners the sync engine finds on slow links reach the peer table, whose `watch`
    /// the staleness gate waits on: finding a slow link wakes the gate (decision 0029).
    #[test]
    fn the_slow_links_the_engine_finds_reach_the_peer_table() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            let keypair = Keypair::generate_ed25519();
            let me = keypair.public().to_peer_id();
            let sync = testing::gossip(me, 8);
            let leave = CancellationToken::new();
            let (readout, feeds) = testing::readout(me, &sync, &leave);
            let mut config = NetworkConfig::new(keypair, testing::RUN_ID, "f");
            config.mdns = false;
            config.transport = TransportKind::Memory;
            // Never run: the actor's heartbeats wait in the network task's queue.
            let (client, events, _network) = network::new(config).unwrap();
            let dir = tempfile::tempdir().unwrap();
            let store = Arc::new(Store::open(&dir.path().join("node.redb")).unwrap());
            let (book, _write) = book::writer(store);
            let (_notes_tx, notes) = mpsc::channel(4);
            let (slow_tx, slow) = watch::channel(BTreeSet::new());
            let mut table = readout.watch_peers();
            let actor = MembershipActor {
                client,
                readout: readout.clone(),
                timeouts: Timeouts::default(),
                table: feeds.peers,
                listen: feeds.listen,
                reach: feeds.reach,
                client_mode: ClientMode::Never,
                events,
                notes,
                progress: readout.watch_progress(),
                engine: readout.watch_engine(),
                slow,
                book,
            };
            let running = tokio::spawn(run(actor, leave.clone()));
            let partner = PeerId::random();
            table.borrow_and_update();
            slow_tx.send_replace(BTreeSet::from([partner]));
            // A bool, not the watch's guard: held, it would block the actor's next write to
            // the table, and with it the actor's exit awaited below.
            let marked = tokio::time::timeout(
                Duration::from_secs(5),
                table.wait_for(|table| table.is_slow(&partner)),
            )
            .await
            .is_ok_and(|seen| seen.is_ok());
            leave.cancel();
            tokio::time::timeout(Duration::from_secs(10), running)
                .await
                .expect("the membership actor did not leave within 10 s")
                .expect("the membership actor panicked");
            assert!(marked, "the slow link was not in the peer table within 5 s");
        });
    }
}
