//! Every partner's pair copies of compressed exchanges (the sync crate's [`CopyBook`]), shared
//! by the node's exchanges, each of which holds a pair's copies as a [`Lease`]; a compressed
//! mix holds its lease on to the replica until it lands (decision 0092).

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use murmur_protocol::network::PeerId;
use murmur_sync::copies::{BookFigures, Copies, CopyBook, HoldsCopies};
use tokio::sync::{Notify, watch};

/// Every partner's copies, within a budget; a pair's copies are lent to one exchange at a
/// time.
#[derive(Debug)]
pub(super) struct PairCopies {
    book: Mutex<CopyBook>,
    /// Told whenever copies come back from a lease.
    returned: Notify,
    /// What the book holds, published for the node's status after every change.
    figures: watch::Sender<BookFigures>,
}

impl Default for PairCopies {
    /// Copies without a bound, published nowhere.
    fn default() -> Self {
        PairCopies::within(u64::MAX, watch::channel(BookFigures::default()).0)
    }
}

impl PairCopies {
    /// Copies of at most `budget` bytes, their figures published on `figures`.
    pub(super) fn within(budget: u64, figures: watch::Sender<BookFigures>) -> Self {
        let book = CopyBook::within(budget);
        figures.send_replace(book.figures());
        PairCopies {
            book: Mutex::new(book),
            returned: Notify::new(),
            figures,
        }
    }

    fn book(&self) -> MutexGuard<'_, CopyBook> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lends `peer`'s copies to an exchange (fresh ones if there are none), or `None` while
    /// another exchange with `peer` (or its mix, until it lands) holds them. They come back
    /// when the lease is dropped.
    pub(super) fn lease(self: &Arc<Self>, peer: PeerId, len: usize) -> Option<Lease> {
        let mut book = self.book();
        let copies = book.lend(peer, len)?;
        self.figures.send_replace(book.figures());
        Some(Lease {
            pairs: Arc::clone(self),
            peer,
            copies,
        })
    }

    /// [`lease`](Self::lease), waiting up to `wait` for an exchange with `peer` that holds
    /// the copies to end: when two peers' offers cross, the one that answers holds its own
    /// offer's lease until the other's `Busy` comes back, one round trip later.
    pub(super) async fn lease_within(
        self: &Arc<Self>,
        peer: PeerId,
        len: usize,
        wait: Duration,
    ) -> Option<Lease> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the check, so that a return between the two is not missed.
            let returned = self.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            if let Some(lease) = self.lease(peer, len) {
                return Some(lease);
            }
            tokio::time::timeout_at(deadline, returned).await.ok()?;
        }
    }
}

/// One exchange's hold on a pair's copies.
#[derive(Debug)]
pub(super) struct Lease {
    pairs: Arc<PairCopies>,
    peer: PeerId,
    pub(super) copies: Copies,
}

impl HoldsCopies for Lease {
    fn copies(&self) -> &Copies {
        &self.copies
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut book = self.pairs.book();
        book.give_back(self.peer, std::mem::take(&mut self.copies));
        self.pairs.figures.send_replace(book.figures());
        drop(book);
        self.pairs.returned.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use murmur_protocol::codec::Codec;
    use murmur_sync::copies::{Scaled, Sent};

    use super::*;

    fn peer() -> PeerId {
        PeerId::random()
    }

    /// The copies take `sent` and `received` as an exchange of values sent as they are would.
    fn commit_values(copies: &mut Copies, sent: &[f32], received: &[f32]) {
        let bytes = Codec::F32.encode(sent);
        let sent = Sent {
            codec: Codec::F32,
            bytes: &bytes,
        };
        copies.commit(sent, received);
    }

    /// A lease holds the pair's copies until it is dropped, and gives them back as it left
    /// them.
    #[test]
    fn a_dropped_lease_gives_the_copies_back() {
        let pairs = Arc::new(PairCopies::default());
        let p = peer();
        let mut lease = pairs.lease(p, 3).unwrap();
        assert!(
            pairs.lease(p, 3).is_none(),
            "a second exchange with the same peer waits"
        );
        assert!(pairs.lease(peer(), 3).is_some(), "other peers are free");
        commit_values(&mut lease.copies, &[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]);
        drop(lease);
        let lease = pairs.lease(p, 3).unwrap();
        assert_eq!(lease.copies.version, 1);
        assert_eq!(lease.copies.own(), &Scaled::of(&[1.0, 2.0, 3.0]));
    }

    #[test]
    fn a_lease_waits_for_the_exchange_that_holds_the_copies() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let pairs = Arc::new(PairCopies::default());
        let p = peer();
        runtime.block_on(async {
            let held = pairs.lease(p, 2).unwrap();
            let wait = Duration::from_secs(5);
            let (waited, ()) = tokio::join!(pairs.lease_within(p, 2, wait), async {
                tokio::task::yield_now().await;
                drop(held);
            });
            assert!(waited.is_some(), "the lease came back and was taken");
            let _holding = waited;
            let short = Duration::from_millis(10);
            assert!(
                pairs.lease_within(p, 2, short).await.is_none(),
                "still held: gives up after the wait"
            );
        });
    }

    #[test]
    fn disagreeing_versions_start_again_from_zero() {
        let pairs = Arc::new(PairCopies::default());
        let p = peer();
        let mut lease = pairs.lease(p, 2).unwrap();
        commit_values(&mut lease.copies, &[1.0, 1.0], &[2.0, 2.0]);
        assert_eq!(lease.copies.agree(Some(1)), 1);
        assert_eq!(lease.copies.own(), &Scaled::of(&[1.0, 1.0]));
        assert_eq!(lease.copies.agree(Some(7)), 0);
        assert_eq!(lease.copies, Copies::fresh(2));
    }
}
