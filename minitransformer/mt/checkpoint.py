"""Checkpoints: one ``.npz`` of named arrays per checkpoint, written atomically.

A run directory holds
    config.json               {"model": TransformerConfig fields, "train": training options}
    spm.model                 the joint sentencepiece model
    checkpoint_last.npz       the newest state (written at every save)
    checkpoint_best.npz       the best by validation BLEU
    checkpoint_<update>.npz   periodic ones, the newest ``keep_last`` kept
    metrics.jsonl             one JSON object per logged update / validation
Each checkpoint holds the parameters as ``model/<name>`` (float32, shapes in the README), the
Adam moments as ``optim/m.<i>`` and ``optim/v.<i>`` (i = parameter order), and ``meta``: one
JSON string with the update count, data position, random-generator states, best BLEU, the
model config and the sentencepiece model's SHA-256. Everything loads with
``np.load(path, allow_pickle=False)`` on any machine, whatever device wrote it.
Writes go to a temporary file in the same directory, are flushed to disk, then renamed over
the target: a run killed at any moment leaves the previous checkpoint intact.
"""
import glob
import hashlib
import json
import os
import re

import numpy as np

from ..nn.transformer import TransformerConfig
from .fileio import atomic_write


class CheckpointError(ValueError):
    pass


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def save_checkpoint(path, model, optimizer=None, meta=None):
    arrays = {f"model/{k}": v for k, v in model.state_dict().items()}
    if optimizer is not None:
        for k, v in optimizer.state_dict().items():
            if isinstance(v, np.ndarray):
                arrays[f"optim/{k}"] = v
    meta = dict(meta or {})
    meta["config"] = json.loads(model.cfg.to_json())
    if optimizer is not None:
        meta["optim"] = {"t": optimizer.t, "lr": optimizer.lr}
    arrays["meta"] = np.array(json.dumps(meta))
    atomic_write(path, lambda f: np.savez(f, **arrays))


def check_npz(path):
    """Raise CheckpointError (its message starting with ``path``) unless ``path`` starts like
    the zip archive every .npz checkpoint is (a clearer message than NumPy's for a file
    that is not one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if head != b"PK\x03\x04":
        raise CheckpointError(f"{path}: not an .npz checkpoint (damaged, or another kind of "
                              "file); use a checkpoint_*.npz file that train.py wrote")


def load_checkpoint(path, optimizer=True):
    """-> (params dict, optimizer arrays dict, meta dict). Clear errors for bad files.
    ``optimizer=False`` leaves the optimizer's arrays unread (an empty dict): translating
    and averaging need only the model's, a third of a checkpoint's bytes with Adam."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    check_npz(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files if optimizer or not k.startswith("optim/")}
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); it is not a "
                              "minitransformer .npz checkpoint or it is damaged") from exc
    if "meta" not in data:
        raise CheckpointError(f"checkpoint {path} has no 'meta' entry: not a minitransformer "
                              "checkpoint")
    meta = json.loads(str(data.pop("meta")))
    params = {k[6:]: v for k, v in data.items() if k.startswith("model/")}
    optim = {k[6:]: v for k, v in data.items() if k.startswith("optim/")}
    return params, optim, meta


def peek_meta(path):
    """The meta dict of checkpoint ``path``, reading only that entry; {} when it cannot be
    read (loading the checkpoint then says what is wrong with the file)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
    except Exception:  # any damage, or not a checkpoint
        return {}
    return meta if isinstance(meta, dict) else {}


def check_compatible(path, meta, cfg):
    """Raise CheckpointError when the checkpoint's model config differs from ``cfg`` (its
    vocabulary is checked by RunDir.check_vocabulary)."""
    theirs = TransformerConfig.from_dict(meta["config"])
    if theirs != cfg:
        diff = {k: (getattr(theirs, k), getattr(cfg, k)) for k in vars(cfg)
                if getattr(theirs, k) != getattr(cfg, k)}
        raise CheckpointError(f"checkpoint {path} was trained with a different model config: "
                              + ", ".join(f"{k}: checkpoint {a!r} vs requested {b!r}"
                                          for k, (a, b) in diff.items()))


def periodic_checkpoints(run_dir):
    """Periodic checkpoints of a run, oldest first: [(update, path)]."""
    found = []
    for p in glob.glob(os.path.join(run_dir, "checkpoint_*.npz")):
        m = re.fullmatch(r"checkpoint_(\d+)\.npz", os.path.basename(p))
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def prune_checkpoints(run_dir, keep_last):
    for _, p in periodic_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        os.unlink(p)


def average_checkpoints(paths):
    """Element-wise mean of the parameters of several checkpoints (§6.1) -> (params, meta):
    the first one's meta, with the sentencepiece vocabulary's hash (``spm_sha256``) that any
    of them records. Checkpoints of different models, or trained with different
    vocabularies (the same shapes, other words), are refused."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    total, meta0, vocab = None, None, None
    for p in paths:
        params, _, meta = load_checkpoint(p, optimizer=False)
        if total is None:
            total, meta0 = {k: v.astype(np.float64) for k, v in params.items()}, meta
        else:
            if meta["config"] != meta0["config"] or set(params) != set(total):
                raise CheckpointError(f"cannot average {p} with {paths[0]}: different models")
            for k, v in params.items():
                total[k] += v
        sha = meta.get("spm_sha256")  # (None: a checkpoint that does not record it)
        if sha is None:
            continue
        if vocab is None:
            vocab = (p, sha)  # the first checkpoint that records its vocabulary
        elif sha != vocab[1]:
            raise CheckpointError(f"cannot average {p} with {vocab[0]}: they were trained "
                                  "with different sentencepiece vocabularies")
    if vocab is not None:
        meta0 = {**meta0, "spm_sha256": vocab[1]}
    return {k: (v / len(paths)).astype(np.float32) for k, v in total.items()}, meta0
