"""Modules: containers of named parameters with a forward pass built from Functions."""
import math

import numpy as np

from .. import backend
from ..engine import ops, scope
from ..engine.layernorm import layer_norm, normalize
from ..engine.tensor import Tensor, plain_inference


def _contents(v):
    """(key, item) of a list, tuple or dict attribute (one level), else nothing."""
    if isinstance(v, dict):
        return v.items()
    return enumerate(v) if isinstance(v, (list, tuple)) else ()


class Module:
    """Base class. Parameters are Tensor attributes with requires_grad=True; submodules are
    Module attributes. Both may also sit in a list, tuple or dict attribute (its items named
    by index or key). Names are dotted paths ('encoder.0.ff.w1.weight').
    """
    training = True

    def __call__(self, *args, **kwargs):
        if plain_inference():  # no op asks which module runs (a decoding step: ~35 calls)
            return self.forward(*args, **kwargs)
        scope.push(self)  # (each op applied in forward records this module: engine/scope.py)
        try:
            return self.forward(*args, **kwargs)
        finally:
            scope.pop()

    def named_children(self):
        for name, v in vars(self).items():
            if isinstance(v, Module):
                yield name, v
            else:
                for i, m in _contents(v):
                    if isinstance(m, Module):
                        yield f"{name}.{i}", m

    def modules(self):
        yield self
        for _, m in self.named_children():
            yield from m.modules()

    def named_modules(self, prefix=""):
        """(path, Module) of this module ("" or ``prefix``) and every module below it."""
        yield prefix, self
        for name, m in self.named_children():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(self, prefix="", frozen=False):
        """(name, Tensor) pairs, each shared parameter once (under its first name): those
        that require grad (what an optimizer steps), and with ``frozen`` also those made by
        ``parameter`` whose requires_grad was turned off since (what a checkpoint holds)."""
        seen = set()
        for name, p in self._named_parameters(prefix, frozen):
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p

    def _named_parameters(self, prefix, frozen):
        def wanted(t):
            return isinstance(t, Tensor) and t.node is None and (
                t.requires_grad or (frozen and getattr(t, "is_parameter", False)))
        for name, v in vars(self).items():
            if isinstance(v, Tensor) and (v.requires_grad or wanted(v)):
                yield prefix + name, v
            for i, t in _contents(v):  # (leaves only: a list of activations holds no parameter)
                if wanted(t):
                    yield f"{prefix}{name}.{i}", t
        for name, m in self.named_children():
            yield from m._named_parameters(f"{prefix}{name}.", frozen)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def zero_grad(self):
        for p in self.parameters():
            p.grad = None

    def train(self, mode=True):
        for m in self.modules():
            m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def state_dict(self):
        """Name -> NumPy copy of every parameter, frozen ones included (a snapshot: training
        does not change it)."""
        return {name: backend.to_numpy(p.data).copy()
                for name, p in self.named_parameters(frozen=True)}

    def load_state_dict(self, state, strict=True):
        own = dict(self.named_parameters(frozen=True))
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(f"parameter names do not match: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
        for name, p in own.items():
            if name not in state:
                continue
            a = state[name]
            if tuple(a.shape) != p.shape:
                raise ValueError(f"parameter {name}: checkpoint shape {tuple(a.shape)}, "
                                 f"model shape {p.shape}")
            # copied into the parameter's own array (which may be a view of an optimizer's
            # flat buffer), so nothing aliases ``state``
            p.data[...] = p.xp.asarray(a, dtype=p.dtype)


def parameter(array):
    """A trainable Tensor of ``array``: requires grad, and stays in the module's state_dict
    if that is turned off later (a frozen parameter)."""
    t = Tensor(array, requires_grad=True)
    t.is_parameter = True
    return t


class Linear(Module):
    """y = x W + b;  W (Din, Dout) initialised Xavier-uniform (Glorot & Bengio), b = 0."""

    def __init__(self, d_in, d_out, bias=True, rng=None, dtype=np.float32, device="cpu"):
        rng = rng or np.random.default_rng(0)
        xp = backend.get_xp(device)
        limit = math.sqrt(6.0 / (d_in + d_out))
        self.weight = parameter(xp.asarray(rng.uniform(-limit, limit, (d_in, d_out)), dtype=dtype))
        self.bias = parameter(xp.zeros(d_out, dtype=dtype)) if bias else None

    def forward(self, x):
        # mixed precision: a float32 weight meeting float16 inputs enters the product as a
        # float16 copy (its gradient comes back in float32); the bias is added as it is
        w = self.weight if x.dtype == self.weight.dtype else ops.cast(self.weight, x.dtype)
        return ops.linear(x, w, self.bias)

    def step(self, x, add_bias=True):
        """forward on a raw array, recording nothing (a decoding step: nn/layers.py); with
        ``add_bias=False`` only x W (the caller adds the bias, in a fused kernel)."""
        w = backend.cast(self.weight.data, x.dtype)
        return ops.affine(x, w, None if self.bias is None or not add_bias else self.bias.data)


class LayerNorm(Module):
    """Layer normalisation over the last axis with gain gamma = 1 and bias beta = 0 at start."""

    def __init__(self, d, eps=1e-5, dtype=np.float32, device="cpu"):
        xp = backend.get_xp(device)
        self.gamma = parameter(xp.ones(d, dtype=dtype))
        self.beta = parameter(xp.zeros(d, dtype=dtype))
        self.eps = eps

    def forward(self, x):
        return layer_norm(x, self.gamma, self.beta, self.eps)

    def step(self, x):
        """forward on a raw array, recording nothing (a decoding step: nn/layers.py)."""
        return normalize(x, self.gamma.data, self.beta.data, self.eps, keep_x_hat=False)[0]


class Dropout(Module):
    """Inverted dropout with its own seedable generator (``rng``), active in training mode."""

    def __init__(self, rate, rng):
        self.rate, self.rng = rate, rng

    def forward(self, x):
        return ops.dropout(x, self.rate, self.rng, self.training)
