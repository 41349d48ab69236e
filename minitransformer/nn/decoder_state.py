"""What incremental decoding carries from one step to the next (the search's view of the model).

The rows being decoded come in groups: ``group`` consecutive rows per sentence (its beams in a
beam search, one row in greedy search), so row r belongs to sentence r // group. Per decoder
layer the state keeps
    self    a SelfCache: the self-attention keys/values of the tokens fed so far, (R, H, t, K),
            in buffers allocated ahead and filled in place (no copy of the history per step)
    cross   a CrossCache: the encoder-decoder keys/values, (N, H, S, K) for the N sentences,
            computed from the encoder output once per sentence, not once per beam
and, per sentence, ``src_bias`` (N, 1, 1, S): the additive key mask of the source (0 for a
token, -inf for padding), built once. ``offset`` is the position of the next token fed.
A search changes which rows there are only through ``keep_sentences`` (and ``reorder_beams``),
so it never touches arrays or cache entries itself.
"""
import numpy as np

from .. import backend


class SelfCache:
    """The self-attention keys and values of one decoder layer, for ``rows`` rows and the
    ``length`` positions fed so far: views (rows, H, length, K) of buffers with room for
    ``capacity`` positions. The buffers are allocated at the first step and doubled if ever
    outgrown; rows that leave are compacted in place, so no step copies the history it
    appends to. The first capacity is the search's maximum length (else 64), but at most
    what keeps a buffer within BUFFER_BYTES: a larger block would come from fresh pages of
    the kernel each batch (see _malloc.py), and writing into them costs more than the rare
    doubling (most outputs are far shorter than their maximum length)."""

    BUFFER_BYTES = 32 << 20

    def __init__(self, capacity=None):
        self.capacity, self.rows, self.length = capacity, 0, 0
        self.k_buf = self.v_buf = None
        self.qkv = None  # MultiHeadAttention.fused_qkv, set by Transformer.start_decoding

    def append(self, k, v):
        """Add the keys and values (R, H, T, K) of T new positions -> every position's."""
        start = self.length
        self.reserve(k)
        self.k_buf[:k.shape[0], :, start:self.length] = k
        self.v_buf[:k.shape[0], :, start:self.length] = v
        return self.keys(), self.values()

    def reserve(self, k):
        """Room for the T new positions of keys like ``k`` (R, H, T, K), counted as fed, but
        not written: the caller writes them (a GPU's decode_attention does, in the kernel
        that reads them) -> (k_buf, v_buf, length), the buffers (rows, H, capacity, K) and
        the positions fed now."""
        R, H, T, K = k.shape
        if self.k_buf is None:
            fit = self.BUFFER_BYTES // max(1, R * H * K * k.dtype.itemsize)
            self.rows, cap = R, max(min(self.capacity or 64, fit), T, 1)
            xp = backend.get_array_module(k)
            self.k_buf, self.v_buf = (xp.empty((R, H, cap, K), k.dtype) for _ in range(2))
        elif self.length + T > self.k_buf.shape[2]:
            self._grow(self.length + T)
        self.length += T
        return self.k_buf, self.v_buf, self.length

    def keys(self):
        return self.k_buf[:self.rows, :, :self.length]

    def values(self):
        return self.v_buf[:self.rows, :, :self.length]

    def _grow(self, need):
        """New buffers of twice the positions (at least ``need``) for the rows still here:
        by the time outputs outgrow the first capacity, most sentences of a batch have
        finished, so the new buffers (and the copy into them) are often far smaller."""
        cap = max(need, 2 * self.k_buf.shape[2])
        for name in ("k_buf", "v_buf"):
            old = getattr(self, name)
            _, H, _, K = old.shape
            new = backend.get_array_module(old).empty((self.rows, H, cap, K), old.dtype)
            new[:, :, :self.length] = old[:self.rows, :, :self.length]
            setattr(self, name, new)

    def take(self, rows):
        """Row i becomes old row ``rows[i]`` (host int array). Only the rows that change are
        copied, within the same buffers, unless there are more rows than the buffers hold
        (a beam search's first step runs one row per sentence): then into new ones."""
        if self.k_buf is None:
            return
        n = len(rows)
        if n > self.k_buf.shape[0]:
            xp = backend.get_array_module(self.k_buf)
            R, H, cap, K = self.k_buf.shape
            fit = self.BUFFER_BYTES // max(1, n * H * K * self.k_buf.dtype.itemsize)
            cap = max(min(cap, fit), self.length, 1)
            idx = xp.asarray(rows)
            for name in ("k_buf", "v_buf"):
                old = getattr(self, name)
                new = xp.empty((n, H, cap, K), old.dtype)
                new[:, :, :self.length] = old[idx, :, :self.length]
                setattr(self, name, new)
            self.rows = n
            return
        moved = np.nonzero(rows != np.arange(n))[0]
        if len(moved):
            xp = backend.get_array_module(self.k_buf)
            src, dst = xp.asarray(rows[moved]), xp.asarray(moved)
            for buf in (self.k_buf, self.v_buf):
                buf[dst, :, :self.length] = buf[src, :, :self.length]  # (the right side is a copy)
        self.rows = n


class CrossCache:
    """The encoder-decoder keys and values of one decoder layer: (N, H, S, K) each, one
    entry per sentence, shared by the ``group`` rows (beams) of that sentence."""

    def __init__(self, group=1):
        self.group, self.k, self.v = group, None, None

    def fill(self, attention, memory, rows=None):
        """Compute the keys and values of ``memory`` with ``attention`` (the layer's
        MultiHeadAttention), unless they are here already (``rows``: memory is the real
        rows of a padded batch, as MultiHeadAttention.memory_kv takes them)."""
        if self.k is None:
            self.k, self.v = (t.data for t in attention.memory_kv(memory, rows))

    def take(self, sentences):
        """Sentence i becomes old sentence ``sentences[i]`` (host int array): only the ones
        that change place are copied, in place."""
        if self.k is not None:
            n = len(sentences)
            moved = np.nonzero(sentences != np.arange(n))[0]
            if len(moved):
                xp = backend.get_array_module(self.k)
                src, dst = xp.asarray(sentences[moved]), xp.asarray(moved)
                for a in (self.k, self.v):
                    a[dst] = a[src]  # (the right side is a copy)
            self.k, self.v = self.k[:n], self.v[:n]


class DecoderState:
    def __init__(self, src_bias, n_layers, group=1, capacity=None):
        self.src_bias, self.group, self.offset = src_bias, group, 0
        self.out_weight = None  # Transformer.output_weight(), set by start_decoding
        self.layers = self.new_layers(n_layers, group, capacity)

    @staticmethod
    def new_layers(n_layers, group=1, capacity=None):
        """Empty caches: one {"self": SelfCache, "cross": CrossCache} per decoder layer."""
        return [{"self": SelfCache(capacity), "cross": CrossCache(group)}
                for _ in range(n_layers)]

    @property
    def sentences(self):
        return self.src_bias.shape[0]

    @property
    def rows(self):
        return self.sentences * self.group

    def keep_sentences(self, sentences, rows=None, group=None):
        """Keep sentences ``sentences`` (host int array, each once, in any order: sentence i
        of the new state is old sentence ``sentences[i]``); the others leave. Row r of the
        new state continues old row ``rows[r]`` (host int array, a row of the same sentence;
        by default each kept sentence's own rows, in order). ``group``: the rows per
        sentence from now on, when it changes (a beam search's first step runs one row per
        sentence, then ``beam``). The source mask and encoder-decoder keys/values follow the
        sentences, the self-attention history the rows."""
        sentences = np.asarray(sentences, dtype=np.int64)
        g = self.group
        if rows is None:
            rows = (sentences[:, None] * g + np.arange(g)).reshape(-1)
        rows = np.asarray(rows, dtype=np.int64)
        if group is not None and group != g:
            self.group = group
            for layer in self.layers:
                layer["cross"].group = group
        if len(sentences) < self.sentences or np.any(sentences != np.arange(len(sentences))):
            self.src_bias = self.src_bias[backend.get_array_module(self.src_bias).asarray(
                sentences)]
            for layer in self.layers:
                layer["cross"].take(sentences)
        for layer in self.layers:
            layer["self"].take(rows)

    def reorder_beams(self, rows):
        """Row i continues the tokens fed so far in row ``rows[i]`` (host int array; a row
        of the same sentence): beams reordered after a step of beam search."""
        self.keep_sentences(np.arange(self.sentences), rows)
