//! Murmur's wire protocol and sans-IO sync logic.
//!
//! - [`wire`]: tensor frames on the stream protocols: a versioned, length-capped CBOR header
//!   followed by the raw little-endian bytes of a flat buffer, with a checksum.
//! - [`heartbeat`]: the small message every peer publishes once a second.
//! - [`membership`]: the live-peer view built from heartbeats (joins, leaves, timeouts).
//! - [`scoring`]: offences of misbehaving peers, and when to block them.
//! - [`sync`]: the staleness gate and filter, partner choice and center election.
//! - [`mix`]: the mixing math of the sync modes on flat buffers (push-pull, elastic, clipping,
//!   the outer step, consensus).
//! - [`throttle`]: warning lines that peers can cause, kept to a few a minute.
//! - [`coupling`]: which peers the staleness gate waits for, so that no clock can stall it.
//! - [`ring`]: the ring all-reduce of trusted peers: its members, schedule, frames and rounds.
//! - [`trust`]: the peers this node trusts (its rings, the elastic election).
//! - [`fuzzing`]: byte-level entry points to the decoders inside the stream protocols, for
//!   the fuzz targets in `fuzz/`.
//!
//! With the `net` feature (which the daemon enables), the side that does I/O:
//! - `network`: the libp2p swarm task and the `Client` the rest of a node uses; the connection
//!   rules in it (`network/connections.rs`) are sans-IO too.
//! - `ring::data_plane`: opening a ring's data connections (libp2p streams, admitted TCP).
//!
//! Without it, everything here takes time as an input and does no I/O of its own (the codecs
//! work on any `AsyncRead`/`AsyncWrite`), so it is tested without sockets or clocks, and builds
//! without libp2p's swarm or tokio's sockets. This crate never depends on the trainer: tensors
//! cross the wire as bytes with a dtype, a shape and a model fingerprint.

pub mod codec;
pub mod coupling;
pub mod fuzzing;
pub mod heartbeat;
pub mod membership;
pub mod mix;
#[cfg(feature = "net")]
pub mod network;
pub mod ring;
pub mod scoring;
pub mod sync;
pub mod throttle;
pub mod trust;
pub mod wire;

/// Stream protocol for pairwise parameter exchange (version 3: the pair copies of compressed
/// exchanges are kept in 16 bits a value, decision 0089, so that a version 2 peer's copies
/// would drift from this side's).
pub const PARAMS_PROTOCOL: &str = "/murmur/params/3";
/// Stream protocol for a late joiner's state download (version 3: the optimizer's state
/// travels with the parameters as named buffers, when both peers' optimizers keep the same;
/// version 4: each buffer in chunks, and a transfer that was cut off goes on where it stopped).
pub const STATE_PROTOCOL: &str = "/murmur/state/4";
/// Stream protocol for ring all-reduce chunks (version 2: a hello names its attempt, so that
/// members bind the connections of the same attempt only).
pub const RING_PROTOCOL: &str = "/murmur/ring/2";

/// The gossipsub topic on which the members of run `run_id` publish heartbeats.
pub fn heartbeat_topic(run_id: &str) -> String {
    format!("murmur/{run_id}/heartbeat")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_ids_carry_a_version() {
        for id in [PARAMS_PROTOCOL, STATE_PROTOCOL, RING_PROTOCOL] {
            let version = id.strip_prefix("/murmur/").and_then(|r| r.rsplit_once('/'));
            assert!(
                version.is_some_and(|(_, v)| v.parse::<u32>().is_ok_and(|v| v >= 1)),
                "{id}"
            );
        }
        assert_eq!(heartbeat_topic("r1"), "murmur/r1/heartbeat");
    }
}
