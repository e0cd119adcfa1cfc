//! Picks the compute backend for `training.device` at start-up. Training code is generic over
//! [`murmur_trainer::Backend`]; `on_backend!` runs it with whichever backend was chosen.

use anyhow::{Context, Result};
use murmur_trainer::backend::cuda;
use murmur_trainer::{CpuBackend, CudaBackend};
use tracing::info;

use crate::config::Device;

/// The backend a command computes on.
#[derive(Debug)]
pub enum SelectedBackend {
    Cpu(CpuBackend),
    Cuda(Box<CudaBackend>),
}

/// Runs `$body` with `$backend` bound to the selected backend, whichever type it has.
macro_rules! on_backend {
    ($selected:expr, $backend:ident => $body:expr) => {
        match $selected {
            $crate::device::SelectedBackend::Cpu($backend) => $body,
            $crate::device::SelectedBackend::Cuda($backend) => {
                let $backend = *$backend;
                $body
            }
        }
    };
}
pub(crate) use on_backend;

/// The backend for `device`; the CPU one computes on `threads` threads. `auto` takes the first
/// GPU when the driver, cuBLAS and NVRTC load and a device answers, and otherwise logs once why
/// it uses the CPU. `cuda:N` where there is no GPU `N` is an error that says why.
pub fn select_backend(device: Device, threads: usize) -> Result<SelectedBackend> {
    let cpu = || -> Result<SelectedBackend> {
        Ok(SelectedBackend::Cpu(CpuBackend::with_threads(threads)?))
    };
    match device {
        Device::Cpu => cpu(),
        Device::Auto => match cuda::probe(0) {
            Ok(()) => match CudaBackend::new(0) {
                Ok(backend) => Ok(announce(backend)),
                Err(e) => {
                    info!(reason = %e, "device auto: using cpu");
                    cpu()
                }
            },
            Err(reason) => {
                info!(%reason, "device auto: using cpu");
                cpu()
            }
        },
        Device::Cuda(ordinal) => {
            let backend = CudaBackend::new(ordinal).with_context(|| {
                format!(
                    "device \"cuda:{ordinal}\" cannot be used; choose \"cpu\" or \"auto\" to \
                     train on the CPU"
                )
            })?;
            Ok(announce(backend))
        }
    }
}

fn announce(backend: CudaBackend) -> SelectedBackend {
    use murmur_trainer::Backend as _;
    info!(device = %backend.name(), gpu = backend.device_name(), "training on the GPU");
    SelectedBackend::Cuda(Box::new(backend))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (text, device) in [
            ("auto", Device::Auto),
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(text.parse::<Device>(), Ok(device));
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        let err = "gpu".parse::<Device>().unwrap_err();
        assert!(err.contains("cuda:N"), "{err}");
        assert!("cuda:x".parse::<Device>().is_err());
    }

    #[test]
    fn a_missing_gpu_is_an_error_for_cuda_and_the_cpu_for_auto() {
        // cuda:4096 exists nowhere, so this holds on GPU machines too.
        let err = select_backend(Device::Cuda(4096), 1).unwrap_err();
        let text = format!("{err:#}");
        assert!(
            text.contains("cuda:4096") && text.contains("\"cpu\""),
            "{text}"
        );
        if cuda::probe(0).is_err() {
            let selected = select_backend(Device::Auto, 1).unwrap();
            assert!(matches!(selected, SelectedBackend::Cpu(_)), "{selected:?}");
        }
    }
}
