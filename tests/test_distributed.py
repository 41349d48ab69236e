"""Data-parallel training: the flat gradient buffer, and `mpiexec -n 2 train.py` end to end.

The mpiexec tests need mpi4py and an `mpiexec` (`pip install -e .[mpi]`, which `.[test]`
includes) and skip cleanly without them; the NCCL test also needs CuPy and a GPU.
"""
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from minitransformer import backend
from minitransformer.engine.tensor import Tensor
from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import distributed as dist
from minitransformer.mt import train as train_cli
from minitransformer.settings import SETTINGS

from conftest import REAL_GPU, small_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--synthetic-pairs", "1500", "--d-model", "32", "--n-heads", "2", "--d-ff", "64",
         "--max-tokens", "600", "--vocab-size", "120", "--no-progress", "--log-every", "2",
         "--warmup", "50", "--valid-bleu-sentences", "20", "--test-split", ""]
K = 8  # updates compared


# ----------------------------------------------------------------------------- no MPI needed

def test_launch_is_detected_from_the_launchers_environment(monkeypatch):
    assert not dist.launched_by_mpi({})
    assert dist.launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert dist.launched_by_mpi({"PMI_SIZE": "4"})
    for v in dist.LAUNCHER_VARS:
        monkeypatch.delenv(v, raising=False)
    assert dist.init_from_env() is None  # plain `python train.py`: no MPI, no mpi4py import


def _params(shapes, seed):
    rng = np.random.default_rng(seed)
    return [Tensor(rng.standard_normal(s).astype(np.float32), requires_grad=True) for s in shapes]


def test_summed_grad_buffers_give_the_summed_gradients():
    """Two simulated ranks: rank a has gradients for params 0 and 2, rank b (say an empty
    shard) has none; param 1 has none anywhere and must stay None, as in one process."""
    shapes = [(3, 4), (5,), (2, 3)]
    a, b = _params(shapes, 0), _params(shapes, 0)
    rng = np.random.default_rng(1)
    ga = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    gb = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    a[0].grad, a[2].grad = ga[0].copy(), ga[2].copy()
    b[0].grad = gb[0].copy()
    buf_a = dist.grad_buffer(a, 7.5, 30)
    buf_b = dist.grad_buffer(b, 2.25, 11)
    empty = dist.grad_buffer(_params(shapes, 0), 0.0, 0)
    assert buf_a.shape == buf_b.shape == empty.shape == (12 + 5 + 6 + 3 + 2,)
    assert not empty.any()  # a rank with nothing contributes zeros, same layout
    total = buf_a + buf_b  # what the all-reduce computes
    loss_sum, n_tok = dist.apply_grad_buffer(total, a)
    assert (loss_sum, n_tok) == (9.75, 41)
    np.testing.assert_array_equal(a[0].grad, ga[0] + gb[0])
    assert a[1].grad is None
    np.testing.assert_array_equal(a[2].grad, ga[2])
    assert a[0].grad.shape == (3, 4) and a[2].grad.shape == (2, 3)
    # filling a reused buffer zeroes what a None gradient left from the last update
    a[0].grad, a[2].grad = None, ga[2].copy()
    again = dist.grad_buffer(a, 0.0, 1, out=total)
    assert again is total and not again[:12].any()


class _TwoEqualRanks:
    """An MPI communicator of two ranks that hold the same numbers: an all-reduce doubles."""
    def __init__(self):
        self.chunks = []

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Allreduce(self, where, chunk, op):
        assert where == "IN_PLACE" and op == "SUM"
        self.chunks.append(chunk.size)
        chunk *= 2


def test_comm_sums_the_optimizers_flat_buffer_in_place(monkeypatch):
    """With flat_grad the gradients are summed where they are (bucket by bucket) and stay
    views of the optimizer's buffer, so its one-array update still applies; the loss and
    the token count come back summed."""
    import types
    from minitransformer.optim import Adam
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    MPI = types.SimpleNamespace(IN_PLACE="IN_PLACE", SUM="SUM")
    mpi = _TwoEqualRanks()
    comm = dist.Comm(MPI, mpi, device="cpu", bucket_bytes=40)  # 10 float32 a bucket
    params = _params([(3, 4), (5,), (2, 3)], 0)
    opt = Adam(params, flat=True)
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    for p, g in zip(params, grads):
        p.grad += g  # backward adds into the views
    flat = opt.flat_grad()
    assert comm.allreduce_grads(params, 1.25, 7, flat_grad=flat) == (2.5, 14)
    assert mpi.chunks == [10, 10, 3, 2]  # 23 gradient numbers in buckets, then the 2 totals
    assert opt.flat_grad() is flat  # still one array: no per-parameter fallback
    for p, g in zip(params, grads):
        np.testing.assert_array_equal(p.grad, 2 * g)
    assert comm._buf is None  # no copy into a buffer of the Comm's


class _OneRank(_TwoEqualRanks):
    """An MPI communicator of one rank: every collective leaves the numbers as they are."""
    def Get_size(self):
        return 1

    def Allreduce(self, where, chunk, op):
        self.chunks.append(chunk.size)

    def Bcast(self, chunk, root=0):
        pass

    def bcast(self, value, root=0):
        return value

    def Barrier(self):
        pass


def test_train_py_hands_the_flat_buffer_to_the_all_reduce(tmp_path, monkeypatch):
    """train.py under a Comm (one rank here, through the same code as N): with flat Adam the
    all-reduce gets Adam's gradient buffer, and the run equals the per-parameter one."""
    import types
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    MPI = types.SimpleNamespace(IN_PLACE="IN_PLACE", SUM="SUM", MAX="MAX")
    given, params = [], {}
    allreduce = dist.Comm.allreduce_grads

    def recording(self, ps, loss_sum, n_tok, flat_grad=None):
        given.append(flat_grad is not None)
        return allreduce(self, ps, loss_sum, n_tok, flat_grad=flat_grad)
    monkeypatch.setattr(dist.Comm, "allreduce_grads", recording)
    for flat in ("0", "1"):
        monkeypatch.setattr(SETTINGS, "flat_adam", flat == "1")
        run = str(tmp_path / flat)
        comm = dist.Comm(MPI, _OneRank())
        assert train_cli.main(SMALL + ["--run-dir", run, "--max-updates", "4",
                                       "--valid-every", "4"], comm=comm) == 0
        params[flat] = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[0]
    assert given == [False] * 4 + [True] * 4
    for k in params["0"]:
        assert np.array_equal(params["0"][k], params["1"][k]), k


def test_buckets_cover_the_buffer_in_bounded_slices():
    assert dist.buckets(10, 4, 12) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert dist.buckets(5, 4, 1 << 20) == [(0, 5)]
    assert dist.buckets(0, 4, 12) == []


class _FakeMPIComm:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


def test_shards_and_dropout_seeds_per_rank(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    comms = [dist.Comm(None, _FakeMPIComm(r, 3)) for r in range(3)]
    batch = [([1] * i, [2] * (i % 5 + 1)) for i in range(1, 8)]
    shards = [c.shard(batch) for c in comms]
    assert sorted(map(repr, sum(shards, []))) == sorted(map(repr, batch))
    assert [c.shard(batch[:2]) for c in comms][2] == []  # fewer pairs than ranks
    seeds = {c.dropout_seed(1, u) for c in comms for u in range(4)}
    assert len(seeds) == 12  # every (rank, update) its own stream
    assert comms[1].dropout_seed(1, 3) == comms[1].dropout_seed(1, 3)


# ----------------------------------------------------------------------------- mpiexec runs

def _mpiexec():
    """The mpiexec to use, or None: on PATH, or beside this Python (an unactivated venv)."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return shutil.which("mpiexec") or (beside if os.access(beside, os.X_OK) else None)


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="needs mpi4py and mpiexec: "
                                                      "pip install -e .[mpi]")


def mpi_env(**extra):
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",  # one BLAS thread per rank
               OMPI_MCA_mpi_yield_when_idle="1")  # a waiting rank yields its core (busy CI)
    env.update(extra)
    return env


def mpi_command(n, *args, stand_in=False):
    """mpiexec ... train.py args; ``stand_in``: through tests/cuda_on_cpu/run.py, so that
    ``--device cuda`` runs on the CuPy stand-in (NCCL summing over MPI)."""
    launcher = [os.path.join(ROOT, "tests", "cuda_on_cpu", "run.py")] if stand_in else []
    return [MPIEXEC, "--oversubscribe", "-n", str(n), sys.executable, *launcher,
            os.path.join(ROOT, "train.py"), *args]


def run_mpi(n, *args, timeout=180, stand_in=False, **env):
    proc = subprocess.run(mpi_command(n, *args, stand_in=stand_in), cwd=ROOT, env=mpi_env(**env),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def records(run):
    return [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]


def assert_state_close(reference, other, what):
    """Parameters within rtol 1e-4 / atol 1e-5; Adam's m and v within 1e-3 relative, floored at
    1e-3 of the largest entry of that kind (m and v of near-zero gradients are rounding
    noise): see the equivalence test for why."""
    pa, oa, _ = ckpt.load_checkpoint(reference)
    pb, ob, _ = ckpt.load_checkpoint(other)
    assert pa.keys() == pb.keys() and oa.keys() == ob.keys()
    worst = []
    for k in pa:
        diff = np.abs(pa[k].astype(np.float64) - pb[k])
        bad = diff > 1e-5 + 1e-4 * np.abs(pa[k])
        worst.append((diff.max(), k))
        assert not bad.any(), (f"{what}: parameter {k}: {int(bad.sum())} of {diff.size} differ; "
                               f"max abs {diff.max():.3e}")
    for kind in ("m", "v"):
        keys = [k for k in oa if k.startswith(kind + ".")]
        floor = 1e-3 * max(float(np.abs(oa[k]).max()) for k in keys)
        for k in keys:
            diff = np.abs(oa[k].astype(np.float64) - ob[k])
            rel = diff / (np.abs(oa[k]) + floor)
            assert rel.max() <= 1e-3, f"{what}: Adam {k}: max rel {rel.max():.3e}"
    return max(worst)


@needs_mpi
def test_two_ranks_equal_one_process_after_k_updates(tmp_path):
    """The 2-rank update is the 1-process update on the union of the shards.

    Not bit for bit: each rank sums its shard's float32 gradients, then the ranks' sums are
    added, so the additions happen in another order (differences ~1e-7 relative). Adam turns
    gradients into steps of about lr each, also where the exact gradient is zero and float32
    leaves only rounding noise (the key biases: softmax ignores a shift shared by all keys);
    there the two runs' steps would differ by up to 2 lr. --adam-eps 1e-6 (instead of 1e-9)
    keeps such noise (|g| ~ 1e-9 << eps) from being amplified, for both runs alike. Measured:
    parameters agree to ~4e-6 absolute; a wrong reduction (a missing sum, a shard lost,
    normalising by the local token count) moves Adam's m and v by tens of percent or the
    parameters by ~lr = 1e-3, far outside rtol 1e-4 / atol 1e-5 (parameters) and 1e-3
    relative (m, v; v ~ g^2 also catches a gradient off by a constant factor, which Adam's
    step alone would hide)."""
    flags = SMALL + ["--dropout", "0", "--adam-eps", "1e-6", "--max-updates", str(K),
                     "--valid-every", "1000"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert train_cli.main(flags + ["--run-dir", one]) == 0
    out = run_mpi(2, *flags, "--run-dir", two)
    assert "allreduce" in out and "ms/update" in out
    a, b = os.path.join(one, "checkpoint_last.npz"), os.path.join(two, "checkpoint_last.npz")
    assert ckpt.load_checkpoint(b)[2]["update"] == K
    assert_state_close(a, b, "2 ranks vs 1 process")
    ra = [r for r in records(one) if "loss" in r]
    rb = [r for r in records(two) if "loss" in r]
    assert [r["update"] for r in ra] == [r["update"] for r in rb]  # rank 0 alone logs
    for x, y in zip(ra, rb):  # the loss is summed over ranks and divided by global tokens
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x, y)
        assert y["allreduce_s"] >= 0 and y["update_s"] >= y["allreduce_s"]


@needs_mpi
def test_two_ranks_resume_exactly_with_validation_and_dropout(tmp_path):
    """Stopped at update 4 and resumed to 8 equals 8 straight, bit for bit (same ranks, same
    additions); dropout is on, so every rank's masks must be reproduced after the resume."""
    flags = SMALL + ["--dropout", "0.1", "--valid-every", "4"]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_mpi(2, *flags, "--max-updates", "8", "--run-dir", straight)
    run_mpi(2, *flags, "--max-updates", "4", "--run-dir", split)
    run_mpi(2, *flags, "--max-updates", "8", "--run-dir", split, "--resume")
    a = ckpt.load_checkpoint(os.path.join(straight, "checkpoint_last.npz"))
    b = ckpt.load_checkpoint(os.path.join(split, "checkpoint_last.npz"))
    assert b[2]["update"] == 8
    for k in a[0]:
        assert np.array_equal(a[0][k], b[0][k]), k
    recs = records(split)
    assert [r["update"] for r in recs if "valid_bleu" in r] == [4, 8]  # rank 0 validates
    assert sum(1 for r in recs if r.get("update") == 8 and "loss" in r) == 1
    assert os.path.exists(os.path.join(split, "checkpoint_best.npz"))


@needs_mpi
def test_two_ranks_with_flat_adam_equal_per_parameter_adam_bit_for_bit(tmp_path):
    """MINITRANSFORMER_FLAT_ADAM=1 (the default on GPUs): the all-reduce sums Adam's flat
    gradient buffer in place and one update covers all parameters. Same additions, same
    elementwise steps: the same run, bit for bit, as the per-parameter path."""
    flags = SMALL + ["--dropout", "0.1", "--max-updates", "6", "--valid-every", "6"]
    runs = {}
    for flat in ("0", "1"):
        runs[flat] = str(tmp_path / f"flat{flat}")
        run_mpi(2, *flags, "--run-dir", runs[flat], MINITRANSFORMER_FLAT_ADAM=flat)
    a = ckpt.load_checkpoint(os.path.join(runs["0"], "checkpoint_last.npz"))
    b = ckpt.load_checkpoint(os.path.join(runs["1"], "checkpoint_last.npz"))
    assert b[2]["update"] == 6
    for k in a[0]:
        assert np.array_equal(a[0][k], b[0][k]), k
    for k in a[1]:
        assert np.array_equal(a[1][k], b[1][k]), k
    assert [r["loss"] for r in records(runs["0"]) if "loss" in r] == \
        [r["loss"] for r in records(runs["1"]) if "loss" in r]


def _pid_of_rank(marker, rank, deadline):
    """The pid of the rank process whose environment holds MT_TEST_MARKER=marker."""
    want = {f"MT_TEST_MARKER={marker}".encode(), f"OMPI_COMM_WORLD_RANK={rank}".encode()}
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                env = set(open(f"/proc/{pid}/environ", "rb").read().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                return int(pid)
        time.sleep(0.2)
    return None


@needs_mpi
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the rank's pid in /proc")
def test_sigterm_to_one_rank_stops_all_ranks_and_rank0_saves(tmp_path):
    """A stop that only rank 1 sees is agreed on by all ranks, so rank 0 saves and nobody
    waits forever in the next all-reduce; the run then resumes under 2 ranks."""
    run = str(tmp_path / "run")
    marker = uuid.uuid4().hex
    cmd = mpi_command(2, *SMALL, "--run-dir", run, "--max-updates", "100000",
                      "--valid-every", "100000")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(MT_TEST_MARKER=marker),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        log = os.path.join(run, "metrics.jsonl")
        while time.time() < deadline and not (os.path.exists(log) and os.path.getsize(log) > 600):
            time.sleep(0.2)
        pid = _pid_of_rank(marker, 1, deadline)
        assert pid is not None, "rank 1 not found"
        os.kill(pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"the ranks did not stop after SIGTERM to rank 1 (pid {pid}):\n"
                        + out[-3000:])
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]  # every rank saved, then
    assert "SIGTERM" in out and "--resume" in out, out[-3000:]    # exited with 143
    stopped = ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"]
    assert stopped > 0
    run_mpi(2, *SMALL, "--run-dir", run, "--resume", "--max-updates", str(stopped + 2),
            "--valid-every", "100000")
    assert ckpt.load_checkpoint(os.path.join(run, "checkpoint_last.npz"))[2]["update"] == \
        stopped + 2


def _gpu_ranks():
    """How many ranks the NCCL test can run (one per GPU, at most 2; 2 on the stand-in,
    which gives each rank a 'GPU'), or a skip reason."""
    if MPIEXEC is None:
        return "needs mpi4py and mpiexec: pip install -e .[mpi]"
    from cupy.cuda import nccl
    if not getattr(nccl, "available", True):
        return "CuPy cannot load NCCL (python -m minitransformer.doctor says how to fix it)"
    if not REAL_GPU:
        return 2
    return min(2, backend.get_xp("cuda").cuda.runtime.getDeviceCount())


@pytest.mark.gpu
def test_nccl_ranks_equal_one_gpu_process_after_k_updates(tmp_path):
    """The same equivalence on GPUs, summed by NCCL in place in flat Adam's gradient buffer
    (1 rank where the machine has 1 GPU: that still runs the NCCL set-up, all-reduce and
    broadcast). Without a GPU: 2 ranks on the stand-in, its NCCL summing over MPI.

    On a real GPU both runs multiply in full float32 (CUPY_TF32=0), in processes of their
    own: with TF32 two runs of the same command already differ beyond these tolerances (seen
    on an H200: the atomic adds of the embedding's backward round in a varying order, and
    TF32's 10-bit rounding of the next products turns those last-bit differences into 1e-4
    ones), while without it they agree to 1e-5."""
    n = _gpu_ranks()
    if isinstance(n, str):
        pytest.skip(n)
    flags = SMALL + ["--dropout", "0", "--adam-eps", "1e-6", "--max-updates", str(K),
                     "--valid-every", "1000", "--device", "cuda", "--valid-bleu-sentences", "8"]
    # a short validation set: on the CPU harness each CUDA thread of a kernel is a fiber
    one, many = small_corpus(tmp_path / "one"), small_corpus(tmp_path / "many")
    if REAL_GPU:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *flags,
                               "--run-dir", one], cwd=ROOT, env=mpi_env(CUPY_TF32="0"),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        assert train_cli.main(flags + ["--run-dir", one]) == 0
    out = run_mpi(n, *flags, "--run-dir", many, stand_in=not REAL_GPU, CUDA_ON_CPU_DEVICES="2",
                  CUPY_TF32="0")
    assert "allreduce" in out
    assert_state_close(os.path.join(one, "checkpoint_last.npz"),
                       os.path.join(many, "checkpoint_last.npz"), f"{n} GPU ranks vs 1 process")


def test_doctor_reports_each_piece_and_a_fix_for_what_is_missing(capsys):
    from minitransformer import doctor
    assert doctor.main([]) in (0, 1)
    out = capsys.readouterr().out
    for piece in ("BLAS", "OPENBLAS_CORETYPE", "CuPy", "NCCL", "mpi4py", "mpiexec"):
        assert piece in out, out
    for line in out.splitlines()[1:]:
        if line.split()[0] == "missing" and "needs CuPy" not in line:
            following = out.splitlines()[out.splitlines().index(line) + 1]
            assert "fix:" in following, out


def test_doctor_reports_a_broken_mpi4py_and_a_bad_switch(tmp_path):
    # an mpi4py that is found but fails to import (its MPI library gone) is one "broken" line
    # with a fix, not a traceback; a MINITRANSFORMER_* switch with a bad value is named
    shadow = tmp_path / "mpi4py"
    shadow.mkdir()
    (shadow / "__init__.py").write_text('raise ImportError("libmpi.so.40: cannot open")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]),
           "MINITRANSFORMER_FLAT_ADAM": "yes"}
    proc = subprocess.run([sys.executable, "-m", "minitransformer.doctor"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "mpi4py cannot be imported (ImportError: libmpi.so.40: cannot open)" in proc.stdout
    assert "MINITRANSFORMER_FLAT_ADAM='yes' is not one of 1, 0" in proc.stdout, proc.stdout
    assert "fix: set the variable to one of those values, or unset it" in proc.stdout
    assert proc.returncode == 1  # (train.py would refuse to start)
    proc = subprocess.run([sys.executable, "-m", "minitransformer.doctor", "--no-such-flag"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unrecognized arguments: --no-such-flag" in proc.stderr


@needs_mpi
def test_two_ranks_stop_together_when_training_diverges(tmp_path):
    """The divergence guard under mpiexec: every rank skips the same bad updates (decided on
    the all-reduced sums), replays its share, and all stop with status 3; one rank prints
    the diagnosis, and the launcher does not abort anyone. A second job into the directory
    is then free to start (the lock died with rank 0)."""
    run = str(tmp_path / "run")
    proc = subprocess.run(mpi_command(2, *SMALL, "--run-dir", run, "--lr-factor", "1e30",
                                      "--max-updates", "40", "--max-bad-updates", "3"),
                          cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert out.count("training diverged: 3 updates in a row") == 1, out[-3000:]
    assert "forward made a NaN or Inf output from finite values" in out
    assert "MPI_ABORT" not in out and "Traceback" not in out, out[-3000:]
    assert not [n for n in os.listdir(run) if n.endswith(".npz")]


@needs_mpi
def test_ranks_started_with_different_options_are_refused_before_any_work(tmp_path):
    """Rank 1 with another --max-updates: refused at the start on every rank, naming the
    flag (it trained on, then waited forever in the stop check rank 0 had left)."""
    run = str(tmp_path / "run")
    script = [sys.executable, os.path.join(ROOT, "train.py"), *SMALL, "--run-dir", run]
    cmd = [MPIEXEC, "--oversubscribe", "-n", "1", *script, "--max-updates", "20", ":",
           "-n", "1", *script, "--max-updates", "30"]
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert ("the ranks were started with different options: rank 1 has --max-updates 30 "
            "(rank 0: 20); give every rank the same command line") in out, out[-3000:]
    assert not os.path.exists(os.path.join(run, "checkpoint_last.npz"))


@needs_mpi
def test_two_ranks_into_a_busy_run_dir_give_rank0s_verdict(tmp_path):
    """A run directory another run holds: every rank says it is in use (rank 1, holding no
    lock, said it held a run and to pass --resume, which is refused too)."""
    from minitransformer.mt.rundir import RunDir
    run = str(tmp_path / "run")
    os.makedirs(run)
    for name in ("checkpoint_last.npz", "config.json"):  # (a run in training there)
        open(os.path.join(run, name), "w").close()
    holder = RunDir(run)
    holder.lock()
    try:
        proc = subprocess.run(mpi_command(2, *SMALL, "--run-dir", run, "--max-updates", "2"),
                              cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                              timeout=120)
    finally:
        holder.unlock()
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and f"--run-dir {run} is in use by another training run" in out
    assert "already holds a run" not in out, out[-3000:]


@needs_mpi
def test_a_signal_to_one_rank_during_the_closing_validation_stops_all_alike(tmp_path):
    """SIGTERM to rank 1 while the closing validation runs (after the loop's last stop
    check): every rank exits 143 with the message (rank 1 called MPI_ABORT), and --resume
    scores the test without validating again."""
    run = str(tmp_path / "run")
    script = tmp_path / "train_signalled.py"
    script.write_text(
        "import os, signal, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from minitransformer.mt import train as t\n"
        "real = t.Trainer._validate_and_save\n"
        "def vs(self, log):\n"
        "    if self.comm.rank == 1 and self.update == 5:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return real(self, log)\n"
        "t.Trainer._validate_and_save = vs\n"
        "from minitransformer.mt.distributed import abort_on_error, init_from_env\n"
        "comm = init_from_env()\n"
        "with abort_on_error(comm):\n"
        "    sys.exit(t.cli(comm=comm))\n")
    args = [*SMALL, "--run-dir", run, "--max-updates", "5", "--valid-every", "3",
            "--test-split", "test"]
    proc = subprocess.run([MPIEXEC, "--oversubscribe", "-n", "2", sys.executable, str(script),
                           *args], cwd=ROOT, env=mpi_env(), capture_output=True, text=True,
                          timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "MPI_ABORT" not in out, out[-3000:]
    assert "SIGTERM during the closing validation and checkpoint: the test of --test-split " \
           "test is skipped; --resume scores it" in out, out[-3000:]
    out = run_mpi(2, *SMALL, "--run-dir", run, "--resume", "--test-split", "test")
    assert "valid update 5" not in out and "test (test, " in out, out[-3000:]
