//! Real `nodectl join` processes in `allreduce` mode on synthetic data, and `nodectl trust`:
//! trusted peers train in lockstep and end bitwise identical, a peer killed mid-run is left
//! behind within the ring timeout while the others go on, and the trust list is edited in
//! place. Waits poll with deadlines.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use common::{
    Daemon, RUN_DEADLINE, json, run, status, synthetic_run, wait_until, wait_until_within,
};
use serde_json::Value;

fn peer_id(dir: &Path) -> String {
    let id = json(&["init", "--data-dir", dir.to_str().unwrap(), "--json"]);
    id["peer_id"].as_str().unwrap().to_owned()
}

fn trust(dir: &Path, args: &[&str]) -> std::process::Output {
    let mut all = vec!["trust"];
    all.extend(args);
    all.extend(["--data-dir", dir.to_str().unwrap()]);
    run(&all)
}

fn step(s: &Value) -> u64 {
    s["step"].as_u64().unwrap()
}

#[test]
fn trust_add_ls_rm_edit_the_list_and_keep_the_comments() {
    let work = tempfile::tempdir().unwrap();
    let (a, b) = (work.path().join("a"), work.path().join("b"));
    let b_id = peer_id(&b);
    peer_id(&a);
    assert!(trust(&a, &["add", &b_id]).status.success());
    let again = trust(&a, &["add", &b_id, "--json"]);
    let again: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["changed"], false);
    let listed = json(&["trust", "ls", "--json", "--data-dir", a.to_str().unwrap()]);
    assert_eq!(listed["peers"], serde_json::json!([b_id]));
    assert_eq!(listed["allowlist"], false);
    let text = fs::read_to_string(a.join("config.toml")).unwrap();
    assert!(
        text.contains("# Peer ids allowed into all-reduce rings"),
        "{text}"
    );

    let bad = trust(&a, &["add", "not-a-peer"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not a peer id"));

    assert!(trust(&a, &["rm", &b_id]).status.success());
    let gone = trust(&a, &["rm", &b_id]);
    assert!(String::from_utf8_lossy(&gone.stderr).contains("not in the trust list"));
    let listed = json(&["trust", "ls", "--json", "--data-dir", a.to_str().unwrap()]);
    assert_eq!(listed["peers"], serde_json::json!([]));
}

/// A run of `names` peers on synthetic data, every one trusting every other, with `ring`
/// added to `[sync.allreduce]`. Returns the work directory and each peer's data directory.
fn trusted_ring(names: &[&str], epochs: u64, ring: &str) -> (tempfile::TempDir, Vec<PathBuf>) {
    let work = synthetic_run(512, 128, |data| {
        format!(
            "[run]\nname = \"ring-test\"\n[model]\nkind = \"mlp\"\nhidden = [16]\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.02\nmomentum = 0.9\n\
             [training]\nepochs = {epochs}\nbatch_size = 32\n[data]\ndir = \"{}\"\n\
             [sync]\nmode = \"allreduce\"\n[sync.allreduce]\n{ring}\n",
            data.display()
        )
    });
    let dirs: Vec<_> = names.iter().map(|n| work.path().join(n)).collect();
    let ids: Vec<String> = dirs.iter().map(|d| peer_id(d)).collect();
    for dir in &dirs {
        for id in &ids {
            assert!(trust(dir, &["add", id]).status.success());
        }
    }
    (work, dirs)
}

/// The consensus distance of the final checkpoints in `dirs`.
fn consensus(work: &Path, dirs: &[PathBuf]) -> Value {
    let config = work.join("run.toml");
    let mut args = vec!["evaluate", "--config", config.to_str().unwrap(), "--json"];
    args.extend(dirs.iter().map(|d| d.to_str().unwrap()));
    json(&args)
}

/// Three trusted peers with `every = 1` and `min_peers = 3`: they start together, one is
/// killed with SIGKILL mid-run, the other two re-form the ring and go on; a second is killed
/// and the last goes on alone. The first comes back while the second is still away: fewer
/// members than `min_peers`, but the run is under way, so it takes over the state (parameters,
/// clock and momentum) and rounds with the survivor rather than wait for the missing peer while
/// the survivor counts it in. Then the second comes back too. All three end bitwise identical,
/// however the kills fell within a round.
#[test]
fn allreduce_peers_train_in_lockstep_and_go_on_through_kills_and_returns() {
    let (work, dirs) = trusted_ring(
        &["a", "b", "c"],
        600,
        "every = 1\nmin_peers = 3\nring_timeout = 5.0",
    );
    let a = Daemon::start(work.path(), "a", &[]);
    let bootstrap = a.join_address();
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    let c = Daemon::start(work.path(), "c", &["--bootstrap", &bootstrap]);
    // Every step is a ring round.
    let s = wait_until(&dirs[0], "ring rounds", |s| step(s) >= 200);
    assert_eq!(s["sync"]["mode"], "allreduce");
    assert!(s["sync"]["exchanges"].as_u64().unwrap() >= 200, "{s}");

    drop(c); // SIGKILL
    let killed_at = step(&status(&dirs[0]));
    let s = wait_until(&dirs[0], "rounds without the killed peer", |s| {
        step(s) >= killed_at + 200
    });
    assert!(s["sync"]["failed"].as_u64().unwrap() >= 1, "{s}");
    a.wait_for_log(&["ring round aborted"]);

    // b dies too: a goes on alone, a ring of one.
    drop(b);
    let alone_at = step(&status(&dirs[0]));
    wait_until(&dirs[0], "rounds alone", |s| step(s) >= alone_at + 100);

    // A killed peer returns: it catches up by state sync and is in the rounds again, with a
    // alone, though that is fewer members than `min_peers`.
    let back_in_rounds = |s: &Value| {
        s["sync"]["state_syncs"].as_u64().unwrap() >= 1
            && s["sync"]["exchanges"].as_u64().unwrap() >= 50
    };
    let c = Daemon::start(work.path(), "c", &["--bootstrap", &bootstrap]);
    let back = wait_until(&dirs[2], "c back in rounds with a alone", back_in_rounds);
    assert!(step(&back) > alone_at + 100, "{back}");
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    wait_until(&dirs[1], "b back in rounds", back_in_rounds);
    for dir in &dirs {
        wait_until_within(dir, "the end of training", RUN_DEADLINE, |s| {
            s["state"] == "finished"
        });
    }
    for (daemon, dir) in [a, b, c].into_iter().zip(&dirs) {
        daemon.leave(dir);
    }
    let report = consensus(work.path(), &dirs);
    assert_eq!(report["consensus_distance"].as_f64(), Some(0.0), "{report}");
}
