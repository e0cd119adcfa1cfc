//! Optimizers (SGD with momentum / Nesterov / weight decay, AdamW) and learning-rate schedules,
//! with PyTorch's update rules so that hyper-parameters carry over.

use serde::{Deserialize, Serialize};

use std::ops::Range;

use crate::backend::{AdamWUpdate, Backend, BackendResult, SgdUpdate, whole, whole_mut};
use crate::params::ParamLayout;

/// Which update rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Sgd,
    Adamw,
}

/// The longest interval between mixes at which quasi-global momentum was measured to take
/// whole mixes and converge (decision 0023); rarer mixes count at a share (decision 0035).
pub const QUASI_GLOBAL_WHOLE_MIX_INTERVAL: u64 = 8;

/// The share of a mix's displacement that quasi-global momentum counts when mixes come about
/// every `interval` steps; `None` when it counts whole.
fn quasi_global_mix_share(interval: u64) -> Option<f32> {
    (interval > QUASI_GLOBAL_WHOLE_MIX_INTERVAL)
        .then(|| QUASI_GLOBAL_WHOLE_MIX_INTERVAL as f32 / interval as f32)
}

/// How the learning rate moves over the run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// `lr` throughout.
    #[default]
    Constant,
    /// Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr` at the last step.
    WarmupCosine,
}

/// The `[optimizer]` table of a run config. Keys that belong to the other optimizer are errors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSpec {
    pub kind: OptimizerKind,
    pub lr: f32,
    /// SGD momentum (default 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub momentum: Option<f32>,
    /// SGD Nesterov momentum (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nesterov: Option<bool>,
    /// SGD momentum over the replica's whole displacement per step, mixes with peers
    /// included, rather than over its own gradients alone (quasi-global momentum; default
    /// false). For peers whose shards hold different labels: see [`Optimizer::step`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quasi_global: Option<bool>,
    /// L2 penalty for SGD, decoupled decay for AdamW (default 0 for SGD, 0.01 for AdamW).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f32>,
    /// AdamW betas (default `[0.9, 0.999]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[f32; 2]>,
    /// AdamW epsilon (default 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f32>,
    #[serde(default)]
    pub schedule: ScheduleKind,
    #[serde(default)]
    pub warmup_steps: u64,
    #[serde(default)]
    pub min_lr: f32,
    /// The largest global L2 norm of a step's gradient; a larger one is scaled down to it
    /// (PyTorch's `clip_grad_norm_`). Default: no clipping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_clip: Option<f32>,
}

/// Why an optimizer spec is unusable.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OptimizerError {
    #[error("optimizer.{key}: {problem}")]
    Invalid { key: &'static str, problem: String },
}

fn invalid(key: &'static str, problem: impl Into<String>) -> OptimizerError {
    OptimizerError::Invalid {
        key,
        problem: problem.into(),
    }
}

impl OptimizerSpec {
    /// SGD with momentum at `lr`, no decay, constant schedule.
    pub fn sgd(lr: f32, momentum: f32) -> Self {
        OptimizerSpec {
            kind: OptimizerKind::Sgd,
            lr,
            momentum: Some(momentum),
            nesterov: None,
            quasi_global: None,
            weight_decay: None,
            betas: None,
            eps: None,
            schedule: ScheduleKind::Constant,
            warmup_steps: 0,
            min_lr: 0.0,
            grad_clip: None,
        }
    }

    /// AdamW at `lr` with PyTorch's defaults.
    pub fn adamw(lr: f32) -> Self {
        OptimizerSpec {
            kind: OptimizerKind::Adamw,
            momentum: None,
            ..OptimizerSpec::sgd(lr, 0.0)
        }
    }

    /// Checks ranges and that every key given belongs to the chosen optimizer.
    pub fn validate(&self) -> Result<(), OptimizerError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid(
                "lr",
                format!("must be a positive number, got {}", self.lr),
            ));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(invalid("min_lr", "must be between 0 and `lr`"));
        }
        if self.schedule == ScheduleKind::Constant && self.warmup_steps > 0 {
            return Err(invalid(
                "warmup_steps",
                "only applies with schedule = \"warmup_cosine\"",
            ));
        }
        let wd = self.weight_decay.unwrap_or(0.0);
        if !(wd.is_finite() && wd >= 0.0) {
            return Err(invalid("weight_decay", "must be zero or positive"));
        }
        if let Some(clip) = self.grad_clip
            && !(clip.is_finite() && clip > 0.0)
        {
            return Err(invalid(
                "grad_clip",
                format!("must be a positive number, got {clip}"),
            ));
        }
        match self.kind {
            OptimizerKind::Sgd => {
                let momentum = self.momentum.unwrap_or(0.0);
                if !(0.0..1.0).contains(&momentum) {
                    return Err(invalid("momentum", "must be in [0, 1)"));
                }
                if self.nesterov == Some(true) && momentum == 0.0 {
                    return Err(invalid("nesterov", "needs a momentum above 0"));
                }
                if self.quasi_global() && momentum == 0.0 {
                    return Err(invalid("quasi_global", "needs a momentum above 0"));
                }
                if self.betas.is_some() {
                    return Err(invalid("betas", "applies to kind = \"adamw\" only"));
                }
                if self.eps.is_some() {
                    return Err(invalid("eps", "applies to kind = \"adamw\" only"));
                }
            }
            OptimizerKind::Adamw => {
                if self.momentum.is_some() {
                    return Err(invalid("momentum", "applies to kind = \"sgd\" only"));
                }
                if self.nesterov.is_some() {
                    return Err(invalid("nesterov", "applies to kind = \"sgd\" only"));
                }
                if self.quasi_global.is_some() {
                    return Err(invalid("quasi_global", "applies to kind = \"sgd\" only"));
                }
                let [b1, b2] = self.betas();
                if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
                    return Err(invalid("betas", "both must be in [0, 1)"));
                }
                if !(self.eps().is_finite() && self.eps() > 0.0) {
                    return Err(invalid("eps", "must be positive"));
                }
            }
        }
        Ok(())
    }

    fn quasi_global(&self) -> bool {
        self.quasi_global.unwrap_or(false)
    }

    fn betas(&self) -> [f32; 2] {
        self.betas.unwrap_or([0.9, 0.999])
    }

    fn eps(&self) -> f32 {
        self.eps.unwrap_or(1e-8)
    }

    fn weight_decay(&self) -> f32 {
        self.weight_decay.unwrap_or(match self.kind {
            OptimizerKind::Sgd => 0.0,
            OptimizerKind::Adamw => 0.01,
        })
    }

    /// Names of the per-parameter state buffers, as stored in checkpoints.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self.kind {
            OptimizerKind::Sgd if self.quasi_global() => {
                &["velocity", "quasi_global_momentum", "last_params"]
            }
            OptimizerKind::Sgd => &["velocity"],
            OptimizerKind::Adamw => &["first_moment", "second_moment"],
        }
    }

    /// Checks state received from a peer against what this optimizer can hold, and says what
    /// is wrong. Every value must be finite. AdamW's moments are averages of the gradients and
    /// of their squares: the second is never negative, and by Cauchy-Schwarz the first is at
    /// most `(1 - b1) / sqrt((1 - b2) (1 - b1^2 / b2))` times the root of the second (7.3 at
    /// the default betas), which also bounds the step it takes. A state off those bounds
    /// would send the replica to NaN or far away at its next update.
    pub fn check_state(&self, buffers: &[Vec<f32>]) -> Result<(), String> {
        let names = self.state_names();
        if buffers.len() != names.len() {
            return Err(format!(
                "{} state buffers, this optimizer has {}",
                buffers.len(),
                names.len()
            ));
        }
        for (name, buffer) in names.iter().zip(buffers) {
            if let Some(i) = buffer.iter().position(|v| !v.is_finite()) {
                return Err(format!("{name}[{i}] is not finite"));
            }
        }
        if let (OptimizerKind::Adamw, [first, second]) = (self.kind, buffers) {
            if let Some(i) = second.iter().position(|&v| v < 0.0) {
                return Err(format!("second_moment[{i}] is negative"));
            }
            let [b1, b2] = self.betas().map(f64::from);
            if b1 * b1 < b2 {
                // 1 % for the rounding of sums kept in f32.
                let bound = 1.01 * (1.0 - b1) / ((1.0 - b2) * (1.0 - b1 * b1 / b2)).sqrt();
                let over = first
                    .iter()
                    .zip(second)
                    .position(|(&m, &v)| f64::from(m).abs() > bound * f64::from(v).sqrt());
                if let Some(i) = over {
                    return Err(format!(
                        "first_moment[{i}] = {} is over {bound:.2} x the root of second_moment \
                         ({}): no sequence of gradients gives that",
                        first[i], second[i]
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Learning rate as a function of the step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    kind: ScheduleKind,
    base: f32,
    min: f32,
    warmup_steps: u64,
    total_steps: u64,
}

impl LrSchedule {
    pub fn new(spec: &OptimizerSpec, total_steps: u64) -> Self {
        LrSchedule {
            kind: spec.schedule,
            base: spec.lr,
            min: spec.min_lr,
            warmup_steps: spec.warmup_steps.min(total_steps),
            total_steps,
        }
    }

    /// The rate for step `step` (counting from 0).
    pub fn lr(&self, step: u64) -> f32 {
        match self.kind {
            ScheduleKind::Constant => self.base,
            ScheduleKind::WarmupCosine => {
                if step < self.warmup_steps {
                    return self.base * (step + 1) as f32 / self.warmup_steps as f32;
                }
                let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
                let progress = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                self.min + (self.base - self.min) * cosine as f32
            }
        }
    }
}

/// An optimizer's state copied to the host: what a state sync hands a peer so that it steps
/// exactly like the replica it took over.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    /// One buffer per [`OptimizerSpec::state_names`] entry, in that order, each with the flat
    /// parameter layout.
    pub buffers: Vec<Vec<f32>>,
    /// Updates applied so far (AdamW's bias correction depends on it).
    pub updates: u64,
}

/// Scales `grads` so that their global L2 norm is at most `max_norm`, as PyTorch's
/// `clip_grad_norm_` does: by `max_norm / (norm + 1e-6)` when that is below 1. Returns the norm
/// before clipping.
pub fn clip_global_norm<B: Backend>(
    backend: &B,
    grads: &mut B::Buffer,
    max_norm: f32,
) -> BackendResult<f32> {
    let norm = backend.sum_squares(whole::<B>(grads))?.sqrt() as f32;
    let coefficient = max_norm / (norm + 1e-6);
    if coefficient < 1.0 {
        backend.scale(coefficient, whole_mut::<B>(grads))?;
    }
    Ok(norm)
}

/// An optimizer's state on the device, one buffer per [`OptimizerSpec::state_names`] entry,
/// each with the flat parameter layout.
pub struct Optimizer<B: Backend> {
    spec: OptimizerSpec,
    /// Each tensor's range in the flat buffers, and whether weight decay applies to it.
    /// Updates go tensor by tensor so that a multi-threaded backend divides each weight by
    /// rows, like its GEMMs do.
    tensors: Vec<(Range<usize>, bool)>,
    state: Vec<B::Buffer>,
    /// Updates applied so far (AdamW's bias correction needs it).
    updates: u64,
    /// The learning rate of the last update, which the quasi-global momentum divides the
    /// displacement since it by (`None` before the first).
    last_lr: Option<f32>,
}

impl<B: Backend> std::fmt::Debug for Optimizer<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("spec", &self.spec)
            .field("updates", &self.updates)
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Optimizer<B> {
    pub fn new(backend: &B, spec: OptimizerSpec, layout: &ParamLayout) -> BackendResult<Self> {
        Self::with_decay_filter(backend, spec, layout, |_| true)
    }

    /// As [`Optimizer::new`], with weight decay only on the tensors whose names `decays`
    /// accepts (a GPT decays its matrices, not its biases and LayerNorm gains).
    pub fn with_decay_filter(
        backend: &B,
        spec: OptimizerSpec,
        layout: &ParamLayout,
        decays: impl Fn(&str) -> bool,
    ) -> BackendResult<Self> {
        let state = spec
            .state_names()
            .iter()
            .map(|_| backend.zeros(layout.len()))
            .collect::<BackendResult<_>>()?;
        Ok(Optimizer {
            spec,
            tensors: layout
                .entries()
                .iter()
                .map(|e| (e.range(), decays(&e.name)))
                .collect(),
            state,
            updates: 0,
            last_lr: None,
        })
    }

    /// Whether [`Optimizer::mixed`] does anything: quasi-global momentum.
    pub fn counts_mixes(&self) -> bool {
        self.spec.quasi_global()
    }

    pub fn spec(&self) -> &OptimizerSpec {
        &self.spec
    }

    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// Applies one update with learning rate `lr`.
    ///
    /// With quasi-global momentum (Lin et al., ICML 2021), the SGD velocity starts each update
    /// from a momentum `m` that follows the replica's displacement since the previous update,
    /// `m <- momentum * m + (1 - momentum) * (x_before - x_now) / lr_before`, so that a mix
    /// with peers between two updates counts as much as the update itself (a rare mix at a
    /// share, see [`Optimizer::mixed`]). Plain momentum
    /// accumulates a peer's own gradients only: on a shard of a few labels it keeps pulling
    /// the replica back towards them after every mix.
    pub fn step(
        &mut self,
        backend: &B,
        params: &mut B::Buffer,
        grads: &B::Buffer,
        lr: f32,
    ) -> BackendResult {
        self.updates += 1;
        if self.spec.quasi_global() {
            self.follow_displacement(backend, params, lr)?;
        }
        let spec = &self.spec;
        for (range, decays) in &self.tensors {
            let r = || range.clone();
            let weight_decay = if *decays { spec.weight_decay() } else { 0.0 };
            match (spec.kind, self.state.as_mut_slice()) {
                (OptimizerKind::Sgd, [velocity, ..]) => backend.sgd_update(
                    SgdUpdate {
                        lr,
                        momentum: spec.momentum.unwrap_or(0.0),
                        nesterov: spec.nesterov.unwrap_or(false),
                        weight_decay,
                    },
                    B::view_mut(params, r()),
                    B::view(grads, r()),
                    B::view_mut(velocity, r()),
                )?,
                (OptimizerKind::Adamw, [m, v]) => {
                    let [beta1, beta2] = spec.betas();
                    backend.adamw_update(
                        AdamWUpdate {
                            lr,
                            beta1,
                            beta2,
                            eps: spec.eps(),
                            weight_decay,
                            step: self.updates,
                        },
                        B::view_mut(params, r()),
                        B::view(grads, r()),
                        B::view_mut(m, r()),
                        B::view_mut(v, r()),
                    )?
                }
                _ => unreachable!("invariant: state buffers are made from spec.state_names()"),
            }
        }
        Ok(())
    }

    /// Moves the quasi-global momentum by the displacement since the last update, and starts
    /// this update's velocity from it (see [`Optimizer::step`]).
    fn follow_displacement(&mut self, backend: &B, params: &B::Buffer, lr: f32) -> BackendResult {
        let [velocity, momentum, last] = self.state.as_mut_slice() else {
            unreachable!("invariant: quasi-global SGD has three state buffers")
        };
        let mu = self.spec.momentum.unwrap_or(0.0);
        if let Some(last_lr) = self.last_lr {
            // last <- x_before - x_now; the velocity buffer is scratch until it is set below.
            backend.axpy(-1.0, whole::<B>(params), whole_mut::<B>(last))?;
            backend.copy(whole::<B>(momentum), whole_mut::<B>(velocity))?;
            backend.axpy(mu - 1.0, whole::<B>(velocity), whole_mut::<B>(momentum))?;
            backend.axpy(
                (1.0 - mu) / last_lr,
                whole::<B>(last),
                whole_mut::<B>(momentum),
            )?;
        }
        backend.copy(whole::<B>(momentum), whole_mut::<B>(velocity))?;
        backend.copy(whole::<B>(params), whole_mut::<B>(last))?;
        self.last_lr = Some(lr);
        Ok(())
    }

    /// Tells the optimizer that a mix with peers moved the parameters by `delta`, one mix
    /// about every `interval` steps. Quasi-global momentum takes a mix every
    /// [`QUASI_GLOBAL_WHOLE_MIX_INTERVAL`] steps or more often whole; a rarer mix is larger
    /// (the replicas drifted apart for longer) and, carried on whole, made the replicas
    /// overshoot each other until they diverged, so it counts at the share
    /// `QUASI_GLOBAL_WHOLE_MIX_INTERVAL / interval` (decision 0035). Without quasi-global
    /// momentum a mix does not touch the optimizer.
    pub fn mixed(&mut self, backend: &B, delta: &[f32], interval: u64) -> BackendResult {
        let Some(share) = quasi_global_mix_share(interval) else {
            return Ok(());
        };
        if !self.counts_mixes() || self.last_lr.is_none() {
            return Ok(());
        }
        let [_, _, last] = self.state.as_mut_slice() else {
            unreachable!("invariant: quasi-global SGD has three state buffers")
        };
        // The next update measures the displacement from `last`: moving `last` by the share
        // not counted leaves `share * delta` of the mix in it.
        let mut moved = backend.zeros(delta.len())?;
        backend.upload(delta, whole_mut::<B>(&mut moved))?;
        backend.axpy(1.0 - share, whole::<B>(&moved), whole_mut::<B>(last))
    }

    /// Copies the state buffers to the host, in [`OptimizerSpec::state_names`] order.
    pub fn download_state(&self, backend: &B) -> BackendResult<Vec<Vec<f32>>> {
        self.state
            .iter()
            .map(|buf| {
                let mut host = vec![0.0; B::buffer_len(buf)];
                backend.download(whole::<B>(buf), &mut host)?;
                Ok(host)
            })
            .collect()
    }

    /// Restores state saved by [`Optimizer::download_state`] after `updates` updates, the
    /// last of them at `last_lr` (`None` if there was none).
    pub fn restore_state(
        &mut self,
        backend: &B,
        state: &[Vec<f32>],
        updates: u64,
        last_lr: Option<f32>,
    ) -> BackendResult {
        for (buf, host) in self.state.iter_mut().zip(state) {
            backend.upload(host, whole_mut::<B>(buf))?;
        }
        self.updates = updates;
        self.last_lr = last_lr.filter(|_| updates > 0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clipping_scales_only_a_norm_past_the_bound() {
        use crate::backend::cpu::CpuBackend;
        let backend = CpuBackend::new();
        let mut grads = vec![3.0, 0.0, 4.0];
        assert_eq!(clip_global_norm(&backend, &mut grads, 10.0).unwrap(), 5.0);
        assert_eq!(grads, [3.0, 0.0, 4.0]);
        assert_eq!(clip_global_norm(&backend, &mut grads, 1.0).unwrap(), 5.0);
        let norm = grads.iter().map(|g| g * g).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-6, "{grads:?}");
        assert!(
            (grads[0] / grads[2] - 0.75).abs() < 1e-7,
            "the direction is kept"
        );
    }

    #[test]
    fn a_decay_filter_leaves_the_tensors_it_rejects_alone() {
        use crate::backend::cpu::CpuBackend;
        let backend = CpuBackend::new();
        let mut layout = ParamLayout::default();
        layout.push("fc.weight", &[2]);
        layout.push("fc.bias", &[2]);
        let spec = OptimizerSpec {
            weight_decay: Some(0.5),
            ..OptimizerSpec::adamw(0.1)
        };
        let decays = |name: &str| name.ends_with(".weight");
        let mut optimizer = Optimizer::with_decay_filter(&backend, spec, &layout, decays).unwrap();
        let mut params = vec![1.0; 4];
        // No gradient: only the decay moves a parameter, by lr * decay.
        optimizer
            .step(&backend, &mut params, &vec![0.0; 4], 0.1)
            .unwrap();
        assert_eq!(params, [0.95, 0.95, 1.0, 1.0]);
    }

    #[test]
    fn warmup_cosine_rises_then_decays_to_min() {
        let spec = OptimizerSpec {
            schedule: ScheduleKind::WarmupCosine,
            warmup_steps: 10,
            min_lr: 0.01,
            ..OptimizerSpec::sgd(0.1, 0.9)
        };
        let s = LrSchedule::new(&spec, 110);
        assert!((s.lr(0) - 0.01).abs() < 1e-7);
        assert!((s.lr(9) - 0.1).abs() < 1e-7);
        assert!((s.lr(10) - 0.1).abs() < 1e-7);
        assert!((s.lr(60) - 0.055).abs() < 1e-6);
        assert!((s.lr(110) - 0.01).abs() < 1e-7);
        assert!((s.lr(500) - 0.01).abs() < 1e-7);
        let constant = LrSchedule::new(&OptimizerSpec::sgd(0.1, 0.9), 110);
        assert_eq!(constant.lr(77), 0.1);
    }

    /// AdamW's moments after any gradients pass the check, the sequence that comes closest to
    /// the bound included (gradients growing by b2 / b1 a step), and damaged ones do not.
    #[test]
    fn adamw_state_from_any_gradients_passes_the_check_and_damaged_state_does_not() {
        use crate::backend::cpu::CpuBackend;
        let backend = CpuBackend::new();
        let mut layout = ParamLayout::default();
        layout.push("w", &[3]);
        let spec = OptimizerSpec::adamw(0.01);
        let mut optimizer = Optimizer::new(&backend, spec.clone(), &layout).unwrap();
        let mut params = backend.zeros(3).unwrap();
        let mut grads = backend.zeros(3).unwrap();
        let growth = 0.999_f32 / 0.9;
        for t in 0..150 {
            let tightest = growth.powi(t);
            let g = [
                tightest,
                ((t * 7919) % 13) as f32 - 6.0,
                if t < 50 { 1e3 } else { -1e-3 },
            ];
            backend
                .upload(&g, whole_mut::<CpuBackend>(&mut grads))
                .unwrap();
            optimizer.step(&backend, &mut params, &grads, 0.01).unwrap();
            let state = optimizer.download_state(&backend).unwrap();
            spec.check_state(&state)
                .unwrap_or_else(|e| panic!("update {t}: {e}"));
        }
        let state = optimizer.download_state(&backend).unwrap();
        let ratio = state[0][0].abs() / state[1][0].sqrt();
        assert!(
            ratio > 0.9 * 7.27 && ratio < 7.3,
            "the bound is tight: {ratio}"
        );

        let damaged = |buffer: usize, value: f32| {
            let mut state = state.clone();
            state[buffer][1] = value;
            spec.check_state(&state)
        };
        assert!(damaged(1, -1e-9).unwrap_err().contains("negative"));
        assert!(
            damaged(0, 8.0 * state[1][1].sqrt())
                .unwrap_err()
                .contains("first_moment[1]")
        );
        assert!(damaged(0, f32::NAN).unwrap_err().contains("not finite"));
        assert!(spec.check_state(&state[..1]).is_err(), "a buffer short");
        let sgd = OptimizerSpec::sgd(0.1, 0.9);
        assert!(
            sgd.check_state(&[vec![1e30, -1e30]]).is_ok(),
            "SGD's velocity is any finite"
        );
    }

    /// Quasi-global momentum, checked against the rule written out on the host: between
    /// updates the momentum follows the replica's displacement, a mix from outside included;
    /// without a mix, it is the momentum of the updates themselves.
    #[test]
    fn quasi_global_momentum_follows_the_displacement_mixes_included() {
        use crate::backend::cpu::CpuBackend;
        let backend = CpuBackend::new();
        let mut layout = ParamLayout::default();
        layout.push("w", &[4]);
        let spec = OptimizerSpec {
            quasi_global: Some(true),
            ..OptimizerSpec::sgd(0.1, 0.9)
        };
        let mut optimizer = Optimizer::new(&backend, spec, &layout).unwrap();
        let mut params = backend.zeros(4).unwrap();
        let mut grads = backend.zeros(4).unwrap();
        let (beta, lrs) = (0.9_f32, [0.1_f32, 0.05, 0.1, 0.2]);
        let (mut x, mut m, mut last) = ([1.0_f32, -2.0, 0.5, 3.0], [0.0_f32; 4], None);
        backend
            .upload(&x, whole_mut::<CpuBackend>(&mut params))
            .unwrap();
        for (t, lr) in lrs.into_iter().enumerate() {
            let g: Vec<f32> = (0..4)
                .map(|i| (i as f32 - 1.5) * (t as f32 + 1.0))
                .collect();
            backend
                .upload(&g, whole_mut::<CpuBackend>(&mut grads))
                .unwrap();
            if t == 2 {
                // A mix: the replica moves halfway to a peer's parameters.
                let peer = [0.0_f32, 0.0, 1.0, 1.0];
                x = std::array::from_fn(|i| 0.5 * (x[i] + peer[i]));
                backend
                    .upload(&x, whole_mut::<CpuBackend>(&mut params))
                    .unwrap();
            }
            if let Some((x_before, lr_before)) = last {
                let x_before: [f32; 4] = x_before;
                m = std::array::from_fn(|i| {
                    beta * m[i] + (1.0 - beta) * (x_before[i] - x[i]) / lr_before
                });
            }
            last = Some((x, lr));
            x = std::array::from_fn(|i| x[i] - lr * (g[i] + beta * m[i]));
            optimizer.step(&backend, &mut params, &grads, lr).unwrap();
            let mut got = [0.0; 4];
            backend
                .download(whole::<CpuBackend>(&params), &mut got)
                .unwrap();
            for i in 0..4 {
                assert!((got[i] - x[i]).abs() < 1e-5, "update {t}: {got:?} vs {x:?}");
            }
        }
    }

    /// The largest distance from the joint optimum reached by two replicas under quasi-global
    /// momentum, each descending its own quadratic (optima 1 and -0.5, so the joint optimum
    /// is 0.25) and averaging with the other every 48 steps, telling the optimizer the mix
    /// came one in `told_interval` steps.
    fn two_replicas_mixing_every_48_steps(told_interval: u64) -> f32 {
        use crate::backend::cpu::CpuBackend;
        let backend = CpuBackend::new();
        let mut layout = ParamLayout::default();
        layout.push("w", &[1]);
        let spec = OptimizerSpec {
            quasi_global: Some(true),
            ..OptimizerSpec::sgd(0.1, 0.9)
        };
        let (optima, curvature, optimum) = ([1.0_f32, -0.5], 0.05, 0.25);
        let mut replicas: Vec<_> = optima
            .iter()
            .map(|_| {
                let optimizer = Optimizer::new(&backend, spec.clone(), &layout).unwrap();
                (
                    optimizer,
                    backend.zeros(1).unwrap(),
                    backend.zeros(1).unwrap(),
                )
            })
            .collect();
        let read = |buf: &<CpuBackend as Backend>::Buffer| {
            let mut x = [0.0];
            backend.download(whole::<CpuBackend>(buf), &mut x).unwrap();
            x[0]
        };
        let mut farthest = 0.0_f32;
        for step in 1..=48 * 40 {
            for ((optimizer, params, grads), target) in replicas.iter_mut().zip(optima) {
                let g = [curvature * (read(params) - target)];
                backend.upload(&g, whole_mut::<CpuBackend>(grads)).unwrap();
                optimizer.step(&backend, params, grads, 0.1).unwrap();
                farthest = farthest.max((read(params) - optimum).abs());
            }
            if step % 48 == 0 {
                let mean = replicas.iter().map(|(_, p, _)| read(p)).sum::<f32>() / 2.0;
                for (optimizer, params, _) in &mut replicas {
                    let delta = [mean - read(params)];
                    backend
                        .upload(&[mean], whole_mut::<CpuBackend>(params))
                        .unwrap();
                    optimizer.mixed(&backend, &delta, told_interval).unwrap();
                }
            }
            if !farthest.is_finite() || farthest > 1e3 {
                return f32::INFINITY;
            }
        }
        farthest
    }

    /// Mixes rarer than every 8 steps count in quasi-global momentum at a share: carried on
    /// whole, each made the replicas overshoot each other by more, until they diverged (as
    /// the testnet's MLP did every 32 and 48 steps, decision 0035).
    #[test]
    fn quasi_global_momentum_takes_rare_mixes_at_a_share() {
        let at_a_share = two_replicas_mixing_every_48_steps(48);
        assert!(
            at_a_share < 1.0,
            "mixes counted at 8/48 still took a replica {at_a_share} from the joint optimum"
        );
        let whole = two_replicas_mixing_every_48_steps(QUASI_GLOBAL_WHOLE_MIX_INTERVAL);
        assert!(
            whole.is_infinite(),
            "whole mixes every 48 steps were expected to diverge here, got {whole}"
        );
    }

    #[test]
    fn keys_of_the_other_optimizer_are_rejected() {
        let mut spec = OptimizerSpec::adamw(1e-3);
        spec.momentum = Some(0.9);
        assert!(
            spec.validate()
                .unwrap_err()
                .to_string()
                .contains("optimizer.momentum")
        );
        let mut spec = OptimizerSpec::sgd(0.1, 0.9);
        spec.betas = Some([0.9, 0.99]);
        assert!(
            spec.validate()
                .unwrap_err()
                .to_string()
                .contains("optimizer.betas")
        );
        let mut spec = OptimizerSpec::sgd(0.1, 0.0);
        spec.nesterov = Some(true);
        assert!(spec.validate().is_err());
        assert!(OptimizerSpec::sgd(-1.0, 0.0).validate().is_err());
        let mut spec = OptimizerSpec::sgd(0.1, 0.0);
        spec.quasi_global = Some(true);
        assert!(
            spec.validate()
                .unwrap_err()
                .to_string()
                .contains("optimizer.quasi_global")
        );
        let mut spec = OptimizerSpec::adamw(1e-3);
        spec.quasi_global = Some(false);
        assert!(spec.validate().is_err());
        assert!(OptimizerSpec::sgd(0.05, 0.9).validate().is_ok());
        assert!(OptimizerSpec::adamw(1e-3).validate().is_ok());
    }
}
