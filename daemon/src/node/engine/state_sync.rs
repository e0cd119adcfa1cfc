//! The requesting side of state sync (`/murmur/state/2`): downloading a peer's parameters,
//! clock, optimizer state (and the outer loop and center, where it has them), checking every
//! frame, and handing them to the trainer. The answering side is `serve::answer`.

use futures::AsyncWriteExt as _;
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{MessageKind, WireError};
use murmur_trainer::OptimizerState;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::pairwise::outcome_label;
use super::policy::{Failure, Outcome};
use super::{Io, Traced, stream_outcome, validate, within};
use crate::node::messages::{OuterState, Rejection, ToTrainer, TrainerState};

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

/// Takes over `peer`'s state, chosen for the clock it `announced`: downloads it, and returns
/// once the trainer continues from it.
pub(super) async fn pull(io: &Io, peer: PeerId, announced: u64) -> Result<Pulled, Outcome> {
    let mut span = Traced::new(tracing::info_span!(
        "state_sync",
        peer = %peer,
        step = tracing::field::Empty,
        outcome = tracing::field::Empty,
        bytes_received = tracing::field::Empty,
    ));
    let counters = io.readout.counters();
    let before = counters.bytes_in();
    let pulled = within(&io.timeouts, take_over(io, peer, announced))
        .instrument(span.span().clone())
        .await;
    let received = counters.bytes_in().saturating_sub(before);
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

async fn take_over(io: &Io, peer: PeerId, announced: u64) -> Result<Pulled, Outcome> {
    let from = io.own_step();
    let (mut stream, header, params) = io
        .ask(peer, STATE_PROTOCOL, MessageKind::State, from, &[])
        .await?;
    match header.kind {
        MessageKind::State => {}
        MessageKind::Busy => {
            return Err(Outcome::Failed(Failure::Stream(
                "the peer is not ready to share its state".into(),
            )));
        }
        kind => {
            return Err(Outcome::Rejected(Rejection::Unexpected {
                what: "as the answer to a state request",
                kind: format!("{kind:?}"),
            }));
        }
    }
    // Clocks heard since the source was chosen count too: a run of fast steps moves on by more
    // than the bound while a request travels.
    let reference = clock_of_the_run(io).map_or(announced, |heard| heard.max(announced));
    check_clock(from, reference, header.step, io.sync.max_staleness)?;
    let count = io.readout.identity().param_count;
    validate::full_and_finite(&params, count, "state").map_err(Outcome::Rejected)?;
    let optimizer = receive_optimizer_state(io, &mut stream).await?;
    let (outer, center) = receive_extras(io, &mut stream).await?;
    let _ = stream.close().await;
    io.saw_step(peer, header.step);
    let step = header.step;
    let (adopted, done) = oneshot::channel();
    let state = TrainerState {
        step,
        params,
        optimizer,
        outer,
    };
    if io
        .trainer
        .try_send(ToTrainer::Adopt { state, adopted })
        .is_err()
    {
        return Err(Outcome::Failed(Failure::Trainer));
    }
    // Only once the trainer is at the peer's step may this node count as joined: before, its
    // heartbeats would announce its old clock and close every peer's gate.
    match tokio::time::timeout(io.timeouts.trainer_answer, done).await {
        Ok(Ok(())) => Ok(Pulled { from, step, center }),
        _ => Err(Outcome::Failed(Failure::Trainer)),
    }
}

/// How many staleness bounds past the clock of the run a state's clock may lie: a source may
/// lead the slowest of its peers by one bound, peers announce their clocks every half bound,
/// and a fast run moves on while those announcements and the request travel.
const STATE_CLOCK_SLACK: u64 = 3;

/// The median of the clocks this node last heard from its live peers: where the run is now,
/// which one peer's heartbeats cannot move far among three or more.
fn clock_of_the_run(io: &Io) -> Option<u64> {
    let mut clocks: Vec<u64> = io.readout.peers().iter().map(|p| p.step).collect();
    clocks.sort_unstable();
    clocks.get(clocks.len() / 2).copied()
}

/// Whether a state stamped `sent` may be taken over by a node at `from`, where the run's clock
/// is `reference` (the later of the clock its source was chosen for and the median clock heard
/// when it arrives; decision 0042). The node continues from that step, and a source could
/// stamp any: one far ahead ended a joiner's run at once (or overflowed its clock), one behind
/// took it back. Peers' gates hold an honest source within the bound of the slowest of them,
/// so its state lies within [`STATE_CLOCK_SLACK`] bounds past the run's clock; with no bound
/// (`max_staleness = "off"`) nothing holds a clock and nothing is checked past `from`. Refused
/// as a failure, not an offence: an honest source whose heartbeats were slow to arrive can
/// miss it once, and the next try asks again.
fn check_clock(
    from: u64,
    reference: u64,
    sent: u64,
    max_staleness: Option<u64>,
) -> Result<(), Outcome> {
    let refuse = |why: String| Err(Outcome::Failed(Failure::Stream(why)));
    if sent < from {
        return refuse(format!(
            "the peer sent its state at step {sent}, behind this node's {from}"
        ));
    }
    match max_staleness {
        Some(bound) if sent > reference.saturating_add(bound.saturating_mul(STATE_CLOCK_SLACK)) => {
            refuse(format!(
                "the peer sent its state at step {sent}, more than {STATE_CLOCK_SLACK} staleness \
                 bounds ({bound} steps each) past the run's step {reference}"
            ))
        }
        _ => Ok(()),
    }
}

/// Reads the optimizer's state that follows a `State` frame: exactly as many buffers as this
/// run's optimizer has, each a whole parameter buffer of finite values within the optimizer's
/// bounds ([`murmur_trainer::OptimizerSpec::check_state`]), all stamped with the same update
/// count.
async fn receive_optimizer_state(io: &Io, stream: &mut Stream) -> Result<OptimizerState, Outcome> {
    let id = io.readout.identity();
    let expected = id.optimizer.state_names().len();
    let mut buffers = Vec::with_capacity(expected);
    let mut updates = None;
    for i in 0..expected {
        let mut buffer = Vec::new();
        let header = io.receive(stream, &mut buffer).await.map_err(|e| match e {
            WireError::Empty => Outcome::Rejected(Rejection::ForeignState(format!(
                "sent {i} optimizer state buffers, this run's optimizer has {expected}: the \
                 peer runs another optimizer"
            ))),
            other => stream_outcome(other),
        })?;
        if header.kind != MessageKind::Optimizer {
            return Err(Outcome::Rejected(Rejection::ForeignState(format!(
                "sent {:?} where optimizer state buffer {} of {expected} belongs",
                header.kind,
                i + 1
            ))));
        }
        if *updates.get_or_insert(header.step) != header.step {
            return Err(Outcome::Rejected(Rejection::ForeignState(
                "stamped its optimizer state buffers with different update counts".into(),
            )));
        }
        validate::full_and_finite(&buffer, id.param_count, "optimizer state")
            .map_err(Outcome::Rejected)?;
        buffers.push(buffer);
    }
    id.optimizer.check_state(&buffers).map_err(|problem| {
        Outcome::Rejected(Rejection::ForeignState(format!(
            "sent optimizer state no optimizer holds: {problem}"
        )))
    })?;
    Ok(OptimizerState {
        buffers,
        updates: updates.unwrap_or(0),
    })
}

/// Reads what may follow the optimizer's state until the stream ends: the outer loop's anchor
/// and velocity (`allreduce`, `every > 1`) and the elastic center, each at most once and in
/// that order.
async fn receive_extras(
    io: &Io,
    stream: &mut Stream,
) -> Result<(Option<OuterState>, Option<Vec<f32>>), Outcome> {
    let count = io.readout.identity().param_count;
    let mut outer: Option<OuterState> = None;
    let mut center = None;
    loop {
        let mut values = Vec::new();
        let (kind, step) = match io.receive(stream, &mut values).await {
            Ok(header) => (header.kind, header.step),
            Err(WireError::Empty) => return Ok((outer, center)),
            Err(e) => return Err(stream_outcome(e)),
        };
        let check =
            |what| validate::full_and_finite(&values, count, what).map_err(Outcome::Rejected);
        match kind {
            MessageKind::Anchor if outer.is_none() && center.is_none() => {
                check("anchor")?;
                outer = Some(OuterState {
                    anchor: values,
                    anchor_step: step,
                    velocity: Vec::new(),
                });
            }
            MessageKind::Velocity if center.is_none() => match outer.as_mut() {
                Some(outer) if outer.velocity.is_empty() => {
                    check("outer velocity")?;
                    outer.velocity = values;
                }
                _ => return Err(unexpected_after_state(kind)),
            },
            MessageKind::Center if center.is_none() => {
                check("center")?;
                center = Some(values);
            }
            _ => return Err(unexpected_after_state(kind)),
        }
    }
}

fn unexpected_after_state(kind: MessageKind) -> Outcome {
    Outcome::Rejected(Rejection::Unexpected {
        what: "after the state",
        kind: format!("{kind:?}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_is_taken_within_three_bounds_past_the_run_clock_and_not_behind() {
        let bound = Some(16);
        assert!(check_clock(0, 100, 100, bound).is_ok());
        // An honest source of the main job served step 128 for the step 102 it was chosen
        // for: a fast run had moved on while the request travelled (one bound was too tight).
        assert!(check_clock(3, 102, 128, bound).is_ok());
        assert!(check_clock(0, 100, 148, bound).is_ok());
        assert!(check_clock(0, 100, 149, bound).is_err());
        assert!(check_clock(0, 100, u64::MAX, bound).is_err());
        assert!(
            check_clock(0, u64::MAX, u64::MAX, bound).is_ok(),
            "no overflow"
        );
        assert!(check_clock(50, 100, 49, bound).is_err(), "behind this node");
        assert!(
            check_clock(50, 100, u64::MAX, None).is_ok(),
            "no bound, no check"
        );
        let refused = check_clock(0, 100, 500, bound).unwrap_err();
        assert!(
            matches!(refused, Outcome::Failed(_)),
            "a failure to retry, not an offence: {refused:?}"
        );
    }
}
