"""Translate lines of text with a trained model: tokenize, batch by length, search, detokenize.

A source longer than the model can attend to (``max_source_tokens``: its ``max_positions``
less one for the EOS the source gets) is cut to its first ``max_source_tokens`` ids rather
than aborting the whole input; ``on_truncate`` tells the caller which lines were cut, so it
can warn. The output is capped by the search at ``max_positions - 1`` tokens (BOS + output
fit the decoder's positions), so no line of any length runs decoding past the positions.
"""
import numpy as np

from .search import beam_search, greedy_search


def pad_batch(seqs, pad_id):
    """List of id lists -> (B, L) int64 array padded with ``pad_id``."""
    L = max(len(s) for s in seqs)
    out = np.full((len(seqs), L), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def max_source_tokens(cfg):
    """Source ids (EOS not counted) a model of config ``cfg`` can attend to:
    ``cfg.max_positions - 1``, since the source gets an EOS and nothing else."""
    return max(1, cfg.max_positions - 1)


def truncate_sources(src_ids, limit):
    """Cut each id list to at most ``limit`` ids -> (ids, cut) where ``cut`` lists
    (index, original length, kept length) of each list that was cut, in input order.
    Lists that fit are passed through unchanged (not copied)."""
    out, cut = [], []
    for i, ids in enumerate(src_ids):
        if len(ids) > limit:
            cut.append((i, len(ids), limit))
            ids = list(ids)[:limit]
        out.append(ids)
    return out, cut


def translate_ids(model, src_ids, beam=4, alpha=0.6, max_len_a=50, max_tokens=4096,
                  length_penalty="gnmt", on_truncate=None):
    """Token-id lists (no EOS) -> output id lists, same order. Sorted by length into batches
    of at most ``max_tokens`` padded source tokens; an empty input gives an empty output.

    A source longer than ``max_source_tokens(model.cfg)`` is translated from its first that
    many ids; ``on_truncate(index, n_tokens, n_kept)`` (0-based index into ``src_ids``) is
    called for each such source, in input order, before any decoding. Outputs are at most
    source length + 1 + ``max_len_a`` and at most ``max_positions - 1`` tokens long.
    """
    src_ids, cut = truncate_sources(src_ids, max_source_tokens(model.cfg))
    if on_truncate is not None:
        for i, n, kept in cut:
            on_truncate(i, n, kept)
    eos = model.cfg.eos_id
    order = sorted((i for i, s in enumerate(src_ids) if s), key=lambda i: len(src_ids[i]))
    out = [[] for _ in src_ids]
    start = 0
    while start < len(order):
        end, longest = start, 0
        while end < len(order):
            longest_next = max(longest, len(src_ids[order[end]]) + 1)
            if end > start and longest_next * (end - start + 1) > max_tokens:
                break
            longest, end = longest_next, end + 1
        rows = order[start:end]
        src = pad_batch([list(src_ids[i]) + [eos] for i in rows], model.cfg.pad_id)
        if beam <= 1:
            hyps = greedy_search(model, src, max_len_a=max_len_a)
        else:
            hyps = beam_search(model, src, beam=beam, alpha=alpha, max_len_a=max_len_a,
                               length_penalty=length_penalty)
        for i, h in zip(rows, hyps):
            out[i] = h
        start = end
    return out


def translate_lines(model, tokenizer, lines, on_truncate=None, **search_options):
    """Plain-text lines -> detokenized translations, one per line, in input order (an empty
    line gives an empty translation).

    A line of more than ``max_source_tokens(model.cfg)`` pieces is translated from its first
    that many; ``on_truncate(index, n_tokens, n_kept)`` is called for each such line (index
    0-based into ``lines``; the counts are sentencepiece pieces, EOS not included), so the
    caller can warn. ``search_options``: those of ``translate_ids``.
    """
    ids = tokenizer.encode([line.strip() for line in lines])
    hyps = translate_ids(model, ids, on_truncate=on_truncate, **search_options)
    return tokenizer.decode(hyps)


def corpus_bleu(hypotheses, references):
    """sacreBLEU corpus score (default 13a tokenization, cased) -> (score, signature)."""
    import sacrebleu
    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(hypotheses, [references])
    return result.score, str(metric.get_signature())
