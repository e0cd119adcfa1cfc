//! The control messages on a ring stream before any data: a left member's hello (run,
//! membership, data plane, attempt) and the right member's answer (keep the stream, connect over
//! TCP with a token, or refuse), each a length-prefixed CBOR message of at most
//! [`MAX_CONTROL_BYTES`]. The connections themselves are set up in `data_plane` (the `net` feature).

use std::net::SocketAddr;

use futures::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::{Deserialize, Serialize};

use super::RingError;

/// Largest control message accepted; a real one is under 200 bytes.
pub(crate) const MAX_CONTROL_BYTES: u32 = 1024;
/// Bytes of a TCP admission token.
pub const TOKEN_BYTES: usize = 16;
/// Which connections carry a ring's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataPlane {
    /// libp2p streams: encrypted and authenticated, for links that are not private.
    Libp2p,
    /// Direct TCP connections admitted by a one-time token: trusted datacenter links.
    Tcp,
}

impl std::fmt::Display for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DataPlane::Libp2p => "libp2p",
            DataPlane::Tcp => "tcp",
        })
    }
}

/// Which attempt at which ring round a connection belongs to: later is greater.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Attempt {
    pub round: u64,
    /// Counted from 1 at every round.
    pub number: u32,
}

impl Attempt {
    /// The first attempt at `round`.
    pub fn first(round: u64) -> Self {
        Attempt { round, number: 1 }
    }
}

/// What a hello says.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Hello {
    pub run_id: String,
    /// The hash of the ring's members ([`super::RingMembers::hash`]).
    pub membership: u64,
    pub plane: DataPlane,
    pub attempt: Attempt,
}

/// The control messages on a ring stream before any data.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Control {
    /// From the left member: "I am your left neighbour in this membership and attempt; here is
    /// my plane".
    Hello(Hello),
    /// Keep this stream as the data connection.
    Accept,
    /// Connect to `addr` over TCP and present `token` first.
    Connect {
        addr: SocketAddr,
        token: [u8; TOKEN_BYTES],
    },
    /// Refused, with the reason, and the refuser's attempt when it is past the caller's.
    Refuse {
        reason: String,
        ahead: Option<Attempt>,
    },
}

pub(crate) async fn write_control<W: AsyncWrite + Unpin>(
    writer: &mut W,
    message: &Control,
) -> Result<(), RingError> {
    let mut encoded = Vec::with_capacity(128);
    ciborium::into_writer(message, &mut encoded)
        .map_err(|e| RingError::Malformed(e.to_string()))?;
    writer
        .write_all(&(encoded.len() as u32).to_le_bytes())
        .await?;
    writer.write_all(&encoded).await?;
    writer.flush().await?;
    Ok(())
}

pub(crate) async fn read_control<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Control, RingError> {
    let mut len = [0u8; 4];
    reader.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len);
    if len > MAX_CONTROL_BYTES {
        return Err(RingError::Malformed(format!(
            "control message of {len} bytes is over the {MAX_CONTROL_BYTES}-byte cap"
        )));
    }
    let mut encoded = vec![0u8; len as usize];
    reader.read_exact(&mut encoded).await?;
    ciborium::from_reader(encoded.as_slice()).map_err(|e| RingError::Malformed(e.to_string()))
}

/// One control message of each kind as a stream carries them, for a fuzzer's first corpus.
pub(crate) fn sample_controls() -> Vec<u8> {
    let attempt = Attempt::first(7);
    let messages = [
        Control::Hello(Hello {
            run_id: "fuzz".into(),
            membership: 0x1234,
            plane: DataPlane::Tcp,
            attempt,
        }),
        Control::Accept,
        Control::Connect {
            addr: SocketAddr::from(([127, 0, 0, 1], 4000)),
            token: [7; TOKEN_BYTES],
        },
        Control::Refuse {
            reason: "not ours".into(),
            ahead: Some(attempt),
        },
    ];
    let mut stream = Vec::new();
    for message in &messages {
        futures::executor::block_on(write_control(&mut stream, message))
            .expect("invariant: writing to a Vec cannot fail");
    }
    stream
}
