//! One module per subcommand; [`run`] dispatches.

mod allreduce_bench;
mod bench;
mod bench_sim;
mod config;
mod control;
mod evaluate;
mod exchange_bench;
mod identity;
pub mod join;
mod sample;
mod samples;
mod shard;
mod train;
mod transfer;
mod trust;

use anyhow::Result;

use crate::cli::{BenchCommand, Command, ConfigCommand, DatasetCommand, TrustCommand};

/// The OpenTelemetry exporters `command` runs with: only the daemon (`join`) exports, and only
/// when an endpoint is configured. `main` sets them up before logging, outside any runtime.
pub fn telemetry(command: &Command) -> Result<Option<crate::telemetry::Telemetry>> {
    match command {
        Command::Join(args) => join::telemetry(args),
        _ => Ok(None),
    }
}

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Init(args) => identity::init(&args),
        Command::Id(args) => identity::id(&args),
        Command::Join(args) => join::run(args),
        Command::Status(args) => control::status(&args),
        Command::Peers(args) => control::peers(&args),
        Command::Wait(args) => control::wait(&args),
        Command::Leave(args) => control::leave(&args),
        Command::Train(args) => train::run(args),
        Command::Evaluate(args) => evaluate::run(&args),
        Command::Sample(args) => sample::run(&args),
        Command::Shard(args) => shard::run(args),
        Command::Dataset(DatasetCommand::Synthetic {
            out,
            train,
            test,
            seed,
        }) => shard::synthetic(&out, train, test, seed),
        Command::Bench(BenchCommand::Train(args)) => bench::run(args),
        Command::Bench(BenchCommand::Transfer(args)) => transfer::run(&args),
        Command::Bench(BenchCommand::Allreduce(args)) => allreduce_bench::run(&args),
        Command::Bench(BenchCommand::Sim(args)) => bench_sim::run(&args),
        Command::Bench(BenchCommand::Exchange(args)) => exchange_bench::run(&args),
        Command::Config(ConfigCommand::Validate { file, json }) => config::validate(&file, json),
        Command::Trust(TrustCommand::Add { peer_id, node }) => trust::add(&peer_id, &node),
        Command::Trust(TrustCommand::Rm { peer_id, node }) => trust::remove(&peer_id, &node),
        Command::Trust(TrustCommand::Ls(node)) => trust::list(&node),
    }
}
