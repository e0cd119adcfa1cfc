//! Opening streams to a peer with libp2p-stream, around a request it can lose.

use std::time::Duration;

use libp2p::{PeerId, Stream, StreamProtocol};
use libp2p_stream::{Control, OpenStreamError};

/// How long the first attempt to open a stream may take; each retry gets twice as long as the
/// one before, up to [`LONGEST_ATTEMPT`].
const FIRST_ATTEMPT: Duration = Duration::from_secs(1);
const LONGEST_ATTEMPT: Duration = Duration::from_secs(16);

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
pub async fn open_stream(
    control: &mut Control,
    peer: PeerId,
    protocol: StreamProtocol,
) -> Result<Stream, OpenStreamError> {
    let mut attempt = FIRST_ATTEMPT;
    loop {
        let opening = control.open_stream(peer, protocol.clone());
        if let Ok(opened) = tokio::time::timeout(attempt, opening).await {
            return opened;
        }
        tracing::debug!(%peer, %protocol, ?attempt, "stream not opened in time: asking again");
        attempt = (attempt * 2).min(LONGEST_ATTEMPT);
    }
}
