"""Installs the CuPy stand-in at interpreter start-up when CUDA_ON_CPU_STAND_IN=1 (set by
tests/cuda_on_cpu/run.py, which puts this directory on PYTHONPATH), then runs the
sitecustomize this one shadows, if there is one."""
import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("CUDA_ON_CPU_STAND_IN") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))  # tests/
    try:
        from cuda_on_cpu import fake_cupy
        fake_cupy.install()
    finally:
        sys.path.pop(0)

# the next sitecustomize on the path (a distribution's), as if this one were not here
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["sitecustomize"]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
finally:
    sys.path[:] = _saved
