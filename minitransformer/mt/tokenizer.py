"""A thin wrapper over sentencepiece: one joint subword model for source and target (§5.1).

The paper shares one byte-pair vocabulary of about 37000 tokens between English and German, and
ties the source embedding, target embedding and pre-softmax weights to it (§3.4). Here one
sentencepiece model (unigram by default, BPE on request) is trained over both sides. Its ids are
fixed so that the rest of the code can rely on them:

    pad_id = 0, unk_id = 1, bos_id = 2, eos_id = 3

``encode`` adds no BOS/EOS; ``data.collate`` adds them where the model needs them.
"""
import io
import os
import re

import numpy as np
import sentencepiece as spm

from .data import DataError
from .fileio import atomic_write, atomic_write_text

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
QUIET = 2  # sentencepiece's minloglevel: 0 info, 1 warning, 2 error


# sentencepiece's trainer skips longer lines (its default: 4192 bytes), silently here
MAX_LINE_BYTES = 1 << 20


def train_sentencepiece(input_files, model_prefix, vocab_size, model_type="unigram",
                        character_coverage=1.0, input_sentence_size=None, seed=0):
    """Train one joint model over all ``input_files``; returns the path ``{model_prefix}.model``.

    input_files: UTF-8 text files, one sentence a line (e.g. train.src and train.tgt).
    vocab_size: number of pieces, the 4 special ones included.
    model_type: "unigram" (sentencepiece's default) or "bpe" (the paper's choice, §5.1).
    character_coverage: fraction of characters kept as pieces; 1.0 keeps all (fine for
        alphabetic languages; 0.9995 is usual for Chinese or Japanese).
    input_sentence_size: train on at most this many lines, drawn uniformly at random from
        all files with a NumPy generator seeded by ``seed``; None uses every line.

    Also writes ``{model_prefix}.vocab`` (piece, tab, score; one a line) for reading.
    The same lines and arguments give a byte-identical .model file: lines reach sentencepiece
    through an iterator (its own sampling ignores any seed in 0.2.x), so the model records no
    paths, and the model is written from memory, so it records no model_prefix either.
    """
    input_files = _training_files(input_files)
    model_prefix = os.fspath(model_prefix)
    if os.path.dirname(model_prefix):
        os.makedirs(os.path.dirname(model_prefix), exist_ok=True)

    lines = _TrainingLines(input_files, input_sentence_size, seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=int(vocab_size),
            model_type=model_type, character_coverage=character_coverage,
            pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, minloglevel=QUIET,
            max_sentence_length=MAX_LINE_BYTES)
    except RuntimeError as exc:
        if lines.error is not None:  # raised inside our iterator; sentencepiece wraps it
            raise lines.error from None
        raise _training_error(str(exc), vocab_size, input_files) from None

    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    atomic_write_text(model_prefix + ".vocab", "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n"
                                                       for i in range(sp.get_piece_size())))
    atomic_write(model_prefix + ".model", lambda f: f.write(model.getvalue()))
    return model_prefix + ".model"


def _training_files(input_files):
    """``input_files`` (one path or several) as a list of str paths; DataError for one that
    is not a file."""
    if isinstance(input_files, (str, os.PathLike)):
        input_files = [input_files]
    input_files = [os.fspath(p) for p in input_files]
    for path in input_files:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file to train the sentencepiece model on")
    return input_files


class VocabTooLarge(DataError):
    """More pieces asked for than sentencepiece can make from the text; ``limit``: the most
    it can."""

    def __init__(self, message, limit):
        super().__init__(message)
        self.limit = limit


def _training_error(message, vocab_size, input_files):
    """sentencepiece's RuntimeError ``message`` -> a DataError saying what to change."""
    too_high = re.search(r"Vocabulary size too high \((\d+)\)\. "
                         r"Please set it to a value <= (\d+)", message)
    if too_high:
        return VocabTooLarge(f"--vocab-size {vocab_size} is too large for this training "
                             f"text: sentencepiece can make at most {too_high.group(2)} "
                             f"pieces from it. Use --vocab-size {too_high.group(2)} or less "
                             "(or more text).", int(too_high.group(2)))
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)",
                        message)
    if too_low:
        return DataError(f"--vocab-size {vocab_size} is too small: the text needs "
                         f"{too_low.group(2)} pieces for its characters and the 4 special "
                         f"ids. Use --vocab-size {too_low.group(2)} or more.")
    if "sentences_.empty()" in message:
        return DataError(f"{', '.join(input_files)}: no text to train the sentencepiece "
                         "model on")
    return DataError(f"sentencepiece training on {', '.join(input_files)} failed: {message}")


class _TrainingLines:
    """The non-empty lines of ``paths`` (all, or ``sample_size`` of them drawn with ``seed``).

    An error while reading is kept in ``self.error``: sentencepiece turns exceptions raised in
    its iterator into a bare RuntimeError.
    """

    def __init__(self, paths, sample_size, seed):
        self.paths, self.sample_size, self.seed = paths, sample_size, seed
        self.error = None

    def _read(self):
        """(path, 1-based line number, line) for every line, newline removed."""
        for path in self.paths:
            with open(path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    try:
                        yield path, number, raw.decode("utf-8").strip()
                    except UnicodeDecodeError:
                        raise DataError(f"{path}, line {number}: not valid UTF-8; convert the "
                                        "file to UTF-8, e.g. `iconv -f latin1 -t utf-8`"
                                        ) from None

    def __iter__(self):
        try:
            chosen = None
            if self.sample_size:
                total = sum(1 for _ in self._read())
                if self.sample_size < total:
                    rng = np.random.default_rng(int(self.seed))
                    chosen = set(rng.choice(total, size=int(self.sample_size),
                                            replace=False).tolist())
            for i, (_, _, line) in enumerate(self._read()):
                if line and (chosen is None or i in chosen):
                    yield line
        except DataError as exc:
            self.error = exc
            raise


class Tokenizer:
    """Text <-> token ids with a trained sentencepiece model.

    V = ``vocab_size``; ids are in [0, V). ``encode`` gives lists of ids without BOS/EOS;
    ``decode`` drops pad, BOS and EOS ids and joins the pieces back into text.
    """

    def __init__(self, model_path):
        model_path = os.fspath(model_path)
        if not os.path.isfile(model_path):
            raise DataError(f"{model_path}: no such sentencepiece model; check the path, or train "
                            "one first (train_sentencepiece writes <prefix>.model)")
        self.model_path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.load(model_path)
        except (RuntimeError, OSError) as exc:
            raise DataError(f"{model_path}: not a readable sentencepiece model ({exc}); "
                            "retrain it or point to the right .model file") from None
        self.vocab_size = self.sp.get_piece_size()
        self.pad_id, self.unk_id = self.sp.pad_id(), self.sp.unk_id()
        self.bos_id, self.eos_id = self.sp.bos_id(), self.sp.eos_id()
        if min(self.pad_id, self.bos_id, self.eos_id) < 0:
            raise DataError(f"{model_path}: the model has no pad, bos or eos id "
                            f"(pad={self.pad_id}, bos={self.bos_id}, eos={self.eos_id}); "
                            "train it with minitransformer's train_sentencepiece")
        self._specials = {self.pad_id, self.bos_id, self.eos_id}

    def encode(self, lines):
        """list of N strings -> list of N lists of ids (no BOS/EOS)."""
        return self.sp.encode(list(lines), out_type=int)

    def decode(self, id_lists):
        """list of N id lists -> list of N strings; pad, BOS and EOS ids are ignored."""
        return self.sp.decode([[int(i) for i in ids if int(i) not in self._specials]
                               for ids in id_lists])

    def encode_as_pieces(self, line):
        """One string -> its pieces, e.g. "the dog" -> ["▁the", "▁dog"]."""
        return self.sp.encode(line, out_type=str)

    def id_to_piece(self, i):
        """The piece string of id ``i`` (e.g. for attention-plot labels)."""
        return self.sp.id_to_piece(int(i))

    def __len__(self):
        return self.vocab_size

    def __repr__(self):
        return f"Tokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


class SubwordSampler:
    """Subword regularization (Kudo, 2018): a fresh segmentation of the same sentences per call.

    A unigram model gives a segmentation x = (x_1 .. x_m) of a sentence the probability
    P(x) = prod_i p(x_i). Training on the single most likely segmentation shows the model one
    way to spell each word; sampling a different segmentation every epoch shows it several,
    which regularizes the model the way dropout does (Kudo reports +1 to +2 BLEU on small
    corpora). Here each sentence's ``nbest`` most likely segmentations are found once, and
    every call picks one of them per sentence with probability proportional to P(x)^alpha:
    alpha = 0 picks uniformly among the n best, a large alpha almost always picks the best.

    The randomness comes only from the generator passed in (a Gumbel-max draw per sentence),
    so an epoch's segmentation is reproducible, and every rank of a multi-GPU run draws the
    same one. (sentencepiece's own sampling uses a process-wide generator that can't be
    re-seeded reliably.) Needs a unigram model: BPE has no probabilities to sample from.
    """

    def __init__(self, tokenizer, lines, alpha, nbest=16):
        if alpha < 0:
            raise DataError(f"--subword-alpha must be >= 0, got {alpha}")
        if not 2 <= nbest <= 512:  # sentencepiece's n-best search stops at 512
            raise DataError(f"--subword-nbest must be between 2 and 512, got {nbest}")
        sp = tokenizer.sp
        try:
            cands = sp.nbest_encode(list(lines), nbest_size=int(nbest), out_type=int)
        except RuntimeError as exc:
            if "NBestEncode is not available" not in str(exc):
                raise
            raise DataError(f"{tokenizer.model_path}: subword sampling needs a unigram model "
                            "(--spm-type unigram); set --subword-alpha 0 or train a new run "
                            "with a unigram model") from None
        log_p = np.array([sp.get_score(i) for i in range(tokenizer.vocab_size)])
        log_p[tokenizer.unk_id] = log_p.min() - 10.0  # sentencepiece's own penalty for <unk>
        # All candidates of all sentences in one flat array: candidate c is
        # ids[starts[c]:starts[c + 1]]; sentence j owns candidates first[j] .. first[j + 1] - 1.
        flat = [seg for c in cands for seg in c]
        lengths = np.array([len(seg) for seg in flat], dtype=np.int64)
        self.ids = np.fromiter((i for seg in flat for i in seg), dtype=np.int32,
                               count=int(lengths.sum()))
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        counts = np.array([len(c) for c in cands], dtype=np.int64)
        self.first = np.concatenate([[0], np.cumsum(counts)])
        self.sentence_of = np.repeat(np.arange(len(cands)), counts)
        # log P(x) = sum of the pieces' log-probabilities, as differences of a running sum
        running = np.concatenate([[0.0], np.cumsum(log_p[self.ids])])
        self.logit = alpha * (running[self.starts[1:]] - running[self.starts[:-1]])

    def __len__(self):
        return len(self.first) - 1

    def __call__(self, rng):
        """One segmentation of every sentence -> list of id lists, drawn with ``rng``."""
        key = self.logit + rng.gumbel(size=len(self.logit))
        # the candidate with the largest key in each sentence (Gumbel-max: a draw from
        # softmax(logit) within the sentence); sort by (sentence, -key), take each first
        order = np.lexsort((-key, self.sentence_of))
        chosen = order[self.first[:-1]]
        ids, starts = self.ids, self.starts
        return [ids[starts[c]:starts[c + 1]].tolist() for c in chosen]
