//! The checkpoints of a PyTorch replica: Murmur's checkpoint files (safetensors, the native
//! trainer's format, readable by `safetensors.torch.load_file`), in the node's data dir,
//! named by the model's tensors, with the optimizer's state as named buffers. A training
//! process killed at any moment resumes from the newest (files are written whole, then
//! renamed), or takes the swarm's state when it lags.

use std::path::PathBuf;

use anyhow::{Result, bail};
use murmur_daemon::model::{ModelDescription, ParamDtype, TensorSpec};
use murmur_daemon::node::replica::{NamedBuffer, OptimizerBuffers, ReplicaState, Saved};
use murmur_trainer::checkpoint::{self, Checkpoint, CheckpointError};

/// Where a replica's checkpoints go, and whose they are.
#[derive(Clone, Debug)]
pub(crate) struct Checkpoints {
    pub(crate) dir: PathBuf,
    pub(crate) model: ModelDescription,
    /// The run they belong to: a checkpoint resumes only a replica of the same run.
    pub(crate) run: String,
    pub(crate) keep: usize,
}

impl Checkpoints {
    /// What a checkpoint of this run says its config is.
    fn run_mark(&self) -> String {
        format!("run {}", self.run)
    }

    pub(crate) fn save(&self, state: &ReplicaState, epoch: u64) -> Result<Saved> {
        let (optimizer_state_names, optimizer_state, optimizer_updates) = match &state.optimizer {
            Some(o) => (
                o.buffers.iter().map(|b| b.name.clone()).collect(),
                o.buffers.iter().map(|b| b.values.clone()).collect(),
                o.updates,
            ),
            None => (Vec::new(), Vec::new(), 0),
        };
        let ckpt = Checkpoint {
            step: state.step,
            epoch,
            config_hash: self.run_mark(),
            fingerprint: self.model.fingerprint(),
            params: state.params.clone(),
            optimizer_state,
            optimizer_state_names,
            optimizer_updates,
        };
        let path = checkpoint::save(&self.dir, &ckpt, &self.model.layout(), self.keep)?;
        let bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
        Ok(Saved {
            step: state.step,
            path,
            bytes,
        })
    }

    /// The state of the newest checkpoint that can be resumed from, if any. A checkpoint of
    /// another model is an error that says what differs; one that cannot be read (cut short,
    /// damaged) is skipped for an older one.
    pub(crate) fn newest(&self) -> Result<Option<ReplicaState>> {
        let found = checkpoint::list(&self.dir)?;
        for (_, path) in found.iter().rev() {
            match checkpoint::load(path, &self.model.layout(), &self.model.fingerprint()) {
                Ok(saved) if saved.config_hash != self.run_mark() => bail!(
                    "the checkpoints in `{}` are of another run ({}); give this run a data \
                     dir of its own (`data_dir=`), or move them away to start over",
                    self.dir.display(),
                    saved.config_hash
                ),
                Ok(saved) if saved.is_finite() => return Ok(Some(state_of(saved))),
                Ok(_) => tracing::warn!(
                    path = %path.display(),
                    "skipping a checkpoint that holds values that are not finite; trying an \
                     older one"
                ),
                Err(CheckpointError::Mismatch { .. }) => {
                    return Err(self.mismatch(path));
                }
                Err(e @ (CheckpointError::Format { .. } | CheckpointError::Io { .. })) => {
                    tracing::warn!(error = %e, "skipping a checkpoint that cannot be read; trying an older one");
                }
                Err(e) => return Err(e.into()),
            }
        }
        if found.is_empty() {
            Ok(None)
        } else {
            bail!(
                "none of the {} checkpoints in `{}` can be resumed from (see the warnings \
                 above): move them away to start over",
                found.len(),
                self.dir.display()
            )
        }
    }

    /// The error for a checkpoint of another model: what differs.
    fn mismatch(&self, path: &std::path::Path) -> anyhow::Error {
        let saved = checkpoint::tensors(path).map(|tensors| {
            tensors
                .into_iter()
                .map(|(name, shape)| TensorSpec {
                    name,
                    shape,
                    dtype: ParamDtype::F32,
                })
                .collect::<Vec<_>>()
        });
        let mut ours: Vec<TensorSpec> = self.model.tensors().to_vec();
        ours.sort_by(|a, b| a.name.cmp(&b.name));
        // The file keeps the values as float32 whatever the model's dtype: compare the rest.
        for tensor in &mut ours {
            tensor.dtype = ParamDtype::F32;
        }
        let differences = match saved.map(ModelDescription::new) {
            Ok(Ok(saved)) => ModelDescription::new(ours)
                .map(|ours| ours.differences(&saved))
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let what = if differences.is_empty() {
            "the same tensors in another order or dtype".to_owned()
        } else {
            differences
                .join("; ")
                .replace("the run's model", "the checkpoint")
        };
        anyhow::anyhow!(
            "checkpoint `{}` was written for another model: {what}. Build the model this data \
             dir trained, or give this model a data dir of its own (`data_dir=`)",
            path.display()
        )
    }
}

fn state_of(saved: Checkpoint) -> ReplicaState {
    let optimizer = (!saved.optimizer_state_names.is_empty()).then(|| OptimizerBuffers {
        buffers: (saved.optimizer_state_names.into_iter())
            .zip(saved.optimizer_state)
            .map(|(name, values)| NamedBuffer { name, values })
            .collect(),
        updates: saved.optimizer_updates,
    });
    ReplicaState {
        step: saved.step,
        params: saved.params,
        optimizer,
    }
}
