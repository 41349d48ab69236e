"""Softmax cross-entropy with label smoothing (§5.4), fused: one node on the tape.

For logits z (N, V), targets t (N,) and the label smoothing ls, the smoothed target
distribution q is
    q_t = 1 - ls,  q_v = ls / (V - 1) for v != t        (default, "others")
    q_t = 1 - ls + ls / V,  q_v = ls / V                (switch: smoothing="uniform")
and the loss of one token is the cross-entropy H(q, softmax(z)):
    loss = -sum_v q_v log p_v = logsumexp(z) - sum_v q_v z_v     (since sum_v q_v = 1)
         = lse - c_o * sum_v z_v - (c_t - c_o) * z_t
Tokens whose target is the padding index contribute nothing. The Function returns the
*summed* loss over non-padding tokens; ``softmax_cross_entropy`` also returns their count,
so the caller normalises (per token, per batch, or across processes) as it needs.
Backward (closed form, no log-softmax kept): dz = (softmax(z) - q) * dloss, 0 on padding rows.
Saves the logits (already alive), logsumexp (N,) and the targets.
"""
from .. import backend
from .ids import check_ids
from .tensor import Function, Tensor


def smoothing_weights(label_smoothing, V, smoothing="others"):
    """(c_t, c_o): the smoothed target's probability on the target class and on each other."""
    ls = label_smoothing
    if smoothing == "others":
        return 1.0 - ls, ls / (V - 1)
    if smoothing == "uniform":
        return 1.0 - ls + ls / V, ls / V
    raise ValueError(f"smoothing must be 'others' or 'uniform', got {smoothing!r}")


def checked_targets(targets, shape, V, pad_id, xp, what):
    """Target ids checked and counted where they are, then placed with the model's arrays:
    -> (ids on ``xp``, number of non-padding targets).

    A NumPy batch is checked on the host, so a GPU step does not stop here to wait for
    its forward pass (reading a device array's max, min or count would).
    """
    t = targets.data if isinstance(targets, Tensor) else targets
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"targets shape {t.shape} does not match {what} {tuple(shape)}")
    tp = backend.get_array_module(t)
    valid = t != pad_id if pad_id is not None else tp.ones(t.shape, bool)
    check_ids(tp.where(valid, t, 0), V, "target id")  # padding may hold any id
    return xp.asarray(t), int(valid.sum())


class SoftmaxCrossEntropy(Function):
    """The summed smoothed loss (the module docstring): logits z (..., V), targets t (...)
    -> a scalar. Options: ``label_smoothing``, ``pad_id`` the padding target (no
    loss), ``smoothing`` "others" or "uniform", ``shape_in`` z's shape (for dz). Saves z,
    lse and t; backward returns dz = (softmax(z) - q) * [t != pad] * dloss, and None for t."""

    options = {"label_smoothing": 0.0, "pad_id": None, "smoothing": "others", "shape_in": None}

    def forward(self, z, t):
        xp = backend.get_array_module(z)
        V = z.shape[-1]
        z = z.reshape(-1, V)
        t = t.reshape(-1)
        valid = t != self.pad_id if self.pad_id is not None else xp.ones(t.shape, bool)
        c_t, c_o = smoothing_weights(self.label_smoothing, V, self.smoothing)
        m = z.max(axis=1)
        e = xp.exp(z - m[:, None])  # the one (N, V) temporary of the forward pass
        lse = m + xp.log(e.sum(axis=1))
        del e
        rows = xp.arange(z.shape[0])
        tc = xp.where(valid, t, 0)  # padding rows read class 0, then are zeroed
        loss = lse - c_o * z.sum(axis=1) - (c_t - c_o) * z[rows, tc]
        self.z, self.lse, self.t, self.valid, self.c = z, lse, tc, valid, (c_t, c_o)
        return (loss * valid).sum()

    def backward(self, dloss):
        xp = backend.get_array_module(dloss)
        z, c_t, c_o = self.z, *self.c
        dz = z - self.lse[:, None]
        xp.exp(dz, out=dz)  # softmax(z)
        dz -= z.dtype.type(c_o)
        dz[xp.arange(z.shape[0]), self.t] -= z.dtype.type(c_t - c_o)  # dz = p - q
        dz *= (self.valid * dloss).astype(z.dtype)[:, None]
        return dz.reshape(self.shape_in), None


def softmax_cross_entropy(logits, targets, label_smoothing=0.0, pad_id=None,
                          smoothing="others"):
    """Label-smoothed cross-entropy summed over non-padding tokens.

    logits: Tensor (..., V); targets: integer array (...); returns (loss_sum, n_tokens)
    where loss_sum is a scalar Tensor and n_tokens the number of non-padding targets (int).
    """
    t, n = checked_targets(targets, logits.shape[:-1], logits.shape[-1], pad_id, logits.xp,
                           "logits")
    loss = SoftmaxCrossEntropy.apply(logits, Tensor(t), label_smoothing=float(label_smoothing),
                                     pad_id=pad_id, smoothing=smoothing,
                                     shape_in=logits.shape)
    return loss, n
