//! Murmur's wire protocol and sans-IO sync logic.
//!
//! For now this crate only names the protocol identifiers that peers will speak; the libp2p
//! behaviour, codecs and sync state machines arrive with `nodectl join`. It never depends on
//! the trainer: tensors cross the wire as bytes with a dtype, a shape and a model fingerprint.

/// Stream protocol for pairwise parameter exchange.
pub const PARAMS_PROTOCOL: &str = "/murmur/params/1";
/// Stream protocol for a late joiner's state download.
pub const STATE_PROTOCOL: &str = "/murmur/state/1";
/// Stream protocol for ring all-reduce chunks.
pub const RING_PROTOCOL: &str = "/murmur/ring/1";

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
            assert!(id.starts_with("/murmur/") && id.ends_with("/1"), "{id}");
        }
        assert_eq!(heartbeat_topic("r1"), "murmur/r1/heartbeat");
    }
}
