use super::*;

const MINIMAL: &str = r#"
[model]
kind = "mlp"

[optimizer]
kind = "sgd"
lr = 0.05
momentum = 0.9

[training]
epochs = 2
batch_size = 64
"#;

fn parse(text: &str) -> Result<RunConfig> {
    RunConfig::parse(Path::new("test.toml"), text)
}

#[test]
fn minimal_config_gets_defaults() {
    let c = parse(MINIMAL).unwrap();
    assert_eq!(c.data.dir, Path::new(DEFAULT_DATA_DIR));
    assert_eq!(c.checkpoint.keep, 3);
    assert_eq!(c.training.device, Device::Auto);
    assert_eq!(c.checkpoint_dir(), Path::new("runs/run/checkpoints"));
}

#[test]
fn unknown_key_names_the_key_and_line() {
    let text = MINIMAL.replace("momentum = 0.9", "momentum = 0.9\nmomentun = 0.8");
    let err = format!("{:#}", parse(&text).unwrap_err());
    assert!(err.contains("unknown field `momentun`"), "{err}");
    assert!(err.contains("test.toml:9:1"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
}

#[test]
fn wrong_type_names_the_expected_type() {
    let text = MINIMAL.replace("epochs = 2", "epochs = \"two\"");
    let err = format!("{:#}", parse(&text).unwrap_err());
    assert!(err.contains("invalid type: string \"two\""), "{err}");
    assert!(err.contains("test.toml:11:10"), "{err}");
    assert!(!err.contains('\n'), "one line: {err}");
}

#[test]
fn invalid_values_name_the_key() {
    for (from, to, key) in [
        ("epochs = 2", "epochs = 0", "training.epochs"),
        ("lr = 0.05", "lr = -1.0", "optimizer.lr"),
        (
            "kind = \"mlp\"",
            "kind = \"mlp\"\nhidden = [0]",
            "model.hidden",
        ),
        (
            "batch_size = 64",
            "batch_size = 64\nthreads = 0",
            "training.threads",
        ),
        (
            "batch_size = 64",
            "batch_size = 64\nepoch_samples = 0",
            "training.epoch_samples",
        ),
    ] {
        let err = format!("{:#}", parse(&MINIMAL.replace(from, to)).unwrap_err());
        assert!(err.contains(key), "{key}: {err}");
    }
}

#[test]
fn sync_values_out_of_range_name_the_key() {
    let gossip = format!("{MINIMAL}\n[sync]\nmode = \"gossip\"\n");
    for (extra, key) in [
        ("max_merge_lag = 0", "sync.max_merge_lag"),
        ("outer_lr = 0.0", "sync.outer_lr"),
        ("outer_momentum = 1.0", "sync.outer_momentum"),
    ] {
        let err = format!("{:#}", parse(&format!("{gossip}{extra}\n")).unwrap_err());
        assert!(err.contains(key), "{key}: {err}");
    }
    let nesterov = "outer = \"nesterov\"\n";
    parse(&format!("{gossip}{nesterov}")).expect("gossip takes an outer step");
    let ring = gossip.replace("gossip", "allreduce");
    let err = format!("{:#}", parse(&format!("{ring}{nesterov}")).unwrap_err());
    assert!(err.contains("sync.allreduce.outer"), "{err}");
}

/// Quasi-global momentum goes where it was measured to help: gossip every few steps.
#[test]
fn quasi_global_momentum_is_refused_where_it_diverged() {
    let qg = MINIMAL.replace("momentum = 0.9\n", "momentum = 0.9\nquasi_global = true\n");
    // The default interval, 8 steps.
    let gossip = format!("{qg}\n[sync]\nmode = \"gossip\"\n");
    parse(&gossip).expect("gossip every 8 steps takes quasi-global momentum");
    // Rarer mixes count at a share (decision 0035).
    parse(&format!("{gossip}interval = 48\nadapt_interval = true\n"))
        .expect("rare and stretched mixes take quasi-global momentum");
    for (extra, named) in [
        ("outer = \"nesterov\"", "sync.outer"),
        ("codec = \"topk\"", "sync.codec"),
        ("codec = \"int8\"\nadapt_codec = true", "sync.adapt_codec"),
    ] {
        let err = format!("{:#}", parse(&format!("{gossip}{extra}\n")).unwrap_err());
        assert!(
            err.contains(named) && err.contains("0023"),
            "{extra}: {err}"
        );
    }
    let elastic = gossip.replace("\"gossip\"", "\"elastic\"");
    let err = format!("{:#}", parse(&elastic).unwrap_err());
    assert!(err.contains("optimizer.quasi_global"), "{err}");
}

#[test]
fn adapt_codec_needs_a_dense_compressed_codec_to_switch_from_and_pairwise_exchanges() {
    let gossip = format!("{MINIMAL}\n[sync]\nmode = \"gossip\"\nadapt_codec = true\n");
    parse(&format!("{gossip}codec = \"int8\"\n")).expect("int8 on fast links, top-k on slow");
    parse(&format!("{gossip}codec = \"bf16\"\n")).expect("bf16 on fast links, top-k on slow");
    parse(&format!("{gossip}codec = \"int4\"\n")).expect("int4 on fast links, top-k on slow");
    for codec in ["f32", "topk"] {
        let err = parse(&format!("{gossip}codec = \"{codec}\"\n")).unwrap_err();
        let err = format!("{err:#}");
        assert!(err.contains("sync.codec = \"int8\""), "{codec}: {err}");
    }
    let ring = gossip.replace("\"gossip\"", "\"allreduce\"");
    let err = format!(
        "{:#}",
        parse(&format!("{ring}codec = \"int8\"\n")).unwrap_err()
    );
    assert!(
        err.contains("sync.adapt_codec applies to pairwise"),
        "{err}"
    );
}

/// A mode's own settings in a run of another mode are refused with the setting and the mode
/// named, not ignored (decision 0076).
#[test]
fn settings_of_another_mode_are_named() {
    let run =
        |mode: &str, extra: &str| parse(&format!("{MINIMAL}\n[sync]\nmode = \"{mode}\"\n{extra}"));
    for (mode, extra, named) in [
        ("gossip", "[sync.elastic]\nalpha = 0.5\n", "[sync.elastic]"),
        (
            "solo",
            "[sync.elastic]\nelection = \"open\"\n",
            "[sync.elastic]",
        ),
        (
            "allreduce",
            "[sync.elastic]\ntopology = \"gossip\"\n",
            "[sync.elastic]",
        ),
        (
            "gossip",
            "[sync.allreduce]\nevery = 4\n",
            "[sync.allreduce]",
        ),
        (
            "elastic",
            "[sync.allreduce]\nplane = \"libp2p\"\n",
            "[sync.allreduce]",
        ),
        ("allreduce", "codec = \"int4\"\n", "sync.codec"),
        ("solo", "codec = \"int8\"\n", "sync.codec"),
        (
            "allreduce",
            "adapt_interval = true\n",
            "sync.adapt_interval",
        ),
    ] {
        let err = format!("{:#}", run(mode, extra).unwrap_err());
        assert!(
            err.contains(named) && err.contains(&format!("sync.mode is \"{mode}\"")),
            "{mode} with {extra:?}: {err}"
        );
    }
    for (mode, extra) in [
        ("elastic", "[sync.elastic]\nalpha = 0.5\n"),
        ("allreduce", "[sync.allreduce]\nevery = 4\n"),
        ("gossip", "codec = \"int4\"\nadapt_interval = true\n"),
        (
            "elastic",
            "codec = \"int8\"\n[sync.elastic]\ntopology = \"gossip\"\n",
        ),
        // Written out at their defaults, another mode's settings change nothing.
        (
            "gossip",
            "codec = \"f32\"\n[sync.elastic]\nelection = \"trusted\"\n",
        ),
    ] {
        run(mode, extra).unwrap_or_else(|e| panic!("{mode} with {extra:?}: {e:#}"));
    }
}

#[test]
fn missing_table_is_named() {
    let text = MINIMAL.replace("[training]\nepochs = 2\nbatch_size = 64\n", "");
    let err = format!("{:#}", parse(&text).unwrap_err());
    assert!(err.contains("missing field `training`"), "{err}");
}

#[test]
fn every_shipped_config_parses() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (dir, at_least) in [("configs", 2), ("examples/pytorch", 3)] {
        let dir = root.join(dir);
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                RunConfig::load(&path).unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                seen += 1;
            }
        }
        assert!(
            seen >= at_least,
            "expected the shipped configs in {}",
            dir.display()
        );
    }
}

/// A run whose peers bring their own model has no [model] nor [optimizer]; `data.kind` says
/// what its data is. Murmur's own trainer refuses such a run with what to do.
#[test]
fn a_run_of_peers_that_bring_their_own_model_needs_no_model() {
    let text = "[training]\nepochs = 2\nbatch_size = 8\n[data]\nkind = \"text\"\n";
    let config = parse(text).unwrap();
    assert!(config.reads_text());
    assert_eq!(config.data.dir, text::default_corpus_dir());
    let error = config.train_spec().unwrap_err().to_string();
    assert!(
        error.contains("has no [model]") && error.contains("murmur.join"),
        "{error}"
    );
    let images = parse("[training]\nepochs = 2\nbatch_size = 8\n").unwrap();
    assert!(!images.reads_text());
    assert_eq!(images.data.dir, Path::new(DEFAULT_DATA_DIR));
    // With a model, the model says what it reads.
    let wrong = format!("{MINIMAL}[data]\nkind = \"text\"\n");
    let error = format!("{:#}", parse(&wrong).unwrap_err());
    assert!(error.contains("data.kind"), "{error}");
}

#[test]
fn a_shard_sets_the_epoch_unless_the_config_does() {
    let data = murmur_trainer::Dataset::synthetic(90, 1);
    let out = tempfile::tempdir().unwrap();
    let partition = murmur_trainer::data::Partition::Dirichlet { alpha: 0.5 };
    let manifest = murmur_trainer::data::shard::write_shards(
        &data,
        "synthetic",
        4,
        partition,
        1,
        out.path(),
        false,
    )
    .unwrap();
    let shard = out.path().join(&manifest.shards[0].dir);
    let mut config = parse(MINIMAL).unwrap();
    assert_eq!(
        config.train_spec_for(out.path()).unwrap().epoch_samples,
        None
    );
    assert_eq!(
        config.train_spec_for(&shard).unwrap().epoch_samples,
        Some(23)
    );
    config.training.epoch_samples = Some(40);
    assert_eq!(
        config.train_spec_for(&shard).unwrap().epoch_samples,
        Some(40)
    );
}
