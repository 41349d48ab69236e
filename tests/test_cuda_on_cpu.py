"""The CUDA-on-CPU harness (tests/cuda_on_cpu) itself: that it runs CUDA source the way a GPU
does, and that the bugs a GPU punishes make a test fail with a message saying what happened.

Small kernels check the execution model (indices, shared memory per block and filled with
garbage, barriers, shuffles, float16 conversions, argument checks). Planted bugs in the real
row-kernel source (engine/cuda_kernels.py): a missing ``__syncthreads`` (shows as garbage in
the result in one warp order or the other), a barrier inside a branch and a divergent shuffle
(the harness stops the launch and says which), an off-by-one row offset (wrong rows; under
AddressSanitizer, the read past the end is reported). The AddressSanitizer variant of the
kernel parity tests is marked ``slow``.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REAL_GPU

kernels = pytest.importorskip("cuda_on_cpu.kernels")
_missing = kernels.compiler_missing()
pytestmark = pytest.mark.skipif(_missing is not None, reason=str(_missing))

from minitransformer.engine import cuda_kernels as ck  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module(source, *names):
    return kernels.RawModule(source, name_expressions=names)


# ---- the execution model --------------------------------------------------------------------
INDICES = r"""
__global__ void indices(int* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[4 * i] = threadIdx.x; out[4 * i + 1] = blockIdx.x;
    out[4 * i + 2] = blockDim.x; out[4 * i + 3] = gridDim.x;
}
"""


def test_thread_and_block_indices():
    out = np.full((3 * 64, 4), -7, np.int32)
    _module(INDICES, "indices").get_function("indices")((3,), (64,), (out,))
    i = np.arange(3 * 64)
    np.testing.assert_array_equal(out[:, 0], i % 64)
    np.testing.assert_array_equal(out[:, 1], i // 64)
    assert (out[:, 2] == 64).all() and (out[:, 3] == 3).all()


REVERSE = r"""
// Reverses each block's chunk through shared memory: needs the barrier between write and read.
__global__ void reverse_chunks(const float* x, float* y, int with_barrier) {
    __shared__ float tile[256];
    const int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    tile[t] = x[base + t];
    if (with_barrier) __syncthreads();
    y[base + t] = tile[blockDim.x - 1 - t];
}
__global__ void read_unwritten(float* y) {
    __shared__ float tile[64];
    if (blockIdx.x == 0) tile[threadIdx.x] = 1.0f;  // only the first block writes
    __syncthreads();
    y[blockIdx.x * blockDim.x + threadIdx.x] = tile[threadIdx.x];
}
"""


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_shared_memory_barrier(order):
    fn = _module(REVERSE, "reverse_chunks").get_function("reverse_chunks")
    x = np.arange(2 * 256, dtype=np.float32)
    y = np.zeros_like(x)
    with kernels.warps_in(order):
        fn((2,), (256,), (x, y, np.int32(1)))
    np.testing.assert_array_equal(y, x.reshape(2, 256)[:, ::-1].ravel())
    # Without the barrier, a warp reads slots another warp has not written yet: in forward
    # order the early warps read garbage (the slots of later warps), in reverse the late ones.
    y[:] = 0
    with kernels.warps_in(order):
        fn((2,), (256,), (x, y, np.int32(0)))
    bad = ~(y == x.reshape(2, 256)[:, ::-1].ravel())
    assert bad.any()
    first_bad = int(np.argmax(bad.reshape(2, 256)[0]))
    assert (first_bad < 128) == (order == "forward")
    assert np.isnan(y[bad]).all()  # the garbage is all bits set: NaN, not a plausible number


def test_shared_memory_is_garbage_in_each_new_block():
    y = np.zeros(2 * 64, np.float32)
    _module(REVERSE, "read_unwritten").get_function("read_unwritten")((2,), (64,), (y,))
    assert (y[:64] == 1).all()
    assert np.isnan(y[64:]).all()  # block 1 does not see block 0's values


SHUFFLE = r"""
template <typename A> __device__ A warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__global__ void warp_sums(const double* x, double* y) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    y[i] = warp_sum(x[i]);
}
__global__ void half_warp_shuffles(const double* x, double* y) {
    const int i = threadIdx.x;
    y[i] = (i & 31) < 16 ? warp_sum(x[i]) : x[i];
}
__global__ void extra_shuffle(const double* x, double* y) {
    double v = warp_sum(x[threadIdx.x]);
    if ((threadIdx.x & 31) == 3) v += __shfl_xor_sync(0xffffffffu, v, 1);
    y[threadIdx.x] = v;
}
__global__ void partial_mask(const double* x, double* y) {
    y[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, x[threadIdx.x], 1);
}
__global__ void barrier_in_branch(double* y) {
    if (threadIdx.x < 32) __syncthreads();
    y[threadIdx.x] = 1;
}
__global__ void two_barriers(double* y) {
    if (threadIdx.x % 2)
        __syncthreads();
    else
        __syncthreads();
    y[threadIdx.x] = 1;
}
__global__ void shuffle_against_barrier(double* y) {  // a deadlock on a GPU
    if ((threadIdx.x & 31) < 16) __syncthreads();
    else y[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0, 1);
}
"""
SHUFFLE_NAMES = ("warp_sums", "half_warp_shuffles", "extra_shuffle", "partial_mask",
                 "barrier_in_branch", "two_barriers", "shuffle_against_barrier")


@pytest.fixture(scope="module")
def shuffles():
    return _module(SHUFFLE, *SHUFFLE_NAMES)


def test_warp_shuffle_sums_each_warp(shuffles):
    x = np.random.default_rng(0).standard_normal(2 * 96)
    y = np.zeros_like(x)
    shuffles.get_function("warp_sums")((2,), (96,), (x, y))
    np.testing.assert_allclose(y, np.repeat(x.reshape(-1, 32).sum(1), 32), rtol=1e-14)


@pytest.mark.parametrize("name, message", [
    ("half_warp_shuffles", "not every lane of the warp reaches"),
    ("extra_shuffle", "not every lane of the warp reaches"),
    ("partial_mask", "partial mask"),
    ("barrier_in_branch", "other threads have returned"),
    ("two_barriers", "different __syncthreads"),
    ("shuffle_against_barrier", "not every lane of the warp reaches"),
])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_divergence_stops_the_launch_with_a_message(shuffles, name, message, order):
    x, y = np.ones(64), np.zeros(64)
    args = (y,) if name in ("barrier_in_branch", "two_barriers", "shuffle_against_barrier") \
        else (x, y)
    with kernels.warps_in(order), pytest.raises(kernels.KernelError, match=message) as e:
        shuffles.get_function(name)((1,), (64,), args)
    assert f"{name}<<<1, 64>>>" in str(e.value) and "line" in str(e.value)
    # the harness is usable after a failed launch
    shuffles.get_function("warp_sums")((1,), (64,), (x, y))
    assert (y == 32).all()


def test_launch_configuration_is_checked(shuffles):
    with pytest.raises(kernels.KernelError, match="block size 2048"):
        shuffles.get_function("warp_sums")((1,), (2048,), (np.ones(2048), np.ones(2048)))
    with pytest.raises(kernels.KernelError, match="grid of 0 blocks"):
        shuffles.get_function("warp_sums")((0,), (32,), (np.ones(32), np.ones(32)))


# ---- arguments are checked against the kernel's parameters ----------------------------------
ARGS = r"""
__global__ void scale(float* y, const float* x, int n, double a) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * (float)a;
}
"""


def test_arguments_match_the_kernel_signature():
    fn = _module(ARGS, "scale").get_function("scale")
    x, y = np.arange(40, dtype=np.float32), np.zeros(40, np.float32)
    fn((1,), (32,), (y, x, np.int32(40), np.float64(0.5)))
    np.testing.assert_array_equal(y, x * 0.5)
    with pytest.raises(kernels.KernelError, match=r"argument 2 is a int64 scalar .*takes i4"):
        fn((1,), (32,), (y, x, np.int64(40), np.float64(0.5)))  # a GPU would read garbage
    with pytest.raises(kernels.KernelError, match=r"argument 1 is an array of float64"):
        fn((1,), (32,), (y, x.astype(np.float64), np.int32(40), np.float64(0.5)))
    with pytest.raises(kernels.KernelError, match="takes 4 arguments, got 3"):
        fn((1,), (32,), (y, x, np.int32(40)))


# ---- float16 conversions are exact ----------------------------------------------------------
F16 = r"""
struct f16 { unsigned short bits; };
__global__ void widen(const f16* h, float* f, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        float a;
        asm("cvt.f32.f16 %0, %1;" : "=f"(a) : "h"(h[i].bits));
        f[i] = a;
    }
}
__global__ void narrow(const float* f, f16* h, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        f16 v;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(v.bits) : "f"(f[i]));
        h[i] = v;
    }
}
"""


def test_float16_conversions_are_exact():
    module = _module(F16, "widen", "narrow")
    bits = np.arange(1 << 16, dtype=np.uint16)
    h = bits.view(np.float16)
    f = np.zeros(h.size, np.float32)
    module.get_function("widen")((64,), (256,), (h, f, np.int32(h.size)))
    np.testing.assert_array_equal(f, h.astype(np.float32))  # NaN == NaN here
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(50000).astype(np.float32) * 100,
                        h.astype(np.float32)[np.isfinite(h)],
                        (h[np.isfinite(h)].astype(np.float32)
                         + np.float32(1e-3) * rng.standard_normal(np.isfinite(h).sum())
                         .astype(np.float32)),
                        np.float32([65504, 65519.99, 65520, 1e9, -1e9, 2.0 ** -25,
                                    3 * 2.0 ** -26])])
    back = np.zeros(x.size, np.float16)
    module.get_function("narrow")((64,), (256,), (x, back, np.int32(x.size)))
    with np.errstate(over="ignore"):  # 1e9 -> inf, on purpose
        want = x.astype(np.float16)
    np.testing.assert_array_equal(back.view(np.uint16), want.view(np.uint16))


# ---- planted bugs in the project's own row kernels ------------------------------------------
def _mutated(old, new, count=1):
    src = ck.ROW_KERNELS_SOURCE
    assert src.count(old) == count, f"the planted bug no longer matches the source: {old!r}"
    return src.replace(old, new)


def _layer_norm(source, x, order="forward"):
    """LayerNorm forward of x (rows, D) through ``source``'s layer_norm_forward<double>."""
    module = kernels.RawModule(source, name_expressions=["layer_norm_forward<double>"])
    rows, D = x.shape
    y, xh, rstd = np.empty_like(x), np.empty_like(x), np.empty((rows, 1))
    g, b = np.ones(D), np.zeros(D)
    with kernels.warps_in(order):
        module.get_function("layer_norm_forward<double>")(
            (rows,), (ck._threads(D),), (x, g, b, y, xh, rstd, np.int32(D), np.float64(1e-5)))
    return y


def _reference(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)


X = np.random.default_rng(3).standard_normal((6, 1000)) * 2 + 1  # 512 threads: 16 warps


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_unchanged_row_kernel_passes(order):
    np.testing.assert_allclose(_layer_norm(ck.ROW_KERNELS_SOURCE, X, order), _reference(X),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_missing_syncthreads_gives_garbage(order):
    # block_sum without the barrier between the warps' writes to shared and the reads of them
    src = _mutated("if (lane == 0) shared[warp] = v;\n    __syncthreads();\n",
                   "if (lane == 0) shared[warp] = v;\n", count=2)
    y = _layer_norm(src, X, order)
    with pytest.raises(AssertionError, match="nan"):
        np.testing.assert_allclose(y, _reference(X), rtol=1e-12, atol=1e-12)


def test_barrier_inside_a_branch_is_reported():
    src = _mutated("if (lane == 0) shared[warp] = v;\n    __syncthreads();\n",
                   "if (lane == 0) { shared[warp] = v;\n    __syncthreads(); }\n", count=2)
    # lane 0 of each warp waits at the barrier while lanes 1..31 go on to the next shuffle
    with pytest.raises(kernels.KernelError, match="lane 0 waits at __syncthreads.*divergent "
                                                  "barrier"):
        _layer_norm(src, X)


def test_shuffle_of_part_of_a_warp_is_reported():
    src = _mutated("    v = warp_sum(v);\n    __syncthreads();  // a previous call",
                   "    if (lane < 31) v = warp_sum(v);\n    __syncthreads();  // a previous call")
    with pytest.raises(kernels.KernelError, match="not every lane of the warp reaches"):
        _layer_norm(src, X)


OFF_BY_ONE = ("const long long off = (long long)blockIdx.x * D;\n    const Loaded<T> row",
              "const long long off = (long long)blockIdx.x * D + 1;\n    const Loaded<T> row")


def test_off_by_one_row_offset_gives_wrong_rows():
    y = _layer_norm(_mutated(*OFF_BY_ONE), X)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        np.testing.assert_allclose(y[:-1], _reference(X)[:-1], rtol=1e-12, atol=1e-12)


# ---- AddressSanitizer -----------------------------------------------------------------------
def _asan_env():
    lib = subprocess.run([kernels._cxx(), "-print-file-name=libasan.so"], capture_output=True,
                         text=True).stdout.strip()
    if not lib or not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip(f"no libasan for {kernels._cxx()} (install libasan / gcc's sanitizers)")
    env = dict(os.environ, LD_PRELOAD=lib, ASAN_OPTIONS="detect_leaks=0",
               CUDA_ON_CPU_CXXFLAGS="-O1 -g -fsanitize=address -fno-omit-frame-pointer")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(ROOT, "tests"),
                                                    env.get("PYTHONPATH")) if p)
    return env


@pytest.mark.slow
def test_off_by_one_read_past_the_end_under_address_sanitizer():
    script = ("import numpy as np, test_cuda_on_cpu as t\n"
              "x = np.random.default_rng(3).standard_normal((6, 1000))\n"
              "t._layer_norm(t._mutated(*t.OFF_BY_ONE), x.copy())\n")
    res = subprocess.run([sys.executable, "-c", script], env=_asan_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in res.stderr, res.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(REAL_GPU, reason="the kernels run on the GPU here")
def test_kernel_parity_under_address_sanitizer():
    """Every kernel's parity tests (forward warp order) with the kernels built with
    -fsanitize=address: no read or write outside the arrays, on any size the tests use."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/test_cuda_kernels.py::TestParity", "-k", "not reverse"],
        env=_asan_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert "AddressSanitizer" not in res.stderr, tail
    assert " passed" in res.stdout and "skipped" not in res.stdout.splitlines()[-1], tail


# ---- the CuPy stand-in keeps CuPy's rules ---------------------------------------------------
@pytest.fixture
def stand_in():
    if REAL_GPU:
        pytest.skip("CuPy runs on the GPU here")
    from cuda_on_cpu import fake_cupy
    undo = fake_cupy.install()
    try:
        yield fake_cupy
    finally:
        undo()


def test_device_arrays_are_not_numpy_arrays(stand_in):
    import cupy
    a = cupy.arange(6, dtype=cupy.float32).reshape(2, 3)
    assert not isinstance(a, np.ndarray)
    with pytest.raises(TypeError):
        np.asarray(a)  # CuPy: implicit conversion to a NumPy array is not allowed
    with pytest.raises(TypeError, match="numpy.ndarray"):
        a + np.ones(3, np.float32)  # a host array where a device one is needed
    with pytest.raises(TypeError, match="numpy.ndarray"):
        cupy.matmul(a, np.ones((3, 2), np.float32))
    total = a.sum()
    assert isinstance(total, cupy.ndarray) and total.shape == ()  # 0-d, not a NumPy scalar
    assert float(total) == 15 and cupy.asnumpy(a).sum() == 15
    np.testing.assert_array_equal(a.get(), np.arange(6).reshape(2, 3))


def test_names_and_keywords_real_cupy_lacks_are_refused(stand_in):
    if not stand_in.API_CHECKED:
        pytest.skip("no CuPy installed to check names against (pip install cupy-cuda12x)")
    import cupy
    a = cupy.ones((2, 3), dtype=cupy.float32)
    with pytest.raises(stand_in.CupyApiError, match="busday_count does not exist in CuPy"):
        cupy.busday_count  # noqa: B018  (a NumPy-only function)
    with pytest.raises(stand_in.CupyApiError, match="resize does not exist"):
        a.resize((3, 2))  # a NumPy-only method
    with pytest.raises(TypeError, match=r"keyword\(s\) \['where'\] that CuPy"):
        cupy.sum(a, where=a > 0)  # a NumPy-only keyword
    assert float(cupy.sum(a, axis=0, keepdims=True).sum()) == 6  # what CuPy has works


def test_float16_products_accumulate_in_float32(stand_in):
    import cupy
    x = cupy.full((1, 4096), 1.0, dtype=cupy.float16)
    y = cupy.full((4096, 1), 1.0, dtype=cupy.float16)
    # float16 accumulation would stop at 2048 (2048 + 1 rounds back to 2048)
    assert float((x @ y)[0, 0]) == 4096 and (x @ y).dtype == cupy.float16


def test_run_py_gives_a_python_command_the_stand_in(tmp_path):
    if REAL_GPU:
        pytest.skip("CuPy runs on the GPU here")
    script = tmp_path / "probe.py"
    script.write_text("import cupy, subprocess, sys\n"
                      "print(cupy.__version__, cupy.cuda.runtime.getDeviceCount())\n"
                      "print(subprocess.run([sys.executable, '-c', 'import cupy; "
                      "print(cupy.__version__)'], capture_output=True, text=True).stdout)\n")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "cuda_on_cpu", "run.py"),
                          str(script)], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, CUDA_ON_CPU_DEVICES="3"))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split()
    assert lines[0].endswith("+cuda-on-cpu") and lines[1] == "3"
    assert lines[2].endswith("+cuda-on-cpu")  # and so does every Python process it starts
    assert "Error in sitecustomize" not in res.stderr


def test_device_memory_is_counted_as_cupys_pool_counts_it(stand_in, monkeypatch):
    # what memfit.py reads on a GPU: the pool's bytes in use, memGetInfo, a MemoryHook's
    # malloc / free calls; and an allocation past the device's memory raises CuPy's error
    import cupy
    pool = cupy.get_default_memory_pool()
    calls = []

    class Hook(cupy.cuda.MemoryHook):
        name = "test-hook"

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            calls.append(("malloc", size, mem_size))

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            calls.append(("free", mem_size))

    before = pool.used_bytes()
    a = cupy.zeros(1000, dtype=cupy.float32)  # 4000 bytes: 4096 in 512-byte blocks
    assert pool.used_bytes() == before + 4096
    view = a[10:].reshape(10, 99)
    assert pool.used_bytes() == before + 4096  # a view holds no memory of its own
    free, total = cupy.cuda.runtime.memGetInfo()
    assert free == total - pool.used_bytes()
    with Hook():
        b = a * 2  # a new array: 4096 bytes
        assert calls == [("malloc", 4000, 4096)]
        del b
        assert calls[-1] == ("free", 4096)
    c = a + 1  # outside the hook: not heard
    assert len(calls) == 2
    del a, view, c
    assert pool.used_bytes() == before  # freed when the last array using it is gone
    monkeypatch.setattr(stand_in._memory, "total", before + 10_000)
    keep = cupy.ones(2000, dtype=cupy.float32)  # 8192 bytes fit
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError, match="Out of memory allocating") as e:
        keep + 1  # 8192 more do not
    assert isinstance(e.value, MemoryError)
    assert pool.used_bytes() == before + 8192
