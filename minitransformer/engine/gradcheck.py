"""gradcheck: compare backward() with central finite differences, in one call.

    from minitransformer import gradcheck
    report = gradcheck(fn, inputs, params=())      # raises GradcheckError on a mismatch

``fn(*inputs)`` returns a Tensor (or a tuple whose first element is one). The check builds
the scalar L = sum(w * fn(...)) with a fixed random upstream weight w, so every output element
matters, and for every float input and parameter compares the analytic gradient dL/dx with
    (L(x + h u) - L(x - h u)) / (2 h)
along random unit directions u, and along every coordinate (the full Jacobian-vector row)
when x has at most ``full_max`` elements. Integer inputs (token ids) are passed through and
skipped. Everything runs in float64 by default (inputs and parameters are cast for the check
and restored after), with h and tolerances taken from the dtype. A Module passed as ``fn`` has
its parameters checked too and is put in eval mode (dropout off) unless ``train=True``; a
dropout kept on is made repeatable by re-seeding the generators before every evaluation.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import backend
from .tensor import Tensor, no_grad

# dtype -> (finite-difference step h, rtol, atol)
TOLERANCES = {np.dtype(np.float64): (1e-6, 1e-5, 1e-8),
              np.dtype(np.float32): (1e-2, 5e-2, 1e-3)}


class GradcheckError(AssertionError):
    """Raised when analytic and numerical gradients disagree; the message has the table."""


def _float(a):
    return a.dtype.kind == "f"


def _is_module(fn):
    """Anything with a Module's interface (named_parameters, train, modules, training): the
    engine does not import nn, whose Module is one such class."""
    return all(hasattr(fn, a) for a in ("named_parameters", "train", "modules", "training"))


def gradcheck(fn: Callable[..., Tensor], inputs: Sequence[Any], params: Sequence[Any] = (),
              dtype: Any = np.float64, n_directions: int = 8, full_max: int = 64,
              eps: Optional[float] = None, rtol: Optional[float] = None,
              atol: Optional[float] = None, seed: int = 0, train: bool = False,
              raise_on_failure: bool = True) -> dict:
    """Check fn's gradients w.r.t. float ``inputs`` and ``params`` by finite differences.

    Returns a dict ``{name: {"max_abs": .., "max_rel": .., "where": .., "ok": bool}}``
    (names ``input[i]`` and the parameters' names). Raises GradcheckError listing, per input
    and parameter, the max absolute and relative error and where, unless
    ``raise_on_failure=False``.
    """
    dtype = np.dtype(dtype)
    h0, rtol0, atol0 = TOLERANCES.get(dtype, TOLERANCES[np.dtype(np.float32)])
    h, rtol, atol = eps or h0, rtol or rtol0, atol or atol0
    module = fn if _is_module(fn) else None
    if module is not None:
        params = list(module.named_parameters()) if not params else params
        was_training = module.training
        module.train(train)
    named = [(f"param[{i}]", p) if isinstance(p, Tensor) else p for i, p in enumerate(params)]

    # cast float inputs and parameters to the check dtype (restored at the end)
    tensors = []
    for x in inputs:
        t = x if isinstance(x, Tensor) else Tensor(x)
        if _float(t.data):
            t = Tensor(t.data.astype(dtype), requires_grad=True)
        tensors.append(t)
    saved = [(p, p.data, p.requires_grad) for _, p in named]
    for _, p in named:
        p.data, p.requires_grad, p.grad = p.data.astype(dtype), True, None
    generators = _generators(module, inputs)

    def evaluate():
        for g, state in generators:
            g.set_state(state)
        out = fn(*tensors)
        return out[0] if isinstance(out, tuple) else out

    try:
        out = evaluate()
        xp = out.xp
        rs = np.random.default_rng(seed)
        w = xp.asarray(rs.standard_normal(out.shape)).astype(dtype)  # structured upstream grad
        (out * Tensor(w)).sum().backward()

        def loss():
            with no_grad():
                return float((evaluate().data * w).sum())

        checked = [(f"input[{i}]", t) for i, t in enumerate(tensors)
                   if _float(t.data)] + list(named)
        report = {}
        for name, t in checked:
            report[name] = _check_one(t, loss, xp, rs, h, rtol, atol, n_directions, full_max)
    finally:
        for p, data, rg in saved:
            p.data, p.requires_grad = data, rg
            p.grad = None
        if module is not None:
            module.train(was_training)

    bad = {k: r for k, r in report.items() if not r["ok"]}
    if bad and raise_on_failure:
        lines = [f"gradcheck failed ({dtype}, h={h}, rtol={rtol}, atol={atol}):"]
        for k, r in report.items():
            lines.append(f"  {'FAIL' if not r['ok'] else 'ok  '} {k:<28} max abs {r['max_abs']:.3e}"
                         f"  max rel {r['max_rel']:.3e}  at {r['where']}")
        raise GradcheckError("\n".join(lines))
    return report


def _check_one(t, loss, xp, rs, h, rtol, atol, n_directions, full_max):
    analytic = t.grad if t.grad is not None else xp.zeros_like(t.data)
    original = t.data.copy()
    results = []  # (abs err, rel err, where, ok)

    def directional(u):
        t.data = original + h * u
        lp = loss()
        t.data = original - h * u
        lm = loss()
        t.data = original.copy()
        return (lp - lm) / (2 * h)

    if t.size <= full_max:  # every coordinate: the full gradient, element by element
        for idx in np.ndindex(*t.shape):
            u = xp.zeros_like(original)
            u[idx] = 1
            num, ana = directional(u), float(analytic[idx])
            results.append(_compare(ana, num, idx, rtol, atol))
    for k in range(n_directions):
        u = xp.asarray(rs.standard_normal(t.shape)).astype(original.dtype)
        u /= max(float(xp.sqrt((u * u).sum())), 1e-30)
        num, ana = directional(u), float((analytic * u).sum())
        results.append(_compare(ana, num, f"direction {k}", rtol, atol))
    t.data = original
    worst = max(results, key=lambda r: r[1] if r[3] else np.inf)
    return {"max_abs": max(r[0] for r in results), "max_rel": max(r[1] for r in results),
            "where": worst[2], "ok": all(r[3] for r in results)}


def _compare(ana, num, where, rtol, atol):
    """Pass when |a - n| <= atol + rtol * max(|a|, |n|). The reported relative error divides by
    max(|a|, |n|, atol / rtol): a gradient that is truly 0 (e.g. of a key bias, to which
    softmax is invariant) is judged by its absolute error, not by 0 / 0."""
    err = abs(ana - num)
    scale = max(abs(ana), abs(num))
    return err, err / max(scale, atol / rtol), where, err <= atol + rtol * scale


def _generators(module, inputs):
    """(generator, state) pairs to reset before each evaluation, so dropout repeats."""
    found = []
    if module is not None:
        for m in module.modules():
            g = getattr(m, "rng", None)
            if isinstance(g, backend.Generator) and all(g is not f for f, _ in found):
                found.append((g, g.get_state()))
    return found
