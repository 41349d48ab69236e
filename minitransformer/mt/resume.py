"""Resuming a training run (``Trainer``'s, mt/train.py): loading checkpoint_last.npz and
checking that the run can go on as it was, and keeping its learning-rate schedule free of
jumps when --max-updates or --max-time is given anew.

``Resuming`` is a base class of ``Trainer``, kept in its own file as ``CorpusSetUp`` is: its
methods use the Trainer's ``args``, ``cfg``, ``model``, ``optim``, ``scaler``, ``plan``,
``batches``, ``rd``, ``files``, ``train_pairs``, ``train_fingerprint`` and ``_saved`` (the
run's config.json), and set ``update``, ``best_bleu``, ``train_time``, ``catch_up``,
``log_window``, ``validated_at``, ``best_due`` and ``linear_from``. Trainer._set_up calls
``_check_resumed_schedule`` before any work; Trainer._build_model calls ``_load``;
Trainer.lr_at calls ``_linear_lr``.
"""
from ..optim import linear_decay_lr
from . import checkpoint as ckpt
from .data import DataError
from .options import plans_to_deadline
from .plan import piece_lr


class Resuming:
    def _load(self, path):
        try:
            params, optim, meta = ckpt.load_checkpoint(path)
        except ckpt.CheckpointError as exc:  # (damaged: what the run can go on from instead)
            saved = self.rd.periodic_checkpoints()
            if not saved:
                raise
            update, newest = saved[-1]
            raise ckpt.CheckpointError(
                f"{exc}; to resume from the newest checkpoint saved before it (update "
                f"{update}; the updates after it are trained again), copy {newest} over "
                f"{path}") from None
        ckpt.check_compatible(path, meta, self.cfg)
        self.rd.check_vocabulary(path, meta)
        self.model.load_state_dict(params)
        self.optim.load_state_dict({**optim, **meta["optim"]})
        self.update, self.best_bleu = meta["update"], meta["best_bleu"]
        self.train_time = meta.get("train_time", 0.0)
        self.catch_up = bool(meta.get("catch_up", False))
        self.validated_at = meta.get("validated_at")
        self.best_due = bool(meta.get("best_due", False))
        self.log_window = meta.get("log_window")
        if meta.get("train_pairs", self.train_pairs) != self.train_pairs:
            raise DataError(f"{path}: the run trained on {meta['train_pairs']} pairs, but "
                            f"{self.files[self.args.train_split][0]} and its target file now "
                            f"hold {self.train_pairs}; resume with the run's training data, or "
                            "start a new --run-dir")
        if meta.get("train_fingerprint", self.train_fingerprint) != self.train_fingerprint:
            raise DataError(f"{path}: {self.files[self.args.train_split][0]} and its target "
                            f"file hold {self.train_pairs} pairs, as when the run started, but "
                            "not the same text (a line was edited, added or removed since); "
                            "resume with the run's training data, or start a new --run-dir")
        self.batches.load_state_dict(meta["data"])
        self.model.rng.set_state(meta["rng"])
        if self.scaler is not None and "loss_scale" in meta:
            self.scaler.load_state_dict(meta["loss_scale"])
        if self.plan is not None and "plan" in meta:
            self.plan.load_state_dict(meta["plan"])
            self._resume_plan()
        elif self.plan is not None:  # (a linear run given --max-time on resume: planned from
            self._plan_from_here(meta.get("linear_from"))  # here on, from the schedule it had)
        elif self.args.lr_schedule == "linear":
            self.linear_from = meta.get("linear_from")
            self._resume_linear()

    def _resume_linear(self):
        """A linear run without a plan given another --max-updates on --resume: its rate
        goes on from that of its last update in a straight line to 0 at the new
        --max-updates (``linear_from``), with no jump (a warm-up not yet over still ends at the
        peak, and the line starts there). A run that has finished (its rate fell to 0 at its
        last update) is not extended, and an unfinished one is not stopped where it stands,
        unannealed: both refused before any work, as for a planned run."""
        a, u = self.args, self.update
        old = self._saved["train"].get("max_updates", a.max_updates)
        if "max_updates" not in a.explicit or a.max_updates == old or not old:
            return
        rate = self._linear_lr(u, old)  # that of its last update, on the schedule it had
        flag = f"--max-updates {a.max_updates}"
        if u >= old and a.max_updates > u:
            raise SystemExit(f"error: {flag} on --resume: this run has finished its linear "
                             f"schedule ({old} updates, the learning rate falling to 0 at the "
                             "last), so there is no schedule left to extend: train longer in a "
                             "new --run-dir, or resume without the flag to validate and test "
                             "again")
        if u < old and a.max_updates <= u:
            raise SystemExit(f"error: {flag} on --resume: this run has made {u} of its {old} "
                             "updates and its rate is not yet 0; that would stop it where it "
                             "stands, unannealed: give more, or resume without the flag")
        if u >= old:
            return
        self.linear_from = [u, rate] if u > a.warmup else None

    def _linear_lr(self, update, total):
        """The linear schedule's rate at ``update`` for --max-updates ``total``: warm-up,
        then a straight line to 0 at ``total`` (from ``linear_from`` when it is set)."""
        a = self.args
        if self.linear_from is not None and update > self.linear_from[0]:  # (a plan's piece)
            return piece_lr(update, [list(self.linear_from) + [total]], self.cfg.d_model,
                            a.warmup, a.lr_factor)
        return linear_decay_lr(update, self.cfg.d_model, a.warmup, total, a.lr_factor)

    def _rate_change(self):
        """A line saying how the rate moves when --warmup or --lr-factor, given anew on
        --resume of a run without a plan (a planned run refuses them: ``_resume_plan``),
        changes the schedule: its next update's rate under the run's values and under the
        new ones; None when neither changed it."""
        a, saved = self.args, self._saved["train"]
        if self.plan is not None:
            return None
        changed = [n for n in ("warmup", "lr_factor")
                   if n in a.explicit and saved.get(n, getattr(a, n)) != getattr(a, n)]
        if not changed:
            return None
        u, given = self.update + 1, {n: getattr(a, n) for n in changed}
        new = self.lr_at(u)
        try:
            for n in changed:
                setattr(a, n, saved[n])
            old = self.lr_at(u)
        finally:
            for n, value in given.items():
                setattr(a, n, value)
        flags = " and ".join(f"--{n.replace('_', '-')} {given[n]:g}" for n in changed)
        if new == old:
            return f"note: {flags} on --resume: the learning rate of update {u} stays {new:.3g}"
        return (f"note: {flags} on --resume: the learning rate of update {u} is {new:.3g}, "
                f"{new / old:.3g}x the {old:.3g} of the run's schedule")

    def _plan_from_here(self, bend=None):
        """A linear run without a plan in its checkpoint (no --max-time until now): its own
        schedule (linear_decay_lr to its saved --max-updates, bent at ``bend`` if a changed
        --max-updates bent it: ``linear_from``) goes on until the first plan, and a new
        --max-updates ends it from the rate it had, as for a plan not yet made."""
        self.plan.from_fixed_schedule(self._saved["train"].get("max_updates", 0),
                                      self.update, self.args.max_updates, bend)

    def _resume_plan(self):
        """A planned run resumed (its plan, warm-up and peak as the checkpoint has them):
        --warmup and --lr-factor given anew are refused, not silently unused; a --max-time or
        --max-updates given anew is planned for at once, not at the plan's next check; one
        that would end the run where it stands, before its rate reaches 0, or extend a plan
        that has ended (its rate at 0), is refused."""
        a, saved, plan, u = self.args, self._saved["train"], self.plan, self.update
        for name in ("warmup", "lr_factor"):
            if name in a.explicit and saved.get(name, getattr(a, name)) != getattr(a, name):
                flag = "--" + name.replace("_", "-")
                raise SystemExit(f"error: {flag} {getattr(a, name)} on --resume: this run "
                                 f"follows a plan to its --max-time, which keeps its warm-up "
                                 f"({plan.warmup} updates) and peak ({plan.peak():.3g}); drop "
                                 "the flag, or start a new --run-dir")
        changed = [k for k in ("max_time", "max_updates")
                   if k in a.explicit and getattr(a, k) != saved.get(k, getattr(a, k))]
        if not changed:
            return
        flags = " and ".join(f"--{k.replace('_', '-')} {getattr(a, k):g}" for k in changed)
        # (ended: the rate reached 0 at its last update, also in a plan capped below the
        # ~30 updates its first plan waits for)
        ended = plan.total is not None and u >= plan.total and plan.lr(u) == 0.0
        more = ("max_time" in changed and a.max_time > saved.get("max_time", 0)
                or "max_updates" in changed and (a.max_updates == 0 or a.max_updates > u))
        if ended and more:
            raise SystemExit(f"error: {flags} on --resume: this run has finished its plan "
                             f"({plan.total} updates, the learning rate falling to 0 at the "
                             "last), so there is no schedule left to extend: train longer in "
                             "a new --run-dir, or resume without the flag to validate and test "
                             "again")
        if not ended and (0 < a.max_updates <= u or a.max_time * 60 <= self.train_time):
            raise SystemExit(f"error: {flags} on --resume: this run has made {u} updates in "
                             f"{self.train_time / 60:.2f} min and its rate is not yet 0; that "
                             "would stop it where it stands, unannealed: give more, or resume "
                             "without the flag")
        if ended:
            return
        plan.new_budget(u, a.max_updates)

    def _check_resumed_schedule(self):
        """The schedule stays on --resume: another --lr-schedule, or --max-time 0 for a run
        planned to its --max-time, would swap the run's schedule (a planned one: its fitted
        warm-up and peak, its line to 0) for another, and the rate would jump; refused
        before any work."""
        a, saved = self.args, self._saved["train"]
        planned = saved.get("lr_schedule") == "linear" and saved.get("max_time", 0) > 0
        if "lr_schedule" in a.explicit and a.lr_schedule != saved.get("lr_schedule"):
            flag = f"--lr-schedule {a.lr_schedule}"
        elif planned and not plans_to_deadline(a):
            flag = f"--max-time {a.max_time:g}"
        else:
            return
        what = (f"follows a plan to its --max-time ({saved['max_time']:g} min)" if planned
                else f"follows --lr-schedule {saved.get('lr_schedule')}")
        raise SystemExit(f"error: {flag} on --resume: this run {what}, and its schedule cannot "
                         "be swapped for another mid-run (the rate would jump); resume "
                         "without the flag, or start a new --run-dir")
