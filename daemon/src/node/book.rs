//! The peer book's writer: where peers listen goes into the redb store from a thread of its
//! own, so that a commit (an fsync) never stalls an async task. The book is a cache for
//! restarts: an entry that does not fit the bounded queue is skipped.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use murmur_protocol::network::{Multiaddr, PeerId};
use tracing::{debug, warn};

use crate::store::Store;

/// Entries waiting for the writer.
const QUEUE: usize = 64;

/// Hands entries to the writer; cheap to clone.
#[derive(Clone, Debug)]
pub struct PeerBook(SyncSender<(PeerId, Vec<Multiaddr>)>);

impl PeerBook {
    /// Remembers that `peer` listens on `addrs`.
    pub fn remember(&self, peer: PeerId, addrs: Vec<Multiaddr>) {
        match self.0.try_send((peer, addrs)) {
            Ok(()) | Err(TrySendError::Disconnected(_)) => {}
            Err(TrySendError::Full(_)) => debug!(peer = %peer, "peer book busy: entry skipped"),
        }
    }
}

/// The book, and the writer's loop to run on a blocking thread: it ends when every
/// [`PeerBook`] is dropped.
pub fn writer(store: Arc<Store>) -> (PeerBook, impl FnOnce() + Send + 'static) {
    let (tx, rx) = sync_channel(QUEUE);
    (PeerBook(tx), move || write(&store, &rx))
}

fn write(store: &Store, entries: &Receiver<(PeerId, Vec<Multiaddr>)>) {
    while let Ok((peer, addrs)) = entries.recv() {
        let addrs: Vec<String> = addrs.iter().map(ToString::to_string).collect();
        if let Err(e) = store.remember_peer(&peer.to_string(), &addrs) {
            warn!(error = %e, "cannot update the peer book");
        }
    }
}
