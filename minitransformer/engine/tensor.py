"""Tensor and the tape: define-by-run reverse-mode autodiff.

Every application of a :class:`Function` to tensors that need gradients creates a node with
a sequence number taken from one global counter: the tape. ``loss.backward()`` collects the
nodes reachable from ``loss`` and walks them in reverse tape order, calling each node's
``backward`` on raw arrays. The engine, not the op, sums broadcast axes back to each input's
shape, checks shapes and accumulates (``grad += g``), so a tensor used twice gets the sum.
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Optional

import numpy as np

from .. import backend
from . import anomaly, scope

_tape_counter = itertools.count()
_profiler = None  # the active profiler.Profiler (set by it while active), or None


class _GradMode(threading.local):
    """Whether ops are recorded, per thread (``enabled`` starts True in every thread): a
    thread decoding under no_grad never switches recording off, or back on, in another."""
    enabled = True


_grad_mode = _GradMode()


@contextlib.contextmanager
def no_grad():
    """Inside this block nothing is recorded on the tape (inference, evaluation); in this
    thread only."""
    previous, _grad_mode.enabled = _grad_mode.enabled, False
    try:
        yield
    finally:
        _grad_mode.enabled = previous


def is_grad_enabled():
    """Whether ops applied in this thread are recorded now."""
    return _grad_mode.enabled


def plain_inference():
    """Whether ops applied now only compute: no tape recorded, no profiler, no anomaly
    checks. ``Function.apply`` then takes its short path, and ``Module.__call__`` keeps no
    stack of running modules (engine/scope.py: only those three ask for it)."""
    return not (_grad_mode.enabled or _profiler is not None or anomaly.enabled())


class Tensor:
    """An n-d array (numpy or cupy) with an optional gradient.

    ``data`` is the raw array, ``grad`` the accumulated gradient (same shape and dtype, or
    None), ``node`` the Function application that produced it (None for leaves).
    """

    # so that array * Tensor calls Tensor.__rmul__: above numpy's 0 and cupy's 100 (a tie
    # would leave the product to cupy, which cannot take a Tensor)
    __array_priority__ = 1000

    def __init__(self, data: Any, requires_grad: bool = False, device: Optional[str] = None,
                 dtype: Any = None, name: Optional[str] = None) -> None:
        if isinstance(data, Tensor):
            data = data.data
        if device is not None:
            xp = backend.get_xp(device)
            data = xp.asarray(data, dtype=dtype)
        else:
            xp = backend.get_array_module(data)
            data = xp.asarray(data, dtype=dtype)
        if requires_grad and data.dtype.kind not in "fc":
            raise TypeError(f"requires_grad=True needs floating-point data, not {data.dtype}: "
                            "integer and bool values have no gradient (cast them first, e.g. "
                            "x.astype(np.float32), or leave requires_grad off for ids)")
        self.data = data
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self.node = None
        self.name = name

    @classmethod
    def wrap(cls, data: Any) -> "Tensor":
        """A constant Tensor around ``data``, an array already on its device (no checks, no
        copy): what ops return under no_grad."""
        if isinstance(data, np.generic):  # (a reduction to a NumPy scalar)
            data = np.asarray(data)
        t = cls.__new__(cls)
        t.data, t.grad, t.requires_grad, t.node, t.name = data, None, False, None, None
        return t

    # ---- basic properties -------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    device = property(lambda self: backend.device_of(self.data))

    @property
    def xp(self):
        return backend.get_array_module(self.data)

    def __len__(self):
        return len(self.data)

    def __bool__(self):  # (as the array's: a one-element Tensor's value, else an error;
        return bool(self.data)  # not its length, which made (x > 1) of [0.0] true)

    def __array__(self, dtype=None, copy=None):
        """np.asarray(t): the values, of a Tensor that needs no gradient (indexing made a
        Tensor look like a sequence, converted element by element); one that requires grad
        is refused (its gradient would be lost silently)."""
        if self.requires_grad:
            raise TypeError("a Tensor that requires grad cannot become a NumPy array (its "
                            "gradient would be lost): use t.numpy() for a copy of its values, "
                            "or the engine's ops")
        values = self.numpy()
        return values if dtype is None else values.astype(dtype, copy=False)

    def __repr__(self):
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, device={self.device}{grad})"

    def numpy(self) -> Any:
        """The values as a NumPy array (copied from the GPU if needed)."""
        return backend.to_numpy(self.data)

    def item(self) -> float:
        return self.numpy().item()

    def detach(self):
        return Tensor(self.data)

    def zero_grad(self) -> None:
        self.grad = None

    # ---- the tape walk ----------------------------------------------------------------
    def backward(self, grad: Any = None) -> None:
        """Reverse-mode sweep from this tensor; gradients accumulate into leaves' ``.grad``.

        ``grad`` is the seed gradient dL/dself; it may be omitted only for a scalar.
        The saved arrays of every node are released afterwards, so a second backward through
        the same graph raises an error (build the graph again by re-running forward).
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad: no input "
                               "of the computation had requires_grad=True (or it ran under "
                               "no_grad())")
        grad = _seed_gradient(self, grad)
        if self.node is None:  # a leaf
            _accumulate(self, grad)
            return
        grads = {id(self.node): grad}  # id(node) -> gradient of its output, summed so far
        for node in _reachable_nodes(self.node):
            g_out = grads.pop(id(node), None)
            if g_out is not None:
                _backward_through(node, g_out, grads)

    # ---- operators: thin wrappers over the Functions in ops.py ------------------------
    def __add__(self, other): return _ops().add(self, other)
    def __radd__(self, other): return _ops().add(other, self)
    def __sub__(self, other): return _ops().sub(self, other)
    def __rsub__(self, other): return _ops().sub(other, self)
    def __mul__(self, other): return _ops().mul(self, other)
    def __rmul__(self, other): return _ops().mul(other, self)
    def __truediv__(self, other): return _ops().div(self, other)
    def __rtruediv__(self, other): return _ops().div(other, self)
    def __neg__(self): return _ops().neg(self)
    def __rmatmul__(self, other): return _ops().matmul(other, self)
    def __getitem__(self, index): return _ops().index(self, index)

    # comparisons give a constant bool Tensor (no gradient). ``==`` and ``!=`` are left to
    # compare Tensors as objects (identity), as lists and dicts of parameters rely on; for
    # values compare the arrays: ``x.data == 0``
    def _compare(self, other, op):
        other = other.data if isinstance(other, Tensor) else other
        return Tensor.wrap(op(self.data, other))

    def __lt__(self, other): return self._compare(other, lambda a, b: a < b)
    def __le__(self, other): return self._compare(other, lambda a, b: a <= b)
    def __gt__(self, other): return self._compare(other, lambda a, b: a > b)
    def __ge__(self, other): return self._compare(other, lambda a, b: a >= b)
    def __matmul__(self, other): return _ops().matmul(self, other)
    def __pow__(self, exponent): return _ops().power(self, exponent)

    def sum(self, axis=None, keepdims=False): return _ops().sum(self, axis, keepdims)
    def mean(self, axis=None, keepdims=False): return _ops().mean(self, axis, keepdims)
    def reshape(self, *shape):
        whole = len(shape) == 1 and isinstance(shape[0], (tuple, list))
        return _ops().reshape(self, shape[0] if whole else shape)

    def transpose(self, *axes):
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])  # x.transpose((1, 0, 2)) as well as x.transpose(1, 0, 2)
        return _ops().transpose(self, axes or None)

    def exp(self): return _ops().exp(self)
    def log(self): return _ops().log(self)
    def relu(self): return _ops().relu(self)

    @property
    def T(self):
        return self.transpose()


def _ops():
    from . import ops  # late import: ops imports this module
    return ops


def _accumulate(t, g):
    """Add ``g`` to leaf t's ``.grad``, in t's dtype (a float32 leaf that met float64 values
    gets a float32 gradient, as its ``.grad`` is documented to be)."""
    if g.shape != t.shape:
        raise RuntimeError(f"internal error: gradient of shape {g.shape} for a tensor of "
                           f"shape {t.shape}")
    if g.dtype != t.dtype:
        g = g.astype(t.dtype)
    if t.grad is None:
        t.grad = g.copy()  # g may be shared with another input (e.g. both sides of an add)
    else:
        t.grad += g


def _seed_gradient(t, grad):
    """The seed gradient dL/dt as an array of t's shape: ones for a scalar when ``grad`` is
    None; RuntimeError / ValueError when it is missing or has the wrong shape."""
    xp = t.xp
    if grad is None:
        if t.size != 1:
            raise RuntimeError(f"backward() on a non-scalar tensor of shape {t.shape} "
                               "needs a seed gradient: call t.backward(grad) with an array "
                               "of that shape, or reduce to a scalar first (e.g. .sum())")
        return xp.ones(t.shape, dtype=t.dtype)
    grad = grad.data if isinstance(grad, Tensor) else xp.asarray(grad, dtype=t.dtype)
    if grad.shape != t.shape:
        raise ValueError(f"seed gradient has shape {grad.shape}, tensor has {t.shape}")
    return grad


def _reachable_nodes(root):
    """The nodes reachable from ``root`` through their inputs, in reverse tape order (a
    reverse topological order: every node comes before the nodes that made its inputs)."""
    nodes, stack, seen = [], [root], {id(root)}
    while stack:
        node = stack.pop()
        nodes.append(node)
        for t in node.inputs:
            if t.node is not None and id(t.node) not in seen:
                seen.add(id(t.node))
                stack.append(t.node)
    nodes.sort(key=lambda n: n.tape_index, reverse=True)
    return nodes


def _backward_through(node, g_out, grads):
    """One step of the sweep: ``node``'s backward from the gradient of its output ``g_out``;
    each input's gradient goes into a leaf's ``.grad``, or is added to ``grads`` (keyed by
    id(node)) for the node that made the input. The node's saved arrays are released."""
    if node.released:
        raise RuntimeError(f"second backward through {type(node).__name__}: its saved "
                           "arrays were released by the first backward; run the "
                           "forward pass again to build a new graph")
    if _profiler is None:
        g_in = node.backward(g_out)
    else:  # (profiler.profile: this backward timed, its FLOPs and bytes counted)
        g_in = _profiler.backward(node, g_out)
    g_in = tuple(g_in) if isinstance(g_in, (tuple, list)) else (g_in,)
    if len(g_in) != len(node.inputs):
        name = type(node).__name__
        raise RuntimeError(f"{name}.backward returned {len(g_in)} gradient"
                           f"{'s' if len(g_in) != 1 else ''} for the {len(node.inputs)} inputs "
                           f"of {name}.forward: return one per input, in order (None for one "
                           "without a gradient, such as integer ids)")
    if anomaly.enabled():
        anomaly.check_backward(node, g_out, g_in)
    node.release()
    for t, g in zip(node.inputs, g_in):
        if g is None or not t.requires_grad:
            continue
        g = unbroadcast(g, t.shape, type(node).__name__)
        if t.node is None:
            _accumulate(t, g)
        else:
            key = id(t.node)
            grads[key] = g if key not in grads else grads[key] + g


def unbroadcast(g, shape, op="Function"):
    """Sum ``g`` over the axes that broadcasting added or stretched, to get ``shape`` (a
    float16 ``g`` added up in float32: ``backend.sum_in_accumulation_dtype``).

    A ``g`` that ``shape`` does not broadcast to is a wrong gradient from ``op``: an error,
    not a silent reshape (a transposed gradient has the right size).
    """
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    if extra < 0 or any(n not in (1, m) for n, m in zip(shape, g.shape[extra:])):
        raise RuntimeError(f"{op}.backward returned a gradient of shape {g.shape} for an input "
                           f"of shape {tuple(shape)}")
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape)
                                       if n == 1 and g.shape[i + extra] != 1)
    g = backend.sum_in_accumulation_dtype(g, axis=axes, keepdims=True) if axes else g
    return g.reshape(shape)


def as_tensor(x, like=None):
    """Wrap a Python number or array as a constant Tensor (on ``like``'s device, in its
    dtype when ``like`` holds floats: 0.5 * a float32 tensor stays float32; with an integer
    or bool ``like`` the dtype NumPy gives the two, so 0.5 * ints is not truncated to 0)."""
    if isinstance(x, Tensor):
        return x
    if like is not None:
        xp, dtype = like.xp, like.dtype
        if dtype.kind in "biu":
            other = (x if isinstance(x, (bool, int, float, complex)) else
                     x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
            dtype = np.result_type(dtype, other)
        return Tensor(xp.asarray(x, dtype=dtype))
    return Tensor(x)


def _raw(x):
    """An input of Function.apply as forward gets it: a Tensor's array, a Python number or
    None as it is (NumPy then treats the number as weak: float32 + 1.0 stays float32), and
    anything else (a list, an array) as an array."""
    if isinstance(x, Tensor):
        return x.data
    if x is None or isinstance(x, (bool, int, float, complex)):
        return x
    return as_tensor(x).data


def _one_output(fn, out):
    """Refuse forward's result ``out``, a tuple or list (it would become one Tensor stacking
    its parts)."""
    raise TypeError(f"{type(fn).__name__}.forward returned a {type(out).__name__}; a Function "
                    "has one output: return one array (or write one Function per output)")


class _Edge:
    """What the tape walk needs of a non-leaf (or constant) input: its node, shape and dtype
    (for the tape listing), no data."""
    __slots__ = ("node", "shape", "dtype", "requires_grad")

    def __init__(self, t):
        self.node, self.shape, self.requires_grad = t.node, t.shape, t.requires_grad
        self.dtype = t.dtype


class Function:
    """One op: ``forward`` on raw arrays, ``backward`` on raw arrays, side by side.

    Subclass it and call ``MyFunction.apply(*inputs, **options)``. ``forward(*arrays)``
    returns the output array and saves what backward needs on ``self``;
    ``backward(dy)`` returns one gradient per tensor input (None for integer or
    non-differentiable ones). Keyword options (not tensors) become attributes: a subclass
    declares them, with their defaults, in ``options`` (``options = {"eps": 1e-5}``), and
    any other keyword is refused; a subclass that declares none (``None``) takes any.
    """

    options = None  # {name: default} of this Function's keyword options

    def __init__(self, **options: Any) -> None:
        declared = type(self).options
        if declared is not None:
            if options and not options.keys() <= declared.keys():
                unknown = sorted(set(options) - set(declared))
                raise TypeError(f"{type(self).__name__} takes the options {sorted(declared)}, "
                                f"not {unknown}")
            self.__dict__.update(declared)
        self.__dict__.update(options)
        self.released = False

    @classmethod
    def apply(cls, *inputs: Any, **options: Any) -> Tensor:
        fn = cls(**options)
        if plain_inference():
            # inference (decoding under no_grad): no tape, nothing kept beyond this call
            # (a decoding step applies about 20 ops a layer, each on a few rows: this path
            # is kept short)
            out = fn.forward(*[x.data if isinstance(x, Tensor) else _raw(x) for x in inputs])
            if isinstance(out, (tuple, list)):
                _one_output(fn, out)
            return Tensor.wrap(out)
        grad = _grad_mode.enabled
        tensors = tuple(x if isinstance(x, Tensor) else as_tensor(x) for x in inputs)
        arrays = [t.data if isinstance(x, Tensor) else _raw(x) for x, t in zip(inputs, tensors)]
        fn.module = scope.current_module()  # the module whose forward applies it, or None
        if _profiler is None:
            out = fn.forward(*arrays)
        else:  # (profiler.profile: this forward timed, its FLOPs and bytes counted)
            out = _profiler.forward(fn, arrays)
        if isinstance(out, (tuple, list)):
            _one_output(fn, out)
        if anomaly.enabled():  # (detect_anomaly: the first NaN or Inf names its op)
            anomaly.check_forward(fn, arrays, out)
        out = Tensor(out)
        if grad and any(t.requires_grad for t in tensors):
            # Parameters are kept (their .grad is where gradients land); every other input
            # is kept as an edge without its array, so an intermediate result is freed as
            # soon as neither the model's code nor a forward that saved it holds it.
            fn.inputs = tuple(t if t.node is None and t.requires_grad else _Edge(t)
                              for t in tensors)
            fn.tape_index = next(_tape_counter)
            out.requires_grad = True
            out.node = fn
        else:  # not recorded: drop what forward saved right away
            fn.release()
        return out

    def forward(self, *arrays):
        raise NotImplementedError

    def backward(self, dy):
        raise NotImplementedError

    def release(self):
        """Drop the arrays saved for backward (called by the engine after backward): every
        attribute that is an array, or a tuple, list or dict holding one."""
        keep = {"inputs", "tape_index", "released"}
        for k in list(vars(self)):
            v = getattr(self, k)
            if k not in keep and (hasattr(v, "shape") or contained_arrays(v)):
                setattr(self, k, None)
        self.released = True


def contained_arrays(v):
    """The arrays in ``v`` when it is a tuple, list or dict (one level): [(index or key,
    array)]; [] for anything else. What release drops and explain counts in containers."""
    items = v.items() if isinstance(v, dict) else \
        enumerate(v) if isinstance(v, (tuple, list)) else ()
    return [(i, x) for i, x in items if hasattr(x, "shape") and hasattr(x, "nbytes")]
