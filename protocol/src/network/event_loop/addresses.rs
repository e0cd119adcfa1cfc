//! The addresses of peers: which of them this node dials, and their parts.

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};

/// `addr` without a trailing `/p2p/<id>`.
pub(super) fn without_peer_id(mut addr: Multiaddr) -> Multiaddr {
    if matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
        addr.pop();
    }
    addr
}

/// A peer's addresses split into those this node dials and those it passes over: its TCP ones
/// if it offers any, else all (decision 0061). A dial by peer id races every address it is
/// given and keeps the first connection, which is usually QUIC's; so which transport a pair
/// ended on changed with every reconnect. Over TCP, exchanges on internet links finish sooner
/// (decision 0031) and a connection keeps less memory, and a swarm's connections stay on one
/// transport however often its peers restart.
pub(super) fn by_preference(addrs: Vec<Multiaddr>) -> (Vec<Multiaddr>, Vec<Multiaddr>) {
    let is_tcp = |addr: &Multiaddr| addr.iter().any(|p| matches!(p, Protocol::Tcp(_)));
    if addrs.iter().any(is_tcp) {
        addrs.into_iter().partition(is_tcp)
    } else {
        (addrs, Vec::new())
    }
}

/// The peer id at the end of a `/p2p/<id>` address, if any.
pub(super) fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    addr.iter().find_map(|p| match p {
        Protocol::P2p(peer) => Some(peer),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> Vec<Multiaddr> {
        list.iter()
            .map(|a| a.parse().expect("an address"))
            .collect()
    }

    #[test]
    fn a_peer_offering_tcp_is_dialled_over_tcp_only() {
        let offered = addrs(&[
            "/ip4/10.0.0.1/udp/4001/quic-v1",
            "/ip4/10.0.0.1/tcp/4001",
            "/ip6/::1/tcp/4001",
        ]);
        let (dialled, passed_over) = by_preference(offered);
        assert_eq!(
            dialled,
            addrs(&["/ip4/10.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"])
        );
        assert_eq!(passed_over, addrs(&["/ip4/10.0.0.1/udp/4001/quic-v1"]));
    }

    #[test]
    fn a_peer_offering_no_tcp_is_dialled_over_what_it_offers() {
        let offered = addrs(&["/ip4/10.0.0.1/udp/4001/quic-v1", "/memory/7"]);
        let (dialled, passed_over) = by_preference(offered.clone());
        assert_eq!(dialled, offered);
        assert!(passed_over.is_empty());
    }
}
