"""Layer normalisation (Ba et al. 2016), fused: one node on the tape.

Forward, over the last axis of size D:
    mean = sum(x) / D,  var = sum((x - mean)^2) / D,  rstd = 1 / sqrt(var + eps)
    x_hat = (x - mean) * rstd,  y = gamma * x_hat + beta
Backward (closed form; dxh = dy * gamma is the gradient reaching x_hat):
    dx = rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat))
    dgamma = sum over rows of dy * x_hat,  dbeta = sum over rows of dy
Saves x_hat, rstd and gamma (a parameter: no extra memory), nothing else.
With float16 x (mixed precision) the statistics and both passes run in float32
(``backend.accumulation_dtype``); y and dx come back in float16, and gamma, beta and their
gradients keep their own dtype (float32 master weights).
On CuPy arrays both passes run as fused kernels (cuda_kernels.py), the same formulas.
"""
from .. import backend
from . import cuda_kernels
from .tensor import Function


class LayerNorm(Function):
    """LayerNorm over the last axis (the module docstring's formulas): x (..., D), gamma and
    beta (D,) -> y (..., D). Option ``eps``, added to the variance. Saves x_hat (..., D),
    rstd (..., 1) and gamma; backward returns dx, dgamma, dbeta."""

    options = {"eps": 1e-5}

    def forward(self, x, gamma, beta):
        self.gamma, self.in_dtype = gamma, x.dtype
        y, self.x_hat, self.rstd = normalize(x, gamma, beta, self.eps)
        return y

    def backward(self, dy):
        x_hat, rstd, gamma = self.x_hat, self.rstd, self.gamma
        if cuda_kernels.use_for(backend.get_array_module(dy)):
            return cuda_kernels.layer_norm_backward(dy, x_hat, rstd, gamma)
        D = x_hat.shape[-1]
        dy = backend.cast(dy, x_hat.dtype)
        dy2, xh2 = dy.reshape(-1, D), x_hat.reshape(-1, D)
        dgamma = backend.cast((dy2 * xh2).sum(axis=0), gamma.dtype)
        dbeta = backend.cast(dy2.sum(axis=0), gamma.dtype)
        dxh = dy * backend.cast(gamma, x_hat.dtype)
        dx = dxh - dxh.mean(axis=-1, keepdims=True)
        dx -= x_hat * (dxh * x_hat).mean(axis=-1, keepdims=True)
        dx *= rstd
        return backend.cast(dx, self.in_dtype), dgamma, dbeta


def normalize(x, gamma, beta, eps=1e-5, keep_x_hat=True):
    """The forward's arithmetic on arrays (the module docstring): x (..., D), gamma and beta
    (D,) -> (y, x_hat, rstd). ``keep_x_hat=False`` (a decoding step, which has no backward):
    y is computed in x_hat's array, the same numbers with one array fewer."""
    xp = backend.get_array_module(x)
    if cuda_kernels.use_for(xp):  # the same formulas, one CUDA block per row
        return cuda_kernels.layer_norm_forward(x, gamma, beta, eps)
    in_dtype, acc = x.dtype, backend.accumulation_dtype(x.dtype)
    x = backend.cast(x, acc)
    D = x.shape[-1]
    # (sums divided by D, as x.mean computes it; small arrays are updated in place: a
    # decoding step normalises a few rows, where each NumPy call's set-up is the cost)
    mean = x.sum(axis=-1, keepdims=True)
    mean /= D
    xc = x - mean
    var = xp.square(xc).sum(axis=-1, keepdims=True)
    var /= D
    var += acc.type(eps)
    rstd = xp.divide(1.0, xp.sqrt(var, out=var), out=var)
    xc *= rstd  # xc is now x_hat
    y = xc * backend.cast(gamma, acc) if keep_x_hat else xp.multiply(xc, gamma, out=xc)
    y += backend.cast(beta, acc)
    return backend.cast(y, in_dtype), (xc if keep_x_hat else None), rstd


def layer_norm(x, gamma, beta, eps=1e-5):
    """LayerNorm over the last axis: x (..., D), gamma (D,), beta (D,) -> (..., D)."""
    return LayerNorm.apply(x, gamma, beta, eps=eps)
