//! State sync (`/murmur/state/4`) on both sides. The requesting side: the sync crate's
//! [`Requester`] (the frames' order and checks, and the clock rule of decision 0042) run over a
//! stream by the engine's pump, and the state handed to the replica. The answering side
//! ([`serve`]): the replica's state in chunks, as the sync crate's [`state_frames`] lays it out.
//!
//! A transfer that is cut off goes on where it stopped (decision 0083): the requester keeps
//! the chunks that arrived ([`Transfers`]) and names the place in its next request to the same
//! source; the source keeps the state it sent ([`Transfers`]) for [`KEPT_FOR`] after it last
//! sent from it, so that it goes on with the same state. A transfer lasts as long as its
//! chunks keep coming, each within the exchange timeout, up to the state sync timeout.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::AsyncWriteExt;
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::Resume;
use murmur_sync::machines::state::{Partial, Requester, STATE_CHUNK_VALUES, Taken, state_frames};
use murmur_sync::policy::{Failure, Outcome};
use murmur_sync::rejection::Rejection;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::{Instrument, info};

use super::io::Opening;
use super::pairwise::outcome_label;
use super::serve::not_now;
use super::{ExchangeContext, Traced, stream_outcome};
use crate::events;
use crate::node::messages::{SyncState, ToReplica};
use crate::readout::Count;

/// How long after it last sent from a state a source keeps it, and a requester what arrived
/// of one: the requester asks again after its failure backoff, or once it has found the
/// source again after a broken connection.
pub(super) const KEPT_FOR: Duration = Duration::from_secs(60);

/// How often a requester notes a transfer's progress in the log.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// The transfers a cut-off transfer leaves to go on with, on both sides: what a requester
/// received of a state, and the state a source sent. One of each: a second takes the place of
/// the first (a cut-off transfer holds a share of a whole state, up to four models' worth).
#[derive(Debug, Default)]
pub(super) struct Transfers {
    received: Mutex<Option<Received>>,
    sent: Mutex<Option<Sent>>,
}

/// What a requester received of a state from `source` before its transfer was cut off.
#[derive(Debug)]
struct Received {
    source: PeerId,
    partial: Partial,
    at: Instant,
}

/// The state a source sent, under the id it gave it.
#[derive(Debug)]
struct Sent {
    id: u64,
    state: Arc<SentState>,
    /// When it last began or ended sending from it.
    at: Instant,
}

/// A state as a source sends it: the replica's, and the center it held.
#[derive(Debug)]
struct SentState {
    sync: SyncState,
    center: Option<Vec<f32>>,
}

fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Transfers {
    /// What arrived from `source` before a transfer was cut off, to go on with (anything that
    /// arrived from another source is let go: its state is not the one `source` holds).
    fn take_received(&self, source: PeerId) -> Option<Partial> {
        let received = locked(&self.received).take()?;
        (received.source == source).then_some(received.partial)
    }

    fn keep_received(&self, source: PeerId, partial: Partial) {
        *locked(&self.received) = Some(Received {
            source,
            partial,
            at: Instant::now(),
        });
    }

    /// The state sent under `id`, if this node still keeps it.
    fn sent(&self, id: u64) -> Option<Arc<SentState>> {
        let mut sent = locked(&self.sent);
        let kept = sent.as_mut().filter(|sent| sent.id == id)?;
        kept.at = Instant::now();
        Some(Arc::clone(&kept.state))
    }

    fn keep_sent(&self, id: u64, state: Arc<SentState>) {
        *locked(&self.sent) = Some(Sent {
            id,
            state,
            at: Instant::now(),
        });
    }

    /// Sending from the state sent under `id` ended: `whole`, no one goes on with it; cut
    /// off, it is kept for [`KEPT_FOR`] from now.
    fn sending_ended(&self, id: u64, whole: bool) {
        let mut sent = locked(&self.sent);
        match sent.as_mut().filter(|sent| sent.id == id) {
            Some(_) if whole => *sent = None,
            Some(kept) => kept.at = Instant::now(),
            None => {}
        }
    }

    /// Lets go what was kept longer than [`KEPT_FOR`] (a state that is being sent is kept).
    pub(super) fn expire(&self, now: Instant) {
        let stale = |at: Instant| now.saturating_duration_since(at) > KEPT_FOR;
        let mut received = locked(&self.received);
        if received.as_ref().is_some_and(|r| stale(r.at)) {
            *received = None;
        }
        let mut sent = locked(&self.sent);
        if sent
            .as_ref()
            .is_some_and(|s| stale(s.at) && Arc::strong_count(&s.state) == 1)
        {
            *sent = None;
        }
    }

    /// Whether this node keeps the state it sent under `id`.
    #[cfg(test)]
    fn keeps_sent(&self, id: u64) -> bool {
        locked(&self.sent)
            .as_ref()
            .is_some_and(|sent| sent.id == id)
    }

    /// Values of a state this node holds to go on with, as a requester.
    #[cfg(test)]
    fn received_values(&self) -> Option<u64> {
        locked(&self.received).as_ref().map(|r| r.partial.values())
    }
}

/// What a state sync took over.
#[derive(Debug)]
pub(super) struct Pulled {
    /// The step this replica was at before.
    pub(super) from: u64,
    /// The step it continues from.
    pub(super) step: u64,
    /// The peer's elastic center, to seed from if this node becomes the center.
    pub(super) center: Option<Vec<f32>>,
}

/// Takes over `peer`'s state, chosen for the clock it `announced`: downloads it (going on
/// with what a cut-off transfer from `peer` left), and returns once the replica continues
/// from it.
pub(super) async fn pull(
    io: &ExchangeContext,
    peer: PeerId,
    announced: u64,
) -> Result<Pulled, Outcome> {
    let mut span = Traced::new(tracing::info_span!(
        "state_sync",
        peer = %peer,
        step = tracing::field::Empty,
        outcome = tracing::field::Empty,
        bytes_received = tracing::field::Empty,
        resumed_at_bytes = tracing::field::Empty,
    ));
    let counters = io.readout.counters();
    let before = counters.get(Count::BytesReceived);
    let pulled = take_over(io, peer, announced, &span)
        .instrument(span.span().clone())
        .await;
    let received = counters.get(Count::BytesReceived).saturating_sub(before);
    counters.add(Count::StateBytesReceived, received);
    span.span().record("bytes_received", received);
    match &pulled {
        Ok(pulled) => {
            span.span().record("step", pulled.step);
            span.outcome("ok");
        }
        Err(outcome) => span.outcome(outcome_label(outcome)),
    }
    pulled
}

/// The state sync itself, the sync crate's [`Requester`] driven over a stream.
async fn take_over(
    io: &ExchangeContext,
    peer: PeerId,
    announced: u64,
    span: &Traced,
) -> Result<Pulled, Outcome> {
    let from = io.own_step();
    let id = io.readout.identity();
    let names = id.optimizer_buffers.clone();
    let mut requester = Requester::new(
        from,
        announced,
        io.sync.max_staleness,
        names,
        id.param_count,
    );
    if let Some(partial) = io.transfers.take_received(peer) {
        requester = requester.going_on(partial);
    }
    let resumed_at = requester.arrived_values() * 4;
    let resumed = resumed_at > 0;
    if resumed {
        info!(peer = %peer, bytes = resumed_at, "going on with a state transfer that was cut off");
        span.span().record("resumed_at_bytes", resumed_at);
    }
    let expected = requester.expected_values() * 4;
    let transfer = async {
        let mut stream = io
            .open(peer, STATE_PROTOCOL)
            .await
            .map_err(Outcome::Failed)?;
        io.pump(peer, &mut stream, &mut requester, Opening::Asks, None)
            .await
    };
    let taken = while_it_comes(io, peer, (resumed_at, expected), transfer).await;
    let Taken {
        replica,
        outer,
        center,
    } = match taken {
        Ok(taken) => taken,
        Err(outcome) => {
            // A transfer cut off keeps what arrived; one refused lets it go.
            if let (Outcome::Failed(_), Some(partial)) = (&outcome, requester.cut_off()) {
                io.transfers.keep_received(peer, partial);
            }
            return Err(outcome);
        }
    };
    if resumed {
        io.readout.counters().count(Count::StateSyncResumed);
    }
    let step = replica.step;
    let (adopted, done) = oneshot::channel();
    let state = SyncState { replica, outer };
    if io
        .replica
        .try_send(ToReplica::Adopt { state, adopted })
        .is_err()
    {
        return Err(Outcome::Failed(Failure::Replica));
    }
    // Only once the replica is at the peer's step may this node count as joined: before, its
    // heartbeats would announce its old clock and close every peer's gate.
    match tokio::time::timeout(io.timeouts.replica_answer, done).await {
        Ok(Ok(Ok(()))) => Ok(Pulled { from, step, center }),
        Ok(Ok(Err(why))) => Err(Outcome::Rejected(Rejection::ForeignState(why))),
        _ => Err(Outcome::Failed(Failure::Replica)),
    }
}

/// Runs a state `transfer` from `peer` while its bytes keep coming: it is cut off once no
/// tensor bytes arrived for the exchange timeout, or at the state sync timeout; its progress
/// (`resumed_at` bytes brought by a cut-off transfer it goes on from, `expected` bytes of a
/// whole state at least) goes to the log every [`PROGRESS_EVERY`]. The bytes are the node's
/// count of all it receives: a joiner receives little else.
async fn while_it_comes<T>(
    io: &ExchangeContext,
    peer: PeerId,
    (resumed_at, expected): (u64, u64),
    transfer: impl Future<Output = Result<T, Outcome>>,
) -> Result<T, Outcome> {
    let counters = io.readout.counters();
    let started = counters.get(Count::BytesReceived);
    let watch = async {
        let mut last = (started, Instant::now());
        loop {
            tokio::time::sleep(PROGRESS_EVERY.min(io.timeouts.exchange)).await;
            let now = counters.get(Count::BytesReceived);
            if now != last.0 {
                last = (now, Instant::now());
                let received = now - started;
                info!(
                    event = events::STATE_SYNC_PROGRESS,
                    peer = %peer,
                    received,
                    expected,
                    resumed_at,
                    "state transfer under way"
                );
            } else if last.1.elapsed() >= io.timeouts.exchange {
                return;
            }
        }
    };
    let limited = tokio::time::timeout(io.timeouts.state_sync, transfer);
    tokio::select! {
        done = limited => done.unwrap_or(Err(Outcome::Failed(Failure::TimedOut))),
        () = watch => Err(Outcome::Failed(Failure::TimedOut)),
    }
}

/// Answers a state request with this node's state, in chunks: parameters and clock, its
/// optimizer's state buffers when the requester's optimizer keeps the same (`optimizer`,
/// their names; the replica decides), the outer loop's anchor and velocity where there is
/// one, then the center if this node holds it. A request that goes on with a state this node
/// still keeps (`resume`) gets the rest of it; any other, this node's state now.
pub(super) async fn serve(
    io: &ExchangeContext,
    stream: &mut Stream,
    optimizer: Vec<String>,
    resume: Option<Resume>,
) -> Result<Outcome, Outcome> {
    let kept = resume.and_then(|resume| Some((resume, io.transfers.sent(resume.state)?)));
    let (from, state) = match kept {
        Some(kept) => kept,
        None => {
            let asked = io
                .ask_replica(|reply| ToReplica::State { optimizer, reply })
                .await;
            let Some(sync) = asked else {
                return not_now(io, stream, Outcome::Busy).await;
            };
            let center = io.center.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let state = Arc::new(SentState { sync, center });
            let id = rand::random();
            io.transfers.keep_sent(id, Arc::clone(&state));
            (Resume { state: id, at: 0 }, state)
        }
    };
    let frames = state_frames(
        &state.sync.replica,
        state.sync.outer.as_ref(),
        state.center.as_deref(),
        from,
        STATE_CHUNK_VALUES,
    );
    let sending = async {
        for (head, payload) in frames {
            // A requester that stops reading is let go after the exchange timeout.
            tokio::time::timeout(io.timeouts.exchange, io.send_head(stream, &head, payload))
                .await
                .map_err(|_| Outcome::Failed(Failure::TimedOut))?
                .map_err(stream_outcome)?;
        }
        Ok(())
    };
    let sent = sending.await;
    io.transfers.sending_ended(from.state, sent.is_ok());
    sent?;
    let _ = stream.close().await;
    Ok(Outcome::StateSent)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> Arc<SentState> {
        Arc::new(SentState {
            sync: SyncState {
                replica: murmur_sync::replica::ReplicaState {
                    step: 3,
                    params: vec![1.0; 4],
                    optimizer: None,
                },
                outer: None,
            },
            center: None,
        })
    }

    /// A state being sent stays; one cut off is kept for [`KEPT_FOR`] from the cut; one sent
    /// whole goes at once.
    #[tokio::test(start_paused = true)]
    async fn a_state_sent_is_kept_while_sent_and_a_while_after_a_cut() {
        let transfers = Transfers::default();
        transfers.keep_sent(9, state());
        let sending = transfers.sent(9).expect("kept");
        assert!(transfers.sent(8).is_none(), "another id");
        tokio::time::advance(KEPT_FOR * 2).await;
        transfers.expire(Instant::now());
        assert!(transfers.keeps_sent(9), "being sent");
        drop(sending);
        transfers.sending_ended(9, false);
        tokio::time::advance(KEPT_FOR / 2).await;
        transfers.expire(Instant::now());
        assert!(transfers.keeps_sent(9), "cut off a moment ago");
        tokio::time::advance(KEPT_FOR).await;
        transfers.expire(Instant::now());
        assert!(!transfers.keeps_sent(9), "let go");

        transfers.keep_sent(10, state());
        transfers.sending_ended(10, true);
        assert!(!transfers.keeps_sent(10), "sent whole");
        assert_eq!(transfers.received_values(), None);
    }
}
