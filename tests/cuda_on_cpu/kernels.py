"""CUDA kernel source compiled for the host against ``cuda_on_cpu.h``, launched like CuPy's.

- ``RawModule(code, options, name_expressions)``: the source, unchanged but for the two PTX
  ``asm`` float16 conversions (replaced by exact host ones) and ``__shared__`` arrays (made
  per-block statics filled with garbage), is compiled by the system C++ compiler with an entry
  point per name expression. ``get_function('k<float>')(grid, block, args)`` launches it as
  CuPy's RawKernel would: arrays by data pointer (any strides: the kernel indexes them),
  NumPy scalars by value. Each argument is checked against the kernel's C++ parameter (a
  pointer to the array's element size and kind, a scalar of the exact type), which a GPU
  does not do: a wrong scalar width there is a silent wrong answer.
- ``ElementwiseKernel(in_params, out_params, operation, name, preamble)``: the operation, in
  a loop over the broadcast inputs, compiled per dtype after the preamble; called like CuPy's.
- Products followed by sums are contracted into fused multiply-adds, as NVRTC does by default
  (``--fmad=true``), where the host CPU has FMA instructions: a kernel that must equal
  separate array ops bit for bit has to round its products itself (``__fmul_rn``), here as
  on a GPU. ``CUDA_ON_CPU_FMA=0`` compiles without contraction.
A kernel error (divergent barrier, shuffle, deadlock) raises :class:`KernelError` with the
header's message.

Settings (environment): ``CXX`` (default g++), ``CUDA_ON_CPU_CXXFLAGS`` (default ``-O1 -g``;
``-fsanitize=address`` needs libasan preloaded, see tests/test_cuda_on_cpu.py),
``CUDA_ON_CPU_WARP_ORDER`` (``forward`` or ``reverse``: the order warps of a block run in).
Builds are cached in tests/cuda_on_cpu/build/, keyed by source, header, compiler and flags.
"""
import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "cuda_on_cpu.h")
BUILD = os.path.join(HERE, "build")


class KernelError(RuntimeError):
    """A kernel did something a GPU would not run correctly (the message says what)."""


def _cxx():
    return os.environ.get("CXX", "g++")


def _cxxflags():
    return shlex.split(os.environ.get("CUDA_ON_CPU_CXXFLAGS", "-O1 -g")) + _fma_flags()


def _fma_flags():
    """Contract a * b + c into one fused multiply-add where NVRTC would (it does by default),
    when this CPU has the instruction (x86-64 with FMA, or 64-bit Arm): GCC forms them with
    -ffp-contract=fast in its -fexpensive-optimizations passes."""
    if os.environ.get("CUDA_ON_CPU_FMA", "1") == "0":
        return []
    contract = ["-ffp-contract=fast", "-fexpensive-optimizations"]
    if platform.machine() in ("aarch64", "arm64"):
        return contract
    return ["-mfma", *contract] if _cpu_has_fma() else []


@functools.lru_cache(maxsize=None)
def _cpu_has_fma():
    """Whether /proc/cpuinfo lists the x86 fma flag (read once: every build asks)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "fma" in line.split() for line in f)
    except OSError:
        return False


_order_override = None


def warp_order():
    """``'forward'`` or ``'reverse'``: the order the warps of a block run in."""
    order = _order_override or os.environ.get("CUDA_ON_CPU_WARP_ORDER", "forward")
    if order not in ("forward", "reverse"):
        raise ValueError(f"CUDA_ON_CPU_WARP_ORDER={order!r}: use forward or reverse")
    return order


@contextlib.contextmanager
def warps_in(order):
    """Within the block, launches run their warps in ``order`` (forward / reverse)."""
    global _order_override
    saved, _order_override = _order_override, order
    try:
        warp_order()
        yield
    finally:
        _order_override = saved


# ---- compiling -------------------------------------------------------------------------------
def _compile(source, tag):
    """A shared library built from ``source`` (cached), loaded."""
    with open(HEADER) as fh:
        header = fh.read()
    flags = ["-std=c++17", "-shared", "-fPIC", "-Wall", "-Wno-unused-function", *_cxxflags()]
    key = hashlib.sha256("\0".join([header, source, _cxx(), _compiler_version(), *flags])
                         .encode()).hexdigest()[:20]
    so = os.path.join(BUILD, f"{tag}-{key}.so")
    if not os.path.exists(so):
        os.makedirs(BUILD, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=BUILD) as tmp:  # concurrent builds never collide
            cpp, out = os.path.join(tmp, f"{tag}.cpp"), os.path.join(tmp, f"{tag}.so")
            with open(cpp, "w") as fh:
                fh.write(source)
            res = subprocess.run([_cxx(), *flags, "-I", HERE, cpp, "-o", out],
                                 capture_output=True, text=True)
            if res.returncode:
                raise KernelError(f"{_cxx()} could not compile the kernel source ({tag}):\n"
                                  f"{res.stderr[-6000:]}")
            os.replace(out, so)
    return ctypes.CDLL(so)


@functools.lru_cache(maxsize=None)
def _compiler_version():
    try:
        return subprocess.run([_cxx(), "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


@functools.lru_cache(maxsize=None)
def compiler_missing():
    """None when kernels can be built here, else a sentence saying why not."""
    if shutil.which(_cxx()) is None:
        return (f"the CUDA-on-CPU tests need a C++ compiler ({_cxx()} not found; install g++ "
                "or set CXX)")
    try:
        lib = _compile('#include "cuda_on_cpu.h"\nextern "C" int ok() { _Float16 h = 1; '
                       "return (int)(float)h; }\n", "probe")
        if lib.ok() != 1:
            return f"{_cxx()} built a probe that returns a wrong value"
    except (KernelError, OSError) as e:
        return f"the CUDA-on-CPU tests cannot build with {_cxx()}: {e}"
    return None


# ---- RawModule ---------------------------------------------------------------------------------
F16_ASM = [  # the PTX asm of the row kernels, and an exact host replacement
    (r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(([\w.\[\]]+)\) : "h"\(([\w.\[\]]+)\)\);',
     r"\1 = sim::f16_bits_to_float(\2);"),
    (r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(([\w.\[\]]+)\) : "f"\(([\w.\[\]]+)\)\);',
     r"\1 = sim::float_to_f16_bits_rn(\2);"),
]
SHARED = re.compile(r"__shared__\s+([\w:<>]+)\s+(\w+)\[(\w+)\];")


def host_source(code):
    """The CUDA source as the host compiles it (see the module docstring)."""
    for pattern, repl in F16_ASM:
        code = re.sub(pattern, repl, code)
    if "asm(" in code:
        raise KernelError("inline PTX asm other than the float16 conversions: the CPU build "
                          "cannot run it (add a host replacement in kernels.F16_ASM)")
    return SHARED.sub(r"static \1 \2[\3]; sim::poison_shared_once(\2, sizeof(\2));", code)


def _c_name(expr):
    return "sim_" + re.sub(r"\W", "_", expr)


# What a NumPy dtype is in the signature code of the header's sim::describe.
_KIND = {"f": "f", "i": "i", "u": "u", "b": "b"}


def _code(dtype):
    dtype = np.dtype(dtype)
    return f"{_KIND.get(dtype.kind, '?')}{dtype.itemsize}"


_CTYPES = {"f4": ctypes.c_float, "f8": ctypes.c_double, "i1": ctypes.c_int8,
           "i2": ctypes.c_int16, "i4": ctypes.c_int32, "i8": ctypes.c_int64,
           "u1": ctypes.c_uint8, "u2": ctypes.c_uint16, "u4": ctypes.c_uint32,
           "u8": ctypes.c_uint64, "b1": ctypes.c_bool}


class RawKernel:
    """One name expression of a :class:`RawModule`, launched as ``k(grid, block, args)``."""

    def __init__(self, lib, expr):
        self.expr = expr
        self._fn = getattr(lib, _c_name(expr))
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_int,
                             ctypes.POINTER(ctypes.c_void_p)]
        sig = getattr(lib, _c_name(expr) + "_signature")
        sig.restype = ctypes.c_char_p
        self.signature = sig().decode().split()
        self._error = lib.sim_error
        self._error.restype = ctypes.c_char_p

    def _arg(self, i, a, want):
        where = f"{self.expr}: argument {i}"
        if isinstance(a, np.ndarray):
            have = "*" + ("s2" if a.dtype == np.float16 and want == "*s2" else _code(a.dtype))
            if want != have:
                raise KernelError(f"{where} is an array of {a.dtype} ({have}); the kernel "
                                  f"takes {want}")
            return ctypes.c_void_p(a.__array_interface__["data"][0])
        if isinstance(a, (bool, int, float)):  # CuPy passes these as bool, int64, float64
            a = np.bool_(a) if isinstance(a, bool) else np.asarray(a)[()]
        if isinstance(a, np.generic):
            have = _code(a.dtype)
            if want != have or have not in _CTYPES:
                raise KernelError(f"{where} is a {a.dtype} scalar ({have}); the kernel takes "
                                  f"{want}: pass np.{_name_of(want)}(...)")
            return _CTYPES[have](a.item())
        raise KernelError(f"{where}: {type(a).__name__} is not a kernel argument (an array or "
                          "a NumPy scalar)")

    def __call__(self, grid, block, args):
        grid, block = tuple(np.atleast_1d(grid)), tuple(np.atleast_1d(block))
        if any(int(g) != 1 for g in grid[1:] + block[1:]):
            raise NotImplementedError("1-D grids and blocks only in the CUDA-on-CPU harness")
        if not 1 <= int(grid[0]) < 2 ** 31 - 1:  # (CUDA: invalid configuration)
            raise KernelError(f"{self.expr}: grid of {int(grid[0])} blocks; give at least 1")
        args = tuple(args)
        if len(args) != len(self.signature):
            raise KernelError(f"{self.expr} takes {len(self.signature)} arguments, got "
                              f"{len(args)}")
        vals = [self._arg(i, a, w) for i, (a, w) in enumerate(zip(args, self.signature))]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        if self._fn(int(grid[0]), int(block[0]), int(warp_order() == "reverse"), ptrs):
            raise KernelError(f"{self.expr}<<<{int(grid[0])}, {int(block[0])}>>>: "
                              f"{self._error().decode()}")


def _name_of(code):
    return {"f4": "float32", "f8": "float64", "i4": "int32", "i8": "int64", "u4": "uint32",
            "b1": "bool_"}.get(code, code)


class RawModule:
    """cupy.RawModule(code, options, name_expressions), built for the host."""

    def __init__(self, code, options=(), name_expressions=()):
        self.names = tuple(name_expressions)
        if not self.names:
            raise NotImplementedError("a RawModule without name_expressions")
        entries = "\n".join(
            f'extern "C" int {_c_name(e)}(unsigned g, unsigned b, int reverse, void** a) {{\n'
            f"    return sim::launch(g, b, reverse, sim::body<&{e}>, a);\n}}\n"
            f'extern "C" const char* {_c_name(e)}_signature() {{\n'
            f"    static const std::string s = sim::signature(&{e});\n    return s.c_str();\n}}"
            for e in self.names)
        full = f'#include "cuda_on_cpu.h"\n#line 1 "kernel source"\n{host_source(code)}\n' \
               f'#line 1 "entry points"\n{entries}\n'
        self._lib = _compile(full, "module")
        self._functions = {}

    def get_function(self, expr):
        if expr not in self.names:
            raise KeyError(f"{expr!r} is not one of the module's name_expressions")
        if expr not in self._functions:
            self._functions[expr] = RawKernel(self._lib, expr)
        return self._functions[expr]


# ---- ElementwiseKernel ---------------------------------------------------------------------------
CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


class ElementwiseKernel:
    """cupy.ElementwiseKernel for type-generic parameters ('T x, T y'), the form the project
    uses: every argument, array or NumPy scalar, has the one dtype T."""

    def __init__(self, in_params, out_params, operation, name="kernel", preamble=""):
        def parse(s):
            params = [p.split() for p in s.split(",") if p.strip()]
            for p in params:
                if len(p) != 2 or p[0] != "T":
                    raise NotImplementedError(f"parameter {' '.join(p)!r} of {name}: the "
                                              "harness supports 'T name' parameters only")
            return [p[1] for p in params]
        self.ins, self.outs = parse(in_params), parse(out_params)
        self.operation, self.name, self.preamble = operation, name, preamble
        self._fns = {}

    def _fn(self, dtype):
        if dtype not in self._fns:
            args = [f"const T* in_{n}" for n in self.ins] + [f"T* out_{n}" for n in self.outs]
            loads = [f"const T {n} = in_{n}[i];" for n in self.ins] + \
                    [f"T& {n} = out_{n}[i];" for n in self.outs]
            src = (f'#include "cuda_on_cpu.h"\ntypedef {CTYPE[dtype]} T;\n{self.preamble}\n'
                   f'extern "C" void run({", ".join(args)}, long long n) {{\n'
                   "  for (long long i = 0; i < n; ++i) {\n    " + "\n    ".join(loads) +
                   f'\n#line 1 "{self.name} operation"\n{self.operation}\n  }}\n}}\n')
            fn = _compile(src, self.name).run
            fn.restype = None
            self._fns[dtype] = fn
        return self._fns[dtype]

    def __call__(self, *args):
        n_in = len(self.ins)
        if len(args) not in (n_in, n_in + len(self.outs)):
            raise TypeError(f"{self.name} takes {n_in} inputs (and optionally "
                            f"{len(self.outs)} outputs), got {len(args)} arguments")
        ins, outs = list(args[:n_in]), list(args[n_in:])
        arrays = [a for a in ins + outs if isinstance(a, np.ndarray)]
        if not arrays:
            raise TypeError(f"{self.name}: no array argument to decide T from")
        dtype = arrays[0].dtype
        if dtype not in CTYPE:
            raise TypeError(f"{self.name}: dtype {dtype} (the harness builds float32 and "
                            "float64)")
        for i, a in enumerate(ins + outs):
            if not isinstance(a, (np.ndarray, np.generic)) or a.dtype != dtype:
                raise TypeError(f"{self.name}: argument {i} is {type(a).__name__} "
                                f"{getattr(a, 'dtype', '')}; T is {dtype} for every argument")
        shape = np.broadcast_shapes(*[np.shape(a) for a in ins])
        if outs:
            shape = np.broadcast_shapes(shape, *[o.shape for o in outs])
            for o in outs:
                if o.shape != shape:
                    raise ValueError(f"{self.name}: output of shape {o.shape}, the broadcast "
                                     f"shape is {shape}")
        ins = [np.ascontiguousarray(np.broadcast_to(a, shape)) for a in ins]
        made = not outs
        if made:
            outs = [np.empty(shape, dtype) for _ in self.outs]
        work = [o if o.flags.c_contiguous else np.ascontiguousarray(o) for o in outs]
        ptr = lambda a: ctypes.c_void_p(a.__array_interface__["data"][0])  # noqa: E731
        self._fn(dtype)(*[ptr(a) for a in ins + work], ctypes.c_longlong(int(np.prod(shape))))
        for o, w in zip(outs, work):
            if w is not o:
                o[...] = w
        return tuple(outs) if len(outs) > 1 else outs[0]
