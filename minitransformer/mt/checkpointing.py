"""A training run's checkpoints (``Trainer``'s, mt/train.py): what each holds (``_meta``),
writing them (``save``), what is due after an update (a validation and its checkpoints, or a
periodic one), and the best model: checkpoint_last.npz says when a new best is not yet in
checkpoint_best.npz (``best_due``), so a run stopped between the two writes loses none.

``Checkpointing`` is a base class of ``Trainer``, as ``Resuming`` (resume.py) is: its
methods use the Trainer's ``args``, ``main``, ``model``, ``optim``, ``params``, ``batches``,
``rd``, ``plan``, ``scaler``, ``log``, ``validate``, ``spm_sha``, ``train_pairs``,
``train_fingerprint``, ``_config_to_save`` and the run's state (``update``, ``best_bleu``,
``train_time``, ``catch_up``, ``validated_at``, ``best_due``, ``linear_from``,
``saved_update``).
"""
import math
import os

from . import checkpoint as ckpt
from .guard import Diverged, all_finite


class Checkpointing:
    def _meta(self):
        meta = {"update": self.update, "best_bleu": self.best_bleu,
                "data": self.batches.state_dict(), "rng": self.model.rng.get_state(),
                "spm_sha256": self.spm_sha, "train_time": self.train_time,
                "train_pairs": self.train_pairs, "train_fingerprint": self.train_fingerprint}
        if self.scaler is not None:
            meta["loss_scale"] = self.scaler.state_dict()
        if self.plan is not None:
            meta["plan"] = self.plan.state_dict()
        if self.catch_up:
            meta["catch_up"] = True
        if self.validated_at is not None:
            meta["validated_at"] = self.validated_at
        if self.best_due:
            meta["best_due"] = True
        if self.log is not None:
            meta["log_window"] = self.log.window()
        if self.linear_from is not None:
            meta["linear_from"] = list(self.linear_from)
        return meta

    def save(self, *paths):
        """The whole training state into each checkpoint of ``paths`` (rank 0 only); never a
        model whose parameters are not finite (-> Diverged on every rank, which hold the
        same parameters, so they decide alike; nothing written)."""
        if not all_finite(self.params):
            raise Diverged(f"the parameters are not finite at update {self.update}; "
                           f"{', '.join(paths)} not written (the checkpoints saved before are "
                           "as they were)", speak=self.main)
        if self.main:
            for path in paths:
                meta = self._meta()
                if path != self.rd.last:  # (only last says a best is due: a run rolled back
                    meta.pop("best_due", None)  # to a periodic one would replace a later best)
                ckpt.save_checkpoint(path, self.model, self.optim, meta)
            if self._config_to_save is not None and self.rd.last in paths:
                self.rd.write_config(*self._config_to_save)  # (the options it now runs with)
                self._config_to_save = None
        if self.rd.last in paths:  # (on every rank, once written: for the messages)
            self.saved_update = self.update

    def _due(self):
        """What is due after update ``self.update``: "valid" (a validation and its
        checkpoints), "save" (a periodic checkpoint) or None."""
        a = self.args
        if self.valid is not None and self.update % a.valid_every == 0:
            return "valid"
        if ((a.save_every and self.update % a.save_every == 0)
                or (self.plan is not None and self.plan.saves_at(self.update))):
            return "save"
        return None

    def _checkpoints_due(self, log):
        """The validation and checkpoints due after update ``self.update``."""
        done = self._due()
        if done == "valid":
            self._validate_and_save(log)
        elif done == "save":
            self.save(self.rd.periodic(self.update), self.rd.last)
            if self.main:  # (rank 0 writes the checkpoints and removes the old ones)
                self.rd.prune(self.args.keep_last)
        else:
            return
        if self.plan is not None:  # (after the save: a checkpoint holds the plan without it)
            self.plan.note(done)

    def _validate_and_save(self, log):
        loss, bleu = self.validate() if self.main else (0.0, 0.0)
        bad = not (math.isfinite(loss) and all_finite(self.params))
        if self.comm:  # rank 0's validation decides for all (one all-reduce)
            bad = self.comm.lowest_rank_where(bad) is not None
        if bad:  # a model that is not finite, or finite but broken: keep what was saved
            raise Diverged(f"the parameters or the validation loss ({loss}) at update "
                           f"{self.update} are not finite; no checkpoint was written for it "
                           f"(those in {self.rd.path} are as saved at update "
                           f"{self.saved_update})", speak=self.main)
        rec = {"update": self.update, "valid_loss": loss, "valid_ppl": math.exp(min(loss, 50)),
               "valid_bleu": bleu, "time": self.train_time}
        log.metrics(rec)
        log.info(f"valid update {self.update}: loss {loss:.3f} ppl {rec['valid_ppl']:.2f} "
                 f"BLEU {bleu:.2f}")
        self.validated_at = self.update  # (in the checkpoints: a resume does not repeat it)
        if self.main:
            if bleu > self.best_bleu:  # last says a best is due until checkpoint_best has it:
                self.best_bleu, self.best_due = bleu, True  # a run stopped before (a kill, a
            self.save(self.rd.periodic(self.update), self.rd.last)  # full disk) writes it
            self.rd.prune(self.args.keep_last)                  # from last on --resume
            if self.best_due:
                self.write_best()
        self.saved_update = self.update

    def _best_from_last(self):
        """--resume of a checkpoint_last that says a best is due: written, unless
        checkpoint_best.npz already holds one at least as good (a copy of an older last put
        back by hand: checkpoint_best only ever improves)."""
        held = self.best_held()
        if held >= self.best_bleu:
            self.best_bleu, self.best_due = held, False
            self.save(self.rd.last)
            return
        self.write_best()

    def best_held(self):
        """The validation BLEU of checkpoint_best.npz (-1 without one)."""
        if not os.path.exists(self.rd.best):
            return -1.0
        return ckpt.load_checkpoint(self.rd.best, optimizer=False)[2].get("best_bleu", -1.0)

    def write_best(self):
        """checkpoint_best.npz from the model in hand (that of update ``self.update``, the
        best validated), then checkpoint_last.npz again, no longer saying a best is due."""
        self.best_due = False  # (if writing best fails, the run stops: last still says so)
        self.save(self.rd.best)
        self.save(self.rd.last)
