//! The stream protocols as sans-IO machines, one per protocol and side: a machine is fed the
//! frames that came in (their [`Head`] and decoded values) and returns the frames to write and,
//! at the end, a verdict. It holds the protocol's message order and its checks; a driver holds
//! only the I/O. Every machine that reads a stream speaks one interface, [`Machine`], so one
//! driver runs them all. The daemon's engine drives them over its streams (with the run's header
//! fields, deadlines, and sending while receiving, decision 0027): libp2p streams in a real
//! node, the simulated network's in the daemon's simulator.
//!
//! - [`pairwise`]: the pairwise exchange of `/murmur/params/3`, dense or compressed.
//! - [`elastic`]: a worker's request to the elastic center, and the center's answer.
//! - [`state`]: state sync, a peer's whole state taken over.

pub mod elastic;
pub mod pairwise;
pub mod state;

use murmur_protocol::codec::{Codec, CodecError};
use murmur_protocol::sync::{mix_weight, partner_mix_weight};
use murmur_protocol::wire::{MessageKind, Resume, TensorHeader};

use crate::copies::{Copies, Gap, Gauge};
use crate::policy::{Outcome, Request};
use crate::rejection::Rejection;
use crate::replica::ExchangeEnd;
use crate::screen;
use crate::settings::SyncSettings;

/// The part of a frame's header that a protocol decides. The wire's header adds the run, the
/// model's fingerprint, and the payload's length and checksum, which the driver fills in and
/// checks.
#[derive(Clone, Debug, PartialEq)]
pub struct Head {
    pub kind: MessageKind,
    /// The sender's step (of its snapshot, where it sends one).
    pub step: u64,
    /// How the payload's values are encoded.
    pub codec: Codec,
    /// A compressed difference: the version of the pair's copies it is taken against.
    pub reference: Option<u64>,
    /// An offer: the codecs the sender takes, preferred first.
    pub accept: Vec<Codec>,
    /// State sync: in a request, the optimizer state buffers the requester keeps; in an
    /// `Optimizer` frame, the one it carries.
    pub buffers: Vec<String>,
    /// State sync: in an answer's frame, the index in its buffer of its first value.
    pub offset: Option<u64>,
    /// State sync: in a request, the transfer to go on with; in an answer's first frame, the
    /// state it sends and where it starts.
    pub resume: Option<Resume>,
}

impl Head {
    /// A head of `kind` at `step`, its values in `f32`.
    pub fn new(kind: MessageKind, step: u64) -> Self {
        Head {
            kind,
            step,
            codec: Codec::F32,
            reference: None,
            accept: Vec::new(),
            buffers: Vec::new(),
            offset: None,
            resume: None,
        }
    }
}

impl Head {
    /// The wire header of a frame of this head carrying `payload`: the head's fields, with the
    /// run, the model's fingerprint, and the payload's length and checksum.
    pub fn wire_header(&self, payload: Payload<'_>, run: &str, model: &str) -> TensorHeader {
        let mut header = match payload {
            Payload::Empty => {
                TensorHeader::for_encoded(self.kind, run, model, self.step, self.codec, 0, &[])
            }
            Payload::Values(values) => {
                TensorHeader::for_payload(self.kind, run, model, self.step, values)
            }
            Payload::Encoded { bytes, count } => TensorHeader::for_encoded(
                self.kind, run, model, self.step, self.codec, count, bytes,
            ),
        };
        header.reference = self.reference;
        header.accept = self.accept.clone();
        header.buffers = self.buffers.clone();
        header.offset = self.offset;
        header.resume = self.resume;
        header
    }
}

impl From<&TensorHeader> for Head {
    fn from(header: &TensorHeader) -> Self {
        Head {
            kind: header.kind,
            step: header.step,
            codec: header.codec,
            reference: header.reference,
            accept: header.accept.clone(),
            buffers: header.buffers.clone(),
            offset: header.offset,
            resume: header.resume,
        }
    }
}

/// The values a frame carries, lent by the machine that sends them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Payload<'a> {
    /// None: an offer, or `Busy`.
    Empty,
    /// Values sent as they are (`f32`).
    Values(&'a [f32]),
    /// `count` values, encoded by the head's codec.
    Encoded { bytes: &'a [u8], count: usize },
}

impl Payload<'_> {
    /// The values as the receiver's wire decodes them, `codec` the head's.
    pub fn decoded(self, codec: Codec) -> Result<Vec<f32>, CodecError> {
        match self {
            Payload::Empty => Ok(Vec::new()),
            Payload::Values(values) => Ok(values.to_vec()),
            Payload::Encoded { bytes, count } => codec.decode(bytes, count),
        }
    }
}

/// A side of a stream protocol, as its driver runs it: the frames that open its part of the
/// stream ([`Machine::start`]), then each frame that comes in, its head first
/// ([`Machine::on_head`]: what to write while its payload is read, decision 0027) and its
/// payload next ([`Machine::on_payload`]), until the machine is done or the stream ends
/// ([`Machine::on_end`]). Once done, the driver writes what the last turn sends and ends its
/// side of the stream.
pub trait Machine {
    /// What the side comes to when it completes: a mix, a state taken over.
    type Done;

    /// The frames this side opens with: a request, or an answer.
    fn start(&self) -> Vec<(Head, Payload<'_>)>;

    /// Work this side can do once its opening frames went out, while it waits for the
    /// other side's first: its driver calls it then, and the result does not depend on
    /// whether it did. By default, nothing.
    fn work_ahead(&mut self, _lent: &mut Lent<'_>) {}

    /// The head of a frame that came in; its payload is read next.
    fn on_head(&mut self, head: &Head, lent: &mut Lent<'_>) -> Turn<'_, Self::Done>;

    /// The gap the turn's [`Turn::gauge`] took over the payload that came in, given before
    /// [`Machine::on_payload`] where the driver fed the gauge every value. By default, nothing.
    fn on_gap(&mut self, _gap: Gap) {}

    /// The payload of the frame whose head came last, decoded.
    fn on_payload(&mut self, values: Vec<f32>, lent: &mut Lent<'_>) -> Turn<'_, Self::Done>;

    /// The stream ended before this side was done.
    fn on_end(&mut self, lent: &mut Lent<'_>) -> Result<Self::Done, Outcome>;
}

/// What a machine does after one input: the frames to write now and, once it is done, what it
/// came to.
#[derive(Debug)]
pub struct Turn<'a, T> {
    pub send: Vec<(Head, Payload<'a>)>,
    /// A compressed exchange: the gap to take over the payload as it comes in (each piece the
    /// wire decodes, with the pair's copies), handed back with [`Machine::on_gap`], so that
    /// the judge need not read the whole model once more. A driver that does not feed it
    /// loses nothing but the time: the judge then takes the gap itself.
    pub gauge: Option<Gauge<'a>>,
    /// The peer's clock that the head just read showed (an answer's step), for the driver to
    /// note in its peer table: a clock seen in a frame is fresher than the peer's last
    /// heartbeat, and the staleness gate waits on it.
    pub saw_step: Option<u64>,
    pub end: Option<Result<T, Outcome>>,
}

impl<T> Turn<'_, T> {
    /// Nothing to write; more to read.
    fn read_on() -> Self {
        Turn {
            send: Vec::new(),
            gauge: None,
            saw_step: None,
            end: None,
        }
    }

    /// An answer's head passed, showing the peer's clock at `step`; more to read.
    fn answered(step: u64) -> Self {
        Turn {
            saw_step: Some(step),
            ..Turn::read_on()
        }
    }

    /// Done, with nothing more to write.
    fn done(end: Result<T, Outcome>) -> Self {
        Turn {
            send: Vec::new(),
            gauge: None,
            saw_step: None,
            end: Some(end),
        }
    }
}

/// What a driver lends a machine for one call: what the node holds beside the stream.
#[derive(Debug, Default)]
pub struct Lent<'a> {
    /// A compressed pairwise exchange's copies of the pair, which the driver lends to one
    /// exchange of the pair at a time.
    pub copies: Option<&'a mut Copies>,
    /// The clocks heard from the node's live peers: state sync holds a state's clock to the
    /// run's (decision 0042).
    pub heard: &'a [u64],
}

impl<'a> Lent<'a> {
    /// The pair's copies, where the exchange holds them.
    pub fn copies(copies: Option<&'a mut Copies>) -> Self {
        Lent { copies, heard: &[] }
    }

    /// The clocks heard from the live peers.
    pub fn heard(heard: &'a [u64]) -> Self {
        Lent {
            copies: None,
            heard,
        }
    }
}

/// A frame as it arrives whole: its head, and its values as the receiver's wire decodes them.
pub type Frame = (Head, Vec<f32>);

/// The stream protocol an inbound request came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `/murmur/params/3`: a pairwise offer, or an elastic worker's parameters.
    Params,
    /// `/murmur/state/4`: a state request.
    State,
}

/// The request that opens an inbound stream of `protocol`, read from the head and the decoded
/// payload of its first frame: an empty offer, an elastic worker's parameters (whole and
/// finite, of a model of `param_count` values) or an empty state request. Anything else is an
/// offence. The answering side's machine starts from the request its node's policy answers.
pub fn request(
    protocol: Protocol,
    head: &Head,
    payload: &[f32],
    param_count: usize,
) -> Result<Request, Outcome> {
    match (protocol, head.kind) {
        (Protocol::Params, MessageKind::Offer) if payload.is_empty() => {
            Ok(Request::Offer { step: head.step })
        }
        (Protocol::Params, MessageKind::Params) => {
            screen::full_and_finite(payload, param_count, "parameters")
                .map_err(Outcome::Rejected)?;
            Ok(Request::Params { step: head.step })
        }
        (Protocol::State, MessageKind::State) if payload.is_empty() => Ok(Request::State),
        (protocol, kind) => Err(Outcome::Rejected(Rejection::Unexpected {
            what: match protocol {
                Protocol::Params => "on the params protocol",
                Protocol::State => "on the state protocol",
            },
            kind: format!("{kind:?} with {} values", payload.len()),
        })),
    }
}

/// What a machine made of the frames [`feed`] gave it.
#[derive(Debug)]
pub struct Fed<T> {
    /// What it wrote meanwhile, as the receiver will read them.
    pub sent: Vec<Frame>,
    /// The peer's clock a head showed ([`Turn::saw_step`]).
    pub saw_step: Option<u64>,
    /// What it came to, once done.
    pub end: Option<Result<T, Outcome>>,
}

impl<T> Fed<T> {
    /// The same, with what it came to mapped by `f`.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Fed<U> {
        Fed {
            sent: self.sent,
            saw_step: self.saw_step,
            end: self.end.map(|end| end.map(f)),
        }
    }
}

/// Feeds `machine` whole frames that came in, then the stream's end where it came (`ended`),
/// as a driver that moves whole frames does (the machines' tests, the poisoning benchmark):
/// a turn's gauge takes the payload's gap in pieces of about [`FED_PIECE`] values, as the
/// engine's takes it while the payload comes in.
pub fn feed<M: Machine>(
    machine: &mut M,
    frames: Vec<Frame>,
    ended: bool,
    lent: &mut Lent<'_>,
) -> Fed<M::Done> {
    let mut fed = Fed {
        sent: Vec::new(),
        saw_step: None,
        end: None,
    };
    for (head, values) in frames {
        let Turn {
            send,
            gauge,
            saw_step,
            end,
        } = machine.on_head(&head, lent);
        fed.saw_step = fed.saw_step.or(saw_step);
        fed.sent.extend(send.into_iter().map(carried));
        if end.is_some() {
            fed.end = end;
            return fed;
        }
        let gap = gauge.and_then(|mut gauge| {
            let copies = lent.copies.as_deref()?;
            let piece = head.codec.piece(FED_PIECE).unwrap_or(values.len()).max(1);
            for (i, values) in values.chunks(piece).enumerate() {
                gauge.add(copies, i * piece, values);
            }
            gauge.finish()
        });
        if let Some(gap) = gap {
            machine.on_gap(gap);
        }
        let turn = machine.on_payload(values, lent);
        fed.sent.extend(turn.send.into_iter().map(carried));
        if turn.end.is_some() {
            fed.end = turn.end;
            return fed;
        }
    }
    fed.end = ended.then(|| machine.on_end(lent));
    fed
}

/// Values in a piece of a payload that [`feed`] hands a gauge.
pub const FED_PIECE: usize = 16;

/// A machine's frame as the receiver reads it: its head, and its values decoded (a machine's
/// own encoding always decodes).
pub fn carried((head, payload): (Head, Payload<'_>)) -> Frame {
    let values = payload.decoded(head.codec).unwrap_or_default();
    (head, values)
}

/// How a mix is weighed by the two sides' steps, from the node's sync settings: past the mix
/// bound, an elastic exchange is not mixed and a pairwise partner counts the less (decision
/// 0029); with `age_weighting`, older parameters count the less.
#[derive(Clone, Copy, Debug)]
struct Weighing {
    bound: Option<u64>,
    age_weighting: bool,
}

impl Weighing {
    fn of(settings: &SyncSettings) -> Self {
        Weighing {
            bound: settings.mix_bound(),
            age_weighting: settings.age_weighting,
        }
    }

    /// A pairwise partner's weight: the two steps alone set it, so both sides agree.
    fn partner(&self, own: u64, theirs: u64, base: f32) -> f32 {
        partner_mix_weight(own, theirs, self.bound, base, self.age_weighting)
    }

    /// An elastic exchange's weight, or `None`: too stale to mix.
    fn elastic(&self, own: u64, theirs: u64) -> Option<f32> {
        mix_weight(own, theirs, self.bound, 1.0, self.age_weighting)
    }
}

/// An exchange this side completed: what lands on the replica, and what the node counts.
#[derive(Debug)]
pub struct Mixed {
    /// [`Outcome::Mixed`], with the distance (or the delta's norm) and the credit.
    pub outcome: Outcome,
    /// What lands on the replica.
    pub end: ExchangeEnd,
    /// What came in lay past the clip radius and was moved within it.
    pub clipped: bool,
    /// It went through the sparse codec `sync.adapt_codec` picks for slow links.
    pub sparse: bool,
}

#[cfg(test)]
pub(crate) mod testing {
    use murmur_protocol::codec::Codec;
    use murmur_protocol::heartbeat::SyncMode;

    use crate::settings::SyncSettings;

    /// Gossip settings with `codec`, a staleness bound of 16 and no age weighting.
    pub(crate) fn settings(codec: Codec) -> SyncSettings {
        SyncSettings {
            codec,
            ..SyncSettings::for_tests(SyncMode::Gossip)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every request the two protocols take, and what else is an offence.
    #[test]
    fn a_request_is_read_by_its_protocol_kind_and_payload() {
        let head = |kind| Head::new(kind, 9);
        let params = [0.5; 4];
        let read = |protocol, kind, payload: &[f32]| request(protocol, &head(kind), payload, 4);
        use MessageKind::{Offer, Params, State};
        use Protocol as P;
        assert_eq!(read(P::Params, Offer, &[]), Ok(Request::Offer { step: 9 }));
        assert_eq!(
            read(P::Params, Params, &params),
            Ok(Request::Params { step: 9 })
        );
        assert_eq!(read(P::State, State, &[]), Ok(Request::State));
        let offence =
            |result: Result<Request, Outcome>| matches!(result, Err(Outcome::Rejected(_)));
        assert!(
            offence(read(P::Params, Offer, &params)),
            "an offer with values"
        );
        assert!(
            offence(read(P::Params, Params, &params[..3])),
            "a short model"
        );
        assert!(offence(read(P::Params, Params, &[0.5, f32::NAN, 0.5, 0.5])));
        assert!(offence(read(P::State, Offer, &[])), "an offer on state");
        assert!(
            offence(read(P::Params, State, &[])),
            "a state request on params"
        );
        assert!(offence(read(P::Params, MessageKind::Busy, &[])));
    }
}
