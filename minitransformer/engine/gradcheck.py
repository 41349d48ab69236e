"""gradcheck: compare backward() with central finite differences, in one call.

    from minitransformer import gradcheck
    report = gradcheck(fn, inputs, params=())      # raises GradcheckError on a mismatch

``fn(*inputs)`` returns a Tensor (or a tuple whose first element is one). The check builds
the scalar L = sum(w * fn(...)) with a fixed random upstream weight w, so every output element
matters, and for every float input and parameter compares the analytic gradient dL/dx with
    (L(x + h u) - L(x - h u)) / (2 h)
along random unit directions u, and along every coordinate (the full Jacobian-vector row)
when x has at most ``full_max`` elements. Integer inputs (token ids) are passed through and
skipped; every float input is checked (to hold one constant, close over it in fn). Everything
runs in float64 by default, with h and tolerances taken from the dtype (float32 is allowed,
with tolerances loose enough to catch only gross errors; shorter floats are refused).

Modules. When ``fn`` is a Module, or a bound method of one (``model.loss``), gradcheck checks
a float64 copy of it (``copy.deepcopy``), not the module itself: every float array the module
tree holds (parameters and buffers such as a sinusoid table, also inside lists, tuples and
dicts), every float dtype attribute (a model's ``dtype`` / ``compute_dtype``, which drive its
casts) and float scalar is cast, so a float32 or float16 (mixed-precision) model really runs
in float64. The copy's parameters are checked under the original names (``params`` given as
the module's tensors are mapped to the copy's), it is put in eval mode (dropout off) unless
``train=True``, and a dropout kept on is made repeatable by re-seeding its generators before
every evaluation (every Generator the modules hold, whatever its attribute's name). The
caller's module is left untouched: same arrays, dtypes, training flag,
gradients and generator states. A module that cannot be deep-copied is checked in place if it
is already entirely in the check dtype, and refused with a TypeError saying what to do
otherwise. Tensors that are not the module's (and every ``params`` entry when ``fn`` is a
plain function) are cast in place for the check and restored after.

A failure report says when dropout drew masks during the evaluations (the engine counts the
draws: ops.dropout_draws), which makes finite differences meaningless unless every evaluation
draws the same masks: typically a lambda closing over a model left in training mode, which
gradcheck cannot see or re-seed. It also says when fn's output has a lower precision than the
check (a closure over a float32 model keeps computing in float32).
"""
from __future__ import annotations

import copy
import types
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .. import backend
from .ops import dropout_draws
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


def _module_of(fn):
    """The Module that ``fn`` is, or whose bound method it is (``model.loss``); else None."""
    if _is_module(fn) and not isinstance(fn, type):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if owner is not None and not isinstance(owner, type) and _is_module(owner) \
        else None


def _copy_in_dtype(module, dtype):
    """(copy of ``module`` with every float array, dtype and scalar cast to ``dtype``, memo
    mapping id(original object) -> its copy), or (module, {}) when a module that cannot be
    copied is already entirely in ``dtype``."""
    memo = {}  # pre-filled: what the copy shares with the original, or gets made afresh
    for m in module.modules():
        for v in vars(m).values():
            if isinstance(v, types.ModuleType):  # an ``xp`` (numpy): shared, not copied
                memo[id(v)] = v
            elif isinstance(v, backend.Generator) and id(v) not in memo:
                twin = backend.Generator(0, v.device)  # a twin in the same state (a CuPy
                twin.set_state(v.get_state())           # generator's handle is not shared)
                memo[id(v)] = twin
    try:
        twin = copy.deepcopy(module, memo)
    except Exception as e:  # a foreign object somewhere in the module tree
        if all(p.dtype == dtype for _, p in module.named_parameters() if _float(p.data)):
            return module, {}
        name = type(module).__name__
        raise TypeError(
            f"gradcheck checks a Module on a {dtype} copy, but copy.deepcopy({name}) failed "
            f"({type(e).__name__}: {e}). Make {name} deep-copyable (give the object that "
            f"copy.deepcopy refuses a __deepcopy__), or build the module in {dtype} (parameters, "
            f"buffers and dtype settings, e.g. Transformer(cfg, dtype=np.{dtype})), or pass "
            f"gradcheck dtype=<the module's dtype> to check it as it is") from e
    seen = set()
    for m in twin.modules():
        for k, v in list(vars(m).items()):
            setattr(m, k, _cast_tree(v, dtype, seen))
    return twin, memo


def _on_copy(p, memo):
    """A ``params`` entry (a Tensor or a (name, Tensor) pair) naming the copy's Tensor when
    the original is the module's; other Tensors are checked in place."""
    if isinstance(p, Tensor):
        return memo.get(id(p), p)
    name, t = p
    return name, memo.get(id(t), t)


def _cast_tree(v, dtype, seen):
    """v with its float arrays, dtypes and scalars cast to ``dtype``: Tensors and containers
    in place (so sharing survives), other values replaced. Modules are left to modules()."""
    if id(v) in seen:
        return v
    if isinstance(v, Tensor):
        seen.add(id(v))
        if _float(v.data):
            v.data, v.grad = v.data.astype(dtype), None
        return v
    if isinstance(v, np.dtype):
        return dtype if v.kind == "f" else v
    if isinstance(v, type):
        return dtype.type if issubclass(v, np.floating) else v
    if isinstance(v, np.floating):
        return dtype.type(v)
    if isinstance(v, (list, dict)):
        seen.add(id(v))
        for k in (range(len(v)) if isinstance(v, list) else list(v)):
            v[k] = _cast_tree(v[k], dtype, seen)
        return v
    if type(v) is tuple:
        return tuple(_cast_tree(x, dtype, seen) for x in v)
    if hasattr(v, "astype") and isinstance(getattr(v, "dtype", None), np.dtype) \
            and hasattr(v, "shape") and not _is_module(v):  # a NumPy or CuPy array
        return v.astype(dtype) if _float(v) else v
    return v


def gradcheck(fn: Callable[..., Tensor], inputs: Sequence[Any], params: Sequence[Any] = (),
              dtype: Any = np.float64, n_directions: int = 8, full_max: int = 64,
              eps: Optional[float] = None, rtol: Optional[float] = None,
              atol: Optional[float] = None, seed: int = 0, train: bool = False,
              raise_on_failure: bool = True) -> dict:
    """Check fn's gradients w.r.t. float ``inputs`` and ``params`` by finite differences.

    Returns a dict ``{name: {"max_abs": .., "max_rel": .., "where": .., "ok": bool,
    "reached": bool}}`` (names ``input[i]`` and the parameters' names; ``where``: the index,
    or random direction, of the largest failure, else of the largest relative error;
    ``reached``: whether backward gave it a gradient at all). ``eps``, ``rtol`` and ``atol``
    default to the dtype's (TOLERANCES); a failure is |a - n| > atol + rtol * max(|a|, |n|).
    Raises GradcheckError listing, per input and parameter, the max absolute and relative
    error and where (and a note when dropout was active, no gradient reached an input, or
    fn's output has a lower precision than ``dtype``), unless
    ``raise_on_failure=False``. A Module, or a bound method of one, as ``fn`` is checked on a
    copy in ``dtype`` with its parameters, in eval mode unless ``train=True`` (see the module
    docstring); the caller's module is not changed.
    """
    dtype = np.dtype(dtype)
    if dtype not in TOLERANCES:
        raise ValueError(f"gradcheck runs in float64 (the default) or float32, not {dtype}: "
                         "finite differences in a shorter float are mostly rounding")
    h0, rtol0, atol0 = TOLERANCES[dtype]
    h = h0 if eps is None else float(eps)
    rtol = rtol0 if rtol is None else float(rtol)
    atol = atol0 if atol is None else float(atol)
    if not h > 0 or rtol < 0 or atol < 0 or not rtol + atol > 0:
        raise ValueError(f"gradcheck needs eps > 0, rtol >= 0 and atol >= 0, not both 0; "
                         f"got eps={eps}, rtol={rtol}, atol={atol}")
    fn, module, params = _on_check_copy(fn, params, dtype)
    if module is not None:
        was_training = module.training
        module.train(train)
    named = [(f"param[{i}]", p) if isinstance(p, Tensor) else p for i, p in enumerate(params)]
    tensors = _cast_inputs(inputs, dtype)
    saved = _cast_params(named, dtype)  # (restored at the end)
    evaluate = _evaluator(fn, tensors, _generators(module, inputs))
    draws_before = dropout_draws()
    try:
        out, report = _check_all(evaluate, tensors, named, dtype, seed, h=h, rtol=rtol,
                                 atol=atol, n_directions=n_directions, full_max=full_max)
        draws = dropout_draws()
    finally:
        _restore(saved)
        if module is not None:
            module.train(was_training)
    if raise_on_failure and not all(r["ok"] for r in report.values()):
        lines = _failure_table(report, dtype, h, rtol, atol)
        lines += _hints(out.dtype, dtype, draws_before, draws, module is not None and train)
        raise GradcheckError("\n".join(lines))
    return report


def _on_check_copy(fn, params, dtype):
    """-> (fn, module, params) to check. When fn is a Module or a bound method of one, fn and
    ``params`` are moved onto its ``dtype`` copy (params default to all its parameters);
    otherwise they are returned as they are, with module None."""
    module = _module_of(fn)
    if module is None:
        return fn, None, params
    original = module
    module, memo = _copy_in_dtype(module, dtype)
    if module is not original:  # fn runs on the copy: the module, or its bound method
        fn = module if fn is original else types.MethodType(fn.__func__, module)
    params = [_on_copy(p, memo) for p in params] or list(module.named_parameters())
    return fn, module, params


def _cast_inputs(inputs, dtype):
    """``inputs`` as Tensors: each float one a new leaf in ``dtype`` that requires grad,
    integer ones (token ids) passed through."""
    tensors = []
    for x in inputs:
        t = x if isinstance(x, Tensor) else Tensor(x)
        if _float(t.data):
            t = Tensor(t.data.astype(dtype), requires_grad=True)
        tensors.append(t)
    return tensors


def _cast_params(named, dtype):
    """Cast each (name, Tensor) parameter to ``dtype``, requiring grad, in place.
    -> what ``_restore`` needs to undo it."""
    saved = [(p, p.data, p.requires_grad, p.grad) for _, p in named]
    for _, p in named:
        p.data, p.requires_grad, p.grad = p.data.astype(dtype), True, None
    return saved


def _restore(saved):
    """Undo ``_cast_params``: the original data, requires_grad and gradient."""
    for p, data, rg, grad in saved:
        p.data, p.requires_grad, p.grad = data, rg, grad


def _evaluator(fn, tensors, generators):
    """-> evaluate(): fn(*tensors) (its first element when a tuple), with the dropout
    ``generators`` reset first, so that every evaluation draws the same masks."""
    def evaluate():
        for g, state in generators:
            g.set_state(state)
        out = fn(*tensors)
        return out[0] if isinstance(out, tuple) else out
    return evaluate


def _check_all(evaluate, tensors, named, dtype, seed, h, rtol, atol, n_directions, full_max):
    """One backward of L = sum(w * out), w a random upstream weight, then each float input's
    and each parameter's gradient compared with finite differences of L. -> (out, report)."""
    out = evaluate()
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: fn returned a {type(out).__name__}, not a Tensor: compute "
                        "its result from the Tensors it is given (inputs arrive as Tensors), "
                        "with the engine's ops or your Functions")
    if not out.requires_grad:
        raise ValueError("gradcheck: fn's output does not depend on any float input or "
                         "parameter (it is a constant: fn detached it, ran under no_grad(), or "
                         "was given integer inputs only); nothing to check")
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
        if t.size > full_max and n_directions < 1:
            raise ValueError(f"gradcheck: {name} has {t.size} elements, more than "
                             f"full_max={full_max}, and n_directions={n_directions}: nothing "
                             "would check it; raise full_max or n_directions")
        report[name] = _check_one(t, loss, xp, rs, h, rtol, atol, n_directions, full_max)
    return out, report


def _failure_table(report, dtype, h, rtol, atol):
    """The lines of a GradcheckError: the settings, then one line per input and parameter."""
    lines = [f"gradcheck failed ({dtype}, h={h}, rtol={rtol}, atol={atol}):"]
    for k, r in report.items():
        lines.append(f"  {'FAIL' if not r['ok'] else 'ok  '} {k:<28} max abs {r['max_abs']:.3e}"
                     f"  max rel {r['max_rel']:.3e}  at {r['where']}")
        if not r["ok"] and not r["reached"]:
            lines.append(f"       (no gradient reached {k}: backward returned None for it, or "
                         "it is not used; to hold a float input constant, close over it in "
                         "fn instead of passing it in inputs)")
    return lines


def _hints(out_dtype, dtype, draws_before, draws, module_train):
    """Likely causes of a failure that are not a wrong backward: dropout drawing masks during
    the evaluations, and an output computed in a lower precision than the check."""
    hints = []
    rates = sorted(r for r, n in draws.items() if n > draws_before.get(r, 0))
    if rates:
        fix = ("pass train=False (the default) to check it in eval mode" if module_train else
               "call module.eval() on the model fn uses (or set its dropout rates to 0), or "
               "pass the module itself or its bound method (e.g. model.loss) as fn, which "
               "gradcheck puts in eval mode")
        hints.append(f"  note: dropout was active during the check (rate "
                     f"{', '.join(f'{r:g}' for r in rates)}): finite differences need every "
                     f"evaluation to draw the same masks; {fix}.")
    if out_dtype.kind == "f" and out_dtype.itemsize < dtype.itemsize:
        hints.append(f"  note: fn's output is {out_dtype}, not {dtype}: fn computes in a lower "
                     f"precision (e.g. a lambda over a {out_dtype} model, whose buffers and "
                     f"compute dtype gradcheck cannot cast); pass the module itself or its "
                     f"bound method (e.g. model.loss) as fn so that a {dtype} copy is checked, "
                     f"or build the model in {dtype}.")
    return hints


def _check_one(t, loss, xp, rs, h, rtol, atol, n_directions, full_max):
    reached = t.grad is not None  # (else no Function gave this input a gradient)
    analytic = t.grad if reached else xp.zeros_like(t.data)
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
    worst = max(results, key=lambda r: (not r[3], r[1]))  # the largest failure, if any
    return {"max_abs": max(r[0] for r in results), "max_rel": max(r[1] for r in results),
            "where": worst[2], "ok": all(r[3] for r in results), "reached": reached}


def _compare(ana, num, where, rtol, atol):
    """Pass when |a - n| <= atol + rtol * max(|a|, |n|). The reported relative error divides by
    max(|a|, |n|, atol / rtol): a gradient that is truly 0 (e.g. of a key bias, to which
    softmax is invariant) is judged by its absolute error, not by 0 / 0."""
    err = abs(ana - num)
    scale = max(abs(ana), abs(num))
    floor = atol / rtol if rtol else np.finfo(np.float64).tiny
    return err, err / max(scale, floor), where, err <= atol + rtol * scale


def _generators(module, inputs):
    """(generator, state) pairs to reset before each evaluation, so dropout repeats."""
    found = []
    if module is not None:
        for m in module.modules():  # (whatever the attribute's name, also in containers)
            for v in [getattr(m, "rng", None), *vars(m).values()]:
                items = v.values() if isinstance(v, dict) else \
                    v if isinstance(v, (list, tuple)) else [v]
                for g in items:
                    if isinstance(g, backend.Generator) and all(g is not f for f, _ in found):
                        found.append((g, g.get_state()))
    return found
