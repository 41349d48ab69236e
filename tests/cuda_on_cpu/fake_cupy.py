"""A CuPy stand-in: the package's GPU code runs unchanged on the CPU, with CuPy's rules.

``install()`` puts a module named ``cupy`` (and ``cupyx``, ``cupy.cuda``, ``cupy.cuda.nccl``,
``cupy.random``) into ``sys.modules`` and into ``minitransformer.backend``, so that
``--device cuda`` and ``Tensor(..., device="cuda")`` take the CuPy code path:

- device arrays are :class:`ndarray`, a wrapper around a NumPy array that is *not* a NumPy
  array: NumPy code that would silently work on the host but fails on a GPU fails here too.
  ``numpy.asarray(device_array)`` raises TypeError as CuPy's does, a ufunc or CuPy function
  given a NumPy array raises TypeError as CuPy's do, reductions return 0-d arrays, and
  ``get()`` / ``cupy.asnumpy`` bring values back;
- every name the package looks up in ``cupy``, ``cupyx``, ``cupy.cuda`` and ``cupy.random``,
  every ``ndarray`` attribute and every keyword argument is checked against the CuPy that is
  installed (``pip install cupy-cuda12x`` imports without a GPU): a NumPy-only function,
  method or keyword on the GPU path raises AttributeError / TypeError naming it;
- float16 products (``matmul``, ``dot``, ``tensordot``, ``einsum``, ``@``) accumulate in
  float32 and round once, as cuBLAS does with CuPy's defaults;
- ``RawModule`` and ``ElementwiseKernel`` compile the CUDA source with the host C++ compiler
  against ``cuda_on_cpu.h`` (``kernels.py``), so the kernels themselves run;
- ``cupy.random.RandomState`` draws from NumPy's Philox (not cuRAND's streams),
  ``cupy.cuda`` has a runtime with ``CUDA_ON_CPU_DEVICES`` GPUs (default 1), devices and
  streams that do nothing, and ``cupy.cuda.nccl`` sums over MPI (mpi4py) between the
  processes of an ``mpiexec`` run, reading the buffers through their pointers;
- device memory is counted as CuPy's pool counts it: each NumPy array that owns the memory
  behind device arrays holds its size rounded up to 512 bytes from its creation until it is
  freed (views add nothing), ``get_default_memory_pool().used_bytes()`` and
  ``cupy.cuda.runtime.memGetInfo()`` report it, ``cupy.cuda.MemoryHook``s entered in a
  thread hear of every allocation and free there, and an allocation past the device's
  memory (``CUDA_ON_CPU_MEMORY`` bytes, default 16 GiB) raises
  ``cupy.cuda.memory.OutOfMemoryError`` (the pool caches nothing: freed memory is free).

Without an installed CuPy the stand-in still runs, but checks nothing against CuPy's API
(``API_CHECKED`` is False).
"""
import collections
import ctypes
import functools
import inspect
import re
import sys
import threading
import types
import weakref

import numpy as np

try:  # the real CuPy, only for its names and signatures: it imports without a GPU
    import cupy as _real_cupy
    import cupyx as _real_cupyx
except Exception:  # not installed, or its CUDA libraries fail to load
    _real_cupy = _real_cupyx = None

API_CHECKED = _real_cupy is not None


class CupyApiError(AttributeError):
    """The GPU path used a name or keyword that real CuPy does not have."""


# ---- CuPy's API, as the installed package spells it ----------------------------------------
def _public(obj):
    return {n for n in dir(obj) if not n.startswith("__")} if obj is not None else None


REAL_NAMES = {  # module path -> names real CuPy has there (None: not checked)
    "cupy": _public(_real_cupy),
    "cupyx": _public(_real_cupyx),
    # cupy.cuda loads these submodules on first use, so dir() lists them only afterwards
    "cupy.cuda": (_public(getattr(_real_cupy, "cuda", None)) or set()) | {
        "nccl", "curand", "cublas", "cusolver", "cusparse", "cufft", "jitify"}
    if _real_cupy is not None else None,
    "cupy.random": _public(getattr(_real_cupy, "random", None)),
    "cupy.cuda.runtime": _public(getattr(getattr(_real_cupy, "cuda", None), "runtime", None)),
    "cupy.ndarray": ({n for n in dir(_real_cupy.ndarray)} if _real_cupy is not None else None),
}


def _check_name(where, name):
    names = REAL_NAMES.get(where)
    if names is not None and name not in names:
        raise CupyApiError(f"{where}.{name} does not exist in CuPy {_real_cupy.__version__}: "
                           "the GPU path called a NumPy-only (or misspelt) name")


_SIG_CACHE = {}


def _keywords(where, obj):
    """The keyword names ``obj`` (a real CuPy callable) accepts; None when any are accepted
    or the signature cannot be read."""
    key = (where, id(obj))
    if key in _SIG_CACHE:
        return _SIG_CACHE[key]
    names = None
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # Cython: the signature is the docstring's first line
        params = None
        head = (getattr(obj, "__doc__", None) or "").split("\n", 1)[0]
        m = re.match(r"[\w.]*\((.*)\)", head)
        if m:
            names = set()
            for part in m.group(1).split(","):
                part = part.strip().lstrip("\\")
                if part.startswith("**"):
                    names = None
                    break
                word = part.split("=")[0].split(":")[0].strip().split()
                if word and word[-1] not in ("*", "/", "self") and not word[-1].startswith("*"):
                    names.add(word[-1])
    if params is not None:
        names = set()
        for p in params:
            if p.kind is p.VAR_KEYWORD:
                names = None
                break
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                names.add(p.name)
    _SIG_CACHE[key] = names
    return names


def _check_keywords(where, real_obj, kwargs):
    if not kwargs or real_obj is None:
        return
    allowed = _keywords(where, real_obj)
    if allowed is not None:
        bad = sorted(set(kwargs) - allowed)
        if bad:
            raise TypeError(f"{where}() got keyword(s) {bad} that CuPy "
                            f"{_real_cupy.__version__} does not take (it takes {sorted(allowed)})")


# ---- device arrays ---------------------------------------------------------------------------
def _refuse_host(value, where):
    if isinstance(value, np.ndarray):
        raise TypeError(f"{where}: unsupported type numpy.ndarray (shape {value.shape}): a host "
                        "array where CuPy needs a device array; move it with cupy.asarray")


def _unwrap(value, where, host_ok=False):
    """Device arrays -> their NumPy arrays, recursively through lists and tuples; a NumPy
    array (host data) is refused unless ``host_ok``."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, where, host_ok) for v in value)
    if not host_ok:
        _refuse_host(value, where)
    return value


def _wrap(value):
    """NumPy results -> device arrays (NumPy scalars become 0-d arrays, as CuPy returns)."""
    if isinstance(value, np.ndarray):
        return ndarray._of(value)
    if isinstance(value, np.generic):
        return ndarray._of(np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


class MemoryPointer:
    """``ndarray.data``: the device pointer (here the host address of the NumPy buffer)."""

    def __init__(self, ptr):
        self.ptr = ptr


class _Flags:
    def __init__(self, flags):
        self.c_contiguous = flags.c_contiguous
        self.f_contiguous = flags.f_contiguous
        self.owndata = flags.owndata

    def __getitem__(self, key):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[key]


# ---- device memory: the pool's count, memGetInfo, MemoryHook, out of memory -----------------
ROUND = 512  # CuPy's pool hands out multiples of 512 bytes
_memory = types.SimpleNamespace(total=1 << 34, used=0, live={})
_hooks = threading.local()  # MemoryHooks entered in this thread, by name (CuPy's are per thread)


def _hooks_here():
    if not hasattr(_hooks, "active"):
        _hooks.active = collections.OrderedDict()
    return _hooks.active


class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError: an allocation the device's memory cannot hold."""

    def __init__(self, size, total):
        super().__init__(f"Out of memory allocating {size:,} bytes (allocated so far: "
                         f"{total:,} bytes).")


def _allocated(a):
    """``a`` (a NumPy array behind a device array), with the memory it lives in counted once:
    the array that owns it holds its size, rounded up to ROUND, until it is freed. Raises
    OutOfMemoryError past the device's memory. Memory NumPy does not own (a view of a host
    buffer) is not device memory and is not counted."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is not None or root.nbytes == 0 or id(root) in _memory.live:
        return a
    size = root.nbytes
    mem = -(-size // ROUND) * ROUND
    hooks = list(_hooks_here().values())
    for h in hooks:
        h.malloc_preprocess(device_id=_state.device, size=size, mem_size=mem)
    if _memory.used + mem > _memory.total:
        raise OutOfMemoryError(mem, _memory.used)
    key, ptr = id(root), root.ctypes.data
    _memory.used += mem
    _memory.live[key] = mem
    weakref.finalize(root, _freed, key, mem, ptr)
    for h in hooks:
        h.malloc_postprocess(device_id=_state.device, size=size, mem_size=mem, mem_ptr=ptr,
                             pmem_id=key)
    return a


def _freed(key, mem, ptr):
    hooks = list(_hooks_here().values())
    for h in hooks:
        h.free_preprocess(device_id=_state.device, mem_size=mem, mem_ptr=ptr, pmem_id=key)
    _memory.used -= mem
    _memory.live.pop(key, None)
    for h in hooks:
        h.free_postprocess(device_id=_state.device, mem_size=mem, mem_ptr=ptr, pmem_id=key)


class MemoryHook:
    """cupy.cuda.MemoryHook: a subclass's methods are called, with CuPy's keywords, around
    each allocation and free of this thread while it is entered (``with hook:``)."""

    name = "MemoryHook"

    def __enter__(self):
        hooks = _hooks_here()
        if self.name in hooks:
            raise RuntimeError(f"memory hook {self.name} already exists")
        hooks[self.name] = self
        return self

    def __exit__(self, *exc):
        del _hooks_here()[self.name]

    def alloc_preprocess(self, **kwargs):
        pass

    def alloc_postprocess(self, **kwargs):
        pass

    def malloc_preprocess(self, **kwargs):
        pass

    def malloc_postprocess(self, **kwargs):
        pass

    def free_preprocess(self, **kwargs):
        pass

    def free_postprocess(self, **kwargs):
        pass


class ndarray:
    """A device array: a NumPy array behind CuPy's interface and rules."""

    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100  # CuPy's: a Tensor (1000) takes the reflected operator
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("ndarray(memptr=..., strides=...) in the stand-in")
        self._a = _allocated(np.empty(shape, dtype=dtype, order=order))

    @classmethod
    def _of(cls, a):
        obj = object.__new__(cls)
        obj._a = _allocated(a)
        return obj

    # attributes CuPy computes, not NumPy's objects
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a.flags))
    data = property(lambda self: MemoryPointer(self._a.ctypes.data))
    T = property(lambda self: ndarray._of(self._a.T))
    base = property(lambda self: None if self._a.base is None else _wrap(self._a.base))
    device = property(lambda self: _current_device())

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Copy to the host (a NumPy array)."""
        if out is not None:
            out[...] = self._a
            return out
        return np.array(self._a, order=order)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("ndarray.set takes a numpy.ndarray")
        self._a[...] = arr

    def scatter_add(self, slices, value):
        np.add.at(self._a, _unwrap(slices, "scatter_add", True), _unwrap(value, "scatter_add"))

    # conversions a GPU array refuses or makes explicit
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly. (a device array "
                        "reached NumPy code on the GPU path)")

    def __bool__(self):
        return bool(self._a)

    def __float__(self):
        return float(self._a)

    def __int__(self):
        return int(self._a)

    def __complex__(self):
        return complex(self._a)

    def __len__(self):
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (ndarray._of(self._a[i]) for i in range(len(self._a)))

    def __repr__(self):
        return "stand-in cupy." + repr(self._a)

    def __str__(self):
        return str(self._a)

    def __format__(self, spec):
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __copy__(self):
        return ndarray._of(self._a.copy())

    def __deepcopy__(self, memo):
        return ndarray._of(self._a.copy())

    def __reduce__(self):
        return (ndarray._of, (self._a,))

    def __dlpack__(self, *args, **kwargs):
        raise NotImplementedError("DLPack in the stand-in")

    # indexing: NumPy arrays and lists are accepted as indices (CuPy copies them over)
    def __getitem__(self, key):
        return _wrap(self._a[_unwrap(key, "indexing", host_ok=True)])

    def __setitem__(self, key, value):
        self._a[_unwrap(key, "indexing", host_ok=True)] = _unwrap(value, "setitem",
                                                                  host_ok=True)

    # NumPy's protocols: numpy functions and ufuncs on device arrays run as CuPy's would
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        name = ufunc.__name__
        real = getattr(_real_cupy, name, None) if _real_cupy is not None else None
        if API_CHECKED and real is None:
            return NotImplemented
        if method != "__call__" and real is not None and not hasattr(real, method):
            return NotImplemented
        for x in inputs:
            if isinstance(x, np.ndarray) or not isinstance(x, (ndarray, np.generic, int, float,
                                                                  complex, bool)):
                return NotImplemented
        args = [_unwrap(x, name) for x in inputs]
        if "out" in kwargs:
            kwargs["out"] = tuple(_unwrap(o, name) for o in kwargs["out"])
        return _wrap(getattr(ufunc, method)(*args, **kwargs))

    def __array_function__(self, func, types_, args, kwargs):
        name = func.__name__
        if func is not getattr(np, name, None):
            return NotImplemented
        try:
            fn = getattr(cupy, name)
        except AttributeError:
            return NotImplemented
        return fn(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _check_name("cupy.ndarray", name)
        method = getattr(self._a, name)
        if not callable(method):
            return _wrap(method)
        real = getattr(_real_cupy.ndarray, name, None) if API_CHECKED else None

        def call(*args, **kwargs):
            _check_keywords(f"cupy.ndarray.{name}", real, kwargs)
            return _wrap(method(*_unwrap(args, f"ndarray.{name}"),
                                **{k: _unwrap(v, f"ndarray.{name}") for k, v in kwargs.items()}))
        return call


def _binary(op, reflected=False, inplace=False):
    def method(self, other):
        if isinstance(other, np.ndarray):
            raise TypeError(f"unsupported operand: cupy.ndarray {op.__name__} numpy.ndarray "
                            f"(shape {other.shape}): move the host array with cupy.asarray")
        if not isinstance(other, (ndarray, np.generic, int, float, complex, bool)):
            if getattr(other, "__array_priority__", -1) > self.__array_priority__ or \
                    not reflected:
                return NotImplemented
        b = other._a if isinstance(other, ndarray) else other
        if inplace:
            op(self._a, b)
            return self
        return _wrap(op(b, self._a) if reflected else op(self._a, b))
    return method


def _unary(op):
    return lambda self: _wrap(op(self._a))


def _products_in_float32(np_fn):
    """A float16 product as cuBLAS computes it by default (CuPy: float32 compute type):
    float16 operands, float32 accumulation, one rounding of the result to float16. (NumPy
    would accumulate in float16, and slowly, with no BLAS for it.)"""
    @functools.wraps(np_fn)
    def product(*args, **kwargs):
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        if arrays and all(a.dtype == np.float16 for a in arrays) and "out" not in kwargs:
            wide = [a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in args]
            return np_fn(*wide, **kwargs).astype(np.float16)
        return np_fn(*args, **kwargs)
    return product


PRODUCTS = {"matmul": _products_in_float32(np.matmul), "dot": _products_in_float32(np.dot),
            "tensordot": _products_in_float32(np.tensordot),
            "einsum": _products_in_float32(np.einsum)}


import operator as _op  # noqa: E402

for _name, _fn in [("add", _op.add), ("sub", _op.sub), ("mul", _op.mul),
                   ("truediv", _op.truediv), ("floordiv", _op.floordiv), ("mod", _op.mod),
                   ("pow", _op.pow), ("matmul", PRODUCTS["matmul"]), ("and", _op.and_),
                   ("or", _op.or_), ("xor", _op.xor), ("lshift", _op.lshift),
                   ("rshift", _op.rshift), ("divmod", divmod)]:
    setattr(ndarray, f"__{_name}__", _binary(_fn))
    setattr(ndarray, f"__r{_name}__", _binary(_fn, reflected=True))
for _name, _fn in [("add", _op.iadd), ("sub", _op.isub), ("mul", _op.imul),
                   ("truediv", _op.itruediv), ("floordiv", _op.ifloordiv), ("mod", _op.imod),
                   ("pow", _op.ipow), ("and", _op.iand), ("or", _op.ior), ("xor", _op.ixor)]:
    setattr(ndarray, f"__i{_name}__", _binary(_fn, inplace=True))
for _name, _fn in [("lt", _op.lt), ("le", _op.le), ("gt", _op.gt), ("ge", _op.ge),
                   ("eq", _op.eq), ("ne", _op.ne)]:
    setattr(ndarray, f"__{_name}__", _binary(_fn))
for _name, _fn in [("neg", _op.neg), ("pos", _op.pos), ("abs", abs), ("invert", _op.invert)]:
    setattr(ndarray, f"__{_name}__", _unary(_fn))


# ---- functions of the cupy namespace ---------------------------------------------------------
# Functions that take host data (lists, NumPy arrays) and copy it to the device.
HOST_INPUT = {"array", "asarray", "asanyarray", "ascontiguousarray", "asfortranarray",
              "get_array_module", "asnumpy"}


def _function(name, np_fn):
    real = getattr(_real_cupy, name, None) if API_CHECKED else None
    host_ok = name in HOST_INPUT

    @functools.wraps(np_fn)
    def call(*args, **kwargs):
        _check_keywords(f"cupy.{name}", real, kwargs)
        args = _unwrap(args, f"cupy.{name}", host_ok)
        kwargs = {k: _unwrap(v, f"cupy.{name}", host_ok) for k, v in kwargs.items()}
        kwargs.pop("blocking", None)  # cupy.asarray's, no meaning on the host
        return _wrap(np_fn(*args, **kwargs))
    return call


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    if isinstance(a, ndarray):
        return a if (dtype is None or np.dtype(dtype) == a.dtype) and copy is not True \
            else ndarray._of(np.array(a._a, dtype=dtype, order=order or "K"))
    return ndarray._of(np.array(a, dtype=dtype, order=order or "K"))  # always a device copy


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, blocking=False):
    return ndarray._of(np.array(_unwrap(obj, "cupy.array", True), dtype=dtype, order=order,
                                ndmin=ndmin))


def ascontiguousarray(a, dtype=None):
    return ndarray._of(np.ascontiguousarray(_unwrap(a, "cupy.ascontiguousarray", True),
                                            dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(order=order, out=out)
    return np.asarray(a, order=order)


def get_array_module(*args):
    return cupy if any(isinstance(a, ndarray) for a in args) else np


class ElementwiseKernel:
    """cupy.ElementwiseKernel, its operation compiled for the host (kernels.py)."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True,
                 preamble="", no_return=False, return_tuple=False, loop_prep="",
                 after_loop=""):
        from . import kernels
        if loop_prep or after_loop:
            raise NotImplementedError("loop_prep / after_loop in the stand-in")
        self._k = kernels.ElementwiseKernel(in_params, out_params, operation, name, preamble)

    def __call__(self, *args, **kwargs):
        _check_keywords("cupy.ElementwiseKernel.__call__",
                        getattr(_real_cupy, "ElementwiseKernel", None) and
                        _real_cupy.ElementwiseKernel.__call__, kwargs)
        if kwargs:
            raise NotImplementedError(f"ElementwiseKernel keywords {sorted(kwargs)}")
        return _wrap(self._k(*_unwrap(args, "ElementwiseKernel")))


class RawModule:
    """cupy.RawModule, compiled for the host against cuda_on_cpu.h (kernels.py)."""

    def __init__(self, code=None, *, path=None, options=(), backend="nvrtc",
                 translate_cucomplex=False, enable_cooperative_groups=False,
                 name_expressions=None, jitify=None):
        from . import kernels
        if path is not None:
            raise NotImplementedError("RawModule(path=...) in the stand-in")
        self._m = kernels.RawModule(code, options=options, name_expressions=name_expressions or ())

    def get_function(self, name):
        fn = self._m.get_function(name)

        def launch(grid, block, args, *, shared_mem=0, stream=None,
                   enable_cooperative_groups=False):
            return fn(grid, block, _unwrap(tuple(args), f"RawKernel {name}"))
        return launch


# ---- cupy.cuda --------------------------------------------------------------------------------
class CUDARuntimeError(RuntimeError):
    pass


_state = types.SimpleNamespace(device=0, n_devices=1)


def _current_device():
    return Device(_state.device)


class Device:
    def __init__(self, device=None):
        self.id = _state.device if device is None else int(device)
        if not 0 <= self.id < _state.n_devices:
            raise CUDARuntimeError(f"cudaErrorInvalidDevice: device {self.id} of "
                                   f"{_state.n_devices}")

    def use(self):
        _state.device = self.id

    def synchronize(self):
        pass

    compute_capability = property(lambda self: "90")

    def __enter__(self):
        self._prev, _state.device = _state.device, self.id
        return self

    def __exit__(self, *exc):
        _state.device = self._prev


class Stream:
    null = None

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        self.ptr = 0

    def synchronize(self):
        pass

    def use(self):
        return self


Stream.null = Stream(null=True)


def get_current_stream(device_id=None):
    return Stream.null


class MemoryPool:
    """What the device's arrays hold (the stand-in's pool keeps no freed blocks)."""

    def used_bytes(self):
        return _memory.used

    def total_bytes(self):
        return _memory.used

    def free_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


class PinnedMemoryPool:
    def free_all_blocks(self):
        pass

    def n_free_blocks(self):
        return 0


_pools = {"device": MemoryPool(), "pinned": PinnedMemoryPool()}


def _runtime():
    rt = types.ModuleType("cupy.cuda.runtime")
    rt.CUDARuntimeError = CUDARuntimeError
    rt.getDeviceCount = lambda: _state.n_devices
    rt.getDevice = lambda: _state.device
    rt.setDevice = lambda d: Device(d).use()
    rt.runtimeGetVersion = lambda: 12090
    rt.driverGetVersion = lambda: 12090
    rt.memGetInfo = lambda: (_memory.total - _memory.used, _memory.total)
    rt.getDeviceProperties = lambda d: {"name": b"CUDA-on-CPU stand-in", "major": 9,
                                        "minor": 0, "totalGlobalMem": _memory.total,
                                        "multiProcessorCount": 1, "warpSize": 32}
    rt.deviceSynchronize = lambda: None
    return _Checked(rt, "cupy.cuda.runtime")


# cuRAND generator types (curand.h): the values CuPy's cupy.cuda.curand exports
CURAND = {"CURAND_RNG_PSEUDO_DEFAULT": 100, "CURAND_RNG_PSEUDO_XORWOW": 101,
          "CURAND_RNG_PSEUDO_MRG32K3A": 121, "CURAND_RNG_PSEUDO_MTGP32": 141,
          "CURAND_RNG_PSEUDO_MT19937": 142, "CURAND_RNG_PSEUDO_PHILOX4_32_10": 161}

# NCCL (nccl.h) as cupy.cuda.nccl exports it: data types, reduction ops
NCCL = {"NCCL_INT8": 0, "NCCL_CHAR": 0, "NCCL_UINT8": 1, "NCCL_INT32": 2, "NCCL_INT": 2,
        "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6,
        "NCCL_HALF": 6, "NCCL_FLOAT32": 7, "NCCL_FLOAT": 7, "NCCL_FLOAT64": 8,
        "NCCL_DOUBLE": 8, "NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3}
_NCCL_DTYPES = {6: np.float16, 7: np.float32, 8: np.float64, 2: np.int32, 4: np.int64}


def _host_view(ptr, count, datatype):
    """The ``count`` elements at address ``ptr`` as a NumPy array (no copy)."""
    dtype = np.dtype(_NCCL_DTYPES[datatype])
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=count)


class NcclCommunicator:
    """cupy.cuda.nccl.NcclCommunicator over MPI: the ranks of this mpiexec run are the
    'GPUs'. Sums gather every rank's buffer and add them in rank order, in its dtype."""

    def __init__(self, ndev, commId, rank):
        from mpi4py import MPI
        self._mpi = MPI.COMM_WORLD
        if self._mpi.Get_size() != ndev or self._mpi.Get_rank() != rank:
            raise RuntimeError(f"NcclCommunicator({ndev}, ..., {rank}) under MPI rank "
                               f"{self._mpi.Get_rank()} of {self._mpi.Get_size()}")
        if not isinstance(commId, tuple) or len(commId) != 128:
            raise TypeError("commId: the tuple nccl.get_unique_id() returns")
        self.ndev, self.rank = ndev, rank

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        if op != NCCL["NCCL_SUM"]:
            raise NotImplementedError("only NCCL_SUM in the stand-in")
        for name, v in (("sendbuf", sendbuf), ("recvbuf", recvbuf), ("stream", stream)):
            if not isinstance(v, int):
                raise TypeError(f"allReduce {name}: an int pointer, got {type(v).__name__}")
        parts = self._mpi.allgather(_host_view(sendbuf, count, datatype).copy())
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        _host_view(recvbuf, count, datatype)[...] = total

    def bcast(self, buff, count, datatype, root, stream):
        view = _host_view(buff, count, datatype)
        view[...] = self._mpi.bcast(view.copy() if self.rank == root else None, root=root)

    def destroy(self):
        pass


def _nccl():
    m = types.ModuleType("cupy.cuda.nccl")
    m.available = True
    m.NcclCommunicator = NcclCommunicator
    m.get_version = lambda: 22703
    m.get_unique_id = lambda: tuple(int(b) for b in np.random.default_rng().integers(
        -128, 128, 128))
    for k, v in NCCL.items():
        setattr(m, k, v)
    return m


def _cuda():
    m = types.ModuleType("cupy.cuda")
    m.Device, m.Stream, m.MemoryPool, m.PinnedMemoryPool = Device, Stream, MemoryPool, \
        PinnedMemoryPool
    m.MemoryPointer = MemoryPointer
    m.MemoryHook = MemoryHook
    m.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, MemoryPool=MemoryPool)
    m.get_current_stream = get_current_stream
    m.runtime = _runtime()
    m.nccl = _nccl()
    m.curand = types.SimpleNamespace(**CURAND)
    m.is_available = lambda: True
    m.get_device_id = lambda: _state.device
    return _Checked(m, "cupy.cuda")


# ---- cupy.random ------------------------------------------------------------------------------
class RandomState:
    """cupy.random.RandomState: seeded draws (NumPy's Philox, not cuRAND's stream)."""

    def __init__(self, seed=None, method=CURAND["CURAND_RNG_PSEUDO_DEFAULT"]):
        if method not in CURAND.values():
            raise ValueError(f"unknown cuRAND generator type {method}")
        self.method = method
        self.seed(seed)

    def seed(self, seed=None):
        if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 2 ** 63:
            # CuPy 13.0-13.2 convert a Python int to int64 here
            raise OverflowError("Python int too large to convert to C long")
        self._rng = np.random.Generator(np.random.Philox(None if seed is None else int(seed)))

    def random_sample(self, size=None, dtype=float):
        dtype = np.dtype(dtype)
        if dtype not in (np.float32, np.float64):
            raise TypeError(f"random_sample: dtype {dtype}: float32 or float64")
        return _wrap(self._rng.random(size, dtype=dtype))

    def standard_normal(self, size=None, dtype=float):
        return _wrap(self._rng.standard_normal(size, dtype=np.dtype(dtype)))

    def uniform(self, low=0.0, high=1.0, size=None, dtype=float):
        return _wrap(self._rng.uniform(low, high, size).astype(dtype))


def _random():
    m = types.ModuleType("cupy.random")
    m.RandomState = RandomState
    glob = RandomState(0)  # the module-level functions draw from one generator
    m.seed = glob.seed
    m.random_sample = m.random = glob.random_sample
    m.standard_normal = glob.standard_normal
    m.uniform = glob.uniform
    return _Checked(m, "cupy.random")


# ---- the modules ------------------------------------------------------------------------------
class _Checked(types.ModuleType):
    """A module whose every attribute is first checked against real CuPy's names."""

    def __init__(self, inner, where):
        super().__init__(where)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_where", where)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        _check_name(self._where, name)
        if name in self._inner.__dict__:
            return self._inner.__dict__[name]
        raise CupyApiError(f"{self._where}.{name}: not in the CuPy stand-in (CuPy has it; add "
                           "it to tests/cuda_on_cpu/fake_cupy.py)")


class _Cupy(types.ModuleType):
    """The ``cupy`` module: stand-ins first, then NumPy's function of the same name."""

    def __init__(self):
        super().__init__("cupy")
        self.__file__ = __file__
        self.__version__ = (_real_cupy.__version__ if API_CHECKED else "0") + "+cuda-on-cpu"
        self._own = {
            "ndarray": ndarray, "asarray": asarray, "array": array,
            "ascontiguousarray": ascontiguousarray, "asnumpy": asnumpy,
            "get_array_module": get_array_module, "ElementwiseKernel": ElementwiseKernel,
            "RawModule": RawModule, "cuda": _cuda(), "random": _random(),
            "get_default_memory_pool": lambda: _pools["device"],
            "get_default_pinned_memory_pool": lambda: _pools["pinned"],
        }
        self._cache = {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cache = self.__dict__.get("_cache")
        if cache is None:
            raise AttributeError(name)
        if name in cache:
            return cache[name]
        _check_name("cupy", name)
        if name in self._own:
            value = self._own[name]
        elif hasattr(np, name):
            value = PRODUCTS.get(name) or getattr(np, name)
            if callable(value) and not isinstance(value, type) and not isinstance(value, np.ufunc):
                value = _function(name, value)
            elif isinstance(value, np.ufunc):
                value = _function(name, value)
        else:
            raise CupyApiError(f"cupy.{name}: not in the CuPy stand-in (and not a NumPy name)")
        cache[name] = value
        return value


def _cupyx():
    m = types.ModuleType("cupyx")

    def scatter_add(a, slices, value):
        _check_keywords("cupyx.scatter_add", None, {})
        if not isinstance(a, ndarray):
            raise TypeError("cupyx.scatter_add: a must be a cupy.ndarray")
        a.scatter_add(slices, value)
    m.scatter_add = scatter_add
    return _Checked(m, "cupyx")


cupy = _Cupy()
cupyx = _cupyx()

MODULES = {"cupy": cupy, "cupyx": cupyx, "cupy.cuda": cupy.cuda,
           "cupy.cuda.nccl": cupy.cuda.nccl, "cupy.cuda.runtime": cupy.cuda.runtime,
           "cupy.random": cupy.random}


def install(n_devices=None, memory=None):
    """Make ``import cupy`` (and the package's backend) use the stand-in; -> undo().

    ``n_devices``: how many GPUs the runtime reports (default: CUDA_ON_CPU_DEVICES or 1);
    ``memory``: each one's memory in bytes (default: CUDA_ON_CPU_MEMORY or 16 GiB)."""
    import os
    _state.n_devices = int(n_devices or os.environ.get("CUDA_ON_CPU_DEVICES", "1"))
    _memory.total = int(memory or os.environ.get("CUDA_ON_CPU_MEMORY", str(1 << 34)))
    _state.device = 0
    saved = {k: sys.modules.get(k) for k in MODULES}
    sys.modules.update(MODULES)
    backend = sys.modules.get("minitransformer.backend")
    saved_backend = None
    if backend is not None:
        saved_backend = (backend._cupy, backend._cupy_error)
        backend._cupy, backend._cupy_error = cupy, None
    kernels_mod = sys.modules.get("minitransformer.engine.cuda_kernels")
    saved_kernels = None
    if kernels_mod is not None:
        saved_kernels = (dict(kernels_mod._kernels), kernels_mod._gpu_seen)
        kernels_mod._kernels.clear()
        kernels_mod._gpu_seen = False

    def undo():
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        if backend is not None:
            backend._cupy, backend._cupy_error = saved_backend
        if kernels_mod is not None:
            kernels_mod._kernels.clear()
            kernels_mod._kernels.update(saved_kernels[0])
            kernels_mod._gpu_seen = saved_kernels[1]
    return undo
