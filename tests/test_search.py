"""The decoder state incremental decoding carries (nn/decoder_state.py), as mt/search.py uses
it: after rows are kept, repeated or their histories reordered, the next scores equal those
of decoding the resulting token histories from scratch, without a cache."""
import os
import threading

import numpy as np
import pytest

from minitransformer.nn.transformer import Transformer, TransformerConfig

CFG = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CFG, seed=3, dtype=np.float64)
    m.eval()
    return m


def _src():
    src = np.random.default_rng(0).integers(4, 30, (3, 6))
    src[1, 4:] = 0  # padding
    return src


def _uncached(model, src, history):
    """Scores of the next token after ``history`` (B, t), decoded from scratch."""
    memory, mask = model.encode(src)
    return model.logits(model.decode(history, memory, mask)).data[:, -1]


def _feed(model, state, history):
    """Feed ``history`` (B, t) one token at a time; -> the last step's scores."""
    for t in range(history.shape[1]):
        scores = model.next_scores(history[:, t:t + 1], state)
    return scores


def test_incremental_scores_equal_a_fresh_decode(model):
    src = _src()
    history = np.random.default_rng(1).integers(4, 30, (3, 4))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src)
    np.testing.assert_allclose(_feed(model, state, history), _uncached(model, src, history),
                               rtol=1e-12, atol=1e-12)
    assert state.offset == 4 and state.rows == 3


def test_kept_sentences_and_reordered_beams_continue_correctly(model):
    src = _src()
    rng = np.random.default_rng(2)
    history = rng.integers(4, 30, (6, 3))  # each beam its own tokens
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src, beams=2)  # two beams a sentence: rows 2b, 2b + 1
    assert state.rows == 6 and state.sentences == 3
    _feed(model, state, history)
    # sentence 1 finishes; then both beams of sentence 0 continue its beam 1, and the beams
    # of sentence 2 swap
    state.keep_sentences(np.array([0, 2]))
    state.reorder_beams(np.array([1, 1, 3, 2]))
    nxt = rng.integers(4, 30, (4, 1))
    got = model.next_scores(nxt, state, log_probs=True)
    beams = np.array([1, 1, 5, 4])  # the original row whose history each row continues
    want_logits = _uncached(model, src[beams // 2], np.concatenate([history[beams], nxt], 1))
    want = want_logits - np.log(np.exp(want_logits - want_logits.max(1, keepdims=True))
                                .sum(1, keepdims=True)) - want_logits.max(1, keepdims=True)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert state.rows == 4 and state.offset == 4


def test_one_step_keeps_sentences_and_reorders_beams_together(model):
    # keep_sentences(..., rows=) is what beam search calls: drop a sentence and reorder
    # the beams of the others in one go, equal to doing the two one after the other
    src = _src()
    history = np.random.default_rng(3).integers(4, 30, (6, 2))
    history[:, 0] = CFG.bos_id
    a, b = model.start_decoding(src, beams=2), model.start_decoding(src, beams=2)
    _feed(model, a, history), _feed(model, b, history)
    a.keep_sentences(np.array([1, 2]), rows=np.array([3, 3, 5, 4]))
    b.keep_sentences(np.array([1, 2]))
    b.reorder_beams(np.array([1, 1, 3, 2]))
    nxt = np.array([[5], [6], [7], [8]])
    np.testing.assert_array_equal(model.next_scores(nxt, a), model.next_scores(nxt, b))


def test_the_self_attention_cache_grows_past_its_capacity(model):
    # the caches are sized by max_length; a search that feeds more positions (or one that
    # gave no max_length) still gets every earlier position back
    src = _src()
    history = np.random.default_rng(4).integers(4, 30, (3, 7))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src, max_length=2)
    np.testing.assert_allclose(_feed(model, state, history), _uncached(model, src, history),
                               rtol=1e-12, atol=1e-12)
    assert state.layers[0]["self"].k_buf.shape[2] >= 7


def test_encoder_decoder_keys_are_computed_once_per_sentence(model):
    src = _src()
    state = model.start_decoding(src, beams=4)
    cross = state.layers[0]["cross"]
    assert state.rows == 12 and cross.k.shape[0] == 3 and cross.group == 4


def test_fused_self_attention_projection_equals_the_three_products(model):
    # start_decoding's caches carry [W_q W_k W_v] (one product a step); new_cache's do not
    # (three products, as in training): the scores agree to float rounding
    src = _src()
    history = np.random.default_rng(5).integers(4, 30, (3, 5))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src)
    assert state.layers[0]["self"].qkv[0].shape == (CFG.d_model, 3 * CFG.d_model)
    fused = _feed(model, state, history)
    memory, mask = model.encode(src)
    cache = model.new_cache()
    for t in range(history.shape[1]):
        plain = model.logits(model.decode(history[:, t:t + 1], memory, mask, cache=cache,
                                          offset=t)).data[:, -1]
    np.testing.assert_allclose(fused, plain, rtol=1e-13, atol=1e-13)


def test_a_cache_larger_than_its_byte_budget_starts_smaller_and_grows(model, monkeypatch):
    # a buffer for max_length positions would be beyond BUFFER_BYTES: the first one holds
    # what fits (here 2 positions) and is doubled as needed, with the same scores
    from minitransformer.nn.decoder_state import SelfCache
    rows, H, K = 3, CFG.n_heads, CFG.d_model // CFG.n_heads
    monkeypatch.setattr(SelfCache, "BUFFER_BYTES", 2 * rows * H * K * 8)  # float64
    src = _src()
    history = np.random.default_rng(6).integers(4, 30, (3, 7))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src, max_length=50)
    model.next_scores(history[:, :1], state)
    assert state.layers[0]["self"].k_buf.shape[2] == 2
    state = model.start_decoding(src, max_length=50)
    np.testing.assert_allclose(_feed(model, state, history), _uncached(model, src, history),
                               rtol=1e-12, atol=1e-12)
    assert 7 <= state.layers[0]["self"].k_buf.shape[2] < 50


def test_a_cache_that_grows_after_sentences_left_keeps_only_the_rows_still_here(model):
    # growing copies the history of the rows still decoding, not of the whole first batch
    src = _src()
    history = np.random.default_rng(7).integers(4, 30, (3, 6))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src, max_length=2)
    _feed(model, state, history[:, :2])
    state.keep_sentences(np.array([2, 0]))  # sentence 1 finished; 2 and 0 go on, reordered
    scores = _feed(model, state, history[[2, 0], 2:])  # past the capacity of 2 positions
    cache = state.layers[0]["self"]
    assert cache.k_buf.shape[0] == 2 and cache.k_buf.shape[2] >= 6
    np.testing.assert_allclose(scores, _uncached(model, src[[2, 0]], history[[2, 0]]),
                               rtol=1e-12, atol=1e-12)


def test_decoding_with_an_unshared_output_projection():
    # start_decoding keeps the output projection as one (D, V) array (output_weight): for
    # separate embeddings it is out_proj's weight, for shared ones the embedding transposed
    for share in (False, True):
        cfg = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                                dropout=0.0, share_embeddings=share)
        m = Transformer(cfg, seed=8, dtype=np.float64)
        m.eval()
        src = _src()
        history = np.random.default_rng(7).integers(4, 30, (3, 4))
        history[:, 0] = cfg.bos_id
        state = m.start_decoding(src)
        assert state.out_weight.shape == (16, 30) and state.out_weight.flags.c_contiguous
        np.testing.assert_allclose(_feed(m, state, history), _uncached(m, src, history),
                                   rtol=1e-12, atol=1e-12)


def test_compacted_moves_only_the_sentences_past_the_new_end():
    from minitransformer.mt.search import compacted
    rng = np.random.default_rng(9)
    for _ in range(50):
        keep = rng.random(int(rng.integers(1, 12))) < 0.6
        order = compacted(keep)
        assert sorted(order) == list(np.nonzero(keep)[0])  # each kept sentence once
        n = len(order)
        moved = order != np.arange(n)
        assert (order[moved] >= n).all() and moved.sum() == (~keep[:n]).sum()


def test_place_beams_keeps_histories_in_place_where_it_can():
    from minitransformer.mt.search import _place_beams
    rng = np.random.default_rng(10)
    for g, k in [(1, 4), (4, 4), (3, 3), (2, 5)]:
        for _ in range(30):
            n = int(rng.integers(1, 5))
            slot = np.stack([rng.permutation(k)[:g] for _ in range(n)])  # rows in use
            prev = rng.integers(0, g, (n, k))  # the hypothesis each new one extends
            new_slot, parent = _place_beams(slot, prev, k)
            pp = np.take_along_axis(slot, prev, 1)
            for i in range(n):
                assert sorted(new_slot[i]) == list(range(k))  # one row each
                # each row continues the history of the hypothesis placed in it
                assert (parent[i, new_slot[i]] == pp[i]).all()
                # rows copied: one per new hypothesis beyond the first of its parent
                assert (parent[i] != np.arange(k)).sum() == k - len(set(pp[i]))


def test_one_row_a_sentence_becomes_beams_and_sentences_change_places(model):
    # beam search's first step: one row a sentence (group 1); then three rows a sentence,
    # continuing that row, while sentence 2 moves into the place of sentence 0, which leaves
    src = _src()
    history = np.random.default_rng(11).integers(4, 30, (3, 3))
    history[:, 0] = CFG.bos_id
    state = model.start_decoding(src)
    _feed(model, state, history)
    state.keep_sentences(np.array([2, 1]), rows=np.array([2, 2, 2, 1, 1, 1]), group=3)
    assert state.rows == 6 and state.layers[0]["cross"].group == 3
    nxt = np.random.default_rng(12).integers(4, 30, (6, 1))
    got = model.next_scores(nxt, state)
    rows = np.array([2, 2, 2, 1, 1, 1])
    want = _uncached(model, src[rows], np.concatenate([history[rows], nxt], 1))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_beam_search_with_a_vocabulary_smaller_than_twice_the_beam():
    # 7 tokens (4 special), beam 5: the first step cannot find 2 * beam candidates in one
    # row, so every beam row runs from the start; the search still finishes and beam 1 of
    # the same model is greedy
    from minitransformer.mt.search import beam_search, greedy_search
    cfg = TransformerConfig(vocab_size=7, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                            dropout=0.0)
    m = Transformer(cfg, seed=2, dtype=np.float64)
    src = np.random.default_rng(13).integers(4, 7, (3, 5))
    out = beam_search(m, src, beam=5, max_len_a=3)
    assert len(out) == 3 and all(all(4 <= t < 7 for t in h) for h in out)
    assert beam_search(m, src, beam=1, max_len_a=3) == greedy_search(m, src, max_len_a=3)


@pytest.mark.parametrize("vocab,beam", [(7, 5), (8, 4), (9, 4)])
def test_beam_search_never_gives_padding_or_bos_however_small_the_vocabulary(vocab, beam):
    # fewer allowed tokens (vocab - 2) than the 2 * beam best a beam looks at: padding and
    # BOS are among them, at -inf, and no hypothesis may ever continue with one
    from minitransformer.mt.search import beam_search
    cfg = TransformerConfig(vocab_size=vocab, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                            dropout=0.0)
    for seed in range(6):
        m = Transformer(cfg, seed=seed, dtype=np.float64)
        src = np.random.default_rng(seed).integers(4, vocab, (4, 5))
        src[:, -1] = cfg.eos_id
        out = beam_search(m, src, beam=beam, max_len_a=3, return_all=True)
        hyps = [(score, h) for sentence in out for score, h in sentence]
        assert all(sentence for sentence in out)
        bad = [(score, h) for score, h in hyps if cfg.pad_id in h or cfg.bos_id in h]
        assert not bad, f"seed {seed}: hypotheses with padding or BOS: {bad[:3]}"
        assert all(np.isfinite(score) for score, _ in hyps)


def test_tokens_fed_back_do_not_take_the_sources_integer_type():
    # ids in a uint8 source (a vocabulary of 300): the searches still feed each output token
    # back as it is (605 stays 605, not 605 mod 256), so they give the int64 source's output
    from minitransformer.mt.search import beam_search, greedy_search
    cfg = TransformerConfig(vocab_size=300, d_model=16, n_heads=2, d_ff=32, n_layers=1,
                            dropout=0.0)
    m = Transformer(cfg, seed=4, dtype=np.float64)
    src = np.random.default_rng(1).integers(4, 250, (4, 6))
    src[:, -1] = cfg.eos_id
    wide = greedy_search(m, src, max_len_a=4), beam_search(m, src, beam=3, max_len_a=4)
    assert any(t > 255 for h in wide[0] + wide[1] for t in h)  # (else the test shows nothing)
    narrow = src.astype(np.uint8)
    assert greedy_search(m, narrow, max_len_a=4) == wide[0]
    assert beam_search(m, narrow, beam=3, max_len_a=4) == wide[1]


def test_searches_check_their_arguments(model):
    from minitransformer.mt.search import beam_search, greedy_search
    for search in (greedy_search, beam_search):
        assert search(model, np.zeros((0, 5), np.int64)) == []
        assert search(model, []) == []
        with pytest.raises(ValueError, match=r"at least its EOS; got shape \(3, 0\)"):
            search(model, np.zeros((3, 0), np.int64))
    with pytest.raises(ValueError, match="beam must be at least 1, got 0"):
        beam_search(model, _src(), beam=0)
    with pytest.raises(ValueError, match="length_penalty must be one of .*'gmnt'"):
        beam_search(model, _src(), length_penalty="gmnt")


def test_candidate_rows_split_across_threads_give_the_same_numbers(monkeypatch):
    # by_rows runs the search's whole-vocabulary work (top_m, the normaliser) on chunks of
    # rows in threads: every row's tokens and log-probabilities equal one call's, bit for bit
    from minitransformer.mt import selection
    from minitransformer.mt import threads as mt_threads
    from minitransformer.mt.selection import by_rows, log_softmax_at, top_m
    z = np.random.default_rng(5).standard_normal((37, 1000)).astype(np.float32) * 4

    def select(rows):
        best = top_m(np, rows, 8)
        return best, log_softmax_at(np, rows, best)

    want = select(z.copy())
    monkeypatch.setattr(selection, "MIN_BLOCK", 1)
    for threads, chunk_bytes in ((1, 12_000), (2, 1 << 19), (3, 1), (5, 12_000)):
        # chunks of 3 rows (12,000 bytes of 4,000-byte rows), all 37 rows in one, or 1 row
        monkeypatch.setattr(mt_threads, "cpu_threads", lambda n=threads: n)
        monkeypatch.setattr(selection, "CHUNK_BYTES", chunk_bytes)
        got = by_rows(np, select, z.copy())
        if chunk_bytes == 1:
            assert mt_threads.row_pool["size"] >= threads  # (the chunks went to the threads)
        order = np.argsort(got[0], axis=1), np.argsort(want[0], axis=1)
        np.testing.assert_array_equal(np.take_along_axis(got[0], order[0], 1),
                                      np.take_along_axis(want[0], order[1], 1))
        np.testing.assert_array_equal(np.take_along_axis(got[1], order[0], 1),
                                      np.take_along_axis(want[1], order[1], 1))


def test_beam_search_with_candidates_in_threads_equals_one_thread(monkeypatch):
    from minitransformer.mt import search, selection
    from minitransformer.mt import threads as mt_threads
    cfg = TransformerConfig(vocab_size=300, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                            dropout=0.0)
    m = Transformer(cfg, seed=4)
    src = np.random.default_rng(17).integers(4, 300, (9, 7))
    src[3, 5:] = 0
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: 1)
    one = search.beam_search(m, src, beam=4, max_len_a=6, return_all=True)
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: 2)
    monkeypatch.setattr(selection, "MIN_BLOCK", 1)
    monkeypatch.setattr(selection, "CHUNK_BYTES", 3 * 300 * 4)  # chunks of 3 rows
    assert search.beam_search(m, src, beam=4, max_len_a=6, return_all=True) == one


def test_searches_from_several_threads_leave_the_blas_threads_as_they_were():
    # two threads of a server search at once: the searches shared out to threads take the
    # one-BLAS-thread limit in turn (B waits for A), each with one thread inside; afterwards
    # the BLAS has its threads again, and a third thread can still set the limit (the thread
    # that set it has let go of threadpoolctl's control)
    import threading
    import time
    pytest.importorskip("threadpoolctl")
    from minitransformer.mt import threads as mt_threads
    if mt_threads.cpu_threads() < 2:  # (a limit set here would make this thread the one
        #                                    that controls OpenBLAS: the others' are ignored)
        pytest.skip("needs a BLAS with two threads or more")
    before = mt_threads.cpu_threads()
    a_in, seen = threading.Event(), {}

    def a():
        with mt_threads.one_blas_thread():
            a_in.set()
            time.sleep(0.2)
            seen["a"] = mt_threads.cpu_threads()
            seen["a_out"] = time.monotonic()

    def b():
        a_in.wait(10)
        with mt_threads.one_blas_thread():
            seen["b_in"] = time.monotonic()
            seen["b"] = mt_threads.cpu_threads()

    def c():
        with mt_threads.one_blas_thread():
            seen["c"] = mt_threads.cpu_threads()

    for group in ([a, b], [c]):
        workers = [threading.Thread(target=f) for f in group]
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
    assert (seen["a"], seen["b"], seen["c"]) == (1, 1, 1)
    assert seen["b_in"] >= seen["a_out"]  # in turn
    assert mt_threads.cpu_threads() == before


def test_cpu_threads_follows_the_blas_thread_limit():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from minitransformer.mt.threads import cpu_threads
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert cpu_threads() == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_search_shared_out_to_threads_equals_one_search(dtype):
    # shared_out deals a batch's sentences out to as many threads as the BLAS has (sentence i
    # to thread i % n), each searching its share, less its columns of padding at the end, with
    # one BLAS thread: every sentence's output and score equal those of one search of the
    # batch, whatever the padding's place (two rows here have theirs before their tokens)
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from minitransformer.mt import search
    from minitransformer.mt import threads as mt_threads
    cfg = TransformerConfig(vocab_size=300, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                            dropout=0.0)
    m = Transformer(cfg, seed=6, dtype=dtype)
    rng = np.random.default_rng(23)
    lengths = np.sort(rng.integers(2, 12, 40))  # a batch sorted by length, as translate.py's
    src = np.zeros((40, 12), dtype=np.int64)
    for i, n in enumerate(lengths):
        src[i, :n] = rng.integers(4, 300, n)
        src[i, n - 1] = cfg.eos_id
    for i in (0, 4):  # short rows padded on the left: their EOS in the last column
        src[i] = np.roll(src[i], 12 - lengths[i])
    runs = {}
    for threads in (1, 3):
        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            if mt_threads.cpu_threads() != threads:
                pytest.skip("the BLAS does not take a thread limit here")
            assert search.search_threads(m, len(src)) == threads  # 40 // 8 >= 3
            runs[threads] = (search.greedy_search(m, src, max_len_a=5),
                             search.beam_search(m, src, beam=3, max_len_a=5, return_all=True))
    assert mt_threads.search_pool["size"] >= 3  # (the shares went to the threads)
    assert runs[3][0] == runs[1][0]  # greedy: the same tokens
    # beam: the same hypotheses in the same order; their scores agree to rounding, as a
    # sentence's do between any two batches: the BLAS sums a product's rows in an order that
    # depends on how many rows it gets (OpenBLAS: in the last bits, with an odd count)
    assert [[h for _, h in hyps] for hyps in runs[3][1]] == \
           [[h for _, h in hyps] for hyps in runs[1][1]]
    np.testing.assert_allclose([s for hyps in runs[3][1] for s, _ in hyps],
                               [s for hyps in runs[1][1] for s, _ in hyps],
                               rtol=2e-6 if dtype == np.float32 else 1e-14)  # (seen: 2e-7, 3e-16)
    assert len(runs[1][0]) == 40 and all(runs[1][1])


def test_no_threads_for_few_sentences_or_while_the_attention_store_is_on(model, monkeypatch):
    from minitransformer.mt import search
    from minitransformer.mt import threads as mt_threads
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: 4)
    assert search.search_threads(model, 8 * 4) == 4
    assert search.search_threads(model, 8 * 2 + 7) == 2
    assert search.search_threads(model, 7) == 1
    model.set_attention_store({})
    try:
        assert search.search_threads(model, 64) == 1  # (the maps follow one thread's ops)
    finally:
        model.set_attention_store(None)


@pytest.mark.parametrize("V", [8000, 6000, 37000, 23, 1])
def test_row_sums_are_accurate_and_each_row_its_own(V):
    from minitransformer.mt.selection import row_sums
    e = np.exp(np.random.default_rng(V).standard_normal((13, V)) * 3).astype(np.float32)
    got = row_sums(np, e)
    assert got.shape == (13, 1) and got.dtype == np.float32
    np.testing.assert_allclose(got[:, 0], e.astype(np.float64).sum(axis=1), rtol=5e-7)
    for a, b in ((0, 1), (3, 4), (5, 13), (0, 13)):  # any rows alone give the same numbers
        np.testing.assert_array_equal(row_sums(np, e[a:b]), got[a:b])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs per-thread CPU affinity and two CPUs")
@pytest.mark.parametrize("own_cores", [True, False])
def test_shared_out_pins_its_threads_one_per_core_when_the_process_has_the_cores(
        model, monkeypatch, own_cores):
    # one thread per core: each thread on a CPU of its own, so that threads woken after an
    # idle spell do not share a core; on a machine with more cores than threads, no pinning
    from minitransformer.mt import search
    from minitransformer.mt import threads as mt_threads
    cpus = sorted(os.sched_getaffinity(0))
    threads = len(cpus) if own_cores else len(cpus) - 1
    if threads < 2:
        pytest.skip("needs three CPUs to leave one over")
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: threads)
    monkeypatch.setattr(mt_threads, "search_pool", {"pid": None, "executor": None, "size": 0})
    seen = {}
    barrier = threading.Barrier(threads, timeout=10)

    def record(part):
        barrier.wait()  # (every share in a thread of its own)
        seen[threading.get_ident()] = sorted(os.sched_getaffinity(0))
        return [0] * len(part)

    src = np.full((8 * threads, 3), 5)
    assert search.shared_out(model, src, record) == [0] * len(src)
    mt_threads.search_pool["executor"].shutdown()
    assert len(seen) == threads
    if own_cores:
        assert sorted(c for got in seen.values() for c in got) == cpus  # one CPU each
    else:
        assert all(got == cpus for got in seen.values())  # left to the scheduler
    assert sorted(os.sched_getaffinity(0)) == cpus  # (the calling thread is left alone)


def test_by_rows_gives_every_thread_a_chunk_however_large_the_chunks(monkeypatch):
    from minitransformer.mt import selection
    from minitransformer.mt import threads as mt_threads
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: 2)
    monkeypatch.setattr(selection, "MIN_BLOCK", 1)
    monkeypatch.setattr(selection, "CHUNK_BYTES", 1 << 30)  # one chunk would hold every row
    z = np.arange(7 * 5, dtype=np.float32).reshape(7, 5)
    calls = []

    def fn(rows):
        calls.append((threading.get_ident(), len(rows)))
        return (rows.sum(axis=1),)

    got = selection.by_rows(np, fn, z)
    np.testing.assert_array_equal(got[0], z.sum(axis=1))
    assert sorted(n for _, n in calls) == [3, 4]  # two chunks, one a thread
    monkeypatch.setattr(mt_threads, "cpu_threads", lambda: 1)
    calls.clear()
    selection.by_rows(np, fn, z)
    assert [n for _, n in calls] == [7]  # one thread: one chunk


@pytest.mark.parametrize("norm, positions", [("post", "sinusoidal"), ("pre", "learned")])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_the_array_step_gives_the_numbers_of_forward_bit_for_bit(norm, positions, dtype,
                                                                  monkeypatch):
    # next_scores runs each decoder layer's ``step`` on raw arrays; with it switched off it
    # runs the same layers' forward on Tensors. Greedy rows (group 1), then three beams a
    # sentence with reordered histories and a sentence gone: the same scores, bit for bit.
    from minitransformer.nn.layers import DecoderLayer
    cfg = TransformerConfig(vocab_size=30, d_model=16, n_heads=2, d_ff=32, n_layers=2,
                            dropout=0.0, norm=norm, positions=positions)
    m = Transformer(cfg, seed=4, dtype=dtype)
    m.eval()
    src = _src()
    rng = np.random.default_rng(14)
    history = rng.integers(4, 30, (3, 4))
    history[:, 0] = cfg.bos_id
    nxt = rng.integers(4, 30, (6, 2))
    steps = []
    monkeypatch.setattr(DecoderLayer, "step", lambda self, *a, f=DecoderLayer.step:
                        steps.append(1) or f(self, *a))

    steps_if_it_may = Transformer._steps

    def run(use_steps):
        monkeypatch.setattr(Transformer, "_steps", lambda self, state:
                            use_steps and steps_if_it_may(self, state))
        state = m.start_decoding(src)
        out = [_feed(m, state, history)]
        state.keep_sentences(np.array([2, 0]), rows=np.array([2, 2, 2, 0, 0, 0]), group=3)
        out.append(m.next_scores(nxt[:, :1], state))
        state.reorder_beams(np.array([1, 0, 0, 5, 3, 4]))
        out.append(m.next_scores(nxt[:, 1:], state, log_probs=True))
        return out

    plain = run(False)
    assert not steps
    stepped = run(True)
    assert len(steps) == 6 * cfg.n_layers  # every step of the second run went through step
    for a, b in zip(stepped, plain):
        assert a.dtype == b.dtype == dtype
        np.testing.assert_array_equal(a, b)


def test_a_profiled_or_recorded_decode_goes_through_forward(model):
    # the profiler follows Functions and the attention store records maps in forward: with
    # either on (or with a tape), next_scores does not take the array step
    from minitransformer.engine.profiler import profile
    from minitransformer.engine.tensor import no_grad
    state = model.start_decoding(_src())
    assert not model._steps(state)  # (a tape would be recorded here)
    with no_grad():
        assert model._steps(state)
        with profile(model):
            assert not model._steps(state)
        store = {}
        model.set_attention_store(store)
        try:
            assert not model._steps(state)
            model.next_scores(np.full((3, 1), CFG.bos_id), state)
            assert len(store["decoder.0.cross_attn"]) == 1
        finally:
            model.set_attention_store(None)
        assert model._steps(state)


def test_largest_selects_the_m_largest_of_each_row_with_ties_and_nan(monkeypatch):
    # sorted values give each row's m-th largest; rows tied there or holding NaN make the
    # count differ from m, and argpartition selects instead (counted here)
    from minitransformer.mt import selection
    rng = np.random.default_rng(15)
    a = rng.standard_normal((9, 40)).astype(np.float32)
    calls = []
    real = np.argpartition
    monkeypatch.setattr(np, "argpartition", lambda *x, **k: calls.append(1) or real(*x, **k))
    got = selection.largest(np, a, 5)
    assert not calls  # distinct values: the sorted path
    for row, want in zip(got, np.argsort(-a, axis=1)[:, :5]):
        assert sorted(row) == sorted(want)
    tied = a.copy()
    tied[4, [3, 7]] = tied[4].max() + 1  # two equal at the top: not a tie at the 5th
    tied[6, :] = 0.0  # all tied: any 5 are right
    tied[6, [1, 2, 3]] = [3.0, 2.0, 1.0]
    got = selection.largest(np, tied, 5)
    assert len(calls) == 1  # row 6 ties at its 5th largest
    assert {3, 7} <= set(got[4]) and {1, 2, 3} <= set(got[6])
    assert all(len(set(row)) == 5 for row in got.tolist())
    nan = a.copy()
    nan[2, 0] = np.nan  # (sorted last, as the largest)
    got = selection.largest(np, nan, 5)
    assert len(calls) == 2 and sorted(got[0]) == sorted(np.argsort(-a[0])[:5])


def test_searches_run_the_longest_sentences_first_and_answer_in_the_callers_order(model):
    # a sentence that finishes at the end of the rows leaves nothing to move: the rows run
    # longest first (stable), and the results come back in the order of src
    from minitransformer.mt.search import beam_search, greedy_search, in_order, longest_first
    assert longest_first(np.array([3, 7, 7, 1, 5])).tolist() == [1, 2, 4, 0, 3]
    src = _src()
    assert in_order(src, np.arange(3)) is src
    np.testing.assert_array_equal(in_order(src, np.array([2, 0, 1])), src[[2, 0, 1]])
    for search in (greedy_search, lambda m, s: beam_search(m, s, beam=3)):
        both = search(model, src)
        assert [search(model, src[i:i + 1])[0] for i in range(3)] == both
        assert search(model, src[::-1]) == both[::-1]


@pytest.mark.parametrize("exp2", [True, False])
def test_log_softmax_at_the_picked_columns_is_the_log_softmax_there(exp2, monkeypatch):
    # the normaliser's exponentials, as exp or as 2 ** ((z - max) log2 e) (where NumPy's exp2
    # is vectorised): in float32 the picked log-probabilities stay within a few roundings of
    # the float64 log-softmax, for logits spread as a trained model's are and with a -inf
    # entry (a forbidden token)
    from minitransformer.mt import selection
    from minitransformer.mt.selection import log_softmax_at, top_m
    monkeypatch.setattr(selection, "EXP2_VECTORISED", exp2)
    rng = np.random.default_rng(16)
    for scale in (1.0, 8.0, 40.0):
        z = (rng.standard_normal((6, 8000)) * scale).astype(np.float32)
        z[:, 0] = -np.inf
        z64 = z.astype(np.float64)
        want = z64 - z64.max(1, keepdims=True)
        want -= np.log(np.exp(want).sum(1, keepdims=True))
        cols = top_m(np, z, 8)
        zz = z.copy()
        got = log_softmax_at(np, zz, cols)
        assert got.dtype == np.float32
        # z is left holding the exponentials, computed the way the flag says
        e = z - z.max(1, keepdims=True)
        e = np.exp2(e * np.float32(selection.LOG2_E)) if exp2 else np.exp(e)
        np.testing.assert_array_equal(zz, e)
        np.testing.assert_allclose(got, np.take_along_axis(want, cols, 1), rtol=2e-6,
                                   atol=2e-6)


def test_exp2_is_used_only_where_numpy_vectorises_it(monkeypatch):
    # NumPy's float32 exp2 has vector loops for AVX-512 only; on an AVX2 CPU it is a scalar
    # loop at twice exp's cost, so the normaliser's exponentials use exp there
    introspect = pytest.importorskip("numpy.lib.introspect")
    from minitransformer.mt import selection

    def info(current):
        return lambda func_name, signature: {"exp2": {"ff": {
            "current": current, "available": "X86_V4 baseline(X86_V2)"}}}

    monkeypatch.setattr(introspect, "opt_func_info", info("baseline(X86_V2)"))
    assert selection.exp2_vectorised() is False
    monkeypatch.setattr(introspect, "opt_func_info", info("X86_V4"))
    assert selection.exp2_vectorised() is True
    # a build for AVX-512 CPUs only: the baseline loop is the vectorised one
    monkeypatch.setattr(introspect, "opt_func_info", info("baseline(X86_V2 X86_V3 X86_V4)"))
    assert selection.exp2_vectorised() is True
    monkeypatch.setattr(introspect, "opt_func_info", lambda func_name, signature: {})
    assert selection.exp2_vectorised() is False
    monkeypatch.setattr(introspect, "opt_func_info", lambda func_name, signature: [])
    assert selection.exp2_vectorised() is False  # an answer of another shape: exp, no error


@pytest.mark.parametrize("avx512", [True, False])
def test_before_numpy_2_exp2_is_used_where_the_cpu_has_avx512(avx512, monkeypatch):
    # NumPy 1.x has no numpy.lib.introspect; its exp2 has AVX-512 loops only, so the CPU
    # features it found decide
    import sys
    import types

    from minitransformer.mt import selection
    monkeypatch.setitem(sys.modules, "numpy.lib.introspect", None)  # (import fails)
    monkeypatch.setitem(sys.modules, "numpy.core._multiarray_umath", types.SimpleNamespace(
        __cpu_features__={"AVX2": True, "AVX512_SKX": avx512}))
    assert selection.exp2_vectorised() is avx512
