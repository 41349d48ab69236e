"""One training update: where batches become a loss and the gradient is finished.

train.py (``Trainer.train_update``) and the benchmark (bench/bench.py) both call
:func:`train_step`, so what is timed is what trains. One update over the batches b_1..b_k
(``--update-freq`` k, this rank's share of each under mpiexec):

    L_b, n_b = model.loss(b)             summed loss and target-token count of batch b
    backward of L_b (of S * L_b in float16, S the loss scale), gradients adding up
    under mpiexec: gradients, sum L_b and sum n_b summed over the ranks (one all-reduce)
    g = grad / n   (n = all target tokens; / S too in float16)
    if g or the loss holds an inf or a NaN: the update is skipped, its gradients dropped
                   (float16: S halves, an overflow now and then is expected; float32: the
                   caller counts bad updates in a row, the divergence guard of train.py)
    g clipped to global norm clip_norm (when > 0)
    Adam step at learning rate lr, gradients zeroed

Dividing by the token count after the sum (not each batch's loss by its own count) gives
every target token the same weight, however the tokens fall into batches and ranks.
"""
import math
from typing import Iterable, NamedTuple

import numpy as np

from ..optim import clip_grad_norm, scale_gradients


class StepResult(NamedTuple):
    loss_sum: float  # summed (label-smoothed) loss over the update's target tokens, all ranks
    tokens: int      # target tokens, all ranks
    applied: bool    # False when the loss or the gradients were not finite: no Adam step


def train_step(model, optim, batches: Iterable[dict], lr: float, *, scaler=None, comm=None,
               clip_norm: float = 0.0) -> StepResult:
    """One update of ``model`` by ``optim`` over ``batches`` (dicts of ``src``, ``tgt_in``,
    ``tgt_out`` id arrays, as ``data.collate`` makes them; pulled one at a time, so a
    generator keeps one batch's activations alive at a time).

    ``scaler``: a DynamicLossScaler for float16 (None in float32); ``comm``: the MPI/NCCL
    communicator under mpiexec (every rank must call this, with or without batches);
    ``clip_norm``: the global gradient norm limit (0 = none).
    """
    model.train()
    loss_sum, n_tok = 0.0, 0
    for b in batches:
        loss, n = model.loss(b["src"], b["tgt_in"], b["tgt_out"])
        if scaler is None:
            loss.backward()
        else:  # an overflow is expected now and then: the scaler handles it, quietly
            with np.errstate(over="ignore", invalid="ignore"):
                loss.backward(scaler.scale)
        # kept on the device until the update is queued (or, under mpiexec, until the
        # all-reduce, which waits for backward anyway): reading it waits for the GPU
        loss_sum, n_tok = loss_sum + loss.data.astype(np.float64), n_tok + n
    if comm is not None:  # (Adam's flat buffer, when the gradients are one, summed in place)
        loss_sum, n_tok = comm.allreduce_grads(optim.params, float(loss_sum), n_tok,
                                               flat_grad=optim.flat_grad())
    grads = optim.gradients()  # the flat buffer as one array, while it is one
    # (after the all-reduce, so every rank sees the same inf and decides alike)
    finite = scale_gradients(grads, 1.0 / max(n_tok, 1), scaler)
    if scaler is None:  # (float16: a NaN loss overflows the gradients too; the scaler decides)
        finite = finite and math.isfinite(float(loss_sum))
    if not finite:
        optim.zero_grad()  # nothing of this update reaches the parameters
        return StepResult(float(loss_sum), n_tok, False)
    if clip_norm > 0:
        clip_grad_norm(optim.params, clip_norm, grads=grads)
    optim.lr = lr
    optim.step()
    optim.zero_grad()
    return StepResult(float(loss_sum), n_tok, True)
