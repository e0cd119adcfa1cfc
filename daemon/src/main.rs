//! `nodectl`: parse flags, install logging, dispatch, and print any error on one line.

use std::process::ExitCode;

use clap::Parser;
use murmur_daemon::telemetry;
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
    if let Err(err) = telemetry::init_logging(&cli.log, cli.log_format, telemetry.as_ref()) {
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
