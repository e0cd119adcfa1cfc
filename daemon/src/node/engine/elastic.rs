//! Elastic averaging (EASGD) with a center: a worker sends its snapshot to the elected center
//! on `/murmur/params/3` and subtracts the delta that comes back; the center moves its center
//! variable by `d = alpha (x_worker - center)` and answers `d` ([`step_center`], and
//! `serve::answer` for other peers' requests).

use std::sync::Arc;

use murmur_protocol::PARAMS_PROTOCOL;
use murmur_protocol::mix;
use murmur_protocol::network::PeerId;
use murmur_sync::machines::elastic::Worker;
use murmur_sync::policy::Outcome;
use murmur_sync::replica::{ExchangeEnd, Snapshot};
use murmur_sync::screen::Screen;
use tracing::Instrument;

use super::io::Opening;
use super::pairwise::{count_mixed, exchange_span, outcome_label, record_exchange};
use super::{ExchangeContext, Traced, within};
use crate::readout::Count;

/// A worker's exchange with the center `peer`, the sync crate's [`Worker`] machine: the
/// outcome (`Mixed` with the delta's norm) and, after a mix, the replica's end. A delta whose
/// norm is an outlier for `screen`, or that is too stale, is refused, one past its radius
/// scaled down to it.
pub(super) async fn ask_center(
    io: &ExchangeContext,
    peer: PeerId,
    snapshot: Arc<Snapshot>,
    screen: Screen,
) -> (Outcome, Option<ExchangeEnd>) {
    let mut span = Traced::new(exchange_span(peer, snapshot.step));
    let sent = snapshot.params.len();
    let mut worker = Worker::new(&io.sync, snapshot, screen);
    let asked = within(&io.timeouts, async {
        let mut stream = io
            .open(peer, PARAMS_PROTOCOL)
            .await
            .map_err(Outcome::Failed)?;
        (io.pump(peer, &mut stream, &mut worker, Opening::Asks, None)).await
    })
    .instrument(span.span().clone())
    .await;
    match asked {
        Ok(mixed) => {
            record_exchange(&mut span, "ok", sent, sent);
            count_mixed(io, &mixed);
            (mixed.outcome, Some(mixed.end))
        }
        Err(outcome) => {
            record_exchange(&mut span, outcome_label(&outcome), sent, 0);
            (counted_stale(io, outcome), None)
        }
    }
}

/// Counts an outcome of [`Outcome::Stale`] as such.
pub(super) fn counted_stale(io: &ExchangeContext, outcome: Outcome) -> Outcome {
    if outcome == Outcome::Stale {
        io.readout.counters().count(Count::Stale);
    }
    outcome
}

/// At the center: moves the center variable toward `worker` by `alpha` and returns the delta
/// the worker subtracts; `None` when this node holds no center variable.
pub(super) fn step_center(io: &ExchangeContext, worker: &[f32], alpha: f32) -> Option<Vec<f32>> {
    let mut center = io.center.lock().unwrap_or_else(|p| p.into_inner());
    let variable = center.as_mut()?;
    Some(mix::elastic_step(variable, worker, alpha))
}
