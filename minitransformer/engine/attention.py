"""Scaled dot-product attention (§3.2.1), fused: one node on the tape.

Forward, per batch b and head h, with q (T, K), k (S, K), v (S, K):
    s = q k^T / sqrt(K)                   scores (T, S)
    s[i, j] = -inf where key j is padding, or (causal) j is in the future of query i
    p = softmax(s)                        over keys; a row with every key masked gives p = 0
    p~ = p * m / (1 - rate)               attention dropout (optional, m ~ Bernoulli)
    out = p~ v                            (T, K)
Backward through the saved probabilities p (and the dropout mask):
    dv = p~^T dout,   dp~ = dout v^T,   dp = dp~ * m / (1 - rate)
    ds = p * (dp - sum_j(dp * p)) / sqrt(K)       (softmax's Jacobian, folded)
    dq = ds k,        dk = ds^T q
Masking convention: the one mask value is -inf, added before the softmax; rows whose keys are
all masked are defined to attend to nothing (output 0, gradient 0) instead of NaN.
With float16 q, k, v (mixed precision) the products stay in float16 and the softmax and its
Jacobian run in float32 (``backend.accumulation_dtype``); p is kept in float16.
On CuPy arrays the masked softmax is one fused kernel (cuda_kernels.masked_softmax_).
"""
import math

import numpy as np

from .. import backend
from . import cuda_kernels
from .ops import note_dropout
from .tensor import Function


def key_bias(key_mask, dtype):
    """The additive key mask (B, 1, 1, S) of a bool key_mask (B, S): 0 for a real token,
    -inf for padding. Incremental decoding builds it once per batch and passes it as the
    key_mask of every step."""
    xp = backend.get_array_module(key_mask)
    dtype = np.dtype(dtype)
    return xp.where(key_mask, dtype.type(0), dtype.type(-xp.inf)).astype(dtype)[:, None, None, :]


def attention_bias(xp, dtype, key_mask=None, causal=False, T=None, S=None):
    """Additive mask: 0 where attending is allowed, -inf elsewhere; broadcasts to (B, H, T, S).

    key_mask: bool (B, S), True for real tokens, or the bias ``key_bias`` made of one.
    causal: query i sees keys j <= i + (S - T), so a block of T new queries at the end of
    S keys (incremental decoding) is handled too.
    """
    bias = None
    if key_mask is not None:
        if key_mask.dtype == bool:
            bias = key_bias(key_mask, dtype)
        else:  # a key_bias already
            bias = key_mask.astype(dtype, copy=False)
    if causal:
        future = xp.triu(xp.ones((T, S), dtype=bool), k=S - T + 1)
        cb = xp.where(future, dtype.type(-xp.inf), dtype.type(0)).astype(dtype)  # (T, S)
        bias = cb if bias is None else bias + cb
    return bias


def attention_probabilities(q, k, key_mask=None, causal=False):
    """p = softmax(q k^T / sqrt(K) + mask) over the keys: arrays q (B, H, T, K), k (B, H, S, K)
    -> p (B, H, T, S) in q's dtype (computed in float32 for float16). A row whose keys are
    all masked is 0. The attention op's forward up to the product with v; on CuPy arrays the
    bias, max, exp, sum and divide are one fused kernel (cuda_kernels.masked_softmax_)."""
    xp = backend.get_array_module(q)
    T, S, K = q.shape[-2], k.shape[-2], q.shape[-1]
    s = (q * q.dtype.type(1.0 / math.sqrt(K))) @ k.swapaxes(-1, -2)  # (B, H, T, S)
    acc = backend.accumulation_dtype(s.dtype)
    bias = attention_bias(xp, acc, key_mask, causal, T, S)
    if cuda_kernels.use_for(xp):  # one CUDA block per row
        return cuda_kernels.masked_softmax_(s, bias)
    s = backend.cast(s, acc)
    if bias is not None:
        s += bias
    m = backend.row_max(s)
    if bias is not None:  # (no boolean-mask writes: on CuPy each would wait for a count)
        m = xp.where(xp.isfinite(m), m, acc.type(0))  # fully masked row: exp(-inf) = 0
    s -= m
    xp.exp(s, out=s)
    z = s.sum(axis=-1, keepdims=True)
    if bias is not None:
        z += z == 0  # a fully masked row sums to 0: divide by 1, no NaN
    s /= z
    return backend.cast(s, q.dtype)


class ScaledDotProductAttention(Function):
    """The fused attention node (module docstring): options ``key_mask`` (bool (B, S) or
    None), ``causal``, ``dropout`` (the rate), ``rng``, ``training``. Saves p, q, k, v and
    the dropout mask for backward."""
    options = {"key_mask": None, "causal": False, "dropout": 0.0, "rng": None, "training": False}


    def forward(self, q, k, v):
        self.scale = q.dtype.type(1.0 / math.sqrt(q.shape[-1]))
        s = attention_probabilities(q, k, self.key_mask, self.causal)
        self.p, self.q, self.k, self.v = s, q, k, v
        self.mask = None
        if self.training and self.dropout > 0:
            note_dropout(self.dropout)
            keep = self.rng.random(s.shape, s.dtype) >= self.dropout
            self.mask = keep * s.dtype.type(1.0 / (1.0 - self.dropout))
            return (s * self.mask) @ v
        return s @ v

    def backward(self, dout):
        p, q, k, v, mask = self.p, self.q, self.k, self.v, self.mask
        pd = p if mask is None else p * mask
        dv = pd.swapaxes(-1, -2) @ dout
        dp = dout @ v.swapaxes(-1, -2)  # (B, H, T, S)
        if mask is not None:
            dp *= mask
        acc = backend.accumulation_dtype(dp.dtype)
        dp, pa = backend.cast(dp, acc), backend.cast(p, acc)
        dp -= (dp * pa).sum(axis=-1, keepdims=True)
        dp *= pa
        dp *= self.scale  # dp is now ds
        dp = backend.cast(dp, q.dtype)
        return dp @ k, dp.swapaxes(-1, -2) @ q, dv


def scaled_dot_product_attention(q, k, v, key_mask=None, causal=False, dropout=0.0,
                                 rng=None, training=False):
    """softmax(q k^T / sqrt(K) + mask) v for q (B, H, T, K), k and v (B, H, S, K).

    key_mask: bool array (B, S), True for real (non-padding) keys, or its ``key_bias``.
    causal: mask the future.
    dropout/rng/training: dropout on the probabilities.
    """
    if key_mask is not None and hasattr(key_mask, "data") and not hasattr(key_mask, "shape"):
        key_mask = key_mask.data
    return ScaledDotProductAttention.apply(q, k, v, key_mask=key_mask, causal=causal,
                                           dropout=dropout if training else 0.0, rng=rng,
                                           training=training)
