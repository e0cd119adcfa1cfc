//! The peer-to-peer network. One task ([`EventLoop`]) owns the libp2p `Swarm` and does nothing
//! else; the rest of the node holds a cloneable [`Client`] that sends it bounded commands with
//! oneshot replies, and receives [`NetworkEvent`]s on a bounded channel. Tensor streams
//! (`/murmur/params/3`, `/murmur/state/2`) are opened through [`Client::open_stream`] and
//! accepted through [`Client::accept`], and run outside the swarm task, so moving 100 MB never
//! stalls it. The same client and events can come from a simulated network instead
//! (`simulated`, feature `sim`), for many nodes in one process in virtual time.
//!
//! Transports: TCP + Noise + Yamux and QUIC v1 (or an in-memory transport for tests).
//! Behaviours: identify, ping, Kademlia (bootstrap, and a provider record for the run key so
//! members find each other), mDNS (optional), gossipsub for heartbeats only, libp2p-stream
//! (outbound streams), `inbound` (inbound streams, queued), block list, the trust allowlist when
//! configured, connection limits and memory connection limits; and for peers behind NAT, AutoNAT
//! v2 (client and server), the relay client, a relay server when configured, and DCUtR hole
//! punching ([`Reachability`], [`Reach`]).

mod behaviour;
mod connections;
mod event_loop;
mod inbound;
mod reachability;
#[cfg(feature = "sim")]
pub mod simulated;
mod streams;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use libp2p::swarm::Swarm;
pub use libp2p::{Multiaddr, PeerId, StreamProtocol, identity::Keypair};
use tokio::sync::{mpsc, oneshot};

pub use crate::membership::ConnectionKind;
pub use event_loop::EventLoop;
pub use inbound::{AlreadyAccepted, Incoming, Over, QUEUED_STREAMS};
pub use reachability::{
    Mapping, PUNCHES_BEFORE_CLIENT, Punches, Reach, Reachability, RelayLimits, is_relayed,
};
pub use streams::{OpenStreamError, Stream};

use crate::heartbeat::{Heartbeat, HeartbeatError};

/// Capacity of the command and event channels.
const CHANNEL_CAPACITY: usize = 256;

/// Which transports a node speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// TCP (Noise, Yamux) and QUIC v1: real nodes.
    TcpQuic,
    /// In-process memory transport (Noise, Yamux): tests.
    Memory,
}

/// Everything the network needs to start.
#[derive(Clone, Debug)]
pub struct NetworkConfig {
    pub keypair: Keypair,
    pub run_id: String,
    pub fingerprint: String,
    pub listen: Vec<Multiaddr>,
    /// Peers to dial at start, as `/ip4/.../tcp/.../p2p/<peer id>`.
    pub bootstrap: Vec<Multiaddr>,
    pub mdns: bool,
    pub transport: TransportKind,
    /// Gossipsub's mesh maintenance interval.
    pub gossip_interval: Duration,
    /// How often to look up the run's provider record for new members.
    pub discovery_interval: Duration,
    pub idle_connection_timeout: Duration,
    /// How long the network keeps running after it is asked to stop, so that what is queued
    /// (the goodbye heartbeat) goes out: gossipsub gives no signal when a message is written.
    pub linger: Duration,
    /// When set, only these peers may connect (in either direction): the node's trust list in
    /// allowlisted mode.
    pub allowlist: Option<Vec<PeerId>>,
    /// When set, the node serves as a relay for peers behind NAT, with these limits.
    pub relay: Option<RelayLimits>,
    /// Addresses the operator declares peers can dial this node at (no `/p2p/<id>`): taken as
    /// confirmed without AutoNAT. A node that is only ever dialled (a bootstrap node, a relay)
    /// is never tested by AutoNAT, which asks for dial-backs over connections it dialled.
    pub external_addrs: Vec<Multiaddr>,
}

impl NetworkConfig {
    /// Defaults for a real node of run `run_id` with model `fingerprint`.
    pub fn new(keypair: Keypair, run_id: &str, fingerprint: &str) -> Self {
        NetworkConfig {
            keypair,
            run_id: run_id.to_owned(),
            fingerprint: fingerprint.to_owned(),
            listen: Vec::new(),
            bootstrap: Vec::new(),
            mdns: true,
            transport: TransportKind::TcpQuic,
            // Mesh upkeep and DHT lookups are most of the idle traffic: keep them infrequent.
            gossip_interval: Duration::from_secs(1),
            discovery_interval: Duration::from_secs(30),
            idle_connection_timeout: Duration::from_secs(60),
            linger: Duration::from_millis(500),
            allowlist: None,
            relay: None,
            external_addrs: Vec::new(),
        }
    }
}

/// What the network tells the rest of the node.
#[derive(Clone, Debug)]
pub enum NetworkEvent {
    /// The node now listens on these addresses (with its peer id). The first such event comes
    /// once every listen address asked for has an address (or failed), and names them all.
    Listening(Vec<Multiaddr>),
    Connected(PeerId),
    Disconnected(PeerId),
    /// `peer` told us (identify) where it listens: worth remembering for a restart.
    Identified {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    },
    /// A valid heartbeat of this run and model from `peer`.
    Heartbeat {
        peer: PeerId,
        heartbeat: Heartbeat,
    },
    /// A ping to `peer` came back after `rtt`.
    Rtt {
        peer: PeerId,
        rtt: std::time::Duration,
    },
    /// A heartbeat `peer` sent was refused; `reason` says why.
    Rejected {
        peer: PeerId,
        reason: HeartbeatError,
    },
    /// What the node knows of whether peers can dial it changed: an address confirmed or
    /// expired, a test failed, a relay's reservation came or went, a hole punch ended.
    Reach(Reach),
    /// How this node is connected to `peer` changed: the best of its connections to the peer
    /// (hole-punched, then direct, then relayed). [`NetworkEvent::Disconnected`] says when the
    /// last one closed.
    Link {
        peer: PeerId,
        kind: ConnectionKind,
    },
}

/// Why a network operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetworkError {
    #[error("cannot start the network: {0}")]
    Build(String),
    #[error("cannot listen on {addr}: {reason}")]
    Listen { addr: Multiaddr, reason: String },
    #[error("cannot dial {addr}: {reason}")]
    Dial { addr: Multiaddr, reason: String },
    #[error("cannot publish: {0}")]
    Publish(String),
    #[error("the network task has stopped")]
    Stopped,
    #[error("the network task is busy: its command queue is full")]
    Busy,
}

/// Requests to the swarm task, each with its reply channel.
#[derive(Debug)]
enum Command {
    ListenAddrs(oneshot::Sender<Vec<Multiaddr>>),
    Dial(Multiaddr, oneshot::Sender<Result<(), NetworkError>>),
    Publish(Vec<u8>, oneshot::Sender<Result<(), NetworkError>>),
    ConnectedPeers(oneshot::Sender<Vec<PeerId>>),
    Connections(oneshot::Sender<Vec<(PeerId, Vec<Multiaddr>)>>),
    Block(PeerId, oneshot::Sender<()>),
    /// Publish without waiting for the outcome.
    PublishNow(Vec<u8>),
    /// Block without waiting.
    BlockNow(PeerId),
    /// Let a blocked peer back in, without waiting.
    UnblockNow(PeerId),
}

/// A handle on the network task; cheap to clone.
#[derive(Clone)]
pub struct Client {
    peer_id: PeerId,
    inbound: inbound::Queues,
    dropped: DroppedEvents,
    backend: Backend,
}

/// What carries out a client's commands and opens its streams.
#[derive(Clone)]
enum Backend {
    /// The swarm task.
    Swarm {
        commands: mpsc::Sender<Command>,
        streams: libp2p_stream::Control,
    },
    /// The simulated network, at once.
    #[cfg(feature = "sim")]
    Simulated(simulated::Port),
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("peer_id", &self.peer_id)
            .finish_non_exhaustive()
    }
}

impl Client {
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Accepts the streams of `protocol` that peers open to this node over direct connections,
    /// until the returned queue is dropped; at most [`QUEUED_STREAMS`] wait in it, and more
    /// are dropped. A connection through a relay does not offer the protocol (see
    /// [`Client::accept_over`]).
    pub fn accept(&self, protocol: StreamProtocol) -> Result<Incoming, AlreadyAccepted> {
        self.accept_over(protocol, Over::Direct)
    }

    /// [`Client::accept`], over the connections `over` names: [`Over::Any`] takes streams
    /// through relays too.
    pub fn accept_over(
        &self,
        protocol: StreamProtocol,
        over: Over,
    ) -> Result<Incoming, AlreadyAccepted> {
        self.inbound.accept(protocol, over)
    }

    /// Opens a stream of `protocol` to `peer`, outside the swarm task (libp2p-stream), dialling
    /// the peer if it is not connected; each attempt has a deadline (see `streams`), and
    /// callers bound the whole with their own.
    pub async fn open_stream(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, OpenStreamError> {
        match &self.backend {
            Backend::Swarm { streams, .. } => {
                streams::open_stream(&mut streams.clone(), peer, protocol).await
            }
            #[cfg(feature = "sim")]
            Backend::Simulated(port) => port.open_stream(peer, protocol).await,
        }
    }

    async fn request<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, NetworkError> {
        let (reply, answer) = oneshot::channel();
        match &self.backend {
            Backend::Swarm { commands, .. } => commands
                .send(make(reply))
                .await
                .map_err(|_| NetworkError::Stopped)?,
            #[cfg(feature = "sim")]
            Backend::Simulated(port) => port.handle(make(reply)),
        }
        answer.await.map_err(|_| NetworkError::Stopped)
    }

    /// The addresses the node listens on (with its peer id appended).
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>, NetworkError> {
        self.request(Command::ListenAddrs).await
    }

    /// Dials `addr`; returns once the dial has started.
    pub async fn dial(&self, addr: Multiaddr) -> Result<(), NetworkError> {
        self.request(|reply| Command::Dial(addr, reply)).await?
    }

    /// Publishes this node's heartbeat to the run.
    pub async fn publish_heartbeat(&self, heartbeat: &Heartbeat) -> Result<(), NetworkError> {
        let bytes = heartbeat.encode();
        self.request(|reply| Command::Publish(bytes, reply)).await?
    }

    pub async fn connected_peers(&self) -> Result<Vec<PeerId>, NetworkError> {
        self.request(Command::ConnectedPeers).await
    }

    /// Each connected peer with the peer's address on each connection open to it: one
    /// connection once a pair has settled (see `ConnectionTracker::tick`), over TCP where the
    /// peer offers it (see `by_preference`).
    pub async fn connections(&self) -> Result<Vec<(PeerId, Vec<Multiaddr>)>, NetworkError> {
        self.request(Command::Connections).await
    }

    /// Disconnects `peer` and refuses it from now on.
    pub async fn block(&self, peer: PeerId) -> Result<(), NetworkError> {
        self.request(|reply| Command::Block(peer, reply)).await
    }

    /// Hands the network task a command without waiting: for callers that must never wait on
    /// it (the task may itself be waiting on them).
    fn command_now(&self, command: Command) -> Result<(), NetworkError> {
        match &self.backend {
            Backend::Swarm { commands, .. } => commands.try_send(command).map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => NetworkError::Busy,
                mpsc::error::TrySendError::Closed(_) => NetworkError::Stopped,
            }),
            #[cfg(feature = "sim")]
            Backend::Simulated(port) => {
                port.handle(command);
                Ok(())
            }
        }
    }

    /// Publishes this node's heartbeat without waiting for the outcome; fails at once when the
    /// network task's queue is full (the next heartbeat follows).
    pub fn try_publish_heartbeat(&self, heartbeat: &Heartbeat) -> Result<(), NetworkError> {
        self.command_now(Command::PublishNow(heartbeat.encode()))
    }

    /// [`Client::block`] without waiting.
    pub fn try_block(&self, peer: PeerId) -> Result<(), NetworkError> {
        self.command_now(Command::BlockNow(peer))
    }

    /// Lets a peer blocked before back in (the node forgot it: its block list is bounded),
    /// without waiting.
    pub fn try_unblock(&self, peer: PeerId) -> Result<(), NetworkError> {
        self.command_now(Command::UnblockNow(peer))
    }

    /// The count of events the network task dropped because the node did not take them in time.
    pub fn dropped_events(&self) -> DroppedEvents {
        self.dropped.clone()
    }
}

/// How many events the network task dropped because the node did not take them in time (its
/// queue to the node was full): the task adds to it, and observers read it. Each is a
/// heartbeat, a connection's news or a peer's rejection the node never saw; heartbeats come
/// again within a period, but a count that keeps rising says the node cannot keep up.
#[derive(Clone, Debug, Default)]
pub struct DroppedEvents(Arc<AtomicU64>);

impl DroppedEvents {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    pub(crate) fn add_one(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// Builds the swarm and returns the client, the event receiver and the task to spawn.
pub fn new(
    config: NetworkConfig,
) -> Result<(Client, mpsc::Receiver<NetworkEvent>, EventLoop), NetworkError> {
    build(config, None)
}

/// [`new`], with libp2p's own metrics (connections, identify, Kademlia, gossipsub, ping)
/// recorded into `registry`, for a node's `/metrics`.
pub fn with_metrics(
    config: NetworkConfig,
    registry: &mut libp2p::metrics::Registry,
) -> Result<(Client, mpsc::Receiver<NetworkEvent>, EventLoop), NetworkError> {
    build(config, Some(libp2p::metrics::Metrics::new(registry)))
}

fn build(
    config: NetworkConfig,
    metrics: Option<libp2p::metrics::Metrics>,
) -> Result<(Client, mpsc::Receiver<NetworkEvent>, EventLoop), NetworkError> {
    let mut swarm: Swarm<behaviour::Behaviour> = behaviour::build_swarm(&config)?;
    let mut listeners = HashSet::new();
    for addr in &config.listen {
        let listener = swarm
            .listen_on(addr.clone())
            .map_err(|e| NetworkError::Listen {
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
        listeners.insert(listener);
    }
    let streams = swarm.behaviour().stream.new_control();
    let inbound = swarm.behaviour().inbound.queues.clone();
    let (command_tx, command_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let (event_tx, event_rx) = mpsc::channel(CHANNEL_CAPACITY);
    let dropped = DroppedEvents::default();
    let client = Client {
        peer_id: *swarm.local_peer_id(),
        inbound,
        dropped: dropped.clone(),
        backend: Backend::Swarm {
            commands: command_tx,
            streams,
        },
    };
    let event_loop = EventLoop::new(
        swarm, config, command_rx, event_tx, listeners, metrics, dropped,
    );
    Ok((client, event_rx, event_loop))
}

/// Waits for the first address the node listens on (with its peer id), passing over every
/// other event; `None` if the network stopped first. For callers that start a node and must
/// print or dial its address before anything else.
pub async fn listen_address(events: &mut mpsc::Receiver<NetworkEvent>) -> Option<Multiaddr> {
    while let Some(event) = events.recv().await {
        if let NetworkEvent::Listening(addrs) = event
            && let Some(addr) = addrs.into_iter().next()
        {
            return Some(addr);
        }
    }
    None
}
