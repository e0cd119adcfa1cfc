//! A simulated network (feature `sim`): many nodes in one process, each with a [`Client`] and
//! network events as the swarm task gives them, over links that delay, throttle, lose
//! heartbeats and can be cut, in the tokio runtime's time. Run in a runtime whose clock is
//! paused, a node's minutes take milliseconds, and the node code above the network runs as it
//! does on real links: the simulator drives the engine itself (decision 0080).
//!
//! What it keeps of libp2p is what the node sees: connected pairs (a node connects to every
//! other over a link that is up and that neither side blocks), heartbeats checked as the swarm
//! task checks them, streams of the protocols a node accepts. What it leaves out is how libp2p
//! gets there: no dialling, no gossipsub mesh (a heartbeat goes to the connected peers, not
//! further), no relays.

mod pipe;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use libp2p::{Multiaddr, PeerId, StreamProtocol};
use rand::rngs::ChaCha8Rng;
use rand::{RngExt, SeedableRng};
use tokio::sync::mpsc;

use pipe::Channel;
pub(crate) use pipe::Pipe;

use super::inbound::Queues;
use super::streams::OpenStreamError;
use super::{Backend, CHANNEL_CAPACITY, Client, Command, DroppedEvents, NetworkEvent, Stream};
use crate::heartbeat::{CLOCK_WINDOW, Heartbeat, unix_ms_now};
use crate::membership::ConnectionKind;

/// How one node reaches another.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// One way.
    pub latency: Duration,
    /// Each direction's.
    pub bytes_per_second: f64,
    /// The share of heartbeats lost on the way, at random.
    pub heartbeat_loss: f64,
    pub up: bool,
}

impl Link {
    pub fn new(latency: Duration, bytes_per_second: f64) -> Self {
        Link {
            latency,
            bytes_per_second,
            heartbeat_loss: 0.0,
            up: true,
        }
    }
}

/// The simulated network: a handle on it, cheap to clone.
#[derive(Clone, Debug)]
pub struct SimulatedNetwork {
    world: Arc<Mutex<World>>,
}

#[derive(Debug)]
struct World {
    run_id: String,
    fingerprint: String,
    /// Ordered, as everything the network iterates: a run's events come in one order.
    nodes: BTreeMap<PeerId, Node>,
    /// Every link that is not the default, by its pair in order.
    links: HashMap<(PeerId, PeerId), Link>,
    default_link: Link,
    /// The directions of every stream between a pair, to break when the pair parts.
    channels: HashMap<(PeerId, PeerId), Vec<Weak<Mutex<Channel>>>>,
    rng: ChaCha8Rng,
}

#[derive(Debug)]
struct Node {
    events: mpsc::Sender<NetworkEvent>,
    inbound: Queues,
    blocked: BTreeSet<PeerId>,
    dropped: DroppedEvents,
}

/// One node's place on the simulated network: what its [`Client`] holds.
#[derive(Clone, Debug)]
pub(crate) struct Port {
    world: Arc<Mutex<World>>,
    me: PeerId,
}

fn pair(a: PeerId, b: PeerId) -> (PeerId, PeerId) {
    if a < b { (a, b) } else { (b, a) }
}

impl SimulatedNetwork {
    /// A network for run `run_id` with model `fingerprint` (what heartbeats are checked
    /// against), whose links are `default_link` until set otherwise; `seed` picks the lost
    /// heartbeats.
    pub fn new(run_id: &str, fingerprint: &str, default_link: Link, seed: u64) -> Self {
        let world = World {
            run_id: run_id.to_owned(),
            fingerprint: fingerprint.to_owned(),
            nodes: BTreeMap::new(),
            links: HashMap::new(),
            default_link,
            channels: HashMap::new(),
            rng: ChaCha8Rng::seed_from_u64(seed),
        };
        SimulatedNetwork {
            world: Arc::new(Mutex::new(world)),
        }
    }

    fn world(&self) -> MutexGuard<'_, World> {
        lock(&self.world)
    }

    /// Puts node `me` on the network: its client and its events, as [`super::new`] gives
    /// them. It connects at once to every node its links reach. A node that is on already is
    /// taken off first (a restart).
    pub fn join(&self, me: PeerId) -> (Client, mpsc::Receiver<NetworkEvent>) {
        self.leave(me);
        let (events, event_rx) = mpsc::channel(CHANNEL_CAPACITY);
        let node = Node {
            events,
            inbound: Queues::default(),
            blocked: BTreeSet::new(),
            dropped: DroppedEvents::default(),
        };
        let client = Client {
            peer_id: me,
            inbound: node.inbound.clone(),
            dropped: node.dropped.clone(),
            backend: Backend::Simulated(Port {
                world: Arc::clone(&self.world),
                me,
            }),
        };
        let mut world = self.world();
        let before = world.connected_pairs();
        world.nodes.insert(me, node);
        world.announce_changes(&before);
        (client, event_rx)
    }

    /// Takes node `me` off the network, as a killed process leaves it: its streams break and
    /// its peers see it disconnect.
    pub fn leave(&self, me: PeerId) {
        let mut world = self.world();
        let before = world.connected_pairs();
        let left = world.nodes.remove(&me);
        if left.is_some() {
            world.announce_changes(&before);
        }
        drop(world);
        // Dropped once the network is unlocked: streams queued for the node may go with it.
        drop(left);
    }

    /// The link between `a` and `b`.
    pub fn link(&self, a: PeerId, b: PeerId) -> Link {
        self.world().link(a, b)
    }

    /// Sets the link between `a` and `b`; the pair connects or disconnects as it says, and
    /// a cut breaks their streams.
    pub fn set_link(&self, a: PeerId, b: PeerId, link: Link) {
        let mut world = self.world();
        let before = world.connected_pairs();
        world.links.insert(pair(a, b), link);
        world.announce_changes(&before);
    }

    /// Whether `a` and `b` are connected now: both on the network, over a link that is up,
    /// neither blocking the other.
    pub fn connected(&self, a: PeerId, b: PeerId) -> bool {
        self.world().connected(a, b)
    }

    /// Sets every link back to the default.
    pub fn reset_links(&self) {
        let mut world = self.world();
        let before = world.connected_pairs();
        world.links.clear();
        world.announce_changes(&before);
    }
}

fn lock(world: &Mutex<World>) -> MutexGuard<'_, World> {
    world
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl World {
    fn link(&self, a: PeerId, b: PeerId) -> Link {
        self.links
            .get(&pair(a, b))
            .copied()
            .unwrap_or(self.default_link)
    }

    fn connected(&self, a: PeerId, b: PeerId) -> bool {
        let (Some(node_a), Some(node_b)) = (self.nodes.get(&a), self.nodes.get(&b)) else {
            return false;
        };
        a != b && self.link(a, b).up && !node_a.blocked.contains(&b) && !node_b.blocked.contains(&a)
    }

    fn connected_pairs(&self) -> BTreeSet<(PeerId, PeerId)> {
        let ids: Vec<PeerId> = self.nodes.keys().copied().collect();
        let mut pairs = BTreeSet::new();
        for (i, &a) in ids.iter().enumerate() {
            for &b in &ids[i + 1..] {
                if self.connected(a, b) {
                    pairs.insert(pair(a, b));
                }
            }
        }
        pairs
    }

    /// Tells each node of the pairs that connected or parted since `before`, and breaks the
    /// streams of the pairs that parted.
    fn announce_changes(&mut self, before: &BTreeSet<(PeerId, PeerId)>) {
        let now = self.connected_pairs();
        for &(a, b) in before.difference(&now) {
            for channel in self.channels.remove(&(a, b)).unwrap_or_default() {
                if let Some(channel) = channel.upgrade() {
                    pipe::break_channel(&channel);
                }
            }
            self.emit(a, NetworkEvent::Disconnected(b));
            self.emit(b, NetworkEvent::Disconnected(a));
        }
        for &(a, b) in now.difference(before) {
            let rtt = self.link(a, b).latency * 2;
            for (me, peer) in [(a, b), (b, a)] {
                self.emit(me, NetworkEvent::Connected(peer));
                self.emit(
                    me,
                    NetworkEvent::Link {
                        peer,
                        kind: ConnectionKind::Direct,
                    },
                );
                self.emit(me, NetworkEvent::Rtt { peer, rtt });
            }
        }
    }

    /// Hands `event` to node `to`, as the swarm task does: dropped (and counted) when the node
    /// is not taking its events.
    fn emit(&self, to: PeerId, event: NetworkEvent) {
        let Some(node) = self.nodes.get(&to) else {
            return;
        };
        if let Err(mpsc::error::TrySendError::Full(_)) = node.events.try_send(event) {
            node.dropped.add_one();
        }
    }

    /// Node `from`'s heartbeat to every node it is connected to, each after its link's
    /// latency unless the link loses it, checked on arrival as the swarm task checks it. One
    /// task carries it to all the nodes at the same latency (a swarm's heartbeats are most of
    /// the simulator's events).
    fn publish(world: &Arc<Mutex<World>>, from: PeerId, bytes: Vec<u8>) {
        let mut this = lock(world);
        let mut by_latency: BTreeMap<Duration, Vec<PeerId>> = BTreeMap::new();
        let ids: Vec<PeerId> = this.nodes.keys().copied().collect();
        for to in ids {
            let link = this.link(from, to);
            if this.connected(from, to)
                && !this.rng.random_bool(link.heartbeat_loss.clamp(0.0, 1.0))
            {
                by_latency.entry(link.latency).or_default().push(to);
            }
        }
        drop(this);
        let bytes = Arc::new(bytes);
        for (latency, targets) in by_latency {
            let (world, bytes) = (Arc::downgrade(world), Arc::clone(&bytes));
            tokio::spawn(async move {
                tokio::time::sleep(latency).await;
                let Some(world) = world.upgrade() else {
                    return;
                };
                let world = lock(&world);
                let event = match Heartbeat::decode(&bytes, &world.run_id, &world.fingerprint)
                    .and_then(|heartbeat| {
                        heartbeat.check_clock(unix_ms_now(), CLOCK_WINDOW)?;
                        Ok(heartbeat)
                    }) {
                    Ok(heartbeat) => NetworkEvent::Heartbeat {
                        peer: from,
                        heartbeat,
                    },
                    Err(reason) => NetworkEvent::Rejected { peer: from, reason },
                };
                for to in targets.into_iter().filter(|&to| world.connected(from, to)) {
                    world.emit(to, event.clone());
                }
            });
        }
    }
}

impl Port {
    /// Carries out a command the swarm task would, at once.
    pub(super) fn handle(&self, command: Command) {
        let me = self.me;
        match command {
            Command::ListenAddrs(reply) => {
                let _ = reply.send(Vec::<Multiaddr>::new());
            }
            // Every node is connected to every other it has a link to already.
            Command::Dial(_, reply) => {
                let _ = reply.send(Ok(()));
            }
            Command::Publish(bytes, reply) => {
                World::publish(&self.world, me, bytes);
                let _ = reply.send(Ok(()));
            }
            Command::PublishNow(bytes) => World::publish(&self.world, me, bytes),
            Command::ConnectedPeers(reply) => {
                let _ = reply.send(self.connected_peers());
            }
            Command::Connections(reply) => {
                let peers = self.connected_peers();
                let _ = reply.send(peers.into_iter().map(|p| (p, Vec::new())).collect());
            }
            Command::Block(peer, reply) => {
                self.set_blocked(peer, true);
                let _ = reply.send(());
            }
            Command::BlockNow(peer) => self.set_blocked(peer, true),
            Command::UnblockNow(peer) => self.set_blocked(peer, false),
        }
    }

    fn connected_peers(&self) -> Vec<PeerId> {
        let world = lock(&self.world);
        let mut peers: Vec<PeerId> = world
            .nodes
            .keys()
            .copied()
            .filter(|&p| world.connected(self.me, p))
            .collect();
        peers.sort();
        peers
    }

    fn set_blocked(&self, peer: PeerId, blocked: bool) {
        let mut world = lock(&self.world);
        let before = world.connected_pairs();
        if let Some(node) = world.nodes.get_mut(&self.me) {
            if blocked {
                node.blocked.insert(peer);
            } else {
                node.blocked.remove(&peer);
            }
        }
        world.announce_changes(&before);
    }

    /// Opens a stream of `protocol` to `peer`, if the pair is connected and the peer accepts
    /// the protocol. As a libp2p stream on a connection that is up, it costs no round trip:
    /// the peer has it at once, and its first bytes after the link's latency.
    pub(super) async fn open_stream(
        &self,
        peer: PeerId,
        protocol: StreamProtocol,
    ) -> Result<Stream, OpenStreamError> {
        let refused = |why: &str| Err(OpenStreamError::Simulated(format!("{peer}: {why}")));
        let mut world = lock(&self.world);
        if !world.connected(self.me, peer) {
            return refused("not connected");
        }
        let inbound = world.nodes[&peer].inbound.clone();
        if !inbound.protocols(false).contains(&protocol) {
            return refused(&format!("does not take {protocol}"));
        }
        let latency = world.link(self.me, peer).latency;
        let (mine, theirs, channels) =
            Pipe::pair(Arc::downgrade(&self.world), self.me, peer, latency);
        let open = world.channels.entry(pair(self.me, peer)).or_default();
        // The directions of streams that ended go here, so that a pair that exchanges for a
        // long run keeps no more than the streams it has open.
        open.retain(|channel| channel.strong_count() > 0);
        open.extend(channels);
        drop(world);
        inbound.queue(self.me, theirs.into(), protocol);
        Ok(mine.into())
    }

    /// The link a pipe's bytes travel now, if the pair is still connected.
    fn link_now(world: &Weak<Mutex<World>>, from: PeerId, to: PeerId) -> Option<Link> {
        let world = world.upgrade()?;
        let world = lock(&world);
        world.connected(from, to).then(|| world.link(from, to))
    }
}

#[cfg(test)]
mod tests;
