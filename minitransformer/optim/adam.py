"""Adam with the paper's defaults and bias correction; the learning-rate schedule; clipping.

Update for each parameter array (vectorised, no loop over elements), step t = 1, 2, ...:
    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    theta -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
On CuPy arrays the update is one fused kernel per parameter, or one over all of them with
``flat`` buffers (engine/cuda_kernels.py).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

from .. import backend
from ..engine import cuda_kernels
from ..settings import SETTINGS


def noam_lr(step, d_model, warmup, factor=1.0):
    """lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)  (§5.3).

    Linear warm-up for ``warmup`` steps, then decay with the inverse square root of the step.
    """
    step = max(int(step), 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def linear_decay_lr(step, d_model, warmup, total, factor=1.0):
    """The same warm-up to the same peak as noam_lr, then a straight line to 0 at ``total``.

    For a run with a fixed budget of ``total`` updates: the rate is still high enough to make
    progress late in training and reaches zero exactly when training stops, where the inverse
    square root leaves it at sqrt(warmup / total) of its peak.
    """
    step = max(int(step), 1)
    if step <= warmup:
        return noam_lr(step, d_model, warmup, factor)
    return noam_lr(warmup, d_model, warmup, factor) * max(total - step, 0) / max(total - warmup, 1)


def clip_grad_norm(params, max_norm, grads=None):
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm before clipping (a float). ``max_norm <= 0`` only measures.
    ``grads``: the gradient arrays to use instead of the parameters' (e.g. ``[Adam.flat_grad()]``,
    one array holding them all).
    """
    grads = [g for g in ([p.grad for p in params] if grads is None else grads) if g is not None]
    if not grads:
        return 0.0
    xp = backend.get_array_module(grads[0])
    # each g . g in the gradient's dtype, summed in float64 on the device: one read of the
    # result, so a GPU run waits once instead of once per parameter
    sq = xp.stack([(g.ravel() @ g.ravel()).astype(xp.float64) for g in grads])
    total = math.sqrt(float(sq.sum()))
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g *= g.dtype.type(scale)
    return total


def scale_gradients(grads, multiplier, scaler=None):
    """After backward (and the all-reduce): every gradient array *= ``multiplier`` (1 / the
    target tokens), in place. With a loss scaler (float16) they are divided by its scale too,
    and the scale adjusted. -> whether they are finite (an update to skip if not), by the
    loss scaler's test: the sum of g . g over the arrays, one wait on a GPU.
    ``grads``: arrays, None entries skipped (``Adam.gradients()``: one flat one when it can)."""
    if scaler is not None:
        finite = scaler.unscale_(grads, multiplier)
        scaler.update(finite)  # LossScaleCollapse when S falls below its minimum
        return finite
    total = 0.0
    for g in grads:
        if g is not None:
            g *= g.dtype.type(multiplier)
            flat = g.ravel()
            total = total + flat @ flat
    return math.isfinite(float(total))


FLAT_CHUNK = 1 << 20  # elements per NumPy pass over the flat buffers (temporaries stay small)


def _adam_update(xp, p, g, m, v, lr, b1, b2, eps, c1, c2, weight_decay):
    """One Adam update of the array p (in place, with m and v) from its gradient g."""
    if cuda_kernels.use_for(xp) and p.dtype in cuda_kernels.ELEMENTWISE_DTYPES:
        # the same update in one CUDA kernel: p, g, m, v read once, p, m, v written once
        cuda_kernels.adam_update_(p, g, m, v, lr, b1, b2, eps, c1, c2, weight_decay)
        return
    if weight_decay:
        g = g + weight_decay * p
    dt = p.dtype.type
    m *= dt(b1)
    m += dt(1 - b1) * g
    v *= dt(b2)
    v += dt(1 - b2) * (g * g)
    # theta -= lr / c1 * m / (sqrt(v / c2) + eps), in two temporaries
    denom = v * dt(1.0 / c2)
    xp.sqrt(denom, out=denom)
    denom += dt(eps)
    p -= dt(lr / c1) * m / denom


class Adam:
    """Adam(params, lr, betas=(0.9, 0.98), eps=1e-9): the paper's values as defaults.

    ``lr`` is the step size for the next ``step()`` (set it from the schedule each update).
    State (``m``, ``v``, ``t``) is saved and restored through ``state_dict`` for exact resumes.

    ``flat`` (default: on for CuPy parameters, or as the environment variable
    MINITRANSFORMER_FLAT_ADAM=1 / 0 says): every parameter, its gradient, m and v become
    views of four flat buffers, so one step is one update over each buffer (one CUDA kernel
    on a GPU) instead of one per parameter. ``zero_grad`` then zeroes the gradient buffer
    and leaves each ``p.grad`` a view of it (backward adds into it), not None. When a
    parameter's data or gradient has been replaced by another array since (a checkpoint
    loaded by assignment, a gradient set by hand, the all-reduce's own buffer when it was not
    given ``flat_grad()``), ``step`` updates parameter by parameter instead, with the same
    formula.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-9,
                 weight_decay: float = 0.0, flat: Optional[bool] = None) -> None:
        self.params = list(params)
        seen = {}
        for i, p in enumerate(self.params):
            if id(p) in seen:  # (it would be stepped twice per step)
                raise ValueError(f"Adam: parameter {i} is parameter {seen[id(p)]} again; pass "
                                 "each parameter once (a tied weight is one parameter)")
            seen[id(p)] = i
        self.lr, self.beta1, self.beta2, self.eps = lr, betas[0], betas[1], eps
        self.weight_decay = weight_decay
        self.t = 0
        if flat is None:  # MINITRANSFORMER_FLAT_ADAM=1 / 0 sets the default; else on a GPU
            flat = SETTINGS.flat_adam
        if flat is None:
            flat = any(cuda_kernels.use_for(p.xp) for p in self.params)
        kinds = {(p.dtype, p.device) for p in self.params}
        self.flat = None
        if flat and len(kinds) == 1:
            self._pack()
        else:
            self.m = [p.xp.zeros_like(p.data) for p in self.params]
            self.v = [p.xp.zeros_like(p.data) for p in self.params]

    def _pack(self):
        """Copy the parameters into one buffer and make each ``p.data`` a view of it;
        likewise for the gradients (a gradient computed before the optimizer was made is
        kept, for the first ``step``), and zeroed buffers for m and v."""
        xp, dtype = self.params[0].xp, self.params[0].dtype
        n = sum(p.size for p in self.params)
        data, grad, m, v = xp.empty(n, dtype), xp.zeros(n, dtype), xp.zeros(n, dtype), \
            xp.zeros(n, dtype)
        self.m, self.v, self._data, self._grad = [], [], [], []
        offset = 0
        for p in self.params:
            part = slice(offset, offset + p.size)
            offset += p.size
            data[part] = p.data.ravel()
            if p.grad is not None:
                grad[part] = p.grad.ravel()
            p.data = data[part].reshape(p.shape)
            self._data.append(p.data)
            self._grad.append(grad[part].reshape(p.shape))
            self.m.append(m[part].reshape(p.shape))
            self.v.append(v[part].reshape(p.shape))
        self.flat = (data, grad, m, v)
        for p, g in zip(self.params, self._grad):
            p.grad = g

    def zero_grad(self) -> None:
        if self.flat is None:
            for p in self.params:
                p.grad = None
            return
        self.flat[1].fill(0)
        for p, g in zip(self.params, self._grad):
            p.grad = g

    def flat_grad(self):
        """The flat gradient buffer while every ``p.grad`` is still a view of it, else None:
        scaling or checking all gradients is then one operation instead of one per
        parameter (on a GPU, one kernel launch instead of hundreds)."""
        return self.flat[1] if self._flat_intact() else None

    def gradients(self) -> list:
        """The arrays holding the gradients, for scaling, checking and clipping: the flat
        buffer alone while intact, else every ``p.grad`` (None where a parameter has none)."""
        flat = self.flat_grad()
        return [p.grad for p in self.params] if flat is None else [flat]

    def _flat_intact(self):
        return self.flat is not None and all(
            p.data is d and p.grad is g for p, d, g in zip(self.params, self._data, self._grad))

    def step(self) -> None:
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        hyper = (self.lr, b1, b2, self.eps, c1, c2, self.weight_decay)
        if self._flat_intact():
            data, grad, m, v = self.flat
            xp = self.params[0].xp
            chunk = max(data.size, 1) if cuda_kernels.use_for(xp) else FLAT_CHUNK
            for a in range(0, data.size, chunk):
                part = slice(a, a + chunk)
                _adam_update(xp, data[part], grad[part], m[part], v[part], *hyper)
            return
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            _adam_update(p.xp, p.data, p.grad, m, v, *hyper)

    def state_dict(self) -> dict:
        from ..backend import to_numpy
        state = {"t": self.t, "lr": self.lr}
        for i, (m, v) in enumerate(zip(self.m, self.v)):  # copies: step() updates m, v in place
            state[f"m.{i}"], state[f"v.{i}"] = to_numpy(m).copy(), to_numpy(v).copy()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.t, self.lr = int(state["t"]), float(state["lr"])
        for i, p in enumerate(self.params):
            for key, buf in (("m", self.m), ("v", self.v)):
                a = state[f"{key}.{i}"]
                if tuple(a.shape) != p.shape:
                    raise ValueError(f"optimizer state {key}.{i} has shape {a.shape}, parameter "
                                     f"has {p.shape}: the checkpoint belongs to another model")
                buf[i][...] = p.xp.asarray(a, dtype=p.dtype)  # in place: a view of flat m, v
