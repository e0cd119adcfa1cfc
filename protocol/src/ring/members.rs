//! Who is in a ring, in which order, and the hash that names them.

use libp2p_identity::PeerId;
use sha2::{Digest, Sha256};

/// The members of one ring, sorted by peer id, and the hash that names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingMembers {
    peers: Vec<PeerId>,
    hash: u64,
}

impl RingMembers {
    /// The ring of `peers` (any order, duplicates ignored) in run `run_id`.
    pub fn new(run_id: &str, mut peers: Vec<PeerId>) -> Self {
        peers.sort_by_key(|peer| peer.to_bytes());
        peers.dedup();
        let mut hasher = Sha256::new();
        hasher.update(run_id.as_bytes());
        for peer in &peers {
            let bytes = peer.to_bytes();
            hasher.update((bytes.len() as u32).to_le_bytes());
            hasher.update(&bytes);
        }
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest[..8]);
        RingMembers {
            peers,
            hash: u64::from_le_bytes(first),
        }
    }

    pub fn peers(&self) -> &[PeerId] {
        &self.peers
    }

    pub fn len(&self) -> usize {
        self.peers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The hash every data connection of this ring carries.
    pub fn hash(&self) -> u64 {
        self.hash
    }

    /// `peer`'s position in the ring.
    pub fn rank_of(&self, peer: &PeerId) -> Option<usize> {
        self.peers.iter().position(|p| p == peer)
    }

    /// The member `rank` sends to.
    pub fn right_of(&self, rank: usize) -> PeerId {
        self.peers[(rank + 1) % self.peers.len()]
    }

    /// The member `rank` receives from.
    pub fn left_of(&self, rank: usize) -> PeerId {
        self.peers[(rank + self.peers.len() - 1) % self.peers.len()]
    }
}
