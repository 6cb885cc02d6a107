// Kernels of the CUDA device's ops (models/src/cuda/device.rs, `Op` of models/src/ops),
// compiled at run time by NVRTC. f32 storage; reductions accumulate in f64 and combine in a
// fixed order, so a result depends only on the inputs (except the embedding backward, whose
// scatter-add uses float atomics). Every kernel bounds its indices by the sizes it is given
// (64-bit index math); the caller checked the buffers against those sizes (Op::check_lens).
// Elementwise kernels are grid-stride loops; row kernels take rows in a block-stride loop,
// so a grid of any size covers them.
//
// Block size: 256 threads (OPS_BLOCK) for the 1-D kernels, (32, 8) for the column kernels.

#define OPS_BLOCK 256
#define COL_X 32
#define COL_Y 8

typedef unsigned long long u64;

// The block's sum of `v`, returned to every thread. `sh` holds OPS_BLOCK doubles; the tree
// is fixed, so the result depends only on the values.
__device__ double block_sum(double v, double* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int w = OPS_BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
        __syncthreads();
    }
    double t = sh[0];
    __syncthreads();
    return t;
}

// The block's maximum of `v`, returned to every thread (NaN-ignoring, as fmaxf).
__device__ float block_max(float v, float* sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned int w = OPS_BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + w]);
        __syncthreads();
    }
    float t = sh[0];
    __syncthreads();
    return t;
}

#define GRID_STRIDE(i, n)                                                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (u64)gridDim.x * blockDim.x)

extern "C" __global__ void fill_f32(float* x, float value, u64 n) {
    GRID_STRIDE(i, n) { x[i] = value; }
}

// y = max(x, 0) (fmaxf(NaN, 0) = 0, as Rust's f32::max).
extern "C" __global__ void relu_out_f32(const float* x, float* y, u64 n) {
    GRID_STRIDE(i, n) { y[i] = fmaxf(x[i], 0.0f); }
}

// dx = dy where y > 0, else 0 (a NaN y gives 0, as the host's comparison).
extern "C" __global__ void relu_bwd_f32(const float* y, const float* dy, float* dx, u64 n) {
    GRID_STRIDE(i, n) { dx[i] = y[i] > 0.0f ? dy[i] : 0.0f; }
}

// The activations of models/src/nn/activation.rs (ACTIV-1..3), kind 0: exact GELU,
// 1: GELU's tanh form, 2: SiLU. Same formulas, same order of operations, in f32.
#define INV_SQRT_2 0.70710678118654752440f
#define INV_SQRT_2PI 0.39894228040143267794f
#define TANH_BETA 0.79788456080286535588f
#define TANH_KAPPA 0.044715f
// 3 * 0.044715 rounded once, as the host's literal.
#define TANH_3KAPPA 0.134145f

__device__ float act_value(int kind, float x) {
    if (kind == 0) return 0.5f * x * (1.0f + erff(x * INV_SQRT_2));
    if (kind == 1) {
        float inner = TANH_BETA * (x + TANH_KAPPA * x * x * x);
        return 0.5f * x * (1.0f + tanhf(inner));
    }
    return x * (1.0f / (1.0f + expf(-x)));
}

__device__ float act_derivative(int kind, float x) {
    if (kind == 0) {
        float cdf = 0.5f * (1.0f + erff(x * INV_SQRT_2));
        return cdf + x * expf(-0.5f * x * x) * INV_SQRT_2PI;
    }
    if (kind == 1) {
        float inner = TANH_BETA * (x + TANH_KAPPA * x * x * x);
        float t = tanhf(inner);
        float sech2 = 1.0f - t * t;
        float left = 0.5f * x;
        // Where tanh has saturated the cubic's slope may be inf: 0 (ACTIV-4).
        float right = 0.0f;
        if (sech2 != 0.0f) {
            float slope = TANH_BETA * (1.0f + TANH_3KAPPA * x * x);
            right = left * sech2 * slope;
        }
        return 0.5f * (1.0f + t) + right;
    }
    float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
}

extern "C" __global__ void act_fwd_f32(const float* x, float* y, int kind, u64 n) {
    GRID_STRIDE(i, n) { y[i] = act_value(kind, x[i]); }
}

extern "C" __global__ void act_bwd_f32(const float* x, const float* dy, float* dx, int kind,
                                       u64 n) {
    GRID_STRIDE(i, n) { dx[i] = dy[i] * act_derivative(kind, x[i]); }
}

// The activation module's forward that saves the derivative instead of the input (ACTIV-5):
// y = f(x), d = f'(x), the two formulas above.
extern "C" __global__ void act_fwd_deriv_f32(const float* x, float* y, float* d, int kind,
                                             u64 n) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        y[i] = act_value(kind, v);
        d[i] = act_derivative(kind, v);
    }
}

// c = a + b (a residual connection and its gradient).
extern "C" __global__ void add_f32(const float* a, const float* b, float* c, u64 n) {
    GRID_STRIDE(i, n) { c[i] = a[i] + b[i]; }
}

// c = a * b (an activation's input gradient from its saved derivative).
extern "C" __global__ void mul_f32(const float* a, const float* b, float* c, u64 n) {
    GRID_STRIDE(i, n) { c[i] = a[i] * b[i]; }
}

// Every row of y [rows, cols] = params[offset .. offset + cols] (a linear layer's bias, which
// the product is then added onto).
extern "C" __global__ void bias_rows_f32(const float* params, u64 offset, float* y, u64 rows,
                                         u64 cols) {
    GRID_STRIDE(i, rows * cols) { y[i] = params[offset + i % cols]; }
}

// out[offset + c] += sum over rows of dy[r, c], dy [rows, cols] (a linear layer's bias
// gradient). Block (COL_X, COL_Y): COL_X columns, COL_Y row strides, f64 partial sums
// combined in a fixed order.
extern "C" __global__ void col_sums_add_f32(const float* dy, float* out, u64 offset, u64 rows,
                                            u64 cols) {
    __shared__ double sh[COL_Y][COL_X];
    u64 c = (u64)blockIdx.x * COL_X + threadIdx.x;
    double s = 0.0;
    if (c < cols) {
        for (u64 r = threadIdx.y; r < rows; r += COL_Y) s += (double)dy[r * cols + c];
    }
    sh[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        double t = 0.0;
        for (int k = 0; k < COL_Y; k++) t += sh[k][threadIdx.x];
        out[offset + c] += (float)t;
    }
}

// LayerNorm forward (NORM-1, NORM-3), one block per row: mean, then the biased variance of
// the deviations (two passes, as the host), rstd = 1 / sqrt(var + eps);
// y = (x - mean) * rstd * weight (+ bias). params: weight [dim], then bias [dim] when
// has_bias.
extern "C" __global__ void ln_fwd_f32(const float* params, const float* x, float* y,
                                      float* mean_out, float* rstd_out, u64 rows, u64 dim,
                                      int has_bias, float eps) {
    __shared__ double sh[OPS_BLOCK];
    const float* gain = params;
    const float* bias = params + dim;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * dim;
        float* yr = y + r * dim;
        double s = 0.0;
        for (u64 j = threadIdx.x; j < dim; j += OPS_BLOCK) s += (double)xr[j];
        float mean = (float)(block_sum(s, sh) / (double)dim);
        double v = 0.0;
        for (u64 j = threadIdx.x; j < dim; j += OPS_BLOCK) {
            double d = (double)(xr[j] - mean);
            v += d * d;
        }
        float var = (float)(block_sum(v, sh) / (double)dim);
        float rstd = 1.0f / sqrtf(var + eps);
        for (u64 j = threadIdx.x; j < dim; j += OPS_BLOCK) {
            float o = (xr[j] - mean) * rstd * gain[j];
            if (has_bias) o = o + bias[j];
            yr[j] = o;
        }
        if (threadIdx.x == 0) {
            mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
    }
}

// LayerNorm input gradient, one block per row:
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * weight, xhat from the saved
// mean and rstd.
extern "C" __global__ void ln_bwd_dx_f32(const float* params, const float* x,
                                         const float* mean_in, const float* rstd_in,
                                         const float* dy, float* dx, u64 rows, u64 dim) {
    __shared__ double sh[OPS_BLOCK];
    const float* gain = params;
    float inv_d = 1.0f / (float)dim;
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * dim;
        const float* dyr = dy + r * dim;
        float* dxr = dx + r * dim;
        float mean = mean_in[r], rstd = rstd_in[r];
        double sg = 0.0, sgx = 0.0;
        for (u64 j = threadIdx.x; j < dim; j += OPS_BLOCK) {
            float xhat = (xr[j] - mean) * rstd;
            float g = dyr[j] * gain[j];
            sg += (double)g;
            sgx += (double)(g * xhat);
        }
        float mean_g = (float)block_sum(sg, sh) * inv_d;
        float mean_gx = (float)block_sum(sgx, sh) * inv_d;
        for (u64 j = threadIdx.x; j < dim; j += OPS_BLOCK) {
            float xhat = (xr[j] - mean) * rstd;
            dxr[j] = rstd * (dyr[j] * gain[j] - mean_g - xhat * mean_gx);
        }
    }
}

// LayerNorm parameter gradients, per column (deterministic, no atomics):
// grads[c] += sum_rows dy * xhat, and grads[dim + c] += sum_rows dy when has_bias.
extern "C" __global__ void ln_bwd_params_f32(const float* x, const float* mean_in,
                                             const float* rstd_in, const float* dy,
                                             float* grads, u64 rows, u64 dim, int has_bias) {
    __shared__ double sw[COL_Y][COL_X];
    __shared__ double sb[COL_Y][COL_X];
    u64 c = (u64)blockIdx.x * COL_X + threadIdx.x;
    double a = 0.0, b = 0.0;
    if (c < dim) {
        for (u64 r = threadIdx.y; r < rows; r += COL_Y) {
            u64 at = r * dim + c;
            float xhat = (x[at] - mean_in[r]) * rstd_in[r];
            a += (double)(dy[at] * xhat);
            b += (double)dy[at];
        }
    }
    sw[threadIdx.y][threadIdx.x] = a;
    sb[threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && c < dim) {
        double ta = 0.0, tb = 0.0;
        for (int k = 0; k < COL_Y; k++) {
            ta += sw[k][threadIdx.x];
            tb += sb[k][threadIdx.x];
        }
        grads[c] += (float)ta;
        if (has_bias) grads[dim + c] += (float)tb;
    }
}

// Cross-entropy per row (XENT-1, LOSS-1), one block per row: lse = max + log(sum
// exp(v - max)), row_loss[r] = lse - logits[r, t], dlogits = scale * (exp(v - lse) -
// onehot(t)) with scale = dloss / rows (Op::CrossEntropy) or 1 / global
// (Op::SoftmaxCrossEntropy). Targets travel as u32 bits. A target >= vocab (which the host
// refuses, XENT-2) gives a NaN row loss, so the mean loss shows it, and a zero gradient row;
// nothing is read out of the row.
extern "C" __global__ void xent_rows_f32(const float* logits, const float* targets,
                                         float* dlogits, float* row_loss, u64 rows, u64 vocab,
                                         float scale) {
    __shared__ double sh[OPS_BLOCK];
    __shared__ float shf[OPS_BLOCK];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* row = logits + r * vocab;
        float* drow = dlogits + r * vocab;
        unsigned int t = __float_as_uint(targets[r]);
        float mx = __uint_as_float(0xff800000u);  // -inf
        for (u64 j = threadIdx.x; j < vocab; j += OPS_BLOCK) mx = fmaxf(mx, row[j]);
        mx = block_max(mx, shf);
        double s = 0.0;
        for (u64 j = threadIdx.x; j < vocab; j += OPS_BLOCK) s += (double)expf(row[j] - mx);
        float lse = mx + (float)log(block_sum(s, sh));
        bool valid = (u64)t < vocab;
        for (u64 j = threadIdx.x; j < vocab; j += OPS_BLOCK) {
            float p = expf(row[j] - lse);
            float onehot = (j == (u64)t) ? 1.0f : 0.0f;
            drow[j] = valid ? scale * (p - onehot) : 0.0f;
        }
        if (threadIdx.x == 0) {
            row_loss[r] = valid ? lse - row[t] : __uint_as_float(0x7fc00000u);  // NaN
        }
    }
}

// loss[0] = (sum of the row losses / div) * mul, the sum in f64, one block, a fixed order (0
// for div 0, which only no row has). Op::CrossEntropy: div = rows, mul = dloss (the mean,
// scaled); Op::SoftmaxCrossEntropy: div = the global rows, mul = 1 (LOSS-1's share).
extern "C" __global__ void xent_loss_f32(const float* row_loss, float* loss, u64 rows,
                                         double div, float mul) {
    __shared__ double sh[OPS_BLOCK];
    double s = 0.0;
    for (u64 r = threadIdx.x; r < rows; r += OPS_BLOCK) s += (double)row_loss[r];
    double total = block_sum(s, sh);
    if (threadIdx.x == 0) {
        float share = div == 0.0 ? 0.0f : (float)(total / div);
        loss[0] = share * mul;
    }
}

// out [n, dim]: row i = table row ids[i] (EMB-1, ids as u32 bits). An id >= vocab (which the
// host refuses, EMB-3) reads nothing and writes a zero row.
extern "C" __global__ void emb_fwd_f32(const float* table, const float* ids, float* out, u64 n,
                                       u64 dim, u64 vocab) {
    GRID_STRIDE(i, n * dim) {
        u64 row = i / dim, j = i % dim;
        u64 id = (u64)__float_as_uint(ids[row]);
        out[i] = id < vocab ? table[id * dim + j] : 0.0f;
    }
}

// grads [vocab, dim]: row ids[i] += dy row i (EMB-2), float atomics for repeated ids. An id
// >= vocab adds nothing.
extern "C" __global__ void emb_bwd_f32(const float* ids, const float* dy, float* grads, u64 n,
                                       u64 dim, u64 vocab) {
    GRID_STRIDE(i, n * dim) {
        u64 row = i / dim, j = i % dim;
        u64 id = (u64)__float_as_uint(ids[row]);
        if (id < vocab) atomicAdd(&grads[id * dim + j], dy[i]);
    }
}

// Sum of squares, first pass: block b's f64 partial sum into partial[b] (the grid is fixed by
// the caller, so the partials and their order depend only on n).
extern "C" __global__ void sumsq_partial_f32(const float* x, double* partial, u64 n) {
    __shared__ double sh[OPS_BLOCK];
    double s = 0.0;
    GRID_STRIDE(i, n) {
        double v = (double)x[i];
        s += v * v;
    }
    double t = block_sum(s, sh);
    if (threadIdx.x == 0) partial[blockIdx.x] = t;
}

// Second pass, one block: the partials summed, the f64 total's bits stored high, low in two
// f32 elements (ops::store_f64).
extern "C" __global__ void sumsq_final_f32(const double* partial, u64 parts, float* out) {
    __shared__ double sh[OPS_BLOCK];
    double s = 0.0;
    for (u64 k = threadIdx.x; k < parts; k += OPS_BLOCK) s += partial[k];
    double t = block_sum(s, sh);
    if (threadIdx.x == 0) {
        u64 bits = (u64)__double_as_longlong(t);
        out[0] = __uint_as_float((unsigned int)(bits >> 32));
        out[1] = __uint_as_float((unsigned int)(bits & 0xffffffffull));
    }
}

// The clipping of the engine's update: g *= min(1, max_norm / (sqrt(sums[1]) + 1e-6)), as
// clip_coef (f64, then f32), and nothing when that is 1.
extern "C" __global__ void clip_scale_f32(const float* sums, float* g, double max_norm, u64 n) {
    double sq = (double)sums[1];
    double coef = max_norm / (sqrt(sq > 0.0 ? sq : 0.0) + 1e-6);
    float c = (float)(coef < 1.0 ? coef : 1.0);
    if (c == 1.0f) return;
    GRID_STRIDE(i, n) g[i] *= c;
}

// The loss, the units' squared norms (f64 bits in element pairs) summed in unit order, and
// the stop wish, into sums[0..3]: one thread, the order fixed.
extern "C" __global__ void norm_sums_f32(const float* loss, const float* sq, float* sums,
                                         u64 units, float stop) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double t = 0.0;
    for (u64 u = 0; u < units; u++) {
        u64 bits = ((u64)__float_as_uint(sq[2 * u]) << 32) | (u64)__float_as_uint(sq[2 * u + 1]);
        t += __longlong_as_double((long long)bits);
    }
    sums[0] = loss[0];
    sums[1] = (float)t;
    sums[2] = stop;
}

// ---- BatchNorm in training mode (models/src/batchnorm.rs), x laid out [n, c, s] ----------

// The index in [n, c, s] of value j (of n * s) of channel ch.
__device__ u64 bn_at(u64 j, u64 ch, u64 c, u64 s) { return ((j / s) * c + ch) * s + j % s; }

// Per-channel mean and M2 (sum of squared deviations from the mean), two passes in f64 as
// channel_stats; one block per channel (block-stride over the channels). count 0: 0 and 0.
// (kernels.cu's bn_stats_f32 is the Cuda backend's, with 32-bit sizes.)
extern "C" __global__ void bn_chan_stats_f32(const float* x, float* mean_out, float* m2_out,
                                             u64 n, u64 c, u64 s) {
    __shared__ double sh[OPS_BLOCK];
    u64 count = n * s;
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double a = 0.0;
        for (u64 j = threadIdx.x; j < count; j += OPS_BLOCK) a += (double)x[bn_at(j, ch, c, s)];
        double total = block_sum(a, sh);
        double mean = count == 0 ? 0.0 : total / (double)count;
        double q = 0.0;
        for (u64 j = threadIdx.x; j < count; j += OPS_BLOCK) {
            double d = (double)x[bn_at(j, ch, c, s)] - mean;
            q += d * d;
        }
        double m2 = block_sum(q, sh);
        if (threadIdx.x == 0) {
            mean_out[ch] = (float)mean;
            m2_out[ch] = (float)m2;
        }
    }
}

// invstd = 1 / sqrt(m2 / count + eps) in f64, rounded once (invstd_of), per channel.
extern "C" __global__ void bn_invstd_f32(const float* m2, float* invstd, u64 c, double count,
                                         float eps) {
    GRID_STRIDE(ch, c) { invstd[ch] = (float)(1.0 / sqrt((double)m2[ch] / count + (double)eps)); }
}

// xhat = (x - mean) * invstd, y = xhat * weight + bias (normalize); params: weight [c], then
// bias [c].
extern "C" __global__ void bn_fwd_f32(const float* params, const float* x, const float* mean,
                                      const float* invstd, float* y, float* xhat, u64 n, u64 c,
                                      u64 s) {
    GRID_STRIDE(i, n * c * s) {
        u64 ch = (i / s) % c;
        float v = (x[i] - mean[ch]) * invstd[ch];
        xhat[i] = v;
        y[i] = v * params[ch] + params[c + ch];
    }
}

// The backward's reduce (backward_reduce), one block per channel: sums[ch] = sum dy,
// sums[c + ch] = sum dy * xhat (f64 accumulation); grads[ch] += sum dy * xhat (weight),
// grads[c + ch] += sum dy (bias).
extern "C" __global__ void bn_bwd_reduce_f32(const float* dy, const float* xhat, float* sums,
                                             float* grads, u64 n, u64 c, u64 s) {
    __shared__ double sh[OPS_BLOCK];
    u64 count = n * s;
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double a = 0.0, b = 0.0;
        for (u64 j = threadIdx.x; j < count; j += OPS_BLOCK) {
            u64 at = bn_at(j, ch, c, s);
            a += (double)dy[at];
            b += (double)(dy[at] * xhat[at]);
        }
        double sdy = block_sum(a, sh);
        double sdyx = block_sum(b, sh);
        if (threadIdx.x == 0) {
            sums[ch] = (float)sdy;
            sums[c + ch] = (float)sdyx;
            grads[ch] += (float)sdyx;
            grads[c + ch] += (float)sdy;
        }
    }
}

// dx = weight * invstd * (dy - sum dy / count - xhat * sum dy xhat / count) (backward_dx),
// the means in f64 rounded once, count the values per channel of the global batch.
extern "C" __global__ void bn_bwd_dx_f32(const float* params, const float* xhat,
                                         const float* invstd, const float* sums, const float* dy,
                                         float* dx, u64 n, u64 c, u64 s, double count) {
    GRID_STRIDE(i, n * c * s) {
        u64 ch = (i / s) % c;
        float a = params[ch] * invstd[ch];
        float b = (float)((double)sums[ch] / count);
        float k = (float)((double)sums[c + ch] / count);
        dx[i] = a * (dy[i] - b - xhat[i] * k);
    }
}

// ---- Causal self-attention (models/src/nn/attention.rs), no dropout ----------------------
// One body per kernel for two layouts, told apart by an AttnLayout (below):
// - the head layout: q, k, v, out and their gradients are [batch, heads, seq, d] row-major
//   (row stride d, the rows of one (batch, head) contiguous), each its own buffer;
// - the token layout (nanoGPT's, ATTN-5): q, k, v read in place from the fused
//   [batch, seq, 3 embd] buffer (q at columns 0..embd, k at embd..2 embd, v at
//   2 embd..3 embd, head h at columns h d..(h + 1) d of each part; row stride 3 embd), the
//   gradient dqkv written alike, out and dout [batch, seq, embd] (row stride embd).
// In both, `rows` = batch * heads * seq query (or key) rows, row = (b heads + h) seq + i, and
// lse and the backward's D are [batch, heads, seq], indexed by row. Scores are
// q_i . k_j * scale (scale = 1 / sqrt(d); dot products and the softmax in f32, as the host's
// f32 kernel), key j visible to query i when j <= i. One block of ATT_BLOCK threads per row
// (block-stride over the rows, so a grid of any size covers them); its keys (or queries) go
// in tiles of ATT_BLOCK, one per thread. No seq x seq buffer exists: a block keeps its row's
// q (or k, v), its accumulators and one tile of probabilities in dynamic shared memory (sizes
// in device_ops/norm_attn.rs). All loop bounds are uniform over a block, so every thread
// meets every barrier.

#define ATT_BLOCK OPS_BLOCK

extern __shared__ float att_sh[];

// Where the rows of one (batch b, head h) lie: row i of its q at
// b * in_bs + h * in_hs + i * in_ld, of its k and v k_off and v_off further (their gradients
// at the same places of the gradient buffers); row i of its out and dout at
// b * out_bs + h * out_hs + i * out_ld. The fields and their order are those of
// device_ops/norm_attn.rs's AttnLayout (twelve u64, passed by value).
struct AttnLayout {
    u64 rows, heads, seq, d;
    u64 in_ld, in_hs, in_bs, k_off, v_off;
    u64 out_ld, out_hs, out_bs;
};
static_assert(sizeof(AttnLayout) == 12 * sizeof(u64), "AttnLayout: twelve u64, no padding");

// The first element of (batch, head) bh = row / seq in the q, k, v layout, and in the output
// layout (heads > 0 wherever a row exists).
__device__ u64 att_in_base(const AttnLayout& L, u64 bh) {
    return (bh / L.heads) * L.in_bs + (bh % L.heads) * L.in_hs;
}
__device__ u64 att_out_base(const AttnLayout& L, u64 bh) {
    return (bh / L.heads) * L.out_bs + (bh % L.heads) * L.out_hs;
}

// Forward, one block per query row i: an online softmax over the key tiles. Per tile the
// running maximum m and sum l are rescaled by exp(m - m') for the tile's maximum m', and the
// output accumulator acc[d] likewise before acc += sum_j p_j v_j; at the end out = acc / l and
// lse = m + log(l). Shared: q [d], acc [d], p [ATT_BLOCK]. In the token layout q, k and v are
// the one qkv buffer.
extern "C" __global__ void attn_fwd_f32(const float* q, const float* k, const float* v,
                                        float* out, float* lse, AttnLayout L, float scale) {
    __shared__ double sh[OPS_BLOCK];
    __shared__ float shf[OPS_BLOCK];
    const u64 d = L.d, ld = L.in_ld;
    float* qs = att_sh;
    float* acc = att_sh + d;
    float* ps = att_sh + 2 * d;
    const float neg_inf = __uint_as_float(0xff800000u);
    for (u64 row = blockIdx.x; row < L.rows; row += gridDim.x) {
        u64 i = row % L.seq, bh = row / L.seq;
        u64 ib = att_in_base(L, bh);
        const float* kh = k + ib + L.k_off;  // the (batch, head)'s key 0
        const float* vh = v + ib + L.v_off;
        const float* qr = q + ib + i * ld;
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
            qs[c] = qr[c];
            acc[c] = 0.0f;
        }
        __syncthreads();
        float m = neg_inf, l = 0.0f;
        for (u64 j0 = 0; j0 <= i; j0 += ATT_BLOCK) {
            u64 j = j0 + threadIdx.x;
            bool live = j <= i;
            float sc = neg_inf;
            if (live) {
                const float* kr = kh + j * ld;
                float dot = 0.0f;
                for (u64 c = 0; c < d; c++) dot += qs[c] * kr[c];
                sc = dot * scale;
            }
            // Key j0 is live, so the maximum is finite from the first tile on.
            float mx = fmaxf(m, block_max(sc, shf));
            float alpha = expf(m - mx);
            float p = live ? expf(sc - mx) : 0.0f;
            ps[threadIdx.x] = p;
            // block_sum's barriers also publish ps.
            l = l * alpha + (float)block_sum((double)p, sh);
            m = mx;
            u64 cnt = i + 1 - j0 < ATT_BLOCK ? i + 1 - j0 : ATT_BLOCK;
            const float* vt = vh + j0 * ld;
            for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
                float a = acc[c] * alpha;
                for (u64 t = 0; t < cnt; t++) a += ps[t] * vt[t * ld + c];
                acc[c] = a;
            }
            __syncthreads();  // ps is rewritten by the next tile
        }
        float inv = 1.0f / l;
        float* orow = out + att_out_base(L, bh) + i * L.out_ld;
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) orow[c] = acc[c] * inv;
        if (threadIdx.x == 0) lse[row] = m + logf(l);
        __syncthreads();  // qs and acc are rewritten by the next row
    }
}

// Backward, first pass, one block per query row i: D_i = dout_i . out_i (into dsum, for the
// second pass), then over the keys j <= i: p = exp(s_ij - lse_i), dp = dout_i . v_j,
// ds = p (dp - D_i), dq_i = scale * sum_j ds k_j. Each dq row is written by its own block (in
// the token layout dq is the dqkv buffer, its q columns).
// Shared: q [d], dout [d], dq accumulator [d], ds [ATT_BLOCK].
extern "C" __global__ void attn_bwd_dq_f32(const float* q, const float* k, const float* v,
                                           const float* out, const float* lse,
                                           const float* dout, float* dq, float* dsum,
                                           AttnLayout L, float scale) {
    __shared__ double sh[OPS_BLOCK];
    const u64 d = L.d, ld = L.in_ld;
    float* qs = att_sh;
    float* gs = att_sh + d;
    float* acc = att_sh + 2 * d;
    float* dss = att_sh + 3 * d;
    for (u64 row = blockIdx.x; row < L.rows; row += gridDim.x) {
        u64 i = row % L.seq, bh = row / L.seq;
        u64 ib = att_in_base(L, bh);
        u64 orow = att_out_base(L, bh) + i * L.out_ld;
        const float* kh = k + ib + L.k_off;
        const float* vh = v + ib + L.v_off;
        const float* qr = q + ib + i * ld;
        double part = 0.0;
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
            qs[c] = qr[c];
            gs[c] = dout[orow + c];
            acc[c] = 0.0f;
            part += (double)(gs[c] * out[orow + c]);
        }
        // block_sum's barriers also publish qs and gs.
        float D = (float)block_sum(part, sh);
        if (threadIdx.x == 0) dsum[row] = D;
        float Lse = lse[row];
        for (u64 j0 = 0; j0 <= i; j0 += ATT_BLOCK) {
            u64 j = j0 + threadIdx.x;
            float ds = 0.0f;
            if (j <= i) {
                const float* kr = kh + j * ld;
                const float* vr = vh + j * ld;
                float dot = 0.0f, dp = 0.0f;
                for (u64 c = 0; c < d; c++) {
                    dot += qs[c] * kr[c];
                    dp += gs[c] * vr[c];
                }
                float p = expf(dot * scale - Lse);
                ds = p * (dp - D);
            }
            dss[threadIdx.x] = ds;
            __syncthreads();
            u64 cnt = i + 1 - j0 < ATT_BLOCK ? i + 1 - j0 : ATT_BLOCK;
            const float* kt = kh + j0 * ld;
            for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
                float a = acc[c];
                for (u64 t = 0; t < cnt; t++) a += dss[t] * kt[t * ld + c];
                acc[c] = a;
            }
            __syncthreads();  // dss is rewritten by the next tile
        }
        float* dqr = dq + ib + i * ld;
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) dqr[c] = acc[c] * scale;
        __syncthreads();  // the row's shared values are rewritten by the next row
    }
}

// Backward, second pass, one block per key row j (after the first, whose dsum it reads):
// over the queries i >= j, with p and ds recomputed as there, dv_j = sum_i p dout_i and
// dk_j = scale * sum_i ds q_i. Each dk, dv row is written by its own block: no atomics, and
// the sums' order is fixed. dk and dv rows lie where k's and v's do (k_off, v_off: in the
// token layout both are the dqkv buffer, apart by their offsets). Shared: k [d], v [d], dk
// and dv accumulators [d] each, p and ds [ATT_BLOCK] each.
__device__ void attn_bwd_dkdv(const float* q, const float* k, const float* v,
                              const float* lse, const float* dout, const float* dsum,
                              float* dk, float* dv, const AttnLayout& L, float scale) {
    const u64 d = L.d, ld = L.in_ld, old = L.out_ld;
    float* ks = att_sh;
    float* vs = att_sh + d;
    float* ak = att_sh + 2 * d;
    float* av = att_sh + 3 * d;
    float* ps = att_sh + 4 * d;
    float* dss = ps + ATT_BLOCK;
    for (u64 row = blockIdx.x; row < L.rows; row += gridDim.x) {
        u64 j = row % L.seq, bh = row / L.seq;
        u64 first = row - j;  // the (batch, head)'s first row
        u64 ib = att_in_base(L, bh), ob = att_out_base(L, bh);
        u64 krow = ib + L.k_off + j * ld, vrow = ib + L.v_off + j * ld;
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
            ks[c] = k[krow + c];
            vs[c] = v[vrow + c];
            ak[c] = 0.0f;
            av[c] = 0.0f;
        }
        __syncthreads();
        for (u64 i0 = j; i0 < L.seq; i0 += ATT_BLOCK) {
            u64 i = i0 + threadIdx.x;
            float p = 0.0f, ds = 0.0f;
            if (i < L.seq) {
                const float* qr = q + ib + i * ld;
                const float* gr = dout + ob + i * old;
                float dot = 0.0f, dp = 0.0f;
                for (u64 c = 0; c < d; c++) {
                    dot += qr[c] * ks[c];
                    dp += gr[c] * vs[c];
                }
                p = expf(dot * scale - lse[first + i]);
                ds = p * (dp - dsum[first + i]);
            }
            ps[threadIdx.x] = p;
            dss[threadIdx.x] = ds;
            __syncthreads();
            u64 cnt = L.seq - i0 < ATT_BLOCK ? L.seq - i0 : ATT_BLOCK;
            const float* qt = q + ib + i0 * ld;
            const float* gt = dout + ob + i0 * old;
            for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
                float a = ak[c], b = av[c];
                for (u64 t = 0; t < cnt; t++) {
                    a += dss[t] * qt[t * ld + c];
                    b += ps[t] * gt[t * old + c];
                }
                ak[c] = a;
                av[c] = b;
            }
            __syncthreads();  // ps and dss are rewritten by the next tile
        }
        for (u64 c = threadIdx.x; c < d; c += ATT_BLOCK) {
            dk[krow + c] = ak[c] * scale;
            dv[vrow + c] = av[c];
        }
        __syncthreads();  // the row's shared values are rewritten by the next row
    }
}

// The second pass on the head layout: dk and dv their own buffers.
extern "C" __global__ void attn_bwd_dkdv_f32(const float* q, const float* k, const float* v,
                                             const float* lse, const float* dout,
                                             const float* dsum, float* dk, float* dv,
                                             AttnLayout L, float scale) {
    attn_bwd_dkdv(q, k, v, lse, dout, dsum, dk, dv, L, scale);
}

// The second pass on the token layout: q, k, v the one qkv buffer, dk and dv the one dqkv
// (their columns apart, so no element is written twice).
extern "C" __global__ void attn_bwd_dkdv_tokens_f32(const float* qkv, const float* lse,
                                                    const float* dout, const float* dsum,
                                                    float* dqkv, AttnLayout L, float scale) {
    attn_bwd_dkdv(qkv, qkv, qkv, lse, dout, dsum, dqkv, dqkv, L, scale);
}
