//! The initiator's side of a pairwise exchange on `/murmur/params/3`: the sync crate's
//! [`Initiator`] machine (the message order, the checks, the screen, the pair's copies) driven
//! over a libp2p stream. Here: the stream, its deadline, the lease of the pair's copies,
//! sending ours while the partner's comes in (decision 0027), and the counters.

use std::sync::Arc;

use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::network::PeerId;
use murmur_protocol::wire::Codec;
use murmur_sync::copies::Copies;
use murmur_sync::machines::Mixed;
use murmur_sync::machines::pairwise::Initiator;
use murmur_sync::policy::Outcome;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use tracing::Instrument;

use super::copies::Lease;
use super::io::Opening;
use super::{ExchangeContext, Traced, within};
use crate::readout::Count;

/// Offers `snapshot` to `peer` through `codec`, to be mixed with `weight` (before age
/// weighting) as `screen` passes the partner's parameters. Returns the outcome, after a mix
/// the replica's end, and the snapshot where the exchange did not let it go (decision 0091:
/// a compressed offer the partner took spends it), to be offered to another partner.
pub(super) async fn offer(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: Arc<Snapshot>,
    codec: Codec,
    weight: f32,
    screen: Screen,
) -> (Outcome, Option<ExchangeEnd>, Option<Arc<Snapshot>>) {
    let mut span = Traced::new(exchange_span(peer, snapshot.step));
    let values = snapshot.params.len();
    // A compressed exchange runs on the pair's copies; an exchange with this partner that it
    // asked for may hold them.
    let mut lease = match codec {
        Codec::F32 => None,
        _ => match io.pairs.lease(peer, values) {
            Some(lease) => Some(lease),
            None => return (Outcome::Busy, None, Some(snapshot)),
        },
    };
    let mut machine = Initiator::new(
        &io.sync,
        snapshot,
        codec,
        weight,
        screen,
        lease.as_ref().map(|lease| &lease.copies),
    );
    // The machine outlives the deadline, so that a snapshot it still holds comes back however
    // the exchange ends.
    let result = within(&io.timeouts, exchange(io, peer, &mut machine, &mut lease))
        .instrument(span.span().clone())
        .await;
    let back = machine.take_snapshot();
    match result {
        Ok(mixed) => {
            record_exchange(&mut span, "ok", values, values);
            // A compressed mix holds the pair's copies until it lands (decision 0092).
            (mixed.outcome, Some(mixed.end.holding(lease)), back)
        }
        Err(outcome) => {
            record_exchange(&mut span, outcome_label(&outcome), 0, 0);
            (outcome, None, back)
        }
    }
}

/// The exchange itself, the [`Initiator`] machine driven over a stream: the mix, or how it
/// ended.
async fn exchange(
    io: &ExchangeContext,
    peer: PeerId,
    machine: &mut Initiator,
    lease: &mut Option<Lease>,
) -> Result<Mixed, Outcome> {
    let mut stream = io
        .open(peer, PARAMS_PROTOCOL)
        .await
        .map_err(Outcome::Failed)?;
    let lent = copies(lease);
    let mixed = (io.pump(peer, &mut stream, machine, Opening::Asks, lent)).await?;
    count_mixed(io, &mixed);
    Ok(mixed)
}

/// The pair's copies a lease holds, lent to one call of a machine.
pub(super) fn copies(lease: &mut Option<Lease>) -> Option<&mut Copies> {
    lease.as_mut().map(|lease| &mut lease.copies)
}

/// Counts what a completed exchange did beyond its outcome.
pub(super) fn count_mixed(io: &ExchangeContext, mixed: &Mixed) {
    if mixed.clipped {
        io.readout.counters().count(Count::Clipped);
    }
    if mixed.sparse {
        io.readout.counters().count(Count::Sparse);
    }
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
