//! `nodectl sample`: text a language model writes from a checkpoint.

use std::io::Write as _;

use anyhow::{Result, bail};
use murmur_trainer::Backend;
use murmur_trainer::checkpoint;
use murmur_trainer::data::text;
use murmur_trainer::gpt::{GptReplica, GptSpec, Sampling};
use murmur_trainer::model::Model;
use rand::SeedableRng;
use rand::rngs::ChaCha8Rng;
use serde_json::json;

use crate::cli::SampleArgs;
use crate::config::RunConfig;
use crate::device::{on_backend, select_backend};

pub(super) fn run(args: &SampleArgs) -> Result<()> {
    let config = RunConfig::load(&args.config)?;
    let Model::Gpt(spec) = config.native()?.0.expand()? else {
        bail!(
            "`{}` trains an image model, which writes no text: pass a config with \
             `[model] kind = \"gpt\"`",
            args.config.display()
        );
    };
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        bail!("--temperature must be a positive number");
    }
    let path = match &args.path {
        Some(path) => super::evaluate::resolve(path)?,
        None => super::evaluate::resolve(&config.checkpoint_dir())?,
    };
    let backend = select_backend(config.training.device, config.threads())?;
    on_backend!(backend, backend => sample_on(args, spec, &path, backend))
}

/// Writes the sample on `backend`.
fn sample_on<B: Backend>(
    args: &SampleArgs,
    spec: GptSpec,
    path: &std::path::Path,
    backend: B,
) -> Result<()> {
    let saved = checkpoint::load(path, &spec.layout(), &Model::Gpt(spec).fingerprint())?;
    let mut model = GptReplica::new(&backend, spec, 1, &saved.params)?;
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: (args.top_k > 0).then_some(args.top_k),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let prompt = text::encode(&args.prompt);
    let tokens = model.generate(&backend, &prompt, args.tokens, sampling, &mut rng)?;
    let written = text::decode(&tokens);
    if args.json {
        println!(
            "{}",
            json!({
                "checkpoint": path,
                "step": saved.step,
                "prompt": args.prompt,
                "text": written,
            })
        );
        return Ok(());
    }
    eprintln!("{} (step {})", path.display(), saved.step);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}{written}", args.prompt)?;
    Ok(())
}
