"""translate_ids with worker processes (mt/translation.py): the same outputs as one process,
whatever the batching; workers kept for the next call only while the model is unchanged; a
worker's error or death reaches the caller; translate.py --workers."""
import atexit
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from minitransformer.mt import translate as translate_cli
from minitransformer.mt.ensemble import Ensemble
from minitransformer.mt import translation
from minitransformer.mt.translation import WorkerDied, length_batches, translate_ids
from minitransformer.nn.transformer import Transformer, TransformerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CFG, seed=5)
    # make EOS likely, so that outputs end at different lengths (an untrained model
    # otherwise runs every output to its limit)
    m.embedding.data[CFG.eos_id] += 0.5 * m.embedding.data[4:].mean(axis=0)
    m.eval()
    return m


def _sources(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(4, CFG.vocab_size, rng.integers(1, 12)).tolist() for _ in range(n)]


@pytest.mark.parametrize("beam", [1, 3])
def test_workers_give_the_outputs_of_one_process(model, beam):
    src = _sources() + [[]]  # (an empty source gives an empty output)
    one = translate_ids(model, src, beam=beam, max_len_a=6, max_tokens=64)
    assert len({len(h) for h in one}) > 2  # outputs of several lengths
    for workers in (2, 3):
        assert translate_ids(model, src, beam=beam, max_len_a=6, max_tokens=64,
                             workers=workers) == one
    # and neither depends on the batching
    assert translate_ids(model, src, beam=beam, max_len_a=6, max_tokens=1000) == one


def test_length_batches_cover_every_source_once_within_the_budget():
    src = _sources(80, seed=1) + [[], [5] * 30]
    batches = length_batches(src, 40)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == [i for i, s in enumerate(src) if s]
    lengths = [len(src[i]) for i in flat]
    assert lengths == sorted(lengths)
    for b in batches:  # padded tokens (EOS counted) within the budget, unless alone
        assert len(b) == 1 or len(b) * (max(len(src[i]) for i in b) + 1) <= 40


def _worker_pids():
    pool = translation.WorkerPool.current
    return None if pool is None else [pid for _, pid in pool.workers]


def _running(pid, seconds=0.0):
    """Whether process ``pid`` still runs (as a zombie it does not), waiting up to
    ``seconds`` for it to end."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z" or time.monotonic() > deadline:
            return state != "Z"
        time.sleep(0.05)


def test_workers_stay_for_the_next_call_while_the_model_is_unchanged():
    m = Transformer(CFG, seed=6)
    src = _sources(seed=3)
    kw = dict(beam=2, max_len_a=4, max_tokens=64)
    first = translate_ids(m, src, workers=2, **kw)
    pids = _worker_pids()
    assert pids is not None and len(pids) == 2
    assert translate_ids(m, src, workers=2, **kw) == first
    assert _worker_pids() == pids  # the same processes
    # the weights changed in place (as an optimizer step or a checkpoint load does): new
    # workers, which translate with the new weights
    m.decoder[0].ff.w1.weight.data *= 1.5
    changed = translate_ids(m, src, workers=2, **kw)
    assert _worker_pids() not in (None, pids)
    assert changed == translate_ids(m, src, **kw) != first
    # another number of workers: new workers too (the old ones end); close_workers ends them
    old = _worker_pids()
    translate_ids(m, src, workers=3, **kw)
    pids = _worker_pids()
    assert len(pids) == 3 and not any(_running(pid) for pid in old)
    translation.close_workers()
    assert _worker_pids() is None and not any(_running(pid) for pid in pids)


def test_an_ensemble_translates_in_workers(model):
    other = Transformer(CFG, seed=8)
    ens = Ensemble([model, other])
    src = _sources(seed=4)
    kw = dict(beam=2, max_len_a=4, max_tokens=64)
    assert translate_ids(ens, src, workers=2, **kw) == translate_ids(ens, src, **kw)
    # the members' weights are checked: one changed in place gets new workers
    pids = _worker_pids()
    other.decoder[1].ff.w2.weight.data *= 0.5
    assert translate_ids(ens, src, workers=2, **kw) == translate_ids(ens, src, **kw)
    assert _worker_pids() != pids


def test_workers_end_with_the_process_that_forked_them(tmp_path):
    """However it ends (here os._exit: no clean-up at all), its workers follow it."""
    script = tmp_path / "die.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from minitransformer.mt import translation
        from minitransformer.nn.transformer import Transformer, TransformerConfig
        cfg = TransformerConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2)
        ids = [[5, 6, 7, 8]] * 40
        translation.translate_ids(Transformer(cfg), ids, beam=1, max_tokens=16, workers=2)
        print(*[pid for _, pid in translation.WorkerPool.current.workers], flush=True)
        os._exit(0)
    """))
    log = tmp_path / "pids.txt"
    with open(log, "w") as f:  # (a file, not a pipe: workers left behind would hold a pipe)
        code = subprocess.run([sys.executable, str(script)], stdout=f, stderr=subprocess.STDOUT,
                              timeout=120).returncode
    pids = [int(p) for p in log.read_text().split()] if code == 0 else []
    assert code == 0 and len(pids) == 2, log.read_text()
    try:
        assert not any(_running(pid, seconds=10) for pid in pids)
    finally:
        for pid in pids:  # (left behind by a failure: end them)
            if _running(pid):
                os.kill(pid, 9)


def test_busy_workers_end_when_the_process_that_forked_them_is_killed(tmp_path):
    """Killed (SIGKILL, as by PID or the out-of-memory killer) while its workers are in the
    middle of a search, which reads no pipe until done (here: a search of two minutes):
    the workers end within seconds, not after their share."""
    script = tmp_path / "busy.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from minitransformer.mt import translation
        translation.translate_ids = lambda *args, **kwargs: time.sleep(120)
        pool = translation.WorkerPool(None, 2, key=None)
        print(*[pid for _, pid in pool.workers], flush=True)
        pool.run([[[5, 6]], [[7, 8]]], 16, {{}})
    """))
    log = tmp_path / "pids.txt"
    with open(log, "w") as f:  # (a file, not a pipe: workers left behind would hold a pipe)
        proc = subprocess.Popen([sys.executable, str(script)], stdout=f,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while len(log.read_text().split()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        pids = [int(p) for p in log.read_text().split()]
        time.sleep(0.5)  # (the workers are in their search)
        assert all(_running(pid) for pid in pids)
    finally:
        proc.kill()
        proc.wait()
    try:
        assert not any(_running(pid, seconds=10) for pid in pids)
    finally:
        for pid in pids:  # (left behind by a failure: end them)
            if _running(pid):
                os.kill(pid, 9)


def test_a_process_forked_from_this_one_leaves_the_workers_alone(model):
    src = _sources(seed=5)
    kw = dict(beam=1, max_len_a=4, max_tokens=64)
    first = translate_ids(model, src, workers=2, **kw)
    pids = _worker_pids()
    child = os.fork()
    if child == 0:  # exits as a program does: its exit handlers run
        try:
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert all(_running(pid) for pid in pids)
    assert translate_ids(model, src, workers=2, **kw) == first and _worker_pids() == pids


def test_a_workers_exception_is_raised_in_the_caller(model, monkeypatch):
    def fail(*args, **kwargs):
        raise ValueError("no room for this batch")
    translation.close_workers()  # (workers forked from here on see the patched function)
    monkeypatch.setattr(translation, "search_batch", fail)
    with pytest.raises(ValueError, match="no room for this batch"):
        translate_ids(model, _sources(), beam=1, max_tokens=64, workers=2)
    assert translation.WorkerPool.current is None  # (an error ends the workers)


def test_a_worker_that_dies_is_reported_not_waited_for(model, monkeypatch):
    def die(*args, **kwargs):
        os._exit(9)
    translation.close_workers()
    monkeypatch.setattr(translation, "search_batch", die)
    with pytest.raises(WorkerDied, match=r"exit code 9.*--max-tokens or --workers"):
        translate_ids(model, _sources(), beam=1, max_tokens=64, workers=2)
    assert translation.WorkerPool.current is None


def test_one_batch_is_translated_in_this_process(model, monkeypatch):
    def no_workers(*args, **kwargs):
        raise AssertionError("started workers for one batch")
    monkeypatch.setattr(translation, "translate_in_workers", no_workers)
    src = _sources(3)
    assert translate_ids(model, src, beam=1, max_tokens=4096, workers=4) == \
        translate_ids(model, src, beam=1, max_tokens=4096)


def test_translate_py_workers_flag(tmp_path, capsys):
    from conftest import synthetic_tokenizer, untrained_run
    tok, corpus = synthetic_tokenizer(tmp_path, n_valid=40)
    run = tmp_path / "run"
    untrained_run(run, tok)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(corpus["valid"][0]) + "\n", encoding="utf-8")
    outs = []
    for workers in ("1", "2"):
        code = translate_cli.main(["--run-dir", str(run), "--input", str(src), "--beam", "2",
                                   "--max-len-a", "3", "--max-tokens", "50",
                                   "--workers", workers])
        out, err = capsys.readouterr()
        assert code == 0, err
        outs.append(out)
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 40
    with pytest.raises(SystemExit) as exc:
        translate_cli.main(["--run-dir", str(run), "--workers", "-1"])
    assert exc.value.code == 2 and "--workers: must be an integer >= 0" in \
        capsys.readouterr().err
