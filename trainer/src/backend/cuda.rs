//! The CUDA backend: cuBLAS for GEMM, and the other kernels of training (`cuda/kernels.cu`)
//! compiled at start-up with NVRTC. Nothing is linked at build time: cudarc loads the driver,
//! cuBLAS and NVRTC when a backend is made, so one binary runs on machines with and without a
//! GPU ([`probe`] says which, without panicking).
//!
//! Parameters, gradients and optimizer state live in device memory for the whole run. Host
//! data crosses only through [`Backend::upload`](super::Backend::upload) /
//! [`Backend::download`](super::Backend::download) (batches, and parameters at exchanges and
//! checkpoints), by way of one page-locked staging buffer. The operations themselves are in
//! `cuda/ops.rs`.
//!
//! Every call is queued on one stream, in order; calls that hand values to the host wait for it.

use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError,
    LaunchConfig, PinnedHostSlice,
};
use cudarc::nvrtc::CompileOptions;

use super::{BackendError, BackendResult};

/// The kernels other than GEMM, as CUDA C.
const KERNELS: &str = include_str!("cuda/kernels.cu");
/// Threads per block of the elementwise kernels; `bias_grad` relies on it being 256.
const BLOCK: u32 = 256;
/// Upper bound on blocks per launch: the kernels loop over what is left.
const MAX_BLOCKS: u64 = 65_535;
/// Values a block of `chunk_sums` adds: rows longer than this (a convolution's channel over a
/// batch) are summed in chunks first, all at once.
const SUM_CHUNK: usize = 4096;

/// Why there is no usable CUDA device here, in words a log line can carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unavailable(pub String);

/// Checks, without panicking, that the driver, cuBLAS and NVRTC libraries load and that device
/// `ordinal` exists. cudarc's own constructors panic when a library is missing, so this runs
/// before any of them.
pub fn probe(ordinal: usize) -> Result<(), Unavailable> {
    #[allow(unsafe_code)]
    // SAFETY: each call only tries to dlopen the library under its known names and reports
    // whether one loaded; no symbol is called.
    let (driver, cublas, nvrtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(Unavailable(
            "no NVIDIA driver library (libcuda.so) could be loaded".into(),
        ));
    }
    if !cublas {
        return Err(Unavailable(format!(
            "the NVIDIA driver is there but cuBLAS (libcublas.so.{CUDA_MAJOR}) could not be \
             loaded; install the CUDA {CUDA_MAJOR} runtime libraries or add them to LD_LIBRARY_PATH"
        )));
    }
    if !nvrtc {
        return Err(Unavailable(format!(
            "the NVIDIA driver is there but NVRTC (libnvrtc.so.{CUDA_MAJOR}) could not be \
             loaded; install the CUDA {CUDA_MAJOR} runtime libraries or add them to LD_LIBRARY_PATH"
        )));
    }
    let count = CudaContext::device_count()
        .map_err(|e| Unavailable(format!("the CUDA driver did not start: {e}")))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(Unavailable(if count == 0 {
            "the CUDA driver reports no device".into()
        } else {
            format!("there is no cuda:{ordinal}: the CUDA driver reports {count} device(s)")
        }));
    }
    Ok(())
}

/// The CUDA major version whose libraries this build loads (chosen by cudarc's `cuda-*`
/// feature; see docs/cuda.md for a CUDA 12 build).
pub const CUDA_MAJOR: &str = "13";

/// One GPU: a context of its own, one stream, a cuBLAS handle and the compiled kernels.
pub struct CudaBackend {
    ordinal: usize,
    device_name: String,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    kernels: Kernels,
    /// Page-locked host memory for uploads and downloads, grown to the largest one.
    staging: Mutex<Option<Staging>>,
}

impl fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBackend")
            .field("ordinal", &self.ordinal)
            .field("device", &self.device_name)
            .finish_non_exhaustive()
    }
}

/// The staging buffer, and the end of the last copy out of it (an upload returns before its
/// copy has run, so the next use of the buffer waits for it).
struct Staging {
    pinned: PinnedHostSlice<f32>,
    copied: Option<CudaEvent>,
}

/// Device memory of one buffer. A zero-length buffer holds one value that no view reaches,
/// because some drivers refuse zero-byte allocations.
#[derive(Debug)]
pub struct CudaBuffer {
    values: CudaSlice<f32>,
    len: usize,
}

/// A read-only window `start..start + len` of a device buffer.
#[derive(Clone, Copy, Debug)]
pub struct DeviceView<'a> {
    buffer: &'a CudaBuffer,
    start: usize,
    len: usize,
}

/// A writable window `start..start + len` of a device buffer.
#[derive(Debug)]
pub struct DeviceViewMut<'a> {
    buffer: &'a mut CudaBuffer,
    start: usize,
    len: usize,
}

impl<'a> DeviceView<'a> {
    /// The window as cudarc sees it, for a launch or a copy.
    fn slice(&self) -> cudarc::driver::CudaView<'a, f32> {
        self.buffer.values.slice(self.start..self.start + self.len)
    }
}

impl DeviceViewMut<'_> {
    /// The window as cudarc sees it, for a launch or a copy.
    fn slice(&mut self) -> cudarc::driver::CudaViewMut<'_, f32> {
        self.buffer
            .values
            .slice_mut(self.start..self.start + self.len)
    }
}

/// The compiled kernels of `kernels.cu`.
struct Kernels {
    _module: Arc<CudaModule>,
    fill: CudaFunction,
    axpy: CudaFunction,
    add_bias: CudaFunction,
    chunk_sums: CudaFunction,
    bias_grad: CudaFunction,
    relu: CudaFunction,
    relu_backward: CudaFunction,
    gelu: CudaFunction,
    gelu_backward: CudaFunction,
    layer_norm: CudaFunction,
    layer_norm_backward: CudaFunction,
    layer_norm_param_grads: CudaFunction,
    causal_softmax: CudaFunction,
    causal_softmax_backward: CudaFunction,
    swap_middle_axes: CudaFunction,
    embed: CudaFunction,
    embed_backward: CudaFunction,
    scale: CudaFunction,
    square_sums: CudaFunction,
    im2col: CudaFunction,
    col2im: CudaFunction,
    swap_outer_axes: CudaFunction,
    max_pool: CudaFunction,
    max_pool_backward: CudaFunction,
    softmax_cross_entropy: CudaFunction,
    argmax_rows: CudaFunction,
    sgd_update: CudaFunction,
    adamw_update: CudaFunction,
}

/// Compiles the kernels to PTX. Needs NVRTC only, not a device.
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx, String> {
    let options = CompileOptions {
        // No fused multiply-add: the CPU backend rounds each product, and so does this one.
        fmad: Some(false),
        ..CompileOptions::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(KERNELS, options).map_err(|e| e.to_string())
}

fn device_error(op: &'static str) -> impl Fn(DriverError) -> BackendError {
    move |e| BackendError::Device {
        op,
        message: e.to_string(),
    }
}

impl CudaBackend {
    /// Opens device `ordinal` in a context of its own and compiles the kernels. Fails with the
    /// reason, never panics, when there is no such device or a library is missing.
    pub fn new(ordinal: usize) -> BackendResult<Self> {
        let unavailable = |message: String| BackendError::Device {
            op: "open",
            message,
        };
        probe(ordinal).map_err(|e| unavailable(e.0))?;
        let context = CudaContext::new(ordinal).map_err(device_error("open"))?;
        let device_name = context.name().map_err(device_error("open"))?;
        let stream = context.default_stream();
        let blas = CudaBlas::new(stream.clone()).map_err(|e| unavailable(e.to_string()))?;
        let ptx = compile_kernels().map_err(|e| unavailable(format!("compiling kernels: {e}")))?;
        let module = context.load_module(ptx).map_err(device_error("load"))?;
        let load = |name: &str| module.load_function(name).map_err(device_error("load"));
        let kernels = Kernels {
            fill: load("fill")?,
            axpy: load("axpy")?,
            add_bias: load("add_bias")?,
            chunk_sums: load("chunk_sums")?,
            bias_grad: load("bias_grad")?,
            relu: load("relu")?,
            relu_backward: load("relu_backward")?,
            gelu: load("gelu")?,
            gelu_backward: load("gelu_backward")?,
            layer_norm: load("layer_norm")?,
            layer_norm_backward: load("layer_norm_backward")?,
            layer_norm_param_grads: load("layer_norm_param_grads")?,
            causal_softmax: load("causal_softmax")?,
            causal_softmax_backward: load("causal_softmax_backward")?,
            swap_middle_axes: load("swap_middle_axes")?,
            embed: load("embed")?,
            embed_backward: load("embed_backward")?,
            scale: load("scale")?,
            square_sums: load("square_sums")?,
            im2col: load("im2col")?,
            col2im: load("col2im")?,
            swap_outer_axes: load("swap_outer_axes")?,
            max_pool: load("max_pool")?,
            max_pool_backward: load("max_pool_backward")?,
            softmax_cross_entropy: load("softmax_cross_entropy")?,
            argmax_rows: load("argmax_rows")?,
            sgd_update: load("sgd_update")?,
            adamw_update: load("adamw_update")?,
            _module: module,
        };
        Ok(CudaBackend {
            ordinal,
            device_name,
            stream,
            blas,
            kernels,
            staging: Mutex::new(None),
        })
    }

    /// The GPU's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// A launch over `n` independent items.
    fn grid(n: usize) -> LaunchConfig {
        let blocks = (n as u64).div_ceil(u64::from(BLOCK)).clamp(1, MAX_BLOCKS);
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// A launch of one block of [`BLOCK`] threads per row (the kernels' shared arrays have that
    /// size), `rows` of them at most [`MAX_BLOCKS`] at once.
    fn per_row(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: ((rows as u64).clamp(1, MAX_BLOCKS) as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Runs `work` on the first `len` values of the staging buffer (grown if need be), once
    /// the last copy out of it has run; `work` returns the copy it queued, if any.
    fn with_staging(
        &self,
        len: usize,
        op: &'static str,
        work: impl FnOnce(&mut [f32]) -> Result<(), DriverError>,
    ) -> BackendResult {
        let mut staging = self
            .staging
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(copied) = staging.as_mut().and_then(|s| s.copied.take()) {
            copied.synchronize().map_err(device_error(op))?;
        }
        if staging.as_ref().is_none_or(|s| s.pinned.len() < len) {
            #[allow(unsafe_code)]
            // SAFETY: the memory starts uninitialised, and every use writes the part it then
            // reads (an upload copies into it, a download copies from the device into it).
            let pinned = unsafe { self.stream.context().alloc_pinned::<f32>(len) };
            *staging = Some(Staging {
                pinned: pinned.map_err(device_error(op))?,
                copied: None,
            });
        }
        let staging = staging
            .as_mut()
            .expect("invariant: the staging buffer was allocated above");
        let host = staging.pinned.as_mut_slice().map_err(device_error(op))?;
        work(&mut host[..len]).map_err(device_error(op))?;
        staging.copied = Some(self.stream.record_event(None).map_err(device_error(op))?);
        Ok(())
    }

    /// Copies `src` to a fresh device buffer of `u32`s (labels).
    pub(super) fn upload_u32(&self, src: &[u32]) -> BackendResult<CudaSlice<u32>> {
        self.stream
            .clone_htod(src)
            .map_err(device_error("upload labels"))
    }

    /// Copies the first `dst.len()` values of a scratch buffer (per-row results) to `dst`.
    fn download_scratch<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        dst: &mut [T],
    ) -> BackendResult {
        self.stream
            .memcpy_dtoh(&src.slice(..dst.len()), dst)
            .and_then(|()| self.stream.synchronize())
            .map_err(device_error("download"))
    }

    /// A scratch buffer of `len` zeros.
    fn scratch<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        op: &'static str,
    ) -> BackendResult<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(device_error(op))
    }
}

mod ops;

/// Whether NVRTC loads here (it needs no GPU, so the kernels can be compiled without one).
pub fn nvrtc_present() -> bool {
    #[allow(unsafe_code)]
    // SAFETY: only tries to dlopen the library under its known names.
    unsafe {
        cudarc::nvrtc::sys::is_culib_present()
    }
}

#[cfg(test)]
mod tests;
