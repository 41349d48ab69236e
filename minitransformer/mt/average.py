"""Average the parameters of a run's last N periodic checkpoints into one file (§6.1):

    python -m minitransformer.mt.average --run-dir R --last 5 --output R/averaged.npz

translate.py --average-last N does the same on the fly.
"""
import argparse
import sys

from ..nn.transformer import Transformer, TransformerConfig
from . import checkpoint as ckpt
from .rundir import RunDir


def main(argv=None):
    p = argparse.ArgumentParser(prog="average", description="average checkpoints' parameters")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--last", type=int, default=5)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    paths = [q for _, q in RunDir(args.run_dir).periodic_checkpoints()][-args.last:]
    params, meta = ckpt.average_checkpoints(paths)
    model = Transformer(TransformerConfig.from_dict(meta["config"]))
    model.load_state_dict(params)
    ckpt.save_checkpoint(args.output, model, None, {"averaged": paths,
                                                    "spm_sha256": meta.get("spm_sha256")})
    print(f"wrote {args.output}: average of {len(paths)} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
