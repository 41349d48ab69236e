"""Installs the CuPy stand-in at interpreter start-up when CUDA_ON_CPU_STAND_IN=1 (set by
tests/cuda_on_cpu/run.py, which puts this directory on PYTHONPATH), then runs the
sitecustomize this one shadows, if there is one."""
import importlib.machinery
import importlib.util
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

# the next sitecustomize on the path (a distribution's, say), run as if this one were not here
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
