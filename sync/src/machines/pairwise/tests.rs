//! The two machines driven against each other, frame by frame, as a driver would: what each
//! side mixes, what the pair's copies hold after, and how each way of declining ends both.

use super::*;
use crate::copies::ConsensusStep;
use crate::machines::testing::settings;
use crate::machines::{Frame, carried, feed};

const LEN: usize = 64;

/// A screen with no baseline yet and a radius past any distance here: nothing is clipped.
fn wide() -> Screen {
    Screen {
        radius: Some(1e6),
        ..Screen::default()
    }
}

fn snapshot(step: u64, shift: f32) -> Arc<Snapshot> {
    let params = (0..LEN).map(|i| (i as f32 * 0.3).sin() + shift).collect();
    Arc::new(Snapshot { step, params })
}

/// The two sides' outcomes when both machines run with these copies (`None`: dense).
struct Ran {
    initiator: Result<Mixed, Outcome>,
    responder: Result<Mixed, Outcome>,
}

/// One exchange, frame by frame through the machines' interface: `a` offers `x` to `b`, which
/// answers with `y`.
fn run(
    settings: &SyncSettings,
    codec: Codec,
    (x, a_screen, a_copies): (Arc<Snapshot>, Screen, Option<&mut Copies>),
    (y, b_screen, b_copies): (Arc<Snapshot>, Screen, Option<&mut Copies>),
) -> Ran {
    let mut b_copies = b_copies;
    let answered_at = y.step;
    let mut initiator = Initiator::new(settings, x, codec, 0.5, a_screen, a_copies.as_deref());
    let offer = carried(initiator.start().remove(0)).0;
    // As the engine drives it: once the offer went out, the initiator works ahead.
    let mut a_copies = a_copies;
    initiator.work_ahead(&mut Lent::copies(a_copies.as_deref_mut()));
    let mut responder = Responder::new(settings, &offer, y, 0.5, b_screen, b_copies.as_deref_mut());
    let answer = responder.start().into_iter().map(carried).collect();
    let to_b = feed(&mut initiator, answer, false, &mut Lent::copies(a_copies));
    // The initiator sends its parameters once the answer's head passed, which shows the
    // responder's clock; the responder notes none (the offer showed the initiator's).
    let passed = !to_b.sent.is_empty();
    assert_eq!(to_b.saw_step, passed.then_some(answered_at));
    let back = feed(&mut responder, to_b.sent, true, &mut Lent::copies(b_copies));
    assert!(
        back.sent.is_empty(),
        "the responder writes nothing after its answer"
    );
    assert_eq!(back.saw_step, None);
    Ran {
        initiator: to_b
            .end
            .expect("the initiator is done once the answer is in"),
        responder: back
            .end
            .expect("the responder is done once the stream ended"),
    }
}

/// What a side's mix moves its replica by: a dense exchange's values, or a compressed one's
/// step, read off the pair's copies when it lands.
#[derive(Debug, PartialEq)]
enum Moves {
    Values(Vec<f32>),
    Step(ConsensusStep),
}

fn mixed(side: Result<Mixed, Outcome>) -> (Moves, f32) {
    match side {
        Ok(Mixed {
            outcome: Outcome::Mixed { .. },
            end: ExchangeEnd::Mix { delta, weight },
            ..
        }) => match delta {
            Delta::Values(values) => (Moves::Values(values), weight),
            Delta::Step { step, copies: None } => (Moves::Step(step), weight),
            Delta::Step { .. } => panic!("a machine holds no copies past its judgement"),
        },
        other => panic!("expected a mix, got {other:?}"),
    }
}

#[test]
fn a_dense_exchange_mixes_each_side_with_the_others_snapshot_at_the_same_weight() {
    let (x, y) = (snapshot(100, 0.0), snapshot(90, 0.01));
    let ran = run(
        &settings(Codec::F32),
        Codec::F32,
        (x.clone(), wide(), None),
        (y.clone(), wide(), None),
    );
    let (a_delta, a_weight) = mixed(ran.initiator);
    let (b_delta, b_weight) = mixed(ran.responder);
    let from = |to: &Snapshot, from: &Snapshot| -> Vec<f32> {
        to.params
            .iter()
            .zip(&from.params)
            .map(|(t, f)| t - f)
            .collect()
    };
    assert_eq!(a_delta, Moves::Values(from(&y, &x)));
    assert_eq!(b_delta, Moves::Values(from(&x, &y)));
    assert_eq!(
        a_weight, b_weight,
        "decision 0029: the two steps alone set the weight"
    );
}

#[test]
fn compressed_exchanges_leave_both_sides_with_the_same_copies_exchange_after_exchange() {
    let codec = Codec::TopK { per_mille: 100 };
    let settings = settings(codec);
    let (mut a, mut b) = (Copies::fresh(LEN), Copies::fresh(LEN));
    for round in 0..3 {
        let (x, y) = (snapshot(10 + round, 0.0), snapshot(10 + round, 0.02));
        let ran = run(
            &settings,
            codec,
            (x, wide(), Some(&mut a)),
            (y, wide(), Some(&mut b)),
        );
        let (Moves::Step(a_step), _) = mixed(ran.initiator) else {
            panic!("a compressed mix is a step")
        };
        let (Moves::Step(b_step), _) = mixed(ran.responder) else {
            panic!("a compressed mix is a step")
        };
        assert_eq!(a.version, round + 1);
        assert_eq!(
            (a.own(), a.theirs()),
            (b.theirs(), b.own()),
            "round {round}"
        );
        // Read off the same copies, seen from the two sides: the pair's two moves cancel.
        let a_moves = a_step.values(&a, 1.0);
        let b_moves: Vec<f32> = b_step.values(&b, 1.0).iter().map(|v| -v).collect();
        assert_eq!(a_moves, b_moves, "round {round}");
        assert!(a_moves.iter().any(|v| *v != 0.0), "round {round}");
    }
}

#[test]
fn copies_of_different_versions_start_again_from_zero_on_both_sides() {
    let codec = Codec::Int8 { block: 32 };
    let settings = settings(codec);
    let mut a = Copies::holding(3, &[1.0; LEN], &[0.0; LEN]);
    let mut b = Copies::fresh(LEN);
    b.version = 2;
    // The initiator let its snapshot go once its difference against version 3 was made
    // (decision 0093): it cannot make one against zero copies, and ends without a mix.
    let ran = run(
        &settings,
        codec,
        (snapshot(5, 0.0), wide(), Some(&mut a)),
        (snapshot(5, 0.0), wide(), Some(&mut b)),
    );
    assert!(
        matches!(ran.initiator, Err(Outcome::Busy)),
        "{:?}",
        ran.initiator
    );
    assert!(ran.responder.is_err(), "{:?}", ran.responder);
    assert_eq!((a.version, b.version), (0, 0));
    // Both sides stand at zero copies: the next exchange runs on them.
    let ran = run(
        &settings,
        codec,
        (snapshot(6, 0.0), wide(), Some(&mut a)),
        (snapshot(6, 0.0), wide(), Some(&mut b)),
    );
    mixed(ran.initiator);
    mixed(ran.responder);
    assert_eq!((a.version, b.version), (1, 1));
    assert_eq!((a.own(), a.theirs()), (b.theirs(), b.own()));
}

/// A compressed exchange lets its snapshot go once its difference stands (decision 0090): the
/// responder as it answers, the initiator of an offer of one codec once it made its difference
/// ahead (decision 0093; of two, once the answer's head took the codec and version of the
/// copies). A dense exchange sends its snapshot, and keeps it.
#[test]
fn a_compressed_exchange_holds_no_snapshot_once_its_difference_stands() {
    let codec = Codec::Int8 { block: 32 };
    let (settings, dense) = (settings(codec), settings(Codec::F32));
    let (x, y) = (snapshot(7, 0.0), snapshot(7, 0.03));
    let (mut a, mut b) = (Copies::fresh(LEN), Copies::fresh(LEN));
    let mut initiator = Initiator::new(&settings, Arc::clone(&x), codec, 0.5, wide(), Some(&a));
    let offer = carried(initiator.start().remove(0)).0;
    initiator.work_ahead(&mut Lent::copies(Some(&mut a)));
    assert_eq!(
        Arc::strong_count(&x),
        1,
        "an offer of one codec lets its snapshot go once its difference is made (0093)"
    );
    let responder = Responder::new(&settings, &offer, Arc::clone(&y), 0.5, wide(), Some(&mut b));
    assert_eq!(Arc::strong_count(&y), 1, "the responder holds its snapshot");
    let (head, _) = carried(responder.start().remove(0));
    let turn = initiator.on_head(&head, &mut Lent::copies(Some(&mut a)));
    assert!(turn.end.is_none(), "the answer was taken");
    drop(turn);
    assert_eq!(Arc::strong_count(&x), 1, "the initiator holds its snapshot");
    assert!(
        initiator.take_snapshot().is_none(),
        "spent with the exchange"
    );

    let mut initiator = Initiator::new(&dense, Arc::clone(&x), Codec::F32, 0.5, wide(), None);
    let offer = carried(initiator.start().remove(0)).0;
    let responder = Responder::new(&dense, &offer, Arc::clone(&y), 0.5, wide(), None);
    assert_eq!(Arc::strong_count(&x), 2);
    assert_eq!(Arc::strong_count(&y), 2);
    drop(responder);
    let back = initiator
        .take_snapshot()
        .expect("a dense offer hands its snapshot back");
    assert!(Arc::ptr_eq(&back, &x));
}

/// The difference an initiator works out while the answer is made is the one it sends when
/// the answer agrees, and what both sides end with is what they end with without it. (An
/// answer that starts the copies again has it made anew: the test above, whose `run` works
/// ahead.)
#[test]
fn a_difference_worked_out_ahead_is_the_one_sent_and_changes_nothing() {
    let codec = Codec::Int8 { block: 32 };
    let settings = settings(codec);
    let (x, y) = (snapshot(7, 0.0), snapshot(7, 0.03));
    let (mut plain_copies, mut b) = (Copies::fresh(LEN), Copies::fresh(LEN));
    let mut plain = Initiator::new(
        &settings,
        x.clone(),
        codec,
        0.5,
        wide(),
        Some(&plain_copies),
    );
    let offer = carried(plain.start().remove(0)).0;
    let responder = Responder::new(&settings, &offer, y, 0.5, wide(), Some(&mut b));
    let answer: Vec<Frame> = responder.start().into_iter().map(carried).collect();
    let plain = feed(
        &mut plain,
        answer.clone(),
        false,
        &mut Lent::copies(Some(&mut plain_copies)),
    );

    let mut copies = Copies::fresh(LEN);
    let mut ahead = Initiator::new(&settings, x, codec, 0.5, wide(), Some(&copies));
    ahead.work_ahead(&mut Lent::copies(Some(&mut copies)));
    let made = |machine: &Initiator| machine.side.difference.as_ref().map(|d| d.encoded.as_ptr());
    let before = made(&ahead);
    assert!(before.is_some(), "no difference worked out ahead");
    let worked = feed(
        &mut ahead,
        answer,
        false,
        &mut Lent::copies(Some(&mut copies)),
    );
    assert_eq!(made(&ahead), before, "the difference was made again");
    assert_eq!(worked.sent, plain.sent);
    assert_eq!(mixed(worked.end.unwrap()), mixed(plain.end.unwrap()));
    assert_eq!(
        (copies.own(), copies.theirs(), copies.version),
        (
            plain_copies.own(),
            plain_copies.theirs(),
            plain_copies.version
        )
    );
}

/// The gap a driver takes while the partner's difference comes in (the turn's gauge, which
/// `feed` fills as the engine does) is the one the judge goes by: the same mix and copies as
/// the judge's own pass over the values, and a gap told otherwise is believed, so no driver
/// that fed the gauge pays for a second pass.
#[test]
fn the_judge_goes_by_the_gap_taken_as_the_values_came_in() {
    let codec = Codec::Int8 { block: 32 };
    let settings = settings(codec);
    let (x, y) = (snapshot(7, 0.0), snapshot(7, 0.03));
    let screen = Screen {
        limit: Some(10.0),
        ..wide()
    };
    // The initiator, its copies and the responder's answer, afresh for each driving.
    let start = || {
        let (copies, mut b) = (Copies::fresh(LEN), Copies::fresh(LEN));
        let initiator = Initiator::new(&settings, x.clone(), codec, 0.5, screen, Some(&copies));
        let offer = carried(initiator.start().remove(0)).0;
        let responder = Responder::new(&settings, &offer, y.clone(), 0.5, wide(), Some(&mut b));
        let answer: Vec<Frame> = responder.start().into_iter().map(carried).collect();
        (initiator, copies, answer)
    };
    // A driver that reads the answer whole and tells the machine `told`, or nothing.
    let told = |told: Option<Gap>| {
        let (mut initiator, mut copies, mut answer) = start();
        let (head, values) = answer.remove(0);
        let mut lent = Lent::copies(Some(&mut copies));
        let turn = initiator.on_head(&head, &mut lent);
        assert!(
            turn.gauge.is_some(),
            "a compressed answer's turn has no gauge"
        );
        drop(turn);
        if let Some(gap) = told {
            initiator.on_gap(gap);
        }
        let end = initiator.on_payload(values, &mut lent).end.unwrap();
        (end, copies)
    };

    let (mut initiator, mut copies, answer) = start();
    let fed = feed(
        &mut initiator,
        answer,
        false,
        &mut Lent::copies(Some(&mut copies)),
    );
    let (fed, fed_copies) = (fed.end.unwrap(), copies);
    let (own_pass, own_copies) = told(None);
    let distance = |end: &Result<Mixed, Outcome>| match end {
        Ok(Mixed {
            outcome: Outcome::Mixed { distance, .. },
            ..
        }) => distance.to_bits(),
        other => panic!("expected a mix, got {other:?}"),
    };
    assert_eq!(distance(&fed), distance(&own_pass));
    assert_eq!(mixed(fed), mixed(own_pass));
    assert_eq!(fed_copies, own_copies);

    let (far, copies) = told(Some(Gap { gap: Some(1e6) }));
    assert!(
        matches!(far, Err(Outcome::Outlier { distance }) if distance == 1e6),
        "{far:?}"
    );
    assert_eq!(copies.version, 0, "a declined exchange commits nothing");
    let (not_finite, _) = told(Some(Gap { gap: None }));
    assert!(
        matches!(
            not_finite,
            Err(Outcome::Rejected(Rejection::NotFinite { .. }))
        ),
        "{not_finite:?}"
    );
}

#[test]
fn an_answer_against_a_version_neither_holds_is_an_offence() {
    let codec = Codec::Int8 { block: 32 };
    let settings = settings(codec);
    let mut copies = Copies::fresh(LEN);
    copies.version = 4;
    let mut initiator = Initiator::new(
        &settings,
        snapshot(1, 0.0),
        codec,
        0.5,
        wide(),
        Some(&copies),
    );
    let answer = Head {
        codec,
        reference: Some(3),
        ..Head::new(MessageKind::Params, 1)
    };
    let outcome = initiator.on_answer(&answer, Some(&mut copies)).err();
    assert!(
        matches!(
            outcome,
            Some(Outcome::Rejected(Rejection::Unexpected { .. }))
        ),
        "{outcome:?}"
    );
    assert_eq!(copies.version, 4, "the copies are left as they were");
}

#[test]
fn an_outlier_is_declined_and_neither_side_mixes_nor_commits_its_copies() {
    let codec = Codec::Int8 { block: 32 };
    let settings = settings(codec);
    let (mut a, mut b) = (Copies::fresh(LEN), Copies::fresh(LEN));
    let strict = Screen {
        limit: Some(1e-3),
        ..wide()
    };
    let ran = run(
        &settings,
        codec,
        (snapshot(1, 0.0), strict, Some(&mut a)),
        (snapshot(1, 50.0), wide(), Some(&mut b)),
    );
    assert!(
        matches!(ran.initiator, Err(Outcome::Outlier { .. })),
        "{:?}",
        ran.initiator
    );
    assert!(
        matches!(ran.responder, Err(Outcome::Busy)),
        "{:?}",
        ran.responder
    );
    assert_eq!((a.version, b.version), (0, 0));
}

#[test]
fn a_busy_answer_or_a_model_of_another_length_ends_the_exchange() {
    let settings = settings(Codec::F32);
    let mut initiator = Initiator::new(&settings, snapshot(1, 0.0), Codec::F32, 0.5, wide(), None);
    let busy = Head::new(MessageKind::Busy, 1);
    assert_eq!(initiator.on_answer(&busy, None).err(), Some(Outcome::Busy));
    let params = Head::new(MessageKind::Params, 1);
    assert!(initiator.on_answer(&params, None).is_ok());
    let outcome = initiator.judge(vec![0.0; LEN - 1], None).err();
    assert!(
        matches!(
            outcome,
            Some(Outcome::Rejected(Rejection::WrongLength { .. }))
        ),
        "{outcome:?}"
    );
}

/// Parameters with a value that is not finite are refused as such, an offence, not taken for
/// an outlier: the distance they make is not finite either, and only then are they read again
/// to find the cause.
#[test]
fn parameters_that_are_not_finite_are_an_offence_not_an_outlier() {
    let settings = settings(Codec::F32);
    let judged = |bad: f32| {
        let mut initiator =
            Initiator::new(&settings, snapshot(1, 0.0), Codec::F32, 0.5, wide(), None);
        let params = Head::new(MessageKind::Params, 1);
        assert!(initiator.on_answer(&params, None).is_ok());
        let mut values = snapshot(1, 0.0).params.clone();
        values[LEN / 2] = bad;
        initiator.judge(values, None).err()
    };
    for bad in [f32::NAN, f32::INFINITY] {
        let outcome = judged(bad);
        assert!(
            matches!(
                outcome,
                Some(Outcome::Rejected(Rejection::NotFinite {
                    what: "parameters"
                }))
            ),
            "{bad}: {outcome:?}"
        );
    }
}

#[test]
fn the_responder_takes_only_the_end_of_the_stream_or_busy_as_the_verdict() {
    let settings = settings(Codec::F32);
    let offer = Head::new(MessageKind::Offer, 1);
    let responder = Responder::new(&settings, &offer, snapshot(1, 0.0), 0.5, wide(), None);
    assert_eq!(responder.on_verdict(None), Ok(()));
    let busy = Head::new(MessageKind::Busy, 1);
    assert_eq!(responder.on_verdict(Some(&busy)), Err(Outcome::Busy));
    let offer_again = Head::new(MessageKind::Offer, 1);
    assert!(matches!(
        responder.on_verdict(Some(&offer_again)),
        Err(Outcome::Rejected(_))
    ));
}
