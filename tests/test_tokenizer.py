"""The sentencepiece wrapper: fixed special ids, exact round trips, deterministic training."""
import re

import pytest
import sentencepiece as spm

from minitransformer.mt import synthetic
from minitransformer.mt.data import DataError
from minitransformer.mt.tokenizer import Tokenizer, train_sentencepiece


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
