//! The requesting side of state sync (`/murmur/state/3`): the sync crate's [`Requester`]
//! (the frames' order and checks, and the clock rule of decision 0042) driven over a stream,
//! and the state handed to the replica. The answering side is `serve::answer`.

use futures::AsyncWriteExt as _;
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::PeerId;
use murmur_protocol::wire::WireError;
use murmur_sync::machines::state::{Requester, Taken, run_clock};
use murmur_sync::machines::{Head, Payload};
use murmur_sync::policy::{Failure, Outcome};
use murmur_sync::rejection::Rejection;
use tokio::sync::oneshot;
use tracing::Instrument;

use super::pairwise::outcome_label;
use super::{ExchangeContext, Traced, stream_outcome, within};
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
    let mut requester = Requester::new(from, io.sync.max_staleness, names, id.param_count);
    let request = io.frame_header(&requester.request(), Payload::Empty);
    let (mut stream, header) = io.ask_header(peer, STATE_PROTOCOL, &request, &[]).await?;
    let heard = io.readout.peers().into_iter().map(|p| p.step);
    let reference = run_clock(announced, heard);
    requester.on_answer(&Head::from(&header), reference)?;
    let mut params = Vec::new();
    io.receive_payload_from(peer, &mut stream, &header, &mut params)
        .await
        .map_err(stream_outcome)?;
    requester.on_params(params)?;
    loop {
        let mut values = Vec::new();
        match io.receive(&mut stream, &mut values).await {
            Ok(header) => requester.on_frame(&Head::from(&header), values)?,
            Err(WireError::Empty) => break,
            Err(e) => return Err(stream_outcome(e)),
        }
    }
    let _ = stream.close().await;
    io.saw_step(peer, header.step);
    let Taken {
        replica,
        outer,
        center,
    } = requester.finish()?;
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
