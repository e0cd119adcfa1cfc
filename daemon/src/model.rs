//! What a replica's flat parameter buffer holds, whoever trains it: a [`ModelDescription`], the
//! names, shapes and dtypes of its tensors in buffer order. It is the contract between peers
//! (decision 0070): two replicas mix only if their descriptions are equal, which their
//! [fingerprints](ModelDescription::fingerprint) tell in heartbeats and frame headers. Murmur's
//! own models describe themselves from their [`ParamLayout`]; a PyTorch model from its
//! `named_parameters()` and floating-point buffers. Values cross the wire as `f32` whatever the
//! dtype; the dtype is part of the description because a bfloat16 replica and a float32 one
//! of the same layout do not train the same model.

use std::fmt;

use anyhow::{Result, bail};
use murmur_trainer::params::ParamLayout;
use sha2::{Digest, Sha256};

/// Element type of a model's tensor, as PyTorch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamDtype {
    F32,
    Bf16,
    F16,
}

impl ParamDtype {
    /// PyTorch's name: `float32`, `bfloat16`, `float16`.
    pub fn name(self) -> &'static str {
        match self {
            ParamDtype::F32 => "float32",
            ParamDtype::Bf16 => "bfloat16",
            ParamDtype::F16 => "float16",
        }
    }
}

impl fmt::Display for ParamDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ParamDtype {
    type Err = anyhow::Error;

    fn from_str(name: &str) -> Result<Self> {
        Ok(match name.trim_start_matches("torch.") {
            "float32" | "float" => ParamDtype::F32,
            "bfloat16" => ParamDtype::Bf16,
            "float16" | "half" => ParamDtype::F16,
            other => bail!(
                "Murmur exchanges float32, bfloat16 and float16 tensors, not {other}: convert \
                 the model (`model.float()`) or keep that tensor out of it"
            ),
        })
    }
}

/// One tensor of a model: its name, shape and dtype.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: ParamDtype,
}

impl TensorSpec {
    /// Values in the tensor.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl fmt::Display for TensorSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` {:?} {}", self.name, self.shape, self.dtype)
    }
}

/// The tensors of a model in the order of its flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelDescription {
    tensors: Vec<TensorSpec>,
}

/// Differences listed in full before the rest are only counted.
const DIFFERENCES_SHOWN: usize = 6;

impl ModelDescription {
    /// A description of `tensors`, which must be at least one, with unique names.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<Self> {
        if tensors.is_empty() {
            bail!("the model has no parameters to exchange");
        }
        let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(pair) = names.windows(2).find(|pair| pair[0] == pair[1]) {
            bail!("the model names two tensors `{}`", pair[0]);
        }
        Ok(ModelDescription { tensors })
    }

    /// The description of one of Murmur's own models: its layout, in `f32`.
    pub fn of_layout(layout: &ParamLayout) -> Self {
        let tensors = layout
            .entries()
            .iter()
            .map(|e| TensorSpec {
                name: e.name.clone(),
                shape: e.shape.clone(),
                dtype: ParamDtype::F32,
            })
            .collect();
        ModelDescription { tensors }
    }

    pub fn tensors(&self) -> &[TensorSpec] {
        &self.tensors
    }

    /// Values in the flat buffer.
    pub fn param_count(&self) -> usize {
        self.tensors.iter().map(TensorSpec::len).sum()
    }

    /// The layout of the flat buffer (names, shapes, offsets), as checkpoints name it.
    pub fn layout(&self) -> ParamLayout {
        let mut layout = ParamLayout::default();
        for tensor in &self.tensors {
            layout.push(tensor.name.clone(), &tensor.shape);
        }
        layout
    }

    /// A short hash of the description: one line `name [shape] dtype` per tensor, in order.
    /// Equal for a native model and a PyTorch model of the same tensors (the trainer's
    /// `ParamLayout::fingerprint` is this hash of a float32 layout).
    pub fn fingerprint(&self) -> String {
        let mut text = String::new();
        for t in &self.tensors {
            text.push_str(&format!("{} {:?} {}\n", t.name, t.shape, t.dtype));
        }
        let digest = Sha256::digest(text.as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    /// What differs between this model and `run`'s, one line each (the first few in full);
    /// empty when they are the same.
    pub fn differences(&self, run: &ModelDescription) -> Vec<String> {
        let mut found = Vec::new();
        for tensor in &self.tensors {
            match run.tensors.iter().find(|t| t.name == tensor.name) {
                None => found.push(format!("{tensor} is not in the run's model")),
                Some(theirs) if theirs.shape != tensor.shape => found.push(format!(
                    "`{}` has shape {:?} here and {:?} in the run's model",
                    tensor.name, tensor.shape, theirs.shape
                )),
                Some(theirs) if theirs.dtype != tensor.dtype => found.push(format!(
                    "`{}` is {} here and {} in the run's model",
                    tensor.name, tensor.dtype, theirs.dtype
                )),
                Some(_) => {}
            }
        }
        for theirs in &run.tensors {
            if !self.tensors.iter().any(|t| t.name == theirs.name) {
                found.push(format!("the run's model has {theirs}, this one does not"));
            }
        }
        if found.is_empty()
            && let Some(at) = (self.tensors.iter().zip(&run.tensors)).position(|(a, b)| a != b)
        {
            found.push(format!(
                "the tensors come in another order: `{}` is tensor {} here, `{}` in the run's \
                 model (the flat buffer follows the order of `named_parameters()`)",
                self.tensors[at].name,
                at + 1,
                run.tensors[at].name
            ));
        }
        if found.len() > DIFFERENCES_SHOWN {
            let more = found.len() - DIFFERENCES_SHOWN;
            found.truncate(DIFFERENCES_SHOWN);
            found.push(format!("and {more} more"));
        }
        found
    }

    /// Fails with every difference from `run`'s model, and what to do, when there is one.
    pub fn check_against(&self, run: &ModelDescription, run_source: &str) -> Result<()> {
        let differences = self.differences(run);
        if differences.is_empty() {
            return Ok(());
        }
        bail!(
            "this model is not the run's ({run_source}): {}. Every peer of a run trains the \
             same tensors; build the model the run's peers train, or start another run",
            differences.join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(name: &str, shape: &[usize], dtype: ParamDtype) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype,
        }
    }

    fn mlp() -> ModelDescription {
        use ParamDtype::F32;
        ModelDescription::new(vec![
            tensor("fc1.weight", &[4, 3], F32),
            tensor("fc1.bias", &[4], F32),
            tensor("fc2.weight", &[2, 4], F32),
            tensor("fc2.bias", &[2], F32),
        ])
        .unwrap()
    }

    #[test]
    fn a_description_counts_its_values_and_lays_them_out_in_order() {
        let model = mlp();
        assert_eq!(model.param_count(), 12 + 4 + 8 + 2);
        let layout = model.layout();
        assert_eq!(layout.get("fc2.weight").map(|e| e.offset), Some(16));
        assert_eq!(ModelDescription::of_layout(&layout), model);
    }

    /// The fingerprint is the hash of the description alone, the same as the trainer's hash
    /// of a float32 layout: a native peer and a PyTorch peer of one model mix.
    #[test]
    fn the_fingerprint_is_the_trainers_for_a_float32_layout() {
        let model = mlp();
        assert_eq!(model.fingerprint(), model.layout().fingerprint());
        assert_eq!(model.fingerprint().len(), 16);
        let mut bf16 = model.tensors().to_vec();
        bf16[0].dtype = ParamDtype::Bf16;
        assert_ne!(
            ModelDescription::new(bf16).unwrap().fingerprint(),
            model.fingerprint()
        );
    }

    #[test]
    fn differences_name_the_tensors_that_differ() {
        use ParamDtype::{Bf16, F32};
        let run = mlp();
        assert!(run.differences(&run).is_empty());
        let other = ModelDescription::new(vec![
            tensor("fc1.weight", &[5, 3], F32),
            tensor("fc1.bias", &[4], Bf16),
            tensor("fc2.weight", &[2, 4], F32),
            tensor("head.bias", &[2], F32),
        ])
        .unwrap();
        let found = other.differences(&run);
        assert_eq!(
            found,
            [
                "`fc1.weight` has shape [5, 3] here and [4, 3] in the run's model",
                "`fc1.bias` is bfloat16 here and float32 in the run's model",
                "`head.bias` [2] float32 is not in the run's model",
                "the run's model has `fc2.bias` [2] float32, this one does not",
            ]
        );
        let error = other.check_against(&run, "its [model]").unwrap_err();
        assert!(error.to_string().contains("fc1.weight"), "{error}");
    }

    #[test]
    fn the_same_tensors_in_another_order_differ() {
        let run = mlp();
        let mut swapped = run.tensors().to_vec();
        swapped.swap(0, 1);
        let found = ModelDescription::new(swapped).unwrap().differences(&run);
        assert_eq!(found.len(), 1);
        assert!(found[0].contains("another order"), "{found:?}");
    }

    #[test]
    fn names_are_unique_and_dtypes_are_those_exchanged() {
        let twice = vec![
            tensor("w", &[1], ParamDtype::F32),
            tensor("w", &[1], ParamDtype::F32),
        ];
        assert!(ModelDescription::new(twice).is_err());
        assert!(ModelDescription::new(Vec::new()).is_err());
        assert_eq!(
            "torch.bfloat16".parse::<ParamDtype>().unwrap(),
            ParamDtype::Bf16
        );
        let error = "float64".parse::<ParamDtype>().unwrap_err().to_string();
        assert!(error.contains("model.float()"), "{error}");
    }
}
