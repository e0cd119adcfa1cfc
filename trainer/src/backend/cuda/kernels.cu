// Elementwise and layout kernels of the CUDA backend, compiled at run time with NVRTC.
//
// Each kernel mirrors one method of the CPU backend (trainer/src/backend/cpu.rs) and sums in
// the same order where the CPU does, so that the two agree to rounding. Every kernel walks its
// index space with a grid-stride loop, so any grid size covers any length.

typedef unsigned long long u64;

// NVRTC has no math.h, so no INFINITY.
#define NEG_INFINITY __int_as_float(0xff800000)

#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

extern "C" __global__ void fill(float *y, float value, u64 n) {
    FOR_EACH(i, n) { y[i] = value; }
}

extern "C" __global__ void axpy(float alpha, const float *x, float *y, u64 n) {
    FOR_EACH(i, n) { y[i] += alpha * x[i]; }
}

// y[o, c, i] += bias[c]
extern "C" __global__ void add_bias(const float *bias, float *y, u64 channels, u64 inner, u64 n) {
    FOR_EACH(i, n) { y[i] += bias[(i / inner) % channels]; }
}

// sums[r, k] = the sum of x[r, k * chunk ..][..chunk], for gridDim.x chunks a row: a block per
// chunk, in a fixed tree order. The first pass of a bias gradient over long rows (a
// convolution's channel spans a whole batch of feature maps), so that every part of every row
// is summed at once rather than a channel per block.
extern "C" __global__ void chunk_sums(const float *x, float *sums, u64 rows, u64 len, u64 chunk) {
    __shared__ float partial[256];
    u64 k = blockIdx.x;
    u64 begin = k * chunk;
    u64 end = begin + chunk < len ? begin + chunk : len;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        float sum = 0.0f;
        for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) sum += x[r * len + i];
        partial[threadIdx.x] = sum;
        __syncthreads();
        for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
            if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
            __syncthreads();
        }
        if (threadIdx.x == 0) sums[r * gridDim.x + k] = partial[0];
        __syncthreads();
    }
}

// dbias[c] = sum over o, i of dy[o, c, i]: one block per channel, a fixed tree order.
extern "C" __global__ void bias_grad(const float *dy, float *dbias, u64 outer, u64 channels, u64 inner) {
    __shared__ float partial[256];
    u64 c = blockIdx.x;
    u64 count = outer * inner;
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < count; j += blockDim.x) {
        u64 o = j / inner, i = j % inner;
        sum += dy[(o * channels + c) * inner + i];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) dbias[c] = partial[0];
}

extern "C" __global__ void relu(const float *x, float *y, u64 n) {
    FOR_EACH(i, n) { y[i] = fmaxf(x[i], 0.0f); }
}

extern "C" __global__ void relu_backward(const float *y, const float *dy, float *dx, u64 n) {
    FOR_EACH(i, n) { dx[i] = y[i] > 0.0f ? dy[i] : 0.0f; }
}

// patches[(c, kh, kw), image, oh, ow] = images[image, c, oh * stride + kh - padding, ...], or
// zero in the padding.
// The GELU in its tanh form, as the CPU's (cpu/transformer.rs).
#define SQRT_2_OVER_PI 0.7978846f
#define GELU_CUBIC 0.044715f

extern "C" __global__ void gelu(const float *x, float *y, u64 n) {
    FOR_EACH(i, n) {
        float v = x[i];
        float u = SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v * v);
        y[i] = 0.5f * v * (1.0f + tanhf(u));
    }
}

extern "C" __global__ void gelu_backward(const float *x, const float *dy, float *dx, u64 n) {
    FOR_EACH(i, n) {
        float v = x[i], v2 = v * v;
        float t = tanhf(SQRT_2_OVER_PI * (v + GELU_CUBIC * v * v2));
        float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_CUBIC * v2);
        dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
}

// The sum of every thread's `value` over a block of 256 threads, in a fixed tree order, handed
// to all of them. Every thread of the block must call it.
__device__ float block_sum(float *partial, float value) {
    partial[threadIdx.x] = value;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    float total = partial[0];
    __syncthreads();
    return total;
}

// LayerNorm of each row of x [rows, cols]: a block of 256 threads per row. stats[r] holds the
// row's mean and 1 / sqrt(var + eps).
extern "C" __global__ void layer_norm(const float *x, const float *gamma, const float *beta, float *y,
                                      float *stats, u64 rows, u64 cols, float eps) {
    __shared__ float partial[256];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *xr = x + r * cols;
        float sum = 0.0f;
        for (u64 i = threadIdx.x; i < cols; i += blockDim.x) sum += xr[i];
        float mean = block_sum(partial, sum) / (float)cols;
        float squares = 0.0f;
        for (u64 i = threadIdx.x; i < cols; i += blockDim.x) squares += (xr[i] - mean) * (xr[i] - mean);
        float rstd = 1.0f / sqrtf(block_sum(partial, squares) / (float)cols + eps);
        for (u64 i = threadIdx.x; i < cols; i += blockDim.x)
            y[r * cols + i] = (xr[i] - mean) * rstd * gamma[i] + beta[i];
        if (threadIdx.x == 0) {
            stats[2 * r] = mean;
            stats[2 * r + 1] = rstd;
        }
    }
}

// dx of a LayerNorm: dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma; a block per row.
extern "C" __global__ void layer_norm_backward(const float *x, const float *gamma, const float *stats,
                                               const float *dy, float *dx, u64 rows, u64 cols) {
    __shared__ float partial[256];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float mean = stats[2 * r], rstd = stats[2 * r + 1];
        float sum_g = 0.0f, sum_g_xhat = 0.0f;
        for (u64 i = threadIdx.x; i < cols; i += blockDim.x) {
            float g = dy[r * cols + i] * gamma[i];
            sum_g += g;
            sum_g_xhat += g * (x[r * cols + i] - mean) * rstd;
        }
        float mean_g = block_sum(partial, sum_g) / (float)cols;
        float mean_g_xhat = block_sum(partial, sum_g_xhat) / (float)cols;
        for (u64 i = threadIdx.x; i < cols; i += blockDim.x) {
            float xhat = (x[r * cols + i] - mean) * rstd;
            dx[r * cols + i] = rstd * (dy[r * cols + i] * gamma[i] - mean_g - xhat * mean_g_xhat);
        }
    }
}

// dgamma then dbeta of a LayerNorm, side by side in dparams: a thread per column sums over the
// rows in order, as the CPU.
extern "C" __global__ void layer_norm_param_grads(const float *x, const float *stats, const float *dy,
                                                  float *dparams, u64 rows, u64 cols) {
    FOR_EACH(i, cols) {
        float dg = 0.0f, db = 0.0f;
        for (u64 r = 0; r < rows; r++) {
            float d = dy[r * cols + i];
            dg += d * (x[r * cols + i] - stats[2 * r]) * stats[2 * r + 1];
            db += d;
        }
        dparams[i] = dg;
        dparams[cols + i] = db;
    }
}

// The largest of every thread's `value` over a block of 256 threads, handed to all of them.
__device__ float block_max(float *partial, float value) {
    partial[threadIdx.x] = value;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) partial[threadIdx.x] = fmaxf(partial[threadIdx.x], partial[threadIdx.x + half]);
        __syncthreads();
    }
    float total = partial[0];
    __syncthreads();
    return total;
}

// Softmax of scale * scores over columns 0..=t of each row t of `matrices` [len, len] matrices
// (rows = matrices * len), 0 beyond: a block per row.
extern "C" __global__ void causal_softmax(const float *scores, float *probs, u64 rows, u64 len, float scale) {
    __shared__ float partial[256];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        u64 seen = r % len + 1;
        const float *x = scores + r * len;
        float *p = probs + r * len;
        float max = NEG_INFINITY;
        for (u64 i = threadIdx.x; i < seen; i += blockDim.x) max = fmaxf(max, scale * x[i]);
        max = block_max(partial, max);
        float sum = 0.0f;
        for (u64 i = threadIdx.x; i < seen; i += blockDim.x) {
            float e = expf(scale * x[i] - max);
            p[i] = e;
            sum += e;
        }
        sum = block_sum(partial, sum);
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) p[i] = i < seen ? p[i] / sum : 0.0f;
    }
}

// dscores = scale * probs * (dprobs - the row's sum of dprobs * probs): a block per row.
extern "C" __global__ void causal_softmax_backward(const float *probs, const float *dprobs, float *dscores,
                                                   u64 rows, u64 len, float scale) {
    __shared__ float partial[256];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float *p = probs + r * len, *dp = dprobs + r * len;
        float dot = 0.0f;
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) dot += dp[i] * p[i];
        dot = block_sum(partial, dot);
        for (u64 i = threadIdx.x; i < len; i += blockDim.x) dscores[r * len + i] = scale * p[i] * (dp[i] - dot);
    }
}

extern "C" __global__ void scale(float *y, float alpha, u64 n) {
    FOR_EACH(i, n) { y[i] *= alpha; }
}

// sums[b] = the sum of the squares of x[b * chunk ..][..chunk]: a block of 256 threads per chunk.
extern "C" __global__ void square_sums(const float *x, float *sums, u64 n, u64 chunk) {
    __shared__ float partial[256];
    for (u64 b = blockIdx.x; b * chunk < n; b += gridDim.x) {
        u64 begin = b * chunk, end = begin + chunk < n ? begin + chunk : n;
        float sum = 0.0f;
        for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) sum += x[i] * x[i];
        sum = block_sum(partial, sum);
        if (threadIdx.x == 0) sums[b] = sum;
    }
}

extern "C" __global__ void im2col(const float *images, float *patches, u64 batch, u64 channels,
                                  u64 height, u64 width, u64 kernel, u64 stride, u64 padding,
                                  u64 out_h, u64 out_w) {
    u64 pixels = out_h * out_w;
    u64 n = channels * kernel * kernel * batch * pixels;
    FOR_EACH(idx, n) {
        u64 ow = idx % out_w;
        u64 oh = (idx / out_w) % out_h;
        u64 image = (idx / pixels) % batch;
        u64 row = idx / (pixels * batch);
        u64 kw = row % kernel, kh = (row / kernel) % kernel, c = row / (kernel * kernel);
        long long h = (long long)(oh * stride + kh) - (long long)padding;
        long long w = (long long)(ow * stride + kw) - (long long)padding;
        float v = 0.0f;
        if (h >= 0 && h < (long long)height && w >= 0 && w < (long long)width) {
            v = images[((image * channels + c) * height + h) * width + w];
        }
        patches[idx] = v;
    }
}

// The adjoint of im2col, gathered per image value so that no two threads write one value; the
// contributions are added in the CPU's order (kh, then kw).
extern "C" __global__ void col2im(const float *patches, float *images, u64 batch, u64 channels,
                                  u64 height, u64 width, u64 kernel, u64 stride, u64 padding,
                                  u64 out_h, u64 out_w) {
    u64 pixels = out_h * out_w;
    u64 n = batch * channels * height * width;
    FOR_EACH(idx, n) {
        u64 w = idx % width;
        u64 h = (idx / width) % height;
        u64 c = (idx / (width * height)) % channels;
        u64 image = idx / (width * height * channels);
        float sum = 0.0f;
        for (u64 kh = 0; kh < kernel; kh++) {
            long long th = (long long)(h + padding) - (long long)kh;
            if (th < 0 || th % (long long)stride != 0) continue;
            u64 oh = (u64)th / stride;
            if (oh >= out_h) continue;
            for (u64 kw = 0; kw < kernel; kw++) {
                long long tw = (long long)(w + padding) - (long long)kw;
                if (tw < 0 || tw % (long long)stride != 0) continue;
                u64 ow = (u64)tw / stride;
                if (ow >= out_w) continue;
                u64 row = (c * kernel + kh) * kernel + kw;
                sum += patches[(row * batch + image) * pixels + oh * out_w + ow];
            }
        }
        images[idx] = sum;
    }
}

// dst[b, a, inner] = src[a, b, inner]
extern "C" __global__ void swap_outer_axes(const float *src, float *dst, u64 a, u64 b, u64 inner) {
    u64 n = a * b * inner;
    FOR_EACH(idx, n) {
        u64 k = idx % inner;
        u64 j = (idx / inner) % b;
        u64 i = idx / (inner * b);
        dst[(j * a + i) * inner + k] = src[idx];
    }
}

// dst[a, c, b, inner] = src[a, b, c, inner]
extern "C" __global__ void swap_middle_axes(const float *src, float *dst, u64 a, u64 b, u64 c, u64 inner) {
    u64 n = a * b * c * inner;
    FOR_EACH(idx, n) {
        u64 k = idx % inner;
        u64 ci = (idx / inner) % c;
        u64 bi = (idx / (inner * c)) % b;
        u64 ai = idx / (inner * c * b);
        dst[((ai * c + ci) * b + bi) * inner + k] = src[idx];
    }
}

// y[n, i] = table[tokens[n], i]
extern "C" __global__ void embed(const float *table, const unsigned *tokens, float *y, u64 count, u64 width) {
    FOR_EACH(idx, count * width) { y[idx] = table[(u64)tokens[idx / width] * width + idx % width]; }
}

// dtable[v, i] += dy[n, i] for every n with tokens[n] == v, in order of n as the CPU: a thread
// per table value, so no two threads add to one value and the sums are deterministic.
extern "C" __global__ void embed_backward(const unsigned *tokens, const float *dy, float *dtable, u64 count,
                                          u64 rows, u64 width) {
    FOR_EACH(idx, rows * width) {
        u64 v = idx / width, i = idx % width;
        float sum = dtable[idx];
        for (u64 n = 0; n < count; n++)
            if (tokens[n] == v) sum += dy[n * width + i];
        dtable[idx] = sum;
    }
}

extern "C" __global__ void max_pool(const float *x, float *y, u64 planes, u64 height, u64 width,
                                    u64 window, u64 out_h, u64 out_w) {
    u64 n = planes * out_h * out_w;
    FOR_EACH(idx, n) {
        u64 j = idx % out_w;
        u64 i = (idx / out_w) % out_h;
        u64 plane = idx / (out_w * out_h);
        const float *p = x + plane * height * width;
        float best = NEG_INFINITY;
        for (u64 di = 0; di < window; di++) {
            for (u64 dj = 0; dj < window; dj++) {
                best = fmaxf(best, p[(i * window + di) * width + j * window + dj]);
            }
        }
        y[idx] = best;
    }
}

// The first input of each window that equals its maximum gets the gradient (dx is zeroed
// first; windows do not overlap, so no two threads write one value).
extern "C" __global__ void max_pool_backward(const float *x, const float *y, const float *dy, float *dx,
                                             u64 planes, u64 height, u64 width, u64 window,
                                             u64 out_h, u64 out_w) {
    u64 n = planes * out_h * out_w;
    FOR_EACH(idx, n) {
        u64 j = idx % out_w;
        u64 i = (idx / out_w) % out_h;
        u64 plane = idx / (out_w * out_h);
        u64 base = plane * height * width;
        float max = y[idx];
        bool done = false;
        for (u64 di = 0; di < window && !done; di++) {
            for (u64 dj = 0; dj < window; dj++) {
                u64 at = base + (i * window + di) * width + j * window + dj;
                if (x[at] == max) {
                    dx[at] += dy[idx];
                    done = true;
                    break;
                }
            }
        }
    }
}

// One thread per row: the softmax gradient of the mean loss into dlogits, the row's loss into
// losses (summed on the host in f64, as the CPU does).
extern "C" __global__ void softmax_cross_entropy(const float *logits, const unsigned *labels,
                                                 float *dlogits, float *losses, u64 rows,
                                                 u64 classes, float scale) {
    FOR_EACH(r, rows) {
        const float *z = logits + r * classes;
        float *dz = dlogits + r * classes;
        unsigned label = labels[r];
        float max = NEG_INFINITY;
        for (u64 k = 0; k < classes; k++) max = fmaxf(max, z[k]);
        float sum = 0.0f;
        for (u64 k = 0; k < classes; k++) {
            dz[k] = expf(z[k] - max);
            sum += dz[k];
        }
        losses[r] = logf(sum) - (z[label] - max);
        float inv = scale / sum;
        for (u64 k = 0; k < classes; k++) dz[k] *= inv;
        dz[label] -= scale;
    }
}

extern "C" __global__ void argmax_rows(const float *logits, unsigned *predictions, u64 rows, u64 classes) {
    FOR_EACH(r, rows) {
        const float *z = logits + r * classes;
        unsigned best = 0;
        for (u64 k = 1; k < classes; k++) {
            if (z[k] > z[best]) best = (unsigned)k;
        }
        predictions[r] = best;
    }
}

extern "C" __global__ void sgd_update(float *params, const float *grads, float *velocity, u64 n,
                                      float lr, float momentum, int nesterov, float weight_decay) {
    FOR_EACH(i, n) {
        float p = params[i];
        float d = grads[i] + weight_decay * p;
        float v = momentum * velocity[i] + d;
        velocity[i] = v;
        float step = nesterov ? d + momentum * v : v;
        params[i] = p - lr * step;
    }
}

extern "C" __global__ void adamw_update(float *params, const float *grads, float *first, float *second,
                                        u64 n, float beta1, float beta2, float eps, float step_size,
                                        float decay, float bias2_sqrt) {
    FOR_EACH(i, n) {
        float g = grads[i];
        float p = params[i] * decay;
        float m = beta1 * first[i] + (1.0f - beta1) * g;
        float v = beta2 * second[i] + (1.0f - beta2) * g * g;
        first[i] = m;
        second[i] = v;
        float denom = sqrtf(v) / bias2_sqrt + eps;
        params[i] = p - step_size * m / denom;
    }
}
