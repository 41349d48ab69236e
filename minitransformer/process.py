"""Process set-up for programs that train or translate: opt-in, never done on import.

``train.py``, ``translate.py``, ``python -m minitransformer.doctor`` and the benchmark call
``configure_process()`` first thing, before NumPy is imported. A library user who wants the
same speed calls it at the top of their script::

    import minitransformer
    minitransformer.configure_process()   # before `import numpy` anywhere
    import numpy as np

It imports nothing heavy (importing ``minitransformer`` itself loads no NumPy).
"""
import os
from typing import MutableMapping

from ._blas import configure_cpu_blas
from ._malloc import configure_allocator


def configure_process(environ: MutableMapping[str, str] = os.environ, tf32: bool = True) -> None:
    """Three settings the command lines run with:

    * ``OPENBLAS_CORETYPE=SkylakeX`` where the CPU has AVX-512 and the user set none
      (float32 GEMM about 2x faster; read by OpenBLAS when NumPy loads, so no effect after);
    * glibc ``mallopt`` keeping freed arrays in the heap (no page faults on every step);
    * ``CUPY_TF32=1`` unless set: float32 products on the GPU use TF32 tensor cores, as is
      usual for training (read by CuPy when it is imported; ``CUPY_TF32=0`` keeps full
      float32 products). ``tf32=False`` (translate.py) makes the default ``0``: TF32 rounds
      a product's inputs to 10-bit significands, enough to reorder near-tied beam
      hypotheses (seen on an H200: 9 of 40 beam-4 lines of a small model differed from the
      CPU's with TF32, none without), while decoding's small products gain little from it.
    """
    configure_cpu_blas(environ)
    configure_allocator(environ)
    environ.setdefault("CUPY_TF32", "1" if tf32 else "0")
