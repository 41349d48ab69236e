"""Anomaly mode: find the first op that makes a NaN or an Inf.

    from minitransformer.engine import detect_anomaly
    with detect_anomaly(model):    # (the model: its module paths go into the message)
        loss = model(...)          # each op's output is checked right after its forward
        loss.backward()            # each op's input gradients right after its backward

Inside the block every Function's result is checked with ``isfinite``; the first one that
holds a NaN or an Inf raises :class:`AnomalyError`, naming the Function, forward or backward,
and the shapes and dtypes of what it was given (and whether that was already non-finite, in
which case the values came from outside the tape: a parameter or the data). Given the root
module, the message also names the module whose forward applied the op (``decoder.1.ff.w1``).
It costs one pass over every array and, on a GPU, a wait per op, so it is for finding a
fault, not for training: train.py turns it on only to replay a batch whose loss or gradient
was not finite.
"""
from __future__ import annotations

import cmath
import contextlib

from .. import backend
from . import scope

_enabled = False
_paths = None     # scope.module_paths of the root given to detect_anomaly, or None


class AnomalyError(FloatingPointError):
    """A NaN or Inf appeared; ``op`` (the Function's class name), ``phase`` ("forward" or
    "backward") and ``shapes`` (of its inputs) say where; the message says it in words."""

    def __init__(self, message, op, phase, shapes, module=None):
        super().__init__(message)
        self.op, self.phase, self.shapes, self.module = op, phase, shapes, module


@contextlib.contextmanager
def detect_anomaly(root=None):
    """Within the block, every op's forward output and backward gradients are checked.
    ``root``: a Module (anything with ``named_modules``) whose paths name where an op ran."""
    global _enabled, _paths
    previous = _enabled, _paths
    _enabled, _paths = True, (None if root is None else scope.module_paths(root))
    try:
        yield
    finally:
        _enabled, _paths = previous


def enabled():
    return _enabled


def _finite(a):
    if isinstance(a, (float, complex)):  # (a Python number given to a Function's apply)
        return cmath.isfinite(a)
    if a is None or not hasattr(a, "dtype") or a.dtype.kind not in "fc":
        return True
    return bool(backend.get_array_module(a).isfinite(a).all())


def _describe(arrays):
    return ", ".join(f"{tuple(a.shape)} {a.dtype}" if hasattr(a, "shape") else repr(a)
                     for a in arrays)


def _raise(fn, phase, given, what):
    name = type(fn).__name__
    module = None if _paths is None else scope.path_of(getattr(fn, "module", None), _paths)
    where = f" (in {module})" if module else ""
    shapes = [tuple(a.shape) for a in given if hasattr(a, "shape")]
    if all(_finite(a) for a in given):
        origin = f"{name} {phase} made a NaN or Inf {what} from finite values"
    else:
        origin = (f"{name} {phase} was given non-finite values (from outside the tape: a "
                  f"parameter or the data), and its {what} is not finite")
    raise AnomalyError(f"{origin}{where}; it was given {_describe(given)}", name, phase, shapes,
                       module)


def check_forward(fn, inputs, output):
    """After ``fn.forward(*inputs)`` returned ``output`` (raw arrays)."""
    if not _finite(output):
        _raise(fn, "forward", inputs, "output")


def check_backward(fn, grad_out, grads_in):
    """After ``fn.backward(grad_out)`` returned ``grads_in`` (raw arrays or None)."""
    if not all(_finite(g) for g in grads_in):
        _raise(fn, "backward", [grad_out], "input gradient")
