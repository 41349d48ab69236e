"""Dropout on a sub-layer's output and the residual add (§5.4), fused: one node on the tape.

For the residual stream x and a sub-layer output f of the same shape (B, T, D):
    m ~ Bernoulli(1 - r) per element (r the rate), drawn from an explicit generator
    mask = m / (1 - r)                    (inverted dropout: E[mask] = 1)
    y = x + f * mask
Backward:  dx = dy,  df = dy * mask.
It equals ``x + dropout(f)`` exactly (same draws, same arithmetic; tested in test_fused.py)
and saves one (B, T, D) temporary and one tape node per sub-layer. On CuPy arrays of float32
or float64 the mask and the sum are one fused kernel (cuda_kernels.dropout_residual).
"""
from .. import backend
from . import cuda_kernels
from .ops import dropout_active, note_dropout
from .tensor import Function


class DropoutResidual(Function):
    """y = x + f * mask (the module docstring): x, f (B, T, D) -> y (B, T, D). Options ``rate``,
    the dropout rate, and ``rng``, the generator that draws m. Saves the mask (None when
    rate = 0 or in eval); backward returns dx = dy, df = dy * mask."""

    options = {"rate": 0.0, "rng": None}

    def forward(self, x, f):
        xp = backend.get_array_module(f)
        note_dropout(self.rate)
        u = self.rng.random(f.shape, f.dtype)
        if cuda_kernels.use_for(xp) and x.dtype == f.dtype \
                and f.dtype in cuda_kernels.ELEMENTWISE_DTYPES:
            y, self.mask = cuda_kernels.dropout_residual(x, f, self.rate, u)
            return y
        self.mask = (u >= self.rate) * f.dtype.type(1.0 / (1.0 - self.rate))
        y = f * self.mask
        y += x
        return y

    def backward(self, dy):
        return dy, dy * self.mask


def dropout_residual(x, f, rate, rng, training=True):
    """x + Dropout(f) with rate ``rate`` and masks from ``rng`` (a backend.Generator); x + f
    when not training or rate = 0."""
    if not dropout_active(rate, training):
        return x + f
    return DropoutResidual.apply(x, f, rate=rate, rng=rng)
