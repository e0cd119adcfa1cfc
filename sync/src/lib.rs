//! One Murmur node's sync brain, with no I/O: nothing here reads a clock, opens a socket or
//! touches a trainer. Callers pass the time and what happened in; the crate answers with what
//! to do. The daemon's actors drive it (in real nodes, and in the daemon's simulator, which runs
//! those nodes in virtual time), so a rule written here is the rule that runs.
//!
//! - [`announce`]: when a heartbeat goes out before its period (a clock that moved).
//! - [`settings`]: how a node syncs ([`settings::SyncSettings`], resolved by the daemon from
//!   the run config) and every bound on a wait ([`settings::Timeouts`]).
//! - [`table`]: the peer table, the live peers as this node sees them and how it reaches each.
//! - [`policy`]: the sync engine's decisions: whom to offer to, what to answer, when to pull a
//!   state, when a ring round starts.
//! - [`screen`]: the checks every received tensor passes before it is mixed (finite, within
//!   the running distance limit, clipped).
//! - [`copies`]: the pair copies of compressed exchanges (CHOCO-gossip with error feedback).
//! - [`machines`]: the stream protocols as sans-IO machines, one per protocol and side,
//!   driven by the engine over its streams.
//! - [`sides`]: a node's open sides of its streams, and how each one's end reaches the policy.
//! - [`rejection`]: why something a peer sent was refused.
//! - [`pace`]: how often a replica hands over a snapshot, stretched to the exchanges' pauses.
//! - [`replica`]: the replica's side: [`replica::ReplicaLoop`] says when it steps, hands over
//!   a snapshot and waits, and how an exchange's end lands on it.
//!
//! It depends on the protocol crate's pure part only (no `net` feature): wire frames, the
//! membership and scoring rules, the mixing math.

pub mod announce;
pub mod copies;
pub mod machines;
pub mod pace;
pub mod policy;
pub mod rejection;
pub mod replica;
pub mod screen;
pub mod settings;
pub mod sides;
pub mod table;
