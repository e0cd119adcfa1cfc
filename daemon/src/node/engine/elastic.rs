//! Elastic averaging (EASGD) with a center: a worker sends its snapshot to the elected center
//! on `/murmur/params/2` and subtracts the delta that comes back; the center moves its center
//! variable by `d = alpha (x_worker - center)` and answers `d` ([`step_center`], and
//! `serve::answer` for other peers' requests).

use std::sync::Arc;

use futures::AsyncWriteExt;
use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::mix;
use murmur_protocol::network::PeerId;
use murmur_protocol::wire::{MessageKind, TensorHeader};
use murmur_sync::policy::Outcome;
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use tracing::Instrument;

use super::pairwise::{exchange_span, outcome_label, record_exchange};
use super::{ExchangeContext, Traced, within};
use crate::readout::Count;

/// A worker's exchange with the center `peer`: the outcome (`Mixed` with the delta's norm) and, after a mix, the replica's end. A delta whose norm is an outlier for `screen`
/// is refused, one past its radius scaled down to it.
pub(super) async fn ask_center(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: Arc<Snapshot>,
    screen: Screen,
) -> (Outcome, Option<ExchangeEnd>) {
    let mut span = Traced::new(exchange_span(peer, snapshot.step));
    let result = within(&io.timeouts, request(io, peer, &snapshot))
        .instrument(span.span().clone())
        .await;
    let sent = snapshot.params.len();
    let (header, mut delta) = match result {
        Ok(answer) => answer,
        Err(outcome) => {
            record_exchange(&mut span, outcome_label(&outcome), sent, 0);
            return (outcome, None);
        }
    };
    record_exchange(&mut span, "ok", sent, delta.len());
    io.saw_step(peer, header.step);
    if !delta.iter().all(|v| v.is_finite()) {
        let what = "elastic delta";
        return (Outcome::Rejected(Rejection::NotFinite { what }), None);
    }
    let admitted = match screen.admit(mix::norm(&delta), &snapshot.params) {
        Ok(admitted) => admitted,
        Err(outlier) => return (outlier, None),
    };
    if io.weight(snapshot.step, header.step, 1.0).is_none() {
        return (Outcome::Stale, None);
    }
    let cleared = admitted.clip_delta(&mut delta, &snapshot.params);
    if cleared.clipped {
        io.readout.counters().count(Count::Clipped);
    }
    (cleared.outcome, Some(ExchangeEnd::Subtract(delta)))
}

/// Sends `snapshot` to the center and reads its `Delta` (or `Busy`).
async fn request(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: &Snapshot,
) -> Result<(TensorHeader, Vec<f32>), Outcome> {
    let (mut stream, header, answer) = io
        .ask(
            peer,
            PARAMS_PROTOCOL,
            MessageKind::Params,
            snapshot.step,
            &snapshot.params,
        )
        .await?;
    let _ = stream.close().await;
    match header.kind {
        MessageKind::Busy => Err(Outcome::Busy),
        MessageKind::Delta => {
            let expected = io.readout.identity().param_count;
            if answer.len() != expected {
                return Err(Outcome::Rejected(Rejection::WrongLength {
                    what: "elastic delta",
                    found: answer.len(),
                    expected,
                }));
            }
            Ok((header, answer))
        }
        kind => Err(Outcome::Rejected(Rejection::Unexpected {
            what: "as the answer to an elastic exchange",
            kind: format!("{kind:?}"),
        })),
    }
}

/// At the center: moves the center variable toward `worker` by `alpha` and returns the delta
/// the worker subtracts; `None` when this node holds no center variable.
pub(super) fn step_center(io: &ExchangeContext, worker: &[f32], alpha: f32) -> Option<Vec<f32>> {
    let mut center = io.center.lock().unwrap_or_else(|p| p.into_inner());
    let variable = center.as_mut()?;
    Some(mix::elastic_step(variable, worker, alpha))
}
