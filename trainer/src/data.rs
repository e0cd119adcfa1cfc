//! Training data: the IDX file format, Fashion-MNIST and synthetic datasets, text for
//! language models, and the shards that each peer keeps to itself.

pub mod dataset;
pub mod idx;
pub mod shard;
pub mod text;

use std::path::PathBuf;

pub use dataset::{Dataset, Split, epoch_order};
pub use shard::{Manifest, Partition, ShardError, ShardInfo};
pub use text::TextSamples;

/// What a model trains or is judged on: labelled images for the classifiers, windows of text
/// for a language model.
#[derive(Clone, Debug)]
pub enum Samples {
    Images(Dataset),
    Text(TextSamples),
}

impl Samples {
    pub fn len(&self) -> usize {
        match self {
            Samples::Images(data) => data.len(),
            Samples::Text(text) => text.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the samples are, for messages.
    pub fn describe(&self) -> &'static str {
        match self {
            Samples::Images(_) => "images",
            Samples::Text(_) => "text",
        }
    }
}

/// Where the Debian package `dataset-fashion-mnist` installs the data.
pub const DEFAULT_DATA_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// Why a dataset could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    #[error(
        "dataset directory `{}` does not exist: install Fashion-MNIST with \
         `apt-get install dataset-fashion-mnist`, or pass `--data DIR` with its IDX files",
        dir.display()
    )]
    MissingDir { dir: PathBuf },
    #[error(
        "`{}` has no `{name}` or `{name}.gz`: point `--data` at a directory with the \
         Fashion-MNIST IDX files (`apt-get install dataset-fashion-mnist` puts them in {})",
        dir.display(), DEFAULT_DATA_DIR
    )]
    MissingFile { dir: PathBuf, name: String },
    #[error(
        "`{}` holds no text: install the Shakespeare corpus with `data/fetch-shakespeare.sh`, \
         or point `--data` at a directory of `.txt` files, one per document",
        dir.display()
    )]
    MissingText { dir: PathBuf },
    #[error("cannot read `{}`: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "`{}` is not an IDX file of bytes (magic number 0x{found:08x}, expected 0x{expected:08x}): \
         the file is damaged or of another format; reinstall it or point `--data` elsewhere",
        path.display()
    )]
    BadMagic {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error(
        "`{}` is truncated: its header promises {expected} bytes but {actual} follow; \
         the file is damaged, reinstall it or point `--data` elsewhere",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("`{}` is corrupt: {reason}; reinstall it or point `--data` elsewhere", path.display())]
    Corrupt { path: PathBuf, reason: String },
}
