"""Ensemble decoding (mt/ensemble.py): the searches on an Ensemble against a search written out
from the members' plain forward passes, and translate.py --ensemble end to end."""
import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import translate as translate_cli
from minitransformer.mt.ensemble import Ensemble
from minitransformer.mt.search import _length_penalty, beam_search, greedy_search
from minitransformer.nn.transformer import Transformer, TransformerConfig

from conftest import synthetic_tokenizer, untrained_run

CFG = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0)


def _models(n, seed=3, **cfg):
    models = [Transformer(TransformerConfig(**{**CFG.__dict__, **cfg}), seed=seed + i,
                          dtype=np.float64) for i in range(n)]
    for m in models:
        m.eval()
    return models


def _src():
    src = np.random.default_rng(0).integers(4, 30, (5, 6))
    src[1, 4:] = 0  # padding
    src[3, 2:] = 0
    return src


def _mean_log_probs(models, src, history):
    """The ensemble's scores of the next token after ``history`` (B, t), from each member's
    plain forward pass (no cache): the mean of their log-softmaxes, renormalised."""
    total = 0.0
    for m in models:
        memory, mask = m.encode(src)
        z = m.logits(m.decode(history, memory, mask)).data[:, -1]
        total = total + (z - z.max(1, keepdims=True)
                         - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)))
    s = total / len(models)
    return s - s.max(1, keepdims=True) - np.log(np.exp(s - s.max(1, keepdims=True))
                                                .sum(1, keepdims=True))


def _greedy_by_hand(models, src, max_len):
    """Greedy decoding written out with full forward passes, one sentence at a time."""
    cfg = models[0].cfg
    out = []
    for b in range(src.shape[0]):
        hist = [cfg.bos_id]
        while len(hist) - 1 < max_len[b]:
            s = _mean_log_probs(models, src[b:b + 1], np.array([hist]))[0]
            s[[cfg.pad_id, cfg.bos_id]] = -np.inf
            tok = int(np.argmax(s))
            if tok == cfg.eos_id:
                break
            hist.append(tok)
        out.append(hist[1:])
    return out


def test_greedy_on_an_ensemble_equals_greedy_written_out_from_the_members():
    models = _models(3)
    src = _src()
    limit = (src != 0).sum(1) + 4
    got = greedy_search(Ensemble(models), src, max_len_a=4)
    assert got == _greedy_by_hand(models, src, limit)
    # and it is not simply one member's search
    assert any(got != greedy_search(m, src, max_len_a=4) for m in models)


def test_beam_scores_on_an_ensemble_are_the_mean_log_probabilities_of_the_hypothesis():
    """Every finished hypothesis's score is its summed ensemble log-probability (from the
    members' plain forward passes) over its length penalty."""
    models = _models(2)
    src = _src()
    results = beam_search(Ensemble(models), src, beam=3, alpha=0.6, max_len_a=5,
                          return_all=True)
    eos = CFG.eos_id
    checked = 0
    for b, hyps in enumerate(results):
        for score, tokens in hyps:
            ends = len(tokens) < (src[b] != 0).sum() + 5
            seq = [CFG.bos_id] + tokens + ([eos] if ends else [])
            logp = sum(_mean_log_probs(models, src[b:b + 1], np.array([seq[:t + 1]]))[0][
                seq[t + 1]] for t in range(len(seq) - 1))
            want = logp / _length_penalty(len(tokens), 0.6, "gnmt", ends=ends)
            assert score == pytest.approx(want, rel=1e-10, abs=1e-10), (b, tokens)
            checked += 1
    assert checked >= 2 * src.shape[0]


def test_an_ensemble_of_one_searches_as_its_model():
    (model,) = _models(1)
    src = _src()
    assert greedy_search(Ensemble([model]), src) == greedy_search(model, src)
    a = beam_search(Ensemble([model]), src, beam=4, return_all=True)
    b = beam_search(model, src, beam=4, return_all=True)
    assert [[t for _, t in h] for h in a] == [[t for _, t in h] for h in b]
    np.testing.assert_allclose([s for h in a for s, _ in h], [s for h in b for s, _ in h],
                               rtol=1e-12)


def test_members_must_share_the_vocabulary_and_positions_are_the_smallest():
    a, = _models(1)
    b, = _models(1, vocab_size=31)
    with pytest.raises(ValueError, match="vocab_size 31.*share one vocabulary"):
        Ensemble([a, b])
    c, = _models(1, max_positions=12)
    assert Ensemble([a, c]).cfg.max_positions == 12
    with pytest.raises(ValueError, match="at least one"):
        Ensemble([])


# ---- translate.py --ensemble ------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two untrained runs of one sentencepiece model (different seeds), and one of another."""
    base = tmp_path_factory.mktemp("ens")
    tok, corpus = synthetic_tokenizer(base, n_valid=12)
    a = untrained_run(base / "a", tok)
    b_model = Transformer(a.cfg, seed=11)
    (base / "b").mkdir()
    (base / "b" / "spm.model").write_bytes((base / "a" / "spm.model").read_bytes())
    ckpt.save_checkpoint(str(base / "b" / "checkpoint_last.npz"), b_model, None,
                         {"spm_sha256": ckpt.file_sha256(str(base / "b" / "spm.model"))})
    (base / "x").mkdir()
    other_tok, _ = synthetic_tokenizer(base / "x", n_valid=2, seed=99)
    untrained_run(base / "other", other_tok)
    src = base / "in.txt"
    src.write_text("\n".join(corpus["valid"][0]) + "\n", encoding="utf-8")
    return base, str(src), len(corpus["valid"][0])


def test_translate_py_ensemble_translates_with_both_models(runs, capsys):
    base, src, n = runs
    outs = {}
    for name, flags in (("a", []), ("b", []), ("ab", ["--ensemble", str(base / "b")])):
        run = base / ("b" if name == "b" else "a")
        assert translate_cli.main(["--run-dir", str(run), "--input", src, "--beam", "2",
                                   "--workers", "1", *flags]) == 0
        outs[name] = capsys.readouterr().out.splitlines()
    assert len(outs["ab"]) == n
    assert outs["ab"] != outs["a"] and outs["ab"] != outs["b"]


def test_translate_py_ensemble_refuses_another_vocabulary_or_a_missing_run(runs, capsys):
    base, src, _ = runs
    code = translate_cli.main(["--run-dir", str(base / "a"), "--input", src,
                               "--ensemble", str(base / "other")])
    err = capsys.readouterr().err
    assert code == 2 and f"--ensemble {base / 'other'}: its spm.model differs" in err, err
    code = translate_cli.main(["--run-dir", str(base / "a"), "--input", src,
                               "--ensemble", str(base / "nowhere")])
    err = capsys.readouterr().err
    assert code == 2 and "--ensemble" in err and "no such directory" in err, err
    code = translate_cli.main(["--run-dir", str(base / "a"), "--input", src, "--ensemble",
                               str(base / "b"), "--plot-attention", str(base / "maps")])
    err = capsys.readouterr().err
    assert code == 2 and "--plot-attention" in err and "--ensemble" in err, err


def test_translate_py_ensemble_refuses_a_run_given_twice(runs, capsys):
    base, src, _ = runs
    for flags, first in (([str(base / "a") + "/"], f"--run-dir {base / 'a'}"),
                         ([str(base / "b"), str(base / "x" / ".." / "b")],
                          f"--ensemble {base / 'b'}")):
        code = translate_cli.main(["--run-dir", str(base / "a"), "--input", src,
                                   "--ensemble", *flags])
        err = capsys.readouterr().err
        assert code == 2 and f"the same model as {first} (the same checkpoint files)" in err, err
    # two checkpoints of one run are two models: --checkpoint is --run-dir's alone
    other = base / "a" / "checkpoint_early.npz"
    other.write_bytes((base / "b" / "checkpoint_last.npz").read_bytes())
    assert translate_cli.main(["--run-dir", str(base / "a"), "--checkpoint", str(other),
                               "--input", src, "--workers", "1", "--ensemble",
                               str(base / "a")]) == 0
    capsys.readouterr()
    other.unlink()  # (the fixture's run as it was, for the other tests)


def test_translate_py_record_appends_the_score_for_the_budget_plot(runs, tmp_path, capsys):
    """--record: the ensemble's BLEU becomes --run-dir's last test record, at the minutes of
    its longest-trained run; what the runs' metrics.jsonl held before stays as it was."""
    import json
    import re
    import shutil

    from minitransformer.mt import plots
    base, src, _ = runs
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(base / "a", a)
    shutil.copytree(base / "b", b)
    ref = tmp_path / "ref.txt"
    ref.write_text(open(src, encoding="utf-8").read(), encoding="utf-8")
    flags = ["--run-dir", str(a), "--ensemble", str(b), "--input", src, "--reference",
             str(ref), "--beam", "2", "--workers", "1", "--record"]
    code = translate_cli.main(flags)  # no metrics.jsonl yet
    err = capsys.readouterr().err
    assert code == 2 and f"--record: {a / 'metrics.jsonl'}: no such metrics file" in err, err
    (a / "metrics.jsonl").write_text(
        json.dumps({"update": 100, "loss": 3.0, "time": 600.0}) + "\n"
        + json.dumps({"update": 120, "valid_bleu": 1.0, "time": 700.0}) + "\n",
        encoding="utf-8")
    (b / "metrics.jsonl").write_text(json.dumps({"update": 90, "loss": 3.1, "time": 750.0})
                                     + "\n", encoding="utf-8")
    before_a, before_b = ((d / "metrics.jsonl").read_text(encoding="utf-8") for d in (a, b))
    assert translate_cli.main(flags) == 0
    err = capsys.readouterr().err
    bleu = float(re.search(r"BLEU = ([\d.]+)", err).group(1))
    after_a = (a / "metrics.jsonl").read_text(encoding="utf-8")
    assert after_a.startswith(before_a) and after_a.count("\n") == 3
    assert (b / "metrics.jsonl").read_text(encoding="utf-8") == before_b
    test = plots.read_test(str(a / "metrics.jsonl"))
    assert abs(test["test_bleu"] - bleu) < 0.005 and test["time"] == 750.0
    assert test["update"] == 120 and test["test_split"] == "in" and test["beam"] == 2
    assert test["ensemble"] == [str(a), str(b)] and "nrefs:1" in test["test_signature"]
    code = translate_cli.main(["--run-dir", str(a), "--input", src, "--record"])
    err = capsys.readouterr().err
    assert code == 2 and "--record" in err and "--reference" in err, err
    assert (a / "metrics.jsonl").read_text(encoding="utf-8") == after_a
    # a last line cut short (a run killed while writing it): cut off, and the score is a
    # line of its own, which the plots and a --resume keep
    with open(a / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"update": 130, "lo')
    assert translate_cli.main(flags) == 0
    capsys.readouterr()
    lines = (a / "metrics.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)
    assert "".join(lines[:-1]) == after_a and json.loads(lines[-1])["recorded_by"]
    assert abs(plots.read_test(str(a / "metrics.jsonl"))["test_bleu"] - bleu) < 0.005
    from minitransformer.mt.rundir import RunDir
    RunDir(str(a)).trim_metrics(120)
    assert (a / "metrics.jsonl").read_text(encoding="utf-8") == "".join(lines)


def test_translate_py_record_of_picked_checkpoints_is_at_the_newest_ones_update(runs, tmp_path,
                                                                                 capsys):
    """--record with --checkpoint: the score is recorded at the update and training time at
    which the newest checkpoint picked was saved (what its meta says), not at the run's end."""
    import json
    import shutil

    from minitransformer.mt import plots
    base, src, _ = runs
    a = tmp_path / "a"
    shutil.copytree(base / "a", a)
    (a / "metrics.jsonl").write_text(json.dumps({"update": 120, "loss": 3.0, "time": 700.0})
                                     + "\n", encoding="utf-8")
    params, _, meta = ckpt.load_checkpoint(str(a / "checkpoint_last.npz"), optimizer=False)
    model = Transformer(TransformerConfig.from_dict(meta["config"]))
    model.load_state_dict(params)
    for update, seconds in ((40, 250.0), (80, 500.0)):
        ckpt.save_checkpoint(str(a / f"checkpoint_{update}.npz"), model, None,
                             {**meta, "update": update, "train_time": seconds})
    ref = tmp_path / "ref.txt"
    ref.write_text(open(src, encoding="utf-8").read(), encoding="utf-8")
    # the best checkpoint (saved at update 40 here) is the run's choice after all its
    # validations: at the run's end, as when translate.py picks it itself
    ckpt.save_checkpoint(str(a / "checkpoint_best.npz"), model, None,
                         {**meta, "update": 40, "train_time": 250.0})
    for picked, update, seconds in ((["checkpoint_40.npz"], 40, 250.0),
                                    (["checkpoint_80.npz", "checkpoint_40.npz"], 80, 500.0),
                                    (["checkpoint_last.npz"], 120, 700.0),  # (no update kept)
                                    (["checkpoint_best.npz"], 120, 700.0), ([], 120, 700.0)):
        flags = ["--checkpoint", *(str(a / p) for p in picked)] if picked else []
        assert translate_cli.main(["--run-dir", str(a), "--input", src, "--reference", str(ref),
                                   "--workers", "1", "--record", *flags]) == 0, \
            capsys.readouterr().err
        capsys.readouterr()
        test = plots.read_test(str(a / "metrics.jsonl"))
        assert (test["update"], test["time"]) == (update, seconds), (picked, test)
