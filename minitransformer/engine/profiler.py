"""Where the time goes: a profiler of the tape, op by op and module by module.

    from minitransformer.engine.profiler import profile
    with profile(model) as prof:          # model: module paths name where each op ran
        train_step(model, optim, [batch], lr)
    print(prof.table(by="op"))            # or by="module" (depth=2: "encoder.0"); top=10
    prof.total_seconds()                  # the seconds spent inside the ops

While a profile is active, ``Function.apply`` times each op's ``forward`` and the backward
sweep times each node's ``backward`` (engine/tensor.py; with no profile active the only cost
is one ``_profiler is None`` check per op, and nothing else changes). Each call adds to its
row (op class, module): calls, forward and backward seconds, FLOPs counted from the shapes
(below) and bytes moved: forward, the input and output arrays; backward, the gradient that
arrives and the gradients returned (the saved activations backward also reads are not
counted: a lower bound). On CuPy arrays the device is synchronised before and after each
timed call (``device_sync``), so a kernel's time is charged to the op that launched it; the
profiled step runs slower than a normal one (no overlap of Python and GPU), the shares are
what it is for. Time outside the ops (the optimizer, the tape walk, data) is not in the
rows; the table's caption compares their sum with the wall time inside the profile.
A profile is for one thread's ops: ops that other threads run meanwhile are counted too, and
their time is taken from whatever op this thread has open (so a search does not share its
sentences out to threads while a profile is active: mt/search.py's ``search_threads``).

FLOPs, a multiply-add counted as 2. n: elements of the output (of the input for Sum, Mean
and SoftmaxCrossEntropy); N rows; B H T S K: batch, heads, queries, keys, head size; V
vocabulary. (*) marks matrix products; ``total_flops(products_only=True)`` sums those only,
which is what bench/common.py's ``train_flops`` counts for a training step (tested equal).

    op                          forward                           backward
    MatMul (..., M, K)@(K, P)   2 M K P per batch entry (*)       2 x forward (*)
    Linear x (N, Din) W, b      2 N Din Dout (*) + N Dout (bias)  2 x forward (*) + N Dout
    ScaledDotProductAttention   4 B H T S K (*: q k^T, p v)       8 B H T S K (*) + 5 B H T S
                                + 5 B H T S (softmax)             (+1 B H T S with dropout)
                                (+1 B H T S with dropout)
    LinearCrossEntropy h, W     2 N D V (*: logits)               N D + V D (scaling dh, dW)
                                + 4 N D V (*: dh, dW, computed in the forward, see its module)
                                + 4 N V (max, subtract, exp, sum)
    SoftmaxCrossEntropy         5 n (max, subtract, exp, sums)    4 n
    Softmax, LogSoftmax         5 n                               4 n, 3 n
    LayerNorm                   7 n                               11 n
    Add, Sub, Neg, Exp, Log     1 n                               Add 0; the others 1 n
    Mul, Div, Power, ReLU       1 n                               2 n, 3 n, 3 n, 1 n
    Dropout, DropoutResidual    1 n, 2 n (drawing the mask: 0)    1 n
    Sum, Mean                   1 n                               0 (a broadcast)
    Embedding                   0 (a gather)                      1 n (the scatter-add)
    Reshape, Transpose, Index, SplitHeads, MergeHeads, Cast, any other Function: 0 FLOPs,
    still timed (moves: an Index's backward adds only where an index repeats)

GFLOP/s is a row's FLOPs over its time; MFU (model FLOPs utilisation) is that rate over the
peak: by default ``measure_peak_gflops``, the best rate of n x n x n products (n = 1024) of
the model's dtype on the same device, timed for at least a quarter of a second, measured once
per (device, dtype). It is this
machine's GEMM rate as its BLAS / cuBLAS reaches it, not a datasheet's peak: 100% means "as
fast as a large square product here"; small or thin products reach less.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from .. import backend
from . import scope, tensor
from .attention import ScaledDotProductAttention
from .cross_entropy import SoftmaxCrossEntropy
from .layernorm import LayerNorm
from .linear_cross_entropy import LinearCrossEntropy
from .ops import (Add, Div, Dropout, Embedding, Exp, Linear, Log, MatMul, Mean, Mul, Neg,
                  Power, ReLU, Sub, Sum)
from .residual import DropoutResidual
from .softmax import LogSoftmax, Softmax


# ---- FLOPs from shapes (the module docstring's table) -------------------------------------
class Cost(NamedTuple):
    """FLOPs of one call: matrix products and the rest, forward and backward."""
    forward_products: int = 0
    forward_other: int = 0
    backward_products: int = 0
    backward_other: int = 0


def _size(shape):
    return math.prod(int(n) for n in shape)


def _matmul(fn, shapes, out):
    products = 2 * _size(out) * shapes[0][-1]  # every output element: a length-K dot product
    return Cost(products, 0, 2 * products, 0)


def _linear(fn, shapes, out):
    products, bias = 2 * _size(out) * shapes[0][-1], _size(out) if len(shapes) == 3 else 0
    return Cost(products, bias, 2 * products, bias)


def _attention(fn, shapes, out):
    q, k = shapes[0], shapes[1]
    scores = _size(q[:-1]) * k[-2]  # B H T S
    softmax = (6 if fn.training and fn.dropout > 0 else 5) * scores
    return Cost(4 * scores * q[-1], softmax, 8 * scores * q[-1], softmax)


def _linear_cross_entropy(fn, shapes, out):
    h, w = shapes[0], shapes[1]
    N, D = _size(h[:-1]), h[-1]
    V = w[1] if fn.layout == "dv" else w[0]
    products = (6 if fn.compute_grad else 2) * N * D * V  # logits (and dh, dW: 4 N D V)
    return Cost(products, 4 * N * V, 0, N * D + V * D)


_RULES = {MatMul: _matmul, Linear: _linear, ScaledDotProductAttention: _attention,
          LinearCrossEntropy: _linear_cross_entropy}
# op: (forward, backward) FLOPs per element of the output
_PER_ELEMENT = {Add: (1, 0), Sub: (1, 1), Neg: (1, 1), Exp: (1, 1), Log: (1, 1), Mul: (1, 2),
                Div: (1, 3), Power: (1, 3), ReLU: (1, 1), Dropout: (1, 1),
                DropoutResidual: (2, 1), Softmax: (5, 4), LogSoftmax: (5, 3),
                LayerNorm: (7, 11), Embedding: (0, 1)}
# op: (forward, backward) FLOPs per element of the (first) input
_PER_INPUT_ELEMENT = {Sum: (1, 0), Mean: (1, 0), SoftmaxCrossEntropy: (5, 4)}


def cost(fn: tensor.Function, shapes: tuple, out_shape: tuple) -> Cost:
    """The FLOPs of one call of ``fn`` with inputs of ``shapes`` and an output of
    ``out_shape`` (the module docstring's table; a subclass counts as its base op)."""
    for klass in type(fn).__mro__:
        if klass in _RULES:
            return _RULES[klass](fn, shapes, out_shape)
        if klass in _PER_ELEMENT or klass in _PER_INPUT_ELEMENT:
            per = _PER_ELEMENT.get(klass) or _PER_INPUT_ELEMENT[klass]
            n = _size(out_shape if klass in _PER_ELEMENT else shapes[0])
            return Cost(0, per[0] * n, 0, per[1] * n)
    return Cost()


# ---- the machine's GEMM rate ----------------------------------------------------------------
_peaks = {}  # (device, dtype, n) -> GFLOP/s


def _synchronizer(xp):
    """A function that waits for ``xp``'s device (nothing to wait for with NumPy)."""
    if xp is np:
        return lambda: None
    return xp.cuda.Device().synchronize


def measure_peak_gflops(xp: Any, dtype: Any, n: int = 1024, repeats: int = 5,
                        min_seconds: float = 0.25) -> float:
    """The best rate, in GFLOP/s, of an n x n x n product of ``dtype`` on ``xp``'s device
    (numpy: the CPU; cupy: the current GPU): 2 n^3 FLOPs over the fastest of the timed
    products, after one untimed: at least ``repeats`` of them, and more until they took
    ``min_seconds`` (at most 10,000: on a GPU a product takes tens of microseconds), so that
    a moment when other work shares the machine does not make the denominator low and a
    row's MFU above 100%. Measured once per (device, dtype, n), then cached."""
    dtype = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype(np.float32)
    device = "cpu" if xp is np else f"cuda:{xp.cuda.Device().id}"
    key = (device, dtype.str, n)
    if key not in _peaks:
        rng = np.random.default_rng(0)
        a, b = (xp.asarray(rng.standard_normal((n, n)), dtype=dtype) for _ in range(2))
        sync, best, spent, timed = _synchronizer(xp), math.inf, 0.0, -1
        while timed < repeats or (spent < min_seconds and timed < 10_000):
            sync()
            t0 = time.perf_counter()
            a @ b
            sync()
            seconds = time.perf_counter() - t0
            if timed >= 0:  # (the first product: untimed)
                best, spent = min(best, seconds), spent + seconds
            timed += 1
        _peaks[key] = 2 * n ** 3 / best / 1e9
    return _peaks[key]


# ---- the profiler ---------------------------------------------------------------------------
@dataclass
class OpStats:
    """What one row of the table adds up."""
    calls: int = 0              # forward calls
    forward_s: float = 0.0
    backward_s: float = 0.0
    flops: int = 0              # all counted FLOPs, forward and backward
    product_flops: int = 0      # those of matrix products
    bytes: int = 0              # bytes read and written, forward and backward

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    def add(self, other: OpStats) -> None:
        for name in vars(other):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _nbytes(a):
    return int(getattr(a, "nbytes", 0))


class Profiler:
    """Records every op run while it is active (``with Profiler(model) as prof:``, or
    ``profile``); it can be entered again to add more. A profile opened inside another
    records its ops in both. ``root``: the model, whose module paths name the rows of
    ``table(by="module")``; ``device_sync``: on CuPy, wait for the GPU around each timed
    call; ``peak_gflops``: the MFU denominator (default: ``measure_peak_gflops``)."""

    def __init__(self, root: Any = None, device_sync: bool = True,
                 peak_gflops: Optional[float] = None) -> None:
        self.root, self.device_sync, self.peak_gflops = root, device_sync, peak_gflops
        self.stats = {}     # (op name, id(module)) -> OpStats
        self._modules = {}  # id(module) -> module, kept so that the id stays its own
        self.wall_seconds = 0.0  # time inside the profile, ops or not
        self._device = None      # (xp, dtype) of the first matrix product: for the peak
        self._outer, self._active, self._nested = None, False, 0.0

    def __enter__(self) -> Profiler:
        if self._active:
            raise RuntimeError("this Profiler is already active")
        self._active, self._outer, tensor._profiler = True, tensor._profiler, self
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall_seconds += time.perf_counter() - self._start
        tensor._profiler, self._outer, self._active = self._outer, None, False

    # ---- called by the engine (tensor.py) while active --------------------------------
    def forward(self, fn: tensor.Function, arrays: list) -> Any:
        """``fn.forward(*arrays)`` (its inputs as forward takes them: arrays, or a Python
        number or None), timed and counted -> its output."""
        seconds, out = self._timed(fn.forward, arrays)
        c = cost(fn, tuple(getattr(a, "shape", ()) for a in arrays), getattr(out, "shape", ()))
        if self._device is None and c.forward_products:
            self._device = (backend.get_array_module(*arrays),
                            next(a.dtype for a in arrays if hasattr(a, "dtype")))
        nbytes = sum(_nbytes(a) for a in arrays) + _nbytes(out)
        self._record(fn, OpStats(1, seconds, 0.0, c.forward_products + c.forward_other,
                                 c.forward_products, nbytes))
        return out

    def backward(self, node: tensor.Function, g_out: Any) -> Any:
        """``node.backward(g_out)``, timed and counted -> the input gradients."""
        seconds, g_in = self._timed(node.backward, [g_out])
        c = cost(node, tuple(tuple(t.shape) for t in node.inputs), getattr(g_out, "shape", ()))
        grads = g_in if isinstance(g_in, tuple) else (g_in,)
        nbytes = _nbytes(g_out) + sum(_nbytes(g) for g in grads)
        self._record(node, OpStats(0, 0.0, seconds, c.backward_products + c.backward_other,
                                   c.backward_products, nbytes))
        return g_in

    def _timed(self, call, arrays):
        """-> (seconds, call(*arrays)); the seconds of ops timed inside it (an op whose forward
        applies other ops) are left to those ops, so no time is counted twice."""
        xp = backend.get_array_module(*arrays)
        sync = _synchronizer(xp if self.device_sync else np)
        sync()
        outer, self._nested = self._nested, 0.0
        t0 = time.perf_counter()
        try:
            result = call(*arrays)
            sync()
        finally:
            elapsed = time.perf_counter() - t0
            own, self._nested = elapsed - self._nested, outer + elapsed
        return own, result

    def _record(self, fn, stats):
        module = getattr(fn, "module", None)
        key = (type(fn).__name__, id(module))
        profiler = self
        while profiler is not None:  # this profile and every one it is nested in
            profiler._modules[id(module)] = module
            profiler.stats.setdefault(key, OpStats()).add(stats)
            profiler = profiler._outer

    # ---- results ---------------------------------------------------------------------------
    def total_seconds(self) -> float:
        """Seconds spent inside the ops' forward and backward, all rows."""
        return sum(s.seconds for s in self.stats.values())

    def total_flops(self, products_only: bool = False) -> int:
        """FLOPs counted, all rows (``products_only``: those of matrix products only)."""
        return sum(s.product_flops if products_only else s.flops for s in self.stats.values())

    def rows(self, by: str = "op", depth: Optional[int] = None) -> list[tuple[str, OpStats]]:
        """[(name, OpStats)], the most time first: one row per op class (``by="op"``) or per
        module path (``by="module"``; ``depth`` keeps the first parts of a path: 2 groups
        "encoder.0.ff.w1" under "encoder.0"); ops applied outside a module: "(no module)"."""
        if by not in ("op", "module"):
            raise ValueError(f"by must be 'op' or 'module', not {by!r}")
        paths = scope.module_paths(self.root)
        groups = {}
        for (op, module_id), stats in self.stats.items():
            if by == "op":
                name = op
            else:
                name = scope.path_of(self._modules[module_id], paths) or "(no module)"
                name = ".".join(name.split(".")[:depth]) if depth else name
            groups.setdefault(name, OpStats()).add(stats)
        return sorted(groups.items(), key=lambda kv: -kv[1].seconds)

    def peak(self) -> float:
        """The MFU denominator in GFLOP/s: ``peak_gflops``, else the measured GEMM rate of
        the device and dtype of the first matrix product profiled (float32 on the CPU when
        there was none)."""
        if self.peak_gflops is None:
            xp, dtype = self._device or (np, np.float32)
            self.peak_gflops = measure_peak_gflops(xp, dtype)
        return self.peak_gflops

    def table(self, by: str = "op", top: Optional[int] = None, depth: Optional[int] = None) -> str:
        """The rows (``rows(by, depth)``) as text, the ``top`` most expensive only (the rest
        summed in one row), a totals row at the end; a caption says what is measured."""
        rows, peak, total = self.rows(by, depth), self.peak(), self.total_seconds()
        if top is not None and len(rows) > top:
            rest = OpStats()
            for _, stats in rows[top:]:
                rest.add(stats)
            rows = rows[:top] + [(f"({len(rows) - top} more)", rest)]
        everything = OpStats()
        for stats in self.stats.values():
            everything.add(stats)
        width = max([len(by), 5] + [len(name) for name, _ in rows])
        above = any(s.seconds > 0 and s.flops / s.seconds / 1e9 > peak for _, s in rows)
        lines = [_caption(total, self.wall_seconds, peak, self._device, above),
                 f"{by:<{width}}" + "".join(f"{c:>{w}}" for c, w in _COLUMNS)]
        lines += [_row(name, s, total, peak, width) for name, s in rows]
        lines.append(_row("total", everything, total, peak, width))
        return "\n".join(lines)


# column titles and widths of ``Profiler.table``
_COLUMNS = [("calls", 7), ("fwd ms", 10), ("bwd ms", 10), ("total ms", 10), ("%", 7),
            ("GFLOP", 9), ("GFLOP/s", 9), ("MFU", 7), ("MB", 9)]


def _row(name, s, total, peak, width):
    rate = s.flops / s.seconds / 1e9 if s.seconds > 0 else 0.0
    share = 100 * s.seconds / total if total > 0 else 0.0
    cells = [f"{s.calls}", f"{1e3 * s.forward_s:.2f}", f"{1e3 * s.backward_s:.2f}",
             f"{1e3 * s.seconds:.2f}", f"{share:.1f}%", f"{s.flops / 1e9:.3f}", f"{rate:.1f}",
             f"{100 * rate / peak:.1f}%", f"{s.bytes / 1e6:.1f}"]
    return f"{name:<{width}}" + "".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS))


def _caption(total, wall, peak, device, above=False):
    dtype = np.dtype(device[1]).name if device else "float32"
    outside = f" of {1e3 * wall:.1f} ms profiled (the rest: optimizer, engine, Python)" \
        if wall > 0 else ""
    text = (f"{1e3 * total:.1f} ms in ops{outside}; MFU against {peak:.0f} GFLOP/s, this "
            f"device's measured {dtype} GEMM rate")
    if above:
        text += ("\n(an MFU above 100%: that row ran faster than the measured 1024-cubed "
                 "product: a larger product, or, on a CPU, other work or fewer BLAS threads "
                 "while it was measured; Profiler(..., peak_gflops=) sets the denominator)")
    return text


def profile(root: Any = None, device_sync: bool = True,
            peak_gflops: Optional[float] = None) -> Profiler:
    """``with profile(model) as prof: ...``: a new :class:`Profiler`, entered by ``with``."""
    return Profiler(root, device_sync, peak_gflops)
