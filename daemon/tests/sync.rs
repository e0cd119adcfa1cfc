//! Real `nodectl join` processes in `gossip` and `elastic` mode on synthetic data: they
//! exchange parameters, a late joiner catches up by state sync, the elastic center is elected
//! once and saved, and `nodectl evaluate` reads what they left behind. Waits poll with
//! deadlines.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

mod common;

use std::fs;
use std::time::Instant;

use common::{DEADLINE, Daemon, json, status, wait_until};
use serde_json::Value;

/// [`common::endless_mlp_run`] in `mode` with a staleness bound of 64 steps.
fn setup(mode: &str, extra: &str) -> tempfile::TempDir {
    common::endless_mlp_run(mode, &format!("max_staleness = 64\n{extra}"))
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
        let offences: String = ["a", "b", "c"]
            .iter()
            .flat_map(|n| {
                let log = fs::read_to_string(work.path().join(format!("{n}.log")));
                let log = log.unwrap_or_default();
                log.lines()
                    .filter(|l| l.contains("WARN") || l.contains("offence"))
                    .map(|l| format!("{n}: {l}\n"))
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(node["rejected"], 0, "{c}\n{offences}");
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

/// A hand-driven peer on `/murmur/params/1`: it offers exchanges to a gossip daemon, which
/// answers each with its snapshot; a declined exchange and invalid parameters are not mixed,
/// a completed one is. The peer heartbeats (at the daemon's own clock, so that neither is
/// stale to the other) so that the daemon counts it as a live partner.
#[test]
fn offers_are_answered_and_only_completed_exchanges_are_mixed() {
    use futures::AsyncWriteExt;
    use murmur_protocol::heartbeat::{HEARTBEAT_VERSION, Heartbeat, Role, SyncMode};
    use murmur_protocol::network::{self, Keypair, NetworkConfig, PeerId, StreamProtocol};
    use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader};

    let work = setup("gossip", "");
    let dir = work.path().join("a");
    let a = Daemon::start(work.path(), "a", &[]);
    let target = a.join_address();
    let own = status(&dir);
    let run_id = own["run_id"].as_str().unwrap().to_owned();
    let fingerprint = own["fingerprint"].as_str().unwrap().to_owned();
    let daemon: PeerId = target.rsplit('/').next().unwrap().parse().unwrap();
    let clock = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let follow = || {
        let step = status(&dir)["step"].as_u64().unwrap();
        clock.store(step, std::sync::atomic::Ordering::Relaxed);
        step
    };
    follow();

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let client = runtime.block_on(async {
        let mut config = NetworkConfig::new(Keypair::generate_ed25519(), &run_id, &fingerprint);
        config.mdns = false;
        config.gossip_interval = std::time::Duration::from_millis(100);
        let (client, _events, event_loop) = network::new(config).unwrap();
        tokio::spawn(event_loop.run(std::future::pending()));
        client.dial(target.parse().unwrap()).await.unwrap();
        let mut heartbeat = Heartbeat {
            version: HEARTBEAT_VERSION,
            run_id: run_id.clone(),
            fingerprint: fingerprint.clone(),
            step: 0,
            epoch: 0,
            loss_ema: 1.0,
            samples_seen: 0,
            mode: SyncMode::Gossip,
            role: Role::Worker,
            leaving: false,
            finished: false,
        };
        // The daemon offers exchanges to this peer too: answer them `Busy`.
        let mut incoming = client
            .stream_control()
            .accept(StreamProtocol::new(murmur_protocol::PARAMS_PROTOCOL))
            .unwrap();
        let (run, fp) = (run_id.clone(), fingerprint.clone());
        tokio::spawn(async move {
            use futures::StreamExt;
            while let Some((_, mut stream)) = incoming.next().await {
                let expect = Expect {
                    run_id: &run,
                    fingerprint: &fp,
                    max_payload_bytes: 1 << 24,
                };
                let _ = wire::read_frame(&mut stream, &expect, &mut Vec::new()).await;
                let busy = TensorHeader::for_payload(MessageKind::Busy, &run, &fp, 0, &[]);
                let _ = wire::write_frame(&mut stream, &busy, &[]).await;
                let _ = stream.close().await;
            }
        });
        let (beating, clock) = (client.clone(), std::sync::Arc::clone(&clock));
        tokio::spawn(async move {
            loop {
                heartbeat.step = clock.load(std::sync::atomic::Ordering::Relaxed);
                let _ = beating.publish_heartbeat(&heartbeat).await;
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        });
        client
    });
    wait_until(&dir, "the daemon joins with its peer", |s| {
        s["sync"]["role"] == "worker" && s["live_peers"].as_u64() == Some(1)
    });

    let log = a.log.clone();
    // One exchange: offer, read the daemon's snapshot, answer with `reply` (None: decline).
    // The daemon may be in an exchange of its own (it answers `Busy`): offer again.
    let exchange = |reply: &dyn Fn(&[f32]) -> Option<Vec<f32>>| {
        runtime.block_on(async {
            let step = follow();
            let send = |kind, payload: &[f32]| {
                TensorHeader::for_payload(kind, &run_id, &fingerprint, step, payload)
            };
            let expect = Expect {
                run_id: &run_id,
                fingerprint: &fingerprint,
                max_payload_bytes: 1 << 24,
            };
            let start = Instant::now();
            let (mut stream, theirs) = loop {
                let mut stream = client
                    .stream_control()
                    .open_stream(
                        daemon,
                        StreamProtocol::new(murmur_protocol::PARAMS_PROTOCOL),
                    )
                    .await
                    .unwrap();
                wire::write_frame(&mut stream, &send(MessageKind::Offer, &[]), &[])
                    .await
                    .unwrap();
                let mut theirs = Vec::new();
                let header = wire::read_frame(&mut stream, &expect, &mut theirs)
                    .await
                    .unwrap();
                if header.kind == MessageKind::Params {
                    break (stream, theirs);
                }
                assert_eq!(header.kind, MessageKind::Busy);
                assert!(
                    start.elapsed() < DEADLINE,
                    "the daemon stays busy; its log:\n{}",
                    fs::read_to_string(&log).unwrap_or_default()
                );
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            };
            let (kind, ours) = match reply(&theirs) {
                Some(ours) => (MessageKind::Params, ours),
                None => (MessageKind::Busy, Vec::new()),
            };
            wire::write_frame(&mut stream, &send(kind, &ours), &ours)
                .await
                .unwrap();
            let _ = stream.close().await;
        });
    };
    let served = |s: &Value| s["sync"]["served"].as_u64().unwrap();

    exchange(&|_| None);
    exchange(&|theirs| Some(theirs.to_vec()));
    let s = wait_until(&dir, "the completed exchange is counted", |s| {
        served(s) == 1
    });
    assert_eq!(s["sync"]["rejected"], 0, "{s}");
    exchange(&|theirs| {
        let mut bad = theirs.to_vec();
        bad[0] = f32::NAN;
        Some(bad)
    });
    let s = wait_until(&dir, "the NaN answer is rejected", |s| {
        s["sync"]["rejected"].as_u64() == Some(1)
    });
    assert_eq!(served(&s), 1, "{s}");
    drop(client);
    a.leave(&dir);
}
