"""Translate lines of text with a trained model: tokenize, batch by length, search, detokenize."""
import numpy as np

from .search import beam_search, greedy_search


def pad_batch(seqs, pad_id):
    """List of id lists -> (B, L) int64 array padded with ``pad_id``."""
    L = max(len(s) for s in seqs)
    out = np.full((len(seqs), L), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def translate_ids(model, src_ids, beam=4, alpha=0.6, max_len_a=50, max_tokens=4096,
                  length_penalty="gnmt"):
    """Token-id lists (no EOS) -> output id lists, same order. Sorted by length into batches
    of at most ``max_tokens`` padded source tokens; an empty input gives an empty output."""
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


def translate_lines(model, tokenizer, lines, **search_options):
    """Plain-text lines -> detokenized translations, one per line, in input order."""
    ids = tokenizer.encode([line.strip() for line in lines])
    hyps = translate_ids(model, ids, **search_options)
    return tokenizer.decode(hyps)


def corpus_bleu(hypotheses, references):
    """sacreBLEU corpus score (default 13a tokenization, cased) -> (score, signature)."""
    import sacrebleu
    metric = sacrebleu.metrics.BLEU()
    result = metric.corpus_score(hypotheses, [references])
    return result.score, str(metric.get_signature())
