"""Adam with the paper's defaults and bias correction; the learning-rate schedule; clipping.

Update for each parameter array (vectorised, no loop over elements), step t = 1, 2, ...:
    m = beta1 m + (1 - beta1) g
    v = beta2 v + (1 - beta2) g^2
    theta -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
On CuPy arrays each parameter's update is one fused kernel (engine/cuda_kernels.py).
"""
import math

import numpy as np

from ..engine import cuda_kernels


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


def clip_grad_norm(params, max_norm):
    """Scale all gradients in place so their global L2 norm is at most ``max_norm``.

    Returns the norm before clipping (a float). ``max_norm <= 0`` only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = math.sqrt(sum(float(g.ravel() @ g.ravel()) for g in grads))
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for g in grads:
            g *= g.dtype.type(scale)
    return total


class Adam:
    """Adam(params, lr, betas=(0.9, 0.98), eps=1e-9): the paper's values as defaults.

    ``lr`` is the step size for the next ``step()`` (set it from the schedule each update).
    State (``m``, ``v``, ``t``) is saved and restored through ``state_dict`` for exact resumes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0):
        self.params = list(params)
        self.lr, self.beta1, self.beta2, self.eps = lr, betas[0], betas[1], eps
        self.weight_decay = weight_decay
        self.t = 0
        self.m = [p.xp.zeros_like(p.data) for p in self.params]
        self.v = [p.xp.zeros_like(p.data) for p in self.params]

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def step(self):
        self.t += 1
        b1, b2 = self.beta1, self.beta2
        c1, c2 = 1.0 - b1 ** self.t, 1.0 - b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad
            if cuda_kernels.use_for(p.xp) and p.dtype in (np.float32, np.float64):
                # the same update in one CUDA kernel: p, g, m, v read once, p, m, v written once
                cuda_kernels.adam_update_(p.data, g, m, v, self.lr, b1, b2, self.eps, c1, c2,
                                          self.weight_decay)
                continue
            if self.weight_decay:
                g = g + self.weight_decay * p.data
            dt = p.dtype.type
            m *= dt(b1)
            m += dt(1 - b1) * g
            v *= dt(b2)
            v += dt(1 - b2) * (g * g)
            # theta -= lr / c1 * m / (sqrt(v / c2) + eps), in two temporaries
            denom = v * dt(1.0 / c2)
            p.xp.sqrt(denom, out=denom)
            denom += dt(self.eps)
            p.data -= dt(self.lr / c1) * m / denom

    def state_dict(self):
        from ..backend import to_numpy
        state = {"t": self.t, "lr": self.lr}
        for i, (m, v) in enumerate(zip(self.m, self.v)):  # copies: step() updates m, v in place
            state[f"m.{i}"], state[f"v.{i}"] = to_numpy(m).copy(), to_numpy(v).copy()
        return state

    def load_state_dict(self, state):
        self.t, self.lr = int(state["t"]), float(state["lr"])
        for i, p in enumerate(self.params):
            for key, buf in (("m", self.m), ("v", self.v)):
                a = state[f"{key}.{i}"]
                if tuple(a.shape) != p.shape:
                    raise ValueError(f"optimizer state {key}.{i} has shape {a.shape}, parameter "
                                     f"has {p.shape}: the checkpoint belongs to another model")
                buf[i] = p.xp.array(a, dtype=p.dtype)  # a copy, not an alias of ``state``
