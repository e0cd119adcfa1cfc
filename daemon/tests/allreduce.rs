//! Real `nodectl join` processes in `allreduce` mode on synthetic data, and `nodectl trust`:
//! trusted peers train in lockstep and end bitwise identical, a peer killed mid-run is left
//! behind within the ring timeout while the others go on, and the trust list is edited in
//! place. Waits poll with deadlines.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::fs;
use std::path::Path;

use common::{Daemon, json, run, status, wait_until};
use murmur_trainer::data::{Dataset, Split};
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

/// Three trusted peers with `every = 1`: they start together, one is killed with SIGKILL
/// mid-run, the other two re-form the ring and go on, bitwise identical; the killed one comes
/// back, takes over their state and trains in the ring again to the end.
#[test]
fn allreduce_peers_train_in_lockstep_and_go_on_without_a_killed_peer() {
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
            "[run]\nname = \"ring-test\"\n[model]\nkind = \"mlp\"\nhidden = [16]\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.02\nmomentum = 0.9\n\
             [training]\nepochs = 300\nbatch_size = 32\n[data]\ndir = \"{}\"\n\
             [sync]\nmode = \"allreduce\"\n[sync.allreduce]\nevery = 1\nmin_peers = 3\n\
             ring_timeout = 5.0\n",
            data.display()
        ),
    )
    .unwrap();
    let names = ["a", "b", "c"];
    let dirs: Vec<_> = names.iter().map(|n| work.path().join(n)).collect();
    let ids: Vec<String> = dirs.iter().map(|d| peer_id(d)).collect();
    for dir in &dirs {
        for id in &ids {
            assert!(trust(dir, &["add", id]).status.success());
        }
    }
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

    // The killed peer returns: it catches up by state sync and is in the rounds again.
    let c = Daemon::start(work.path(), "c", &["--bootstrap", &bootstrap]);
    let back = wait_until(&dirs[2], "the returning peer in rounds", |s| {
        s["sync"]["state_syncs"].as_u64().unwrap() >= 1
            && s["sync"]["exchanges"].as_u64().unwrap() >= 50
    });
    assert!(step(&back) > killed_at + 200, "{back}");
    for dir in &dirs {
        wait_until(dir, "the end of training", |s| s["state"] == "finished");
    }
    for (daemon, dir) in [a, b, c].into_iter().zip(&dirs) {
        daemon.leave(dir);
    }
    let report = json(&[
        "evaluate",
        "--config",
        work.path().join("run.toml").to_str().unwrap(),
        "--json",
        dirs[0].to_str().unwrap(),
        dirs[1].to_str().unwrap(),
    ]);
    assert_eq!(report["consensus_distance"].as_f64(), Some(0.0), "{report}");
}
