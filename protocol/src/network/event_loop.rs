//! The task that owns the swarm: it turns swarm events into [`NetworkEvent`]s and commands into
//! swarm calls, one arm each, and never computes.

mod addresses;
mod relays;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use libp2p::core::ConnectedPoint;
use libp2p::core::transport::{ListenerId, PortUse};
use libp2p::gossipsub::{self, MessageAcceptance};
use libp2p::metrics::{Metrics, Recorder};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionError, ConnectionId, DialError, Swarm, SwarmEvent};
use libp2p::{Multiaddr, PeerId, autonat, dcutr, identify, kad, mdns, ping, relay};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use super::behaviour::{Behaviour, BehaviourEvent, topic};
use super::connections::{ConnectionAction, ConnectionTracker, NewConnection, Open};
use super::reachability::Tracker;
use super::{Command, DroppedEvents, NetworkConfig, NetworkError, NetworkEvent};
use crate::heartbeat::{CLOCK_WINDOW, Heartbeat, unix_ms_now};
use crate::membership::ConnectionKind;
use crate::throttle::{LOG_LINES, LogThrottle};
use addresses::{by_preference, peer_of, without_peer_id};

/// How often the event loop dials the peers whose grace is over and looks for spare
/// connections.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(1);

/// Drives the swarm; spawn [`EventLoop::run`] on the runtime.
pub struct EventLoop {
    swarm: Swarm<Behaviour>,
    config: NetworkConfig,
    commands: mpsc::Receiver<Command>,
    events: mpsc::Sender<NetworkEvent>,
    listen_addrs: Vec<Multiaddr>,
    /// Listeners that have not reported an address yet. Until every one has (or has failed),
    /// addresses are held back, so that the first [`NetworkEvent::Listening`] names every
    /// transport the node was asked to listen on (a node is announced ready on that event).
    unheard: HashSet<ListenerId>,
    run_key: kad::RecordKey,
    /// libp2p's own metrics, when the node serves them.
    metrics: Option<Metrics>,
    /// The open connections, and which to close, drop or dial (docs/connections.md).
    connections: ConnectionTracker,
    /// Events dropped because the receiver's queue was full (shared with the clients).
    dropped: DroppedEvents,
    /// What AutoNAT and the relays say of this node.
    reach: Tracker,
    /// Connected peers that serve as relays (identify lists the relay protocol), with the
    /// address this node reaches each at.
    relays: HashMap<PeerId, Multiaddr>,
    /// The relays this node listens through, while it is private.
    relay_listeners: HashMap<PeerId, ListenerId>,
    /// How this node is connected to each connected peer, as last told to the node.
    links: HashMap<PeerId, ConnectionKind>,
    /// While private: when to look the run's members up next, and the pause after that.
    private_lookup: Option<(Instant, Duration)>,
}

impl std::fmt::Debug for EventLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLoop")
            .field("peer_id", self.swarm.local_peer_id())
            .finish_non_exhaustive()
    }
}

impl EventLoop {
    pub(super) fn new(
        swarm: Swarm<Behaviour>,
        config: NetworkConfig,
        commands: mpsc::Receiver<Command>,
        events: mpsc::Sender<NetworkEvent>,
        listeners: HashSet<ListenerId>,
        metrics: Option<Metrics>,
        dropped: DroppedEvents,
    ) -> Self {
        let run_key = kad::RecordKey::new(&format!("murmur/run/{}", config.run_id));
        let connections = ConnectionTracker::new(*swarm.local_peer_id());
        EventLoop {
            swarm,
            config,
            commands,
            events,
            listen_addrs: Vec::new(),
            unheard: listeners,
            run_key,
            metrics,
            connections,
            dropped,
            reach: Tracker::default(),
            relays: HashMap::new(),
            relay_listeners: HashMap::new(),
            links: HashMap::new(),
            private_lookup: None,
        }
    }

    /// Runs until `shutdown` resolves or every [`super::Client`] is dropped; then lingers for
    /// [`NetworkConfig::linger`], driving the connections so that what is queued goes out.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) {
        // One dial per bootstrap peer, over its preferred addresses: a restart brings back
        // every address of every peer in the peer book, and one dial per address would open a
        // connection per transport.
        let mut offers: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
        for addr in self.config.bootstrap.clone() {
            match peer_of(&addr) {
                Some(peer) => offers.entry(peer).or_default().push(addr),
                None => {
                    if let Err(e) = self.swarm.dial(addr.clone()) {
                        warn!(%addr, error = %e, "cannot dial bootstrap peer");
                    }
                }
            }
        }
        for (peer, addrs) in offers {
            if let Err(e) = self.dial_offered(peer, addrs) {
                warn!(%peer, error = %e, "cannot dial bootstrap peer");
            }
        }
        // Addresses the operator declares public (a server's, a forwarded port): taken as
        // confirmed at once, so that a relay serves without waiting to be dialled back.
        for addr in self.config.external_addrs.clone() {
            info!(%addr, "peers can reach this node at an address (declared)");
            self.swarm.add_external_address(addr.clone());
            self.update_reach(|reach| reach.confirmed(addr));
        }
        if let Err(e) = self
            .swarm
            .behaviour_mut()
            .kad
            .start_providing(self.run_key.clone())
        {
            warn!(error = %e, "cannot announce the run in the DHT");
        }
        let mut discovery = tokio::time::interval(self.config.discovery_interval);
        let mut upkeep = tokio::time::interval(UPKEEP_INTERVAL);
        upkeep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                command = self.commands.recv() => match command {
                    Some(command) => self.on_command(command),
                    None => break,
                },
                _ = discovery.tick() => {
                    self.swarm.behaviour_mut().kad.get_providers(self.run_key.clone());
                }
                _ = upkeep.tick() => {
                    let due = self.connections.tick(Instant::now());
                    self.apply(due);
                    self.keep_relays();
                    self.look_up_while_private();
                }
            }
        }
        let linger = tokio::time::sleep(self.config.linger);
        tokio::pin!(linger);
        loop {
            tokio::select! {
                () = &mut linger => break,
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
            }
        }
        debug!("network task stopped");
    }

    /// Hands `event` to the node without ever waiting for it: the swarm task must not depend
    /// on its consumer (which may be waiting on a reply from this task). An event that does not
    /// fit the queue is dropped and counted; heartbeats come again within a period.
    fn emit(&mut self, event: NetworkEvent) {
        match self.events.try_send(event) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(event)) => {
                self.dropped.add_one();
                debug!(?event, "the node is not taking network events; one dropped");
            }
            // A closed receiver means the node is shutting down; nothing to tell.
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(self.listen_addrs.clone());
            }
            Command::Dial(addr, reply) => {
                if let Some(peer) = peer_of(&addr) {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer, addr.clone());
                }
                let result = self
                    .swarm
                    .dial(addr.clone())
                    .map_err(|e| NetworkError::Dial {
                        addr,
                        reason: e.to_string(),
                    });
                let _ = reply.send(result);
            }
            Command::Publish(bytes, reply) => {
                let topic = topic(&self.config.run_id);
                let result = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(topic, bytes)
                    .map(|_| ())
                    .map_err(|e| NetworkError::Publish(e.to_string()));
                let _ = reply.send(result);
            }
            Command::ConnectedPeers(reply) => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Connections(reply) => {
                let mut peers: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
                for open in self.connections.all() {
                    peers
                        .entry(open.peer)
                        .or_default()
                        .push(open.remote.clone());
                }
                let _ = reply.send(peers.into_iter().collect());
            }
            Command::Block(peer, reply) => {
                self.swarm.behaviour_mut().blocked.block_peer(peer);
                let _ = reply.send(());
            }
            Command::PublishNow(bytes) => {
                let topic = topic(&self.config.run_id);
                if let Err(e) = self.swarm.behaviour_mut().gossipsub.publish(topic, bytes) {
                    debug!(error = %e, "heartbeat not published");
                }
            }
            Command::BlockNow(peer) => {
                self.swarm.behaviour_mut().blocked.block_peer(peer);
            }
            Command::UnblockNow(peer) => {
                self.swarm.behaviour_mut().blocked.unblock_peer(peer);
            }
        }
    }

    /// Notes that `listener` reported `addrs` (none if it closed): announces them, or, while
    /// other listeners have not reported yet, holds them back for one announcement of all.
    fn heard_from(&mut self, listener: ListenerId, addrs: Vec<Multiaddr>) {
        let was_waiting = !self.unheard.is_empty();
        self.unheard.remove(&listener);
        if was_waiting && self.unheard.is_empty() && !self.listen_addrs.is_empty() {
            self.emit(NetworkEvent::Listening(self.listen_addrs.clone()));
        } else if !was_waiting && !addrs.is_empty() {
            self.emit(NetworkEvent::Listening(addrs));
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        if let Some(metrics) = &self.metrics {
            record(metrics, &event);
        }
        match event {
            SwarmEvent::NewListenAddr {
                listener_id,
                address,
            } => {
                let local = *self.swarm.local_peer_id();
                // A listener through a relay names this node already.
                let full = without_peer_id(address).with(Protocol::P2p(local));
                info!(addr = %full, "listening");
                self.listen_addrs.push(full.clone());
                self.heard_from(listener_id, vec![full]);
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                addresses,
                reason,
            } => {
                if let Err(e) = reason {
                    warn!(error = %e, addrs = ?addresses, "a listener failed");
                }
                let local = *self.swarm.local_peer_id();
                let closed: Vec<_> = addresses
                    .into_iter()
                    .map(|a| without_peer_id(a).with(Protocol::P2p(local)))
                    .collect();
                self.listen_addrs.retain(|a| !closed.contains(a));
                self.relay_listeners.retain(|_, id| *id != listener_id);
                self.heard_from(listener_id, Vec::new());
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                num_established,
                endpoint,
                ..
            } => self.on_established(peer_id, connection_id, &endpoint, num_established.get()),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                cause,
                ..
            } => self.on_closed(peer_id, connection_id, num_established, cause),
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                debug!(peer = ?peer_id, error = %error, "dial failed");
                // Every address failed, or there was none (a dial that was not made, because
                // the peer is connected or being dialled, says nothing of its addresses).
                if let Some(peer) = peer_id
                    && matches!(error, DialError::Transport(_) | DialError::NoAddresses)
                {
                    let actions = self.connections.on_dial_failed(Instant::now(), peer);
                    self.apply(actions);
                }
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                info!(addr = %address, "peers can reach this node at an address");
                self.update_reach(|reach| reach.confirmed(address));
            }
            SwarmEvent::ExternalAddrExpired { address } => {
                info!(addr = %address, "an address of this node no longer holds");
                self.update_reach(|reach| reach.expired(&address));
            }
            SwarmEvent::Behaviour(event) => self.on_behaviour_event(event),
            _ => {}
        }
    }

    fn on_behaviour_event(&mut self, event: BehaviourEvent) {
        match event {
            BehaviourEvent::Ping(ping::Event {
                peer,
                connection,
                result,
            }) => self.on_ping(peer, connection, result),
            BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            }) => self.on_gossip(propagation_source, &message_id, &message),
            BehaviourEvent::Mdns(mdns::Event::Discovered(found)) => {
                let mut offers: HashMap<PeerId, Vec<Multiaddr>> = HashMap::new();
                for (peer, addr) in found {
                    offers.entry(peer).or_default().push(addr);
                }
                for (peer, addrs) in offers {
                    // Refused, and nothing to tell, when the peer is connected already.
                    let _ = self.dial_offered(peer, addrs);
                }
            }
            BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                connection_id,
                info,
            }) => self.on_identified(peer_id, connection_id, info),
            BehaviourEvent::Kad(kad::Event::OutboundQueryProgressed {
                result:
                    kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders {
                        providers,
                        ..
                    })),
                ..
            }) => {
                let now = Instant::now();
                for peer in providers {
                    let actions = self.connections.on_found(now, peer);
                    self.apply(actions);
                }
            }
            BehaviourEvent::Kad(kad::Event::OutboundQueryProgressed {
                result: kad::QueryResult::GetClosestPeers(Ok(found)),
                ..
            }) => self.on_looked_up(found),
            // The DHT takes the address of every connection this node dials in its own right,
            // a dial-back's or a bootstrap over QUIC among them; every dial by peer id (a
            // query's too) races the addresses it holds, so those this node passes over
            // leave again as soon as they arrive.
            BehaviourEvent::Kad(kad::Event::RoutingUpdated {
                peer, addresses, ..
            }) => {
                let (_, passed_over) = by_preference(addresses.into_vec());
                let kad = &mut self.swarm.behaviour_mut().kad;
                for addr in &passed_over {
                    kad.remove_address(&peer, addr);
                }
            }
            BehaviourEvent::Relay(relay::Event::ReservationReqAccepted {
                src_peer_id,
                renewed: false,
            }) => self.announce_relayed(src_peer_id),
            BehaviourEvent::Autonat(autonat::v2::client::Event {
                tested_addr,
                server,
                result: Err(error),
                ..
            }) => {
                debug!(addr = %tested_addr, %server, %error, "a dial back to this node failed");
                self.update_reach(|reach| reach.test_failed(tested_addr));
            }
            BehaviourEvent::AutonatServer(autonat::v2::server::Event {
                client,
                tested_addr,
                result,
                ..
            }) => {
                debug!(peer = %client, addr = %tested_addr, ok = result.is_ok(), "dialled a peer back");
                let done = self.connections.on_dial_back_done(client);
                self.apply(done);
            }
            BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => match result {
                Ok(connection) => {
                    info!(peer = %remote_peer_id, "hole punched: a direct connection");
                    self.connections.on_hole_punched(connection);
                    self.update_link(remote_peer_id);
                    self.update_reach(|reach| reach.punched(true));
                }
                Err(error) => {
                    info!(peer = %remote_peer_id, %error, "hole punch failed");
                    self.update_reach(|reach| reach.punched(false));
                }
            },
            _ => {}
        }
    }

    /// `count` connections to `peer` are open, the newest being `connection`.
    fn on_established(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        endpoint: &ConnectedPoint,
        count: u32,
    ) {
        let remote = endpoint.get_remote_address().clone();
        // A connection through a relay that this node took shows it on the relayed address it
        // listens on, not on the peer's.
        let kind = if endpoint.is_relayed() {
            ConnectionKind::Relayed
        } else {
            ConnectionKind::Direct
        };
        // AutoNAT's server alone dials from a fresh port, so that the peer sees a connection
        // its NAT did not expect.
        let dial_back = matches!(
            endpoint,
            ConnectedPoint::Dialer {
                port_use: PortUse::New,
                ..
            }
        );
        // A dial-back's address is the one the peer asked to have tested, perhaps of a
        // transport this node passes over; the peer lists its own soon enough.
        if endpoint.is_dialer() && !dial_back {
            let kad = &mut self.swarm.behaviour_mut().kad;
            kad.add_address(&peer, remote.clone());
        }
        let dialled_here = match endpoint {
            ConnectedPoint::Listener { local_addr, .. } => Some(local_addr.clone()),
            ConnectedPoint::Dialer { .. } => None,
        };
        let new = NewConnection {
            peer,
            remote,
            dialled_here,
            kind,
            dial_back,
        };
        let actions = self
            .connections
            .on_established(Instant::now(), connection, new);
        self.apply(actions);
        if count == 1 {
            debug!(%peer, "connected");
            self.emit(NetworkEvent::Connected(peer));
        }
        self.update_link(peer);
    }

    /// `connection` to `peer` closed, and `left` others are open. Only a broken connection
    /// (an I/O error; not one closed on purpose or for idleness) may start a reconnect: QUIC's
    /// own idle timeout finds a dead one even between pings.
    fn on_closed(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        left: u32,
        cause: Option<ConnectionError>,
    ) {
        let failed = match &cause {
            Some(ConnectionError::IO(error)) => {
                debug!(%peer, %error, "a connection to the peer broke");
                true
            }
            _ => false,
        };
        let actions = self
            .connections
            .on_closed(Instant::now(), connection, peer, failed);
        self.apply(actions);
        if left == 0 {
            self.relays.remove(&peer);
            self.links.remove(&peer);
            debug!(%peer, "disconnected");
            self.emit(NetworkEvent::Disconnected(peer));
        } else {
            self.update_link(peer);
        }
    }

    fn on_ping(
        &mut self,
        peer: PeerId,
        connection: ConnectionId,
        result: Result<Duration, ping::Failure>,
    ) {
        match result {
            Ok(rtt) => {
                self.connections.on_pong(Instant::now(), connection);
                self.emit(NetworkEvent::Rtt { peer, rtt });
            }
            Err(ping::Failure::Unsupported) => {}
            Err(failure) => {
                debug!(%peer, ?connection, %failure, "ping failed");
                let actions = self
                    .connections
                    .on_ping_failed(Instant::now(), connection, peer);
                self.apply(actions);
            }
        }
    }

    /// A heartbeat from `propagation_source`: checked, reported to gossipsub (which relays only
    /// what it accepts) and handed to the node.
    fn on_gossip(
        &mut self,
        propagation_source: PeerId,
        message_id: &gossipsub::MessageId,
        message: &gossipsub::Message,
    ) {
        let author = message.source.unwrap_or(propagation_source);
        let decoded =
            Heartbeat::decode(&message.data, &self.config.run_id, &self.config.fingerprint)
                .and_then(|hb| {
                    hb.check_clock(unix_ms_now(), CLOCK_WINDOW)?;
                    Ok(hb)
                });
        // Out of the clock window: not relayed, but not held against whoever relayed it either
        // (it may be an honest peer's old heartbeat, replayed).
        let acceptance = match &decoded {
            Ok(_) => MessageAcceptance::Accept,
            Err(e) if !e.is_offence() => MessageAcceptance::Ignore,
            Err(_) => MessageAcceptance::Reject,
        };
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(message_id, &propagation_source, acceptance);
        match decoded {
            Ok(heartbeat) => {
                self.emit(NetworkEvent::Heartbeat {
                    peer: author,
                    heartbeat,
                });
            }
            Err(e) if !e.is_offence() => {
                debug!(peer = %author, reason = %e, "heartbeat ignored");
                self.emit(NetworkEvent::Rejected {
                    peer: author,
                    reason: e,
                });
            }
            Err(e) => {
                static REJECTED: LogThrottle = LogThrottle::new(LOG_LINES);
                if let Some(held) = REJECTED.allow() {
                    warn!(peer = %author, reason = %e, held, "heartbeat rejected");
                }
                self.emit(NetworkEvent::Rejected {
                    peer: author,
                    reason: e,
                });
            }
        }
    }

    /// `peer` said, over `connection`, where it listens and where it sees this node come from.
    fn on_identified(&mut self, peer: PeerId, connection: ConnectionId, info: identify::Info) {
        // Where the peer sees this node come from, over a connection of this node's own
        // socket: a dial-back comes from a fresh port, a relayed one from the relay.
        let own_socket = self.connections.get(connection).is_some_and(Open::is_own);
        if own_socket {
            let observed = info.observed_addr.clone();
            self.update_reach(|reach| reach.observed(peer, observed));
        }
        // Only the addresses this node would dial go to the DHT, which every dial by peer id (a
        // redial, a peer found in the DHT, a query) takes its addresses from; the others are
        // dropped, in case a dial or mDNS put them there.
        if info.protocols.contains(&relay::HOP_PROTOCOL_NAME)
            && let Some(addr) = self.direct_address_of(peer, &info.listen_addrs)
        {
            self.relays.insert(peer, addr);
        }
        debug!(%peer, addrs = ?info.listen_addrs, "the peer listens at");
        let (dialled, passed_over) = by_preference(info.listen_addrs.clone());
        let kad = &mut self.swarm.behaviour_mut().kad;
        for addr in dialled {
            kad.add_address(&peer, addr);
        }
        for addr in &passed_over {
            kad.remove_address(&peer, addr);
        }
        self.emit(NetworkEvent::Identified {
            peer,
            addrs: info.listen_addrs,
        });
    }
}

impl EventLoop {
    /// Carries out what the connection tracker decided.
    fn apply(&mut self, actions: Vec<ConnectionAction>) {
        for action in actions {
            match action {
                ConnectionAction::Close(connection) => {
                    self.swarm.close_connection(connection);
                }
                ConnectionAction::Disconnect(peer) => {
                    let _ = self.swarm.disconnect_peer_id(peer);
                }
                ConnectionAction::Dial(peer) => self.dial(peer),
                // The addresses this node held for the peer all failed: they go, or the lookup
                // would try them first and pass over the peer, and not dial it at the
                // addresses the peers that answer give.
                ConnectionAction::LookUp(peer) => {
                    let kad = &mut self.swarm.behaviour_mut().kad;
                    kad.remove_peer(&peer);
                    kad.get_closest_peers(peer);
                }
            }
        }
    }

    /// A lookup by id of a peer whose dials failed ([`ConnectionAction::LookUp`]) ended: the
    /// peer is dialled at the addresses the peers that know it gave, its current ones among
    /// them, unless the lookup connected it already.
    fn on_looked_up(&mut self, found: kad::GetClosestPeersOk) {
        let looked_up = PeerId::from_bytes(&found.key).ok();
        for peer in found.peers {
            if Some(peer.peer_id) == looked_up
                && !peer.addrs.is_empty()
                && !self.connections.is_connected(peer.peer_id)
            {
                // Refused, and nothing to tell, when a dial is under way already.
                let _ = self.dial_offered(peer.peer_id, peer.addrs);
            }
        }
    }

    /// Dials `peer` unless it is connected; even while a dial of ours is pending (a disconnect
    /// aborts it).
    fn dial(&mut self, peer: PeerId) {
        let dial = DialOpts::peer_id(peer)
            .condition(PeerCondition::Disconnected)
            .build();
        if let Err(error) = self.swarm.dial(dial) {
            debug!(%peer, %error, "cannot dial the peer");
        }
    }

    /// Puts the addresses `peer` offers that this node dials ([`by_preference`]) in the DHT and
    /// dials the peer over them, unless it is connected or being dialled.
    fn dial_offered(
        &mut self,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    ) -> Result<(), libp2p::swarm::DialError> {
        let (dialled, _) = by_preference(addrs);
        let kad = &mut self.swarm.behaviour_mut().kad;
        for addr in &dialled {
            kad.add_address(&peer, addr.clone());
        }
        self.swarm
            .dial(DialOpts::peer_id(peer).addresses(dialled).build())
    }

    /// Tells the node how it is connected to `peer` if that changed: the best of the pair's
    /// open connections, dial-backs left out.
    fn update_link(&mut self, peer: PeerId) {
        let Some(kind) = self.connections.link(peer) else {
            return; // the last connection closed: `Disconnected` says so
        };
        if self.links.insert(peer, kind) != Some(kind) {
            debug!(%peer, ?kind, "connected another way");
            self.emit(NetworkEvent::Link { peer, kind });
        }
    }
}

/// Counts `event` in libp2p's metrics: the swarm's and each protocol's that libp2p measures.
fn record(metrics: &Metrics, event: &SwarmEvent<BehaviourEvent>) {
    metrics.record(event);
    match event {
        SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(e)) => metrics.record(e),
        SwarmEvent::Behaviour(BehaviourEvent::Identify(e)) => metrics.record(e),
        SwarmEvent::Behaviour(BehaviourEvent::Kad(e)) => metrics.record(e),
        SwarmEvent::Behaviour(BehaviourEvent::Ping(e)) => metrics.record(e),
        SwarmEvent::Behaviour(BehaviourEvent::Dcutr(e)) => metrics.record(e),
        SwarmEvent::Behaviour(BehaviourEvent::Relay(e)) => metrics.record(e),
        _ => {}
    }
}
