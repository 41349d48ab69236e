"""The command line of train.py: flags, their defaults and help, and config files.

Every flag is an attribute of the ``args`` namespace the Trainer reads (``--d-model`` ->
``args.d_model``). A JSON or TOML file given with ``--config`` supplies the same keys; flags
on the command line win. ``args.explicit`` records which options the command line or the
config file named, so that ``--resume`` can tell a deliberate change from a default.
"""
import argparse
import dataclasses
import json
import os
import sys

from ..nn.transformer import PRESETS, TransformerConfig

USAGE = """train.py: train a Transformer on parallel text, the paper's recipe (§5), from the
command line.

    python train.py                                   # synthetic corpus, tiny model, then BLEU
    python train.py --data DIR --src-lang en --tgt-lang de --preset base --run-dir runs/ende
    python train.py --config recipe.toml              # the same flags from a JSON/TOML file
    python train.py --run-dir runs/ende --resume      # continue exactly where a run stopped

Files are DIR/{train,valid,test}.{src-lang,tgt-lang} (split names set by --train-split etc.).
"""

MODEL_FLAGS = ["d_model", "n_heads", "d_ff", "n_layers", "dropout", "attention_dropout",
               "relu_dropout", "label_smoothing", "smoothing", "norm", "positions",
               "sinusoid_layout", "max_positions", "share_embeddings"]

# options that describe this process, not the run: never saved in config.json
PER_PROCESS = {"config", "resume", "run_dir", "device", "no_progress"}


def build_parser():
    p = argparse.ArgumentParser(prog="train.py", description=USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--config", help="JSON or TOML file of options (keys as flag names, '-' or '_'); "
                       "flags on the command line win")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="directory with {split}.{lang} files; without it a synthetic "
                                  "corpus is generated in RUN_DIR/data")
    g.add_argument("--src-lang", default=None, help="source file suffix (default: src)")
    g.add_argument("--tgt-lang", default=None, help="target file suffix (default: tgt)")
    g.add_argument("--train-split", default="train")
    g.add_argument("--valid-split", default="valid")
    g.add_argument("--test-split", default="test", help="scored with beam search at the end "
                                                        "if its files exist ('' to skip)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="joint sentencepiece vocabulary (default 8000; 1000 for the synthetic "
                        "corpus)")
    g.add_argument("--spm-type", default=None, choices=["unigram", "bpe", "char", "word"],
                   help="sentencepiece algorithm (default unigram; bpe for the synthetic corpus, "
                        "whose words it keeps whole)")
    g.add_argument("--subword-alpha", type=float, default=0.0,
                   help="subword regularization: each epoch, each training sentence gets one of "
                        "its --subword-nbest segmentations x with probability ~ P(x)^alpha "
                        "(unigram models; 0 = off, always the best one; e.g. 0.5)")
    g.add_argument("--subword-nbest", type=int, default=16,
                   help="segmentations per sentence to sample from (with --subword-alpha)")
    g.add_argument("--max-tokens", type=int, default=4096,
                   help="padded source (and target) tokens per batch")
    g.add_argument("--max-len", type=int, default=256,
                   help="drop training pairs longer than this many tokens (counted in the log)")
    g.add_argument("--synthetic-pairs", type=int, default=20000,
                   help="training pairs of the generated corpus (no --data)")
    g = p.add_argument_group("model")
    g.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    for f in dataclasses.fields(TransformerConfig):
        if f.name in MODEL_FLAGS:
            flag = "--" + f.name.replace("_", "-")
            if f.type in (bool, "bool"):
                g.add_argument(flag, dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction)
            else:
                typ = {"int": int, "float": float, "str": str}.get(str(f.type), f.type)
                g.add_argument(flag, dest=f.name, type=typ, default=None,
                               help=f"overrides the preset (paper default {f.default})")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr-factor", type=float, default=1.0,
                   help="multiplies d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)")
    g.add_argument("--lr-schedule", default="inverse-sqrt", choices=["inverse-sqrt", "linear"],
                   help="after the warm-up: the paper's inverse square root decay, or a straight "
                        "line to 0 at --max-updates (for a fixed budget of updates)")
    g.add_argument("--warmup", type=int, default=None,
                   help="warm-up updates (default 4000 as in the paper; 300 for the synthetic "
                        "corpus)")
    g.add_argument("--adam-betas", type=float, nargs=2, default=[0.9, 0.98])
    g.add_argument("--adam-eps", type=float, default=1e-9)
    g.add_argument("--clip-norm", type=float, default=0.0, help="0 = no clipping")
    g.add_argument("--precision", default="float32", choices=["float32", "float16"],
                   help="float16: mixed precision, for GPUs with float16 tensor cores (float16 "
                        "activations and products, float32 master weights and optimizer, "
                        "dynamic loss scaling); on a CPU it is slower than float32")
    g.add_argument("--loss-scale-init", type=float, default=2.0 ** 7,
                   help="float16: the first loss scale (of the loss summed over a batch's tokens)")
    g.add_argument("--loss-scale-window", type=int, default=2000,
                   help="float16: double the loss scale after this many updates without overflow")
    g.add_argument("--min-loss-scale", type=float, default=2.0 ** -14,
                   help="float16: stop with an error when overflows push the loss scale below this")
    g.add_argument("--update-freq", type=int, default=1,
                   help="accumulate gradients over this many batches per update")
    g.add_argument("--max-updates", type=int, default=None,
                   help="0 = no limit (default; 600 for the synthetic corpus)")
    g.add_argument("--max-epochs", type=int, default=0, help="0 = no limit")
    g.add_argument("--max-time", type=float, default=0.0, help="minutes of training; 0 = no limit")
    g.add_argument("--seed", type=int, default=1)
    g = p.add_argument_group("validation, checkpoints, logging")
    g.add_argument("--run-dir", default="runs/default")
    g.add_argument("--resume", action="store_true",
                   help="continue from RUN_DIR/checkpoint_last.npz exactly where it stopped")
    g.add_argument("--valid-every", type=int, default=None,
                   help="validate every K updates (default 500; 200 for the synthetic corpus)")
    g.add_argument("--valid-bleu-sentences", type=int, default=500,
                   help="validation BLEU on the first N sentences (greedy); 0 = all")
    g.add_argument("--save-every", type=int, default=0,
                   help="periodic checkpoint every K updates (default: at each validation)")
    g.add_argument("--keep-last", type=int, default=5, help="periodic checkpoints kept")
    g.add_argument("--log-every", type=int, default=50)
    g.add_argument("--no-progress", action="store_true", help="plain log lines, no tqdm bar")
    g.add_argument("--beam", type=int, default=4, help="beam size for the final test score")
    g.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty")
    g.add_argument("--average-last", type=int, default=0,
                   help="score the test split with the average of the last N periodic checkpoints")
    g.add_argument("--device", default=None, help="cpu or cuda (default: $MINITRANSFORMER_DEVICE "
                                                   "or cpu)")
    return p


def load_config_file(path):
    """Options from a .json or .toml file -> dict with '_' keys."""
    if not os.path.exists(path):
        raise SystemExit(f"error: --config {path}: file not found")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib
            d = tomllib.loads(raw.decode("utf-8"))
        else:
            d = json.loads(raw.decode("utf-8"))
    except Exception as exc:
        raise SystemExit(f"error: --config {path}: cannot parse ({exc})") from None
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
        parser.set_defaults(**options)
        args = parser.parse_args(argv)
    args.explicit = {a.dest for a in parser._actions
                     if any(s in (argv if argv is not None else sys.argv[1:])
                            for s in a.option_strings)}
    if args.config:  # a config file's options are as deliberate as flags
        args.explicit |= set(options)
    return args


def option_names():
    """The ``args`` attribute of every flag."""
    return {a.dest for a in build_parser()._actions if a.dest != "help"}


# ---- after parsing: resume, defaults, checks ------------------------------------------------
RESUME_FIXED = MODEL_FLAGS + ["preset", "vocab_size", "data", "src_lang", "tgt_lang", "seed",
                              "subword_alpha", "subword_nbest"]  # a resumed run cannot change


def restore_for_resume(args, saved, run_dir):
    """``--resume``: refuse a flag that would change the run (``RESUME_FIXED``), then take
    every other option the run was started with (``saved``, its config.json) unless this
    command line gives it again."""
    parser = build_parser()
    for name in RESUME_FIXED:
        if name in args.explicit:
            # a run saved before the option existed ran with its default
            old = saved["train"].get(name, saved["model"].get(name, parser.get_default(name)))
            if old != getattr(args, name):
                raise SystemExit(f"error: --{name.replace('_', '-')} {getattr(args, name)!r} "
                                 f"differs from the run being resumed ({old!r} in "
                                 f"{run_dir}/config.json); drop the flag or start a new "
                                 "--run-dir")
    for name, value in saved["train"].items():
        if name not in args.explicit:
            setattr(args, name, value)


def fill_defaults(args):
    """Options left unset get the defaults of the data source."""
    if args.data is None:  # the default run: 90+ BLEU in about 5 minutes on 2 cores
        defaults = dict(vocab_size=1000, spm_type="bpe", warmup=300, max_updates=600,
                        valid_every=200)
    else:
        defaults = dict(vocab_size=8000, spm_type="unigram", warmup=4000, max_updates=0,
                        valid_every=500)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_options(args):
    """Combinations of options that cannot work, each refused with what to do instead."""
    if args.lr_schedule == "linear" and not args.max_updates > args.warmup:
        raise SystemExit("error: --lr-schedule linear decays to 0 at --max-updates; "
                         f"give --max-updates N with N > --warmup ({args.warmup})")
    if not args.subword_alpha >= 0:  # NaN too
        raise SystemExit(f"error: --subword-alpha must be >= 0 (0 = off), got "
                         f"{args.subword_alpha}")
    if args.subword_alpha > 0 and args.spm_type != "unigram":
        raise SystemExit(f"error: --subword-alpha samples segmentations of a unigram model; "
                         f"this run's --spm-type is {args.spm_type}: add --spm-type unigram "
                         "(in a new --run-dir) or drop --subword-alpha")


def run_options(args):
    """Every option but the model's (saved under "model") and those about this process
    only, for config.json: ``--resume`` restores them, so a resumed run keeps its stopping
    rule, schedule, checkpointing and test settings."""
    return {k: getattr(args, k) for k in sorted(option_names())
            if k not in MODEL_FLAGS and k not in PER_PROCESS}
