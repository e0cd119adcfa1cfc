//! [`Swarm`]: a node of Murmur running inside the training process (decision 0071), and the
//! handle the training loop holds.
//!
//! `join` builds the node around a [`TorchReplica`] and starts it on a runtime of its own:
//! the network task, the sync engine, the membership actor and the control API. The node lends
//! the replica's driver to the training loop ([`Drive::Lend`]): [`Swarm::step`] reports the
//! step the loop took, and drives the node's rules on the loop's own thread (hand the
//! parameters over, land a mix, wait at the staleness gate) until the loop may take the next.
//! Once the loop finishes, a thread of the swarm's answers the peers until the node leaves.

use std::ffi::CString;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use murmur_daemon::cli::LogFormat;
use murmur_daemon::commands::join::{self, JoinOptions};
use murmur_daemon::config::{NodeConfig, RunConfig, SyncModeName};
use murmur_daemon::model::{ModelDescription, ParamDtype, TensorSpec};
use murmur_daemon::node::replica::driver::Turn;
use murmur_daemon::node::replica::{Diverged, Replica, ReplicaInfo, StepReport};
use murmur_daemon::node::{self, Drive, LentDriver, Ready};
use murmur_daemon::readout::Count;
use murmur_daemon::store::DataDir;
use murmur_daemon::telemetry::{self, Telemetry};
use pyo3::exceptions::PyUserWarning;
use pyo3::prelude::*;
use pyo3::sync::MutexExt;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::checkpoints::Checkpoints;
use crate::replica::{SharedClock, TorchReplica};
use crate::{ConfigError, ModelMismatchError, MurmurError, SwarmStopped};

/// How often a wait of the training loop looks for a signal (Ctrl-C) and for a node that
/// stopped.
const POLL: Duration = Duration::from_millis(100);
/// How long `join` waits for the node to listen.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// How a node joins, as `murmur.join`'s keyword arguments say.
#[derive(Debug)]
pub(crate) struct JoinArgs {
    pub(crate) data_dir: PathBuf,
    pub(crate) bootstrap: Vec<String>,
    pub(crate) listen: Vec<String>,
    pub(crate) api: Option<String>,
    pub(crate) peer_timeout: f64,
    pub(crate) mdns: bool,
    pub(crate) steps_per_epoch: Option<u64>,
    pub(crate) samples_per_step: Option<u64>,
    pub(crate) log: String,
    pub(crate) progress: bool,
}

/// A running node with a PyTorch replica. Its methods take it shared (a frozen class): the
/// training loop may step while another thread reads the status.
#[pyclass(module = "murmur._native", frozen)]
pub(crate) struct Swarm {
    /// The node's runtime and task, until it ended.
    running: Mutex<Option<Running>>,
    shutdown: CancellationToken,
    ready: Ready,
    clock: Arc<SharedClock>,
    /// Who drives the replica now.
    driving: Mutex<Driving>,
    samples_per_step: u64,
    /// The step training resumed from (a checkpoint), or 0.
    start_step: u64,
    /// Steps to the end of the run's epochs, when the loop's epochs are known.
    total_steps: Option<u64>,
    progress: Mutex<Option<Progress>>,
    /// How the node ended, once it has: `None` while it runs.
    ended: Mutex<Option<Result<(), String>>>,
}

/// Who drives the replica.
enum Driving {
    /// The training loop, on its thread, at each `step`.
    Loop(Box<LentDriver>),
    /// A thread of the swarm's that answers the peers after the loop finished.
    Answering(JoinHandle<anyhow::Result<()>>),
    /// Nobody: the swarm left, or its driving failed.
    Done,
}

/// A node that runs: its runtime, its task, and its telemetry's exporters.
struct Running {
    runtime: tokio::runtime::Runtime,
    node: tokio::task::JoinHandle<anyhow::Result<()>>,
    telemetry: Option<Telemetry>,
}

impl std::fmt::Debug for Swarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swarm")
            .field("peer_id", &self.ready.peer_id)
            .finish_non_exhaustive()
    }
}

/// The progress line on a terminal, as `nodectl train` shows it.
struct Progress {
    bar: indicatif::ProgressBar,
    last: Instant,
}

/// Installs logging once per process.
fn init_logging(filter: &str) -> anyhow::Result<()> {
    static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();
    INSTALLED
        .get_or_init(|| {
            telemetry::init_logging(filter, LogFormat::Text, None).map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(anyhow::Error::msg)
}

/// The model's description from the adapter: `(name, shape, dtype)` per tensor, in order.
pub(crate) fn description(py: Python<'_>, adapter: &Py<PyAny>) -> PyResult<ModelDescription> {
    let tensors: Vec<(String, Vec<usize>, String)> =
        adapter.bind(py).call_method0("describe")?.extract()?;
    let tensors = tensors
        .into_iter()
        .map(|(name, shape, dtype)| {
            let dtype: ParamDtype = dtype
                .parse()
                .map_err(|e| ModelMismatchError::new_err(format!("`{name}`: {e:#}")))?;
            Ok(TensorSpec { name, shape, dtype })
        })
        .collect::<PyResult<Vec<_>>>()?;
    ModelDescription::new(tensors).map_err(|e| ModelMismatchError::new_err(format!("{e:#}")))
}

/// Fails unless the run can be trained by a PyTorch peer with this model; warns of what the
/// run asks that a PyTorch optimizer does not do.
fn check_run(py: Python<'_>, config: &RunConfig, model: &ModelDescription) -> PyResult<()> {
    if config.sync.mode == SyncModeName::Allreduce && config.sync.allreduce.every == 1 {
        return Err(ConfigError::new_err(format!(
            "run `{}`: sync.mode = \"allreduce\" with every = 1 steps the ring's mean gradient \
             (synchronous SGD), which Murmur's own trainer does; a PyTorch peer steps its own \
             optimizer: set sync.allreduce.every > 1, or use gossip or elastic",
            config.name()
        )));
    }
    if let Some(spec) = &config.model {
        let network = spec
            .expand()
            .map_err(|e| ConfigError::new_err(e.to_string()))?;
        let run = ModelDescription::of_layout(&network.layout());
        model
            .check_against(&run, "its [model] section")
            .map_err(|e| ModelMismatchError::new_err(format!("{e:#}")))?;
    }
    if config.optimizer.as_ref().and_then(|o| o.quasi_global) == Some(true) {
        // Native peers count every mix into their momentum; a PyTorch optimizer's momentum
        // is its own steps'. In one swarm the two pull apart: on the MLP example, a swarm of
        // two of each ended at 85-86 % with it and at 88.4 % without (all native: 88.1 %).
        let message = CString::new(format!(
            "run `{}`: optimizer.quasi_global = true is Murmur's own optimizer's (its momentum \
             counts the mixes); this PyTorch optimizer's momentum does not, and native peers \
             with it train worse beside PyTorch peers: set optimizer.quasi_global = false in \
             a run with PyTorch peers",
            config.name()
        ))?;
        PyErr::warn(py, &py.get_type::<PyUserWarning>(), &message, 1)?;
    }
    Ok(())
}

/// Starts a node of the run `config` around the model `adapter` describes, and returns once
/// the node listens and the model may take its first step.
pub(crate) fn join(
    py: Python<'_>,
    config_path: PathBuf,
    adapter: Py<PyAny>,
    args: JoinArgs,
) -> PyResult<Swarm> {
    init_logging(&args.log).map_err(|e| ConfigError::new_err(format!("{e:#}")))?;
    let config =
        RunConfig::load(&config_path).map_err(|e| ConfigError::new_err(format!("{e:#}")))?;
    let model = description(py, &adapter)?;
    check_run(py, &config, &model)?;

    let data = DataDir::new(args.data_dir.clone());
    data.init()
        .map_err(|e| MurmurError::new_err(format!("{e:#}")))?;
    let node_config = NodeConfig::load(&data.node_config_path())
        .map_err(|e| ConfigError::new_err(format!("{e:#}")))?;
    let options = JoinOptions::resolve(
        &node_config,
        &args.listen,
        &args.bootstrap,
        !args.mdns,
        args.api.clone(),
        Duration::from_secs_f64(args.peer_timeout.max(1.0)),
    )
    .map_err(|e| ConfigError::new_err(format!("{e:#}")))?;
    let telemetry =
        join::telemetry_of(&data).map_err(|e| MurmurError::new_err(format!("{e:#}")))?;

    let adapter_ref = adapter.bind(py);
    let info = ReplicaInfo {
        model: model.clone(),
        kind: "pytorch".into(),
        device: adapter_ref.call_method0("device")?.extract()?,
        optimizer_buffers: adapter_ref.call_method0("optimizer_buffers")?.extract()?,
        steps_per_epoch: args.steps_per_epoch,
    };
    let checkpoints = Checkpoints {
        dir: data.checkpoints(),
        model,
        run: config.name().to_owned(),
        keep: config.checkpoint.keep,
    };
    let resumed = checkpoints
        .newest()
        .map_err(|e| ModelMismatchError::new_err(format!("{e:#}")))?;

    let clock = Arc::new(SharedClock::default());
    let mut replica = TorchReplica::new(adapter, info, Arc::clone(&clock), checkpoints);
    let mut start_step = 0;
    if let Some(mut state) = resumed {
        if state.optimizer.as_ref().map(|o| o.names())
            != Some(replica.describe().optimizer_buffers.clone())
        {
            // Saved with another optimizer: the parameters and the clock only.
            state.optimizer = None;
        }
        start_step = state.step;
        replica.adopt(state).map_err(|e| {
            MurmurError::new_err(format!("cannot resume from the checkpoint: {e:#}"))
        })?;
        tracing::info!(step = start_step, "resumed from the newest checkpoint");
    }

    let (lend, mut lent) = oneshot::channel();
    let setup = join::setup(
        &config,
        &node_config,
        data,
        &options,
        Box::new(replica),
        Drive::Lend(lend),
    )
    .map_err(|e| ConfigError::new_err(format!("{e:#}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("murmur-net")
        .enable_all()
        .build()
        .map_err(|e| MurmurError::new_err(format!("cannot start the async runtime: {e}")))?;
    let shutdown = CancellationToken::new();
    let (ready_tx, mut ready_rx) = oneshot::channel();
    let node = runtime.spawn(node::run(setup, shutdown.clone(), ready_tx));

    // The node listens, and lends its driver.
    let deadline = Instant::now() + READY_WITHIN;
    let (mut ready, mut driver) = (None, None);
    while ready.is_none() || driver.is_none() {
        let (want_ready, want_driver) = (ready.is_none(), driver.is_none());
        let waited = py.detach(|| {
            runtime.block_on(async {
                tokio::time::timeout(POLL, async {
                    tokio::select! {
                        got = &mut ready_rx, if want_ready => got.map(|r| (Some(r), None)),
                        got = &mut lent, if want_driver => got.map(|d| (None, Some(d))),
                    }
                })
                .await
            })
        });
        match waited {
            Ok(Ok((r, d))) => {
                ready = ready.or(r);
                driver = driver.or(d);
            }
            Ok(Err(_)) => {
                // The node ended before it listened: its error says why.
                let result = py.detach(|| runtime.block_on(node));
                let why = match result {
                    Ok(Err(e)) => format!("{e:#}"),
                    Ok(Ok(())) => "it left".into(),
                    Err(e) => e.to_string(),
                };
                return Err(SwarmStopped::new_err(format!(
                    "the node did not start: {why}"
                )));
            }
            Err(_) if Instant::now() > deadline => {
                shutdown.cancel();
                return Err(MurmurError::new_err(format!(
                    "the node did not listen within {} s: check `listen` and the node config",
                    READY_WITHIN.as_secs()
                )));
            }
            Err(_) => py.check_signals()?,
        }
    }
    let (Some(ready), Some(driver)) = (ready, driver) else {
        unreachable!("the loop above ends with both");
    };
    let total_steps = args
        .steps_per_epoch
        .map(|per_epoch| per_epoch * config.training.epochs);
    let progress = args.progress.then(|| {
        let bar = match total_steps {
            Some(total) => indicatif::ProgressBar::new(total),
            None => indicatif::ProgressBar::no_length(),
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} steps {msg}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_prefix(format!("murmur {}", config.name()));
        bar.set_position(start_step);
        Progress {
            bar,
            last: Instant::now(),
        }
    });
    let swarm = Swarm {
        running: Mutex::new(Some(Running {
            runtime,
            node,
            telemetry,
        })),
        shutdown,
        ready,
        clock,
        driving: Mutex::new(Driving::Loop(Box::new(driver))),
        samples_per_step: args
            .samples_per_step
            .unwrap_or(config.training.batch_size as u64),
        start_step,
        total_steps,
        progress: Mutex::new(progress),
        ended: Mutex::new(None),
    };
    // The first turn comes once the node lets the replica step: after a state sync, at the
    // staleness gate.
    swarm.drive(py, None)?;
    Ok(swarm)
}

impl Swarm {
    /// Drives the node's rules on this thread, with the interpreter released, until the loop
    /// may take its next step; after `stepped` when there is one. Raises on a signal (Ctrl-C)
    /// or when the node stopped; a failure of the driving makes the node stop.
    fn drive(&self, py: Python<'_>, stepped: Option<StepReport>) -> PyResult<()> {
        let mut driving = self
            .driving
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner());
        let Driving::Loop(lent) = &mut *driving else {
            return Err(MurmurError::new_err(
                "this swarm's training loop has finished (`finish()`) or left: no more steps",
            ));
        };
        let driver = lent.driver();
        let mut result = match stepped {
            Some(report) => py.detach(|| driver.stepped(report)).map(|()| Turn::Pending),
            None => Ok(Turn::Pending),
        };
        while let Ok(Turn::Pending) = result {
            py.check_signals()?;
            result = py.detach(|| driver.next_turn(Some(Instant::now() + POLL)));
        }
        let outcome = match result {
            Ok(Turn::Step) => return Ok(()),
            // The node leaves (`nodectl leave`): the driving ends here.
            Ok(Turn::Leaving) => Ok(()),
            Ok(Turn::SynchronousStep | Turn::Pending) => {
                unreachable!("refused at join, and looped on above")
            }
            Err(e) => Err(e),
        };
        let Driving::Loop(lent) = std::mem::replace(&mut *driving, Driving::Done) else {
            unreachable!("matched above");
        };
        let finished = py.detach(|| lent.finish(outcome));
        drop(driving);
        Err(self.stopped(py, finished.err()))
    }

    /// Takes the driving from the swarm, leaving it done.
    fn take_driving(&self, py: Python<'_>) -> Driving {
        std::mem::replace(
            &mut *self
                .driving
                .lock_py_attached(py)
                .unwrap_or_else(|p| p.into_inner()),
            Driving::Done,
        )
    }

    fn clear_progress(&self) {
        let progress = self
            .progress
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(progress) = progress {
            progress.bar.finish_and_clear();
        }
    }

    fn node_runs(&self) -> bool {
        let running = self.running.lock().unwrap_or_else(|p| p.into_inner());
        running.as_ref().is_some_and(|r| !r.node.is_finished())
    }

    /// The error for a node that stopped: how it ended (`failed`, what failed on this side).
    fn stopped(&self, py: Python<'_>, failed: Option<anyhow::Error>) -> PyErr {
        let ended = self.end(py);
        let why = match (failed, ended) {
            (Some(e), _) => format!("{e:#}"),
            (None, Ok(())) => "the node left (`nodectl leave`, or POST /leave)".to_owned(),
            (None, Err(why)) => why,
        };
        SwarmStopped::new_err(format!(
            "{why}; the training loop cannot go on in the swarm"
        ))
    }

    /// Waits for the node's end (with the interpreter released) and remembers it.
    fn end(&self, py: Python<'_>) -> Result<(), String> {
        let running = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(Running {
            runtime,
            node,
            telemetry,
        }) = running
        {
            let result = py.detach(|| runtime.block_on(node));
            let ended = match result {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(format!("the node stopped: {e:#}")),
                Err(e) => Err(format!("the node failed: {e}")),
            };
            py.detach(|| runtime.shutdown_timeout(Duration::from_secs(2)));
            if let Some(telemetry) = telemetry {
                telemetry.shutdown();
            }
            *self.ended.lock().unwrap_or_else(|p| p.into_inner()) = Some(ended);
        }
        self.clear_progress();
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // Another thread may be ending it right now: its end is the one that counts.
        ended.unwrap_or(Ok(()))
    }

    fn draw_progress(&self, step: u64, loss: Option<f64>) {
        let mut progress = self.progress.lock().unwrap_or_else(|p| p.into_inner());
        let Some(progress) = progress.as_mut() else {
            return;
        };
        if progress.last.elapsed() < Duration::from_millis(200) {
            return;
        }
        progress.last = Instant::now();
        progress.bar.set_position(step);
        let readout = &self.ready.readout;
        let peers = readout.peers().len();
        let loss = loss.map_or(String::new(), |l| format!("loss {l:.4} "));
        progress.bar.set_message(format!(
            "{loss}peers {peers} bytes out {:.1} MB",
            readout.counters().get(Count::BytesSent) as f64 / 1e6
        ));
    }
}

#[pymethods]
impl Swarm {
    /// Tells the node that the training loop took a step, and returns when the loop may take
    /// its next one (after a hand-over or a mix, or at the staleness gate).
    #[pyo3(signature = (loss=None, samples=None))]
    fn step(&self, py: Python<'_>, loss: Option<f64>, samples: Option<u64>) -> PyResult<()> {
        let step = self.clock.step.load(Ordering::Acquire) + 1;
        let report = StepReport {
            step,
            loss: loss.map(|l| l as f32),
            samples: samples.unwrap_or(self.samples_per_step),
        };
        if loss.is_some_and(|l| !l.is_finite()) {
            // As Murmur's trainer: the last good checkpoint stays the newest.
            let driving = self.take_driving(py);
            let diverged = Diverged(format!(
                "training diverged: the loss was {loss:?} at step {step}; lower the learning \
                 rate or add warmup"
            ));
            if let Driving::Loop(lent) = driving {
                let _ = py.detach(|| lent.finish(Err(diverged.into())));
            }
            self.shutdown.cancel();
            return Err(self.stopped(py, None));
        }
        self.clock.step.store(step, Ordering::Release);
        self.drive(py, Some(report))?;
        self.draw_progress(self.clock.step.load(Ordering::Acquire), loss);
        Ok(())
    }

    /// Tells the node the loop has finished training: a thread of the swarm's answers the peers
    /// (the model still takes their mixes) until the node leaves (`leave()`, `nodectl leave`).
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let mut driving = self
            .driving
            .lock_py_attached(py)
            .unwrap_or_else(|p| p.into_inner());
        if let Driving::Loop(_) = &*driving {
            let Driving::Loop(mut lent) = std::mem::replace(&mut *driving, Driving::Done) else {
                unreachable!("matched above");
            };
            self.clock.finished.store(true, Ordering::Release);
            let answering = std::thread::Builder::new()
                .name("murmur-finished".into())
                .spawn(move || {
                    let answered = loop {
                        match lent.driver().next_turn(None) {
                            Ok(Turn::Leaving) => break Ok(()),
                            Ok(_) => {}
                            Err(e) => break Err(e),
                        }
                    };
                    lent.finish(answered)
                })
                .map_err(|e| MurmurError::new_err(format!("cannot start a thread: {e}")))?;
            *driving = Driving::Answering(answering);
        }
        self.clear_progress();
        Ok(())
    }

    /// Leaves the swarm: saves a checkpoint, says goodbye, and stops the node.
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        self.shutdown.cancel();
        let driving = self.take_driving(py);
        let finished = match driving {
            Driving::Loop(lent) => py.detach(|| lent.finish(Ok(()))),
            Driving::Answering(thread) => py.detach(|| {
                thread
                    .join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the answering thread panicked")))
            }),
            Driving::Done => Ok(()),
        };
        let ended = self.end(py);
        finished.map_err(|e| SwarmStopped::new_err(format!("{e:#}")))?;
        ended.map_err(SwarmStopped::new_err)
    }

    /// Blocks until the node leaves (`nodectl leave`, POST /leave) or `timeout` seconds pass;
    /// returns whether it left. Ctrl-C raises `KeyboardInterrupt`.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
        loop {
            if !self.node_runs() {
                return self.end(py).map(|()| true).map_err(SwarmStopped::new_err);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(false);
            }
            py.detach(|| std::thread::sleep(POLL));
            py.check_signals()?;
        }
    }

    /// The node's status, as `nodectl status --json` prints it.
    fn status_json(&self) -> PyResult<String> {
        serde_json::to_string(&self.ready.readout.status())
            .map_err(|e| MurmurError::new_err(e.to_string()))
    }

    #[getter]
    fn peer_id(&self) -> String {
        self.ready.peer_id.to_string()
    }

    /// The control API's address (`nodectl status --data-dir` finds it in the data dir).
    #[getter]
    fn api(&self) -> String {
        self.ready.api.to_string()
    }

    /// The addresses the node listens on, with its peer id: what other peers bootstrap from.
    #[getter]
    fn listen(&self) -> Vec<String> {
        self.ready.listen.iter().map(ToString::to_string).collect()
    }

    /// Local steps taken (after a checkpoint or a state sync, from where it resumed).
    #[getter]
    fn steps(&self) -> u64 {
        self.clock.step.load(Ordering::Acquire)
    }

    #[getter]
    fn start_step(&self) -> u64 {
        self.start_step
    }

    /// Steps to the end of the run's epochs, when `steps_per_epoch` was given.
    #[getter]
    fn total_steps(&self) -> Option<u64> {
        self.total_steps
    }

    /// Whether the node still runs.
    #[getter]
    fn running(&self) -> bool {
        self.node_runs()
    }
}

impl Drop for Swarm {
    fn drop(&mut self) {
        // The interpreter may be going away: no waiting here, only the word to leave (the
        // package's `atexit` hook leaves properly before that). A driver dropped unfinished
        // makes the node leave too.
        self.shutdown.cancel();
        let running = self
            .running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(running) = running {
            running.runtime.shutdown_background();
        }
    }
}

/// Checks that a description parses: for `murmur.describe`.
pub(crate) fn fingerprint(py: Python<'_>, adapter: &Py<PyAny>) -> PyResult<String> {
    Ok(description(py, adapter)?.fingerprint())
}
