//! Why a ring round was aborted.

use std::io;

use super::{Attempt, RoundHeader};

/// Why a round was aborted. None of these panics, and none leaves a half-reduced result behind:
/// the caller throws its working copy away.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingError {
    #[error("round header mismatch: expected {expected:?}, received {found:?}")]
    Mismatch {
        expected: RoundHeader,
        found: RoundHeader,
    },
    #[error("sub-chunk {seq} has {found} bytes, expected {expected}")]
    WrongSize { seq: u32, expected: u32, found: u32 },
    #[error("sub-chunk {found} arrived where {expected} was due")]
    OutOfOrder { expected: u32, found: u32 },
    #[error("sub-chunk {seq}: checksum {found:08x} does not match the sender's {expected:08x}")]
    Checksum { seq: u32, expected: u32, found: u32 },
    #[error("malformed ring frame: {0}")]
    Malformed(String),
    #[error("a neighbour closed the ring connection mid-round")]
    Closed,
    #[error("the round did not finish within {0:?}")]
    Timeout(std::time::Duration),
    #[error("ring connection: {0}")]
    Io(io::Error),
    #[error("ring set-up: {0}")]
    Setup(String),
    #[error("peer {0} is not in this node's trust list")]
    Untrusted(String),
    /// The reduced sum holds NaN or infinite values: some member sent them. Every member
    /// reduces the same sum, so every member refuses the round; which member it was cannot be
    /// told, so it is no one's offence.
    #[error("the ring's mean holds NaN or infinite values: a member sent them")]
    NotFinite,
    /// A member is at a later attempt (or round) than this one: this attempt is over, and the
    /// next is that one.
    #[error("a member is at attempt {} of round {}: this attempt is superseded", .by.number, .by.round)]
    Superseded { by: Attempt },
}

impl From<io::Error> for RingError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            // A stream the other side reset or closed: yamux says so with `WriteZero`.
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::WriteZero
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted => RingError::Closed,
            _ => RingError::Io(e),
        }
    }
}

impl RingError {
    /// Whether the peer on the other end sent something it should not have (as opposed to going
    /// away or timing out).
    pub fn is_offence(&self) -> bool {
        matches!(
            self,
            RingError::Mismatch { .. }
                | RingError::WrongSize { .. }
                | RingError::OutOfOrder { .. }
                | RingError::Checksum { .. }
                | RingError::Malformed(_)
        )
    }
}
