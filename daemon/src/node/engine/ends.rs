//! The ends of the engine's tasks: what each came back with, turned into the policy's input,
//! the counters and the replica's mix.

use std::sync::Arc;
use std::time::Instant;

use murmur_protocol::network::PeerId;
use murmur_protocol::ring::{RingError, RoundTraffic};
use murmur_protocol::throttle::{LOG_LINES, LogThrottle};
use murmur_sync::policy::{Adopted, Failure, Input, Outcome};
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::sides::Side;
use tracing::{debug, info, warn};

use super::{Engine, ring, serve, state_sync};
use crate::clock;
use crate::events;
use crate::readout::Count;

/// What a task of the engine came back with.
#[derive(Debug)]
pub(super) enum Done {
    /// The first frame of an inbound stream was read (boxed: the stream and the request's
    /// head are most of a task's answer).
    Request {
        peer: PeerId,
        read: Result<Box<serve::Inbound>, Outcome>,
    },
    /// An exchange this node started ended; `end` is for the replica, `back` the due snapshot
    /// where a pairwise offer still held it.
    Exchanged {
        peer: PeerId,
        outcome: Outcome,
        end: Option<ExchangeEnd>,
        started: Instant,
        back: Option<Arc<Snapshot>>,
    },
    /// An exchange (or request) this node answered ended.
    Served {
        peer: PeerId,
        outcome: Outcome,
    },
    StateSynced {
        peer: PeerId,
        result: Result<state_sync::Pulled, Outcome>,
    },
    Round {
        ring: Box<ring::RingIo>,
        round: u64,
        peers: usize,
        result: Result<(Vec<f32>, RoundTraffic), RingError>,
        started: Instant,
    },
    CenterSeeded(Option<Vec<f32>>),
}

impl Engine {
    pub(super) fn on_done(
        &mut self,
        done: Result<(tokio::task::Id, Done), tokio::task::JoinError>,
    ) {
        let (id, done) = match done {
            Ok(done) => done,
            Err(e) => {
                self.aborts.remove(&e.id());
                let side = self.sides.close(e.id());
                if e.is_panic() {
                    warn!(?side, "an engine task panicked");
                }
                // A task given up because its peer left (`Action::Cancel`).
                if let Some((peer, side)) = side {
                    self.cancelled(peer, side);
                }
                return;
            }
        };
        self.aborts.remove(&id);
        let side = self.sides.close(id).map(|(_, side)| side);
        match done {
            Done::Request { peer, read } => match read {
                Ok(inbound) => {
                    let request = inbound.request;
                    self.request = Some((peer, *inbound));
                    self.input(Input::Request { peer, request });
                    // An answer the policy did not give (it never fails to) drops the stream.
                    self.request = None;
                }
                Err(outcome) => self.count_served(peer, outcome, side),
            },
            Done::Exchanged {
                peer,
                outcome,
                end,
                started,
                back,
            } => {
                let counters = self.io.readout.counters();
                match &outcome {
                    Outcome::Mixed { .. } => {
                        counters.count(Count::Exchange);
                        self.io
                            .readout
                            .timings()
                            .exchange_done(clock::since(started));
                        debug!(peer = %peer, ms = clock::since(started).as_millis() as u64, "exchange done");
                    }
                    Outcome::Busy => counters.count(Count::Busy),
                    Outcome::Failed(failure) => {
                        counters.count(Count::Failed);
                        match failure {
                            Failure::TimedOut => {
                                static TIMED_OUT: LogThrottle = LogThrottle::new(LOG_LINES);
                                if let Some(held) = TIMED_OUT.allow() {
                                    warn!(peer = %peer, held, "exchange timed out");
                                }
                            }
                            other => debug!(peer = %peer, reason = %other, "exchange failed"),
                        }
                    }
                    // Declined as too far from this replica: counted, not an offence.
                    Outcome::Outlier { distance } => {
                        counters.count(Count::Rejected);
                        debug!(peer = %peer, distance, "declined: parameters too far from this replica");
                    }
                    Outcome::Stale | Outcome::Rejected(_) | Outcome::StateSent => {}
                }
                if let Some(end) = end {
                    self.deliver(end);
                }
                self.offered_back(back);
                self.ended(peer, side, outcome);
            }
            Done::Served { peer, outcome } => self.count_served(peer, outcome, side),
            Done::StateSynced { peer, result } => {
                let result = match result {
                    Ok(pulled) => {
                        self.io.readout.counters().count(Count::StateSync);
                        info!(event = events::STATE_SYNC_DONE, peer = %peer, from = pulled.from, to = pulled.step, "state sync done");
                        if pulled.center.is_some() {
                            self.inherited_center = pulled.center;
                        }
                        Ok(Adopted {
                            from: pulled.from,
                            step: pulled.step,
                        })
                    }
                    Err(outcome) => {
                        match &outcome {
                            Outcome::Failed(failure) => {
                                warn!(peer = %peer, reason = %failure, "state sync failed; retrying");
                            }
                            other => debug!(peer = %peer, outcome = ?other, "state sync refused"),
                        }
                        return self.ended(peer, side, outcome);
                    }
                };
                self.input(Input::StateSynced { peer, result });
            }
            Done::Round {
                ring,
                round,
                peers,
                result,
                started,
            } => {
                self.ring = Some(ring);
                let result = match result {
                    Ok((mean, traffic)) => {
                        let counters = self.io.readout.counters();
                        counters.add(Count::BytesSent, traffic.bytes_sent);
                        counters.add(Count::BytesReceived, traffic.bytes_received);
                        counters.count(Count::Exchange);
                        let values = mean.len();
                        self.deliver(ExchangeEnd::Reduced { step: round, mean });
                        let took = clock::since(started);
                        self.io
                            .readout
                            .timings()
                            .ring_round_done(took, values, peers);
                        debug!(
                            round,
                            peers,
                            ms = took.as_secs_f64() * 1e3,
                            "ring round done"
                        );
                        Ok(())
                    }
                    Err(e) => {
                        self.io.readout.counters().count(Count::Failed);
                        warn!(event = events::RING_ROUND_ABORTED, round, peers, error = %e, "ring round aborted; re-forming the ring");
                        Err(e)
                    }
                };
                self.input(Input::RoundEnded { round, result });
            }
            Done::CenterSeeded(seed) => {
                let ok = seed.is_some();
                *self.io.center.lock().unwrap_or_else(|p| p.into_inner()) = seed;
                self.input(Input::CenterSeeded { ok });
            }
        }
    }

    /// Counts how an answered exchange (or request) ended and tells the policy.
    pub(super) fn count_served(&mut self, peer: PeerId, outcome: Outcome, side: Option<Side>) {
        let counters = self.io.readout.counters();
        match &outcome {
            Outcome::Mixed { .. } => counters.count(Count::Served),
            Outcome::Outlier { distance } => {
                counters.count(Count::Rejected);
                debug!(peer = %peer, distance, "declined: parameters too far from this replica");
            }
            Outcome::Failed(failure) => {
                counters.count(Count::Failed);
                debug!(peer = %peer, reason = %failure, "answering failed");
            }
            _ => {}
        }
        self.ended(peer, side, outcome);
    }

    /// Tells the policy how `peer`'s `side` ended, as the sides' rule has it.
    fn ended(&mut self, peer: PeerId, side: Option<Side>, outcome: Outcome) {
        if let Some(input) = side.and_then(|side| side.ended(peer, outcome)) {
            self.input(input);
        }
    }

    /// A task given up because its peer left.
    pub(super) fn cancelled(&mut self, peer: PeerId, side: Side) {
        if side == Side::Exchange {
            self.io.readout.counters().count(Count::Failed);
            // A pairwise offer given up took the due snapshot with it.
            self.offered_back(None);
        }
        if let Some(input) = side.cancelled(peer) {
            self.input(input);
        }
    }
}
