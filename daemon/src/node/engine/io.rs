//! What the engine's tasks share (the way to the network, the replica, the counters) and the
//! helpers every exchange task uses: its traced span, its deadline, how a stream failed.

use futures::{AsyncRead, AsyncWrite, AsyncWriteExt};
use murmur_sync::machines::{Head, Payload};

use super::*;

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
    pub(super) pairs: PairCopies,
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

    /// Opens a stream of `protocol` to `peer`, writes a protocol machine's frame and reads
    /// the answer's first frame.
    pub(super) async fn ask(
        &self,
        peer: PeerId,
        protocol: &'static str,
        (head, payload): (Head, Payload<'_>),
    ) -> Result<(Stream, TensorHeader, Vec<f32>), Outcome> {
        let mut stream = self.open(peer, protocol).await.map_err(Outcome::Failed)?;
        self.send_head(&mut stream, &head, payload)
            .await
            .map_err(stream_outcome)?;
        self.answer_on(peer, stream).await
    }

    /// Opens a stream of `protocol` to `peer`, sends `header` with its encoded `payload` and
    /// reads only the header of the answer: its payload is left on the stream, to be read
    /// ([`ExchangeContext::receive_payload_from`]) while this side writes its own.
    pub(super) async fn ask_header(
        &self,
        peer: PeerId,
        protocol: &'static str,
        header: &TensorHeader,
        payload: &[u8],
    ) -> Result<(Stream, TensorHeader), Outcome> {
        let mut stream = self.open(peer, protocol).await.map_err(Outcome::Failed)?;
        self.send_encoded(&mut stream, header, payload)
            .await
            .map_err(stream_outcome)?;
        let answer = wire::read_header(&mut stream, &self.expect())
            .await
            .map_err(stream_outcome)?;
        Ok((stream, answer))
    }

    /// Reads the first frame of `peer`'s answer on `stream` into a new buffer.
    async fn answer_on(
        &self,
        peer: PeerId,
        mut stream: Stream,
    ) -> Result<(Stream, TensorHeader, Vec<f32>), Outcome> {
        let mut answer = Vec::new();
        let header = self
            .receive_from(peer, &mut stream, &mut answer)
            .await
            .map_err(stream_outcome)?;
        Ok((stream, header, answer))
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
        let (run, model) = (&id.run_id, &id.fingerprint);
        let mut header = match payload {
            Payload::Empty => {
                TensorHeader::for_encoded(head.kind, run, model, head.step, head.codec, 0, &[])
            }
            Payload::Values(values) => {
                TensorHeader::for_payload(head.kind, run, model, head.step, values)
            }
            Payload::Encoded { bytes, count } => TensorHeader::for_encoded(
                head.kind, run, model, head.step, head.codec, count, bytes,
            ),
        };
        header.reference = head.reference;
        header.accept = head.accept.clone();
        header.buffers = head.buffers.clone();
        header
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

    /// Reads one frame; a full frame counts as tensor bytes in.
    pub(super) async fn receive(
        &self,
        stream: &mut Stream,
        into: &mut Vec<f32>,
    ) -> Result<TensorHeader, WireError> {
        let header = wire::read_frame(stream, &self.expect(), into).await?;
        self.count_received(header.byte_len);
        Ok(header)
    }

    /// [`ExchangeContext::receive`] of a frame from `peer`, its payload timed for the link's
    /// throughput.
    pub(super) async fn receive_from(
        &self,
        peer: PeerId,
        stream: &mut (impl AsyncRead + Unpin),
        into: &mut Vec<f32>,
    ) -> Result<TensorHeader, WireError> {
        let header = wire::read_header(stream, &self.expect()).await?;
        self.receive_payload_from(peer, stream, &header, into)
            .await?;
        Ok(header)
    }

    /// Reads the payload of `peer`'s frame whose `header` was read, timed for the link's
    /// throughput; it counts as tensor bytes in.
    pub(super) async fn receive_payload_from(
        &self,
        peer: PeerId,
        stream: &mut (impl AsyncRead + Unpin),
        header: &TensorHeader,
        into: &mut Vec<f32>,
    ) -> Result<(), WireError> {
        let started = Instant::now();
        wire::read_payload(stream, header, into).await?;
        self.readout
            .link_table()
            .received(peer, header.byte_len, started.elapsed());
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
