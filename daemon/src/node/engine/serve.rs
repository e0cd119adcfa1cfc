//! The responder's side of every stream protocol. The first frame of an inbound stream is read
//! within the exchange timeout, its header within the shorter request timeout
//! ([`read_request`]); the policy decides how to answer; the answer runs here ([`answer`]): an
//! exchange offer, an elastic worker's request at the center, or a state sync
//! (`state_sync::serve`).

use std::sync::Arc;

use crate::readout::Count;
use futures::AsyncWriteExt;
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{self, WireError};
use murmur_sync::machines::elastic::answer_worker;
use murmur_sync::machines::pairwise::Responder;
use murmur_sync::machines::{self, Head, Protocol};
use murmur_sync::policy::{Answer, Failure, Outcome, Request};
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use tokio::sync::oneshot;
use tracing::debug;

use murmur_sync::copies::CROSSING_WAIT;

use super::elastic::counted_stale;
use super::io::Opening;
use super::pairwise::{copies, count_mixed};
use super::{ExchangeContext, state_sync, stream_outcome, within};
use crate::node::messages::ToReplica;

/// An inbound stream whose first frame was read.
#[derive(Debug)]
pub(super) struct Inbound {
    stream: Stream,
    pub(super) request: Request,
    /// The worker's parameters of an elastic request; empty otherwise.
    payload: Vec<f32>,
    /// The request's head (an offer's codecs and copy version; a state request's optimizer
    /// buffers and the transfer it goes on with).
    head: Head,
}

/// Reads the request that opens `stream` (of `protocol`) from `peer`. A stream closed before
/// its first byte is a peer that went away; anything else that is not a valid request, a
/// truncated frame included, is an offence: a peer that dies mid-frame is scored once, a peer
/// that keeps doing it is blocked.
pub(super) async fn read_request(
    io: &ExchangeContext,
    peer: PeerId,
    protocol: &'static str,
    mut stream: Stream,
) -> Result<Inbound, Outcome> {
    within(&io.timeouts, async {
        let mut payload = Vec::new();
        let header = tokio::time::timeout(
            io.timeouts.request,
            wire::read_header(&mut stream, &io.expect()),
        )
        .await
        .map_err(|_| Outcome::Failed(Failure::TimedOut))?
        .map_err(request_outcome)?;
        io.receive_payload_from(peer, &mut stream, &header, &mut payload, |_, _| {})
            .await
            .map_err(request_outcome)?;
        io.saw_step(peer, header.step);
        debug!(peer = %peer, kind = ?header.kind, step = header.step, bytes = header.byte_len, "request received");
        let head = Head::from(&header);
        let protocol = if protocol == STATE_PROTOCOL {
            Protocol::State
        } else {
            Protocol::Params
        };
        let count = io.readout.identity().param_count;
        let request = machines::request(protocol, &head, &payload, count)?;
        Ok(Inbound {
            stream,
            request,
            payload,
            head,
        })
    })
    .await
}

fn request_outcome(e: WireError) -> Outcome {
    match e {
        WireError::Empty | WireError::Io(_) => stream_outcome(e),
        other => Outcome::Rejected(Rejection::Frame(other.to_string())),
    }
}

/// Answers `peer`'s request as the policy decided.
pub(super) async fn answer(
    io: &ExchangeContext,
    peer: PeerId,
    inbound: Inbound,
    answer: Answer,
) -> Outcome {
    let Inbound {
        mut stream,
        request,
        payload,
        head,
    } = inbound;
    let answered = match (answer, request) {
        (Answer::Exchange { weight, screen }, Request::Offer { .. }) => {
            let serving = serve_offer(io, peer, &mut stream, &head, weight, screen);
            within(&io.timeouts, serving).await
        }
        (Answer::Center { alpha, screen }, Request::Params { step }) => {
            let serving = serve_center(io, &mut stream, (step, payload), alpha, screen);
            within(&io.timeouts, serving).await
        }
        // A state takes as long as its chunks keep going out (`state_sync::serve`).
        (Answer::State, Request::State) => {
            state_sync::serve(io, &mut stream, head.buffers, head.resume).await
        }
        _ => within(&io.timeouts, not_now(io, &mut stream, Outcome::Busy)).await,
    };
    let outcome = answered.unwrap_or_else(|outcome| outcome);
    debug!(peer = %peer, ?outcome, "answered");
    outcome
}

/// The replica's snapshot to answer an offer with, and the end the replica then waits on (it
/// pauses until `end` is used or dropped, however the exchange ends); or, as `Err`, how serving
/// ended already: `Busy` when the replica did not answer (told to the peer). An offer is never
/// too old to answer: its step only sets the weight of the mix (decision 0029).
async fn answering(
    io: &ExchangeContext,
    peer: PeerId,
    stream: &mut Stream,
) -> Result<(Snapshot, oneshot::Sender<ExchangeEnd>), Result<Outcome, Outcome>> {
    let (end, ended) = oneshot::channel();
    let Some(snapshot) = io
        .ask_replica(|reply| ToReplica::Serve {
            reply,
            end: ended,
            overlap: io.slow.borrow().contains(&peer),
        })
        .await
    else {
        return Err(not_now(io, stream, Outcome::Busy).await);
    };
    Ok((snapshot, end))
}

/// Answers `busy` and ends serving with `outcome` (a failed write is the stream's failure).
pub(super) async fn not_now(
    io: &ExchangeContext,
    stream: &mut Stream,
    outcome: Outcome,
) -> Result<Outcome, Outcome> {
    io.busy(stream).await.map_err(stream_outcome)?;
    Ok(outcome)
}

/// The partner's side of a pairwise exchange, the sync crate's [`Responder`] machine driven
/// over the stream: our snapshot (or, compressed, our difference against the pair's copies)
/// goes out while the initiator's comes in, then its verdict, then the mix.
async fn serve_offer(
    io: &ExchangeContext,
    peer: PeerId,
    stream: &mut Stream,
    offer: &Head,
    weight: f32,
    screen: Screen,
) -> Result<Outcome, Outcome> {
    let count = io.readout.identity().param_count;
    // Our own offer to this peer may hold the pair's copies until its answer comes back.
    let mut lease = None;
    if Responder::codec(&io.sync, offer).is_some() {
        match io.pairs.lease_within(peer, count, CROSSING_WAIT).await {
            Some(held) => lease = Some(held),
            None => return not_now(io, stream, Outcome::Busy).await,
        }
    }
    let (snapshot, end) = match answering(io, peer, stream).await {
        Ok(answering) => answering,
        Err(done) => return done,
    };
    let mut machine = Responder::new(
        &io.sync,
        offer,
        Arc::new(snapshot),
        weight,
        screen,
        copies(&mut lease),
    );
    // Ours goes out while the initiator's comes in. The initiator may go away now (it left,
    // or gave up on us): a cut stream here is a failure, not an offence; anything it does
    // send must still be valid.
    let lent = copies(&mut lease);
    let mixed = (io.pump(peer, stream, &mut machine, Opening::Answers, lent)).await?;
    count_mixed(io, &mixed);
    // A compressed mix holds the pair's copies until it lands (decision 0092).
    let _ = end.send(mixed.end.holding(lease));
    Ok(mixed.outcome)
}

/// The center's side of an elastic exchange, the sync crate's [`answer_worker`]: the delta
/// that moves the center toward the worker, or `Busy` when the center declines (or this node
/// holds no center variable).
async fn serve_center(
    io: &ExchangeContext,
    stream: &mut Stream,
    worker: (u64, Vec<f32>),
    alpha: f32,
    screen: Screen,
) -> Result<Outcome, Outcome> {
    let own = io.own_step();
    let answered = {
        let mut center = io.center.lock().unwrap_or_else(|p| p.into_inner());
        center
            .as_mut()
            .map(|center| answer_worker(&io.sync, center, own, worker, alpha, screen))
    };
    match answered {
        Some(Ok(answered)) => {
            if answered.clipped {
                io.readout.counters().count(Count::Clipped);
            }
            let (head, payload) = answered.frame(own);
            io.send_head(stream, &head, payload)
                .await
                .map_err(stream_outcome)?;
            let _ = stream.close().await;
            Ok(answered.outcome)
        }
        Some(Err(outcome)) => not_now(io, stream, counted_stale(io, outcome)).await,
        // Not (or no longer) the center.
        None => not_now(io, stream, Outcome::Busy).await,
    }
}
