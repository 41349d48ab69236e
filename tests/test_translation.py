"""translate_ids with worker processes (mt/translation.py): the same outputs as one process,
whatever the batching; workers kept for the next call only while the model is unchanged; a
worker's error or death reaches the caller; translate.py --workers."""
import os

import numpy as np
import pytest

from minitransformer.mt import translate as translate_cli
from minitransformer.mt import translation
from minitransformer.mt.translation import WorkerDied, length_batches, translate_ids
from minitransformer.nn.transformer import Transformer, TransformerConfig

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
    return None if pool is None else [proc.pid for _, proc in pool.procs]


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
    # another number of workers: new workers too; and close_workers ends them
    translate_ids(m, src, workers=3, **kw)
    assert len(_worker_pids()) == 3
    procs = [proc for _, proc in translation.WorkerPool.current.procs]
    translation.close_workers()
    assert _worker_pids() is None and not any(proc.is_alive() for proc in procs)


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
