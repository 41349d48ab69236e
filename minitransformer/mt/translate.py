"""translate.py: translate text with a trained run, print detokenized output, optionally score.

    python translate.py --run-dir runs/default --input test.src > test.hyp
    echo "the small dog sees a cat" | python translate.py --run-dir runs/default
    python translate.py --run-dir runs/ende --input test2016.en --reference test2016.de \\
        --average-last 5
    python translate.py --run-dir runs/a --ensemble runs/b --average-last 5 --input test.en

Every input line gives one output line (an empty line an empty one). A line longer than the
model's positions is translated from its first pieces, with a warning naming the line.
With --ensemble, the models of several runs of one vocabulary decode together, each token
scored by the mean of their log-probabilities (ensemble.py).
"""
import argparse
import os
import signal
import stat
import sys

from .. import backend
from ..nn.transformer import Transformer, TransformerConfig
from . import checkpoint as ckpt
from .data import DataError, read_lines
from .ensemble import Ensemble
from .ranges import add_number
from .rundir import RunDir
from .tokenizer import Tokenizer
from .translation import (WorkerDied, add_bleu_tokenize, bleu_metric, corpus_bleu, cpu_count,
                          max_source_tokens, translate_lines)

USER_ERROR = 2     # a flag, a file or the run directory is wrong: the message says what to do
MACHINE_ERROR = 1  # the machine could not finish: out of memory, output not writable
INTERRUPTED = 128 + signal.SIGINT    # 130, as a shell reports a Ctrl-C
BROKEN_PIPE = 128 + signal.SIGPIPE   # 141, as a shell reports `... | head`


def check_bleu_tokenize(tokenize):
    """Refuse a --bleu-tokenize whose packages are missing (before any work): UsageError."""
    try:
        bleu_metric(tokenize)
    except ValueError as exc:
        raise UsageError(f"--bleu-tokenize {tokenize}: {exc}") from None


def add_search_flags(p):
    """--beam, --alpha, --length-penalty, --max-len-a: how translate.py (and the explorer)
    search."""
    add_number(p, "--beam", int, ">= 1", default=4, help="beam size; 1 = greedy")
    add_number(p, "--alpha", float, ">= 0", default=0.6,
               help="the length penalty's exponent (in --length-penalty's formula)")
    p.add_argument("--length-penalty", default="gnmt", choices=["gnmt", "power"],
                   help="gnmt: ((5 + length) / 6) ** alpha; power: length ** alpha with "
                        "EOS counted in the length, as fairseq and CTranslate2 count it "
                        "(default gnmt)")
    add_number(p, "--max-len-a", int, ">= 0", default=50,
               help="maximum output length = source length + this (never more than the "
                    "model's positions allow)")


def build_parser():
    p = argparse.ArgumentParser(prog="translate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the training run (config.json, spm.model, "
                                                    "checkpoints)")
    p.add_argument("--checkpoint", nargs="+", default=None,
                   help="checkpoint file(s); several are averaged (default: the run's best, "
                        "else last)")
    add_number(p, "--average-last", int, ">= 0", default=0,
               help="average the run's last N periodic checkpoints (the paper uses 5; "
                    "0 = don't)")
    p.add_argument("--ensemble", nargs="+", metavar="RUN_DIR", default=None,
                   help="more training runs whose models decode together with --run-dir's, "
                        "each token scored by the mean of their log-probabilities; each is "
                        "loaded as --run-dir is (--average-last N, else its best or last "
                        "checkpoint; --checkpoint is --run-dir's alone); all must share "
                        "--run-dir's spm.model")
    p.add_argument("--input", default="-", help="text file, one sentence per line "
                                                "(default '-' = stdin)")
    add_search_flags(p)
    add_number(p, "--max-tokens", int, ">= 1", default=4096, help="source tokens per batch")
    add_number(p, "--workers", int, ">= 0", default=0,
               help="processes that translate on the CPU, each with its share of the "
                    "input and cores / workers BLAS threads (same output as 1); "
                    "0 = one per core when the input fills more than one batch (default)")
    p.add_argument("--reference", help="reference file: print sacreBLEU and its signature "
                                       "to stderr")
    add_bleu_tokenize(p, "--reference's BLEU")
    p.add_argument("--record", action="store_true",
                   help="with --reference: also append the score to --run-dir's metrics.jsonl "
                        "as a test record (what train.py writes at the end of a run), which "
                        "`python -m minitransformer.mt.plots --runs` draws against minutes of "
                        "training; with --ensemble, the ensemble's score, at the minutes of "
                        "its longest-trained run; with periodic checkpoints given to "
                        "--checkpoint, at the update and minutes of the newest one")
    p.add_argument("--plot-attention", metavar="DIR",
                   help="write attention heatmaps (every layer and head) for the input "
                        "sentences into DIR (needs matplotlib: pip install -e .[plot])")
    p.add_argument("--device", default=None, help="cpu or cuda (default: $MINITRANSFORMER_DEVICE)")
    return p


class UsageError(Exception):
    """A mistake in the command line or its files: one line for the user, exit code 2."""


def load_model(run_dir, checkpoints=None, average_last=0, device="cpu"):
    """-> (model, tokenizer, description) from a run directory: the given checkpoint(s), or
    the run's choice (RunDir.choose_checkpoints); several are averaged.

    Raises ckpt.CheckpointError (a checkpoint missing, damaged or not the run's), DataError
    (spm.model unreadable) or RuntimeError / ValueError (``device`` unusable)."""
    rd = RunDir(run_dir)
    rd.require_spm_model()
    if average_last or not checkpoints:  # (--average-last wins over --checkpoint)
        checkpoints = rd.choose_checkpoints(average_last)
    try:
        params, meta, what = rd.load_params(checkpoints)
        config = TransformerConfig.from_dict(meta["config"])
    except ckpt.CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as exc:  # meta unreadable or without a config
        raise ckpt.CheckpointError(f"checkpoint {', '.join(checkpoints)} has no usable model "
                                   f"config ({type(exc).__name__}: {exc}); it is damaged or "
                                   "not a minitransformer checkpoint") from None
    tok = Tokenizer(rd.spm_model)
    rd.check_vocabulary(checkpoints[0], meta, tok.vocab_size)
    model = Transformer(config, device=device)
    try:
        model.load_state_dict(params)
    except (KeyError, ValueError) as exc:
        raise ckpt.CheckpointError(f"checkpoint {what}: its parameters do not fit its model "
                                   f"config ({str(exc).strip(chr(34))}); it is damaged or "
                                   "not a minitransformer checkpoint") from None
    model.eval()
    return model, tok, what


# ----------------------------------------------------------------------------- checks

def check_device(device, named):
    """-> the array module for ``device``; UsageError naming where it came from (``named``,
    from backend.chosen_device) when it cannot run."""
    try:
        return backend.get_xp(device)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(f"{named}: {exc}") from None


def check_run_dir(args):
    """Refuse a --run-dir, --ensemble run or --checkpoint that cannot be translated with,
    before any work. (The explorer and the exporter share it: their flags have no
    --ensemble.)"""
    ensemble = getattr(args, "ensemble", None)
    _check_one_run_dir(args.run_dir, "--run-dir", args)
    seen = {_model_files(args.run_dir, args, True): f"--run-dir {args.run_dir}"}
    for path in ensemble or ():
        _check_one_run_dir(path, "--ensemble", args)
        files = _model_files(path, args)
        if files in seen:
            raise UsageError(f"--ensemble {path}: the same model as {seen[files]} (the same "
                             "checkpoint files); a model in an ensemble with itself translates "
                             "as it does alone, in twice the time: give each model once")
        seen[files] = f"--ensemble {path}"
    if ensemble and getattr(args, "plot_attention", None):
        raise UsageError("--plot-attention draws one model's attention: leave out --ensemble "
                         "(or --plot-attention)")


def _model_files(path, args, main=False):
    """The checkpoint files (real paths, as a set) that make the model of run ``path``, as
    load_model chooses them: --checkpoint is --run-dir's alone."""
    if main and args.checkpoint and not args.average_last:
        files = args.checkpoint
    else:
        files = RunDir(path).choose_checkpoints(args.average_last)
    return frozenset(os.path.realpath(f) for f in files)


def _check_one_run_dir(path, flag, args):
    if not os.path.exists(path):
        raise UsageError(f"{flag} {path}: no such directory; give the directory train.py "
                         "wrote (its --run-dir)")
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: not a directory; give the directory train.py "
                         "wrote (its --run-dir), and a checkpoint file with --checkpoint")
    rd = RunDir(path)
    if not os.path.isfile(rd.spm_model):
        raise UsageError(f"{flag} {path}: no spm.model; is it a training run directory? "
                         "(train.py writes spm.model there before the first update)")
    if args.average_last:
        found = len(rd.periodic_checkpoints())
        if not found:
            raise UsageError(f"--average-last {args.average_last}: no checkpoint_<update>.npz "
                             f"in {path} yet (train.py writes one at each validation, or "
                             "every --save-every updates); wait for the run's first, or leave "
                             "out --average-last")
        if found < args.average_last:
            say(f"warning: --average-last {args.average_last}: {path} has {found} periodic "
                f"checkpoint(s) (checkpoint_<update>.npz); averaging those {found}")
        if args.checkpoint and flag == "--run-dir":
            say(f"warning: --average-last {args.average_last} is used instead of "
                f"--checkpoint {' '.join(args.checkpoint)}; give one of the two")
    elif args.checkpoint and flag == "--run-dir":
        for c in args.checkpoint:
            if not os.path.exists(c):
                raise UsageError(f"--checkpoint {c}: no such file; check the path")
            if not os.path.isfile(c):
                raise UsageError(f"--checkpoint {c}: not a file; give a checkpoint_*.npz file")
            try:
                ckpt.check_npz(c)
            except ckpt.CheckpointError as exc:
                raise UsageError(f"--checkpoint {exc}") from None
    elif not (os.path.isfile(rd.best) or os.path.isfile(rd.last)):
        raise UsageError(f"{flag} {path}: no checkpoint_best.npz or checkpoint_last.npz; "
                         "train first (or wait for the first save)"
                         + (", or give --checkpoint FILE" if flag == "--run-dir" else ""))
    if flag == "--ensemble":
        main_spm = RunDir(args.run_dir).spm_model
        if ckpt.file_sha256(rd.spm_model) != ckpt.file_sha256(main_spm):
            raise UsageError(f"--ensemble {path}: its spm.model differs from {main_spm}; the "
                             "models of an ensemble must share one vocabulary (train.py "
                             "builds the same one from the same --data and vocabulary flags)")


def check_plot_dir(path):
    """Make sure heatmaps can be written into ``path`` (created if missing) before any work."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--plot-attention {path}: exists and is not a directory; give a "
                         "directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--plot-attention {path}: cannot create the directory "
                         f"({exc.strerror or exc}); give a directory you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--plot-attention {path}: the directory is not writable; give a "
                         "directory you can write to")


def read_text(flag, path):
    """read_lines, its DataError as a UsageError naming ``flag``."""
    try:
        return read_lines(path)
    except DataError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _stdout_to_devnull():
    """Point file descriptor 1 at /dev/null, so that Python's flush at exit of what is left
    in sys.stdout's buffer cannot fail again (a broken pipe, a full disk)."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # no real stdout (a test's capture)
        pass


def say(message):
    """One line on stderr; nothing when stderr is closed (the exit code says the rest)."""
    if sys.stderr is None:  # (print(file=None) would write to stdout, into the output)
        return
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _error(message):
    say(f"error: {message}")


# ----------------------------------------------------------------------------- main

def translate(args):
    """The work of main (everything after parsing) -> exit code; raises UsageError."""
    if sys.stdout is None:
        raise UsageError("standard output is closed; the translations are written there: "
                         "redirect it to a file, e.g. `> out.txt`")
    device, named = backend.chosen_device(args.device)
    lines, refs = _check_and_read(args, device, named)
    # (--record: each run's training time, read before any work, so a run without it fails now)
    trained = _training_seconds(args) if args.record else None
    model, tok, what = load_for_translation(args, device)
    if args.plot_attention:
        _plot_inputs(args, model, tok, lines)
    warn = _truncation_warning(_input_name(args), model.cfg)
    hyps = translate_lines(model, tok, lines, on_truncate=warn, beam=args.beam,
                           alpha=args.alpha, max_len_a=args.max_len_a,
                           max_tokens=args.max_tokens, length_penalty=args.length_penalty,
                           workers=args.workers or cpu_count())
    if not _write_translations(hyps):
        return MACHINE_ERROR
    if refs is not None:
        bleu, sig = corpus_bleu(hyps, refs, args.bleu_tokenize)
        say(f"BLEU = {bleu:.2f}  ({what}, beam {args.beam})  {sig}")
        if args.record:
            _record_score(args, bleu, sig, what, *trained)
    return 0


def _training_seconds(args):
    """-> ([each run's training seconds], --run-dir's update), from the runs' metrics.jsonl:
    the last update and its time, as train.py records its test; for checkpoints picked with
    --checkpoint, those of the newest one picked (its meta says when it was saved), so a
    score of an earlier checkpoint is drawn at its own time; but checkpoint_best.npz, the
    run's choice after all its validations, at the run's end, as without --checkpoint.
    UsageError naming --record when a run has no record of time."""
    from .plots import PlotError, _records
    seconds, last_update = [], None
    for run in [args.run_dir, *(getattr(args, "ensemble", None) or ())]:
        path = os.path.join(run, "metrics.jsonl")
        try:
            timed = [rec for rec in _records(path) if "time" in rec]
        except PlotError as exc:
            raise UsageError(f"--record: {exc}") from None
        if not timed:
            raise UsageError(f"--record: {path} has no record of training time "
                             "(train.py writes one every --log-every updates)")
        seconds.append(max(rec["time"] for rec in timed))
        if last_update is None:
            last_update = max(rec["update"] for rec in timed)
    # (a periodic checkpoint or a copy of one; the best is the run's choice: the run's end)
    files = [] if args.average_last else args.checkpoint or ()
    picked = [] if any(os.path.basename(p) == "checkpoint_best.npz" for p in files) else \
        [ckpt.peek_meta(p) for p in files]
    if picked and all(isinstance(m.get("update"), int) and
                      isinstance(m.get("train_time"), (int, float)) for m in picked):
        newest = max(picked, key=lambda m: m["update"])
        seconds[0], last_update = float(newest["train_time"]), newest["update"]
    return seconds, last_update


def _record_score(args, bleu, sig, what, seconds, update):
    """--record: the score as a test record on --run-dir's metrics.jsonl (one line, appended
    by RunDir.append_record: what train.py wrote before stays as it was, but for a last line
    cut short); ``seconds`` and ``update`` from _training_seconds."""
    name = "stdin" if args.input == "-" else os.path.basename(args.input)
    record = {"update": update, "test_split": os.path.splitext(name)[0], "test_bleu": bleu,
              "test_signature": sig, "test_checkpoints": what, "beam": args.beam,
              "alpha": args.alpha, "length_penalty": args.length_penalty,
              "time": max(seconds), "recorded_by": "translate.py"}
    if len(seconds) > 1:
        record["ensemble"] = [args.run_dir, *args.ensemble]
    rd = RunDir(args.run_dir)
    path = rd.metrics
    try:
        rd.append_record(record)
    except OSError as exc:
        say(f"warning: --record: could not append to {path} ({exc.strerror}); the score is "
            "the line above")
        return
    say(f"recorded in {path}")


def _input_name(args):
    """--input as messages name it."""
    return "<stdin>" if args.input == "-" else args.input


def _check_and_read(args, device, named):
    """Refuse an unusable device (``named`` as backend.chosen_device names it), run
    directory or --plot-attention directory, then read the input and the reference, which
    must be aligned line by line. -> (lines, refs or None)."""
    check_device(device, named)
    check_run_dir(args)
    if args.plot_attention:
        check_plot_dir(args.plot_attention)
    for flag, path in (("--input", args.input), ("--reference", args.reference)):
        if path not in (None, "-") and _is_stdout(path):
            raise UsageError(f"{flag} {path} is also where the translations go (standard "
                             f"output): with `> {path}` the shell has already emptied it, "
                             f"with `>> {path}` they would be added to it; write the "
                             "translations to another file")
    if args.reference:
        check_bleu_tokenize(args.bleu_tokenize)
    lines = read_text("--input", args.input)
    refs = read_text("--reference", args.reference) if args.reference else None
    if getattr(args, "record", False):
        if refs is None:
            raise UsageError("--record appends the BLEU score to the run's metrics.jsonl: "
                             "give the --reference to score against")
    if refs is not None and not lines:
        raise UsageError(f"--reference: the input {_input_name(args)} has no lines, so there is "
                         "nothing to score; give a non-empty input, or leave out --reference")
    if refs is not None and len(refs) != len(lines):
        raise UsageError(f"--reference {args.reference} has {len(refs)} lines, the input "
                         f"{_input_name(args)} has {len(lines)}; "
                         "they must be aligned line by line")
    if not lines:
        say(f"warning: the input {_input_name(args)} has no lines: nothing to translate")
    return lines, refs


def _is_stdout(path):
    """Whether ``path`` is the regular file that standard output writes to."""
    try:
        out, there = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError, AttributeError):  # (no such file, or no real stdout)
        return False
    return stat.S_ISREG(out.st_mode) and (out.st_dev, out.st_ino) == (there.st_dev, there.st_ino)


def load_for_translation(args, device):
    """load_model with the command line's run and checkpoints, its errors as UsageErrors;
    with --ensemble, an Ensemble of its model and theirs. -> (model, tokenizer, what)."""
    loaded = [_load(args.run_dir, args.checkpoint, args, device)]
    for path in getattr(args, "ensemble", None) or ():
        loaded.append(_load(path, None, args, device))
    if len(loaded) == 1:
        return loaded[0]
    try:
        model = Ensemble([m for m, _, _ in loaded])
    except ValueError as exc:
        raise UsageError(f"--ensemble: {exc}") from None
    what = f"ensemble of {len(loaded)}: " + "; ".join(
        f"{path}: {w}" for path, (_, _, w) in zip([args.run_dir, *args.ensemble], loaded))
    return model, loaded[0][1], what


def _load(path, checkpoints, args, device):
    try:
        return load_model(path, checkpoints, args.average_last, device)
    except (ckpt.CheckpointError, DataError) as exc:
        raise UsageError(str(exc)) from None
    except (RuntimeError, ValueError) as exc:  # the device, or a config the model refuses
        raise UsageError(f"loading {path} on {backend.chosen_device(args.device)[1]}: "
                         f"{exc}") from None


def _truncation_warning(name, cfg):
    """-> the on_truncate of translate_lines: a warning naming the input line that was cut."""
    def warn(index, n_tokens, n_kept):
        say(f"warning: {name}, line {index + 1}: {n_tokens} tokens, more than the "
             f"{n_kept} the model can attend to (max_positions {cfg.max_positions}, "
             f"less EOS); translating the first {n_kept}, the rest is dropped")
    return warn


def _plot_inputs(args, model, tok, lines):
    """--plot-attention: heatmaps of the non-empty input lines that fit the model's source
    positions (the others are left out, and counted), each named by its input line number."""
    from .plots import PlotError, plot_attention
    limit = max_source_tokens(model.cfg)
    candidates = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    lengths = [len(ids) for ids in tok.encode([line for _, line in candidates])]
    fits = [c for c, length in zip(candidates, lengths) if length <= limit]
    if len(fits) < len(candidates):
        say(f"--plot-attention: leaving out {len(candidates) - len(fits)} line(s) longer "
             f"than the model's {limit} source positions")
    try:
        written = plot_attention(model, tok, [line for _, line in fits], args.plot_attention,
                                 max_len_a=args.max_len_a, numbers=[n for n, _ in fits])
    except PlotError as exc:
        raise UsageError(f"--plot-attention: {exc}") from None
    except OSError as exc:
        raise UsageError(f"--plot-attention {args.plot_attention}: cannot write the "
                         f"heatmaps ({exc.strerror or exc}); give a directory you can "
                         "write to") from None
    say(f"wrote {len(written)} attention heatmaps to {args.plot_attention}")


def _write_translations(hyps):
    """Write ``hyps`` to standard output, one a line. -> False (after an error line) when it
    cannot take them; a BrokenPipeError is left to main."""
    try:
        out = sys.stdout
        for h in hyps:
            out.write(h + "\n")
        out.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        _stdout_to_devnull()
        _error(f"cannot write the translations to standard output ({exc.strerror or exc}); "
               "redirect it to a file with room, e.g. `> out.txt`")
        return False
    return True


def main(argv=None):
    """-> exit code: 0, 2 for a mistake in the flags or files (one `error:` line on stderr
    saying what to do), 1 when the machine could not finish, 130 on Ctrl-C, 141 when the
    reader of stdout went away (`translate.py ... | head -1`)."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return translate(args)
    except UsageError as exc:
        _error(str(exc))
        return USER_ERROR
    except MemoryError:  # NumPy's, or CuPy's OutOfMemoryError (a MemoryError)
        _error(f"out of memory; lower --max-tokens (now {args.max_tokens}) or --beam (now "
               f"{args.beam}), or translate on another device" if args else "out of memory")
        return MACHINE_ERROR
    except WorkerDied as exc:  # (the kernel killed it, most likely for its memory)
        _error(str(exc))
        return MACHINE_ERROR
    except BrokenPipeError:  # the reader of our output is gone: stop quietly, as `cat` does
        _stdout_to_devnull()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        _error("interrupted (Ctrl-C) before the translation finished")
        return INTERRUPTED
