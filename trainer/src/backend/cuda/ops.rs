//! The backend's operations on device memory: each checks its lengths on the host, then
//! queues a cuBLAS call or one of the kernels of `kernels.cu` on the backend's stream. The GEMMs
//! are in `ops/gemm.rs`, and a transformer's kernels (embeddings, the heads' layout, GELU,
//! LayerNorm, causal softmax) are launched from `ops/transformer.rs`.

use std::ops::Range;

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{
    BLOCK, CudaBackend, CudaBuffer, DeviceView, DeviceViewMut, MAX_BLOCKS, SUM_CHUNK, device_error,
};
use crate::backend::cpu::SUM_SQUARES_BLOCK;
use crate::backend::{
    AdamWUpdate, Backend, BackendError, BackendResult, CausalShape, ChannelLayout, ConvGeometry,
    Gemm, LayerNormShape, PoolGeometry, SgdUpdate, check,
};

/// `usize` to the `u64` the kernels take.
fn n(v: usize) -> u64 {
    v as u64
}

/// `usize` to the `int` cuBLAS takes.
fn blas_int(op: &'static str, v: usize) -> BackendResult<i32> {
    i32::try_from(v).map_err(|_| BackendError::Device {
        op,
        message: format!("dimension {v} is beyond cuBLAS's 32-bit range"),
    })
}

/// Launches `$kernel` over `$config` with the arguments given; the launch is unsafe because
/// the device cannot check the arguments, so every caller checks the lengths first.
macro_rules! launch {
    ($self:ident, $op:literal, $kernel:ident, $config:expr, [$($arg:expr),* $(,)?]) => {{
        #[allow(unsafe_code)]
        // SAFETY: the caller checked every view against the shape the kernel indexes with, and
        // the argument list matches the kernel's signature in kernels.cu (pointers, then u64
        // lengths, then f32 or int scalars, in order). One expression, so that the temporary
        // views live until the launch is queued.
        let launched = unsafe {
            $self
                .stream
                .launch_builder(&$self.kernels.$kernel)
                $( .arg($arg) )*
                .launch($config)
        };
        launched.map(|_| ()).map_err(device_error($op))
    }};
}

mod gemm;
mod transformer;

impl CudaBackend {
    /// `dbias[c]` = the sum over `o, i` of `dy[o, c, i]`: one block of [`BLOCK`] threads per
    /// channel (the kernel's shared array has that size).
    fn channel_sums(
        &self,
        layout: ChannelLayout,
        dy: &cudarc::driver::CudaView<'_, f32>,
        mut dbias: DeviceViewMut<'_>,
    ) -> BackendResult {
        let config = LaunchConfig {
            grid_dim: (blas_int("bias_grad", layout.channels)? as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            "bias_grad",
            bias_grad,
            config,
            [
                dy,
                &mut dbias.slice(),
                &n(layout.outer),
                &n(layout.channels),
                &n(layout.inner)
            ]
        )
    }
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type View<'a> = DeviceView<'a>;
    type ViewMut<'a> = DeviceViewMut<'a>;

    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn synchronize(&self) -> BackendResult {
        self.stream
            .synchronize()
            .map_err(device_error("synchronize"))
    }

    fn zeros(&self, len: usize) -> BackendResult<CudaBuffer> {
        Ok(CudaBuffer {
            values: self.scratch(len, "zeros")?,
            len,
        })
    }

    fn buffer_len(buffer: &CudaBuffer) -> usize {
        buffer.len
    }

    fn view(buffer: &CudaBuffer, range: Range<usize>) -> DeviceView<'_> {
        assert!(
            range.start <= range.end && range.end <= buffer.len,
            "view {range:?} out of bounds for a buffer of {}",
            buffer.len
        );
        DeviceView {
            buffer,
            start: range.start,
            len: range.len(),
        }
    }

    fn view_mut(buffer: &mut CudaBuffer, range: Range<usize>) -> DeviceViewMut<'_> {
        assert!(
            range.start <= range.end && range.end <= buffer.len,
            "view {range:?} out of bounds for a buffer of {}",
            buffer.len
        );
        DeviceViewMut {
            buffer,
            start: range.start,
            len: range.len(),
        }
    }

    fn reborrow_mut<'s, 'a: 's>(view: &'s mut DeviceViewMut<'a>) -> DeviceViewMut<'s> {
        DeviceViewMut {
            buffer: view.buffer,
            start: view.start,
            len: view.len,
        }
    }

    fn upload(&self, src: &[f32], mut dst: DeviceViewMut<'_>) -> BackendResult {
        check("upload", "dst", src.len(), dst.len)?;
        if src.is_empty() {
            return Ok(());
        }
        self.with_staging(src.len(), "upload", |staged| {
            staged.copy_from_slice(src);
            self.stream.memcpy_htod(&*staged, &mut dst.slice())
        })
    }

    fn download(&self, src: DeviceView<'_>, dst: &mut [f32]) -> BackendResult {
        check("download", "dst", src.len, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.with_staging(dst.len(), "download", |staged| {
            self.stream.memcpy_dtoh(&src.slice(), staged)?;
            self.stream.synchronize()?;
            dst.copy_from_slice(staged);
            Ok(())
        })
    }

    fn copy(&self, src: DeviceView<'_>, mut dst: DeviceViewMut<'_>) -> BackendResult {
        check("copy", "dst", src.len, dst.len)?;
        if src.len == 0 {
            return Ok(());
        }
        self.stream
            .memcpy_dtod(&src.slice(), &mut dst.slice())
            .map_err(device_error("copy"))
    }

    fn fill(&self, mut dst: DeviceViewMut<'_>, value: f32) -> BackendResult {
        let len = dst.len;
        if len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "fill",
            fill,
            Self::grid(len),
            [&mut dst.slice(), &value, &n(len)]
        )
    }

    fn axpy(&self, alpha: f32, x: DeviceView<'_>, mut y: DeviceViewMut<'_>) -> BackendResult {
        check("axpy", "y", x.len, y.len)?;
        let len = x.len;
        if len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "axpy",
            axpy,
            Self::grid(len),
            [&alpha, &x.slice(), &mut y.slice(), &n(len)]
        )
    }

    fn scale(&self, alpha: f32, mut y: DeviceViewMut<'_>) -> BackendResult {
        if y.len == 0 {
            return Ok(());
        }
        let len = y.len;
        launch!(
            self,
            "scale",
            scale,
            Self::grid(len),
            [&mut y.slice(), &alpha, &n(len)]
        )
    }

    fn sum_squares(&self, x: DeviceView<'_>) -> BackendResult<f64> {
        let op = "sum_squares";
        if x.len == 0 {
            return Ok(0.0);
        }
        let chunks = x.len.div_ceil(SUM_SQUARES_BLOCK);
        let mut sums = self.scratch::<f32>(chunks, op)?;
        launch!(
            self,
            "sum_squares",
            square_sums,
            Self::per_row(chunks),
            [&x.slice(), &mut sums, &n(x.len), &n(SUM_SQUARES_BLOCK)]
        )?;
        let mut host = vec![0.0f32; chunks];
        self.download_scratch(&sums, &mut host)?;
        Ok(host.iter().map(|&s| f64::from(s)).sum())
    }

    fn gemm(
        &self,
        g: Gemm,
        a: DeviceView<'_>,
        b: DeviceView<'_>,
        c: DeviceViewMut<'_>,
    ) -> BackendResult {
        gemm::gemm(self, g, a, b, c)
    }

    fn gemm_batched(
        &self,
        g: Gemm,
        count: usize,
        a: DeviceView<'_>,
        b: DeviceView<'_>,
        c: DeviceViewMut<'_>,
    ) -> BackendResult {
        gemm::gemm_batched(self, g, count, a, b, c)
    }

    fn add_bias(
        &self,
        layout: ChannelLayout,
        bias: DeviceView<'_>,
        mut y: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("add_bias", "bias", layout.channels, bias.len)?;
        check("add_bias", "y", layout.len(), y.len)?;
        if layout.is_empty() {
            return Ok(());
        }
        launch!(
            self,
            "add_bias",
            add_bias,
            Self::grid(layout.len()),
            [
                &bias.slice(),
                &mut y.slice(),
                &n(layout.channels),
                &n(layout.inner),
                &n(layout.len())
            ]
        )
    }

    fn bias_grad(
        &self,
        layout: ChannelLayout,
        dy: DeviceView<'_>,
        dbias: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("bias_grad", "dbias", layout.channels, dbias.len)?;
        check("bias_grad", "dy", layout.len(), dy.len)?;
        if layout.channels == 0 {
            return Ok(());
        }
        if layout.is_empty() {
            return self.fill(dbias, 0.0);
        }
        if layout.inner > SUM_CHUNK {
            // A block per channel would leave most of the GPU idle over a convolution's long
            // rows (the CNN spent a third of its step here): sum chunks of every row at once,
            // then the chunks' sums per channel.
            let rows = layout.outer * layout.channels;
            let chunks = layout.inner.div_ceil(SUM_CHUNK);
            let mut sums = self.scratch::<f32>(rows * chunks, "bias_grad")?;
            let config = LaunchConfig {
                grid_dim: (
                    blas_int("bias_grad", chunks)? as u32,
                    rows.min(MAX_BLOCKS as usize) as u32,
                    1,
                ),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                self,
                "bias_grad",
                chunk_sums,
                config,
                [
                    &dy.slice(),
                    &mut sums,
                    &n(rows),
                    &n(layout.inner),
                    &n(SUM_CHUNK)
                ]
            )?;
            let per_chunk = ChannelLayout {
                inner: chunks,
                ..layout
            };
            return self.channel_sums(per_chunk, &sums.slice(..rows * chunks), dbias);
        }
        self.channel_sums(layout, &dy.slice(), dbias)
    }

    fn relu(&self, x: DeviceView<'_>, mut y: DeviceViewMut<'_>) -> BackendResult {
        check("relu", "y", x.len, y.len)?;
        if x.len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "relu",
            relu,
            Self::grid(x.len),
            [&x.slice(), &mut y.slice(), &n(x.len)]
        )
    }

    fn relu_backward(
        &self,
        y: DeviceView<'_>,
        dy: DeviceView<'_>,
        mut dx: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("relu_backward", "dy", y.len, dy.len)?;
        check("relu_backward", "dx", y.len, dx.len)?;
        if y.len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "relu_backward",
            relu_backward,
            Self::grid(y.len),
            [&y.slice(), &dy.slice(), &mut dx.slice(), &n(y.len)]
        )
    }

    fn gelu(&self, x: DeviceView<'_>, y: DeviceViewMut<'_>) -> BackendResult {
        transformer::gelu(self, x, y)
    }

    fn gelu_backward(
        &self,
        x: DeviceView<'_>,
        dy: DeviceView<'_>,
        dx: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::gelu_backward(self, x, dy, dx)
    }

    fn causal_softmax(
        &self,
        shape: CausalShape,
        scale: f32,
        scores: DeviceView<'_>,
        probs: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::causal_softmax(self, shape, scale, scores, probs)
    }

    fn causal_softmax_backward(
        &self,
        shape: CausalShape,
        scale: f32,
        probs: DeviceView<'_>,
        dprobs: DeviceView<'_>,
        dscores: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::causal_softmax_backward(self, shape, scale, probs, dprobs, dscores)
    }

    fn layer_norm(
        &self,
        shape: LayerNormShape,
        x: DeviceView<'_>,
        gamma: DeviceView<'_>,
        beta: DeviceView<'_>,
        y: DeviceViewMut<'_>,
        stats: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::layer_norm(self, shape, x, gamma, beta, y, stats)
    }

    fn layer_norm_backward(
        &self,
        shape: LayerNormShape,
        x: DeviceView<'_>,
        gamma: DeviceView<'_>,
        stats: DeviceView<'_>,
        dy: DeviceView<'_>,
        dx: DeviceViewMut<'_>,
        dparams: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::layer_norm_backward(self, shape, x, gamma, stats, dy, dx, dparams)
    }

    fn im2col(
        &self,
        g: ConvGeometry,
        batch: usize,
        images: DeviceView<'_>,
        mut patches: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("im2col", "images", batch * g.image_len(), images.len)?;
        let total = g.patch_len() * batch * g.out_pixels();
        check("im2col", "patches", total, patches.len)?;
        if total == 0 {
            return Ok(());
        }
        launch!(
            self,
            "im2col",
            im2col,
            Self::grid(total),
            [
                &images.slice(),
                &mut patches.slice(),
                &n(batch),
                &n(g.channels),
                &n(g.height),
                &n(g.width),
                &n(g.kernel),
                &n(g.stride),
                &n(g.padding),
                &n(g.out_height()),
                &n(g.out_width())
            ]
        )
    }

    fn col2im(
        &self,
        g: ConvGeometry,
        batch: usize,
        patches: DeviceView<'_>,
        mut images: DeviceViewMut<'_>,
    ) -> BackendResult {
        let total = batch * g.image_len();
        check("col2im", "images", total, images.len)?;
        check(
            "col2im",
            "patches",
            g.patch_len() * batch * g.out_pixels(),
            patches.len,
        )?;
        if total == 0 {
            return Ok(());
        }
        launch!(
            self,
            "col2im",
            col2im,
            Self::grid(total),
            [
                &patches.slice(),
                &mut images.slice(),
                &n(batch),
                &n(g.channels),
                &n(g.height),
                &n(g.width),
                &n(g.kernel),
                &n(g.stride),
                &n(g.padding),
                &n(g.out_height()),
                &n(g.out_width())
            ]
        )
    }

    fn swap_outer_axes(
        &self,
        dims: [usize; 3],
        src: DeviceView<'_>,
        mut dst: DeviceViewMut<'_>,
    ) -> BackendResult {
        let [a, b, inner] = dims;
        check("swap_outer_axes", "src", a * b * inner, src.len)?;
        check("swap_outer_axes", "dst", a * b * inner, dst.len)?;
        if src.len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "swap_outer_axes",
            swap_outer_axes,
            Self::grid(src.len),
            [&src.slice(), &mut dst.slice(), &n(a), &n(b), &n(inner)]
        )
    }

    fn swap_middle_axes(
        &self,
        dims: [usize; 4],
        src: DeviceView<'_>,
        dst: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::swap_middle_axes(self, dims, src, dst)
    }

    fn embed(
        &self,
        width: usize,
        tokens: &[u32],
        table: DeviceView<'_>,
        y: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::embed(self, width, tokens, table, y)
    }

    fn embed_backward(
        &self,
        width: usize,
        tokens: &[u32],
        dy: DeviceView<'_>,
        dtable: DeviceViewMut<'_>,
    ) -> BackendResult {
        transformer::embed_backward(self, width, tokens, dy, dtable)
    }

    fn max_pool(
        &self,
        g: PoolGeometry,
        planes: usize,
        x: DeviceView<'_>,
        mut y: DeviceViewMut<'_>,
    ) -> BackendResult {
        let (oh, ow) = (g.out_height(), g.out_width());
        check("max_pool", "x", planes * g.height * g.width, x.len)?;
        check("max_pool", "y", planes * oh * ow, y.len)?;
        let outputs = y.len;
        if outputs == 0 {
            return Ok(());
        }
        launch!(
            self,
            "max_pool",
            max_pool,
            Self::grid(outputs),
            [
                &x.slice(),
                &mut y.slice(),
                &n(planes),
                &n(g.height),
                &n(g.width),
                &n(g.window),
                &n(oh),
                &n(ow)
            ]
        )
    }

    fn max_pool_backward(
        &self,
        g: PoolGeometry,
        planes: usize,
        x: DeviceView<'_>,
        y: DeviceView<'_>,
        dy: DeviceView<'_>,
        mut dx: DeviceViewMut<'_>,
    ) -> BackendResult {
        let (oh, ow) = (g.out_height(), g.out_width());
        check("max_pool_backward", "x", planes * g.height * g.width, x.len)?;
        check("max_pool_backward", "dx", x.len, dx.len)?;
        check("max_pool_backward", "y", planes * oh * ow, y.len)?;
        check("max_pool_backward", "dy", y.len, dy.len)?;
        self.fill(Self::reborrow_mut(&mut dx), 0.0)?;
        if y.len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "max_pool_backward",
            max_pool_backward,
            Self::grid(y.len),
            [
                &x.slice(),
                &y.slice(),
                &dy.slice(),
                &mut dx.slice(),
                &n(planes),
                &n(g.height),
                &n(g.width),
                &n(g.window),
                &n(oh),
                &n(ow)
            ]
        )
    }

    fn softmax_cross_entropy(
        &self,
        classes: usize,
        logits: DeviceView<'_>,
        labels: &[u32],
        mut dlogits: DeviceViewMut<'_>,
    ) -> BackendResult<f32> {
        let op = "softmax_cross_entropy";
        check(op, "logits", labels.len() * classes, logits.len)?;
        check(op, "dlogits", logits.len, dlogits.len)?;
        let rows = labels.len();
        if rows == 0 {
            return Ok(0.0);
        }
        if let Some(&label) = labels.iter().find(|&&l| l as usize >= classes) {
            return Err(BackendError::Label { op, label, classes });
        }
        let device_labels = self.upload_u32(labels)?;
        let mut losses = self.scratch::<f32>(rows, op)?;
        let scale = 1.0 / rows as f32;
        launch!(
            self,
            "softmax_cross_entropy",
            softmax_cross_entropy,
            Self::grid(rows),
            [
                &logits.slice(),
                &device_labels,
                &mut dlogits.slice(),
                &mut losses,
                &n(rows),
                &n(classes),
                &scale
            ]
        )?;
        let mut row_losses = vec![0.0f32; rows];
        self.download_scratch(&losses, &mut row_losses)?;
        // Summed in f64 in row order, as the CPU backend does.
        let total: f64 = row_losses.iter().map(|&l| f64::from(l)).sum();
        Ok((total / rows as f64) as f32)
    }

    fn argmax_rows(
        &self,
        classes: usize,
        logits: DeviceView<'_>,
        predictions: &mut [u32],
    ) -> BackendResult {
        check(
            "argmax_rows",
            "logits",
            predictions.len() * classes,
            logits.len,
        )?;
        let rows = predictions.len();
        if rows == 0 || classes == 0 {
            predictions.fill(0);
            return Ok(());
        }
        let mut found = self.scratch::<u32>(rows, "argmax_rows")?;
        launch!(
            self,
            "argmax_rows",
            argmax_rows,
            Self::grid(rows),
            [&logits.slice(), &mut found, &n(rows), &n(classes)]
        )?;
        self.download_scratch(&found, predictions)
    }

    fn sgd_update(
        &self,
        u: SgdUpdate,
        mut params: DeviceViewMut<'_>,
        grads: DeviceView<'_>,
        mut velocity: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("sgd_update", "grads", params.len, grads.len)?;
        check("sgd_update", "velocity", params.len, velocity.len)?;
        let len = params.len;
        if len == 0 {
            return Ok(());
        }
        launch!(
            self,
            "sgd_update",
            sgd_update,
            Self::grid(len),
            [
                &mut params.slice(),
                &grads.slice(),
                &mut velocity.slice(),
                &n(len),
                &u.lr,
                &u.momentum,
                &i32::from(u.nesterov),
                &u.weight_decay
            ]
        )
    }

    fn adamw_update(
        &self,
        u: AdamWUpdate,
        mut params: DeviceViewMut<'_>,
        grads: DeviceView<'_>,
        mut first_moment: DeviceViewMut<'_>,
        mut second_moment: DeviceViewMut<'_>,
    ) -> BackendResult {
        check("adamw_update", "grads", params.len, grads.len)?;
        check("adamw_update", "first_moment", params.len, first_moment.len)?;
        check(
            "adamw_update",
            "second_moment",
            params.len,
            second_moment.len,
        )?;
        let len = params.len;
        if len == 0 {
            return Ok(());
        }
        // The scalars exactly as the CPU backend forms them.
        let step = i32::try_from(u.step).unwrap_or(i32::MAX);
        let bias1 = 1.0 - u.beta1.powi(step);
        let bias2_sqrt = (1.0 - u.beta2.powi(step)).sqrt();
        let step_size = u.lr / bias1;
        let decay = 1.0 - u.lr * u.weight_decay;
        launch!(
            self,
            "adamw_update",
            adamw_update,
            Self::grid(len),
            [
                &mut params.slice(),
                &grads.slice(),
                &mut first_moment.slice(),
                &mut second_moment.slice(),
                &n(len),
                &u.beta1,
                &u.beta2,
                &u.eps,
                &step_size,
                &decay,
                &bias2_sqrt
            ]
        )
    }
}
