"""Inputs longer than the model's positions (issue 17, item 4): every line is translated.

A source longer than ``max_positions - 1`` pieces (the source gets an EOS) is cut, with a
warning naming the file and line; the output is capped at ``max_positions - 1`` tokens, so
decoding never runs past the positions; one output line per input line, always.
"""
import numpy as np
import pytest

from minitransformer.mt import translate as translate_cli
from minitransformer.mt.data import DataError, overlong_pairs
from minitransformer.mt.search import beam_search, greedy_search, output_limits
from minitransformer.mt.translation import (max_source_tokens, translate_ids, translate_lines,
                                            truncate_sources)

from conftest import synthetic_tokenizer, untrained_run

SHORT = 48  # max_positions of the small model: 47 source pieces + EOS


def _run_dir(path, tok, max_positions):
    """A run directory translate.py can load, with an untrained model (an untrained model
    never emits EOS by itself, so every output runs to its length limit)."""
    return untrained_run(path, tok, max_positions=max_positions)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    tok, corpus = synthetic_tokenizer(d, n_valid=40)
    short = _run_dir(d / "short", tok, SHORT)
    wide = _run_dir(d / "wide", tok, 1024)  # the default max_positions
    lines = [s for s in corpus["valid"][0] if len(tok.encode([s])[0]) < SHORT // 2]
    assert len(lines) >= 5
    return {"tok": tok, "lines": lines, "short": short, "wide": wide,
            "short_dir": str(d / "short"), "wide_dir": str(d / "wide")}


def _long_line(tok, lines, n_pieces):
    """A line of at least ``n_pieces`` pieces, made of repeated sentences."""
    line = lines[0]
    while len(tok.encode([line])[0]) < n_pieces:
        line = line + " " + lines[len(line) % len(lines)]
    return line


def test_a_too_long_line_in_the_middle_translates_every_line(setup, tmp_path, capsys):
    tok, lines = setup["tok"], setup["lines"]
    long = _long_line(tok, lines, 3 * SHORT)
    n_long = len(tok.encode([long])[0])
    src = tmp_path / "in.txt"
    src.write_text("\n".join([lines[1], lines[2], long, "", lines[3]]) + "\n", encoding="utf-8")
    code = translate_cli.main(["--run-dir", setup["short_dir"], "--input", str(src),
                               "--beam", "2", "--max-len-a", "5"])
    out, err = capsys.readouterr()
    assert code == 0, err
    out_lines = out.split("\n")[:-1]
    assert len(out_lines) == 5 and out_lines[3] == "" and all(out_lines[i] for i in (0, 1, 2, 4))
    warnings = [w for w in err.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 1, err
    assert f"{src}, line 3: {n_long} tokens" in warnings[0]
    assert f"translating the first {SHORT - 1}" in warnings[0]
    assert "Traceback" not in err


def test_the_truncated_line_is_translated_from_its_first_pieces(setup):
    model, tok, lines = setup["short"], setup["tok"], setup["lines"]
    ids = tok.encode([_long_line(tok, lines, 2 * SHORT)])[0]
    cut = []
    full = translate_ids(model, [ids, ids[:5]], beam=1, max_len_a=3,
                         on_truncate=lambda *a: cut.append(a))
    assert cut == [(0, len(ids), SHORT - 1)]
    assert full == translate_ids(model, [ids[:SHORT - 1], ids[:5]], beam=1, max_len_a=3)


def test_a_thousand_token_line_does_not_crash(setup, tmp_path, capsys):
    """Source 1000 + EOS fits 1024 positions; source + --max-len-a 50 would not: the output
    stops at 1023 tokens instead of decoding past the position table."""
    tok, lines, model = setup["tok"], setup["lines"], setup["wide"]
    long = _long_line(tok, lines, 1000)
    ids = tok.encode([long])[0]
    ids = ids[:1000]
    (out,) = translate_ids(model, [ids], beam=1, max_len_a=50)
    assert len(out) == 1023  # (untrained: never stops by itself)
    src = tmp_path / "in.txt"
    src.write_text(lines[1] + "\n" + _long_line(tok, lines, 1100) + "\n", encoding="utf-8")
    code = translate_cli.main(["--run-dir", setup["wide_dir"], "--input", str(src),
                               "--beam", "1"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.split("\n")[:-1]) == 2
    assert "line 2:" in err and "translating the first 1023" in err


@pytest.mark.parametrize("beam", [1, 3])
def test_the_output_length_cap_holds(setup, beam):
    model, tok, lines = setup["short"], setup["tok"], setup["lines"]
    ids = tok.encode(lines[:4] + [_long_line(tok, lines, 100)])
    outs = translate_ids(model, ids, beam=beam, max_len_a=10_000)
    assert all(0 < len(o) <= SHORT - 1 for o in outs)
    assert max(len(o) for o in outs) == SHORT - 1  # an untrained model runs to the cap
    src = np.array([[5] * (SHORT - 1) + [model.cfg.eos_id], [5, 6, model.cfg.eos_id] +
                    [model.cfg.pad_id] * (SHORT - 3)])
    assert output_limits(model, src, 0).tolist() == [SHORT - 1, 3]
    assert output_limits(model, src, 5).tolist() == [SHORT - 1, 8]
    search = greedy_search if beam == 1 else (lambda m, s, max_len_a: beam_search(
        m, s, beam=beam, max_len_a=max_len_a))
    assert [len(o) for o in search(model, src, max_len_a=10_000)] == [SHORT - 1] * 2


def test_translate_lines_reports_the_cut_lines(setup):
    model, tok, lines = setup["short"], setup["tok"], setup["lines"]
    long = _long_line(tok, lines, 2 * SHORT)
    cut = []
    hyps = translate_lines(model, tok, ["", long, lines[1], long], beam=1, max_len_a=2,
                           on_truncate=lambda i, n, kept: cut.append((i, n, kept)))
    n = len(tok.encode([long])[0])
    assert cut == [(1, n, SHORT - 1), (3, n, SHORT - 1)]
    assert len(hyps) == 4 and hyps[0] == "" and hyps[1] == hyps[3]
    assert max_source_tokens(model.cfg) == SHORT - 1


def test_truncate_sources_and_overlong_pairs():
    ids, cut = truncate_sources([[1, 2, 3], [4], []], 2)
    assert ids == [[1, 2], [4], []] and cut == [(0, 3, 2)]
    src = [[5] * 3, [5] * 4, [5], [5] * 9]
    tgt = [[6] * 3, [6], [6] * 4, [6]]
    # max_positions 4: a source of 3 + EOS fits, 4 + EOS does not; likewise BOS + target
    assert overlong_pairs(src, tgt, 4) == [1, 2, 3]
    assert overlong_pairs(src, tgt, 10) == []
    with pytest.raises(DataError):
        overlong_pairs(src, tgt[:2], 4)
