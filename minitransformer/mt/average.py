"""python -m minitransformer.mt.average --run-dir R --last 5 --output R/averaged.npz"""
import sys

from .translate import average_main

if __name__ == "__main__":
    sys.exit(average_main())
