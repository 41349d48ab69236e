"""The layers of the Transformer (§3.1-3.5): sinusoidal positions, multi-head attention, the
position-wise feed-forward network, the residual sub-layer connection, and the encoder and
decoder layers built from them. transformer.py assembles them into the model.

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H, F d_ff.
"""

import numpy as np

from .. import backend
from ..engine import cuda_kernels, ops
from ..engine.attention import attention_probabilities, scaled_dot_product_attention
from ..engine.residual import dropout_residual
from ..engine.tensor import Tensor
from .decoder_state import CrossCache, SelfCache
from .module import Dropout, LayerNorm, Linear, Module


def sinusoids(n_positions, d_model, layout="interleaved", dtype=np.float32):
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)) (§3.5).

    'concat' puts all sines first, then all cosines (a common variant).
    """
    pos = np.arange(n_positions, dtype=np.float64)[:, None]
    inv = 10000.0 ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
    angles = pos * inv  # (P, D/2)
    pe = np.zeros((n_positions, d_model))
    if layout == "interleaved":
        pe[:, 0::2], pe[:, 1::2] = np.sin(angles), np.cos(angles[:, : d_model // 2])
    else:
        half = angles.shape[1]
        pe[:, :half], pe[:, half:] = np.sin(angles), np.cos(angles[:, : d_model - half])
    return pe.astype(dtype)


class MultiHeadAttention(Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_H) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    The H projections of each kind are one (D, D) matrix; heads are its K-column blocks.
    query (B, T, D), memory (B, S, D) -> (B, T, D).
    """

    def __init__(self, cfg, rng, init, dtype, device):
        D = cfg.d_model
        self.n_heads, self.cfg, self.rng = cfg.n_heads, cfg, rng
        self.wq, self.wk, self.wv, self.wo = (Linear(D, D, rng=init, dtype=dtype, device=device)
                                              for _ in range(4))
        self.store = None  # set to a list to record attention maps (B, H, T, S)

    def forward(self, query, memory, key_mask, causal, cache=None, rows=None):
        """key_mask: bool (B, S) or an additive bias (B, 1, 1, S) (engine/attention.key_bias).

        cache (incremental decoding): a SelfCache, to which this step's keys and values are
        appended (self-attention); or a CrossCache holding memory's keys and values, computed
        once per sentence (encoder-decoder attention: memory never changes). A CrossCache's
        ``group`` rows of one sentence (its beams) attend as one block of queries.
        rows: a RealRows (nn/real_rows.py; the encoder's self-attention under no_grad):
        query is then the N real positions (N, D) of a padded batch, and so is the output.
        """
        if rows is not None:
            return self._on_real_rows(query, key_mask, rows)
        H = self.n_heads
        B, T, D = query.shape
        group = cache.group if isinstance(cache, CrossCache) else 1
        if group > 1:  # (B, T, D) -> (sentences, beams * T, D): queries are independent
            query = query.reshape(B // group, group * T, D)
        q, k, v = self._project(query, memory, cache)  # (B, H, T, K), (B, H, S, K) twice
        causal = causal and q.shape[2] > 1  # one new query sees every key so far: no mask
        out = scaled_dot_product_attention(q, k, v, key_mask=key_mask, causal=causal,
                                           dropout=self.cfg.attention_dropout, rng=self.rng,
                                           training=self.training)
        self._record(q, k, key_mask, causal)
        out = self.wo(ops.merge_heads(out, H))
        return out if group == 1 else out.reshape(B, T, D)

    def step(self, x, cache, key_bias=None, add_bias=True):
        """forward(x, ..., cache=cache) for the one new position of each row, on raw arrays
        (a decoding step under no_grad: ``Transformer.next_scores``): x (R, D) -> (R, D);
        ``add_bias=False`` leaves W_O's bias to the caller (SublayerConnection.step).
        cache: the layer's SelfCache, with the fused [W_q W_k W_v] (this position's keys and
        values are appended), or its CrossCache (``group`` rows a sentence attend to the
        sentence's keys and values as one block of queries) with the source's ``key_bias``.
        The same products and softmax, in the same order and layout, as forward: the same
        numbers (tested), without Tensors, Function objects or a tape. On a GPU the append,
        the attention and merge_heads are one kernel (cuda_kernels.decode_attention: the
        same formulas and roundings, summed in another order) instead of about seven."""
        H = self.n_heads
        R, D = x.shape
        xp = backend.get_array_module(x)
        if isinstance(cache, SelfCache):
            w, b = cache.qkv
            if cuda_kernels.fits_decode_attention(xp, D // H, cache.length + 1):
                # on a GPU: the biases, the cache's append, the attention and merge_heads in
                # one kernel
                heads = ops.affine(x, w).reshape(R, 3 * H, 1, D // H)  # (without b)
                q, k_new, v_new = heads[:, :H], heads[:, H:2 * H], heads[:, 2 * H:]
                k_buf, v_buf, n = cache.reserve(k_new)
                return self.wo.step(cuda_kernels.decode_attention(
                    q, k_buf, v_buf, n, k_new=k_new, v_new=v_new, q_bias=b[:D],
                    k_bias=b[D:2 * D], v_bias=b[2 * D:]), add_bias)
            heads = ops.affine(x, w, b).reshape(R, 3 * H, 1, D // H)  # split_heads
            q = heads[:, :H]
            k, v = cache.append(heads[:, H:2 * H], heads[:, 2 * H:])
        elif cuda_kernels.fits_decode_attention(xp, D // H, cache.k.shape[2]):
            return self.wo.step(cuda_kernels.decode_attention(
                self.wq.step(x, add_bias=False).reshape(R, H, D // H), cache.k, cache.v,
                cache.k.shape[2], group=cache.group, bias=key_bias,
                q_bias=None if self.wq.bias is None else self.wq.bias.data), add_bias)
        else:  # split_heads of (sentences, group, D): the group's queries as one block
            g = cache.group
            q = self.wq.step(x).reshape(R // g, g, H, D // H).transpose(0, 2, 1, 3)
            q = xp.ascontiguousarray(q)
            k, v = cache.k, cache.v
        out = attention_probabilities(q, k, key_bias) @ v  # (ScaledDotProductAttention)
        return self.wo.step(out.transpose(0, 2, 1, 3).reshape(R, D), add_bias)  # merge_heads

    def _on_real_rows(self, x, key_mask, rows):
        """Self-attention of the real positions x (N, D) of a padded batch -> (N, D): the
        products run on the N rows, the scores on the padded layout (nn/real_rows.py)."""
        q, k, v = (Tensor.wrap(a) for a in self._qkv_heads(x, self.fused_qkv(x.dtype), rows))
        out = scaled_dot_product_attention(q, k, v, key_mask=key_mask)
        self._record(q, k, key_mask, False)
        return self.wo(rows.gather(ops.merge_heads(out, self.n_heads)))

    def _qkv_heads(self, x, qkv, rows=None):
        """x [W_q W_k W_v] + [b_q b_k b_v] (``qkv``, from fused_qkv) as one product -> the
        q, k and v heads, three (B, H, T, K) arrays (views); ``rows``: x is the real rows of
        a padded batch, scattered into it after the product."""
        H = self.n_heads
        y = ops.linear(x, Tensor.wrap(qkv[0]), Tensor.wrap(qkv[1]))  # (..., 3D)
        if rows is not None:
            y = rows.scatter(y)
        heads = ops.split_heads(y, 3 * H).data  # (B, 3H, T, K): q, k, v heads in turn
        return heads[:, :H], heads[:, H:2 * H], heads[:, 2 * H:]

    def _record(self, q, k, key_mask, causal):
        """Attention maps for plots, (B, H, T, S), recomputed, when a store is set."""
        if self.store is not None:
            mask = key_mask.data if isinstance(key_mask, Tensor) else key_mask
            self.store.append(backend.to_numpy(attention_probabilities(q.data, k.data, mask,
                                                                       causal)))

    def memory_kv(self, memory, rows=None):
        """The keys and values of ``memory`` (B, S, D) -> two (B, H, S, K) Tensors. With a
        RealRows ``rows``, memory is the real rows (N, D) of a padded batch: the products
        run on them, and the padding's keys and values are 0 (masked, as in _on_real_rows)."""
        kv = (self.wk(memory), self.wv(memory))
        if rows is not None:
            kv = (rows.scatter(t) for t in kv)
        return tuple(ops.split_heads(t, self.n_heads) for t in kv)

    def fused_qkv(self, dtype):
        """[W_q W_k W_v] (D, 3D) and [b_q b_k b_v] (3D,) as ``dtype`` arrays: the three
        projections of self-attention as one product. Incremental decoding builds them once
        per search (``Transformer.start_decoding``); x [W_q W_k W_v] + [b_q b_k b_v] is
        [x W_q + b_q, x W_k + b_k, x W_v + b_v], column block by column block."""
        xp = backend.get_array_module(self.wq.weight.data)
        parts = (self.wq, self.wk, self.wv)
        return (xp.concatenate([m.weight.data for m in parts], axis=1).astype(dtype),
                xp.concatenate([m.bias.data for m in parts]))

    def _project(self, query, memory, cache):
        """-> q (B, H, T, K) and the keys and values (B, H, S, K) it attends to."""
        H = self.n_heads
        if isinstance(cache, SelfCache) and cache.qkv is not None:
            # self-attention, one step of decoding (no_grad): one product for q, k and v
            q, k, v = self._qkv_heads(query, cache.qkv)
            k, v = cache.append(k, v)
            return Tensor.wrap(q), Tensor.wrap(k), Tensor.wrap(v)
        q = ops.split_heads(self.wq(query), H)
        if cache is None:
            return (q,) + self.memory_kv(memory)
        if isinstance(cache, CrossCache):  # encoder-decoder keys/values: computed once
            cache.fill(self, memory)
            return q, Tensor(cache.k), Tensor(cache.v)
        k, v = self.memory_kv(memory)  # self-attention: this step's, after the history
        return (q,) + tuple(Tensor(a) for a in cache.append(k.data, v.data))


class FeedForward(Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2  (§3.3): (B, T, D) -> (B, T, F) -> (B, T, D)."""

    def __init__(self, cfg, rng, init, dtype, device):
        self.w1 = Linear(cfg.d_model, cfg.d_ff, rng=init, dtype=dtype, device=device)
        self.w2 = Linear(cfg.d_ff, cfg.d_model, rng=init, dtype=dtype, device=device)
        self.drop = Dropout(cfg.relu_dropout, rng)

    def forward(self, x):
        return self.w2(self.drop(ops.relu(self.w1(x))))

    def step(self, x, add_bias=True):
        """forward on a raw array (R, D) in evaluation mode (dropout off), recording nothing;
        ``add_bias=False`` leaves W_2's bias to the caller (SublayerConnection.step)."""
        xp = backend.get_array_module(x)
        if cuda_kernels.step_kernels(xp) and self.w1.bias is not None:  # (one kernel: + b, ReLU)
            h = cuda_kernels.bias_relu_(self.w1.step(x, add_bias=False), self.w1.bias.data)
        else:
            h = self.w1.step(x)
            h = xp.maximum(h, 0, out=h)  # ReLU
        return self.w2.step(h, add_bias)


class SublayerConnection(Module):
    """post: LayerNorm(x + Dropout(f(x)));  pre: x + Dropout(f(LayerNorm(x))).

    The dropout and the residual add are one fused Function (engine/residual.py).
    """

    def __init__(self, cfg, rng, dtype, device):
        self.norm = LayerNorm(cfg.d_model, cfg.ln_eps, dtype=dtype, device=device)
        self.drop = Dropout(cfg.dropout, rng)
        self.pre = cfg.norm == "pre"

    def forward(self, x, f):
        d = self.drop
        if self.pre:
            return dropout_residual(x, f(self.norm(x)), d.rate, d.rng, d.training)
        return self.norm(dropout_residual(x, f(x), d.rate, d.rng, d.training))

    def step(self, x, f, last=None):
        """forward on raw arrays in evaluation mode (dropout off): f takes and returns one.
        ``last``: the Linear that ends f, whose bias f leaves out when called with
        add_bias=False; on a GPU (post-norm) that bias, the residual add and LayerNorm are
        then one kernel (cuda_kernels.bias_residual_layer_norm), the same numbers."""
        if self.pre:
            return x + f(self.norm.step(x))
        if last is not None and last.bias is not None and \
                cuda_kernels.step_kernels(backend.get_array_module(x)):
            n = self.norm
            return cuda_kernels.bias_residual_layer_norm(f(x, add_bias=False), last.bias.data,
                                                         x, n.gamma.data, n.beta.data, n.eps)
        return self.norm.step(x + f(x))


class EncoderLayer(Module):
    def __init__(self, cfg, rng, init, dtype, device):
        self.self_attn = MultiHeadAttention(cfg, rng, init, dtype, device)
        self.ff = FeedForward(cfg, rng, init, dtype, device)
        self.sub1 = SublayerConnection(cfg, rng, dtype, device)
        self.sub2 = SublayerConnection(cfg, rng, dtype, device)

    def forward(self, x, src_mask, rows=None):
        """x (B, S, D), or its real positions (N, D) with their RealRows ``rows``."""
        x = self.sub1(x, lambda h: self.self_attn(h, h, src_mask, causal=False, rows=rows))
        return self.sub2(x, self.ff)


class DecoderLayer(Module):
    def __init__(self, cfg, rng, init, dtype, device):
        self.self_attn = MultiHeadAttention(cfg, rng, init, dtype, device)
        self.cross_attn = MultiHeadAttention(cfg, rng, init, dtype, device)
        self.ff = FeedForward(cfg, rng, init, dtype, device)
        self.sub1 = SublayerConnection(cfg, rng, dtype, device)
        self.sub2 = SublayerConnection(cfg, rng, dtype, device)
        self.sub3 = SublayerConnection(cfg, rng, dtype, device)

    def forward(self, y, memory, src_mask, cache=None):
        """cache: this layer's {"self": SelfCache, "cross": CrossCache} (nn/decoder_state.py)
        in incremental decoding, else None."""
        c_self = c_cross = None
        if cache is not None:
            c_self, c_cross = cache["self"], cache["cross"]
        y = self.sub1(y, lambda h: self.self_attn(h, h, None, causal=True, cache=c_self))
        y = self.sub2(y, lambda h: self.cross_attn(h, memory, src_mask, causal=False,
                                                   cache=c_cross))
        return self.sub3(y, self.ff)

    def step(self, y, cache, src_bias):
        """forward for one new position per row on raw arrays (R, D), in evaluation mode
        (``Transformer.next_scores``): cache is this layer's {"self", "cross"} as in
        forward, src_bias the source's additive key mask (engine/attention.key_bias)."""
        sa, ca = self.self_attn, self.cross_attn
        y = self.sub1.step(y, lambda h, **kw: sa.step(h, cache["self"], **kw), sa.wo)
        y = self.sub2.step(y, lambda h, **kw: ca.step(h, cache["cross"], src_bias, **kw), ca.wo)
        return self.sub3.step(y, self.ff.step, self.ff.w2)
