//! Real `nodectl join` processes on loopback (mDNS off): they find each other, report each
//! other's steps, leave cleanly, and a restarted daemon keeps its peer id and reconnects to
//! known peers from its peer book without a bootstrap address. Waits poll with deadlines.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

use murmur_trainer::data::{Dataset, Split};
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(60);

fn nodectl() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nodectl"));
    cmd.args(["--log", "warn"]);
    cmd
}

fn run(args: &[&str]) -> Output {
    nodectl().args(args).output().unwrap()
}

/// A daemon that is killed if the test fails before it leaves.
struct Daemon {
    child: Child,
    log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    fn start(work: &Path, name: &str, extra: &[&str]) -> Daemon {
        let log = work.join(format!("{name}.log"));
        let out = fs::File::create(&log).unwrap();
        let child = nodectl()
            .args(["join", "--config"])
            .arg(work.join("run.toml"))
            .arg("--data-dir")
            .arg(work.join(name))
            .args([
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--no-mdns",
                "--threads",
                "1",
            ])
            .args(extra)
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let daemon = Daemon { child, log };
        daemon.wait_for_line("ready ");
        daemon
    }

    fn wait_for_line(&self, prefix: &str) -> String {
        let start = Instant::now();
        loop {
            let text = fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| l.starts_with(prefix)) {
                return line.to_owned();
            }
            assert!(start.elapsed() < DEADLINE, "no `{prefix}` line in:\n{text}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn join_address(&self) -> String {
        let line = self.wait_for_line("to join this node:");
        line.rsplit(' ').next().unwrap().to_owned()
    }

    /// Asks the daemon to leave and checks that it exits 0.
    fn leave(mut self, data_dir: &Path) {
        let out = run(&["leave", "--data-dir", data_dir.to_str().unwrap()]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "daemon exited with {status}");
                return;
            }
            assert!(
                start.elapsed() < DEADLINE,
                "daemon did not exit after leave"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "{:?}: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn setup() -> tempfile::TempDir {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    fs::create_dir(&data).unwrap();
    Dataset::synthetic(256, 1)
        .write_split(&data, Split::Train)
        .unwrap();
    Dataset::synthetic(64, 2)
        .write_split(&data, Split::Test)
        .unwrap();
    fs::write(
        work.path().join("run.toml"),
        format!(
            "[run]\nname = \"join-test\"\n[model]\nkind = \"mlp\"\nhidden = [16]\n\
             [optimizer]\nkind = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n\
             [training]\nepochs = 3\nbatch_size = 32\n[data]\ndir = \"{}\"\n",
            data.display()
        ),
    )
    .unwrap();
    work
}

#[test]
fn two_daemons_find_each_other_and_a_restart_reconnects_from_the_peer_book() {
    let work = setup();
    let (a_dir, b_dir) = (work.path().join("a"), work.path().join("b"));
    let a = Daemon::start(work.path(), "a", &[]);
    let bootstrap = a.join_address();
    let b = Daemon::start(work.path(), "b", &["--bootstrap", &bootstrap]);
    let a_id = json(&["id", "--data-dir", a_dir.to_str().unwrap(), "--json"])["peer_id"].clone();
    let b_id = json(&["id", "--data-dir", b_dir.to_str().unwrap(), "--json"])["peer_id"].clone();

    for dir in [&a_dir, &b_dir] {
        let waited = json(&[
            "wait",
            "--data-dir",
            dir.to_str().unwrap(),
            "--min-peers",
            "1",
            "--timeout",
            "30",
            "--json",
        ]);
        assert_eq!(waited["live_peers"], 1);
    }
    let peers = json(&["peers", "--data-dir", a_dir.to_str().unwrap(), "--json"]);
    assert_eq!(peers[0]["peer_id"], b_id);
    assert!(peers[0]["step"].is_u64());
    let status = json(&["status", "--data-dir", b_dir.to_str().unwrap(), "--json"]);
    assert_eq!(status["run_id"], "join-test");
    assert_eq!(status["live_peers"], 1);

    // b leaves and comes back with no bootstrap flag: same peer id, and it finds a again
    // from its peer book.
    b.leave(&b_dir);
    assert!(
        !b_dir.join("api").exists(),
        "the api file is removed on leave"
    );
    let b = Daemon::start(work.path(), "b", &[]);
    assert_eq!(
        b.wait_for_line("peer id: "),
        format!("peer id: {}", b_id.as_str().unwrap())
    );
    let waited = json(&[
        "wait",
        "--data-dir",
        b_dir.to_str().unwrap(),
        "--min-peers",
        "1",
        "--timeout",
        "30",
        "--json",
    ]);
    assert_eq!(waited["live_peers"], 1);
    let peers = json(&["peers", "--data-dir", b_dir.to_str().unwrap(), "--json"]);
    assert_eq!(peers[0]["peer_id"], a_id);
    b.leave(&b_dir);
    a.leave(&a_dir);
}

#[test]
fn control_commands_without_a_daemon_say_how_to_start_one() {
    let work = tempfile::tempdir().unwrap();
    let out = run(&["status", "--data-dir", work.path().to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("nodectl join"), "{stderr}");
    let out = run(&[
        "wait",
        "--data-dir",
        work.path().to_str().unwrap(),
        "--min-peers",
        "1",
        "--timeout",
        "0.3",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
}
