#!/usr/bin/env python
"""Translate with a trained run: see `python translate.py --help` and the README."""
import sys

from minitransformer.mt.translate import main

if __name__ == "__main__":
    sys.exit(main())
