//! A node that peers cannot dial, on the memory transport: AutoNAT finds it private, it listens
//! through a relay among its peers, and a peer reaches it through that relay. Every wait has a
//! deadline.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::time::Duration;

use murmur_protocol::network::{
    self, Client, ConnectionKind, Keypair, Multiaddr, NetworkConfig, NetworkEvent, PeerId, Reach,
    Reachability, RelayLimits, TransportKind, is_relayed,
};
use tokio::sync::mpsc;

const DEADLINE: Duration = Duration::from_secs(45);

struct Node {
    client: Client,
    events: mpsc::Receiver<NetworkEvent>,
}

fn config(listen: Option<&str>, relay: bool) -> NetworkConfig {
    let mut config = NetworkConfig::new(Keypair::generate_ed25519(), "run-1", "abcd");
    config.transport = TransportKind::Memory;
    config.mdns = false;
    config.listen = listen.map(|a| a.parse().unwrap()).into_iter().collect();
    config.gossip_interval = Duration::from_millis(100);
    config.relay = relay.then(RelayLimits::default);
    config
}

/// Starts a node; with `listen`, returns once it listens, with its address.
async fn start(config: NetworkConfig) -> (Node, Option<Multiaddr>) {
    let listens = !config.listen.is_empty();
    let (client, mut events, event_loop) = network::new(config).unwrap();
    tokio::spawn(event_loop.run(std::future::pending()));
    let addr = if listens {
        let addr = tokio::time::timeout(DEADLINE, network::listen_address(&mut events))
            .await
            .ok()
            .flatten()
            .expect("the node never listened");
        Some(addr)
    } else {
        None
    };
    (Node { client, events }, addr)
}

/// Waits for the node's reach to satisfy `wanted`, passing over other events.
async fn reach_until(node: &mut Node, what: &str, wanted: impl Fn(&Reach) -> bool) -> Reach {
    let mut last = Reach::default();
    let found = tokio::time::timeout(DEADLINE, async {
        while let Some(event) = node.events.recv().await {
            if let NetworkEvent::Reach(reach) = event {
                if wanted(&reach) {
                    return Some(reach);
                }
                last = reach;
            }
        }
        None
    })
    .await;
    match found {
        Ok(Some(reach)) => reach,
        _ => panic!("{what}: not within {DEADLINE:?}; the last reach was {last:?}"),
    }
}

/// Waits until the node tells how it is connected to `peer`, passing over other events.
async fn link_to(node: &mut Node, peer: PeerId) -> ConnectionKind {
    let found = tokio::time::timeout(DEADLINE, async {
        while let Some(event) = node.events.recv().await {
            if let NetworkEvent::Link { peer: p, kind } = event
                && p == peer
            {
                return Some(kind);
            }
        }
        None
    })
    .await;
    found
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("no word of a connection to {peer} within {DEADLINE:?}"))
}

/// Keeps taking a node's events, so that its queue never fills.
fn drain(mut node: Node) -> Client {
    let client = node.client.clone();
    tokio::spawn(async move { while node.events.recv().await.is_some() {} });
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_nobody_can_dial_is_found_private_and_reached_through_a_relay() {
    let (mut relay, relay_addr) = start(config(Some("/memory/0"), true)).await;
    let relay_addr = relay_addr.unwrap();
    let (dialable, dialable_addr) = start(config(Some("/memory/0"), false)).await;
    // Listens nowhere: the address a peer sees its connections come from leads nowhere, like
    // a port of a NAT that lets nothing in.
    let (mut hidden, _) = start(config(None, false)).await;

    // AutoNAT asks only peers this node dialled to dial it back, so the relay dials one.
    relay
        .client
        .dial(dialable_addr.clone().unwrap())
        .await
        .unwrap();
    hidden.client.dial(relay_addr.clone()).await.unwrap();
    hidden.client.dial(dialable_addr.unwrap()).await.unwrap();
    let dialable = drain(dialable);

    // The relay serves once a peer has dialled it back: it is public.
    let relay_reach = reach_until(&mut relay, "the relay found public", |r| {
        r.reachability == Reachability::Public
    })
    .await;
    assert!(!relay_reach.confirmed.is_empty(), "{relay_reach:?}");
    let relay_client = drain(relay);

    let reach = reach_until(
        &mut hidden,
        "the hidden node listening through the relay",
        |r| r.reachability == Reachability::Private && !r.relayed.is_empty(),
    )
    .await;
    assert!(reach.confirmed.is_empty(), "{reach:?}");
    let hidden_id = hidden.client.peer_id();
    let through_relay = reach.relayed[0].clone();
    assert!(
        through_relay
            .to_string()
            .contains(&relay_client.peer_id().to_string()),
        "{through_relay} is not through the relay"
    );

    // A peer with no direct address for it reaches it through the relay.
    let (newcomer, _) = start(config(Some("/memory/0"), false)).await;
    let newcomer = drain(newcomer);
    assert!(
        through_relay.to_string().ends_with(&hidden_id.to_string()),
        "{through_relay} does not name the hidden node"
    );
    newcomer.dial(through_relay).await.unwrap();
    // The hidden node took that connection on the address it listens on through the relay: it
    // knows it for a relayed one, and tells the node so.
    assert_eq!(
        link_to(&mut hidden, newcomer.peer_id()).await,
        ConnectionKind::Relayed
    );
    let connected = tokio::time::timeout(DEADLINE, async {
        loop {
            let open = newcomer.connections().await.unwrap();
            if let Some((_, addrs)) = open.iter().find(|(peer, _)| *peer == hidden_id) {
                return addrs.clone();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("the newcomer never connected to the hidden node through the relay");
    assert!(
        connected.iter().all(is_relayed),
        "the newcomer's connections to the hidden node: {connected:?}"
    );
    drop(dialable);
}

/// Over QUIC a node behind NAT could not be found: it tells its peers the address it listens
/// at through a relay by an identify push, and over QUIC the push is lost (the pushing side
/// drops the stream unread, QUIC stops it, and the receiving side's protocol negotiation
/// fails). The relay now puts that address in the DHT when it grants the reservation: a peer
/// that knows only the relay finds the hidden node in a lookup and reaches it through the
/// relay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_quic_a_node_behind_nat_is_found_in_the_dht_through_its_relay() {
    let quic = |listen: Option<&str>, relay: bool| {
        let mut config = config(listen, relay);
        config.transport = TransportKind::TcpQuic;
        config.discovery_interval = Duration::from_secs(1);
        config
    };
    // A public relay declares its address (docs/operations.md), so it relays from the start:
    // the hop protocol it lists once it is public would reach peers by a push too.
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("/ip4/127.0.0.1/udp/{port}/quic-v1");
    let mut relay_config = quic(Some(&listen), true);
    relay_config.external_addrs = vec![listen.parse().unwrap()];
    let (relay, relay_addr) = start(relay_config).await;
    let relay_addr = relay_addr.unwrap();
    let relay = drain(relay);
    let (dialable, dialable_addr) = start(quic(Some("/ip4/127.0.0.1/udp/0/quic-v1"), false)).await;
    let dialable = drain(dialable);
    // Listens nowhere: it dials from a socket that takes no connections, as behind a NAT.
    let (mut hidden, _) = start(quic(None, false)).await;
    hidden.client.dial(relay_addr.clone()).await.unwrap();
    hidden.client.dial(dialable_addr.unwrap()).await.unwrap();
    reach_until(
        &mut hidden,
        "the hidden node listening through the relay",
        |r| r.reachability == Reachability::Private && !r.relayed.is_empty(),
    )
    .await;
    let hidden_id = hidden.client.peer_id();
    let hidden = drain(hidden);

    // The newcomer is given the relay only and is behind NAT too, so that neither can dial
    // the other and neither heard the other's relayed address but from the relay.
    let mut joining = quic(None, false);
    joining.bootstrap = vec![relay_addr];
    let (mut newcomer, _) = start(joining).await;
    assert_eq!(
        link_to(&mut newcomer, hidden_id).await,
        ConnectionKind::Relayed,
        "the newcomer met the hidden node other than through the relay"
    );
    drop((dialable, relay, hidden, newcomer));
}
