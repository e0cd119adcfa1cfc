//! What the node's unit tests build their actors from: one node's settings and read side.

use std::time::Duration;

use murmur_protocol::codec::Codec;
use murmur_protocol::network::{DroppedEvents, PeerId};
use murmur_protocol::trust::TrustList;
use murmur_sync::settings::{Mode, Outer, SyncSettings};
use tokio_util::sync::CancellationToken;

use crate::readout::{Feeds, Readout};
use crate::settings::Identity;

/// The run every test node is of.
pub(crate) const RUN_ID: &str = "node-test";

/// Gossip every `interval` steps within a staleness bound of 64, trusting `me`.
pub(crate) fn gossip(me: PeerId, interval: u64) -> SyncSettings {
    SyncSettings {
        mode: Mode::Gossip,
        interval,
        max_staleness: Some(64),
        age_weighting: false,
        overlap: false,
        max_merge_lag: 256,
        adapt_interval: false,
        outer: Outer::Average,
        codec: Codec::F32,
        sparse_codec: None,
        slowdown: 1.0,
        relayed_exchanges: false,
        seed: 1,
        trust: TrustList::new([me]),
    }
}

/// The read side of node `me` of a toy model of two values, and what its actors feed it.
pub(crate) fn readout(
    me: PeerId,
    sync: &SyncSettings,
    leave: &CancellationToken,
) -> (Readout, Feeds) {
    let identity = Identity {
        peer_id: me,
        run_id: RUN_ID.into(),
        fingerprint: "f".into(),
        model: "toy".into(),
        device: "cpu".into(),
        epochs: 1,
        param_count: 2,
        optimizer_buffers: Vec::new(),
    };
    Readout::new(
        identity,
        sync.clone(),
        Duration::from_secs(10),
        leave.clone(),
        DroppedEvents::default(),
    )
}
