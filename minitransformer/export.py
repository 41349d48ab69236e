"""python -m minitransformer.export ctranslate2: a trained run as a CTranslate2 model directory.

    python -m minitransformer.export ctranslate2 --run-dir runs/ende --output ende-ct2 \\
        [--checkpoint FILE ... | --average-last 5] [--quantization int8] [--force]

The model is described through CTranslate2's specification API (``ctranslate2.specs``) and
saved with it; nothing else of CTranslate2 is used. The output directory holds model.bin,
config.json, shared_vocabulary.json (CTranslate2's files), spm.model (the run's sentencepiece
model, to tokenize) and minitransformer.json (the export's source and model config). It is
built in a temporary directory beside --output and renamed into place at the end, so an
interrupted export leaves nothing half-written; an existing non-empty --output is replaced
only with --force (and only when it holds a CTranslate2 model). Nothing the run directory
holds is changed (an --output may be made inside it).

Usage (pieces in, pieces out; translate_options sets the decoding options below)::

    import ctranslate2, sentencepiece as spm
    from minitransformer.export import translate_options
    sp = spm.SentencePieceProcessor(model_file="ende-ct2/spm.model")
    pieces = sp.encode("the small dog sees a cat", out_type=str)
    out = ctranslate2.Translator("ende-ct2").translate_batch(
        [pieces], **translate_options("ende-ct2", len(pieces), beam=4))
    print(sp.decode(out[0].hypotheses[0]))

Mapping: our weights become CTranslate2's TransformerSpec as minitransformer/ct2_spec.py
lists (every matrix transposed, q/k/v fused, our position table written as the
encodings); ``ct2_spec.unsupported`` says which configs cannot be mapped.

Refused (exit code 2, one line naming the config field): a config field or value this exporter
does not know (a newer minitransformer: export with that version), n_layers < 1 (CTranslate2
needs a layer in each stack), max_positions < 2 (no room for a source piece and EOS), and
special-token ids outside the vocabulary or equal to one another.

Decoding equivalence (float32 export, CPU; checked by tests/test_export.py):
  * ``beam_size=1`` is our ``greedy_search``, token for token, given the options below.
  * Beam search, length penalty: CTranslate2 divides a finished hypothesis's log-probability
    by ``n ** length_penalty`` with n the tokens it generated, EOS included (its hypotheses
    keep EOS until the end; return_end_token only decides whether EOS is returned). Our
    ``--length-penalty power`` does the same: (|Y| + 1) ** alpha for a hypothesis ending in
    EOS, |Y| ** alpha for one cut at the maximum length, and 1 for an empty one. So 'power'
    with alpha = length_penalty matches (tested for alpha 0, 0.6 and 1.4); our default,
    'gnmt' ((5 + |Y|) / 6) ** alpha, has no CTranslate2 counterpart except at alpha = 0.
  * Beam search, otherwise: both keep ``beam`` hypotheses, take the 2 * beam best candidates a
    step, finish a candidate ending in EOS only among the ``beam`` best, and stop a sentence
    at ``beam`` finished ones (CTranslate2's patience=1; with length_penalty=0 it stops as soon
    as its best candidate ends, which cannot change the best: every later hypothesis scores
    lower). They can still differ: (1) we never extend a hypothesis with padding or BOS, yet
    keep both in the softmax's normaliser; CTranslate2 can do one of the two only:
    suppress_sequences takes them out before the softmax, which shifts every step's
    log-probabilities by log(1 - p(pad) - p(BOS)) (3e-3 on average, up to 3e-2, in a model
    trained for seconds with label smoothing: enough to reorder close beams in 2 to 3% of
    sentences), while without it they stay in the normaliser but may be candidates. So
    translate_options suppresses them for greedy search (the argmax is then exactly ours)
    and not for beam search (200 of 200 sentences identical with length_penalty=0 on the
    tests' model; a pad or BOS candidate would show up as a difference); (2) at the maximum
    length CTranslate2 finishes the ``beam`` best candidates, we the EOS ones among them and
    then the ``beam`` best that continue, which may include ranks beam+1..2*beam; (3)
    CTranslate2 sums scores in float32, we in float64 (a near tie can go either way).
  * Options that must be set (translate_options returns them): max_decoding_length =
    min(source pieces + 1 + max_len_a, P - 1) (ours is per sentence: batch sources of one
    length, or translate one at a time); min_decoding_length=0 (its default 1 forbids an
    immediate EOS, which we allow); for beam 1 suppress_sequences=[[pad piece], [BOS piece]]
    (we never generate them); max_input_length=P; length_penalty=alpha; the defaults patience=1,
    num_hypotheses=1, sampling_topk=1, coverage_penalty=0, repetition_penalty=1,
    no_repeat_ngram_size=0, disable_unk=False, return_end_token=False (EOS not returned, as
    ours), prefix_bias_beta=0. An empty source line: we output an empty line without
    decoding; CTranslate2 would translate the lone EOS, so skip empty lines yourself.
  * The layer norm epsilon is honoured (config.json layer_norm_epsilon; without it
    CTranslate2 would use 1e-5, or 1e-6 for RMS norms): log-probabilities of a model with
    ln_eps=0.5 agree with ours to 1e-6, as for every config above.
  * int8 and float16 exports are approximations: their outputs may differ from ours.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import stat
import sys
import tempfile
from typing import Optional, Sequence, Union

from .ct2_spec import model_spec, unsupported
from .mt.fileio import umask
from .mt.ranges import add_number
from .process import configure_process

USER_ERROR = 2     # a flag, the run or its config cannot be exported: the message says why
MACHINE_ERROR = 1  # the machine could not finish (e.g. the disk filled up while writing)
INTERRUPTED = 128 + signal.SIGINT
QUANTIZATIONS = ("int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16",
                 "float16", "bfloat16", "float32")  # CTranslate2's ACCEPTED_MODEL_TYPES
INFO_FILE = "minitransformer.json"  # what was exported, read by translate_options

class ExportError(ValueError):
    """The run, its config or an option cannot be exported: one line saying what to do."""


# ----------------------------------------------------------------------------- the API

def export_ctranslate2(run_dir: Union[str, os.PathLike], output: Union[str, os.PathLike],
                       checkpoint: Union[None, str, os.PathLike, Sequence] = None,
                       average_last: Optional[int] = None, quantization: Optional[str] = None,
                       force: bool = False) -> str:
    """Convert the run in ``run_dir`` into a CTranslate2 model directory ``output``.

    The model is the run's best checkpoint (else its last), ``checkpoint`` (one path, or a
    list of paths to average), or the average of its last ``average_last`` periodic
    checkpoints. ``quantization``: one of QUANTIZATIONS, or None to keep float32. An
    existing non-empty ``output`` is replaced only with ``force``. -> the output path.
    Raises ExportError for anything the user can fix (the message names it).
    """
    run_dir, output = os.fspath(run_dir), os.fspath(output)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ExportError(f"--quantization {quantization}: not a CTranslate2 type; choose one "
                          f"of {', '.join(QUANTIZATIONS)}")
    checkpoints = _checkpoint_list(checkpoint)
    _check_run(run_dir, checkpoints, average_last)
    _check_output(output, run_dir, force)
    checkpoints = _chosen(run_dir, checkpoints, average_last)
    problem = unsupported(_peek_config(checkpoints[0]))
    if problem:
        raise ExportError(f"{checkpoints[0]}: {problem}")
    ct2 = _import_ctranslate2()
    model, tok, what = _load(run_dir, checkpoints)
    spec = model_spec(model, tok, ct2)
    info = {"exported_from": os.path.abspath(run_dir), "checkpoint": what,
            "checkpoints": [os.path.abspath(p) for p in checkpoints],  # (averaged if several)
            "quantization": quantization or "float32", "config": _config_dict(model.cfg),
            "pad_token": tok.id_to_piece(model.cfg.pad_id),
            "bos_token": tok.id_to_piece(model.cfg.bos_id)}
    _write_atomically(output, lambda tmp: _save(spec, quantization, tok.model_path, info, tmp))
    return output


def translate_options(model_dir: Union[str, os.PathLike], source_length: int, beam: int = 1,
                      alpha: float = 0.0, max_len_a: int = 50) -> dict:
    """Keyword arguments for ``ctranslate2.Translator.translate_batch`` that make it search as
    mt/search.py does with ``beam``, ``alpha`` and ``max_len_a``, for a batch of sources of
    ``source_length`` pieces each (EOS not counted): greedy_search for beam 1, beam_search
    with ``length_penalty="power"`` (``alpha`` becomes CTranslate2's length_penalty) for
    beam > 1 (the module docstring lists where the two can still differ)."""
    with open(os.path.join(os.fspath(model_dir), INFO_FILE), encoding="utf-8") as f:
        info = json.load(f)
    return search_options(info["config"]["max_positions"], info["pad_token"],
                          info["bos_token"], source_length, beam, alpha, max_len_a)


def search_options(max_positions: int, pad_token: str, bos_token: str, source_length: int,
                   beam: int = 1, alpha: float = 0.0, max_len_a: int = 50) -> dict:
    """translate_options for a model of ``max_positions`` positions whose padding and BOS
    are the pieces ``pad_token`` and ``bos_token`` (for a model saved without
    minitransformer.json, e.g. the benchmark's)."""
    P = max_positions
    fed = min(source_length, P - 1) + 1  # the source as the encoder sees it, EOS included
    options = dict(beam_size=beam, max_decoding_length=max(1, min(fed + max_len_a, P - 1)),
                   min_decoding_length=0, max_input_length=P, num_hypotheses=1, patience=1,
                   return_end_token=False, sampling_topk=1)
    if beam > 1:  # padding and BOS stay in the softmax's normaliser, as in ours
        options["length_penalty"] = float(alpha)
    else:  # never the argmax, as in ours
        options["suppress_sequences"] = [[pad_token], [bos_token]]
    return options


# ----------------------------------------------------------------------------- checks

def _checkpoint_list(checkpoint):
    if checkpoint is None:
        return None
    if isinstance(checkpoint, (str, os.PathLike)):
        return [os.fspath(checkpoint)]
    return [os.fspath(c) for c in checkpoint] or None


def _import_ctranslate2():
    try:
        import ctranslate2
        import ctranslate2.specs  # noqa: F401
    except ImportError as exc:
        raise ExportError(f"ctranslate2 cannot be imported ({exc}); install it with "
                          "`pip install ctranslate2` (or `pip install -e .[deploy]`)") from None
    return ctranslate2


def _check_run(run_dir, checkpoints, average_last):
    """translate.py's checks of --run-dir, --checkpoint and --average-last."""
    from .mt.translate import UsageError, check_run_dir
    args = argparse.Namespace(run_dir=run_dir, checkpoint=checkpoints,
                              average_last=average_last or 0)
    try:
        check_run_dir(args)
    except UsageError as exc:
        raise ExportError(str(exc)) from None


def _check_output(output, run_dir, force):
    """Refuse an --output that is a file, would replace the run, or is a non-empty directory
    (without --force, or with --force when it is not a CTranslate2 model directory), and
    one that cannot be replaced by a rename: the current directory, a mount point."""
    if not output:
        raise ExportError("--output is empty; give the directory to write the CTranslate2 "
                          "model to")
    real = os.path.realpath(output)
    if os.path.realpath(run_dir) == real or \
            os.path.realpath(run_dir).startswith(real.rstrip(os.sep) + os.sep):
        raise ExportError(f"--output {output} is the run directory or contains it; give a "
                          "new directory for the CTranslate2 model")
    cwd = os.path.realpath(os.getcwd())
    if real == cwd or cwd.startswith(real.rstrip(os.sep) + os.sep):
        raise ExportError(f"--output {output} is the current directory or contains it; the "
                          "export puts a new directory in its place: give a new directory")
    _check_writable(output)
    if not os.path.lexists(output):
        return
    if os.path.islink(output):
        raise ExportError(f"--output {output} is a symbolic link; the export puts a new "
                          "directory in its place, not in the one it points to: give the "
                          "directory's own path, or a new directory")
    if not os.path.isdir(output):
        raise ExportError(f"--output {output} exists and is not a directory; give a new "
                          "directory for the CTranslate2 model")
    if os.path.ismount(output):
        raise ExportError(f"--output {output} is a mount point, which the export cannot put "
                          "a new directory in place of: give a new directory inside it")
    if os.listdir(output) and not force:
        raise ExportError(f"--output {output} exists and is not empty; give a new directory, "
                          "or --force to replace it")
    if os.listdir(output) and not os.path.isfile(os.path.join(output, "model.bin")):
        raise ExportError(f"--output {output} is not empty and holds no model.bin: --force "
                          "replaces only a CTranslate2 model directory; give a new directory")


def _check_writable(output):
    """Refuse an --output whose nearest existing parent directory we cannot write into."""
    parent = os.path.dirname(os.path.abspath(output))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        if os.path.lexists(output):  # (replaced by a rename, not written into)
            raise ExportError(f"--output {output}: the export writes the model beside it, in "
                              f"{parent}, and renames it into place, so {parent} must be "
                              "writable; choose a path in a directory you can write to")
        raise ExportError(f"--output {output}: cannot create it ({parent} is not a writable "
                          "directory); choose a path you can write to")


def _chosen(run_dir, checkpoints, average_last):
    """The checkpoint files to export: translate.py's choice (RunDir.choose_checkpoints)."""
    from .mt import checkpoint as ckpt
    from .mt.rundir import RunDir
    if average_last or not checkpoints:
        try:
            return RunDir(run_dir).choose_checkpoints(average_last or 0)
        except ckpt.CheckpointError as exc:
            raise ExportError(str(exc)) from None
    return checkpoints


def _load(run_dir, checkpoints):
    """-> (model, tokenizer, description) as translate.py loads them (averaged when several)."""
    from .mt import checkpoint as ckpt
    from .mt.data import DataError
    from .mt.translate import load_model
    try:
        return load_model(run_dir, checkpoints, 0, "cpu")
    except (ckpt.CheckpointError, DataError, ValueError) as exc:
        raise ExportError(str(exc)) from None


def _peek_config(path):
    """The model config stored in checkpoint ``path``, reading only its meta entry ({} when it
    cannot be read: load_model then says what is wrong with the file)."""
    from .mt.checkpoint import peek_meta
    config = peek_meta(path).get("config")
    return config if isinstance(config, dict) else {}


def _config_dict(cfg):
    import dataclasses
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------- writing

def _save(spec, quantization, spm_model, info, directory):
    """Validate, quantize and save ``spec`` into ``directory``, with spm.model and INFO_FILE."""
    try:
        spec.validate()
        spec.optimize(quantization=quantization)
    except (RuntimeError, ValueError) as exc:  # e.g. bfloat16 without torch
        raise ExportError(f"--quantization {quantization}: {exc}") from None
    spec.save(directory)
    shutil.copyfile(spm_model, os.path.join(directory, "spm.model"))
    with open(os.path.join(directory, INFO_FILE), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2, sort_keys=True)
        f.write("\n")


def _write_atomically(output, fill):
    """Call ``fill(tmp)`` on a new directory beside ``output``, flush its files to disk, then
    rename it to ``output`` (an existing one is moved aside first and removed after). On a
    failure the existing model is put back; should that fail too, it is kept where it was
    moved, and the error says where."""
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    name = os.path.basename(os.path.abspath(output))
    tmp = tempfile.mkdtemp(prefix=".tmp-", suffix="-" + name, dir=parent)
    old = None
    try:
        fill(tmp)
        _sync_directory(tmp)
        os.chmod(tmp, 0o777 & ~umask())
        was = os.stat(output) if os.path.isdir(output) else None
        if os.path.isdir(output) and os.listdir(output):
            old = tempfile.mkdtemp(prefix=".old-", suffix="-" + name, dir=parent)
            os.rename(output, os.path.join(old, name))
        os.replace(tmp, output)
        if was is not None:  # the directory replaced: its mode and owner stay (set once in
            _same_mode_and_owner(output, was)  # place: a failure before leaves tmp removable)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        moved = None if old is None else os.path.join(old, name)
        if moved is not None and os.path.exists(moved) and not os.path.exists(output):
            try:  # put the old model back
                os.rename(moved, output)
            except OSError as again:
                old = None  # (kept: not removed below)
                raise OSError(again.errno, f"{again.strerror}; the previous model at "
                              f"{output} is kept in {moved}", moved) from exc
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _same_mode_and_owner(path, st):
    """Give directory ``path`` the permissions, owner and group of ``st`` (a directory the
    export replaces); the owner and group only where this process may set them (as their
    owner or root), and silently not elsewhere."""
    os.chmod(path, stat.S_IMODE(st.st_mode))
    try:
        os.chown(path, st.st_uid, st.st_gid)
    except PermissionError:
        try:  # (a member of the group may still give it)
            os.chown(path, -1, st.st_gid)
        except PermissionError:
            pass


def _sync_directory(path):
    """Flush the files of directory ``path``, and its entries, to disk."""
    for name in os.listdir(path) + [os.curdir]:
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- main

def build_parser():
    p = argparse.ArgumentParser(prog="python -m minitransformer.export",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="target", required=True, metavar="TARGET")
    c = sub.add_parser("ctranslate2", help="a CTranslate2 model directory",
                       description="Convert a trained run into a CTranslate2 model directory "
                                   "(see `pydoc minitransformer.export`).")
    c.add_argument("--run-dir", required=True, help="the training run (config.json, "
                                                    "spm.model, checkpoints); its files are "
                                                    "only read")
    c.add_argument("--checkpoint", nargs="+", default=None,
                   help="checkpoint file(s); several are averaged (default: the run's best, "
                        "else last)")
    add_number(c, "--average-last", int, ">= 1", default=None, metavar="N",
               help="average the run's last N periodic checkpoints (wins over --checkpoint)")
    c.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="weight type (default: float32, the only exact one)")
    c.add_argument("--output", required=True, help="the model directory to write")
    c.add_argument("--force", action="store_true",
                   help="replace an existing CTranslate2 model directory at --output")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """-> exit code: 0; 2 when the run, a flag or --output is wrong (one `error:` line saying
    what to do); 1 when the machine could not finish writing; 130 on Ctrl-C."""
    args = build_parser().parse_args(argv)
    try:
        out = export_ctranslate2(args.run_dir, args.output, args.checkpoint, args.average_last,
                                 args.quantization, args.force)
    except ExportError as exc:
        return _fail(str(exc), USER_ERROR)
    except OSError as exc:
        from .mt.fileio import describe_os_error
        return _fail(f"cannot write {args.output}: {describe_os_error(exc)}", MACHINE_ERROR)
    except MemoryError:
        return _fail("out of memory while converting the model; free some memory or export "
                     "on a machine with more", MACHINE_ERROR)
    except KeyboardInterrupt:
        return _fail("interrupted (Ctrl-C); nothing was written", INTERRUPTED)
    print(f"wrote {out}: CTranslate2 model ({args.quantization or 'float32'}) with spm.model; "
          f"decode as our search does with minitransformer.export.translate_options")
    return 0


def _fail(message, code):
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    configure_process()  # BLAS, malloc and TF32 settings, before NumPy loads
    sys.exit(main())
