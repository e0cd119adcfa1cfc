//! How a node that peers cannot dial is reached: the relays it listens through, the relayed
//! addresses it announces for the peers it relays, what it knows of its own reachability, and
//! the quick lookups of a private node.

use std::time::{Duration, Instant};

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use tracing::{debug, info};

use super::EventLoop;
use super::addresses::{by_preference, without_peer_id};
use crate::membership::ConnectionKind;
use crate::network::NetworkEvent;
use crate::network::reachability::{Reachability, Tracker, is_relayed};

/// How many relays a node that peers cannot dial keeps a reservation on: one more than it
/// needs, so that one relay leaving does not cut it off while it finds another.
const RELAYS_KEPT: usize = 2;
/// The pause after a private node's first quick lookup of the run's members (see
/// `EventLoop::look_up_while_private`).
const FIRST_PRIVATE_LOOKUP_PAUSE: Duration = Duration::from_secs(1);

impl EventLoop {
    /// Puts in the DHT the address at which `peer`, which now holds a reservation with this
    /// relay, is reached through it: this relay's address the peer dialled, and the circuit.
    /// The peer tells the peers it is connected to with an identify push, but over QUIC the
    /// push is lost: the pushing side drops the stream unread, QUIC stops it, and the
    /// receiving side's protocol negotiation, which writes back, fails. So members behind
    /// NAT never learnt each other's relayed address from the DHT, and never met over QUIC.
    pub(super) fn announce_relayed(&mut self, peer: PeerId) {
        let relay = *self.swarm.local_peer_id();
        let circuits: Vec<Multiaddr> = self
            .connections
            .to(peer)
            .filter(|o| o.kind == ConnectionKind::Direct && !o.dial_back)
            .filter_map(|o| o.dialled_here.clone())
            .map(|addr| {
                without_peer_id(addr)
                    .with(Protocol::P2p(relay))
                    .with(Protocol::P2pCircuit)
                    .with(Protocol::P2p(peer))
            })
            .collect();
        let kad = &mut self.swarm.behaviour_mut().kad;
        for addr in circuits {
            debug!(%peer, %addr, "a peer listens through this relay");
            kad.add_address(&peer, addr);
        }
    }

    /// Applies `change` to what the node knows of its reachability and tells the node if that
    /// changed.
    pub(super) fn update_reach(&mut self, change: impl FnOnce(&mut Tracker)) {
        let before = self.reach.reach();
        change(&mut self.reach);
        let now = self.reach.reach();
        if now.reachability != before.reachability {
            info!(reachability = %now.reachability, "peers' view of this node changed");
        }
        if now != before {
            self.emit(NetworkEvent::Reach(now));
        }
    }

    /// The direct address this node reaches `peer` at: the one it dialled, else the first it
    /// would dial of those the peer listens on.
    pub(super) fn direct_address_of(
        &self,
        peer: PeerId,
        listen_addrs: &[Multiaddr],
    ) -> Option<Multiaddr> {
        let dialled = self
            .connections
            .to(peer)
            .find(|o| o.kind != ConnectionKind::Relayed)
            .map(|o| o.remote.clone());
        dialled.or_else(|| {
            let direct = listen_addrs.iter().filter(|a| !is_relayed(a)).cloned();
            by_preference(direct.collect()).0.into_iter().next()
        })
    }

    /// A node that peers cannot dial looks the run's members up 1, 2, 4... seconds apart after
    /// it finds out, up to the discovery interval: the members behind NAT it must punch
    /// through to are found once both listen through relays, within seconds rather than the
    /// interval. A public node keeps to the interval: lookups dial members, and two members
    /// that dial each other at once hold a spare connection until one is pruned (decision
    /// 0067).
    pub(super) fn look_up_while_private(&mut self) {
        if self.reach.reachability() != Reachability::Private {
            return;
        }
        let now = Instant::now();
        let (due, pause) = *self
            .private_lookup
            .get_or_insert((now, FIRST_PRIVATE_LOOKUP_PAUSE));
        if now < due || pause > self.config.discovery_interval {
            return;
        }
        self.swarm
            .behaviour_mut()
            .kad
            .get_providers(self.run_key.clone());
        self.private_lookup = Some((now + pause, pause * 2));
    }

    /// While peers cannot dial this node, listens through up to [`RELAYS_KEPT`] of the
    /// connected relays: each holds a reservation for the node, and peers dial it through the
    /// relay and then hole-punch a direct connection.
    pub(super) fn keep_relays(&mut self) {
        if self.reach.reachability() != Reachability::Private {
            return;
        }
        self.relay_listeners
            .retain(|relay, _| self.relays.contains_key(relay));
        let wanted = RELAYS_KEPT.saturating_sub(self.relay_listeners.len());
        let candidates: Vec<(PeerId, Multiaddr)> = self
            .relays
            .iter()
            .filter(|(relay, _)| !self.relay_listeners.contains_key(relay))
            .take(wanted)
            .map(|(relay, addr)| (*relay, addr.clone()))
            .collect();
        for (relay, addr) in candidates {
            let circuit = without_peer_id(addr)
                .with(Protocol::P2p(relay))
                .with(Protocol::P2pCircuit);
            match self.swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    info!(%relay, addr = %circuit, "listening through a relay");
                    self.relay_listeners.insert(relay, listener);
                }
                Err(error) => {
                    debug!(%relay, %error, "cannot listen through the relay");
                    self.relays.remove(&relay);
                }
            }
        }
    }
}
