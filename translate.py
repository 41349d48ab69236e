#!/usr/bin/env python
"""Translate with a trained run: see `python translate.py --help` and the README."""
import sys

from minitransformer import configure_process

if __name__ == "__main__":
    configure_process()  # BLAS, malloc and TF32 settings, before NumPy loads
    from minitransformer.mt.translate import main

    sys.exit(main())
