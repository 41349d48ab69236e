"""The command line of train.py: flags, their defaults and help, and config files.

Every flag is an attribute of the ``args`` namespace the Trainer reads (``--d-model`` ->
``args.d_model``). A JSON or TOML file given with ``--config`` supplies the same keys; flags
on the command line win. ``args.explicit`` records which options the command line or the
config file named, so that ``--resume`` can tell a deliberate change from a default.
"""
import argparse
import dataclasses
import json
import math
import os

from ..nn.transformer import CHOICES, PRESETS, TransformerConfig
from .ranges import add_number, check_ranges
from .translation import add_bleu_tokenize, bleu_metric

USAGE = """train.py: train a Transformer on parallel text, the paper's recipe (§5), from the
command line.

    python train.py                                   # synthetic corpus, tiny model, then BLEU
    python train.py --data DIR --src-lang en --tgt-lang de --max-time 30   # sizes itself
    python train.py --data DIR --src-lang en --tgt-lang de --preset base --run-dir runs/ende
    python train.py --config recipe.toml              # the same flags from a JSON/TOML file
    python train.py --run-dir runs/ende --resume      # continue exactly where a run stopped

Files are DIR/{train,valid,test}.{src-lang,tgt-lang} (split names set by --train-split etc.).
"""

MODEL_FLAGS = ["d_model", "n_heads", "d_ff", "n_layers", "dropout", "attention_dropout",
               "relu_dropout", "label_smoothing", "smoothing", "norm", "positions",
               "sinusoid_layout", "max_positions", "share_embeddings"]

# the valid range of each numeric model flag (ranges.py)
MODEL_RANGES = {"d_model": ">= 1", "n_heads": ">= 1", "d_ff": ">= 1", "n_layers": ">= 1",
                "dropout": "[0, 1)", "attention_dropout": "[0, 1)", "relu_dropout": "[0, 1)",
                "label_smoothing": "[0, 1)", "max_positions": ">= 2"}

# --profile N: updates run before the N profiled ones (the first are slower: memory, caches)
PROFILE_WARMUP = 5

# options that describe this process, not the run: never saved in config.json
PER_PROCESS = {"config", "resume", "run_dir", "device", "no_progress", "profile"}


def build_parser():
    """The train.py argument parser: --config, then the flags in four groups."""
    p = argparse.ArgumentParser(prog="train.py", description=USAGE,
                                usage="python train.py [options]   (all of them: --help)",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="JSON or TOML file of options (keys as flag names, '-' or "
                                    "'_'); flags on the command line win")
    _data_flags(p.add_argument_group("data"))
    _model_flags(p.add_argument_group("model"))
    g = p.add_argument_group("optimisation")
    _optimiser_flags(g)
    _precision_flags(g)
    _budget_flags(g)
    _run_flags(p.add_argument_group("validation, checkpoints, logging"))
    return p


def _data_flags(g):
    """The corpus, its splits, the subword vocabulary and the batches."""
    g.add_argument("--data", help="directory with {split}.{lang} files; without it a synthetic "
                                  "corpus is generated in RUN_DIR/data")
    g.add_argument("--src-lang", default=None, help="source file suffix (default: src)")
    g.add_argument("--tgt-lang", default=None, help="target file suffix (default: tgt)")
    g.add_argument("--train-split", default="train")
    g.add_argument("--valid-split", default="valid")
    g.add_argument("--test-split", default="test", help="scored with beam search at the end "
                                                        "if its files exist ('' to skip)")
    add_number(g, "--vocab-size", int, ">= 8", default=None,
               help="joint sentencepiece vocabulary (default 8000; 1000 for the synthetic "
                    "corpus; with --data and --max-time and no --preset, chosen from the "
                    "corpus size: mt/autosize.py)")
    g.add_argument("--spm-type", default=None, choices=["unigram", "bpe", "char", "word"],
                   help="sentencepiece algorithm (default unigram; bpe for the synthetic corpus, "
                        "whose words it keeps whole)")
    add_number(g, "--subword-alpha", float, ">= 0", default=0.0,
               help="subword regularization: each epoch, each training sentence gets one of "
                    "its --subword-nbest segmentations x with probability ~ P(x)^alpha "
                    "(unigram models; 0 = off, always the best one; e.g. 0.5)")
    add_number(g, "--subword-nbest", int, "[2, 512]", default=16,
               help="segmentations per sentence to sample from (with --subword-alpha)")
    add_number(g, "--max-tokens", int, ">= 1", default=4096, auto=True,
               help="padded source (and target) tokens per batch; auto: the largest that "
                    "fits in --memory, measured on the longest pairs (mt/memfit.py)")
    g.add_argument("--memory", type=_memory, default=None, metavar="SIZE",
                   help="memory one rank may use with --max-tokens auto, e.g. 8G or 800M "
                        "(default: half of the machine's available memory, shared by its "
                        "ranks; 80%% of a GPU's free memory)")
    add_number(g, "--max-len", int, ">= 1", default=256,
               help="drop training pairs longer than this many tokens (counted in the log)")
    add_number(g, "--synthetic-pairs", int, ">= 10", default=20000,
               help="training pairs of the generated corpus (no --data)")


def _memory(text):
    """--memory: a size such as 8G -> the text (kept as given, for config.json)."""
    from .memfit import parse_memory
    try:
        parse_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 8G, 800M or 1.5GiB, got "
                                         f"{text!r}") from None
    return str(text)


def _model_flags(g):
    """--preset, and one flag per MODEL_FLAGS field of TransformerConfig, overriding it."""
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                   help="default tiny; with --data and --max-time and no --preset, the run "
                        "sizes itself: the largest model of a ladder that the corpus and the "
                        "measured update rate can feed, with its vocabulary, batch, peak rate "
                        "and subword regularization (mt/autosize.py; model flags still win)")
    for f in dataclasses.fields(TransformerConfig):
        if f.name not in MODEL_FLAGS:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            g.add_argument(flag, dest=f.name, default=None,
                           action=argparse.BooleanOptionalAction)
        elif f.name in MODEL_RANGES:
            typ = {"int": int, "float": float}.get(str(f.type), f.type)
            add_number(g, flag, typ, MODEL_RANGES[f.name], dest=f.name, default=None,
                       help=f"overrides the preset (paper default {f.default})")
        else:
            g.add_argument(flag, dest=f.name, default=None, choices=CHOICES.get(f.name),
                           help=f"overrides the preset (paper default {f.default})")


def _optimiser_flags(g):
    """The learning-rate schedule, Adam and gradient clipping."""
    add_number(g, "--lr-factor", float, "> 0", default=1.0,
               help="multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)")
    g.add_argument("--lr-schedule", default="inverse-sqrt", choices=["inverse-sqrt", "linear"],
                   help="after the warm-up: the paper's inverse square root decay, or a straight "
                        "line to 0 at --max-updates (for a fixed budget of updates) or, with "
                        "--max-time, at the number of updates the run plans to fit in it "
                        "(default: linear for a new run with --max-time and no --max-updates "
                        "given, or one that sizes itself with no --warmup given, its warm-up "
                        "then 12%% of the plan unless --warmup is given; else inverse-sqrt)")
    add_number(g, "--warmup", int, ">= 1", default=None,
               help="warm-up updates (default 4000 as in the paper; 300 for the synthetic "
                    "corpus)")
    add_number(g, "--adam-betas", float, "[0, 1)", nargs=2, default=[0.9, 0.98],
               help="Adam's beta1 and beta2 (default 0.9 0.98)")
    add_number(g, "--adam-eps", float, "> 0", default=1e-9)
    add_number(g, "--clip-norm", float, ">= 0", default=0.0,
               help="clip the gradient's global norm to this; 0 = no clipping")


def _precision_flags(g):
    """--precision and the loss scaling of float16 training."""
    g.add_argument("--precision", default="float32", choices=["float32", "float16"],
                   help="float16: mixed precision, for GPUs with float16 tensor cores (float16 "
                        "activations and products, float32 master weights and optimizer, "
                        "dynamic loss scaling); on a CPU it is slower than float32")
    add_number(g, "--loss-scale-init", float, "> 0", default=2.0 ** 7,
               help="float16: the first loss scale (of the loss summed over a batch's tokens)")
    add_number(g, "--loss-scale-window", int, ">= 1", default=2000,
               help="float16: double the loss scale after this many updates without overflow")
    add_number(g, "--min-loss-scale", float, "> 0", default=2.0 ** -14,
               help="float16: stop with an error when overflows push the loss scale below this")


def _budget_flags(g):
    """Batches per update, when training stops, and the random seed."""
    add_number(g, "--update-freq", int, ">= 1", default=1,
               help="accumulate gradients over this many batches per update")
    add_number(g, "--max-updates", int, ">= 0", default=None,
               help="0 = no limit (default; 600 for the synthetic corpus)")
    add_number(g, "--max-epochs", int, ">= 0", default=0, help="0 = no limit")
    add_number(g, "--max-time", float, ">= 0", default=0.0,
               help="minutes of training (the loop: updates, validations, checkpoints; not "
                    "the set-up or the final test); 0 = no limit. With --lr-schedule linear "
                    "the run plans to the deadline: it measures its seconds per update "
                    "(after about 30 updates) and its validations, chooses the number of "
                    "updates N that fits (at most --max-updates, if given), decays the rate "
                    "to 0 at N, re-plans every 50 updates and after each validation, and "
                    "stops after update N (mt/plan.py)")
    add_number(g, "--max-bad-updates", int, ">= 1", default=5,
               help="stop when this many updates in a row have a loss or gradient that is not "
                    "finite (each is skipped; the run ends with the first op that made a NaN "
                    "or Inf, and its checkpoints as the last good validation left them)")
    add_number(g, "--seed", int, ">= 0", default=1)


def _run_flags(g):
    """The run directory, validation, checkpoints, logging, the profiler, the final test and
    the device."""
    g.add_argument("--run-dir", default="runs/default")
    g.add_argument("--resume", action="store_true",
                   help="continue from RUN_DIR/checkpoint_last.npz exactly where it stopped")
    add_number(g, "--valid-every", int, ">= 1", default=None,
               help="validate every K updates (default 500; 200 for the synthetic corpus)")
    add_number(g, "--valid-bleu-sentences", int, ">= 0", default=500,
               help="validation BLEU on the first N sentences (greedy); 0 = all")
    add_bleu_tokenize(g, "the validation and test BLEU")
    add_number(g, "--save-every", int, ">= 0", default=0,
               help="periodic checkpoint every K updates (default: at each validation)")
    add_number(g, "--keep-last", int, ">= 0", default=5,
               help="periodic checkpoints kept (0 = all)")
    add_number(g, "--log-every", int, ">= 1", default=50)
    g.add_argument("--no-progress", action="store_true", help="plain log lines, no tqdm bar")
    add_number(g, "--profile", int, ">= 1", default=None, metavar="N",
               help=f"instead of training: run {PROFILE_WARMUP} warm-up updates, then N "
                    "updates under the profiler, print where their time goes (per op and per "
                    "module: time, GFLOP/s, MFU, memory traffic) and stop, writing no "
                    "checkpoint or metrics (with --resume: profiles the run where it stands "
                    "and leaves its files as they are)")
    add_number(g, "--beam", int, ">= 1", default=4, help="beam size for the final test score")
    add_number(g, "--alpha", float, ">= 0", default=0.6,
               help="GNMT length penalty exponent for the final test score")
    add_number(g, "--average-last", int, ">= 0", default=0,
               help="score the test split with the average of the last N periodic checkpoints")
    g.add_argument("--device", default=None, help="cpu or cuda (default: $MINITRANSFORMER_DEVICE "
                                                   "or cpu)")


def load_config_file(path):
    """Options from a .json or .toml file -> dict with '_' keys."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise SystemExit(f"error: --config {path}: cannot read it ({exc.strerror}); give a "
                         ".json or .toml file of options") from None
    try:
        if path.endswith(".toml"):
            import tomllib
            d = tomllib.loads(raw.decode("utf-8"))
        else:
            d = json.loads(raw.decode("utf-8"))
    except Exception as exc:
        raise SystemExit(f"error: --config {path}: cannot parse ({exc})") from None
    if not isinstance(d, dict):
        raise SystemExit(f"error: --config {path}: the top level must be a table of options "
                         f"(a JSON object such as {{\"warmup\": 4000}}), not "
                         f"{type(d).__name__}")
    return {k.replace("-", "_"): v for k, v in d.items()}


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        options = load_config_file(args.config)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(options) - known)
        if unknown:
            raise SystemExit(f"error: --config {args.config}: unknown options {unknown}")
        options = check_ranges(parser, options, f"--config {args.config}")
        parser.set_defaults(**options)
        args = parser.parse_args(argv)
    args.explicit = given_on_command_line(argv)
    if args.config:  # a config file's options are as deliberate as flags
        args.explicit |= set(options)
    return args


def given_on_command_line(argv=None):
    """The options the command line gives, however each is written (``--max-updates 5``,
    ``--max-updates=5``, an abbreviation such as ``--max-upd 5``): the command line parsed
    again with every default a marker no flag can produce."""
    probe, unset = build_parser(), object()
    for action in probe._actions:
        if action.dest != "help":
            action.default = unset
    given = probe.parse_args(argv)
    return {name for name, value in vars(given).items() if value is not unset}


def option_names():
    """The ``args`` attribute of every flag."""
    return {a.dest for a in build_parser()._actions if a.dest != "help"}


# ---- after parsing: resume, defaults, checks ------------------------------------------------
RESUME_FIXED = MODEL_FLAGS + ["preset", "vocab_size", "spm_type", "data", "train_split",
                              "synthetic_pairs", "src_lang", "tgt_lang", "seed",
                              "subword_alpha", "subword_nbest",
                              "bleu_tokenize"]  # a resumed run cannot change


def restore_for_resume(args, saved, run_dir):
    """``--resume``: refuse a flag that would change the run (``RESUME_FIXED``), then take
    every other option the run was started with (``saved``, its config.json) unless this
    command line gives it again."""
    parser = build_parser()
    for name in RESUME_FIXED:
        if name in args.explicit:
            # a run saved before the option existed ran with its default
            old = saved["train"].get(name, saved["model"].get(name, parser.get_default(name)))
            if name == "data" and _same_corpus(old, args.data):
                continue
            if old != getattr(args, name):
                raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)!r} "
                                 f"differs from the run being resumed ({old!r} in "
                                 f"{run_dir}/config.json); drop the flag or start a new "
                                 "--run-dir")
    for name, value in saved["train"].items():
        if name not in args.explicit:
            setattr(args, name, value)


def _same_corpus(saved, given):
    """--data on --resume: the run's directory however it is written (relative or absolute,
    a trailing slash), or another directory (the corpus moved or was copied, or the run was
    started from another directory with a relative path): the training pairs there are
    checked against those the run trained on (their number and fingerprint, in each
    checkpoint), so another corpus is still refused."""
    if saved is None or given is None:
        return saved == given
    if os.path.realpath(saved) == os.path.realpath(given):
        return True
    if os.path.isdir(given):
        why = "is not found from here" if not os.path.isdir(saved) else "is given anew"
        print(f"note: the run's --data {saved} {why}; using {given} (its training pairs "
              "must be the run's)", flush=True)
        return True
    return False


def fill_defaults(args):
    """Options left unset get the defaults of the data source."""
    if args.data is None:  # the default run: 90+ BLEU in about 5 minutes on 2 cores
        defaults = dict(vocab_size=1000, spm_type="bpe", warmup=300, max_updates=600,
                        valid_every=200)
    else:  # (a run that sizes itself chooses its vocabulary from the corpus: autosize.py)
        defaults = dict(vocab_size=None if sizes_itself(args) else 8000, spm_type="unigram",
                        warmup=4000, max_updates=0, valid_every=500)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if (sizes_itself(args) and "subword_alpha" not in args.explicit
            and args.spm_type == "unigram"):
        from .autosize import SUBWORD_ALPHA
        args.subword_alpha = SUBWORD_ALPHA
    if sizes_itself(args) and "lr_factor" not in args.explicit:
        from .autosize import LR_FACTOR, LR_FACTOR_WARMUP
        # the recipe's peak (noam's peak goes as factor / sqrt(warm-up)): for a --warmup
        # given, the factor that keeps it (2 with 400 updates would double it: a run that
        # short and that high stayed at its first loss)
        args.lr_factor = LR_FACTOR * math.sqrt(args.warmup / LR_FACTOR_WARMUP)
    # (not the synthetic corpus's default 600; --max-updates 0 is no cap, as when not given)
    given = "max_updates" in args.explicit and args.max_updates > 0
    if (not args.resume and args.max_time > 0 and "lr_schedule" not in args.explicit
            and (not given or (sizes_itself(args) and ("warmup" not in args.explicit
                                                       or args.max_updates > args.warmup)))):
        # a time budget: the decay planned to end with it (--max-updates capping the plan
        # in a run that sizes itself, whose learning rate is chosen for the plan's warm-up)
        args.lr_schedule = "linear"


def sizes_itself(args):
    """True when a new run on --data with a time budget (--max-time) and no --preset chooses
    the vocabulary, model, batch and subword regularization the flags leave open from the
    corpus and the machine (mt/autosize.py)."""
    return (args.data is not None and args.max_time > 0 and not args.resume
            and "preset" not in args.explicit)


def plans_to_deadline(args):
    """True when the run plans its number of updates to --max-time (mt/plan.py): the linear
    schedule and a time budget; --max-updates, if given, caps the plan."""
    return args.lr_schedule == "linear" and args.max_time > 0


def check_options(args):
    """Combinations of options that cannot work, each refused with what to do instead."""
    preset = {} if sizes_itself(args) or args.resume else PRESETS.get(args.preset, {})
    d, h = (getattr(args, k) or preset.get(k) for k in ("d_model", "n_heads"))
    if d and h and d % h:  # (before the corpus work: the model is built after it)
        raise SystemExit(f"error: the model's d_model {d} (--d-model) must be divisible by "
                         f"its n_heads {h} (--n-heads): each head attends over d_model / "
                         f"n_heads features; give, e.g., --n-heads "
                         f"{max(k for k in range(1, h + 1) if d % k == 0)}")
    if args.resume and args.max_tokens == "auto":
        raise SystemExit("error: --max-tokens auto chooses the batch size when a run starts; "
                         "a resumed run keeps the one it chose (in config.json): drop "
                         "--max-tokens, or give a number")
    planned = plans_to_deadline(args)
    # (a plan without --max-updates chooses its N; one with it fits a warm-up not chosen to N)
    if args.lr_schedule == "linear" and not args.max_updates > args.warmup and not (
            planned and (not args.max_updates or "warmup" not in args.explicit)):
        raise SystemExit("error: --lr-schedule linear decays to 0 at --max-updates; "
                         f"give --max-updates N with N > --warmup ({args.warmup}), or "
                         "--max-time M to plan the decay to end with the M minutes")
    try:
        bleu_metric(args.bleu_tokenize)
    except ValueError as exc:  # (its packages are missing)
        raise SystemExit(f"error: --bleu-tokenize {args.bleu_tokenize}: {exc}") from None
    if args.subword_alpha > 0 and args.spm_type != "unigram":
        raise SystemExit(f"error: --subword-alpha samples segmentations of a unigram model; "
                         f"this run's --spm-type is {args.spm_type}: add --spm-type unigram "
                         "(in a new --run-dir) or drop --subword-alpha")


def option_warnings(args):
    """Options that work but not as their user likely means -> lines to print: the
    schedule's (``schedule_warnings``) and checkpoints to average that are not kept."""
    lines = schedule_warnings(args)
    if 0 < args.keep_last < args.average_last:
        lines.append(f"warning: --average-last {args.average_last} averages the newest "
                     f"{args.average_last} periodic checkpoints for the test, but --keep-last "
                     f"{args.keep_last} keeps only {args.keep_last}: give --keep-last "
                     f"{args.average_last} (or 0, to keep them all)")
    return lines


def schedule_warnings(args):
    """Options that work but train badly, each with what to do instead -> lines to print
    (on --resume only when a schedule flag is given again: a run's own are said once)."""
    n, w = args.max_updates, args.warmup
    again = not args.resume or {"max_updates", "warmup", "lr_schedule"} & args.explicit
    if args.lr_schedule == "inverse-sqrt" and 0 < n <= w and again:
        from .plan import WARMUP_SHARE, fitted_warmup
        fit = max(1, fitted_warmup(n, w, WARMUP_SHARE))
        where = "in a new --run-dir " if args.resume else ""  # (on resume: the rate jumps)
        return [f"warning: --max-updates {n} ends the run inside the warm-up (--warmup {w}): "
                f"the learning rate rises all run and ends at {n / w:.0%} of its peak; for "
                f"the same peak within the run give {where}--warmup {fit} --lr-factor "
                f"{args.lr_factor * math.sqrt(fit / w):.3g} (noam's peak grows as "
                "1/sqrt(warm-up), so a shorter warm-up alone would raise it)"]
    return []


def run_options(args):
    """Every option but the model's (saved under "model") and those about this process
    only, for config.json: ``--resume`` restores them, so a resumed run keeps its stopping
    rule, schedule, checkpointing and test settings."""
    return {k: getattr(args, k) for k in sorted(option_names())
            if k not in MODEL_FLAGS and k not in PER_PROCESS}
