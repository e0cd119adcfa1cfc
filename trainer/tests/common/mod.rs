//! What the trainer's device-generic tests share: running a case on every device this machine
//! has, and moving values between the host and a device.
//!
//! A case is a generic function `fn case<B: Backend>(new: fn() -> B)`; it makes as many backends
//! as it needs (a kernel test one, a determinism test one per run) with `new`.

// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use murmur_trainer::backend::{cuda, whole, whole_mut};
use murmur_trainer::{Backend, CudaBackend};

/// Runs `case` on the CPU and, where one answers the probe, on `cuda:0`; says so when it skips
/// the GPU, so a log shows which devices a test ran on.
#[allow(unused_macros)] // see the module's allow
macro_rules! on_every_device {
    ($case:ident) => {{
        $case(murmur_trainer::CpuBackend::new);
        match common::gpu_here() {
            Ok(()) => $case(common::cuda_zero),
            Err(reason) => eprintln!("{}: cpu only ({reason})", stringify!($case)),
        }
    }};
}
#[allow(unused_imports)]
pub(crate) use on_every_device;

/// Whether `cuda:0` can be used, or why not.
pub(crate) fn gpu_here() -> Result<(), String> {
    cuda::probe(0).map_err(|reason| reason.to_string())
}

/// A backend on `cuda:0`; only called after [`gpu_here`] said yes.
pub(crate) fn cuda_zero() -> CudaBackend {
    CudaBackend::new(0).expect("cuda:0 answered the probe")
}

pub(crate) fn to_device<B: Backend>(backend: &B, host: &[f32]) -> B::Buffer {
    let mut buffer = backend.zeros(host.len()).unwrap();
    backend.upload(host, whole_mut::<B>(&mut buffer)).unwrap();
    buffer
}

pub(crate) fn to_host<B: Backend>(backend: &B, buffer: &B::Buffer) -> Vec<f32> {
    let mut host = vec![0.0; B::buffer_len(buffer)];
    backend.download(whole::<B>(buffer), &mut host).unwrap();
    host
}
