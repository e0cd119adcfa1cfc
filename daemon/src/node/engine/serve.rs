//! The responder side: inbound exchanges and state requests from other peers.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::{AsyncWriteExt, StreamExt};
use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{MessageKind, TensorHeader, WireError};
use murmur_trainer::averaging;
use tracing::debug;

use super::{
    Context, EXCHANGE_TIMEOUT, Failure, InFlight, SyncStats, full_and_finite, outlier_floor,
    while_live,
};
use crate::node::messages::ToTrainer;
use crate::readout::lock;

/// Serves the inbound streams of one protocol, each in its own task, at most
/// [`MAX_INBOUND`] at once (so a receiver holds a bounded number of extra parameter copies).
/// Nothing a peer sends can stop this loop.
pub(super) async fn accept(
    ctx: Arc<Context>,
    mut incoming: libp2p_stream::IncomingStreams,
    protocol: &'static str,
) {
    while let Some((peer, stream)) = incoming.next().await {
        if lock(&ctx.state.blocked).contains(&peer) {
            continue;
        }
        let Ok(permit) = Arc::clone(&ctx.inbound).try_acquire_owned() else {
            debug!(peer = %peer, "too many inbound streams; dropping one");
            continue;
        };
        let ctx = Arc::clone(&ctx);
        tokio::spawn(async move {
            let _permit = permit;
            let served = while_live(&ctx, peer, async {
                if protocol == STATE_PROTOCOL {
                    serve_state(&ctx, peer, stream).await
                } else {
                    serve_params(&ctx, peer, stream).await
                }
            })
            .await;
            match served {
                Ok(()) => {}
                Err(Failure::Offence(reason)) => ctx.offence(peer, reason),
                // A peer that opens a stream and never completes its frame is misbehaving.
                Err(Failure::TimedOut) => ctx.offence(
                    peer,
                    format!(
                        "no complete exchange within {}s",
                        EXCHANGE_TIMEOUT.as_secs()
                    ),
                ),
                Err(failure) => ctx.failed(peer, &failure),
            }
        });
    }
}

/// Answers a gossip `Offer` (see [`serve_offer`]) or an elastic worker's `Params` (with a
/// delta, when this node holds the center). A request that is not a valid frame is an offence,
/// a truncated one included: a peer that dies mid-frame is scored once, a peer that keeps
/// doing it is blocked.
async fn serve_params(ctx: &Context, peer: PeerId, mut stream: Stream) -> Result<(), Failure> {
    let mut other = Vec::new();
    let header = ctx
        .receive(&mut stream, &mut other)
        .await
        .map_err(request_failure)?;
    lock(&ctx.state.membership).saw_step(&peer, header.step);
    debug!(peer = %peer, kind = ?header.kind, step = header.step, bytes = header.byte_len, "tensor received");
    let settings = &ctx.settings;
    let ready = !ctx.joining.load(Ordering::Relaxed);
    match header.kind {
        MessageKind::Offer if header.byte_len == 0 => {
            if ready && settings.pairwise() {
                serve_offer(ctx, &mut stream, header).await
            } else {
                ctx.busy(&mut stream).await
            }
        }
        MessageKind::Params => {
            full_and_finite(&other, ctx.state.param_count, "parameters")
                .map_err(Failure::Offence)?;
            if ready && settings.centered() {
                serve_center(ctx, &mut stream, header, other).await
            } else {
                ctx.busy(&mut stream).await
            }
        }
        kind => Err(Failure::Offence(format!(
            "sent {kind:?} with {} bytes on the params protocol",
            header.byte_len
        ))),
    }
}

/// The partner's side of a pairwise exchange: our snapshot (or `Busy`), then the initiator's
/// parameters (or its `Busy`: it declined), then the mix. A node answers one exchange at a
/// time, and one it is initiating counts.
async fn serve_offer(
    ctx: &Context,
    stream: &mut Stream,
    offer: TensorHeader,
) -> Result<(), Failure> {
    let Some(_claim) = ctx.claim() else {
        return ctx.busy(stream).await;
    };
    let _in_flight = InFlight::begin(ctx);
    let Some(snapshot) = ctx.snapshot().await else {
        return ctx.busy(stream).await;
    };
    let p = ctx.live_count();
    let Some(weight) = ctx.weight(snapshot.step, offer.step, ctx.settings.pair_weight(p)) else {
        return ctx.busy(stream).await;
    };
    ctx.send(stream, MessageKind::Params, snapshot.step, &snapshot.params)
        .await?;
    // The initiator may go away now (it left, or gave up on us): a cut stream here is a
    // failure, not an offence; anything it does send must still be valid.
    let mut other = Vec::new();
    let answer = ctx.receive(stream, &mut other).await?;
    match answer.kind {
        MessageKind::Params => {}
        MessageKind::Busy => return Ok(()),
        kind => {
            return Err(Failure::Offence(format!(
                "answered our snapshot with {kind:?}"
            )));
        }
    }
    full_and_finite(&other, ctx.state.param_count, "parameters").map_err(Failure::Offence)?;
    ctx.check_distance(&other, &snapshot.params)
        .map_err(Failure::Offence)?;
    if ctx.to_trainer(ToTrainer::Mix {
        other,
        base: snapshot.params,
        weight,
    }) {
        SyncStats::bump(&ctx.stats().served);
    }
    Ok(())
}

/// Why a request could not be read: a stream closed before its first byte is a peer that went
/// away (leaving, or giving up); anything else, a truncated frame included, is an offence.
fn request_failure(e: WireError) -> Failure {
    match e {
        WireError::Empty | WireError::Io(_) => Failure::Io(e.to_string()),
        other => Failure::Offence(other.to_string()),
    }
}

/// The center's side of an elastic exchange.
async fn serve_center(
    ctx: &Context,
    stream: &mut Stream,
    header: TensorHeader,
    worker: Vec<f32>,
) -> Result<(), Failure> {
    let own = ctx.own_step();
    let Some(weight) = ctx.weight(own, header.step, 1.0) else {
        return ctx.busy(stream).await;
    };
    let p = ctx.live_count();
    let delta = match lock(&ctx.center).as_mut() {
        Some(center) => {
            lock(&ctx.distances)
                .check(averaging::distance(&worker, center), outlier_floor(center))
                .map_err(Failure::Offence)?;
            Some(averaging::elastic_step(
                center,
                &worker,
                ctx.settings.alpha(p) * weight,
            ))
        }
        // Not (or no longer) the center.
        None => None,
    };
    let Some(delta) = delta else {
        return ctx.busy(stream).await;
    };
    ctx.send(stream, MessageKind::Delta, own, &delta).await?;
    let _ = stream.close().await;
    SyncStats::bump(&ctx.stats().served);
    Ok(())
}

/// Answers a state request with this node's parameters and clock, its optimizer's state
/// buffers, the outer loop's anchor and velocity in `allreduce` with `every > 1`, then the
/// center if this node holds it.
async fn serve_state(ctx: &Context, _peer: PeerId, mut stream: Stream) -> Result<(), Failure> {
    let mut empty = Vec::new();
    let header = ctx
        .receive(&mut stream, &mut empty)
        .await
        .map_err(request_failure)?;
    if header.kind != MessageKind::State || header.byte_len != 0 {
        return Err(Failure::Offence(format!(
            "sent {:?} with {} bytes on the state protocol",
            header.kind, header.byte_len
        )));
    }
    // Answered even while this node is still joining: the first node of a run is alone
    // (joining) exactly when the second one needs its state.
    let Some(state) = ctx.trainer_state().await else {
        return ctx.busy(&mut stream).await;
    };
    ctx.send(&mut stream, MessageKind::State, state.step, &state.params)
        .await?;
    for buffer in &state.optimizer.buffers {
        ctx.send(
            &mut stream,
            MessageKind::Optimizer,
            state.optimizer.updates,
            buffer,
        )
        .await?;
    }
    if let Some(outer) = &state.outer {
        ctx.send(
            &mut stream,
            MessageKind::Anchor,
            outer.anchor_step,
            &outer.anchor,
        )
        .await?;
        if !outer.velocity.is_empty() {
            ctx.send(
                &mut stream,
                MessageKind::Velocity,
                state.step,
                &outer.velocity,
            )
            .await?;
        }
    }
    let center = lock(&ctx.center).clone();
    if let Some(center) = center {
        ctx.send(&mut stream, MessageKind::Center, state.step, &center)
            .await?;
    }
    let _ = stream.close().await;
    Ok(())
}
