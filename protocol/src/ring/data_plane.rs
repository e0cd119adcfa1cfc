//! Setting up a ring's data connections.
//!
//! Every connection starts on the authenticated libp2p channel: the left member opens a
//! `/murmur/ring/2` stream to its right neighbour and says hello (run, membership hash, data
//! plane, and which attempt at which round it is). The right member checks that the caller is
//! its left neighbour in the same membership and attempt, and trusted, then either keeps that
//! stream as the data connection ([`DataPlane::Libp2p`]:
//! encrypted by Noise, for links that are not private), or hands out a one-time token and the
//! address of its [`TcpDataListener`] ([`DataPlane::Tcp`]: plain TCP as NCCL and gloo use on
//! datacenter links, so the values are not encrypted twice). A TCP connection is admitted only
//! if its first bytes are a token that was handed out and not yet used, for the same membership.
//!
//! Members number the attempts at a round, and a connection joins two attempts of the same
//! number only ([`super::binding`], the rule the simulator runs too). Without the numbers, a
//! member would take whichever stream its neighbour had opened last, bind to an attempt already
//! doomed elsewhere, and, with every member retrying on its own clock, the aborts could go round
//! the ring for ever (decision 0017).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use libp2p::{PeerId, StreamProtocol};
use rand::TryRng;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};
use tracing::debug;

use super::binding::{Acceptor, Answered, OnHello, Opener};
use super::control::{Control, Hello, TOKEN_BYTES, read_control, write_control};
use super::{Attempt, DataPlane, RingError, RingLinks, RingMembers};
use crate::RING_PROTOCOL;
use crate::network::{Client, Stream};
use crate::trust::TrustList;

/// How long a TCP connection may take to present its token, and a token stays valid.
const ADMISSION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may take to send its token once connected: a member sends it at once.
const GREETING_TIMEOUT: Duration = Duration::from_secs(2);
/// Connections waiting to present their token, from one address and in all; more are closed
/// at once, so that nobody holds the listener's memory with connections that say nothing.
const ADMISSIONS_PER_ADDRESS: usize = 4;
const ADMISSIONS: usize = 256;

/// A hello read off an incoming ring stream, kept with its stream when it belongs to a later
/// attempt than the one under way, for that attempt to take first.
#[derive(Debug)]
pub struct HeldHello {
    from: PeerId,
    stream: Stream,
    hello: Hello,
}

/// A data connection, whichever plane it is on.
pub type DataReader = Box<dyn AsyncRead + Send + Unpin>;
/// A data connection, whichever plane it is on.
pub type DataWriter = Box<dyn AsyncWrite + Send + Unpin>;

/// A TCP listener for ring data, admitting only connections with a token it handed out. It
/// stops listening when the last clone is dropped.
#[derive(Clone, Debug)]
pub struct TcpDataListener {
    addr: SocketAddr,
    pending: Arc<Mutex<HashMap<[u8; TOKEN_BYTES], PendingAdmission>>>,
    /// Held for its `Drop`, which stops the accepting task.
    _accepting: Arc<Accepting>,
}

/// The task that accepts connections, stopped when dropped.
#[derive(Debug)]
struct Accepting(Option<tokio::task::JoinHandle<()>>);

impl Drop for Accepting {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

#[derive(Debug)]
struct PendingAdmission {
    membership: u64,
    admit: oneshot::Sender<TcpStream>,
}

impl TcpDataListener {
    /// Binds `addr` (port 0 picks one) and starts admitting connections on the current tokio
    /// runtime.
    pub async fn bind(addr: SocketAddr) -> Result<Self, RingError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| RingError::Setup(format!("cannot listen for ring data on {addr}: {e}")))?;
        let addr = listener.local_addr().map_err(RingError::Io)?;
        let pending: Arc<Mutex<HashMap<[u8; TOKEN_BYTES], PendingAdmission>>> = Arc::default();
        let admitting = Admitter {
            pending: Arc::clone(&pending),
            waiting: Arc::default(),
        };
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, from)) => {
                        let Some(waiting) = Waiting::enter(&admitting.waiting, from.ip()) else {
                            debug!(%from, "ring data connection closed: too many waiting");
                            continue;
                        };
                        let admitting = admitting.clone();
                        tokio::spawn(async move {
                            if let Err(e) = admitting.admit(stream).await {
                                debug!(%from, "ring data connection refused: {e}");
                            }
                            drop(waiting);
                        });
                    }
                    Err(e) => {
                        debug!("ring data listener: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        Ok(TcpDataListener {
            addr,
            pending,
            _accepting: Arc::new(Accepting(Some(task))),
        })
    }

    /// The address handed out with tokens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A fresh one-time token for `membership`, and the connection that presents it.
    fn issue(
        &self,
        membership: u64,
    ) -> Result<([u8; TOKEN_BYTES], oneshot::Receiver<TcpStream>), RingError> {
        let mut token = [0u8; TOKEN_BYTES];
        rand::rngs::SysRng
            .try_fill_bytes(&mut token)
            .map_err(|e| RingError::Setup(format!("no randomness for a ring token: {e}")))?;
        let (admit, admitted) = oneshot::channel();
        lock(&self.pending).insert(token, PendingAdmission { membership, admit });
        Ok((token, admitted))
    }

    fn withdraw(&self, token: &[u8; TOKEN_BYTES]) {
        lock(&self.pending).remove(token);
    }
}

fn lock(
    pending: &Mutex<HashMap<[u8; TOKEN_BYTES], PendingAdmission>>,
) -> std::sync::MutexGuard<'_, HashMap<[u8; TOKEN_BYTES], PendingAdmission>> {
    pending
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The accepting task's side of the listener: the tokens handed out, and no handle on the
/// listener itself (which would keep it listening for ever).
#[derive(Clone, Debug)]
struct Admitter {
    pending: Arc<Mutex<HashMap<[u8; TOKEN_BYTES], PendingAdmission>>>,
    /// Connections waiting to present their token, per address.
    waiting: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// A connection counted as waiting for admission until dropped.
#[derive(Debug)]
struct Waiting {
    counts: Arc<Mutex<HashMap<IpAddr, usize>>>,
    from: IpAddr,
}

impl Waiting {
    /// Counts a connection from `from`, unless its address or the listener has as many
    /// waiting as it may.
    fn enter(counts: &Arc<Mutex<HashMap<IpAddr, usize>>>, from: IpAddr) -> Option<Self> {
        let mut waiting = counts.lock().unwrap_or_else(|p| p.into_inner());
        let total: usize = waiting.values().sum();
        let here = waiting.entry(from).or_default();
        if *here >= ADMISSIONS_PER_ADDRESS || total >= ADMISSIONS {
            return None;
        }
        *here += 1;
        Some(Waiting {
            counts: Arc::clone(counts),
            from,
        })
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let mut waiting = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(here) = waiting.get_mut(&self.from) {
            *here -= 1;
            if *here == 0 {
                waiting.remove(&self.from);
            }
        }
    }
}

impl Admitter {
    /// Reads a connection's token and membership, and hands it to whoever issued the token.
    async fn admit(&self, mut stream: TcpStream) -> Result<(), RingError> {
        use tokio::io::AsyncReadExt as _;
        let mut greeting = [0u8; TOKEN_BYTES + 8];
        tokio::time::timeout(GREETING_TIMEOUT, stream.read_exact(&mut greeting))
            .await
            .map_err(|_| RingError::Timeout(GREETING_TIMEOUT))??;
        let mut token = [0u8; TOKEN_BYTES];
        token.copy_from_slice(&greeting[..TOKEN_BYTES]);
        let mut membership = [0u8; 8];
        membership.copy_from_slice(&greeting[TOKEN_BYTES..]);
        let membership = u64::from_le_bytes(membership);
        // A token is taken out whatever happens next: it admits one connection at most.
        let pending = lock(&self.pending)
            .remove(&token)
            .ok_or_else(|| RingError::Setup("unknown or used token".into()))?;
        if pending.membership != membership {
            return Err(RingError::Setup(format!(
                "token for membership {:016x} presented for {membership:016x}",
                pending.membership
            )));
        }
        configure(&stream);
        pending
            .admit
            .send(stream)
            .map_err(|_| RingError::Setup("nobody waits for this connection any more".into()))
    }
}

fn configure(stream: &TcpStream) {
    // Sub-chunks are large and sent whole; never hold the tail of one back.
    if let Err(e) = stream.set_nodelay(true) {
        debug!("ring data connection: cannot set TCP_NODELAY: {e}");
    }
}

/// Opens this member's connection to its right neighbour `right` in `members`, for `attempt`.
pub async fn connect_right(
    client: &Client,
    run_id: &str,
    members: &RingMembers,
    right: PeerId,
    plane: DataPlane,
    attempt: Attempt,
) -> Result<DataWriter, RingError> {
    let opener = Opener::new(run_id, members, plane, attempt);
    let mut stream = client
        .open_stream(right, StreamProtocol::new(RING_PROTOCOL))
        .await
        .map_err(|e| RingError::Setup(format!("cannot open a ring stream to {right}: {e}")))?;
    write_control(&mut stream, &opener.hello()).await?;
    let answer = read_control(&mut stream).await?;
    match opener.answered(&right, answer)? {
        Answered::Keep => Ok(Box::new(stream)),
        Answered::Connect { addr, token } => {
            let tcp = TcpStream::connect(addr).await.map_err(|e| {
                RingError::Setup(format!("cannot reach {right}'s ring data port {addr}: {e}"))
            })?;
            configure(&tcp);
            let mut tcp = tcp.compat_write();
            let mut greeting = [0u8; TOKEN_BYTES + 8];
            greeting[..TOKEN_BYTES].copy_from_slice(&token);
            greeting[TOKEN_BYTES..].copy_from_slice(&members.hash().to_le_bytes());
            tcp.write_all(&greeting).await?;
            Ok(Box::new(tcp))
        }
    }
}

/// Reads the hello that opens an incoming ring stream.
async fn read_hello(stream: &mut Stream) -> Result<Hello, RingError> {
    match read_control(stream).await? {
        Control::Hello(hello) => Ok(hello),
        _ => Err(RingError::Malformed(
            "a ring stream must open with hello".into(),
        )),
    }
}

/// Takes the stream of a bound hello as the data connection: answers it as `plane` says (keep
/// it, or hand out a token for `tcp` and wait for the connection that presents it).
async fn accept_left(
    mut stream: Stream,
    membership: u64,
    plane: DataPlane,
    tcp: Option<&TcpDataListener>,
) -> Result<DataReader, RingError> {
    match plane {
        DataPlane::Libp2p => {
            write_control(&mut stream, &Control::Accept).await?;
            Ok(Box::new(stream))
        }
        DataPlane::Tcp => {
            let listener = tcp.ok_or_else(|| {
                RingError::Setup("the tcp data plane needs a data listener".into())
            })?;
            let (token, admitted) = listener.issue(membership)?;
            let answer = Control::Connect {
                addr: listener.addr(),
                token,
            };
            if let Err(e) = write_control(&mut stream, &answer).await {
                listener.withdraw(&token);
                return Err(e);
            }
            let connection = tokio::time::timeout(ADMISSION_TIMEOUT, admitted).await;
            listener.withdraw(&token);
            match connection {
                Ok(Ok(tcp)) => Ok(Box::new(tcp.compat())),
                Ok(Err(_)) => Err(RingError::Closed),
                Err(_) => Err(RingError::Timeout(ADMISSION_TIMEOUT)),
            }
        }
    }
}

/// Both data connections of this member of `members` for `attempt`: opens the one to the
/// right and takes the one from the left off `incoming` (after `held`, a hello kept from the
/// last attempt), each hello judged by the [`Acceptor`]. A hello of a later attempt ends this
/// one ([`RingError::Superseded`]) and is kept in `held` for the next; streams whose opener
/// gave up on them are skipped. The first side to fail ends the attempt.
#[allow(clippy::too_many_arguments)]
pub async fn connect_ring(
    client: &Client,
    incoming: &mut (impl futures::Stream<Item = (PeerId, Stream)> + Unpin),
    held: &mut Option<HeldHello>,
    trust: &TrustList,
    run_id: &str,
    members: &RingMembers,
    me: PeerId,
    plane: DataPlane,
    tcp: Option<&TcpDataListener>,
    attempt: Attempt,
) -> Result<RingLinks<DataReader, DataWriter>, RingError> {
    use futures::StreamExt as _;
    let rank = members
        .rank_of(&me)
        .ok_or_else(|| RingError::Setup("this node is not in the ring".into()))?;
    let acceptor = Acceptor::new(run_id, members, &me, plane, attempt)?;
    let right = members.right_of(rank);
    let to_right = connect_right(client, run_id, members, right, plane, attempt);
    let from_left = async {
        loop {
            let HeldHello {
                from,
                mut stream,
                hello,
            } = match held.take() {
                Some(kept) => kept,
                None => {
                    let (from, mut stream) = incoming.next().await.ok_or_else(|| {
                        RingError::Setup("no longer accepting ring streams".into())
                    })?;
                    match read_hello(&mut stream).await {
                        Ok(hello) => HeldHello {
                            from,
                            stream,
                            hello,
                        },
                        // A stream its opener gave up on before its hello was read.
                        Err(e) => {
                            debug!(%from, "ring stream without a hello skipped: {e}");
                            continue;
                        }
                    }
                }
            };
            match acceptor.on_hello(&from, &hello, trust) {
                OnHello::Bind => match accept_left(stream, hello.membership, plane, tcp).await {
                    Ok(reader) => return Ok(reader),
                    // A stream that its opener gave up on after its hello: skipped, as the
                    // left neighbour's stream for this attempt comes after it.
                    Err(RingError::Closed) => {
                        debug!(%from, "stale ring stream from the left neighbour skipped");
                    }
                    Err(e) => return Err(e),
                },
                OnHello::Skip { answer } => {
                    debug!(%from, theirs = ?hello.attempt, ours = ?attempt, "ring stream refused: {answer:?}");
                    let _ = write_control(&mut stream, &answer).await;
                }
                OnHello::Fail { answer, error } => {
                    let _ = write_control(&mut stream, &answer).await;
                    return Err(error);
                }
                OnHello::Superseded { by } => {
                    *held = Some(HeldHello {
                        from,
                        stream,
                        hello,
                    });
                    return Err(RingError::Superseded { by });
                }
            }
        }
    };
    // Either side's failure ends the attempt at once: refused by the right neighbour, it
    // would otherwise wait on for a left one that may never open.
    let (to_right, from_left) = futures::future::try_join(to_right, from_left).await?;
    Ok(RingLinks::new(from_left, to_right))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// Whether the listener closes `stream` within `within` (reads end), rather than waiting.
    async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(within, stream.read(&mut byte)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    /// Connections that say nothing wait for their token a short while only, and at most
    /// a few per address: one more is closed at once, and a member's connection that comes
    /// later is admitted.
    #[tokio::test]
    async fn connections_that_say_nothing_are_capped_per_address_and_time_out() {
        let listener = TcpDataListener::bind(([127, 0, 0, 1], 0).into())
            .await
            .unwrap();
        let mut silent = Vec::new();
        for _ in 0..ADMISSIONS_PER_ADDRESS {
            silent.push(TcpStream::connect(listener.addr()).await.unwrap());
        }
        let mut one_more = TcpStream::connect(listener.addr()).await.unwrap();
        assert!(
            closed_within(&mut one_more, Duration::from_secs(1)).await,
            "a connection over the address's share is closed at once"
        );
        for stream in &mut silent {
            assert!(
                closed_within(stream, GREETING_TIMEOUT * 3).await,
                "a silent connection is closed after the greeting timeout"
            );
        }
        let (token, admitted) = listener.issue(7).unwrap();
        let mut member = TcpStream::connect(listener.addr()).await.unwrap();
        let mut greeting = token.to_vec();
        greeting.extend(7u64.to_le_bytes());
        member.write_all(&greeting).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), admitted)
            .await
            .expect("the member is admitted within 10 s")
            .expect("the listener hands the connection over");
    }
}
