//! The `nodectl` binary end to end on small synthetic datasets: training reports, determinism,
//! resume, sharding, benchmarks, and one-line errors for every kind of bad input.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use murmur_trainer::checkpoint;
use murmur_trainer::data::{Dataset, Split};
use serde_json::Value;
use tempfile::TempDir;

fn nodectl(args: &[&str]) -> Output {
    common::output_within(
        Command::new(env!("CARGO_BIN_EXE_nodectl"))
            .args(["--log", "warn"])
            .args(args),
        &format!("`nodectl {}`", args.join(" ")),
    )
}

fn stdout_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "nodectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Asserts a clean failure: non-zero exit, exactly one `error:` line on stderr that contains
/// every `needle`, and no panic.
fn assert_one_line_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "`{needle}` missing from: {stderr}"
        );
    }
}

/// A dataset directory with synthetic train and test splits.
fn data_dir(train: usize, test: usize) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    Dataset::synthetic(train, 1)
        .write_split(dir.path(), Split::Train)
        .unwrap();
    Dataset::synthetic(test, 2)
        .write_split(dir.path(), Split::Test)
        .unwrap();
    dir
}

/// A small MLP run config over `data`, checkpointing into `ckpt`.
fn config(dir: &Path, data: &Path, ckpt: &Path, epochs: u64) -> PathBuf {
    let path = dir.join("run.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[run]
name = "test"
seed = 3

[model]
kind = "mlp"
hidden = [32]

[optimizer]
kind = "sgd"
lr = 0.05
momentum = 0.9

[training]
epochs = {epochs}
batch_size = 32

[data]
dir = "{}"

[checkpoint]
dir = "{}"
keep = 10
"#,
            data.display(),
            ckpt.display()
        ),
    )
    .unwrap();
    path
}

fn final_params(ckpt_dir: &Path) -> Vec<u32> {
    let arch = common::mlp_architecture(32);
    let path = checkpoint::latest(ckpt_dir).unwrap().unwrap();
    let ckpt = checkpoint::load(&path, arch.layout(), &arch.fingerprint()).unwrap();
    ckpt.params.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn train_reports_json_and_learns() {
    let data = data_dir(400, 200);
    let work = tempfile::tempdir().unwrap();
    let ckpt = work.path().join("ckpt");
    let cfg = config(work.path(), data.path(), &ckpt, 2);
    let report = stdout_json(&nodectl(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--json",
    ]));
    for key in [
        "test_accuracy",
        "epochs",
        "steps",
        "samples_per_sec",
        "wall_s",
    ] {
        assert!(report.get(key).is_some(), "missing {key}: {report}");
    }
    assert_eq!(report["epochs"], 2);
    assert_eq!(report["steps"], 26); // ceil(400 / 32) * 2
    assert!(report["test_accuracy"].as_f64().unwrap() > 0.8, "{report}");
    assert_eq!(report["history"].as_array().unwrap().len(), 2);
    assert_eq!(checkpoint::list(&ckpt).unwrap().len(), 2);
}

#[test]
fn one_thread_twice_gives_bitwise_identical_parameters() {
    let data = data_dir(300, 50);
    let work = tempfile::tempdir().unwrap();
    let (a, b) = (work.path().join("a"), work.path().join("b"));
    let cfg = config(work.path(), data.path(), &a, 2);
    for dir in [&a, &b] {
        let out = nodectl(&[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--threads",
            "1",
            "--checkpoint-dir",
            dir.to_str().unwrap(),
            "--json",
        ]);
        stdout_json(&out);
    }
    assert_eq!(final_params(&a), final_params(&b));
}

/// A run of 3 epochs trained to the end, with a checkpoint per epoch (steps 10, 20, 30) in
/// `<work>/full`: the data, the work dir and the run config.
fn trained_three_epochs() -> (tempfile::TempDir, tempfile::TempDir, PathBuf) {
    let data = data_dir(300, 50);
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), data.path(), &work.path().join("full"), 3);
    stdout_json(&nodectl(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--json",
    ]));
    (data, work, cfg)
}

#[test]
fn resuming_from_a_middle_checkpoint_ends_where_an_uninterrupted_run_does() {
    let (_data, work, cfg) = trained_three_epochs();
    let full = work.path().join("full");
    let cfg = cfg.to_str().unwrap();
    let steps: Vec<u64> = checkpoint::list(&full)
        .unwrap()
        .iter()
        .map(|(s, _)| *s)
        .collect();
    assert_eq!(steps, [10, 20, 30]);

    // As if the process had been killed after epoch 1: only that checkpoint exists.
    let partial = work.path().join("partial");
    std::fs::create_dir(&partial).unwrap();
    std::fs::copy(
        full.join("step-10.safetensors"),
        partial.join("step-10.safetensors"),
    )
    .unwrap();
    let report = stdout_json(&nodectl(&[
        "train",
        "--config",
        cfg,
        "--checkpoint-dir",
        partial.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(report["resumed_from_step"], 10);
    assert_eq!(report["steps"], 30);
    assert_eq!(final_params(&full), final_params(&partial));

    // Running a finished run again trains nothing and reports the same model.
    let again = stdout_json(&nodectl(&["train", "--config", cfg, "--json"]));
    assert_eq!(again["samples"], 0);
    assert_eq!(again["resumed_from_step"], 30);

    // A different config refuses to continue these checkpoints, and says what to do.
    let out = nodectl(&["train", "--config", cfg, "--seed", "9"]);
    assert_one_line_error(&out, &["different config", "--fresh"]);
    let fresh = stdout_json(&nodectl(&[
        "train", "--config", cfg, "--seed", "9", "--fresh", "--json",
    ]));
    assert_eq!(fresh["resumed_from_step"], Value::Null);
}

#[test]
fn a_damaged_or_diverged_newest_checkpoint_is_skipped_for_an_older_one() {
    let (_data, work, cfg) = trained_three_epochs();
    let full = work.path().join("full");
    let cfg = cfg.to_str().unwrap();

    // As if the process had been killed while writing step 30 (cut short) after step 20 had
    // been saved holding a diverged replica.
    let kept = work.path().join("kept");
    std::fs::create_dir(&kept).unwrap();
    std::fs::copy(
        full.join("step-10.safetensors"),
        kept.join("step-10.safetensors"),
    )
    .unwrap();
    let arch = common::mlp_architecture(32);
    let mut diverged = checkpoint::load(
        &full.join("step-20.safetensors"),
        arch.layout(),
        &arch.fingerprint(),
    )
    .unwrap();
    diverged.params[0] = f32::NAN;
    checkpoint::save(&kept, &diverged, arch.layout(), 10).unwrap();
    let whole = std::fs::read(full.join("step-30.safetensors")).unwrap();
    std::fs::write(kept.join("step-30.safetensors"), &whole[..whole.len() / 2]).unwrap();

    let kept_dir = kept.to_str().unwrap();
    let out = nodectl(&[
        "train",
        "--config",
        cfg,
        "--checkpoint-dir",
        kept_dir,
        "--json",
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    for skipped in ["step-30.safetensors", "step-20.safetensors"] {
        assert!(said.contains(skipped), "no warning names {skipped}: {said}");
    }
    let report = stdout_json(&out);
    assert_eq!(report["resumed_from_step"], 10);
    assert_eq!(report["steps"], 30);
    assert_eq!(final_params(&full), final_params(&kept));

    // With no usable checkpoint left, it stops and says what to do rather than start over.
    let none = work.path().join("none");
    std::fs::create_dir(&none).unwrap();
    std::fs::write(none.join("step-10.safetensors"), b"not a checkpoint").unwrap();
    let out = nodectl(&[
        "train",
        "--config",
        cfg,
        "--checkpoint-dir",
        none.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started although nothing is usable: {said}"
    );
    let last = said.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("--fresh"),
        "the last line should be the error naming --fresh: {said}"
    );
    assert!(
        none.join("step-10.safetensors").exists(),
        "a damaged checkpoint is kept"
    );
}

#[test]
fn missing_dataset_says_how_to_install_it() {
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), Path::new("/no/such/dir"), work.path(), 1);
    let out = nodectl(&["train", "--config", cfg.to_str().unwrap()]);
    assert_one_line_error(
        &out,
        &[
            "/no/such/dir",
            "apt-get install dataset-fashion-mnist",
            "--data DIR",
        ],
    );
    let out = nodectl(&[
        "shard",
        "--data",
        "/no/such/dir",
        "--peers",
        "2",
        "--out",
        "x",
    ]);
    assert_one_line_error(&out, &["apt-get install dataset-fashion-mnist"]);
}

#[test]
fn damaged_idx_files_are_named_with_the_problem() {
    let work = tempfile::tempdir().unwrap();
    type Damage = fn(&mut Vec<u8>);
    let cases: [(&str, Damage, &[&str]); 3] = [
        ("truncated", |b| b.truncate(b.len() / 2), &["truncated"]),
        ("magic", |b| b[3] = 1, &["magic number", "0x00000801"]),
        (
            "gzip",
            |b| {
                b.splice(0..0, [0x1f, 0x8b, 8, 0]);
            },
            &["corrupt", "gzip"],
        ),
    ];
    for (name, damage, needles) in cases {
        let data = data_dir(50, 20);
        let path = data.path().join(Split::Train.images_file());
        let mut bytes = std::fs::read(&path).unwrap();
        damage(&mut bytes);
        std::fs::write(&path, bytes).unwrap();
        let cfg = config(work.path(), data.path(), &work.path().join(name), 1);
        let out = nodectl(&["train", "--config", cfg.to_str().unwrap()]);
        assert_one_line_error(&out, needles);
        assert_one_line_error(&out, &[path.to_str().unwrap()]);
    }
}

#[test]
fn bad_configs_name_the_key_and_line() {
    let data = data_dir(50, 20);
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), data.path(), work.path(), 1);
    let good = std::fs::read_to_string(&cfg).unwrap();
    for (from, to, needles) in [
        (
            "momentum = 0.9",
            "momentum = 0.9\nmomentun = 1",
            &["unknown field `momentun`", "run.toml:14:1"][..],
        ),
        (
            "epochs = 1",
            "epochs = \"one\"",
            &["invalid type: string \"one\"", "run.toml:16:10"][..],
        ),
        ("lr = 0.05", "lr = -0.05", &["optimizer.lr"][..]),
        (
            "[model]\nkind = \"mlp\"",
            "[model]\nkind = \"rnn\"",
            &["unknown variant `rnn`"][..],
        ),
    ] {
        std::fs::write(&cfg, good.replace(from, to)).unwrap();
        let path = cfg.to_str().unwrap();
        assert_one_line_error(&nodectl(&["config", "validate", path]), needles);
        assert_one_line_error(&nodectl(&["train", "--config", path]), needles);
    }
    std::fs::write(&cfg, &good).unwrap();
    let ok = stdout_json(&nodectl(&[
        "config",
        "validate",
        cfg.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(ok["valid"], true);
    let out = nodectl(&["config", "validate", "/no/such.toml"]);
    assert_one_line_error(&out, &["/no/such.toml"]);
}

/// An elastic run elects its center among the peers a node trusts (decision 0052): a node that
/// trusts nobody and pins no center is refused before it joins, and told its ways out.
#[test]
fn an_elastic_node_that_trusts_nobody_is_refused_and_told_what_to_do() {
    let data = data_dir(50, 20);
    let work = tempfile::tempdir().unwrap();
    let cfg = config(work.path(), data.path(), work.path(), 1);
    let elastic = std::fs::read_to_string(&cfg).unwrap() + "\n[sync]\nmode = \"elastic\"\n";
    std::fs::write(&cfg, elastic).unwrap();
    let node = work.path().join("node");
    let out = nodectl(&[
        "join",
        "--config",
        cfg.to_str().unwrap(),
        "--data-dir",
        node.to_str().unwrap(),
        "--no-mdns",
    ]);
    assert_one_line_error(
        &out,
        &[
            "[trust] peers",
            "nodectl trust add",
            "sync.elastic.center",
            "sync.elastic.election = \"open\"",
        ],
    );
}

#[test]
fn shipped_configs_validate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for name in [
        "fashion-mlp.toml",
        "fashion-cnn.toml",
        "shakespeare-gpt.toml",
        "shakespeare-gpt-swarm.toml",
        "shakespeare-gpt-85m-swarm.toml",
    ] {
        let path = root.join("configs").join(name);
        let out = stdout_json(&nodectl(&[
            "config",
            "validate",
            path.to_str().unwrap(),
            "--json",
        ]));
        assert_eq!(out["valid"], true, "{name}");
    }
}

#[test]
fn shard_writes_a_manifest_and_refuses_impossible_splits() {
    let data = data_dir(120, 10);
    let out_dir = tempfile::tempdir().unwrap();
    let out = out_dir.path().join("shards");
    let args = |peers: &str, partition: &str| {
        nodectl(&[
            "shard",
            "--data",
            data.path().to_str().unwrap(),
            "--peers",
            peers,
            "--partition",
            partition,
            "--seed",
            "4",
            "--out",
            out.to_str().unwrap(),
            "--force",
            "--json",
        ])
    };
    let manifest = stdout_json(&args("3", "dirichlet:0.5"));
    let shards = manifest["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 3);
    let total: u64 = shards.iter().map(|s| s["samples"].as_u64().unwrap()).sum();
    assert_eq!(total, 120);
    assert!(
        out.join("shard-002")
            .join(Split::Train.labels_file())
            .is_file()
    );
    // Deterministic: the same seed writes the same manifest.
    assert_eq!(stdout_json(&args("3", "dirichlet:0.5")), manifest);

    assert_one_line_error(&args("121", "iid"), &["120 samples", "--peers 120"]);
    assert_one_line_error(&args("2", "zipf:2"), &["unknown partition `zipf:2`"]);
    assert_one_line_error(&args("2", "labels:20"), &["labels:20"]);
}

#[test]
fn bench_train_prints_samples_per_sec() {
    let out = nodectl(&[
        "bench",
        "train",
        "--model",
        "mlp",
        "--batch",
        "16",
        "--threads",
        "1",
        "--trials",
        "2",
        "--trial-secs",
        "0.05",
        "--warmup",
        "2",
        "--peak-size",
        "64",
        "--json",
    ]);
    let report = stdout_json(&out);
    assert!(
        report["samples_per_sec"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    assert!(
        report["fraction_of_sgemm_peak"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    assert_eq!(report["threads"], 1);
}

/// `bench exchange` runs a whole exchange per size through the machines and the wire: a frame
/// of the codec's size, every stage timed, the memory counted by nodectl's allocator; a codec
/// the config does not know is named.
#[test]
fn bench_exchange_prints_each_stage_and_the_memory_it_took() {
    let out = nodectl(&[
        "bench", "exchange", "--params", "1k,20k", "--codec", "int8", "--rounds", "1", "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    let big = &lines[1];
    assert_eq!(big["params"], 20_000);
    // 20,000 int8 values: a byte each and a scale per block of 256, and the frame's header.
    let frame = big["frame_bytes"].as_u64().unwrap();
    assert!(
        (20_000 + 79 * 4..20_000 + 79 * 4 + 400).contains(&frame),
        "{big}"
    );
    for stage in ["difference_s", "read_s", "judge_s"] {
        assert!(
            big["stages"][stage].as_f64().unwrap() > 0.0,
            "{stage}: {big}"
        );
    }
    assert!(big["peak_extra_bytes"].as_u64().unwrap() > 80_000, "{big}");

    let out = nodectl(&["bench", "exchange", "--params", "1k", "--codec", "int3"]);
    assert_one_line_error(&out, &["int3"]);
}

/// `bench exchange --transport` runs each exchange between two processes over the network
/// stack: the same frame as in one process, the whole exchange timed beside a plain frame of
/// its bytes on the same connection, the stages, and each side's memory from its own count.
#[test]
fn bench_exchange_between_two_processes_times_it_against_the_link() {
    let out = nodectl(&[
        "bench",
        "exchange",
        "--params",
        "20k",
        "--codec",
        "int8",
        "--rounds",
        "2",
        "--transport",
        "tcp",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    assert_eq!(report["transport"], "tcp");
    let frame = report["frame_bytes"].as_u64().unwrap();
    assert!(
        (20_000 + 79 * 4..20_000 + 79 * 4 + 400).contains(&frame),
        "{report}"
    );
    for figure in ["exchange_s", "link_s", "exchange_over_link"] {
        assert!(report[figure].as_f64().unwrap() > 0.0, "{figure}: {report}");
    }
    // The stages that wait on the other process take time at any size; the others may round
    // to nothing at 20k values.
    for stage in ["answer_s", "transfer_s", "judge_s"] {
        assert!(
            report["stages"][stage].as_f64().unwrap() > 0.0,
            "{stage}: {report}"
        );
    }
    for stage in ["snapshot_s", "ahead_s", "mix_s"] {
        assert!(report["stages"][stage].is_f64(), "{stage}: {report}");
    }
    // The pair's copies of 20k values (two, of 16 bits a value and a scale a block of 256:
    // 1.01 models) are not counted; the snapshot is.
    assert_eq!(report["copies_models"], 1.01, "{report}");
    for side in ["initiator_peak_extra_models", "responder_peak_extra_models"] {
        assert!(report[side].as_f64().unwrap() >= 1.0, "{side}: {report}");
    }

    let out = nodectl(&["bench", "exchange", "--params", "1k", "--transport", "udp"]);
    assert_one_line_error(&out, &["udp"]);
}

/// A responder started by hand (`--serve`, as on another machine) answers an initiator given
/// its address (`--partner`): the exchange over whatever link joins them. The responder prints
/// its address, then its memory for each size; an initiator started with other `--params` is
/// refused by name on both sides, and each says what to do.
///
/// Both sides log warnings but libp2p's DHT's: it warns of a bootstrap that found no peer (half
/// a second after one connected, if it left by then), which is no output of the bench's and
/// made a clean failure two lines on a loaded machine.
#[test]
fn bench_exchange_answers_a_partner_started_by_hand() {
    let nodectl = || {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_nodectl"));
        cmd.args(["--log", "warn,libp2p_kad=error"]);
        cmd
    };
    let serve = |params: &str| {
        let mut child = nodectl()
            .args(["bench", "exchange", "--params", params, "--rounds", "2"])
            .args(["--transport", "tcp", "--serve"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let (lines, printed) = std::sync::mpsc::sync_channel(16);
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(stdout).map_while(Result::ok) {
                let _ = lines.send(line);
            }
        });
        let addr = printed
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("the responder printed its address within 60 s");
        (child, addr, printed)
    };
    let partner = |params: &str, addr: &str| {
        let args = ["bench", "exchange", "--params", params, "--rounds", "2"];
        let partner = ["--transport", "tcp", "--partner", addr, "--json"];
        common::output_within(nodectl().args(args).args(partner), "the partner")
    };

    let (child, addr, printed) = serve("20k,30k");
    assert!(
        addr.starts_with("/ip4/127.0.0.1/tcp/") && addr.contains("/p2p/"),
        "{addr}"
    );
    let out = partner("20k,30k", &addr);
    let served = common::finish_within(child, "the responder");
    assert!(out.status.success(), "{out:?}");
    assert!(served.status.success(), "{served:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let reports: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reports.len(), 2, "{stdout}");
    for (report, params) in reports.iter().zip([20_000, 30_000]) {
        assert_eq!(report["params"], params, "{report}");
        assert_eq!(report["partner"], addr.as_str(), "{report}");
        assert!(
            report["exchange_over_link"].as_f64().unwrap() > 0.0,
            "{report}"
        );
        // The responder's memory is in its own output, not here.
        assert!(report["responder_peak_extra_models"].is_null(), "{report}");
        assert!(
            report["initiator_peak_extra_models"].as_f64().unwrap() >= 1.0,
            "{report}"
        );
    }
    let memory: Vec<Value> = printed
        .try_iter()
        .map(|l| serde_json::from_str(&l).unwrap())
        .collect();
    assert_eq!(memory.len(), 2, "{memory:?}");
    for (report, params) in memory.iter().zip([20_000, 30_000]) {
        assert_eq!(report["params"], params, "{report}");
        assert!(
            report["peak_extra_models"].as_f64().unwrap() >= 1.0,
            "{report}"
        );
    }

    let (child, addr, _) = serve("20k");
    let out = partner("30k", &addr);
    let served = common::finish_within(child, "the refusing responder");
    assert_one_line_error(&out, &["exchange 0", "same --params"]);
    assert_one_line_error(
        &served,
        &["bench-30000-int8-2", "bench-20000-int8-2", "same --params"],
    );

    let out = partner("20k", "/ip4/127.0.0.1/tcp/9");
    assert_one_line_error(&out, &["no peer id", "/p2p/"]);
    let out = partner(
        "20k",
        "/ip4/127.0.0.1/udp/9/quic-v1/p2p/12D3KooWK5VZwKco2SUVsf2TrKBNhVc6bUzbqYksAATDE68NyKuR",
    );
    assert_one_line_error(&out, &["not a tcp address"]);
}

/// A release build leaves the simulator out; `bench sim` then says how to build one with it
/// (or, in a build with it, runs a small simulated swarm).
#[test]
fn bench_sim_runs_in_a_build_with_the_simulator_and_says_how_to_get_one_otherwise() {
    let out = nodectl(&["bench", "sim", "--peers", "4", "--steps", "50", "--json"]);
    if cfg!(feature = "sim") {
        let report = stdout_json(&out);
        assert_eq!(report["completed"], true, "{report}");
    } else {
        assert_one_line_error(&out, &["without the simulator", "--features sim"]);
    }
}
