"""The paper's Transformer (§3): encoder-decoder, multi-head attention, shared embeddings.

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H, F d_ff,
V vocabulary. Token ids are integer arrays; the padding id marks positions to ignore.

Every sub-layer is wrapped as the paper does (post-norm):
    x = LayerNorm(x + Dropout(Sublayer(x)))
or, with ``norm="pre"`` (a later variant), x = x + Dropout(Sublayer(LayerNorm(x))) and one
final LayerNorm on each stack.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Optional

import numpy as np

from .. import backend
from ..engine import ops
from ..engine.attention import key_bias
from ..engine.ids import check_ids
from ..engine.linear_cross_entropy import linear_cross_entropy
from ..engine.softmax import log_softmax
from ..engine import tensor as tensor_module
from ..engine.tensor import Tensor, no_grad
from .decoder_state import DecoderState
from .layers import (DecoderLayer, EncoderLayer, FeedForward, MultiHeadAttention,  # noqa: F401
                     SublayerConnection, sinusoids)
from .module import Dropout, LayerNorm, Linear, Module, parameter
from .real_rows import RealRows


# the values each of TransformerConfig's string fields takes (train.py's flags offer them)
CHOICES = {"norm": ("post", "pre"), "positions": ("sinusoidal", "learned"),
           "sinusoid_layout": ("interleaved", "concat"), "smoothing": ("others", "uniform")}


@dataclasses.dataclass
class TransformerConfig:
    """Every hyperparameter of the model; saved as config.json with each checkpoint.

    The defaults are the paper's base model (Table 3). Switches for the places where
    public implementations differ from the paper are documented on each field.
    """
    vocab_size: int = 8000          # V: joint source/target vocabulary (sentencepiece)
    d_model: int = 512              # D
    n_heads: int = 8                # H (d_k = d_v = D / H)
    d_ff: int = 2048                # F: inner size of the position-wise feed-forward net
    n_layers: int = 6               # N: layers in the encoder and in the decoder
    dropout: float = 0.1            # P_drop: sub-layer outputs and embedding+position sums
    attention_dropout: float = 0.0  # on attention probabilities (not in the paper)
    relu_dropout: float = 0.0       # inside the feed-forward net (not in the paper)
    label_smoothing: float = 0.1    # epsilon_ls
    smoothing: str = "others"       # 'others': ls/(V-1) on non-targets; 'uniform': ls/V
    norm: str = "post"              # 'post' (paper) or 'pre'
    positions: str = "sinusoidal"   # 'sinusoidal' (paper) or 'learned'
    sinusoid_layout: str = "interleaved"  # 'interleaved' sin/cos (paper) or 'concat' [sin, cos]
    max_positions: int = 1024       # longest sequence the position table covers
    share_embeddings: bool = True   # one matrix: source emb, target emb, pre-softmax (§3.4)
    ln_eps: float = 1e-5
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads "
                             f"({self.n_heads})")
        for field, allowed in CHOICES.items():
            if getattr(self, field) not in allowed:
                raise ValueError(f"{field} must be one of {allowed}, got {getattr(self, field)!r}")

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config fields {unknown}; known: {sorted(known)}")
        return cls(**d)


PRESETS = {
    # tests and the default run: small enough to train in minutes on a laptop CPU
    "tiny": dict(d_model=128, n_heads=4, d_ff=512, n_layers=2, dropout=0.1),
    # the paper's base and big models (Table 3)
    "base": dict(d_model=512, n_heads=8, d_ff=2048, n_layers=6, dropout=0.1),
    "big": dict(d_model=1024, n_heads=16, d_ff=4096, n_layers=6, dropout=0.3),
}


def preset(name, **overrides):
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return TransformerConfig(**{**PRESETS[name], **overrides})


class Transformer(Module):
    """Encoder-decoder Transformer.

    Parameters (names as in checkpoints; W matrices are (in, out), applied as x W):
      embedding (V, D)                  shared source/target embedding, also the pre-softmax
                                        weight (logits = h embedding^T) when share_embeddings
      src_embedding, tgt_embedding (V, D), out_proj.weight (D, V)   when not shared
      positions (max_positions, D)      only with positions='learned'
      encoder.{i}.self_attn.{wq,wk,wv,wo}.{weight (D, D), bias (D,)}
      encoder.{i}.ff.w1.{weight (D, F), bias (F,)}, encoder.{i}.ff.w2.{weight (F, D), bias (D,)}
      encoder.{i}.sub{1,2}.norm.{gamma, beta} (D,)
      decoder.{i}.{self_attn, cross_attn, ff, sub1, sub2, sub3}...   likewise
      enc_norm, dec_norm .{gamma, beta}  only with norm='pre'
    """

    def __init__(self, cfg: TransformerConfig, seed: int = 0, device: str = "cpu",
                 dtype: Any = np.float32, compute_dtype: Any = None) -> None:
        self.cfg, self.device, self.dtype = cfg, device, np.dtype(dtype)
        # mixed precision: with compute_dtype float16 the parameters stay ``dtype`` (the
        # master weights the optimizer updates) and the activations, products and their
        # gradients run in float16; see ``embed``, ``logits`` and ``loss``
        self.compute_dtype = np.dtype(compute_dtype or dtype)
        xp = backend.get_xp(device)
        init = np.random.default_rng(seed)  # parameter initialisation (host, then copied)
        self.rng = backend.Generator(seed + 1, device)  # dropout masks
        D, V = cfg.d_model, cfg.vocab_size

        def emb():
            # N(0, D^-0.5): after the sqrt(D) scaling the embeddings have unit scale
            return parameter(xp.asarray(init.normal(0, D ** -0.5, (V, D)), dtype=dtype))

        if cfg.share_embeddings:
            self.embedding = emb()
        else:
            self.src_embedding, self.tgt_embedding = emb(), emb()
            self.out_proj = Linear(D, V, bias=False, rng=init, dtype=dtype, device=device)
        if cfg.positions == "learned":
            self.positions = parameter(xp.asarray(init.normal(0, D ** -0.5, (cfg.max_positions, D)),
                                                  dtype=dtype))
        else:
            self.pe = xp.asarray(sinusoids(cfg.max_positions, D, cfg.sinusoid_layout, dtype))
        self.encoder = [EncoderLayer(cfg, self.rng, init, dtype, device)
                        for _ in range(cfg.n_layers)]
        self.decoder = [DecoderLayer(cfg, self.rng, init, dtype, device)
                        for _ in range(cfg.n_layers)]
        if cfg.norm == "pre":
            self.enc_norm = LayerNorm(D, cfg.ln_eps, dtype=dtype, device=device)
            self.dec_norm = LayerNorm(D, cfg.ln_eps, dtype=dtype, device=device)
        self.emb_drop = Dropout(cfg.dropout, self.rng)

    # ---- pieces ------------------------------------------------------------------------
    def _table(self, side):
        if self.cfg.share_embeddings:
            return self.embedding
        return self.src_embedding if side == "src" else self.tgt_embedding

    def embed(self, ids, side, offset=0):
        """Dropout(Embedding(ids) * sqrt(D) + PE[offset : offset + L]):  (B, L) -> (B, L, D)."""
        L = ids.shape[1]
        self._check_positions(offset + L)
        x = ops.embedding(ids, self._table(side), pad_id=self.cfg.pad_id)
        x = x * math.sqrt(self.cfg.d_model)
        if self.cfg.positions == "learned":
            pos = ops.embedding(self.xp().arange(offset, offset + L)[None, :], self.positions)
            x = x + pos
        else:
            x = x + Tensor(self.pe[offset:offset + L])
        if x.dtype != self.compute_dtype:  # the activations' dtype from here on
            x = ops.cast(x, self.compute_dtype)
        return self.emb_drop(x)

    def _check_positions(self, length):
        """A sequence of ``length`` positions must fit the position table."""
        if length > self.cfg.max_positions:
            raise ValueError(f"sequence of length {length} exceeds max_positions "
                             f"({self.cfg.max_positions}); raise --max-positions or shorten input")

    def _embed_step(self, ids, offset):
        """embed on raw arrays for one position, ``offset``, of each row: ids (R,) -> (R, D),
        the same arithmetic in evaluation mode (a decoding step: ``_step``)."""
        self._check_positions(offset + 1)
        x = self._table("tgt").data[ids]
        x *= x.dtype.type(math.sqrt(self.cfg.d_model))
        x += (self.positions.data if self.cfg.positions == "learned" else self.pe)[offset]
        return backend.cast(x, self.compute_dtype)

    def xp(self):
        return backend.get_xp(self.device)

    def ids(self, x):
        """Token ids (a list, NumPy/CuPy array or Tensor) as an integer array on our device.

        Ids still on the host are checked against the vocabulary here (on a GPU an id out of
        range would silently wrap around in the embedding lookup); device arrays are taken
        as they are, since reading them back would make the step wait.
        """
        a = self._host_or_device(x)
        if isinstance(a, np.ndarray):
            check_ids(a, self.cfg.vocab_size, "token id",
                          ": was the data encoded with another sentencepiece model?")
        return self.xp().asarray(a)

    @staticmethod
    def _host_or_device(x):
        """Ids as they came: a device array stays one, anything else becomes a NumPy array."""
        a = x.data if isinstance(x, Tensor) else x
        return a if hasattr(a, "shape") and not isinstance(a, np.generic) else np.asarray(a)

    def encode(self, src: Any) -> tuple[Tensor, Any]:
        """src ids (B, S) -> memory (B, S, D), src_mask bool (B, S) (True = real token)."""
        x, src_mask, rows = self._encode(src)
        return (x if rows is None else rows.scatter(x)), src_mask

    def _encode(self, src):
        """encode, but under no_grad in evaluation mode the memory may come as its real
        rows (N, D), with their RealRows (nn/real_rows.py; else None)."""
        src = self.ids(src)
        src_mask = src != self.cfg.pad_id
        x = self.embed(src, "src")
        rows = RealRows.worth_it(src_mask, self.training)  # inference: real tokens only
        if rows is not None:
            x = rows.gather(x)
        for layer in self.encoder:
            x = layer(x, src_mask, rows)
        if self.cfg.norm == "pre":
            x = self.enc_norm(x)
        return x, src_mask, rows

    def decode(self, tgt_in: Any, memory: Tensor, src_mask: Any, cache: Optional[list] = None,
               offset: int = 0) -> Tensor:
        """tgt_in ids (B, T) -> decoder output (B, T, D). With ``cache`` (a list with one dict
        per layer), only the new positions are fed; ``offset`` is the first one's position."""
        y = self.embed(self.ids(tgt_in), "tgt", offset)
        for i, layer in enumerate(self.decoder):
            y = layer(y, memory, src_mask, None if cache is None else cache[i])
        if self.cfg.norm == "pre":
            y = self.dec_norm(y)
        return y

    def _in_compute_dtype(self, p):
        return p if p.dtype == self.compute_dtype else ops.cast(p, self.compute_dtype)

    def logits(self, h: Tensor, weight: Any = None) -> Tensor:
        """Pre-softmax projection (§3.4): h (B, T, D) -> (B, T, V), in the parameters' dtype
        (under mixed precision the product runs in float16 and the scores are widened).
        ``weight``: the projection as one (D, V) array, ``output_weight()``, when the caller
        has it (decoding, once per search)."""
        if weight is not None:
            z = ops.linear(h, Tensor.wrap(weight))
        elif self.cfg.share_embeddings:
            z = ops.linear(h, ops.transpose(self._in_compute_dtype(self.embedding)))
        else:
            z = self.out_proj(h)
        return z if z.dtype == self.dtype else ops.cast(z, self.dtype)

    def output_weight(self) -> Any:
        """The pre-softmax projection as one C-contiguous (D, V) array in the compute dtype:
        the shared embedding transposed, or out_proj's weight. Decoding multiplies each
        step's few rows by it; stored (D, V), not read as the transpose of (V, D), the BLAS
        runs that product up to 2.5x faster for a few rows (the same numbers)."""
        w = self.embedding if self.cfg.share_embeddings else self.out_proj.weight
        w = self._in_compute_dtype(w).data
        if self.cfg.share_embeddings:
            return backend.transposed(w)
        return backend.get_array_module(w).ascontiguousarray(w)

    def forward(self, src, tgt_in):
        memory, src_mask = self.encode(src)
        return self.logits(self.decode(tgt_in, memory, src_mask))

    def loss(self, src: Any, tgt_in: Any, tgt_out: Any) -> tuple[Tensor, int]:
        """Summed label-smoothed cross-entropy over non-padding targets, and their count.

        The pre-softmax projection and the loss run as one fused Function
        (engine/linear_cross_entropy.py), so the (B, T, V) logits are never stored.
        """
        memory, src_mask = self.encode(src)
        h = self.decode(tgt_in, memory, src_mask)
        cfg = self.cfg
        weight, layout = (self.embedding, "vd") if cfg.share_embeddings else \
            (self.out_proj.weight, "dv")
        # targets stay where they are (a host batch is checked on the host; see
        # engine/cross_entropy.checked_targets) and are then copied to the device
        return linear_cross_entropy(h, self._in_compute_dtype(weight),
                                    self._host_or_device(tgt_out),
                                    cfg.label_smoothing, pad_id=cfg.pad_id,
                                    smoothing=cfg.smoothing, layout=layout)

    def new_cache(self):
        """Empty per-layer key/value caches for ``decode(..., cache=)``."""
        return DecoderState.new_layers(len(self.decoder))

    # ---- incremental decoding (mt/search.py) ----
    def start_decoding(self, src: Any, beams: int = 1,
                       max_length: Optional[int] = None) -> DecoderState:
        """Encode src ids (B, S) -> the DecoderState of B sentences with ``beams`` rows
        each, before the first token. The encoder-decoder keys and values of each layer are
        computed here, once per sentence; ``max_length`` (the most tokens a row will be fed)
        sizes the self-attention caches. Decoding never records a tape (no_grad)."""
        with no_grad():
            memory, src_mask, rows = self._encode(src)
            acc = backend.accumulation_dtype(self.compute_dtype)
            state = DecoderState(key_bias(src_mask, acc), len(self.decoder), beams, max_length)
            for layer, cache in zip(self.decoder, state.layers):
                cache["cross"].fill(layer.cross_attn, memory, rows)
                cache["self"].qkv = layer.self_attn.fused_qkv(self.compute_dtype)
            state.out_weight = self.output_weight()
        return state

    def next_scores(self, last: Any, state: DecoderState, log_probs: bool = False) -> Any:
        """Feed the newest tokens ``last`` (R, 1) of the R rows of ``state`` -> the scores
        of the token after them, (R, V) on the model's device: logits, or log-probabilities
        with ``log_probs``. Earlier positions come from the state's caches; the state
        advances by one position."""
        with no_grad():
            if last.shape[1] == 1 and self._steps(state):
                z = self.logits(Tensor.wrap(self._step(last, state)), state.out_weight)
                return (log_softmax(z) if log_probs else z).data
            h = self.decode(last, None, state.src_bias, cache=state.layers,
                            offset=state.offset)
            state.offset += last.shape[1]
            z = self.logits(h, state.out_weight)
            return (log_softmax(z) if log_probs else z).data[:, -1]

    def _steps(self, state):
        """Whether next_scores runs the decoder's ``step`` methods on raw arrays: in
        evaluation mode when nothing watches the ops (no tape, profiler or anomaly mode: they
        follow Functions, which then run through forward) and no attention maps are being
        recorded. Both paths give the same numbers (tests/test_search.py)."""
        return (tensor_module.plain_inference() and not self.training
                and all(layer.self_attn.store is None and layer.cross_attn.store is None
                        for layer in self.decoder)
                and all(c["self"].qkv is not None and c["cross"].k is not None
                        for c in state.layers))

    def _step(self, last, state):
        """The decoder output (R, D) for the newest tokens ``last`` (R, 1) of the R rows of
        ``state``, through each decoder layer's ``step`` (nn/layers.py); the state advances
        by one position."""
        x = self._embed_step(self.ids(last)[:, 0], state.offset)
        for layer, cache in zip(self.decoder, state.layers):
            x = layer.step(x, cache, state.src_bias)
        if self.cfg.norm == "pre":
            x = self.dec_norm.step(x)
        state.offset += 1
        return x

    def set_attention_store(self, store):
        """store: dict to fill with lists of attention maps, or None to stop recording."""
        for name, stack, kinds in (("encoder", self.encoder, ("self_attn",)),
                                   ("decoder", self.decoder, ("self_attn", "cross_attn"))):
            for i, layer in enumerate(stack):
                for kind in kinds:
                    mha = getattr(layer, kind)
                    if store is None:
                        mha.store = None
                    else:
                        mha.store = store.setdefault(f"{name}.{i}.{kind}", [])


def count_parameters(model):
    return sum(p.size for p in model.parameters())


__all__ = ["TransformerConfig", "Transformer", "PRESETS", "preset", "sinusoids",
           "count_parameters", "no_grad"]
