use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use tokio::time::Instant;

use super::*;
use crate::heartbeat::{HEARTBEAT_VERSION, Role, SyncMode};

const RUN: &str = "sim-run";
const MODEL: &str = "sim-model";
const PROTOCOL: StreamProtocol = StreamProtocol::new("/murmur-test/sim");
const LATENCY: Duration = Duration::from_millis(50);
/// 1 MB/s: a megabyte takes a second on the wire.
const RATE: f64 = 1e6;

fn network() -> SimulatedNetwork {
    SimulatedNetwork::new(RUN, MODEL, Link::new(LATENCY, RATE), 7)
}

fn heartbeat(step: u64) -> Heartbeat {
    Heartbeat {
        sent_ms: unix_ms_now(),
        version: HEARTBEAT_VERSION,
        run_id: RUN.into(),
        fingerprint: MODEL.into(),
        step,
        epoch: 0,
        loss_ema: 2.3,
        samples_seen: step * 64,
        mode: SyncMode::Gossip,
        role: Role::Worker,
        leaving: false,
        finished: false,
        client: false,
    }
}

/// The events that came, without waiting.
fn drain(events: &mut mpsc::Receiver<NetworkEvent>) -> Vec<NetworkEvent> {
    std::iter::from_fn(|| events.try_recv().ok()).collect()
}

fn connected_to(events: &[NetworkEvent]) -> Vec<PeerId> {
    events
        .iter()
        .filter_map(|e| match e {
            NetworkEvent::Connected(peer) => Some(*peer),
            _ => None,
        })
        .collect()
}

fn disconnected_from(events: &[NetworkEvent]) -> Vec<PeerId> {
    events
        .iter()
        .filter_map(|e| match e {
            NetworkEvent::Disconnected(peer) => Some(*peer),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn joined_nodes_connect_and_hear_heartbeats_after_the_latency() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, mut events_a) = net.join(a);
    let (_client_b, mut events_b) = net.join(b);
    assert_eq!(connected_to(&drain(&mut events_a)), vec![b]);
    assert_eq!(connected_to(&drain(&mut events_b)), vec![a]);
    assert_eq!(client_a.connected_peers().await.unwrap(), vec![b]);

    let sent = Instant::now();
    client_a.publish_heartbeat(&heartbeat(3)).await.unwrap();
    let Some(NetworkEvent::Heartbeat { peer, heartbeat }) = events_b.recv().await else {
        panic!("no heartbeat arrived");
    };
    assert_eq!((peer, heartbeat.step), (a, 3));
    assert_eq!(sent.elapsed(), LATENCY);
    assert!(drain(&mut events_a).is_empty(), "a node hears itself");
}

#[tokio::test(start_paused = true)]
async fn a_heartbeat_of_another_run_is_rejected() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, _events_a) = net.join(a);
    let (_client_b, mut events_b) = net.join(b);
    drain(&mut events_b);
    let mut stranger = heartbeat(1);
    stranger.run_id = "another-run".into();
    client_a.try_publish_heartbeat(&stranger).unwrap();
    let event = events_b.recv().await.unwrap();
    assert!(
        matches!(event, NetworkEvent::Rejected { peer, .. } if peer == a),
        "{event:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_takes_as_long_as_its_bytes_on_the_link() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, _events_a) = net.join(a);
    let (client_b, _events_b) = net.join(b);
    let mut incoming = client_b.accept(PROTOCOL).unwrap();
    let payload: Vec<u8> = (0..1_000_000u32).map(|i| i as u8).collect();

    let started = Instant::now();
    let mut stream = client_a.open_stream(b, PROTOCOL).await.unwrap();
    let opened = started.elapsed();
    let expected = payload.clone();
    let receiver = tokio::spawn(async move {
        let (from, mut stream) = incoming.next().await.unwrap();
        let mut received = Vec::new();
        stream.read_to_end(&mut received).await.unwrap();
        stream.write_all(b"ok").await.unwrap();
        stream.close().await.unwrap();
        (from, received == expected)
    });
    stream.write_all(&payload).await.unwrap();
    stream.close().await.unwrap();
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.unwrap();
    let took = started.elapsed();
    assert_eq!(receiver.await.unwrap(), (a, true));
    assert_eq!(answer, b"ok");

    assert_eq!(
        opened,
        Duration::ZERO,
        "opening a stream costs no round trip"
    );
    // One second of wire, the bytes' latency and the answer's.
    let expected = LATENCY * 2 + Duration::from_secs(1);
    let off = took.abs_diff(expected);
    assert!(
        off < Duration::from_millis(5),
        "took {took:?}, not {expected:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_writer_runs_ahead_of_a_slow_link_by_its_window_only() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, _events_a) = net.join(a);
    let (client_b, _events_b) = net.join(b);
    let _incoming = client_b.accept(PROTOCOL).unwrap();
    let mut stream = client_a.open_stream(b, PROTOCOL).await.unwrap();
    let started = Instant::now();
    stream.write_all(&vec![0u8; 2_000_000]).await.unwrap();
    let wrote_in = started.elapsed();
    // Two seconds of wire, less the window that may still be on the way.
    let window = Duration::from_secs_f64(pipe::WINDOW as f64 / RATE);
    let expected = Duration::from_secs(2) - window;
    assert!(
        wrote_in.abs_diff(expected) < Duration::from_millis(70),
        "wrote in {wrote_in:?}, expected about {expected:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_cut_link_disconnects_the_pair_and_breaks_its_streams() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, mut events_a) = net.join(a);
    let (client_b, mut events_b) = net.join(b);
    let mut incoming = client_b.accept(PROTOCOL).unwrap();
    let mut stream = client_a.open_stream(b, PROTOCOL).await.unwrap();
    let (_, mut theirs) = incoming.next().await.unwrap();
    stream.write_all(b"hello").await.unwrap();
    drain(&mut events_a);
    drain(&mut events_b);

    net.set_link(
        a,
        b,
        Link {
            up: false,
            ..net.link(a, b)
        },
    );
    assert_eq!(disconnected_from(&drain(&mut events_a)), vec![b]);
    assert_eq!(disconnected_from(&drain(&mut events_b)), vec![a]);
    let mut buf = [0u8; 5];
    let read = theirs.read_exact(&mut buf).await;
    assert_eq!(
        read.unwrap_err().kind(),
        std::io::ErrorKind::ConnectionReset,
        "the bytes on the way are lost with the link"
    );
    assert!(stream.write_all(b"more").await.is_err());
    let refused = client_a.open_stream(b, PROTOCOL).await;
    assert!(refused.is_err(), "a stream opened over a cut link");

    net.reset_links();
    assert_eq!(connected_to(&drain(&mut events_a)), vec![b]);
    assert!(client_a.open_stream(b, PROTOCOL).await.is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_node_that_leaves_is_gone_for_its_peers() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, mut events_a) = net.join(a);
    let (_client_b, _events_b) = net.join(b);
    drain(&mut events_a);
    net.leave(b);
    assert_eq!(disconnected_from(&drain(&mut events_a)), vec![b]);
    assert!(client_a.connected_peers().await.unwrap().is_empty());
    let refused = client_a.open_stream(b, PROTOCOL).await.unwrap_err();
    assert!(refused.to_string().contains("not connected"), "{refused}");
}

#[tokio::test(start_paused = true)]
async fn a_stream_of_a_protocol_the_peer_does_not_take_is_refused() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, _events_a) = net.join(a);
    let (_client_b, _events_b) = net.join(b);
    let refused = client_a.open_stream(b, PROTOCOL).await.unwrap_err();
    assert!(refused.to_string().contains("does not take"), "{refused}");
}

#[tokio::test(start_paused = true)]
async fn a_blocked_peer_is_disconnected_until_let_back_in() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, mut events_a) = net.join(a);
    let (client_b, mut events_b) = net.join(b);
    drain(&mut events_a);
    client_a.try_block(b).unwrap();
    assert_eq!(disconnected_from(&drain(&mut events_b)), vec![a]);
    client_b.publish_heartbeat(&heartbeat(1)).await.unwrap();
    tokio::time::sleep(LATENCY * 2).await;
    assert!(
        !drain(&mut events_a)
            .iter()
            .any(|e| matches!(e, NetworkEvent::Heartbeat { .. })),
        "a blocked peer's heartbeat arrived"
    );
    client_a.try_unblock(b).unwrap();
    assert_eq!(connected_to(&drain(&mut events_b)), vec![a]);
}

#[tokio::test(start_paused = true)]
async fn a_link_that_loses_every_heartbeat_delivers_none() {
    let net = network();
    let (a, b) = (PeerId::random(), PeerId::random());
    let (client_a, _events_a) = net.join(a);
    let (_client_b, mut events_b) = net.join(b);
    net.set_link(
        a,
        b,
        Link {
            heartbeat_loss: 1.0,
            ..net.link(a, b)
        },
    );
    drain(&mut events_b);
    for step in 0..10 {
        client_a.publish_heartbeat(&heartbeat(step)).await.unwrap();
    }
    tokio::time::sleep(LATENCY * 2).await;
    assert!(drain(&mut events_b).is_empty());
}
