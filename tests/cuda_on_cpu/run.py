"""Run a Python command with the CuPy stand-in in place of CuPy:

    python tests/cuda_on_cpu/run.py train.py --device cuda ...
    python tests/cuda_on_cpu/run.py -m minitransformer.doctor
    mpiexec -n 2 python tests/cuda_on_cpu/run.py train.py --device cuda ...

``--device cuda`` then runs the package's GPU code path on this CPU: the CUDA kernels
compiled for the host, NCCL summing over MPI between the ranks (see fake_cupy.py). The
command runs in a fresh interpreter whose ``sitecustomize`` (site/) installs the stand-in
before anything imports CuPy, and so does every Python process it starts (the benchmark's
workers, for one). CUDA_ON_CPU_DEVICES sets how many GPUs it reports (default 1).
"""
import os
import sys

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")


def stand_in_env(env=None):
    """``env`` (default: this process's) with the stand-in switched on for Python children."""
    env = dict(os.environ if env is None else env)
    env["CUDA_ON_CPU_STAND_IN"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, env.get("PYTHONPATH")) if p)
    return env


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    os.execve(sys.executable, [sys.executable, *sys.argv[1:]], stand_in_env())


if __name__ == "__main__":
    main()
