"""Fused CuPy kernels for the GPU fast path: the same formulas as the NumPy ops, fewer passes.

Each function takes and returns raw CuPy arrays and computes exactly the formula of the
NumPy code named in its docstring, so it can be swapped in where ``xp is cupy`` and is
parity-tested against it (tests/test_cuda_kernels.py). Rounding differs only in summation
order and contracted multiply-adds.

    layer_norm_forward / layer_norm_backward    layernorm.py
    bias_residual_layer_norm                    a post-norm sub-layer's end in a decoding
                                                step: + bias, + residual, layernorm.py
    bias_relu_                                  a decoding step's x W_1 + b_1, then ReLU
    masked_softmax_                             attention.py (bias, softmax, masked rows)
    dropout_residual                            residual.py (DropoutResidual: dropout, then
                                                the residual add)
    smoothed_ce_chunk                           linear_cross_entropy.py, one chunk of rows
    top_m_log_softmax                           mt/selection.py top_m + log_softmax_at
    decode_attention                            attention.py on one query a row (a decoding
                                                step), merge_heads after it
    adam_update_                                optim/adam.py, one parameter array

Two kinds of kernel:
- row kernels (one thread block per row, CUDA templates in ``ROW_KERNELS_SOURCE``, in
  cuda_source.py) where a row-wise reduction (mean, max, sum) is followed by an elementwise
  pass over the same row;
- ``cupy.ElementwiseKernel`` (``ELEMENTWISE_SPECS``) where every element is independent.
Dtypes: float32 and float64; row kernels also take float16 and then accumulate in float32
(``Acc<T>::type`` is float for float16/float32, double for float64) and write the input dtype.

Nothing here imports CuPy: it comes from ``backend._cupy``, and kernels are compiled on first
use and cached in ``_kernels``, so this module imports (and ``available()`` says False)
where CuPy or a GPU is missing.
"""

import numpy as np

from .. import backend
from ..settings import SETTINGS
from .cuda_source import (  # noqa: F401  (the tests read the source through this module)
    ELEMENTWISE_PREAMBLE, ELEMENTWISE_SPECS, MAX_THREADS, ROW_KERNEL_OPTIONS, ROW_KERNELS,
    DECODE_MAX_K, DECODE_MAX_KEYS, ROW_KERNELS_SOURCE, STORAGE_TYPES, TOP_M_MAX,
    row_kernel_names)

_kernels = {}  # name -> compiled RawModule / ElementwiseKernel, built on first use


def available():
    """True when CuPy imports and sees a GPU: the only case where these kernels can run."""
    return backend.cupy_available()


def use_for(xp):
    """Whether the ops take the fused path for arrays of module ``xp``: on CuPy arrays,
    unless MINITRANSFORMER_FUSED=0 (then the ops run the same NumPy-style code on CuPy, the
    reference the kernels are tested against)."""
    return xp is not np and SETTINGS.fused


_gpu_seen = False  # set once CuPy has seen a GPU: launches do not ask the driver again


def _cupy():
    global _gpu_seen
    cp = backend._cupy
    if not _gpu_seen:
        if cp is None or not backend.cupy_available():
            raise RuntimeError(f"the CUDA kernels need CuPy and a GPU; {backend.CUPY_FIX}")
        _gpu_seen = True
    return cp


def _row_kernel(name, dtype):
    """The compiled instantiation ``name<T>`` for arrays of ``dtype``."""
    if np.dtype(dtype) not in STORAGE_TYPES:
        raise TypeError(f"{name}: dtype {np.dtype(dtype)} not supported "
                        "(float16, float32, float64)")
    module = _kernels.get("rows")
    if module is None:
        module = _kernels["rows"] = _cupy().RawModule(
            code=ROW_KERNELS_SOURCE, options=ROW_KERNEL_OPTIONS,
            name_expressions=row_kernel_names())
    return module.get_function(f"{name}<{STORAGE_TYPES[np.dtype(dtype)]}>")


ELEMENTWISE_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # dropout_residual, Adam


def _elementwise(name, dtype):
    if np.dtype(dtype) not in ELEMENTWISE_DTYPES:
        raise TypeError(f"{name}: dtype {np.dtype(dtype)} not supported (float32, float64)")
    kernel = _kernels.get(name)
    if kernel is None:
        kernel = _kernels[name] = _cupy().ElementwiseKernel(
            *ELEMENTWISE_SPECS[name], preamble=ELEMENTWISE_PREAMBLE)
    return kernel


def _threads(n):
    """Threads per block for a row of n elements: a multiple of 32, at most MAX_THREADS."""
    return int(min(MAX_THREADS, 32 * max(1, -(-n // 32))))


# ---- LayerNorm ---------------------------------------------------------------------------------
def layer_norm_forward(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last axis, as layernorm.py's forward: x (..., D), gamma, beta (D,).

    mean = sum(x) / D,  var = sum((x - mean)^2) / D,  rstd = 1 / sqrt(var + eps),
    x_hat = (x - mean) * rstd,  y = gamma * x_hat + beta.
    Returns (y, x_hat, rstd): y and x_hat (..., D) in x's dtype, rstd (..., 1) in the
    accumulation dtype (float16 input: statistics, gamma, beta and rstd in float32, as
    layernorm.py computes them). One block per row, two reduction passes.
    """
    cp = _cupy()
    x = cp.ascontiguousarray(x)
    D = x.shape[-1]
    acc = backend.accumulation_dtype(x.dtype)
    gamma = cp.ascontiguousarray(gamma, dtype=acc)
    beta = cp.ascontiguousarray(beta, dtype=acc)
    y, x_hat = cp.empty_like(x), cp.empty_like(x)
    rstd = cp.empty(x.shape[:-1] + (1,), dtype=acc)
    rows = x.size // D if D else 0
    if rows:
        _row_kernel("layer_norm_forward", x.dtype)(
            (rows,), (_threads(D),), (x, gamma, beta, y, x_hat, rstd, np.int32(D),
                                      np.float64(eps)))
    return y, x_hat, rstd


def layer_norm_backward(dy, x_hat, rstd, gamma):
    """Gradients of LayerNorm from what the forward saved, as layernorm.py's backward.

    dxh = dy * gamma,  dx = rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat))
    (one block per row), dgamma = sum over rows of dy * x_hat, dbeta = sum over rows of dy
    (CuPy reductions; products and sums in float32 for float16, so dy * x_hat cannot
    overflow where layernorm.py's would not). dy, x_hat (..., D), rstd (..., 1), gamma (D,)
    -> dx (..., D) in dy's dtype, dgamma (D,), dbeta (D,) in gamma's dtype.
    """
    cp = _cupy()
    acc = backend.accumulation_dtype(dy.dtype)
    dy, x_hat = cp.ascontiguousarray(dy), cp.ascontiguousarray(x_hat, dtype=dy.dtype)
    rstd = cp.ascontiguousarray(rstd, dtype=acc)
    param_dtype = gamma.dtype  # dgamma, dbeta in gamma's dtype (float32 master weights)
    gamma = cp.ascontiguousarray(gamma, dtype=acc)
    D = dy.shape[-1]
    dx = cp.empty_like(dy)
    rows = dy.size // D if D else 0
    if rows:
        _row_kernel("layer_norm_backward", dy.dtype)(
            (rows,), (_threads(D),), (dy, x_hat, rstd, gamma, dx, np.int32(D)))
    dy2 = backend.cast(dy.reshape(-1, D), acc)
    xh2 = backend.cast(x_hat.reshape(-1, D), acc)
    return dx, backend.cast((dy2 * xh2).sum(axis=0), param_dtype), \
        backend.cast(dy2.sum(axis=0), param_dtype)


def bias_residual_layer_norm(f, b, x, gamma, beta, eps=1e-5):
    """The end of a post-norm sub-layer in a decoding step (SublayerConnection.step): the
    sub-layer's last bias, the residual and LayerNorm, as the array ops compute them on a GPU,

        v = x + (f + b),  y = layer_norm_forward(v, gamma, beta, eps)[0]

    (each sum rounded to f's dtype; the same numbers as those calls, bit for bit, in one
    launch instead of three). f, x: (..., D) of one dtype, f the sub-layer's output before
    the bias; b, gamma, beta: (D,), in the accumulation dtype (float32 for float16 f).
    Returns y like f. One block per row."""
    cp = _cupy()
    if f.shape != x.shape or f.dtype != x.dtype:
        raise ValueError(f"bias_residual_layer_norm: f {tuple(f.shape)} {f.dtype} and x "
                         f"{tuple(x.shape)} {x.dtype} must match")
    f, x = cp.ascontiguousarray(f), cp.ascontiguousarray(x)
    D = f.shape[-1]
    acc = backend.accumulation_dtype(f.dtype)
    b, gamma, beta = (cp.ascontiguousarray(a, dtype=acc) for a in (b, gamma, beta))
    y = cp.empty_like(f)
    rows = f.size // D if D else 0
    if rows:
        _row_kernel("bias_residual_layer_norm", f.dtype)(
            (rows,), (_threads(D),), (f, b, x, gamma, beta, y, np.int32(D), np.float64(eps)))
    return y


def bias_relu_(h, b):
    """In place: h <- max(h + b, 0), the first feed-forward product of a decoding step
    finished (FeedForward.step), as Linear.step adds the bias (in h's dtype) and
    ``maximum(h, 0, out=h)`` then runs: the same numbers, one launch instead of two. h: C
    contiguous (..., F); b: (F,) in the accumulation dtype. Returns h. One block per row."""
    cp = _cupy()
    if not h.flags.c_contiguous:
        raise ValueError("bias_relu_ works in place and needs a C-contiguous array")
    F = h.shape[-1]
    b = cp.ascontiguousarray(b, dtype=backend.accumulation_dtype(h.dtype))
    rows = h.size // F if F else 0
    if rows:
        _row_kernel("bias_relu", h.dtype)((rows,), (_threads(F),), (h, b, np.int32(F)))
    return h


# ---- masked softmax ----------------------------------------------------------------------------
def masked_softmax_(s, bias=None):
    """In place: s <- softmax(s + bias) over the last axis, as attention.py's forward.

    s: C-contiguous (..., S), e.g. scores (B, H, T, S); bias: None or an additive mask
    (0 / -inf) that broadcasts to s, e.g. (B, 1, 1, S) or (T, S); it is read through strides,
    never expanded. Per row: v = s + bias, m = max v (0 if not finite), e = exp(v - m),
    z = sum e (1 if 0), s = e / z. A row whose keys are all masked becomes all zeros, no NaN.
    The two guards are applied with or without bias (they change nothing on a finite row).
    Returns s. One block per row; float16 computes in float32.
    """
    cp = _cupy()
    if not s.flags.c_contiguous:
        raise ValueError("masked_softmax_ works in place and needs a C-contiguous array")
    S = s.shape[-1]
    lead = s.shape[:-1]
    if bias is not None and len(lead) > 4:  # beyond (n0, n1, n2, n3) rows: add it first
        s += cp.asarray(bias, dtype=s.dtype)
        bias = None
    n = (1,) * (4 - len(lead)) + tuple(lead) if bias is not None else (1, 1, 1, 1)
    strides = (0, 0, 0, 0, 0)
    if bias is not None:
        b = cp.broadcast_to(cp.asarray(bias, dtype=s.dtype), s.shape)  # stride 0 where broadcast
        strides = (0,) * (4 - len(lead)) + tuple(st // b.itemsize for st in b.strides)
    rows = s.size // S if S else 0
    if rows:
        _row_kernel("masked_softmax", s.dtype)(
            (rows,), (_threads(S),),
            (s, b if bias is not None else s, np.int32(S),
             *(np.int64(k) for k in n[1:]), *(np.int64(k) for k in strides),
             np.int32(bias is not None)))
    return s


# ---- dropout + residual ------------------------------------------------------------------------
def dropout_residual(x, f, rate, u):
    """y = x + dropout(f): mask = [u >= rate] / (1 - rate) in x's dtype, y = x + f * mask.

    u: uniform [0, 1) of f's shape, drawn by the caller's generator (as ops.py Dropout draws
    it), so masks stay reproducible. Returns (y, mask); dropout's backward is dy * mask.
    One ElementwiseKernel, one thread per element, both outputs in one pass. rate < 1.
    """
    dt = np.dtype(x.dtype).type
    kernel = _elementwise("dropout_residual", x.dtype)
    return kernel(x, f, u, dt(rate), dt(1.0 / (1.0 - rate)))


# ---- cross-entropy chunk -----------------------------------------------------------------------
def smoothed_ce_chunk(z, t, valid, c_t, c_o, want_grad, z_sum=None):
    """Per-row label-smoothed cross-entropy of one chunk of logits, as the loop body of
    linear_cross_entropy.py.

    z: C-contiguous logits (n, V), float16/32/64, modified in place when want_grad;
    t: integer targets (n,) (padding rows may hold any value: they use class 0, like ``tc``);
    valid: bool (n,) or None (all valid); c_t, c_o: smoothing_weights(eps, V);
    z_sum: optional (n,) row sums of z; None computes sum_v z_nv here, while the NumPy code
    passes h_n . w_sum (the same value, rounded differently), which a caller may pass too.
    Per row, with c_d = c_t - c_o:
        m = max z,  s = sum exp(z - m),  lse = m + log s,
        row_loss = (lse - c_o * z_sum - c_d * z[t]) * valid
    Returns (row_loss, s), both (n,) in float32 for float16/float32 z, float64 for float64.
    If want_grad, z is overwritten with e' = exp(z - m) and e'[r, t_r] -= c_d * s_r (in z's
    dtype): exactly what linear_cross_entropy.py holds in ``z`` before ``scale``, so the
    caller goes on with scale = valid / s, dh = scale * (e' W) - valid c_o w_sum, and so on.
    If not, z is left unchanged. One block per row.
    """
    cp = _cupy()
    if not z.flags.c_contiguous:
        raise ValueError("smoothed_ce_chunk needs C-contiguous logits")
    n, V = z.shape
    acc = np.float64 if z.dtype == np.float64 else np.float32
    t = cp.ascontiguousarray(t, dtype=np.int64)
    valid = (cp.ones(n, dtype=bool) if valid is None
             else cp.ascontiguousarray(valid, dtype=bool))
    row_loss, s = cp.empty(n, dtype=acc), cp.empty(n, dtype=acc)
    has_z_sum = z_sum is not None
    z_sum = cp.ascontiguousarray(z_sum, dtype=acc) if has_z_sum else row_loss  # unread if None
    if n and V:
        _row_kernel("smoothed_ce_chunk", z.dtype)(
            (n,), (_threads(V),),
            (z, t, valid, z_sum, row_loss, s, np.int32(V), np.float64(c_o),
             np.float64(c_t - c_o), np.int32(has_z_sum), np.int32(bool(want_grad))))
    return row_loss, s


# ---- beam search's candidates ------------------------------------------------------------------
def top_m_log_softmax(z, m, skip=()):
    """The m best columns of each row of scores z (R, V) and their log-probabilities, as
    mt/selection.py's ``top_m`` then ``log_softmax_at`` (what beam search's candidate
    selection runs on NumPy):

        best[r] = the m largest z[r, j], j not in ``skip``, best first (ties: lower j first),
        lp[r, i] = z[r, best[r, i]] - max_j z[r, j] - log sum_j exp(z[r, j] - max_j z[r, j])

    Every column, ``skip``'s too, counts in the max and the sum. ``skip``: up to two column
    indices (padding and BOS; negative ones count from the end) that are never picked. z is
    read, not changed (top_m_log_softmax writes out none of the V - m other
    log-probabilities, and needs no sort: CuPy's argpartition sorts each whole row).
    m <= TOP_M_MAX, and each row has at least m columns outside ``skip``. Returns (best
    int64 (R, m), lp (R, m) in float32, float64 for float64 z). One block per row; float16
    computes in float32.
    """
    cp = _cupy()
    if not z.flags.c_contiguous:
        raise ValueError("top_m_log_softmax needs C-contiguous scores")
    R, V = z.shape
    if len(skip) > 2 or not all(-V <= int(j) < V for j in skip):
        raise ValueError(f"top_m_log_softmax: skip {tuple(skip)} must be at most two columns "
                         f"of the {V}")
    skip = tuple(int(j) % V for j in skip)  # (-1: the last column, as NumPy indexes)
    if not 1 <= m <= TOP_M_MAX or m > V - len(set(skip)):
        raise ValueError(f"top_m_log_softmax: m={m} must be in [1, {TOP_M_MAX}] and leave "
                         f"m columns of {V} outside {skip}")
    skip += (-1,) * (2 - len(skip))  # (-1 in the kernel: no column)
    acc = np.float64 if z.dtype == np.float64 else np.float32
    best, lp = cp.empty((R, m), dtype=np.int64), cp.empty((R, m), dtype=acc)
    if R:
        _row_kernel("top_m_log_softmax", z.dtype)(
            (R,), (_threads(V),),
            (z, best, lp, np.int32(V), np.int32(m), np.int64(skip[0]), np.int64(skip[1])))
    return best, lp


# ---- a decoding step's attention ---------------------------------------------------------------
DECODE_STEP_KERNELS = True  # False: a decoding step without decode_attention,
# bias_residual_layer_norm and bias_relu_, as before them (bench/decode_kernels_ab.py)


def step_kernels(xp):
    """Whether a decoding step on arrays of module ``xp`` runs decode_attention,
    bias_residual_layer_norm and bias_relu_: on the fused path (``use_for``) unless
    DECODE_STEP_KERNELS is off."""
    return use_for(xp) and DECODE_STEP_KERNELS


def fits_decode_attention(xp, K, n):
    """Whether decode_attention takes a step's attention on arrays of module ``xp``
    (``step_kernels``): heads of K <= DECODE_MAX_K values, n <= DECODE_MAX_KEYS keys."""
    return step_kernels(xp) and 1 <= K <= DECODE_MAX_K and 1 <= n <= DECODE_MAX_KEYS


def _elements(a, axis, what):
    """a's stride along ``axis`` in elements (a whole number of them: checked)."""
    st = a.strides[axis]
    if st % a.itemsize:
        raise ValueError(f"decode_attention: {what} has a stride of {st} bytes, not a whole "
                         "number of elements")
    return st // a.itemsize


def decode_attention(q, keys, values, n, group=1, bias=None, k_new=None, v_new=None,
                     q_bias=None, k_bias=None, v_bias=None):
    """One decoding step's attention, as attention.py's arrays then merge_heads (what
    MultiHeadAttention.step runs on NumPy), in one kernel:

        qs = q * (1 / sqrt(K)),  s_j = qs . keys[i, h, j]  (j < n),
        p = softmax(s + bias[i]) over j (a fully masked row: 0),
        out[r, h*K:(h+1)*K] = sum_j p_j values[i, h, j]           with i = r // group

    q: (R, H, K), or (R, H, 1, K) (the query heads of the fused q/k/v product: a view with
    row and head strides; a head's K values contiguous). keys, values: (N, H, L, K) with
    L >= n, K contiguous (a self-attention cache's buffers, or a sentence's encoder-decoder
    keys and values, shared by its ``group`` rows). bias: None, or the additive key mask
    (N, ..., S) in the accumulator dtype (engine/attention.key_bias), S >= n, contiguous
    along S. k_new, v_new (self-attention; group 1): this step's keys and values, strides as
    q, written at position n - 1 of keys and values first (the cache's append). q_bias
    (and with k_new, k_bias and v_bias): (H*K,), the projections' biases (used in the
    accumulation dtype), when q (k_new, v_new) are the products without them: added first, as
    Linear.step adds them (one launch fewer each). Each step is
    rounded to q's dtype as the array ops round it; float16 accumulates in float32; only
    the summation order differs. Returns out (R, H*K) in q's dtype. One block per (row,
    head) (``fits_decode_attention`` says which sizes).
    """
    cp = _cupy()
    R, H, K = q.shape[0], q.shape[1], q.shape[-1]
    if q.ndim not in (3, 4) or q.size != R * H * K:
        raise ValueError(f"decode_attention: q must be (R, H, K) or (R, H, 1, K), got "
                         f"{tuple(q.shape)}")
    if keys.ndim != 4 or keys.shape != values.shape or keys.strides != values.strides \
            or keys.shape[1] != H or keys.shape[3] != K:
        raise ValueError(f"decode_attention: keys and values must be (N, {H}, L, {K}) alike, "
                         f"got {tuple(keys.shape)} and {tuple(values.shape)}")
    if not 1 <= n <= min(keys.shape[2], DECODE_MAX_KEYS) or K > DECODE_MAX_K:
        raise ValueError(f"decode_attention: n={n} keys of {keys.shape[2]} (at most "
                         f"{DECODE_MAX_KEYS}) and K={K} (at most {DECODE_MAX_K})")
    if (R + group - 1) // group > keys.shape[0]:
        raise ValueError(f"decode_attention: {R} rows in groups of {group} need "
                         f"{(R + group - 1) // group} sentences, keys hold {keys.shape[0]}")
    for a, what in ((q, "q"), (keys, "keys"), (values, "values"), (k_new, "k_new"),
                    (v_new, "v_new")):
        if a is not None and (a.dtype != q.dtype or a.strides[-1] != a.itemsize):
            raise ValueError(f"decode_attention: {what} must be {q.dtype} with its last axis "
                             "contiguous")
    has_new = k_new is not None
    if has_new and (v_new is None or k_new.shape != q.shape or v_new.shape != q.shape
                    or k_new.strides != q.strides or v_new.strides != q.strides or group != 1):
        raise ValueError("decode_attention: k_new and v_new come together, shaped and strided "
                         "as q, with group 1")
    acc = backend.accumulation_dtype(q.dtype)
    proj = [q_bias] + ([k_bias, v_bias] if has_new else [])
    has_proj_bias = q_bias is not None
    if any((b is None) == has_proj_bias for b in proj) or (not has_new and (
            k_bias is not None or v_bias is not None)):
        raise ValueError("decode_attention: q_bias comes with k_bias and v_bias when k_new is "
                         "given, and alone otherwise")
    for b in proj if has_proj_bias else ():
        if b.shape != (H * K,):
            raise ValueError(f"decode_attention: a projection bias must be ({H * K},), got "
                             f"{tuple(b.shape)}")
    if has_proj_bias:  # (in the accumulation dtype: float16 biases widen exactly)
        q_bias, k_bias, v_bias = (None if b is None else cp.ascontiguousarray(b, dtype=acc)
                                  for b in (q_bias, k_bias, v_bias))
    bs = 0
    if bias is not None:
        if bias.dtype != acc or bias.strides[-1] != bias.itemsize or bias.shape[-1] < n \
                or bias.shape[0] != keys.shape[0]:
            raise ValueError(f"decode_attention: bias must be ({keys.shape[0]}, ..., S >= {n}) "
                             f"in {np.dtype(acc)}, contiguous along S")
        bs = _elements(bias, 0, "bias")
    out = cp.empty((R, H * K), dtype=q.dtype)
    none = cp.empty(1, dtype=acc)  # (for the pointers a launch does not read)
    if R:
        scale = float(np.dtype(q.dtype).type(1.0 / np.sqrt(K)))  # rounded as q * scale rounds
        _row_kernel("decode_attention", q.dtype)(
            (R * H,), (_threads(max(K, n)),),
            (q, k_new if has_new else q, v_new if has_new else q,
             np.int64(_elements(q, 0, "q")), np.int64(_elements(q, 1, "q")),
             keys, values, np.int64(_elements(keys, 0, "keys")),
             np.int64(_elements(keys, 1, "keys")), np.int64(_elements(keys, 2, "keys")),
             np.int32(group), bias if bias is not None else none,
             np.int64(bs), np.int32(bias is not None), np.int32(has_new),
             *(b if b is not None else none for b in (q_bias, k_bias, v_bias)),
             np.int32(has_proj_bias), np.int32(n), np.int32(K), np.int32(H),
             np.float64(scale), out))
    return out


# ---- Adam --------------------------------------------------------------------------------------
def adam_update_(param, grad, m, v, lr, beta1, beta2, eps, c1, c2, weight_decay=0.0):
    """One Adam step on one parameter array, in place (param, m, v), as optim/adam.py:

        g' = g + wd * p,  m = b1 m + (1 - b1) g',  v = b2 v + (1 - b2) g'^2,
        p -= (lr / c1) * m / (sqrt(v / c2) + eps)      with c1 = 1 - b1^t, c2 = 1 - b2^t.
    Constants are rounded to param's dtype as adam.py does. One ElementwiseKernel, one thread
    per element, reading p, g, m, v once and writing p, m, v once. Returns param.
    """
    dt = np.dtype(param.dtype).type
    kernel = _elementwise("adam_update", param.dtype)
    kernel(grad, dt(lr / c1), dt(beta1), dt(1 - beta1), dt(beta2), dt(1 - beta2),
           dt(1.0 / c2), dt(eps), dt(weight_decay), param, m, v)
    return param
