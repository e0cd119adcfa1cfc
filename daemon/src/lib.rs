//! The Murmur daemon: the `nodectl` command line, run configs, and the commands that drive the
//! trainer (and, in time, the peer-to-peer node).
//!
//! - [`cli`]: every subcommand and flag (clap), parsed before anything runs.
//! - [`config`]: run files (TOML) with defaults, validation and located error messages.
//! - [`commands`]: one module per subcommand; `train` owns the epoch loop, progress,
//!   evaluation and checkpoints.
//! - [`node`]: a running peer (`nodectl join`): network task, control API, membership;
//!   [`worker`]: its trainer thread; [`sync`]: the sync engine that exchanges parameters;
//!   [`metrics`]: what it measures, served at `GET /metrics`.
//!
//! The binary's `main` parses the [`cli::Cli`], installs logging and calls [`commands::run`].

pub mod api;
pub mod cli;
pub mod commands;
pub mod config;
pub mod device;
pub mod events;
pub mod metrics;
pub mod node;
pub mod report;
pub mod store;
pub mod sync;
pub mod telemetry;
pub mod worker;
