//! Real `nodectl join` processes in `gossip` and `elastic` mode on synthetic data: they
//! exchange parameters, a late joiner catches up by state sync, the elastic center is elected
//! once and saved, and `nodectl evaluate` reads what they left behind. Waits poll with
//! deadlines.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::fs;
use std::path::Path;
use std::time::Instant;

use common::{DEADLINE, Daemon, json};
use murmur_trainer::data::{Dataset, Split};
use serde_json::Value;

/// A work dir with synthetic data and a run config in `mode`, long enough (many epochs of a
/// tiny MLP) that the tests stop the daemons rather than wait for the end.
fn setup(mode: &str, extra: &str) -> tempfile::TempDir {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    fs::create_dir(&data).unwrap();
    Dataset::synthetic(512, 1)
        .write_split(&data, Split::Train)
        .unwrap();
    Dataset::synthetic(128, 2)
        .write_split(&data, Split::Test)
        .unwrap();
    fs::write(
        work.path().join("run.toml"),
        format!(
            "[run]\nname = \"sync-test\"\n[model]\nkind = \"mlp\"\nhidden = [16]\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.02\nmomentum = 0.9\n\
             [training]\nepochs = 20000\nbatch_size = 32\n[data]\ndir = \"{}\"\n\
             [sync]\nmode = \"{mode}\"\ninterval = 4\nmax_staleness = 64\n{extra}",
            data.display()
        ),
    )
    .unwrap();
    work
}

fn status(dir: &Path) -> Value {
    json(&["status", "--data-dir", dir.to_str().unwrap(), "--json"])
}

/// Polls the status of the daemon of `dir` until `done` holds; returns that status.
fn wait_until(dir: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    let start = Instant::now();
    loop {
        let s = status(dir);
        if done(&s) {
            return s;
        }
        assert!(start.elapsed() < DEADLINE, "{what}: last status {s}");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

fn exchanges(s: &Value) -> u64 {
    s["sync"]["exchanges"].as_u64().unwrap() + s["sync"]["served"].as_u64().unwrap()
}

#[test]
fn gossip_peers_exchange_stay_within_the_bound_and_leave_evaluable_checkpoints() {
    let work = setup("gossip", "");
    let dirs: Vec<_> = ["a", "b", "c"]
        .iter()
        .map(|n| work.path().join(n))
        .collect();
    let a = Daemon::start(work.path(), "a", &[]);
    let bootstrap = a.join_address();
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    let c = Daemon::start(work.path(), "c", &["--bootstrap", &bootstrap]);
    for dir in &dirs {
        let s = wait_until(dir, "exchanges on every peer", |s| exchanges(s) >= 5);
        assert_eq!(s["sync"]["mode"], "gossip");
        assert!(s["sync"]["bytes_out"].as_u64().unwrap() > 0);
    }
    for (daemon, dir) in [a, b, c].into_iter().zip(&dirs) {
        daemon.leave(dir);
    }
    let mut args = vec!["evaluate", "--config"];
    let config = work.path().join("run.toml");
    args.push(config.to_str().unwrap());
    args.push("--json");
    args.extend(dirs.iter().map(|d| d.to_str().unwrap()));
    let report = json(&args);
    let checkpoints = report["checkpoints"].as_array().unwrap();
    assert_eq!(checkpoints.len(), 3);
    for c in checkpoints {
        let node = &c["node"];
        assert_eq!(node["rejected"], 0, "{c}");
        // The gate let no step be taken more than the bound ahead of the slowest peer.
        assert!(node["max_lead"].as_u64().unwrap() <= 64, "{c}");
        assert!(node["bytes_out_per_step"].as_f64().unwrap() > 0.0);
    }
    let distance = report["consensus_distance"].as_f64().unwrap();
    assert!(distance.is_finite() && distance < 1.0, "{report}");
}

#[test]
fn a_late_joiner_takes_over_the_state_of_the_run() {
    let work = setup("gossip", "");
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let bootstrap = a.join_address();
    // Far past the staleness bound (64) before b starts.
    wait_until(&a_dir, "a trains alone", |s| {
        s["step"].as_u64().unwrap() >= 2_000
    });
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    let s = wait_until(&b_dir, "state sync", |s| {
        s["sync"]["state_syncs"].as_u64().unwrap() == 1
    });
    assert!(s["step"].as_u64().unwrap() >= 2_000, "{s}");
    wait_until(&b_dir, "exchanges after joining", |s| exchanges(s) >= 3);
    b.leave(&b_dir);
    a.leave(&a_dir);
}

#[test]
fn elastic_peers_agree_on_one_center_that_is_saved_when_it_leaves() {
    let work = setup("elastic", "");
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let bootstrap = a.join_address();
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    // While one of them is still joining the other may elect itself; the election then
    // settles on the same center everywhere.
    wait_until(&a_dir, "a exchanges", |s| exchanges(s) >= 5);
    let sa = wait_until(&a_dir, "a and b follow the same center", |sa| {
        let sb = status(&b_dir);
        exchanges(&sb) >= 5
            && sa["sync"]["center"].is_string()
            && sb["sync"]["center"] == sa["sync"]["center"]
    });
    let center = sa["sync"]["center"].as_str().unwrap().to_owned();
    let (center_dir, worker_dir) = if center == sa["peer_id"] {
        (&a_dir, &b_dir)
    } else {
        (&b_dir, &a_dir)
    };
    assert_eq!(status(center_dir)["sync"]["role"], "center");
    assert_eq!(status(worker_dir)["sync"]["role"], "worker");
    b.leave(&b_dir);
    a.leave(&a_dir);
    assert!(center_dir.join("checkpoints/center.safetensors").is_file());
    let config = work.path().join("run.toml");
    let report = json(&[
        "evaluate",
        "--config",
        config.to_str().unwrap(),
        "--json",
        center_dir.to_str().unwrap(),
    ]);
    let accuracy = report["center"]["test_accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&accuracy), "{report}");
}
