//! The peers this node trusts: those it lets into its rings, and among which it elects an
//! elastic center.

use std::collections::BTreeSet;

use libp2p_identity::PeerId;

use crate::ring::RingMembers;

/// The peers this node lets into its rings: a ring is formed from trusted live members only, and
/// a ring stream from anyone else is refused.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrustList(BTreeSet<PeerId>);

impl TrustList {
    pub fn new(peers: impl IntoIterator<Item = PeerId>) -> Self {
        TrustList(peers.into_iter().collect())
    }

    pub fn contains(&self, peer: &PeerId) -> bool {
        self.0.contains(peer)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Trusted peers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The ring of a round: this node and the trusted ones among `live`.
    pub fn ring(
        &self,
        run_id: &str,
        me: PeerId,
        live: impl IntoIterator<Item = PeerId>,
    ) -> RingMembers {
        let members = live
            .into_iter()
            .filter(|peer| self.contains(peer))
            .chain(std::iter::once(me))
            .collect();
        RingMembers::new(run_id, members)
    }
}
