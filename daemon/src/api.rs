//! The control API: HTTP+JSON on a loopback address only, written to `<data-dir>/api` so that
//! `nodectl status | peers | wait | leave` find the daemon of a data dir.
//!
//! - `GET /`: the status page (peer table, loss and accuracy curves), built into the binary.
//! - `GET /history`: the loss curve and every test evaluation ([`types::HistoryReport`]).
//! - `GET /status`: this node's progress and view of the run ([`types::StatusReport`]).
//! - `GET /peers`: the live peers with their steps ([`types::PeerReport`]).
//! - `GET /metrics`: Murmur's and libp2p's metrics as Prometheus text ([`crate::metrics`]).
//! - `POST /leave`: leave the run gracefully (checkpoint, goodbye heartbeat, exit 0); it needs
//!   `Authorization: Bearer <token>` with the token of `<data-dir>/api-token` (owner-only,
//!   new at each start).
//!
//! Every request must address a loopback host (`Host`), and one from a browser (`Origin`)
//! must come from this API's own status page: a web page elsewhere can neither make the node
//! leave nor read it through a name it points at 127.0.0.1 (decision 0038).
//!
//! [`types`] are the reports (vocabulary, imported by everyone), [`client`] calls a running
//! daemon, [`server`] serves the read side of this one.

pub mod client;
pub mod server;
pub mod types;
