//! Emulated wide-area links for the testnet. This machine's kernel shapes rates (`tbf`) but has
//! no `netem`, so the delay and the loss of a link are added here, in userspace: a switch that
//! takes every frame off the testnet's links (raw `AF_PACKET` sockets on the hub's ends of the
//! veth pairs), holds it for its path's delay, drops it with its path's loss, and hands it to
//! the port its destination MAC was learned on. `tc` still shapes each link's rate, on the veth
//! pair's two ends.
//!
//! The probes (`wanlink probe ...`) measure what a link does (round-trip time, throughput, loss),
//! so that a test can hold the emulation to its profile.

pub mod delay_line;
pub mod probe;
pub mod profile;
pub mod switch;
