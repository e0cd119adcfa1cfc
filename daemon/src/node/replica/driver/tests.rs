//! The replica's driver with a toy replica behind the contract, and the test in the engine's
//! seat: what it hands over, and how what comes back lands.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode};
use murmur_protocol::network::{Keypair, PeerId};
use murmur_sync::replica::{Clock, Delta};

use super::*;
use crate::model::{ModelDescription, ParamDtype, TensorSpec};
use crate::node::replica::{Evaluation, ReplicaInfo, Saved};
use crate::node::testing;
use crate::readout::Feeds;

/// A replica of two values whose every step adds one to the first; it logs what lands on it.
struct Toy {
    step: u64,
    steps: u64,
    params: Vec<f32>,
    info: ReplicaInfo,
    log: Arc<Mutex<Vec<String>>>,
}

impl Toy {
    fn new(steps: u64, log: Arc<Mutex<Vec<String>>>) -> Self {
        Toy::starting(steps, vec![0.0, 0.0], log)
    }

    fn starting(steps: u64, params: Vec<f32>, log: Arc<Mutex<Vec<String>>>) -> Self {
        let tensor = TensorSpec {
            name: "w".into(),
            shape: vec![2],
            dtype: ParamDtype::F32,
        };
        Toy {
            step: 0,
            steps,
            params,
            info: ReplicaInfo {
                model: ModelDescription::new(vec![tensor]).unwrap(),
                kind: "toy".into(),
                device: "cpu".into(),
                optimizer_buffers: Vec::new(),
                steps_per_epoch: Some(2),
            },
            log,
        }
    }

    fn note(&self, line: String) {
        self.log.lock().unwrap().push(line);
    }
}

impl Replica for Toy {
    fn describe(&self) -> &ReplicaInfo {
        &self.info
    }

    fn clock(&self) -> Clock {
        Clock {
            step: self.step,
            finished: self.step >= self.steps,
        }
    }

    fn step(&mut self) -> anyhow::Result<Option<StepReport>> {
        self.step += 1;
        self.params[0] += 1.0;
        Ok(Some(StepReport {
            step: self.step,
            loss: Some(0.5),
            samples: 4,
        }))
    }

    fn gradient(&mut self) -> anyhow::Result<(u64, Vec<f32>)> {
        anyhow::bail!("no rings here")
    }

    fn apply_mean_gradient(&mut self, _: &[f32]) -> anyhow::Result<StepReport> {
        anyhow::bail!("no rings here")
    }

    fn params(&mut self) -> anyhow::Result<Vec<f32>> {
        Ok(self.params.clone())
    }

    fn set_params(&mut self, params: Vec<f32>) -> anyhow::Result<()> {
        self.params = params;
        Ok(())
    }

    fn add(&mut self, delta: Vec<f32>, mixed_over: Option<u64>) -> anyhow::Result<()> {
        self.note(format!(
            "add {delta:?} over {mixed_over:?} at step {}",
            self.step
        ));
        for (x, d) in self.params.iter_mut().zip(&delta) {
            *x += d;
        }
        Ok(())
    }

    fn state(&mut self) -> anyhow::Result<ReplicaState> {
        Ok(ReplicaState {
            step: self.step,
            params: self.params.clone(),
            optimizer: None,
        })
    }

    fn adopt(&mut self, state: ReplicaState) -> anyhow::Result<Adoption> {
        self.note(format!("adopt step {}", state.step));
        self.step = state.step;
        self.params = state.params;
        Ok(Adoption::ParametersOnly)
    }

    fn evaluate(&mut self) -> anyhow::Result<Option<Evaluation>> {
        self.note(format!("evaluate at step {}", self.step));
        Ok(Some(Evaluation {
            accuracy: 0.5,
            loss: None,
        }))
    }

    fn checkpoint(&mut self) -> anyhow::Result<Option<Saved>> {
        self.note(format!(
            "checkpoint at step {} of {:?}",
            self.step, self.params
        ));
        Ok(None)
    }
}

/// What one replica driver runs with.
struct Parts {
    dir: tempfile::TempDir,
    readout: Readout,
    feeds: Feeds,
    sync: SyncSettings,
    leave: CancellationToken,
}

fn parts(interval: u64) -> Parts {
    let dir = tempfile::tempdir().unwrap();
    let peer_id = Keypair::generate_ed25519().public().to_peer_id();
    let sync = testing::gossip(peer_id, interval);
    let leave = CancellationToken::new();
    let (readout, feeds) = testing::readout(peer_id, &sync, &leave);
    Parts {
        dir,
        readout,
        feeds,
        sync,
        leave,
    }
}

/// A gossip peer at step 0 in the table: a partner the driver hands its snapshots over for.
fn with_partner(parts: &Parts) -> PeerId {
    let peer = Keypair::generate_ed25519().public().to_peer_id();
    let heartbeat = Heartbeat {
        version: HEARTBEAT_VERSION,
        run_id: testing::RUN_ID.into(),
        fingerprint: "f".into(),
        step: 0,
        epoch: 0,
        loss_ema: 1.0,
        samples_seen: 0,
        mode: SyncMode::Gossip,
        role: Role::Worker,
        leaving: false,
        finished: false,
        client: false,
        sent_ms: 1,
    };
    parts.feeds.peers.send_modify(|table| {
        table
            .members_mut()
            .observe(peer, &heartbeat, Instant::now());
    });
    peer
}

/// The engine's ends of the thread's channels.
struct Engine {
    requests: mpsc::Sender<ToReplica>,
    due: mpsc::Receiver<Due>,
}

fn ports(parts: &Parts) -> (ReplicaPorts, Engine, watch::Receiver<Progress>) {
    let (requests, inbox) = mpsc::channel(4);
    let (due_tx, due) = mpsc::channel(1);
    let (progress, progress_rx) = watch::channel(Progress::default());
    let ports = ReplicaPorts {
        inbox,
        due: due_tx,
        peers: parts.readout.watch_peers(),
        progress,
        leave: parts.leave.clone(),
    };
    (ports, Engine { requests, due }, progress_rx)
}

/// A driver lent to a caller that takes its own steps, built in the node's runtime: its timers
/// end the caller's waits, though the caller is outside it. Keep the runtime while driving.
fn lent_driver(
    parts: &Parts,
    toy: Box<Toy>,
    store: Arc<Store>,
    ports: ReplicaPorts,
) -> (tokio::runtime::Runtime, ReplicaDriver) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let driver = {
        let _node = runtime.enter();
        let (readout, sync) = (parts.readout.clone(), parts.sync.clone());
        ReplicaDriver::new(toy, readout, store, sync, ports).unwrap()
    };
    (runtime, driver)
}

/// Waits for `what` with a deadline that fails the test.
fn within<T>(what: &str, wait: impl std::future::Future<Output = Option<T>>) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), wait).await })
        .unwrap_or_else(|_| panic!("{what}: not within 10 s"))
        .unwrap_or_else(|| panic!("{what}: the channel closed"))
}

/// The thread hands over a snapshot every `interval` steps, holds training until the mix comes
/// back, lands it through the contract (as a mix, over the interval), evaluates and
/// checkpoints at each epoch's end, and once the replica finished answers until it leaves.
#[test]
fn the_thread_hands_over_and_lands_mixes_through_the_contract() {
    let p = parts(2);
    with_partner(&p);
    let log = Arc::new(Mutex::new(Vec::new()));
    let (ports, mut engine, progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let toy = Box::new(Toy::new(4, Arc::clone(&log)));
    let driver = ReplicaDriver::new(toy, p.readout.clone(), store, p.sync.clone(), ports).unwrap();
    let thread = std::thread::spawn(move || driver.run());
    for due_at in [2, 4] {
        let due = within("a due snapshot", engine.due.recv());
        assert_eq!(due.snapshot.step, due_at);
        // The partner's parameters lie 2 above the snapshot.
        let delta = vec![2.0; due.snapshot.params.len()];
        let end = ExchangeEnd::Mix {
            delta: Delta::Values(delta),
            weight: 0.5,
        };
        due.end.send(end).unwrap();
    }
    let mut finished = progress.clone();
    within("the replica to finish", async {
        finished.wait_for(|p| p.finished).await.ok().map(|_| ())
    });
    // A finished replica still answers its peers.
    let (reply, answer) = oneshot::channel();
    let (_end, end) = oneshot::channel();
    engine
        .requests
        .try_send(ToReplica::Serve {
            reply,
            end,
            overlap: false,
        })
        .unwrap();
    let answered = within("an answer", async { answer.await.ok() });
    assert_eq!(answered.step, 4);
    p.leave.cancel();
    thread.join().unwrap().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        [
            "evaluate at step 2",
            "checkpoint at step 2 of [2.0, 0.0]",
            "add [1.0, 1.0] over Some(2) at step 2",
            "evaluate at step 4",
            "checkpoint at step 4 of [5.0, 1.0]",
            "add [1.0, 1.0] over Some(2) at step 4",
            // On the way out, the replica changed since it last saved: four steps (+4) and
            // two mixes of +1 each.
            "checkpoint at step 4 of [6.0, 2.0]",
        ]
    );
    assert_eq!(progress.borrow().test_accuracy, Some(0.5));
}

/// A replica gated on a slow peer wakes as soon as the peer table changes, however soon
/// after its check that happens: the wait is on the table's `watch`, which remembers a change.
#[test]
fn the_gate_wakes_on_a_peer_table_change_made_right_after_the_check() {
    let p = parts(2);
    let (ports, _engine, _progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let toy = Box::new(Toy::new(4, Arc::default()));
    let mut driver =
        ReplicaDriver::new(toy, p.readout.clone(), store, p.sync.clone(), ports).unwrap();
    // The check: the driver marks the table seen.
    let _ = driver.ports.peers.borrow_and_update().len();
    // A change between the check and the wait (a heartbeat of the slow peer).
    p.feeds.peers.send_modify(|_| {});
    let waited = Instant::now();
    futures::executor::block_on(driver.wait_until(true, None)).unwrap();
    assert!(
        waited.elapsed() < Duration::from_secs(1),
        "the change was missed"
    );
}

/// A replica held at the staleness gate by a lagging peer goes on as soon as the engine marks
/// that peer's link slow (decision 0029): the slow set is part of the peer table, whose
/// `watch` the gate waits on, rather than a figure beside it that no one is woken for.
#[test]
fn the_gate_opens_when_the_peer_it_waits_for_is_marked_slow() {
    let p = parts(1_000);
    let lagging = with_partner(&p);
    let (ports, _engine, progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let toy = Box::new(Toy::new(200, Arc::default()));
    let driver = ReplicaDriver::new(toy, p.readout.clone(), store, p.sync.clone(), ports).unwrap();
    // On the node's blocking pool, as in `node::run`: the gate's patience is a timer.
    let node = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let thread = node.spawn_blocking(move || driver.run());
    // max_staleness is 64 and the peer is at step 0.
    let mut at_gate = progress.clone();
    within("the replica to reach the gate", async {
        at_gate.wait_for(|p| p.step == 64).await.ok().map(|_| ())
    });
    // What the membership actor does when the engine finds the peer's link slow.
    p.feeds.peers.send_modify(|table| {
        table.set_slow(std::collections::BTreeSet::from([lagging]));
    });
    // Well within the gate's patience (10 s), after which it would stop waiting anyway.
    let mut past_gate = progress.clone();
    // A bool, not the watch's guard: held, it would block the driver's next step from being
    // recorded, and with it the driver's exit awaited below (a hang seen in the suite).
    let passed = node.block_on(async {
        tokio::time::timeout(Duration::from_secs(3), past_gate.wait_for(|p| p.step > 64))
            .await
            .is_ok_and(|seen| seen.is_ok())
    });
    p.leave.cancel();
    node.block_on(async { tokio::time::timeout(Duration::from_secs(10), thread).await })
        .expect("the driver did not leave within 10 s")
        .unwrap()
        .unwrap();
    assert!(
        passed,
        "the replica stayed at the gate for 3 s after its peer was marked slow"
    );
}

/// A caller that drives its own steps (a PyTorch loop) is given its turns: the driver hands
/// over and lands between them, and a wait that goes past the caller's deadline gives the
/// turn back as `Pending` (so that the caller can look at its signals) and goes on when asked
/// again.
#[test]
fn a_caller_that_takes_its_own_steps_is_given_turns_and_gets_control_back_from_long_waits() {
    let p = parts(2);
    with_partner(&p);
    let (ports, mut engine, _progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let toy = Box::new(Toy::new(100, Arc::clone(&log)));
    let (_runtime, mut driver) = lent_driver(&p, toy, store, ports);
    let soon = || Some(Instant::now() + Duration::from_millis(50));
    assert_eq!(driver.next_turn(soon()).unwrap(), Turn::Step);
    for step in 1..=2 {
        // The caller's own step.
        driver.replica().step().unwrap();
        driver
            .stepped(StepReport {
                step,
                loss: None,
                samples: 4,
            })
            .unwrap();
    }
    // Step 2 handed a snapshot over; without overlap the next turn waits for its end.
    let due = engine
        .due
        .try_recv()
        .expect("the snapshot of step 2 was handed over");
    assert_eq!(driver.next_turn(soon()).unwrap(), Turn::Pending);
    assert_eq!(driver.next_turn(soon()).unwrap(), Turn::Pending);
    let end = ExchangeEnd::Subtract(vec![0.5, 0.5]);
    due.end.send(end).unwrap();
    assert_eq!(driver.next_turn(soon()).unwrap(), Turn::Step);
    assert_eq!(
        *log.lock().unwrap(),
        [
            // Step 2 ended the toy's epoch.
            "evaluate at step 2",
            "checkpoint at step 2 of [2.0, 0.0]",
            "add [-0.5, -0.5] over Some(2) at step 2"
        ]
    );
    p.leave.cancel();
    assert_eq!(driver.next_turn(None).unwrap(), Turn::Leaving);
}

/// A gossip replica with no peer trains as it would without Murmur: no snapshot is taken nor
/// handed over, and no step waits; once a peer is in the table, the next due one is.
#[test]
fn alone_the_driver_hands_nothing_over_until_a_peer_comes() {
    let p = parts(2);
    let (ports, mut engine, _progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let toy = Box::new(Toy::new(100, Arc::default()));
    let (_runtime, mut driver) = lent_driver(&p, toy, store, ports);
    let take_step = |driver: &mut ReplicaDriver, step: u64| {
        let deadline = Instant::now() + Duration::from_secs(5);
        let turn = driver.next_turn(Some(deadline)).unwrap();
        assert_eq!(turn, Turn::Step, "no turn to take step {step} within 5 s");
        driver.replica().step().unwrap();
        let report = StepReport {
            step,
            loss: None,
            samples: 4,
        };
        driver.stepped(report).unwrap();
    };
    for step in 1..=6 {
        take_step(&mut driver, step);
    }
    assert!(
        engine.due.try_recv().is_err(),
        "a snapshot was handed over with no peer to take it"
    );
    with_partner(&p);
    for step in 7..=8 {
        take_step(&mut driver, step);
    }
    let due = engine
        .due
        .try_recv()
        .expect("the snapshot of step 8 was handed over once a peer is there");
    assert_eq!(due.snapshot.step, 8);
}

/// A replica that finished and then takes over a peer's state behind its own (a joiner whose
/// state sync crossed a slow link while it trained to the end alone) trains on from there and
/// says it finished again: without that, its node never counted as finished, and a run of the
/// WAN config waited for it for ever.
#[test]
fn a_replica_that_took_over_a_state_after_finishing_finishes_again() {
    let p = parts(2);
    let log = Arc::new(Mutex::new(Vec::new()));
    let (ports, engine, progress) = ports(&p);
    let store = Arc::new(Store::open(&p.dir.path().join("node.redb")).unwrap());
    let toy = Box::new(Toy::new(4, Arc::clone(&log)));
    let driver = ReplicaDriver::new(toy, p.readout.clone(), store, p.sync.clone(), ports).unwrap();
    let thread = std::thread::spawn(move || driver.run());
    let mut finished = progress.clone();
    within("the replica to finish alone", async {
        finished.wait_for(|p| p.finished).await.ok().map(|_| ())
    });
    let (adopted, answer) = oneshot::channel();
    let state = SyncState {
        replica: ReplicaState {
            step: 2,
            params: vec![9.0, 9.0],
            optimizer: None,
        },
        outer: None,
    };
    let adopt = ToReplica::Adopt { state, adopted };
    engine.requests.try_send(adopt).unwrap();
    within("the state taken over", async { answer.await.ok() }).unwrap();
    within("the replica to finish again", async {
        finished.wait_for(|p| p.finished).await.ok().map(|_| ())
    });
    assert_eq!(progress.borrow().step, 4);
    p.leave.cancel();
    thread.join().unwrap().unwrap();
    assert!(
        log.lock().unwrap().contains(&"adopt step 2".to_owned()),
        "{:?}",
        log.lock().unwrap()
    );
}
