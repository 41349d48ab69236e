"""python -m minitransformer.export ctranslate2: the exported model decodes as our search does.

A tiny model is trained for a few seconds on the synthetic corpus, so that its outputs end
with EOS; its CTranslate2 export must then give our greedy outputs token for token, and our
beam search's outputs where the two searches are defined alike (minitransformer/export.py
says where they are not). Models with random weights check the mapping of every config,
by comparing log-probabilities of given targets (score_batch).
"""
import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minitransformer import ct2_spec, export
from minitransformer.engine.tensor import no_grad
from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt.search import beam_search
from minitransformer.mt.translate import load_model
from minitransformer.mt.translation import pad_batch, translate_ids
from minitransformer.nn.transformer import Transformer, TransformerConfig
from minitransformer.optim import Adam

from conftest import synthetic_tokenizer

ctranslate2 = pytest.importorskip("ctranslate2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_POSITIONS, MAX_LEN_A, UPDATES = 48, 5, 150  # two validation sources are cut


def _train(run, tok, corpus):
    """Train a tiny model on the short pairs of ``corpus`` (Adam, 150 updates of 16 pairs),
    saving periodic checkpoints at the last three saves and checkpoint_last.npz."""
    cfg = TransformerConfig(vocab_size=tok.vocab_size, d_model=32, n_heads=2, d_ff=64,
                            n_layers=2, dropout=0.0, max_positions=MAX_POSITIONS)
    model, rng = Transformer(cfg, seed=1), np.random.default_rng(0)
    pairs = [(s, t) for s, t in zip(tok.encode(corpus[0]), tok.encode(corpus[1]))
             if len(s) < 30 and len(t) < 30]
    opt, meta = Adam(model.parameters(), lr=3e-3), {"spm_sha256": ckpt.file_sha256(
        str(run / "spm.model"))}
    for update in range(1, UPDATES + 1):
        batch = [pairs[i] for i in rng.choice(len(pairs), 16, replace=False)]
        src = pad_batch([s + [cfg.eos_id] for s, _ in batch], cfg.pad_id)
        tgt = pad_batch([[cfg.bos_id] + t + [cfg.eos_id] for _, t in batch], cfg.pad_id)
        loss, n = model.loss(src, tgt[:, :-1], tgt[:, 1:])
        (loss * (1.0 / n)).backward()
        opt.step()
        opt.zero_grad()
        if update in (UPDATES - 20, UPDATES - 10, UPDATES):
            ckpt.save_checkpoint(str(run / f"checkpoint_{update}.npz"), model, None, meta)
    ckpt.save_checkpoint(str(run / "checkpoint_last.npz"), model, None, meta)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """-> (run directory, the validation sentences as id lists, its float32 export)."""
    d = tmp_path_factory.mktemp("export")
    tok, corpus = synthetic_tokenizer(d, n_valid=30)
    run = d / "run"
    run.mkdir()
    (run / "spm.model").write_bytes(open(tok.model_path, "rb").read())
    _train(run, tok, corpus["train"])
    out = export.export_ctranslate2(run, d / "ct2")
    return str(run), tok.encode(corpus["valid"][0]), out


def _translator(path):
    return ctranslate2.Translator(str(path), device="cpu", inter_threads=1, intra_threads=1)


def _ct2_search(path, tok, sources, beam, alpha=0.0, **extra):
    """CTranslate2's results for id lists ``sources``, batched by length (our maximum output
    length is per sentence), with translate_options -> results in input order."""
    translator, results = _translator(path), [None] * len(sources)
    for n in sorted({len(s) for s in sources}):
        rows = [i for i, s in enumerate(sources) if len(s) == n]
        options = export.translate_options(path, n, beam=beam, alpha=alpha, max_len_a=MAX_LEN_A)
        batch = [[tok.id_to_piece(t) for t in sources[i]] for i in rows]
        for i, r in zip(rows, translator.translate_batch(batch, **options, **extra)):
            results[i] = r
    return results


def _ids(tok, pieces):
    return [tok.sp.piece_to_id(p) for p in pieces]


def test_greedy_is_ours_token_for_token(trained):
    run, sources, out = trained
    model, tok, _ = load_model(run)
    ours = translate_ids(model, sources, beam=1, max_len_a=MAX_LEN_A)
    theirs = [_ids(tok, r.hypotheses[0]) for r in _ct2_search(out, tok, sources, beam=1)]
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not differ, [(i, ours[i], theirs[i]) for i in differ]
    # the comparison means something: most outputs end with EOS, some sources were cut
    limits = [min(min(len(s), MAX_POSITIONS - 1) + 1 + MAX_LEN_A, MAX_POSITIONS - 1)
              for s in sources]
    assert sum(len(h) < n for h, n in zip(ours, limits)) >= 0.8 * len(sources)
    assert max(len(s) for s in sources) > MAX_POSITIONS - 1


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.4])
def test_beam_with_the_power_length_penalty_is_ours(trained, alpha):
    # CTranslate2's length_penalty alpha divides by (tokens generated, EOS included) ** alpha,
    # as our 'power' does: the same best hypothesis for every source
    run, sources, out = trained
    model, tok, _ = load_model(run)
    ours = translate_ids(model, sources, beam=4, alpha=alpha, max_len_a=MAX_LEN_A,
                         length_penalty="power")
    theirs = [_ids(tok, r.hypotheses[0])
              for r in _ct2_search(out, tok, sources, beam=4, alpha=alpha)]
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    assert not differ, [(i, ours[i], theirs[i]) for i in differ]
    if alpha:  # the penalty decides: without it, some outputs change
        plain = translate_ids(model, sources, beam=4, alpha=0.0, max_len_a=MAX_LEN_A)
        assert plain != ours


def test_the_power_length_penalty_counts_eos(trained):
    # our score of the returned hypothesis is CTranslate2's: log P(Y, EOS | X) / (|Y| + 1) **
    # alpha (|Y| ** alpha when cut at the maximum length, with no EOS)
    run, sources, out = trained
    model, tok, _ = load_model(run)
    alpha = 0.6
    found = _ct2_search(out, tok, sources[:40], beam=4, alpha=alpha, return_scores=True)
    for src, result in zip(sources[:40], found):
        src = src[:MAX_POSITIONS - 1]
        (score, hyp), *_ = beam_search(model, pad_batch([src + [3]], 0), beam=4, alpha=alpha,
                                       max_len_a=MAX_LEN_A, length_penalty="power",
                                       return_all=True)[0]
        assert hyp == _ids(tok, result.hypotheses[0])
        assert abs(score - result.scores[0]) < 1e-4


def _randomise_norms_and_biases(params, rng):
    """LayerNorm gains and offsets and the biases drawn at random, so a misplaced one shows."""
    for name, p in params.items():
        if name.endswith(("gamma", "beta", "bias")):
            p[...] = rng.normal(1.0 if name.endswith("gamma") else 0.0, 0.3, p.shape)


def _random_run(path, spm_model, tweak=_randomise_norms_and_biases, **config):
    """A run directory with an untrained model of ``config`` (vocabulary of ``spm_model``),
    its parameters changed in place by ``tweak(params, rng)`` -> its path."""
    path.mkdir()
    (path / "spm.model").write_bytes(open(spm_model, "rb").read())
    cfg = TransformerConfig(**{**dict(vocab_size=100, d_model=16, n_heads=2, d_ff=32,
                                      n_layers=2, max_positions=40), **config})
    model = Transformer(cfg, seed=5)
    tweak({name: p.data for name, p in model.named_parameters()}, np.random.default_rng(5))
    ckpt.save_checkpoint(str(path / "checkpoint_last.npz"), model, None,
                         {"spm_sha256": ckpt.file_sha256(str(path / "spm.model"))})
    return path


def _max_score_difference(out, model, tok, seed=0):
    """Largest |CTranslate2 log P(y_t) - ours| over a few random source/target pairs."""
    rng = np.random.default_rng(seed)
    sources = [list(rng.integers(4, tok.vocab_size, n)) for n in (3, 9, 14)]
    targets = [list(rng.integers(4, tok.vocab_size, n)) for n in (6, 1, 11)]
    pieces = [[[tok.id_to_piece(i) for i in s] for s in side] for side in (sources, targets)]
    worst = 0.0
    for src, tgt, r in zip(sources, targets, _translator(out).score_batch(*pieces)):
        with no_grad():
            z = model.forward(pad_batch([src + [3]], 0), np.array([[2] + tgt])).data[0]
        z = z.astype(np.float64) - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        ours = logp[np.arange(len(tgt) + 1), tgt + [3]]
        worst = max(worst, float(np.abs(ours - np.array(r.log_probs)).max()))
    return worst


@pytest.mark.parametrize("config", [
    {},
    {"norm": "pre", "share_embeddings": False, "positions": "learned"},
    {"sinusoid_layout": "concat", "ln_eps": 0.5, "d_model": 30, "n_heads": 3, "n_layers": 1},
])
def test_every_mapped_config_scores_as_ours(trained, tmp_path, config):
    spm_model = os.path.join(trained[0], "spm.model")
    run = _random_run(tmp_path / "run", spm_model, **config)
    out = export.export_ctranslate2(run, tmp_path / "ct2")
    model, tok, _ = load_model(str(run))
    assert _max_score_difference(out, model, tok) < 1e-5
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["layer_norm_epsilon"] == pytest.approx(model.cfg.ln_eps)


def _favour_padding_then_bos(params, rng):
    """Every decoder output the same vector, whose best tokens are padding, BOS, then id 5."""
    params["dec_norm.gamma"][...], params["dec_norm.beta"][...] = 0.0, 1.0
    params["out_proj.weight"][...] = 0.0
    params["out_proj.weight"][:, [0, 2, 5]] = [3.0, 2.0, 1.0]  # logits 3D, 2D, D, 0, ...


def test_greedy_never_gives_padding_or_bos(trained, tmp_path):
    spm_model = os.path.join(trained[0], "spm.model")
    run = _random_run(tmp_path / "run", spm_model, _favour_padding_then_bos, norm="pre",
                      share_embeddings=False)
    out = export.export_ctranslate2(run, tmp_path / "ct2")
    model, tok, _ = load_model(str(run))
    sources = [[7, 8, 9], [10, 11, 12, 13, 14, 15]]
    ours = translate_ids(model, sources, beam=1, max_len_a=MAX_LEN_A)
    theirs = [_ids(tok, r.hypotheses[0]) for r in _ct2_search(out, tok, sources, beam=1)]
    assert ours == theirs == [[5] * (3 + 1 + MAX_LEN_A), [5] * (6 + 1 + MAX_LEN_A)]


def test_int8_export_loads_and_translates(trained, tmp_path):
    run, sources, f32 = trained
    out = export.export_ctranslate2(run, tmp_path / "int8", quantization="int8")
    assert os.path.getsize(os.path.join(out, "model.bin")) < \
        0.6 * os.path.getsize(os.path.join(f32, "model.bin"))
    model, tok, _ = load_model(run)
    ours = translate_ids(model, sources, beam=1, max_len_a=MAX_LEN_A)
    theirs = [_ids(tok, r.hypotheses[0]) for r in _ct2_search(out, tok, sources, beam=1)]
    assert all(h and tok.unk_id not in h for h in theirs)
    # an approximation, but of this model: most of its outputs begin as ours do
    assert sum(a[:3] == b[:3] for a, b in zip(ours, theirs)) >= 0.5 * len(sources)


def test_the_docstring_example_runs(trained):
    _, _, out = trained
    doc = export.__doc__
    example = textwrap.dedent(doc[doc.index("Usage"):doc.index("Mapping")].split("::", 1)[1])
    printed = []
    exec(example.replace("ende-ct2", out), {"print": printed.append})
    assert len(printed) == 1 and printed[0].strip()


def _export(*args):
    return subprocess.run([sys.executable, "-m", "minitransformer.export", "ctranslate2",
                           *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def _one_error_line(proc, *names):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for name in names:
        assert name in lines[0], lines[0]


def _with_config(src, dst, **changes):
    """Copy checkpoint ``src`` to ``dst`` with its stored model config changed."""
    with np.load(src, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    meta["config"].update(changes)
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(dst, **arrays)


@pytest.mark.parametrize("changes, field", [({"n_layers": 0}, "n_layers=0"),
                                            ({"norm": "sandwich"}, "norm='sandwich'"),
                                            ({"rope": True}, "'rope'")])
def test_unsupported_config_is_refused(trained, tmp_path, changes, field):
    bad = str(tmp_path / "bad.npz")
    _with_config(os.path.join(trained[0], "checkpoint_last.npz"), bad, **changes)
    proc = _export("--run-dir", trained[0], "--checkpoint", bad, "--output",
                   str(tmp_path / "out"))
    _one_error_line(proc, field, "config field")
    assert not os.path.exists(tmp_path / "out")
    assert [n for n in os.listdir(tmp_path) if n != "bad.npz"] == []  # no temporary left


@pytest.mark.parametrize("changes, words", [
    ({"max_positions": 1}, "max_positions=1"), ({"bos_id": 3}, "three different ids"),
    ({"pad_id": 100}, "pad_id=100 is outside"), ({"n_layers": "2"}, "n_layers='2' is not an"),
])
def test_what_cannot_be_exported_is_named(changes, words):
    config = dict(vars(TransformerConfig(vocab_size=100)), **changes)
    assert words in ct2_spec.unsupported(config)
    assert ct2_spec.unsupported(vars(TransformerConfig(vocab_size=100, norm="pre"))) is None


def _tree(path):
    out = {}
    for base, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(base, n), "rb") as f:
                out[os.path.relpath(os.path.join(base, n), path)] = \
                    hashlib.sha256(f.read()).hexdigest()
    return out


def test_existing_output_needs_force_and_the_run_is_untouched(trained, tmp_path, capsys):
    run, _, _ = trained
    before = _tree(run)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    # --force replaces only a CTranslate2 model directory, never an arbitrary one
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out), "--force"]) == 2
    assert "model.bin" in capsys.readouterr().err
    assert _tree(out) == {"notes.txt": hashlib.sha256(b"mine\n").hexdigest()}
    model_dir = tmp_path / "model"
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(model_dir)]) == 0
    (model_dir / "stale.txt").write_text("from an older export\n")
    proc = _export("--run-dir", run, "--output", str(model_dir))
    _one_error_line(proc, "--force")
    os.chmod(model_dir, 0o750)  # (a directory the user set up: replaced, it stays so)
    if os.geteuid() == 0:
        os.chown(model_dir, 1234, 5678)
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(model_dir),
                        "--force"]) == 0
    assert "stale.txt" not in os.listdir(model_dir) and "spm.model" in os.listdir(model_dir)
    st = os.stat(model_dir)
    assert stat.S_IMODE(st.st_mode) == 0o750
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert sorted(os.listdir(tmp_path)) == ["model", "out"]  # no temporary left
    assert _tree(run) == before


def test_output_paths_a_model_cannot_replace_are_refused_before_any_work(
        trained, tmp_path, monkeypatch, capsys):
    # the export renames a new directory into --output's place: an empty flag, the current
    # directory (or one above it) and a symbolic link are refused with one line, exit 2,
    # before the conversion, and what is there stays as it was
    run, _, model_dir = trained
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    before = _tree(model_dir)
    for output, words in (("", "--output is empty"), (".", "is the current directory"),
                          (str(tmp_path), "is the current directory or contains it"),
                          (str(link), "is a symbolic link")):
        assert export.main(["ctranslate2", "--run-dir", run, "--output", output,
                            "--force"]) == 2, output
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err
    assert os.listdir(here) == [] and sorted(os.listdir(tmp_path)) == ["here", "link"]
    assert _tree(model_dir) == before


def test_a_failed_replace_keeps_the_previous_model(trained, tmp_path, monkeypatch, capsys):
    # --force over a model: if the new one cannot be renamed into place and the old one
    # cannot be put back either, the old one stays where it was moved, and the error says
    # where (before, that copy was removed with the temporaries)
    run, _, _ = trained
    out = tmp_path / "model"
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out)]) == 0
    before = _tree(out)

    def fail(src, dst):
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(export.os, "replace", fail)
    monkeypatch.setattr(export.os, "rename", lambda src, dst, real=os.rename: (
        fail(src, dst) if os.path.basename(os.path.dirname(src)).startswith(".old-")
        else real(src, dst)))
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out), "--force"]) == 1
    err = capsys.readouterr().err
    kept = [p for p in os.listdir(tmp_path) if p.startswith(".old-")]
    assert len(kept) == 1 and not out.exists(), os.listdir(tmp_path)
    assert _tree(tmp_path / kept[0] / "model") == before
    assert f"is kept in {tmp_path / kept[0] / 'model'}" in err, err
    assert [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")] == []


def test_a_failed_replace_of_a_read_only_model_leaves_no_temporary(trained, tmp_path,
                                                                    monkeypatch):
    # a model directory of mode 0o555: the new model takes that mode only once it is in
    # place, so when moving the old one aside fails, the temporary is still writable and is
    # removed (with the mode copied first, rmtree could not empty it, except as root)
    run, _, _ = trained
    out = tmp_path / "model"
    assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out)]) == 0
    before = _tree(out)
    os.chmod(out, 0o555)
    modes = []

    def fail_moving_aside(src, dst):
        modes.extend(stat.S_IMODE(os.stat(tmp_path / p).st_mode)
                     for p in os.listdir(tmp_path) if p.startswith(".tmp-"))
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(export.os, "rename", fail_moving_aside)
    try:
        assert export.main(["ctranslate2", "--run-dir", run, "--output", str(out),
                            "--force"]) == 1  # (an OSError: as in the test above)
    finally:
        os.chmod(out, 0o755)
    umask = os.umask(0)
    os.umask(umask)
    assert modes == [0o777 & ~umask]  # (not the replaced directory's 0o555 yet)
    assert [p for p in os.listdir(tmp_path) if p.startswith((".tmp-", ".old-"))] == []
    assert _tree(out) == before


def test_average_last_exports_the_average(trained, tmp_path, capsys):
    run, _, _ = trained
    out = export.export_ctranslate2(run, tmp_path / "avg", average_last=3)
    assert "warning" not in capsys.readouterr().err
    # more than the run has (3 periodic checkpoints): those 3, and a warning that says so
    more = export.export_ctranslate2(run, tmp_path / "avg5", average_last=5)
    err = capsys.readouterr().err
    assert "warning: --average-last 5" in err and "has 3 periodic checkpoint(s)" in err, err
    with open(os.path.join(more, export.INFO_FILE), encoding="utf-8") as f:
        info = json.load(f)
    assert info["checkpoint"] == "average of 3 checkpoints"
    assert info["checkpoints"] == [os.path.abspath(p)
                                   for _, p in ckpt.periodic_checkpoints(run)]
    # with --checkpoint as well: the average is what is used, and a warning says so
    export.export_ctranslate2(run, tmp_path / "both", os.path.join(run, "checkpoint_last.npz"),
                              average_last=3)
    assert "is used instead of --checkpoint" in capsys.readouterr().err
    averaged, tok, what = load_model(run, average_last=3)
    last, _, _ = load_model(run)
    assert what == "average of 3 checkpoints"
    with open(os.path.join(out, export.INFO_FILE), encoding="utf-8") as f:
        assert json.load(f)["checkpoint"] == what
    assert _max_score_difference(out, averaged, tok) < 1e-5
    assert _max_score_difference(out, last, tok) > 1e-3  # not simply the last checkpoint


def test_importing_the_exporter_loads_nothing_heavy():
    code = ("import sys, minitransformer.export; "
            "print(sorted(m for m in ('numpy', 'ctranslate2') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr[-2000:]
