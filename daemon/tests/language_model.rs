//! A GPT through `nodectl` end to end, on the public-domain Shakespeare excerpts kept in the
//! repository: a config with `[model] kind = "gpt"` trains on text and reports its validation
//! loss, `nodectl sample` writes text from its checkpoint, `nodectl shard` deals text, and two
//! daemons train one GPT together by gossip.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::path::{Path, PathBuf};

use common::{Daemon, RUN_DEADLINE, json, run, wait_until_within};
use serde_json::Value;

/// The Hamlet and Sonnets excerpts.
fn excerpts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../trainer/testdata/shakespeare")
}

/// A run config of a tiny GPT over `data`, checkpointing into `work/checkpoints`, with `sync`
/// as its `[sync]` table.
fn gpt_config(work: &Path, data: &Path, epochs: u64, sync: &str) -> PathBuf {
    let path = work.join("run.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[run]
name = "gpt-test"
seed = 5

[model]
kind = "gpt"
layers = 1
heads = 2
width = 32
context = 32

[optimizer]
kind = "adamw"
lr = 1e-2
weight_decay = 0.1
grad_clip = 1.0

[training]
epochs = {epochs}
batch_size = 8
epoch_samples = 800

[data]
dir = "{}"

[checkpoint]
dir = "{}"

[sync]
{sync}
"#,
            data.display(),
            work.join("checkpoints").display()
        ),
    )
    .unwrap();
    path
}

fn sample(config: &Path, seed: &str) -> Value {
    json(&[
        "sample",
        "--config",
        config.to_str().unwrap(),
        "--prompt",
        "HAMLET:",
        "--tokens",
        "60",
        "--seed",
        seed,
        "--json",
    ])
}

#[test]
fn a_gpt_trains_on_text_reports_its_validation_loss_and_writes_a_sample() {
    let work = tempfile::tempdir().unwrap();
    let config = gpt_config(work.path(), &excerpts(), 3, "");
    let report = json(&["train", "--config", config.to_str().unwrap(), "--json"]);
    assert_eq!(report["model"], "gpt");
    assert_eq!(report["steps"], 300);
    let losses: Vec<f64> = report["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["test_loss"].as_f64().unwrap())
        .collect();
    // Uniform guessing over 256 bytes is ln 256 = 5.55 nats; the excerpts' letter
    // frequencies alone give 3.2.
    assert!(losses[2] < 2.9 && losses[2] < losses[0], "{losses:?}");

    let text = sample(&config, "1");
    assert_eq!(text["step"], 300);
    let written = text["text"].as_str().unwrap();
    assert!(!written.is_empty(), "{text}");
    assert_eq!(
        sample(&config, "1"),
        text,
        "the same seed writes the same text"
    );
    assert_ne!(sample(&config, "2")["text"], text["text"]);

    // An image model writes no text, and a GPT needs its epoch length.
    let mlp = work.path().join("mlp.toml");
    std::fs::write(
        &mlp,
        "[model]\nkind = \"mlp\"\n[optimizer]\nkind = \"sgd\"\nlr = 0.1\n\
                          [training]\nepochs = 1\nbatch_size = 8\n",
    )
    .unwrap();
    let out = run(&["sample", "--config", mlp.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("kind = \"gpt\""),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("epoch_samples = 800\n", "")).unwrap();
    let out = run(&["config", "validate", config.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("epoch_samples"),
        "{stderr}"
    );
}

#[test]
fn text_shards_train_two_daemons_by_gossip_to_a_lower_validation_loss() {
    let work = tempfile::tempdir().unwrap();
    let shards = work.path().join("shards");
    let manifest = json(&[
        "shard",
        "--data",
        excerpts().to_str().unwrap(),
        "--peers",
        "2",
        "--partition",
        "iid",
        "--out",
        shards.to_str().unwrap(),
        "--json",
    ]);
    let tokens: Vec<u64> = manifest["shards"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["samples"].as_u64().unwrap())
        .collect();
    assert!(tokens.iter().all(|&t| t > 0), "{manifest}");

    // A run longer than the test: the first daemon trains alone until the second has joined,
    // however long that takes on a loaded machine, and the test stops both once they mixed.
    gpt_config(
        work.path(),
        &excerpts(),
        1000,
        "mode = \"gossip\"\ninterval = 10\ncodec = \"int8\"\noverlap = true",
    );
    let shard = |i: usize| shards.join(format!("shard-{i:03}"));
    let a = Daemon::start(work.path(), "a", &["--shard", shard(0).to_str().unwrap()]);
    let bootstrap = a.join_address();
    let b = Daemon::start(
        work.path(),
        "b",
        &[
            "--shard",
            shard(1).to_str().unwrap(),
            "--bootstrap",
            &bootstrap,
        ],
    );
    for name in ["a", "b"] {
        let dir = work.path().join(name);
        // Mixes applied, whether this node offered them or served them, and a validation
        // loss (taken at every epoch's end) below 3.2.
        wait_until_within(
            &dir,
            "mixes and a validation loss below 3.2",
            RUN_DEADLINE,
            |s| {
                s["sync"]["merges"].as_u64().unwrap_or(0) > 0
                    && s["test_loss"].as_f64().is_some_and(|loss| loss < 3.2)
            },
        );
    }
    b.leave(&work.path().join("b"));
    a.leave(&work.path().join("a"));
}
