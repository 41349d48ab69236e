"""CPU BLAS set-up that must run before numpy is imported (so: no numpy import here)."""
import os


def configure_cpu_blas(environ=os.environ, cpuinfo_path="/proc/cpuinfo"):
    """Let OpenBLAS use its AVX-512 kernels where the CPU has them.

    NumPy's bundled OpenBLAS may pick AVX2 kernels on AVX-512 machines; with
    OPENBLAS_CORETYPE=SkylakeX float32 GEMM runs about twice as fast. It must be set before
    numpy is first imported (``process.configure_process`` calls this first) and only where
    the CPU reports avx512f, avx512bw, avx512dq and avx512vl (elsewhere it crashes).
    A value the user set is kept. Returns the value in force, or None.
    """
    if "OPENBLAS_CORETYPE" in environ:
        return environ["OPENBLAS_CORETYPE"]
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            else:
                return None
    except OSError:
        return None
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        environ["OPENBLAS_CORETYPE"] = "SkylakeX"
        return "SkylakeX"
    return None
