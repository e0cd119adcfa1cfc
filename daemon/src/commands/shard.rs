//! `nodectl shard`: one shard per peer plus a manifest; `nodectl dataset synthetic`.

use anyhow::{Context, Result};
use murmur_trainer::data::shard::{write_shards, write_text_shards};
use murmur_trainer::data::text::{self, Corpus, TextPartition};
use murmur_trainer::data::{Dataset, Partition, Split};

use crate::cli::ShardArgs;

pub(super) fn run(args: ShardArgs) -> Result<()> {
    let source = args.data.display().to_string();
    let manifest = if text::holds_text(&args.data) {
        let partition: TextPartition = args.partition.parse()?;
        let corpus = Corpus::load(&args.data)?;
        write_text_shards(
            &corpus, &source, args.peers, partition, args.seed, &args.out, args.force,
        )
    } else {
        let partition: Partition = args.partition.parse()?;
        let data = Dataset::load(&args.data, Split::Train)?;
        write_shards(
            &data, &source, args.peers, partition, args.seed, &args.out, args.force,
        )
    }
    .context("writing shards")?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&manifest)?);
        return Ok(());
    }
    println!(
        "wrote {} shards of {} ({}, seed {}) to {}",
        manifest.peers,
        args.data.display(),
        manifest.partition,
        manifest.seed,
        args.out.display()
    );
    if manifest.shards.iter().all(|s| s.label_counts.is_none()) {
        println!("{:<10} {:>9}", "shard", "tokens");
        for s in &manifest.shards {
            println!("{:<10} {:>9}", s.dir, s.samples);
        }
    } else {
        println!("{:<10} {:>8}  samples per label 0..9", "shard", "samples");
        for s in &manifest.shards {
            let counts: Vec<String> = s
                .label_counts
                .iter()
                .flatten()
                .map(|c| format!("{c:>5}"))
                .collect();
            println!("{:<10} {:>8}  {}", s.dir, s.samples, counts.join(" "));
        }
    }
    if manifest.unassigned_samples > 0 {
        println!(
            "note: {} samples carry labels no shard holds; use more peers or a larger K",
            manifest.unassigned_samples
        );
    }
    Ok(())
}

/// Writes a synthetic train and test split to `out`.
pub(super) fn synthetic(out: &std::path::Path, train: usize, test: usize, seed: u64) -> Result<()> {
    if train == 0 || test == 0 {
        anyhow::bail!("--train and --test must be at least 1 sample");
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create `{}`", out.display()))?;
    // Distinct seeds, shared prototypes: the test split is held-out data of the same task.
    for (split, samples, split_seed) in [
        (Split::Train, train, seed),
        (Split::Test, test, seed ^ 0x7e57),
    ] {
        Dataset::synthetic(samples, split_seed)
            .write_split(out, split)
            .with_context(|| {
                format!("cannot write the synthetic dataset to `{}`", out.display())
            })?;
    }
    println!(
        "wrote {train} training and {test} test samples to {}",
        out.display()
    );
    Ok(())
}
