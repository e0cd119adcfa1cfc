//! The requesting side of state sync (`/murmur/state/2`): deciding to take over a peer's
//! state, downloading and checking every frame of it, and handing it to the trainer. The
//! answering side is `serve::serve_state`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use murmur_protocol::STATE_PROTOCOL;
use murmur_protocol::heartbeat::Role;
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::wire::{MessageKind, WireError};
use murmur_trainer::OptimizerState;
use tokio::sync::oneshot;
use tracing::{Instrument, info, warn};

use super::{
    Context, Engine, Failure, MAX_STATE_SYNC_TRIES, SNAPSHOT_TIMEOUT, SyncStats, full_and_finite,
    within,
};
use crate::events;
use crate::node::messages::{OuterState, ToTrainer, TrainerState};
use crate::readout::lock;

impl Engine {
    /// Decides whether this node is far enough behind the run to take over a peer's state,
    /// does so, and then counts as joined.
    pub(super) async fn try_join(&mut self) {
        let ctx = Arc::clone(&self.ctx);
        let own = ctx.own_step();
        let source = {
            let members = lock(&ctx.state.membership);
            // In elastic the center's holder is asked first: it has the center to hand over.
            let holder = members
                .peers()
                .find(|(_, v)| v.role == Role::Center)
                .map(|(p, v)| (*p, v.step));
            holder.or_else(|| members.most_advanced().map(|(p, s)| (*p, s)))
        };
        // Alone: nothing to catch up with yet.
        let Some((peer, their_step)) = source else {
            return;
        };
        // Ring members all sit at the same step: any lag is caught up on at once.
        let behind_limit = if ctx.settings.ring.is_some() {
            0
        } else {
            ctx.settings
                .max_staleness
                .unwrap_or(4 * ctx.settings.interval)
        };
        if their_step > own + behind_limit && self.join_tries < MAX_STATE_SYNC_TRIES {
            self.join_tries += 1;
            match within(self.pull_state(peer)).await {
                Ok(step) => {
                    SyncStats::bump(&ctx.stats().state_syncs);
                    info!(event = events::STATE_SYNC_DONE, peer = %peer, from = own, to = step, "state sync done");
                }
                Err(Failure::Offence(reason)) => {
                    ctx.offence(peer, reason);
                    return;
                }
                Err(Failure::Io(reason)) => {
                    warn!(peer = %peer, %reason, "state sync failed; retrying");
                    return;
                }
                Err(Failure::TimedOut) => {
                    warn!(peer = %peer, "state sync timed out; retrying");
                    return;
                }
            }
        }
        self.mark_joined();
        info!(step = ctx.own_step(), "joined the run");
    }

    /// From now on this node is a member: a partner, counted by gates, in rings.
    pub(super) fn mark_joined(&self) {
        self.ctx.joining.store(false, Ordering::Relaxed);
        let mut role = lock(&self.ctx.state.role);
        if *role == Role::Joining {
            *role = Role::Worker;
        }
    }

    /// Downloads a peer's parameters, optimizer state (and center) and hands them to the
    /// trainer.
    pub(super) async fn pull_state(&mut self, peer: PeerId) -> Result<u64, Failure> {
        let span = tracing::info_span!(
            "state_sync",
            peer = %peer,
            step = tracing::field::Empty,
            outcome = tracing::field::Empty,
            bytes_received = tracing::field::Empty,
        );
        // A joining node answers no exchanges, so what arrives meanwhile is the state.
        let before = self.ctx.state.bytes_in.load(Ordering::Relaxed);
        let pulled = self.take_over(peer).instrument(span.clone()).await;
        let received = self
            .ctx
            .state
            .bytes_in
            .load(Ordering::Relaxed)
            .saturating_sub(before);
        span.record("bytes_received", received);
        match &pulled {
            Ok(step) => {
                span.record("step", step);
                span.record("outcome", "ok");
                if let Some(ring) = self.ring.as_mut() {
                    ring.joined_run_under_way();
                }
            }
            Err(failure) => {
                span.record("outcome", failure.outcome());
            }
        }
        pulled
    }

    /// [`Engine::pull_state`] without its span.
    async fn take_over(&mut self, peer: PeerId) -> Result<u64, Failure> {
        let ctx = Arc::clone(&self.ctx);
        let mut stream = self.open(peer, STATE_PROTOCOL).await?;
        ctx.send(&mut stream, MessageKind::State, ctx.own_step(), &[])
            .await?;
        let mut params = Vec::new();
        let header = ctx.receive(&mut stream, &mut params).await?;
        match header.kind {
            MessageKind::State => {}
            MessageKind::Busy => return Err(Failure::Io("the peer is not ready to share".into())),
            other => {
                return Err(Failure::Offence(format!(
                    "answered a state request with {other:?}"
                )));
            }
        }
        full_and_finite(&params, ctx.state.param_count, "state").map_err(Failure::Offence)?;
        let optimizer = receive_optimizer_state(&ctx, &mut stream).await?;
        let (outer, center) = receive_extras(&ctx, &mut stream).await?;
        if center.is_some() {
            *lock(&ctx.inherited_center) = center;
        }
        lock(&ctx.state.membership).saw_step(&peer, header.step);
        let step = header.step;
        let (adopted, done) = oneshot::channel();
        if !ctx.to_trainer(ToTrainer::Adopt {
            state: TrainerState {
                step,
                params,
                optimizer,
                outer,
            },
            adopted,
        }) {
            return Err(Failure::Io("the trainer is not taking messages".into()));
        }
        // Only once the trainer is at the peer's step may this node count as joined: before,
        // its heartbeats would announce its old clock and close every peer's gate.
        match tokio::time::timeout(SNAPSHOT_TIMEOUT, done).await {
            Ok(Ok(())) => Ok(step),
            _ => Err(Failure::Io(
                "the trainer did not take over the state".into(),
            )),
        }
    }
}

/// Reads the optimizer's state that follows a `State` frame: exactly as many buffers as this
/// run's optimizer has, each a whole parameter buffer of finite values, all stamped with the
/// same update count.
async fn receive_optimizer_state(
    ctx: &Context,
    stream: &mut Stream,
) -> Result<OptimizerState, Failure> {
    let expected = ctx.state.optimizer_buffers;
    let mut buffers = Vec::with_capacity(expected);
    let mut updates = None;
    for i in 0..expected {
        let mut buffer = Vec::new();
        let header = ctx
            .receive(stream, &mut buffer)
            .await
            .map_err(|e| match e {
                WireError::Empty => Failure::Offence(format!(
                    "sent {i} optimizer state buffers, this run's optimizer has {expected}: \
                     the peer runs another optimizer"
                )),
                other => other.into(),
            })?;
        if header.kind != MessageKind::Optimizer {
            return Err(Failure::Offence(format!(
                "sent {:?} where optimizer state buffer {} of {expected} belongs",
                header.kind,
                i + 1
            )));
        }
        if *updates.get_or_insert(header.step) != header.step {
            return Err(Failure::Offence(
                "stamped its optimizer state buffers with different update counts".into(),
            ));
        }
        full_and_finite(&buffer, ctx.state.param_count, "optimizer state")
            .map_err(Failure::Offence)?;
        buffers.push(buffer);
    }
    Ok(OptimizerState {
        buffers,
        updates: updates.unwrap_or(0),
    })
}

/// Reads what may follow the optimizer's state until the stream ends: the outer loop's anchor
/// and velocity (`allreduce`, `every > 1`) and the elastic center, each at most once and in
/// that order.
async fn receive_extras(
    ctx: &Context,
    stream: &mut Stream,
) -> Result<(Option<OuterState>, Option<Vec<f32>>), Failure> {
    let mut outer: Option<OuterState> = None;
    let mut center = None;
    loop {
        let mut values = Vec::new();
        let (kind, step) = match ctx.receive(stream, &mut values).await {
            Ok(header) => (header.kind, header.step),
            Err(WireError::Empty) => return Ok((outer, center)),
            Err(e) => return Err(e.into()),
        };
        let check = |what| full_and_finite(&values, ctx.state.param_count, what);
        match kind {
            MessageKind::Anchor if outer.is_none() && center.is_none() => {
                check("anchor").map_err(Failure::Offence)?;
                outer = Some(OuterState {
                    anchor: values,
                    anchor_step: step,
                    velocity: Vec::new(),
                });
            }
            MessageKind::Velocity if center.is_none() => match outer.as_mut() {
                Some(outer) if outer.velocity.is_empty() => {
                    check("outer velocity").map_err(Failure::Offence)?;
                    outer.velocity = values;
                }
                _ => return Err(unexpected_after_state(kind)),
            },
            MessageKind::Center if center.is_none() => {
                check("center").map_err(Failure::Offence)?;
                center = Some(values);
            }
            _ => return Err(unexpected_after_state(kind)),
        }
    }
}

fn unexpected_after_state(kind: MessageKind) -> Failure {
    Failure::Offence(format!("unexpected {kind:?} after the state"))
}
