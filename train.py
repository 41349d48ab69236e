#!/usr/bin/env python
"""Train a Transformer: see `python train.py --help` and the README.

`mpiexec -n N python train.py ...` trains data-parallel on N ranks (README: "Multiple
processes and GPUs"); plain `python train.py ...` is one process.
"""
import sys

from minitransformer import configure_process

if __name__ == "__main__":
    configure_process()  # BLAS, malloc and TF32 settings, before NumPy loads
    from minitransformer.settings import refuse_problems

    refuse_problems()  # (a MINITRANSFORMER_* switch with a value it does not take)
    from minitransformer.mt.distributed import abort_on_error, init_from_env
    from minitransformer.mt.train import cli

    comm = init_from_env()  # None unless started by mpiexec / srun
    with abort_on_error(comm):  # one failing rank ends the job instead of hanging the others
        sys.exit(cli(comm=comm))
