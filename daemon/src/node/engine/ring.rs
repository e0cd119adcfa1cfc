//! The I/O of `allreduce` rounds: every `every` steps the replica hands over its gradient
//! (`every = 1`) or its parameters (`every > 1`), and the engine all-reduces them over a ring of
//! the live trusted members, then hands the mean back. An attempt runs on a copy, so an aborted
//! attempt changes nothing; the policy decides on the members, and on what follows an abort
//! (decision 0010).
//!
//! [`RingIo`] holds this node's side of the rings between attempts: the queue of incoming ring
//! streams (trusted peers only, bounded), the TCP data listener, and the connections of the last
//! membership, kept from round to round while it holds. An attempt ([`attempt`]) takes it and
//! gives it back.

use std::sync::Arc;

use futures::io::{AsyncRead, AsyncWrite};
use murmur_protocol::network::{PeerId, Stream};
use murmur_protocol::ring::data_plane::{self, DataReader, DataWriter, HeldHello, TcpDataListener};
use murmur_protocol::ring::{
    self, Attempt, DataPlane, RingError, RingLinks, RingMembers, RingSchedule,
};
use murmur_protocol::throttle::{LOG_LINES, LogThrottle};
use murmur_protocol::trust::TrustList;
use murmur_sync::replica::Snapshot;
use murmur_sync::settings::RingSettings;
use tokio::sync::mpsc;
use tracing::{Instrument, debug, info};

use super::{ExchangeContext, Traced};

/// Incoming ring streams queued per trusted peer. libp2p holds one unanswered stream per
/// protocol and drops those that arrive meanwhile, so streams are taken off it at once and
/// queued here; the queue holds a few attempts' worth from every trusted peer (decision 0015).
const STREAMS_PER_PEER: usize = 4;

/// The data connections of one membership, named by its hash.
type HeldLinks = (u64, RingLinks<DataReader, DataWriter>);

/// This node's side of the rings between attempts.
pub(super) struct RingIo {
    settings: RingSettings,
    /// The node's trusted peers, the only ones a ring connects to.
    trust: TrustList,
    incoming: mpsc::Receiver<(PeerId, Stream)>,
    tcp: Option<TcpDataListener>,
    links: Option<HeldLinks>,
    /// A hello of a later attempt, kept for that attempt.
    held: Option<HeldHello>,
}

impl std::fmt::Debug for RingIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingIo")
            .field("plane", &self.settings.plane)
            .field("held_links", &self.links.as_ref().map(|(hash, _)| hash))
            .finish_non_exhaustive()
    }
}

/// Where the engine puts incoming ring streams for the rings to take.
pub(super) type RingQueue = mpsc::Sender<(PeerId, Stream)>;

impl RingIo {
    /// The queue of incoming ring streams and, for the TCP plane, a listening data port.
    pub(super) async fn start(
        settings: RingSettings,
        trust: TrustList,
    ) -> anyhow::Result<(RingQueue, RingIo)> {
        let capacity = (trust.len() * STREAMS_PER_PEER).max(STREAMS_PER_PEER);
        let (queue, incoming) = mpsc::channel(capacity);
        let tcp = match settings.plane {
            DataPlane::Tcp => {
                let listener = TcpDataListener::bind(settings.listen).await.map_err(|e| {
                    anyhow::anyhow!("{e}; set `ring_listen` in the node config to a free address")
                })?;
                info!(addr = %listener.addr(), "ring data plane listening");
                Some(listener)
            }
            DataPlane::Libp2p => None,
        };
        let io = RingIo {
            settings,
            trust,
            incoming,
            tcp,
            links: None,
            held: None,
        };
        Ok((queue, io))
    }
}

/// Queues an incoming ring stream for the next attempt, if its peer is trusted and there is
/// room; otherwise it is dropped at once (the opener's attempt fails, and it retries).
pub(super) fn admit(queue: &RingQueue, peer: PeerId, stream: Stream, trust: &TrustList) {
    if !trust.contains(&peer) {
        static REFUSED: LogThrottle = LogThrottle::new(LOG_LINES);
        if let Some(held) = REFUSED.allow() {
            info!(peer = %peer, held, "ring stream refused: the peer is not in this node's trust list");
        }
        return;
    }
    if queue.try_send((peer, stream)).is_err() {
        debug!(peer = %peer, "ring stream dropped: the queue is full");
    }
}

/// One attempt at the round `round` among `members`: connects the ring unless the last round's
/// connections are for the same members, then all-reduces `snapshot`. Bounded by the ring
/// timeout; hands `ring` back whatever happens.
pub(super) async fn attempt(
    io: &ExchangeContext,
    mut ring: Box<RingIo>,
    round: u64,
    number: u32,
    members: RingMembers,
    snapshot: Arc<Snapshot>,
) -> (
    Box<RingIo>,
    Result<(Vec<f32>, ring::RoundTraffic), RingError>,
) {
    let timeout = ring.settings.timeout;
    let mut span = Traced::new(tracing::info_span!(
        "ring_round",
        step = round,
        peers = members.len(),
        attempt = number,
        outcome = tracing::field::Empty,
        bytes_sent = tracing::field::Empty,
        bytes_received = tracing::field::Empty,
        error = tracing::field::Empty,
    ));
    let outcome = tokio::time::timeout(
        timeout,
        connect_and_reduce(
            io,
            &mut ring,
            Attempt { round, number },
            &members,
            &snapshot.params,
        ),
    )
    .instrument(span.span().clone())
    .await
    .unwrap_or(Err(RingError::Timeout(timeout)));
    match &outcome {
        Ok((_, traffic)) => {
            span.outcome("ok");
            span.span().record("bytes_sent", traffic.bytes_sent);
            span.span().record("bytes_received", traffic.bytes_received);
        }
        Err(e) => {
            // The connections are gone: the next attempt connects afresh.
            ring.links = None;
            span.outcome("aborted");
            span.span().record("error", tracing::field::display(e));
        }
    }
    (ring, outcome)
}

async fn connect_and_reduce(
    io: &ExchangeContext,
    ring: &mut RingIo,
    attempt: Attempt,
    members: &RingMembers,
    values: &[f32],
) -> Result<(Vec<f32>, ring::RoundTraffic), RingError> {
    let me = io.readout.identity().peer_id;
    let run_id = &io.readout.identity().run_id;
    if members.len() == 1 {
        return Ok((values.to_vec(), ring::RoundTraffic::default()));
    }
    let hash = members.hash();
    // The last round's connections serve this attempt if its members are the same. Those of
    // other members are closed now, not when this attempt ends: a neighbour still rounding on
    // them then fails at once, where it would wait out the ring timeout.
    let links = match ring.links.take().filter(|(held, _)| *held == hash) {
        Some((_, links)) => links,
        None => {
            let mut incoming = futures::stream::poll_fn(|cx| ring.incoming.poll_recv(cx));
            data_plane::connect_ring(
                &io.client,
                &mut incoming,
                &mut ring.held,
                &ring.trust,
                run_id,
                members,
                me,
                ring.settings.plane,
                ring.tcp.as_ref(),
                attempt,
            )
            .await?
        }
    };
    let rank = members
        .rank_of(&me)
        .ok_or_else(|| RingError::Setup("this node is not in its own ring".into()))?;
    let schedule = RingSchedule::new(rank, members.len(), values.len(), ring.settings.sub_chunk);
    let (mean, traffic, links) = mean_in_ring(schedule, attempt.round, hash, values, links).await?;
    ring.links = Some((hash, links));
    Ok((mean, traffic))
}

/// All-reduces `values` over `links` and divides by the ring size: the mean of every member's
/// `values`, bitwise the same on every member, refused (on every member alike) unless finite.
/// `values` is left as it is whatever happens; on an error the links are gone (see
/// [`ring::all_reduce`]).
pub async fn mean_in_ring<R, W>(
    schedule: RingSchedule,
    round: u64,
    membership: u64,
    values: &[f32],
    links: RingLinks<R, W>,
) -> Result<(Vec<f32>, ring::RoundTraffic, RingLinks<R, W>), RingError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let size = schedule.size();
    let mut sum = values.to_vec();
    let (traffic, links) = ring::all_reduce(schedule, round, membership, &mut sum, links).await?;
    ring::into_mean(&mut sum, size)?;
    Ok((sum, traffic, links))
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use std::time::Duration;

    use tokio_util::compat::{Compat, TokioAsyncReadCompatExt};

    use super::*;

    type Pipe = Compat<tokio::io::DuplexStream>;

    /// `size` ring links over in-memory pipes: link `i` runs from member `i` to `i + 1`.
    fn ring_links(size: usize) -> Vec<RingLinks<Pipe, Pipe>> {
        let (mut writers, mut readers) = (Vec::new(), Vec::new());
        for _ in 0..size {
            let (a, b) = tokio::io::duplex(1 << 16);
            writers.push(Some(a.compat()));
            readers.push(Some(b.compat()));
        }
        (0..size)
            .map(|rank| {
                let left = (rank + size - 1) % size;
                RingLinks::new(readers[left].take().unwrap(), writers[rank].take().unwrap())
            })
            .collect()
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap()
    }

    /// Flips one bit of what passes through at byte `at` of the stream.
    struct Corrupt<W> {
        inner: W,
        written: usize,
        at: usize,
    }

    impl<W: AsyncWrite + Unpin> AsyncWrite for Corrupt<W> {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let (start, at) = (self.written, self.at);
            let mut owned = buf.to_vec();
            if (start..start + buf.len()).contains(&at) {
                owned[at - start] ^= 0x10;
            }
            let poll = Pin::new(&mut self.inner).poll_write(cx, &owned);
            if let Poll::Ready(Ok(n)) = poll {
                self.written += n;
            }
            poll
        }

        fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_flush(cx)
        }

        fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.inner).poll_close(cx)
        }
    }

    /// A member whose values are not finite (a broken replica) makes every member refuse the
    /// round alike, and no one is scored for it.
    #[test]
    fn a_mean_that_is_not_finite_is_refused_by_every_member() {
        let rt = runtime();
        let p = 3;
        let mut values: Vec<Vec<f32>> = (0..p).map(|r| vec![r as f32 + 1.0; 1001]).collect();
        values[1][500] = f32::NAN;
        let rounds = ring_links(p).into_iter().enumerate().map(|(rank, held)| {
            let schedule = RingSchedule::new(rank, p, values[rank].len(), 200);
            mean_in_ring(schedule, 0, 7, &values[rank], held)
        });
        let results = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(rounds))
                .await
                .expect("the round ends")
        });
        for (rank, result) in results.into_iter().enumerate() {
            let error = result.expect_err("no member may take a NaN mean");
            assert!(matches!(error, RingError::NotFinite), "{rank}: {error}");
            assert!(!error.is_offence());
        }
    }

    /// A trusted member whose bytes are damaged on the way (a value, or a sub-chunk's length)
    /// makes the round fail on every member: no member gets a mean, so no replica changes,
    /// and the member that received the damage sees an offence.
    #[test]
    fn a_damaged_sub_chunk_aborts_the_round_for_every_member() {
        use ring::{ROUND_HEADER_BYTES, SUB_CHUNK_HEADER_BYTES};
        let rt = runtime();
        let p = 3;
        let values: Vec<Vec<f32>> = (0..p).map(|r| vec![r as f32 + 1.0; 1001]).collect();
        // Byte offsets: inside the first value of the first sub-chunk, and its length field.
        let payload = ROUND_HEADER_BYTES + SUB_CHUNK_HEADER_BYTES + 1;
        let length = ROUND_HEADER_BYTES + 4;
        for at in [payload, length] {
            let mut links = ring_links(p);
            let RingLinks {
                from_left,
                to_right,
                ..
            } = links.remove(1);
            let damaged = RingLinks::new(
                from_left,
                Box::new(Corrupt {
                    inner: to_right,
                    written: 0,
                    at,
                }) as Box<dyn AsyncWrite + Send + Unpin>,
            );
            let others: Vec<_> = links
                .into_iter()
                .map(|l| {
                    let RingLinks {
                        from_left,
                        to_right,
                        ..
                    } = l;
                    RingLinks::new(
                        from_left,
                        Box::new(to_right) as Box<dyn AsyncWrite + Send + Unpin>,
                    )
                })
                .collect();
            let mut all: Vec<_> = others;
            all.insert(1, damaged);
            let rounds = all.into_iter().enumerate().map(|(rank, held)| {
                let schedule = RingSchedule::new(rank, p, values[rank].len(), 200);
                mean_in_ring(schedule, 0, 7, &values[rank], held)
            });
            let results = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), futures::future::join_all(rounds))
                    .await
                    .expect("an aborted round ends")
            });
            let errors: Vec<RingError> = results
                .into_iter()
                .map(|r| r.err().expect("no member may get a mean"))
                .collect();
            // Member 2 reads what member 1 damaged.
            assert!(errors[2].is_offence(), "at byte {at}: {errors:?}");
            assert!(
                errors.iter().filter(|e| e.is_offence()).count() == 1,
                "{errors:?}"
            );
        }
    }
}
