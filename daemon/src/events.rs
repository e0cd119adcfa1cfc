//! The stable event names of the daemon's log: the `event` field of the lines that scripts may
//! rely on, in text and in JSON logs (`--log-format json`). Their other fields may gain
//! members but are not renamed; docs/operations.md (Logs) lists them.

/// The node is up: `peer_id`, `api`.
pub const READY: &str = "ready";
/// A peer's first heartbeat: `peer`, `step`.
pub const PEER_JOINED: &str = "peer_joined";
/// A peer said goodbye: `peer`.
pub const PEER_LEFT: &str = "peer_left";
/// A peer went silent for the peer timeout: `peer`.
pub const PEER_TIMED_OUT: &str = "peer_timed_out";
/// A peer held the staleness gate past the patience and is not waited for until it catches
/// up: `peer`, `step` (this node's), `their_step`.
pub const PEER_UNCOUPLED: &str = "peer_uncoupled";
/// A peer is refused from now on after repeated invalid messages: `peer`, `reason`.
pub const PEER_BLOCKED: &str = "peer_blocked";
/// An epoch of the local shard ended and the replica was tested: `epoch`, `step`,
/// `test_accuracy`.
pub const EPOCH_DONE: &str = "epoch_done";
/// A checkpoint was written: `path`, `step`.
pub const CHECKPOINT_SAVED: &str = "checkpoint_saved";
/// The replica took over a peer's state: `peer`, `to` (the step taken over) and, when it
/// caught up on joining, `from`.
pub const STATE_SYNC_DONE: &str = "state_sync_done";
/// A state transfer is under way (every 10 s while bytes arrive): `peer`, `received` (bytes
/// of this try), `expected` (bytes of a whole state, at least) and `resumed_at` (bytes that
/// a cut-off transfer had brought, which this one goes on from).
pub const STATE_SYNC_PROGRESS: &str = "state_sync_progress";
/// A ring all-reduce round was aborted and the ring re-forms: `round`, `peers`, `error`.
pub const RING_ROUND_ABORTED: &str = "ring_round_aborted";
/// The configured epochs are done (the node keeps answering peers): `step`.
pub const TRAINING_FINISHED: &str = "training_finished";
/// Training stopped on an error: `error`.
pub const TRAINING_STOPPED: &str = "training_stopped";
/// The node is leaving the run (signal or `nodectl leave`).
pub const LEAVING: &str = "leaving";

/// Every event name, for the docs check.
pub const ALL: [&str; 14] = [
    READY,
    PEER_JOINED,
    PEER_LEFT,
    PEER_TIMED_OUT,
    PEER_UNCOUPLED,
    PEER_BLOCKED,
    EPOCH_DONE,
    CHECKPOINT_SAVED,
    STATE_SYNC_DONE,
    STATE_SYNC_PROGRESS,
    RING_ROUND_ABORTED,
    TRAINING_FINISHED,
    TRAINING_STOPPED,
    LEAVING,
];

#[cfg(test)]
mod tests {
    #[test]
    fn every_event_is_documented_for_operators() {
        let docs = include_str!("../../docs/operations.md");
        for event in super::ALL {
            assert!(
                docs.contains(&format!("`{event}`")),
                "event `{event}` is not in docs/operations.md (Logs)"
            );
        }
    }
}
