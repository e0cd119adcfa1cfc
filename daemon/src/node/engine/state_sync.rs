//! The requesting side of state sync (`/murmur/state/3`): the sync crate's [`Requester`]
//! (the frames' order and checks, and the clock rule of decision 0042) run over a stream by
//! the engine's pump, and the state handed to the replica. The answering side is `serve::answer`.

use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::PeerId;
use murmur_sync::machines::state::{Requester, Taken};
use murmur_sync::policy::{Failure, Outcome};
use murmur_sync::rejection::Rejection;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::io::Opening;
use super::pairwise::outcome_label;
use super::{ExchangeContext, Traced, within};
use crate::node::messages::{SyncState, ToReplica};
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

/// The state sync itself, the sync crate's [`Requester`] driven over a stream.
async fn take_over(io: &ExchangeContext, peer: PeerId, announced: u64) -> Result<Pulled, Outcome> {
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
    let mut stream = io
        .open(peer, STATE_PROTOCOL)
        .await
        .map_err(Outcome::Failed)?;
    let Taken {
        replica,
        outer,
        center,
    } = (io.pump(peer, &mut stream, &mut requester, Opening::Asks, None)).await?;
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
