"""Decoding (§6.1): greedy and batched beam search with cached keys and values.

Both run the decoder incrementally through the model's own modules (nn/decoder_state.py says
what is carried): at step t only the newest token is fed, under no_grad, so no tape is built;
each decoder layer runs its ``step``, the same arithmetic as its forward on raw arrays,
without Tensors or Function objects (Transformer.next_scores).
Each decoder layer writes this step's self-attention keys/values into buffers allocated
ahead (for the longest output, within 32 MiB, doubled if outgrown; one product with
[W_q W_k W_v] gives q, k and v); the encoder-decoder
keys/values are computed once per sentence, and a sentence's beams attend to them as one
block of queries; the source mask is built once per batch. The sentences run longest first
(``longest_first``), and those that finish leave the batch: the last ones move into their
places (``compacted``), so the remaining ones run on smaller arrays and only the moved rows
are copied (few: sentences tend to finish in order of length). Beam search's first step
runs one row a sentence (there is one hypothesis), the others ``beam``; a hypothesis stays
in the row of the one it extends when it is the first to extend it (``_place_beams``), so
few histories are copied. The search reads back only what it decides on: greedy, the
argmax of each row; beam search, the 2 * beam best tokens of each beam, normalised to
log-probabilities only there. That work over the whole vocabulary (mt/selection.py)
runs on chunks of rows that stay in cache, in as many threads as the BLAS has
(``by_rows``), as the products do; on a GPU it is one kernel
(cuda_kernels.top_m_log_softmax).
On a CPU with several BLAS threads a batch's sentences are first shared out to as many
threads, each searching its share with one BLAS thread (``shared_out``): NumPy runs a step's
elementwise work on one core, and a step's products are too small to gain much from several
BLAS threads, so a whole search per core keeps every core busy.

Beam search keeps ``beam`` hypotheses per sentence, ranked by their summed log-probability;
finished ones are ranked by the GNMT-normalised score  log P(Y|X) / lp(Y) with
    lp(Y) = ((5 + |Y|) / 6) ** alpha              (Wu et al. 2016; the paper's alpha = 0.6)
or (|Y| + 1) ** alpha with ``length_penalty="power"`` (EOS counted in the length, as fairseq
and CTranslate2 count it; |Y| ** alpha for a hypothesis cut at the maximum length, which
has no EOS). A hypothesis ending in EOS is kept only when
it ranks among the ``beam`` best candidates of its step (so beam 1 is exactly greedy); a
sentence stops once it has ``beam`` finished hypotheses, or at the maximum length
(source length + ``max_len_a``, 50 by default), where active hypotheses are finished as they are.
The maximum length is capped at ``max_positions - 1`` tokens (``output_limits``): BOS and the
output then fit the decoder's positions, so a long source never runs decoding past them.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import get_array_module, to_numpy
from ..engine import anomaly, cuda_kernels
from ..engine import tensor as tensor_module
from ..engine.tensor import no_grad
from ..nn.transformer import Transformer
from . import threads
from .selection import along_rows, by_rows, log_softmax_at, top_m


LENGTH_PENALTIES = ("gnmt", "power")


def _length_penalty(length, alpha, kind, ends=False):
    """lp(Y) of a hypothesis of ``length`` tokens (EOS not counted) that ``ends`` in EOS or
    was cut at the maximum length: gnmt ((5 + |Y|) / 6) ** alpha, power (|Y| + 1) ** alpha
    when it ends (EOS counted, as fairseq and CTranslate2 do), |Y| ** alpha when cut."""
    if kind == "gnmt":
        return ((5.0 + length) / 6.0) ** alpha
    n = length + 1 if ends else length
    return float(n) ** alpha if n > 0 else 1.0


def _forbid(scores, cfg):
    """Padding and BOS are never generated: their scores become -inf, in place."""
    scores[..., cfg.pad_id] = -np.inf
    scores[..., cfg.bos_id] = -np.inf
    return scores


def output_limits(model: Transformer, src: Any, max_len_a: int) -> np.ndarray:
    """Maximum output length of each row of src (B, S): its length (EOS included, padding
    not) + ``max_len_a``, at most ``max_positions - 1`` (BOS + output fit the decoder's
    position table) and at least 1. -> int64 host array (B,)."""
    lengths = to_numpy((src != model.cfg.pad_id).sum(axis=1)).astype(np.int64) + int(max_len_a)
    return np.clip(lengths, 1, max(1, model.cfg.max_positions - 1))


def _source(model, src):
    """src as the model's id array (Transformer.ids: host ids are checked against the
    vocabulary), which must be (B, S) with S >= 1; what shared_out, _greedy and _beam take."""
    src = model.ids(src)
    if src.ndim == 1 and not len(src):  # no sentences
        src = src.reshape(0, 1)
    if src.ndim != 2 or (src.shape[0] and not src.shape[1]):
        raise ValueError(f"src must hold token ids (B, S), each row with at least its EOS; "
                         f"got shape {tuple(src.shape)}")
    return src


def greedy_search(model: Transformer, src: Any, max_len_a: int = 50) -> list[list[int]]:
    """src ids (B, S) -> list of B token-id lists (EOS and padding stripped). On a CPU with
    several BLAS threads the sentences are shared out to threads (``shared_out``)."""
    src = _source(model, src)
    if not len(src):
        return []
    return shared_out(model, src, lambda part: _greedy(model, part, max_len_a))


def _greedy(model, src, max_len_a):
    """greedy_search in this thread."""
    with no_grad():
        model.eval()
        xp, eos = model.xp(), model.cfg.eos_id
        B = src.shape[0]
        limit = output_limits(model, src, max_len_a)
        alive = longest_first(limit)  # original sentence of each row
        state = model.start_decoding(in_order(src, alive), max_length=int(limit.max()))
        out = np.zeros((B, int(limit.max())), dtype=np.int64)  # tokens of sentence b so far:
        n_out = np.zeros(B, dtype=np.int64)                    # out[b, :n_out[b]]
        last = xp.full((B, 1), model.cfg.bos_id, dtype=np.int64)  # (int64: any id fits)
        t = 0
        while len(alive):
            logits = _forbid(model.next_scores(last, state), model.cfg)  # (B*, V)
            nxt = to_numpy(logits.argmax(axis=-1))
            del logits  # freed before the next step makes its own: one block of scores in cache
            grows = nxt != eos  # every live row holds t tokens before this step
            out[alive[grows], t] = nxt[grows]
            n_out[alive[grows]] = t + 1
            t += 1
            going = grows & (t < limit[alive])
            if not going.all():
                keep = compacted(going)
                state.keep_sentences(keep)
                alive, nxt = alive[keep], nxt[keep]
            last = xp.asarray(nxt[:, None])
        return [out[b, :n_out[b]].tolist() for b in range(B)]


def beam_search(model: Transformer, src: Any, beam: int = 4, alpha: float = 0.6,
                max_len_a: int = 50, length_penalty: str = "gnmt",
                return_all: bool = False) -> list:
    """src ids (B, S) -> list of B best token-id lists (EOS stripped).

    With ``return_all`` each entry is instead the list of (score, tokens) of the finished
    hypotheses, best first. On a CPU with several BLAS threads the sentences are shared out
    to threads (``shared_out``).
    """
    if int(beam) < 1:
        raise ValueError(f"beam must be at least 1, got {beam}")
    if length_penalty not in LENGTH_PENALTIES:
        raise ValueError(f"length_penalty must be one of {LENGTH_PENALTIES}, got "
                         f"{length_penalty!r}")
    src = _source(model, src)
    if not len(src):
        return []
    return shared_out(model, src, lambda part: _beam(model, part, int(beam), alpha, max_len_a,
                                                     length_penalty, return_all))


def _beam(model, src, beam, alpha, max_len_a, length_penalty, return_all):
    """beam_search in this thread."""
    with no_grad():
        model.eval()
        xp = model.xp()
        B, k = src.shape[0], beam
        eos = model.cfg.eos_id
        limit = output_limits(model, src, max_len_a)
        # The first step runs one row per sentence (there is one hypothesis, BOS), the
        # others k: the rows of sentence i are i*k .. i*k + k - 1, sharing its
        # encoder-decoder keys/values, and its j-th best hypothesis is in row
        # i*k + slot[i, j] (_place_beams: a row keeps its history when it can).
        # (a vocabulary of fewer than 2 * beam tokens: all beam rows from the start, so that
        # the first step still has 2 * beam candidates, most of them -inf)
        g = 1 if model.cfg.vocab_size >= 2 * k else k
        alive = longest_first(limit)  # original sentence of each active block of rows
        state = model.start_decoding(in_order(src, alive), beams=g, max_length=int(limit.max()))
        tokens, scores = np.zeros((B, g, 0), dtype=np.int64), np.full((B, g), -np.inf)
        scores[:, 0] = 0.0  # one hypothesis: BOS
        slot = np.tile(np.arange(g), (B, 1))
        finished, n_finished = [[] for _ in range(B)], np.zeros(B, dtype=np.int64)
        last = xp.full((B * g, 1), model.cfg.bos_id, dtype=np.int64)
        t = 0
        while len(alive):
            logits = model.next_scores(last, state)  # (rows, V), overwritten below
            top_scores, prev, tok = _best_candidates(xp, logits, scores, slot, k, model.cfg)
            del logits  # (as in _greedy: one block of scores in cache, not two)
            t += 1
            lp = _length_penalty(t - 1, alpha, length_penalty, ends=True)
            _finish_ending(finished, n_finished, alive, top_scores, prev, tok, tokens, eos, lp,
                           k)
            prev, tokens, scores = _continuing(top_scores, prev, tok, tokens, eos, k)
            lp = _length_penalty(t, alpha, length_penalty)
            at_limit = t >= limit[alive]
            _finish_at_limit(finished, alive, at_limit, tokens, scores, lp)
            open_ = ~at_limit & np.isfinite(scores[:, 0]) & (n_finished[alive] < k)
            if not open_.any():
                break
            kb = compacted(open_)
            g = slot.shape[1]
            slot, parent = _place_beams(slot[kb], prev[kb], k)
            state.keep_sentences(kb, rows=(kb[:, None] * g + parent).reshape(-1), group=k)
            alive, tokens, scores = alive[kb], tokens[kb], scores[kb]
            fed = np.empty_like(slot)
            np.put_along_axis(fed, slot, tokens[:, :, -1], 1)  # row i*k + slot[i, j]: beam j
            last = xp.asarray(fed.reshape(-1, 1))
        return _best_first(finished, return_all)


# shared_out gives each thread at least this many sentences: fewer do not pay for the
# thread (its products get too few rows to run at the BLAS's speed).
MIN_THREAD_SENTENCES = 8


def search_threads(model: Transformer, sentences: int) -> int:
    """How many threads shared_out splits a search of ``sentences`` sentences into: as many
    as the BLAS has (``cpu_threads``), each with at least MIN_THREAD_SENTENCES sentences; 1
    on a GPU, and while the profiler, anomaly mode or the attention store is on (they
    follow one thread's ops)."""
    if model.xp() is not np or tensor_module._profiler is not None or anomaly.enabled():
        return 1
    if any(getattr(m, "store", None) is not None for m in model.modules()):
        return 1
    return max(1, min(threads.cpu_threads(), sentences // MIN_THREAD_SENTENCES))


def shared_out(model: Transformer, src: Any, search) -> list:
    """search(src) -> its list of per-sentence results, with the sentences of src (B, S)
    shared out to ``search_threads`` threads: sentence i goes to thread i % n (a batch is
    sorted by length, so each thread gets as much work), each thread runs ``search`` on its
    share, less the columns of padding at its end, with one BLAS thread, and the results are
    put back in order. NumPy and the BLAS release the GIL while they work, so a step's elementwise
    work, which NumPy runs on one core, and its products, too small to gain much from
    several BLAS threads, run on every core at once. A sentence's result does not depend on
    the others in its batch (padding adds exact zeros, a product's rows are independent), so
    it is the same as in one search."""
    n = search_threads(model, len(src))
    if n <= 1:
        return search(src)
    pad = model.cfg.pad_id
    parts = []
    for w in range(n):
        part = src[w::n]
        used = np.nonzero((part != pad).any(axis=0))[0]  # columns with a token (any padding)
        parts.append(part[:, :int(used[-1]) + 1 if len(used) else 1])
    with threads.one_blas_thread():
        results = list(threads.executor(threads.search_pool, n, pin=True).map(search, parts))
    out = [None] * len(src)
    for w, result in enumerate(results):
        out[w::n] = result
    return out


def longest_first(limit):
    """The order in which a search runs the sentences of a batch, from their maximum output
    lengths ``limit`` (B,): longest first (stable). Sentences tend to finish in order of
    their length, and one that finishes at the end of the rows leaves nothing to move
    (``compacted``); in ascending order each would make a sentence from the end move into
    its place, copying its cached keys and values."""
    return np.argsort(-limit, kind="stable")


def in_order(src, order):
    """The rows of src (B, S) in ``order`` (host int array); src itself when unchanged."""
    if (order == np.arange(len(order))).all():
        return src
    return src[get_array_module(src).asarray(order)]


def compacted(keep):
    """The sentences to keep (bool (n,)) in their new order -> int array: each kept sentence
    at or after the new end moves into the place of one that leaves before it, so only
    those rows are copied (the others keep their place)."""
    n = int(keep.sum())
    order = np.arange(n)
    holes = np.nonzero(~keep[:n])[0]
    order[holes] = np.nonzero(keep[n:])[0] + n
    return order


def _place_beams(slot, prev, k):
    """Rows for the next step's hypotheses: ``slot`` (n, g) the row (within its sentence)
    of each current hypothesis, ``prev`` (n, k) the hypothesis each new one extends ->
    (slot (n, k) of the new ones, parent (n, k): the current row each row continues).
    The first new hypothesis to extend a row stays in it; the others take the rows no one
    extends, whose history is then copied (fewer rows copied than by keeping hypothesis j
    in row j)."""
    n = slot.shape[0]
    pp = along_rows(np, slot, prev)  # the row each new hypothesis extends
    order = np.argsort(pp, axis=1, kind="stable")
    ranked = along_rows(np, pp, order)
    first = np.empty((n, k), dtype=bool)
    np.put_along_axis(first, order, np.concatenate(
        [np.ones((n, 1), dtype=bool), ranked[:, 1:] != ranked[:, :-1]], axis=1), 1)
    used = np.zeros((n, k), dtype=bool)
    np.put_along_axis(used, pp, True, 1)
    free = np.argsort(used, axis=1, kind="stable")  # unused rows first, in order
    rank = np.maximum(np.cumsum(~first, axis=1) - 1, 0)
    new_slot = np.where(first, pp, along_rows(np, free, rank))
    parent = np.empty_like(new_slot)
    np.put_along_axis(parent, new_slot, pp, 1)
    return new_slot, parent


def _best_candidates(xp, logits, scores, slot, k, cfg):
    """The 2k best candidates of each of the n sentences, best first -> (scores, hypothesis
    they extend, token), each (n, 2k) on the host; ``logits`` (n*g, V) (overwritten),
    ``scores`` (n, g) of the current hypotheses, hypothesis j of sentence i in row
    i*g + slot[i, j]. Candidates are ranked by log-probability (normalised over every
    token), and padding and BOS are never candidates."""
    n, g, V = scores.shape[0], scores.shape[1], logits.shape[-1]
    # At most k of the 2k end in EOS (one per beam), so at least k continue. Each of them is
    # among the 2k best tokens of its own beam, so those are found first, on the device and
    # in the model's precision, and only they are normalised; n*g*2k numbers come back.
    m = min(2 * k, V)

    def select(z):  # rows z (r, V) -> their m best tokens and log-probabilities
        if cuda_kernels.use_for(xp) and m <= cuda_kernels.TOP_M_MAX and m <= V - 2:
            # one kernel for the lines below (which take ~35 CuPy calls and two full sorts)
            return cuda_kernels.top_m_log_softmax(z, m, (cfg.pad_id, cfg.bos_id))
        forbidden = z[:, [cfg.pad_id, cfg.bos_id]]  # (a copy)
        best, zmax = top_m(xp, _forbid(z, cfg), m, with_max=True)  # (r, m), any order
        z[:, [cfg.pad_id, cfg.bos_id]] = forbidden  # they still count in the normaliser
        zmax = xp.maximum(zmax, forbidden.max(axis=1, keepdims=True))
        lp = log_softmax_at(xp, z, best, zmax)
        if m > V - 2:  # fewer allowed tokens than m: padding or BOS is among the m, at -inf
            lp = xp.where((best == cfg.pad_id) | (best == cfg.bos_id), lp.dtype.type(-np.inf), lp)
        return best, lp

    best, best_lp = by_rows(xp, select, logits)
    best_lp = to_numpy(best_lp).astype(np.float64)
    rows = (np.arange(n)[:, None] * g + slot).reshape(-1)  # hypothesis order
    best, best_lp = to_numpy(best)[rows].reshape(n, g * m), best_lp[rows]
    cand = (scores[:, :, None] + best_lp.reshape(n, g, m)).reshape(n, g * m)
    order = np.argsort(-cand, axis=1, kind="stable")[:, :2 * k]
    top_scores = along_rows(np, cand, order)
    return top_scores, order // m, along_rows(np, best, order)


def _finish_ending(finished, n_finished, alive, top_scores, prev, tok, tokens, eos, lp, k):
    """Add the candidates that end in EOS, among the k best of their sentence, to
    ``finished``, scored by their log-probability / ``lp``."""
    ends = (tok == eos) & np.isfinite(top_scores)
    for i, r in zip(*np.nonzero(ends[:, :k])):  # EOS counts only among the k best
        finished[alive[i]].append((top_scores[i, r] / lp, tokens[i, prev[i, r]].tolist()))
        n_finished[alive[i]] += 1


def _continuing(top_scores, prev, tok, tokens, eos, k):
    """The k best candidates that do not end in EOS -> (beam each extends (n, k), their
    tokens (n, k, t), their scores (n, k))."""
    pick = np.argsort(tok == eos, axis=1, kind="stable")[:, :k]  # stable: non-EOS first
    prev, tok = along_rows(np, prev, pick), along_rows(np, tok, pick)
    new_scores = along_rows(np, top_scores, pick)
    new_tokens = np.concatenate([np.take_along_axis(tokens, prev[:, :, None], 1),
                                 tok[:, :, None]], axis=2)  # (n, k, t)
    return prev, new_tokens, new_scores


def _finish_at_limit(finished, alive, at_limit, tokens, scores, lp):
    """Finish the live hypotheses of the sentences ``at_limit`` (maximum length) as they are,
    scored / ``lp``."""
    k = tokens.shape[1]
    for i in np.nonzero(at_limit)[0]:
        finished[alive[i]].extend((scores[i, j] / lp, tokens[i, j].tolist())
                                  for j in range(k) if np.isfinite(scores[i, j]))


def _best_first(finished, return_all):
    """Each sentence's finished (score, tokens) sorted best first, or (``return_all``
    False) just the best tokens ([] when none finished)."""
    results = []
    for hyps in finished:
        hyps = sorted(hyps, key=lambda x: -x[0])
        results.append(hyps if return_all else (hyps[0][1] if hyps else []))
    return results
