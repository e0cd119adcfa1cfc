//! Nodes in this process: each a whole `node::run` (network over libp2p's memory transport,
//! membership, engine, trainer thread, control API on loopback), built from a run config the
//! way `nodectl join` builds it. Every wait has a deadline and says what did not happen.

#![allow(clippy::unwrap_used, dead_code)] // test helpers may panic; not every test uses each

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use murmur_daemon::api::types::StatusReport;
use murmur_daemon::commands::join::{self, JoinOptions};
use murmur_daemon::config::{NodeConfig, RunConfig};
use murmur_daemon::node::{self, Ready};
use murmur_daemon::store::DataDir;
use murmur_protocol::network::{self, Client, Keypair, Multiaddr, NetworkConfig, TransportKind};
use murmur_trainer::CpuBackend;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

/// How long any one condition may take to come about.
pub(crate) const DEADLINE: Duration = Duration::from_secs(60);

/// A node running in this process.
pub(crate) struct LocalNode {
    pub(crate) ready: Ready,
    pub(crate) dir: PathBuf,
    task: JoinHandle<anyhow::Result<()>>,
    /// Makes the node leave when cancelled, or when dropped: a node dropped by a failed test
    /// leaves too, so that its trainer thread stops and the test ends at once instead of when
    /// the run would.
    shutdown: DropGuard,
}

/// What a test may change about how a node joins.
#[derive(Clone, Debug, Default)]
pub(crate) struct Joining {
    pub(crate) bootstrap: Vec<Multiaddr>,
    /// The node config; default: the defaults.
    pub(crate) node_config: Option<NodeConfig>,
}

impl LocalNode {
    /// Starts a node of the run `config` (a run file's text) with its data dir `work/name`.
    pub(crate) async fn start(
        work: &Path,
        name: &str,
        config: &str,
        joining: Joining,
    ) -> LocalNode {
        let dir = work.join(name);
        let data = DataDir::new(&dir);
        data.init().unwrap();
        let config = RunConfig::parse(&work.join("run.toml"), config).unwrap();
        let node_config = joining.node_config.unwrap_or_default();
        let options = JoinOptions {
            listen: vec!["/memory/0".parse().unwrap()],
            bootstrap: joining.bootstrap,
            mdns: false,
            transport: TransportKind::Memory,
            api: "127.0.0.1:0".into(),
            peer_timeout: Duration::from_secs(10),
        };
        let setup = tokio::task::spawn_blocking(move || {
            join::prepare(
                &config,
                &node_config,
                data,
                &options,
                CpuBackend::with_threads(1).unwrap(),
            )
        })
        .await
        .unwrap()
        .unwrap();
        let shutdown = CancellationToken::new();
        let (ready, is_ready) = oneshot::channel();
        let task = tokio::spawn(node::run(setup, shutdown.clone(), ready));
        let ready = within(DEADLINE, "the node to be ready", is_ready)
            .await
            .unwrap();
        LocalNode {
            ready,
            dir,
            shutdown: shutdown.drop_guard(),
            task,
        }
    }

    /// The address another node bootstraps from.
    pub(crate) fn address(&self) -> Multiaddr {
        self.ready.listen[0].clone()
    }

    pub(crate) fn status(&self) -> StatusReport {
        self.ready.readout.status()
    }

    /// Waits until the node's status satisfies `done`; returns that status.
    pub(crate) async fn wait_until(
        &self,
        what: &str,
        done: impl Fn(&StatusReport) -> bool,
    ) -> StatusReport {
        self.wait_until_within(what, DEADLINE, done).await
    }

    /// [`LocalNode::wait_until`] with a deadline of its own (the end of a run:
    /// [`super::RUN_DEADLINE`]).
    pub(crate) async fn wait_until_within(
        &self,
        what: &str,
        deadline: Duration,
        done: impl Fn(&StatusReport) -> bool,
    ) -> StatusReport {
        let start = Instant::now();
        loop {
            let status = self.status();
            if done(&status) {
                return status;
            }
            assert!(
                start.elapsed() < deadline,
                "{what}: not within {deadline:?}; last status {}",
                serde_json::to_string(&status).unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Leaves the run and waits for the node to finish; its result.
    pub(crate) async fn leave(self) -> anyhow::Result<()> {
        self.shutdown.disarm().cancel();
        within(DEADLINE, "the node to leave", self.task)
            .await
            .unwrap()
    }
}

impl LocalNode {
    /// Waits for the node to end on its own, without being told to leave; its result.
    pub(crate) async fn ended(self) -> anyhow::Result<()> {
        within(DEADLINE, "the node to end on its own", self.task)
            .await
            .unwrap()
    }
}

/// A hand-driven libp2p peer of run `run_id` and model `fingerprint` on the memory transport,
/// dialled to `target`: it speaks no stream protocol until a test accepts one on it, and
/// publishes what the test tells it to.
pub(crate) async fn stranger(run_id: &str, fingerprint: &str, target: &Multiaddr) -> Client {
    stranger_with(Keypair::generate_ed25519(), run_id, fingerprint, target).await
}

/// [`stranger`] with the identity `keypair`.
pub(crate) async fn stranger_with(
    keypair: Keypair,
    run_id: &str,
    fingerprint: &str,
    target: &Multiaddr,
) -> Client {
    let mut config = NetworkConfig::new(keypair, run_id, fingerprint);
    config.mdns = false;
    config.transport = TransportKind::Memory;
    config.listen = vec!["/memory/0".parse().unwrap()];
    config.gossip_interval = Duration::from_millis(100);
    let (client, _events, event_loop) = network::new(config).unwrap();
    tokio::spawn(event_loop.run(std::future::pending()));
    client.dial(target.clone()).await.unwrap();
    client
}

/// `future`, or a failure naming `what` after `deadline`.
pub(crate) async fn within<T>(
    deadline: Duration,
    what: &str,
    future: impl Future<Output = T>,
) -> T {
    match tokio::time::timeout(deadline, future).await {
        Ok(value) => value,
        Err(_) => panic!("{what}: not within {deadline:?}"),
    }
}

/// A run config for synthetic data in `data`: an MLP with 16 hidden units, trained long enough
/// that the tests stop the nodes rather than wait for the end; `[sync]` is `mode` with `extra`.
pub(crate) fn endless_run(data: &Path, mode: &str, extra: &str) -> String {
    format!(
        "[run]\nname = \"node-test\"\n[model]\nkind = \"mlp\"\nhidden = [16]\n\
         [optimizer]\nkind = \"sgd\"\nlr = 0.02\nmomentum = 0.9\n\
         [training]\nepochs = 20000\nbatch_size = 32\n[data]\ndir = \"{}\"\n\
         [sync]\nmode = \"{mode}\"\ninterval = 4\n{extra}",
        data.display()
    )
}

/// Every log line of this test binary, for tests that look for an event.
static LOGS: Mutex<String> = Mutex::new(String::new());

/// Installs (once) the subscriber that writes every log line into [`LOGS`].
pub(crate) fn capture_logs() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_writer(|| LogWriter)
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .try_init();
    });
}

/// Whether a log line so far contains every one of `words`.
pub(crate) fn logged(words: &[&str]) -> bool {
    LOGS.lock()
        .unwrap()
        .lines()
        .any(|l| words.iter().all(|w| l.contains(w)))
}

/// Waits for a log line that contains every one of `words`.
pub(crate) async fn wait_for_log(words: &[&str]) -> String {
    let start = Instant::now();
    loop {
        if let Some(line) = LOGS
            .lock()
            .unwrap()
            .lines()
            .find(|l| words.iter().all(|w| l.contains(w)))
        {
            return line.to_owned();
        }
        assert!(start.elapsed() < DEADLINE, "no log line with {words:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every log line so far that contains `words`.
pub(crate) fn log_lines_with(words: &[&str]) -> Vec<String> {
    LOGS.lock()
        .unwrap()
        .lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .map(str::to_owned)
        .collect()
}

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGS.lock().unwrap().push_str(&String::from_utf8_lossy(buf));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
