"""translate.py: translate text with a trained run, print detokenized output, optionally score.

    python translate.py --run-dir runs/default --input test.src > test.hyp
    echo "the small dog sees a cat" | python translate.py --run-dir runs/default
    python translate.py --run-dir runs/ende --input test2016.en --reference test2016.de \\
        --average-last 5
"""
import argparse
import sys

from .. import backend
from ..nn.transformer import Transformer, TransformerConfig
from . import checkpoint as ckpt
from .data import DataError, read_lines
from .rundir import RunDir
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


def load_model(run_dir, checkpoints=None, average_last=0, device="cpu"):
    """-> (model, tokenizer, description) from a run directory: the given checkpoint(s), or
    the run's choice (RunDir.choose_checkpoints); several are averaged."""
    rd = RunDir(run_dir)
    rd.require_spm_model()
    if average_last or not checkpoints:  # (--average-last wins over --checkpoint)
        checkpoints = rd.choose_checkpoints(average_last)
    params, meta, what = rd.load_params(checkpoints)
    tok = Tokenizer(rd.spm_model)
    rd.check_vocabulary(checkpoints[0], meta, tok.vocab_size)
    model = Transformer(TransformerConfig.from_dict(meta["config"]), device=device)
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
    try:
        lines = read_lines(args.input)
        refs = read_lines(args.reference) if args.reference else None
    except DataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
        if len(refs) != len(hyps):
            print(f"error: --reference {args.reference} has {len(refs)} lines, the input has "
                  f"{len(hyps)}", file=sys.stderr)
            return 2
        bleu, sig = corpus_bleu(hyps, refs)
        print(f"BLEU = {bleu:.2f}  ({what}, beam {args.beam})  {sig}", file=sys.stderr)
    return 0
