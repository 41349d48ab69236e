"""train.py's output: the log lines (a tqdm bar on a terminal), metrics.jsonl, and the
signals that stop a run cleanly."""
import json
import math
import signal
import sys
import time

from .fileio import naming


class Log:
    """tqdm bar on a terminal, plain lines otherwise; JSONL metrics in the run directory."""

    def __init__(self, path, total, progress, enabled=True, comm=None):
        self.enabled, self.comm, self.path = enabled, comm, path
        self.file = open(path, "a", encoding="utf-8") if enabled else None
        self.bar = None
        if enabled and progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total or None, unit="upd", dynamic_ncols=True)
        # the window a log line averages over: the updates since the previous line
        self.loss, self.tokens, self.seconds, self.updates = 0.0, 0, 0.0, 0
        self.allreduce_s = 0.0  # the communicator's all-reduce seconds at the window's start

    def window(self):
        """The window so far (updates since the last line: their summed loss, tokens,
        seconds, count and, under mpiexec, all-reduce seconds), which a checkpoint keeps so
        that a resumed run's next line averages the same updates as an uninterrupted run's."""
        return {"loss": self.loss, "tokens": self.tokens, "seconds": self.seconds,
                "updates": self.updates,
                "allreduce_s": self.comm.allreduce_s - self.allreduce_s if self.comm else 0.0}

    def restore_window(self, window):
        """Go on from a checkpoint's ``window()``."""
        self.loss, self.tokens = float(window["loss"]), int(window["tokens"])
        self.seconds, self.updates = float(window["seconds"]), int(window["updates"])
        if self.comm:  # (the communicator's count starts again at 0 in this process)
            self.allreduce_s = self.comm.allreduce_s - float(window.get("allreduce_s", 0.0))

    def add_update(self, loss_sum, tokens, seconds):
        """One update (applied or skipped) into the window."""
        self.loss += loss_sum
        self.tokens += tokens
        self.seconds += seconds
        self.updates += 1

    def update_line(self, update, epoch, lr, train_time, loss_scale=None):
        """The metrics record and log line of update ``update``, over the window since the
        previous line: loss and ppl per target token, tokens/s of update time; under mpiexec
        the all-reduce's and the whole update's seconds per update. Starts a new window."""
        loss = self.loss / max(self.tokens, 1)
        rec = {"update": update, "epoch": epoch, "loss": loss, "ppl": math.exp(min(loss, 50)),
               "lr": lr, "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
               "time": train_time}
        if loss_scale is not None:
            rec["loss_scale"] = loss_scale
        if self.comm:
            rec["allreduce_s"] = (self.comm.allreduce_s - self.allreduce_s) / self.updates
            rec["update_s"] = self.seconds / self.updates
        self.metrics(rec)
        text = (f"loss {loss:.3f} ppl {rec['ppl']:.1f} lr {rec['lr']:.2e} "
                f"tok/s {rec['tokens_per_s']:.0f}")
        if self.comm:
            text += (f" allreduce {rec['allreduce_s'] * 1e3:.1f} ms of "
                     f"{rec['update_s'] * 1e3:.1f} ms/update")
        if self.bar is not None:
            self.progress(update, text)
        else:
            self.info(f"update {update} epoch {epoch} {text}")
        self.loss, self.tokens, self.seconds, self.updates = 0.0, 0, 0.0, 0
        self.allreduce_s = self.comm.allreduce_s if self.comm else 0.0

    def metrics(self, record):
        if self.enabled:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as exc:  # (a full disk: the error names the file)
                raise naming(exc, self.path) from exc

    def info(self, text):
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def progress(self, n, postfix):
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix_str(postfix, refresh=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.file:
            self.file.close()


class ForcedStop(KeyboardInterrupt):
    """A second stop signal: the run ends at once, without saving (StopSignals)."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


# A Ctrl-C this long after the first stop signal ends the run at once; one sooner is the same
# stop delivered twice (a terminal's Ctrl-C reaches mpiexec and every rank, and mpiexec
# forwards it too; a scheduler may signal the ranks and their launcher alike)
FORCE_AFTER_S = 1.0


class StopSignals:
    """Within ``with StopSignals(say) as stop:`` SIGINT and SIGTERM set ``stop.signum``
    instead of ending the process, so the loop can finish its update and save; ``say`` tells
    the user at once. A Ctrl-C (SIGINT) FORCE_AFTER_S or more after the first signal raises
    ForcedStop where the process is (a save in progress leaves the file it replaces intact:
    fileio.atomic_write); a repeated SIGTERM, which comes from a machine, never does."""

    def __init__(self, say=None):
        self.say = say

    def __enter__(self):
        self.signum, self.first = None, None
        self._saved = {s: signal.signal(s, self._on_signal)
                       for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def _on_signal(self, signum, frame):
        if self.signum is not None:
            if signum == signal.SIGINT and time.monotonic() - self.first >= FORCE_AFTER_S:
                raise ForcedStop(signum)
            return
        self.signum, self.first = signum, time.monotonic()
        if self.say is not None:
            self.say(f"{signal.Signals(signum).name}: stopping once the update, validation or "
                     "checkpoint in progress is done, and saving; Ctrl-C again stops at once, "
                     "without saving")

    def __exit__(self, *exc):
        for s, handler in self._saved.items():
            signal.signal(s, handler)
