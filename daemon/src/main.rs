//! `nodectl`: parse flags, install logging, dispatch, and print any error on one line.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use murmur_daemon::cli::LogFormat;
use murmur_daemon::{cli, commands};

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    if let Err(err) = init_logging(&cli.log, cli.log_format) {
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

fn init_logging(filter: &str, format: LogFormat) -> anyhow::Result<()> {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::prelude::*;
    let targets: Targets = filter.parse().map_err(|e| {
        anyhow::anyhow!("--log `{filter}` is not a log filter ({e}); try `info` or `debug`")
    })?;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let layer = match format {
        LogFormat::Text => layer.with_ansi(std::io::stderr().is_terminal()).boxed(),
        // One object per line, the event's fields at the top level next to `level` and
        // `timestamp`, for log shippers and scripts.
        LogFormat::Json => layer
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .boxed(),
    };
    tracing_subscriber::registry()
        .with(layer)
        .with(targets)
        .init();
    Ok(())
}
