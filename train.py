#!/usr/bin/env python
"""Train a Transformer: see `python train.py --help` and the README."""
import sys

from minitransformer.mt.train import main

if __name__ == "__main__":
    sys.exit(main())
