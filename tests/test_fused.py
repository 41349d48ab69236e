"""Fused Functions equal the same computation composed from primitive Functions.

Values and gradients, in float64, to a tight tolerance: LayerNorm, Softmax, LogSoftmax,
ScaledDotProductAttention (masks, dropout) and SoftmaxCrossEntropy (label smoothing,
padding). Plus the edge cases the fused forms promise: attention rows with every key masked
give 0 and no NaN, softmax of logits around 1e4 is finite, and the cross-entropy closed form.
"""
import math

import numpy as np
import pytest

import minitransformer as mt
import minitransformer.functional as F
from minitransformer import Tensor

RTOL, ATOL = 1e-10, 1e-12  # float64: the two forms differ only by rounding order


def run(fn, inputs, w):
    """Output and gradients of every float input for L = sum(w * (y + 1) ** 2) (a structured
    upstream gradient, dL/dy = 2 w (y + 1))."""
    ts = [Tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]
    y = fn(*ts)
    (((y + 1.0) ** 2) * Tensor(w)).sum().backward()
    return y, [t.grad for t in ts if t.requires_grad]


def assert_same(fused, composed, inputs, arrays, assert_close, what):
    out = fused(*[Tensor(a) for a in inputs])
    w = arrays.randn(*out.shape)
    y1, g1 = run(fused, inputs, w)
    y2, g2 = run(composed, inputs, w)
    assert_close(y1, y2, RTOL, ATOL, f"{what}: value")
    assert len(g1) == len(g2)
    for i, (a, b) in enumerate(zip(g1, g2)):
        assert_close(a, b, RTOL, ATOL, f"{what}: gradient of input {i}")


# ---- LayerNorm ----------------------------------------------------------------------------------
def composed_layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(axis=-1, keepdims=True)
    xc = x - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return xc * (var + eps) ** -0.5 * gamma + beta


@pytest.mark.parametrize("shape", [(4, 8), (2, 3, 6)])
def test_layer_norm_equals_primitives(xp, arrays, assert_close, shape):
    D = shape[-1]
    inputs = [arrays.randn(*shape) * 3 + 1, arrays.randn(D), arrays.randn(D)]
    assert_same(F.layer_norm, composed_layer_norm, inputs, arrays, assert_close, "layer_norm")


def test_layer_norm_eps_is_used(xp, arrays, assert_close):
    x, g, b = arrays.randn(3, 4) * 1e-3, arrays.asarray(np.ones(4)), arrays.asarray(np.zeros(4))
    assert_same(lambda *a: F.layer_norm(*a, eps=0.1), lambda *a: composed_layer_norm(*a, eps=0.1),
                [x, g, b], arrays, assert_close, "layer_norm eps=0.1")


# ---- Softmax and LogSoftmax ---------------------------------------------------------------------
def _row_max(x):
    """A constant shift (no gradient): softmax and its gradient do not depend on it."""
    return Tensor(x.data.max(axis=-1, keepdims=True))


def composed_softmax(x):
    e = (x - _row_max(x)).exp()
    return e / e.sum(axis=-1, keepdims=True)


def composed_log_softmax(x):
    y = x - _row_max(x)
    return y - y.exp().sum(axis=-1, keepdims=True).log()


@pytest.mark.parametrize("fused,composed", [(F.softmax, composed_softmax),
                                            (F.log_softmax, composed_log_softmax)],
                         ids=["softmax", "log_softmax"])
def test_softmax_equals_primitives(xp, arrays, assert_close, fused, composed):
    inputs = [arrays.randn(2, 3, 7) * 4]
    assert_same(fused, composed, inputs, arrays, assert_close, fused.__name__)


def test_softmax_stable_for_large_logits(xp, arrays, assert_close):
    x = arrays.asarray(np.array([[1e4, 0.0, -1e4], [1e4, 1e4, 1e4 - 1.0], [-1e4, -1e4, -1e4]]))
    e = math.exp(-1.0)
    expected_p = np.array([[1, 0, 0], [1 / (2 + e), 1 / (2 + e), e / (2 + e)], [1 / 3] * 3])
    expected_logp = np.log(np.where(expected_p > 0, expected_p, 1.0)) + \
        np.array([[0, -1e4, -2e4], [0, 0, 0], [0, 0, 0]])
    for fn, expected in ((F.softmax, expected_p), (F.log_softmax, expected_logp)):
        t = Tensor(x, requires_grad=True)
        y = fn(t)
        assert np.isfinite(y.numpy()).all(), f"{fn.__name__}: {y.numpy()}"
        assert_close(y, expected, 1e-14, 1e-14, fn.__name__)
        (y * Tensor(arrays.randn(3, 3))).sum().backward()
        assert np.isfinite(arrays.numpy(t.grad)).all(), f"{fn.__name__} gradient: {t.grad}"


# ---- ScaledDotProductAttention ------------------------------------------------------------------
NEG = -1e30  # additive mask for the composed form: exp(-1e30 - max) == 0 exactly in float64


def additive_mask(B, T, S, key_mask=None, causal=False):
    """(B, 1, T, S): 0 where query i may attend key j, NEG elsewhere; written with loops."""
    bias = np.zeros((B, 1, T, S))
    for b, i, j in np.ndindex(B, T, S):
        if (key_mask is not None and not key_mask[b, j]) or (causal and j > i + S - T):
            bias[b, 0, i, j] = NEG
    return bias


def composed_attention(q, k, v, bias, keep=None):
    """softmax(q k^T / sqrt(K) + bias) [* keep] v, from MatMul, Transpose, Mul, Add, Softmax."""
    K = q.shape[-1]
    s = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / math.sqrt(K)) + Tensor(bias)
    p = F.softmax(s)
    if keep is not None:
        p = p * Tensor(keep)
    return p @ v


MASK = np.array([[True, True, True, False, True], [True, False, True, False, False]])


@pytest.mark.parametrize("T,S,use_mask,causal", [
    (3, 5, False, False), (3, 5, True, False), (5, 5, False, True), (5, 5, True, True),
    (2, 5, True, True),  # causal with 2 new queries at the end of 5 keys (incremental decoding)
], ids=["plain", "key_mask", "causal", "key_mask+causal", "causal_tail"])
def test_attention_equals_primitives(xp, arrays, assert_close, T, S, use_mask, causal):
    B, H, K = 2, 2, 4
    q, k, v = arrays.randn(B, H, T, K), arrays.randn(B, H, S, K), arrays.randn(B, H, S, K)
    key_mask = MASK if use_mask else None
    bias = arrays.asarray(additive_mask(B, T, S, key_mask, causal))
    km = arrays.asarray(key_mask) if use_mask else None
    assert_same(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, key_mask=km,
                                                               causal=causal),
                lambda q, k, v: composed_attention(q, k, v, bias),
                [q, k, v], arrays, assert_close, "attention")


@pytest.mark.parametrize("rate", [0.2, 0.5])
def test_attention_dropout_equals_primitives(xp, arrays, assert_close, rate):
    B, H, T, S, K = 2, 2, 4, 5, 3
    q, k, v = arrays.randn(B, H, T, K), arrays.randn(B, H, S, K), arrays.randn(B, H, S, K)
    device = Tensor(q).device
    bias = arrays.asarray(additive_mask(B, T, S, MASK, causal=True))
    # the composed form draws the same uniforms from a generator in the same state
    u = mt.Generator(11, device=device).random((B, H, T, S), np.float64)
    keep = (u >= rate) * (1.0 / (1.0 - rate))
    assert 0 < float((u < rate).mean()) < 1, "some probabilities are dropped, some kept"
    fused = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, key_mask=arrays.asarray(MASK), causal=True, dropout=rate,
        rng=mt.Generator(11, device=device), training=True)
    assert_same(fused, lambda q, k, v: composed_attention(q, k, v, bias, keep),
                [q, k, v], arrays, assert_close, f"attention dropout {rate}")
    # not training: no dropout, whatever the rate
    off = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v), dropout=rate,
                                         rng=mt.Generator(11, device=device), training=False)
    on_free = F.scaled_dot_product_attention(Tensor(q), Tensor(k), Tensor(v))
    assert_close(off, on_free, 0, 0, "attention with training=False")


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_residual_equals_add_of_dropout(xp, arrays, assert_close, rate):
    """x + dropout(f) fused equals the two primitives, bit for bit (same draws, same sums);
    off (x + f) when not training or at rate 0."""
    x, f = arrays.randn(3, 5, 8), arrays.randn(3, 5, 8)
    device = Tensor(x).device
    fused = lambda x, f: F.dropout_residual(x, f, rate, mt.Generator(5, device=device))  # noqa
    composed = lambda x, f: x + F.dropout(f, rate, mt.Generator(5, device=device))  # noqa
    w = arrays.randn(3, 5, 8)
    y1, g1 = run(fused, [x, f], w)
    y2, g2 = run(composed, [x, f], w)
    assert_close(y1, y2, 0, 0, f"dropout_residual {rate}: value")
    for a, b in zip(g1, g2):
        assert_close(a, b, 0, 0, f"dropout_residual {rate}: gradient")
    assert 0 < float((arrays.numpy(y1) == arrays.numpy(x)).mean()) < 1  # some dropped
    for off in (F.dropout_residual(Tensor(x), Tensor(f), rate, None, training=False),
                F.dropout_residual(Tensor(x), Tensor(f), 0.0, None)):
        assert_close(off, arrays.numpy(x) + arrays.numpy(f), 0, 0, "no dropout")
    with pytest.raises(ValueError, match="dropout rate"):
        F.dropout_residual(Tensor(x), Tensor(f), 1.0, mt.Generator(5))


def test_attention_fully_masked_rows_are_zero_not_nan(xp, arrays, assert_close):
    B, H, T, S, K = 2, 2, 3, 4, 3
    key_mask = arrays.asarray(np.array([[True, True, False, True], [False] * 4]))
    q, k, v = arrays.randn(B, H, T, K), arrays.randn(B, H, S, K), arrays.randn(B, H, S, K)
    for rate in (0.0, 0.3):
        ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
        out = F.scaled_dot_product_attention(*ts, key_mask=key_mask, dropout=rate,
                                             rng=mt.Generator(0, device=ts[0].device),
                                             training=rate > 0)
        store = [arrays.numpy(F.attention_probabilities(q, k, key_mask))]  # the op's p
        o = out.numpy()
        assert not np.isnan(o).any(), f"NaN in the output (dropout {rate})"
        assert_close(o[1], np.zeros((H, T, K)), 0, 0, "output of the fully masked batch row")
        assert_close(store[0][1], np.zeros((H, T, S)), 0, 0, "probabilities, fully masked")
        assert_close(store[0][0].sum(-1), np.ones((H, T)), 1e-14, 1e-14, "probability sums")
        assert_close(store[0][0][..., 2], np.zeros((H, T)), 0, 0, "probability of a padding key")
        (out * Tensor(arrays.randn(*out.shape))).sum().backward()
        for name, t in zip("qkv", ts):
            g = arrays.numpy(t.grad)
            assert np.isfinite(g).all(), f"d{name} not finite (dropout {rate})"
            assert_close(g[1], np.zeros(g[1].shape), 0, 0, f"d{name} of the fully masked row")
        assert_close(arrays.numpy(ts[1].grad)[0, :, 2], np.zeros((H, K)), 0, 0, "dk, padding key")
        assert_close(arrays.numpy(ts[2].grad)[0, :, 2], np.zeros((H, K)), 0, 0, "dv, padding key")


def test_attention_causal_rows_before_first_key_are_zero(xp, arrays):
    """causal with T > S: query i sees keys j <= i - (T - S); the first T - S see none."""
    q, k, v = (Tensor(arrays.randn(1, 1, n, 2), requires_grad=True) for n in (4, 2, 2))
    out = F.scaled_dot_product_attention(q, k, v, causal=True)
    o = out.numpy()
    assert not np.isnan(o).any()
    assert (o[0, 0, :2] == 0).all() and (o[0, 0, 2:] != 0).all(), o
    out.sum().backward()
    assert np.isfinite(arrays.numpy(q.grad)).all() and (arrays.numpy(q.grad)[0, 0, :2] == 0).all()


def test_attention_large_scores_are_finite(xp, arrays, assert_close):
    q, k, v = (arrays.randn(1, 2, 3, 4) * c for c in (300, 300, 1))
    ts = [Tensor(a, requires_grad=True) for a in (q, k, v)]
    out = F.scaled_dot_product_attention(*ts, causal=True)
    assert np.isfinite(out.numpy()).all()
    out.sum().backward()
    assert all(np.isfinite(arrays.numpy(t.grad)).all() for t in ts)


# ---- SoftmaxCrossEntropy ------------------------------------------------------------------------
def smoothed_targets(t, V, eps, pad_id, smoothing):
    """The explicit smoothed distribution q (..., V); all-zero rows at padding targets."""
    other = eps / (V - 1) if smoothing == "others" else eps / V
    target = 1 - eps if smoothing == "others" else 1 - eps + eps / V
    q = np.full(t.shape + (V,), other)
    for idx in np.ndindex(*t.shape):
        q[idx + (t[idx],)] = target
        if pad_id is not None and t[idx] == pad_id:
            q[idx] = 0.0
    return q


TARGETS = np.array([[3, 1, 0, 0], [2, 2, 5, 0]])  # pad_id 0 ends each row


@pytest.mark.parametrize("eps,smoothing", [(0.0, "others"), (0.1, "others"), (0.1, "uniform"),
                                           (0.3, "uniform")])
def test_cross_entropy_equals_log_softmax_composition(xp, arrays, assert_close, eps, smoothing):
    V = 6
    t = arrays.asarray(TARGETS)
    q = arrays.asarray(smoothed_targets(TARGETS, V, eps, 0, smoothing))
    assert_close(q.sum(-1), (TARGETS != 0).astype(float), 1e-15, 1e-15, "q sums to 1")
    assert_same(lambda z: F.softmax_cross_entropy(z, t, eps, pad_id=0, smoothing=smoothing)[0],
                lambda z: -(F.log_softmax(z) * Tensor(q)).sum(),
                [arrays.randn(2, 4, V) * 2], arrays, assert_close, f"cross-entropy {smoothing}")


@pytest.mark.parametrize("smoothing", ["others", "uniform"])
def test_cross_entropy_closed_form(xp, arrays, assert_close, smoothing):
    """Loss, token count and dz by hand in NumPy: lse - sum_v q_v z_v; dz = p - q."""
    eps, V = 0.1, 6
    z = np.random.default_rng(1).standard_normal((2, 4, V)) * 3
    zt = Tensor(arrays.asarray(z), requires_grad=True)
    loss, n = F.softmax_cross_entropy(zt, arrays.asarray(TARGETS), eps, pad_id=0,
                                      smoothing=smoothing)
    valid = TARGETS != 0
    assert n == int(valid.sum()) == 5 and isinstance(n, int)
    lse = np.log(np.exp(z).sum(-1))  # |z| is small: no shift needed
    if smoothing == "others":
        q_t, q_o = 1 - eps, eps / (V - 1)
    else:
        q_t, q_o = 1 - eps + eps / V, eps / V
    z_t = np.take_along_axis(z, TARGETS[..., None], -1)[..., 0]
    per_token = lse - q_o * (z.sum(-1) - z_t) - q_t * z_t
    assert loss.shape == ()
    assert_close(loss, (per_token * valid).sum(), 1e-13, 0, f"CE loss ({smoothing})")
    loss.backward()
    p = np.exp(z - lse[..., None])
    q = np.where(np.arange(V) == TARGETS[..., None], q_t, q_o)
    assert_close(zt.grad, (p - q) * valid[..., None], 1e-13, 1e-15, f"CE dz ({smoothing})")


def test_cross_entropy_uniform_logits_is_log_v(xp, arrays, assert_close):
    """With equal logits every log p_v = -log V, so any q (summing to 1) gives log V."""
    for smoothing in ("others", "uniform"):
        loss, n = F.softmax_cross_entropy(Tensor(arrays.asarray(np.zeros((2, 4, 6)))),
                                          arrays.asarray(TARGETS), 0.1, pad_id=0,
                                          smoothing=smoothing)
        assert_close(loss, np.array(5 * math.log(6)), 1e-14, 0, f"uniform logits ({smoothing})")


def test_cross_entropy_large_logits_and_all_padding(xp, arrays, assert_close):
    z = Tensor(arrays.asarray(np.array([[1e4, 0.0, -1e4], [0.0, 1e4, 0.0]])), requires_grad=True)
    loss, n = F.softmax_cross_entropy(z, arrays.asarray(np.array([0, 2])), 0.0)
    assert n == 2
    assert_close(loss, np.array(1e4), 1e-14, 0, "CE at 1e4 logits")  # 0 + (1e4 - 0)
    loss.backward()
    assert_close(z.grad, np.array([[0, 0, 0], [0, 1, -1.0]]), 0, 1e-15, "CE dz at 1e4 logits")
    z = Tensor(arrays.randn(2, 3), requires_grad=True)
    loss, n = F.softmax_cross_entropy(z, arrays.asarray(np.array([0, 0])), 0.1, pad_id=0)
    assert n == 0 and loss.item() == 0.0
    loss.backward()
    assert (arrays.numpy(z.grad) == 0).all()


def test_cross_entropy_rejects_bad_arguments(xp, arrays):
    z = Tensor(arrays.randn(2, 3, 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        F.softmax_cross_entropy(z, arrays.asarray(np.array([[1, 5, 0], [0, 0, 0]])), pad_id=0)
    with pytest.raises(ValueError, match="does not match"):
        F.softmax_cross_entropy(z, arrays.asarray(np.array([1, 2])))
    with pytest.raises(ValueError, match="smoothing"):
        F.softmax_cross_entropy(z, arrays.asarray(np.ones((2, 3), int)), 0.1, smoothing="bogus")


class _DeviceIds(np.ndarray):
    """Ids on a stand-in device: reading anything back from them fails the test."""
    def _read(self, *a, **k):
        raise AssertionError("the targets were read back from the device")
    max = min = sum = __int__ = __bool__ = _read


class _Device:
    asarray = staticmethod(lambda a: np.asarray(a).view(_DeviceIds))


def test_host_targets_are_checked_and_counted_on_the_host():
    # a NumPy batch for a model on a GPU: the range check and the token count must not read
    # the device (each read would make the step wait for its forward pass)
    from minitransformer.engine.cross_entropy import checked_targets
    t = np.array([[5, 2, 0], [7, 0, 0]])
    ids, n = checked_targets(t, (2, 3), 8, 0, _Device, "logits")
    assert isinstance(ids, _DeviceIds) and (np.asarray(ids) == t).all() and n == 3
    for bad in ([[5, 8, 0], [7, 0, 0]], [[5, -1, 0], [7, 0, 0]]):
        with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 8\)"):
            checked_targets(np.array(bad), (2, 3), 8, 0, _Device, "logits")
    with pytest.raises(ValueError, match=r"targets shape \(2, 3\) does not match logits \(3, 2\)"):
        checked_targets(t, (3, 2), 8, 0, _Device, "logits")
    # padding may hold any id; without a padding index every target counts
    assert checked_targets(np.array([[9, 0]]), (1, 2), 8, 9, _Device, "logits")[1] == 1
    assert checked_targets(np.array([[1, 0]]), (1, 2), 8, None, _Device, "logits")[1] == 2


# ---- LinearCrossEntropy (pre-softmax projection + loss, chunked) --------------------------------
@pytest.mark.parametrize("layout", ["vd", "dv"])
@pytest.mark.parametrize("chunk", [None, 7])  # 7 logits per chunk: one row at a time
def test_linear_cross_entropy_equals_projection_then_loss(xp, arrays, assert_close, monkeypatch,
                                                          layout, chunk):
    import importlib  # (the package's attribute of that name is the function)
    lce = importlib.import_module("minitransformer.engine.linear_cross_entropy")
    if chunk:
        monkeypatch.setattr(lce, "CHUNK_ELEMENTS", chunk)
        monkeypatch.setattr(lce, "GPU_CHUNK_ELEMENTS", chunk)
    V, D = 6, 5
    t = arrays.asarray(TARGETS)
    w_shape = (V, D) if layout == "vd" else (D, V)

    def composed(h, w):
        logits = F.linear(h, F.transpose(w) if layout == "vd" else w)
        return F.softmax_cross_entropy(logits, t, 0.1, pad_id=0)[0]
    assert_same(lambda h, w: F.linear_cross_entropy(h, w, t, 0.1, pad_id=0, layout=layout)[0],
                composed, [arrays.randn(2, 4, D), arrays.randn(*w_shape)], arrays,
                assert_close, f"linear cross-entropy {layout}")
    h, w = Tensor(arrays.randn(2, 4, D)), Tensor(arrays.randn(*w_shape))
    with mt.no_grad():  # the loss alone (no gradient work) is the same number
        a, n = F.linear_cross_entropy(h, w, t, 0.1, pad_id=0, layout=layout)
    assert n == int((TARGETS != 0).sum())
    assert_close(a, composed(h, w), RTOL, ATOL, "no_grad value")
