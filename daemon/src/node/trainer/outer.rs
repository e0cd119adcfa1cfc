//! `allreduce`'s outer loop with `every > 1` (local SGD, optionally the DiLoCo outer step): the
//! parameters every replica started the current `H` local steps from, and the outer optimizer
//! that moves them when a round's mean comes back. The same on every replica, and handed over
//! whole in a state sync.

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
