"""The profiler (engine/profiler.py): its FLOP counts against the benchmark's method, its
times against the wall clock, its tables, and that it changes nothing when on or off."""
import dataclasses
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from minitransformer import engine
from minitransformer.engine import profiler, tensor
from minitransformer.engine.profiler import Profiler, measure_peak_gflops, profile
from minitransformer.mt.step import train_step
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402  (bench/common.py: the benchmark's FLOP count)

CFG = TransformerConfig(vocab_size=40, d_model=16, n_heads=2, d_ff=32, n_layers=1)
PEAK = 100.0  # GFLOP/s: given, so that the tables need no GEMM measurement


def tiny_model():
    return Transformer(CFG, seed=0)


def batch():
    """One padded batch of the benchmark's kind: src (B, S), tgt_in and tgt_out (B, T)."""
    return common.training_batches(1, CFG.vocab_size, 200, seed=0)[0]


def shapes(b):
    return b["src"].shape[0], b["src"].shape[1], b["tgt_in"].shape[1]


def forward_backward(model, b):
    loss, _ = model.loss(b["src"], b["tgt_in"], b["tgt_out"])
    loss.backward()


# ---- FLOPs ----------------------------------------------------------------------------------
def test_matrix_product_flops_of_a_training_step_equal_the_benchmarks_count():
    model, b = tiny_model(), batch()
    with profile(model, peak_gflops=PEAK) as prof:
        forward_backward(model, b)
    B, S, T = shapes(b)
    assert prof.total_flops(products_only=True) == \
        common.train_flops(dataclasses.asdict(CFG), B, S, T)
    assert prof.total_flops() > prof.total_flops(products_only=True)  # + softmax, norms, ...


def test_forward_only_counts_a_third_of_the_step():
    """Under no_grad the fused loss computes no gradient products: forward = step / 3."""
    model, b = tiny_model(), batch()
    with engine.no_grad(), profile(model, peak_gflops=PEAK) as prof:
        model.loss(b["src"], b["tgt_in"], b["tgt_out"])
    B, S, T = shapes(b)
    assert 3 * prof.total_flops(products_only=True) == \
        common.train_flops(dataclasses.asdict(CFG), B, S, T)


def test_layernorm_and_attention_rows_follow_the_documented_formulas():
    model, b = tiny_model(), batch()
    with profile(model, peak_gflops=PEAK) as prof:
        forward_backward(model, b)
    B, S, T = shapes(b)
    D, H, K = CFG.d_model, CFG.n_heads, CFG.d_model // CFG.n_heads
    rows = dict(prof.rows("op"))
    # LayerNorm: 7 n forward + 11 n backward; 2 in the encoder layer, 3 in the decoder's
    assert rows["LayerNorm"].flops == (7 + 11) * D * (2 * B * S + 3 * B * T)
    assert rows["LayerNorm"].calls == 5 and rows["LayerNorm"].product_flops == 0
    # attention (no dropout on it here): 4 B H T S K (+ 5 per score) forward, 2x + 5 backward
    scores = B * H * (S * S + T * T + T * S)  # encoder self, decoder self, cross
    attention = rows["ScaledDotProductAttention"]
    assert attention.product_flops == 12 * scores * K
    assert attention.flops == 12 * scores * K + 10 * scores


def test_a_batched_matmul_counts_2_m_n_k_per_entry_and_twice_that_backward():
    a = engine.Tensor(np.ones((2, 3, 4), np.float32), requires_grad=True)
    w = engine.Tensor(np.ones((2, 4, 5), np.float32), requires_grad=True)
    with profile(peak_gflops=PEAK) as prof:
        engine.matmul(a, w).sum().backward()
    mm = dict(prof.rows("op"))["MatMul"]
    assert mm.product_flops == 3 * (2 * 2 * 3 * 4 * 5)
    assert mm.bytes == 4 * (24 + 40 + 30) + 4 * (30 + 24 + 40)  # in + out; dy + da, dw


def test_every_function_of_the_engine_is_in_the_flop_table():
    zero = {"Reshape", "Transpose", "Index", "SplitHeads", "MergeHeads", "Cast"}  # moves
    counted = set(profiler._RULES) | set(profiler._PER_ELEMENT) | \
        set(profiler._PER_INPUT_ELEMENT)
    for fn in engine.FUNCTIONS:
        assert fn in counted or fn.__name__ in zero, fn.__name__
        assert fn.__name__ in profiler.__doc__, f"{fn.__name__} missing from the docstring"


# ---- time -----------------------------------------------------------------------------------
def test_op_times_add_up_within_the_wall_time_of_the_step():
    model, b = tiny_model(), batch()
    optim = Adam(model.parameters(), lr=1e-3)
    train_step(model, optim, [b], 1e-3)  # warm
    t0 = time.perf_counter()
    with profile(model, peak_gflops=PEAK) as prof:
        train_step(model, optim, [b], 1e-3)
    wall = time.perf_counter() - t0
    assert 0 < prof.total_seconds() <= prof.wall_seconds <= wall
    rows = prof.rows("op")
    assert sum(s.seconds for _, s in rows) == pytest.approx(prof.total_seconds())
    assert all(s.forward_s > 0 for _, s in rows)
    assert dict(rows)["Linear"].backward_s > 0


def test_measured_peak_is_positive_and_cached():
    first = measure_peak_gflops(np, np.float32, n=64)
    assert first > 0 and measure_peak_gflops(np, np.float32, n=64) == first


def test_the_peak_is_the_best_of_products_timed_for_long_enough(monkeypatch):
    # a moment of other work must not make the denominator low: the products go on until
    # they took min_seconds (then the best counts), not just ``repeats`` of them
    from minitransformer.engine import profiler
    monkeypatch.setattr(profiler, "_peaks", {})
    times = iter([0.0, 1.0] + [2.0, 2.5] * 5 + [3.0, 3.01] + [4.0, 4.5] * 200)
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: next(times))
    rate = measure_peak_gflops(np, np.float32, n=8, repeats=5, min_seconds=3.0)
    assert rate == pytest.approx(2 * 8 ** 3 / 0.01 / 1e9)  # the quick 7th product counts


def test_a_row_above_the_measured_peak_is_explained_in_the_caption():
    model, b = tiny_model(), batch()
    with profile(model, peak_gflops=1e-6) as prof:  # any real rate is above this
        forward_backward(model, b)
    assert "an MFU above 100%" in prof.table(by="op")
    with profile(model, peak_gflops=1e9) as prof:
        forward_backward(model, b)
    assert "an MFU above 100%" not in prof.table(by="op")


# ---- tables ---------------------------------------------------------------------------------
def test_tables_group_by_op_and_by_module_path():
    model, b = tiny_model(), batch()
    with profile(model, peak_gflops=PEAK) as prof:
        forward_backward(model, b)
    by_op = prof.table(by="op")
    for name in ("Linear", "ScaledDotProductAttention", "LinearCrossEntropy", "LayerNorm",
                 "MFU", "GFLOP/s", "total"):
        assert name in by_op
    modules = dict(prof.rows("module"))
    for path in ("encoder.0.ff", "encoder.0.ff.w1", "decoder.0.cross_attn.wq",
                 "decoder.0.sub3.norm", "(no module)"):
        assert path in modules and path in prof.table(by="module")
    assert set(dict(prof.rows("module", depth=2))) == {"encoder.0", "decoder.0", "emb_drop",
                                                       "(no module)"}
    everything = sum(s.calls for s in modules.values())
    assert everything == sum(s.calls for _, s in prof.rows("op"))
    short = prof.table(by="op", top=3).splitlines()
    assert short[-2].lstrip().startswith("(") and "more)" in short[-2]  # the rest, summed
    assert short[-1].split()[:2] == ["total", str(everything)]
    with pytest.raises(ValueError, match="by must be"):
        prof.rows("layer")


def test_a_profiled_search_still_names_the_modules():
    # outside the profiler, inference keeps no stack of running modules (Module.__call__);
    # a profiled search (no_grad) must still see which module applies each op
    from minitransformer.mt.search import greedy_search
    model, b = tiny_model(), batch()
    with profile(model, peak_gflops=PEAK) as prof:
        greedy_search(model, b["src"], max_len_a=2)
    modules = dict(prof.rows("module"))
    for path in ("encoder.0.ff.w1", "decoder.0.cross_attn.wq", "decoder.0.sub3.norm"):
        assert path in modules


def test_without_a_root_modules_are_named_by_class():
    model, b = tiny_model(), batch()
    with profile(peak_gflops=PEAK) as prof:
        forward_backward(model, b)
    names = set(dict(prof.rows("module")))
    assert {"FeedForward", "MultiHeadAttention", "Linear", "LayerNorm"} <= names


# ---- it changes nothing -------------------------------------------------------------------
def _one_step(profiled):
    model, b = tiny_model(), batch()
    optim = Adam(model.parameters(), lr=1e-3)
    if profiled:
        with profile(model, peak_gflops=PEAK):
            result = train_step(model, optim, [b], 1e-3)
    else:
        result = train_step(model, optim, [b], 1e-3)
    return result, model.state_dict()


def test_a_profiled_step_is_bit_identical_to_an_unprofiled_one():
    (plain, params), (profiled, params_p) = _one_step(False), _one_step(True)
    assert plain == profiled  # the loss, with dropout on (CFG's 0.1)
    assert params.keys() == params_p.keys()
    for k in params:
        assert params[k].tobytes() == params_p[k].tobytes(), k


def test_no_hook_is_left_behind_nested_unused_or_failed():
    model, b = tiny_model(), batch()
    Profiler(model)  # never entered
    assert tensor._profiler is None
    outer = Profiler(model, peak_gflops=PEAK)
    with outer:
        with profile(model, peak_gflops=PEAK) as inner:
            assert tensor._profiler is inner
            forward_backward(model, b)
        assert tensor._profiler is outer
        with pytest.raises(RuntimeError, match="already active"):
            outer.__enter__()
    assert tensor._profiler is None
    assert outer.total_flops() == inner.total_flops() > 0  # the inner's ops count in both
    with pytest.raises(ZeroDivisionError):
        with outer:
            raise ZeroDivisionError
    assert tensor._profiler is None
    with outer:  # entered again: adds up
        forward_backward(model, b)
    assert outer.total_flops() == 2 * inner.total_flops()


# ---- train.py --profile ---------------------------------------------------------------------
SMALL = ["--synthetic-pairs", "600", "--d-model", "16", "--n-heads", "2", "--d-ff", "32",
         "--n-layers", "1", "--max-tokens", "400", "--vocab-size", "100", "--no-progress",
         "--log-every", "2", "--warmup", "20", "--valid-bleu-sentences", "5", "--test-split",
         ""]


def train(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *SMALL, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)


def digest(directory):
    return {name: hashlib.sha256(open(os.path.join(directory, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(directory))
            if os.path.isfile(os.path.join(directory, name)) and name != "train.lock"}


def test_train_py_profile_prints_the_tables_and_saves_nothing(tmp_path):
    run = str(tmp_path / "run")
    proc = train("--run-dir", run, "--profile", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "profile of 2 updates after 5 warm-up updates" in out
    for text in ("LinearCrossEntropy", "encoder.0.self_attn", "MFU", "total"):
        assert text in out
    assert not any(name.startswith("checkpoint") for name in os.listdir(run))
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))
    assert "profile" not in open(os.path.join(run, "config.json")).read()


def test_train_py_profile_of_a_resumed_run_leaves_its_files_as_they_were(tmp_path):
    run = str(tmp_path / "run")
    assert train("--run-dir", run, "--max-updates", "2").returncode == 0
    before = digest(run)
    proc = train("--run-dir", run, "--resume", "--profile", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "by module" in proc.stdout and digest(run) == before
