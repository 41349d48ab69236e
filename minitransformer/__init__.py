"""minitransformer: "Attention Is All You Need", framework-free, on NumPy (CPU) or CuPy (GPU).

Importing the package has no side effects and loads nothing heavy: the names below are
imported on first use. Programs that train call ``configure_process()`` first (process.py).
"""
import importlib

from .process import configure_process

__version__ = "0.1.0"

# name -> the submodule that defines it (a submodule itself where the value is None)
_LAZY = {
    "Tensor": "engine", "Function": "engine", "gradcheck": "engine", "GradcheckError": "engine",
    "no_grad": "engine", "detect_anomaly": "engine", "AnomalyError": "engine",
    "explain": "engine.explain", "to_dot": "engine.explain", "render": "engine.explain",
    "profile": "engine",
    "Profiler": "engine",
    "Generator": "backend", "cupy_available": "backend",
    "get_array_module": "backend", "to_numpy": "backend",
    "engine": None, "nn": None, "optim": None, "functional": None, "backend": None,
}
__all__ = ["configure_process"] + list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'minitransformer' has no attribute {name!r}")
    where = _LAZY[name]
    if where is None:
        value = importlib.import_module(f".{name}", __name__)
    else:
        value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
