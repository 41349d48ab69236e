"""The CUDA source of the fused kernels (cuda_kernels.py compiles and launches them).

``ROW_KERNELS_SOURCE``: C++ templates, one thread block per row, instantiated for each
storage type in ``STORAGE_TYPES`` (``row_kernel_names``); ``ELEMENTWISE_SPECS``: the
(in_params, out_params, operation, name) of each ``cupy.ElementwiseKernel`` (compiled with
``ELEMENTWISE_PREAMBLE`` ahead of it). Kept apart so
that the Python that launches them reads on one screen, and so that the tests compile
exactly this text (with NVRTC, and for the CPU in tests/cuda_on_cpu).
"""
import numpy as np

MAX_THREADS = 512  # threads per block of a row kernel (a multiple of 32)

# ---- CUDA source of the row kernels ------------------------------------------------------------
# Self-contained (no #include), so NVRTC compiles it anywhere, with or without a GPU.
ROW_KERNELS_SOURCE = r"""
// Storage type T -> accumulator type A = Acc<T>::type, with load (T -> A) and store (A -> T).
// float16 is stored as raw bits and converted with PTX cvt instructions (no cuda_fp16.h).
struct f16 { unsigned short bits; };

template <typename T> struct Acc;
template <> struct Acc<float> {
    typedef float type;
    static __device__ float load(float v) { return v; }
    static __device__ float store(float a) { return a; }
    static __device__ float neg_inf() { return __int_as_float(0xff800000); }
};
template <> struct Acc<double> {
    typedef double type;
    static __device__ double load(double v) { return v; }
    static __device__ double store(double a) { return a; }
    static __device__ double neg_inf() { return __longlong_as_double(0xfff0000000000000LL); }
};
template <> struct Acc<f16> {
    typedef float type;
    static __device__ float load(f16 v) {
        float a;
        asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(v.bits));
        return a;
    }
    static __device__ f16 store(float a) {
        f16 v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.bits) : "f"(a));
        return v;
    }
    static __device__ float neg_inf() { return __int_as_float(0xff800000); }
};

// ---- block-wide reductions ----
// blockDim.x is a multiple of 32. Each warp reduces its 32 values with xor shuffles (after
// which every lane holds the warp's result), warp results meet in shared[0..31], and every
// warp reduces those: all threads return the same value, so no extra broadcast is needed.
template <typename A> __device__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
template <typename A> __device__ A warp_max(A v) {
    for (int o = 16; o > 0; o >>= 1) {
        A w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}
template <typename A> __device__ A block_sum(A v, A* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // a previous call may still be reading shared
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return warp_sum(lane < (int)(blockDim.x >> 5) ? shared[lane] : A(0));
}
template <typename A> __device__ A block_max(A v, A* shared, A identity) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return warp_max(lane < (int)(blockDim.x >> 5) ? shared[lane] : identity);
}

// ---- LayerNorm of one row, from its values v(j): thread i takes j = i, i + blockDim, ... ----
// mean = sum(v) / D, var = sum((v - mean)^2) / D (two passes), rstd = 1 / sqrt(var + eps),
// x_hat = (v - mean) * rstd (written when x_hat is given), y = x_hat * gamma + beta. gamma
// and beta in the accumulator type (float32 for float16: the master weights are not rounded
// to float16). -> rstd. Row: a functor, the row's values in the accumulator type.
template <typename T, typename Row>
__device__ typename Acc<T>::type normalize_row(const Row& v, const typename Acc<T>::type* gamma,
                                               const typename Acc<T>::type* beta, T* y,
                                               T* x_hat, int D, double eps,
                                               typename Acc<T>::type* shared) {
    typedef Acc<T> C;
    typedef typename C::type A;
    A sum = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) sum += v(j);
    const A mean = block_sum(sum, shared) / A(D);
    A sq = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        const A c = v(j) - mean;
        sq += c * c;
    }
    const A var = block_sum(sq, shared) / A(D);
    const A r = A(1) / sqrt(var + A(eps));
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        const A xh = (v(j) - mean) * r;
        if (x_hat) x_hat[j] = C::store(xh);
        y[j] = C::store(xh * gamma[j] + beta[j]);
    }
    return r;
}

template <typename T> struct Loaded {  // a row as stored
    const T* x;
    __device__ typename Acc<T>::type operator()(int j) const { return Acc<T>::load(x[j]); }
};

// v = x + (f + b): f a sub-layer's output before its last bias b (in the accumulator type,
// as the master weights are), x the residual; each sum rounded to T as the array ops round
// them.
template <typename T> struct ResidualSum {
    const T* f;
    const typename Acc<T>::type* b;
    const T* x;
    __device__ typename Acc<T>::type operator()(int j) const {
        typedef Acc<T> C;
        return C::load(C::store(C::load(x[j]) + C::load(C::store(C::load(f[j]) + b[j]))));
    }
};

// ---- LayerNorm forward: one block per row of D (normalize_row) ----
template <typename T>
__global__ void layer_norm_forward(const T* x, const typename Acc<T>::type* gamma,
                                   const typename Acc<T>::type* beta, T* y, T* x_hat,
                                   typename Acc<T>::type* rstd, int D, double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A shared[32];
    const long long off = (long long)blockIdx.x * D;
    const Loaded<T> row = {x + off};
    const A r = normalize_row<T>(row, gamma, beta, y + off, x_hat + off, D, eps, shared);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// ---- the end of a post-norm sub-layer in a decoding step: one block per row of D ----
// y = LayerNorm(x + (f + b)) (ResidualSum), as layer_norm_forward computes it (x_hat and
// rstd not written: a decoding step has no backward).
template <typename T>
__global__ void bias_residual_layer_norm(const T* f, const typename Acc<T>::type* b, const T* x,
                                         const typename Acc<T>::type* gamma,
                                         const typename Acc<T>::type* beta, T* y, int D,
                                         double eps) {
    typedef typename Acc<T>::type A;
    __shared__ A shared[32];
    const long long off = (long long)blockIdx.x * D;
    const ResidualSum<T> row = {f + off, b, x + off};
    normalize_row<T>(row, gamma, beta, y + off, (T*)0, D, eps, shared);
}

// ---- a decoding step's first feed-forward product, finished: one block per row of F ----
// h = max(h + b, 0) in place: b the product's bias (in the accumulator type), the sum rounded
// to T as Linear.step rounds it, then the ReLU (NaN stays NaN, as maximum keeps it).
template <typename T>
__global__ void bias_relu(T* h, const typename Acc<T>::type* b, int F) {
    typedef Acc<T> C;
    typedef typename C::type A;
    h += (long long)blockIdx.x * F;
    for (int j = threadIdx.x; j < F; j += blockDim.x) {
        const A v = C::load(C::store(C::load(h[j]) + b[j]));
        h[j] = C::store(v < A(0) ? A(0) : v);
    }
}

// ---- LayerNorm backward (dx only): one block per row of D ----
// dxh = dy * gamma,  dx = rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat)).
// rstd and gamma in the accumulator type, as the forward takes them.
template <typename T>
__global__ void layer_norm_backward(const T* dy, const T* x_hat, const typename Acc<T>::type* rstd,
                                    const typename Acc<T>::type* gamma, T* dx, int D) {
    typedef Acc<T> C;
    typedef typename C::type A;
    __shared__ A shared[32];
    const long long off = (long long)blockIdx.x * D;
    dy += off; x_hat += off; dx += off;
    A s1 = 0, s2 = 0;
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        const A dxh = C::load(dy[j]) * gamma[j];
        s1 += dxh;
        s2 += dxh * C::load(x_hat[j]);
    }
    const A mean_dxh = block_sum(s1, shared) / A(D);
    const A mean_dxh_xh = block_sum(s2, shared) / A(D);
    const A r = rstd[blockIdx.x];
    for (int j = threadIdx.x; j < D; j += blockDim.x) {
        const A dxh = C::load(dy[j]) * gamma[j];
        dx[j] = C::store(((dxh - mean_dxh) - C::load(x_hat[j]) * mean_dxh_xh) * r);
    }
}

// ---- masked softmax, in place: one block per row of S ----
// v = s + bias (bias read through element strides, so a broadcast view costs no copy),
// m = max v (0 when not finite: a fully masked row), e = exp(v - m), z = sum e (1 when 0),
// s = e / z. The row index is unravelled over the leading shape (n0, n1, n2, n3).
template <typename T>
__device__ typename Acc<T>::type biased(const T* row, const T* brow, long long bs, int j) {
    return Acc<T>::load(row[j]) + (brow ? Acc<T>::load(brow[j * bs]) : typename Acc<T>::type(0));
}

template <typename T>
__global__ void masked_softmax(T* s, const T* bias, int S, long long n1, long long n2,
                               long long n3, long long b0, long long b1, long long b2,
                               long long b3, long long bs, int has_bias) {
    typedef Acc<T> C;
    typedef typename C::type A;
    __shared__ A shared[32];
    long long r = blockIdx.x;
    T* row = s + r * S;
    const T* brow = 0;
    if (has_bias) {
        const long long i3 = r % n3; r /= n3;
        const long long i2 = r % n2; r /= n2;
        const long long i1 = r % n1; r /= n1;
        brow = bias + r * b0 + i1 * b1 + i2 * b2 + i3 * b3;
    }
    A m = C::neg_inf();
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        const A v = biased(row, brow, bs, j);
        m = v > m ? v : m;
    }
    m = block_max(m, shared, C::neg_inf());
    if (!isfinite(m)) m = A(0);  // every key masked: exp(-inf - 0) = 0, no NaN
    A z = 0;
    for (int j = threadIdx.x; j < S; j += blockDim.x) z += exp(biased(row, brow, bs, j) - m);
    z = block_sum(z, shared);
    if (z == A(0)) z = A(1);
    for (int j = threadIdx.x; j < S; j += blockDim.x)
        row[j] = C::store(exp(biased(row, brow, bs, j) - m) / z);
}

// ---- label-smoothed cross-entropy of one chunk of logits: one block per row of V ----
// m = max z, s = sum exp(z - m), lse = m + log s,
// loss = (lse - c_o * z_sum - c_d * z[t]) * valid  with c_d = c_t - c_o and z_sum = sum z
// (or the caller's z_sum when has_z_sum). With want_grad, z becomes e' = exp(z - m) with
// e'[t] -= c_d * s. Padding rows (valid = 0) use class 0 as target, like the NumPy code.
template <typename T>
__global__ void smoothed_ce_chunk(T* z, const long long* t, const bool* valid,
                                  const typename Acc<T>::type* z_sum_in,
                                  typename Acc<T>::type* row_loss, typename Acc<T>::type* s_out,
                                  int V, double c_o, double c_d, int has_z_sum, int want_grad) {
    typedef Acc<T> C;
    typedef typename C::type A;
    __shared__ A shared[32];
    const long long r = blockIdx.x;
    T* row = z + r * V;
    const bool ok = valid[r];
    const long long tr = ok ? t[r] : 0;
    const A z_t = C::load(row[tr]);  // read before any thread can overwrite the row
    A m = C::neg_inf(), zs = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const A v = C::load(row[j]);
        m = v > m ? v : m;
        zs += v;
    }
    m = block_max(m, shared, C::neg_inf());
    zs = block_sum(zs, shared);
    A s = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const A e = exp(C::load(row[j]) - m);
        s += e;
        if (want_grad) row[j] = C::store(e);
    }
    s = block_sum(s, shared);  // its __syncthreads also publishes the writes of e
    if (threadIdx.x == 0) {
        const A lse = m + log(s);
        const A z_sum = has_z_sum ? z_sum_in[r] : zs;
        row_loss[r] = (lse - A(c_o) * z_sum - A(c_d) * z_t) * (ok ? A(1) : A(0));
        s_out[r] = s;
        if (want_grad) row[tr] = C::store(C::load(row[tr]) - A(c_d) * s);
    }
}
// ---- beam search's candidates of one row of scores: one block per row of V ----
// m = max z, s = sum exp(z - m) over every column; then the n best columns other than skip0
// and skip1 (padding and BOS: they count in the normaliser, but are never candidates), best
// first, ties to the lower column: best[i], lp[i] = z[best[i]] - m - log s (their
// log-probabilities). Each thread keeps the n best of its own columns (j = tid, tid +
// blockDim, ... in increasing order) in a sorted list, in the key (value, lower column first)
// with NaN as -inf; n rounds of a block-wide maximum over the heads of the lists then pick
// the n best of the row, the thread whose head won moving to its next. n <= TOP_M_MAX, and
// the row has at least n columns besides skip0 and skip1 (the caller checks both).
#define TOP_M_MAX 16
template <typename A> __device__ bool ahead(A v1, int j1, A v2, int j2) {  // (v1, j1) first?
    if (j2 < 0) return j1 >= 0;  // j < 0: no candidate
    if (j1 < 0) return false;
    return v1 > v2 || (v1 == v2 && j1 < j2);
}

template <typename T>
__global__ void top_m_log_softmax(const T* z, long long* best, typename Acc<T>::type* lp, int V,
                                  int n, long long skip0, long long skip1) {
    typedef Acc<T> C;
    typedef typename C::type A;
    __shared__ A shared[32];
    __shared__ int shared_j[32];
    const long long r = blockIdx.x;
    const T* row = z + r * V;
    A mx = C::neg_inf();
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const A v = C::load(row[j]);
        mx = v > mx ? v : mx;
    }
    mx = block_max(mx, shared, C::neg_inf());
    A s = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += exp(C::load(row[j]) - mx);
    const A log_s = log(block_sum(s, shared));
    A tv[TOP_M_MAX];
    int tj[TOP_M_MAX];
    int have = 0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        if (j == skip0 || j == skip1) continue;
        A v = C::load(row[j]);
        if (v != v) v = C::neg_inf();  // NaN: last
        if (have == n && !(v > tv[n - 1])) continue;  // (equal: the lower column stays)
        int p = have < n ? have++ : n - 1;
        for (; p > 0 && v > tv[p - 1]; --p) {
            tv[p] = tv[p - 1];
            tj[p] = tj[p - 1];
        }
        tv[p] = v;
        tj[p] = j;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int head = 0;
    for (int i = 0; i < n; ++i) {
        A v = head < have ? tv[head] : C::neg_inf();
        int j = head < have ? tj[head] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            const A v2 = __shfl_xor_sync(0xffffffffu, v, o);
            const int j2 = __shfl_xor_sync(0xffffffffu, j, o);
            if (ahead(v2, j2, v, j)) { v = v2; j = j2; }
        }
        __syncthreads();  // the previous round may still be reading shared
        if (lane == 0) { shared[warp] = v; shared_j[warp] = j; }
        __syncthreads();
        v = lane < (int)(blockDim.x >> 5) ? shared[lane] : C::neg_inf();
        j = lane < (int)(blockDim.x >> 5) ? shared_j[lane] : -1;
        for (int o = 16; o > 0; o >>= 1) {
            const A v2 = __shfl_xor_sync(0xffffffffu, v, o);
            const int j2 = __shfl_xor_sync(0xffffffffu, j, o);
            if (ahead(v2, j2, v, j)) { v = v2; j = j2; }
        }
        if (head < have && tj[head] == j) ++head;  // this thread's candidate was taken
        if (threadIdx.x == 0) {
            best[r * n + i] = j;
            lp[r * n + i] = C::load(row[j]) - mx - log_s;
        }
    }
}

// ---- attention of one new query per row (a decoding step): one block per (row, head) ----
// q: the rows' queries (R, H, K) through strides (row qr, head qh; a head's K values
// contiguous); keys and values (N, H, L, K) through strides (sentence ks, head kh, position
// kl; K contiguous): row r attends to positions 0 .. n-1 of sentence r / group. bias: an
// additive key mask in the accumulator type, bias[sentence * bs + j], when has_bias. With
// has_new (self-attention's cache, group 1) the row's new key and value (k_new, v_new,
// strides as q) are first written at position n - 1. With has_proj_bias, q, k_new and v_new
// are products still without their projections' biases (q_bias, k_bias, v_bias: (H*K,) in
// the accumulator type), added here first, each sum rounded to T as Linear.step's is.
// Then, as attention.py on arrays
// (attention_probabilities, then the product with v), each step rounded to T as there:
//   qs = q * scale,  s_j = qs . k_j,  p = softmax(s + bias) (as masked_softmax: a fully
//   masked row is 0),  out[r, h*K + c] = sum_j p_j v_jc      (out (R, H*K): heads merged)
// float16 computes in float32. n <= DECODE_MAX_KEYS, K <= DECODE_MAX_K (the caller checks).
#define DECODE_MAX_KEYS 1024
#define DECODE_MAX_K 256
template <typename T>
__global__ void decode_attention(const T* q, const T* k_new, const T* v_new, long long qr,
                                 long long qh, T* keys, T* values, long long ks, long long kh,
                                 long long kl, int group, const typename Acc<T>::type* bias,
                                 long long bs, int has_bias, int has_new,
                                 const typename Acc<T>::type* q_bias,
                                 const typename Acc<T>::type* k_bias,
                                 const typename Acc<T>::type* v_bias, int has_proj_bias, int n,
                                 int K, int H, double scale, T* out) {
    typedef Acc<T> C;
    typedef typename C::type A;
    __shared__ A shared[32];
    __shared__ A qs[DECODE_MAX_K];
    __shared__ A p[DECODE_MAX_KEYS];
    const long long r = blockIdx.x / H;
    const int h = blockIdx.x % H;
    const long long sentence = r / group;
    const long long qoff = r * qr + h * qh;
    T* kb = keys + sentence * ks + h * kh;
    T* vb = values + sentence * ks + h * kh;
    const int boff = h * K;
    if (has_new) {
        for (int c = threadIdx.x; c < K; c += blockDim.x) {
            T kv = k_new[qoff + c], vv = v_new[qoff + c];
            if (has_proj_bias) {
                kv = C::store(C::load(kv) + k_bias[boff + c]);
                vv = C::store(C::load(vv) + v_bias[boff + c]);
            }
            kb[(long long)(n - 1) * kl + c] = kv;
            vb[(long long)(n - 1) * kl + c] = vv;
        }
    }
    const A sc = A(scale);  // (the scale as T holds it: the caller rounds it)
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        A qv = C::load(q[qoff + c]);
        if (has_proj_bias) qv = C::load(C::store(qv + q_bias[boff + c]));
        qs[c] = C::load(C::store(qv * sc));
    }
    __syncthreads();  // qs, and the new key and value, for every thread
    const A* brow = has_bias ? bias + sentence * bs : 0;
    A m = C::neg_inf();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const T* kj = kb + (long long)j * kl;
        A d = 0;
        for (int c = 0; c < K; ++c) d += qs[c] * C::load(kj[c]);
        const A v = C::load(C::store(d)) + (brow ? brow[j] : A(0));
        p[j] = v;
        m = v > m ? v : m;
    }
    m = block_max(m, shared, C::neg_inf());
    if (!isfinite(m)) m = A(0);  // every key masked: exp(-inf - 0) = 0, no NaN
    A z = 0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const A e = exp(p[j] - m);
        p[j] = e;
        z += e;
    }
    z = block_sum(z, shared);
    if (z == A(0)) z = A(1);
    for (int j = threadIdx.x; j < n; j += blockDim.x) p[j] = C::load(C::store(p[j] / z));
    __syncthreads();  // every p, for every thread
    T* orow = out + r * (long long)H * K + (long long)h * K;
    for (int c = threadIdx.x; c < K; c += blockDim.x) {
        A acc = 0;
        for (int j = 0; j < n; ++j) acc += p[j] * C::load(vb[(long long)j * kl + c]);
        orow[c] = C::store(acc);
    }
}
"""

ROW_KERNELS = ("layer_norm_forward", "layer_norm_backward", "masked_softmax", "smoothed_ce_chunk",
               "top_m_log_softmax", "decode_attention", "bias_residual_layer_norm",
               "bias_relu")
TOP_M_MAX = 16  # the most candidates top_m_log_softmax takes per row (its TOP_M_MAX)
DECODE_MAX_KEYS, DECODE_MAX_K = 1024, 256  # decode_attention's limits (its #defines)
STORAGE_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "float",
                 np.dtype(np.float64): "double"}
ROW_KERNEL_OPTIONS = ("--std=c++14",)


def row_kernel_names():
    """The template instantiations compiled, e.g. 'layer_norm_forward<float>' (24 of them)."""
    return [f"{k}<{c}>" for k in ROW_KERNELS for c in STORAGE_TYPES.values()]


# ---- elementwise kernels: (in_params, out_params, operation, name) for cupy.ElementwiseKernel --
# NVRTC contracts a product followed by a sum into one fused multiply-add (--fmad=true, the
# default), which rounds once where the unfused ops round twice. Where a kernel must equal a
# chain of separate array ops bit for bit, its product goes through mul_rn (rounded on its
# own, never contracted); ELEMENTWISE_PREAMBLE is compiled ahead of every elementwise kernel.
ELEMENTWISE_PREAMBLE = """
template <typename T> __device__ T mul_rn(T a, T b) { return a * b; }
template <> __device__ float mul_rn<float>(float a, float b) { return __fmul_rn(a, b); }
template <> __device__ double mul_rn<double>(double a, double b) { return __dmul_rn(a, b); }
"""
ELEMENTWISE_SPECS = {
    # mask = [u >= rate] / (1 - rate),  y = x + f * mask   (ops.py Dropout on f, then x + f:
    # the product rounded before the sum, as the two ops round it)
    "dropout_residual": (
        "T x, T f, T u, T rate, T scale",
        "T y, T mask",
        "mask = u >= rate ? scale : T(0);\n"
        "y = x + mul_rn(f, mask);",
        "minitransformer_dropout_residual"),
    # g' = g + wd p;  m = b1 m + (1 - b1) g';  v = b2 v + (1 - b2) g'^2;
    # p -= (lr / c1) m / (sqrt(v / c2) + eps)   (optim/adam.py, with inv_c2 = 1 / c2)
    "adam_update": (
        "T grad, T lr_c1, T beta1, T one_minus_beta1, T beta2, T one_minus_beta2, "
        "T inv_c2, T eps, T wd",
        "T param, T m, T v",
        "T g = grad;\n"
        "if (wd != T(0)) g = g + wd * param;\n"
        "m = beta1 * m + one_minus_beta1 * g;\n"
        "v = beta2 * v + one_minus_beta2 * (g * g);\n"
        "param = param - lr_c1 * m / (sqrt(v * inv_c2) + eps);",
        "minitransformer_adam_update"),
}
