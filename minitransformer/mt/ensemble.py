"""Ensemble decoding: several models of one vocabulary translate as one.

Models trained apart (different seeds: different initial weights, dropout masks and batch
orders) make partly different errors. An ensemble scores each next token by the mean of the
members' log-probabilities,

    s(y | prefix, x) = (1/M) sum_m log p_m(y | prefix, x),

each member reading the prefix from its own decoder state (its own encoder output, caches
and positions). The search normalises s over the vocabulary as it normalises one model's
logits (greedy takes its argmax; beam search its log-softmax), so the ensemble's
distribution is the renormalised geometric mean of the members' (a product of experts).
Checkpoint averaging and ensembling combine: each member may itself be the average of its
run's last checkpoints (translate.py --average-last N --ensemble RUN ...).

``Ensemble`` offers the part of a Transformer's interface that search.py and translation.py
use (cfg, device, xp, ids, eval, modules, start_decoding, next_scores), so greedy_search,
beam_search and translate_lines take it in place of a model. It costs the members' decoding
time added up, plus a log-softmax over the vocabulary per member and step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from ..nn.transformer import Transformer

# what every member must agree on: the same token ids mean the same pieces
SHARED_FIELDS = ("vocab_size", "pad_id", "bos_id", "eos_id")


class EnsembleState:
    """The members' DecoderStates, advanced and compacted together."""

    def __init__(self, members: list):
        self.members = members

    def keep_sentences(self, sentences, rows=None, group=None):
        for state in self.members:
            state.keep_sentences(sentences, rows=rows, group=group)


class Ensemble:
    """Models of one vocabulary on one device, decoding as one (see the module docstring).

    ``cfg`` is the first member's, with the smallest ``max_positions`` of them all, so that
    inputs are cut and outputs capped where every member can still attend."""

    def __init__(self, models: Sequence[Transformer]):
        models = list(models)
        if not models:
            raise ValueError("an ensemble needs at least one model")
        first = models[0]
        for i, m in enumerate(models[1:], 2):
            for field in SHARED_FIELDS:
                a, b = getattr(first.cfg, field), getattr(m.cfg, field)
                if a != b:
                    raise ValueError(f"model {i} has {field} {b}, model 1 {a}: the models of "
                                     "an ensemble must share one vocabulary")
            if m.device != first.device:
                raise ValueError(f"model {i} is on {m.device}, model 1 on {first.device}")
        self.models = models
        self.device = first.device
        self.cfg = dataclasses.replace(first.cfg, max_positions=min(
            m.cfg.max_positions for m in models))

    def xp(self):
        return self.models[0].xp()

    def ids(self, x):
        return self.models[0].ids(x)

    def eval(self):
        for m in self.models:
            m.eval()
        return self

    def modules(self):
        for m in self.models:
            yield from m.modules()

    def start_decoding(self, src: Any, beams: int = 1,
                       max_length: Optional[int] = None) -> EnsembleState:
        """Each member encodes src (B, S) -> their states, before the first token."""
        return EnsembleState([m.start_decoding(src, beams=beams, max_length=max_length)
                              for m in self.models])

    def next_scores(self, last: Any, state: EnsembleState) -> Any:
        """Feed the newest tokens ``last`` (R, 1) to every member -> (R, V): the mean of
        their log-probabilities (the search normalises it, as it does one model's logits)."""
        total = None
        for m, member_state in zip(self.models, state.members):
            lp = m.next_scores(last, member_state, log_probs=True)
            if total is None:
                total = lp.copy()  # (the member's array may be a view of its own)
            else:
                total += lp
        total /= len(self.models)
        return total


__all__ = ["Ensemble", "EnsembleState"]
