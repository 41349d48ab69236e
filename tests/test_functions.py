"""Every Function in ``minitransformer.engine.FUNCTIONS``, one table row (or more) each:

(a) forward against an independent naive formula (Python loops over scalars, or NumPy
    written another way), (b) a float64 gradcheck, once with gradcheck's random upstream
    weight and once through the non-linear head ((y + 1) ** 2).mean(), (c) float32 in ->
    float32 out and float32 gradients.
A Function without a row here fails ``test_every_function_has_a_gradcheck``.
"""
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import Tensor
from minitransformer.engine import FUNCTIONS, Function, ops
from minitransformer.engine.attention import ScaledDotProductAttention
from minitransformer.engine.cross_entropy import SoftmaxCrossEntropy
from minitransformer.engine.layernorm import LayerNorm
from minitransformer.engine.linear_cross_entropy import LinearCrossEntropy
from minitransformer.engine.residual import DropoutResidual
from minitransformer.engine.softmax import LogSoftmax, Softmax

DROPOUT_SEED = 7


# ---- naive references: Python scalars and loops, no engine code ---------------------------------
def elementwise(fn, *arrays):
    """fn applied to Python floats at every index of the broadcast shape."""
    arrays = np.broadcast_arrays(*arrays)
    out = np.empty(arrays[0].shape)
    for idx in np.ndindex(out.shape):
        out[idx] = fn(*(float(a[idx]) for a in arrays))
    return out


def naive_reduce(x, axis, keepdims, mean=False):
    axes = range(x.ndim) if axis is None else (axis,) if isinstance(axis, int) else axis
    axes = {a % x.ndim for a in axes}
    kept = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
    out = np.zeros(kept)
    for idx in np.ndindex(x.shape):
        out[tuple(0 if i in axes else j for i, j in enumerate(idx))] += float(x[idx])
    if mean:
        out /= math.prod(x.shape[a] for a in axes)
    if not keepdims:
        out = out.reshape(tuple(n for i, n in enumerate(x.shape) if i not in axes))
    return out


def naive_reshape(x, shape):
    out = np.empty(shape)
    for o, i in zip(np.ndindex(*shape), np.ndindex(*x.shape)):  # both in row-major order
        out[o] = x[i]
    return out


def naive_transpose(x, axes=None):
    axes = tuple(reversed(range(x.ndim))) if axes is None else axes
    out = np.empty(tuple(x.shape[a] for a in axes))
    for o in np.ndindex(out.shape):
        i = [0] * x.ndim
        for k, a in enumerate(axes):
            i[a] = o[k]
        out[o] = x[tuple(i)]
    return out


def naive_split_heads(x, H):
    B, T, D = x.shape
    K = D // H
    out = np.empty((B, H, T, K))
    for b, h, t, k in np.ndindex(B, H, T, K):
        out[b, h, t, k] = x[b, t, h * K + k]
    return out


def naive_merge_heads(x):
    B, H, T, K = x.shape
    out = np.empty((B, T, H * K))
    for b, h, t, k in np.ndindex(B, H, T, K):
        out[b, t, h * K + k] = x[b, h, t, k]
    return out


def naive_matmul(a, b):
    """Triple loop, batch axes broadcast; 1-D operands promoted and the axis removed after."""
    a2 = a[None, :] if a.ndim == 1 else a
    b2 = b[:, None] if b.ndim == 1 else b
    batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    A = np.broadcast_to(a2, batch + a2.shape[-2:])
    Bm = np.broadcast_to(b2, batch + b2.shape[-2:])
    M, N, P = A.shape[-2], A.shape[-1], Bm.shape[-1]
    out = np.zeros(batch + (M, P))
    for bi in np.ndindex(*batch):
        for i, j in np.ndindex(M, P):
            out[bi + (i, j)] = math.fsum(float(A[bi + (i, k)]) * float(Bm[bi + (k, j)])
                                         for k in range(N))
    if b.ndim == 1:
        out = out[..., 0]
    if a.ndim == 1:
        out = out[..., 0, :] if b.ndim > 1 else out[..., 0]
    return out


def naive_linear(x, w, b=None):
    rows = x.reshape(-1, x.shape[-1])
    out = np.array([[math.fsum(float(r[i]) * float(w[i, j]) for i in range(w.shape[0]))
                     + (float(b[j]) if b is not None else 0.0)
                     for j in range(w.shape[1])] for r in rows])
    return out.reshape(x.shape[:-1] + (w.shape[1],))


def naive_embedding(ids, w):
    out = np.empty(ids.shape + (w.shape[1],))
    for idx in np.ndindex(*ids.shape):
        out[idx] = w[int(ids[idx])]
    return out


def naive_softmax(x, log=False):
    out = np.empty(x.shape)
    for idx in np.ndindex(*x.shape[:-1]):
        row = [float(v) for v in x[idx]]
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(v - m) for v in row))
        out[idx] = [v - lse if log else math.exp(v - lse) for v in row]
    return out


def naive_layer_norm(x, g, b, eps=1e-5):
    mu = x.mean(axis=-1, keepdims=True)
    return (x - mu) / np.sqrt(np.var(x, axis=-1, keepdims=True) + eps) * g + b


def naive_attention(q, k, v, key_mask=None, causal=False):
    """One (batch, head, query) at a time, softmax over the visible keys only."""
    B, H, T, K = q.shape
    S = k.shape[2]
    out = np.zeros((B, H, T, v.shape[-1]))
    for b, h, i in np.ndindex(B, H, T):
        keys = [j for j in range(S) if (key_mask is None or key_mask[b, j])
                and (not causal or j <= i + S - T)]
        if not keys:
            continue  # attends to nothing: output 0
        s = [math.fsum(float(q[b, h, i, c]) * float(k[b, h, j, c]) for c in range(K))
             / math.sqrt(K) for j in keys]
        m = max(s)
        e = [math.exp(x - m) for x in s]
        z = math.fsum(e)
        for p, j in zip(e, keys):
            out[b, h, i] += p / z * v[b, h, j]
    return out


def naive_cross_entropy(z, t, eps, pad_id, smoothing):
    """sum over non-padding tokens of -sum_v q_v log softmax(z)_v, q built explicitly."""
    V = z.shape[-1]
    z, t = z.reshape(-1, V), t.reshape(-1)
    total = 0.0
    for n in range(len(t)):
        if pad_id is not None and t[n] == pad_id:
            continue
        if smoothing == "others":
            q = [1 - eps if v == t[n] else eps / (V - 1) for v in range(V)]
        else:
            q = [1 - eps + eps / V if v == t[n] else eps / V for v in range(V)]
        row = [float(x) for x in z[n]]
        m = max(row)
        lse = m + math.log(math.fsum(math.exp(x - m) for x in row))
        total += -math.fsum(qv * (x - lse) for qv, x in zip(q, row))
    return np.array(total)


# ---- the table ----------------------------------------------------------------------------------
@dataclass
class Case:
    id: str
    function: type                 # the Function this row exercises (the output's node)
    make: Callable                 # (arrays, dtype) -> list of inputs (ids stay integer)
    f: Callable                    # (*Tensors) -> Tensor
    ref: Optional[Callable] = None  # (*numpy inputs) -> numpy output; None: own test


def _away_from_zero(a):
    """Values with |x| >= 0.3: no kink of ReLU (or pole of 1/x) within the FD step."""
    xp = mt.get_array_module(a)
    return a + xp.sign(a) * a.dtype.type(0.3)


def _gen(t):
    """A fresh generator per call: every evaluation in gradcheck draws the same mask."""
    return mt.Generator(DROPOUT_SEED, device=t.device)


KEY_MASK = np.array([[True, True, True, False], [True, True, False, False]])
CE_TARGETS = np.array([[1, 0, 3], [2, 4, 0]])  # 0 is padding


def _mask(t):
    return mt.get_array_module(t.data).asarray(KEY_MASK)


def _targets(z):
    return mt.get_array_module(z.data).asarray(CE_TARGETS)


def _r(*shape):
    return lambda A, dt: [A.randn(*shape, dtype=dt)]


def _rr(s1, s2):
    return lambda A, dt: [A.randn(*s1, dtype=dt), A.randn(*s2, dtype=dt)]


CASES = [
    # elementwise, with broadcasting on either side
    Case("add", ops.Add, _rr((3, 4), (3, 4)), lambda a, b: a + b,
         lambda a, b: elementwise(lambda x, y: x + y, a, b)),
    Case("add_row", ops.Add, _rr((3, 4), (4,)), lambda a, b: a + b,
         lambda a, b: elementwise(lambda x, y: x + y, a, b)),
    Case("add_col", ops.Add, _rr((3, 4), (3, 1)), lambda a, b: a + b,
         lambda a, b: elementwise(lambda x, y: x + y, a, b)),
    Case("add_both", ops.Add, _rr((2, 1, 4), (3, 1)), lambda a, b: a + b,
         lambda a, b: elementwise(lambda x, y: x + y, a, b)),
    Case("sub_row", ops.Sub, _rr((3, 4), (4,)), lambda a, b: a - b,
         lambda a, b: elementwise(lambda x, y: x - y, a, b)),
    Case("sub_col", ops.Sub, _rr((3, 1), (3, 4)), lambda a, b: a - b,
         lambda a, b: elementwise(lambda x, y: x - y, a, b)),
    Case("mul", ops.Mul, _rr((3, 4), (3, 4)), lambda a, b: a * b,
         lambda a, b: elementwise(lambda x, y: x * y, a, b)),
    Case("mul_row", ops.Mul, _rr((3, 4), (4,)), lambda a, b: a * b,
         lambda a, b: elementwise(lambda x, y: x * y, a, b)),
    Case("mul_col", ops.Mul, _rr((3, 4), (3, 1)), lambda a, b: a * b,
         lambda a, b: elementwise(lambda x, y: x * y, a, b)),
    Case("mul_both", ops.Mul, _rr((3, 1), (2, 1, 4)), lambda a, b: a * b,
         lambda a, b: elementwise(lambda x, y: x * y, a, b)),
    Case("div_row", ops.Div,
         lambda A, dt: [A.randn(3, 4, dtype=dt), _away_from_zero(A.randn(4, dtype=dt))],
         lambda a, b: a / b, lambda a, b: elementwise(lambda x, y: x / y, a, b)),
    Case("div_col", ops.Div,
         lambda A, dt: [A.randn(3, 4, dtype=dt), _away_from_zero(A.randn(3, 1, dtype=dt))],
         lambda a, b: a / b, lambda a, b: elementwise(lambda x, y: x / y, a, b)),
    Case("neg", ops.Neg, _r(3, 4), lambda a: -a, lambda a: elementwise(lambda x: -x, a)),
    Case("power_3", ops.Power, _r(3, 4), lambda a: a ** 3,
         lambda a: elementwise(lambda x: x * x * x, a)),
    Case("power_sqrt", ops.Power, lambda A, dt: [A.uniform(0.5, 2.0, 3, 4, dtype=dt)],
         lambda a: a ** 0.5, lambda a: elementwise(math.sqrt, a)),
    Case("power_neg", ops.Power, lambda A, dt: [_away_from_zero(A.randn(3, 4, dtype=dt))],
         lambda a: F.power(a, -2), lambda a: elementwise(lambda x: 1.0 / (x * x), a)),
    Case("exp", ops.Exp, _r(3, 4), F.exp, lambda a: elementwise(math.exp, a)),
    Case("log", ops.Log, lambda A, dt: [A.uniform(0.5, 3.0, 3, 4, dtype=dt)], F.log,
         lambda a: elementwise(math.log, a)),
    Case("relu", ops.ReLU, lambda A, dt: [_away_from_zero(A.randn(3, 5, dtype=dt))], F.relu,
         lambda a: elementwise(lambda x: x if x > 0 else 0.0, a)),
    # reductions and shape
    Case("sum_all", ops.Sum, _r(3, 4), lambda a: a.sum(),
         lambda a: naive_reduce(a, None, False)),
    Case("sum_axis", ops.Sum, _r(3, 4, 2), lambda a: a.sum(axis=1),
         lambda a: naive_reduce(a, 1, False)),
    Case("sum_axes_keepdims", ops.Sum, _r(3, 4, 2), lambda a: a.sum(axis=(0, -1), keepdims=True),
         lambda a: naive_reduce(a, (0, -1), True)),
    Case("mean_all", ops.Mean, _r(3, 4), lambda a: a.mean(),
         lambda a: naive_reduce(a, None, False, mean=True)),
    Case("mean_last", ops.Mean, _r(3, 4, 2), lambda a: a.mean(axis=-1),
         lambda a: naive_reduce(a, -1, False, mean=True)),
    Case("mean_axes_keepdims", ops.Mean, _r(3, 4, 2), lambda a: a.mean(axis=(0, 2), keepdims=True),
         lambda a: naive_reduce(a, (0, 2), True, mean=True)),
    Case("reshape", ops.Reshape, _r(3, 4), lambda a: a.reshape(2, 6),
         lambda a: naive_reshape(a, (2, 6))),
    Case("reshape_infer", ops.Reshape, _r(2, 3, 4), lambda a: a.reshape((4, -1)),
         lambda a: naive_reshape(a, (4, 6))),
    Case("transpose_T", ops.Transpose, _r(3, 4), lambda a: a.T,
         lambda a: naive_transpose(a)),
    Case("transpose_axes", ops.Transpose, _r(2, 3, 4), lambda a: a.transpose(1, 2, 0),
         lambda a: naive_transpose(a, (1, 2, 0))),
    Case("transpose_tuple", ops.Transpose, _r(2, 3, 4), lambda a: a.transpose((2, 0, 1)),
         lambda a: naive_transpose(a, (2, 0, 1))),
    Case("split_heads", ops.SplitHeads, _r(2, 3, 6), lambda a: F.split_heads(a, 3),
         lambda a: naive_split_heads(a, 3)),
    Case("merge_heads", ops.MergeHeads, _r(2, 3, 2, 2), lambda a: F.merge_heads(a, 3),
         naive_merge_heads),
    # linear algebra
    Case("matmul", ops.MatMul, _rr((3, 4), (4, 5)), lambda a, b: a @ b, naive_matmul),
    Case("matmul_batched", ops.MatMul, _rr((2, 3, 4), (2, 4, 5)), lambda a, b: a @ b,
         naive_matmul),
    Case("matmul_batch_broadcast", ops.MatMul, _rr((2, 1, 3, 4), (3, 4, 5)), lambda a, b: a @ b,
         naive_matmul),
    Case("matmul_shared_rhs", ops.MatMul, _rr((2, 3, 4), (4, 5)), lambda a, b: a @ b,
         naive_matmul),
    Case("matmul_vector", ops.MatMul, _rr((2, 3, 4), (4,)), lambda a, b: a @ b, naive_matmul),
    Case("vector_matmul", ops.MatMul, _rr((4,), (2, 4, 5)), lambda a, b: a @ b, naive_matmul),
    Case("linear_bias", ops.Linear,
         lambda A, dt: [A.randn(2, 3, 4, dtype=dt), A.randn(4, 5, dtype=dt), A.randn(5, dtype=dt)],
         F.linear, naive_linear),
    Case("linear_no_bias", ops.Linear, _rr((3, 4), (4, 5)), lambda x, w: F.linear(x, w),
         naive_linear),
    # the dtype change itself is tested in test_mixed_precision.py; here the node in float64
    Case("cast", ops.Cast, _r(3, 4), lambda x: ops.cast(x, x.dtype), lambda x: x.copy()),
    # regularisation and lookup
    Case("dropout", ops.Dropout, _r(4, 6), lambda x: F.dropout(x, 0.4, _gen(x), training=True)),
    Case("dropout_residual", DropoutResidual, _rr((4, 6), (4, 6)),
         lambda x, f: F.dropout_residual(x, f, 0.4, _gen(x), training=True)),
    # indexing: a view (each place once), and integer arrays with a repeat (summed back)
    Case("index_slices", ops.Index, _r(3, 4, 2), lambda x: x[1:, None, ::2, -1],
         lambda x: x[1:, None, ::2, -1].copy()),
    Case("index_repeats", ops.Index, _r(4, 3),
         lambda x: x[np.array([[0, 2], [0, 3]]), 1:],
         lambda x: x[np.array([[0, 2], [0, 3]]), 1:].copy()),
    Case("index_mask", ops.Index, _r(2, 3), lambda x: x[np.array([True, False])],
         lambda x: x[np.array([True, False])].copy()),
    # no padding id among the ids here: the padding row's gradient is deliberately 0, not
    # the true derivative (test_autograd checks that row); repeated ids must accumulate
    Case("embedding", ops.Embedding,
         lambda A, dt: [A.asarray(np.array([[1, 2, 1], [4, 3, 3]])), A.randn(5, 3, dtype=dt)],
         lambda ids, w: F.embedding(ids, w, pad_id=0), naive_embedding),
    # fused
    Case("softmax", Softmax, _r(3, 5), F.softmax, naive_softmax),
    Case("softmax_3d", Softmax, _r(2, 2, 4), F.softmax, naive_softmax),
    Case("log_softmax", LogSoftmax, _r(2, 3, 5), F.log_softmax,
         lambda a: naive_softmax(a, log=True)),
    Case("layer_norm", LayerNorm,
         lambda A, dt: [A.randn(2, 3, 6, dtype=dt), A.randn(6, dtype=dt), A.randn(6, dtype=dt)],
         F.layer_norm, naive_layer_norm),
    Case("attention", ScaledDotProductAttention,
         lambda A, dt: [A.randn(2, 2, 3, 4, dtype=dt), A.randn(2, 2, 4, 4, dtype=dt),
                        A.randn(2, 2, 4, 4, dtype=dt)],
         F.scaled_dot_product_attention, naive_attention),
    Case("attention_key_mask", ScaledDotProductAttention,
         lambda A, dt: [A.randn(2, 2, 3, 4, dtype=dt), A.randn(2, 2, 4, 4, dtype=dt),
                        A.randn(2, 2, 4, 4, dtype=dt)],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, key_mask=_mask(q)),
         lambda q, k, v: naive_attention(q, k, v, key_mask=KEY_MASK)),
    Case("attention_causal", ScaledDotProductAttention,
         lambda A, dt: [A.randn(2, 2, 4, 3, dtype=dt), A.randn(2, 2, 4, 3, dtype=dt),
                        A.randn(2, 2, 4, 3, dtype=dt)],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, causal=True),
         lambda q, k, v: naive_attention(q, k, v, causal=True)),
    Case("attention_causal_tail", ScaledDotProductAttention,  # 2 new queries after 4 keys
         lambda A, dt: [A.randn(2, 2, 2, 3, dtype=dt), A.randn(2, 2, 4, 3, dtype=dt),
                        A.randn(2, 2, 4, 3, dtype=dt)],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, causal=True),
         lambda q, k, v: naive_attention(q, k, v, causal=True)),
    Case("attention_mask_and_causal", ScaledDotProductAttention,
         lambda A, dt: [A.randn(2, 2, 4, 3, dtype=dt), A.randn(2, 2, 4, 3, dtype=dt),
                        A.randn(2, 2, 4, 3, dtype=dt)],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, key_mask=_mask(q), causal=True),
         lambda q, k, v: naive_attention(q, k, v, key_mask=KEY_MASK, causal=True)),
    Case("attention_dropout", ScaledDotProductAttention,
         lambda A, dt: [A.randn(2, 2, 3, 4, dtype=dt), A.randn(2, 2, 4, 4, dtype=dt),
                        A.randn(2, 2, 4, 4, dtype=dt)],
         lambda q, k, v: F.scaled_dot_product_attention(q, k, v, key_mask=_mask(q), dropout=0.3,
                                                        rng=_gen(q), training=True)),
    Case("cross_entropy_others", SoftmaxCrossEntropy, _r(2, 3, 5),
         lambda z: F.softmax_cross_entropy(z, _targets(z), 0.1, pad_id=0)[0],
         lambda z: naive_cross_entropy(z, CE_TARGETS, 0.1, 0, "others")),
    Case("cross_entropy_uniform", SoftmaxCrossEntropy, _r(2, 3, 5),
         lambda z: F.softmax_cross_entropy(z, _targets(z), 0.2, pad_id=0, smoothing="uniform")[0],
         lambda z: naive_cross_entropy(z, CE_TARGETS, 0.2, 0, "uniform")),
    Case("cross_entropy_plain", SoftmaxCrossEntropy, _r(6, 5),
         lambda z: F.softmax_cross_entropy(z, _targets(z).reshape(-1))[0],
         lambda z: naive_cross_entropy(z, CE_TARGETS, 0.0, None, "others")),
    Case("linear_cross_entropy_vd", LinearCrossEntropy,
         lambda A, dt: [A.randn(2, 3, 4, dtype=dt), A.randn(5, 4, dtype=dt)],
         lambda h, w: F.linear_cross_entropy(h, w, _targets(h), 0.1, pad_id=0)[0],
         lambda h, w: naive_cross_entropy(h @ w.T, CE_TARGETS, 0.1, 0, "others")),
    Case("linear_cross_entropy_dv", LinearCrossEntropy,
         lambda A, dt: [A.randn(2, 3, 4, dtype=dt), A.randn(4, 5, dtype=dt)],
         lambda h, w: F.linear_cross_entropy(h, w, _targets(h), 0.2, pad_id=0,
                                             smoothing="uniform", layout="dv")[0],
         lambda h, w: naive_cross_entropy(h @ w, CE_TARGETS, 0.2, 0, "uniform")),
]
IDS = [c.id for c in CASES]


def _inputs(case, arrays, dtype):
    return case.make(arrays, dtype)


def _tensors(inputs):
    """Float inputs become leaves that require grad; integer ids stay constants."""
    return [Tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]


# ---- the coverage guard -------------------------------------------------------------------------
def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def test_every_function_has_a_gradcheck():
    covered = {c.function for c in CASES}
    missing = [f.__name__ for f in FUNCTIONS if f not in covered]
    assert not missing, f"Functions without a gradcheck row in CASES: {missing}"
    assert len(FUNCTIONS) == len(covered), (
        f"FUNCTIONS lists {len(FUNCTIONS)} Functions, the gradcheck table covers "
        f"{len(covered)}: {sorted(c.__name__ for c in covered)}")
    # and a Function defined in the package but left out of FUNCTIONS is caught too
    unlisted = sorted(c.__name__ for c in _all_subclasses(Function)
                      if c.__module__.startswith("minitransformer.") and c not in FUNCTIONS)
    assert not unlisted, f"Function subclasses missing from engine.FUNCTIONS: {unlisted}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_case_exercises_its_function(case, arrays):
    out = case.f(*_tensors(_inputs(case, arrays, np.float64)))
    assert type(out.node) is case.function, (
        f"{case.id}: output made by {type(out.node).__name__}, table says "
        f"{case.function.__name__}")


# ---- (a) forward against the naive formula ------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in CASES if c.ref is not None],
                         ids=[c.id for c in CASES if c.ref is not None])
def test_forward_matches_naive_formula(case, arrays, assert_close):
    inputs = _inputs(case, arrays, np.float64)
    out = case.f(*[Tensor(a) for a in inputs])
    expected = case.ref(*[arrays.numpy(a) for a in inputs])
    assert_close(out, expected, rtol=1e-12, atol=1e-12, what=f"{case.id} forward")


@pytest.mark.parametrize("rate", [0.25, 0.5])
def test_dropout_forward_zeroes_and_rescales(xp, arrays, rate, assert_close):
    x = arrays.uniform(1.0, 2.0, 40, 50)  # no zeros: a zero output means dropped
    y = arrays.numpy(F.dropout(Tensor(x), rate, mt.Generator(3, device=Tensor(x).device)))
    u = arrays.numpy(mt.Generator(3, device=Tensor(x).device).random(x.shape, np.float64))
    keep = u >= rate
    assert_close(y, np.where(keep, arrays.numpy(x) / (1 - rate), 0.0), 1e-15, 0, "dropout")
    assert abs(keep.mean() - (1 - rate)) < 0.05, f"kept fraction {keep.mean()} for rate={rate}"
    # off in eval mode or at rate = 0: the same tensor comes back
    t = Tensor(x, requires_grad=True)
    assert F.dropout(t, rate, mt.Generator(3), training=False) is t
    assert F.dropout(t, 0.0, mt.Generator(3)) is t
    with pytest.raises(ValueError, match="dropout rate"):
        F.dropout(t, 1.0, mt.Generator(3))


def test_softmax_rows_sum_to_one(arrays, assert_close):
    p = F.softmax(Tensor(arrays.randn(4, 7) * 5))
    assert_close(p.numpy().sum(-1), np.ones(4), 1e-14, 1e-14, "softmax row sums")
    assert (p.numpy() > 0).all()


# ---- (b) float64 gradcheck ----------------------------------------------------------------------
def _check(case, arrays, head):
    inputs = _inputs(case, arrays, np.float64)
    f = case.f if head is None else (lambda *a: head(case.f(*a)))
    report = mt.gradcheck(f, inputs)
    n_float = sum(a.dtype.kind == "f" for a in inputs)
    assert len(report) == n_float, f"{case.id}: checked {sorted(report)}"
    return report


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck(case, arrays):
    """gradcheck's own upstream gradient: a fixed random weight on every output element."""
    _check(case, arrays, head=None)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradcheck_nonlinear_head(case, arrays):
    """Upstream gradient dL/dy = 2 (y + 1) / n: depends on y, not a constant."""
    _check(case, arrays, head=lambda y: ((y + 1.0) ** 2).mean())


# ---- (c) dtype preservation ---------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_float32_in_float32_out(case, arrays):
    inputs = _inputs(case, arrays, np.float32)
    tensors = _tensors(inputs)
    out = case.f(*tensors)
    assert out.dtype == np.float32, f"{case.id}: output {out.dtype}"
    seed = arrays.randn(*out.shape, dtype=np.float32)
    out.backward(seed)
    for i, t in enumerate(tensors):
        if t.requires_grad:
            assert t.grad is not None, f"{case.id}: input[{i}] got no gradient"
            assert t.grad.dtype == np.float32, f"{case.id}: input[{i}] gradient {t.grad.dtype}"
            assert t.grad.shape == t.shape


SCALAR_OPS = {
    "x * 2.0": lambda x: x * 2.0,
    "2.0 * x": lambda x: 2.0 * x,
    "x + 1": lambda x: x + 1,
    "1 + x": lambda x: 1 + x,
    "x - 1.5": lambda x: x - 1.5,
    "1.5 - x": lambda x: 1.5 - x,
    "x / 3.0": lambda x: x / 3.0,
    "3.0 / x": lambda x: 3.0 / x,
    "x ** 2": lambda x: x ** 2,
    "x ** 0.5": lambda x: x ** 0.5,
    "x ** np.float64(1.5)": lambda x: x ** np.float64(1.5),
    "x * np.float64(2)": lambda x: x * np.float64(2.0),
    "np.float64(2) * x": lambda x: np.float64(2.0) * x,
    "x + float64 array": lambda x: x + np.linspace(0, 1, 4),
    "x.mean() * 0.1": lambda x: x.mean(axis=0) * 0.1,
    "layer_norm eps": lambda x: F.layer_norm(x, Tensor(np.ones(4, np.float32)),
                                            Tensor(np.zeros(4, np.float32)), eps=1e-5),
}


@pytest.mark.parametrize("name", list(SCALAR_OPS))
def test_python_scalar_operand_keeps_float32(name):
    x = Tensor(np.random.default_rng(0).uniform(0.5, 2.0, (3, 4)).astype(np.float32),
               requires_grad=True)
    y = SCALAR_OPS[name](x)
    assert y.dtype == np.float32, f"{name}: output {y.dtype}"
    y.sum().backward()
    assert x.grad.dtype == np.float32, f"{name}: gradient {x.grad.dtype}"
