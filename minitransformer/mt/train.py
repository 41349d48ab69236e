"""The training loop behind train.py (the paper's recipe, §5); its flags are in ``options``.

``Trainer`` prepares the data (sentencepiece model, length-bucketed batches: its base class
in corpus_setup.py), builds the model and Adam, then runs updates with the paper's
learning-rate schedule, validating (loss and greedy BLEU), checkpointing and logging as it
goes; ``main`` is the command line.
A run lives in one directory (config.json, spm.model, checkpoints, metrics.jsonl) and can be
resumed exactly from it. With ``--max-time`` and the linear schedule the run plans its number
of updates to the deadline (``plan``).
"""
import dataclasses
import json
import os
import signal
import sys
import time

import numpy as np

from .. import backend
from ..engine.profiler import Profiler
from ..engine.tensor import no_grad
from ..nn.transformer import Transformer, count_parameters
from ..optim import Adam, DynamicLossScaler, LossScaleCollapse, noam_lr
from . import checkpoint as ckpt
from . import autosize
from .checkpointing import Checkpointing
from .corpus_setup import CorpusSetUp
from .resume import Resuming
from .data import DataError, collate
from .fileio import atomic_write_text, describe_os_error, naming
from .guard import DivergenceGuard, Diverged, first_bad_op
from .log import ForcedStop, Log, StopSignals
from .options import (MODEL_FLAGS, PROFILE_WARMUP, check_options, fill_defaults, parse_args,
                      option_warnings, plans_to_deadline, restore_for_resume, run_options,
                      sizes_itself)
from .plan import MEASURE, SKIP, WARMUP_SHARE, DeadlinePlan
from .rundir import RunDir, RunDirBusy
from .step import train_step
from .translation import corpus_bleu, translate_lines


# Where --precision float16 may run. NumPy has no float16 matrix product that accumulates in
# float32 (as GPU tensor cores do): its own rounds every partial sum to float16, so long sums
# overflow, and it is ~100x slower than float32. The tests widen this to run the logic on a CPU.
FLOAT16_DEVICES = ("cuda",)


class Trainer(CorpusSetUp, Resuming, Checkpointing):
    """One training run: set up from the flags (data, vocabulary, model, optimizer; or the
    state of the run being resumed), then ``run()`` the loop and ``test()`` the result."""

    clock = staticmethod(time.perf_counter)  # the loop's clock (--max-time, the plan)

    def __init__(self, args, comm=None):
        self.args, self.comm = args, comm
        self.rank = comm.rank if comm else 0
        self.world = comm.size if comm else 1
        self.main = self.rank == 0
        device, named = backend.chosen_device(args.device)
        try:
            backend.get_xp(device)
        except (RuntimeError, ValueError) as exc:
            raise SystemExit(f"error: {named}: {exc}") from None
        if comm is not None:  # this rank's GPU (by local rank) and NCCL, or the CPU and MPI
            device = comm.init_device(device)
        self.device = device
        if args.precision == "float16" and device not in FLOAT16_DEVICES:
            raise SystemExit(f"error: --precision float16 needs a GPU (--device cuda); this run's "
                             f"device is {device}, where NumPy's float16 matrix products are "
                             "slow and round every partial sum to float16: use float32 here")
        self.rd = RunDir(args.run_dir)
        self._config_to_save = None  # (options given again on --resume: see _set_up)
        try:
            self._set_up()
        except BaseException:
            self.rd.unlock()
            raise

    def _set_up(self):
        args = self.args
        self._open_run_dir()
        if args.resume and args.precision == "float16" and self.device not in FLOAT16_DEVICES:
            raise SystemExit(f"error: --resume: the run trains with --precision float16 (in "
                             f"{self.rd.config}), which needs a GPU; this run's device is "
                             f"{self.device}: resume with --device cuda, or with --precision "
                             "float32")
        fill_defaults(args)
        if args.resume:
            self._check_resumed_schedule()
        self.sizing = sizes_itself(args)
        if self.sizing and "max_tokens" not in args.explicit:
            args.max_tokens = autosize.CPU_TOKENS if self.device == "cpu" else "auto"
        check_options(args)
        if self.comm:
            self._check_same_options()
        for line in option_warnings(args):
            self._log_early(line)
        self._prepare_data()
        self.cfg = self._model_config()
        self._prepare_valid()
        if self.sizing:
            self.cfg = self._choose_model()
        if args.max_tokens != "auto":
            self._make_batches()
        self._build_model()
        if args.max_tokens == "auto":  # (a new run: a resumed one has its number)
            self._fit_max_tokens()
            self._make_batches()
        if self.main and not args.resume:
            self.rd.write_config(dataclasses.asdict(self.cfg), run_options(args))
        elif self.main and run_options(args) != self._saved["train"]:
            # an option given again overrides the saved one, for the next --resume too: saved
            # with the next checkpoint (a run that fails before it leaves config.json as it was)
            self._config_to_save = (self._saved["model"], run_options(args))
            changed = [f"--{k.replace('_', '-')}" for k, v in sorted(run_options(args).items())
                       if k in args.explicit and self._saved["train"].get(k, v) != v]
            if changed:
                self._log_early(f"{', '.join(changed)} as given here: saved in config.json "
                                "with the next checkpoint, for the next --resume")
            note = self._rate_change()
            if note:
                self._log_early(note)

    def _check_same_options(self):
        """Every rank must train with rank 0's options (its model's and its run's; --data may
        name the same corpus by another path on another machine): refused before any work,
        alike on every rank."""
        a = self.args
        mine = {k: v for k, v in {**run_options(a), **{k: getattr(a, k) for k in MODEL_FLAGS
                                                        if hasattr(a, k)}}.items()
                if k != "data"}
        found = self.comm.differences_from_rank0(mine)
        if found is not None:
            rank, diff = found
            flags = ", ".join(f"--{k.replace('_', '-')} {v} (rank 0: {r})" for k, v, r in diff)
            raise SystemExit(f"error: the ranks were started with different options: rank "
                             f"{rank} has {flags}; give every rank the same command line")

    def _open_run_dir(self):
        """--run-dir: a new run there, or with --resume the run it holds (whose options then
        fill in those this command line does not give). Nothing in it is overwritten.
        Rank 0 holds the directory's lock for the life of the process (RunDir.lock)."""
        if not self.args.run_dir:
            raise SystemExit("error: --run-dir is empty: give the run's directory")
        if self.args.resume and not os.path.exists(self.rd.path):  # (not made: a typo)
            raise SystemExit(f"error: --resume: --run-dir {self.rd.path} does not exist; give "
                             "the directory of the run to continue")
        os.makedirs(self.rd.path, exist_ok=True)
        busy = None
        if self.main:
            try:
                if not self.rd.lock():  # (RunDirBusy while another run trains here)
                    self._log_early(f"warning: the file system of {self.rd.path} has no file "
                                    "locks; nothing stops a second run from training there")
            except RunDirBusy as exc:
                busy = (exc.path, exc.holder)
        if self.comm:  # (rank 0's verdict for every rank: the others hold no lock, and
            busy = self.comm.same_as_rank0(busy)  # would judge the directory by its files)
        if busy is not None:
            raise RunDirBusy(*busy)
        if self.main:
            removed = self.rd.remove_stale_temporaries()
            if removed:
                self._log_early(f"removed {len(removed)} temporary file(s) left by an "
                                f"interrupted save: {', '.join(removed)}")
        if self.args.resume:
            missing = [os.path.basename(p) for p in (self.rd.last, self.rd.config)
                       if not os.path.exists(p)]
            if missing:
                early = ("; the run there stopped before its first checkpoint: start it "
                         "again without --resume (what it left is set aside)"
                         if os.path.exists(self.rd.config) else "; start without --resume")
                raise SystemExit(f"error: --resume: no {' and no '.join(missing)} in "
                                 f"--run-dir {self.rd.path}{early}")
            self._saved = self.rd.read_config()
            restore_for_resume(self.args, self._saved, self.rd.path)
        elif self.rd.holds_run():
            raise SystemExit(f"error: --run-dir {self.rd.path} already holds a run "
                             "(checkpoint_last.npz); pass --resume to continue it or choose "
                             "another --run-dir (nothing was overwritten)")
        elif self.main:
            moved = self.rd.set_aside_unsaved(corpus=self.args.data is None)
            if moved:
                self._log_early(f"{self.rd.path} held what a run that stopped before its "
                                f"first checkpoint left ({', '.join(moved[1])}): moved to "
                                f"{moved[0]}; this run starts afresh")

    def _build_model(self):
        """The model, Adam and (float16) the loss scaler: new, or as the resumed run left
        them; under mpiexec every rank then holds rank 0's parameters."""
        a, half = self.args, self.args.precision == "float16"
        self.model = Transformer(self.cfg, seed=a.seed, device=self.device,
                                 compute_dtype=np.float16 if half else None)
        self.scaler = DynamicLossScaler(a.loss_scale_init, 2.0, a.loss_scale_window,
                                        a.min_loss_scale) if half else None
        self.params = self.model.parameters()
        self.optim = Adam(self.params, lr=0.0, betas=tuple(a.adam_betas), eps=a.adam_eps)
        self.update, self.best_bleu = 0, -1.0
        self.train_time = 0.0
        self.guard = DivergenceGuard(a.max_bad_updates)  # float32 (float16: the scaler)
        self.saved_update = None  # the update checkpoint_last.npz holds, once written
        # a signal stopped the run right after update ``self.update``, before the validation
        # and checkpoints due after it: --resume does them first (``_loop``)
        self.catch_up = False
        self.validated_at = None  # the update of the latest validation (not repeated on resume)
        self.best_due = False  # a validation found a new best not yet in checkpoint_best.npz
        self.log = None  # the run's Log (its line's window goes into each checkpoint)
        self.log_window = None  # the window the resumed checkpoint kept, for run()'s Log
        # (update, rate): a linear run (no plan) whose --max-updates changed on --resume
        # falls from this rate at this update in a straight line to 0 at its --max-updates
        self.linear_from = None
        self.last_batch = None  # (pairs, S, T) of the batch in hand, for an out-of-memory report
        self.plan = None
        if plans_to_deadline(a):
            self.plan = DeadlinePlan(a.max_time * 60, self.cfg.d_model, a.warmup, a.lr_factor,
                                     a.valid_every if self.valid is not None else 0,
                                     a.save_every, a.max_updates,
                                     warmup_share=None if "warmup" in a.explicit or a.resume
                                     else WARMUP_SHARE, average_last=a.average_last)
        if a.resume:
            self._load(self.rd.last)
            self.saved_update = self.update
            if self.main and not self.best_due:  # (a run put back to an older checkpoint:
                self.best_bleu = max(self.best_bleu, self.best_held())  # best only improves)
            if self.main and not a.profile:  # the log lines after the checkpoint come again
                self.rd.trim_metrics(self.update)
        if self.comm is not None:
            self.comm.broadcast_params(self.params)

    def _log_early(self, text):
        """A line of the set-up, printed by rank 0 (the corpus steps are in corpus_setup.py)."""
        if self.main:
            print(text, flush=True)

    # ---- training ------------------------------------------------------------------------
    def lr_at(self, update):
        a = self.args
        if self.plan is not None:
            return self.plan.lr(update)
        if a.lr_schedule == "linear":
            return self._linear_lr(update, a.max_updates)
        return noam_lr(update, self.cfg.d_model, a.warmup, a.lr_factor)

    def train_update(self):
        """One update (mt/step.py) over the next ``--update-freq`` batches, this rank's share
        of each under mpiexec. -> (loss_sum, tokens) over all ranks. An update whose loss or
        gradients are not finite is skipped: ``self.update`` does not advance (mt/guard.py)."""
        if self.comm:  # each rank its own dropout masks, a function of (seed, rank, update)
            self.model.rng.seed(self.comm.dropout_seed(self.args.seed, self.update))
        rng_state, batches = self.model.rng.get_state(), []
        try:
            result = train_step(self.model, self.optim, self._update_batches(batches),
                                self.lr_at(self.update + 1), scaler=self.scaler,
                                comm=self.comm, clip_norm=self.args.clip_norm)
        except LossScaleCollapse as exc:  # float16's guard gave up (on every rank alike)
            raise self._diverged(batches, rng_state, f"update {self.update + 1}: {exc}") \
                from None
        if result.applied:
            self.update += 1
        if self.scaler is None and self.guard.record(result.applied):
            raise self._diverged(batches, rng_state)
        return result.loss_sum, result.tokens

    def _update_batches(self, kept):
        """The update's batches, collated, one at a time (this rank's rows under mpiexec);
        each is also appended to ``kept`` (the guard replays them)."""
        for _ in range(self.args.update_freq):
            batch = next(self.batch_iter)
            if self.comm:
                batch = self.comm.shard(batch)
            if batch:
                kept.append(collate(batch, self.tok.pad_id, self.tok.bos_id, self.tok.eos_id))
                self.last_batch = (len(batch),) + tuple(kept[-1][k].shape[1]
                                                         for k in ("src", "tgt_in"))
                yield kept[-1]

    def _diverged(self, batches, rng_state, why=None):
        """Why training stops (``why``: the float16 loss scaler's reason; else too many bad
        updates in a row): the update, and the first op that made a NaN or an Inf (under
        mpiexec each rank replays its share; the lowest rank that finds the op speaks)."""
        found, where = first_bad_op(self.model, self.optim, batches, rng_state)
        speak = self.main
        if self.comm:
            first = self.comm.lowest_rank_where(found)
            speak, found = self.rank == (0 if first is None else first), first is not None
            where = where if first is None else f"on rank {first}, {where}"
        elif not found and why is None:
            where = ("no op made a NaN or an Inf in the replay: the sum of the squared "
                     "gradients overflowed float32 (a gradient norm above about 1e19)")
        saved = (f"the checkpoints in {self.rd.path} are as saved at update "
                 f"{self.saved_update}" if self.saved_update is not None
                 else f"no checkpoint was written in {self.rd.path}")
        if why is not None:  # float16 (the replay runs without the loss scale)
            where = where if found else "every op stayed finite (the loss scale overflowed)"
            return Diverged(f"{why}. Its batches replayed with every op checked, without the "
                            f"loss scale: {where}. {saved[0].upper()}{saved[1:]}.",
                            speak=speak)
        return Diverged(
            f"training diverged: {self.guard.bad_in_a_row} updates in a row had a loss or "
            f"gradient that is not finite (--max-bad-updates {self.args.max_bad_updates}); "
            f"each was skipped. Update {self.update + 1}: {where}. Nothing of it reached "
            f"the parameters or a checkpoint: {saved}. Lower --lr-factor, lengthen "
            "--warmup or set --clip-norm, then start a new --run-dir, or --resume with the "
            "new flags", speak=speak)

    def profile(self):
        """--profile N: PROFILE_WARMUP updates, then N updates under the profiler
        (engine/profiler.py), whose tables rank 0 prints, by op and by module; then the run
        stops. Nothing is saved (no checkpoint, no metrics): the updates change this
        process's copy of the model only. -> 0, the exit status."""
        self.batch_iter = iter(self.batches)
        for _ in range(PROFILE_WARMUP):
            self.train_update()
        with Profiler(self.model) as prof:
            for _ in range(self.args.profile):
                self.train_update()
        n = self.args.profile
        self._log_early(f"profile of {n} update{'s' if n > 1 else ''} after {PROFILE_WARMUP} "
                        f"warm-up updates ({self.device}, {self.args.precision}), by op:\n"
                        f"{prof.table(by='op')}\n\nby module (3 levels of the path):\n"
                        f"{prof.table(by='module', depth=3)}")
        return 0

    def validate(self):
        """Validation loss per token (no dropout) and greedy BLEU on the first N sentences."""
        loss_sum, n_tok = 0.0, 0
        with no_grad():
            self.model.eval()
            for idx in self.valid_batches.epoch_batches(0):
                b = collate(self.valid_batches.pairs(idx), self.tok.pad_id, self.tok.bos_id,
                            self.tok.eos_id)
                loss, n = self.model.loss(b["src"], b["tgt_in"], b["tgt_out"])
                loss_sum, n_tok = loss_sum + float(loss.data), n_tok + n
        vs, vt = self.valid
        n = self.args.valid_bleu_sentences or len(vs)
        hyps = translate_lines(self.model, self.tok, vs[:n], beam=1,
                               max_tokens=self.args.max_tokens)
        bleu, _ = corpus_bleu(hyps, vt[:n], self.args.bleu_tokenize)
        return loss_sum / max(n_tok, 1), bleu

    def run(self):
        """Train until a stopping rule (--max-updates / --max-epochs / --max-time) or a
        signal. -> True when training finished, False when a signal stopped it (the state
        is then saved in checkpoint_last.npz, to continue with --resume)."""
        with StopSignals(self._log_early) as stop:  # (a signal during the final save: noted)
            log = self.log = Log(self.rd.metrics, self.args.max_updates,
                                 not self.args.no_progress, enabled=self.main, comm=self.comm)
            if self.log_window is not None:  # (resumed: the next line's window goes on)
                log.restore_window(self.log_window)
            log.info(f"model: {count_parameters(self.model):,} parameters, config "
                     f"{json.dumps(dataclasses.asdict(self.cfg))}")
            if self.device == "cpu" and self.main:  # (the note is rank 0's to log)
                from ..doctor import slow_blas_note
                note = slow_blas_note()
                if note:
                    log.info(note)
            self.batch_iter = iter(self.batches)
            reason = self._loop(log, stop)
            finished = stop.signum is None
            if stop.signum is not None:
                if self.comm:  # every rank stops here, with the same status
                    self.comm.agreed_stop = True
                self.save(self.rd.last)
                due = {"valid": "its validation and checkpoints", "save": "its checkpoint"}.get(
                    self._due() if self.catch_up else None)
                log.info(f"{signal.Signals(stop.signum).name}: stopped at update "
                         f"{self.update}; saved {self.rd.last}; continue with --resume"
                         + (f" (which first writes {due}, due after update {self.update})"
                            if due else ""))
            elif (self.valid is not None and self.update % self.args.valid_every != 0
                  and self.validated_at != self.update):  # (a resumed finished run: done)
                self._validate_and_save(log)
            else:
                self.save(self.rd.last)
            if finished and self.comm:  # a signal during the closing work, on any rank:
                _, agreed = self.comm.agree_to_stop(0.0, stop.signum)  # all stop alike
                if agreed is not None:
                    stop.signum, self.comm.agreed_stop = agreed, True
        # (a signal during the closing validation or save: training finished, and the run
        # still stops with the signal's status, skipping the test)
        self.stopped_by = stop.signum
        if finished:
            log.info(f"training finished ({reason}) after {self.update} updates, "
                     f"{self.train_time:.0f} s ({self.clock() - self.start:.1f} s with the "
                     "closing validation and checkpoint)")
        if finished and stop.signum is not None and self.test_set is not None:
            log.info(f"{signal.Signals(stop.signum).name} during the closing validation and "
                     f"checkpoint: the test of --test-split {self.args.test_split} is skipped; "
                     "--resume scores it (the training is finished and saved)")
        log.close()
        return stop.signum is None

    def _loop(self, log, stop):
        """Updates until a stopping rule (-> its description) or a signal (-> None)."""
        self.start = start = self.clock() - self.train_time  # the run's time, over resumes
        if self.best_due and self.main:  # resumed from a stop before the best was written
            self._best_from_last()
        if self.catch_up:  # resumed from a stop right after an update: what was due after it
            self.catch_up = False  # (before the checkpoints it writes)
            self._checkpoints_due(log)
        while True:
            reason = self._stop_reason(self.clock() - start, stop, log)
            if reason is not None:
                return reason
            t0, before = self.clock(), self.update
            loss_sum, n_tok = self.train_update()
            log.add_update(loss_sum, n_tok, self.clock() - t0)  # update time only
            self.train_time = self.clock() - start
            if self.update == before and self.scaler is not None:  # an overflow: skipped
                log.info(f"update {self.update + 1}: float16 gradients overflowed; update "
                         f"skipped, loss scale now {self.scaler.scale:g}")
            elif self.update == before:
                log.info(f"update {self.update + 1}: the loss or gradient is not finite; "
                         f"update skipped ({self.guard.bad_in_a_row} in a row, the run stops at "
                         f"--max-bad-updates {self.args.max_bad_updates})")
            if stop.signum is not None and not self.comm:  # (ranks: at the loop's top)
                if self.update != before:  # stop now: the update's log line is written,
                    self._log_line(log)    # its validation and checkpoints wait for --resume
                    self.catch_up = True
                return None
            if self.update != before:
                self._log_line(log)
                self._checkpoints_due(log)

    def _stop_reason(self, elapsed, stop, log):
        """Why training stops before the next update, or None to go on. Under mpiexec all
        ranks stop together: rank 0's clock decides, and a signal on any rank. The deadline
        plan reads the same clock here, so every rank plans alike."""
        a = self.args
        if self.comm:
            elapsed, agreed = self.comm.agree_to_stop(elapsed, stop.signum)
            if agreed is not None:  # (a signal arriving meanwhile stays in stop)
                stop.signum = agreed
                return "signal"
        elif stop.signum is not None:  # (one that came during a validation or checkpoint:
            return "signal"            # stop before another update, as the ranks do)
        if self.plan is not None:
            planned = self.plan.observe(self.update, elapsed)
            if planned is not None:
                log.info(planned[0])
                log.metrics(planned[1])
            if self.plan.done(self.update):
                return f"reached the {self.plan.total} updates planned for --max-time " \
                       f"{a.max_time:g} min"
        if a.max_updates and self.update >= a.max_updates:
            return f"reached --max-updates {a.max_updates}"
        if a.max_epochs and self.batches.state_dict()["epoch"] >= a.max_epochs:
            return f"reached --max-epochs {a.max_epochs}"
        if a.max_time and elapsed >= a.max_time * 60:
            if self.plan is not None and self.plan.rate is None:  # (ended before any plan)
                log.info(f"warning: --max-time {a.max_time:g} min ended after {self.update} "
                         f"updates ({elapsed / max(self.update, 1):.2g} s each), before the "
                         f"{SKIP + MEASURE} the plan measures first, so the learning rate was "
                         f"never decayed (it is {self.lr_at(self.update):.3g}): give a "
                         "--max-time several times as long")
            return f"reached --max-time {a.max_time} min"
        return None

    def _log_line(self, log):
        """The log line of update ``self.update``, when one is due."""
        if self.update % self.args.log_every == 0 or self.update == 1:
            log.update_line(self.update, self.batches.state_dict()["epoch"], self.optim.lr,
                            self.train_time, self.scaler.scale if self.scaler else None)

    def test(self):
        """Score the test split with beam search: the best checkpoint, or an average."""
        a = self.args
        split = a.test_split
        if self.test_set is None:
            return None
        src, ref = self.test_set  # (every line: an empty source gives an empty translation,
        #                            as translate.py gives it, so test.hyp aligns with it)
        params, _, what = self.rd.load_params(self.rd.choose_checkpoints(a.average_last),
                                              average=bool(a.average_last))
        what = os.path.basename(what) if what.endswith(".npz") else what
        self.model.load_state_dict(params)
        t0 = time.perf_counter()
        long = []  # (line index, tokens, kept) of the sources longer than the model's positions
        hyps = translate_lines(self.model, self.tok, src, beam=a.beam, alpha=a.alpha,
                               max_tokens=a.max_tokens, on_truncate=lambda *t: long.append(t))
        if long:
            print(f"test: {len(long)} of {len(src)} sources longer than the model's positions "
                  f"were translated from their first {long[0][2]} tokens "
                  f"({self.files[split][0]}, lines "
                  f"{', '.join(str(i + 1) for i, _, _ in long[:10])}"
                  f"{' ...' if len(long) > 10 else ''})", flush=True)
        bleu, sig = corpus_bleu(hyps, ref, a.bleu_tokenize)
        out = self.rd.hypotheses(split)
        atomic_write_text(out, "".join(h + "\n" for h in hyps))
        print(f"test ({split}, {len(src)} sentences, {what}, beam {a.beam}, "
              f"{time.perf_counter() - t0:.1f} s): BLEU = {bleu:.2f}  {sig}", flush=True)
        # the score beside the learning curves (mt/plots.py draws it against training time)
        try:
            self.rd.add_test_record({"update": self.update, "test_split": split,
                                     "test_bleu": bleu, "test_signature": sig,
                                     "test_checkpoints": what, "beam": a.beam, "alpha": a.alpha,
                                     "time": self.train_time})
        except OSError as exc:  # (a full disk: the error names the file)
            raise naming(exc, self.rd.metrics) from exc
        return bleu


def out_of_memory(args, trainer):
    """The message for a MemoryError (NumPy's, or CuPy's OutOfMemoryError): where it struck,
    the batch that did not fit, and what to pass instead."""
    keep = f"the checkpoints in {args.run_dir} are intact (--resume continues)"
    batch = getattr(trainer, "last_batch", None)
    if trainer is None or batch is None:
        return (f"out of memory before training: lower --max-tokens (now {args.max_tokens}) "
                f"or --max-len, or pass --max-tokens auto to fit the batches to --memory; "
                f"{keep}")
    pairs, S, T = batch
    lower = max(64, int(0.7 * pairs * max(S, T)) // 64 * 64)
    return (f"out of memory at update {trainer.update + 1}, on a batch of {pairs} pairs "
            f"padded to {S} source and {T} target tokens ({pairs * max(S, T)} of "
            f"--max-tokens {args.max_tokens}): pass --max-tokens {lower} (or lower "
            f"--max-len {args.max_len}), or start a new run with --max-tokens auto; {keep}")


def main(argv=None, comm=None):
    """train.py. Exit status: 0 trained (and tested); 1 out of memory; 2 a mistake in the
    flags, files or data, or a path the run cannot use (refusals of flags and run
    directories raise SystemExit with the message; ``cli`` turns them into 2 as well); 3
    training diverged; 128 + N stopped by signal N (130 Ctrl-C, 143 SIGTERM: the state is
    saved, --resume continues; after a second signal, as last saved)."""
    args = parse_args(argv)
    trainer = None
    try:
        trainer = Trainer(args, comm)
        if args.profile:  # the profile's tables instead of training (Trainer.profile)
            return trainer.profile()
        if not trainer.run():
            return 128 + trainer.stopped_by
        if trainer.main:
            trainer.test()
    except (DataError, ckpt.CheckpointError, RunDirBusy, ValueError) as exc:
        return _fail(str(exc), 2)
    except OSError as exc:
        return _fail(describe_os_error(exc), 2)
    except Diverged as exc:
        if comm is not None:  # every rank raised it, after the same collective decision
            comm.agreed_stop = True
        return _fail(str(exc), 3) if exc.speak else 3
    except MemoryError:
        return _fail(out_of_memory(args, trainer), 1)
    except ForcedStop as exc:  # a second signal, while training: nothing more saved
        saved = getattr(trainer, "saved_update", None)
        return _fail(f"a second {signal.Signals(exc.signum).name}: stopped at once, without "
                     f"saving; {args.run_dir} holds the run as last saved"
                     + (f" (checkpoint_last.npz at update {saved})" if saved is not None
                        else "") + "; continue with --resume",
                     128 + exc.signum if comm is None else 1)
    except KeyboardInterrupt:  # (under mpiexec: status 1, so the other ranks are stopped)
        if trainer is None:
            stage, again = "while setting up the run", "run the same command again"
        elif args.profile:
            stage, again = "while profiling", "run the same command again"
        else:  # (training finished: its checkpoints are saved)
            stage, again = ("while scoring the test set", "training had finished; the same "
                            "command with --resume scores the test set")
        return _fail(f"interrupted {stage}; what was saved in {args.run_dir} is intact "
                     f"({again})", 130 if comm is None else 1)
    finally:
        if trainer is not None:
            trainer.rd.unlock()
    return 0


def cli(argv=None, comm=None):
    """train.py's entry point: ``main``, with a refusal raised as SystemExit("error: ...")
    (a flag, a config file or a run directory that cannot work) printed on stderr and
    given exit status 2, as argparse gives its own."""
    try:
        return main(argv, comm)
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        print(exc.code, file=sys.stderr)
        return 2


def _fail(message, status):
    print(f"error: {message}", file=sys.stderr)
    return status
