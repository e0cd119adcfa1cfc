//! The CPU's GEMM: `matrixmultiply` on blocks of C, which the backend hands to its threads.

use std::ops::Range;

use crate::backend::Gemm;

/// Splits `0..len` into at most `parts` ranges whose inner edges are multiples of `align`.
pub(super) fn aligned_blocks(len: usize, parts: usize, align: usize) -> Vec<Range<usize>> {
    let step = len.div_ceil(parts.max(1)).div_ceil(align) * align;
    (0..len)
        .step_by(step.max(1))
        .map(|start| start..(start + step).min(len))
        .collect()
}

/// Raw operand pointers of one GEMM, shared by the threads that compute its blocks.
#[derive(Clone, Copy)]
pub(super) struct GemmOperands {
    pub(super) a: *const f32,
    pub(super) b: *const f32,
    pub(super) c: *mut f32,
}

impl GemmOperands {
    /// The operands of matrix `i` of a batch whose matrices hold `lens` values each.
    ///
    /// # Safety
    /// Each buffer must hold at least `i + 1` matrices.
    #[allow(unsafe_code)]
    pub(super) unsafe fn matrix(self, i: usize, lens: [usize; 3]) -> Self {
        // SAFETY: by the contract above the offsets stay inside the buffers.
        unsafe {
            GemmOperands {
                a: self.a.add(i * lens[0]),
                b: self.b.add(i * lens[1]),
                c: self.c.add(i * lens[2]),
            }
        }
    }
}

// SAFETY: the pointers are only dereferenced by `gemm_block`, whose callers guarantee that the
// buffers outlive the call and that concurrent blocks write disjoint parts of `c`.
#[allow(unsafe_code)]
unsafe impl Send for GemmOperands {}
#[allow(unsafe_code)]
unsafe impl Sync for GemmOperands {}

/// Computes the block `rows x cols` of `C` for GEMM `g` with one `matrixmultiply` call.
///
/// # Safety
/// `ops` must point to buffers of exactly `m*k`, `k*n` and `m*n` values that live for the call,
/// the ranges must lie within `0..m` and `0..n`, and no other thread may touch this block of C.
#[allow(unsafe_code)]
pub(super) unsafe fn gemm_block(
    g: Gemm,
    ops: GemmOperands,
    rows: Range<usize>,
    cols: Range<usize>,
) {
    // Row-major storage; a transposed operand is read with swapped strides.
    let (rsa, csa) = if g.transpose_a { (1, g.m) } else { (g.k, 1) };
    let (rsb, csb) = if g.transpose_b { (1, g.k) } else { (g.n, 1) };
    // SAFETY: by the contract above every offset stays inside its buffer.
    unsafe {
        matrixmultiply::sgemm(
            rows.len(),
            g.k,
            cols.len(),
            g.alpha,
            ops.a.add(rows.start * rsa),
            to_stride(rsa),
            to_stride(csa),
            ops.b.add(cols.start * csb),
            to_stride(rsb),
            to_stride(csb),
            g.beta,
            ops.c.add(rows.start * g.n + cols.start),
            to_stride(g.n),
            1,
        );
    }
}

fn to_stride(v: usize) -> isize {
    isize::try_from(v).expect("invariant: a buffer length fits in isize")
}
