"""C allocator set-up for NumPy's temporaries (Linux with glibc; elsewhere nothing happens).

A training step allocates and frees the same few hundred activation and gradient arrays of
one to a few tens of MiB. By default glibc serves such blocks with fresh ``mmap`` pages and
hands them back to the kernel on ``free``, so every step page-faults its whole working set
in again: on a 2-core machine that was a quarter of the step time (1.68 s against 1.26 s
per update for the Multi30k recipe's model, see bench/RESULTS.md). Three ``mallopt``
settings keep freed blocks in the heap for the next step instead.
"""
import ctypes
import ctypes.util
import os

from .settings import read as read_settings

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>
SETTINGS = (
    (M_MMAP_THRESHOLD, 32 << 20),  # blocks up to 32 MiB (glibc's maximum) come from the heap
    (M_TRIM_THRESHOLD, 1 << 30),   # return heap memory to the kernel only above 1 GiB free
    (M_TOP_PAD, 64 << 20),         # grow the heap 64 MiB at a time
)
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "GLIBC_TUNABLES")


def _glibc():
    name = ctypes.util.find_library("c")
    if os.name != "posix" or not name:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (raises AttributeError outside glibc)
    except (OSError, AttributeError):
        return None
    return libc


def configure_allocator(environ=os.environ, libc=None):
    """Apply SETTINGS with ``mallopt``; returns True when they are in force.

    Left alone where the user tunes malloc themselves (any of USER_VARIABLES is set), where
    MINITRANSFORMER_MALLOC=0, and where the C library is not glibc. Freed memory stays with
    the process (up to 1 GiB); the peak resident size does not change.
    """
    if not read_settings(environ).malloc:
        return False
    if any(v in environ for v in USER_VARIABLES):
        return False
    libc = _glibc() if libc is None else libc
    if libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in SETTINGS)
