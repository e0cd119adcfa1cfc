//! The composed libp2p behaviour and the swarm builder.

use std::time::Duration;

use libp2p::core::ConnectedPoint;
use libp2p::core::Transport as _;
use libp2p::core::transport::{MemoryTransport, map::Map};
use libp2p::core::upgrade::Version;
use libp2p::gossipsub::{self, IdentTopic, MessageAuthenticity, ValidationMode};
use libp2p::kad::{self, store::MemoryStore};
use libp2p::swarm::{NetworkBehaviour, Swarm, behaviour::toggle::Toggle};
use libp2p::tcp::tokio::TcpStream;
use libp2p::{
    StreamProtocol, allow_block_list, autonat, connection_limits, dcutr, identify, mdns,
    memory_connection_limits, noise, ping, relay, tcp, yamux,
};

use super::reachability::RelayLimits;
use super::{NetworkConfig, NetworkError, TransportKind};
use crate::heartbeat::MAX_HEARTBEAT_BYTES;

/// Protocol of Murmur's own Kademlia DHT (kept apart from any public one).
pub(crate) const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/murmur/kad/1.0.0");
/// Identify protocol version string.
const IDENTIFY_PROTOCOL: &str = "/murmur/id/1.0.0";
/// The longest a TCP connection may take to set up (connect, Noise, Yamux): QUIC's handshake
/// timeout, and below AutoNAT's 10 s for a dial-back request.
const CONNECTION_SETUP_TIMEOUT: Duration = Duration::from_secs(5);
/// A process killed without closing its QUIC connections (UDP has no FIN) leaves them open on
/// the other side until they time out; found dead, they start a reconnect (see
/// `ConnectionTracker::on_closed`). QUIC's keep-alives find a dead one within its idle timeout,
/// 5 s rather than libp2p's 10 s, well inside the heartbeat peer timeout.
const QUIC_IDLE_TIMEOUT_MS: u32 = 5_000;
const QUIC_KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Streams a peer may have open to this node at once on one QUIC connection (libp2p's default
/// is 256): Murmur serves a peer two exchange streams at a time, beside gossipsub, identify,
/// Kademlia and ping. QUIC keeps the receive buffers of closed streams for reuse, each as large
/// as the most data it ever held unread; a peer allowed hundreds of streams could have this
/// node keep hundreds of such buffers per connection, and a busy swarm grows them slowly for
/// as long as its connections last.
const QUIC_MAX_STREAMS: u32 = 16;
/// Unread bytes one QUIC stream may hold (libp2p's default 10 MB), and one connection (15 MB):
/// a stream's window of 1 MB carries 80 Mbit/s over a 100 ms round trip, more than the
/// internet links Murmur runs on, and bounds what a peer can park in this node's memory (a
/// pooled buffer holds as many chunks as its stream held unread).
const QUIC_STREAM_WINDOW_BYTES: u32 = 1 << 20;
const QUIC_CONNECTION_WINDOW_BYTES: u32 = 4 << 20;
/// The most bytes a TCP socket holds that it has not sent yet (`TCP_NOTSENT_LOWAT`; Linux's
/// own bound is the send buffer, up to 4 MB). An exchange's two frames cross one connection at
/// once, each way, multiplexed by yamux, and the window updates that let one frame go on are
/// written behind the other frame's data: with megabytes waiting in the send buffer they came
/// a third of a second late at 100 Mbit/s, and the frames stalled by turns (decision 0088).
/// 128 KiB waits 10 ms at 100 Mbit/s and 0.2 s at 5 Mbit/s.
const TCP_UNSENT_BYTES: u32 = 128 * 1024;
/// Pings find a dead TCP connection (a host that vanished without a FIN or RST), which nothing
/// else would for many minutes: libp2p reports the second failed ping in a row (it forgives the
/// first), some 15 s after the peer went silent, and the pair connects afresh (a relayed
/// connection or a dial-back is closed instead; see `ConnectionTracker::on_ping_failed`).
const PING_INTERVAL: Duration = Duration::from_secs(2);
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest gossipsub frame, control messages included (libp2p's default).
const MAX_GOSSIP_FRAME_BYTES: usize = 64 * 1024;
/// The most message ids a peer advertises to another per gossip round: some 36 KB, inside
/// a frame.
const MAX_GOSSIP_IDS_SENT: usize = 512;
/// How long gossipsub remembers a message id to drop copies of it (libp2p's default is
/// 60 s): a mesh of three forwards a heartbeat across the swarm within a few periods.
const DUPLICATE_CACHE_TIME: Duration = Duration::from_secs(15);

#[derive(NetworkBehaviour)]
pub(crate) struct Behaviour {
    pub(crate) blocked: allow_block_list::Behaviour<allow_block_list::BlockedPeers>,
    /// With a trust allowlist: every peer not on it is refused at connection time.
    pub(crate) allowed: Toggle<allow_block_list::Behaviour<allow_block_list::AllowedPeers>>,
    pub(crate) limits: connection_limits::Behaviour,
    pub(crate) memory: memory_connection_limits::Behaviour,
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) kad: kad::Behaviour<MemoryStore>,
    pub(crate) mdns: Toggle<mdns::tokio::Behaviour>,
    pub(crate) gossipsub: gossipsub::Behaviour,
    /// Dials peers through relays, and listens through them when peers cannot dial this node.
    pub(crate) relay_client: relay::client::Behaviour,
    /// Relays for peers behind NAT, when the node config says so (`relay = true`).
    pub(crate) relay: Toggle<relay::Behaviour>,
    /// Asks peers to dial this node's candidate addresses back (AutoNAT v2), to learn whether
    /// it is reachable.
    pub(crate) autonat: autonat::v2::client::Behaviour,
    /// Dials candidates back for peers that ask.
    pub(crate) autonat_server: autonat::v2::server::Behaviour,
    /// Turns a relayed connection into a direct one by a hole punch (DCUtR).
    pub(crate) dcutr: dcutr::Behaviour,
    /// Opens this node's streams (its inbound side accepts nothing).
    pub(crate) stream: libp2p_stream::Behaviour,
    /// Accepts the streams peers open to this node.
    pub(crate) inbound: super::inbound::Behaviour,
}

/// The heartbeat topic of a run.
pub(crate) fn topic(run_id: &str) -> IdentTopic {
    IdentTopic::new(crate::heartbeat_topic(run_id))
}

/// A relay server with `limits`. Reservations and circuits are also rate-limited per peer and
/// per address, by libp2p's defaults (a reservation every 2 minutes, a circuit every 2 minutes
/// from one peer).
fn relay_server(peer_id: libp2p::PeerId, limits: &RelayLimits) -> relay::Behaviour {
    let defaults = relay::Config::default();
    relay::Behaviour::new(
        peer_id,
        relay::Config {
            max_reservations: limits.max_reservations,
            max_circuits: limits.max_circuits,
            max_circuits_per_peer: limits.max_circuits_per_peer,
            max_circuit_duration: limits.max_circuit_duration,
            max_circuit_bytes: limits.max_circuit_bytes,
            ..defaults
        },
    )
}

fn make_behaviour(
    key: &libp2p::identity::Keypair,
    relay_client: relay::client::Behaviour,
    config: &NetworkConfig,
) -> Result<Behaviour, Box<dyn std::error::Error + Send + Sync>> {
    let peer_id = key.public().to_peer_id();
    let gossip_config = gossipsub::ConfigBuilder::default()
        .heartbeat_interval(config.gossip_interval)
        .validation_mode(ValidationMode::Strict)
        .validate_messages()
        // A heartbeat is small, but a frame also carries gossipsub's control messages, and
        // the lists of recent message ids sent to peers outside the mesh grow with the swarm
        // (some 70 bytes an id, three heartbeats' worth from every peer). A frame over the
        // limit fails its stream, and after five failures gossipsub gives up on the
        // connection: heartbeats between two live peers stop. So frames get room for the
        // lists of a swarm of hundreds, the lists are capped below it, and the limit for
        // heartbeats themselves is set on their topic.
        .max_transmit_size(MAX_GOSSIP_FRAME_BYTES)
        .max_control_message_size(MAX_GOSSIP_FRAME_BYTES)
        .max_control_messages_sent(MAX_GOSSIP_IDS_SENT)
        .max_transmit_size_for_topic(2 * MAX_HEARTBEAT_BYTES, topic(&config.run_id).hash())
        // A peer's own heartbeat goes straight to every connected peer of the run, so that a
        // peer that just came back is heard at once, before it is in anyone's mesh again
        // (decision 0014). Forwarding stays on the small mesh.
        .flood_publish(true)
        .mesh_n(3)
        .mesh_n_low(2)
        .mesh_n_high(4)
        .mesh_outbound_min(1)
        // No lazy gossip (IHAVE and IWANT): a heartbeat lost on the way is superseded by the
        // author's next one within a period, and the author's own goes to every connected
        // peer, so repair buys nothing. And gossipsub 0.50 keeps each IWANT that was never
        // answered (the peer restarted, or lied) for as long as the node runs, unless peer
        // scoring is on: a daemon amid churn held more and more, and a stranger could make it
        // store hundreds of ids a round (decision 0063).
        .gossip_lazy(0)
        .gossip_factor(0.0)
        .max_ihave_messages_heartbeat(0)
        // The ids of the messages seen lately, kept so that a copy arriving by another path
        // is dropped. Their table keeps the largest size it ever needed, so it grows in
        // steps with the busiest minute a node has seen (an hour's soak). With no lazy
        // gossip nothing is sent again on purpose, and the node ignores a late copy of a
        // heartbeat by its send time anyway, so a few gossip periods of ids are enough
        // (decision 0064).
        .duplicate_cache_time(DUPLICATE_CACHE_TIME)
        .build()?;
    let mut gossipsub =
        gossipsub::Behaviour::new(MessageAuthenticity::Signed(key.clone()), gossip_config)?;
    gossipsub.subscribe(&topic(&config.run_id))?;

    let mut kad = kad::Behaviour::with_config(
        peer_id,
        MemoryStore::new(peer_id),
        kad::Config::new(KAD_PROTOCOL),
    );
    kad.set_mode(Some(kad::Mode::Server));

    let mdns = if config.mdns && config.transport == TransportKind::TcpQuic {
        Some(mdns::tokio::Behaviour::new(
            mdns::Config::default(),
            peer_id,
        )?)
    } else {
        None
    };
    let allowed = config.allowlist.as_ref().map(|peers| {
        let mut allowed = allow_block_list::Behaviour::<allow_block_list::AllowedPeers>::default();
        for peer in peers {
            allowed.allow_peer(*peer);
        }
        allowed
    });
    Ok(Behaviour {
        blocked: Default::default(),
        allowed: allowed.into(),
        limits: connection_limits::Behaviour::new(
            connection_limits::ConnectionLimits::default()
                .with_max_established_per_peer(Some(4))
                .with_max_established(Some(512))
                .with_max_pending_incoming(Some(64)),
        ),
        memory: memory_connection_limits::Behaviour::with_max_percentage(0.95),
        // No cache of peers' addresses in identify: it would offer every address a peer
        // listens on to each dial by peer id, QUIC's too; the DHT gets the ones this node dials
        // (decision 0061). A new address is pushed to connected peers: a node behind NAT that
        // comes to listen through a relay must be found there by peers that never met it.
        identify: identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL.to_owned(), key.public())
                .with_cache_size(0)
                .with_push_listen_addr_updates(true),
        ),
        ping: ping::Behaviour::new(
            ping::Config::new()
                .with_interval(PING_INTERVAL)
                .with_timeout(PING_TIMEOUT),
        ),
        kad,
        mdns: mdns.into(),
        gossipsub,
        relay_client,
        relay: config
            .relay
            .as_ref()
            .map(|limits| relay_server(peer_id, limits))
            .into(),
        // A candidate is tested every 5 s (libp2p's default), each by one peer.
        autonat: Default::default(),
        autonat_server: Default::default(),
        dcutr: dcutr::Behaviour::new(peer_id),
        stream: libp2p_stream::Behaviour::new(),
        inbound: Default::default(),
    })
}

/// The swarm's settings. Outbound streams settle their protocol lazily (multistream-select's
/// `V1Lazy`): the protocol proposal goes out with the stream's first data instead of a round
/// trip before it, so that an exchange offer on a 50 ms link waits one round trip, not two.
/// The wire is `V1`'s, and every Murmur stream opens with a frame of its one protocol, so
/// peers that take `V1` only interoperate; a protocol the peer lacks shows up as a failed
/// read instead of a failed open.
fn swarm_config(config: libp2p::swarm::Config, network: &NetworkConfig) -> libp2p::swarm::Config {
    config
        .with_idle_connection_timeout(network.idle_connection_timeout)
        .with_substream_upgrade_protocol_override(Version::V1Lazy)
}

/// TCP as the swarm dials and accepts it: no Nagle delay, and a bound on the bytes a socket
/// holds unsent ([`TCP_UNSENT_BYTES`]).
fn tcp_transport() -> Map<tcp::tokio::Transport, fn(TcpStream, ConnectedPoint) -> TcpStream> {
    tcp::tokio::Transport::new(tcp::Config::default().nodelay(true)).map(bound_unsent_bytes)
}

/// Sets [`TCP_UNSENT_BYTES`] on `stream`'s socket, where the system has the option.
fn bound_unsent_bytes(stream: TcpStream, _: ConnectedPoint) -> TcpStream {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    if let Err(error) = socket2::SockRef::from(&stream.0).set_tcp_notsent_lowat(TCP_UNSENT_BYTES) {
        // Only the pace of exchanges that cross on TCP depends on it.
        tracing::debug!(%error, "TCP_NOTSENT_LOWAT not set on a connection");
    }
    stream
}

/// Builds the swarm for `config`'s transport.
pub(crate) fn build_swarm(config: &NetworkConfig) -> Result<Swarm<Behaviour>, NetworkError> {
    let build = |e: &dyn std::fmt::Display| NetworkError::Build(e.to_string());
    let builder = libp2p::SwarmBuilder::with_existing_identity(config.keypair.clone()).with_tokio();
    let swarm = match config.transport {
        TransportKind::TcpQuic => builder
            .with_quic_config(|mut quic| {
                quic.max_idle_timeout = QUIC_IDLE_TIMEOUT_MS;
                quic.keep_alive_interval = QUIC_KEEP_ALIVE;
                quic.max_concurrent_stream_limit = QUIC_MAX_STREAMS;
                quic.max_stream_data = QUIC_STREAM_WINDOW_BYTES;
                quic.max_connection_data = QUIC_CONNECTION_WINDOW_BYTES;
                quic
            })
            // TCP as libp2p's builder makes it, with a bound on setting up a connection: a dial
            // to an address behind a firewall that drops it would otherwise wait for the
            // system's connect timeout (two minutes on Linux), and AutoNAT's dial-backs to a
            // node behind NAT would time out at the node before they fail at the server, so
            // that the node never learns it is private.
            .with_other_transport(
                |key| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                    Ok(tcp_transport()
                        .upgrade(Version::V1Lazy)
                        .authenticate(noise::Config::new(key)?)
                        .multiplex(yamux::Config::default())
                        .timeout(CONNECTION_SETUP_TIMEOUT))
                },
            )
            .map_err(|e| build(&e))?
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| build(&e))?
            .with_behaviour(|key, relay_client| make_behaviour(key, relay_client, config))
            .map_err(|e| build(&e))?
            .with_swarm_config(|c| swarm_config(c, config))
            .build(),
        TransportKind::Memory => builder
            .with_other_transport(
                |key| -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                    Ok(MemoryTransport::default()
                        .upgrade(Version::V1)
                        .authenticate(noise::Config::new(key)?)
                        .multiplex(yamux::Config::default()))
                },
            )
            .map_err(|e| build(&e))?
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| build(&e))?
            .with_behaviour(|key, relay_client| make_behaviour(key, relay_client, config))
            .map_err(|e| build(&e))?
            .with_swarm_config(|c| swarm_config(c, config))
            .build(),
    };
    Ok(swarm)
}

#[cfg(test)]
mod tests {
    use asynchronous_codec::{FramedRead, LengthCodec};
    use futures::StreamExt;

    /// Noise over TCP reads through `asynchronous-codec`'s `FramedRead`. Murmur runs a patched
    /// copy (vendor/asynchronous-codec, decision 0062) so that a buffer grown for a large frame
    /// is given back once the frame is decoded, instead of being kept for the connection's life.
    #[test]
    fn framed_read_gives_back_a_grown_buffer() {
        let frame = vec![7u8; 64 * 1024];
        let mut wire = (frame.len() as u64).to_be_bytes().to_vec();
        wire.extend_from_slice(&frame);
        let mut framed = FramedRead::new(futures::io::Cursor::new(wire), LengthCodec);

        let read = futures::executor::block_on(framed.next());
        let read = read
            .expect("the stream ends before its frame")
            .expect("a valid frame");

        assert_eq!(read.len(), frame.len());
        let kept = framed.read_buffer().capacity();
        assert!(
            kept <= 16 * 1024,
            "the read buffer kept {kept} bytes after the frame was decoded"
        );
    }

    /// Both ends of a TCP connection the swarm makes hold at most [`TCP_UNSENT_BYTES`] unsent
    /// (decision 0088): the dialer's socket and the one the listener accepts.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn tcp_connections_bound_their_unsent_bytes() {
        use futures::StreamExt;
        use libp2p::core::transport::{DialOpts, ListenerId, PortUse, TransportEvent};
        use libp2p::core::{Endpoint, Transport};

        let mut listener = super::tcp_transport().boxed();
        listener
            .listen_on(ListenerId::next(), "/ip4/127.0.0.1/tcp/0".parse().unwrap())
            .expect("no TCP listener on loopback");
        let connect = async {
            let address = loop {
                if let Some(TransportEvent::NewAddress { listen_addr, .. }) = listener.next().await
                {
                    break listen_addr;
                }
            };
            let opts = DialOpts {
                role: Endpoint::Dialer,
                port_use: PortUse::New,
            };
            let dial = super::tcp_transport()
                .boxed()
                .dial(address, opts)
                .expect("the dial is refused");
            let accept = async {
                loop {
                    if let Some(TransportEvent::Incoming { upgrade, .. }) = listener.next().await {
                        break upgrade.await;
                    }
                }
            };
            futures::join!(dial, accept)
        };
        let (dialed, accepted) = tokio::time::timeout(std::time::Duration::from_secs(10), connect)
            .await
            .expect("no TCP connection on loopback within 10 s");

        for (side, stream) in [("dialer", dialed), ("listener", accepted)] {
            let stream = stream.unwrap_or_else(|e| panic!("the {side}'s connection failed: {e}"));
            let unsent = socket2::SockRef::from(&stream.0)
                .tcp_notsent_lowat()
                .expect("TCP_NOTSENT_LOWAT cannot be read");
            assert_eq!(
                unsent,
                super::TCP_UNSENT_BYTES,
                "the {side}'s socket may hold {unsent} bytes unsent"
            );
        }
    }

    /// TCP connections are multiplexed by `yamux`. Murmur runs a patched copy (vendor/yamux,
    /// decision 0069): a stream waiting to read on a connection that this side closes ends at
    /// once. The published crate left it waiting for ever, and an exchange whose connection was
    /// closed as a spare held training for the exchange timeout.
    #[tokio::test]
    async fn a_read_ends_when_its_connection_is_closed_here() {
        use futures::{AsyncReadExt, AsyncWriteExt, FutureExt, future::poll_fn};
        use std::task::Poll;
        use tokio_util::compat::TokioAsyncReadCompatExt;

        let (near, far) = tokio::io::duplex(64 * 1024);
        let mut client =
            yamux::Connection::new(near.compat(), yamux::Config::default(), yamux::Mode::Client);
        let mut server =
            yamux::Connection::new(far.compat(), yamux::Config::default(), yamux::Mode::Server);

        // The far side takes the stream and its first byte, then holds it without answering.
        let (took, taken) = futures::channel::oneshot::channel();
        let far_side = tokio::spawn(async move {
            let mut stream = poll_fn(|cx| server.poll_next_inbound(cx))
                .await
                .expect("the far side sees no stream")
                .expect("the far side's connection failed");
            let mut first = [0u8; 1];
            stream
                .read_exact(&mut first)
                .await
                .expect("the far side reads no byte");
            let _ = took.send(());
            // Drives the connection (and keeps the stream) until the near side closes it.
            while let Some(Ok(_)) = poll_fn(|cx| server.poll_next_inbound(cx)).await {}
            drop(stream);
        });

        let mut stream = poll_fn(|cx| client.poll_new_outbound(cx))
            .await
            .expect("no stream opened");
        let (close, closing) = futures::channel::oneshot::channel::<()>();
        let near_side = tokio::spawn(async move {
            let mut closing = closing;
            // Drives the connection until told to close it, then closes it.
            poll_fn(|cx| {
                if closing.poll_unpin(cx).is_ready() {
                    return Poll::Ready(());
                }
                match client.poll_next_inbound(cx) {
                    Poll::Ready(Some(Ok(_))) => {
                        cx.waker().wake_by_ref();
                        Poll::Pending
                    }
                    Poll::Ready(_) => Poll::Ready(()),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await;
            poll_fn(|cx| client.poll_close(cx)).await
        });
        stream.write_all(&[1]).await.expect("the byte is not sent");
        stream.flush().await.expect("the byte is not flushed");
        tokio::time::timeout(std::time::Duration::from_secs(10), taken)
            .await
            .expect("the far side did not take the stream within 10 s")
            .expect("the far side ended before taking the stream");

        let _ = close.send(());
        let mut answer = [0u8; 1];
        // The deadline is polled first: a read that was never woken must not get a last poll
        // at the deadline (the published crate's read would then see the closed connection).
        let read = tokio::select! {
            biased;
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => None,
            read = stream.read(&mut answer) => Some(read),
        };
        let Some(read) = read else {
            panic!(
                "a read on a stream whose connection was closed on this side was not woken in \
                 5 s: the published yamux is linked, not vendor/yamux (decision 0069)"
            );
        };
        assert!(
            !matches!(read, Ok(n) if n > 0),
            "the read returned bytes the far side never sent"
        );
        near_side
            .await
            .expect("the near side panicked")
            .expect("the close failed");
        far_side.await.expect("the far side panicked");
    }

    /// The tests above check the copies this crate's tests link; this one checks that libp2p
    /// links the vendored copies too (asynchronous-codec, decision 0062; libp2p-stream,
    /// decision 0063; yamux, decision 0069). A libp2p release that moves to another version of
    /// one would bring the published crate back beside the copy, and the patch would silently
    /// stop applying.
    #[test]
    fn the_build_has_only_the_patched_copies_of_vendored_crates() {
        let lock = include_str!("../../../Cargo.lock");
        for (name, decision) in [
            ("asynchronous-codec", "0062"),
            ("libp2p-stream", "0063"),
            ("yamux", "0069"),
        ] {
            let packages: Vec<&str> = lock
                .split("[[package]]")
                .filter(|package| package.contains(&format!("name = \"{name}\"")))
                .collect();
            assert_eq!(
                packages.len(),
                1,
                "Cargo.lock has {} {name} packages: port the change in vendor/{name} to the \
                 version libp2p now needs, or drop the copy if that version has the fix \
                 (decision {decision})",
                packages.len()
            );
            assert!(
                !packages[0].contains("source ="),
                "Cargo.lock's {name} comes from a registry, not vendor/ (is the root \
                 Cargo.toml's [patch.crates-io] entry gone?): {}",
                packages[0].trim()
            );
        }
    }
}
