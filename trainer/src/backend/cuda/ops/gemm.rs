//! GEMM on the CUDA backend: cuBLAS's `sgemm` and its strided-batched form, for row-major
//! matrices.

use cudarc::cublas::{Gemm as _, GemmConfig, StridedBatchedConfig, sys::cublasOperation_t};

use super::super::{CudaBackend, DeviceView, DeviceViewMut};
use super::blas_int;
use crate::backend::{BackendError, BackendResult, Gemm, check};

/// The cuBLAS call for row-major GEMM `g`. cuBLAS is column-major, and a row-major matrix read
/// column-major is its transpose: so it computes `C^T = op(B)^T op(A)^T`, B as the first operand.
fn gemm_config(op: &'static str, g: Gemm) -> BackendResult<GemmConfig<f32>> {
    let transpose = |t: bool| {
        if t {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    Ok(GemmConfig {
        transa: transpose(g.transpose_b),
        transb: transpose(g.transpose_a),
        m: blas_int(op, g.n)?,
        n: blas_int(op, g.m)?,
        k: blas_int(op, g.k)?,
        alpha: g.alpha,
        lda: blas_int(op, if g.transpose_b { g.k } else { g.n }.max(1))?,
        ldb: blas_int(op, if g.transpose_a { g.m } else { g.k }.max(1))?,
        beta: g.beta,
        ldc: blas_int(op, g.n)?,
    })
}

pub(super) fn gemm(
    backend: &CudaBackend,
    g: Gemm,
    a: DeviceView<'_>,
    b: DeviceView<'_>,
    mut c: DeviceViewMut<'_>,
) -> BackendResult {
    check("gemm", "a", g.m * g.k, a.len)?;
    check("gemm", "b", g.k * g.n, b.len)?;
    check("gemm", "c", g.m * g.n, c.len)?;
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let config = gemm_config("gemm", g)?;
    #[allow(unsafe_code)]
    // SAFETY: the checks above guarantee that a, b and c hold exactly m*k, k*n and m*n
    // values, which is what the leading dimensions and sizes passed describe.
    let done = unsafe {
        backend
            .blas
            .gemm(config, &b.slice(), &a.slice(), &mut c.slice())
    };
    done.map_err(|e| BackendError::Device {
        op: "gemm",
        message: e.to_string(),
    })
}

pub(super) fn gemm_batched(
    backend: &CudaBackend,
    g: Gemm,
    count: usize,
    a: DeviceView<'_>,
    b: DeviceView<'_>,
    mut c: DeviceViewMut<'_>,
) -> BackendResult {
    let op = "gemm_batched";
    let (a_len, b_len, c_len) = (g.m * g.k, g.k * g.n, g.m * g.n);
    check(op, "a", count * a_len, a.len)?;
    check(op, "b", count * b_len, b.len)?;
    check(op, "c", count * c_len, c.len)?;
    if g.m == 0 || g.n == 0 || count == 0 {
        return Ok(());
    }
    let stride = |len: usize| {
        i64::try_from(len).map_err(|_| BackendError::Device {
            op,
            message: format!("matrix of {len} values is beyond cuBLAS's 64-bit strides"),
        })
    };
    // B first, as in `gemm`.
    let config = StridedBatchedConfig {
        gemm: gemm_config(op, g)?,
        batch_size: blas_int(op, count)?,
        stride_a: stride(b_len)?,
        stride_b: stride(a_len)?,
        stride_c: stride(c_len)?,
    };
    #[allow(unsafe_code)]
    // SAFETY: the checks above guarantee `count` whole matrices of m*k, k*n and m*n values
    // back to back, which is what the sizes, leading dimensions and strides describe.
    let done = unsafe {
        backend
            .blas
            .gemm_strided_batched(config, &b.slice(), &a.slice(), &mut c.slice())
    };
    done.map_err(|e| BackendError::Device {
        op,
        message: e.to_string(),
    })
}
