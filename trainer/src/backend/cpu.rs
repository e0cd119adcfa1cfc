//! The CPU backend: the `gemm` crate for GEMM, plain loops that the compiler vectorises for
//! everything else, and a fork-join pool (`cpu/fork_join.rs`) that splits each large GEMM and
//! optimizer update into one block per thread.
//!
//! Why not a GEMM library's own threading: the heuristics of `matrixmultiply` (this backend's
//! GEMM until decision 0058) left the small GEMMs of a batch-64 MLP step almost serial (2
//! threads gained 8% on 2 cores), while one block per thread on a pool whose workers stay awake
//! gains 70-85% per GEMM. Every output value is still computed by one thread in the same order,
//! so results do not depend on the thread count (docs/decisions/0003).

mod fork_join;
mod gemm;
mod transformer;

use std::ops::Range;
use std::sync::{Arc, Mutex};

use fork_join::ForkJoin;
use gemm::{GemmOperands, aligned_blocks, blocks_sum_like_the_whole, gemm_block};

use super::{
    AdamWUpdate, Backend, BackendError, BackendResult, CausalShape, ChannelLayout, ConvGeometry,
    Gemm, GemmSplit, LayerNormShape, PoolGeometry, SgdUpdate, check,
};

/// Values a block of [`Backend::sum_squares`] sums in `f32` before the blocks are added in
/// `f64` (the CUDA backend's blocks are the same).
pub(crate) const SUM_SQUARES_BLOCK: usize = 4096;
/// GEMMs below this many flops run on the calling thread: waking a helper costs more.
const MIN_SPLIT_FLOPS: u64 = 1 << 20;
/// Elementwise updates below this length run on the calling thread.
const MIN_SPLIT_LEN: usize = 1 << 15;
/// Block edges are multiples of this, so blocks keep whole register tiles.
const BLOCK_ALIGN: usize = 16;

/// Host memory and host kernels, on `threads` threads.
#[derive(Clone, Debug)]
pub struct CpuBackend {
    threads: usize,
    /// The calling thread plus `threads - 1` workers; none when single-threaded.
    pool: Option<Arc<ForkJoin>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuBackend {
    /// A single-threaded backend.
    pub fn new() -> Self {
        CpuBackend {
            threads: 1,
            pool: None,
        }
    }

    /// A backend that computes on `threads` threads.
    pub fn with_threads(threads: usize) -> BackendResult<Self> {
        if threads <= 1 {
            return Ok(Self::new());
        }
        let pool = ForkJoin::new(threads).map_err(|e| BackendError::Device {
            op: "with_threads",
            message: format!("cannot start {threads} threads: {e}"),
        })?;
        Ok(CpuBackend {
            threads,
            pool: Some(Arc::new(pool)),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `work(block)` for each of `blocks` (at most one per thread), the first on the
    /// calling thread, and returns when all are done.
    fn run_blocks(&self, blocks: Vec<Range<usize>>, work: impl Fn(Range<usize>) + Sync) {
        match &self.pool {
            Some(pool) if blocks.len() > 1 => pool.run(blocks.len(), &|i| work(blocks[i].clone())),
            _ => blocks.into_iter().for_each(work),
        }
    }

    /// Runs `update` on each of `parts` (at most one per thread), in parallel.
    fn run_parts<T: Send>(&self, parts: Vec<T>, update: impl Fn(T) + Sync) {
        match &self.pool {
            Some(pool) if parts.len() > 1 => {
                // Each thread takes its own part out of its slot, so the parts (which hold
                // `&mut` chunks) move to the threads without unsafe code.
                let slots: Vec<Mutex<Option<T>>> =
                    parts.into_iter().map(|p| Mutex::new(Some(p))).collect();
                pool.run(slots.len(), &|i| {
                    let part = slots[i].lock().unwrap_or_else(|p| p.into_inner()).take();
                    if let Some(part) = part {
                        update(part);
                    }
                });
            }
            _ => parts.into_iter().for_each(update),
        }
    }

    /// Length of each part when `len` values, in whole `unit`s (rows, matrices), are shared
    /// between the threads: all of them in one part when they are too few to be worth it.
    fn part_len(&self, len: usize, unit: usize) -> usize {
        let unit = unit.max(1);
        if len < MIN_SPLIT_LEN {
            len.max(unit)
        } else {
            len.div_ceil(unit).div_ceil(self.threads).max(1) * unit
        }
    }

    /// Chunk length that gives each thread one piece of a `len`-long elementwise update.
    fn chunk_len(&self, len: usize) -> usize {
        if len < MIN_SPLIT_LEN {
            len.max(1)
        } else {
            len.div_ceil(self.threads).max(1)
        }
    }
}

impl Backend for CpuBackend {
    type Buffer = Vec<f32>;
    type View<'a> = &'a [f32];
    type ViewMut<'a> = &'a mut [f32];

    fn name(&self) -> String {
        "cpu".to_owned()
    }

    fn zeros(&self, len: usize) -> BackendResult<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn buffer_len(buffer: &Vec<f32>) -> usize {
        buffer.len()
    }

    fn view(buffer: &Vec<f32>, range: Range<usize>) -> &[f32] {
        &buffer[range]
    }

    fn view_mut(buffer: &mut Vec<f32>, range: Range<usize>) -> &mut [f32] {
        &mut buffer[range]
    }

    fn reborrow_mut<'s, 'a: 's>(view: &'s mut &'a mut [f32]) -> &'s mut [f32] {
        view
    }

    fn upload(&self, src: &[f32], dst: &mut [f32]) -> BackendResult {
        check("upload", "dst", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &[f32], dst: &mut [f32]) -> BackendResult {
        check("download", "dst", src.len(), dst.len())?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn copy(&self, src: &[f32], dst: &mut [f32]) -> BackendResult {
        check("copy", "dst", src.len(), dst.len())?;
        let chunk = self.chunk_len(dst.len());
        let parts: Vec<_> = dst.chunks_mut(chunk).zip(src.chunks(chunk)).collect();
        self.run_parts(parts, |(dst, src)| dst.copy_from_slice(src));
        Ok(())
    }

    fn fill(&self, dst: &mut [f32], value: f32) -> BackendResult {
        dst.fill(value);
        Ok(())
    }

    fn add_host(&self, src: &[f32], dst: &mut [f32]) -> BackendResult {
        self.axpy(1.0, src, dst)
    }

    fn axpy(&self, alpha: f32, x: &[f32], y: &mut [f32]) -> BackendResult {
        check("axpy", "y", x.len(), y.len())?;
        let chunk = self.chunk_len(y.len());
        let parts: Vec<_> = y.chunks_mut(chunk).zip(x.chunks(chunk)).collect();
        self.run_parts(parts, |(y, x)| {
            for (yi, xi) in y.iter_mut().zip(x) {
                *yi += alpha * xi;
            }
        });
        Ok(())
    }

    fn scale(&self, alpha: f32, y: &mut [f32]) -> BackendResult {
        for v in y {
            *v *= alpha;
        }
        Ok(())
    }

    fn sum_squares(&self, x: &[f32]) -> BackendResult<f64> {
        // In blocks of 4096, each summed in f32 lanes and the blocks in f64, in order (the
        // CUDA backend sums the same blocks, each in its own order).
        Ok(x.chunks(SUM_SQUARES_BLOCK)
            .map(|block| {
                let mut lanes = [0.0f32; 8];
                let chunks = block.chunks_exact(8);
                let rest: f32 = chunks.remainder().iter().map(|v| v * v).sum();
                for chunk in chunks {
                    for (lane, v) in lanes.iter_mut().zip(chunk) {
                        *lane += v * v;
                    }
                }
                f64::from(lanes.iter().sum::<f32>() + rest)
            })
            .sum())
    }

    fn gemm(&self, g: Gemm, a: &[f32], b: &[f32], c: &mut [f32]) -> BackendResult {
        check("gemm", "a", g.m * g.k, a.len())?;
        check("gemm", "b", g.k * g.n, b.len())?;
        check("gemm", "c", g.m * g.n, c.len())?;
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let ops = GemmOperands {
            a: a.as_ptr(),
            b: b.as_ptr(),
            c: c.as_mut_ptr(),
        };
        let parts = if g.flops() < MIN_SPLIT_FLOPS {
            1
        } else {
            self.threads
        };
        let split_rows = match g.split {
            GemmSplit::Rows => true,
            GemmSplit::Columns => false,
            // The longer side, so every block stays a well-shaped GEMM.
            GemmSplit::Auto => g.m >= g.n,
        };
        let (len, other_side) = if split_rows { (g.m, g.n) } else { (g.n, g.m) };
        let mut blocks = aligned_blocks(len, parts, BLOCK_ALIGN);
        if !blocks_sum_like_the_whole(&blocks, other_side) {
            blocks = aligned_blocks(len, 1, BLOCK_ALIGN);
        }
        self.run_blocks(blocks, |block| {
            let (rows, cols) = if split_rows {
                (block, 0..g.n)
            } else {
                (0..g.m, block)
            };
            #[allow(unsafe_code)]
            // SAFETY: the checks above guarantee that a, b and c hold exactly m*k, k*n and m*n
            // values; `c` is borrowed mutably for the whole call, so it aliases neither input;
            // the blocks partition one side of C, so no two threads write the same value.
            unsafe {
                gemm_block(g, ops, rows, cols);
            }
        });
        Ok(())
    }

    fn gemm_batched(
        &self,
        g: Gemm,
        count: usize,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
    ) -> BackendResult {
        let (a_len, b_len, c_len) = (g.m * g.k, g.k * g.n, g.m * g.n);
        check("gemm_batched", "a", count * a_len, a.len())?;
        check("gemm_batched", "b", count * b_len, b.len())?;
        check("gemm_batched", "c", count * c_len, c.len())?;
        if g.m == 0 || g.n == 0 || count == 0 {
            return Ok(());
        }
        let ops = GemmOperands {
            a: a.as_ptr(),
            b: b.as_ptr(),
            c: c.as_mut_ptr(),
        };
        let parts = if g.flops() * (count as u64) < MIN_SPLIT_FLOPS {
            1
        } else {
            self.threads
        };
        self.run_blocks(aligned_blocks(count, parts, 1), |matrices| {
            for i in matrices {
                #[allow(unsafe_code)]
                // SAFETY: the checks above guarantee `count` whole matrices in each operand, so
                // matrix i's offsets leave a full matrix in each buffer; `c` is borrowed mutably
                // for the whole call, and each matrix of C belongs to one block of one thread.
                unsafe {
                    gemm_block(g, ops.matrix(i, [a_len, b_len, c_len]), 0..g.m, 0..g.n);
                }
            }
        });
        Ok(())
    }

    fn add_bias(&self, layout: ChannelLayout, bias: &[f32], y: &mut [f32]) -> BackendResult {
        check("add_bias", "bias", layout.channels, bias.len())?;
        check("add_bias", "y", layout.len(), y.len())?;
        if layout.is_empty() {
            return Ok(());
        }
        if layout.inner == 1 {
            // A bias per feature of each row (linear layers): rows of whole vectors.
            let part = self.part_len(y.len(), layout.channels);
            self.run_parts(y.chunks_mut(part).collect(), |rows: &mut [f32]| {
                for row in rows.chunks_exact_mut(layout.channels) {
                    for (v, b) in row.iter_mut().zip(bias) {
                        *v += b;
                    }
                }
            });
            return Ok(());
        }
        for block in y.chunks_exact_mut(layout.channels * layout.inner) {
            for (row, b) in block.chunks_exact_mut(layout.inner).zip(bias) {
                for v in row {
                    *v += b;
                }
            }
        }
        Ok(())
    }

    fn bias_grad(&self, layout: ChannelLayout, dy: &[f32], dbias: &mut [f32]) -> BackendResult {
        check("bias_grad", "dbias", layout.channels, dbias.len())?;
        check("bias_grad", "dy", layout.len(), dy.len())?;
        dbias.fill(0.0);
        if layout.is_empty() {
            return Ok(());
        }
        if layout.inner == 1 {
            // Rows of whole vectors, added in row order: the same sums as the loop below. Each
            // thread sums its own features over every row, in parts of whole cache lines so
            // that no two threads write to one.
            let channels = layout.channels;
            let threads = if dy.len() < MIN_SPLIT_LEN {
                1
            } else {
                self.threads
            };
            let features = aligned_blocks(channels, threads, BLOCK_ALIGN)[0].len();
            let parts: Vec<_> = dbias.chunks_mut(features).enumerate().collect();
            self.run_parts(parts, |(i, dbias)| {
                let first = i * features;
                for row in dy.chunks_exact(channels) {
                    for (db, v) in dbias.iter_mut().zip(&row[first..]) {
                        *db += v;
                    }
                }
            });
            return Ok(());
        }
        for block in dy.chunks_exact(layout.channels * layout.inner) {
            for (row, db) in block.chunks_exact(layout.inner).zip(dbias.iter_mut()) {
                *db += lane_sum(row);
            }
        }
        Ok(())
    }

    fn relu(&self, x: &[f32], y: &mut [f32]) -> BackendResult {
        check("relu", "y", x.len(), y.len())?;
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = xi.max(0.0);
        }
        Ok(())
    }

    fn relu_backward(&self, y: &[f32], dy: &[f32], dx: &mut [f32]) -> BackendResult {
        check("relu_backward", "dy", y.len(), dy.len())?;
        check("relu_backward", "dx", y.len(), dx.len())?;
        for ((dxi, &dyi), &yi) in dx.iter_mut().zip(dy).zip(y) {
            *dxi = if yi > 0.0 { dyi } else { 0.0 };
        }
        Ok(())
    }

    fn gelu(&self, x: &[f32], y: &mut [f32]) -> BackendResult {
        transformer::gelu(self, x, y)
    }

    fn gelu_backward(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) -> BackendResult {
        transformer::gelu_backward(self, x, dy, dx)
    }

    fn causal_softmax(
        &self,
        shape: CausalShape,
        scale: f32,
        scores: &[f32],
        probs: &mut [f32],
    ) -> BackendResult {
        transformer::causal_softmax(self, shape, scale, scores, probs)
    }

    fn causal_softmax_backward(
        &self,
        shape: CausalShape,
        scale: f32,
        probs: &[f32],
        dprobs: &[f32],
        dscores: &mut [f32],
    ) -> BackendResult {
        transformer::causal_softmax_backward(self, shape, scale, probs, dprobs, dscores)
    }

    fn layer_norm(
        &self,
        shape: LayerNormShape,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        y: &mut [f32],
        stats: &mut [f32],
    ) -> BackendResult {
        transformer::layer_norm(self, shape, x, gamma, beta, y, stats)
    }

    fn layer_norm_backward(
        &self,
        shape: LayerNormShape,
        x: &[f32],
        gamma: &[f32],
        stats: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        dparams: &mut [f32],
    ) -> BackendResult {
        transformer::layer_norm_backward(self, shape, x, gamma, stats, dy, dx, dparams)
    }

    fn im2col(
        &self,
        g: ConvGeometry,
        batch: usize,
        images: &[f32],
        patches: &mut [f32],
    ) -> BackendResult {
        check("im2col", "images", batch * g.image_len(), images.len())?;
        check(
            "im2col",
            "patches",
            g.patch_len() * batch * g.out_pixels(),
            patches.len(),
        )?;
        let (out_h, out_w) = (g.out_height(), g.out_width());
        for_each_patch_row(g, batch, |row, image, c, kh, kw, columns| {
            let plane =
                &images[(image * g.channels + c) * g.height * g.width..][..g.height * g.width];
            let dst = &mut patches[row..][..columns];
            dst.fill(0.0);
            let valid_w = valid_outputs(out_w, g.width, kw, g.stride, g.padding);
            for oh in valid_outputs(out_h, g.height, kh, g.stride, g.padding) {
                let src = &plane[(oh * g.stride + kh - g.padding) * g.width..][..g.width];
                let out = &mut dst[oh * out_w..][..out_w];
                if g.stride == 1 {
                    let first = valid_w.start + kw - g.padding;
                    out[valid_w.clone()].copy_from_slice(&src[first..first + valid_w.len()]);
                } else {
                    for ow in valid_w.clone() {
                        out[ow] = src[ow * g.stride + kw - g.padding];
                    }
                }
            }
        });
        Ok(())
    }

    fn col2im(
        &self,
        g: ConvGeometry,
        batch: usize,
        patches: &[f32],
        images: &mut [f32],
    ) -> BackendResult {
        check("col2im", "images", batch * g.image_len(), images.len())?;
        check(
            "col2im",
            "patches",
            g.patch_len() * batch * g.out_pixels(),
            patches.len(),
        )?;
        images.fill(0.0);
        let (out_h, out_w) = (g.out_height(), g.out_width());
        for_each_patch_row(g, batch, |row, image, c, kh, kw, columns| {
            let plane =
                &mut images[(image * g.channels + c) * g.height * g.width..][..g.height * g.width];
            let src = &patches[row..][..columns];
            let valid_w = valid_outputs(out_w, g.width, kw, g.stride, g.padding);
            for oh in valid_outputs(out_h, g.height, kh, g.stride, g.padding) {
                let dst = &mut plane[(oh * g.stride + kh - g.padding) * g.width..][..g.width];
                let grads = &src[oh * out_w..][..out_w];
                if g.stride == 1 {
                    let first = valid_w.start + kw - g.padding;
                    let dst = &mut dst[first..first + valid_w.len()];
                    for (d, v) in dst.iter_mut().zip(&grads[valid_w.clone()]) {
                        *d += v;
                    }
                } else {
                    for ow in valid_w.clone() {
                        dst[ow * g.stride + kw - g.padding] += grads[ow];
                    }
                }
            }
        });
        Ok(())
    }

    fn swap_outer_axes(&self, dims: [usize; 3], src: &[f32], dst: &mut [f32]) -> BackendResult {
        let [a, b, inner] = dims;
        check("swap_outer_axes", "src", a * b * inner, src.len())?;
        check("swap_outer_axes", "dst", a * b * inner, dst.len())?;
        if inner == 0 {
            return Ok(());
        }
        for (i, block) in src.chunks_exact(b * inner).enumerate() {
            for (j, run) in block.chunks_exact(inner).enumerate() {
                dst[(j * a + i) * inner..][..inner].copy_from_slice(run);
            }
        }
        Ok(())
    }

    fn swap_middle_axes(&self, dims: [usize; 4], src: &[f32], dst: &mut [f32]) -> BackendResult {
        transformer::swap_middle_axes(self, dims, src, dst)
    }

    fn embed(&self, width: usize, tokens: &[u32], table: &[f32], y: &mut [f32]) -> BackendResult {
        transformer::embed(width, tokens, table, y)
    }

    fn embed_backward(
        &self,
        width: usize,
        tokens: &[u32],
        dy: &[f32],
        dtable: &mut [f32],
    ) -> BackendResult {
        transformer::embed_backward(width, tokens, dy, dtable)
    }

    fn max_pool(&self, g: PoolGeometry, planes: usize, x: &[f32], y: &mut [f32]) -> BackendResult {
        let (oh, ow) = (g.out_height(), g.out_width());
        check("max_pool", "x", planes * g.height * g.width, x.len())?;
        check("max_pool", "y", planes * oh * ow, y.len())?;
        let plane_len = g.height * g.width;
        for (plane, out) in x
            .chunks_exact(plane_len)
            .zip(y.chunks_exact_mut(oh * ow))
            .take(planes)
        {
            for (i, out_row) in out.chunks_exact_mut(ow).enumerate() {
                out_row.fill(f32::NEG_INFINITY);
                for di in 0..g.window {
                    let in_row = &plane[(i * g.window + di) * g.width..][..ow * g.window];
                    for (best, window) in out_row.iter_mut().zip(in_row.chunks_exact(g.window)) {
                        for &v in window {
                            *best = best.max(v);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn max_pool_backward(
        &self,
        g: PoolGeometry,
        planes: usize,
        x: &[f32],
        y: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) -> BackendResult {
        let (oh, ow) = (g.out_height(), g.out_width());
        check(
            "max_pool_backward",
            "x",
            planes * g.height * g.width,
            x.len(),
        )?;
        check("max_pool_backward", "dx", x.len(), dx.len())?;
        check("max_pool_backward", "y", planes * oh * ow, y.len())?;
        check("max_pool_backward", "dy", y.len(), dy.len())?;
        dx.fill(0.0);
        let plane_len = g.height * g.width;
        let planes_in = x
            .chunks_exact(plane_len)
            .zip(dx.chunks_exact_mut(plane_len));
        let planes_out = y.chunks_exact(oh * ow).zip(dy.chunks_exact(oh * ow));
        for ((xp, dxp), (yp, dyp)) in planes_in.zip(planes_out).take(planes) {
            for i in 0..oh {
                for j in 0..ow {
                    let (max, grad) = (yp[i * ow + j], dyp[i * ow + j]);
                    // The first input that equals the maximum gets the gradient. A NaN maximum
                    // equals nothing, so its gradient is dropped rather than misrouted.
                    for di in 0..g.window {
                        let row = (i * g.window + di) * g.width + j * g.window;
                        if let Some(k) = xp[row..row + g.window].iter().position(|&v| v == max) {
                            dxp[row + k] += grad;
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: &[f32],
        labels: &[u32],
        dlogits: &mut [f32],
    ) -> BackendResult<f32> {
        check(
            "softmax_cross_entropy",
            "logits",
            labels.len() * classes,
            logits.len(),
        )?;
        check(
            "softmax_cross_entropy",
            "dlogits",
            logits.len(),
            dlogits.len(),
        )?;
        let rows = labels.len();
        if rows == 0 {
            return Ok(0.0);
        }
        if let Some(&label) = labels.iter().find(|&&label| label as usize >= classes) {
            return Err(BackendError::Label {
                op: "softmax_cross_entropy",
                label,
                classes,
            });
        }
        let scale = 1.0 / rows as f32;
        // Each row's loss is kept and the losses added in row order, so that the total does
        // not depend on how the rows were shared between threads.
        let mut losses = vec![0.0f64; rows];
        // Every label is below `classes`, so there is at least one class.
        let part = self.part_len(logits.len(), classes);
        let part_rows = part / classes;
        let parts: Vec<_> = logits
            .chunks(part)
            .zip(dlogits.chunks_mut(part))
            .zip(labels.chunks(part_rows))
            .zip(losses.chunks_mut(part_rows))
            .collect();
        self.run_parts(parts, |(((z, dz), labels), losses)| {
            softmax_cross_entropy_rows(classes, scale, z, dz, labels, losses);
        });
        Ok((losses.iter().sum::<f64>() / rows as f64) as f32)
    }

    fn argmax_rows(
        &self,
        classes: usize,
        logits: &[f32],
        predictions: &mut [u32],
    ) -> BackendResult {
        check(
            "argmax_rows",
            "logits",
            predictions.len() * classes,
            logits.len(),
        )?;
        for (row, p) in logits.chunks_exact(classes).zip(predictions.iter_mut()) {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] {
                    best = i;
                }
            }
            *p = best as u32;
        }
        Ok(())
    }

    fn sgd_update(
        &self,
        u: SgdUpdate,
        params: &mut [f32],
        grads: &[f32],
        velocity: &mut [f32],
    ) -> BackendResult {
        check("sgd_update", "grads", params.len(), grads.len())?;
        check("sgd_update", "velocity", params.len(), velocity.len())?;
        let chunk = self.chunk_len(params.len());
        let parts: Vec<_> = params
            .chunks_mut(chunk)
            .zip(grads.chunks(chunk))
            .zip(velocity.chunks_mut(chunk))
            .collect();
        self.run_parts(parts, |((params, grads), velocity)| {
            for ((p, &g), v) in params.iter_mut().zip(grads).zip(velocity.iter_mut()) {
                let d = g + u.weight_decay * *p;
                *v = u.momentum * *v + d;
                let step = if u.nesterov { d + u.momentum * *v } else { *v };
                *p -= u.lr * step;
            }
        });
        Ok(())
    }

    fn adamw_update(
        &self,
        u: AdamWUpdate,
        params: &mut [f32],
        grads: &[f32],
        first_moment: &mut [f32],
        second_moment: &mut [f32],
    ) -> BackendResult {
        check("adamw_update", "grads", params.len(), grads.len())?;
        check(
            "adamw_update",
            "first_moment",
            params.len(),
            first_moment.len(),
        )?;
        check(
            "adamw_update",
            "second_moment",
            params.len(),
            second_moment.len(),
        )?;
        let step = i32::try_from(u.step).unwrap_or(i32::MAX);
        let bias1 = 1.0 - u.beta1.powi(step);
        let bias2_sqrt = (1.0 - u.beta2.powi(step)).sqrt();
        let step_size = u.lr / bias1;
        let decay = 1.0 - u.lr * u.weight_decay;
        let chunk = self.chunk_len(params.len());
        let parts: Vec<_> = params
            .chunks_mut(chunk)
            .zip(grads.chunks(chunk))
            .zip(
                first_moment
                    .chunks_mut(chunk)
                    .zip(second_moment.chunks_mut(chunk)),
            )
            .collect();
        self.run_parts(parts, |((params, grads), (first, second))| {
            let moments = first.iter_mut().zip(second.iter_mut());
            for ((p, &g), (m, v)) in params.iter_mut().zip(grads).zip(moments) {
                *p *= decay;
                *m = u.beta1 * *m + (1.0 - u.beta1) * g;
                *v = u.beta2 * *v + (1.0 - u.beta2) * g * g;
                let denom = v.sqrt() / bias2_sqrt + u.eps;
                *p -= step_size * *m / denom;
            }
        });
        Ok(())
    }
}

/// Sum with eight independent accumulators, which the compiler can vectorise (a single
/// running sum cannot be reordered). The order is fixed, so the result is deterministic.
#[inline(always)] // into the kernels compiled for wider vectors (`multiversion`)
fn lane_sum(values: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let chunks = values.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (lane, v) in lanes.iter_mut().zip(chunk) {
            *lane += v;
        }
    }
    lanes.iter().sum::<f32>() + rest
}

/// Output positions `o` (of `out`) whose input position `o * stride + k - padding` falls
/// inside `0..size`: the part of a patch row that is not zero padding.
fn valid_outputs(out: usize, size: usize, k: usize, stride: usize, padding: usize) -> Range<usize> {
    let first = padding.saturating_sub(k).div_ceil(stride).min(out);
    let end = (size + padding).saturating_sub(k).div_ceil(stride).min(out);
    first..end.max(first)
}

/// Calls `f(row_offset, image, channel, kh, kw, columns)` for every (patch row, image) pair of an
/// im2col matrix, where `row_offset` is where that image's run of `columns` values starts.
fn for_each_patch_row(
    g: ConvGeometry,
    batch: usize,
    mut f: impl FnMut(usize, usize, usize, usize, usize, usize),
) {
    let columns = g.out_pixels();
    let row_len = batch * columns;
    for c in 0..g.channels {
        for kh in 0..g.kernel {
            for kw in 0..g.kernel {
                let row = (c * g.kernel + kh) * g.kernel + kw;
                for image in 0..batch {
                    f(row * row_len + image * columns, image, c, kh, kw, columns);
                }
            }
        }
    }
}

/// Softmax cross-entropy of whole rows of logits `z` whose labels are in range: each row's
/// loss into `losses`, and its gradient, scaled by `scale` (one over the batch's rows), into
/// `dz`.
fn softmax_cross_entropy_rows(
    classes: usize,
    scale: f32,
    z: &[f32],
    dz: &mut [f32],
    labels: &[u32],
    losses: &mut [f64],
) {
    for (((z, dz), &label), loss) in z
        .chunks_exact(classes)
        .zip(dz.chunks_exact_mut(classes))
        .zip(labels)
        .zip(losses)
    {
        let label = label as usize;
        let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (d, &v) in dz.iter_mut().zip(z) {
            *d = (v - max).exp();
            sum += *d;
        }
        *loss = f64::from(sum.ln() - (z[label] - max));
        let inv = scale / sum;
        for d in dz.iter_mut() {
            *d *= inv;
        }
        dz[label] -= scale;
    }
}

#[cfg(test)]
mod tests;
