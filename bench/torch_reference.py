"""The same Transformer in PyTorch, as the benchmark's reference (bench-only; torch is never a
dependency of minitransformer).

It is the model of ``minitransformer.nn.transformer`` with the benchmark's settings: post-norm
``LayerNorm(x + Dropout(Sublayer(x)))``, one embedding matrix shared by source, target and the
pre-softmax projection and scaled by sqrt(D), interleaved sinusoidal positions, dropout on the
embedding sums and sub-layer outputs, label-smoothed cross-entropy with eps/(V-1) on the
non-target classes. Parameter names match the package's, so its weights load one to one
(``load_minitransformer_state``; the package stores Linear weights as (in, out), torch as
(out, in)). Attention uses ``torch.nn.functional.scaled_dot_product_attention``.

Decoding mirrors ``minitransformer.mt.search``: incremental, with a key/value cache per
decoder layer (self-attention keys/values appended each step, cross-attention keys/values
computed once), finished sentences leave the batch, the maximum length is source length +
``max_len_a``, and beam search keeps finished hypotheses by the GNMT-normalised score
log P / ((5 + |Y|) / 6) ** alpha, taking an EOS only among the ``beam`` best candidates.

Shapes: B batch, S source length, T target length, D d_model, H heads, K = D / H, V vocabulary.
"""
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def sinusoids(n_positions, d_model):
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(same): (P, D), float32."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    angles = pos * inv
    pe = torch.zeros(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(angles), torch.cos(angles[:, : d_model // 2])
    return pe.float()


def smoothed_cross_entropy(logits, targets, eps, pad_id, smoothing="others"):
    """Summed label-smoothed cross-entropy over non-padding targets, and their count.

    q_t = 1 - eps and q_v = eps / (V - 1) for v != t ('others', the package's default).
    torch's built-in ``label_smoothing=ls`` gives q_t = 1 - ls + ls / V and q_v = ls / V, so
    ls = eps * V / (V - 1) yields exactly q_v = eps / (V - 1) and q_t = 1 - eps: the same
    loss through torch's fused kernel. ('uniform': ls = eps.) Checked against the formula
    written out in ``smoothed_cross_entropy_by_hand``.
    """
    V = logits.shape[-1]
    ls = eps * V / (V - 1) if smoothing == "others" else eps
    loss = F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), ignore_index=pad_id,
                           reduction="sum", label_smoothing=ls)
    return loss, int((targets != pad_id).sum())


def smoothed_cross_entropy_by_hand(logits, targets, eps, pad_id):
    """loss = logsumexp(z) - c_o * sum_v z_v - (c_t - c_o) * z_t, c_t = 1 - eps, c_o = eps/(V-1)."""
    V = logits.shape[-1]
    z, t = logits.reshape(-1, V).double(), targets.reshape(-1)
    valid = t != pad_id
    c_t, c_o = 1.0 - eps, eps / (V - 1)
    zt = z.gather(1, t.clamp(min=0)[:, None])[:, 0]
    loss = torch.logsumexp(z, 1) - c_o * z.sum(1) - (c_t - c_o) * zt
    return (loss * valid).sum()


class MultiHeadAttention(nn.Module):
    def __init__(self, D, H):
        super().__init__()
        self.H = H
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D) for _ in range(4))

    def _split(self, x):  # (B, L, D) -> (B, H, L, K)
        B, L, D = x.shape
        return x.view(B, L, self.H, D // self.H).transpose(1, 2)

    def forward(self, query, memory, attn_mask=None, causal=False, cache=None, static_kv=False):
        """attn_mask: bool (B, 1, 1, S), True where a key may be attended to."""
        q = self._split(self.wq(query))
        if cache is not None and static_kv and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            k, v = self._split(self.wk(memory)), self._split(self.wv(memory))
            if cache is not None:
                if not static_kv and "k" in cache:  # self-attention: append this step's keys
                    k = torch.cat([cache["k"], k], dim=2)
                    v = torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal)
        B, H, L, K = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, L, H * K))


class FeedForward(nn.Module):
    def __init__(self, D, F_):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, F_), nn.Linear(F_, D)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))


class Sublayer(nn.Module):
    """Post-norm residual: LayerNorm(x + Dropout(f(x)))."""

    def __init__(self, D, p, ln_eps):
        super().__init__()
        self.norm, self.drop = nn.LayerNorm(D, eps=ln_eps), nn.Dropout(p)

    def forward(self, x, f):
        return self.norm(x + self.drop(f(x)))


class EncoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        D = c["d_model"]
        self.self_attn = MultiHeadAttention(D, c["n_heads"])
        self.ff = FeedForward(D, c["d_ff"])
        self.sub1, self.sub2 = (Sublayer(D, c["dropout"], c["ln_eps"]) for _ in range(2))

    def forward(self, x, src_mask):
        x = self.sub1(x, lambda h: self.self_attn(h, h, src_mask))
        return self.sub2(x, self.ff)


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        D = c["d_model"]
        self.self_attn = MultiHeadAttention(D, c["n_heads"])
        self.cross_attn = MultiHeadAttention(D, c["n_heads"])
        self.ff = FeedForward(D, c["d_ff"])
        self.sub1, self.sub2, self.sub3 = (Sublayer(D, c["dropout"], c["ln_eps"])
                                           for _ in range(3))

    def forward(self, y, memory, src_mask, cache=None):
        c_self = c_cross = None
        if cache is not None:
            c_self, c_cross = cache.setdefault("self", {}), cache.setdefault("cross", {})
        # training: a causal mask; incremental decoding: one new query sees every cached key
        causal = cache is None
        y = self.sub1(y, lambda h: self.self_attn(h, h, None, causal, cache=c_self))
        y = self.sub2(y, lambda h: self.cross_attn(h, memory, src_mask, cache=c_cross,
                                                   static_kv=True))
        return self.sub3(y, self.ff)


class Transformer(nn.Module):
    """c: the package's TransformerConfig fields as a dict (post-norm, shared, sinusoidal)."""

    def __init__(self, c):
        super().__init__()
        if c["norm"] != "post" or not c["share_embeddings"] or c["positions"] != "sinusoidal" \
                or c["sinusoid_layout"] != "interleaved" or c["attention_dropout"] \
                or c["relu_dropout"]:
            raise ValueError("the torch reference implements only the paper's set-up")
        self.c = c
        D, V = c["d_model"], c["vocab_size"]
        self.embedding = nn.Parameter(torch.randn(V, D) * D ** -0.5)
        self.register_buffer("pe", sinusoids(c["max_positions"], D), persistent=False)
        self.encoder = nn.ModuleList(EncoderLayer(c) for _ in range(c["n_layers"]))
        self.decoder = nn.ModuleList(DecoderLayer(c) for _ in range(c["n_layers"]))
        self.emb_drop = nn.Dropout(c["dropout"])

    def embed(self, ids, offset=0):
        """Dropout(E[ids] * sqrt(D) + PE[offset : offset + L]): (B, L) -> (B, L, D)."""
        x = F.embedding(ids, self.embedding, padding_idx=self.c["pad_id"])
        x = x * math.sqrt(self.c["d_model"]) + self.pe[offset:offset + ids.shape[1]]
        return self.emb_drop(x)

    def encode(self, src):
        """-> memory (B, S, D), attention mask (B, 1, 1, S) True for real keys."""
        mask = (src != self.c["pad_id"])[:, None, None, :]
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, mask)
        return x, mask

    def decode(self, tgt_in, memory, mask, cache=None, offset=0):
        y = self.embed(tgt_in, offset)
        for i, layer in enumerate(self.decoder):
            y = layer(y, memory, mask, None if cache is None else cache[i])
        return y

    def logits(self, h):
        return F.linear(h, self.embedding)  # h E^T: (B, T, D) -> (B, T, V)

    def forward(self, src, tgt_in):
        memory, mask = self.encode(src)
        return self.logits(self.decode(tgt_in, memory, mask))

    def loss(self, src, tgt_in, tgt_out):
        """Summed label-smoothed cross-entropy over non-padding targets, and their count."""
        return smoothed_cross_entropy(self(src, tgt_in), tgt_out, self.c["label_smoothing"],
                                      self.c["pad_id"], self.c["smoothing"])

    def new_cache(self):
        return [{} for _ in self.decoder]

    @torch.no_grad()
    def load_minitransformer_state(self, arrays):
        """arrays: mapping name -> NumPy array, as ``Module.state_dict()`` / a checkpoint's
        ``model/`` entries (read one at a time, so an npz loads lazily)."""
        own = dict(self.named_parameters())
        for name in list(own):
            ours = name.replace("norm.weight", "norm.gamma").replace("norm.bias", "norm.beta")
            a = torch.from_numpy(np.asarray(arrays[ours]))
            if a.ndim == 2 and name != "embedding":
                a = a.T  # (in, out) -> (out, in)
            if tuple(a.shape) != tuple(own[name].shape):
                raise ValueError(f"{name}: shape {tuple(a.shape)} != {tuple(own[name].shape)}")
            own[name].copy_(a)


class LossOf(nn.Module):
    """The model with ``loss`` as its forward, for DistributedDataParallel (which hooks only
    ``forward``): (src, tgt_in, tgt_out) -> (summed loss, target tokens)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, src, tgt_in, tgt_out):
        return self.model.loss(src, tgt_in, tgt_out)


# ---- decoding --------------------------------------------------------------------------------
def _forbid(scores, c):
    scores[..., c["pad_id"]] = -math.inf
    scores[..., c["bos_id"]] = -math.inf
    return scores


def _select(cache, index):
    for layer in cache:
        for part in layer.values():
            for key in ("k", "v"):
                if key in part:
                    part[key] = part[key].index_select(0, index)


@torch.inference_mode()
def greedy_search(model, src, max_len_a=50):
    """src (B, S) long tensor -> list of B token-id lists (EOS stripped)."""
    model.eval()
    c, dev = model.c, src.device
    B = src.shape[0]
    memory, mask = model.encode(src)
    limit = ((src != c["pad_id"]).sum(1) + max_len_a).tolist()
    cache = model.new_cache()
    alive = np.arange(B)
    out = [[] for _ in range(B)]
    last = torch.full((B, 1), c["bos_id"], dtype=src.dtype, device=dev)
    t = 0
    while len(alive):
        h = model.decode(last, memory, mask, cache=cache, offset=t)
        nxt_t = _forbid(model.logits(h)[:, -1], c).argmax(-1)
        nxt = nxt_t.cpu().numpy()
        t += 1
        keep = []
        for row, (b, tok) in enumerate(zip(alive, nxt)):
            if tok == c["eos_id"]:
                continue
            out[b].append(int(tok))
            if t < limit[b]:
                keep.append(row)
        if len(keep) < len(alive):
            idx = torch.as_tensor(keep, dtype=torch.long, device=dev)
            memory, mask = memory.index_select(0, idx), mask.index_select(0, idx)
            _select(cache, idx)
            alive, nxt_t = alive[keep], nxt_t.index_select(0, idx)
        last = nxt_t[:, None].to(src.dtype)
    return out


def _length_penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


@torch.inference_mode()
def beam_search(model, src, beam=4, alpha=0.6, max_len_a=50):
    """src (B, S) long tensor -> list of B best token-id lists (EOS stripped).

    The scores and the top-2k candidate selection stay on the device (torch.topk over the
    k * V continuations of each sentence); only the 2k candidates per sentence come to the
    host for the bookkeeping of finished hypotheses, as in the package's implementation.
    """
    model.eval()
    c, dev, k = model.c, src.device, beam
    B, eos = src.shape[0], c["eos_id"]
    memory, mask = model.encode(src)
    limit = ((src != c["pad_id"]).sum(1) + max_len_a).tolist()
    rep = torch.arange(B, device=dev).repeat_interleave(k)  # beams of b: rows b*k .. b*k+k-1
    memory, mask = memory.index_select(0, rep), mask.index_select(0, rep)
    cache = model.new_cache()
    alive = np.arange(B)
    tokens = np.zeros((B, k, 0), dtype=np.int64)
    scores = torch.full((B, k), -math.inf, device=dev)
    scores[:, 0] = 0.0
    finished = [[] for _ in range(B)]
    last = torch.full((B * k, 1), c["bos_id"], dtype=src.dtype, device=dev)
    t = 0
    while len(alive):
        h = model.decode(last, memory, mask, cache=cache, offset=t)
        logp = _forbid(F.log_softmax(model.logits(h)[:, -1].float(), dim=-1), c)
        n, V = len(alive), logp.shape[-1]
        cand = (scores[:, :, None] + logp.view(n, k, V)).view(n, k * V)
        top_s, top_i = cand.topk(min(2 * k, k * V), dim=1)  # sorted, best first
        top_s, top_i = top_s.cpu().numpy(), top_i.cpu().numpy()
        t += 1
        new_tokens = np.zeros((n, k, t), dtype=np.int64)
        new_scores = np.full((n, k), -np.inf, dtype=np.float32)
        src_rows = np.zeros((n, k), dtype=np.int64)
        keep_blocks = []
        for i in range(n):
            b, filled = alive[i], 0
            for rank in range(top_i.shape[1]):
                s = top_s[i, rank]
                if not np.isfinite(s):
                    break
                prev, tok = divmod(int(top_i[i, rank]), V)
                if tok == eos:
                    if rank < k:
                        finished[b].append((s / _length_penalty(t - 1, alpha),
                                            tokens[i, prev].tolist()))
                    continue
                if filled < k:
                    new_tokens[i, filled, :-1] = tokens[i, prev]
                    new_tokens[i, filled, -1] = tok
                    new_scores[i, filled], src_rows[i, filled] = s, i * k + prev
                    filled += 1
            if t >= limit[b]:
                lp = _length_penalty(t, alpha)
                finished[b].extend((new_scores[i, j] / lp, new_tokens[i, j].tolist())
                                   for j in range(filled))
            elif len(finished[b]) < k and filled:
                keep_blocks.append(i)
        if not keep_blocks:
            break
        kb = np.array(keep_blocks)
        if len(kb) < n:
            rows = torch.as_tensor((kb[:, None] * k + np.arange(k)).reshape(-1), device=dev)
            memory, mask = memory.index_select(0, rows), mask.index_select(0, rows)
        _select(cache, torch.as_tensor(src_rows[kb].reshape(-1), device=dev))
        alive, tokens = alive[kb], new_tokens[kb]
        scores = torch.as_tensor(new_scores[kb], device=dev)
        last = torch.as_tensor(tokens[:, :, -1].reshape(-1, 1), device=dev).to(src.dtype)
    results = []
    for hyps in finished:
        hyps = sorted(hyps, key=lambda x: -x[0])
        results.append(hyps[0][1] if hyps else [])
    return results
