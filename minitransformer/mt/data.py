"""Parallel text in, padded id arrays out: reading, token-budget batching, collation, splitting.

The paper batches "by approximate sequence length", each batch holding about 25000 source and
25000 target tokens (§5.1). ``Batches`` does the same with a budget counted in padded tokens:
pairs are sorted by length so that a batch wastes little padding, cut into batches that fit
``max_tokens``, and the order of the batches is shuffled every epoch.

Shape letters: B sentences in a batch, S source length (EOS included), T target length (BOS or
EOS included).
"""
import hashlib
import os
import stat
import sys

import numpy as np


class DataError(ValueError):
    """Bad input data or flags. The message names the file and line (or the flag) and the fix."""


# ----------------------------------------------------------------------------- reading text

def read_lines(path):
    """All lines of a UTF-8 text file, each stripped of surrounding whitespace.

    Lines end at "\\n" only ("\\r\\n" works: strip() removes the "\\r"); tabs and no-break
    spaces inside a line are kept. A UTF-8 byte-order mark at the start is dropped. ``-``
    reads standard input.
    """
    path = os.fspath(path)
    if path == "-":
        path, data = "<stdin>", _read_stdin()
    else:
        data = _read_file(path)
    text = _decode_utf8(data, path)
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":  # the newline that ends the last line starts no new line
        lines.pop()
    return [line.strip() for line in lines]


def _read_stdin():
    """The bytes of standard input; DataError when it is closed or unreadable."""
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    if stdin is None or getattr(stdin, "closed", False):
        raise DataError("standard input is closed; give the text with --input FILE or "
                        "pipe it in")
    try:
        data = stdin.read()
    except OSError as exc:
        raise DataError(f"<stdin>: cannot be read ({exc.strerror or exc}); give the text "
                        "with --input FILE") from None
    if isinstance(data, str):  # a text stream without .buffer (a test's StringIO)
        data = data.encode("utf-8")
    return data


def _read_file(path):
    """The bytes of the regular file or pipe ``path`` (a shell's ``<(...)`` or /dev/stdin
    piped); DataError naming it when it cannot be read."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file; check the path")
    if not (os.path.isfile(path) or stat.S_ISFIFO(os.stat(path).st_mode)):
        raise DataError(f"{path}: not a regular file or a pipe; give the path of a text file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror})") from None


def _decode_utf8(data, path):
    """``data`` decoded as UTF-8; DataError naming the line of the first invalid byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8 (byte 0x{data[exc.start]:02x}); "
                        f"{_conversion(data)}") from None


def _conversion(data):
    """What to do with a file that is not UTF-8, from its first bytes: a compressed file is
    decompressed, a UTF-16 one (its byte-order mark) converted from UTF-16, and anything
    else converted from its encoding (latin1, a guess that never fails, would turn those two
    into text that looks valid)."""
    if data[:2] == b"\x1f\x8b":
        return "it is gzip-compressed: decompress it first (`gunzip -k FILE`)"
    if data[:6] == b"\xfd7zXZ\x00" or data[:3] == b"BZh" or data[:4] == b"\x28\xb5\x2f\xfd":
        return "it is compressed (xz, bzip2 or zstd): decompress it first"
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "it is UTF-16 (it starts with a UTF-16 byte-order mark): convert it, e.g. " \
               "`iconv -f utf-16 -t utf-8`"
    return "convert the file to UTF-8 from its encoding, e.g. `iconv -f latin1 -t utf-8` " \
           "for Latin-1"


def read_parallel(src_path, tgt_path):
    """Aligned source and target lines -> (src_lines, tgt_lines, stats).

    Line i of one file translates line i of the other. A pair with an empty side is skipped;
    stats = {"pairs": pairs kept, "skipped_empty": pairs skipped}.
    """
    src_all, tgt_all = read_lines(src_path), read_lines(tgt_path)
    if len(src_all) != len(tgt_all):
        raise DataError(f"{os.fspath(src_path)} has {len(src_all)} lines but "
                        f"{os.fspath(tgt_path)} has {len(tgt_all)}; the files must be aligned "
                        "line by line (line i of one translates line i of the other)")
    src_lines, tgt_lines = [], []
    for src, tgt in zip(src_all, tgt_all):
        if src and tgt:
            src_lines.append(src)
            tgt_lines.append(tgt)
    skipped = len(src_all) - len(src_lines)
    if not src_lines:
        raise DataError(f"{os.fspath(src_path)} and {os.fspath(tgt_path)} hold no pair with "
                        f"text on both sides ({len(src_all)} lines, {skipped} with an empty "
                        "side); check the paths")
    return src_lines, tgt_lines, {"pairs": len(src_lines), "skipped_empty": skipped}


def pairs_fingerprint(src_lines, tgt_lines):
    """A short hash of the training pairs (their text, in order): a resumed run checks that it
    reads the pairs it started with, which a count alone does not tell (an edited line)."""
    h = hashlib.sha256("\n".join(src_lines).encode("utf-8"))
    h.update(b"\0")
    h.update("\n".join(tgt_lines).encode("utf-8"))
    return h.hexdigest()[:16]


def overlong_pairs(src_ids, tgt_ids, max_positions):
    """Indices of the pairs a model with ``max_positions`` positions cannot hold whole:
    source + EOS longer than ``max_positions`` (``len(src) + 1 > max_positions``) or target +
    BOS (decoder input; + EOS as its output) longer than it (``len(tgt) + 1 >
    max_positions``). ``src_ids`` / ``tgt_ids``: aligned lists of token-id lists (no BOS /
    EOS). -> sorted list of int, empty when every pair fits (the same test as ``Batches``
    with ``max_len=max_positions``)."""
    if len(src_ids) != len(tgt_ids):
        raise DataError(f"{len(src_ids)} source but {len(tgt_ids)} target sentences")
    return [i for i, (s, t) in enumerate(zip(src_ids, tgt_ids))
            if len(s) + 1 > max_positions or len(t) + 1 > max_positions]


# ----------------------------------------------------------------------------- batching

class Batches:
    """Token-budget batches of (src_ids, tgt_ids) pairs, bucketed by length, resumable.

    A batch of B pairs costs B * S source and B * T target tokens after padding, where
    S = 1 + longest source (EOS) and T = 1 + longest target (BOS or EOS); both must be
    <= ``max_tokens``, except that a single pair over the budget forms a batch of its own.
    Pairs with S or T above ``max_len`` are dropped; ``self.dropped`` counts them.

    Each epoch sorts the pairs by (target length, source length), breaking ties at random, cuts
    the sorted list into batches and shuffles the order of the batches. Target length first:
    the decoder and the output layer, about two thirds of a step's work, run on the target
    side, so that is the side to keep free of padding (on Multi30k: 0.4% target and 12%
    source padding, against 10% and 0.3% the other way round; 3% less work a step). The
    randomness comes from a generator seeded with (seed, epoch), so an epoch's batches are a
    function of the seed and the epoch number. With shuffle=False ties keep input order and
    batches come shortest first.

    ``resegment`` (optional) gives every epoch its own tokenization of the same sentences
    (subword regularization, ``tokenizer.SubwordSampler``): a function of a NumPy generator
    returning new (src_ids, tgt_ids) lists. It is called with a generator seeded with
    (seed, epoch, 1), so this too is a function of the seed and the epoch; lengths, dropped
    pairs and the number of batches may then differ a little from epoch to epoch.
    ``src_ids`` / ``tgt_ids`` are still needed: they fix the pairs and, with ``max_len``,
    report pairs that are too long before training starts.

    Iterating yields batches forever, epoch after epoch, each a list of (src_ids, tgt_ids);
    ``state_dict()`` / ``load_state_dict()`` save and restore the position, so that a resumed
    run yields exactly the batches an uninterrupted one would have.
    """

    def __init__(self, src_ids, tgt_ids, max_tokens, max_len=None, seed=0, shuffle=True,
                 resegment=None):
        if len(src_ids) != len(tgt_ids):
            raise DataError(f"{len(src_ids)} source but {len(tgt_ids)} target sentences")
        if max_tokens < 1:
            raise DataError(f"--max-tokens must be positive, got {max_tokens}")
        if max_len is not None and max_len < 2:
            raise DataError(f"--max-len must be at least 2 (one token and EOS), got {max_len}")
        self.max_tokens, self.max_len = int(max_tokens), max_len
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.resegment = resegment
        self._resegmented = (None, None)  # (epoch, _Layout) of the last epoch resegmented
        self._fixed = self._layout(src_ids, tgt_ids)
        self.src_ids, self.tgt_ids = src_ids, tgt_ids
        self.dropped = self._fixed.dropped

        self.epoch, self.index = 0, 0  # the next batch is epoch_batches(epoch)[index]
        self._cached_epoch, self._cached_batches = None, None

    def _layout(self, src_ids, tgt_ids):
        """Lengths, kept pairs and batch boundaries of one tokenization of the corpus."""
        src_len = np.array([len(s) + 1 for s in src_ids], dtype=np.int64)  # + EOS
        tgt_len = np.array([len(t) + 1 for t in tgt_ids], dtype=np.int64)  # + BOS / EOS
        keep = np.ones(len(src_ids), dtype=bool)
        if self.max_len is not None:
            keep = (src_len <= self.max_len) & (tgt_len <= self.max_len)
        kept = np.flatnonzero(keep)  # indices into src_ids / tgt_ids
        if len(kept) == 0:
            raise DataError(f"all {len(src_ids)} pairs are longer than --max-len {self.max_len} "
                            "tokens (EOS included); raise --max-len")
        src_len, tgt_len = src_len[kept], tgt_len[kept]
        # The batch boundaries depend only on the sequence of (T, S) lengths in sorted order,
        # which is the same whatever order the ties take, so they are cut once per tokenization.
        order = np.lexsort((src_len, tgt_len))
        bounds = self._cut(src_len[order].tolist(), tgt_len[order].tolist())
        return _Layout(src_ids, tgt_ids, kept, src_len, tgt_len, bounds,
                       len(src_ids) - len(kept))

    def _epoch_layout(self, epoch):
        if self.resegment is None:
            return self._fixed
        epoch = int(epoch)
        if self._resegmented[0] != epoch:  # only one epoch's ids are kept
            src_ids, tgt_ids = self.resegment(np.random.default_rng([self.seed, epoch, 1]))
            if len(src_ids) != len(self.src_ids) or len(tgt_ids) != len(self.tgt_ids):
                raise DataError(f"resegment returned {len(src_ids)} / {len(tgt_ids)} sentences "
                                f"for a corpus of {len(self.src_ids)} pairs")
            self._resegmented = (epoch, self._layout(src_ids, tgt_ids))
        return self._resegmented[1]

    def _cut(self, src_len, tgt_len):
        """[(start, end)] slices of the sorted pairs, each batch as large as the budget allows."""
        bounds, start, max_s, max_t = [], 0, 0, 0
        for i, (s, t) in enumerate(zip(src_len, tgt_len)):
            max_s, max_t = max(max_s, s), max(max_t, t)
            n = i - start + 1
            if n > 1 and (n * max_s > self.max_tokens or n * max_t > self.max_tokens):
                bounds.append((start, i))
                start, max_s, max_t = i, s, t
        bounds.append((start, len(src_len)))
        return bounds

    def __len__(self):
        """Batches per epoch (of the current epoch; the same for every epoch unless
        resegmenting)."""
        return len(self._epoch_layout(self.epoch).bounds)

    def epoch_batches(self, epoch):
        """The batches of epoch ``epoch`` in the order they are yielded, as lists of indices
        into the pairs (``pairs(indices, epoch)`` gives the pairs)."""
        lay = self._epoch_layout(epoch)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, int(epoch)])
            ties = rng.random(len(lay.kept))
        else:
            ties = np.arange(len(lay.kept))
        order = lay.kept[np.lexsort((ties, lay.src_len, lay.tgt_len))]
        batches = [order[a:b].tolist() for a, b in lay.bounds]
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return batches

    def pairs(self, indices, epoch=0):
        """Indices -> the list of (src_ids, tgt_ids) pairs they name (as tokenized in
        ``epoch``, which matters only when resegmenting)."""
        lay = self._epoch_layout(epoch)
        return [(lay.src_ids[i], lay.tgt_ids[i]) for i in indices]

    def __iter__(self):
        return self

    def __next__(self):
        """The next batch as a list of (src_ids, tgt_ids); never stops (epochs roll over)."""
        epoch = self.epoch
        if self._cached_epoch != epoch:
            self._cached_epoch, self._cached_batches = epoch, self.epoch_batches(epoch)
        batch = self._cached_batches[self.index]
        self.index += 1
        if self.index == len(self._cached_batches):  # roll over now: "epoch" counts finished ones
            self.epoch, self.index = self.epoch + 1, 0
        return self.pairs(batch, epoch)

    def state_dict(self):
        """The position: the next batch is ``epoch_batches(epoch)[index]``; ``epoch`` is also
        the number of epochs finished."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state):
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < len(self._epoch_layout(epoch).bounds):
            raise DataError(f"batch position {state} does not fit the batches of epoch {epoch}; "
                            "resume with the same data, --max-tokens, --max-len and "
                            "--subword-alpha")
        self.epoch, self.index = epoch, index


class _Layout:
    """One tokenization of the corpus as ``Batches`` sees it."""
    __slots__ = ("src_ids", "tgt_ids", "kept", "src_len", "tgt_len", "bounds", "dropped")

    def __init__(self, src_ids, tgt_ids, kept, src_len, tgt_len, bounds, dropped):
        self.src_ids, self.tgt_ids, self.kept = src_ids, tgt_ids, kept
        self.src_len, self.tgt_len, self.bounds, self.dropped = src_len, tgt_len, bounds, dropped


def collate(pairs, pad_id, bos_id, eos_id):
    """A list of B (src_ids, tgt_ids) pairs -> padded int64 arrays for one training step.

    src     (B, S): source ids + EOS, then pad_id          S = 1 + longest source
    tgt_in  (B, T): BOS + target ids, then pad_id          T = 1 + longest target
    tgt_out (B, T): target ids + EOS, then pad_id          (tgt_in shifted left by one)
    n_src_tokens, n_tgt_tokens: non-pad entries of src and of tgt_out (ints).

    The decoder reads tgt_in and is trained to predict tgt_out at every position.
    """
    if not pairs:
        raise ValueError("collate needs at least one pair")
    B = len(pairs)
    S = 1 + max(len(src) for src, _ in pairs)
    T = 1 + max(len(tgt) for _, tgt in pairs)
    src = np.full((B, S), pad_id, dtype=np.int64)
    tgt_in = np.full((B, T), pad_id, dtype=np.int64)
    tgt_out = np.full((B, T), pad_id, dtype=np.int64)
    for b, (s, t) in enumerate(pairs):
        src[b, :len(s)] = s
        src[b, len(s)] = eos_id
        tgt_in[b, 0] = bos_id
        tgt_in[b, 1:len(t) + 1] = t
        tgt_out[b, :len(t)] = t
        tgt_out[b, len(t)] = eos_id
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out,
            "n_src_tokens": sum(len(s) + 1 for s, _ in pairs),
            "n_tgt_tokens": sum(len(t) + 1 for _, t in pairs)}


def split_batch(pairs, n_parts):
    """Split a batch into ``n_parts`` sub-batches with about equal target tokens (len + 1 each).

    Greedy: pairs in order of decreasing target length each go to the part with the fewest
    tokens so far (the lowest-numbered on ties). Every part gets a pair when there are at least
    n_parts pairs, since each pair costs at least one token. Within a part, pairs keep their
    order in ``pairs``. Returns a list of n_parts lists of pairs (for data-parallel ranks).
    """
    if n_parts < 1:
        raise ValueError(f"n_parts must be >= 1, got {n_parts}")
    cost = [len(tgt) + 1 for _, tgt in pairs]
    loads, parts = [0] * n_parts, [[] for _ in range(n_parts)]
    for i in sorted(range(len(pairs)), key=lambda i: (-cost[i], i)):
        k = min(range(n_parts), key=lambda k: (loads[k], k))
        parts[k].append(i)
        loads[k] += cost[i]
    return [[pairs[i] for i in sorted(part)] for part in parts]
