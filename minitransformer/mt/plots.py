"""Pictures of a run: learning curves from metrics.jsonl, and attention heatmaps.

    python -m minitransformer.mt.plots --run-dir runs/ende              # -> runs/ende/curves.png
    python -m minitransformer.mt.plots --metrics runs/ende/metrics.jsonl --output curves.png
    python -m minitransformer.mt.plots --runs runs/m15 runs/m30 runs/m60 --output budgets.png
    python translate.py --run-dir runs/ende --input some.en --plot-attention attn/

matplotlib is optional (``pip install -e .[plot]``). Figures are drawn on matplotlib's
non-interactive Agg canvas directly (no pyplot), so nothing changes the backend or the global
state of a program (or notebook) that imports this module.

Attention maps come from the model itself: ``Transformer.set_attention_store`` makes every
attention module record its probabilities (B, H, T, S) during one teacher-forced forward pass.
"""
import argparse
import json
import math
import os
import sys

import numpy as np

from ..engine.tensor import no_grad
from .search import greedy_search

MAX_SENTENCES = 8  # plot_attention draws the first 8 sentences: 3 * n_layers files each
KINDS = (  # (store key pattern, file name part, title, query side, key side)
    ("encoder.{i}.self_attn", "enc-self", "encoder self-attention", "src", "src"),
    ("decoder.{i}.self_attn", "dec-self", "decoder self-attention", "tgt", "tgt"),
    ("decoder.{i}.cross_attn", "enc-dec", "encoder-decoder attention", "tgt", "src"),
)


class PlotError(RuntimeError):
    """matplotlib is missing, or the input to plot is missing or unreadable (named in the text)."""


def _figure(width, height, layout=None):
    """A matplotlib Figure on an Agg canvas (PNG output, no display, no pyplot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError("plotting needs matplotlib, which is not installed: "
                        "pip install -e .[plot]  (or: pip install matplotlib)") from None
    fig = Figure(figsize=(width, height), layout=layout)
    FigureCanvasAgg(fig)
    return fig


# ----------------------------------------------------------------------------- learning curves

# the fields the plots draw, which must be numbers where a record has them
NUMBERS = ("loss", "valid_loss", "valid_bleu", "test_bleu", "time")


def _records(path):
    """The JSON records of a metrics.jsonl, in order (blank lines skipped)."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such metrics file (train.py writes RUN_DIR/metrics.jsonl)")
    with open(path, "rb") as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        damaged = (f"{path}, line {number}: {{}}; the file is damaged: remove that line (or "
                   "restore the file)")
        try:
            rec = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            if number == len(lines) and not line.endswith(b"\n"):
                continue  # a record cut short by a kill (train.py --resume drops it too)
            what = "not UTF-8" if isinstance(exc, UnicodeDecodeError) else f"not JSON ({exc.msg})"
            raise PlotError(damaged.format(what)) from None
        if not isinstance(rec, dict) or "update" not in rec:
            continue
        if not _is_number(rec["update"], whole=True):
            raise PlotError(damaged.format(f"its update is {rec['update']!r}, not a whole number"))
        for key in NUMBERS:
            if key in rec and not _is_number(rec[key]):
                raise PlotError(damaged.format(f"its {key} is {rec[key]!r}, not a number"))
        yield rec


def _is_number(value, whole=False):
    return not isinstance(value, bool) and isinstance(value, int if whole else (int, float))


def read_metrics(path):
    """metrics.jsonl -> (train, valid): lists of records sorted by update.

    Training records have "loss"; validation records have "valid_loss" and "valid_bleu". A
    resumed run may log an update twice; the later record wins.
    """
    train, valid = {}, {}
    for rec in _records(path):
        if "loss" in rec:
            train[rec["update"]] = rec
        if "valid_loss" in rec:
            valid[rec["update"]] = rec
    if not train and not valid:
        raise PlotError(f"{path}: no training or validation records (is the file empty, or "
                        "did the run stop before its first logged update?)")
    return [train[u] for u in sorted(train)], [valid[u] for u in sorted(valid)]


def plot_curves(metrics_path, out_png):
    """Loss (training and validation) and validation BLEU against updates -> ``out_png``."""
    train, valid = read_metrics(metrics_path)
    fig = _figure(11, 4)
    ax_loss, ax_bleu = fig.subplots(1, 2)
    if train:
        ax_loss.plot([r["update"] for r in train], [r["loss"] for r in train],
                     label="training", lw=1)
    if valid:
        ax_loss.plot([r["update"] for r in valid], [r["valid_loss"] for r in valid], "o-",
                     label="validation", ms=3)
        ax_bleu.plot([r["update"] for r in valid], [r.get("valid_bleu", math.nan) for r in valid],
                     "o-", color="C2", ms=3)
    else:
        ax_bleu.text(0.5, 0.5, "no validation records", ha="center", va="center",
                     transform=ax_bleu.transAxes)
    ax_loss.set(xlabel="update", ylabel="loss per target token (label-smoothed)", title="loss")
    ax_loss.legend()
    ax_bleu.set(xlabel="update", ylabel="BLEU", title="validation BLEU (greedy)")
    for ax in (ax_loss, ax_bleu):
        ax.grid(alpha=0.3)
    fig.suptitle(metrics_path, fontsize=9)
    fig.tight_layout()
    if os.path.dirname(os.path.abspath(out_png)):
        os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def read_test(path):
    """The last test score on a run's record: train.py's at the end of the run, or a later
    `translate.py --record` one (a record with "test_bleu": split, BLEU, signature,
    checkpoints, beam, alpha, training seconds; "ensemble": the runs, for an ensemble's), or
    None for a run that has not been scored."""
    tests = [rec for rec in _records(path) if "test_bleu" in rec]
    return tests[-1] if tests else None


def budget_lines(ends):
    """(minutes, BLEU, models) of each scored run -> {models: [(minutes, BLEU), ...] by
    minutes}: one line per kind of score, single models (1) or ensembles of ``models``, so
    that a line joins only scores of one recipe."""
    lines = {}
    for minutes, bleu, models in sorted(ends):
        lines.setdefault(models, []).append((minutes, bleu))
    return lines


def plot_budgets(run_dirs, out_png):
    """BLEU against minutes of training for runs of different --max-time budgets -> out_png:
    each run's validation BLEU (greedy) as it trained, and its last test BLEU on record
    (train.py's final score, or a later `translate.py --record` one, an ensemble's say) at
    the minute its training ended; the test scores of the same kind (single models, or
    ensembles of as many models) joined across the runs (``budget_lines``)."""
    fig = _figure(8, 4.5)
    ax = fig.subplots()
    ends = []
    for i, run in enumerate(run_dirs):
        path = os.path.join(run, "metrics.jsonl")
        _, valid = read_metrics(path)
        test = read_test(path)
        name = os.path.basename(os.path.normpath(run))
        ax.plot([r["time"] / 60 for r in valid if "time" in r],
                [r.get("valid_bleu", math.nan) for r in valid if "time" in r], "o-", ms=3,
                lw=1, color=f"C{i}", alpha=0.6, label=f"{name}: validation (greedy)")
        if test is not None:
            minutes = test["time"] / 60
            models = len(test.get("ensemble") or ()) or 1
            ends.append((minutes, test["test_bleu"], models))
            scored = f"ensemble of {models}, " if test.get("ensemble") else ""
            ax.plot([minutes], [test["test_bleu"]], "*", ms=12, color=f"C{i}",
                    label=f"{name}: {test['test_split']} {test['test_bleu']:.1f} "
                          f"({scored}beam {test['beam']}, {minutes:.0f} min)")
            ax.annotate(f"{test['test_bleu']:.1f}", (minutes, test["test_bleu"]),
                        textcoords="offset points", xytext=(6, -12), fontsize=8)
    for models, points in budget_lines(ends).items():
        if len(points) > 1:
            ax.plot([m for m, _ in points], [b for _, b in points], color="k", lw=0.8,
                    ls=("--", ":", "-.")[min(models, 3) - 1])  # single, pairs, more
    ax.set(xlabel="minutes of training", ylabel="BLEU", title="BLEU against training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    if os.path.dirname(os.path.abspath(out_png)):
        os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


# ----------------------------------------------------------------------------- attention maps

def attention_labels(tokenizer, src_ids, out_ids):
    """Axis labels: source pieces + "</s>" (encoder side), "<s>" + output pieces (decoder
    queries: the tokens fed to the decoder, each predicting the next one)."""
    src = [tokenizer.id_to_piece(i) for i in src_ids] + ["</s>"]
    tgt = ["<s>"] + [tokenizer.id_to_piece(i) for i in out_ids]
    return src, tgt


def record_attention_pass(model, src_ids, out_ids):
    """The attention of one teacher-forced pass over source ``src_ids`` + EOS and decoder
    input BOS + ``out_ids``, in eval mode (no dropout), the model's mode restored after:
    -> {"encoder.{i}.self_attn": (H, S, S), "decoder.{i}.self_attn": (H, T, T),
    "decoder.{i}.cross_attn": (H, T, S)} host arrays, S = len(src_ids) + 1, T = len(out_ids) + 1.
    """
    cfg = model.cfg
    src = np.array([list(src_ids) + [cfg.eos_id]], dtype=np.int64)  # (1, S)
    tgt_in = np.array([[cfg.bos_id] + list(out_ids)], dtype=np.int64)  # (1, T)
    was_training, store = model.training, {}
    try:
        model.eval()
        model.set_attention_store(store)
        with no_grad():
            memory, src_mask = model.encode(src)
            model.decode(tgt_in, memory, src_mask)
    finally:
        model.set_attention_store(None)
        model.train(was_training)
    return {name: arrays[0][0] for name, arrays in store.items()}  # one pass: row 0


def attention_maps(model, tokenizer, line, max_len_a=50):
    """Translate ``line`` greedily (at most source length + ``max_len_a`` tokens), then record
    the attention of one teacher-forced pass.

    -> {"source": line, "src_ids", "out_ids", "src_labels" (S,), "tgt_labels" (T,),
        "maps": {"encoder.{i}.self_attn": (H, S, S), "decoder.{i}.self_attn": (H, T, T),
                 "decoder.{i}.cross_attn": (H, T, S)}}
    with S = source pieces + EOS and T = BOS + output pieces.
    """
    src_ids = tokenizer.encode([line])[0]
    src = np.array([src_ids + [model.cfg.eos_id]], dtype=np.int64)  # (1, S)
    was_training = model.training
    out_ids = greedy_search(model, src, max_len_a=max_len_a)[0]  # (switches to eval mode)
    model.train(was_training)
    maps = record_attention_pass(model, src_ids, out_ids)
    src_labels, tgt_labels = attention_labels(tokenizer, src_ids, out_ids)
    return {"source": line, "src_ids": src_ids, "out_ids": out_ids, "src_labels": src_labels,
            "tgt_labels": tgt_labels, "maps": maps}


def _heads_figure(maps, ylabels, xlabels, title, head_title):
    """One figure: a grid of heatmaps, one per head, maps (H, Tq, Tk), rows = queries.

    One colour scale for all heads of the figure, from 0 to their largest weight (with a
    colour bar), so weak heads stay visible and heads stay comparable.
    """
    H = maps.shape[0]
    ncols = min(H, 4)
    nrows = math.ceil(H / ncols)
    cell = 0.25  # inches per token
    w = max(3.0, cell * len(xlabels) + 1.2)  # + tick labels
    h = max(3.0, cell * len(ylabels) + 1.6)  # + tick labels and the head's title
    fig = _figure(w * ncols + 1.0, h * nrows + 0.8, layout="constrained")  # + colour bar, title
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    vmax = float(maps.max()) or 1.0
    for head, ax in enumerate(axes):
        if head >= H:
            ax.axis("off")
            continue
        im = ax.imshow(maps[head], cmap="viridis", vmin=0.0, vmax=vmax, aspect="equal",
                       interpolation="nearest")
        ax.set_xticks(range(len(xlabels)))
        ax.set_xticklabels(xlabels, rotation=90, fontsize=8)
        ax.set_yticks(range(len(ylabels)))
        ax.set_yticklabels(ylabels, fontsize=8)
        ax.set_title(f"{head_title}, head {head}", fontsize=9)
    fig.colorbar(im, ax=list(axes), shrink=0.6, label="attention weight")
    fig.suptitle(title, fontsize=10)
    return fig


def plot_attention(model, tokenizer, lines, out_dir, max_sentences=MAX_SENTENCES, max_len_a=50,
                   numbers=None):
    """Attention heatmaps for the first ``max_sentences`` (8) non-empty ``lines`` -> list of
    PNG paths.

    Each sentence is translated greedily (``max_len_a`` as in translate.py), then its attention
    is recorded in one teacher-forced pass. Sentence n is ``numbers[i]`` for ``lines[i]``
    (translate.py: its line number in the input), by default its place among the non-empty
    lines (1, 2, ...). Per sentence n and layer i there are three PNGs, each a grid of the
    H heads:
        sent{n}_enc-self_layer{i}.png   encoder self-attention   (source x source)
        sent{n}_dec-self_layer{i}.png   decoder self-attention   (output x output, causal)
        sent{n}_enc-dec_layer{i}.png    encoder-decoder attention (output x source)
    Rows are queries, columns keys; each row sums to 1. Labels are sentencepiece pieces
    ("▁" starts a word). sent{n}.txt holds the sentence and its translation.
    """
    _figure(1, 1)  # fail on a missing matplotlib before translating anything
    numbered = [(n, line) for n, line in zip(numbers or range(1, len(lines) + 1), lines)
                if line.strip()]
    if numbers is None:  # (the n-th non-empty line)
        numbered = [(n, line) for n, (_, line) in enumerate(numbered, 1)]
    if not numbered:
        raise PlotError("plot_attention: no non-empty sentence to plot")
    if len(numbered) > max_sentences:
        print(f"plot_attention: plotting the first {max_sentences} of {len(numbered)} "
              "sentences", file=sys.stderr)
        numbered = numbered[:max_sentences]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for n, line in numbered:
        rec = attention_maps(model, tokenizer, line, max_len_a)
        labels = {"src": rec["src_labels"], "tgt": rec["tgt_labels"]}
        text = os.path.join(out_dir, f"sent{n}.txt")
        with open(text, "w", encoding="utf-8") as f:
            f.write(f"source: {line}\n"
                    f"translation (greedy): {tokenizer.decode([rec['out_ids']])[0]}\n")
        for i in range(model.cfg.n_layers):
            for key, part, title, q_side, k_side in KINDS:
                fig = _heads_figure(rec["maps"][key.format(i=i)], labels[q_side], labels[k_side],
                                    f"sentence {n}: {title}, layer {i}  (rows: queries, "
                                    f"columns: keys)\n{line}", f"{part} layer {i}")
                path = os.path.join(out_dir, f"sent{n}_{part}_layer{i}.png")
                fig.savefig(path, dpi=100)
                written.append(path)
    return written


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m minitransformer.mt.plots",
                                description="Plot training and validation loss and validation "
                                            "BLEU of a run against updates; or, with --runs, "
                                            "the BLEU of several runs against minutes.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--metrics", help="a run's metrics.jsonl")
    src.add_argument("--run-dir", help="a training run directory (reads RUN_DIR/metrics.jsonl)")
    src.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                     help="run directories (say, one per --max-time budget): validation and "
                          "test BLEU against minutes of training")
    p.add_argument("--output", help="PNG to write (default: curves.png next to metrics.jsonl; "
                                    "with --runs, budgets.png here)")
    args = p.parse_args(argv)
    if args.output is not None and (not args.output.lower().endswith(".png")
                                    or os.path.isdir(args.output)):
        print(f"error: --output {args.output}: give the name of a .png file to write",
              file=sys.stderr)
        return 2
    try:
        if args.runs:
            out = args.output or "budgets.png"
            plot_budgets(args.runs, out)
        else:
            metrics = args.metrics or os.path.join(args.run_dir, "metrics.jsonl")
            out = args.output or os.path.join(os.path.dirname(os.path.abspath(metrics)),
                                              "curves.png")
            plot_curves(metrics, out)
    except PlotError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # (the output's directory cannot be made, or the file written)
        from .fileio import describe_os_error
        print(f"error: cannot write {out}: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
