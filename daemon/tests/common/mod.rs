//! Helpers shared by the tests that run real `nodectl` processes.

#![allow(clippy::unwrap_used, dead_code)] // test helpers may panic; not every test uses each

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use murmur_trainer::data::{Dataset, Split};
use murmur_trainer::model::{Architecture, ModelSpec};
use serde_json::Value;

pub(crate) mod nodes;

pub(crate) const DEADLINE: Duration = Duration::from_secs(60);

/// How long a whole training run of a test may take to end: its epochs are sized to end in
/// well under a minute here, and a machine half as fast (a busy CI runner) must not fail it.
pub(crate) const RUN_DEADLINE: Duration = Duration::from_secs(240);

pub(crate) fn nodectl() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nodectl"));
    // `TEST_NODECTL_LOG=debug cargo test ...` for more in the daemon logs a failure prints.
    let log = std::env::var("TEST_NODECTL_LOG").unwrap_or_else(|_| "warn".into());
    cmd.args(["--log", &log]);
    cmd
}

pub(crate) fn run(args: &[&str]) -> Output {
    output_within(
        nodectl().args(args),
        &format!("`nodectl {}`", args.join(" ")),
    )
}

/// Runs `cmd` to its end, as [`Command::output`] does, but kills it and fails the test, naming
/// `what`, if it has not ended within [`DEADLINE`].
pub(crate) fn output_within(cmd: &mut Command, what: &str) -> Output {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("could not start {what}: {e}"));
    finish_within(child, what)
}

/// Waits for a started `child` (its stdout and stderr piped) and collects its output; kills it
/// and fails the test, naming `what`, if it has not ended within [`DEADLINE`].
pub(crate) fn finish_within(mut child: Child, what: &str) -> Output {
    // Read both pipes while waiting, so that a child with much to say never blocks on them.
    let stdout = read_to_end(child.stdout.take());
    let stderr = read_to_end(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not end within {} s", DEADLINE.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
    }
}

fn read_to_end(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

/// A daemon that is killed if the test fails before it leaves.
pub(crate) struct Daemon {
    pub(crate) child: Child,
    pub(crate) log: PathBuf,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Daemon {
    pub(crate) fn start(work: &Path, name: &str, extra: &[&str]) -> Daemon {
        Daemon::start_with_env(work, name, extra, &[])
    }

    /// [`Daemon::start`] with environment variables set for the daemon.
    pub(crate) fn start_with_env(
        work: &Path,
        name: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let log = work.join(format!("{name}.log"));
        let out = fs::File::create(&log).unwrap();
        let child = nodectl()
            .envs(env.iter().copied())
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

    pub(crate) fn wait_for_line(&self, prefix: &str) -> String {
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

    /// Waits for a log line that contains every one of `words`, and returns it.
    pub(crate) fn wait_for_log(&self, words: &[&str]) -> String {
        let start = Instant::now();
        loop {
            let text = fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(line) = text.lines().find(|l| words.iter().all(|w| l.contains(w))) {
                return line.to_owned();
            }
            assert!(
                start.elapsed() < DEADLINE,
                "no line with {words:?} in:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What the daemon wrote so far (`TEST_NODECTL_LOG=debug` for more), for a failure message.
    pub(crate) fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub(crate) fn join_address(&self) -> String {
        let line = self.wait_for_line("to join this node:");
        line.rsplit(' ').next().unwrap().to_owned()
    }

    /// Asks the daemon to leave and checks that it exits 0.
    pub(crate) fn leave(mut self, data_dir: &Path) {
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

pub(crate) fn json(args: &[&str]) -> Value {
    let out = run(args);
    assert!(
        out.status.success(),
        "{:?}: {}",
        args,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// `GET /status` of the daemon of `dir`.
pub(crate) fn status(dir: &Path) -> Value {
    json(&["status", "--data-dir", dir.to_str().unwrap(), "--json"])
}

/// Polls the status of the daemon of `dir` until `done` holds; returns that status.
pub(crate) fn wait_until(dir: &Path, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    wait_until_within(dir, what, DEADLINE, done)
}

/// [`wait_until`] with a deadline of its own (the end of a run: [`RUN_DEADLINE`]).
pub(crate) fn wait_until_within(
    dir: &Path,
    what: &str,
    deadline: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let start = Instant::now();
    loop {
        let s = status(dir);
        if done(&s) {
            return s;
        }
        assert!(
            start.elapsed() < deadline,
            "{what}: not within {deadline:?}; last status {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `nodectl wait` for `peers` live peers of the daemon of `dir`; returns how many it saw.
pub(crate) fn wait_for_peers(dir: &Path, peers: usize) -> Value {
    let dir = dir.to_str().unwrap();
    let n = peers.to_string();
    json(&[
        "wait",
        "--data-dir",
        dir,
        "--min-peers",
        &n,
        "--timeout",
        "30",
        "--json",
    ])["live_peers"]
        .clone()
}

/// A work dir with synthetic data and a run config in sync `mode` (`extra` is appended to the
/// `[sync]` table), long enough (many epochs of a tiny MLP) that the tests stop the daemons
/// rather than wait for the end.
/// The MLP of the test configs, with one hidden layer of `hidden` units: what reads their
/// checkpoints.
pub(crate) fn mlp_architecture(hidden: usize) -> Architecture {
    ModelSpec {
        hidden: Some(vec![hidden]),
        ..ModelSpec::mlp()
    }
    .build()
    .unwrap()
}

pub(crate) fn endless_mlp_run(mode: &str, extra: &str) -> tempfile::TempDir {
    synthetic_run(512, 128, |data| nodes::endless_run(data, mode, extra))
}

/// A work dir with `train` and `test` synthetic samples under `data/` and the run config that
/// `config` writes for that data dir as `run.toml`.
pub(crate) fn synthetic_run(
    train: usize,
    test: usize,
    config: impl FnOnce(&Path) -> String,
) -> tempfile::TempDir {
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("data");
    fs::create_dir(&data).unwrap();
    Dataset::synthetic(train, 1)
        .write_split(&data, Split::Train)
        .unwrap();
    Dataset::synthetic(test, 2)
        .write_split(&data, Split::Test)
        .unwrap();
    fs::write(work.path().join("run.toml"), config(&data)).unwrap();
    work
}
