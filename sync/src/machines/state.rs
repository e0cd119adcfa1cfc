//! State sync on `/murmur/state/3`: a node far behind (joining, returning, past a failed ring
//! round) takes over a peer's whole state. The request names the optimizer state buffers the
//! requester's optimizer keeps; the answer is `Busy`, or these frames until the stream ends:
//!
//! 1. `State`: the parameters, stamped with the source's step;
//! 2. `Optimizer`, one per buffer: all those the request named, in its order, each stamped
//!    with the optimizer's own update count (AdamW's bias correction); none from a peer of
//!    another optimizer;
//! 3. `Anchor` and `Velocity`: the outer loop's, where there is one (no velocity before the
//!    first outer step);
//! 4. `Center`: the elastic center variable, from the peer that holds it.
//!
//! The requester ([`Requester`]) checks each frame as it comes (its place, and a whole, finite
//! buffer of the model) and the source's clock against the run's (decision 0042); whether an
//! optimizer can hold the state is its replica's to say. The source's side is
//! [`state_frames`].

use murmur_protocol::wire::MessageKind;

use super::{Head, Lent, Machine, Payload, Turn};
use crate::policy::{Failure, Outcome};
use crate::rejection::Rejection;
use crate::replica::{NamedBuffer, OptimizerBuffers, OuterState, ReplicaState};
use crate::screen;

/// How many staleness bounds past the clock of the run a state's clock may lie: a source may
/// lead the slowest of its peers by one bound, peers announce their clocks every half bound,
/// and a fast run moves on while those announcements and the request travel.
pub const STATE_CLOCK_SLACK: u64 = 3;

/// The clock a state is held to (decision 0042): the later of the clock its source announced
/// when it was chosen and the median of the clocks `heard` from the live peers since (a run of
/// fast steps moves on by more than the bound while a request travels). The median is where
/// the run is now, which one peer's heartbeats cannot move far among three or more.
pub fn run_clock(announced: u64, heard: impl IntoIterator<Item = u64>) -> u64 {
    let mut clocks: Vec<u64> = heard.into_iter().collect();
    clocks.sort_unstable();
    clocks
        .get(clocks.len() / 2)
        .map_or(announced, |&median| median.max(announced))
}

/// A peer's state, taken over.
#[derive(Debug, PartialEq)]
pub struct Taken {
    pub replica: ReplicaState,
    pub outer: Option<OuterState>,
    /// The peer's elastic center, to seed from if this node becomes the center.
    pub center: Option<Vec<f32>>,
}

/// The side that asks for a state.
#[derive(Debug)]
pub struct Requester {
    from: u64,
    /// The clock its source announced when it was chosen.
    announced: u64,
    max_staleness: Option<u64>,
    /// The optimizer state buffers this replica's optimizer keeps.
    names: Vec<String>,
    /// The model's parameter count.
    count: usize,
    /// The answer's clock, once its head passed.
    step: Option<u64>,
    params: Option<Vec<f32>>,
    buffers: Vec<NamedBuffer>,
    updates: Option<u64>,
    outer: Option<OuterState>,
    center: Option<Vec<f32>>,
    /// The head of a frame after the parameters, until its values come.
    pending: Option<Head>,
}

impl Requester {
    /// A request by a node at step `from` to a source chosen for the clock it `announced`,
    /// whose optimizer keeps the buffers `names`, for a model of `count` parameters, under the
    /// staleness bound `max_staleness`.
    pub fn new(
        from: u64,
        announced: u64,
        max_staleness: Option<u64>,
        names: Vec<String>,
        count: usize,
    ) -> Self {
        Requester {
            from,
            announced,
            max_staleness,
            names,
            count,
            step: None,
            params: None,
            buffers: Vec::new(),
            updates: None,
            outer: None,
            center: None,
            pending: None,
        }
    }

    /// The earliest clock this node takes a state at: its own, or the source's when it asked
    /// a source behind it (a member far ahead of the run rejoins it, decision 0033).
    fn floor(&self) -> u64 {
        self.from.min(self.announced)
    }

    /// The request (no payload).
    fn request(&self) -> Head {
        Head {
            buffers: self.names.clone(),
            ..Head::new(MessageKind::State, self.from)
        }
    }

    /// The answer's head: a `State` whose clock a node where the run's clock is `reference`
    /// may take over, whose parameters follow; or the end: `Busy`, a clock refused (a failure
    /// to retry, not an offence), or an offence.
    fn on_answer(&mut self, head: &Head, reference: u64) -> Result<(), Outcome> {
        match head.kind {
            MessageKind::State => {}
            MessageKind::Busy => {
                return Err(Outcome::Failed(Failure::Stream(
                    "the peer is not ready to share its state".into(),
                )));
            }
            kind => return Err(unexpected("as the answer to a state request", kind)),
        }
        check_clock(self.floor(), reference, head.step, self.max_staleness)?;
        self.step = Some(head.step);
        Ok(())
    }

    /// The parameters of the `State` frame.
    fn on_params(&mut self, params: Vec<f32>) -> Result<(), Outcome> {
        screen::full_and_finite(&params, self.count, "state").map_err(Outcome::Rejected)?;
        self.params = Some(params);
        Ok(())
    }

    /// A frame after the parameters, with its values.
    fn on_frame(&mut self, head: &Head, values: Vec<f32>) -> Result<(), Outcome> {
        let check =
            |what| screen::full_and_finite(&values, self.count, what).map_err(Outcome::Rejected);
        let extras = self.outer.is_some() || self.center.is_some();
        match head.kind {
            MessageKind::Optimizer if !extras && self.buffers.len() < self.names.len() => {
                let expected = &self.names[self.buffers.len()];
                if head.buffers.as_slice() != std::slice::from_ref(expected) {
                    return Err(Outcome::Rejected(Rejection::ForeignState(format!(
                        "sent optimizer state buffer {:?} where `{expected}` belongs",
                        head.buffers
                    ))));
                }
                if *self.updates.get_or_insert(head.step) != head.step {
                    return Err(Outcome::Rejected(Rejection::ForeignState(
                        "stamped its optimizer state buffers with different update counts".into(),
                    )));
                }
                check("optimizer state")?;
                let name = expected.clone();
                self.buffers.push(NamedBuffer { name, values });
            }
            MessageKind::Anchor if !extras => {
                check("anchor")?;
                self.outer = Some(OuterState {
                    anchor: values,
                    anchor_step: head.step,
                    velocity: Vec::new(),
                });
            }
            MessageKind::Velocity if self.center.is_none() => match self.outer.as_mut() {
                Some(outer) if outer.velocity.is_empty() => {
                    check("outer velocity")?;
                    outer.velocity = values;
                }
                _ => return Err(unexpected("after the state", head.kind)),
            },
            MessageKind::Center if self.center.is_none() => {
                check("center")?;
                self.center = Some(values);
            }
            kind => return Err(unexpected("after the state", kind)),
        }
        Ok(())
    }

    /// The stream ended: the state taken over, or why not.
    fn finish(&mut self) -> Result<Taken, Outcome> {
        let (Some(step), Some(params)) = (self.step, self.params.take()) else {
            return Err(Outcome::Failed(Failure::Stream(
                "the stream ended before the state's parameters".into(),
            )));
        };
        let buffers = std::mem::take(&mut self.buffers);
        if !buffers.is_empty() && buffers.len() != self.names.len() {
            return Err(Outcome::Rejected(Rejection::ForeignState(format!(
                "sent {} of the {} optimizer state buffers this run's optimizer keeps",
                buffers.len(),
                self.names.len()
            ))));
        }
        let optimizer = (!buffers.is_empty()).then(|| OptimizerBuffers {
            buffers,
            updates: self.updates.unwrap_or(0),
        });
        Ok(Taken {
            replica: ReplicaState {
                step,
                params,
                optimizer,
            },
            outer: self.outer.take(),
            center: self.center.take(),
        })
    }
}

impl Machine for Requester {
    type Done = Taken;

    fn start(&self) -> Vec<(Head, Payload<'_>)> {
        vec![(self.request(), Payload::Empty)]
    }

    /// The answer's head, held to the run's clock as the node hears it now; then the head of
    /// each frame after the parameters.
    fn on_head(&mut self, head: &Head, lent: &mut Lent<'_>) -> Turn<'_, Taken> {
        if self.step.is_some() {
            self.pending = Some(head.clone());
            return Turn::read_on();
        }
        let reference = run_clock(self.announced, lent.heard.iter().copied());
        match self.on_answer(head, reference) {
            Ok(()) => Turn::answered(head.step),
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_payload(&mut self, values: Vec<f32>, _: &mut Lent<'_>) -> Turn<'_, Taken> {
        let read = match self.pending.take() {
            Some(head) => self.on_frame(&head, values),
            None => self.on_params(values),
        };
        match read {
            Ok(()) => Turn::read_on(),
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_end(&mut self, _: &mut Lent<'_>) -> Result<Taken, Outcome> {
        self.finish()
    }
}

/// The frames that answer a state request, in order (see the module documentation): the
/// `replica`'s state (with its optimizer's buffers where it has them for the requester: the
/// replica leaves them out for another optimizer's), the `outer` loop's, and the `center`
/// this node holds.
pub fn state_frames<'a>(
    replica: &'a ReplicaState,
    outer: Option<&'a OuterState>,
    center: Option<&'a [f32]>,
) -> Vec<(Head, Payload<'a>)> {
    let mut frames = vec![(
        Head::new(MessageKind::State, replica.step),
        Payload::Values(&replica.params),
    )];
    if let Some(optimizer) = &replica.optimizer {
        for buffer in &optimizer.buffers {
            let head = Head {
                buffers: vec![buffer.name.clone()],
                ..Head::new(MessageKind::Optimizer, optimizer.updates)
            };
            frames.push((head, Payload::Values(&buffer.values)));
        }
    }
    if let Some(outer) = outer {
        let anchor = Head::new(MessageKind::Anchor, outer.anchor_step);
        frames.push((anchor, Payload::Values(&outer.anchor)));
        if !outer.velocity.is_empty() {
            let velocity = Head::new(MessageKind::Velocity, replica.step);
            frames.push((velocity, Payload::Values(&outer.velocity)));
        }
    }
    if let Some(center) = center {
        let head = Head::new(MessageKind::Center, replica.step);
        frames.push((head, Payload::Values(center)));
    }
    frames
}

/// Whether a state stamped `sent` may be taken over by a node whose floor is `from` (its own
/// clock, or the clock of a source behind it that it asked, [`Requester::floor`]), where the
/// run's clock is `reference` (the later of the clock its source was chosen for and the median
/// clock heard when it arrives; decision 0042). The node continues from that step, and a
/// source could stamp any: one far ahead ended a joiner's run at once (or overflowed its
/// clock), one behind took it back. Peers' gates hold an honest source within the bound of
/// the slowest of them, so its state lies within [`STATE_CLOCK_SLACK`] bounds past the run's
/// clock; with no bound (`max_staleness = "off"`) nothing holds a clock and nothing is checked
/// past `from`. Refused as a failure, not an offence: an honest source whose heartbeats were
/// slow to arrive can miss it once, and the next try asks again.
fn check_clock(
    from: u64,
    reference: u64,
    sent: u64,
    max_staleness: Option<u64>,
) -> Result<(), Outcome> {
    let refuse = |why: String| Err(Outcome::Failed(Failure::Stream(why)));
    if sent < from {
        return refuse(format!(
            "the peer sent its state at step {sent}, behind step {from} (this node's, or the one its source was chosen for)"
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

fn unexpected(what: &'static str, kind: MessageKind) -> Outcome {
    Outcome::Rejected(Rejection::Unexpected {
        what,
        kind: format!("{kind:?}"),
    })
}

#[cfg(test)]
mod tests;
