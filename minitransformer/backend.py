"""Array backend: NumPy on CPU (default), CuPy on GPU. The only module that imports cupy.

Every op calls ``xp = get_array_module(*arrays)`` and then uses ``xp.*``, so one code path
serves both devices. The device is chosen explicitly: ``Tensor(..., device="cuda")``, a
``device=`` argument of the model and CLI, or ``MINITRANSFORMER_DEVICE=cuda`` for the CLI.
"""
import numpy as np

from .settings import SETTINGS

_cupy = None
_cupy_error = None
try:  # CuPy is optional: the [cuda12] / [cuda13] extras install it.
    import cupy as _cupy  # noqa: F401
except Exception as exc:  # ImportError, or a CUDA library failing to load
    _cupy, _cupy_error = None, exc

CUPY_FIX = ("install CuPy for your CUDA version with `pip install -e .[cuda12]` "
            "(or `.[cuda13]`), on a machine with an NVIDIA GPU and driver")


def cupy_available():
    """True when CuPy imports and sees at least one GPU."""
    if _cupy is None:
        return False
    try:
        return _cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get_xp(device):
    """The array module for ``device``: 'cpu' -> numpy, 'cuda' (or 'gpu') -> cupy."""
    device = (device or "cpu").lower()
    if device == "cpu":
        return np
    if device not in ("cuda", "gpu"):
        raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
    if _cupy is None:
        raise RuntimeError(f"device 'cuda' needs CuPy, which failed to import ({_cupy_error}); "
                           f"{CUPY_FIX}")
    if not cupy_available():
        raise RuntimeError(f"device 'cuda' asked for, but CuPy sees no GPU; {CUPY_FIX}, "
                           "or use device 'cpu'")
    return _cupy


def default_device():
    """The device named by MINITRANSFORMER_DEVICE, else 'cpu'."""
    return SETTINGS.device


def chosen_device(flag):
    """-> (device, how a message names where it came from) for a command line's --device
    value ``flag`` (None when not given): the flag's, else MINITRANSFORMER_DEVICE's."""
    if flag:
        return flag, f"--device {flag}"
    device = default_device()
    return device, f"MINITRANSFORMER_DEVICE={device} (the default of --device)"


def get_array_module(*arrays):
    """numpy or cupy, whichever owns the arrays (numpy for scalars and None)."""
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def device_of(array):
    return "cuda" if get_array_module(array) is not np else "cpu"


def accumulation_dtype(dtype):
    """The dtype a reduction over ``dtype`` values runs in: float32 for float16 (its 11-bit
    significand loses small terms of a long sum, and its range ends at 65504), else ``dtype``."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def sum_in_accumulation_dtype(x, axis=None, keepdims=False):
    """``x.sum(axis, keepdims)`` added up in ``accumulation_dtype`` (float32 for float16)
    and returned in x's dtype: the same call as x.sum for float32 and float64."""
    acc = accumulation_dtype(x.dtype)
    if acc == x.dtype:
        return x.sum(axis=axis, keepdims=keepdims)
    return x.sum(axis=axis, keepdims=keepdims, dtype=acc).astype(x.dtype)


def cast(x, dtype):
    """``x`` in ``dtype``, the same array when it already is. The one widen / narrow of the
    ops: float16 arrays are widened to ``accumulation_dtype`` for sums, exponentials and
    normalisation, and the result narrowed back to the input's dtype."""
    return x.astype(dtype, copy=False)


def row_max(x):
    """The maximum over the last axis, keepdims: ``x.max(axis=-1, keepdims=True)``, the same
    values (a maximum is exact in any order). NumPy reduces a short last axis (fewer than 64
    numbers: attention scores over a sentence's keys) one row at a time, about 40 ns a row;
    the rows transposed into columns are reduced with vector instructions, 3 to 4 times
    faster even counting the transposing copy."""
    S = x.shape[-1]
    if get_array_module(x) is not np or S >= 64 or S == 0 or x.size < 2 * S:
        return x.max(axis=-1, keepdims=True)
    return x.reshape(-1, S).T.copy().max(axis=0).reshape(x.shape[:-1] + (1,))


def transposed(a):
    """``a.T`` of a 2-D array as a new C-contiguous array. On NumPy the copy runs by blocks
    of rows that fit the L1 cache (about 32 KiB), each written out as columns: 3-4x faster
    than ``ascontiguousarray(a.T)``, which walks one side of the array with a large stride
    (the (8000, 128) output projection of the bench's tiny model: 1.1 ms -> 0.3 ms)."""
    xp = get_array_module(a)
    if xp is not np or a.ndim != 2:
        return xp.ascontiguousarray(a.T)
    n, d = a.shape
    out = np.empty((d, n), a.dtype)
    step = max(8, (32 << 10) // max(1, d * a.itemsize))
    for i in range(0, n, step):
        out[:, i:i + step] = a[i:i + step].T
    return out


def to_numpy(array):
    """A NumPy copy (or the array itself when already NumPy)."""
    if _cupy is not None and isinstance(array, _cupy.ndarray):
        return _cupy.asnumpy(array)
    return np.asarray(array)


def scatter_add(table, index, values):
    """table[index] += values, with repeated indices summed (embedding backward)."""
    if get_array_module(table) is np:
        np.add.at(table, index, values)
    else:
        import cupyx  # noqa: F401  (only reached when CuPy is present)
        cupyx.scatter_add(table, index, values)


class Generator:
    """A seedable random generator on the device, with a state that is plain data.

    Dropout takes one explicitly, so masks are reproducible. Each draw comes from a
    generator seeded afresh with a key derived from (seed, number of earlier draws), so the
    whole state is those two integers on every backend: ``get_state`` / ``set_state``
    restore it exactly, which a checkpoint needs for an exact resume (CuPy's generators
    expose no state). On NumPy the generator is numpy's default (PCG64). On CuPy it is one
    cuRAND Philox4x32-10 generator, reseeded for each draw: Philox is counter-based, so a
    new seed costs nothing, while a new cupy.random.default_rng (XORWOW) would set up
    256,000 cuRAND states at every dropout call.
    """

    def __init__(self, seed=0, device="cpu"):
        self.device = device
        self.xp = get_xp(device)
        self._curand = None  # the cuRAND generator (CuPy only), made on the first draw
        self.seed(seed)

    def seed(self, seed):
        self._seed, self.draws = int(seed), 0

    def random(self, shape, dtype):
        """Uniform [0, 1) of ``dtype`` (float32 or float64; float16 draws float32, which
        compares with a dropout rate just as well)."""
        key = np.random.SeedSequence([self._seed, self.draws]).generate_state(1, np.uint64)[0]
        self.draws += 1
        dtype = accumulation_dtype(dtype)
        if self.xp is np:
            return np.random.default_rng(int(key)).random(shape, dtype=dtype)
        if self._curand is None:
            self._curand = self.xp.random.RandomState(
                method=self.xp.cuda.curand.CURAND_RNG_PSEUDO_PHILOX4_32_10)
        # the key (a uint64: CuPy 13.0-13.2 refuse a Python int above int64 there) and the
        # stream's offset back to 0
        self._curand.seed(key)
        return self._curand.random_sample(shape, dtype=dtype)

    def get_state(self):
        return {"seed": self._seed, "draws": self.draws}

    def set_state(self, state):
        self._seed, self.draws = int(state["seed"]), int(state.get("draws", 0))
