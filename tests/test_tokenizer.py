"""The sentencepiece wrapper: fixed special ids, exact round trips, deterministic training."""
import re

import numpy as np
import pytest
import sentencepiece as spm

from minitransformer.mt import synthetic
from minitransformer.mt.data import DataError
from minitransformer.mt.tokenizer import SubwordSampler, Tokenizer, train_sentencepiece


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("corpus")
    return synthetic.write_corpus(directory, seed=3, n_train=2000, n_valid=100, n_test=100)


@pytest.fixture(scope="module")
def tok(corpus, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "joint"
    return Tokenizer(train_sentencepiece(list(corpus["train"]), prefix, vocab_size=200))


def lines_of(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def test_special_ids(tok):
    assert (tok.pad_id, tok.unk_id, tok.bos_id, tok.eos_id) == (0, 1, 2, 3)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert tok.vocab_size == len(tok) == 200


def test_round_trip_on_unseen_sentences(tok, corpus):
    for path in corpus["test"]:  # both languages share the one model
        lines = lines_of(path)
        ids = tok.encode(lines)
        assert all(ids) and not {0, 1, 2, 3} & {i for sentence in ids for i in sentence}
        assert tok.decode(ids) == lines


def test_decode_ignores_pad_bos_eos(tok):
    line = "the old man with a red ball sees these small cats"
    ids = tok.encode([line])[0]
    padded = [tok.bos_id] + ids + [tok.eos_id, tok.pad_id, tok.pad_id]
    assert tok.decode([padded, ids]) == [line, line]


def test_pieces(tok):
    line = "una kulat rufa kum ko gorum seno"
    pieces = tok.encode_as_pieces(line)
    assert "".join(pieces) == "▁" + line.replace(" ", "▁")
    assert pieces == [tok.id_to_piece(i) for i in tok.encode([line])[0]]


def test_training_is_deterministic(corpus, tmp_path):
    """Same text and options -> identical bytes, wherever the model is written."""
    for options in ({}, {"input_sentence_size": 1500, "seed": 4}):
        a = train_sentencepiece(list(corpus["train"]), tmp_path / "a" / "m", 150, **options)
        b = train_sentencepiece(list(corpus["train"]), tmp_path / "b" / "other", 150, **options)
        with open(a, "rb") as fa, open(b, "rb") as fb:
            assert fa.read() == fb.read()


def test_bpe_of_1000_keeps_synthetic_words_whole(tmp_path):
    """The recommended model for the synthetic language: one piece per word."""
    paths = synthetic.write_corpus(tmp_path / "corpus")
    tok = Tokenizer(train_sentencepiece(list(paths["train"]), tmp_path / "bpe", 1000,
                                        model_type="bpe"))
    lines = lines_of(paths["valid"][0]) + lines_of(paths["valid"][1])
    n_words = sum(len(line.split()) for line in lines)
    assert sum(map(len, tok.encode(lines))) <= 1.01 * n_words


def test_vocab_too_large_names_the_flag_and_the_maximum(corpus, tmp_path):
    with pytest.raises(ValueError) as info:
        train_sentencepiece(list(corpus["train"]), tmp_path / "m", 50000)
    message = str(info.value)
    assert "--vocab-size 50000" in message
    maximum = int(re.search(r"at most (\d+)", message).group(1))
    assert 100 < maximum < 50000 and f"--vocab-size {maximum} or less" in message
    with pytest.raises(ValueError, match="--vocab-size 10 is too small"):
        train_sentencepiece(list(corpus["train"]), tmp_path / "m", 10)


def test_training_input_errors(tmp_path):
    with pytest.raises(DataError, match="nothere.txt: no such file"):
        train_sentencepiece([tmp_path / "nothere.txt"], tmp_path / "m", 100)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nna\xefve\n")
    with pytest.raises(DataError, match="bad.txt, line 2: not valid UTF-8"):
        train_sentencepiece([bad], tmp_path / "m", 100)


def test_loading_errors_name_the_file(tmp_path, corpus):
    with pytest.raises(DataError, match="missing.model: no such sentencepiece model"):
        Tokenizer(tmp_path / "missing.model")
    corrupt = tmp_path / "corrupt.model"
    corrupt.write_bytes(b"not a model")
    with pytest.raises(DataError, match="corrupt.model: not a readable sentencepiece model"):
        Tokenizer(corrupt)
    # a plain sentencepiece model has no pad id (-1): refused with the reason
    spm.SentencePieceTrainer.train(input=corpus["train"][0], model_prefix=str(tmp_path / "plain"),
                                   vocab_size=100, minloglevel=2)
    with pytest.raises(DataError, match="no pad, bos or eos id"):
        Tokenizer(tmp_path / "plain.model")


# ----------------------------------------------------------------------------- subword sampling

def nbest_with_probabilities(tok, line, nbest, alpha):
    """The n best segmentations of ``line`` and P(x)^alpha normalised, from sentencepiece
    directly (the sampler's flat arrays are not used)."""
    segs = tok.sp.nbest_encode(line, nbest_size=nbest, out_type=int)
    log_p = np.array([sum(tok.sp.get_score(i) for i in seg) for seg in segs])
    w = np.exp(alpha * (log_p - log_p.max()))
    return [tuple(seg) for seg in segs], w / w.sum()


def test_sampled_segmentations_spell_the_sentence_and_vary(tok, corpus):
    lines = lines_of(corpus["valid"][1])[:60]
    sampler = SubwordSampler(tok, lines, alpha=0.3, nbest=8)
    assert len(sampler) == len(lines)
    first = sampler(np.random.default_rng(0))
    assert sampler(np.random.default_rng(0)) == first  # the generator decides everything
    second = sampler(np.random.default_rng(1))
    assert first != second
    for line, a, b in zip(lines, first, second):
        assert tok.decode([a]) == [line] and tok.decode([b]) == [line]
        allowed = set(nbest_with_probabilities(tok, line, 8, 0.3)[0])
        assert tuple(a) in allowed and tuple(b) in allowed
    assert sum(a != v for a, v in zip(first, tok.encode(lines))) > len(lines) // 4


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_segmentations_are_drawn_with_probability_p_to_the_alpha(tok, corpus, alpha):
    """20000 draws for one sentence against P(x)^alpha / Z over its 6 best segmentations."""
    line = lines_of(corpus["valid"][1])[0]
    segs, expected = nbest_with_probabilities(tok, line, 6, alpha)
    assert len(segs) == 6
    sampler = SubwordSampler(tok, [line] * 20000, alpha=alpha, nbest=6)
    drawn = sampler(np.random.default_rng(3))
    counts = np.array([sum(tuple(d) == seg for d in drawn) for seg in segs])
    assert counts.sum() == 20000
    assert np.abs(counts / 20000 - expected).max() < 0.015, (counts / 20000, expected)


def test_a_large_alpha_gives_the_best_segmentation(tok, corpus):
    lines = lines_of(corpus["valid"][0])[:40]
    sampler = SubwordSampler(tok, lines, alpha=200.0, nbest=4)
    assert sampler(np.random.default_rng(5)) == tok.encode(lines)


def test_subword_sampling_errors(tok, corpus, tmp_path):
    with pytest.raises(DataError, match="--subword-alpha"):
        SubwordSampler(tok, ["a"], alpha=-1)
    for nbest in (1, 513):
        with pytest.raises(DataError, match="--subword-nbest must be between 2 and 512"):
            SubwordSampler(tok, ["a"], alpha=0.5, nbest=nbest)
    bpe = Tokenizer(train_sentencepiece(list(corpus["train"]), tmp_path / "bpe", 150,
                                        model_type="bpe"))
    with pytest.raises(DataError, match=r"bpe.model.*--spm-type unigram"):
        SubwordSampler(bpe, lines_of(corpus["valid"][1])[:2], alpha=0.5)


def test_long_lines_are_used_to_train_the_vocabulary(tmp_path):
    # sentencepiece's trainer skipped lines over 4192 bytes without a word: five such lines
    # alone were "no text to train on"
    from minitransformer.mt.tokenizer import Tokenizer, train_sentencepiece
    text = tmp_path / "long.txt"
    text.write_text(("word " * 1400 + "\n") * 5, encoding="utf-8")
    tok = Tokenizer(train_sentencepiece([str(text)], str(tmp_path / "spm"), 10))
    assert tok.sp.unk_id() not in tok.encode(["word word"])[0]


@pytest.mark.parametrize("head,advice", [
    (b"\x1f\x8b\x08\x00", "it is gzip-compressed: decompress it first (`gunzip -k FILE`)"),
    (b"\xfd7zXZ\x00", "it is compressed (xz, bzip2 or zstd)"),
    ("Ein Mann.\n".encode("utf-16"), "it is UTF-16 (it starts with a UTF-16 byte-order mark): "
                                     "convert it, e.g. `iconv -f utf-16 -t utf-8`"),
    ("Caf\xe9\n".encode("latin1"), "convert the file to UTF-8 from its encoding, e.g. "
                                   "`iconv -f latin1 -t utf-8` for Latin-1"),
])
def test_a_file_that_is_not_utf8_gets_advice_for_what_it_is(tmp_path, head, advice):
    """A compressed or UTF-16 file is told to be decompressed or converted from UTF-16 (the
    advice was always iconv -f latin1, which turns them into valid-looking garbage)."""
    from minitransformer.mt.data import read_lines
    path = tmp_path / "f.txt"
    path.write_bytes(head + b"\xff\xfe rest\n")
    with pytest.raises(DataError) as err:
        read_lines(str(path))
    assert advice in str(err.value) and "line 1: not valid UTF-8" in str(err.value)
