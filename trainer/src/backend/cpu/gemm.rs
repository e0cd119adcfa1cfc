//! The CPU's GEMM: the `gemm` crate on blocks of C, which the backend hands to its threads.

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

/// The deepest slice of `k` that one `gemm` call sums. `gemm` picks its own depth blocking from
/// the block's shape (up to 512 for blocks of at most 64 x 64, from the cache sizes otherwise),
/// and a value summed in other slices rounds differently; slices no deeper than that make every
/// block, whatever its size, sum each value in one order.
const MAX_DEPTH: usize = 512;

/// Whether every block of one side of C, with `other_side` values across, is computed by the
/// same `gemm` kernels as the whole. `gemm` takes a block with a side of one value as a
/// matrix-vector product and one of at most 256 values as dot products, both summed in another
/// order; a GEMM split only into other blocks gives the bits of one thread.
pub(super) fn blocks_sum_like_the_whole(blocks: &[Range<usize>], other_side: usize) -> bool {
    other_side > 1
        && blocks
            .iter()
            .all(|block| block.len() > 1 && block.len() * other_side > 256)
}

/// Computes the block `rows x cols` of `C` for GEMM `g` with single-threaded `gemm` calls, one
/// per slice of at most [`MAX_DEPTH`] of `k`.
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
    // Even slices, so that none is a sliver.
    let depth = g.k.div_ceil(g.k.div_ceil(MAX_DEPTH).max(1)).max(1);
    let mut start = 0;
    loop {
        let len = depth.min(g.k - start);
        // The first slice scales C by beta; the others add to it. `gemm` computes
        // `dst = alpha dst + beta lhs rhs`, so the roles of the two scales swap, and a C scaled
        // by zero is never read (it may hold anything, NaN included).
        let (keep_c, c_scale) = if start == 0 {
            (g.beta != 0.0, g.beta)
        } else {
            (true, 1.0)
        };
        // SAFETY: by the contract above every offset stays inside its buffer: the slice
        // `start..start + len` lies within `0..k`.
        unsafe {
            gemm::gemm(
                rows.len(),
                cols.len(),
                len,
                ops.c.add(rows.start * g.n + cols.start),
                1,
                to_stride(g.n),
                keep_c,
                ops.a.add(rows.start * rsa + start * csa),
                to_stride(csa),
                to_stride(rsa),
                ops.b.add(cols.start * csb + start * rsb),
                to_stride(csb),
                to_stride(rsb),
                c_scale,
                g.alpha,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        start += len;
        if start >= g.k {
            break;
        }
    }
}

fn to_stride(v: usize) -> isize {
    isize::try_from(v).expect("invariant: a buffer length fits in isize")
}
