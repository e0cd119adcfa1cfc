//! Streams to peers: Murmur's [`Stream`] type, and opening one with libp2p-stream, around a
//! request it can lose.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::io::{AsyncRead, AsyncWrite};
use libp2p::{PeerId, StreamProtocol};
use libp2p_stream::Control;

/// How long the first attempt to open a stream may take; each retry gets twice as long as the
/// one before, up to [`LONGEST_ATTEMPT`].
const FIRST_ATTEMPT: Duration = Duration::from_secs(1);
const LONGEST_ATTEMPT: Duration = Duration::from_secs(16);

/// A stream to a peer, of one protocol: a libp2p stream, or a stream of the simulated network
/// (feature `sim`). Reads and writes bytes ([`AsyncRead`], [`AsyncWrite`]); closing it ends
/// the peer's reads.
#[derive(Debug)]
pub struct Stream(Carrier);

#[derive(Debug)]
enum Carrier {
    Swarm(libp2p::Stream),
    /// Boxed: a pipe is several times the size of a libp2p stream.
    #[cfg(feature = "sim")]
    Simulated(Box<super::simulated::Pipe>),
}

impl From<libp2p::Stream> for Stream {
    fn from(stream: libp2p::Stream) -> Self {
        Stream(Carrier::Swarm(stream))
    }
}

#[cfg(feature = "sim")]
impl From<super::simulated::Pipe> for Stream {
    fn from(pipe: super::simulated::Pipe) -> Self {
        Stream(Carrier::Simulated(Box::new(pipe)))
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().0 {
            Carrier::Swarm(stream) => Pin::new(stream).poll_read(cx, buf),
            #[cfg(feature = "sim")]
            Carrier::Simulated(pipe) => Pin::new(pipe.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().0 {
            Carrier::Swarm(stream) => Pin::new(stream).poll_write(cx, buf),
            #[cfg(feature = "sim")]
            Carrier::Simulated(pipe) => Pin::new(pipe.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().0 {
            Carrier::Swarm(stream) => Pin::new(stream).poll_flush(cx),
            #[cfg(feature = "sim")]
            Carrier::Simulated(pipe) => Pin::new(pipe.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().0 {
            Carrier::Swarm(stream) => Pin::new(stream).poll_close(cx),
            #[cfg(feature = "sim")]
            Carrier::Simulated(pipe) => Pin::new(pipe.as_mut()).poll_close(cx),
        }
    }
}

/// Why a stream to a peer could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenStreamError {
    #[error(transparent)]
    Swarm(#[from] libp2p_stream::OpenStreamError),
    /// The simulated network refused it: no link to the peer, or the peer is gone or does not
    /// take the protocol.
    #[error("{0}")]
    Simulated(String),
}

/// Opens a stream of `protocol` to `peer`, dialling it if it is not connected.
///
/// libp2p-stream loses a request made in the instant between a new connection's handler and
/// the swarm's notice of that connection: it sees no connection, asks for a dial, the swarm
/// refuses the dial because the peer is connected by then, and the request waits for ever
/// (rust-libp2p issue 6157). So each attempt has a deadline, and a request that is not served
/// in time is made again, on the connection that exists by then. The deadline doubles at every
/// retry, so that a negotiation that is merely slow (a loaded machine, a long round trip) still
/// completes. Errors are returned as they come; callers bound the whole with their own
/// deadlines.
pub(crate) async fn open_stream(
    control: &mut Control,
    peer: PeerId,
    protocol: StreamProtocol,
) -> Result<Stream, OpenStreamError> {
    let mut attempt = FIRST_ATTEMPT;
    loop {
        let opening = control.open_stream(peer, protocol.clone());
        if let Ok(opened) = tokio::time::timeout(attempt, opening).await {
            return Ok(opened?.into());
        }
        tracing::debug!(%peer, %protocol, ?attempt, "stream not opened in time: asking again");
        attempt = (attempt * 2).min(LONGEST_ATTEMPT);
    }
}
