//! The requesting side of state sync (`/murmur/state/3`): downloading a peer's parameters,
//! clock, optimizer state (when both run the same optimizer: the request names the buffers
//! this replica's keeps), the outer loop and the center, where it has them; checking every
//! frame, and handing them to the replica. The answering side is `serve::answer`.

use futures::AsyncWriteExt as _;
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{Codec, MessageKind, WireError};
use murmur_sync::policy::{Failure, Outcome};
use murmur_sync::rejection::Rejection;
use murmur_sync::replica::OuterState;
use murmur_sync::screen;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::pairwise::outcome_label;
use super::{ExchangeContext, Traced, stream_outcome, within};
use crate::node::messages::{SyncState, ToReplica};
use crate::node::replica::{NamedBuffer, OptimizerBuffers, ReplicaState};
use crate::readout::Count;

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
/// once the replica continues from it.
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
    ));
    let counters = io.readout.counters();
    let before = counters.get(Count::BytesReceived);
    let pulled = within(&io.timeouts, take_over(io, peer, announced))
        .instrument(span.span().clone())
        .await;
    let received = counters.get(Count::BytesReceived).saturating_sub(before);
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

async fn take_over(io: &ExchangeContext, peer: PeerId, announced: u64) -> Result<Pulled, Outcome> {
    let from = io.own_step();
    let mut request = io.header(MessageKind::State, from, Codec::F32, 0, &[]);
    request.buffers = io.readout.identity().optimizer_buffers.clone();
    let (mut stream, header) = io.ask_header(peer, STATE_PROTOCOL, &request, &[]).await?;
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
    let mut params = Vec::new();
    io.receive_payload_from(peer, &mut stream, &header, &mut params)
        .await
        .map_err(stream_outcome)?;
    let count = io.readout.identity().param_count;
    screen::full_and_finite(&params, count, "state").map_err(Outcome::Rejected)?;
    let rest = receive_rest(io, &mut stream).await?;
    let _ = stream.close().await;
    io.saw_step(peer, header.step);
    let step = header.step;
    let (adopted, done) = oneshot::channel();
    let state = SyncState {
        replica: ReplicaState {
            step,
            params,
            optimizer: rest.optimizer,
        },
        outer: rest.outer,
    };
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
        Ok(Ok(Ok(()))) => Ok(Pulled {
            from,
            step,
            center: rest.center,
        }),
        Ok(Ok(Err(why))) => Err(Outcome::Rejected(Rejection::ForeignState(why))),
        _ => Err(Outcome::Failed(Failure::Replica)),
    }
}

/// How many staleness bounds past the clock of the run a state's clock may lie: a source may
/// lead the slowest of its peers by one bound, peers announce their clocks every half bound,
/// and a fast run moves on while those announcements and the request travel.
const STATE_CLOCK_SLACK: u64 = 3;

/// The median of the clocks this node last heard from its live peers: where the run is now,
/// which one peer's heartbeats cannot move far among three or more.
fn clock_of_the_run(io: &ExchangeContext) -> Option<u64> {
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

/// What follows the parameters of a state.
#[derive(Debug, Default)]
struct Rest {
    optimizer: Option<OptimizerBuffers>,
    outer: Option<OuterState>,
    center: Option<Vec<f32>>,
}

/// Reads what follows a `State` frame until the stream ends, each at most once and in this
/// order: the optimizer's state buffers (all those the request named, in its order, each
/// stamped with the same update count; or none, from a peer of another optimizer), the outer
/// loop's anchor and velocity, and the elastic center. Every buffer is a whole parameter
/// buffer of finite values; whether an optimizer can hold the state is its replica's to say.
async fn receive_rest(io: &ExchangeContext, stream: &mut Stream) -> Result<Rest, Outcome> {
    let id = io.readout.identity();
    let (names, count) = (&id.optimizer_buffers, id.param_count);
    let mut buffers = Vec::new();
    let mut updates = None;
    let mut rest = Rest::default();
    loop {
        let mut values = Vec::new();
        let header = match io.receive(stream, &mut values).await {
            Ok(header) => header,
            Err(WireError::Empty) => break,
            Err(e) => return Err(stream_outcome(e)),
        };
        let check = |what| screen::full_and_finite(&values, count, what).map_err(Outcome::Rejected);
        let extras = rest.outer.is_some() || rest.center.is_some();
        match header.kind {
            MessageKind::Optimizer if !extras && buffers.len() < names.len() => {
                let expected = &names[buffers.len()];
                if header.buffers.as_slice() != std::slice::from_ref(expected) {
                    return Err(Outcome::Rejected(Rejection::ForeignState(format!(
                        "sent optimizer state buffer {:?} where `{expected}` belongs",
                        header.buffers
                    ))));
                }
                if *updates.get_or_insert(header.step) != header.step {
                    return Err(Outcome::Rejected(Rejection::ForeignState(
                        "stamped its optimizer state buffers with different update counts".into(),
                    )));
                }
                check("optimizer state")?;
                buffers.push(NamedBuffer {
                    name: expected.clone(),
                    values,
                });
            }
            MessageKind::Anchor if !extras => {
                check("anchor")?;
                rest.outer = Some(OuterState {
                    anchor: values,
                    anchor_step: header.step,
                    velocity: Vec::new(),
                });
            }
            MessageKind::Velocity if rest.center.is_none() => match rest.outer.as_mut() {
                Some(outer) if outer.velocity.is_empty() => {
                    check("outer velocity")?;
                    outer.velocity = values;
                }
                _ => return Err(unexpected_after_state(header.kind)),
            },
            MessageKind::Center if rest.center.is_none() => {
                check("center")?;
                rest.center = Some(values);
            }
            kind => return Err(unexpected_after_state(kind)),
        }
    }
    if !buffers.is_empty() && buffers.len() != names.len() {
        return Err(Outcome::Rejected(Rejection::ForeignState(format!(
            "sent {} of the {} optimizer state buffers this run's optimizer keeps",
            buffers.len(),
            names.len()
        ))));
    }
    rest.optimizer = (!buffers.is_empty()).then(|| OptimizerBuffers {
        buffers,
        updates: updates.unwrap_or(0),
    });
    Ok(rest)
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
