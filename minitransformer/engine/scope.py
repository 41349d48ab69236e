"""Which module is running: the stack of Module forwards, so that each tape node knows the
module whose forward applied it.

``Module.__call__`` (nn/module.py) pushes the module while its forward runs; the engine knows
nothing of nn beyond that (it never imports it). ``Function.apply`` stores the innermost
running module on the node it records (``node.module``, None outside any module), and a
module's path in a model (``decoder.1.cross_attn``) comes from ``module_paths(root)``. The
tape listing, the profiler and anomaly mode name ops by it.
"""
from __future__ import annotations

import threading


class _Running(threading.local):
    """The modules whose forward is running in this thread, innermost last (a stack per
    thread: two threads decoding with one model do not see each other's modules)."""

    def __init__(self):
        self.stack = []


_running = _Running()


def push(module):
    """``module``'s forward starts (Module.__call__; ``pop`` when it returns or raises)."""
    _running.stack.append(module)


def pop():
    _running.stack.pop()


def current_module():
    """The innermost module whose forward is running in this thread, or None."""
    stack = _running.stack
    return stack[-1] if stack else None


def module_paths(root):
    """{id(module): path} for ``root`` (anything with ``named_modules``) and every module
    below it; the root's own path is "" (named "(model)" by ``path_of``)."""
    if root is None:
        return {}
    return {id(m): name for name, m in root.named_modules()}


def path_of(module, paths):
    """A module's path in ``paths`` (from ``module_paths``), else its class name, else None."""
    if module is None:
        return None
    name = paths.get(id(module))
    if name is None:
        return type(module).__name__
    return name or "(model)"
