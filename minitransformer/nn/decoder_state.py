"""What incremental decoding carries from one step to the next (the search's view of the model).

For each of the B* rows being decoded (a sentence, or one beam of one):
    memory   (B*, S, D)   the encoder output, and src_mask its key mask
    layers   one dict per decoder layer: "self" holds the self-attention keys/values of the
             tokens fed so far (B*, H, t, K), appended to at every step; "cross" the
             encoder-decoder keys/values (B*, H, S, K), computed from memory once
    offset   the position of the next token fed
A search changes which rows there are only through the two operations below, so it never
touches arrays or cache entries itself.
"""
from ..engine.tensor import Tensor


class DecoderState:
    def __init__(self, memory, src_mask, n_layers):
        self.memory, self.src_mask = memory, src_mask
        self.layers = [{} for _ in range(n_layers)]
        self.offset = 0

    @property
    def rows(self):
        return self.memory.shape[0]

    def keep_rows(self, rows):
        """Keep (or repeat) rows ``rows`` (an index array on the model's device): sentences
        that finished leave, and a beam search starts by repeating each sentence k times.
        Everything per row follows: memory, its mask, and both caches."""
        self.memory, self.src_mask = Tensor(self.memory.data[rows]), self.src_mask[rows]
        self._take(rows, ("self", "cross"))

    def reorder_history(self, rows):
        """Row i continues the tokens fed so far in row ``rows[i]`` (beams reordered after a
        step of beam search). Only the self-attention history moves: the encoder-decoder
        keys/values and memory are the same for every beam of one sentence."""
        self._take(rows, ("self",))

    def _take(self, rows, parts):
        for layer in self.layers:
            for part in parts:
                cache = layer.get(part, {})
                for key in ("k", "v"):
                    if key in cache:
                        cache[key] = Tensor(cache[key].data[rows])
