"""The command-line tools with ``--device cuda``, end to end, against the NumPy path.

Marked ``gpu``: on a real GPU, or else on the CUDA-on-CPU stand-in (tests/cuda_on_cpu), where
the same Python code runs with CuPy's rules and the CUDA kernels compiled for this CPU. The
stand-in's products are exact float32 (no TF32) and its dropout draws come from another
generator than cuRAND, so runs are compared with dropout off, to float32 tolerances (the
kernels sum in another order than NumPy).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import train as train_cli
from minitransformer.mt import translate as translate_cli

from conftest import REAL_GPU, small_corpus
from test_cli import ROOT, SMALL

pytestmark = pytest.mark.gpu
# small batches: on the CPU harness every CUDA thread is a fiber, a kernel costs ~50 ns per
# thread and barrier, and these runs are about the code path, not the model
UPDATES = ["--dropout", "0", "--max-updates", "8", "--valid-every", "8", "--log-every", "1",
           "--max-tokens", "300", "--valid-bleu-sentences", "8"]


def _train(run, *flags):
    small_corpus(run)
    assert train_cli.main(SMALL + UPDATES + ["--run-dir", str(run), *flags]) == 0
    params, opt, meta = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))
    losses = [r["loss"] for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
              if "loss" in r]
    return params, opt, meta, losses


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The reference: the same 8 updates on the NumPy path (float32, per-parameter Adam)."""
    run = tmp_path_factory.mktemp("cpu") / "run"
    return run, _train(run, "--device", "cpu")


def _initial(meta):
    """The parameters train.py starts from (seed 1, its default)."""
    from minitransformer.nn.transformer import Transformer, TransformerConfig
    model = Transformer(TransformerConfig.from_dict(meta["config"]), seed=1)
    return {k: v.copy() for k, v in model.state_dict().items()}


def _relative_distance(a, b):
    num = np.sqrt(sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a))
    return num / np.sqrt(sum(np.sum(b[k].astype(np.float64) ** 2) for k in b))


def test_train_py_device_cuda_float32_matches_the_numpy_path(tmp_path, cpu_run):
    """Fused kernels, flat-buffer Adam (one kernel), the loss kept on the device: after 8
    updates the parameters and Adam's moments equal the NumPy run's to float32 rounding."""
    _, (p_cpu, o_cpu, _, l_cpu) = cpu_run
    p, o, meta, losses = _train(tmp_path / "gpu", "--device", "cuda")
    assert meta["update"] == 8
    assert p.keys() == p_cpu.keys()
    assert all(a.dtype == np.float32 for a in p.values())
    np.testing.assert_allclose(losses, l_cpu, rtol=1e-4 if not REAL_GPU else 5e-3)
    tol = 1e-5 if not REAL_GPU else 5e-3  # TF32 products on a real GPU
    # The key projection's bias adds q . b_k to every score of a query, which softmax
    # ignores: its exact gradient is 0, so both runs hold rounding noise there, and Adam
    # (g / sqrt(v)) turns noise of either sign into a whole step. Compare it apart.
    zero_grad = [k for k in p if k.endswith(".wk.bias")]
    assert len(zero_grad) == 6

    def part(d, prefix=""):
        return {k: v for k, v in d.items()
                if k.startswith(prefix) and k[len(prefix):] not in zero_grad}
    assert _relative_distance(part(p), part(p_cpu)) < tol
    assert _relative_distance(part(o, "m."), part(o_cpu, "m.")) < 100 * tol
    for k in zero_grad:  # at most one step of the peak learning rate per update
        assert np.abs(p[k] - p_cpu[k]).max() < 2 * 8 * 4e-3


def test_train_py_device_cuda_float16_learns_and_stays_near_float32(tmp_path, cpu_run):
    """--precision float16: float16 activations and kernels, float32 master weights in flat
    Adam, dynamic loss scaling; 8 updates land near the float32 NumPy run."""
    _, (p_cpu, _, _, l_cpu) = cpu_run
    p, _, meta, losses = _train(tmp_path / "half", "--device", "cuda", "--precision", "float16")
    assert meta["update"] == 8 and meta["loss_scale"]["scale"] > 0
    assert all(a.dtype == np.float32 and np.isfinite(a).all() for a in p.values())
    np.testing.assert_allclose(losses, l_cpu, rtol=2e-2)
    # what the 8 updates changed, float16 against float32: Adam divides each gradient by
    # its own size, so float16's rounding of small gradients moves a few coordinates by a
    # whole step; the update as a whole agrees
    p0 = _initial(meta)
    d16 = {k: p[k] - p0[k] for k in p0}
    d32 = {k: p_cpu[k] - p0[k] for k in p0}
    assert _relative_distance(d16, d32) < 0.1


def _translate_py_cuda(*flags):
    """translate.py --device cuda in a process of its own, as a user runs it (through
    tests/cuda_on_cpu/run.py on the stand-in) -> its output lines. On a real GPU that process
    multiplies in full float32 (translate.py's default; this test process imported CuPy with
    TF32 on, which reorders near-tied beam hypotheses: 9 of these 40 beam-4 lines on an H200)."""
    env = {k: v for k, v in os.environ.items() if k != "CUPY_TF32"}
    launcher = [] if REAL_GPU else [os.path.join(ROOT, "tests", "cuda_on_cpu", "run.py")]
    proc = subprocess.run([sys.executable, *launcher, os.path.join(ROOT, "translate.py"), *flags,
                           "--device", "cuda"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_translate_py_device_cuda_gives_the_cpu_translations(cpu_run, capsys):
    """Greedy and beam search on the device: the same output lines as on the CPU."""
    run, _ = cpu_run
    src = os.path.join(run, "data", "valid.src")  # 40 sentences (small_corpus)
    for beam in ("1", "4"):
        flags = ["--run-dir", str(run), "--input", src, "--beam", beam]
        assert translate_cli.main(flags + ["--device", "cpu"]) == 0
        cpu = capsys.readouterr().out.splitlines()
        assert len(cpu) == 40 and cpu == _translate_py_cuda(*flags), f"beam {beam}"


def test_translate_py_ensemble_on_the_device_gives_the_cpu_translations(cpu_run, tmp_path,
                                                                       capsys):
    """--ensemble on the device: two models' mean log-probabilities, beam 4, the same output
    lines as on the CPU."""
    run, _ = cpu_run
    other = tmp_path / "seed2"
    _train(other, "--device", "cpu", "--seed", "2")
    capsys.readouterr()
    src = os.path.join(run, "data", "valid.src")
    flags = ["--run-dir", str(run), "--ensemble", str(other), "--input", src, "--beam", "4"]
    assert translate_cli.main(flags + ["--device", "cpu"]) == 0
    cpu = capsys.readouterr().out.splitlines()
    assert translate_cli.main(["--run-dir", str(run), "--input", src, "--beam", "4",
                               "--device", "cpu"]) == 0
    assert cpu != capsys.readouterr().out.splitlines()  # (the second model counts)
    assert len(cpu) == 40 and cpu == _translate_py_cuda(*flags)


@pytest.mark.skipif(REAL_GPU, reason="the stand-in's run; on a GPU run bench.py itself")
@pytest.mark.parametrize("precision", ["float32", "float16"])
def test_bench_device_cuda_runs_through_on_the_stand_in(tmp_path, precision):
    """bench.py --device cuda --no-torch: its timings mean nothing here, its code path is the
    GPU one (training step, decoding, memory pool, the CuPy GEMM rate)."""
    results = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "cuda_on_cpu", "run.py"),
           os.path.join(ROOT, "bench", "bench.py"), "--device", "cuda", "--no-torch",
           "--precision", precision, "--steps", "2", "--warmup", "1", "--max-tokens", "200",
           "--gemm-size", "256",
           "--decode-sentences", "4",
           "--decode-reps", "1", "--profile", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cuda" in proc.stdout and results.exists()
    # the report names the GPU it ran on (the stand-in's name) in the machine's block
    assert "* GPU: CUDA-on-CPU stand-in; CuPy " in results.read_text()


@pytest.mark.skipif(REAL_GPU, reason="sets the stand-in's device memory")
def test_max_tokens_auto_on_the_device_fits_the_memory_budget(tmp_path, capsys, monkeypatch):
    """--device cuda --max-tokens auto --memory 30M: memfit measures the step's peak in CuPy's
    pool (a MemoryHook) on the longest pairs. On a device of exactly 30 MiB the chosen
    number then trains, as the run that chose it did, and a larger batch runs out of memory
    with the message that names it and what to pass."""
    import re

    from cuda_on_cpu import fake_cupy
    short = ["--max-updates", "3", "--valid-every", "3"]  # (after UPDATES: these win)
    auto = tmp_path / "auto"
    small_corpus(auto)
    assert train_cli.main(SMALL + UPDATES + short + ["--run-dir", str(auto), "--device", "cuda",
                                                     "--max-tokens", "auto",
                                                     "--memory", "30M"]) == 0
    err = "".join(capsys.readouterr())
    m = re.search(r"--max-tokens auto: (\d+) \(memory budget 30 MiB; .*measured at .*\)", err)
    assert m, err
    chosen = int(m.group(1))
    assert 600 < chosen < 65536  # (more than the CPU runs' 600; not the largest allowed)
    saved = json.loads((auto / "config.json").read_text())["train"]
    assert saved["max_tokens"] == chosen and saved["memory"] == "30M"

    monkeypatch.setattr(fake_cupy._memory, "total", 30 << 20)  # a device of 30 MiB
    given = tmp_path / "given"
    small_corpus(given)
    assert train_cli.main(SMALL + UPDATES + short + ["--run-dir", str(given), "--device",
                                                     "cuda", "--max-tokens", str(chosen)]) == 0
    a, b = (ckpt.load_checkpoint(str(d / "checkpoint_last.npz"))[0] for d in (auto, given))
    assert all(np.array_equal(a[k], b[k]) for k in a)  # the measuring left no trace
    capsys.readouterr()
    big = tmp_path / "big"
    small_corpus(big)
    assert train_cli.main(SMALL + UPDATES + short + ["--run-dir", str(big), "--device", "cuda",
                                                     "--max-tokens", str(3 * chosen)]) == 1
    err = "".join(capsys.readouterr())
    m = re.search(r"out of memory at update \d+, on a batch of \d+ pairs padded to \d+ source "
                  rf"and \d+ target tokens \(\d+ of --max-tokens {3 * chosen}\): pass "
                  r"--max-tokens (\d+)", err)
    assert m, err
    assert int(m.group(1)) < 3 * chosen and "are intact" in err
