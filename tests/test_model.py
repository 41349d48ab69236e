"""The whole Transformer: gradients, decoding properties, checkpoints."""
import numpy as np
import pytest

import minitransformer as mt
from minitransformer.backend import to_numpy
from minitransformer.engine.tensor import no_grad
from minitransformer.mt import checkpoint as ckpt
from minitransformer.mt.search import beam_search, greedy_search
from minitransformer.mt.selection import top_m
from minitransformer.nn.transformer import Transformer, TransformerConfig, preset, sinusoids

V = 23


def tiny_config(**overrides):
    base = dict(vocab_size=V, d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0,
                label_smoothing=0.1)
    base.update(overrides)
    return TransformerConfig(**base)


def toy_batch(seed=0, B=3, S=6, T=5):
    r = np.random.default_rng(seed)
    src = r.integers(4, V, (B, S))
    src[0, S - 2:] = 0  # padding in the source
    tgt = r.integers(4, V, (B, T + 1))
    tgt[1, T - 1:] = 0  # padding in the target
    return src, tgt[:, :-1], tgt[:, 1:]


@pytest.mark.parametrize("overrides", [
    {},                                                    # the paper: post-norm, shared, sinusoids
    {"norm": "pre", "positions": "learned", "share_embeddings": False, "smoothing": "uniform"},
])
def test_whole_model_gradcheck_float64(overrides):
    model = Transformer(tiny_config(**overrides), seed=3, dtype=np.float64)
    src, tin, tout = toy_batch()
    report = mt.gradcheck(lambda s: model.loss(s, tin, tout)[0], [src],
                          params=list(model.named_parameters()), n_directions=3, full_max=0)
    names = {n for n, _ in model.named_parameters()}
    assert set(report) == names  # every parameter was checked (the int input was skipped)
    assert "embedding" in report or "src_embedding" in report
    worst = max(r["max_rel"] for r in report.values())
    assert worst < 1e-5


def test_shared_embedding_is_one_matrix():
    model = Transformer(tiny_config())
    names = [n for n, _ in model.named_parameters()]
    assert "embedding" in names and "src_embedding" not in names
    assert not any(n.startswith("out_proj") for n in names)
    unshared = Transformer(tiny_config(share_embeddings=False))
    names = {n for n, _ in unshared.named_parameters()}
    assert {"src_embedding", "tgt_embedding", "out_proj.weight"} <= names


def test_sinusoids_match_the_paper_formula():
    pe = sinusoids(50, 8, dtype=np.float64)
    pos, i = 7, 2
    assert pe[pos, 2 * i] == pytest.approx(np.sin(pos / 10000 ** (2 * i / 8)))
    assert pe[pos, 2 * i + 1] == pytest.approx(np.cos(pos / 10000 ** (2 * i / 8)))
    cat = sinusoids(50, 8, layout="concat", dtype=np.float64)
    assert cat[pos, i] == pytest.approx(pe[pos, 2 * i])
    assert cat[pos, 4 + i] == pytest.approx(pe[pos, 2 * i + 1])


def test_presets_are_the_papers():
    base, big = preset("base"), preset("big")
    def shape(c):
        return c.n_layers, c.d_model, c.n_heads, c.d_ff, c.dropout
    assert shape(base) == (6, 512, 8, 2048, 0.1)
    assert shape(big) == (6, 1024, 16, 4096, 0.3)
    assert preset("tiny", d_model=64).d_model == 64
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(d_model=10, n_heads=3)


def test_overfits_one_batch():
    model = Transformer(tiny_config(label_smoothing=0.0), seed=0)
    src, tin, tout = toy_batch(1)
    opt = mt.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(150):
        loss, n = model.loss(src, tin, tout)
        (loss * (1.0 / n)).backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else loss.item() / n
    assert first > 2.5 and loss.item() / n < 0.05


def test_dropout_is_seeded_and_off_in_eval():
    cfg = tiny_config(dropout=0.3, attention_dropout=0.1, relu_dropout=0.1)
    src, tin, tout = toy_batch()
    a, b = Transformer(cfg, seed=5), Transformer(cfg, seed=5)
    assert a.loss(src, tin, tout)[0].item() == b.loss(src, tin, tout)[0].item()
    a.eval()
    with no_grad():
        assert a.loss(src, tin, tout)[0].item() == a.loss(src, tin, tout)[0].item()


def test_cached_decoding_equals_full_decoding():
    model = Transformer(tiny_config(), seed=2, dtype=np.float64).eval()
    src, tin, _ = toy_batch(2)
    tin = np.where(tin == 0, 5, tin)
    with no_grad():
        memory, mask = model.encode(src)
        full = model.logits(model.decode(tin, memory, mask)).data
        cache = model.new_cache()
        steps = [model.logits(model.decode(tin[:, t:t + 1], memory, mask, cache=cache,
                                           offset=t)).data
                 for t in range(tin.shape[1])]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-10, atol=1e-12)


def trained_toy_model():
    """A model that has learnt to copy reversed short sequences, so outputs are non-trivial."""
    model = Transformer(tiny_config(label_smoothing=0.0, d_model=32, d_ff=64), seed=4,
                        dtype=np.float64)
    r = np.random.default_rng(0)
    opt = mt.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        L = r.integers(2, 6)
        src = r.integers(4, V, (8, L))
        tgt = np.concatenate([np.full((8, 1), 2), src[:, ::-1], np.full((8, 1), 3)], axis=1)
        loss, n = model.loss(np.concatenate([src, np.full((8, 1), 3)], 1), tgt[:, :-1], tgt[:, 1:])
        (loss * (1.0 / n)).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.fixture(scope="module")
def toy_model():
    return trained_toy_model()


@pytest.mark.parametrize("V, m", [(6000, 8), (8000, 8), (37, 6), (100, 2), (5, 5)])
def test_top_m_finds_the_m_largest_of_each_row(xp, V, m):
    # against a full sort; rows with -inf entries (forbidden tokens) and with the largest
    # values crowded into one group of columns, the case the group pruning must get right
    rng = np.random.default_rng(V + m)
    x = rng.standard_normal((12, V)).astype(np.float32)
    x[0, : V // 2] = -np.inf
    G = -(-V // 32)
    x[1, np.arange(m) * G % V] = 10.0 + np.arange(m)  # all in group 0 when G > m
    x[2] = -np.arange(V, dtype=np.float32)  # best columns first
    x[3, :] = -np.inf  # fewer than m entries above -inf: ties at -inf, all ids in range
    x[3, :: max(1, V // (m - 1))][: m - 1] = 1.0
    got = to_numpy(top_m(xp, xp.asarray(x), m))
    assert got.shape == (12, m)
    again, row_max = top_m(xp, xp.asarray(x), m, with_max=True)
    assert (to_numpy(again) == got).all()
    np.testing.assert_array_equal(to_numpy(row_max), x.max(axis=1, keepdims=True))
    want = np.argsort(-x, axis=1, kind="stable")[:, :m]
    assert ((0 <= got) & (got < V)).all() and all(len(set(row)) == m for row in got.tolist())
    for r in range(12):
        if r == 3:  # only the finite entries are determined
            assert set(np.nonzero(np.isfinite(x[3]))[0]) <= set(got[3].tolist())
            continue
        assert sorted(got[r]) == sorted(want[r]), (r, sorted(got[r]), sorted(want[r]))


def test_beam_one_equals_greedy(toy_model):
    src, _, _ = toy_batch(3, B=5, S=7)
    src[:, -1] = 3
    greedy = greedy_search(toy_model, src, max_len_a=8)
    assert beam_search(toy_model, src, beam=1, max_len_a=8) == greedy


def test_decoding_independent_of_batch_and_padding(toy_model):
    r = np.random.default_rng(7)
    seqs = [list(r.integers(4, V, n)) + [3] for n in (2, 5, 3, 4)]
    from minitransformer.mt.translation import pad_batch
    batch = pad_batch(seqs, 0)
    for search in (lambda s: greedy_search(toy_model, s, max_len_a=6),
                   lambda s: beam_search(toy_model, s, beam=3, max_len_a=6)):
        together = search(batch)
        alone = [search(np.array([s]))[0] for s in seqs]
        extra_pad = search(np.concatenate([batch, np.zeros((4, 3), np.int64)], axis=1))
        assert together == alone == extra_pad


def test_beam_finds_at_least_greedy_score(toy_model):
    src, _, _ = toy_batch(4, B=4, S=6)
    hyps = beam_search(toy_model, src, beam=4, max_len_a=8, return_all=True)
    for h in hyps:
        assert h and all(h[i][0] >= h[i + 1][0] for i in range(len(h) - 1))


def naive_beam_search(model, src_row, beam, alpha, max_len_a):
    """One sentence, no cache, no top-k shortcuts: every step decodes each live prefix in full
    and ranks all beam * V continuations, with beam_search's rules (module docstring)."""
    from minitransformer.engine.softmax import log_softmax
    cfg, k = model.cfg, beam
    lp = lambda n: ((5.0 + n) / 6.0) ** alpha  # noqa: E731
    limit = int((src_row != cfg.pad_id).sum()) + max_len_a
    with no_grad():
        memory, mask = model.encode(src_row[None])
        live, finished, t = [(0.0, [])], [], 0
        while True:
            cands = []
            for score, toks in live:
                tin = np.array([[cfg.bos_id] + toks])
                logp = log_softmax(model.logits(model.decode(tin, memory, mask))).data[0, -1]
                logp = logp.astype(np.float64)
                logp[[cfg.pad_id, cfg.bos_id]] = -np.inf
                cands += [(score + logp[v], toks, v) for v in range(len(logp))]
            top = sorted(cands, key=lambda c: -c[0])[:2 * k]
            t += 1
            finished += [(s / lp(t - 1), toks) for s, toks, v in top[:k]
                         if v == cfg.eos_id and np.isfinite(s)]
            live = [(s, toks + [v]) for s, toks, v in top if v != cfg.eos_id][:k]
            if t >= limit:
                finished += [(s / lp(t), toks) for s, toks in live if np.isfinite(s)]
                break
            if len(finished) >= k:
                break
    return sorted(finished, key=lambda h: -h[0])


@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beam_search_equals_an_exhaustive_uncached_search(toy_model, beam):
    src, _, _ = toy_batch(5, B=4, S=6)
    src[1, 4:] = 0  # one shorter, padded sentence
    got = beam_search(toy_model, src, beam=beam, alpha=0.6, max_len_a=5, return_all=True)
    for row, hyps in zip(src, got):
        want = naive_beam_search(toy_model, row, beam, 0.6, 5)
        assert [h[1] for h in hyps] == [h[1] for h in want]
        np.testing.assert_allclose([h[0] for h in hyps], [h[0] for h in want], rtol=1e-9)


def test_max_length_is_source_plus_a():
    model = Transformer(tiny_config(), seed=0)  # untrained: rarely emits EOS
    src = np.array([[5, 6, 3]])
    for out in (greedy_search(model, src, max_len_a=4)[0],
                beam_search(model, src, beam=2, max_len_a=4)[0]):
        assert len(out) <= 3 + 4
        assert 0 not in out and 2 not in out  # padding and BOS are never produced


def test_token_ids_outside_the_vocabulary_are_refused_with_a_clear_error():
    # checked on the host: on a GPU the embedding lookup would wrap such an id around silently
    model = Transformer(tiny_config(), seed=0)
    src, tgt_in, tgt_out = toy_batch()
    src_bad = src.copy()
    src_bad[1, 2] = V
    for bad_src, bad_in, bad, _case in ((src_bad, tgt_in, V, "source"),
                                        (src, np.where(tgt_in > 0, -1, 0), -1, "target input"),
                                        (src.tolist(), tgt_in.tolist(), None, "lists: fine")):
        if bad is None:
            loss, n = model.loss(bad_src, bad_in, tgt_out)
            assert n == int((tgt_out != 0).sum()) and np.isfinite(float(loss.data))
            continue
        with pytest.raises(ValueError, match=rf"token id {bad} is outside the vocabulary "
                                             rf"\[0, {V}\): .*sentencepiece"):
            model.loss(bad_src, bad_in, tgt_out)
    with pytest.raises(ValueError, match="outside the"):
        greedy_search(model, np.array([[5, V, 3]]))


def test_checkpoint_round_trip(tmp_path):
    cfg = tiny_config()
    model = Transformer(cfg, seed=1)
    opt = mt.optim.Adam(model.parameters(), lr=1e-3)
    src, tin, tout = toy_batch()
    loss, n = model.loss(src, tin, tout)
    loss.backward()
    opt.step()
    path = str(tmp_path / "c.npz")
    ckpt.save_checkpoint(path, model, opt, {"update": 1})
    params, optim, meta = ckpt.load_checkpoint(path)
    with np.load(path, allow_pickle=False) as z:  # plain arrays, no pickle needed
        assert "model/embedding" in z.files
    other = Transformer(cfg, seed=99)
    other.load_state_dict(params)
    for (na, a), (nb, b) in zip(model.named_parameters(), other.named_parameters()):
        assert na == nb and np.array_equal(a.data, b.data)
    opt2 = mt.optim.Adam(other.parameters())
    opt2.load_state_dict({**optim, **meta["optim"]})
    assert opt2.t == 1 and all(np.array_equal(x, y) for x, y in zip(opt.m, opt2.m))
    ckpt.check_compatible(path, meta, cfg)
    with pytest.raises(ckpt.CheckpointError, match="d_model"):
        ckpt.check_compatible(path, meta, tiny_config(d_model=32))
    # for translating, the model's arrays only: the optimizer's are not even read
    read = []
    real_getitem = np.lib.npyio.NpzFile.__getitem__

    def spy(z, key):
        read.append(key)
        return real_getitem(z, key)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np.lib.npyio.NpzFile, "__getitem__", spy)
        params2, optim2, meta2 = ckpt.load_checkpoint(path, optimizer=False)
    assert optim2 == {} and meta2 == meta and params2.keys() == params.keys()
    assert all(np.array_equal(params[k], params2[k]) for k in params)
    assert read and not any(k.startswith("optim/") for k in read)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    model = Transformer(tiny_config(), seed=1)
    path = str(tmp_path / "c.npz")
    ckpt.save_checkpoint(path, model, None, {"update": 1})
    before = open(path, "rb").read()

    def explode(*a, **k):
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(np, "savez", explode)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(path, model, None, {"update": 2})
    assert open(path, "rb").read() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary left behind


def test_bad_checkpoint_gives_clear_error(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ckpt.CheckpointError, match="bad.npz"):
        ckpt.load_checkpoint(str(bad))
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.load_checkpoint(str(tmp_path / "missing.npz"))


def test_average_checkpoints(tmp_path):
    cfg = tiny_config()
    paths = []
    for seed in (1, 2):
        p = str(tmp_path / f"checkpoint_{seed}.npz")
        ckpt.save_checkpoint(p, Transformer(cfg, seed=seed), None, {})
        paths.append(p)
    avg, _ = ckpt.average_checkpoints(paths)
    a, b = (ckpt.load_checkpoint(p)[0] for p in paths)
    np.testing.assert_allclose(avg["embedding"], (a["embedding"] + b["embedding"]) / 2, rtol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"norm": "pre", "positions": "learned"}])
def test_the_encoder_on_real_rows_equals_the_padded_encoder(overrides, monkeypatch):
    # under no_grad in evaluation mode the encoder runs its position-wise layers on the real
    # tokens only (nn/real_rows.py); the real positions must get the padded batch's numbers
    from minitransformer.nn import real_rows
    model = Transformer(tiny_config(**overrides), seed=4, dtype=np.float64)
    model.eval()
    r = np.random.default_rng(8)
    src = r.integers(4, V, (5, 9))
    for i, n in enumerate((9, 2, 5, 1, 7)):
        src[i, n:] = 0
    store = {}
    model.set_attention_store(store)
    with no_grad():
        packed, mask = model.encode(src)
        monkeypatch.setattr(real_rows, "MIN_PADDING", 2.0)  # never worth it: padded layout
        padded, _ = model.encode(src)
    model.set_attention_store(None)
    assert (packed.data[~mask] == 0).all()  # (the real-rows path ran: padding left at 0)
    np.testing.assert_allclose(packed.data[mask], padded.data[mask], rtol=1e-13, atol=1e-13)
    assert [len(store[f"encoder.{i}.self_attn"]) for i in range(2)] == [2, 2]
    for got, want in (store[f"encoder.{i}.self_attn"] for i in range(2)):
        # the attention maps (B, H, S, S) of the real queries
        for s, n in enumerate(mask.sum(axis=1)):
            np.testing.assert_allclose(got[s, :, :n], want[s, :, :n], rtol=1e-12, atol=1e-14)


def test_decoding_from_the_real_rows_gives_the_padded_batch_scores(monkeypatch):
    # start_decoding computes the encoder-decoder keys and values on the real rows too
    from minitransformer.nn import real_rows
    model = Transformer(tiny_config(), seed=5, dtype=np.float64)
    model.eval()
    src = np.random.default_rng(9).integers(4, V, (4, 8))
    src[1, 2:] = src[2, 5:] = src[3, 1:] = 0
    bos = np.full((4, 1), model.cfg.bos_id)

    def first_two_steps():
        state = model.start_decoding(src)
        first = model.next_scores(bos, state, log_probs=True)
        return first, model.next_scores(first.argmax(axis=-1)[:, None], state, log_probs=True)

    packed = first_two_steps()
    monkeypatch.setattr(real_rows, "MIN_PADDING", 2.0)
    for got, want in zip(packed, first_two_steps()):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


def test_the_encoder_keeps_the_padded_layout_when_recording_training_or_barely_padded():
    from minitransformer.nn.real_rows import RealRows
    mask = np.ones((4, 10), bool)
    mask[0, 5:] = False  # an eighth of the batch is padding
    with no_grad():
        assert RealRows.worth_it(mask, training=False) is not None
        assert RealRows.worth_it(mask, training=True) is None  # dropout draws per position
        mask[0, 5:] = True
        assert RealRows.worth_it(mask, training=False) is None  # no padding
    mask[0, 5:] = False
    assert RealRows.worth_it(mask, training=False) is None  # a tape is being recorded
