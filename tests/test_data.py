"""Reading parallel text, token-budget batching with exact resume, collation, batch splitting."""
import numpy as np
import pytest

from minitransformer.mt.data import (Batches, DataError, collate, read_lines, read_parallel,
                                     split_batch)

PAD, BOS, EOS = 0, 2, 3


def write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


# ----------------------------------------------------------------------------- read_parallel

def test_read_parallel_strips_skips_empty_and_counts(tmp_path):
    src = write(tmp_path / "a.src", "one  \n\n  three\n   \nfive\n")
    tgt = write(tmp_path / "a.tgt", "eins\nzwei\n\ndrei\nfünf\n")
    src_lines, tgt_lines, stats = read_parallel(src, tgt)
    assert src_lines == ["one", "five"]
    assert tgt_lines == ["eins", "fünf"]
    assert stats == {"pairs": 2, "skipped_empty": 3}


def test_read_parallel_crlf_and_missing_final_newline(tmp_path):
    src = write(tmp_path / "a.src", "a b\r\nc d\r\ne")
    tgt = write(tmp_path / "a.tgt", "x\r\ny\r\nz\r\n")
    src_lines, tgt_lines, stats = read_parallel(src, tgt)
    assert src_lines == ["a b", "c d", "e"]
    assert tgt_lines == ["x", "y", "z"]
    assert stats == {"pairs": 3, "skipped_empty": 0}


def test_read_lines_keeps_inner_tab_and_no_break_space_drops_bom(tmp_path):
    path = write(tmp_path / "f.txt", "\ufeffa\u00a0b \nc\td\t\n")
    assert read_lines(path) == ["a\u00a0b", "c\td"]


def test_missing_file_names_the_path(tmp_path):
    src = write(tmp_path / "a.src", "x\n")
    missing = tmp_path / "nothere.tgt"
    with pytest.raises(DataError, match="nothere.tgt: no such file"):
        read_parallel(src, missing)
    with pytest.raises(DataError, match="nothere.tgt: no such file"):
        read_parallel(missing, src)
    with pytest.raises(DataError, match="not a regular file"):
        read_parallel(tmp_path, src)


def test_line_count_mismatch_states_both_counts_and_paths(tmp_path):
    src = write(tmp_path / "train.en", "a\nb\nc\n")
    tgt = write(tmp_path / "train.de", "x\ny\n")
    with pytest.raises(DataError) as info:
        read_parallel(src, tgt)
    message = str(info.value)
    assert "train.en has 3 lines" in message and "train.de has 2" in message


def test_non_utf8_names_file_and_line(tmp_path):
    src = write(tmp_path / "a.src", "ok\nfine\nstill fine\n")
    tgt = write(tmp_path / "bad.tgt", b"ok\nfine\ncaf\xe9 latin-1\n")
    with pytest.raises(DataError) as info:
        read_parallel(src, tgt)
    message = str(info.value)
    assert "bad.tgt, line 3" in message and "UTF-8" in message


def test_empty_corpus_is_an_error(tmp_path):
    src = write(tmp_path / "a.src", "\nx\n\n")
    tgt = write(tmp_path / "a.tgt", "y\n\n\n")
    with pytest.raises(DataError, match="no pair with text on both sides"):
        read_parallel(src, tgt)
    empty_src, empty_tgt = write(tmp_path / "e.src", ""), write(tmp_path / "e.tgt", "")
    with pytest.raises(DataError, match="no pair"):
        read_parallel(empty_src, empty_tgt)


def test_data_error_is_a_value_error():
    assert issubclass(DataError, ValueError)


# ----------------------------------------------------------------------------- Batches

def random_pairs(n, seed=0, low=1, high=30):
    rng = np.random.default_rng(seed)
    src = [rng.integers(4, 100, rng.integers(low, high)).tolist() for _ in range(n)]
    tgt = [rng.integers(4, 100, rng.integers(low, high)).tolist() for _ in range(n)]
    return src, tgt


def test_batches_respect_the_token_budget():
    src, tgt = random_pairs(500)
    src.append(list(range(4, 84)))  # 81 tokens with EOS: over the budget on its own
    tgt.append([5])
    batches = Batches(src, tgt, max_tokens=64, seed=1)
    seen_long = False
    for indices in batches.epoch_batches(0):
        b = collate(batches.pairs(indices), PAD, BOS, EOS)
        B, S = b["src"].shape
        T = b["tgt_in"].shape[1]
        assert S == 1 + max(len(src[i]) for i in indices)
        if B > 1:
            assert B * S <= 64 and B * T <= 64, (B, S, T)
        seen_long |= indices == [len(src) - 1]
    assert seen_long


def test_batches_fill_the_budget():
    """A batch closes only when the next pair would break the budget (in sorted order)."""
    src, tgt = random_pairs(400, seed=3)
    batches = Batches(src, tgt, max_tokens=100, shuffle=False)
    plan = batches.epoch_batches(0)
    for this, following in zip(plan, plan[1:]):
        grown = this + following[:1]
        S = 1 + max(len(src[i]) for i in grown)
        T = 1 + max(len(tgt[i]) for i in grown)
        assert len(grown) * S > 100 or len(grown) * T > 100


def test_every_kept_pair_once_per_epoch_and_dropped_count():
    src, tgt = random_pairs(300, seed=2)
    max_len = 20
    too_long = sum(len(s) + 1 > max_len or len(t) + 1 > max_len for s, t in zip(src, tgt))
    assert too_long > 0
    batches = Batches(src, tgt, max_tokens=80, max_len=max_len, seed=7)
    assert batches.dropped == too_long
    kept = sorted(i for i in range(len(src))
                  if len(src[i]) + 1 <= max_len and len(tgt[i]) + 1 <= max_len)
    for epoch in range(3):
        flat = [i for batch in batches.epoch_batches(epoch) for i in batch]
        assert sorted(flat) == kept
    # iterating: one epoch of batches covers every kept pair once, as (src, tgt) pairs
    drawn = [pair for _ in range(len(batches)) for pair in next(batches)]
    assert sorted(map(str, drawn)) == sorted(str((src[i], tgt[i])) for i in kept)
    assert batches.state_dict() == {"epoch": 1, "index": 0}


def test_all_pairs_too_long_is_an_error():
    with pytest.raises(DataError, match="--max-len 3"):
        Batches([[5, 6, 7]], [[5]], max_tokens=100, max_len=3)


def test_batches_are_length_buckets():
    """Sorted by target length (the costlier side), then source length."""
    src, tgt = random_pairs(400, seed=4)
    batches = Batches(src, tgt, max_tokens=200, shuffle=False)
    flat = [(len(tgt[i]), len(src[i])) for b in batches.epoch_batches(0) for i in b]
    assert flat == sorted(flat)
    # with shuffling, each batch still holds one target-length bucket
    shuffled = Batches(src, tgt, max_tokens=200, seed=0)
    spans = [max(len(tgt[i]) for i in b) - min(len(tgt[i]) for i in b)
             for b in shuffled.epoch_batches(0)]
    assert max(spans) <= 2
    firsts = [len(tgt[b[0]]) for b in shuffled.epoch_batches(0)]
    assert firsts != sorted(firsts)  # the order of the batches is shuffled


def test_ties_are_broken_at_random_each_epoch():
    """Pairs of equal lengths meet different partners in different epochs."""
    src, tgt = random_pairs(300, seed=9, low=1, high=3)
    batches = Batches(src, tgt, max_tokens=24, seed=0)
    as_sets = [{frozenset(b) for b in batches.epoch_batches(epoch)} for epoch in (0, 1)]
    assert as_sets[0] != as_sets[1]
    assert len(batches.epoch_batches(0)) == len(batches.epoch_batches(1)) == len(batches)


def test_batches_are_deterministic_and_vary_by_epoch_and_seed():
    src, tgt = random_pairs(300, seed=5)
    a = Batches(src, tgt, max_tokens=90, seed=11)
    b = Batches(src, tgt, max_tokens=90, seed=11)
    c = Batches(src, tgt, max_tokens=90, seed=12)
    assert a.epoch_batches(0) == b.epoch_batches(0)
    assert a.epoch_batches(5) == b.epoch_batches(5)
    assert a.epoch_batches(0) != a.epoch_batches(1)
    assert a.epoch_batches(0) != c.epoch_batches(0)
    assert [next(a) for _ in range(50)] == [next(b) for _ in range(50)]


@pytest.mark.parametrize("steps", [0, 3, "last-but-two", "epoch", "epoch+4"])
def test_resume_yields_exactly_the_uninterrupted_batches(steps):
    src, tgt = random_pairs(200, seed=6)
    make = lambda: Batches(src, tgt, max_tokens=70, max_len=25, seed=3)  # noqa: E731
    n = len(make())
    steps = {"last-but-two": n - 2, "epoch": n, "epoch+4": n + 4}.get(steps, steps)
    uninterrupted = make()
    expected = [next(uninterrupted) for _ in range(steps + 2 * n)][steps:]

    first = make()
    for _ in range(steps):
        next(first)
    state = dict(first.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(2 * n)] == expected


def toy_resegment(src, tgt):
    """A stand-in for SubwordSampler: each call splits a random half of the tokens in two
    (id t -> t, t + 1000), so lengths, and with them the batches, change every epoch."""
    def split(ids, rng):
        out = []
        for seq in ids:
            cut = rng.random(len(seq)) < 0.5
            out.append([x for t, c in zip(seq, cut) for x in ((t, t + 1000) if c else (t,))])
        return out

    calls = []

    def resegment(rng):
        calls.append(1)
        return split(src, rng), split(tgt, rng)
    return resegment, calls


def test_resegmenting_gives_each_epoch_its_own_tokens_and_batches():
    src, tgt = random_pairs(300, seed=8)
    resegment, calls = toy_resegment(src, tgt)
    batches = Batches(src, tgt, max_tokens=90, max_len=40, seed=2, resegment=resegment)
    reference = toy_resegment(src, tgt)[0]  # the same function, called independently
    drawn = []
    for epoch in range(3):
        n = len(batches)
        assert batches.state_dict() == {"epoch": epoch, "index": 0}
        pairs = [pair for _ in range(n) for pair in next(batches)]
        drawn.append(pairs)
        expected_src, expected_tgt = reference(np.random.default_rng([2, epoch, 1]))
        kept = [s for s, t in zip(expected_src, expected_tgt) if len(s) < 40 and len(t) < 40]
        assert sorted(map(str, (s for s, _ in pairs))) == sorted(map(str, kept))
        for indices in batches.epoch_batches(epoch):
            b = collate(batches.pairs(indices, epoch), PAD, BOS, EOS)
            if len(indices) > 1:
                assert b["src"].size <= 90 and b["tgt_in"].size <= 90
    sources = [sorted(map(str, (s for s, _ in pairs))) for pairs in drawn]
    assert sources[0] != sources[1] != sources[2]  # other tokens, not just another order
    assert len(calls) <= 4  # one segmentation per epoch, not one per batch


@pytest.mark.parametrize("steps", [0, 5, "epoch-1", "epoch+3"])
def test_resegmented_batches_resume_exactly(steps):
    src, tgt = random_pairs(200, seed=6)

    def make():
        return Batches(src, tgt, max_tokens=70, max_len=30, seed=3,
                       resegment=toy_resegment(src, tgt)[0])
    n = len(make())
    steps = {"epoch-1": n - 1, "epoch+3": n + 3}.get(steps, steps)
    uninterrupted = make()
    expected = [next(uninterrupted) for _ in range(steps + 3 * n)][steps:]
    first = make()
    for _ in range(steps):
        next(first)
    resumed = make()
    resumed.load_state_dict(dict(first.state_dict()))
    assert [next(resumed) for _ in range(3 * n)] == expected


def test_a_resegmented_position_is_checked_against_its_own_epoch():
    src, tgt = random_pairs(300, seed=10)
    batches = Batches(src, tgt, max_tokens=60, seed=4, resegment=toy_resegment(src, tgt)[0])
    counts = {e: len(batches.epoch_batches(e)) for e in range(6)}
    small = min(counts, key=counts.get)
    assert counts[small] < max(counts.values())  # lengths and batch counts vary by epoch
    batches.load_state_dict({"epoch": small, "index": counts[small] - 1})
    assert len(batches) == counts[small]
    with pytest.raises(DataError, match=f"epoch {small}"):
        batches.load_state_dict({"epoch": small, "index": counts[small]})


def test_load_state_dict_rejects_a_position_that_does_not_fit():
    src, tgt = random_pairs(50)
    batches = Batches(src, tgt, max_tokens=60)
    with pytest.raises(DataError, match="--max-tokens"):
        batches.load_state_dict({"epoch": 0, "index": len(batches) + 5})


def test_bad_flags_are_data_errors():
    with pytest.raises(DataError, match="--max-tokens"):
        Batches([[5]], [[6]], max_tokens=0)
    with pytest.raises(DataError, match="--max-len"):
        Batches([[5]], [[6]], max_tokens=10, max_len=1)


# ----------------------------------------------------------------------------- collate

def test_collate_layout():
    pairs = [([10, 11, 12], [20, 21]), ([13], [22, 23, 24, 25])]
    b = collate(pairs, PAD, BOS, EOS)
    np.testing.assert_array_equal(b["src"], [[10, 11, 12, EOS], [13, EOS, PAD, PAD]])
    np.testing.assert_array_equal(b["tgt_in"], [[BOS, 20, 21, PAD, PAD], [BOS, 22, 23, 24, 25]])
    np.testing.assert_array_equal(b["tgt_out"], [[20, 21, EOS, PAD, PAD], [22, 23, 24, 25, EOS]])
    assert b["src"].dtype == np.int64 and b["tgt_in"].shape == b["tgt_out"].shape == (2, 5)
    assert b["n_src_tokens"] == 6 and b["n_tgt_tokens"] == 8
    assert b["n_tgt_tokens"] == int((b["tgt_out"] != PAD).sum())
    # the decoder input is the output shifted right by one, BOS in front
    np.testing.assert_array_equal(b["tgt_in"][:, 1:][b["tgt_out"][:, :-1] != EOS],
                                  b["tgt_out"][:, :-1][b["tgt_out"][:, :-1] != EOS])


# ----------------------------------------------------------------------------- split_batch

def test_split_batch_balances_target_tokens():
    src, tgt = random_pairs(37, seed=8)
    pairs = list(zip(src, tgt))
    parts = split_batch(pairs, 4)
    assert len(parts) == 4 and all(parts)
    assert sorted(map(str, (p for part in parts for p in part))) == sorted(map(str, pairs))
    loads = [sum(len(t) + 1 for _, t in part) for part in parts]
    assert max(loads) - min(loads) <= max(len(t) + 1 for t in tgt)
    for part in parts:  # input order kept within a part
        positions = [pairs.index(p) for p in part]
        assert positions == sorted(positions)
    assert split_batch(pairs, 4) == parts


def test_split_batch_small_cases():
    pairs = [([1], [5, 6, 7]), ([2], [5]), ([3], [5, 6])]
    assert split_batch(pairs, 1) == [pairs]
    assert split_batch(pairs, 3) == [[pairs[0]], [pairs[2]], [pairs[1]]]
    parts = split_batch(pairs, 5)
    assert sum(map(len, parts)) == 3 and sum(1 for p in parts if not p) == 2
    with pytest.raises(ValueError):
        split_batch(pairs, 0)
