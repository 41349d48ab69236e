"""The GPU fast path's calling code, run on a CPU.

On CuPy arrays the ops hand their work to ``engine/cuda_kernels.py``. Here ``use_for`` is
made to say yes for NumPy arrays and each kernel is replaced by a NumPy function that keeps
its documented contract (argument order, shapes, dtypes, what it changes in place), so the
code around the kernels (LayerNorm, attention, the loss chunks, dropout + residual, the
flat-buffer Adam) runs on this machine: a model's loss, gradients and one Adam step through
that path must equal the NumPy path's. The kernels themselves are tested against these
formulas on a GPU (test_cuda_kernels.py).
"""
import numpy as np
import pytest

from minitransformer.backend import accumulation_dtype
from minitransformer.engine import cuda_kernels
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam

from test_mixed_precision import _batch  # a padded batch for a vocabulary of 60


# ---- NumPy stand-ins with the kernels' contracts ---------------------------------------------
def layer_norm_forward(x, gamma, beta, eps=1e-5):
    acc = accumulation_dtype(x.dtype)
    xa = x.astype(acc)
    xc = xa - xa.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + acc.type(eps))
    x_hat = xc * rstd
    y = x_hat * gamma.astype(acc) + beta.astype(acc)
    return y.astype(x.dtype), x_hat.astype(x.dtype), rstd  # rstd in float32 for float16


def layer_norm_backward(dy, x_hat, rstd, gamma):
    D = dy.shape[-1]
    acc = accumulation_dtype(dy.dtype)
    dya, xh = dy.astype(acc), x_hat.astype(acc)
    dxh = dya * gamma.astype(acc)
    dx = rstd.astype(acc) * (dxh - dxh.mean(-1, keepdims=True)
                             - xh * (dxh * xh).mean(-1, keepdims=True))
    dgamma = (dya * xh).reshape(-1, D).sum(0).astype(gamma.dtype)
    return dx.astype(dy.dtype), dgamma, dya.reshape(-1, D).sum(0).astype(gamma.dtype)


def masked_softmax_(s, bias=None):
    assert s.flags.c_contiguous
    v = s.astype(accumulation_dtype(s.dtype)) + (0 if bias is None else bias)
    m = v.max(axis=-1, keepdims=True)
    m[~np.isfinite(m)] = 0
    e = np.exp(v - m)
    z = e.sum(axis=-1, keepdims=True)
    z[z == 0] = 1
    s[...] = e / z
    return s


def dropout_residual(x, f, p, u):
    assert x.dtype in (np.float32, np.float64) and u.shape == f.shape
    mask = (u >= p) * x.dtype.type(1.0 / (1.0 - p))
    return x + f * mask, mask


def smoothed_ce_chunk(z, t, valid, c_t, c_o, want_grad, z_sum=None):
    assert z.flags.c_contiguous and z.ndim == 2
    acc = accumulation_dtype(z.dtype)
    za = z.astype(acc)
    r = np.arange(z.shape[0])
    tc = np.where(valid, t, 0)
    m = za.max(axis=1, keepdims=True)
    e = np.exp(za - m)
    s = e.sum(axis=1)
    zs = za.sum(axis=1) if z_sum is None else z_sum
    row_loss = (m[:, 0] + np.log(s) - c_o * zs - (c_t - c_o) * za[r, tc]) * valid
    if want_grad:
        e[r, tc] -= (c_t - c_o) * s
        z[...] = e
    return row_loss.astype(acc), s.astype(acc)


def adam_update_(param, grad, m, v, lr, beta1, beta2, eps, c1, c2, weight_decay=0.0):
    dt = param.dtype.type
    g = grad + dt(weight_decay) * param if weight_decay else grad
    m[...] = dt(beta1) * m + dt(1 - beta1) * g
    v[...] = dt(beta2) * v + dt(1 - beta2) * (g * g)
    param -= dt(lr / c1) * m / (np.sqrt(v * dt(1.0 / c2)) + dt(eps))
    return param


STAND_INS = dict(layer_norm_forward=layer_norm_forward, layer_norm_backward=layer_norm_backward,
                 masked_softmax_=masked_softmax_, dropout_residual=dropout_residual,
                 smoothed_ce_chunk=smoothed_ce_chunk, adam_update_=adam_update_)


def _train_step(dtype, compute_dtype=None):
    cfg = TransformerConfig(vocab_size=60, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                            dropout=0.2, attention_dropout=0.1)
    model = Transformer(cfg, seed=3, dtype=dtype, compute_dtype=compute_dtype)
    opt = Adam(model.parameters(), lr=1e-2, flat=True)
    loss, n = model.loss(*_batch())
    loss.backward(8.0)
    grads = {k: p.grad.copy() for k, p in model.named_parameters()}
    opt.step()
    return float(loss.data), grads, model.state_dict()


def take_the_fused_path(monkeypatch):
    """Make the ops call the stand-ins; -> a dict counting the calls of each."""
    calls = {name: 0 for name in STAND_INS}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(cuda_kernels, "use_for", lambda xp: True)
    for name, fn in STAND_INS.items():
        monkeypatch.setattr(cuda_kernels, name, counted(name, fn))
    return calls


@pytest.mark.parametrize("dtype,compute_dtype,rtol", [(np.float64, None, 1e-12),
                                                      (np.float32, np.float16, 2e-3)])
def test_fused_path_gives_the_numpy_paths_loss_gradients_and_step(monkeypatch, dtype,
                                                                   compute_dtype, rtol):
    reference = _train_step(dtype, compute_dtype)
    calls = take_the_fused_path(monkeypatch)
    fused = _train_step(dtype, compute_dtype)
    # every kernel was reached (dropout + residual only for float32/64 activations)
    expected = set(STAND_INS) - ({"dropout_residual"} if compute_dtype else set())
    assert {k for k, v in calls.items() if v} == expected, calls
    assert abs(fused[0] - reference[0]) <= rtol * abs(reference[0]), (fused[0], reference[0])
    # all gradients as one vector (the key biases' true gradient is 0: only rounding is left
    # in them, which float16 makes large relative to itself)
    diff = np.sqrt(sum(np.sum((fused[1][k] - g) ** 2) for k, g in reference[1].items()))
    norm = np.sqrt(sum(np.sum(g ** 2) for g in reference[1].values()))
    assert diff <= 10 * rtol * norm, f"gradients differ: {diff:.3e} against norm {norm:.3e}"
    if compute_dtype is None:  # (in float16 Adam's g / |g| turns the rounding noise of
        # those zero gradients into whole steps of either sign)
        for name in reference[2]:  # after one Adam step through the flat kernel
            a, b = fused[2][name], reference[2][name]
            assert np.allclose(a, b, rtol=10 * rtol, atol=0), name
