//! Ring all-reduce through full network stacks: set-up over libp2p (memory transport), data on
//! either plane, and the trust checks. Every wait has a deadline.

#![allow(clippy::unwrap_used)] // test helpers may panic on failure

use std::time::Duration;

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use murmur_protocol::RING_PROTOCOL;
use murmur_protocol::network::{
    self, Client, Keypair, Multiaddr, NetworkConfig, NetworkEvent, PeerId, StreamProtocol,
    TransportKind,
};
use murmur_protocol::ring::data_plane::{self, TcpDataListener};
use murmur_protocol::ring::{self, Attempt, DataPlane, RingError, RingSchedule};
use murmur_protocol::trust::TrustList;
use tokio::sync::mpsc;

const RUN: &str = "run-1";
const DEADLINE: Duration = Duration::from_secs(30);

struct Node {
    client: Client,
    /// Peers this node connected to, in order. The network's own event channel is drained
    /// by a task, so that a test that stops watching never stalls the network.
    connections: mpsc::Receiver<PeerId>,
    /// Peers taken out of `connections` so far.
    seen: Vec<PeerId>,
    addr: Multiaddr,
}

async fn start(keypair: Keypair, allowlist: Option<Vec<PeerId>>) -> Node {
    let mut config = NetworkConfig::new(keypair, RUN, "abcd");
    config.transport = TransportKind::Memory;
    config.mdns = false;
    config.listen = vec!["/memory/0".parse().unwrap()];
    config.allowlist = allowlist;
    let (client, mut events, event_loop) = network::new(config).unwrap();
    tokio::spawn(event_loop.run(std::future::pending()));
    let addr = tokio::time::timeout(DEADLINE, network::listen_address(&mut events))
        .await
        .ok()
        .flatten()
        .expect("node never listened");
    let (connected, connections) = mpsc::channel(64);
    tokio::spawn(async move {
        while let Some(event) = events.recv().await {
            if let NetworkEvent::Connected(peer) = event {
                let _ = connected.try_send(peer);
            }
        }
    });
    Node {
        client,
        connections,
        seen: Vec::new(),
        addr,
    }
}

/// Waits until `node` has reported a connection to `peer` (now or earlier).
async fn connected(node: &mut Node, peer: PeerId) {
    tokio::time::timeout(DEADLINE, async {
        while !node.seen.contains(&peer) {
            let p = node.connections.recv().await.expect("network stopped");
            node.seen.push(p);
        }
    })
    .await
    .expect("never connected");
}

/// Two nodes, `b` dialled by `a`, each having seen the other's connection.
async fn connected_pair() -> (Node, Node) {
    let mut a = start(Keypair::generate_ed25519(), None).await;
    let mut b = start(Keypair::generate_ed25519(), None).await;
    let (a_id, b_id) = (a.client.peer_id(), b.client.peer_id());
    a.client.dial(b.addr.clone()).await.unwrap();
    connected(&mut a, b_id).await;
    connected(&mut b, a_id).await;
    (a, b)
}

/// Takes `node`'s incoming ring streams and holds them unanswered, as a member at another
/// attempt does: an attempt whose right neighbour this is waits on its answer.
fn hold_ring_streams(node: &Node) {
    let mut incoming = node
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(stream) = incoming.next().await {
            held.push(stream);
        }
    });
}

/// Three connected nodes; each all-reduces its own values twice on `plane`.
async fn three_member_ring(plane: DataPlane) {
    let mut nodes = Vec::new();
    for _ in 0..3 {
        nodes.push(start(Keypair::generate_ed25519(), None).await);
    }
    for (i, j) in [(0, 1), (0, 2), (1, 2)] {
        let (addr, peer) = (nodes[j].addr.clone(), nodes[j].client.peer_id());
        nodes[i].client.dial(addr).await.unwrap();
        connected(&mut nodes[i], peer).await;
        // The listener may open the first ring stream: it must have the connection too, or
        // libp2p tries to dial a peer it has no address for.
        let dialer = nodes[i].client.peer_id();
        connected(&mut nodes[j], dialer).await;
    }
    let peers: Vec<PeerId> = nodes.iter().map(|n| n.client.peer_id()).collect();
    // Every node accepts ring streams before any opens one.
    let incoming: Vec<_> = nodes
        .iter()
        .map(|n| n.client.accept(StreamProtocol::new(RING_PROTOCOL)).unwrap())
        .collect();
    let mut tasks = Vec::new();
    for ((index, node), mut incoming) in nodes.iter().enumerate().zip(incoming) {
        let client = node.client.clone();
        let peers = peers.clone();
        tasks.push(tokio::spawn(async move {
            let me = client.peer_id();
            let trust = TrustList::new(peers.iter().copied().filter(|p| *p != me));
            let members = trust.ring(RUN, me, peers.iter().copied());
            let tcp = match plane {
                DataPlane::Tcp => Some(
                    TcpDataListener::bind(([127, 0, 0, 1], 0).into())
                        .await
                        .unwrap(),
                ),
                DataPlane::Libp2p => None,
            };
            let mut links = data_plane::connect_ring(
                &client,
                &mut incoming,
                &mut None,
                &trust,
                RUN,
                &members,
                me,
                plane,
                tcp.as_ref(),
                Attempt::first(0),
            )
            .await
            .unwrap();
            let rank = members.rank_of(&me).unwrap();
            let mut values = vec![index as f32 + 1.0; 10_001];
            for round in 0..2 {
                let schedule = RingSchedule::new(rank, 3, values.len(), 1000);
                let (_, kept) =
                    ring::all_reduce(schedule, round, members.hash(), &mut values, links)
                        .await
                        .unwrap();
                links = kept;
            }
            values
        }));
    }
    for task in tasks {
        let values = tokio::time::timeout(DEADLINE, task).await.unwrap().unwrap();
        // 1 + 2 + 3 = 6, then 3 x 6.
        assert!(values.iter().all(|&v| v == 18.0), "{:?}", &values[..3]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_peers_all_reduce_over_libp2p_streams() {
    three_member_ring(DataPlane::Libp2p).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_peers_all_reduce_over_token_admitted_tcp() {
    three_member_ring(DataPlane::Tcp).await;
}

/// A left neighbour's stream from an attempt it gave up on may still be queued when the next
/// attempt starts (libp2p queues one incoming stream per protocol): the right member skips it
/// and takes the stream of this attempt, rather than abort on the dead one, and the next
/// attempt on this one's, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_of_an_abandoned_attempt_is_skipped() {
    const FLUSH: StreamProtocol = StreamProtocol::new("/murmur-test/flush");
    let (left, right) = connected_pair().await;
    let (right_id, left_id) = (right.client.peer_id(), left.client.peer_id());
    let members = ring::RingMembers::new(RUN, vec![right_id, left_id]);
    let trust = TrustList::new([right_id, left_id]);
    let right_client = right.client.clone();
    let incoming = right
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    let mut flushes = right.client.accept(FLUSH).unwrap();

    // The left's first attempt says hello and is abandoned before the right answers: its
    // stream is reset. A stream opened after it on the same connection arrives after the reset.
    let left_client = left.client.clone();
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        data_plane::connect_right(
            &left_client,
            RUN,
            &members,
            right_id,
            DataPlane::Libp2p,
            Attempt::first(0),
        ),
    )
    .await;
    assert!(abandoned.is_err(), "the right member answered nothing yet");
    let mut flush = left_client.open_stream(right_id, FLUSH).await.unwrap();
    // Streams settle their protocol lazily: the proposal goes out with the first flush.
    flush.flush().await.unwrap();
    tokio::time::timeout(DEADLINE, flushes.next())
        .await
        .unwrap();

    // The right member's attempt takes the dead stream first; once it did, the left's next
    // attempt opens its stream. (The left accepts ring streams before the right opens one.)
    let mut left_incoming = left
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    let (took, taken) = tokio::sync::oneshot::channel();
    let mut took = Some(took);
    let mut incoming = incoming.inspect(move |_| {
        if let Some(took) = took.take() {
            let _ = took.send(());
        }
    });
    let right_members = members.clone();
    let right_trust = trust.clone();
    let right_side = tokio::spawn(async move {
        data_plane::connect_ring(
            &right_client,
            &mut incoming,
            &mut None,
            &right_trust,
            RUN,
            &right_members,
            right_id,
            DataPlane::Libp2p,
            None,
            Attempt::first(0),
        )
        .await
    });
    tokio::time::timeout(DEADLINE, taken)
        .await
        .unwrap()
        .unwrap();
    let left_links = tokio::time::timeout(
        DEADLINE,
        data_plane::connect_ring(
            &left_client,
            &mut left_incoming,
            &mut None,
            &trust,
            RUN,
            &members,
            left_id,
            DataPlane::Libp2p,
            None,
            Attempt::first(0),
        ),
    )
    .await
    .unwrap()
    .unwrap();
    let right_links = tokio::time::timeout(DEADLINE, right_side)
        .await
        .unwrap()
        .unwrap()
        .expect("the dead stream must be skipped");

    // The links carry a round.
    let run = |links, me: PeerId, value: f32| {
        let members = members.clone();
        tokio::spawn(async move {
            let rank = members.rank_of(&me).unwrap();
            let mut values = vec![value; 1001];
            let schedule = RingSchedule::new(rank, 2, values.len(), 100);
            ring::all_reduce(schedule, 0, members.hash(), &mut values, links)
                .await
                .unwrap();
            values
        })
    };
    let (a, b) = (
        run(right_links, right_id, 1.0),
        run(left_links, left_id, 2.0),
    );
    for task in [a, b] {
        let values = tokio::time::timeout(DEADLINE, task).await.unwrap().unwrap();
        assert!(values.iter().all(|&v| v == 3.0), "{:?}", &values[..3]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_peer_cannot_open_a_ring_connection() {
    let (stranger, mut host) = connected_pair().await;
    let (host_id, stranger_id) = (host.client.peer_id(), stranger.client.peer_id());

    // The host trusts somebody else, its neighbour both ways, who holds the host's stream
    // unanswered (the host's attempt stays open); the stranger claims to be its left
    // neighbour in a ring that it made up, with itself in it.
    let mut friend_node = start(Keypair::generate_ed25519(), None).await;
    let friend = friend_node.client.peer_id();
    host.client.dial(friend_node.addr.clone()).await.unwrap();
    connected(&mut host, friend).await;
    connected(&mut friend_node, host_id).await;
    hold_ring_streams(&friend_node);
    let trust = TrustList::new([friend]);
    let claimed = ring::RingMembers::new(RUN, vec![host_id, stranger_id]);
    let host_client = host.client.clone();
    let mut incoming = host
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    let host_side = tokio::spawn(async move {
        let members = trust.ring(RUN, host_id, [friend]);
        tokio::time::timeout(
            Duration::from_secs(2),
            data_plane::connect_ring(
                &host_client,
                &mut incoming,
                &mut None,
                &trust,
                RUN,
                &members,
                host_id,
                DataPlane::Libp2p,
                None,
                Attempt::first(0),
            ),
        )
        .await
    });
    let refused = data_plane::connect_right(
        &stranger.client,
        RUN,
        &claimed,
        host_id,
        DataPlane::Libp2p,
        Attempt::first(0),
    )
    .await
    .err()
    .expect("the stranger must be refused");
    assert!(refused.to_string().contains("trust list"), "{refused}");
    // The host took no link from it: it still waits for its trusted neighbour.
    let waited = tokio::time::timeout(DEADLINE, host_side)
        .await
        .unwrap()
        .unwrap();
    assert!(
        waited.is_err(),
        "the host connected a ring with the stranger"
    );
}

/// `connect_ring` on the libp2p plane for `me` in `members` at `attempt`.
async fn connect_at(
    client: &network::Client,
    incoming: &mut network::Incoming,
    held: &mut Option<data_plane::HeldHello>,
    trust: &TrustList,
    members: &ring::RingMembers,
    me: PeerId,
    attempt: Attempt,
) -> Result<ring::RingLinks<data_plane::DataReader, data_plane::DataWriter>, RingError> {
    data_plane::connect_ring(
        client,
        incoming,
        held,
        trust,
        RUN,
        members,
        me,
        DataPlane::Libp2p,
        None,
        attempt,
    )
    .await
}

/// Attempt `number` at round 7.
fn at(number: u32) -> Attempt {
    Attempt { round: 7, number }
}

/// A ring of two for tests of the right member's attempts. The left member only opens
/// ([`LeftOpens::open_at`]) and holds the right's own hellos unanswered, so that the right's
/// attempts end by what their left side reads alone: an attempt ends at the first failure of
/// either side.
struct LeftOpens {
    left: Node,
    _right: Node,
    right_id: PeerId,
    members: ring::RingMembers,
    trust: TrustList,
    right_client: network::Client,
    right_incoming: network::Incoming,
}

impl LeftOpens {
    async fn new() -> Self {
        let (left, right) = connected_pair().await;
        let (right_id, left_id) = (right.client.peer_id(), left.client.peer_id());
        let right_incoming = right
            .client
            .accept(StreamProtocol::new(RING_PROTOCOL))
            .unwrap();
        hold_ring_streams(&left);
        LeftOpens {
            members: ring::RingMembers::new(RUN, vec![right_id, left_id]),
            trust: TrustList::new([right_id, left_id]),
            right_client: right.client.clone(),
            right_incoming,
            right_id,
            left,
            _right: right,
        }
    }

    /// The left member opens a connection to the right at attempt `number`.
    fn open_at(
        &self,
        number: u32,
    ) -> tokio::task::JoinHandle<Result<data_plane::DataWriter, RingError>> {
        let left_client = self.left.client.clone();
        let (members, right_id) = (self.members.clone(), self.right_id);
        tokio::spawn(async move {
            data_plane::connect_right(
                &left_client,
                RUN,
                &members,
                right_id,
                DataPlane::Libp2p,
                at(number),
            )
            .await
        })
    }

    /// The right member's attempt `number`, given up after `within`.
    async fn attempt(
        &mut self,
        held: &mut Option<data_plane::HeldHello>,
        number: u32,
        within: Duration,
    ) -> Result<
        Result<ring::RingLinks<data_plane::DataReader, data_plane::DataWriter>, RingError>,
        tokio::time::error::Elapsed,
    > {
        tokio::time::timeout(
            within,
            connect_at(
                &self.right_client,
                &mut self.right_incoming,
                held,
                &self.trust,
                &self.members,
                self.right_id,
                at(number),
            ),
        )
        .await
    }
}

/// Attempts are numbered: a hello of a later attempt ends the attempt under way
/// (`Superseded`) and is the first taken by the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_attempt_supersedes_and_is_taken_first_by_the_next() {
    let mut ring = LeftOpens::new().await;

    // The left member opens at attempt 2, the right is at 1: the right's attempt is
    // superseded, and the hello is kept for its next attempt.
    let opened = ring.open_at(2);
    let mut held = None;
    let first = ring.attempt(&mut held, 1, DEADLINE).await.unwrap();
    assert!(
        matches!(first, Err(RingError::Superseded { by }) if by == at(2)),
        "{:?}",
        first.err()
    );
    assert!(held.is_some(), "the later hello is kept");
    // The next attempt, at 2, takes the kept hello first and binds it: the left's opener is
    // accepted. (The attempt itself waits on its own hello, which the left holds.)
    let second =
        tokio::spawn(async move { ring.attempt(&mut held, 2, Duration::from_secs(2)).await });
    let accepted = tokio::time::timeout(DEADLINE, opened)
        .await
        .unwrap()
        .unwrap();
    assert!(accepted.is_ok(), "{:?}", accepted.err());
    assert!(
        tokio::time::timeout(DEADLINE, second)
            .await
            .unwrap()
            .unwrap()
            .is_err(),
        "no ring without the right's own connection"
    );
}

/// A hello of an earlier attempt is refused, and its opener learns it is behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_earlier_attempt_is_refused_and_told_it_is_behind() {
    let mut ring = LeftOpens::new().await;
    let behind = ring.open_at(1);
    let third = ring.attempt(&mut None, 3, Duration::from_secs(2)).await;
    assert!(third.is_err(), "no link from a stale hello");
    let told = tokio::time::timeout(DEADLINE, behind)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(told, Err(RingError::Superseded { by }) if by == at(3)),
        "{:?}",
        told.err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allowlisted_node_refuses_strangers_at_connection_time() {
    let friend_key = Keypair::generate_ed25519();
    let friend_id = friend_key.public().to_peer_id();
    let mut host = start(Keypair::generate_ed25519(), Some(vec![friend_id])).await;
    let host_id = host.client.peer_id();
    let stranger = start(Keypair::generate_ed25519(), None).await;
    let friend = start(friend_key, None).await;

    // The stranger cannot reach the host: the host denies every connection from a peer that
    // is not on its list. The stranger's side may still open a stream in the instant before
    // the denial reaches it (a stream is announced with its first frame), but such a stream
    // ends with the connection and carries nothing.
    stranger.client.dial(host.addr.clone()).await.unwrap();
    let attempt = tokio::time::timeout(
        DEADLINE,
        stranger
            .client
            .open_stream(host_id, StreamProtocol::new(RING_PROTOCOL)),
    )
    .await
    .unwrap();
    if let Ok(mut stream) = attempt {
        let mut byte = [0u8; 1];
        let read = tokio::time::timeout(DEADLINE, stream.read(&mut byte))
            .await
            .expect("a stranger's stream to an allowlisted node stayed open");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "a stranger's stream to an allowlisted node carried data"
        );
    }

    friend.client.dial(host.addr.clone()).await.unwrap();
    connected(&mut host, friend_id).await;
    assert!(
        !host.seen.contains(&stranger.client.peer_id()),
        "the allowlisted node reported a connection to the stranger"
    );
    let peers = host.client.connected_peers().await.unwrap();
    assert_eq!(peers, vec![friend_id]);
}

/// An attempt ends as soon as either of its connections fails: refused by its right
/// neighbour (here for another membership), it does not wait on for a left neighbour that
/// never opens (here one that is not running), which held it to the ring timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_from_the_right_ends_the_attempt_while_the_left_is_silent() {
    let (one, other) = connected_pair().await;
    // Members sort by their id's bytes, and a random id (an identity multihash) sorts before
    // any key's: the ring runs absent -> me -> right -> absent when `me` sorts first of the two.
    let (me, right) = if one.client.peer_id().to_bytes() < other.client.peer_id().to_bytes() {
        (one, other)
    } else {
        (other, one)
    };
    let (me_id, right_id) = (me.client.peer_id(), right.client.peer_id());
    // A third member, never started, that is this member's left neighbour.
    let absent = PeerId::random();
    let members = ring::RingMembers::new(RUN, vec![me_id, right_id, absent]);
    let rank = members.rank_of(&me_id).unwrap();
    assert_eq!(members.right_of(rank), right_id, "{members:?}");
    assert_eq!(members.left_of(rank), absent, "{members:?}");
    let trust = TrustList::new([me_id, right_id, absent]);
    // The right member rounds in a ring of the two of them only.
    let (right_client, right_trust) = (right.client.clone(), trust.clone());
    let mut right_incoming = right
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    let pair = ring::RingMembers::new(RUN, vec![me_id, right_id]);
    let right_side = tokio::spawn(async move {
        tokio::time::timeout(
            DEADLINE,
            connect_at(
                &right_client,
                &mut right_incoming,
                &mut None,
                &right_trust,
                &pair,
                right_id,
                Attempt::first(3),
            ),
        )
        .await
    });
    let mut incoming = me
        .client
        .accept(StreamProtocol::new(RING_PROTOCOL))
        .unwrap();
    let ended = tokio::time::timeout(
        DEADLINE,
        connect_at(
            &me.client,
            &mut incoming,
            &mut None,
            &trust,
            &members,
            me_id,
            Attempt::first(3),
        ),
    )
    .await
    .expect("the attempt must end once its right neighbour refused it");
    // The refusal; or the refuser's own attempt ended first, and this member's stream found
    // it closed, or, negotiated lazily after the refuser stopped taking ring streams, refused
    // (an I/O error: seen once in a loaded test run).
    assert!(
        matches!(
            &ended,
            Err(RingError::Setup(_) | RingError::Closed | RingError::Io(_))
        ),
        "{:?}",
        ended.err()
    );
    let right_ended = tokio::time::timeout(DEADLINE, right_side)
        .await
        .unwrap()
        .unwrap();
    assert!(
        matches!(right_ended, Ok(Err(_))),
        "the right member's attempt fails too"
    );
}
