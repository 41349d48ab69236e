"""The divergence guard: a run whose loss or gradient stops being finite ends with a
diagnosis, never with NaN in its parameters or checkpoints.

    update skipped     the loss or a gradient is not finite (step.py: no Adam step, the
                       gradients dropped; under mpiexec every rank sees the same sums)
    run stopped        after --max-bad-updates such updates in a row: the update's batches
                       are replayed with every op checked (engine/anomaly.py), and the
                       first op that made a NaN or an Inf is named (exit status 3)
    never saved        parameters that are not finite, or a model whose validation loss is
                       not finite: the checkpoints stay as the last good save left them

In float16 the loss scaler (optim/loss_scale.py) plays this part: an overflow now and then
is expected, and the run stops only when the scale collapses.
"""
import numpy as np

from ..engine.anomaly import AnomalyError, detect_anomaly


class Diverged(RuntimeError):
    """Training cannot go on; nothing bad was saved. The message says why and what to do;
    under mpiexec every rank raises it and one, ``speak``, prints it."""

    def __init__(self, message, speak=True):
        super().__init__(message)
        self.speak = speak


class DivergenceGuard:
    """Counts the updates skipped in a row for a loss or gradient that is not finite."""

    def __init__(self, max_bad_updates):
        self.max_bad_updates, self.bad_in_a_row = max_bad_updates, 0

    def record(self, finite):
        """After an update: -> True when the run must stop (too many bad ones in a row)."""
        self.bad_in_a_row = 0 if finite else self.bad_in_a_row + 1
        return self.bad_in_a_row >= self.max_bad_updates


def first_bad_op(model, optim, batches, rng_state):
    """Replay ``batches`` (collated, as the update saw them) from the dropout state
    ``rng_state`` with every op checked: -> (whether an op made one, where the first NaN or
    Inf came from in words). The gradients of the replay are dropped."""
    model.rng.set_state(rng_state)
    model.train()
    done = 0
    try:
        with detect_anomaly(model), np.errstate(all="ignore"):
            for b in batches:
                loss, _ = model.loss(b["src"], b["tgt_in"], b["tgt_out"])
                loss.backward()
                done += 1
    except AnomalyError as exc:
        src, tgt = batches[done]["src"].shape, batches[done]["tgt_in"].shape
        return True, (f"in batch {done + 1} of {len(batches)} ({src[0]} sentences, source "
                      f"length {src[1]}, target length {tgt[1]}), replayed with every op "
                      f"checked: {exc}")
    finally:
        optim.zero_grad()
    return False, ("replaying its batches with every op checked found no op that made a NaN "
                   "or an Inf on any rank")


def all_finite(params):
    """Whether every parameter array is finite (one pass over each; a wait on a GPU)."""
    return all(bool(p.xp.isfinite(p.data).all()) for p in params)
