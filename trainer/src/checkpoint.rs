//! Checkpoints: safetensors files (readable by PyTorch and the Hugging Face tools) holding every
//! named parameter tensor and the optimizer state, plus metadata (step, epoch, config hash,
//! model fingerprint). Files are written atomically: to a temporary name, fsynced, renamed, and
//! the directory fsynced, so a crash leaves either the old file or the new one.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

use crate::params::ParamLayout;

/// Value of the `format` metadata key.
pub const FORMAT: &str = "murmur-checkpoint/1";
const SUFFIX: &str = ".safetensors";
const PREFIX: &str = "step-";

/// Everything needed to resume training bit-exactly.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    /// Optimizer steps taken.
    pub step: u64,
    /// Epochs completed.
    pub epoch: u64,
    /// Hash of the run config that produced it.
    pub config_hash: String,
    /// [`crate::model::Architecture::fingerprint`] of the model.
    pub fingerprint: String,
    /// The flat parameter buffer.
    pub params: Vec<f32>,
    /// Optimizer state buffers (flat layout), named as in `optimizer_state_names`.
    pub optimizer_state: Vec<Vec<f32>>,
    pub optimizer_state_names: Vec<String>,
    /// Updates the optimizer has applied (AdamW bias correction).
    pub optimizer_updates: u64,
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("checkpoint `{}`: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error(
        "`{}` is not a usable checkpoint ({reason}); delete it, or start over with `--fresh`",
        path.display()
    )]
    Format { path: PathBuf, reason: String },
    #[error(
        "checkpoint `{}` was written for a different {what} ({found}, this run has {expected}); \
         use another checkpoint directory, or start over with `--fresh`",
        path.display()
    )]
    Mismatch {
        path: PathBuf,
        what: &'static str,
        expected: String,
        found: String,
    },
}

impl Checkpoint {
    /// Whether every parameter and optimizer value is finite: a replica that diverged is not.
    pub fn is_finite(&self) -> bool {
        let finite = |values: &[f32]| values.iter().all(|v| v.is_finite());
        finite(&self.params) && self.optimizer_state.iter().all(|b| finite(b))
    }

    /// Serialises to safetensors bytes; `layout` names the tensors of the flat buffers.
    pub fn to_bytes(&self, layout: &ParamLayout) -> Result<Vec<u8>, safetensors::SafeTensorError> {
        // Each flat buffer as little-endian bytes, with the prefix its tensors are named by.
        let states = self.optimizer_state_names.iter().zip(&self.optimizer_state);
        let buffers: Vec<(String, Vec<u8>)> = std::iter::once((String::new(), &self.params))
            .chain(states.map(|(name, flat)| (format!("optimizer.{name}."), flat)))
            .map(|(prefix, flat)| (prefix, flat.iter().flat_map(|v| v.to_le_bytes()).collect()))
            .collect();
        let mut views = Vec::new();
        for (prefix, raw) in &buffers {
            for entry in layout.entries() {
                let bytes = &raw[entry.offset * 4..(entry.offset + entry.len()) * 4];
                let view = TensorView::new(Dtype::F32, entry.shape.clone(), bytes)?;
                views.push((format!("{prefix}{}", entry.name), view));
            }
        }
        let metadata = HashMap::from([
            ("format".to_owned(), FORMAT.to_owned()),
            ("step".to_owned(), self.step.to_string()),
            ("epoch".to_owned(), self.epoch.to_string()),
            ("config_hash".to_owned(), self.config_hash.clone()),
            ("fingerprint".to_owned(), self.fingerprint.clone()),
            (
                "optimizer_updates".to_owned(),
                self.optimizer_updates.to_string(),
            ),
            (
                "optimizer_state".to_owned(),
                self.optimizer_state_names.join(","),
            ),
        ]);
        safetensors::serialize(views, Some(metadata))
    }

    /// Parses safetensors bytes written by [`Checkpoint::to_bytes`] for a model with `layout`.
    pub fn from_bytes(
        path: &Path,
        bytes: &[u8],
        layout: &ParamLayout,
    ) -> Result<Self, CheckpointError> {
        let format_err = |reason: String| CheckpointError::Format {
            path: path.to_owned(),
            reason,
        };
        let (_, header) =
            SafeTensors::read_metadata(bytes).map_err(|e| format_err(e.to_string()))?;
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| format_err(e.to_string()))?;
        let meta = header.metadata().clone().unwrap_or_default();
        let get = |key: &str| {
            meta.get(key)
                .cloned()
                .ok_or_else(|| format_err(format!("metadata has no `{key}`")))
        };
        let number = |key: &str| {
            get(key)?
                .parse::<u64>()
                .map_err(|_| format_err(format!("metadata `{key}` is not a number")))
        };
        if get("format")? != FORMAT {
            return Err(format_err(format!("format is not {FORMAT}")));
        }
        let read_flat = |prefix: &str| -> Result<Vec<f32>, CheckpointError> {
            let mut flat = vec![0.0f32; layout.len()];
            for entry in layout.entries() {
                let name = format!("{prefix}{}", entry.name);
                let view = tensors
                    .tensor(&name)
                    .map_err(|_| format_err(format!("tensor `{name}` is missing")))?;
                if view.dtype() != Dtype::F32 || view.shape() != entry.shape.as_slice() {
                    return Err(format_err(format!(
                        "tensor `{name}` is {:?} {:?}, expected F32 {:?}",
                        view.dtype(),
                        view.shape(),
                        entry.shape
                    )));
                }
                for (dst, src) in flat[entry.range()]
                    .iter_mut()
                    .zip(view.data().chunks_exact(4))
                {
                    *dst = f32::from_le_bytes([src[0], src[1], src[2], src[3]]);
                }
            }
            Ok(flat)
        };
        let state_names: Vec<String> = get("optimizer_state")?
            .split(',')
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        let optimizer_state = state_names
            .iter()
            .map(|n| read_flat(&format!("optimizer.{n}.")))
            .collect::<Result<_, _>>()?;
        Ok(Checkpoint {
            step: number("step")?,
            epoch: number("epoch")?,
            config_hash: get("config_hash")?,
            fingerprint: get("fingerprint")?,
            params: read_flat("")?,
            optimizer_state,
            optimizer_state_names: state_names,
            optimizer_updates: number("optimizer_updates")?,
        })
    }
}

/// Writes `bytes` to `path` atomically: temporary file, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Checkpoints in `dir`, as `(step, path)` sorted by step.
pub fn list(dir: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(CheckpointError::Io {
                path: dir.to_owned(),
                source,
            });
        }
    };
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name
                .strip_prefix(PREFIX)?
                .strip_suffix(SUFFIX)?
                .parse()
                .ok()?;
            Some((step, e.path()))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// The checkpoint with the highest step in `dir`, if any.
pub fn latest(dir: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(list(dir)?.pop().map(|(_, p)| p))
}

/// Writes `checkpoint` as `dir/step-N.safetensors` and deletes all but the newest `keep`,
/// and what writes cut short by a crash left (`step-N.safetensors.tmp`).
pub fn save(
    dir: &Path,
    checkpoint: &Checkpoint,
    layout: &ParamLayout,
    keep: usize,
) -> Result<PathBuf, CheckpointError> {
    let path = dir.join(format!("{PREFIX}{}{SUFFIX}", checkpoint.step));
    let io_err = |path: &Path| {
        let path = path.to_owned();
        move |source| CheckpointError::Io { path, source }
    };
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let bytes = checkpoint
        .to_bytes(layout)
        .map_err(|e| CheckpointError::Format {
            path: path.clone(),
            reason: e.to_string(),
        })?;
    write_atomic(&path, &bytes).map_err(io_err(&path))?;
    let all = list(dir)?;
    for (_, old) in all.iter().take(all.len().saturating_sub(keep.max(1))) {
        fs::remove_file(old).map_err(io_err(old))?;
    }
    remove_cut_short(dir);
    Ok(path)
}

/// Removes the temporary files of checkpoint writes a crash cut short: the writer of this
/// directory's checkpoints is the one calling, so no other write is under way. Best effort:
/// a file that cannot be removed is only garbage.
fn remove_cut_short(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let temporary = format!("{SUFFIX}.tmp");
    for entry in entries.filter_map(Result::ok) {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(PREFIX) && name.ends_with(&temporary) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Reads the checkpoint at `path` for a model with `layout` and `fingerprint`.
pub fn load(
    path: &Path,
    layout: &ParamLayout,
    fingerprint: &str,
) -> Result<Checkpoint, CheckpointError> {
    let bytes = fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| CheckpointError::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let found = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("fingerprint").cloned())
        .unwrap_or_default();
    if found != fingerprint {
        return Err(CheckpointError::Mismatch {
            path: path.to_owned(),
            what: "model",
            expected: fingerprint.to_owned(),
            found,
        });
    }
    Checkpoint::from_bytes(path, &bytes, layout)
}

/// Reads the checkpoint at `path` whatever model wrote it: the layout is the file's own
/// parameter tensors, by name. For tools that compare replicas of a model they cannot build
/// (a PyTorch model's), such as their consensus distance.
pub fn load_any(path: &Path) -> Result<(Checkpoint, ParamLayout), CheckpointError> {
    let mut layout = ParamLayout::default();
    for (name, shape) in tensors(path)? {
        layout.push(name, &shape);
    }
    let bytes = fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok((Checkpoint::from_bytes(path, &bytes, &layout)?, layout))
}

/// The parameter tensors a checkpoint file holds, with their shapes, by name (its optimizer
/// state left out): what a model that does not load it differs in.
pub fn tensors(path: &Path) -> Result<Vec<(String, Vec<usize>)>, CheckpointError> {
    let bytes = fs::read(path).map_err(|source| CheckpointError::Io {
        path: path.to_owned(),
        source,
    })?;
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    let mut found: Vec<(String, Vec<usize>)> = tensors
        .tensors()
        .into_iter()
        .filter(|(name, _)| !name.starts_with("optimizer."))
        .map(|(name, view)| (name, view.shape().to_vec()))
        .collect();
    found.sort();
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelSpec;

    fn sample(step: u64) -> (Checkpoint, ParamLayout) {
        let arch = ModelSpec::mlp().build().unwrap();
        let params = arch.init_params(step);
        let velocity: Vec<f32> = params.iter().map(|v| v * 0.5).collect();
        let ckpt = Checkpoint {
            step,
            epoch: 1,
            config_hash: "abc".into(),
            fingerprint: arch.fingerprint(),
            params,
            optimizer_state: vec![velocity],
            optimizer_state_names: vec!["velocity".into()],
            optimizer_updates: step,
        };
        (ckpt, arch.layout().clone())
    }

    #[test]
    fn one_value_that_is_not_finite_in_parameters_or_optimizer_state_marks_a_diverged_checkpoint() {
        let (ckpt, _) = sample(3);
        assert!(ckpt.is_finite());
        let mut diverged = ckpt.clone();
        diverged.params[7] = f32::NAN;
        assert!(!diverged.is_finite());
        let mut diverged = ckpt;
        diverged.optimizer_state[0][11] = f32::INFINITY;
        assert!(!diverged.is_finite());
    }

    #[test]
    fn save_load_round_trips_bit_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, layout) = sample(7);
        let path = save(dir.path(), &ckpt, &layout, 3).unwrap();
        assert_eq!(path.file_name().unwrap(), "step-7.safetensors");
        let back = load(&path, &layout, &ckpt.fingerprint).unwrap();
        assert_eq!(back, ckpt);
        // Readable as plain safetensors with named tensors.
        let bytes = fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("fc1.weight").unwrap().shape(), [256, 784]);
        assert!(st.tensor("optimizer.velocity.fc3.bias").is_ok());
    }

    #[test]
    fn keeps_only_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        for step in [5, 10, 15, 20] {
            let (ckpt, layout) = sample(step);
            save(dir.path(), &ckpt, &layout, 2).unwrap();
        }
        let steps: Vec<u64> = list(dir.path())
            .unwrap()
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        assert_eq!(steps, [15, 20]);
        assert!(
            latest(dir.path())
                .unwrap()
                .unwrap()
                .ends_with("step-20.safetensors")
        );
        assert!(latest(&dir.path().join("none")).unwrap().is_none());
    }

    /// A kill during a write leaves its temporary file (the kill -9 loop saw up to two); the
    /// next save clears them, and leaves other files alone.
    #[test]
    fn a_save_clears_what_writes_cut_short_left() {
        let dir = tempfile::tempdir().unwrap();
        let cut_short = dir.path().join("step-7.safetensors.tmp");
        let center = dir.path().join("center.safetensors.tmp");
        fs::write(&cut_short, b"half a checkpoint").unwrap();
        fs::write(&center, b"the center's own write").unwrap();
        let (ckpt, layout) = sample(9);
        save(dir.path(), &ckpt, &layout, 2).unwrap();
        assert!(!cut_short.exists());
        assert!(center.exists(), "another writer's file is not touched");
        assert_eq!(list(dir.path()).unwrap().len(), 1);
    }

    #[test]
    fn wrong_model_and_garbage_are_refused_with_advice() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, layout) = sample(1);
        let path = save(dir.path(), &ckpt, &layout, 1).unwrap();
        let err = load(&path, &layout, "0000").unwrap_err();
        assert!(matches!(err, CheckpointError::Mismatch { .. }));
        assert!(err.to_string().contains("--fresh"));
        let junk = dir.path().join("step-2.safetensors");
        fs::write(&junk, b"not a checkpoint").unwrap();
        assert!(matches!(
            load(&junk, &layout, &ckpt.fingerprint).unwrap_err(),
            CheckpointError::Format { .. }
        ));
    }
}
