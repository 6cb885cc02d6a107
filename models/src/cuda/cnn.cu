// Kernels of the CUDA device's convolutional-model ops (models/src/cuda/device_ops/cnn.rs,
// the `Op`s of models/src/ops/cnn.rs): im2col and col2im around cuBLAS's products, max and
// global average pooling, and BatchNorm on the exact route (statistics in f64, SyncBatchNorm's
// records merged in rank order). Compiled by NVRTC at open as its own module, with
// `--fmad=false`: no multiply-add is contracted, so each kernel does the host reference's
// IEEE operations in the host's order (the layer code of models/src/conv.rs, layers.rs and
// batchnorm.rs) and, apart from the cuBLAS products, gives its bits. No atomics: every sum
// has a fixed order (the host's), every element is written by one thread.
//
// Every kernel bounds its indices by the sizes it is given (64-bit index math); the caller
// checked the buffers against those sizes (Op::check_lens). Elementwise kernels are
// grid-stride loops; the per-channel ones take channels in a block-stride loop (one block of
// CNN_BLOCK threads per channel), so a grid of any size covers them. An f64 travels in two
// f32 elements holding its bits, high word first (ops::store_f64, ops::load_f64).

#define CNN_BLOCK 256

typedef unsigned long long u64;

#define CNN_STRIDE(i, n)                                                                   \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                      \
         i += (u64)gridDim.x * blockDim.x)

__device__ double cnn_load_f64(const float* two) {
    u64 bits = ((u64)__float_as_uint(two[0]) << 32) | (u64)__float_as_uint(two[1]);
    return __longlong_as_double((long long)bits);
}

__device__ void cnn_store_f64(double v, float* two) {
    u64 bits = (u64)__double_as_longlong(v);
    two[0] = __uint_as_float((unsigned int)(bits >> 32));
    two[1] = __uint_as_float((unsigned int)(bits & 0xffffffffull));
}

// Rust's f32::sum and f64::sum start from -0.0 (so a sum of -0.0s is -0.0).
#define NEG_ZERO_F (-0.0f)
#define NEG_ZERO_D (-0.0)

// ---- Convolution (models/src/conv.rs), x [n, cin, h, w], weight [cout, cin, k, k] ---------
// A chunk of `b` samples at a time: its columns are `b` matrices col [cin k k, ho wo], one
// per sample (conv.rs's im2col), one after the other.

// col[s, (ci k + ky) k + kx, oy wo + ox] = x[s, ci, oy stride + ky - pad, ox stride + kx -
// pad], 0 outside the input (the zero padding).
extern "C" __global__ void conv_im2col_f32(const float* x, float* col, u64 b, u64 cin, u64 h,
                                           u64 w, u64 k, u64 stride, u64 pad, u64 ho, u64 wo) {
    u64 p = ho * wo, kk = cin * k * k;
    CNN_STRIDE(i, b * kk * p) {
        u64 q = i % p, r = (i / p) % kk, s = i / (p * kk);
        u64 oy = q / wo, ox = q % wo;
        u64 kx = r % k, ky = (r / k) % k, ci = r / (k * k);
        // Unsigned: a position left of or above the input wraps past h (or w).
        u64 iy = oy * stride + ky - pad, ix = ox * stride + kx - pad;
        float v = 0.0f;
        if (oy * stride + ky >= pad && ox * stride + kx >= pad && iy < h && ix < w)
            v = x[((s * cin + ci) * h + iy) * w + ix];
        col[i] = v;
    }
}

// The input gradient of a chunk from its column gradients (conv.rs's col2im), as a gather:
// each dx element sums the column entries that came from it, over (ky, kx) in order from
// 0 (the order in which col2im adds them into a zeroed gradient); dx is overwritten.
extern "C" __global__ void conv_col2im_f32(const float* dcol, float* dx, u64 b, u64 cin, u64 h,
                                           u64 w, u64 k, u64 stride, u64 pad, u64 ho, u64 wo) {
    u64 p = ho * wo, kk = cin * k * k;
    CNN_STRIDE(i, b * cin * h * w) {
        u64 ix = i % w, iy = (i / w) % h, ci = (i / (w * h)) % cin, s = i / (w * h * cin);
        const float* cs = dcol + s * kk * p;
        float acc = 0.0f;
        for (u64 ky = 0; ky < k; ky++) {
            u64 ty = iy + pad;  // oy stride + ky
            if (ty < ky || (ty - ky) % stride != 0) continue;
            u64 oy = (ty - ky) / stride;
            if (oy >= ho) continue;
            for (u64 kx = 0; kx < k; kx++) {
                u64 tx = ix + pad;
                if (tx < kx || (tx - kx) % stride != 0) continue;
                u64 ox = (tx - kx) / stride;
                if (ox >= wo) continue;
                acc += cs[((ci * k + ky) * k + kx) * p + oy * wo + ox];
            }
        }
        dx[i] = acc;
    }
}

// y [b, cout, p]: every plane (s, o) = bias[o] = params[offset + o], which the product is then
// added onto (conv.rs's plane fill).
extern "C" __global__ void conv_bias_fill_f32(const float* params, u64 offset, float* y,
                                              u64 total, u64 p, u64 cout) {
    CNN_STRIDE(i, total) { y[i] = params[offset + (i / p) % cout]; }
}

// The bias gradient, one block per output channel o: grads[offset + o] += the f32 sum of
// each sample's plane dy[s, o, :] (in order from -0.0, as f32::sum), added sample by sample
// in sample order, as conv.rs's backward. The block's threads sum CNN_BLOCK planes at a
// time; thread 0 adds them in order.
extern "C" __global__ void conv_bias_grad_f32(const float* dy, float* grads, u64 offset, u64 n,
                                              u64 cout, u64 p) {
    __shared__ float sh[CNN_BLOCK];
    for (u64 o = blockIdx.x; o < cout; o += gridDim.x) {
        float g = grads[offset + o];
        for (u64 s0 = 0; s0 < n; s0 += CNN_BLOCK) {
            u64 s = s0 + threadIdx.x;
            float t = NEG_ZERO_F;
            if (s < n) {
                const float* plane = dy + (s * cout + o) * p;
                for (u64 j = 0; j < p; j++) t += plane[j];
            }
            sh[threadIdx.x] = t;
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 cnt = n - s0 < CNN_BLOCK ? n - s0 : CNN_BLOCK;
                for (u64 j = 0; j < cnt; j++) g += sh[j];
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) grads[offset + o] = g;
    }
}

// ---- Pooling (models/src/layers.rs) -----------------------------------------------------

// Max pooling over `planes` planes of [h, w], no padding: y and argmax [planes, ho, wo].
// As MaxPool2d::forward: the window's first element is taken first, a later one only when
// strictly greater (so the first maximum wins, and a NaN is kept only as the first element);
// argmax holds the index into the whole input (plane h w + position) as u32 bits.
extern "C" __global__ void maxpool_fwd_f32(const float* x, float* y, float* argmax, u64 planes,
                                           u64 h, u64 w, u64 k, u64 stride, u64 ho, u64 wo) {
    CNN_STRIDE(o, planes * ho * wo) {
        u64 ox = o % wo, oy = (o / wo) % ho, plane = o / (wo * ho);
        const float* src = x + plane * h * w;
        float best = __uint_as_float(0xff800000u);  // -inf
        u64 at = 0;
        for (u64 ky = 0; ky < k; ky++) {
            for (u64 kx = 0; kx < k; kx++) {
                u64 idx = (oy * stride + ky) * w + ox * stride + kx;
                float v = src[idx];
                if (v > best || (ky == 0 && kx == 0)) {
                    best = v;
                    at = idx;
                }
            }
        }
        y[o] = best;
        argmax[o] = __uint_as_float((unsigned int)(plane * h * w + at));
    }
}

// Its backward as a gather (no atomics): dx[i] = the sum, in output order from 0, of dy[o]
// over the outputs o whose window covers i and whose argmax is i, the order in which
// MaxPool2d::backward adds them into a zeroed gradient. An argmax outside its output's
// window (which the forward never writes) routes nothing.
extern "C" __global__ void maxpool_bwd_f32(const float* argmax, const float* dy, float* dx,
                                           u64 planes, u64 h, u64 w, u64 k, u64 stride, u64 ho,
                                           u64 wo) {
    CNN_STRIDE(i, planes * h * w) {
        u64 ix = i % w, iy = (i / w) % h, plane = i / (w * h);
        // The windows covering row iy: oy stride <= iy < oy stride + k, oy < ho.
        u64 oy0 = iy < k ? 0 : (iy - k) / stride + 1, oy1 = iy / stride;
        u64 ox0 = ix < k ? 0 : (ix - k) / stride + 1, ox1 = ix / stride;
        float acc = 0.0f;
        for (u64 oy = oy0; oy <= oy1 && oy < ho; oy++) {
            for (u64 ox = ox0; ox <= ox1 && ox < wo; ox++) {
                u64 o = (plane * ho + oy) * wo + ox;
                if ((u64)__float_as_uint(argmax[o]) == i) acc += dy[o];
            }
        }
        dx[i] = acc;
    }
}

// Global average pooling, y [planes] = (the f64 sum of the plane, in order from -0.0) times
// 1 / s in f64, rounded once (global_avg_pool_forward); one thread per plane.
extern "C" __global__ void gap_fwd_f32(const float* x, float* y, u64 planes, u64 s) {
    double inv = s == 0 ? 0.0 : 1.0 / (double)s;
    CNN_STRIDE(pl, planes) {
        const float* p = x + pl * s;
        double t = NEG_ZERO_D;
        for (u64 j = 0; j < s; j++) t += (double)p[j];
        y[pl] = (float)(t * inv);
    }
}

// Its backward: dx[pl, j] = dy[pl] * (1 / s in f32) (global_avg_pool_backward).
extern "C" __global__ void gap_bwd_f32(const float* dy, float* dx, u64 planes, u64 s) {
    float inv = 1.0f / (float)s;
    CNN_STRIDE(i, planes * s) { dx[i] = dy[i / s] * inv; }
}

// ---- BatchNorm on the exact route (models/src/batchnorm.rs), x [n, c, s] -----------------
// Statistics records: per channel count, mean, M2, each an f64 as two elements (stats [6 c]);
// SyncBatchNorm's message records: the same three as (hi, lo) f32 pairs (BN-5).

// The sum over the n planes x[(i c + ch) s .. + s] of each plane's f64 sum of f(v) (from
// -0.0, in order), the planes added in order from -0.0 (channel_stats for s > 1): the
// block's threads sum CNN_BLOCK planes at a time, thread 0 adds them in order; every thread
// gets the total. f: 0 the values, 1 their squared deviations from `mean`.
__device__ double bn_plane_sums(const float* x, u64 n, u64 c, u64 s, u64 ch, int f,
                                double mean, double* sh) {
    double total = NEG_ZERO_D;
    for (u64 i0 = 0; i0 < n; i0 += CNN_BLOCK) {
        u64 i = i0 + threadIdx.x;
        double t = NEG_ZERO_D;
        if (i < n) {
            const float* p = x + (i * c + ch) * s;
            for (u64 j = 0; j < s; j++) {
                double v = (double)p[j];
                if (f == 1) {
                    double d = v - mean;
                    v = d * d;
                }
                t += v;
            }
        }
        sh[threadIdx.x] = t;
        __syncthreads();
        if (threadIdx.x == 0) {
            u64 cnt = n - i0 < CNN_BLOCK ? n - i0 : CNN_BLOCK;
            for (u64 j = 0; j < cnt; j++) total += sh[j];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) sh[0] = total;
    __syncthreads();
    total = sh[0];
    __syncthreads();
    return total;
}

__device__ void bn_store_stats(float* out, double count, double mean, double m2) {
    cnn_store_f64(count, out);
    cnn_store_f64(mean, out + 2);
    cnn_store_f64(m2, out + 4);
}

// Local statistics for s == 1 ([n, c]): one thread per channel walks the rows in order, the
// sum and then the squared deviations in f64 from 0 (channel_stats's row walk); n == 0:
// count, mean and M2 0.
extern "C" __global__ void bn_local_stats_rows_f32(const float* x, float* stats, u64 n, u64 c) {
    CNN_STRIDE(ch, c) {
        double sum = 0.0;
        for (u64 i = 0; i < n; i++) sum += (double)x[i * c + ch];
        double mean = n == 0 ? 0.0 : sum / (double)n;
        double m2 = 0.0;
        for (u64 i = 0; i < n; i++) {
            double d = (double)x[i * c + ch] - mean;
            m2 += d * d;
        }
        bn_store_stats(stats + 6 * ch, (double)n, mean, m2);
    }
}

// Local statistics for s != 1, one block per channel (bn_plane_sums); count n s 0: all 0.
extern "C" __global__ void bn_local_stats_planes_f32(const float* x, float* stats, u64 n, u64 c,
                                                     u64 s) {
    __shared__ double sh[CNN_BLOCK];
    double count = (double)(n * s);
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        if (n * s == 0) {
            if (threadIdx.x == 0) bn_store_stats(stats + 6 * ch, 0.0, 0.0, 0.0);
            continue;
        }
        double mean = bn_plane_sums(x, n, c, s, ch, 0, 0.0, sh) / count;
        double m2 = bn_plane_sums(x, n, c, s, ch, 1, mean, sh);
        if (threadIdx.x == 0) bn_store_stats(stats + 6 * ch, count, mean, m2);
    }
}

// An f64 as SyncBatchNorm's pair: hi = v rounded to f32, lo = the rest rounded to f32.
__device__ void bn_split(double v, float* two) {
    float hi = (float)v;
    two[0] = hi;
    two[1] = (float)(v - (double)hi);
}

__device__ double bn_join(const float* two) { return (double)two[0] + (double)two[1]; }

// records [6 c]: every f64 of stats [6 c] split into its pair (ChannelStats::encode).
extern "C" __global__ void bn_encode_f32(const float* stats, float* records, u64 values) {
    CNN_STRIDE(i, values) { bn_split(cnn_load_f64(stats + 2 * i), records + 2 * i); }
}

// Every rank's records merged per channel as the reducer combines them: rank 0's record,
// then each other rank's in rank order by Chan's merge (ChannelStats::merge on the decoded
// records), re-encoded after each merge (combine_stats); the result decoded and stored as
// f64 bits. records [world, 6 c], stats [6 c]; one thread per channel.
extern "C" __global__ void bn_merge_f32(const float* records, float* stats, u64 c, u64 world) {
    CNN_STRIDE(ch, c) {
        float acc[6];
        for (int j = 0; j < 6; j++) acc[j] = records[6 * ch + j];
        for (u64 r = 1; r < world; r++) {
            const float* o = records + r * 6 * c + 6 * ch;
            double an = bn_join(acc), am = bn_join(acc + 2), a2 = bn_join(acc + 4);
            double on = bn_join(o), om = bn_join(o + 2), o2 = bn_join(o + 4);
            double mn = an, mm = am, m2 = a2;
            if (on == 0.0) {
                // self
            } else if (an == 0.0) {
                mn = on;
                mm = om;
                m2 = o2;
            } else {
                double nn = an + on;
                double delta = om - am;
                mn = nn;
                mm = am + delta * (on / nn);
                m2 = a2 + o2 + delta * delta * (an * on / nn);
            }
            bn_split(mn, acc);
            bn_split(mm, acc + 2);
            bn_split(m2, acc + 4);
        }
        bn_store_stats(stats + 6 * ch, bn_join(acc), bn_join(acc + 2), bn_join(acc + 4));
    }
}

// The training forward's per-channel part (train_normalize), one thread per channel:
// invstd = 1 / sqrt(m2 / count + eps) in f64 rounded once, the running mean and variance
// (torch's unbiased m2 / (count - 1)) updated in f64 with `momentum`, num_batches_tracked
// (buffers[2 c]) += 1 by thread 0, which also writes channel 0's count (the batch's) as f64
// bits into count_out. The host refuses a count of at most 1 (BN-4) before writing; a kernel
// cannot refuse, so then (c == 0 included) every invstd is NaN (and so are y and xhat) and
// the running statistics are left as they were: the output shows it.
extern "C" __global__ void bn_train_stats_f32(const float* stats, float* invstd,
                                              float* count_out, float* buffers, u64 c,
                                              float eps, float momentum) {
    double count0 = c == 0 ? 0.0 : cnn_load_f64(stats);
    bool ok = count0 > 1.0;
    double mom = (double)momentum;
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        cnn_store_f64(count0, count_out);
        if (ok) buffers[2 * c] += 1.0f;
    }
    CNN_STRIDE(ch, c) {
        const float* st = stats + 6 * ch;
        double count = cnn_load_f64(st), mean = cnn_load_f64(st + 2), m2 = cnn_load_f64(st + 4);
        if (!ok) {
            invstd[ch] = __uint_as_float(0x7fc00000u);  // NaN
            continue;
        }
        double var_unbiased = m2 / (count - 1.0);
        invstd[ch] = (float)(1.0 / sqrt(m2 / count + (double)eps));
        buffers[ch] = (float)((1.0 - mom) * (double)buffers[ch] + mom * mean);
        buffers[c + ch] = (float)((1.0 - mom) * (double)buffers[c + ch] + mom * var_unbiased);
    }
}

// xhat = (x - mean) * invstd with the mean of stats rounded to f32, y = xhat * weight + bias
// (normalize); params: weight [c], then bias [c].
extern "C" __global__ void bn_train_fwd_f32(const float* params, const float* x,
                                            const float* stats, const float* invstd, float* y,
                                            float* xhat, u64 n, u64 c, u64 s) {
    CNN_STRIDE(i, n * c * s) {
        u64 ch = (i / s) % c;
        float mean = (float)cnn_load_f64(stats + 6 * ch + 2);
        float v = (x[i] - mean) * invstd[ch];
        xhat[i] = v;
        y[i] = v * params[ch] + params[c + ch];
    }
}

// Evaluation mode (eval_normalize): with the running mean and variance of buffers [2 c + 1],
// invstd = 1 / sqrt(var + eps) in f64 rounded once, y = (x - mean) * invstd * weight + bias.
extern "C" __global__ void bn_eval_f32(const float* params, const float* x, const float* buffers,
                                       float* y, u64 n, u64 c, u64 s, float eps) {
    CNN_STRIDE(i, n * c * s) {
        u64 ch = (i / s) % c;
        float is = (float)(1.0 / sqrt((double)buffers[c + ch] + (double)eps));
        float v = (x[i] - buffers[ch]) * is;
        y[i] = v * params[ch] + params[c + ch];
    }
}

__device__ void bn_store_grad_sums(float* sums, float* grads, u64 c, u64 ch, double sdy,
                                   double sdyx) {
    cnn_store_f64(sdy, sums + 2 * ch);
    cnn_store_f64(sdyx, sums + 2 * (c + ch));
    grads[ch] += (float)sdyx;
    grads[c + ch] += (float)sdy;
}

// The backward's reduce for s == 1 (backward_reduce's row walk), one thread per channel:
// sum dy and sum dy * xhat (the product in f32) in f64 from 0, in row order; sums [4 c] (the
// two as f64 bits), grads [2 c] += (weight: sum dy * xhat, bias: sum dy).
extern "C" __global__ void bn_grad_sums_rows_f32(const float* dy, const float* xhat, float* sums,
                                                 float* grads, u64 n, u64 c) {
    CNN_STRIDE(ch, c) {
        double a = 0.0, b = 0.0;
        for (u64 i = 0; i < n; i++) {
            float d = dy[i * c + ch];
            a += (double)d;
            b += (double)(d * xhat[i * c + ch]);
        }
        bn_store_grad_sums(sums, grads, c, ch, a, b);
    }
}

// The same for s != 1, one block per channel: each plane's sums in f32 from 0, in order,
// the planes' added in f64 from 0 in plane order (thread 0 adds what the block's threads
// summed, CNN_BLOCK planes at a time).
extern "C" __global__ void bn_grad_sums_planes_f32(const float* dy, const float* xhat,
                                                   float* sums, float* grads, u64 n, u64 c,
                                                   u64 s) {
    __shared__ float sa[CNN_BLOCK];
    __shared__ float sb[CNN_BLOCK];
    for (u64 ch = blockIdx.x; ch < c; ch += gridDim.x) {
        double a = 0.0, b = 0.0;
        for (u64 i0 = 0; i0 < n; i0 += CNN_BLOCK) {
            u64 i = i0 + threadIdx.x;
            float pa = 0.0f, pb = 0.0f;
            if (i < n) {
                u64 off = (i * c + ch) * s;
                for (u64 j = 0; j < s; j++) {
                    float d = dy[off + j];
                    pa += d;
                    pb += d * xhat[off + j];
                }
            }
            sa[threadIdx.x] = pa;
            sb[threadIdx.x] = pb;
            __syncthreads();
            if (threadIdx.x == 0) {
                u64 cnt = n - i0 < CNN_BLOCK ? n - i0 : CNN_BLOCK;
                for (u64 j = 0; j < cnt; j++) {
                    a += (double)sa[j];
                    b += (double)sb[j];
                }
            }
            __syncthreads();
        }
        if (threadIdx.x == 0) bn_store_grad_sums(sums, grads, c, ch, a, b);
    }
}

// dx = weight * invstd * (dy - sum dy / count - xhat * sum dy xhat / count) (backward_dx):
// the sums and the count f64 bits, each mean in f64 rounded once.
extern "C" __global__ void bn_grad_dx_f32(const float* params, const float* xhat,
                                          const float* invstd, const float* sums,
                                          const float* count, const float* dy, float* dx, u64 n,
                                          u64 c, u64 s) {
    double cnt = cnn_load_f64(count);
    CNN_STRIDE(i, n * c * s) {
        u64 ch = (i / s) % c;
        float a = params[ch] * invstd[ch];
        float b = (float)(cnn_load_f64(sums + 2 * ch) / cnt);
        float k = (float)(cnn_load_f64(sums + 2 * (c + ch)) / cnt);
        dx[i] = a * (dy[i] - b - xhat[i] * k);
    }
}

// ---- Conversions ------------------------------------------------------------------------

// out[i] = the f64 of in[2 i], in[2 i + 1] rounded to f32.
extern "C" __global__ void f64_to_f32(const float* in, float* out, u64 n) {
    CNN_STRIDE(i, n) { out[i] = (float)cnn_load_f64(in + 2 * i); }
}

// out[2 i], out[2 i + 1] = the bits of in[i] widened to f64.
extern "C" __global__ void f32_to_f64(const float* in, float* out, u64 n) {
    CNN_STRIDE(i, n) { cnn_store_f64((double)in[i], out + 2 * i); }
}
