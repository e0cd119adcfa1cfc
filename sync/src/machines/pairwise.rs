//! The pairwise exchange of `/murmur/params/3`, one machine per side.
//!
//! 1. The initiator offers ([`Initiator`]'s start): its step and, for a compressed exchange,
//!    the codecs it takes, preferred first, and the version of the pair's copies.
//! 2. The responder answers with its parameters ([`Responder`]'s start) or, before any machine
//!    exists, `Busy`.
//! 3. The initiator reads the answer's head and sends its own parameters while the responder's
//!    come in: both directions of the link carry a snapshot at once (decision 0027), and
//!    nothing large goes to a busy partner.
//! 4. The initiator judges what came in and ends the stream (both sides mix) or answers `Busy`
//!    (neither does).
//! 5. The responder reads the initiator's parameters, then its verdict (the stream's end or
//!    `Busy`), and judges what came in.
//!
//! Judging is the same on both sides: the values must be a whole, finite model; the screen
//! admits their distance (to this snapshot, or for a compressed exchange the gap between the
//! pair's copies, decision 0034) or finds an outlier; admitted values are clipped within its
//! radius; the mix's weight falls with the two snapshots' age (decision 0029).
//!
//! A compressed exchange (any codec but `f32`) sends differences against the pair's copies
//! ([`Copies`]), which the driver lends to one exchange of the pair at a time and hands to the
//! machine at each call that reads or changes them.

use std::sync::Arc;

use murmur_protocol::codec::{Codec, all_finite};
use murmur_protocol::mix;
use murmur_protocol::wire::MessageKind;

use super::{Head, Lent, Machine, Mixed, Payload, Turn, Weighing};
use crate::copies::{Copies, Gap, Gauge, Sent};
use crate::policy::{Failure, Outcome};
use crate::rejection::Rejection;
use crate::replica::{Delta, ExchangeEnd, Snapshot};
use crate::screen::{self, Screen};
use crate::settings::SyncSettings;

/// What either side holds and judges by: the snapshot it sends (or, compressed, its
/// difference), the screen the partner's parameters pass and the mix's weight.
#[derive(Debug)]
struct Side {
    weighing: Weighing,
    sparse_codec: Option<Codec>,
    /// The step of the snapshot.
    step: u64,
    /// The snapshot, until a compressed exchange's difference stands (decision 0090: what
    /// comes in is judged and mixed against the pair's copies; the snapshot would be a model
    /// held for nothing while it comes).
    snapshot: Option<Arc<Snapshot>>,
    screen: Screen,
    weight: f32,
    difference: Option<Difference>,
    /// The gap the driver took over the partner's difference as it came in.
    gap: Option<Gap>,
}

impl Side {
    fn new(settings: &SyncSettings, snapshot: Arc<Snapshot>, weight: f32, screen: Screen) -> Self {
        Side {
            weighing: Weighing::of(settings),
            sparse_codec: settings.sparse_codec,
            step: snapshot.step,
            snapshot: Some(snapshot),
            screen,
            weight,
            difference: None,
            gap: None,
        }
    }

    /// The snapshot's parameters, where it is still held.
    fn params(&self) -> Option<&[f32]> {
        self.snapshot
            .as_ref()
            .map(|snapshot| snapshot.params.as_slice())
    }

    /// This side's difference against `copies` in `codec`, made from the snapshot (unless the
    /// one made ahead stands); once `settle`d, the snapshot is let go. `false` where none can
    /// stand: the one made ahead is of another codec or version, and its snapshot is gone.
    fn make_difference(&mut self, copies: &Copies, codec: Codec, settle: bool) -> bool {
        let ahead = self.difference.as_ref();
        let stands = ahead.is_some_and(|d| d.codec == codec && d.version == copies.version);
        if !stands {
            let Some(params) = self.params() else {
                self.difference = None;
                return false;
            };
            self.difference = Some(Difference::against(copies, codec, params));
        }
        if settle {
            self.snapshot = None;
        }
        true
    }

    /// A gauge of the gap over the partner's difference as it comes in (a compressed
    /// exchange).
    fn gauge(&self) -> Option<Gauge<'_>> {
        let difference = self.difference.as_ref()?;
        Some(Gauge::new(difference.sent(), difference.count))
    }

    /// The mix's weight with a partner at `theirs` (decision 0029: the two steps alone, so
    /// both sides agree).
    fn weigh(&mut self, theirs: u64) {
        self.weight = self.weighing.partner(self.step, theirs, self.weight);
    }

    /// This side's parameters, or its difference.
    fn frame(&self) -> (Head, Payload<'_>) {
        match (&self.difference, self.params()) {
            (Some(difference), _) => (difference.head(self.step), difference.payload()),
            (None, Some(params)) => (
                Head::new(MessageKind::Params, self.step),
                Payload::Values(params),
            ),
            (None, None) => unreachable!("the snapshot is let go only once a difference stands"),
        }
    }

    /// The judgement of the partner's parameters (see the module documentation): the mix's
    /// delta, what this replica moves by before the mix's weight.
    fn judge(&mut self, received: Vec<f32>, copies: Option<&mut Copies>) -> Result<Mixed, Outcome> {
        let measured = self.gap.take();
        let count = match &self.difference {
            Some(difference) => difference.count,
            None => self.params().map_or(0, <[f32]>::len),
        };
        screen::whole(&received, count, "parameters").map_err(Outcome::Rejected)?;
        // A value that is not finite makes the distance (or the gap) so: the values are read
        // again to find whether they were the cause only then, not on every exchange.
        let not_finite = |what| Outcome::Rejected(Rejection::NotFinite { what });
        let screen = self.screen;
        let (delta, cleared, sparse) = match (&self.difference, copies, self.params()) {
            (None, _, Some(own)) => {
                let distance = mix::distance(&received, own);
                if !distance.is_finite() && !all_finite(&received) {
                    return Err(not_finite("parameters"));
                }
                let own_norm = mix::norm(own);
                let admitted = screen.admit_by_norm(distance, own_norm)?;
                let mut delta = received;
                mix::into_delta(&mut delta, own, 1.0);
                let cleared = admitted.clip_mix(&mut delta, own, own_norm);
                (Delta::Values(delta), cleared, false)
            }
            (Some(difference), Some(copies), _) => {
                // One pass for the gap (or none, where the driver took it as the values came
                // in), one to commit, one for the clip's sums: no whole-model temporary, no
                // snapshot, and what came in let go once committed; the delta is read off the
                // copies when it lands (decision 0092).
                let gap = match measured {
                    Some(measured) => measured.gap,
                    None => copies.gap_after(difference.sent(), &received),
                };
                let Some(gap) = gap else {
                    let finite = all_finite(&received);
                    return Err(not_finite(if finite {
                        "the partner's copy"
                    } else {
                        "parameters"
                    }));
                };
                let admitted = screen.admit_by_norm(gap, difference.own_norm)?;
                copies.commit(difference.sent(), &received);
                drop(received);
                let scale = difference.codec.consensus_scale();
                let (step, cleared) = admitted.clip_step(copies, scale, difference.own_norm);
                let sparse = Some(difference.codec) == self.sparse_codec;
                let delta = Delta::Step { step, copies: None };
                (delta, cleared, sparse)
            }
            // The copies were not lent to this exchange: it cannot mix.
            (Some(_), None, _) => return Err(Outcome::Busy),
            (None, _, None) => unreachable!("the snapshot is let go only once a difference stands"),
        };
        Ok(Mixed {
            outcome: cleared.outcome,
            end: ExchangeEnd::Mix {
                delta,
                weight: self.weight,
            },
            clipped: cleared.clipped,
            sparse,
        })
    }
}

/// A compressed exchange under way: its codec, the copies' version it runs against, the
/// difference this side sends, encoded, of `count` values, and the norm of the snapshot it
/// was taken from (what the screen needs of the snapshot once it is let go).
#[derive(Debug)]
struct Difference {
    codec: Codec,
    version: u64,
    encoded: Vec<u8>,
    count: usize,
    own_norm: f64,
}

impl Difference {
    /// This side's difference against `copies` (at the version both agreed on).
    fn against(copies: &Copies, codec: Codec, params: &[f32]) -> Self {
        Difference {
            codec,
            version: copies.version,
            encoded: copies.difference(codec, params),
            count: params.len(),
            own_norm: mix::norm(params),
        }
    }

    fn sent(&self) -> Sent<'_> {
        Sent {
            codec: self.codec,
            bytes: &self.encoded,
        }
    }

    fn head(&self, step: u64) -> Head {
        Head {
            codec: self.codec,
            reference: Some(self.version),
            ..Head::new(MessageKind::Params, step)
        }
    }

    fn payload(&self) -> Payload<'_> {
        Payload::Encoded {
            bytes: &self.encoded,
            count: self.count,
        }
    }
}

/// The side that offers.
#[derive(Debug)]
pub struct Initiator {
    /// Its weight is the one before age weighting until the answer comes; its difference
    /// is made once it comes.
    side: Side,
    /// A compressed offer: the codecs it takes and the copies' version it names.
    accept: Vec<Codec>,
    reference: Option<u64>,
}

impl Initiator {
    /// An exchange of `snapshot` through `codec`, to be mixed with `weight` (before age
    /// weighting) as `screen` passes the partner's parameters. A compressed exchange also
    /// takes `sync.codec` where the partner does not take `codec`, and runs on the pair's
    /// `copies`, lent to it.
    pub fn new(
        settings: &SyncSettings,
        snapshot: Arc<Snapshot>,
        codec: Codec,
        weight: f32,
        screen: Screen,
        copies: Option<&Copies>,
    ) -> Self {
        let (accept, reference) = match copies {
            Some(copies) if codec != Codec::F32 => {
                let mut accept = vec![codec];
                if settings.codec != codec {
                    accept.push(settings.codec);
                }
                (accept, Some(copies.version))
            }
            _ => (Vec::new(), None),
        };
        Initiator {
            side: Side::new(settings, snapshot, weight, screen),
            accept,
            reference,
        }
    }

    /// The snapshot, where this side still holds it: a dense exchange's, or a compressed one's
    /// until the answer took its difference (decision 0090). The driver offers it to another
    /// partner where this one declined; once let go, it is spent with this exchange.
    pub fn take_snapshot(&mut self) -> Option<Arc<Snapshot>> {
        self.side.snapshot.take()
    }

    /// The offer that opens the stream (no payload).
    fn offer(&self) -> Head {
        Head {
            accept: self.accept.clone(),
            reference: self.reference,
            ..Head::new(MessageKind::Offer, self.side.step)
        }
    }

    /// The partner's answer: its parameters follow, and this side's go out meanwhile (made
    /// here unless worked out ahead in the codec and version the answer took); or the
    /// exchange ends, `Busy` or an offence.
    fn on_answer(&mut self, answer: &Head, copies: Option<&mut Copies>) -> Result<(), Outcome> {
        match answer.kind {
            MessageKind::Params => {}
            MessageKind::Busy => return Err(Outcome::Busy),
            kind => return Err(unexpected("as the answer to an exchange offer", kind)),
        }
        self.side.weigh(answer.step);
        let Some(offered) = self.reference else {
            return Ok(());
        };
        let Some(copies) = copies else {
            // The copies were not lent to this exchange: it cannot go on.
            return Err(Outcome::Busy);
        };
        let codec = answer.codec;
        let Some(version) = answer.reference.filter(|_| self.accept.contains(&codec)) else {
            return Err(Outcome::Rejected(Rejection::Unexpected {
                what: "as the answer to a compressed offer",
                kind: format!("{codec:?} without a copy's version"),
            }));
        };
        // The partner answers against our version, or starts both sides again from zero
        // copies.
        if version != offered {
            if version != 0 {
                return Err(Outcome::Rejected(Rejection::Unexpected {
                    what: "as the answer to a compressed offer",
                    kind: format!("a difference against copy version {version}"),
                }));
            }
            copies.agree(Some(0));
        }
        // The difference worked out ahead stands if the answer took its codec and version.
        // Where it does not, its snapshot is gone (decision 0093): this exchange ends without
        // a mix, and the pair's next one runs on the zero copies both sides now hold.
        if !self.side.make_difference(copies, codec, true) {
            return Err(Outcome::Busy);
        }
        Ok(())
    }

    /// Judges the partner's parameters (`received`, decoded) once this side's went out: the
    /// mix, after which the stream ends (the partner mixes too); or, as `Err`, why this side
    /// declines, which it tells the partner with `Busy`.
    fn judge(&mut self, received: Vec<f32>, copies: Option<&mut Copies>) -> Result<Mixed, Outcome> {
        self.side.judge(received, copies)
    }
}

impl Machine for Initiator {
    type Done = Mixed;

    fn start(&self) -> Vec<(Head, Payload<'_>)> {
        vec![(self.offer(), Payload::Empty)]
    }

    /// A compressed offer: our difference against the copies, in the codec offered first,
    /// while the partner makes its own; the answer keeps it unless it starts the copies again
    /// or takes another codec. A model-sized pass off the exchange's path (a `Busy` answer
    /// wastes it). An offer of one codec lets its snapshot go at once (decision 0093): the
    /// partner's trainer makes its answer at the end of a step, and the snapshot would be a
    /// model held for nothing meanwhile; should the answer start the copies again, the
    /// exchange ends without a mix.
    fn work_ahead(&mut self, lent: &mut Lent<'_>) {
        if let (Some(copies), Some(&codec)) = (lent.copies.as_deref(), self.accept.first()) {
            let settle = self.accept.len() == 1;
            self.side.make_difference(copies, codec, settle);
        }
    }

    /// The answer's head: ours goes out while its parameters come in (after which this side
    /// is done), their gap taken as they come.
    fn on_head(&mut self, head: &Head, lent: &mut Lent<'_>) -> Turn<'_, Mixed> {
        if let Err(outcome) = self.on_answer(head, lent.copies.as_deref_mut()) {
            return Turn::done(Err(outcome));
        }
        let side = &self.side;
        Turn {
            send: vec![side.frame()],
            gauge: side.gauge(),
            ..Turn::answered(head.step)
        }
    }

    fn on_gap(&mut self, gap: Gap) {
        self.side.gap = Some(gap);
    }

    /// The partner's parameters: the mix, after which the stream ends (the partner mixes
    /// too), or `Busy` (neither does).
    fn on_payload(&mut self, values: Vec<f32>, lent: &mut Lent<'_>) -> Turn<'_, Mixed> {
        match self.judge(values, lent.copies.as_deref_mut()) {
            Ok(mixed) => Turn::done(Ok(mixed)),
            Err(outcome) => Turn {
                send: vec![busy(self.side.step)],
                ..Turn::done(Err(outcome))
            },
        }
    }

    fn on_end(&mut self, _: &mut Lent<'_>) -> Result<Mixed, Outcome> {
        Err(Outcome::Failed(Failure::Stream(
            "the stream ended before the partner's answer".into(),
        )))
    }
}

/// The side that answers an offer.
#[derive(Debug)]
pub struct Responder {
    side: Side,
    /// The initiator's parameters, decoded, until its verdict.
    received: Option<Vec<f32>>,
}

impl Responder {
    /// The codec of a compressed exchange that `offer` asks for and this node takes: the first
    /// of its list; `None` for a dense exchange.
    pub fn codec(settings: &SyncSettings, offer: &Head) -> Option<Codec> {
        offer.accept.iter().copied().find(|&c| settings.takes(c))
    }

    /// Answers `offer` with `snapshot`, to be mixed with `weight` (before age weighting) as
    /// `screen` passes the initiator's parameters. A compressed exchange (a codec this node
    /// takes, see [`Responder::codec`]) runs on the pair's `copies`, lent to it: at the
    /// offer's version, or zero copies where the two disagree.
    pub fn new(
        settings: &SyncSettings,
        offer: &Head,
        snapshot: Arc<Snapshot>,
        weight: f32,
        screen: Screen,
        copies: Option<&mut Copies>,
    ) -> Self {
        let mut side = Side::new(settings, snapshot, weight, screen);
        side.weigh(offer.step);
        if let (Some(codec), Some(copies)) = (Self::codec(settings, offer), copies) {
            copies.agree(offer.reference);
            side.make_difference(copies, codec, true);
        }
        Responder {
            side,
            received: None,
        }
    }

    /// The answer: this side's parameters, or its difference.
    fn answer(&self) -> (Head, Payload<'_>) {
        self.side.frame()
    }

    /// The head of what the initiator sent while the answer went out: its parameters (then
    /// its verdict follows), or `Busy` (it declined ours, so neither side mixes).
    fn on_params(&self, head: &Head) -> Result<(), Outcome> {
        let expected = match &self.side.difference {
            Some(difference) => {
                head.codec == difference.codec && head.reference == Some(difference.version)
            }
            None => true,
        };
        match head.kind {
            MessageKind::Params if expected => Ok(()),
            MessageKind::Busy => Err(Outcome::Busy),
            kind => {
                let what = if self.side.difference.is_some() {
                    "as the answer to our compressed difference"
                } else {
                    "as the answer to our snapshot"
                };
                Err(Outcome::Rejected(Rejection::Unexpected {
                    what,
                    kind: format!("{kind:?} ({:?}, copy {:?})", head.codec, head.reference),
                }))
            }
        }
    }

    /// The initiator's verdict after its parameters: the stream's end (`None`: it mixes ours)
    /// or a `Busy` head (it declined them). Anything else is an offence.
    fn on_verdict(&self, verdict: Option<&Head>) -> Result<(), Outcome> {
        match verdict {
            None => Ok(()),
            Some(head) if head.kind == MessageKind::Busy => Err(Outcome::Busy),
            Some(head) => Err(unexpected("after the initiator's parameters", head.kind)),
        }
    }

    /// Judges the initiator's parameters (`received`, decoded) once it ended the stream: the
    /// mix, or, as `Err`, why this side does not mix.
    fn judge(&mut self, received: Vec<f32>, copies: Option<&mut Copies>) -> Result<Mixed, Outcome> {
        self.side.judge(received, copies)
    }
}

impl Machine for Responder {
    type Done = Mixed;

    fn start(&self) -> Vec<(Head, Payload<'_>)> {
        vec![self.answer()]
    }

    /// The head of the initiator's parameters, then of its verdict where it declines.
    fn on_head(&mut self, head: &Head, _: &mut Lent<'_>) -> Turn<'_, Mixed> {
        let read = if self.received.is_some() {
            self.on_verdict(Some(head))
        } else {
            self.on_params(head)
        };
        match read {
            // The initiator's parameters: their gap taken as they come.
            Ok(()) if self.received.is_none() => Turn {
                gauge: self.side.gauge(),
                ..Turn::read_on()
            },
            Ok(()) => Turn::read_on(),
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_gap(&mut self, gap: Gap) {
        self.side.gap = Some(gap);
    }

    fn on_payload(&mut self, values: Vec<f32>, _: &mut Lent<'_>) -> Turn<'_, Mixed> {
        self.received = Some(values);
        Turn::read_on()
    }

    /// The stream's end after the initiator's parameters: it mixes ours, and we judge theirs.
    fn on_end(&mut self, lent: &mut Lent<'_>) -> Result<Mixed, Outcome> {
        let Some(received) = self.received.take() else {
            return Err(Outcome::Failed(Failure::Stream(
                "the stream ended before the initiator's parameters".into(),
            )));
        };
        self.on_verdict(None)?;
        self.judge(received, lent.copies.as_deref_mut())
    }
}

/// `Busy`, alone: not now, or declined.
fn busy(step: u64) -> (Head, Payload<'static>) {
    (Head::new(MessageKind::Busy, step), Payload::Empty)
}

fn unexpected(what: &'static str, kind: MessageKind) -> Outcome {
    Outcome::Rejected(Rejection::Unexpected {
        what,
        kind: format!("{kind:?}"),
    })
}

#[cfg(test)]
mod tests;
