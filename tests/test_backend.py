"""Device selection, the seedable Generator, and the CPU BLAS set-up."""
import copy
import os
import json
import pickle

import numpy as np
import pytest

import minitransformer as mt
from minitransformer import Tensor, backend
from minitransformer import _malloc, settings
from minitransformer._blas import configure_cpu_blas
from minitransformer._malloc import configure_allocator


# ---- devices ------------------------------------------------------------------------------------
@pytest.mark.skipif(backend.cupy_available(), reason="a GPU is available: 'cuda' works here")
@pytest.mark.parametrize("device", ["cuda", "gpu", "CUDA"])
def test_cuda_without_gpu_says_how_to_install(device):
    for make in (lambda: backend.get_xp(device), lambda: Tensor(np.zeros(2), device=device),
                 lambda: mt.Generator(0, device=device)):
        with pytest.raises(RuntimeError) as info:
            make()
        assert "pip install -e .[cuda12]" in str(info.value), str(info.value)


@pytest.mark.parametrize("device", ["tpu", "cuda:0", "mps"])
def test_unknown_device_is_a_value_error(device):
    with pytest.raises(ValueError, match=f"unknown device '{device.lower()}'"):
        backend.get_xp(device)
    with pytest.raises(ValueError, match="use 'cpu' or 'cuda'"):
        Tensor(np.zeros(2), device=device)


def test_cpu_is_numpy_and_the_default(monkeypatch):
    assert backend.get_xp("cpu") is backend.get_xp("CPU") is backend.get_xp(None) is np
    t = Tensor([1.0, 2.0], device="cpu")
    assert isinstance(t.data, np.ndarray) and t.device == "cpu"
    assert backend.get_array_module(np.zeros(1), 1.0, None) is np
    assert settings.read({}).device == "cpu"
    assert settings.read({"MINITRANSFORMER_DEVICE": "CUDA"}).device == "cuda"
    monkeypatch.setattr(settings.SETTINGS, "device", "cuda")
    assert backend.default_device() == "cuda"


def test_tensor_on_device_round_trip(xp, arrays):
    device = "cpu" if xp is np else "cuda"
    t = Tensor(np.arange(6.0).reshape(2, 3), device=device, dtype=np.float32)
    assert t.device == device and backend.get_array_module(t.data) is xp
    assert t.dtype == np.float32
    out = t.numpy()
    assert isinstance(out, np.ndarray) and (out == np.arange(6.0).reshape(2, 3)).all()


# ---- Generator ----------------------------------------------------------------------------------
def _device(xp):
    return "cpu" if xp is np else "cuda"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_generator_reproducible(xp, dtype):
    a = mt.Generator(42, device=_device(xp))
    b = mt.Generator(42, device=_device(xp))
    x1, x2 = a.random((3, 5), dtype), a.random((3, 5), dtype)
    assert x1.dtype == dtype and x1.shape == (3, 5)
    assert backend.get_array_module(x1) is xp
    assert ((0 <= backend.to_numpy(x1)) & (backend.to_numpy(x1) < 1)).all()
    assert (backend.to_numpy(x1) == backend.to_numpy(b.random((3, 5), dtype))).all()
    assert (backend.to_numpy(x2) == backend.to_numpy(b.random((3, 5), dtype))).all()
    assert not (backend.to_numpy(x1) == backend.to_numpy(x2)).all(), "draws move on"
    other = mt.Generator(43, device=_device(xp)).random((3, 5), dtype)
    assert not (backend.to_numpy(other) == backend.to_numpy(x1)).all(), "seeds differ"
    a.seed(42)
    assert (backend.to_numpy(a.random((3, 5), dtype)) == backend.to_numpy(x1)).all()


def test_generator_state_round_trip(xp):
    g = mt.Generator(7, device=_device(xp))
    g.random((4,), np.float64)  # move away from the seed first
    state = g.get_state()
    state = pickle.loads(pickle.dumps(state))  # plain data: survives a checkpoint
    json.dumps(state)
    a = backend.to_numpy(g.random((6,), np.float32))
    b = backend.to_numpy(g.random((2, 3), np.float64))
    g.set_state(state)
    assert (backend.to_numpy(g.random((6,), np.float32)) == a).all()
    assert (backend.to_numpy(g.random((2, 3), np.float64)) == b).all()
    # a fresh generator with another seed takes the state over completely
    h = mt.Generator(999, device=_device(xp))
    h.set_state(copy.deepcopy(state))
    assert (backend.to_numpy(h.random((6,), np.float32)) == a).all()


def test_generator_draws_are_uniform(xp):
    # a broken generator (constant, clipped, too few distinct values) would pass the
    # reproducibility tests above; dropout needs P(u < p) = p
    u = backend.to_numpy(mt.Generator(3, device=_device(xp)).random((1000, 1000), np.float32))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 2e-3  # standard error 2.9e-4
    for p in (0.1, 0.5):
        assert abs((u < p).mean() - p) < 2e-3
    assert len(np.unique(u.ravel()[:1000])) > 990  # distinct values, not a coarse grid


class _FakeCuRAND:
    """Stand-in for cupy.random.RandomState: records how the Generator drives it."""
    made = []

    def __init__(self, method):
        self.method, self.calls = method, []
        _FakeCuRAND.made.append(self)

    def seed(self, key):
        self.calls.append(("seed", key))
        self._rng = np.random.default_rng(key)

    def random_sample(self, shape, dtype):
        self.calls.append(("random_sample", shape, np.dtype(dtype)))
        return self._rng.random(shape, dtype=dtype)


def test_generator_on_cupy_reseeds_one_philox_generator_per_draw(monkeypatch):
    # the CuPy branch, run here with a stand-in module: one cuRAND Philox generator per
    # Generator, seeded with the draw's key before each draw (so set_state restores masks)
    import types
    fake = types.SimpleNamespace(random=types.SimpleNamespace(RandomState=_FakeCuRAND),
                                 cuda=types.SimpleNamespace(curand=types.SimpleNamespace(
                                     CURAND_RNG_PSEUDO_PHILOX4_32_10=161)))
    _FakeCuRAND.made.clear()
    g = mt.Generator(5)
    g.xp = fake
    state = g.get_state()
    a = g.random((2, 3), np.float16)
    b = g.random((4,), np.float64)
    assert len(_FakeCuRAND.made) == 1 and _FakeCuRAND.made[0].method == 161
    calls = _FakeCuRAND.made[0].calls
    keys = [c[1] for c in calls if c[0] == "seed"]
    assert [c[0] for c in calls] == ["seed", "random_sample"] * 2 and keys[0] != keys[1]
    assert calls[1][1:] == ((2, 3), np.dtype(np.float32))  # float16 draws float32
    assert calls[3][1:] == ((4,), np.dtype(np.float64))
    g.set_state(state)
    assert (g.random((2, 3), np.float16) == a).all() and (g.random((4,), np.float64) == b).all()
    assert [c[1] for c in calls[4:] if c[0] == "seed"] == keys


# ---- CPU BLAS -----------------------------------------------------------------------------------
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl"


def _cpuinfo(tmp_path, flags, processors=2):
    text = "".join(f"processor\t: {i}\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 avx "
                   f"avx2 {flags}\n\n" for i in range(processors))
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    return str(path)


def test_blas_skylakex_when_all_four_avx512_flags(tmp_path):
    env = {}
    assert configure_cpu_blas(env, _cpuinfo(tmp_path, AVX512)) == "SkylakeX"
    assert env == {"OPENBLAS_CORETYPE": "SkylakeX"}


@pytest.mark.parametrize("missing", ["avx512f", "avx512bw", "avx512dq", "avx512vl"])
def test_blas_untouched_when_an_avx512_flag_is_missing(tmp_path, missing):
    flags = " ".join(f for f in AVX512.split() if f != missing)
    env = {"PATH": "/bin"}
    assert configure_cpu_blas(env, _cpuinfo(tmp_path, flags)) is None
    assert env == {"PATH": "/bin"}


def test_blas_flags_are_whole_words(tmp_path):
    """'avx512vl' must be a flag of its own, not a prefix of another one."""
    flags = "avx512f avx512dq avx512bw avx512vlx avx512_vl"
    env = {}
    assert configure_cpu_blas(env, _cpuinfo(tmp_path, flags)) is None
    assert env == {}


def test_blas_keeps_the_users_value(tmp_path):
    env = {"OPENBLAS_CORETYPE": "Haswell"}
    assert configure_cpu_blas(env, _cpuinfo(tmp_path, AVX512)) == "Haswell"
    assert env == {"OPENBLAS_CORETYPE": "Haswell"}


@pytest.mark.parametrize("coretype,core,slow", [("Haswell", "Haswell", True),
                                                 (None, "Haswell", True),
                                                 ("SkylakeX", "SkylakeX", False)])
def test_train_py_notes_avx2_kernels_on_an_avx512_cpu(monkeypatch, coretype, core, slow):
    """A user's (or a machine's) OPENBLAS_CORETYPE=Haswell wins over the AVX-512 kernels;
    train.py then says so at its start (doctor.slow_blas_note), with the fix."""
    from minitransformer import doctor
    monkeypatch.setattr(doctor, "_cpu_flags", lambda: set(AVX512.split()))
    monkeypatch.setattr(doctor, "_openblas_runtime", lambda: (core, 1))
    if coretype:
        monkeypatch.setenv("OPENBLAS_CORETYPE", coretype)
    else:
        monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    note = doctor.slow_blas_note()
    if not slow:
        assert note is None
    else:
        assert note.startswith("note: ") and f"OPENBLAS_CORETYPE={coretype or 'unset'}" in note
        assert "Haswell kernels" in note and "export OPENBLAS_CORETYPE=SkylakeX" in note


def test_blas_without_cpuinfo(tmp_path):
    env = {}
    assert configure_cpu_blas(env, str(tmp_path / "does-not-exist")) is None
    (tmp_path / "noflags").write_text("processor\t: 0\nmodel name\t: something\n")
    assert configure_cpu_blas(env, str(tmp_path / "noflags")) is None
    assert env == {}


# ---- allocator settings (minitransformer/_malloc.py) ----------------------------------------
class _FakeLibc:
    def __init__(self, answer=1):
        self.calls, self.answer = [], answer

    def mallopt(self, param, value):
        self.calls.append((param, value))
        return self.answer


def test_allocator_settings_applied():
    libc = _FakeLibc()
    assert configure_allocator({}, libc) is True
    assert libc.calls == list(_malloc.SETTINGS)
    assert dict(libc.calls)[_malloc.M_MMAP_THRESHOLD] == 32 << 20


@pytest.mark.parametrize("env", [{"MINITRANSFORMER_MALLOC": "0"}, {"MALLOC_TRIM_THRESHOLD_": "0"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}])
def test_allocator_left_to_the_user(env):
    libc = _FakeLibc()
    assert configure_allocator(env, libc) is False
    assert libc.calls == []


def test_allocator_reports_a_refused_setting():
    assert configure_allocator({}, _FakeLibc(answer=0)) is False


def test_glibc_accepts_the_settings():
    # On glibc every value is within mallopt's limits (32 MiB is its largest mmap threshold).
    libc = _malloc._glibc()
    if libc is None:
        pytest.skip("not glibc")
    assert configure_allocator({}, libc) is True


# ---- importing the package ----------------------------------------------------------------------
def test_import_has_no_side_effects_and_configure_process_opts_in():
    """`import minitransformer` (and using its names) leaves the environment and NumPy's set-up
    alone; configure_process() is what the command lines call, before NumPy loads."""
    import subprocess
    import sys
    code = (
        "import os, sys, json\n"
        "before = dict(os.environ)\n"
        "import minitransformer as mt\n"
        "lazy = 'numpy' not in sys.modules\n"
        "mt.Tensor([1.0]); mt.nn.Linear\n"
        "untouched = dict(os.environ) == before\n"
        "mt.configure_process()\n"
        "tf32 = os.environ.get('CUPY_TF32')\n"
        "decoding = {}; mt.configure_process(decoding, tf32=False)\n"
        "mine = {'CUPY_TF32': '1'}; mt.configure_process(mine, tf32=False)\n"
        "print(json.dumps([lazy, untouched, tf32, decoding['CUPY_TF32'], mine['CUPY_TF32']]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CUPY_TF32", "OPENBLAS_CORETYPE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    # TF32 for training; translate.py's tf32=False: full float32 unless the user set it
    assert json.loads(out) == [True, True, "1", "0", "1"]


# ---- row_max ------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7, 3, 1, 20), (256, 31), (5, 64), (3, 200), (1, 9), (4, 0, 5)])
def test_row_max_equals_the_max_over_the_last_axis(shape):
    # short rows are reduced transposed (faster on NumPy); the values must be the same,
    # -inf rows (fully masked attention) and NaN included
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
    if x.size:
        x.reshape(-1, shape[-1])[0] = -np.inf
        x.reshape(-1, shape[-1])[-1, -1] = np.nan
    got = backend.row_max(x)
    np.testing.assert_array_equal(got, x.max(axis=-1, keepdims=True))
    assert got.dtype == x.dtype


@pytest.mark.parametrize("shape, dtype", [((8000, 128), np.float32), ((37, 5), np.float64),
                                          ((1, 300), np.float32), ((0, 4), np.float32),
                                          ((300, 1), np.float16)])
def test_transposed_is_a_contiguous_copy_of_the_transpose(shape, dtype):
    a = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    t = backend.transposed(a)
    assert t.flags.c_contiguous and t.dtype == a.dtype and not np.shares_memory(t, a)
    np.testing.assert_array_equal(t, a.T)


def test_a_switch_with_a_value_it_does_not_take_is_named_and_refused():
    read = settings.read
    good = read({"MINITRANSFORMER_FUSED": "0", "MINITRANSFORMER_FLAT_ADAM": "1",
                 "MINITRANSFORMER_MALLOC": "0", "MINITRANSFORMER_DEVICE": "cuda"})
    assert (good.fused, good.flat_adam, good.malloc, good.device, good.problems) == \
        (False, True, False, "cuda", [])
    bad = read({"MINITRANSFORMER_FUSED": "maybe", "MINITRANSFORMER_DEVICE": "tpu"})
    assert (bad.fused, bad.device) == (True, "cpu")  # (the defaults stand)
    assert len(bad.problems) == 2
    assert "MINITRANSFORMER_FUSED='maybe' is not one of 1, 0" in bad.problems[1]
    assert "MINITRANSFORMER_DEVICE='tpu' is not one of cpu, cuda" in bad.problems[0]
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for script in ("train.py", "translate.py"):
        proc = subprocess.run([sys.executable, os.path.join(root, script), "--help"],
                              env={**os.environ, "MINITRANSFORMER_FUSED": "maybe"},
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stdout == "", (script, proc.stderr)
        assert proc.stderr == "error: MINITRANSFORMER_FUSED='maybe' is not one of 1, 0 (or " \
            "unset); set one of those, or unset it\n", proc.stderr
