//! Murmur's local trainer: everything one peer needs to train its replica, and nothing about
//! the network.
//!
//! - [`backend`]: the [`Backend`] trait (device buffers and kernels) and its CPU implementation.
//! - [`model`], [`layers`], [`params`]: a [`ModelSpec`] expands into an [`model::Architecture`],
//!   a list of [`layers::Layer`]s whose parameters are named ranges of one flat buffer.
//! - [`replica`]: a replica's device buffers and the forward and backward passes.
//! - [`optim`]: SGD and AdamW with learning-rate schedules.
//! - [`data`]: IDX files, Fashion-MNIST and synthetic datasets, text, per-peer shards.
//! - [`gpt`]: a decoder-only transformer language model and its passes; the [`Trainer`]
//!   trains it on windows of text as it trains the image models on images.
//! - [`train`]: the [`Trainer`] loop that ties these together, deterministic under a seed.
//! - [`checkpoint`]: safetensors checkpoints written atomically, for bit-exact resume.
//! - [`mod@bench`]: throughput of the real training step.
//!
//! Data flow of one step (an image model's; a GPT's is alike): the [`Trainer`] picks the
//! step's batch from a seeded permutation, the [`replica::Replica`] uploads it, runs every
//! layer forward, the loss, every layer backward into the flat gradient buffer, and the
//! [`optim::Optimizer`] updates the flat parameter buffer in place.

pub mod backend;
pub mod bench;
pub mod checkpoint;
pub mod data;
pub mod gpt;
pub mod layers;
pub mod model;
pub mod optim;
pub mod params;
pub mod replica;
pub mod train;

pub use backend::{Backend, CpuBackend, CudaBackend};
pub use data::Dataset;
pub use model::ModelSpec;
pub use optim::{OptimizerSpec, OptimizerState};
pub use train::{PendingStep, TrainSpec, Trainer};
