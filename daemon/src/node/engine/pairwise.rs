//! The initiator's side of a pairwise exchange on `/murmur/params/2`: `Offer`, the partner's
//! `Params` (or `Busy`), and ours written while the partner's comes in, then the end of the
//! stream, or `Busy` when what came back fails its checks. Nothing large is sent to a busy
//! partner, both directions of the link carry a snapshot at once (decision 0027), and the
//! partner mixes only once the stream ends without a `Busy`, so that both sides mix or neither.
//!
//! With a compressed codec (`sync.codec`, or top-k where `sync.adapt_codec` chose it for a slow
//! link), the offer names the codecs this node takes, in order of preference, and the version
//! of the pair's copies (see `copies`); `Params` then carry compressed differences against
//! those copies through the first codec the partner takes, and the mix moves the replica by
//! `weight (theirs - own)`.

use std::sync::Arc;

use futures::{AsyncReadExt, AsyncWrite, AsyncWriteExt};
use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::mix;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{Codec, MessageKind, TensorHeader};
use murmur_sync::copies::mixed_other;
use murmur_sync::policy::Outcome;
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::{self, Admitted, Screen};
use tracing::Instrument;

use super::{Copies, ExchangeContext, Traced, stream_outcome, within};
use crate::readout::Count;

/// Offers `snapshot` to `peer` through `codec`, to be mixed with `weight` (before age
/// weighting) as `screen` passes the partner's parameters. Returns the outcome and, after a
/// mix, the replica's end.
pub(super) async fn offer(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: Arc<Snapshot>,
    codec: Codec,
    weight: f32,
    screen: Screen,
) -> (Outcome, Option<ExchangeEnd>) {
    let mut span = Traced::new(exchange_span(peer, snapshot.step));
    let result = within(
        &io.timeouts,
        exchange(io, peer, &snapshot, codec, weight, screen),
    )
    .instrument(span.span().clone())
    .await;
    match result {
        Ok((mixed, other, weight)) => {
            record_exchange(&mut span, "ok", snapshot.params.len(), other.len());
            let end = ExchangeEnd::Mix {
                other,
                base: snapshot,
                weight,
            };
            (mixed, Some(end))
        }
        Err(outcome) => {
            record_exchange(&mut span, outcome_label(&outcome), 0, 0);
            (outcome, None)
        }
    }
}

/// The exchange itself: its outcome ([`Outcome::Mixed`]), the partner's parameters, and the
/// weight to mix them with.
async fn exchange(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: &Snapshot,
    codec: Codec,
    weight: f32,
    screen: Screen,
) -> Result<(Outcome, Vec<f32>, f32), Outcome> {
    if codec != Codec::F32 {
        return compressed(io, peer, snapshot, codec, weight, screen).await;
    }
    let offer = io.header(MessageKind::Offer, snapshot.step, Codec::F32, 0, &[]);
    let (mut stream, header) = io.ask_header(peer, PARAMS_PROTOCOL, &offer, &[]).await?;
    answered_with_params(&mut stream, &header).await?;
    let weight = weigh(io, peer, snapshot, &header, weight);
    let (mut reader, mut writer) = stream.split();
    let mut other = Vec::new();
    let (received, sent) = futures::join!(
        io.receive_payload_from(peer, &mut reader, &header, &mut other),
        io.send(
            &mut writer,
            MessageKind::Params,
            snapshot.step,
            &snapshot.params
        ),
    );
    sent.map_err(stream_outcome)?;
    let param_count = io.readout.identity().param_count;
    let other = received.map_err(stream_outcome).and_then(|()| {
        screen::full_and_finite(&other, param_count, "parameters").map_err(Outcome::Rejected)?;
        Ok(other)
    });
    let judged = other.map(|other| {
        let distance = mix::distance(&other, &snapshot.params);
        (other, distance)
    });
    let (mut other, admitted) = conclude(io, &mut writer, snapshot, judged, screen).await?;
    let mixed = clip(io, admitted, &mut other, &snapshot.params);
    Ok((mixed, other, weight))
}

/// A compressed exchange: the same steps as [`exchange`] on differences against the pair's
/// copies, through `preferred` or, if the partner does not take it, `sync.codec`. The
/// parameters it returns are shifted so that the replica's mix is CHOCO's consensus step (see
/// [`mixed_other`]).
async fn compressed(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: &Snapshot,
    preferred: Codec,
    weight: f32,
    screen: Screen,
) -> Result<(Outcome, Vec<f32>, f32), Outcome> {
    let Some(mut lease) = io.pairs.lease(peer, snapshot.params.len()) else {
        // An exchange with this partner (it asked us) is under way.
        return Err(Outcome::Busy);
    };
    let mut offer = io.header(MessageKind::Offer, snapshot.step, Codec::F32, 0, &[]);
    offer.accept = vec![preferred];
    if preferred != io.sync.codec {
        offer.accept.push(io.sync.codec);
    }
    offer.reference = Some(lease.copies.version);
    let (mut stream, header) = io.ask_header(peer, PARAMS_PROTOCOL, &offer, &[]).await?;
    answered_with_params(&mut stream, &header).await?;
    let codec = header.codec;
    let Some(version) = header.reference.filter(|_| offer.accept.contains(&codec)) else {
        return Err(Outcome::Rejected(Rejection::Unexpected {
            what: "as the answer to a compressed offer",
            kind: format!("{:?} without a copy's version", header.codec),
        }));
    };
    // The partner answers against our version, or starts both sides again from zero copies.
    if version != lease.copies.version {
        if version != 0 {
            return Err(Outcome::Rejected(Rejection::Unexpected {
                what: "as the answer to a compressed offer",
                kind: format!("a difference against copy version {version}"),
            }));
        }
        lease.agree(Some(0));
    }
    let weight = weigh(io, peer, snapshot, &header, weight);
    let (mut reader, mut writer) = stream.split();
    let mut received = Vec::new();
    let (read, sent) = futures::join!(
        io.receive_payload_from(peer, &mut reader, &header, &mut received),
        io.send_difference(
            &mut writer,
            snapshot.step,
            codec,
            &lease.copies,
            &snapshot.params,
        ),
    );
    let sent = sent.map_err(stream_outcome)?;
    let param_count = io.readout.identity().param_count;
    let theirs = read.map_err(stream_outcome).and_then(|()| {
        screen::full_and_finite(&received, param_count, "parameters").map_err(Outcome::Rejected)?;
        let theirs = lease.copies.theirs_after(&received);
        screen::full_and_finite(&theirs, param_count, "parameters").map_err(Outcome::Rejected)?;
        let gap = lease.copies.gap_after(&sent, &theirs);
        Ok((theirs, gap))
    });
    let (theirs, admitted) = conclude(io, &mut writer, snapshot, theirs, screen).await?;
    let mut other = commit_and_mix(
        io,
        codec,
        &mut lease.copies,
        &sent,
        theirs,
        &snapshot.params,
    );
    let mixed = clip(io, admitted, &mut other, &snapshot.params);
    Ok((mixed, other, weight))
}

/// The weight to mix the partner's answer with, from its header's step (decision 0029: both
/// sides weigh by the two steps alone, so neither declines what the other sends).
fn weigh(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: &Snapshot,
    header: &TensorHeader,
    weight: f32,
) -> f32 {
    io.saw_step(peer, header.step);
    io.partner_weight(snapshot.step, header.step, weight)
}

/// Ends an exchange whose parameters went out already: once the partner's, `theirs`, are in
/// and passed their checks, and `screen` admits their distance (to our snapshot, or between
/// the pair's copies), the stream is closed (the partner mixes) and both returned; otherwise
/// the partner is told we decline.
async fn conclude(
    io: &ExchangeContext,
    writer: &mut (impl AsyncWrite + Unpin),
    snapshot: &Snapshot,
    theirs: Result<(Vec<f32>, f64), Outcome>,
    screen: Screen,
) -> Result<(Vec<f32>, Admitted), Outcome> {
    let (theirs, distance) = match theirs {
        Ok(judged) => judged,
        Err(outcome) => {
            // Best effort: a stream that broke already tells the partner as much.
            let _ = decline(io, writer).await;
            return Err(outcome);
        }
    };
    let admitted = match screen.admit(distance, &snapshot.params) {
        Ok(admitted) => admitted,
        Err(outlier) => {
            decline(io, writer).await?;
            return Err(outlier);
        }
    };
    let _ = writer.close().await;
    Ok((theirs, admitted))
}

/// Moves the `admitted` parameters `other` within the screen's radius around this replica's
/// `snapshot`, and counts a clip: the mix's outcome.
pub(super) fn clip(
    io: &ExchangeContext,
    admitted: Admitted,
    other: &mut [f32],
    snapshot: &[f32],
) -> Outcome {
    let cleared = admitted.clip(other, snapshot);
    if cleared.clipped {
        io.readout.counters().count(Count::Clipped);
    }
    cleared.outcome
}

/// Both sides completed a compressed exchange through `codec`: the pair's `copies` take the
/// differences `sent` and (summed) `theirs`, and the parameters to mix are returned (see
/// [`mixed_other`]).
pub(super) fn commit_and_mix(
    io: &ExchangeContext,
    codec: Codec,
    copies: &mut Copies,
    sent: &[f32],
    theirs: Vec<f32>,
    snapshot: &[f32],
) -> Vec<f32> {
    copies.commit(sent, theirs);
    if Some(codec) == io.sync.sparse_codec {
        io.readout.counters().count(Count::Sparse);
    }
    mixed_other(codec, &copies.theirs, &copies.own, snapshot)
}

/// The partner's answer to an offer is its parameters; `Busy` ends the exchange, anything else
/// is an offence.
async fn answered_with_params(stream: &mut Stream, header: &TensorHeader) -> Result<(), Outcome> {
    match header.kind {
        MessageKind::Params => Ok(()),
        MessageKind::Busy => {
            let _ = stream.close().await;
            Err(Outcome::Busy)
        }
        kind => Err(Outcome::Rejected(Rejection::Unexpected {
            what: "as the answer to an exchange offer",
            kind: format!("{kind:?}"),
        })),
    }
}

/// Declining (`Busy`) tells the partner not to mix either.
async fn decline(
    io: &ExchangeContext,
    stream: &mut (impl AsyncWrite + Unpin),
) -> Result<(), Outcome> {
    io.busy(stream).await.map_err(stream_outcome)
}

/// The span of one exchange with `peer` (an OTLP span when telemetry is exported); its outcome
/// and bytes are recorded when it ends.
pub(super) fn exchange_span(peer: PeerId, step: u64) -> tracing::Span {
    tracing::info_span!(
        "exchange",
        peer = %peer,
        step,
        outcome = tracing::field::Empty,
        bytes_sent = tracing::field::Empty,
        bytes_received = tracing::field::Empty,
    )
}

/// What an exchange came to, on its span: its outcome and the values sent and received.
pub(super) fn record_exchange(span: &mut Traced, outcome: &str, sent: usize, received: usize) {
    let bytes = |values: usize| (values * std::mem::size_of::<f32>()) as u64;
    span.outcome(outcome);
    span.span().record("bytes_sent", bytes(sent));
    span.span().record("bytes_received", bytes(received));
}

/// The outcome as the `murmur_exchanges_total` label names it.
pub(super) fn outcome_label(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Mixed { .. } => "ok",
        Outcome::Busy => "busy",
        Outcome::Stale => "stale",
        Outcome::Outlier { .. } | Outcome::Rejected(_) => "rejected",
        Outcome::Failed(_) | Outcome::StateSent => "failed",
    }
}
