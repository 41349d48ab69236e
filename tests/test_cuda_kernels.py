"""The fused CUDA kernels (engine/cuda_kernels.py) equal the NumPy code they replace.

GPU parity tests (class TestParity, marked ``gpu``) run each kernel on CuPy arrays and the
NumPy Function or formula on host copies of the same numbers: float64 to ~1e-12, float32 to
~1e-5, float16 (row kernels) against the float32 result to float16's precision; awkward
sizes (D, S, V not multiples of 32), fully masked rows, padding targets. On a real GPU they
run there; without one they run the same CUDA source on the CPU (tests/cuda_on_cpu: the
kernels compiled for the host, their warps in forward and in reverse order, so a missing
barrier between warps shows). Also everywhere: the module imports without CuPy, and (where
NVRTC loads, e.g. ``pip install cupy-cuda12x nvidia-cuda-nvrtc-cu12`` on a machine without a
GPU, as the ``test`` extra does) every kernel's CUDA source compiles with NVRTC.
"""
import numpy as np
import pytest

from minitransformer import Tensor, backend
from minitransformer.engine import cuda_kernels as ck
from minitransformer.engine.attention import ScaledDotProductAttention, attention_bias
from minitransformer.engine.cross_entropy import smoothing_weights
from minitransformer.engine.layernorm import LayerNorm
from minitransformer.engine.linear_cross_entropy import linear_cross_entropy
from minitransformer.engine.ops import Dropout
from minitransformer.optim.adam import Adam

from conftest import REAL_GPU

GPU = pytest.mark.gpu  # a real GPU, or the CUDA source executed on the CPU (tests/cuda_on_cpu)
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
ATOL = {np.float64: 1e-13, np.float32: 1e-6}
FLOATS = [np.float64, np.float32]


# ---- without a GPU -----------------------------------------------------------------------------
@pytest.mark.skipif(REAL_GPU, reason="a GPU is present")
def test_imports_and_reports_unavailable_without_gpu():
    assert ck.available() is False
    assert ck._kernels == {}  # nothing compiled at import
    with pytest.raises(RuntimeError, match="CuPy"):
        ck.layer_norm_forward(np.ones((2, 3)), np.ones(3), np.zeros(3))


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # no CuPy, or no libnvrtc
        pytest.skip(f"NVRTC is not available: {exc}")
    return nvrtc


def _compile(nvrtc, source, name_expressions, options):
    """Compile with NVRTC (no GPU needed); fail with the compiler log."""
    prog = nvrtc.createProgram(source, "check.cu", (), ())
    for name in name_expressions:
        nvrtc.addNameExpression(prog, name)
    try:
        nvrtc.compileProgram(prog, list(options))
    except Exception as exc:
        pytest.fail(f"{exc}\n{nvrtc.getProgramLog(prog)}")
    log = nvrtc.getProgramLog(prog)
    assert "warning" not in log.lower(), log
    return [nvrtc.getLoweredName(prog, name) for name in name_expressions]


@pytest.mark.parametrize("arch", ["compute_75", "compute_90"])
def test_row_kernels_compile_with_nvrtc(arch):
    """The RawModule source as it is compiled on a GPU: every template instantiation."""
    nvrtc = _nvrtc()
    names = ck.row_kernel_names()
    lowered = _compile(nvrtc, ck.ROW_KERNELS_SOURCE, names,
                       ck.ROW_KERNEL_OPTIONS + (f"-arch={arch}",))
    assert len(names) == 24 and all(lowered)


def elementwise_as_raw_kernel(in_params, out_params, operation, ctype):
    """The shape of the kernel CuPy generates from an ElementwiseKernel spec, for T = ctype:
    ``typedef ctype T;``, each input a const value, each output a reference, then the
    operation. Every input is read from an array here; CuPy passes scalars by value, which
    is the same to the operation."""
    params = [p.split() for p in (in_params + ", " + out_params).split(",")]
    n_in = len(in_params.split(","))
    args, loads = [], []
    for k, (typ, name) in enumerate(params):
        assert typ == "T", f"only T-typed params are wrapped, got {typ} {name}"
        if k < n_in:
            args.append(f"const T* _in_{name}")
            loads.append(f"const T {name} = _in_{name}[i];")
        else:
            args.append(f"T* _out_{name}")
            loads.append(f"T& {name} = _out_{name}[i];")
    return (f"typedef {ctype} T;\n{ck.ELEMENTWISE_PREAMBLE}\n"
            f"extern \"C\" __global__ void check({', '.join(args)}, long long n) {{\n"
            "    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
            "    if (i >= n) return;\n    " + "\n    ".join(loads) + "\n"
            + operation + "\n}\n")


@pytest.mark.parametrize("name", sorted(ck.ELEMENTWISE_SPECS))
@pytest.mark.parametrize("ctype", ["float", "double"])
def test_elementwise_operations_compile_with_nvrtc(name, ctype):
    """The ElementwiseKernel operations, wrapped as CuPy wraps them (see above)."""
    nvrtc = _nvrtc()
    in_params, out_params, operation, _ = ck.ELEMENTWISE_SPECS[name]
    source = elementwise_as_raw_kernel(in_params, out_params, operation, ctype)
    _compile(nvrtc, source, [], ("--std=c++14", "-arch=compute_75"))


# ---- GPU parity --------------------------------------------------------------------------------
def _rng():
    return np.random.default_rng(0)


@pytest.fixture(params=["forward"] if REAL_GPU else ["forward", "reverse"])
def cp(request):
    """CuPy; on the CPU harness, with the warps of each block run in both orders."""
    if REAL_GPU:
        yield backend.get_xp("cuda")
        return
    from cuda_on_cpu import kernels
    with kernels.warps_in(request.param):
        yield backend.get_xp("cuda")


class TestParity:
    pytestmark = GPU

    # LayerNorm
    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("D", [77, 512, 1000])
    def test_layer_norm(self, cp, dtype, D, assert_close):
        rng = _rng()
        x = (rng.standard_normal((3, 5, D)) * 2 + 0.5).astype(dtype)
        g, b = rng.standard_normal(D).astype(dtype), rng.standard_normal(D).astype(dtype)
        dy = rng.standard_normal((3, 5, D)).astype(dtype)
        ref = LayerNorm(eps=1e-5)
        y_ref = ref.forward(x, g, b)
        x_hat_ref, rstd_ref = ref.x_hat.copy(), ref.rstd.copy()
        dx_ref, dg_ref, db_ref = ref.backward(dy)

        y, x_hat, rstd = ck.layer_norm_forward(cp.asarray(x), cp.asarray(g), cp.asarray(b), 1e-5)
        for got, want, what in ((y, y_ref, "y"), (x_hat, x_hat_ref, "x_hat"),
                                (rstd, rstd_ref, "rstd")):
            assert got.dtype == dtype
            assert_close(got, want, RTOL[dtype], ATOL[dtype], f"{what} D={D} {dtype.__name__}")
        dx, dg, db = ck.layer_norm_backward(cp.asarray(dy), x_hat, rstd, cp.asarray(g))
        for got, want, what in ((dx, dx_ref, "dx"), (dg, dg_ref, "dgamma"), (db, db_ref, "dbeta")):
            assert got.shape == want.shape and got.dtype == dtype
            assert_close(got, want, RTOL[dtype] * 10, ATOL[dtype] * 10,
                         f"{what} D={D} {dtype.__name__}")

    @pytest.mark.parametrize("D", [77, 1000])
    def test_layer_norm_float16(self, cp, D, assert_close):
        rng = _rng()
        x16 = (rng.standard_normal((4, D)) * 3).astype(np.float16)
        g, b = rng.standard_normal(D).astype(np.float16), rng.standard_normal(D).astype(np.float16)
        y, x_hat, rstd = ck.layer_norm_forward(cp.asarray(x16), cp.asarray(g), cp.asarray(b))
        y32, xh32, r32 = ck.layer_norm_forward(*(cp.asarray(a, dtype=np.float32)
                                                 for a in (x16, g, b)))
        assert y.dtype == x_hat.dtype == np.float16 and rstd.dtype == np.float32
        # same float16 inputs, statistics in float32: only the float16 rounding of the output
        assert_close(y, y32, 1e-3, 1e-3, "y float16")
        assert_close(x_hat, xh32, 1e-3, 1e-3, "x_hat float16")
        assert_close(rstd, r32, 1e-6, 0, "rstd float16 (kept in float32)")

    def test_layer_norm_backward_float16_with_large_gradients(self, cp, assert_close):
        """Under loss scaling dy is large: an entry of dy * x_hat may exceed float16's 65504
        while dgamma's sums, in float32 like layernorm.py's, stay finite. gamma and beta are
        float32 master weights and are not rounded to float16."""
        rng = _rng()
        D = 77
        x16 = (rng.standard_normal((4, D)) * 3).astype(np.float16)
        g, b = rng.standard_normal(D).astype(np.float32), rng.standard_normal(D).astype(np.float32)
        # large but finite float16 gradients (N(0, 1) * 3e4 alone overflows to inf past 65504)
        dy16 = cp.asarray(np.clip(rng.standard_normal((4, D)) * 3e4, -6e4, 6e4)
                          .astype(np.float16))
        y, x_hat, rstd = ck.layer_norm_forward(cp.asarray(x16), cp.asarray(g), cp.asarray(b))
        assert float(cp.abs(dy16.astype(np.float32) * x_hat.astype(np.float32)).max()) > 65504
        dx, dg, db = ck.layer_norm_backward(dy16, x_hat, rstd, cp.asarray(g))
        y32, xh32, r32 = ck.layer_norm_forward(cp.asarray(x16, np.float32), cp.asarray(g),
                                               cp.asarray(b))
        dx32, dg32, db32 = ck.layer_norm_backward(dy16.astype(np.float32), xh32, r32,
                                                  cp.asarray(g))
        assert dx.dtype == np.float16 and dg.dtype == db.dtype == np.float32
        assert bool(cp.isfinite(dg).all()) and bool(cp.isfinite(dx).all())
        assert_close(y, y32, 1e-3, 1e-3, "y float16, float32 gamma and beta")
        # x_hat is kept in float16 (about 5e-4 relative): the gradients differ by about that
        assert_close(dg, dg32, 2e-3, 2e-3 * float(cp.abs(dg32).max()), "dgamma float16")
        assert_close(db, db32, 1e-6, 0, "dbeta float16")
        assert_close(dx, dx32, 2e-3, 2e-3 * float(cp.abs(dx32).max()), "dx float16")

    # masked softmax
    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("T, S, causal", [(7, 77, False), (9, 5, True), (33, 513, True)])
    def test_masked_softmax_matches_attention(self, cp, dtype, T, S, causal, assert_close):
        """The probabilities ScaledDotProductAttention computes, from its own scores and mask;
        batch row 1 has every key masked (and causal T > S masks the first queries)."""
        rng = _rng()
        B, H, K = 3, 2, 8
        q, k, v = (rng.standard_normal((B, H, n, K)).astype(dtype) for n in (T, S, S))
        key_mask = rng.random((B, S)) > 0.3
        key_mask[0, 0] = True
        key_mask[1] = False
        ref = ScaledDotProductAttention(key_mask=key_mask, causal=causal, dropout=0.0, rng=None,
                                        training=False)
        ref.forward(q, k, v)
        # the scores as the reference computes them, on the host: a GPU product would use
        # TF32 for float32 (about 1e-3 relative), not what this test compares
        s = cp.asarray((q * ref.scale) @ k.swapaxes(-1, -2))  # (B, H, T, S)
        bias = attention_bias(cp, s.dtype, cp.asarray(key_mask), causal, T, S)
        p = ck.masked_softmax_(s, bias)
        assert p is s
        assert not bool(cp.isnan(p).any())
        assert float(cp.abs(p[1]).max()) == 0.0  # every key of batch row 1 masked
        assert_close(p, ref.p, RTOL[dtype] * 10, ATOL[dtype], f"p T={T} S={S} {dtype.__name__}")

    @pytest.mark.parametrize("dtype", FLOATS)
    def test_masked_softmax_bias_shapes(self, cp, dtype, assert_close):
        rng = _rng()
        s = rng.standard_normal((4, 6, 37)).astype(dtype) * 5
        for bias in (None, np.where(rng.random((6, 37)) > 0.5, 0, -np.inf).astype(dtype),
                     np.where(rng.random((4, 1, 37)) > 0.2, 0, -np.inf).astype(dtype)):
            want = s if bias is None else s + bias
            m = want.max(axis=-1, keepdims=True)
            m[~np.isfinite(m)] = 0
            e = np.exp(want - m)
            z = e.sum(axis=-1, keepdims=True)
            z[z == 0] = 1
            got = ck.masked_softmax_(cp.array(s), None if bias is None else cp.asarray(bias))
            assert_close(got, e / z, RTOL[dtype] * 10, ATOL[dtype], f"bias {np.shape(bias)}")
        big = cp.asarray(rng.standard_normal((2, 3, 2, 2, 3, 6)).astype(dtype))  # 5 leading axes
        bias = cp.zeros((1, 1, 1, 1, 1, 6), dtype)
        bias[..., 0] = -cp.inf
        want = cp.exp(big[..., 1:] - big[..., 1:].max(axis=-1, keepdims=True))
        got = ck.masked_softmax_(big.copy(), bias)
        assert_close(got[..., 1:], want / want.sum(axis=-1, keepdims=True), RTOL[dtype] * 10,
                     ATOL[dtype], "5 leading axes")

    def test_masked_softmax_float16(self, cp, assert_close):
        rng = _rng()
        s = (rng.standard_normal((2, 3, 5, 77)) * 4).astype(np.float16)
        bias = np.where(rng.random((2, 1, 1, 77)) > 0.3, 0, -np.inf).astype(np.float16)
        bias[1] = -np.inf
        got = ck.masked_softmax_(cp.array(s), cp.asarray(bias))
        want = ck.masked_softmax_(cp.array(s, dtype=np.float32), cp.asarray(bias, np.float32))
        assert got.dtype == np.float16
        assert_close(got, want, 1e-3, 1e-3, "p float16")
        assert float(cp.abs(got[1]).max()) == 0.0

    # dropout + residual
    @pytest.mark.parametrize("dtype", FLOATS)
    def test_dropout_residual(self, cp, dtype, assert_close):
        rng = _rng()
        x, f = (rng.standard_normal((4, 7, 77)).astype(dtype) for _ in range(2))
        gen = backend.Generator(seed=3)  # the same uniforms Dropout draws (CPU generator)
        ref = Dropout(rate=0.3, rng=gen)
        y_ref = x + ref.forward(f)
        gen.seed(3)
        u = gen.random(f.shape, dtype)
        y, mask = ck.dropout_residual(cp.asarray(x), cp.asarray(f), 0.3, cp.asarray(u))
        assert y.dtype == mask.dtype == dtype
        assert_close(mask, ref.mask, 0, 0, "mask")
        assert_close(y, y_ref, RTOL[dtype], ATOL[dtype], "y")

    # label-smoothed cross-entropy, one chunk
    @staticmethod
    def ce_reference(z, t, valid, c_t, c_o, z_sum):
        """The loop body of linear_cross_entropy.py on one chunk (z is changed in place)."""
        r = np.arange(z.shape[0])
        tc = np.where(valid, t, 0)
        z_t = z[r, tc]
        m = z.max(axis=1, keepdims=True)
        z -= m
        np.exp(z, out=z)
        s = z.sum(axis=1)
        lse = m[:, 0] + np.log(s)
        loss = (lse - c_o * z_sum - (c_t - c_o) * z_t) * valid
        z[r, tc] -= z.dtype.type(c_t - c_o) * s
        return loss, s

    # beam search's candidates
    @staticmethod
    def top_m_reference(z, m, skip):
        """The m best columns outside ``skip`` (ties: the lower column first) and their
        log-probabilities over the whole row, in float64 on the host."""
        z64 = z.astype(np.float64)
        cols = np.setdiff1d(np.arange(z.shape[1]), skip)  # (skip's never, even at -inf)
        keys = np.where(np.isnan(z64[:, cols]), -np.inf, z64[:, cols])
        best = cols[np.argsort(-keys, axis=1, kind="stable")[:, :m]]
        zmax = z64.max(axis=1, keepdims=True)
        lse = zmax + np.log(np.exp(z64 - zmax).sum(axis=1, keepdims=True))
        return best, np.take_along_axis(z64, best, 1) - lse

    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("V, m", [(37, 1), (37, 8), (8000, 8), (8000, 16), (1000, 3)])
    def test_top_m_log_softmax(self, cp, dtype, V, m, assert_close):
        rng = _rng()
        z = (rng.standard_normal((13, V)) * 3).astype(dtype)
        z[4, 0] = 50.0  # padding the largest: never picked, but it dominates the normaliser
        z[5, 2] = 50.0  # (BOS likewise)
        z[6, :] = -np.inf
        z[6, 5:5 + m] = rng.standard_normal(m)  # just m finite candidates
        z[7, 1:] = -np.inf
        z[7, :2 + m] = 1.5  # exact ties: the lower columns first
        want_best, want_lp = self.top_m_reference(z, m, (0, 2))
        zc = cp.asarray(z)
        best, lp = ck.top_m_log_softmax(zc, m, (0, 2))
        assert best.dtype == np.int64 and lp.dtype == dtype and best.shape == (13, m)
        np.testing.assert_array_equal(backend.to_numpy(zc), z)  # read, not changed
        np.testing.assert_array_equal(backend.to_numpy(best), want_best)
        lp = backend.to_numpy(lp)
        finite = np.isfinite(want_lp)  # row 7's -inf columns past its ties stay -inf
        np.testing.assert_array_equal(np.isfinite(lp), finite)
        assert_close(lp[finite], want_lp[finite], RTOL[dtype] * 10, ATOL[dtype] * 10,
                     "log-probabilities")

    @pytest.mark.parametrize("V, m", [(5000, 1), (5000, 8), (2000, 16)])
    def test_top_m_log_softmax_ties_and_short_rows(self, cp, V, m, assert_close):
        """Rows where a thread's own list fills with ties (all equal; 0/1 values; one value
        in every column from 600 on: the lower columns first throughout), a row of one
        finite score (then -inf ones, never padding or BOS), and a row whose best scores
        all lie in one thread's columns (3, 3 + blockDim, ...: its own list overflows)."""
        rng = _rng()
        z = rng.standard_normal((5, V)).astype(np.float32)
        z[0] = 0.0
        z[1] = rng.integers(0, 2, V)
        z[2] = -np.inf
        z[2, 7] = 1.0
        z[3, 600:] = z[3].max() + 1
        one_thread = np.arange(3, V, ck._threads(V))
        z[4, one_thread] = 40 + rng.standard_normal(len(one_thread))
        want_best, want_lp = self.top_m_reference(z, m, (0, 2))
        best, lp = ck.top_m_log_softmax(cp.asarray(z), m, (0, 2))
        np.testing.assert_array_equal(backend.to_numpy(best), want_best)
        lp, finite = backend.to_numpy(lp), np.isfinite(want_lp)
        np.testing.assert_array_equal(np.isfinite(lp), finite)
        assert_close(lp[finite], want_lp[finite], 1e-5, 1e-6, "log-probabilities")

    def test_top_m_log_softmax_skips_as_numpy_indexes(self, cp):
        """Skip ids index as NumPy does (-1: the last column); others are refused."""
        z = np.arange(10, dtype=np.float32)[None, ::-1].copy()  # column 0 the best
        best, _ = ck.top_m_log_softmax(cp.asarray(z), 2, (-10, 2))  # -10: column 0
        np.testing.assert_array_equal(backend.to_numpy(best), [[1, 3]])
        for skip in ((0, 1, 2), (10,), (-11,)):
            with pytest.raises(ValueError, match="skip"):
                ck.top_m_log_softmax(cp.asarray(z), 2, skip)

    def test_top_m_log_softmax_float16(self, cp, assert_close):
        rng = _rng()
        z = (rng.standard_normal((9, 1000)) * 3).astype(np.float16)
        best16, lp16 = ck.top_m_log_softmax(cp.asarray(z), 8, (0, 2))
        best32, lp32 = ck.top_m_log_softmax(cp.asarray(z, dtype=np.float32), 8, (0, 2))
        assert lp16.dtype == np.float32  # the same float16 numbers, computed in float32
        np.testing.assert_array_equal(backend.to_numpy(best16), backend.to_numpy(best32))
        assert_close(lp16, lp32, 1e-6, 1e-6, "log-probabilities of float16 scores")

    @pytest.mark.parametrize("dtype", FLOATS)
    def test_top_m_log_softmax_matches_the_primitives(self, cp, dtype, monkeypatch,
                                                      assert_close):
        """The same candidates and log-probabilities as beam search's route without it
        (selection.top_m then log_softmax_at, on the same device, fused kernels off)."""
        from minitransformer.mt.selection import log_softmax_at, top_m
        from minitransformer.settings import SETTINGS
        rng = _rng()
        z = (rng.standard_normal((40, 8000)) * 3).astype(dtype)
        monkeypatch.setattr(SETTINGS, "fused", False)
        zz = cp.array(z)
        zz[:, [0, 2]] = -np.inf  # as search._forbid, for the selection only
        cols = top_m(cp, zz, 8)
        zz[:, [0, 2]] = cp.asarray(z[:, [0, 2]])
        want_lp = backend.to_numpy(log_softmax_at(cp, zz, cols))
        want = np.sort(backend.to_numpy(cols), axis=1)
        monkeypatch.setattr(SETTINGS, "fused", True)
        best, lp = ck.top_m_log_softmax(cp.asarray(z), 8, (0, 2))
        got_best, got_lp, cols = (backend.to_numpy(a) for a in (best, lp, cols))
        got_order, want_order = np.argsort(got_best, axis=1), np.argsort(cols, axis=1)
        np.testing.assert_array_equal(np.take_along_axis(got_best, got_order, 1), want)
        assert_close(np.take_along_axis(got_lp, got_order, 1),
                     np.take_along_axis(want_lp, want_order, 1),
                     RTOL[dtype] * 10, ATOL[dtype] * 10, "log-probabilities")

    @pytest.mark.parametrize("m, skip", [(0, (0, 2)), (17, (0, 2)), (9, (0, 2)), (10, (0,))])
    def test_top_m_log_softmax_refuses_what_it_cannot_pick(self, cp, m, skip):
        with pytest.raises(ValueError, match="top_m_log_softmax: m="):
            ck.top_m_log_softmax(cp.zeros((2, 10), dtype=np.float32), m, skip)

    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("V", [37, 8000])
    @pytest.mark.parametrize("smoothing", ["others", "uniform"])
    @pytest.mark.parametrize("pass_z_sum", [False, True])
    def test_smoothed_ce_chunk(self, cp, dtype, V, smoothing, pass_z_sum, assert_close):
        rng = _rng()
        n = 13
        z = (rng.standard_normal((n, V)) * 3).astype(dtype)
        t = rng.integers(0, V, n)
        t[[2, 7]] = -1  # padding (any value): class 0 is read, the loss is zeroed
        valid = t >= 0
        c_t, c_o = smoothing_weights(0.1, V, smoothing)
        z_sum = z.sum(axis=1)
        want_z = z.copy()
        want_loss, want_s = self.ce_reference(want_z, t, valid, c_t, c_o, z_sum)
        zc = cp.array(z)  # a copy: the kernel works in place
        loss, s = ck.smoothed_ce_chunk(zc, cp.asarray(t), cp.asarray(valid), c_t, c_o,
                                       want_grad=False,
                                       z_sum=cp.asarray(z_sum) if pass_z_sum else None)
        assert loss.dtype == s.dtype == dtype
        assert_close(zc, z, 0, 0, "z untouched without want_grad")
        assert_close(loss, want_loss, RTOL[dtype] * 10, ATOL[dtype] * 10, "row_loss")
        assert_close(s, want_s, RTOL[dtype] * 10, 0, "s")
        assert float(cp.abs(loss[cp.asarray(~valid)]).max()) == 0.0
        loss2, s2 = ck.smoothed_ce_chunk(zc, cp.asarray(t), cp.asarray(valid), c_t, c_o,
                                         want_grad=True)
        assert_close(loss2, want_loss, RTOL[dtype] * 10, ATOL[dtype] * 10, "row_loss (grad)")
        assert_close(zc, want_z, RTOL[dtype] * 10, ATOL[dtype] * 10, "e' left in z")

    def test_smoothed_ce_chunk_float16(self, cp, assert_close):
        rng = _rng()
        z = (rng.standard_normal((9, 1000)) * 3).astype(np.float16)
        t = rng.integers(0, 1000, 9)
        valid = np.ones(9, bool)
        valid[4] = False
        c_t, c_o = smoothing_weights(0.1, 1000)
        z16, z32 = cp.array(z), cp.array(z, dtype=np.float32)
        args = (cp.asarray(t), cp.asarray(valid), c_t, c_o, True)
        loss16, s16 = ck.smoothed_ce_chunk(z16, *args)
        loss32, s32 = ck.smoothed_ce_chunk(z32, *args)
        assert z16.dtype == np.float16 and loss16.dtype == s16.dtype == np.float32
        assert_close(loss16, loss32, 1e-5, 1e-5, "row_loss float16")  # same numbers, in float32
        assert_close(s16, s32, 1e-5, 0, "s float16")
        assert_close(z16, z32, 1e-3, 1e-3, "e' float16")

    @pytest.mark.parametrize("dtype", FLOATS)
    def test_smoothed_ce_chunk_in_linear_cross_entropy(self, cp, dtype, assert_close):
        """Swapped into linear_cross_entropy's loop: the same loss and dh as the NumPy op."""
        rng = _rng()
        N, D, V, pad = 21, 16, 37, 0
        h = rng.standard_normal((N, D)).astype(dtype)
        w = (rng.standard_normal((V, D)) * 0.5).astype(dtype)
        t = rng.integers(1, V, N)
        t[[3, 4, 20]] = pad
        ht = Tensor(h, requires_grad=True)
        loss_ref, _ = linear_cross_entropy(ht, Tensor(w), t, label_smoothing=0.1, pad_id=pad)
        loss_ref.backward()
        c_t, c_o = smoothing_weights(0.1, V)
        # the products on the host, as the NumPy op computes them (on the GPU float32 ones
        # would use TF32); only the kernel runs on the device
        valid, w_sum = t != pad, w.sum(axis=0)
        z = cp.asarray(h @ w.T)
        row_loss, s = ck.smoothed_ce_chunk(z, cp.asarray(t), cp.asarray(valid), c_t, c_o, True,
                                           z_sum=cp.asarray(h @ w_sum))
        scale = (valid / backend.to_numpy(s)).astype(dtype)[:, None]
        dh = (backend.to_numpy(z) @ w) * scale - dtype(c_o) * valid[:, None] * w_sum
        assert_close(row_loss.sum(), loss_ref.data, RTOL[dtype] * 10, 0, "loss")
        assert_close(dh, ht.grad, RTOL[dtype] * 100, ATOL[dtype] * 10, "dh")

    @pytest.mark.parametrize("dtype", FLOATS + [np.float16])
    @pytest.mark.parametrize("D", [77, 512])
    def test_bias_residual_layer_norm_is_the_three_calls_it_replaces(self, cp, dtype, D,
                                                                     assert_close):
        """v = x + (f + b) then layer_norm_forward, as a decoding step computes them with
        separate calls (the bias in the accumulation dtype, each sum rounded to f's dtype):
        the same numbers, bit for bit where the kernels run on the CPU (on a GPU to the
        last bits: a compiler may contract the two kernels' arithmetic differently)."""
        rng = _rng()
        acc = np.float32 if dtype == np.float16 else dtype
        f, x = (cp.asarray(rng.standard_normal((7, D)).astype(dtype)) for _ in range(2))
        b, gamma, beta = (cp.asarray(rng.standard_normal(D).astype(acc)) for _ in range(3))
        fb = f.copy()
        fb += b  # (as Linear.step adds its bias: in f's dtype)
        want = ck.layer_norm_forward(x + fb, gamma, beta, 1e-5)[0]
        got = ck.bias_residual_layer_norm(f, b, x, gamma, beta, 1e-5)
        assert got.dtype == dtype and got.shape == (7, D)
        got, want = backend.to_numpy(got), backend.to_numpy(want)
        if REAL_GPU:
            assert_close(got.astype(np.float64), want.astype(np.float64),
                         RTOL.get(dtype, 1e-3), ATOL.get(dtype, 1e-3), "normalised rows")
        else:
            np.testing.assert_array_equal(got, want)

    @pytest.mark.parametrize("dtype", FLOATS + [np.float16])
    def test_bias_relu_is_the_two_calls_it_replaces(self, cp, dtype):
        """h += b (the bias in the accumulation dtype), then maximum(h, 0, out=h): the same
        numbers, bit for bit, NaN kept; awkward F."""
        rng = _rng()
        acc = np.float32 if dtype == np.float16 else dtype
        h = rng.standard_normal((9, 77)).astype(dtype)
        h[3, 5] = np.nan
        b = rng.standard_normal(77).astype(acc)
        want = cp.asarray(h)
        want += cp.asarray(b)
        cp.maximum(want, 0, out=want)
        got = cp.asarray(h)
        assert ck.bias_relu_(got, cp.asarray(b)) is got
        np.testing.assert_array_equal(backend.to_numpy(got), backend.to_numpy(want))
        assert np.isnan(backend.to_numpy(got)[3, 5])

    # a decoding step's attention
    @staticmethod
    def decode_reference(q, keys, values, n, group=1, bias=None):
        """attention.py's formulas in float64 on the host: q (R, H, K), keys/values
        (N, H, L, K), bias (N, S) or None -> (R, H*K)."""
        R, H, K = q.shape
        i = np.arange(R) // group
        k, v = keys[i, :, :n].astype(np.float64), values[i, :, :n].astype(np.float64)
        s = np.einsum("rhc,rhjc->rhj", q.astype(np.float64) / np.sqrt(K), k)
        if bias is not None:
            s = s + bias[i, None, :n]
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.exp(s - m)
        z = e.sum(axis=-1, keepdims=True)
        p = e / np.where(z == 0, 1.0, z)
        return np.einsum("rhj,rhjc->rhc", p, v).reshape(R, H * K)

    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("K, n, L", [(32, 1, 64), (24, 37, 40), (64, 300, 300)])
    def test_decode_attention_cross(self, cp, dtype, K, n, L, assert_close):
        """Encoder-decoder attention: 3 beams a sentence share its keys and values; one
        sentence's source is padding from key 5 on, another's fully masked (its rows: 0);
        more keys than threads (300)."""
        rng = _rng()
        N, H, g = 4, 3, 3
        q = rng.standard_normal((N * g, H, K)).astype(dtype)
        keys, values = (rng.standard_normal((N, H, L, K)).astype(dtype) for _ in range(2))
        bias = np.zeros((N, 1, 1, L), dtype)
        bias[1, ..., 5:] = -np.inf
        bias[2] = -np.inf
        want = self.decode_reference(q, keys, values, n, g, bias[:, 0, 0])
        out = ck.decode_attention(cp.asarray(q), cp.asarray(keys), cp.asarray(values), n,
                                  group=g, bias=cp.asarray(bias))
        assert out.shape == (N * g, H * K) and out.dtype == dtype
        out = backend.to_numpy(out)
        assert (out[2 * g:3 * g] == 0).all()  # fully masked: zeros, no NaN
        assert_close(out, want, RTOL[dtype] * 10, ATOL[dtype] * 10, "attention output")

    @pytest.mark.parametrize("dtype", FLOATS + [np.float16])
    @pytest.mark.parametrize("K, n", [(32, 1), (16, 45)])
    @pytest.mark.parametrize("biased", [False, True])
    def test_decode_attention_self_writes_the_new_key_and_value(self, cp, dtype, K, n,
                                                                biased, assert_close):
        """Self-attention: the query, key and value heads are views of one fused q/k/v
        product (R, 3H, 1, K), with its biases added already or (``biased``) by the kernel
        (then in the accumulation dtype, each sum rounded to the heads' dtype); the kernel
        writes this step's key and value at position n - 1 of the cache's buffers (which
        have more rows and room than used) and attends over positions 0 .. n-1, the new
        one included."""
        rng = _rng()
        R, H, cap = 5, 2, 64
        acc = np.float32 if dtype == np.float16 else dtype
        heads = rng.standard_normal((R, 3 * H, 1, K)).astype(dtype)
        k_buf, v_buf = (rng.standard_normal((R + 2, H, cap, K)).astype(dtype)
                        for _ in range(2))
        b = rng.standard_normal(3 * H * K).astype(acc)
        added = (heads + b.reshape(1, 3 * H, 1, K)).astype(dtype) if biased else heads
        want_k, want_v = k_buf.copy(), v_buf.copy()
        want_k[:R, :, n - 1] = added[:, H:2 * H, 0]
        want_v[:R, :, n - 1] = added[:, 2 * H:, 0]
        want = self.decode_reference(added[:, :H, 0], want_k, want_v, n)
        hc, kc, vc, bc = (cp.asarray(a) for a in (heads, k_buf, v_buf, b))
        D = H * K
        biases = dict(q_bias=bc[:D], k_bias=bc[D:2 * D], v_bias=bc[2 * D:]) if biased else {}
        out = ck.decode_attention(hc[:, :H], kc, vc, n, k_new=hc[:, H:2 * H],
                                  v_new=hc[:, 2 * H:], **biases)
        np.testing.assert_array_equal(backend.to_numpy(kc), want_k)  # only position n - 1
        np.testing.assert_array_equal(backend.to_numpy(vc), want_v)  # of rows < R changed
        assert_close(backend.to_numpy(out).astype(np.float64), want,
                     RTOL.get(dtype, 2e-3) * 10, ATOL.get(dtype, 2e-3) * 10, "attention output")

    def test_decode_attention_float16(self, cp, assert_close):
        rng = _rng()
        q = rng.standard_normal((6, 4, 32)).astype(np.float16)
        keys, values = (rng.standard_normal((2, 4, 20, 32)).astype(np.float16)
                        for _ in range(2))
        bias = np.zeros((2, 1, 1, 20), np.float32)
        bias[1, ..., 7:] = -np.inf
        out16 = ck.decode_attention(cp.asarray(q), cp.asarray(keys), cp.asarray(values), 20,
                                    group=3, bias=cp.asarray(bias))
        assert out16.dtype == np.float16
        want = self.decode_reference(q, keys, values, 20, 3, bias[:, 0, 0])
        assert_close(backend.to_numpy(out16).astype(np.float64), want, 1e-2, 1e-2,
                     "float16 attention output")

    @pytest.mark.parametrize("dtype", FLOATS)
    def test_decode_attention_matches_the_primitives(self, cp, dtype, monkeypatch,
                                                     assert_close):
        """The numbers of the route it replaces on the same device (fused kernels off: the
        query's bias, attention_probabilities, the product with v, merge_heads), a
        cross-attention with beams and a masked tail."""
        from minitransformer.engine.attention import attention_probabilities
        from minitransformer.settings import SETTINGS
        rng = _rng()
        N, g, H, K, S = 3, 4, 4, 32, 29
        q = rng.standard_normal((N * g, H, K)).astype(dtype)
        keys, values = (rng.standard_normal((N, H, S, K)).astype(dtype) for _ in range(2))
        acc = np.float64 if dtype == np.float64 else np.float32
        bias = np.zeros((N, 1, 1, S), acc)
        bias[0, ..., 11:] = -np.inf
        kc, vc, bc = cp.asarray(keys), cp.asarray(values), cp.asarray(bias)
        q_bias = cp.asarray(rng.standard_normal(H * K).astype(acc))
        monkeypatch.setattr(SETTINGS, "fused", False)
        qd = cp.asarray(q).reshape(N * g, H * K)
        qd += q_bias  # (as Linear.step adds the query projection's bias)
        qb = cp.ascontiguousarray(qd.reshape(N, g, H, K).transpose(0, 2, 1, 3))
        want = (attention_probabilities(qb, kc, bc) @ vc).transpose(0, 2, 1, 3)
        want = backend.to_numpy(want.reshape(N * g, H * K))
        monkeypatch.setattr(SETTINGS, "fused", True)
        got = ck.decode_attention(cp.asarray(q), kc, vc, S, group=g, bias=bc, q_bias=q_bias)
        assert_close(backend.to_numpy(got), want, RTOL[dtype] * 10, ATOL[dtype] * 10,
                     "attention output")

    def test_decode_attention_refuses_what_it_cannot_take(self, cp):
        q = cp.zeros((2, 2, 8), dtype=np.float32)
        kv = cp.zeros((2, 2, 10, 8), dtype=np.float32)
        for kwargs, match in (({"n": 11}, "n=11 keys of 10"), ({"n": 0}, "n=0"),
                              ({"n": 5, "group": 1, "bias": cp.zeros((2, 1, 1, 4))},
                               "bias must be"),
                              ({"n": 5, "k_new": q}, "k_new and v_new come together"),
                              ({"n": 5, "k_new": q, "v_new": q,
                                "q_bias": cp.zeros(16, dtype=np.float32)},
                               "q_bias comes with k_bias and v_bias"),
                              ({"n": 5, "q_bias": cp.zeros(8, dtype=np.float32)},
                               "a projection bias must be \\(16,\\)")):
            n = kwargs.pop("n")
            with pytest.raises(ValueError, match=match):
                ck.decode_attention(q, kv, kv, n, **kwargs)
        with pytest.raises(ValueError, match="need 3 sentences, keys hold 2"):
            ck.decode_attention(cp.zeros((5, 2, 8), dtype=np.float32), kv, kv, 5, group=2)

    # Adam
    @pytest.mark.parametrize("dtype", FLOATS)
    @pytest.mark.parametrize("weight_decay", [0.0, 0.01])
    def test_adam_update(self, cp, dtype, weight_decay, assert_close):
        rng = _rng()
        p0 = rng.standard_normal((7, 77)).astype(dtype)
        grads = [rng.standard_normal((7, 77)).astype(dtype) for _ in range(3)]
        param = Tensor(p0.copy(), requires_grad=True)
        opt = Adam([param], lr=1e-2, betas=(0.9, 0.98), eps=1e-9, weight_decay=weight_decay)
        pc, m, v = cp.array(p0), cp.zeros(p0.shape, dtype), cp.zeros(p0.shape, dtype)
        for step, g in enumerate(grads, start=1):
            param.grad = g
            opt.step()
            c1, c2 = 1.0 - 0.9 ** step, 1.0 - 0.98 ** step
            out = ck.adam_update_(pc, cp.asarray(g), m, v, 1e-2, 0.9, 0.98, 1e-9, c1, c2,
                                  weight_decay)
            assert out is pc
            assert_close(m, opt.m[0], RTOL[dtype], ATOL[dtype], f"m, step {step}")
            assert_close(v, opt.v[0], RTOL[dtype], ATOL[dtype], f"v, step {step}")
            assert_close(pc, param.data, RTOL[dtype] * 10, ATOL[dtype], f"param, step {step}")
