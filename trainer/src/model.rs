//! Model descriptions: what the config says ([`ModelSpec`]) and the layer list and parameter
//! layout it expands to ([`Architecture`]). Nothing here owns memory; see
//! [`crate::replica::Replica`] for the buffers.

use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use rand_distr::{Distribution, Uniform};
use serde::{Deserialize, Serialize};

use crate::backend::{ConvGeometry, PoolGeometry};
use crate::data::text::BYTE_VOCAB;
use crate::gpt::{GptSpec, GptSpecError};
use crate::layers::Layer;
use crate::params::ParamLayout;

/// Side of the square, single-channel images every model takes (Fashion-MNIST).
pub const IMAGE_SIDE: usize = 28;
/// Values in one input image.
pub const INPUT_LEN: usize = IMAGE_SIDE * IMAGE_SIDE;
/// Number of classes every model predicts.
pub const CLASSES: usize = 10;

/// Which family of model to build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// Fully connected: `784 -> hidden... -> 10` with ReLU between.
    Mlp,
    /// Convolutional: `[conv3x3 -> relu -> maxpool2]` per entry of `channels`, then the MLP head.
    Cnn,
    /// A decoder-only transformer language model over bytes (see [`crate::gpt`]).
    Gpt,
}

/// The `[model]` table of a run config.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub kind: ModelKind,
    /// Widths of the hidden fully connected layers. Default: `[256, 128]` for `mlp`, `[128]`
    /// for `cnn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hidden: Option<Vec<usize>>,
    /// Output channels of each convolution block (`cnn` only). Default: `[32, 64]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channels: Option<Vec<usize>>,
    /// Transformer blocks (`gpt` only). Default: 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    /// Attention heads per block (`gpt` only); they split `width` evenly. Default: 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<usize>,
    /// Values per token in the residual stream (`gpt` only). Default: 128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<usize>,
    /// The longest sequence the model reads, in tokens (`gpt` only). Default: 64.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<usize>,
}

/// Why a model spec cannot be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    #[error("model.{key}: {problem}")]
    Invalid { key: &'static str, problem: String },
    #[error(transparent)]
    Gpt(#[from] GptSpecError),
}

impl ModelSpec {
    fn of_kind(kind: ModelKind) -> Self {
        ModelSpec {
            kind,
            hidden: None,
            channels: None,
            layers: None,
            heads: None,
            width: None,
            context: None,
        }
    }

    pub fn mlp() -> Self {
        Self::of_kind(ModelKind::Mlp)
    }

    pub fn cnn() -> Self {
        Self::of_kind(ModelKind::Cnn)
    }

    /// nanoGPT's CPU configuration: 4 layers, 4 heads, width 128, context 64.
    pub fn gpt() -> Self {
        Self::of_kind(ModelKind::Gpt)
    }

    /// Expands the spec into the model it describes.
    pub fn expand(&self) -> Result<Model, ModelError> {
        match self.kind {
            ModelKind::Gpt => self.gpt_spec().map(Model::Gpt),
            ModelKind::Mlp | ModelKind::Cnn => self.build().map(Model::Layers),
        }
    }

    /// The GPT a `gpt` spec describes, its vocabulary the 256 byte values.
    fn gpt_spec(&self) -> Result<GptSpec, ModelError> {
        for (key, given) in [
            ("hidden", self.hidden.is_some()),
            ("channels", self.channels.is_some()),
        ] {
            if given {
                return Err(ModelError::Invalid {
                    key,
                    problem: "a `gpt` has no such key; remove it (its shape is `layers`, \
                              `heads`, `width` and `context`)"
                        .into(),
                });
            }
        }
        let spec = GptSpec {
            layers: self.layers.unwrap_or(4),
            heads: self.heads.unwrap_or(4),
            width: self.width.unwrap_or(128),
            context: self.context.unwrap_or(64),
            vocab: BYTE_VOCAB,
        };
        spec.validate()?;
        Ok(spec)
    }

    pub fn hidden(&self) -> Vec<usize> {
        self.hidden.clone().unwrap_or_else(|| match self.kind {
            ModelKind::Mlp => vec![256, 128],
            ModelKind::Cnn | ModelKind::Gpt => vec![128],
        })
    }

    pub fn channels(&self) -> Vec<usize> {
        self.channels.clone().unwrap_or_else(|| vec![32, 64])
    }

    /// Expands an image classifier's spec (`mlp`, `cnn`) into layers and a parameter layout.
    pub fn build(&self) -> Result<Architecture, ModelError> {
        if self.kind == ModelKind::Gpt {
            return Err(ModelError::Invalid {
                key: "kind",
                problem: "a `gpt` is not a stack of layers: build it with `network`".into(),
            });
        }
        for (key, given) in [
            ("layers", self.layers.is_some()),
            ("heads", self.heads.is_some()),
            ("width", self.width.is_some()),
            ("context", self.context.is_some()),
        ] {
            if given {
                return Err(ModelError::Invalid {
                    key,
                    problem: "only a `gpt` has this key; remove it".into(),
                });
            }
        }
        let hidden = self.hidden();
        if hidden.contains(&0) {
            return Err(ModelError::Invalid {
                key: "hidden",
                problem: "every layer width must be at least 1".into(),
            });
        }
        let mut arch = Architecture::default();
        let mut features = INPUT_LEN;
        match self.kind {
            ModelKind::Gpt => unreachable!("refused above"),
            ModelKind::Mlp => {
                if self.channels.is_some() {
                    return Err(ModelError::Invalid {
                        key: "channels",
                        problem: "only a `cnn` has convolution channels; remove the key".into(),
                    });
                }
            }
            ModelKind::Cnn => {
                let channels = self.channels();
                if channels.is_empty() || channels.len() > 4 || channels.contains(&0) {
                    return Err(ModelError::Invalid {
                        key: "channels",
                        problem: "give 1 to 4 convolution blocks, each with at least 1 channel"
                            .into(),
                    });
                }
                let (mut c, mut side) = (1, IMAGE_SIDE);
                for (i, &out) in channels.iter().enumerate() {
                    if side < 2 {
                        return Err(ModelError::Invalid {
                            key: "channels",
                            problem: format!("{} blocks pool a 28x28 image away", channels.len()),
                        });
                    }
                    let geometry = ConvGeometry {
                        channels: c,
                        height: side,
                        width: side,
                        kernel: 3,
                        stride: 1,
                        padding: 1,
                    };
                    arch.push_conv(&format!("conv{}", i + 1), geometry, out);
                    arch.push(Layer::Relu {
                        len: out * side * side,
                    });
                    arch.push(Layer::MaxPool2d {
                        channels: out,
                        geometry: PoolGeometry {
                            height: side,
                            width: side,
                            window: 2,
                        },
                    });
                    c = out;
                    side /= 2;
                }
                features = c * side * side;
                arch.push(Layer::Flatten { len: features });
            }
        }
        for (i, &width) in hidden.iter().chain(&[CLASSES]).enumerate() {
            if i > 0 {
                arch.push(Layer::Relu { len: features });
            }
            arch.push_linear(&format!("fc{}", i + 1), features, width);
            features = width;
        }
        Ok(arch)
    }
}

/// What a [`ModelSpec`] expands to: a stack of layers (the image classifiers) or a GPT.
#[derive(Clone, Debug)]
pub enum Model {
    Layers(Architecture),
    Gpt(GptSpec),
}

impl Model {
    /// Tokens per sample of a language model; `None` for an image model.
    pub fn context(&self) -> Option<usize> {
        match self {
            Model::Layers(_) => None,
            Model::Gpt(spec) => Some(spec.context),
        }
    }

    /// Every tensor's name, shape and place in the flat parameter buffer.
    pub fn layout(&self) -> ParamLayout {
        match self {
            Model::Layers(arch) => arch.layout().clone(),
            Model::Gpt(spec) => spec.layout(),
        }
    }

    /// Initial parameters; the same seed always gives the same values.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        match self {
            Model::Layers(arch) => arch.init_params(seed),
            Model::Gpt(spec) => spec.init_params(seed),
        }
    }

    /// Floating-point operations of one training step on `batch` samples (sequences of the
    /// full context for a GPT), counting GEMMs only.
    pub fn train_step_flops(&self, batch: usize) -> u64 {
        match self {
            Model::Layers(arch) => arch.train_step_flops(batch),
            Model::Gpt(spec) => spec.train_step_flops(batch),
        }
    }

    /// A short hash of the parameter layout ([`ParamLayout::fingerprint`]): two replicas can
    /// average their buffers only if their fingerprints match.
    pub fn fingerprint(&self) -> String {
        self.layout().fingerprint()
    }
}

/// A model's layers in order, with their parameters' places in the flat buffer.
#[derive(Clone, Debug, Default)]
pub struct Architecture {
    layers: Vec<Layer>,
    layout: ParamLayout,
}

impl Architecture {
    fn push(&mut self, layer: Layer) {
        self.layers.push(layer);
    }

    fn push_linear(&mut self, name: &str, inputs: usize, outputs: usize) {
        let weight = self
            .layout
            .push(format!("{name}.weight"), &[outputs, inputs]);
        let bias = self.layout.push(format!("{name}.bias"), &[outputs]);
        self.layers.push(Layer::Linear {
            inputs,
            outputs,
            weight,
            bias,
        });
    }

    fn push_conv(&mut self, name: &str, geometry: ConvGeometry, out_channels: usize) {
        let weight = self.layout.push(
            format!("{name}.weight"),
            &[
                out_channels,
                geometry.channels,
                geometry.kernel,
                geometry.kernel,
            ],
        );
        let bias = self.layout.push(format!("{name}.bias"), &[out_channels]);
        self.layers.push(Layer::Conv2d {
            geometry,
            out_channels,
            weight,
            bias,
        });
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    pub fn param_count(&self) -> usize {
        self.layout.len()
    }

    /// Values per sample entering the first layer.
    pub fn input_len(&self) -> usize {
        INPUT_LEN
    }

    /// Values per sample leaving the last layer.
    pub fn output_len(&self) -> usize {
        self.layers.last().map_or(INPUT_LEN, Layer::output_len)
    }

    /// Initial parameters, PyTorch's default for linear and convolution layers: weights and
    /// biases uniform in `±1/sqrt(fan_in)`. The same seed always gives the same values.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut params = vec![0.0f32; self.layout.len()];
        for layer in &self.layers {
            if let Some((weight, bias, fan_in)) = layer.param_ranges() {
                let bound = 1.0 / (fan_in as f32).sqrt();
                let dist = Uniform::new_inclusive(-bound, bound)
                    .expect("invariant: 1/sqrt(fan_in) is finite and positive");
                for v in &mut params[weight] {
                    *v = dist.sample(&mut rng);
                }
                for v in &mut params[bias] {
                    *v = dist.sample(&mut rng);
                }
            }
        }
        params
    }

    /// Floating-point operations of one training step (forward, backward) on `batch` samples,
    /// counting GEMMs only: they are where the time goes.
    pub fn train_step_flops(&self, batch: usize) -> u64 {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| l.gemm_flops(batch, i > 0))
            .sum()
    }

    /// A short hash of the parameter layout ([`ParamLayout::fingerprint`]): two replicas can
    /// average their buffers only if their fingerprints match.
    pub fn fingerprint(&self) -> String {
        self.layout.fingerprint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_mlp_is_784_256_128_10() {
        let arch = ModelSpec::mlp().build().unwrap();
        let names: Vec<_> = arch
            .layout()
            .entries()
            .iter()
            .map(|e| e.name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias",
                "fc3.weight",
                "fc3.bias"
            ]
        );
        assert_eq!(
            arch.param_count(),
            784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10
        );
        assert_eq!(arch.layout().get("fc2.weight").unwrap().shape, [128, 256]);
        assert_eq!(arch.output_len(), 10);
    }

    #[test]
    fn default_cnn_has_two_conv_blocks_and_two_linear_layers() {
        let arch = ModelSpec::cnn().build().unwrap();
        assert_eq!(
            arch.layout().get("conv2.weight").unwrap().shape,
            [64, 32, 3, 3]
        );
        assert_eq!(
            arch.layout().get("fc1.weight").unwrap().shape,
            [128, 64 * 7 * 7]
        );
        assert_eq!(arch.layout().get("fc2.weight").unwrap().shape, [10, 128]);
        assert!(arch.layout().get("fc3.weight").is_none());
    }

    #[test]
    fn bad_specs_are_rejected_with_the_key() {
        let spec = ModelSpec {
            hidden: Some(vec![0]),
            ..ModelSpec::mlp()
        };
        assert!(
            spec.build()
                .unwrap_err()
                .to_string()
                .contains("model.hidden")
        );
        let spec = ModelSpec {
            channels: Some(vec![8]),
            ..ModelSpec::mlp()
        };
        assert!(
            spec.build()
                .unwrap_err()
                .to_string()
                .contains("model.channels")
        );
        let spec = ModelSpec {
            channels: Some(vec![4; 5]),
            ..ModelSpec::cnn()
        };
        assert!(spec.build().is_err());
    }

    #[test]
    fn init_is_deterministic_and_bounded() {
        let arch = ModelSpec::mlp().build().unwrap();
        let a = arch.init_params(7);
        assert_eq!(a, arch.init_params(7));
        assert_ne!(a, arch.init_params(8));
        let bound = 1.0 / 784f32.sqrt();
        assert!(
            a[arch.layout().get("fc1.weight").unwrap().range()]
                .iter()
                .all(|v| v.abs() <= bound)
        );
    }

    #[test]
    fn fingerprint_tells_architectures_apart() {
        let mlp = ModelSpec::mlp().build().unwrap().fingerprint();
        let wide = ModelSpec {
            hidden: Some(vec![512]),
            ..ModelSpec::mlp()
        };
        assert_eq!(mlp, ModelSpec::mlp().build().unwrap().fingerprint());
        assert_ne!(mlp, wide.build().unwrap().fingerprint());
        assert_eq!(mlp.len(), 16);
    }
}
