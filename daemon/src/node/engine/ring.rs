//! The `allreduce` mode: every `every` steps the trainer hands over its gradient (`every = 1`)
//! or its parameters (`every > 1`), and the engine all-reduces them over a ring of the live
//! trusted members, then hands the mean back. A round runs on a copy, so an aborted round
//! changes nothing; it is retried until it completes, this node takes over a peer's state, or
//! the node shuts down (decision 0010).
//!
//! Failure handling, all bounded in time:
//! - every attempt (ring set-up and all-reduce) is aborted after `ring_timeout`; a neighbour
//!   that dies mid-round makes its neighbours fail at once (the connection breaks) and the
//!   abort travels round the ring as each member drops its connections;
//! - after an abort each member waits until every ring member has sent a heartbeat since, or
//!   [`SETTLE`] has passed: those not heard from are left out of the next attempts until they
//!   are heard from again, so the survivors of a crash re-form without it long before the
//!   peer timeout;
//! - a member that finds a ring member past the round's step (that member completed the round
//!   this one missed) takes over that member's state and continues from there.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::channel::mpsc;
use futures::io::{AsyncRead, AsyncWrite};
use murmur_protocol::RING_PROTOCOL;
use murmur_protocol::heartbeat::{Role, SyncMode};
use murmur_protocol::membership::PeerView;
use murmur_protocol::network::{Client, PeerId, StreamProtocol};
use murmur_protocol::ring::data_plane::{self, DataPlane, DataReader, DataWriter, TcpDataListener};
use murmur_protocol::ring::{self, RingError, RingLinks, RingMembers, RingSchedule};
use murmur_trainer::averaging;
use tracing::{Instrument, debug, info, warn};

use super::{Engine, Failure, PEER_CHECK_INTERVAL, SyncStats, within};
use crate::events;
use crate::node::messages::{Snapshot, ToTrainer};
use crate::readout::lock;
use crate::settings::RingSettings;

/// How long after an abort a ring member may stay silent before the next attempts leave it
/// out: one and a half heartbeat periods, so a live member is heard from at least once.
const SETTLE: Duration = Duration::from_millis(1500);
/// How long a starting node listens for peers before it takes itself for the first of its run
/// (two heartbeat periods: a running peer is heard within one).
const FIRST_PEER_GRACE: Duration = Duration::from_secs(2);

/// The data connections of one membership, named by its hash.
type HeldLinks = (u64, RingLinks<DataReader, DataWriter>);

/// This node's side of the rings: incoming ring streams, the TCP data listener, and the
/// connections of the current membership, kept from round to round while it holds.
pub(super) struct RingState {
    settings: RingSettings,
    /// Every incoming ring stream, in order of arrival. libp2p holds one unanswered stream per
    /// protocol and drops those that arrive meanwhile, so a stream of an aborted attempt would
    /// push out the next attempt's; a task moves each one here at once (decision 0015).
    incoming: mpsc::UnboundedReceiver<(PeerId, libp2p::Stream)>,
    tcp: Option<TcpDataListener>,
    /// Behind a lock only so that the engine stays `Sync`: it is taken out for a round and put
    /// back after it.
    links: Mutex<Option<HeldLinks>>,
    /// Members left out of rings since the abort at the given time, until heard from again.
    suspects: HashMap<PeerId, Instant>,
    /// Whether "waiting for peers" was said.
    told_waiting: bool,
    /// Whether the run is under way: a round with at least `min_peers` members has completed,
    /// or this node took over a peer's state. From then on rounds go on with whoever is live,
    /// so that a crash never stops the run, and a node that comes back never waits for peers
    /// that are gone while the others count it in their ring.
    started: bool,
}

impl RingState {
    /// Starts accepting ring streams (before any peer can open one) and, for the TCP plane,
    /// listening for data connections.
    pub(super) async fn start(settings: RingSettings, client: &Client) -> anyhow::Result<Self> {
        let mut accepted = client
            .stream_control()
            .accept(StreamProtocol::new(RING_PROTOCOL))
            .map_err(|e| anyhow::anyhow!("cannot accept `{RING_PROTOCOL}` streams: {e}"))?;
        let (forward, incoming) = mpsc::unbounded();
        tokio::spawn(async move {
            while let Some(stream) = accepted.next().await {
                if forward.unbounded_send(stream).is_err() {
                    break;
                }
            }
        });
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
        Ok(RingState {
            settings,
            incoming,
            tcp,
            links: Mutex::new(None),
            suspects: HashMap::new(),
            told_waiting: false,
            started: false,
        })
    }
}

impl RingState {
    /// The node took over a peer's state: the run is under way (see `started`).
    pub(super) fn joined_run_under_way(&mut self) {
        self.started = true;
    }
}

/// All-reduces `values` over `links` and divides by the ring size: the mean of every member's
/// `values`, bitwise the same on every member. `values` is left as it is whatever happens; on
/// an error the links are gone (see [`ring::all_reduce`]).
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
    averaging::scale(&mut sum, 1.0 / size as f32);
    Ok((sum, traffic, links))
}

/// Whether a peer takes part in ring rounds: in `allreduce` mode and done joining.
fn in_rounds(view: &PeerView) -> bool {
    view.mode == SyncMode::Allreduce && view.role != Role::Joining
}

impl Engine {
    /// Runs the round of `snapshot` (taken at step `snapshot.step`, which is also the round
    /// number) until it completes and the mean is with the trainer, this node takes over a
    /// peer's state instead, or the node shuts down.
    pub(super) async fn ring_round(&mut self, snapshot: Snapshot) {
        let ctx = Arc::clone(&self.ctx);
        let round = snapshot.step;
        let mut attempts = 0u32;
        while !ctx.state.is_shutting_down() {
            if ctx.joining.load(Ordering::Relaxed) {
                self.try_join().await;
                if ctx.joining.load(Ordering::Relaxed) {
                    if !self.first_of_the_run() {
                        tokio::time::sleep(PEER_CHECK_INTERVAL).await;
                        continue;
                    }
                    self.mark_joined();
                    info!(
                        "no peer heard of: the first of the run, rounding alone until others come"
                    );
                }
            }
            if ctx.own_step() != round {
                // The trainer took over a peer's state: this round is someone else's past.
                return;
            }
            let members = self.ring_members();
            let Some(ring) = self.ring.as_mut() else {
                return;
            };
            if !ring.started && members.len() < ring.settings.min_peers {
                if !ring.told_waiting {
                    info!(
                        have = members.len(),
                        need = ring.settings.min_peers,
                        "waiting for trusted peers before the first ring round"
                    );
                    ring.told_waiting = true;
                }
                tokio::time::sleep(PEER_CHECK_INTERVAL).await;
                continue;
            }
            attempts += 1;
            let started = Instant::now();
            let timeout = ring.settings.timeout;
            let span = tracing::info_span!(
                "ring_round",
                step = round,
                peers = members.len(),
                attempt = attempts,
                outcome = tracing::field::Empty,
                bytes_sent = tracing::field::Empty,
                bytes_received = tracing::field::Empty,
                error = tracing::field::Empty,
            );
            let attempt = self.ring_attempt(&members, round, &snapshot.params);
            let outcome = tokio::time::timeout(timeout, attempt)
                .instrument(span.clone())
                .await
                .unwrap_or(Err(RingError::Timeout(timeout)));
            match &outcome {
                Ok((_, traffic)) => {
                    span.record("outcome", "ok");
                    span.record("bytes_sent", traffic.bytes_sent);
                    span.record("bytes_received", traffic.bytes_received);
                }
                Err(e) => {
                    span.record("outcome", "aborted");
                    span.record("error", tracing::field::display(e));
                }
            }
            match outcome {
                Ok((mean, traffic)) => {
                    ctx.stats()
                        .bytes_out
                        .fetch_add(traffic.bytes_sent, Ordering::Relaxed);
                    ctx.state
                        .bytes_in
                        .fetch_add(traffic.bytes_received, Ordering::Relaxed);
                    if ctx.to_trainer(ToTrainer::Reduced { step: round, mean }) {
                        SyncStats::bump(&ctx.stats().exchanges);
                    }
                    let took = started.elapsed();
                    ctx.stats()
                        .timings
                        .ring_round_done(took, snapshot.params.len(), members.len());
                    let ms = took.as_secs_f64() * 1e3;
                    if attempts > 1 {
                        info!(
                            round,
                            peers = members.len(),
                            attempts,
                            ms,
                            "ring round done after an abort"
                        );
                    } else {
                        debug!(round, peers = members.len(), ms, "ring round done");
                    }
                    if let Some(ring) = self.ring.as_mut() {
                        ring.started = true;
                    }
                    return;
                }
                Err(e) => {
                    let failed_at = Instant::now();
                    if let Some(ring) = self.ring.as_mut() {
                        *lock(&ring.links) = None;
                    }
                    SyncStats::bump(&ctx.stats().failed);
                    self.blame(&members, &e);
                    warn!(event = events::RING_ROUND_ABORTED, round, peers = members.len(), error = %e, "ring round aborted; re-forming the ring");
                    if self.catch_up(round).await {
                        return;
                    }
                    self.settle(failed_at).await;
                }
            }
        }
    }

    /// One attempt: connects the ring unless the last round's connections are for the same
    /// members, then all-reduces.
    async fn ring_attempt(
        &mut self,
        members: &RingMembers,
        round: u64,
        values: &[f32],
    ) -> Result<(Vec<f32>, ring::RoundTraffic), RingError> {
        let me = self.ctx.state.peer_id;
        let run_id = self.ctx.state.run_id.clone();
        let ring = self
            .ring
            .as_mut()
            .ok_or_else(|| RingError::Setup("not in allreduce mode".into()))?;
        if members.len() == 1 {
            return Ok((values.to_vec(), ring::RoundTraffic::default()));
        }
        let hash = members.hash();
        let held = lock(&ring.links).take();
        let links = match held {
            Some((held, links)) if held == hash => links,
            _ => {
                data_plane::connect_ring(
                    &mut self.client.stream_control(),
                    &mut ring.incoming,
                    &ring.settings.trust,
                    &run_id,
                    members,
                    me,
                    ring.settings.plane,
                    ring.tcp.as_ref(),
                )
                .await?
            }
        };
        let rank = members
            .rank_of(&me)
            .ok_or_else(|| RingError::Setup("this node is not in its own ring".into()))?;
        let schedule =
            RingSchedule::new(rank, members.len(), values.len(), ring.settings.sub_chunk);
        let (mean, traffic, links) = mean_in_ring(schedule, round, hash, values, links).await?;
        *lock(&ring.links) = Some((hash, links));
        Ok((mean, traffic))
    }

    /// Whether this node, still joining, has heard of no peer for [`FIRST_PEER_GRACE`] and
    /// `min_peers` lets it round alone: the first peer of a run trains on (a ring of one), and
    /// whoever comes next takes over its state. Should the grace have been too short (a slow
    /// bootstrap), the first shared round aborts on the step mismatch and the one behind
    /// catches up by state sync.
    fn first_of_the_run(&self) -> bool {
        self.ring
            .as_ref()
            .is_some_and(|ring| ring.settings.min_peers <= 1)
            && self.ctx.state.uptime() >= FIRST_PEER_GRACE
            && lock(&self.ctx.state.membership).peers().next().is_none()
    }

    /// The ring of the next attempt: this node and the live trusted members in allreduce mode
    /// that have joined, are still training, and are not suspected since an abort.
    fn ring_members(&mut self) -> RingMembers {
        let ctx = &self.ctx;
        let Some(ring) = self.ring.as_mut() else {
            return RingMembers::new(&ctx.state.run_id, vec![ctx.state.peer_id]);
        };
        let members = lock(&ctx.state.membership);
        // A suspect heard from since it was suspected is back; one that left is forgotten.
        ring.suspects
            .retain(|peer, since| members.get(peer).is_some_and(|v| v.last_seen <= *since));
        let live = members
            .peers()
            .filter(|(peer, v)| in_rounds(v) && !v.finished && !ring.suspects.contains_key(*peer))
            .map(|(peer, _)| *peer);
        ring.settings
            .trust
            .ring(&ctx.state.run_id, ctx.state.peer_id, live)
    }

    /// A peer that sent something invalid on the ring is scored down; only the left neighbour
    /// sends to this node. Header mismatches are not offences: views of the membership differ
    /// for a moment whenever a peer joins or leaves.
    fn blame(&self, members: &RingMembers, error: &RingError) {
        if !error.is_offence() || matches!(error, RingError::Mismatch { .. }) {
            return;
        }
        if let Some(rank) = members.rank_of(&self.ctx.state.peer_id) {
            self.ctx.offence(members.left_of(rank), error.to_string());
        }
    }

    /// After an abort: if a ring member is past `round` it completed the round this node
    /// missed, so this node takes over its state. Returns whether it did.
    async fn catch_up(&mut self, round: u64) -> bool {
        let ahead = {
            let Some(ring) = self.ring.as_ref() else {
                return false;
            };
            let members = lock(&self.ctx.state.membership);
            members
                .peers()
                .filter(|(peer, v)| {
                    in_rounds(v) && v.step > round && ring.settings.trust.contains(peer)
                })
                .max_by_key(|(_, v)| v.step)
                .map(|(peer, v)| (*peer, v.step))
        };
        let Some((peer, step)) = ahead else {
            return false;
        };
        info!(peer = %peer, round, step, "a ring member completed this round: taking over its state");
        match within(self.pull_state(peer)).await {
            Ok(step) => {
                SyncStats::bump(&self.ctx.stats().state_syncs);
                info!(event = events::STATE_SYNC_DONE, peer = %peer, to = step, "state sync done");
                true
            }
            Err(Failure::Offence(reason)) => {
                self.ctx.offence(peer, reason);
                false
            }
            Err(failure) => {
                self.ctx.failed(peer, &failure);
                false
            }
        }
    }

    /// Waits until every ring member has been heard from since `failed_at`, or [`SETTLE`]
    /// has passed; those still silent are suspected until they are heard from again.
    async fn settle(&mut self, failed_at: Instant) {
        let deadline = failed_at + SETTLE;
        loop {
            let silent: Vec<PeerId> = {
                let members = self.ring_members();
                let view = lock(&self.ctx.state.membership);
                members
                    .peers()
                    .iter()
                    .filter(|peer| view.get(peer).is_some_and(|v| v.last_seen <= failed_at))
                    .copied()
                    .collect()
            };
            if silent.is_empty() || self.ctx.state.is_shutting_down() {
                return;
            }
            if Instant::now() >= deadline {
                if let Some(ring) = self.ring.as_mut() {
                    for peer in silent {
                        info!(peer = %peer, "no heartbeat since the abort: leaving it out of the ring");
                        ring.suspects.insert(peer, failed_at);
                    }
                }
                return;
            }
            tokio::time::sleep(PEER_CHECK_INTERVAL).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use murmur_trainer::data::Dataset;
    use murmur_trainer::optim::OptimizerSpec;
    use murmur_trainer::train::TrainSpec;
    use murmur_trainer::{CpuBackend, ModelSpec, Trainer};
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

    fn spec(batch_size: usize, steps: u64) -> TrainSpec {
        TrainSpec {
            model: ModelSpec::mlp(),
            optimizer: OptimizerSpec::sgd(0.05, 0.9),
            batch_size,
            epochs: steps,
            seed: 11,
            // One step per epoch: the whole shard is the batch.
            epoch_samples: Some(batch_size),
        }
    }

    fn relative_distance(a: &[f32], b: &[f32]) -> f64 {
        averaging::distance(a, b) / averaging::norm(b)
    }

    /// The acceptance test of `every = 1`: p replicas, each on its own shard, averaging their
    /// gradients through the ring every step, end where one process training on the union
    /// of the shards (the global batch) ends, and bitwise equal to one another.
    #[test]
    fn synchronous_sgd_over_the_ring_matches_one_process_on_the_global_batch() {
        const STEPS: u64 = 100;
        const BATCH: usize = 8;
        let rt = runtime();
        for p in [2usize, 3, 4] {
            let global = Dataset::synthetic(p * BATCH, 5);
            let shards: Vec<Dataset> = (0..p)
                .map(|i| global.subset(&(i * BATCH..(i + 1) * BATCH).collect::<Vec<_>>()))
                .collect();
            let mut single =
                Trainer::new(CpuBackend::new(), spec(p * BATCH, STEPS), &global).unwrap();
            for _ in 0..STEPS {
                single.train_step(&global).unwrap();
            }

            let mut replicas: Vec<_> = shards
                .iter()
                .map(|s| Trainer::new(CpuBackend::new(), spec(BATCH, STEPS), s).unwrap())
                .collect();
            let mut links: Vec<_> = ring_links(p).into_iter().map(Some).collect();
            for step in 0..STEPS {
                let pending: Vec<_> = replicas
                    .iter_mut()
                    .zip(&shards)
                    .map(|(t, s)| t.compute_gradients(s).unwrap())
                    .collect();
                let grads: Vec<Vec<f32>> =
                    replicas.iter().map(|t| t.gradients().unwrap()).collect();
                let rounds = (0..p).map(|rank| {
                    let schedule = RingSchedule::new(rank, p, grads[rank].len(), 1000);
                    let held = links[rank].take().unwrap();
                    mean_in_ring(schedule, step, 7, &grads[rank], held)
                });
                let results = rt.block_on(futures::future::join_all(rounds));
                for (rank, result) in results.into_iter().enumerate() {
                    let (mean, _, held) = result.unwrap();
                    links[rank] = Some(held);
                    replicas[rank]
                        .apply_gradients(pending[rank], Some(&mean))
                        .unwrap();
                }
            }
            let reference = single.params().unwrap();
            let first = replicas[0].params().unwrap();
            for replica in &replicas[1..] {
                assert_eq!(replica.params().unwrap(), first, "p = {p}: replicas differ");
            }
            let gap = relative_distance(&first, &reference);
            eprintln!("p = {p}: relative distance to the global-batch run {gap:e}");
            assert!(gap < 1e-5, "p = {p}: {gap:e} from the global-batch run");
            let start = Trainer::new(CpuBackend::new(), spec(BATCH, STEPS), &shards[0])
                .unwrap()
                .params()
                .unwrap();
            assert!(
                relative_distance(&start, &reference) > 1e-2,
                "p = {p}: nothing trained"
            );
        }
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
