//! Elastic averaging (EASGD) with a center on `/murmur/params/3`: a worker sends its snapshot
//! (`Params`); the center moves its center variable by `d = alpha w (x_worker - center)` and
//! answers `d` (`Delta`), or `Busy`; the worker subtracts `d`. One request, one answer.
//!
//! Both sides judge: the center clips the worker within the screen's radius of the center first
//! (no worker moves the center farther than the others do), and the worker declines a delta
//! whose norm is an outlier or that is too stale, and clips one past the radius. Past the mix
//! bound in steps apart, the two decline (a center is never mixed with old parameters).

use std::sync::Arc;

use murmur_protocol::mix;
use murmur_protocol::wire::MessageKind;

use super::{Head, Lent, Machine, Mixed, Payload, Turn, Weighing};
use crate::policy::{Failure, Outcome};
use crate::rejection::Rejection;
use crate::replica::{ExchangeEnd, Snapshot};
use crate::screen::{self, Screen};
use crate::settings::SyncSettings;

/// A worker's request to the center.
#[derive(Debug)]
pub struct Worker {
    weighing: Weighing,
    snapshot: Arc<Snapshot>,
    screen: Screen,
    /// The step of the center's answer, once its head passed.
    answered: Option<u64>,
}

impl Worker {
    /// A request with `snapshot`, the delta that comes back held to `screen`.
    pub fn new(settings: &SyncSettings, snapshot: Arc<Snapshot>, screen: Screen) -> Self {
        Worker {
            weighing: Weighing::of(settings),
            snapshot,
            screen,
            answered: None,
        }
    }

    /// The request: this worker's parameters.
    fn request(&self) -> (Head, Payload<'_>) {
        (
            Head::new(MessageKind::Params, self.snapshot.step),
            Payload::Values(&self.snapshot.params),
        )
    }

    /// Judges the delta of the center's answer at `step`: the delta to subtract, or why not.
    fn judge_delta(&self, step: u64, mut delta: Vec<f32>) -> Result<Mixed, Outcome> {
        let own = &self.snapshot.params;
        screen::full_and_finite(&delta, own.len(), "elastic delta").map_err(Outcome::Rejected)?;
        let admitted = self.screen.admit(mix::norm(&delta), own)?;
        if self.weighing.elastic(self.snapshot.step, step).is_none() {
            return Err(Outcome::Stale);
        }
        let cleared = admitted.clip_delta(&mut delta, own);
        Ok(Mixed {
            outcome: cleared.outcome,
            end: ExchangeEnd::Subtract(delta),
            clipped: cleared.clipped,
            sparse: false,
        })
    }
}

/// The center's answer: a delta follows, or `Busy`.
fn check_answer(answer: &Head) -> Result<(), Outcome> {
    match answer.kind {
        MessageKind::Delta => Ok(()),
        MessageKind::Busy => Err(Outcome::Busy),
        kind => Err(Outcome::Rejected(Rejection::Unexpected {
            what: "as the answer to an elastic exchange",
            kind: format!("{kind:?}"),
        })),
    }
}

impl Machine for Worker {
    type Done = Mixed;

    fn start(&self) -> Vec<(Head, Payload<'_>)> {
        vec![self.request()]
    }

    /// The answer's head; its delta, next, ends this side.
    fn on_head(&mut self, head: &Head, _: &mut Lent<'_>) -> Turn<'_, Mixed> {
        match check_answer(head) {
            Ok(()) => {
                self.answered = Some(head.step);
                Turn::answered(head.step)
            }
            Err(outcome) => Turn::done(Err(outcome)),
        }
    }

    fn on_payload(&mut self, values: Vec<f32>, _: &mut Lent<'_>) -> Turn<'_, Mixed> {
        let step = self.answered.unwrap_or(self.snapshot.step);
        Turn::done(self.judge_delta(step, values))
    }

    fn on_end(&mut self, _: &mut Lent<'_>) -> Result<Mixed, Outcome> {
        Err(Outcome::Failed(Failure::Stream(
            "the stream ended before the center's answer".into(),
        )))
    }
}

/// What the center answers a worker with.
#[derive(Debug, PartialEq)]
pub struct Answered {
    /// [`Outcome::Mixed`], with the worker's distance to the center.
    pub outcome: Outcome,
    /// The delta the center moved by, which the worker subtracts.
    pub delta: Vec<f32>,
    /// The worker lay past the clip radius and was moved within it.
    pub clipped: bool,
}

impl Answered {
    /// The answer's frame.
    pub fn frame(&self, step: u64) -> (Head, Payload<'_>) {
        (
            Head::new(MessageKind::Delta, step),
            Payload::Values(&self.delta),
        )
    }
}

/// The center's side of a request: the center variable `center`, at this node's step `own`,
/// takes the step toward the worker's parameters `worker` (at step `worker_step`, checked
/// whole and finite when the request was read), by `alpha`, as `screen` passes them. As
/// `Err`: why the center declines, which it answers with `Busy`.
pub fn answer_worker(
    settings: &SyncSettings,
    center: &mut [f32],
    own: u64,
    (worker_step, mut worker): (u64, Vec<f32>),
    alpha: f32,
    screen: Screen,
) -> Result<Answered, Outcome> {
    let weight = Weighing::of(settings)
        .elastic(own, worker_step)
        .ok_or(Outcome::Stale)?;
    let admitted = screen.admit(mix::distance(&worker, center), center)?;
    let cleared = admitted.clip(&mut worker, center);
    let delta = mix::elastic_step(center, &worker, alpha * weight);
    Ok(Answered {
        outcome: cleared.outcome,
        delta,
        clipped: cleared.clipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machines::feed;
    use crate::machines::testing::settings;
    use murmur_protocol::codec::Codec;

    /// A screen with a radius past any distance here: nothing is clipped.
    fn wide() -> Screen {
        Screen {
            radius: Some(1e6),
            ..Screen::default()
        }
    }

    /// The worker's judgement of the center's answer, fed to it as a driver does.
    fn judged(worker: &mut Worker, answer: Head, delta: Vec<f32>) -> Result<Mixed, Outcome> {
        let fed = feed(worker, vec![(answer, delta)], true, &mut Lent::default());
        fed.end.expect("a worker is done once the answer is in")
    }

    fn snapshot(step: u64, value: f32) -> Arc<Snapshot> {
        Arc::new(Snapshot {
            step,
            params: vec![value; 16],
        })
    }

    #[test]
    fn a_worker_subtracts_the_delta_the_center_moved_by() {
        let settings = settings(Codec::F32);
        let mut worker = Worker::new(&settings, snapshot(10, 1.0), wide());
        let (head, payload) = worker.request();
        let Payload::Values(values) = payload else {
            panic!("a worker sends its parameters as they are");
        };
        let mut center = vec![0.0; 16];
        let answered = answer_worker(
            &settings,
            &mut center,
            12,
            (head.step, values.to_vec()),
            0.5,
            wide(),
        )
        .expect("the center answers");
        assert_eq!(center, vec![0.5; 16], "the center moved halfway");
        let (answer, Payload::Values(delta)) = answered.frame(12) else {
            panic!("a delta is sent as it is");
        };
        let mixed = judged(&mut worker, answer, delta.to_vec()).expect("mixed");
        let ExchangeEnd::Subtract(delta) = mixed.end else {
            panic!("a worker subtracts");
        };
        assert_eq!(
            delta,
            vec![0.5; 16],
            "x - d: the worker moves toward the center by as much"
        );
    }

    #[test]
    fn parameters_too_far_apart_in_steps_are_declined_on_both_sides() {
        let settings = settings(Codec::F32);
        let bound = settings.mix_bound().expect("a bound");
        let mut center = vec![0.0; 16];
        let outcome = answer_worker(
            &settings,
            &mut center,
            bound + 11,
            (10, vec![1.0; 16]),
            0.5,
            wide(),
        );
        assert_eq!(outcome, Err(Outcome::Stale));
        assert_eq!(center, vec![0.0; 16], "the center did not move");
        let mut worker = Worker::new(&settings, snapshot(10, 1.0), wide());
        let answer = Head::new(MessageKind::Delta, bound + 11);
        let judged = judged(&mut worker, answer, vec![0.1; 16]).err();
        assert_eq!(judged, Some(Outcome::Stale));
    }

    #[test]
    fn a_worker_rejects_a_delta_that_is_not_a_whole_finite_model() {
        let settings = settings(Codec::F32);
        let worker = || Worker::new(&settings, snapshot(10, 1.0), wide());
        let answer = Head::new(MessageKind::Delta, 10);
        let short = judged(&mut worker(), answer.clone(), vec![0.1; 15]).err();
        assert!(
            matches!(
                short,
                Some(Outcome::Rejected(Rejection::WrongLength { .. }))
            ),
            "{short:?}"
        );
        let mut nan = vec![0.1; 16];
        nan[3] = f32::NAN;
        let nan = judged(&mut worker(), answer, nan).err();
        assert!(
            matches!(nan, Some(Outcome::Rejected(Rejection::NotFinite { .. }))),
            "{nan:?}"
        );
    }
}
