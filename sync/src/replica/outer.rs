//! The outer loop (local SGD, optionally the DiLoCo outer step). In `allreduce` with
//! `every > 1`: the parameters every replica started the current `H` local steps from, and the
//! outer optimizer that moves them when a round's mean comes back; the same on every replica.
//! In gossip and elastic with `sync.outer`: each replica's own anchor, moved by the outer step
//! on its progress whenever its parameters are taken for an exchange, and by the mixes that
//! land. Handed over whole in a state sync.

use murmur_protocol::mix::{self, OuterNesterov};

use super::OuterState;
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

    /// Pairwise and elastic modes, when this replica's parameters are taken for an exchange:
    /// its own progress since the anchor, up to `at`, goes through the outer step as a
    /// pseudo-gradient, and the anchor moves now. Returns what the replica owes: the outer
    /// step's move from `at` (the new anchor minus `at`), which its parameters take when the
    /// exchange ends, with the mix (decision 0030). The mix is applied as it came, to both the
    /// parameters and the anchor ([`mixed`](Self::mixed)): the outer momentum never acts on the
    /// differences between replicas, which it would overshoot. `None` without an outer step.
    pub(super) fn snapshot_taken(&mut self, step: u64, at: &[f32]) -> Option<Vec<f32>> {
        let outer = self.nesterov.as_mut()?;
        outer.step(&mut self.anchor, at);
        self.anchor_step = step;
        Some(self.anchor.iter().zip(at).map(|(a, x)| a - x).collect())
    }

    /// A mix (`delta`, added to the parameters) landed: the anchor moves with it, so that the
    /// next outer step counts only this replica's own progress.
    pub(super) fn mixed(&mut self, delta: &[f32]) {
        mix::add(&mut self.anchor, delta);
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

    fn nesterov() -> OuterLoop {
        OuterLoop::new(
            vec![0.0],
            0,
            Outer::Nesterov {
                lr: 1.0,
                momentum: 0.5,
            },
        )
    }

    #[test]
    fn without_an_outer_step_nothing_is_owed() {
        let mut outer = OuterLoop::new(vec![0.0, 0.0], 0, Outer::Average);
        assert_eq!(outer.snapshot_taken(8, &[1.0, 2.0]), None);
    }

    #[test]
    fn the_outer_step_moves_the_own_progress_and_not_the_mix() {
        let mut outer = nesterov();
        // Progress 1 from the anchor 0: g = -1, v = -1, anchor 0 - (-1 - 0.5) = 1.5, so the
        // replica at 1 owes 0.5. A mix of +1 lands: the anchor follows it to 2.5.
        assert_eq!(outer.snapshot_taken(8, &[1.0]), Some(vec![0.5]));
        outer.mixed(&[1.0]);
        assert_eq!(outer.anchor, [2.5]);
        assert_eq!(outer.anchor_step, 8);
        // The replica (at 1 + 0.5 + 1 = 2.5) progresses 1 again: g = -1, v = -1.5, anchor
        // 2.5 - (-1 - 0.75) = 4.25, and the momentum carried the progress on: 0.75 owed.
        assert_eq!(outer.snapshot_taken(16, &[3.5]), Some(vec![0.75]));
        assert_eq!(outer.anchor, [4.25]);
    }
}
