//! One module per subcommand; [`run`] dispatches.

mod bench;
mod config;
mod shard;
mod train;

use anyhow::{Result, bail};
use murmur_trainer::CpuBackend;
use tracing::info;

use crate::cli::{BenchCommand, Command, ConfigCommand};
use crate::config::Device;

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Train(args) => train::run(args),
        Command::Shard(args) => shard::run(args),
        Command::Bench(BenchCommand::Train(args)) => bench::run(args),
        Command::Config(ConfigCommand::Validate { file, json }) => config::validate(&file, json),
    }
}

/// Sets the number of GEMM threads. `matrixmultiply` reads `MATMUL_NUM_THREADS` once, at the
/// first GEMM of the process, so this must run before any training or benchmarking.
fn set_gemm_threads(threads: usize) {
    #[allow(unsafe_code)]
    // SAFETY: nodectl calls this right after parsing its flags and config, while the process
    // still has a single thread, so nothing reads the environment concurrently.
    unsafe {
        std::env::set_var("MATMUL_NUM_THREADS", threads.to_string());
    }
}

/// The backend for the configured device.
fn select_backend(device: Device) -> Result<CpuBackend> {
    match device {
        Device::Cpu => Ok(CpuBackend::new()),
        Device::Auto => {
            info!(
                reason = "this build has no CUDA backend",
                "device auto: using cpu"
            );
            Ok(CpuBackend::new())
        }
        Device::Cuda => bail!(
            "training.device = \"cuda\", but this nodectl was built without a CUDA backend; \
             set training.device = \"cpu\" or \"auto\""
        ),
    }
}
