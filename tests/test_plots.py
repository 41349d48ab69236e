"""Learning curves and attention heatmaps (minitransformer.mt.plots).

Tests that draw need matplotlib (pip install -e .[plot], also in the test extra) and skip
without it; the error paths and the attention maps themselves are tested either way.
"""
import json
import os
import re
import sys

import numpy as np
import pytest

from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt import plots
from minitransformer.mt import translate as translate_cli
from minitransformer.nn.transformer import Transformer, TransformerConfig

from conftest import synthetic_tokenizer

PNG = b"\x89PNG\r\n\x1a\n"
N_LAYERS, N_HEADS = 1, 2
MAX_LEN_A = 3  # an untrained model never stops by itself: keep its outputs (and figures) short


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """An untrained tiny Transformer and a 100-piece tokenizer from synthetic text."""
    d = tmp_path_factory.mktemp("tiny")
    tok, corpus = synthetic_tokenizer(d, n_valid=4)
    cfg = TransformerConfig(vocab_size=tok.vocab_size, d_model=16, n_heads=N_HEADS, d_ff=32,
                            n_layers=N_LAYERS, pad_id=tok.pad_id, bos_id=tok.bos_id,
                            eos_id=tok.eos_id)
    return Transformer(cfg, seed=3), tok, corpus["valid"][0], d


def attention_stores(model):
    return ([layer.self_attn.store for layer in model.encoder]
            + [m.store for layer in model.decoder for m in (layer.self_attn, layer.cross_attn)])


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


# ----------------------------------------------------------------------------- attention maps

def test_attention_maps_shapes_and_labels_use_the_pieces(tiny):
    model, tok, lines, _ = tiny
    model.train()
    rec = plots.attention_maps(model, tok, lines[0], max_len_a=MAX_LEN_A)
    src_ids = tok.encode([lines[0]])[0]
    assert rec["src_ids"] == src_ids
    assert rec["src_labels"] == tok.encode_as_pieces(lines[0]) + ["</s>"]
    assert rec["tgt_labels"] == ["<s>"] + [tok.id_to_piece(i) for i in rec["out_ids"]]
    assert 1 <= len(rec["out_ids"]) <= len(src_ids) + 1 + MAX_LEN_A
    S, T = len(rec["src_labels"]), len(rec["tgt_labels"])
    expected = {"encoder.0.self_attn": (N_HEADS, S, S), "decoder.0.self_attn": (N_HEADS, T, T),
                "decoder.0.cross_attn": (N_HEADS, T, S)}
    assert {k: v.shape for k, v in rec["maps"].items()} == expected
    for name, p in rec["maps"].items():  # probabilities: rows sum to 1
        err = np.abs(p.sum(-1) - 1).max()
        assert err < 1e-5, f"{name}: rows sum to 1 within {err:.2e}"
    assert np.all(np.triu(rec["maps"]["decoder.0.self_attn"], k=1) == 0), "decoder is causal"
    assert all(s is None for s in attention_stores(model)), "recording is switched off again"
    assert model.training, "the model's mode is restored"


def test_attention_labels():
    class Pieces:
        def id_to_piece(self, i):
            return f"p{i}"
    src, tgt = plots.attention_labels(Pieces(), [5, 6], [7, 8, 9])
    assert src == ["p5", "p6", "</s>"]
    assert tgt == ["<s>", "p7", "p8", "p9"]


def test_plot_attention_writes_one_png_per_sentence_layer_and_kind(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model, tok, lines, _ = tiny
    out = tmp_path / "attn"
    files = plots.plot_attention(model, tok, lines[:3], str(out), max_sentences=2,
                                 max_len_a=MAX_LEN_A)
    assert "plotting the first 2 of 3 sentences" in capsys.readouterr().err
    kinds = ("enc-self", "dec-self", "enc-dec")
    assert [os.path.basename(f) for f in files] == [
        f"sent{n}_{k}_layer{i}.png" for n in (1, 2) for i in range(N_LAYERS) for k in kinds]
    assert len(files) == 2 * N_LAYERS * len(kinds)
    for f in files:
        assert is_png(f) and os.path.getsize(f) > 1000, f
    assert (out / "sent1.txt").read_text(encoding="utf-8").startswith(f"source: {lines[0]}\n")


def test_heads_figure_ticks_are_the_labels():
    pytest.importorskip("matplotlib")
    maps = np.full((3, 2, 4), 0.25)
    fig = plots._heads_figure(maps, ["<s>", "▁Hund"], ["▁the", "▁dog", "s", "</s>"],
                              "title", "enc-dec layer 0")
    axes = [ax for ax in fig.axes if ax.images]
    assert len(axes) == 3
    ax = axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["▁the", "▁dog", "s", "</s>"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["<s>", "▁Hund"]
    assert ax.get_title() == "enc-dec layer 0, head 0"


# ----------------------------------------------------------------------------- translate.py

@pytest.fixture(scope="module")
def run_dir(tiny):
    """A run directory translate.py can load: spm.model and checkpoint_last.npz."""
    model, tok, _, d = tiny
    run = d / "run"
    run.mkdir()
    (run / "spm.model").write_bytes(open(tok.model_path, "rb").read())
    ckpt.save_checkpoint(str(run / "checkpoint_last.npz"), model, None,
                         {"spm_sha256": ckpt.file_sha256(str(run / "spm.model"))})
    return run


def test_translate_plot_attention(run_dir, tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    _, _, lines, _ = tiny
    src = tmp_path / "in.txt"
    # empty lines are left out; the files are named by the input's line numbers
    src.write_text(f"\n{lines[0]}\n\n\n{lines[1]}\n", encoding="utf-8")
    out = tmp_path / "attn"
    assert translate_cli.main(["--run-dir", str(run_dir), "--input", str(src), "--beam", "1",
                               "--max-len-a", str(MAX_LEN_A), "--plot-attention", str(out)]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 5  # translations are still printed
    assert sorted(p for p in os.listdir(out) if p.endswith(".png")) == sorted(
        f"sent{n}_{k}_layer0.png" for n in (2, 5) for k in ("enc-self", "dec-self", "enc-dec"))
    for n, line in ((2, lines[0]), (5, lines[1])):
        assert (out / f"sent{n}.txt").read_text(encoding="utf-8").startswith(
            f"source: {line}\n")


def test_translate_without_matplotlib_says_how_to_install(run_dir, tiny, tmp_path, monkeypatch,
                                                          capsys):
    _, _, lines, _ = tiny
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    src = tmp_path / "in.txt"
    src.write_text(lines[0] + "\n", encoding="utf-8")
    code = translate_cli.main(["--run-dir", str(run_dir), "--input", str(src),
                               "--plot-attention", str(tmp_path / "attn")])
    assert code == 2
    assert "pip install -e .[plot]" in capsys.readouterr().err


# ----------------------------------------------------------------------------- curves

def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


RECORDS = ([{"update": u, "epoch": 0, "loss": 6.0 / u ** 0.3, "ppl": 1.0, "lr": 1e-3,
             "tokens_per_s": 1000.0} for u in (1, 50, 100, 150, 200)]
           + [{"update": u, "valid_loss": 4.0 / u ** 0.2, "valid_ppl": 1.0, "valid_bleu": b}
              for u, b in ((100, 1.5), (200, 4.0))])


def test_read_metrics_splits_and_deduplicates(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, RECORDS + [{"update": 100, "loss": 9.0}])  # a resumed run logs it again
    train, valid = plots.read_metrics(str(path))
    assert [r["update"] for r in train] == [1, 50, 100, 150, 200]
    assert train[2]["loss"] == 9.0
    assert [(r["update"], r["valid_bleu"]) for r in valid] == [(100, 1.5), (200, 4.0)]


def test_plot_curves_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    write_metrics(path, RECORDS)
    out = tmp_path / "pics" / "curves.png"
    assert plots.plot_curves(str(path), str(out)) == str(out)
    assert is_png(out) and out.stat().st_size > 5000
    fig_default = path.parent / "curves.png"
    assert plots.main(["--run-dir", str(path.parent)]) == 0
    assert is_png(fig_default)
    assert f"wrote {fig_default}" in capsys.readouterr().out


def test_curves_errors_name_the_file(tmp_path, capsys):
    missing = tmp_path / "nope" / "metrics.jsonl"
    with pytest.raises(plots.PlotError, match=rf"{missing}: no such metrics file"):
        plots.plot_curves(str(missing), str(tmp_path / "c.png"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(plots.PlotError, match=rf"{empty}: no training or validation records"):
        plots.read_metrics(str(empty))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"update": 1, "loss": 2.0}\n{oops\n', encoding="utf-8")
    with pytest.raises(plots.PlotError, match=rf"{bad}, line 2: not JSON"):
        plots.read_metrics(str(bad))
    # other damage: a byte that is not UTF-8, an update or a drawn number of another type
    for line, words in ((b'{"update": 2, "loss": 1.5, "x": "\xff"}', "not UTF-8"),
                        (b'{"update": null, "loss": 1.5}', "its update is None, not a whole"),
                        (b'{"update": "3", "loss": 1.5}', "its update is '3', not a whole"),
                        (b'{"update": 3, "loss": "1.5"}', "its loss is '1.5', not a number"),
                        (b'{"update": 3, "valid_bleu": true}', "its valid_bleu is True")):
        bad.write_bytes(b'{"update": 1, "loss": 2.0}\n' + line + b"\n")
        with pytest.raises(plots.PlotError, match=rf"{bad}, line 2: {re.escape(words)}"):
            plots.read_metrics(str(bad))
        assert plots.main(["--metrics", str(bad), "--output", str(tmp_path / "c.png")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}, line 2: ") and "damaged" in err, err
    assert plots.main(["--metrics", str(missing), "--output", str(tmp_path / "c.png")]) == 2
    assert f"error: {missing}: no such metrics file" in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_a_record_cut_short_at_the_end_is_skipped(tmp_path):
    # a run killed while logging leaves its last line unfinished (no newline): the plot
    # draws the rest, as --resume drops that line; a bad line inside still stops it
    cut = tmp_path / "metrics.jsonl"
    cut.write_text('{"update": 1, "loss": 2.0}\n{"update": 2, "lo', encoding="utf-8")
    train, _ = plots.read_metrics(str(cut))
    assert [r["update"] for r in train] == [1]


def test_an_output_that_cannot_be_written_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "metrics.jsonl"
    write_metrics(path, RECORDS)
    (tmp_path / "a_file").write_text("x")
    for output, code, words in ((tmp_path / "curves", 2, "give the name of a .png file"),
                                (tmp_path, 2, "give the name of a .png file"),
                                (tmp_path / "a_file" / "c.png", 1, "cannot write")):
        assert plots.main(["--metrics", str(path), "--output", str(output)]) == code, output
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["a_file", "metrics.jsonl"]


# ----------------------------------------------------------------------------- budgets

def _budget_run(root, name, minutes, test_bleu=None, ensemble=None):
    run = root / name
    run.mkdir()
    records = [{"update": u, "valid_loss": 3.0, "valid_bleu": b, "time": 60.0 * m}
               for u, b, m in ((100, 5.0, minutes / 3), (200, 9.0, 2 * minutes / 3),
                               (300, 11.0, minutes))]
    if test_bleu is not None:
        records.append({"update": 300, "test_split": "test2016", "test_bleu": test_bleu,
                        "test_signature": "nrefs:1", "test_checkpoints": "average of 5",
                        "beam": 4, "alpha": 1.4, "time": 60.0 * minutes})
    if ensemble:  # (translate.py --record's, after train.py's)
        records.append({**records[-1], "test_bleu": ensemble, "ensemble": ["a", "b"]})
    write_metrics(run / "metrics.jsonl", records)
    return str(run)


def test_plot_budgets_draws_bleu_against_minutes(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    runs = [_budget_run(tmp_path, "m15", 15, 30.5), _budget_run(tmp_path, "m30", 30, 35.0),
            _budget_run(tmp_path, "unscored", 20), _budget_run(tmp_path, "pair", 25, 33.0, 34.2)]
    assert plots.read_test(os.path.join(runs[1], "metrics.jsonl"))["test_bleu"] == 35.0
    assert plots.read_test(os.path.join(runs[3], "metrics.jsonl"))["test_bleu"] == 34.2
    assert plots.read_test(os.path.join(runs[2], "metrics.jsonl")) is None
    out = tmp_path / "pics" / "budgets.png"
    assert plots.main(["--runs", *runs, "--output", str(out)]) == 0
    assert is_png(out) and out.stat().st_size > 5000
    assert f"wrote {out}" in capsys.readouterr().out
    missing = str(tmp_path / "nope")
    assert plots.main(["--runs", runs[0], missing, "--output", str(tmp_path / "b.png")]) == 2
    assert f"{missing}/metrics.jsonl: no such metrics file" in capsys.readouterr().err


def test_budget_lines_join_only_scores_of_one_kind():
    # (minutes, BLEU, models): pairs and ensembles of three at several budgets, one single
    ends = [(30, 37.3, 2), (15, 31.4, 2), (59, 40.6, 3), (15, 32.0, 3), (59, 40.0, 2),
            (20, 28.0, 1)]
    assert plots.budget_lines(ends) == {1: [(20, 28.0)],
                                        2: [(15, 31.4), (30, 37.3), (59, 40.0)],
                                        3: [(15, 32.0), (59, 40.6)]}
    assert plots.budget_lines([]) == {}


def test_train_logs_its_test_score_for_the_budget_plot(tmp_path):
    from minitransformer.mt import train as train_cli
    run = str(tmp_path / "run")
    assert train_cli.main(["--synthetic-pairs", "1500", "--d-model", "32", "--n-heads", "2",
                           "--d-ff", "64", "--max-tokens", "600", "--vocab-size", "120",
                           "--no-progress", "--warmup", "50", "--valid-bleu-sentences", "20",
                           "--max-updates", "20", "--run-dir", run, "--beam", "2"]) == 0
    test = plots.read_test(os.path.join(run, "metrics.jsonl"))
    assert test["test_split"] == "test" and test["beam"] == 2 and test["update"] == 20
    assert 0.0 <= test["test_bleu"] <= 100.0 and "nrefs:1" in test["test_signature"]
    assert test["time"] > 0
