//! `nodectl`: parse flags, install logging, dispatch, and print any error on one line.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use murmur_daemon::cli::LogFormat;
use murmur_daemon::telemetry::Telemetry;
use murmur_daemon::{allocator, cli, commands};

/// The system's allocator, counting what the process holds: `nodectl status` and `/metrics` show
/// it beside resident memory.
#[global_allocator]
static ALLOCATOR: allocator::Counting = allocator::Counting;

fn main() -> ExitCode {
    // Before any other thread starts: the allocator's arenas are set up per thread.
    allocator::tune();
    let cli = cli::Cli::parse();
    let telemetry = match commands::telemetry(&cli.command) {
        Ok(telemetry) => telemetry,
        Err(err) => {
            eprintln!("error: {err:#}");
            return ExitCode::from(2);
        }
    };
    if let Err(err) = init_logging(&cli.log, cli.log_format, telemetry.as_ref()) {
        eprintln!("error: {err:#}");
        return ExitCode::from(2);
    }
    let outcome = commands::run(cli.command);
    // Flushes the last spans and metrics, whatever the outcome.
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line: the error and each context, outermost first.
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging(
    filter: &str,
    format: LogFormat,
    telemetry: Option<&Telemetry>,
) -> anyhow::Result<()> {
    use tracing_subscriber::filter::Targets;
    use tracing_subscriber::prelude::*;
    let targets: Targets = filter.parse().map_err(|e| {
        anyhow::anyhow!("--log `{filter}` is not a log filter ({e}); try `info` or `debug`")
    })?;
    // Murmur's own spans (exchange, ring_round, state_sync, checkpoint) go to the collector
    // whatever `--log` says; libp2p's are left out.
    let spans = telemetry.map(|telemetry| {
        tracing_opentelemetry::layer()
            .with_tracer(telemetry.tracer())
            .with_filter(
                Targets::new()
                    .with_target("murmur_daemon", tracing::Level::INFO)
                    .with_target("murmur_protocol", tracing::Level::INFO),
            )
    });
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
        .with(layer.with_filter(targets))
        .with(spans)
        .init();
    Ok(())
}
