// Kernels of the CUDA backend, compiled at run time by NVRTC. f32 storage, f64 accumulation
// in the per-channel reductions (the CPU backend accumulates BatchNorm statistics in f64 too).
// Layouts follow the CPU backend: BatchNorm inputs are [n, c, s] (s = 1 for [N, C]).

extern "C" __global__ void relu_f32(float* x, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fmaxf(x[i], 0.0f);
}

extern "C" __global__ void relu_backward_f32(const float* out, float* g, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && out[i] <= 0.0f) g[i] = 0.0f;
}

extern "C" __global__ void axpy_f32(float alpha, const float* x, float* y, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += alpha * x[i];
}

#define BLOCK 256

// Sums two per-thread f64 values over the block; thread 0 holds the totals.
__device__ void block_sum2(double* sa, double* sb, double a, double b) {
    sa[threadIdx.x] = a;
    sb[threadIdx.x] = b;
    __syncthreads();
    for (unsigned int w = BLOCK / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) {
            sa[threadIdx.x] += sa[threadIdx.x + w];
            sb[threadIdx.x] += sb[threadIdx.x + w];
        }
        __syncthreads();
    }
}

// One block per channel: mean and M2 (sum of squared deviations) in two passes.
extern "C" __global__ void bn_stats_f32(const float* x, float* mean_out, float* m2_out,
                                        unsigned int n, unsigned int c, unsigned int s) {
    __shared__ double sa[BLOCK];
    __shared__ double sb[BLOCK];
    unsigned int ch = blockIdx.x;
    unsigned long long count = (unsigned long long)n * s;
    double sum = 0.0;
    for (unsigned long long j = threadIdx.x; j < count; j += BLOCK) {
        unsigned long long i = j / s, k = j % s;
        sum += (double)x[(i * c + ch) * s + k];
    }
    block_sum2(sa, sb, sum, 0.0);
    double mean = count ? sa[0] / (double)count : 0.0;
    __syncthreads();
    double m2 = 0.0;
    for (unsigned long long j = threadIdx.x; j < count; j += BLOCK) {
        unsigned long long i = j / s, k = j % s;
        double d = (double)x[(i * c + ch) * s + k] - mean;
        m2 += d * d;
    }
    block_sum2(sa, sb, m2, 0.0);
    if (threadIdx.x == 0) {
        mean_out[ch] = (float)mean;
        m2_out[ch] = (float)sa[0];
    }
}

// x <- (x - mean) * invstd (the saved xhat), y = xhat * w + b.
extern "C" __global__ void bn_normalize_f32(float* x, float* y, const float* mean,
                                            const float* invstd, const float* w, const float* b,
                                            unsigned int n, unsigned int c, unsigned int s) {
    unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= (unsigned long long)n * c * s) return;
    unsigned int ch = (unsigned int)((j / s) % c);
    float v = (x[j] - mean[ch]) * invstd[ch];
    x[j] = v;
    y[j] = v * w[ch] + b[ch];
}

// One block per channel: sum(dy) and sum(dy * xhat).
extern "C" __global__ void bn_backward_reduce_f32(const float* dy, const float* xhat,
                                                  float* sum_dy, float* sum_dy_xhat,
                                                  unsigned int n, unsigned int c, unsigned int s) {
    __shared__ double sa[BLOCK];
    __shared__ double sb[BLOCK];
    unsigned int ch = blockIdx.x;
    unsigned long long count = (unsigned long long)n * s;
    double a = 0.0, b = 0.0;
    for (unsigned long long j = threadIdx.x; j < count; j += BLOCK) {
        unsigned long long i = j / s, k = j % s;
        unsigned long long at = (i * c + ch) * s + k;
        a += (double)dy[at];
        b += (double)dy[at] * (double)xhat[at];
    }
    block_sum2(sa, sb, a, b);
    if (threadIdx.x == 0) {
        sum_dy[ch] = (float)sa[0];
        sum_dy_xhat[ch] = (float)sb[0];
    }
}

// dx = w * invstd * (dy - sum_dy / count - xhat * sum_dy_xhat / count), where count is the
// number of values per channel in the (global) batch.
extern "C" __global__ void bn_backward_dx_f32(const float* dy, const float* xhat,
                                              const float* invstd, const float* w,
                                              const float* sum_dy, const float* sum_dy_xhat,
                                              float* dx, float count,
                                              unsigned int n, unsigned int c, unsigned int s) {
    unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= (unsigned long long)n * c * s) return;
    unsigned int ch = (unsigned int)((j / s) % c);
    float mdy = sum_dy[ch] / count;
    float mdyx = sum_dy_xhat[ch] / count;
    dx[j] = w[ch] * invstd[ch] * (dy[j] - mdy - xhat[j] * mdyx);
}

// torch.optim.SGD for one element per thread; `first` is the step that seeds the buffer.
extern "C" __global__ void sgd_f32(float* p, const float* g, float* buf, float lr,
                                   float momentum, float dampening, float weight_decay,
                                   int nesterov, int first, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float d = g[i];
    if (weight_decay != 0.0f) d += weight_decay * p[i];
    if (momentum != 0.0f) {
        float b = first ? d : momentum * buf[i] + (1.0f - dampening) * d;
        buf[i] = b;
        d = nesterov ? d + momentum * b : b;
    }
    p[i] -= lr * d;
}

// torch.optim.AdamW; state interleaved (m, v) per element. The bias corrections are computed
// on the host in f64, as PyTorch does.
extern "C" __global__ void adamw_f32(float* p, const float* g, float* st, float step_size,
                                     float bc2_sqrt, float beta1, float beta2, float eps,
                                     float decay, unsigned int n) {
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gi = g[i];
    p[i] *= decay;
    float m = st[2 * i];
    m += (gi - m) * (1.0f - beta1);
    st[2 * i] = m;
    float v = st[2 * i + 1] * beta2 + (1.0f - beta2) * gi * gi;
    st[2 * i + 1] = v;
    float denom = sqrtf(v) / bc2_sqrt + eps;
    p[i] -= step_size * (m / denom);
}
