//! `nodectl`: parse flags, install logging, dispatch, and print any error on one line.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use murmur_daemon::{cli, commands};

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    if let Err(err) = init_logging(&cli.log) {
        eprintln!("error: {err:#}");
        return ExitCode::from(2);
    }
    match commands::run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line: the error and each context, outermost first.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(filter: &str) -> anyhow::Result<()> {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::prelude::*;
    let targets: Targets = filter.parse().map_err(|e| {
        anyhow::anyhow!("--log `{filter}` is not a log filter ({e}); try `info` or `debug`")
    })?;
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_target(false),
        )
        .with(targets)
        .init();
    Ok(())
}
