"""The encoder on the real tokens of a padded batch only (inference).

A batch of B sources padded to S positions holds N <= B * S real tokens. Everything in an
encoder layer except the attention scores works on each position alone: the products with
W^Q, W^K, W^V, W^O and the feed-forward network, the residual adds and LayerNorm. So under
``no_grad`` in evaluation mode the encoder keeps its activations as the N real rows (N, D),
and self-attention scatters its queries, keys and values into the padded (B, S) layout for
the scores, with zeros at the padding, and gathers the real rows back. A padding key is
masked (its weight is exactly 0 and its zero value adds exactly 0), so the real positions get
the numbers they get on the padded batch. On batches of unsorted lengths about a third of the
rows are padding; length-sorted batches (translate.py's) have little, and are left padded.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .. import backend
from ..engine.tensor import Tensor, is_grad_enabled

# Rows are gathered only when at least this share of the batch is padding (the gathers and
# scatters cost about a tenth of what each padding row costs in the products).
MIN_PADDING = 0.1


class RealRows:
    """The real positions of a padded batch: ``mask`` bool (B, S), True for real tokens."""

    def __init__(self, mask: Any) -> None:
        xp = backend.get_array_module(mask)
        self.shape = tuple(mask.shape)
        self.index = xp.flatnonzero(mask.reshape(-1))  # (N,) rows of the (B * S, ...) layout

    @classmethod
    def worth_it(cls, mask: Any, training: bool) -> Optional["RealRows"]:
        """A RealRows for ``mask`` when it applies: NumPy arrays, no tape being recorded, no
        dropout (``training`` off) and at least MIN_PADDING of the batch padding; else None."""
        if training or is_grad_enabled() or backend.get_array_module(mask) is not np:
            return None
        if mask.size == 0 or np.count_nonzero(mask) > (1.0 - MIN_PADDING) * mask.size:
            return None
        return cls(mask)

    def gather(self, x: Tensor) -> Tensor:
        """(B, S, ...) -> the real rows (N, ...)."""
        a = x.data
        return Tensor.wrap(a.reshape((-1,) + a.shape[2:])[self.index])

    def scatter(self, x: Tensor) -> Tensor:
        """The real rows (N, ...) -> (B, S, ...), zeros at the padding."""
        a = x.data
        xp = backend.get_array_module(a)
        out = xp.zeros((self.shape[0] * self.shape[1],) + a.shape[1:], a.dtype)
        out[self.index] = a
        return Tensor.wrap(out.reshape(self.shape + a.shape[1:]))
