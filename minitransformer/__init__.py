"""minitransformer: "Attention Is All You Need", framework-free, on NumPy (CPU) or CuPy (GPU)."""
from ._blas import configure_cpu_blas as _configure_cpu_blas
from ._malloc import configure_allocator as _configure_allocator

_configure_cpu_blas()  # before numpy's OpenBLAS starts (no effect if numpy was imported first)
_configure_allocator()  # keep freed arrays in the heap: no page faults on every step

from . import engine, functional, nn, optim  # noqa: E402
from .backend import Generator, cupy_available, get_array_module, to_numpy  # noqa: E402
from .engine import Function, GradcheckError, Tensor, gradcheck, no_grad  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Tensor", "Function", "gradcheck", "GradcheckError", "no_grad", "Generator",
           "cupy_available", "get_array_module", "to_numpy", "engine", "nn", "optim",
           "functional"]
