//! Whether peers can dial this node, and how it is connected to each peer.
//!
//! Candidates for this node's public addresses come from identify: each peer says which address
//! it sees this node's connection come from. AutoNAT v2 asks peers to dial a candidate back over
//! a fresh port, which a NAT drops unless the port is forwarded, so a candidate it confirms is
//! an address anyone can dial. A node with a confirmed address is `public`; one whose candidates
//! all failed is `private`, and is reached through relays; before any test it is `unknown`.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;
use serde::Serialize;

/// Whether peers can dial this node directly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Reachability {
    /// A peer dialled one of this node's addresses back over a port it had not used before.
    Public,
    /// Every address tested failed: the node sits behind a NAT or a firewall.
    Private,
    /// Nothing tested yet.
    #[default]
    Unknown,
}

impl std::fmt::Display for Reachability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reachability::Public => "public",
            Reachability::Private => "private",
            Reachability::Unknown => "unknown",
        })
    }
}

/// How the NAT in front of this node maps its sockets, as peers' observations of its address
/// tell: what decides whether a hole punch can work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mapping {
    /// Fewer than two peers have said where they see this node's connections come from.
    #[default]
    Unknown,
    /// Every peer sees a socket at one address: no NAT, or one that maps a socket to one port
    /// whatever it sends to (a home router). Hole punches through it can work.
    EndpointIndependent,
    /// Peers see one socket at different ports: a NAT that maps a socket anew for each
    /// destination (symmetric, many carrier-grade NATs). No hole punch through it works.
    EndpointDependent,
}

impl std::fmt::Display for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Mapping::Unknown => "unknown",
            Mapping::EndpointIndependent => "endpoint_independent",
            Mapping::EndpointDependent => "endpoint_dependent",
        })
    }
}

/// Hole punches this node took part in (DCUtR), either side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Punches {
    pub succeeded: u64,
    pub failed: u64,
}

/// What the node knows of its own reachability.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reach {
    pub reachability: Reachability,
    /// Addresses of this node that a peer dialled back (with no peer id).
    pub confirmed: Vec<Multiaddr>,
    /// Addresses through relays that hold a reservation for this node.
    pub relayed: Vec<Multiaddr>,
    pub mapping: Mapping,
    pub punches: Punches,
}

impl Reach {
    /// Whether this node can never take a connection a peer dials, so that only peers with
    /// public addresses can exchange with it: peers cannot dial it (AutoNAT), and its NAT maps
    /// each destination anew, or hole punches failed again and again and none worked.
    pub fn cannot_accept_connections(&self) -> bool {
        self.reachability == Reachability::Private
            && (self.mapping == Mapping::EndpointDependent
                || (self.punches.failed >= PUNCHES_BEFORE_CLIENT && self.punches.succeeded == 0))
    }
}

/// Failed hole punches, with none that worked, after which a private node takes itself for one
/// that cannot accept connections ([`Reach::cannot_accept_connections`]).
pub const PUNCHES_BEFORE_CLIENT: u64 = 3;

/// The limits of a node that serves as a relay (`relay = true` in the node config). The
/// defaults are libp2p's: enough for heartbeats and offers, not for parameters, so a relay run
/// with them carries control only.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelayLimits {
    /// Peers that may hold a reservation (be reachable through this relay) at once.
    pub max_reservations: usize,
    /// Circuits relayed at once, and per peer.
    pub max_circuits: usize,
    pub max_circuits_per_peer: usize,
    /// A circuit is closed after this long or this many bytes, whichever comes first.
    pub max_circuit_duration: Duration,
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        RelayLimits {
            max_reservations: 128,
            max_circuits: 16,
            max_circuits_per_peer: 4,
            max_circuit_duration: Duration::from_secs(120),
            max_circuit_bytes: 128 * 1024,
        }
    }
}

/// Whether `addr` goes through a relay.
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| matches!(p, Protocol::P2pCircuit))
}

/// How many failed candidates a [`Tracker`] remembers.
const FAILED_KEPT: usize = 16;
/// How many peers' observations of this node's address a [`Tracker`] remembers.
const OBSERVED_KEPT: usize = 16;

/// Keeps track of what AutoNAT and the relays say of this node.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    confirmed: Vec<Multiaddr>,
    relayed: Vec<Multiaddr>,
    /// Candidates a dial back failed on, until one is confirmed.
    failed: HashSet<Multiaddr>,
    /// Where peers see this node's connections come from: each peer's latest observation of a
    /// connection this node holds from its own listening socket, by peer.
    observed: HashMap<libp2p::PeerId, Multiaddr>,
    punches: Punches,
}

impl Tracker {
    /// The swarm confirmed `addr` as an address of this node: by AutoNAT, or a relay's
    /// reservation for a relayed one.
    pub(crate) fn confirmed(&mut self, addr: Multiaddr) {
        let list = if is_relayed(&addr) {
            &mut self.relayed
        } else {
            self.failed.remove(&addr);
            &mut self.confirmed
        };
        if !list.contains(&addr) {
            list.push(addr);
        }
    }

    /// `addr` is no longer an address of this node (a relay dropped its reservation, or a
    /// later test failed).
    pub(crate) fn expired(&mut self, addr: &Multiaddr) {
        self.confirmed.retain(|a| a != addr);
        self.relayed.retain(|a| a != addr);
    }

    /// A peer's dial back to candidate `addr` failed. Behind a NAT that maps each connection
    /// anew, every connection brings a new candidate; only whether any failed is used, so a
    /// few are kept, not all.
    pub(crate) fn test_failed(&mut self, addr: Multiaddr) {
        if self.failed.len() < FAILED_KEPT {
            self.failed.insert(addr);
        }
    }

    /// `peer` sees this node's connection come from `addr` (identify). Only connections made
    /// from the node's listening socket count (port reuse): a connection from a fresh port
    /// says nothing of how the NAT maps the socket peers dial.
    pub(crate) fn observed(&mut self, peer: libp2p::PeerId, addr: Multiaddr) {
        if is_relayed(&addr) {
            return;
        }
        if self.observed.len() >= OBSERVED_KEPT && !self.observed.contains_key(&peer) {
            return;
        }
        self.observed.insert(peer, addr);
    }

    /// A hole punch ended.
    pub(crate) fn punched(&mut self, succeeded: bool) {
        if succeeded {
            self.punches.succeeded += 1;
        } else {
            self.punches.failed += 1;
        }
    }

    pub(crate) fn reachability(&self) -> Reachability {
        if !self.confirmed.is_empty() {
            Reachability::Public
        } else if !self.failed.is_empty() {
            Reachability::Private
        } else {
            Reachability::Unknown
        }
    }

    pub(crate) fn reach(&self) -> Reach {
        Reach {
            reachability: self.reachability(),
            confirmed: self.confirmed.clone(),
            relayed: self.relayed.clone(),
            mapping: mapping_of(self.observed.values()),
            punches: self.punches,
        }
    }
}

/// How a NAT maps, from where peers see one node's connections come from: two observations of
/// one host and transport at different ports show a mapping per destination.
fn mapping_of<'a>(observed: impl Iterator<Item = &'a Multiaddr>) -> Mapping {
    // Each address without its port: the host and transport a port was seen for.
    let mut ports: HashMap<Multiaddr, HashSet<u16>> = HashMap::new();
    let mut seen = 0;
    for addr in observed {
        let mut host = Multiaddr::empty();
        let mut port = None;
        for protocol in addr.iter() {
            match protocol {
                Protocol::Tcp(p) => {
                    port = Some(p);
                    host.push(Protocol::Tcp(0));
                }
                Protocol::Udp(p) => {
                    port = Some(p);
                    host.push(Protocol::Udp(0));
                }
                Protocol::P2p(_) => {}
                other => host.push(other),
            }
        }
        if let Some(port) = port {
            ports.entry(host).or_default().insert(port);
            seen += 1;
        }
    }
    if ports.values().any(|ports| ports.len() > 1) {
        Mapping::EndpointDependent
    } else if seen >= 2 {
        Mapping::EndpointIndependent
    } else {
        Mapping::Unknown
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(text: &str) -> Multiaddr {
        text.parse().expect("an address")
    }

    #[test]
    fn a_node_is_unknown_until_tested_then_private_until_a_dial_back_succeeds() {
        let mut tracker = Tracker::default();
        assert_eq!(tracker.reachability(), Reachability::Unknown);

        tracker.test_failed(addr("/ip4/198.51.100.7/tcp/4001"));
        assert_eq!(tracker.reachability(), Reachability::Private);

        // A reservation on a relay does not make the node dialable directly.
        let relayed = addr(
            "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
        );
        tracker.confirmed(relayed.clone());
        assert_eq!(tracker.reachability(), Reachability::Private);
        assert_eq!(tracker.reach().relayed, vec![relayed.clone()]);

        tracker.confirmed(addr("/ip4/198.51.100.7/tcp/4001"));
        assert_eq!(tracker.reachability(), Reachability::Public);
        tracker.expired(&addr("/ip4/198.51.100.7/tcp/4001"));
        assert_eq!(
            tracker.reachability(),
            Reachability::Unknown,
            "a confirmed address that expired is not a failed test"
        );
        tracker.expired(&relayed);
        assert!(tracker.reach().relayed.is_empty());
    }

    #[test]
    fn relayed_addresses_are_told_from_direct_ones() {
        assert!(is_relayed(&addr(
            "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
        )));
        assert!(!is_relayed(&addr("/ip4/198.51.100.1/udp/4001/quic-v1")));
    }

    #[test]
    fn peers_that_see_one_socket_at_different_ports_show_a_symmetric_nat() {
        let peers: Vec<libp2p::PeerId> = (0..3).map(|_| libp2p::PeerId::random()).collect();
        let mut home = Tracker::default();
        home.observed(peers[0], addr("/ip4/203.0.113.7/tcp/4001"));
        assert_eq!(
            home.reach().mapping,
            Mapping::Unknown,
            "one observation tells nothing"
        );
        home.observed(peers[1], addr("/ip4/203.0.113.7/tcp/4001"));
        home.observed(peers[2], addr("/ip4/203.0.113.7/udp/4002/quic-v1"));
        assert_eq!(home.reach().mapping, Mapping::EndpointIndependent);

        let mut symmetric = Tracker::default();
        symmetric.observed(peers[0], addr("/ip4/203.0.113.8/tcp/31002"));
        symmetric.observed(peers[1], addr("/ip4/203.0.113.8/tcp/47113"));
        assert_eq!(symmetric.reach().mapping, Mapping::EndpointDependent);

        symmetric.test_failed(addr("/ip4/203.0.113.8/tcp/31002"));
        assert!(symmetric.reach().cannot_accept_connections());
        home.test_failed(addr("/ip4/203.0.113.7/tcp/4001"));
        assert!(
            !home.reach().cannot_accept_connections(),
            "a home router can be punched through"
        );
    }

    #[test]
    fn a_private_node_whose_hole_punches_all_fail_cannot_accept_connections() {
        let mut tracker = Tracker::default();
        tracker.test_failed(addr("/ip4/203.0.113.7/tcp/4001"));
        for _ in 0..PUNCHES_BEFORE_CLIENT {
            assert!(!tracker.reach().cannot_accept_connections());
            tracker.punched(false);
        }
        assert!(tracker.reach().cannot_accept_connections());
        tracker.punched(true);
        assert!(!tracker.reach().cannot_accept_connections());
    }

    #[test]
    fn a_node_behind_a_nat_that_maps_anew_keeps_a_few_failed_candidates() {
        let mut tracker = Tracker::default();
        for port in 1000..1100 {
            tracker.test_failed(addr(&format!("/ip4/203.0.113.7/tcp/{port}")));
        }
        assert_eq!(tracker.reachability(), Reachability::Private);
        assert_eq!(tracker.failed.len(), FAILED_KEPT);
    }
}
