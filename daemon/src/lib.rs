//! The Murmur daemon: the `nodectl` command line, run configs, and the running peer.
//!
//! The crate is layered; a module imports only from its own layer or the ones below it
//! (`tests/layers.rs` checks every `crate::` path):
//!
//! 0. Vocabulary: [`cli`] (every subcommand and flag), [`config`] (what the TOML files say),
//!    [`model`] (what a replica's parameters are: the description peers agree on),
//!    [`settings`] (resolved settings and the timeout hierarchy), [`store`] (the data dir and
//!    its redb store), [`events`] (stable log event names), [`api::types`] (the control API's
//!    reports), [`report`] (how figures are printed), [`allocator`] (the binary's global
//!    allocator, counting the bytes the process holds, and glibc's settings), [`clock`] (the
//!    runtime's clock, which the node reads).
//! 1. The read side: [`readout`] (what observers read of a running node), [`device`]
//!    (backend selection), [`api::client`] (calls a running daemon).
//! 2. Observers: [`metrics`] (`GET /metrics`), [`telemetry`] (OTLP), [`api::server`].
//! 3. One running peer: [`node`] (`nodectl join`'s network task, replica driver, sync engine;
//!    the trainer contract, [`node::replica::Replica`]); and the simulator, `sim` (feature
//!    `sim`): many of them on a simulated network in virtual time.
//! 4. Commands: [`commands`], one module per subcommand.
//!
//! The binary's `main` installs [`allocator::Counting`], tunes glibc ([`allocator::tune`]),
//! parses the [`cli::Cli`], installs logging and calls [`commands::run`].

pub mod allocator;
pub mod api;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod config;
pub mod device;
pub mod events;
pub mod metrics;
pub mod model;
pub mod node;
pub mod readout;
pub mod report;
pub mod settings;
#[cfg(feature = "sim")]
pub mod sim;
pub mod store;
pub mod telemetry;
