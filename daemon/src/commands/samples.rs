//! The samples a run's model trains and is judged on, from the config's `[data]`: the images
//! of Fashion-MNIST for the image models, a directory of text for a `gpt`.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use murmur_trainer::data::text::{Corpus, DEFAULT_VALIDATION_SHARE, Windows};
use murmur_trainer::data::{Dataset, Samples, ShardInfo, Split, TextSamples};

use crate::config::RunConfig;

/// Held-out windows a language model is judged on: at most this many, spread evenly over
/// the last tenth of every document of `data.dir`.
pub(super) const HELD_OUT_WINDOWS: usize = 512;

/// The training samples (the shard's, else `data.dir`'s) and the test samples of `config`.
///
/// For text, `data.dir` is the whole corpus: each document keeps its last tenth for the
/// held-out windows. A shard written by `nodectl shard` holds training text only, so all of
/// it is trained on; without a shard the first nine tenths of every document are.
pub(super) fn load(config: &RunConfig) -> Result<(Samples, Samples)> {
    let dir = &config.data.dir;
    let train_dir = config.data.shard.as_deref().unwrap_or(dir);
    let Some(context) = config.native()?.0.expand()?.context() else {
        let train = Dataset::load(train_dir, Split::Train).context("training data")?;
        let test = Dataset::load(dir, Split::Test).context("test data")?;
        return Ok((Samples::Images(train), Samples::Images(test)));
    };
    let window = context + 1;
    let corpus = Arc::new(Corpus::load(dir).context("the text corpus")?);
    let train = match &config.data.shard {
        Some(shard) => {
            let own = Arc::new(Corpus::load(shard).context("the shard's text")?);
            let windows = Windows::every_token(own.train_ranges(held_out_share(shard)?), window);
            TextSamples::new(own, windows)
        }
        None => {
            let ranges = corpus.train_ranges(DEFAULT_VALIDATION_SHARE);
            TextSamples::new(corpus.clone(), Windows::every_token(ranges, window))
        }
    };
    let held_out = Windows::held_out(
        corpus.validation_ranges(DEFAULT_VALIDATION_SHARE),
        window,
        HELD_OUT_WINDOWS,
    );
    let test = TextSamples::of_windows(corpus, held_out, window);
    Ok((Samples::Text(train), Samples::Text(test)))
}

/// The share of each document of a text directory held out from training: none in a shard
/// (`nodectl shard` wrote the training text only), else the usual tenth.
fn held_out_share(dir: &Path) -> Result<f64> {
    Ok(match ShardInfo::read(dir)? {
        Some(_) => 0.0,
        None => DEFAULT_VALIDATION_SHARE,
    })
}
