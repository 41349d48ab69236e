"""The benchmark harness (bench/): how it splits a batch over ranks, and a short run of it.

Timings are never asserted here (bench/RESULTS.md holds them); these tests check that the
harness still runs and measures the model it claims to.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench  # noqa: E402  (bench/bench.py)
import common  # noqa: E402  (bench/common.py)


def _rows(a, pad_id=0):
    return [tuple(int(x) for x in row if x != pad_id) for row in a]


@pytest.mark.parametrize("size", [1, 2, 3])
def test_shard_rows_covers_the_batch_once_balanced_and_trimmed(size):
    for batch in common.training_batches(4, 8000, 2000, seed=3):
        shards = [common.shard_rows(batch, r, size) for r in range(size)]
        if batch["src"].shape[0] < size:  # fewer rows than ranks: some ranks get none
            assert sum(s is None for s in shards) == size - batch["src"].shape[0]
            shards = [s for s in shards if s is not None]
        else:
            assert all(s is not None for s in shards)
        for key in ("src", "tgt_in", "tgt_out"):
            got = sorted(row for s in shards for row in _rows(s[key]))
            assert got == sorted(_rows(batch[key])), key  # every row exactly once
            for s in shards:  # padding cut to the shard's own longest row
                assert (s[key][:, -1] != 0).any() and s[key].flags.c_contiguous
        for s in shards:  # a row's source, input and output stay together
            assert s["tgt_in"].shape == s["tgt_out"].shape
            assert s["src"].shape[0] == s["tgt_in"].shape[0]
            words = s["tgt_in"][:, 1:] != 0  # tgt_in = BOS + y, tgt_out = y + EOS
            assert np.array_equal(s["tgt_in"][:, 1:][words], s["tgt_out"][:, :-1][words])
        tokens = [int((s["tgt_out"] != 0).sum()) for s in shards]
        assert sum(tokens) == int((batch["tgt_out"] != 0).sum())
        longest = int((batch["tgt_out"] != 0).sum(axis=1).max())
        assert max(tokens) - min(tokens) <= longest  # greedy balance: within one row


@pytest.mark.skipif(bench.find_mpiexec() is None,
                    reason="needs mpi4py and mpiexec: pip install -e .[mpi]")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binds 2 ranks to 2 cores")
def test_bench_runs_one_process_and_two_ranks(tmp_path):
    """bench.py --ranks 2 (without torch): both set-ups train the same model on the same
    batches and decode the same sentences to the same outputs, and the report gets a row
    for each."""
    report = tmp_path / "RESULTS.md"
    env = dict(os.environ, OMPI_MCA_mpi_yield_when_idle="1")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--config", "tiny",
           "--no-torch", "--no-ctranslate2", "--ranks", "2", "--steps", "2", "--warmup", "1",
           "--decode-sentences", "3", "--decode-reps", "1", "--profile", "--threads", "1",
           "--results", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "results" / "run-tiny-cpu-t1.json").read_text())
    assert set(res["train"]) == {"ours", "ours_ranks"} and res["settings"]["ranks"] == 2
    assert set(res["decode"]) == {"ours", "ours_ranks"}
    for kind in ("greedy", "beam"):  # ranks of 2 and 1 sentences, gathered back in place
        agree = res["decode_agreement_ranks"]["ours_ranks"][kind]
        assert agree["identical"] == agree["of"] == 3, agree
        assert res["decode"]["ours_ranks"][kind]["out_tokens"] == \
            res["decode"]["ours"][kind]["out_tokens"]
    one, two = res["train_steps"]["ours"], res["train_steps"]["ours_ranks"]
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):  # same batches; loss of the same model (dropout differs)
        assert a["tokens"] == b["tokens"] and (a["B"], a["S"], a["T"]) == (b["B"], b["S"], b["T"])
        assert abs(a["loss_per_token"] - b["loss_per_token"]) < 0.1
    assert len(res["memory"]["ours_ranks"]["per_rank_mib"]) == 2
    text = report.read_text()
    assert "2 ranks x 1 thread" in text and "ranks summed" in text
    assert "greedy decoding, sentences/s (median; rank r translates sentences r, r + 2" in text


def test_bench_decodes_with_ctranslate2_where_it_is_installed(tmp_path):
    """Where ctranslate2 is installed, decoding gets it as a third engine on the same
    initial weights; its greedy outputs are ours (float32, exported exactly)."""
    pytest.importorskip("ctranslate2")
    report = tmp_path / "RESULTS.md"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench.py"), "--config", "tiny",
           "--no-torch", "--steps", "1", "--warmup", "1", "--decode-sentences", "16",
           "--decode-reps", "1", "--profile", "--threads", "1", "--results", str(report)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads((tmp_path / "results" / "run-tiny-cpu-t1.json").read_text())
    assert set(res["decode"]) == {"ours", "ctranslate2"}
    greedy = res["decode_agreement_ctranslate2"]["greedy"]
    assert greedy["identical"] == greedy["of"] == 16, greedy
    assert "CTranslate2 float32" in report.read_text()


def test_bench_float16_without_a_gpu_says_what_it_needs(tmp_path):
    with pytest.raises(SystemExit, match="--precision float16 needs --device cuda"):
        bench.main(["--precision", "float16", "--no-torch", "--results",
                    str(tmp_path / "RESULTS.md")])
    assert not (tmp_path / "RESULTS.md").exists()


def test_all_adds_the_papers_base_model_on_a_gpu_only():
    assert bench.selected_configs(bench.parse_args(["--all"])) == ["tiny", "base-lite"]
    assert bench.selected_configs(bench.parse_args(["--all", "--device", "cuda"])) == \
        ["tiny", "base-lite", "base"]
    assert common.model_config("base")["vocab_size"] == 37000
    assert bench.selected_configs(bench.parse_args([])) == ["tiny"]


def _run(config, device, cpu, date):
    """A run's record as report.machine reads it: the machine's fields and the run's own."""
    machine = dict(cpu=cpu, usable_cpus=2, logical_cpus=2, simd=["avx2"], mem_gib=24.0,
                   python="3.11.7", platform="Linux", numpy="2.4.6", loadavg=[0.1, 0.1, 0.1],
                   blas=dict(config="OpenBLAS", corename="SkylakeX", threads=2,
                             OPENBLAS_CORETYPE="SkylakeX"))
    return dict(config=config, device=device, date=date, machine=machine, loadavg_end=None,
                settings=dict(threads=2), setup={"ours": {}},
                peak=dict(how="numpy float32 matmul", gflops=400.0), gemm={})


def test_report_describes_each_machine_its_runs_were_measured_on():
    """Rows measured on two machines (the CPU rows on one, a GPU's on another): the report's
    machine section has a block for each, naming its runs, not only the last run's CPU."""
    import report
    runs = [_run("tiny", "cpu", "AMD EPYC", "2026-11-26 20:05 UTC"),
            _run("base-lite", "cpu", "AMD EPYC", "2026-11-26 18:12 UTC"),
            _run("tiny", "cuda", "Intel Xeon", "2026-11-26 23:38 UTC")]
    text = report.machine(runs)
    first, second = text.split("Machine 2 of 2, for ")
    assert first.startswith("Machine 1 of 2, for tiny (cpu, 2 threads, load 0.1), "
                            "base-lite (cpu, 2 threads, load 0.1):")
    assert "* CPU: AMD EPYC;" in first and "Intel Xeon" not in first
    assert second.startswith("tiny (cuda, 2 threads, load 0.1):")
    assert "* CPU: Intel Xeon;" in second and "AMD EPYC" not in second
    one = report.machine(runs[:2])  # one machine: no numbered blocks
    assert "Machine 1" not in one and one.startswith("* CPU: AMD EPYC;")
    # two GPUs on hosts alike: a block each, each naming its own GPU (and a run that
    # recorded none is not put under another's)
    gpus = [_run("tiny", "cuda", "Intel Xeon", "2026-11-26 23:38 UTC") for _ in range(3)]
    for run, name in zip(gpus, ("NVIDIA H100 80GB HBM3", "NVIDIA H200")):
        run["setup"]["ours"]["gpu"] = dict(name=name, cupy="14.2.0", cuda_runtime=13000)
    blocks = report.machine(gpus).split("Machine ")[1:]
    assert len(blocks) == 3
    assert "* GPU: NVIDIA H100 80GB HBM3;" in blocks[0] and "H200" not in blocks[0]
    assert "* GPU: NVIDIA H200;" in blocks[1] and "H100" not in blocks[1]
    assert "* GPU:" not in blocks[2]
