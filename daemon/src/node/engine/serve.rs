//! The responder's side of every stream protocol. The first frame of an inbound stream is read
//! within the exchange timeout, its header within the shorter request timeout
//! ([`read_request`]); the policy decides how to answer; the answer runs here ([`answer`]): an
//! exchange offer, an elastic worker's request at the center, or a state sync.

use std::sync::Arc;

use futures::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use murmur_protocol::mix;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{self, Codec, MessageKind, WireError};
use murmur_protocol::{PARAMS_PROTOCOL, STATE_PROTOCOL};
use murmur_sync::policy::{Answer, Failure, Outcome, Request};
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::{self, Screen};
use tokio::sync::oneshot;
use tracing::debug;

use murmur_sync::copies::CROSSING_WAIT;

use super::pairwise::{clip, commit_and_mix};
use super::{ExchangeContext, stream_outcome, within};
use crate::node::messages::{SyncState, ToReplica};

/// An inbound stream whose first frame was read.
#[derive(Debug)]
pub(super) struct Inbound {
    stream: Stream,
    pub(super) request: Request,
    /// The worker's parameters of an elastic request; empty otherwise.
    payload: Vec<f32>,
    /// An offer of a compressed exchange that this node takes.
    compressed: Option<Compressed>,
    /// A state request: the optimizer buffers the requester keeps.
    optimizer: Vec<String>,
}

/// A compressed exchange as an offer asks for it: the first codec of its list that this node
/// takes, and the version of the pair's copies.
#[derive(Debug)]
struct Compressed {
    codec: Codec,
    reference: Option<u64>,
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
        io.receive_payload_from(peer, &mut stream, &header, &mut payload)
            .await
            .map_err(request_outcome)?;
        io.saw_step(peer, header.step);
        debug!(peer = %peer, kind = ?header.kind, step = header.step, bytes = header.byte_len, "request received");
        let request = match (protocol, header.kind) {
            (PARAMS_PROTOCOL, MessageKind::Offer) if header.byte_len == 0 => Request::Offer {
                step: header.step,
            },
            (PARAMS_PROTOCOL, MessageKind::Params) => {
                let count = io.readout.identity().param_count;
                screen::full_and_finite(&payload, count, "parameters")
                    .map_err(Outcome::Rejected)?;
                Request::Params { step: header.step }
            }
            (STATE_PROTOCOL, MessageKind::State) if header.byte_len == 0 => Request::State,
            (protocol, kind) => {
                return Err(Outcome::Rejected(Rejection::Unexpected {
                    what: if protocol == STATE_PROTOCOL {
                        "on the state protocol"
                    } else {
                        "on the params protocol"
                    },
                    kind: format!("{kind:?} with {} bytes", header.byte_len),
                }));
            }
        };
        let codec = header.accept.iter().copied().find(|&c| io.sync.takes(c));
        Ok(Inbound {
            stream,
            request,
            payload,
            compressed: codec.map(|codec| Compressed {
                codec,
                reference: header.reference,
            }),
            optimizer: header.buffers,
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
        compressed,
        optimizer,
    } = inbound;
    let answered = within(&io.timeouts, async {
        match (answer, request) {
            (Answer::Exchange { weight, screen }, Request::Offer { step }) => match compressed {
                Some(offer) => {
                    serve_compressed(io, peer, &mut stream, step, offer, weight, screen).await
                }
                None => serve_offer(io, peer, &mut stream, step, weight, screen).await,
            },
            (Answer::Center { alpha, screen }, Request::Params { step }) => {
                serve_center(io, &mut stream, step, payload, alpha, screen).await
            }
            (Answer::State, Request::State) => serve_state(io, &mut stream, optimizer).await,
            _ => {
                io.busy(&mut stream).await.map_err(stream_outcome)?;
                Ok(Outcome::Busy)
            }
        }
    })
    .await;
    let outcome = answered.unwrap_or_else(|outcome| outcome);
    debug!(peer = %peer, ?outcome, "answered");
    outcome
}

/// The replica's snapshot to answer an offer of `offer_step` with, the weight to mix with, and
/// the end the replica then waits on (it pauses until `end` is used or dropped, however the
/// exchange ends); or, as `Err`, how serving ended already: `Busy` when the replica did not
/// answer (told to the peer). An offer is never too old to answer: its step only sets the
/// weight of the mix (decision 0029).
async fn answering(
    io: &ExchangeContext,
    peer: PeerId,
    stream: &mut Stream,
    offer_step: u64,
    weight: f32,
) -> Result<(Snapshot, f32, oneshot::Sender<ExchangeEnd>), Result<Outcome, Outcome>> {
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
    let weight = io.partner_weight(snapshot.step, offer_step, weight);
    Ok((snapshot, weight, end))
}

/// Answers `busy` and ends serving with `outcome` (a failed write is the stream's failure).
async fn not_now(
    io: &ExchangeContext,
    stream: &mut Stream,
    outcome: Outcome,
) -> Result<Outcome, Outcome> {
    io.busy(stream).await.map_err(stream_outcome)?;
    Ok(outcome)
}

/// The partner's side of a pairwise exchange: our snapshot (or `Busy`) while the initiator's
/// parameters come in (or its `Busy`: it declined), then its verdict, then the mix.
async fn serve_offer(
    io: &ExchangeContext,
    peer: PeerId,
    stream: &mut Stream,
    offer_step: u64,
    weight: f32,
    screen: Screen,
) -> Result<Outcome, Outcome> {
    let (snapshot, weight, end) = match answering(io, peer, stream, offer_step, weight).await {
        Ok(answering) => answering,
        Err(done) => return done,
    };
    // Ours goes out while the initiator's comes in. The initiator may go away now (it left,
    // or gave up on us): a cut stream here is a failure, not an offence; anything it does
    // send must still be valid.
    let (mut reader, mut writer) = (&mut *stream).split();
    let mut other = Vec::new();
    let (sent, answer) = futures::join!(
        io.send(
            &mut writer,
            MessageKind::Params,
            snapshot.step,
            &snapshot.params
        ),
        io.receive_from(peer, &mut reader, &mut other),
    );
    let answer = answer.map_err(stream_outcome)?;
    match answer.kind {
        MessageKind::Params => {}
        MessageKind::Busy => return Ok(Outcome::Busy),
        kind => {
            return Err(Outcome::Rejected(Rejection::Unexpected {
                what: "as the answer to our snapshot",
                kind: format!("{kind:?}"),
            }));
        }
    }
    sent.map_err(stream_outcome)?;
    if !accepted(io, &mut reader).await? {
        return Ok(Outcome::Busy);
    }
    let count = io.readout.identity().param_count;
    screen::full_and_finite(&other, count, "parameters").map_err(Outcome::Rejected)?;
    let admitted = match screen.admit(mix::distance(&other, &snapshot.params), &snapshot.params) {
        Ok(admitted) => admitted,
        Err(outlier) => return Ok(outlier),
    };
    let mixed = clip(io, admitted, &mut other, &snapshot.params);
    let _ = end.send(ExchangeEnd::Mix {
        other,
        base: Arc::new(snapshot),
        weight,
    });
    Ok(mixed)
}

/// [`serve_offer`] for a compressed exchange: our difference against the pair's copies (at the
/// offer's version, or zero copies when the versions disagree) while the initiator's comes in.
async fn serve_compressed(
    io: &ExchangeContext,
    peer: PeerId,
    stream: &mut Stream,
    offer_step: u64,
    offer: Compressed,
    weight: f32,
    screen: Screen,
) -> Result<Outcome, Outcome> {
    let codec = offer.codec;
    let count = io.readout.identity().param_count;
    // Our own offer to this peer may hold the copies until its answer comes back.
    let Some(mut lease) = io.pairs.lease_within(peer, count, CROSSING_WAIT).await else {
        return not_now(io, stream, Outcome::Busy).await;
    };
    let (snapshot, weight, end) = match answering(io, peer, stream, offer_step, weight).await {
        Ok(answering) => answering,
        Err(done) => return done,
    };
    let version = lease.agree(offer.reference);
    // Ours goes out while the initiator's comes in.
    let (mut reader, mut writer) = (&mut *stream).split();
    let mut received = Vec::new();
    let (sent, answer) = futures::join!(
        io.send_difference(
            &mut writer,
            snapshot.step,
            codec,
            &lease.copies,
            &snapshot.params,
        ),
        io.receive_from(peer, &mut reader, &mut received),
    );
    let answer = answer.map_err(stream_outcome)?;
    match answer.kind {
        MessageKind::Params if answer.codec == codec && answer.reference == Some(version) => {}
        MessageKind::Busy => return Ok(Outcome::Busy),
        kind => {
            return Err(Outcome::Rejected(Rejection::Unexpected {
                what: "as the answer to our compressed difference",
                kind: format!("{kind:?} ({:?}, copy {:?})", answer.codec, answer.reference),
            }));
        }
    }
    let sent = sent.map_err(stream_outcome)?;
    if !accepted(io, &mut reader).await? {
        return Ok(Outcome::Busy);
    }
    screen::full_and_finite(&received, count, "parameters").map_err(Outcome::Rejected)?;
    let theirs = lease.copies.theirs_after(&received);
    screen::full_and_finite(&theirs, count, "parameters").map_err(Outcome::Rejected)?;
    let admitted = match screen.admit(lease.copies.gap_after(&sent, &theirs), &snapshot.params) {
        Ok(admitted) => admitted,
        Err(outlier) => return Ok(outlier),
    };
    let mut other = commit_and_mix(
        io,
        codec,
        &mut lease.copies,
        &sent,
        theirs,
        &snapshot.params,
    );
    let mixed = clip(io, admitted, &mut other, &snapshot.params);
    let _ = end.send(ExchangeEnd::Mix {
        other,
        base: Arc::new(snapshot),
        weight,
    });
    Ok(mixed)
}

/// The initiator's verdict once its parameters are in: the stream's end (it mixes ours) or
/// `busy` (it declined them, so we do not mix either). Anything else is an offence.
async fn accepted(
    io: &ExchangeContext,
    stream: &mut (impl AsyncRead + Unpin),
) -> Result<bool, Outcome> {
    match wire::read_header(stream, &io.expect()).await {
        Err(WireError::Empty) => Ok(true),
        Ok(header) if header.kind == MessageKind::Busy && header.byte_len == 0 => Ok(false),
        Ok(header) => Err(Outcome::Rejected(Rejection::Unexpected {
            what: "after the initiator's parameters",
            kind: format!("{:?} with {} bytes", header.kind, header.byte_len),
        })),
        Err(e) => Err(stream_outcome(e)),
    }
}

/// The center's side of an elastic exchange: the delta that moves the center toward the worker
/// (the worker clipped within the screen's radius of the center first: no worker moves the
/// center farther than the others do).
async fn serve_center(
    io: &ExchangeContext,
    stream: &mut Stream,
    worker_step: u64,
    mut worker: Vec<f32>,
    alpha: f32,
    screen: Screen,
) -> Result<Outcome, Outcome> {
    let own = io.own_step();
    let Some(weight) = io.weight(own, worker_step, 1.0) else {
        return not_now(io, stream, Outcome::Stale).await;
    };
    let stepped = {
        let mut center = io.center.lock().unwrap_or_else(|p| p.into_inner());
        center.as_mut().map(|center| {
            let admitted = screen.admit(mix::distance(&worker, center), center)?;
            let mixed = clip(io, admitted, &mut worker, center);
            Ok((mixed, mix::elastic_step(center, &worker, alpha * weight)))
        })
    };
    match stepped {
        Some(Ok((mixed, delta))) => {
            io.send(stream, MessageKind::Delta, own, &delta)
                .await
                .map_err(stream_outcome)?;
            let _ = stream.close().await;
            Ok(mixed)
        }
        Some(Err(outlier)) => not_now(io, stream, outlier).await,
        // Not (or no longer) the center.
        None => not_now(io, stream, Outcome::Busy).await,
    }
}

/// Answers a state request with this node's parameters and clock, its optimizer's state
/// buffers when the requester's optimizer keeps the same (`optimizer`, their names), the outer
/// loop's anchor and velocity where there is one, then the center if this node holds it.
async fn serve_state(
    io: &ExchangeContext,
    stream: &mut Stream,
    optimizer: Vec<String>,
) -> Result<Outcome, Outcome> {
    let asked = io
        .ask_replica(|reply| ToReplica::State { optimizer, reply })
        .await;
    let Some(SyncState { replica, outer }) = asked else {
        return not_now(io, stream, Outcome::Busy).await;
    };
    io.send(stream, MessageKind::State, replica.step, &replica.params)
        .await
        .map_err(stream_outcome)?;
    if let Some(optimizer) = &replica.optimizer {
        for buffer in &optimizer.buffers {
            // An optimizer's own update count (AdamW's bias correction) stamps its buffers.
            let mut header =
                io.payload_header(MessageKind::Optimizer, optimizer.updates, &buffer.values);
            header.buffers = vec![buffer.name.clone()];
            io.send_frame(stream, &header, &buffer.values)
                .await
                .map_err(stream_outcome)?;
        }
    }
    if let Some(outer) = &outer {
        io.send(
            stream,
            MessageKind::Anchor,
            outer.anchor_step,
            &outer.anchor,
        )
        .await
        .map_err(stream_outcome)?;
        if !outer.velocity.is_empty() {
            io.send(stream, MessageKind::Velocity, replica.step, &outer.velocity)
                .await
                .map_err(stream_outcome)?;
        }
    }
    let center = io.center.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if let Some(center) = center {
        io.send(stream, MessageKind::Center, replica.step, &center)
            .await
            .map_err(stream_outcome)?;
    }
    let _ = stream.close().await;
    Ok(Outcome::StateSent)
}
