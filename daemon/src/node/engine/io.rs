//! What the engine's tasks share (the way to the network, the replica, the counters) and the
//! helpers every exchange task uses: its traced span, its deadline, how a stream failed.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use murmur_protocol::network::{Client, PeerId, Stream, StreamProtocol};
use murmur_protocol::wire::{self, Expect, MessageKind, TensorHeader, WireError};
use murmur_sync::copies::{Copies, Gauge};
use murmur_sync::machines::{Head, Lent, Machine, Payload};
use murmur_sync::policy::{Failure, Outcome};
use murmur_sync::rejection::Rejection;
use murmur_sync::settings::{SyncSettings, Timeouts};
use tokio::sync::{mpsc, oneshot, watch};

use super::copies::PairCopies;
use super::state_sync::Transfers;
use crate::clock;
use crate::node::messages::{PeerNote, ToReplica};
use crate::readout::{Count, Progress, Readout};

tokio::task_local! {
    /// Whether the exchange the current task runs goes through a relay (set when the task is
    /// spawned, from how the node is connected to the peer): its bytes are counted apart, so
    /// that a swarm routing exchanges through relays (`sync.relayed_exchanges`) sees what
    /// they carry.
    pub(super) static THROUGH_RELAY: bool;
}

/// Whether the current task's exchange goes through a relay.
fn through_relay() -> bool {
    THROUGH_RELAY.try_with(|relayed| *relayed).unwrap_or(false)
}

/// What the exchange tasks share: the way to the network, the replica and the counters.
#[derive(Debug)]
pub(super) struct ExchangeContext {
    pub(super) readout: Readout,
    pub(super) sync: SyncSettings,
    pub(super) timeouts: Timeouts,
    pub(super) client: Client,
    pub(super) replica: mpsc::Sender<ToReplica>,
    pub(super) notes: mpsc::Sender<PeerNote>,
    pub(super) progress: watch::Receiver<Progress>,
    /// The partners on slow links, as the policy last said.
    pub(super) slow: watch::Sender<BTreeSet<PeerId>>,
    /// The elastic center variable, while this node holds it. A std mutex: tasks that serve
    /// workers hold it only for one elastic step (no await inside), and there is no other state
    /// behind it.
    pub(super) center: Mutex<Option<Vec<f32>>>,
    /// Compressed exchanges: the copies this node and each partner hold of each other.
    pub(super) pairs: Arc<PairCopies>,
    /// State syncs: what a transfer cut off left, on either side, to go on with.
    pub(super) transfers: Transfers,
}

impl ExchangeContext {
    pub(super) fn expect(&self) -> Expect<'_> {
        let id = self.readout.identity();
        Expect {
            run_id: &id.run_id,
            fingerprint: &id.fingerprint,
            max_payload_bytes: id.param_bytes(),
        }
    }

    /// Counts `bytes` of tensor frames sent, apart too if they went through a relay.
    fn count_sent(&self, bytes: u64) {
        let counters = self.readout.counters();
        counters.add(Count::BytesSent, bytes);
        if through_relay() {
            counters.add(Count::RelayedBytesSent, bytes);
        }
    }

    /// Counts `bytes` of tensor frames received, apart too if they came through a relay.
    fn count_received(&self, bytes: u64) {
        let counters = self.readout.counters();
        counters.add(Count::BytesReceived, bytes);
        if through_relay() {
            counters.add(Count::RelayedBytesReceived, bytes);
        }
    }

    pub(super) fn own_step(&self) -> u64 {
        self.progress.borrow().step
    }

    pub(super) async fn open(
        &self,
        peer: PeerId,
        protocol: &'static str,
    ) -> Result<Stream, Failure> {
        self.client
            .open_stream(peer, StreamProtocol::new(protocol))
            .await
            .map_err(|e| Failure::Stream(e.to_string()))
    }

    /// Runs a protocol `machine`, this node's side of `stream` with `peer`, to its end: writes
    /// the frames it opens with, then feeds it each frame that comes in, the head before its
    /// payload is read; what the machine writes on a head goes out while that payload comes in,
    /// so both directions carry a snapshot at once (decision 0027). Once the machine is done,
    /// or the stream ended, a side that asked ends its side of the stream (a pairwise
    /// initiator's end is its verdict: mix); one that answers leaves the stream to its caller,
    /// so that a close waiting on the transport does not hold up what it came to. `copies`:
    /// the pair's copies, lent to a compressed exchange.
    pub(super) async fn pump<M: Machine>(
        &self,
        peer: PeerId,
        stream: &mut Stream,
        machine: &mut M,
        opening: Opening,
        mut copies: Option<&mut Copies>,
    ) -> Result<M::Done, Outcome> {
        let mut first = match opening {
            Opening::Asks => {
                self.send_all(stream, machine.start())
                    .await
                    .map_err(stream_outcome)?;
                machine.work_ahead(&mut Lent::copies(copies.as_deref_mut()));
                None
            }
            Opening::Answers => Some(self.answer_while_reading(peer, stream, machine).await?),
        };
        // The clocks heard when the answer came (state sync holds its clock to the run's).
        let mut heard = Vec::new();
        let mut answered = false;
        let mut received = Vec::new();
        // Whether a read failed: outbound streams settle their protocol lazily, with the first
        // read, and one whose protocol the peer refused panics on any later write or close
        // (libp2p's negotiated stream), so such a stream is only dropped.
        let mut read_failed = false;
        let done = loop {
            let (header, read) = match first.take() {
                Some((header, values)) => (header, Some(values)),
                None => match wire::read_header(stream, &self.expect()).await {
                    Ok(header) => (header, None),
                    Err(WireError::Empty) => {
                        break machine.on_end(&mut Lent::copies(copies.as_deref_mut()));
                    }
                    Err(e) => {
                        read_failed = true;
                        break Err(stream_outcome(e));
                    }
                },
            };
            let answer =
                matches!(opening, Opening::Asks) && !std::mem::replace(&mut answered, true);
            if answer {
                heard = self.readout.clocks();
            }
            let mut lent = Lent {
                copies: copies.as_deref_mut(),
                heard: &heard,
            };
            let turn = machine.on_head(&Head::from(&header), &mut lent);
            if let Some(step) = turn.saw_step {
                self.saw_step(peer, step);
            }
            if let Some(end) = turn.end {
                // Best effort: a stream that broke tells the other side as much.
                let _ = self.send_all(stream, turn.send).await;
                break end;
            }
            let values = match read {
                Some(values) => {
                    self.send_all(stream, turn.send)
                        .await
                        .map_err(stream_outcome)?;
                    values
                }
                None => {
                    // A compressed exchange takes the gap of what comes in as it comes.
                    let mut gauge = turn.gauge;
                    let watch = Gauge::watch(&mut gauge, lent.copies.as_deref());
                    let (mut reader, mut writer) = (&mut *stream).split();
                    let (sent, read) = futures::join!(
                        self.send_all(&mut writer, turn.send),
                        self.receive_payload_from(peer, &mut reader, &header, &mut received, watch),
                    );
                    sent.and(read).map_err(stream_outcome)?;
                    if let Some(gap) = gauge.and_then(Gauge::finish) {
                        machine.on_gap(gap);
                    }
                    std::mem::take(&mut received)
                }
            };
            let turn = machine.on_payload(values, &mut lent);
            let end = turn.end;
            let sent = self.send_all(stream, turn.send).await;
            if let Some(end) = end {
                break end;
            }
            sent.map_err(stream_outcome)?;
        };
        if matches!(opening, Opening::Asks) && !read_failed {
            let _ = stream.close().await;
        }
        done
    }

    /// The answering side's opening: its frames go out while the other side's first frame
    /// comes in whole (it sends once it has read our head); that frame's header and values.
    async fn answer_while_reading<M: Machine>(
        &self,
        peer: PeerId,
        stream: &mut Stream,
        machine: &M,
    ) -> Result<(TensorHeader, Vec<f32>), Outcome> {
        let (mut reader, mut writer) = (&mut *stream).split();
        let mut values = Vec::new();
        let (sent, read) = futures::join!(
            self.send_all(&mut writer, machine.start()),
            self.receive_from(peer, &mut reader, &mut values),
        );
        let header = read.map_err(stream_outcome)?;
        sent.map_err(stream_outcome)?;
        Ok((header, values))
    }

    /// Writes a machine's frames in order.
    async fn send_all(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        frames: Vec<(Head, Payload<'_>)>,
    ) -> Result<(), WireError> {
        for (head, payload) in frames {
            self.send_head(stream, &head, payload).await?;
        }
        Ok(())
    }

    /// Writes one frame; its bytes count as sent.
    pub(super) async fn send(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        kind: MessageKind,
        step: u64,
        payload: &[f32],
    ) -> Result<(), WireError> {
        let header = self.payload_header(kind, step, payload);
        self.send_frame(stream, &header, payload).await
    }

    /// A header of this run and model for `payload`, to send as it is.
    pub(super) fn payload_header(
        &self,
        kind: MessageKind,
        step: u64,
        payload: &[f32],
    ) -> TensorHeader {
        let id = self.readout.identity();
        TensorHeader::for_payload(kind, &id.run_id, &id.fingerprint, step, payload)
    }

    /// Writes one frame of `payload` under `header`; its bytes count as sent.
    pub(super) async fn send_frame(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        header: &TensorHeader,
        payload: &[f32],
    ) -> Result<(), WireError> {
        let bytes = wire::write_frame(stream, header, payload).await?;
        self.count_sent(bytes);
        Ok(())
    }

    /// Writes one frame with an encoded payload; its bytes count as sent.
    pub(super) async fn send_encoded(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        header: &TensorHeader,
        payload: &[u8],
    ) -> Result<(), WireError> {
        let bytes = wire::write_encoded(stream, header, payload).await?;
        self.count_sent(bytes);
        Ok(())
    }

    /// The wire header of a protocol machine's frame: its head, with this run and model and
    /// the payload's length and checksum.
    pub(super) fn frame_header(&self, head: &Head, payload: Payload<'_>) -> TensorHeader {
        let id = self.readout.identity();
        head.wire_header(payload, &id.run_id, &id.fingerprint)
    }

    /// Writes one frame of a protocol machine; its bytes count as sent.
    pub(super) async fn send_head(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
        head: &Head,
        payload: Payload<'_>,
    ) -> Result<(), WireError> {
        let header = self.frame_header(head, payload);
        match payload {
            Payload::Values(values) => self.send_frame(stream, &header, values).await,
            Payload::Empty => self.send_encoded(stream, &header, &[]).await,
            Payload::Encoded { bytes, .. } => self.send_encoded(stream, &header, bytes).await,
        }
    }

    /// Answers `Busy` (not now, or declined) and ends the stream.
    pub(super) async fn busy(
        &self,
        stream: &mut (impl AsyncWrite + Unpin),
    ) -> Result<(), WireError> {
        self.send(stream, MessageKind::Busy, self.own_step(), &[])
            .await?;
        let _ = stream.close().await;
        Ok(())
    }

    /// Reads one frame from `peer`, its payload timed for the link's throughput; it counts
    /// as tensor bytes in.
    pub(super) async fn receive_from(
        &self,
        peer: PeerId,
        stream: &mut (impl AsyncRead + Unpin),
        into: &mut Vec<f32>,
    ) -> Result<TensorHeader, WireError> {
        let header = wire::read_header(stream, &self.expect()).await?;
        self.receive_payload_from(peer, stream, &header, into, |_, _| {})
            .await?;
        Ok(header)
    }

    /// Reads the payload of `peer`'s frame whose `header` was read, timed for the link's
    /// throughput; it counts as tensor bytes in. `watch` sees each piece as it is decoded
    /// ([`wire::read_payload_watched`]).
    pub(super) async fn receive_payload_from(
        &self,
        peer: PeerId,
        stream: &mut (impl AsyncRead + Unpin),
        header: &TensorHeader,
        into: &mut Vec<f32>,
        watch: impl FnMut(usize, &[f32]),
    ) -> Result<(), WireError> {
        let started = clock::now();
        wire::read_payload_watched(stream, header, into, watch).await?;
        self.readout
            .link_table()
            .received(peer, header.byte_len, clock::since(started));
        self.count_received(header.byte_len);
        Ok(())
    }

    /// A clock seen in a frame from `peer`, fresher than its last heartbeat.
    pub(super) fn saw_step(&self, peer: PeerId, step: u64) {
        let _ = self.notes.try_send(PeerNote::SawStep { peer, step });
    }

    /// Sends the replica `ask` with a reply channel and waits for the answer.
    pub(super) async fn ask_replica<T>(
        &self,
        ask: impl FnOnce(oneshot::Sender<T>) -> ToReplica,
    ) -> Option<T> {
        let (tx, rx) = oneshot::channel();
        self.replica.try_send(ask(tx)).ok()?;
        tokio::time::timeout(self.timeouts.replica_answer, rx)
            .await
            .ok()?
            .ok()
    }
}

/// How a machine's side of a stream opens.
#[derive(Clone, Copy, Debug)]
pub(super) enum Opening {
    /// It asks: its frames go out before anything is read.
    Asks,
    /// It answers a request read already: its frames go out while the other side's first
    /// frame comes in.
    Answers,
}

/// The span of a task's work (an exchange, a state sync, a ring attempt) that records an
/// outcome however the work ends: `cancelled` when its task is given up (aborted) first.
#[derive(Debug)]
pub(super) struct Traced {
    span: tracing::Span,
    ended: bool,
}

impl Traced {
    pub(super) fn new(span: tracing::Span) -> Self {
        Traced { span, ended: false }
    }

    pub(super) fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Records how the work ended.
    pub(super) fn outcome(&mut self, outcome: &str) {
        self.span.record("outcome", outcome);
        self.ended = true;
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        if !self.ended {
            self.span.record("outcome", "cancelled");
        }
    }
}

/// Runs an exchange under the exchange timeout.
pub(super) async fn within<T>(
    timeouts: &Timeouts,
    exchange: impl std::future::Future<Output = Result<T, Outcome>>,
) -> Result<T, Outcome> {
    tokio::time::timeout(timeouts.exchange, exchange)
        .await
        .unwrap_or(Err(Outcome::Failed(Failure::TimedOut)))
}

/// How a stream failed, as an exchange outcome: a stream that ended or broke is no one's
/// fault; anything else the peer sent wrong.
pub(super) fn stream_outcome(e: WireError) -> Outcome {
    match e {
        WireError::Truncated | WireError::Empty | WireError::Io(_) => {
            Outcome::Failed(Failure::Stream(e.to_string()))
        }
        other => Outcome::Rejected(Rejection::Frame(other.to_string())),
    }
}
