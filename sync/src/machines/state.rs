//! State sync on `/murmur/state/4`: a node far behind (joining, returning, past a failed ring
//! round) takes over a peer's whole state. The request names the optimizer state buffers the
//! requester's optimizer keeps, and the place to go on from where an earlier transfer from
//! this source was cut off; the answer is `Busy`, or these buffers until the stream ends, each
//! in chunks of at most [`STATE_CHUNK_VALUES`] values (a frame each, its `offset` the index of
//! its first value in the buffer):
//!
//! 1. `State`: the parameters, stamped with the source's step;
//! 2. `Optimizer`, one per buffer: all those the request named, in its order, each stamped
//!    with the optimizer's own update count (AdamW's bias correction); none from a peer of
//!    another optimizer;
//! 3. `Anchor` and `Velocity`: the outer loop's, where there is one (no velocity before the
//!    first outer step);
//! 4. `Center`: the elastic center variable, from the peer that holds it.
//!
//! The answer's first frame names the state (an id its source gave it) and where in it the
//! answer starts: at 0, or, where the request asked to go on with that state and the source
//! still holds it, at the place the request named (decision 0083). A requester whose transfer
//! is cut off keeps the chunks that arrived whole ([`Requester::cut_off`]) for its next request
//! to the same source.
//!
//! The requester ([`Requester`]) checks each frame as it comes (its place, and finite values
//! of a buffer of the model) and the source's clock against the run's (decision 0042); whether
//! an optimizer can hold the state is its replica's to say. The source's side is
//! [`state_frames`].

use murmur_protocol::codec::all_finite;
use murmur_protocol::wire::{MessageKind, Resume};

use super::{Head, Lent, Machine, Payload, Turn};
use crate::policy::{Failure, Outcome};
use crate::rejection::Rejection;
use crate::replica::{NamedBuffer, OptimizerBuffers, OuterState, ReplicaState};

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

/// Values a state frame carries at most (4 MiB): a transfer cut off loses at most a chunk.
pub const STATE_CHUNK_VALUES: usize = 1 << 20;

/// A peer's state, taken over.
#[derive(Debug, PartialEq)]
pub struct Taken {
    pub replica: ReplicaState,
    pub outer: Option<OuterState>,
    /// The peer's elastic center, to seed from if this node becomes the center.
    pub center: Option<Vec<f32>>,
}

/// The buffer of a state that chunks go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Params,
    /// The last optimizer state buffer taken.
    Optimizer,
    Anchor,
    Velocity,
    Center,
}

/// What has arrived of a state: whole chunks, in the answer's order.
#[derive(Debug, Default)]
struct Arrived {
    /// The source's id of the state, and its step.
    state: u64,
    step: u64,
    /// The floor of the request it first came to ([`Requester::floor`]): a transfer that
    /// goes on is held to the clock rule as it stood then, since a joiner trains on its own
    /// while it waits, and those steps of a replica it replaces are no reason to refuse the
    /// state it asked for.
    floor: u64,
    params: Vec<f32>,
    buffers: Vec<NamedBuffer>,
    updates: Option<u64>,
    outer: Option<OuterState>,
    center: Option<Vec<f32>>,
    /// The buffer the last chunk went to.
    slot: Option<Slot>,
    /// Values arrived, counted in the answer's order: where a transfer goes on from.
    at: u64,
}

/// What a transfer that was cut off left: the part of a state that arrived, to go on with
/// from the same source ([`Requester::going_on`]).
#[derive(Debug)]
pub struct Partial {
    arrived: Arrived,
    names: Vec<String>,
    count: usize,
}

impl Partial {
    /// The values that arrived.
    pub fn values(&self) -> u64 {
        self.arrived.at
    }
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
    /// What has arrived, of this answer or of a transfer it goes on with; `None` until the
    /// answer's head passed, unless it goes on with one.
    arrived: Option<Arrived>,
    /// Whether the answer's head passed.
    answered: bool,
    /// The head of the frame whose values come next.
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
            arrived: None,
            answered: false,
            pending: None,
        }
    }

    /// The same request, asking the source to go on with the transfer that left `partial`
    /// (from the same source; one of another model or optimizer is let go).
    pub fn going_on(mut self, partial: Partial) -> Self {
        if partial.names == self.names && partial.count == self.count {
            self.arrived = Some(partial.arrived);
        }
        self
    }

    /// The transfer was cut off (the stream broke, or its deadline passed): what arrived of
    /// it, for the next request to the same source, if anything did.
    pub fn cut_off(self) -> Option<Partial> {
        let arrived = self.arrived.filter(|arrived| arrived.at > 0)?;
        Some(Partial {
            arrived,
            names: self.names,
            count: self.count,
        })
    }

    /// Values of the state arrived so far (of a transfer gone on with, too).
    pub fn arrived_values(&self) -> u64 {
        self.arrived.as_ref().map_or(0, |arrived| arrived.at)
    }

    /// The values a whole state of this request's model and optimizer has at least: the
    /// parameters and the optimizer's buffers (an outer loop or a center add more).
    pub fn expected_values(&self) -> u64 {
        ((1 + self.names.len()) * self.count) as u64
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
            resume: self.arrived.as_ref().map(|arrived| Resume {
                state: arrived.state,
                at: arrived.at,
            }),
            ..Head::new(MessageKind::State, self.from)
        }
    }

    /// The answer's head: the first frame of a state whose clock a node where the run's
    /// clock is `reference` may take over, or of the state this node went on with; or the
    /// end: `Busy`, a clock refused (a failure to retry, not an offence), or an offence.
    /// Returns the source's step.
    fn on_answer(&mut self, head: &Head, reference: u64) -> Result<u64, Outcome> {
        if head.kind == MessageKind::Busy {
            return Err(Outcome::Failed(Failure::Stream(
                "the peer is not ready to share its state".into(),
            )));
        }
        let Some(place) = head.resume else {
            return Err(foreign("answered without naming the state it sends"));
        };
        if place.at == 0 {
            if head.kind != MessageKind::State || head.offset.unwrap_or(0) != 0 {
                return Err(unexpected("as the answer to a state request", head.kind));
            }
            check_clock(self.floor(), reference, head.step, self.max_staleness)?;
            // A fresh state: whatever arrived of another is let go.
            self.arrived = Some(Arrived {
                state: place.state,
                step: head.step,
                floor: self.floor(),
                ..Arrived::default()
            });
            return Ok(head.step);
        }
        match &self.arrived {
            Some(arrived) if arrived.state == place.state && arrived.at == place.at => {
                check_clock(arrived.floor, reference, arrived.step, self.max_staleness)?;
                Ok(arrived.step)
            }
            _ => Err(foreign(
                "went on with a transfer from a place this node did not ask for",
            )),
        }
    }

    /// A chunk of the state, `values` from the frame of `head`: the start of the next buffer,
    /// or more of the one the last chunk went to.
    fn on_chunk(&mut self, head: &Head, values: Vec<f32>) -> Result<(), Outcome> {
        let count = self.count;
        let names = &self.names;
        let Some(arrived) = self.arrived.as_mut() else {
            return Err(unexpected("before the answer", head.kind));
        };
        let Some(carried) = Slot::carried_by(head.kind) else {
            return Err(unexpected("in a state", head.kind));
        };
        let what = carried.what();
        if !all_finite(&values) {
            return Err(Outcome::Rejected(Rejection::NotFinite { what }));
        }
        let offset = head.offset.unwrap_or(0);
        let slot = if offset == 0 {
            if let Some(last) = arrived.slot {
                let filled = arrived.buffer(last).map_or(0, Vec::len);
                if filled != count {
                    return Err(short(last.what(), filled, count));
                }
            }
            arrived.start(head, names, count)?
        } else {
            let Some(slot) = arrived.slot.filter(|&slot| slot == carried) else {
                return Err(unexpected(
                    "as more of a buffer that was not under way",
                    head.kind,
                ));
            };
            if slot == Slot::Optimizer {
                arrived.check_optimizer_frame(head, names.get(arrived.buffers.len() - 1))?;
            }
            slot
        };
        let Some(buffer) = arrived.buffer_mut(slot) else {
            return Err(unexpected("before its buffer began", head.kind));
        };
        if offset != buffer.len() as u64 || buffer.len() + values.len() > count {
            return Err(short(what, buffer.len() + values.len(), count));
        }
        buffer.extend_from_slice(&values);
        arrived.at += values.len() as u64;
        Ok(())
    }

    /// The stream ended: the state taken over, or why not.
    fn finish(&mut self) -> Result<Taken, Outcome> {
        let arrived = self
            .arrived
            .take()
            .filter(|arrived| !arrived.params.is_empty());
        let Some(mut arrived) = arrived else {
            return Err(Outcome::Failed(Failure::Stream(
                "the stream ended before the state's parameters".into(),
            )));
        };
        // A buffer starts only once the one before it is whole, and none grows past the
        // model: the last one started is the only one that can be short.
        let filled = arrived
            .slot
            .and_then(|slot| arrived.buffer(slot))
            .map_or(0, Vec::len);
        if filled != self.count {
            let what = arrived.slot.map_or("state", Slot::what);
            let count = self.count;
            // Cut off, not finished: what arrived is kept for the next request.
            self.arrived = Some(arrived);
            return Err(Outcome::Failed(Failure::Stream(format!(
                "the stream ended after {filled} of the {count} values of the {what} buffer"
            ))));
        }
        let buffers = std::mem::take(&mut arrived.buffers);
        if !buffers.is_empty() && buffers.len() != self.names.len() {
            return Err(foreign(&format!(
                "sent {} of the {} optimizer state buffers this run's optimizer keeps",
                buffers.len(),
                self.names.len()
            )));
        }
        let optimizer = (!buffers.is_empty()).then(|| OptimizerBuffers {
            buffers,
            updates: arrived.updates.unwrap_or(0),
        });
        Ok(Taken {
            replica: ReplicaState {
                step: arrived.step,
                params: arrived.params,
                optimizer,
            },
            outer: arrived.outer,
            center: arrived.center,
        })
    }
}

impl Slot {
    /// The slot of the buffers that frames of `kind` carry.
    fn carried_by(kind: MessageKind) -> Option<Slot> {
        match kind {
            MessageKind::State => Some(Slot::Params),
            MessageKind::Optimizer => Some(Slot::Optimizer),
            MessageKind::Anchor => Some(Slot::Anchor),
            MessageKind::Velocity => Some(Slot::Velocity),
            MessageKind::Center => Some(Slot::Center),
            _ => None,
        }
    }

    /// The buffer, in a rejection's words.
    fn what(self) -> &'static str {
        match self {
            Slot::Params => "state",
            Slot::Optimizer => "optimizer state",
            Slot::Anchor => "anchor",
            Slot::Velocity => "outer velocity",
            Slot::Center => "center",
        }
    }
}

impl Arrived {
    /// The buffer `slot` names, where one was started.
    fn buffer(&self, slot: Slot) -> Option<&Vec<f32>> {
        match slot {
            Slot::Params => Some(&self.params).filter(|p| !p.is_empty()),
            Slot::Optimizer => self.buffers.last().map(|b| &b.values),
            Slot::Anchor => self.outer.as_ref().map(|outer| &outer.anchor),
            Slot::Velocity => self.outer.as_ref().map(|outer| &outer.velocity),
            Slot::Center => self.center.as_ref(),
        }
    }

    /// The buffer `slot` names, where [`Arrived::start`] started one.
    fn buffer_mut(&mut self, slot: Slot) -> Option<&mut Vec<f32>> {
        match slot {
            Slot::Params => Some(&mut self.params),
            Slot::Optimizer => self.buffers.last_mut().map(|buffer| &mut buffer.values),
            Slot::Anchor => self.outer.as_mut().map(|outer| &mut outer.anchor),
            Slot::Velocity => self.outer.as_mut().map(|outer| &mut outer.velocity),
            Slot::Center => self.center.as_mut(),
        }
    }

    /// Checks that an `Optimizer` frame carries `expected` (the buffer whose place it is)
    /// and the update count of the buffers before it.
    fn check_optimizer_frame(
        &mut self,
        head: &Head,
        expected: Option<&String>,
    ) -> Result<(), Outcome> {
        let Some(expected) = expected else {
            return Err(unexpected("after the state", head.kind));
        };
        if head.buffers.as_slice() != std::slice::from_ref(expected) {
            return Err(foreign(&format!(
                "sent optimizer state buffer {:?} where `{expected}` belongs",
                head.buffers
            )));
        }
        if *self.updates.get_or_insert(head.step) != head.step {
            return Err(foreign(
                "stamped its optimizer state buffers with different update counts",
            ));
        }
        Ok(())
    }

    /// Starts the buffer the frame of `head` opens, in its place in the answer's order (the
    /// module documentation); returns its slot. `capacity`: the buffer's values.
    fn start(&mut self, head: &Head, names: &[String], capacity: usize) -> Result<Slot, Outcome> {
        let extras = self.outer.is_some() || self.center.is_some();
        let slot = match head.kind {
            MessageKind::State if self.slot.is_none() => {
                self.params = Vec::with_capacity(capacity);
                Slot::Params
            }
            MessageKind::Optimizer
                if self.slot.is_some() && !extras && self.buffers.len() < names.len() =>
            {
                let name = &names[self.buffers.len()];
                self.check_optimizer_frame(head, Some(name))?;
                self.buffers.push(NamedBuffer {
                    name: name.clone(),
                    values: Vec::with_capacity(capacity),
                });
                Slot::Optimizer
            }
            MessageKind::Anchor if self.slot.is_some() && !extras => {
                self.outer = Some(OuterState {
                    anchor: Vec::with_capacity(capacity),
                    anchor_step: head.step,
                    velocity: Vec::new(),
                });
                Slot::Anchor
            }
            MessageKind::Velocity
                if self.center.is_none()
                    && self.outer.as_ref().is_some_and(|o| o.velocity.is_empty()) =>
            {
                if let Some(outer) = self.outer.as_mut() {
                    outer.velocity = Vec::with_capacity(capacity);
                }
                Slot::Velocity
            }
            MessageKind::Center if self.slot.is_some() && self.center.is_none() => {
                self.center = Some(Vec::with_capacity(capacity));
                Slot::Center
            }
            kind => return Err(unexpected("after the state", kind)),
        };
        self.slot = Some(slot);
        Ok(slot)
    }
}

impl Machine for Requester {
    type Done = Taken;

    fn start(&self) -> Vec<(Head, Payload<'_>)> {
        vec![(self.request(), Payload::Empty)]
    }

    /// The answer's head, held to the run's clock as the node hears it now; then the head of
    /// each frame after it.
    fn on_head(&mut self, head: &Head, lent: &mut Lent<'_>) -> Turn<'_, Taken> {
        self.pending = Some(head.clone());
        if std::mem::replace(&mut self.answered, true) {
            return Turn::read_on();
        }
        let reference = run_clock(self.announced, lent.heard.iter().copied());
        match self.on_answer(head, reference) {
            Ok(step) => Turn::answered(step),
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_payload(&mut self, values: Vec<f32>, _: &mut Lent<'_>) -> Turn<'_, Taken> {
        let Some(head) = self.pending.take() else {
            return Turn::done(Err(Outcome::Failed(Failure::Stream(
                "values came before their frame's head".into(),
            ))));
        };
        match self.on_chunk(&head, values) {
            Ok(()) => Turn::read_on(),
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_end(&mut self, _: &mut Lent<'_>) -> Result<Taken, Outcome> {
        self.finish()
    }
}

/// The frames that answer a state request (see the module documentation): the `replica`'s
/// state (with its optimizer's buffers where it has them for the requester: the replica leaves
/// them out for another optimizer's), the `outer` loop's, and the `center` this node holds,
/// each buffer in chunks of `chunk` values ([`STATE_CHUNK_VALUES`]), from the place `from`
/// names in the state `from.state`. A place that is not the start of a chunk of this state's
/// frames (a request that names a place it was never sent) starts it over, at 0. The first
/// frame names the state and the place it starts at.
pub fn state_frames<'a>(
    replica: &'a ReplicaState,
    outer: Option<&'a OuterState>,
    center: Option<&'a [f32]>,
    from: Resume,
    chunk: usize,
) -> Vec<(Head, Payload<'a>)> {
    let mut buffers = vec![(
        Head::new(MessageKind::State, replica.step),
        &replica.params[..],
    )];
    if let Some(optimizer) = &replica.optimizer {
        for buffer in &optimizer.buffers {
            let head = Head {
                buffers: vec![buffer.name.clone()],
                ..Head::new(MessageKind::Optimizer, optimizer.updates)
            };
            buffers.push((head, &buffer.values));
        }
    }
    if let Some(outer) = outer {
        buffers.push((
            Head::new(MessageKind::Anchor, outer.anchor_step),
            &outer.anchor,
        ));
        if !outer.velocity.is_empty() {
            buffers.push((
                Head::new(MessageKind::Velocity, replica.step),
                &outer.velocity,
            ));
        }
    }
    if let Some(center) = center {
        buffers.push((Head::new(MessageKind::Center, replica.step), center));
    }
    let mut frames = Vec::new();
    let mut at = 0u64;
    for (head, values) in buffers {
        for (i, piece) in values.chunks(chunk.max(1)).enumerate() {
            let head = Head {
                offset: Some((i * chunk.max(1)) as u64),
                ..head.clone()
            };
            frames.push((at, head, Payload::Values(piece)));
            at += piece.len() as u64;
        }
    }
    let start = frames
        .iter()
        .position(|(at, _, _)| *at == from.at)
        .unwrap_or(0);
    let mut frames: Vec<(Head, Payload<'a>)> = frames
        .into_iter()
        .skip(start)
        .map(|(_, head, payload)| (head, payload))
        .collect();
    let at = if start == 0 { 0 } else { from.at };
    if let Some((head, _)) = frames.first_mut() {
        head.resume = Some(Resume {
            state: from.state,
            at,
        });
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

fn foreign(why: &str) -> Outcome {
    Outcome::Rejected(Rejection::ForeignState(why.to_owned()))
}

/// A buffer of `found` values where one of `expected` belongs.
fn short(what: &'static str, found: usize, expected: usize) -> Outcome {
    Outcome::Rejected(Rejection::WrongLength {
        what,
        found,
        expected,
    })
}

fn unexpected(what: &'static str, kind: MessageKind) -> Outcome {
    Outcome::Rejected(Rejection::Unexpected {
        what,
        kind: format!("{kind:?}"),
    })
}

#[cfg(test)]
mod tests;
