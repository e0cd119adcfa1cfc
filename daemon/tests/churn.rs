//! A node that lives through churn must hold no more for each connection it has seen close:
//! a daemon of a long run sees peers restart, dials cross and connections renewed all the time.
//! This test binary counts its own heap with `nodectl`'s allocator, so it sees what the
//! network stack keeps, byte for byte. Every wait has a deadline.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::time::{Duration, Instant};

use murmur_daemon::allocator::{Counting, held_bytes};
use murmur_protocol::network::{
    self, Client, Keypair, Multiaddr, NetworkConfig, NetworkEvent, TransportKind,
};
use tokio::sync::{mpsc, oneshot};

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const DEADLINE: Duration = Duration::from_secs(20);

/// A node on the memory transport; it listens if `listen` is given.
fn config(key: Keypair, listen: Option<&str>) -> NetworkConfig {
    let mut config = NetworkConfig::new(key, "run-churn", "abcd");
    config.transport = TransportKind::Memory;
    config.mdns = false;
    config.listen = listen.iter().map(|addr| addr.parse().unwrap()).collect();
    config.linger = Duration::ZERO;
    config
}

/// Waits until `node` has `want` connections to `peer`; `what` names the wait in the failure.
async fn await_connections(node: &Client, peer: network::PeerId, want: usize, what: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let open = node.connections().await.unwrap();
        let have = open
            .iter()
            .find(|(p, _)| *p == peer)
            .map_or(0, |(_, remotes)| remotes.len());
        if have == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {have} connections, not {want}, after {DEADLINE:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Drops whatever `events` holds, so that a full queue is not counted as growth.
fn drain(events: &mut mpsc::Receiver<NetworkEvent>) {
    while events.try_recv().is_ok() {}
}

/// One peer, the same identity each time, connects to `node` (at `addr`) and goes away, `times`
/// times; the peer's whole stack is dropped each time, so what the process holds after is
/// `node`'s.
async fn churn(
    node: &Client,
    addr: &Multiaddr,
    events: &mut mpsc::Receiver<NetworkEvent>,
    times: usize,
) {
    let key = Keypair::generate_ed25519();
    let peer = key.public().to_peer_id();
    for _ in 0..times {
        let (client, peer_events, event_loop) = network::new(config(key.clone(), None)).unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(event_loop.run(async {
            let _ = stopped.await;
        }));
        client.dial(addr.clone()).await.unwrap();
        await_connections(node, peer, 1, "the peer dialled").await;
        drop((client, peer_events));
        let _ = stop.send(());
        tokio::time::timeout(DEADLINE, task)
            .await
            .expect("the peer's network task did not stop")
            .unwrap();
        await_connections(node, peer, 0, "the peer went away").await;
        drain(events);
    }
}

/// What the node holds grows by less than 40 bytes for each connection that opened and closed,
/// over 300 of them after a warm-up. libp2p-stream 0.5.0-alpha kept each closed connection's
/// channel, some 300 bytes (vendor/libp2p-stream, decision 0063): a daemon's held bytes rose
/// through every long soak.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_that_closed_leave_nothing_held() {
    const WARM_UP: usize = 50;
    const MEASURED: usize = 300;
    const MOST_PER_CONNECTION: f64 = 40.0;
    let (node, mut events, event_loop) =
        network::new(config(Keypair::generate_ed25519(), Some("/memory/0"))).unwrap();
    tokio::spawn(event_loop.run(std::future::pending()));
    let addr = tokio::time::timeout(DEADLINE, network::listen_address(&mut events))
        .await
        .ok()
        .flatten()
        .expect("the node never listened");

    churn(&node, &addr, &mut events, WARM_UP).await;
    let before = held_bytes().expect("the counting allocator is installed");
    churn(&node, &addr, &mut events, MEASURED).await;
    let after = held_bytes().unwrap();

    let per_connection = (after as f64 - before as f64) / MEASURED as f64;
    println!(
        "{{\"held_before\":{before},\"held_after\":{after},\"connections\":{MEASURED},\
         \"bytes_per_connection\":{per_connection:.1}}}"
    );
    assert!(
        per_connection < MOST_PER_CONNECTION,
        "the node holds {per_connection:.1} bytes more for each connection that closed \
         ({before} bytes held after {WARM_UP} connections, {after} after {MEASURED} more)"
    );
}
