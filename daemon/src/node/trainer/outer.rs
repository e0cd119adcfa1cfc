//! The outer loop (local SGD, optionally the DiLoCo outer step). In `allreduce` with
//! `every > 1`: the parameters every replica started the current `H` local steps from, and the
//! outer optimizer that moves them when a round's mean comes back; the same on every replica.
//! In gossip and elastic with `sync.outer`: each replica's own anchor, moved at each of its
//! mixes by the outer step on its progress since the last one. Handed over whole in a state
//! sync.

use murmur_trainer::averaging::OuterNesterov;

use crate::node::messages::OuterState;
use crate::settings::Outer;

/// The anchor and the outer optimizer of one replica.
#[derive(Debug)]
pub(super) struct OuterLoop {
    /// The parameters the current `H` local steps started from.
    anchor: Vec<f32>,
    /// The step the anchor is from: the last completed average, or where training started.
    anchor_step: u64,
    nesterov: Option<OuterNesterov>,
}

impl OuterLoop {
    /// The loop of a replica at `step` with `params`, followed by `outer`.
    pub(super) fn new(params: Vec<f32>, step: u64, outer: Outer) -> Self {
        let nesterov = match outer {
            Outer::Nesterov { lr, momentum } => Some(OuterNesterov::new(lr, momentum)),
            Outer::Average => None,
        };
        OuterLoop {
            anchor: params,
            anchor_step: step,
            nesterov,
        }
    }

    /// The round of `step` averaged to `mean`: the outer step moves the anchor, and the replica
    /// continues from it. Returns the parameters to continue from.
    pub(super) fn averaged(&mut self, step: u64, mean: Vec<f32>) -> &[f32] {
        match self.nesterov.as_mut() {
            Some(outer) => outer.step(&mut self.anchor, &mean),
            None => self.anchor = mean,
        }
        self.anchor_step = step;
        &self.anchor
    }

    /// Pairwise and elastic modes: this replica's own progress since the last mix (`params`,
    /// before the mix) goes through the outer step as a pseudo-gradient, and the mix is then
    /// applied to the result as it came (`mixed`, a function of the parameters): the outer
    /// momentum never acts on the differences between replicas, which it would overshoot.
    /// Returns the parameters to continue from, which are the next anchor.
    pub(super) fn progressed(
        &mut self,
        step: u64,
        params: Vec<f32>,
        mix: impl FnOnce(&mut Vec<f32>),
    ) -> &[f32] {
        let mut next = match self.nesterov.as_mut() {
            Some(outer) => {
                outer.step(&mut self.anchor, &params);
                std::mem::take(&mut self.anchor)
            }
            None => params,
        };
        mix(&mut next);
        self.anchor = next;
        self.anchor_step = step;
        &self.anchor
    }

    /// What a state sync hands over.
    pub(super) fn state(&self) -> OuterState {
        OuterState {
            anchor: self.anchor.clone(),
            anchor_step: self.anchor_step,
            velocity: self
                .nesterov
                .as_ref()
                .map(|o| o.velocity().to_vec())
                .unwrap_or_default(),
        }
    }

    /// Takes over a peer's loop; a peer in another mode has none, and the loop starts afresh
    /// from the adopted parameters. Returns whether the replica owes the round at `step`: the
    /// peer stood at a round's step without that round's average, so it waits in that round,
    /// and so must this replica.
    pub(super) fn adopt(
        &mut self,
        state: Option<OuterState>,
        params: &[f32],
        step: u64,
        every: u64,
    ) -> bool {
        let state = state.unwrap_or_else(|| OuterState {
            anchor: params.to_vec(),
            anchor_step: step,
            velocity: Vec::new(),
        });
        let owes_round = state.anchor_step < step && step.is_multiple_of(every);
        self.anchor = state.anchor;
        self.anchor_step = state.anchor_step;
        if let Some(outer) = self.nesterov.as_mut() {
            outer.set_velocity(state.velocity);
        }
        owes_round
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix_half_toward(other: &'static [f32]) -> impl FnOnce(&mut Vec<f32>) {
        move |x: &mut Vec<f32>| {
            for (v, o) in x.iter_mut().zip(other) {
                *v += 0.5 * (o - *v);
            }
        }
    }

    #[test]
    fn without_an_outer_step_a_mix_is_applied_as_it_came() {
        let mut outer = OuterLoop::new(vec![0.0, 0.0], 0, Outer::Average);
        let next = outer.progressed(8, vec![1.0, 2.0], mix_half_toward(&[3.0, 2.0]));
        assert_eq!(next, [2.0, 2.0]);
        assert_eq!(outer.anchor_step, 8);
    }

    #[test]
    fn the_outer_step_moves_the_own_progress_and_not_the_mix() {
        let mut outer = OuterLoop::new(
            vec![0.0],
            0,
            Outer::Nesterov {
                lr: 1.0,
                momentum: 0.5,
            },
        );
        // Progress 1 from the anchor 0: g = -1, v = -1, anchor 0 - (-1 - 0.5) = 1.5; then the
        // mix moves half the way to 3.5: 2.5.
        assert_eq!(
            outer.progressed(8, vec![1.0], mix_half_toward(&[3.5])),
            [2.5]
        );
        // A mix that changes nothing: progress 1 again from the new anchor 2.5: g = -1,
        // v = -1.5, anchor 2.5 - (-1 - 0.75) = 4.25, and the momentum carried the progress on.
        assert_eq!(outer.progressed(16, vec![3.5], |_| {}), [4.25]);
    }
}
