"""Average the parameters of a run's last N periodic checkpoints into one file (§6.1):

    python -m minitransformer.mt.average --run-dir R --last 5 --output R/avg.npz

translate.py --average-last N does the same on the fly. The output is a parameters-only
checkpoint (no optimizer state: it cannot be resumed from), so it never replaces one of the
run's own checkpoints, nor an existing file without ``--force``.
"""
import argparse
import os
import sys

from . import checkpoint as ckpt
from .fileio import describe_os_error
from .ranges import add_number
from .rundir import CHECKPOINT_NAME, RunDir


class AverageError(Exception):
    """A flag or a file that cannot work: one line for the user, exit code 2."""


def build_parser():
    p = argparse.ArgumentParser(prog="python -m minitransformer.mt.average",
                                description="Average the parameters of a run's last N "
                                            "periodic checkpoints into one checkpoint file.")
    p.add_argument("--run-dir", required=True, help="the training run (only read)")
    add_number(p, "--last", int, ">= 1", default=5,
               help="how many of the newest periodic checkpoints (checkpoint_<update>.npz)")
    p.add_argument("--output", required=True, help="the .npz file to write")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    return p


def average_run(run_dir, last, output, force=False):
    """Write the average of ``run_dir``'s ``last`` newest periodic checkpoints to ``output``
    -> (the checkpoints averaged, a warning or None). Raises AverageError for anything the
    user can fix, CheckpointError for a damaged checkpoint, OSError when writing fails."""
    if not os.path.isdir(run_dir):
        raise AverageError(f"--run-dir {run_dir}: no such directory; give the directory "
                           "train.py wrote")
    paths = [q for _, q in RunDir(run_dir).periodic_checkpoints()]
    if not paths:
        raise AverageError(f"--run-dir {run_dir}: no checkpoint_<update>.npz to average; "
                           "train.py writes one at each validation, or every --save-every updates")
    _check_output(output, force)
    warning = None
    if len(paths) < last:
        warning = (f"--last {last}: {run_dir} has {len(paths)} periodic checkpoint(s); "
                   f"averaging those {len(paths)}")
    paths = paths[-last:]
    from ..nn.transformer import Transformer, TransformerConfig  # (after the checks: NumPy)
    params, meta = ckpt.average_checkpoints(paths)
    model = Transformer(TransformerConfig.from_dict(meta["config"]))
    model.load_state_dict(params)
    ckpt.save_checkpoint(output, model, None, {"averaged": paths,
                                               "spm_sha256": meta.get("spm_sha256")})
    return paths, warning


def _check_output(output, force):
    """Refuse an --output whose name does not end in .npz (--force could otherwise replace
    a run's spm.model, config.json or metrics.jsonl), one named like a run's own checkpoint,
    a directory, a path in a directory that does not exist, and (without --force) an
    existing file."""
    if not output.endswith(".npz") and not os.path.isdir(output):
        raise AverageError(f"--output {output}: an average is a .npz checkpoint; give a name "
                           "ending in .npz, e.g. avg.npz")
    if CHECKPOINT_NAME.fullmatch(os.path.basename(output)):  # (it would be taken for one)
        raise AverageError(f"--output {output}: named like a run's own checkpoint, it would be "
                           "taken for one (an average has no optimizer state to resume from); "
                           "give another name, e.g. avg.npz")
    if os.path.isdir(output):
        raise AverageError(f"--output {output} is a directory; give a file name, e.g. "
                           f"{os.path.join(output, 'avg.npz')}")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise AverageError(f"--output {output}: the directory {parent} does not exist; "
                           "create it or choose another path")
    if os.path.lexists(output) and not force:
        raise AverageError(f"--output {output} exists; give another name, or --force to "
                           "replace it")


def main(argv=None):
    """-> exit code: 0; 2 for a flag or a file that cannot work (one `error:` line saying
    what to do); 1 when writing failed."""
    args = build_parser().parse_args(argv)
    try:
        paths, warning = average_run(args.run_dir, args.last, args.output, args.force)
    except (AverageError, ckpt.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: cannot write {args.output}: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.output}: average of {len(paths)} checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
