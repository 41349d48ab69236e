"""Defaults for a new corpus: the vocabulary, the model, the batch and the warm-up chosen from
the corpus size and the machine's measured update rate, for a run given only ``--data``, the
languages and ``--max-time`` (train.py; any flag given still wins).

The rules, and the experiments they come from (README, "A new corpus: a run that sizes
itself"):

* **Vocabulary** (``vocab_size``): one joint unigram model of about 6000 pieces per 29,000
  pairs (the Multi30k recipe's), scaled with the square root of the number of pairs, rounded
  to 500, between ``MIN_VOCAB`` and ``MAX_VOCAB``. A small corpus sees each piece of a large
  vocabulary too rarely to learn it; a large one can afford longer pieces.
* **Model** (``choose_model``): a rung of ``LADDER``, the largest that both the data and the
  time can feed. The data: at most ``PARAMS_PER_TOKEN`` parameters per target token of the
  training corpus. The time: each rung's update is timed on this machine (``probe``, a few
  updates on the corpus's own batches), and a rung is taken only if the updates that fit in
  the budget show it at least ``TOKENS_PER_PARAM`` target tokens per parameter. With too
  little of either a smaller model learns more in the same minutes: in 20 minutes on one
  core, on Multi30k, d_model 128 saw 2.2 tokens per parameter and scored 34.1 on test2016,
  d_model 256 saw 0.4 and scored 24.9.
* **Batch**: ``CPU_TOKENS`` padded tokens a side on a CPU (on Multi30k, at a fixed time,
  more and smaller updates learned faster and the throughput hardly dropped); on a GPU,
  ``--max-tokens auto`` (the largest that fits, mt/memfit.py).
* **Learning rate**: the warm-up fitted to the plan (mt/plan.py, ``fitted_warmup``: 12% of
  the planned updates, at least 500 or 40% of a shorter plan), to the Multi30k recipe's
  peak, 2e-3 at d_model 256 (``--lr-factor 2`` with the default warm-up of 4000 gives it,
  and the plan keeps the peak when it shortens the warm-up), scaled with d_model^-0.5 as in
  the paper; and subword regularization (``--subword-alpha 0.5``), as in the recipe.
"""
import math
import time

import numpy as np

LADDER = (  # smallest first; the second is the Multi30k recipe's model
    dict(d_model=128, n_heads=4, d_ff=512, n_layers=3),
    dict(d_model=256, n_heads=4, d_ff=512, n_layers=3),
    dict(d_model=384, n_heads=6, d_ff=1536, n_layers=4),
    dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6),  # the paper's base
)
REFERENCE_PAIRS, REFERENCE_VOCAB = 29000, 6000  # Multi30k and its recipe's vocabulary
MIN_VOCAB, MAX_VOCAB = 1000, 32000
PARAMS_PER_TOKEN = 16.0  # at most this many parameters per training target token
TOKENS_PER_PARAM = 1.0  # at least this many target tokens trained on per parameter
CPU_TOKENS = 3072
SUBWORD_ALPHA = 0.5
LR_FACTOR = 2.0  # with the default warm-up of 4000: the recipe's peak (2e-3 at d_model 256)
LR_FACTOR_WARMUP = 4000  # (a --warmup given scales the factor to keep that peak)
PROBE_STEPS = 3  # updates timed per rung (after one more to warm up)
BUDGET_SHARE = 0.9  # of --max-time spent on updates (the rest: validations, checkpoints)


def vocab_size(pairs):
    """The joint vocabulary for a corpus of ``pairs`` training pairs."""
    v = REFERENCE_VOCAB * math.sqrt(max(pairs, 1) / REFERENCE_PAIRS)
    return int(min(MAX_VOCAB, max(MIN_VOCAB, round(v / 500) * 500)))


def describe(fields):
    return (f"d_model {fields['d_model']}, {fields['n_layers']}+{fields['n_layers']} layers, "
            f"{fields['n_heads']} heads, d_ff {fields['d_ff']}")


def choose_model(corpus_tokens, budget_s, measure):
    """The largest rung of ``LADDER`` that the data and the time can feed.

    ``corpus_tokens``: target tokens in the training corpus; ``budget_s``: the training
    budget in seconds; ``measure(fields) -> (seconds per update, target tokens per update,
    parameters)``, called on the rungs from the smallest up until one is too large.
    -> (index, [(fields, seconds, tokens, params, why_not or None)] of those measured)."""
    chosen, notes = 0, []
    for i, fields in enumerate(LADDER):
        seconds, tokens, params = measure(fields)
        trained = BUDGET_SHARE * budget_s / max(seconds, 1e-9) * tokens
        why = None
        if params > PARAMS_PER_TOKEN * corpus_tokens:
            why = (f"{params / corpus_tokens:.1f} parameters per corpus token, more than "
                   f"{PARAMS_PER_TOKEN:g}")
        elif trained < TOKENS_PER_PARAM * params:
            why = (f"{trained / params:.2f} trained tokens per parameter in the budget, "
                   f"fewer than {TOKENS_PER_PARAM:g}")
        notes.append((fields, seconds, tokens, params, why))
        if why is not None:  # (the smallest rung is taken even when too large)
            break
        chosen = i
    return chosen, notes


def probe(model, optim, batches, steps=PROBE_STEPS):
    """Seconds per update of ``model`` on ``batches`` (collated dicts): one update to warm
    up, then the mean of ``steps``. The updates run at learning rate 0 and change nothing
    that matters: the caller throws this model away."""
    from .step import train_step
    times = []
    for b in batches[:steps + 1]:
        start = time.perf_counter()
        train_step(model, optim, [b], 0.0)
        times.append(time.perf_counter() - start)
    return float(np.mean(times[1:])) if len(times) > 1 else times[0]


def report(index, notes, corpus_tokens, minutes, given=None):
    """The log line of ``choose_model``'s choice (``given``: model flags that override the
    rung's fields)."""
    given = given or {}
    tried = "; ".join(
        f"d_model {f['d_model']} x {f['n_layers']}: {p / 1e6:.2f} M parameters, "
        f"{s:.3g} s/update" + (f" ({why})" if why else "")
        for f, s, _, p, why in (({**f, **given}, *rest) for f, *rest in notes))
    return (f"model for {corpus_tokens} target tokens and {minutes:g} min: "
            f"{describe({**LADDER[index], **given})} (measured: {tried})")
