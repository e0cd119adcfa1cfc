//! Ring all-reduce for trusted peers (`allreduce` mode).
//!
//! The `p` members of a round, sorted by peer id, form a ring: each sends to its right
//! neighbour and receives from its left one. The flat buffer is cut into `p` chunks
//! ([`RingSchedule`]); in `p - 1` reduce-scatter steps every chunk travels once round the ring
//! picking up each member's contribution, and in `p - 1` all-gather steps the finished chunks
//! travel round again so that everyone has all of them. Each member sends `2 (p - 1) / p` of the
//! buffer, the lower bound for any all-reduce.
//!
//! Chunks move in sub-chunks so that sending, receiving and adding overlap: a member forwards
//! sub-chunk `j` as soon as it has added its own values to it, while sub-chunk `j + 1` is still on
//! the wire ([`all_reduce`]). Every sum is formed in the same order (a chunk starts at its owner
//! and picks up the members in ring order), and the all-gather copies the finished chunks
//! verbatim, so every member ends with bitwise-identical values. What a member does with the
//! round's data, its checks and what it forwards, is the sans-IO [`Reducer`]: `all_reduce`
//! drives it over two byte streams, the simulator of the sync crate over its links.
//!
//! The data connections are plain byte streams: a libp2p stream (encrypted) or a TCP connection
//! admitted with a one-time token (`data_plane`, with the `net` feature). Each round opens with a [`RoundHeader`]
//! naming the round and the hash of its membership on every connection; a sub-chunk carries its
//! sequence number, length and CRC-32. Any mismatch ends the round with a [`RingError`], and the
//! member drops its connections, so that its neighbours fail too and the abort travels round the
//! ring. Callers run the round on a copy of their buffer: an aborted round changes nothing.

pub mod binding;
pub(crate) mod control;
mod error;
pub(crate) mod frame;
mod members;
mod reduce;
mod reducer;
mod schedule;

#[cfg(feature = "net")]
pub mod data_plane;

pub use control::{Attempt, Control, DataPlane, Hello, TOKEN_BYTES};
pub use error::RingError;
pub use frame::{
    DEFAULT_SUB_CHUNK_BYTES, RING_WIRE_VERSION, ROUND_HEADER_BYTES, RoundHeader,
    SUB_CHUNK_HEADER_BYTES, SubChunkHeader, checksum,
};
pub use members::RingMembers;
pub use reduce::{RingLinks, RoundTraffic, all_reduce};
pub use reducer::{Due, Passed, Reducer, into_mean};
pub use schedule::{Phase, RingSchedule, bus_factor};

#[cfg(test)]
mod tests;
