"""translate.py: translate text with a trained run, print detokenized output, optionally score.

    python translate.py --run-dir runs/default --input test.src > test.hyp
    echo "the small dog sees a cat" | python translate.py --run-dir runs/default
    python translate.py --run-dir runs/ende --input test2016.en --reference test2016.de \\
        --average-last 5
"""
import argparse
import os
import sys

from .. import backend
from ..nn.transformer import Transformer, TransformerConfig
from . import checkpoint as ckpt
from .tokenizer import Tokenizer
from .translation import corpus_bleu, translate_lines


def build_parser():
    p = argparse.ArgumentParser(prog="translate.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="the training run (config.json, spm.model, "
                                                    "checkpoints)")
    p.add_argument("--checkpoint", nargs="+", default=None,
                   help="checkpoint file(s); several are averaged (default: the run's best, "
                        "else last)")
    p.add_argument("--average-last", type=int, default=0,
                   help="average the run's last N periodic checkpoints (the paper uses 5)")
    p.add_argument("--input", default="-", help="text file, one sentence per line ('-' = stdin)")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 = greedy")
    p.add_argument("--alpha", type=float, default=0.6, help="GNMT length penalty exponent")
    p.add_argument("--length-penalty", default="gnmt", choices=["gnmt", "power"])
    p.add_argument("--max-len-a", type=int, default=50,
                   help="maximum output length = source length + this")
    p.add_argument("--max-tokens", type=int, default=4096, help="source tokens per batch")
    p.add_argument("--reference", help="reference file: print sacreBLEU and its signature "
                                       "to stderr")
    p.add_argument("--plot-attention", metavar="DIR",
                   help="write attention heatmaps (every layer and head) for the input "
                        "sentences into DIR (needs matplotlib: pip install -e .[plot])")
    p.add_argument("--device", default=None, help="cpu or cuda (default: $MINITRANSFORMER_DEVICE)")
    return p


def read_lines(path):
    """Lines of a UTF-8 file or stdin, newline stripped; bad bytes -> error naming the line."""
    name = "<stdin>" if path == "-" else path
    if path != "-" and not os.path.exists(path):
        raise SystemExit(f"error: --input {path}: file not found")
    raw = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    out = []
    for i, line in enumerate(lines, 1):
        try:
            out.append(line.decode("utf-8").rstrip("\r"))
        except UnicodeDecodeError as exc:
            raise SystemExit(f"error: {name} line {i}: not UTF-8 ({exc.reason} at byte "
                             f"{exc.start}); convert the file to UTF-8")
    return out


def load_model(run_dir, checkpoints=None, average_last=0, device="cpu"):
    """-> (model, tokenizer, description) from a run directory."""
    spm_path = os.path.join(run_dir, "spm.model")
    if not os.path.exists(spm_path):
        raise ckpt.CheckpointError(f"--run-dir {run_dir}: no spm.model (is it a training run "
                                   "directory?)")
    if average_last:
        found = [p for _, p in ckpt.periodic_checkpoints(run_dir)]
        if not found:
            raise ckpt.CheckpointError(f"--average-last: no checkpoint_<update>.npz in {run_dir}")
        checkpoints = found[-average_last:]
    if not checkpoints:
        best = os.path.join(run_dir, "checkpoint_best.npz")
        checkpoints = [best if os.path.exists(best) else os.path.join(run_dir, "checkpoint_last.npz")]
    if len(checkpoints) > 1:
        params, meta = ckpt.average_checkpoints(checkpoints)
        what = f"average of {len(checkpoints)} checkpoints"
    else:
        params, _, meta = ckpt.load_checkpoint(checkpoints[0])
        what = checkpoints[0]
    cfg = TransformerConfig.from_dict(meta["config"])
    sha = ckpt.file_sha256(spm_path)
    if meta.get("spm_sha256") not in (None, sha):
        raise ckpt.CheckpointError(f"{checkpoints[0]} was trained with another vocabulary than "
                                   f"{spm_path}; use the run directory it came from")
    tok = Tokenizer(spm_path)
    if tok.vocab_size != cfg.vocab_size:
        raise ckpt.CheckpointError(f"{spm_path} has {tok.vocab_size} pieces but the checkpoint's "
                                   f"model has vocab_size {cfg.vocab_size}")
    model = Transformer(cfg, device=device)
    model.load_state_dict(params)
    model.eval()
    return model, tok, what


def main(argv=None):
    args = build_parser().parse_args(argv)
    device = args.device or backend.default_device()
    try:
        model, tok, what = load_model(args.run_dir, args.checkpoint, args.average_last, device)
    except (ckpt.CheckpointError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lines = read_lines(args.input)
    if args.plot_attention:
        from .plots import PlotError, plot_attention
        try:
            written = plot_attention(model, tok, [line for line in lines if line.strip()],
                                     args.plot_attention, max_len_a=args.max_len_a)
        except PlotError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {len(written)} attention heatmaps to {args.plot_attention}",
              file=sys.stderr)
    hyps = translate_lines(model, tok, lines, beam=args.beam, alpha=args.alpha,
                           max_len_a=args.max_len_a, max_tokens=args.max_tokens,
                           length_penalty=args.length_penalty)
    out = sys.stdout
    for h in hyps:
        out.write(h + "\n")
    out.flush()
    if args.reference:
        refs = read_lines(args.reference)
        if len(refs) != len(hyps):
            print(f"error: --reference {args.reference} has {len(refs)} lines, the input has "
                  f"{len(hyps)}", file=sys.stderr)
            return 2
        bleu, sig = corpus_bleu(hyps, refs)
        print(f"BLEU = {bleu:.2f}  ({what}, beam {args.beam})  {sig}", file=sys.stderr)
    return 0


def average_main(argv=None):
    """python -m minitransformer.mt.average --run-dir R --last 5 --output avg.npz"""
    p = argparse.ArgumentParser(prog="average", description="average checkpoints' parameters")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    paths = [q for _, q in ckpt.periodic_checkpoints(args.run_dir)][-args.last:]
    params, meta = ckpt.average_checkpoints(paths)
    model = Transformer(TransformerConfig.from_dict(meta["config"]))
    model.load_state_dict(params)
    ckpt.save_checkpoint(args.output, model, None, {"averaged": paths,
                                                    "spm_sha256": meta.get("spm_sha256")})
    print(f"wrote {args.output}: average of {len(paths)} checkpoints")
    return 0
