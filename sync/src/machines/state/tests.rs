//! The requester fed the source's frames as a driver would, and the clock rule.

use super::*;
use crate::machines::feed;

const COUNT: usize = 8;

fn buffer(name: &str, value: f32) -> NamedBuffer {
    NamedBuffer {
        name: name.into(),
        values: vec![value; COUNT],
    }
}

/// A source's whole state: AdamW's two moments, an outer loop with a velocity, a center.
fn source() -> (ReplicaState, OuterState, Vec<f32>) {
    let replica = ReplicaState {
        step: 120,
        params: vec![1.0; COUNT],
        optimizer: Some(OptimizerBuffers {
            buffers: vec![buffer("exp_avg", 0.1), buffer("exp_avg_sq", 0.01)],
            updates: 118,
        }),
    };
    let outer = OuterState {
        anchor: vec![0.9; COUNT],
        anchor_step: 112,
        velocity: vec![0.05; COUNT],
    };
    (replica, outer, vec![0.95; COUNT])
}

fn names() -> Vec<String> {
    vec!["exp_avg".to_string(), "exp_avg_sq".to_string()]
}

fn requester() -> Requester {
    Requester::new(100, 110, Some(16), names(), COUNT)
}

fn values(payload: Payload<'_>) -> Vec<f32> {
    match payload {
        Payload::Values(values) => values.to_vec(),
        other => panic!("a state is sent as it is, not {other:?}"),
    }
}

/// Feeds `frames` to `requester`, then the end of the stream, with no clocks heard (the run's
/// clock is the one its source announced, 110).
fn take(mut requester: Requester, frames: Vec<(Head, Vec<f32>)>) -> Result<Taken, Outcome> {
    let fed = feed(&mut requester, frames, true, &mut Lent::default());
    fed.end.expect("the stream ended")
}

/// The id the source gives its state in these tests.
const STATE: u64 = 7;

/// The whole answer, each buffer in one frame.
fn sent(replica: &ReplicaState, outer: &OuterState, center: &[f32]) -> Vec<(Head, Vec<f32>)> {
    sent_from(replica, outer, center, 0, COUNT)
}

/// The answer from the place `at` of the state [`STATE`], in chunks of `chunk` values.
fn sent_from(
    replica: &ReplicaState,
    outer: &OuterState,
    center: &[f32],
    at: u64,
    chunk: usize,
) -> Vec<(Head, Vec<f32>)> {
    let from = Resume { state: STATE, at };
    state_frames(replica, Some(outer), Some(center), from, chunk)
        .into_iter()
        .map(|(head, payload)| (head, values(payload)))
        .collect()
}

#[test]
fn a_whole_state_arrives_as_it_was_sent() {
    let (replica, outer, center) = source();
    let taken = take(requester(), sent(&replica, &outer, &center)).expect("taken over");
    assert_eq!(
        taken,
        Taken {
            replica,
            outer: Some(outer),
            center: Some(center),
        }
    );
}

#[test]
fn frames_out_of_their_order_or_of_another_optimizer_are_refused() {
    let (replica, outer, center) = source();
    let frames = sent(&replica, &outer, &center);
    let refused = |frames: Vec<(Head, Vec<f32>)>| take(requester(), frames).err();

    // The center before the anchor.
    let mut swapped = frames.clone();
    let n = swapped.len();
    swapped.swap(n - 1, n - 3);
    assert!(matches!(refused(swapped), Some(Outcome::Rejected(_))));

    // A buffer under another name.
    let mut renamed = frames.clone();
    renamed[1].0.buffers = vec!["momentum".into()];
    assert!(matches!(
        refused(renamed),
        Some(Outcome::Rejected(Rejection::ForeignState(_)))
    ));

    // Buffers stamped with different update counts.
    let mut restamped = frames.clone();
    restamped[2].0.step += 1;
    assert!(matches!(
        refused(restamped),
        Some(Outcome::Rejected(Rejection::ForeignState(_)))
    ));

    // One buffer of two.
    let mut short = frames.clone();
    short.remove(2);
    assert!(matches!(
        refused(short),
        Some(Outcome::Rejected(Rejection::ForeignState(_)))
    ));

    // A buffer with a NaN.
    let mut nan = frames;
    nan[1].1[0] = f32::NAN;
    assert!(matches!(
        refused(nan),
        Some(Outcome::Rejected(Rejection::NotFinite { .. }))
    ));
}

#[test]
fn a_state_of_another_optimizer_comes_without_its_buffers() {
    let (mut replica, outer, center) = source();
    replica.optimizer = None;
    let taken = take(requester(), sent(&replica, &outer, &center)).expect("taken over");
    assert_eq!(taken.replica.optimizer, None);
}

#[test]
fn a_busy_source_or_a_stream_that_ends_early_is_a_failure_to_retry() {
    let mut busy = requester();
    let outcome = busy.on_answer(&Head::new(MessageKind::Busy, 0), 110);
    assert!(matches!(outcome, Err(Outcome::Failed(_))), "{outcome:?}");
    let mut cut = requester();
    let answer = Head {
        resume: Some(Resume {
            state: STATE,
            at: 0,
        }),
        ..Head::new(MessageKind::State, 120)
    };
    cut.on_answer(&answer, 110)
        .expect("a clock within the bounds");
    assert!(matches!(cut.finish(), Err(Outcome::Failed(_))));
}

/// A state of six buffers of 8 values in chunks of 3: 18 frames, each buffer's chunks at
/// offsets 0, 3 and 6.
#[test]
fn a_state_in_chunks_arrives_whole() {
    let (replica, outer, center) = source();
    let frames = sent_from(&replica, &outer, &center, 0, 3);
    assert_eq!(frames.len(), 6 * 3, "six buffers of three chunks");
    let offsets: Vec<_> = frames[..3].iter().map(|(head, _)| head.offset).collect();
    assert_eq!(offsets, [Some(0), Some(3), Some(6)]);
    let taken = take(requester(), frames).expect("taken over");
    assert_eq!(taken.replica, replica);
    assert_eq!(taken.outer, Some(outer));
    assert_eq!(taken.center, Some(center));
}

/// A transfer cut off after 7 chunks keeps them; the next request names the place after them,
/// the source goes on from there, and the state arrives whole. A source that no longer holds
/// that state starts over with another, which replaces what had arrived.
#[test]
fn a_transfer_cut_off_goes_on_where_it_stopped() {
    let (replica, outer, center) = source();
    let frames = sent_from(&replica, &outer, &center, 0, 3);
    let mut first = requester();
    let fed = feed(
        &mut first,
        frames[..7].to_vec(),
        false,
        &mut Lent::default(),
    );
    assert!(fed.end.is_none(), "cut off before its end");
    let partial = first.cut_off().expect("chunks arrived");
    assert_eq!(
        partial.values(),
        8 + 8 + 3,
        "two buffers and a chunk of the third"
    );

    // The node trained on meanwhile, past the state's step (120), and so did its source: the
    // state it asked for is still the one it takes.
    let again = Requester::new(125, 130, Some(16), names(), COUNT).going_on(partial);
    let (asked, _) = &again.start()[0];
    let place = asked.resume.expect("the request names the place");
    assert_eq!(
        place,
        Resume {
            state: STATE,
            at: 19
        }
    );
    let rest = sent_from(&replica, &outer, &center, place.at, 3);
    assert_eq!(
        rest.len(),
        frames.len() - 7,
        "the source sends the rest alone"
    );
    let taken = take(again, rest).expect("taken over");
    assert_eq!(taken.replica, replica);
    assert_eq!(taken.outer, Some(outer.clone()));

    // The source let that state go: it starts over with its state now, at step 130.
    let mut first = requester();
    feed(
        &mut first,
        frames[..7].to_vec(),
        false,
        &mut Lent::default(),
    );
    let newer = ReplicaState {
        step: 130,
        ..replica.clone()
    };
    let over = state_frames(
        &newer,
        Some(&outer),
        Some(&center),
        Resume { state: 8, at: 0 },
        3,
    );
    let over: Vec<_> = over.into_iter().map(|(h, p)| (h, values(p))).collect();
    let again = requester().going_on(first.cut_off().expect("chunks arrived"));
    assert_eq!(take(again, over).expect("taken over").replica, newer);
}

/// A source that goes on from a place the request did not name, or sends a chunk that is not
/// the next of its buffer, or more values than the model has, is refused.
#[test]
fn chunks_out_of_place_are_refused() {
    let (replica, outer, center) = source();
    let frames = sent_from(&replica, &outer, &center, 0, 3);

    // An answer that goes on from a place no transfer left.
    let elsewhere = sent_from(&replica, &outer, &center, 6, 3);
    assert!(matches!(
        take(requester(), elsewhere),
        Err(Outcome::Rejected(Rejection::ForeignState(_)))
    ));

    // A chunk skipped.
    let mut skipped = frames.clone();
    skipped.remove(1);
    assert!(matches!(
        take(requester(), skipped),
        Err(Outcome::Rejected(Rejection::WrongLength { .. }))
    ));

    // A buffer of more values than the model.
    let mut long = frames.clone();
    long[2].1.extend([1.0, 1.0]);
    assert!(matches!(
        take(requester(), long),
        Err(Outcome::Rejected(Rejection::WrongLength { .. }))
    ));

    // The next buffer before this one is whole: the short one is named.
    let mut early = frames;
    early.remove(2);
    let refused = take(requester(), early);
    assert!(
        matches!(
            refused,
            Err(Outcome::Rejected(Rejection::WrongLength {
                what: "state",
                ..
            }))
        ),
        "{refused:?}"
    );
}

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

/// A member far ahead of the run asks a source behind it (decision 0033, second amendment): it
/// takes that source's state at the clock the source was chosen for, and none behind it.
#[test]
fn a_node_that_asked_a_source_behind_it_takes_its_state_but_none_further_behind() {
    let (replica, outer, center) = source();
    let ahead = Requester::new(300, 120, Some(16), names(), COUNT);
    let taken = take(ahead, sent(&replica, &outer, &center)).expect("the run's state");
    assert_eq!(taken.replica.step, 120);

    let older = ReplicaState {
        step: 119,
        ..replica
    };
    let ahead = Requester::new(300, 120, Some(16), names(), COUNT);
    let refused = take(ahead, sent(&older, &outer, &center)).unwrap_err();
    assert!(matches!(refused, Outcome::Failed(_)), "{refused:?}");
}
