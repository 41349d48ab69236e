"""A training run's directory: every file name in it, and every choice made from them.

    RUN_DIR/config.json               the model config and the run's options (--resume)
    RUN_DIR/spm.model, spm.vocab      the joint sentencepiece model
    RUN_DIR/data/                     the generated corpus, when training without --data
    RUN_DIR/checkpoint_last.npz       the latest state: --resume continues from it
    RUN_DIR/checkpoint_best.npz       the best validation BLEU so far
    RUN_DIR/checkpoint_<update>.npz   periodic checkpoints (the last --keep-last kept)
    RUN_DIR/metrics.jsonl             one JSON record per log line and per validation
    RUN_DIR/<split>.hyp               the test split's translations
    RUN_DIR/train.lock                held (flock) by the run training here; who and since when
    RUN_DIR/unsaved-<UTC time>/       what a run that stopped before its first checkpoint left,
                                      set aside when a new run starts here (set_aside_unsaved)

train.py writes it, translate.py and averaging read it; the checkpoint a translation uses
(the best, else the last; or the average of the last N periodic ones) and the check that a
checkpoint belongs with the run's vocabulary are made here, once.
"""
import datetime
import errno
import fcntl
import json
import os
import re
import socket

from . import checkpoint as ckpt
from .fileio import atomic_write_text


def _path(name):
    """A property: the path of file ``name`` in the run directory."""
    return property(lambda self: self.file(name))


class RunDir:
    """The directory ``path`` of one training run (see the module docstring)."""

    def __init__(self, path):
        self.path = os.fspath(path)

    def file(self, name):
        return os.path.join(self.path, name)

    config = _path("config.json")        # the model config and the run's options
    spm_model = _path("spm.model")       # the sentencepiece model
    spm_prefix = _path("spm")            # sentencepiece writes <prefix>.model, <prefix>.vocab
    data = _path("data")                 # the generated corpus (no --data)
    last = _path("checkpoint_last.npz")  # the latest state
    best = _path("checkpoint_best.npz")  # the best validation BLEU
    metrics = _path("metrics.jsonl")
    lock_file = _path("train.lock")      # one training run at a time (RunDir.lock)

    def periodic(self, update):
        return self.file(f"checkpoint_{update}.npz")

    def hypotheses(self, split):
        return self.file(f"{split}.hyp")

    # ---- one run at a time ----
    def lock(self):
        """Take the run directory for this process: an exclusive ``flock`` on train.lock,
        held until the process ends (the OS releases it when the process dies, however it
        dies, so a killed run never leaves the directory locked). Another process holding
        it -> RunDirBusy naming its host, PID and start time. Reading the run (translate.py,
        averaging) takes no lock. -> False where the file system has no locks (the run
        goes on unguarded), else True."""
        fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
            os.close(fd)
            if exc.errno in NO_LOCKS:  # a file system without flock (some cluster mounts)
                return False
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            raise RunDirBusy(self.path, holder) from None
        self._lock_fd = fd  # kept open (and so locked) for the life of the process
        since = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        try:  # who holds it, for the refusal's message (only informative: a full disk is
            os.ftruncate(fd, 0)  # no reason not to train)
            os.write(fd, f"host {socket.gethostname()}, PID {os.getpid()}, since {since}\n"
                     .encode("utf-8"))
        except OSError:
            pass
        return True

    def unlock(self):
        fd = getattr(self, "_lock_fd", None)
        if fd is not None:
            os.close(fd)  # closing releases the flock
            self._lock_fd = None

    def remove_stale_temporaries(self):
        """Delete the temporary files of saves that were interrupted (a killed process
        leaves ``.tmp-*`` beside the file it was replacing; the file itself is intact).
        Only the temporaries of the run's own files go (``atomic_write`` names them
        ``.tmp-<8 random characters><file name>``); call it while holding the lock.
        -> the names removed."""
        removed = []
        for name in sorted(os.listdir(self.path)):
            if STALE_TEMPORARY.fullmatch(name):
                os.unlink(self.file(name))
                removed.append(name)
        return removed

    # ---- the run's state ----
    def holds_run(self):
        """Whether a run has saved its state here (what --resume continues)."""
        return os.path.exists(self.last)

    def trim_metrics(self, update):
        """Drop the records of metrics.jsonl after ``update`` (and a line cut short by a
        kill): a run resumed from its checkpoint at ``update`` logs those updates again, so
        each update is recorded once (the scores ``translate.py --record`` added are
        kept: they do not come again). -> the number of lines dropped."""
        if not os.path.exists(self.metrics):
            return 0
        with open(self.metrics, encoding="utf-8") as fh:
            lines = fh.readlines()
        records = [_record(line) for line in lines]  # (None: a line cut short)
        keep = [line for line, rec in zip(lines, records) if rec is not None
                and (rec.get("update", 0) <= update or "recorded_by" in rec)]
        if len(keep) != len(lines) or (keep and not keep[-1].endswith("\n")):
            self._rewrite_metrics(keep)
        return len(lines) - len(keep)

    def _rewrite_metrics(self, lines):
        """metrics.jsonl replaced, atomically, by ``lines`` (each ended by a newline)."""
        atomic_write_text(self.metrics, "".join(line.rstrip("\n") + "\n" for line in lines))

    def append_record(self, record):
        """Append ``record`` as the last line of metrics.jsonl, in place (a training run that
        has the file open goes on appending after it), so that it is a line of its own: a
        last line without its newline gets one when it is a whole record (an edited file),
        and is cut off when it was cut short (a run killed while writing it, or a full
        disk), as trim_metrics would on --resume. One open file throughout."""
        with open(self.metrics, "a+b") as fh:  # (every write at the end, wherever that is)
            fh.seek(0)
            text = fh.read()
            whole = text.rfind(b"\n") + 1  # (the complete lines)
            if whole < len(text):
                if _record(text[whole:].decode("utf-8", "replace")) is None:
                    fh.truncate(whole)
                else:
                    fh.write(b"\n")
            fh.write((json.dumps(record) + "\n").encode("utf-8"))

    def add_test_record(self, record):
        """Append train.py's test ``record`` to metrics.jsonl, in place of one that scored
        the same checkpoints the same way (a finished run resumed to be tested again),
        so each score is recorded once."""
        same = ("update", "test_split", "test_checkpoints", "beam", "alpha")
        lines = []
        if os.path.exists(self.metrics):
            with open(self.metrics, encoding="utf-8") as fh:
                lines = fh.readlines()
        kept = [line for line, rec in zip(lines, map(_record, lines))
                if not (rec is not None and "test_bleu" in rec and "recorded_by" not in rec
                        and all(rec.get(k) == record.get(k) for k in same))]
        if len(kept) == len(lines):
            self.append_record(record)
        else:
            self._rewrite_metrics(kept + [json.dumps(record)])

    def set_aside_unsaved(self, corpus=False):
        """A new run starting here (no checkpoint_last.npz): move what an earlier run that
        stopped before its first checkpoint left (its config, vocabulary, log, periodic
        checkpoints, hypotheses, generated corpus) into ``unsaved-<UTC time>/``, so that the
        new run neither reuses a vocabulary or corpus made with other flags nor appends to
        another run's log. The generated corpus (``data/``) goes with them only with
        ``corpus`` (a run without --data, which generates its own) and when there are such
        files: a data/ alone may be a corpus put there for the run.
        -> (that directory, the names moved), or None when there was nothing."""
        names = sorted(n for n in os.listdir(self.path) if UNSAVED_RUN_FILE.fullmatch(n))
        if not names:
            return None
        if corpus and os.path.isdir(self.data):
            names.append("data")
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        aside, n = self.file(f"unsaved-{stamp}"), 1
        while os.path.exists(aside):
            n += 1
            aside = self.file(f"unsaved-{stamp}-{n}")
        os.mkdir(aside)
        for name in names:
            os.rename(self.file(name), os.path.join(aside, name))
        return aside, names

    def read_config(self):
        with open(self.config, encoding="utf-8") as fh:
            return json.load(fh)

    def write_config(self, model, options):
        atomic_write_text(self.config, json.dumps({"model": model, "train": options}, indent=2,
                                                  sort_keys=True))

    def periodic_checkpoints(self):
        """[(update, path)] of the periodic checkpoints, oldest first."""
        return ckpt.periodic_checkpoints(self.path)

    def prune(self, keep_last):
        """Delete all but the newest ``keep_last`` periodic checkpoints (0 keeps all)."""
        ckpt.prune_checkpoints(self.path, keep_last)

    # ---- choosing what to translate with ----
    def choose_checkpoints(self, average_last=0):
        """The checkpoints a translation uses: the newest ``average_last`` periodic ones
        (averaged, §6.1), or else the best, or else the last."""
        if average_last:
            found = [p for _, p in self.periodic_checkpoints()]
            if not found:
                raise ckpt.CheckpointError(f"--average-last: no checkpoint_<update>.npz in "
                                           f"{self.path}")
            return found[-average_last:]
        return [self.best if os.path.exists(self.best) else self.last]

    def load_params(self, checkpoints, average=False):
        """-> (params, meta, description) of one checkpoint, or of the average of several
        (or, with ``average``, of however many there are)."""
        if average or len(checkpoints) > 1:
            params, meta = ckpt.average_checkpoints(checkpoints)
            return params, meta, f"average of {len(checkpoints)} checkpoints"
        params, _, meta = ckpt.load_checkpoint(checkpoints[0], optimizer=False)
        return params, meta, checkpoints[0]

    def require_spm_model(self):
        """Refuse a directory without the run's sentencepiece model (not a training run)."""
        if not os.path.exists(self.spm_model):
            raise ckpt.CheckpointError(f"--run-dir {self.path}: no spm.model (is it a training "
                                       "run directory?)")

    def check_vocabulary(self, where, meta, vocab_size=None):
        """Refuse a checkpoint (``where``, its ``meta``) trained with another sentencepiece
        model than this run's, or a model whose vocabulary size is not the tokenizer's."""
        self.require_spm_model()
        if meta.get("spm_sha256") not in (None, ckpt.file_sha256(self.spm_model)):
            raise ckpt.CheckpointError(f"{where} was trained with another sentencepiece "
                                       f"vocabulary than {self.spm_model}; use the run "
                                       "directory it came from")
        model_vocab = meta["config"]["vocab_size"] if "config" in meta else None
        if vocab_size is not None and model_vocab is not None and vocab_size != model_vocab:
            raise ckpt.CheckpointError(f"{self.spm_model} has {vocab_size} pieces but the "
                                       f"checkpoint's model has vocab_size {model_vocab}")


NO_LOCKS = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP}  # flock not supported there
# the names of a run's own checkpoints (the last, the best, the periodic ones)
CHECKPOINT_NAME = re.compile(r"checkpoint_(last|best|\d+)\.npz")
# what atomic_write leaves of an interrupted save of one of the run's files
STALE_TEMPORARY = re.compile(rf"\.tmp-.{{8}}({CHECKPOINT_NAME.pattern}|config\.json|"
                             r"metrics\.jsonl|spm\.(model|vocab)|[^/]*\.hyp)")


# the files of a run, which a new run must not mix with its own (RunDir.set_aside_unsaved)
UNSAVED_RUN_FILE = re.compile(r"config\.json|metrics\.jsonl|spm\.(model|vocab)|"
                              r"checkpoint_(best|\d+)\.npz|[^/]*\.hyp")


def _record(line):
    """The record (a dict) a metrics.jsonl line holds, or None (a line cut short by a kill)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


class RunDirBusy(RuntimeError):
    """Another process trains in this run directory."""

    def __init__(self, path, holder):
        super().__init__(f"--run-dir {path} is in use by another training run "
                         f"({holder or 'holder unknown'}); wait for it to finish or stop it "
                         "(it saves on SIGINT / SIGTERM), or choose another --run-dir. "
                         "translate.py can read the run meanwhile")
        self.path, self.holder = path, holder
