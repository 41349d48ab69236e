#!/usr/bin/env python
"""Translate with a trained run: see `python translate.py --help` and the README."""
import sys

from minitransformer import configure_process

if __name__ == "__main__":
    # BLAS and malloc settings before NumPy loads; full float32 products on a GPU (no TF32),
    # so that a GPU gives the CPU's translations (CUPY_TF32=1 in the environment wins)
    configure_process(tf32=False)
    from minitransformer.settings import refuse_problems

    refuse_problems()  # (a MINITRANSFORMER_* switch with a value it does not take)
    from minitransformer.mt.translate import main

    sys.exit(main())
