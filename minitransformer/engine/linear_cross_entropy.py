"""Pre-softmax projection and label-smoothed cross-entropy, fused: one node on the tape.

For decoder states h (N, D), the output weight W and targets t (N,), the loss is
    z = h W^T                                 logits (N, V); W is (V, D), e.g. the shared
                                              embedding (§3.4), or (D, V) with layout="dv"
    loss = sum over non-padding n of  lse(z_n) - c_o * sum_v z_nv - (c_t - c_o) * z_n,t_n
exactly as in ``cross_entropy.py`` (same smoothing weights c_t, c_o).
Its gradient is known as soon as the logits are: with dz = (softmax(z) - q) * [t != pad],
    dh = dz W,    dW = dz^T h        (for layout "dv": dh = dz W^T, dW = h^T dz)
so the forward pass walks the rows in chunks, computes each chunk's logits, loss and dz,
folds dz into dh and dW, and frees it: the (N, V) logits never exist all at once, which is
the largest block of memory of a small model. Backward only scales dh and dW by the
upstream gradient. Under no_grad (validation) the gradient part is skipped.
The result equals ``softmax_cross_entropy(linear(h, W^T), t)`` (tested in test_fused.py).
With float16 h and W (mixed precision) the products run in float16 and everything between
them (max, exp, sums, the loss) in float32; the loss comes back in float32, dh and dW in
float16. On CuPy arrays each chunk's max, exp, sums and e' are one fused kernel
(cuda_kernels.smoothed_ce_chunk).
"""
import numpy as np

from .. import backend
from . import cuda_kernels
from .cross_entropy import checked_targets, smoothing_weights
from .tensor import Function, Tensor, is_grad_enabled

CHUNK_ELEMENTS = 1 << 22  # logits per chunk on a CPU (16 MiB in float32)
# On a GPU each chunk costs some 25 kernel launches from Python whatever its size, so chunks
# are larger there (256 MiB in float32): a base model's 12000 x 37000 logits take 7 chunks
# instead of 107, and the products stay large enough to fill the GPU.
GPU_CHUNK_ELEMENTS = 1 << 26


def smoothed_ce_chunk(z, t, valid, c_t, c_o, want_grad, z_sum):
    """One chunk of rows: logits z (n, V), targets t (n,) (padding rows hold class 0), valid
    (n,), z_sum (n,) the row sums of z. Per row, in the accumulation dtype:
        m = max z,  e = exp(z - m),  s = sum e,  lse = m + log s,
        row_loss = (lse - c_o * z_sum - (c_t - c_o) * z_t) * valid
    -> (row_loss, s, e') with e' = e - (c_t - c_o) * s * onehot(t) when ``want_grad`` (what
    the gradient needs; e' reuses z's memory where it can). The NumPy twin of
    cuda_kernels.smoothed_ce_chunk, which computes the same in one CUDA block per row."""
    xp = backend.get_array_module(z)
    acc = backend.accumulation_dtype(z.dtype)
    z = backend.cast(z, acc)
    r = xp.arange(z.shape[0])
    z_t = z[r, t]
    m = z.max(axis=1, keepdims=True)
    z -= m
    xp.exp(z, out=z)  # z is now e = exp(z - max)
    s = z.sum(axis=1)
    lse = m[:, 0] + xp.log(s)
    row_loss = (lse - c_o * z_sum - (c_t - c_o) * z_t) * valid
    if want_grad:
        z[r, t] -= acc.type(c_t - c_o) * s  # z is now e'
    return row_loss, s, z


def _fused_chunk(z, t, valid, c_t, c_o, want_grad, z_sum):
    """smoothed_ce_chunk as one CUDA kernel: e' is written over z in z's dtype."""
    row_loss, s = cuda_kernels.smoothed_ce_chunk(z, t, valid, c_t, c_o, want_grad, z_sum=z_sum)
    return row_loss, s, z


class LinearCrossEntropy(Function):
    """The summed smoothed loss of the logits h W^T (the module docstring): h (..., D),
    w (V, D) (``layout`` "vd") or (D, V) ("dv"), targets t (...) -> a scalar. Options:
    ``label_smoothing``, ``pad_id``, ``smoothing`` ("others" / "uniform"),
    ``layout``, ``compute_grad`` (False under no_grad: the loss only). Saves dh and dw,
    computed during the forward chunk by chunk; backward scales them by dloss."""

    options = {"label_smoothing": 0.0, "pad_id": None, "smoothing": "others", "layout": "vd",
               "compute_grad": True}

    def forward(self, h, w, t):
        xp = backend.get_array_module(h)
        D = h.shape[-1]
        h2, t = h.reshape(-1, D), t.reshape(-1)
        dv = self.layout == "dv"
        V = w.shape[1] if dv else w.shape[0]
        c_t, c_o = smoothing_weights(self.label_smoothing, V, self.smoothing)
        acc = backend.accumulation_dtype(h.dtype)  # h's dtype, or float32 for float16
        valid = (t != self.pad_id) if self.pad_id is not None else xp.ones(t.shape, bool)
        tc = xp.where(valid, t, 0)
        if self.compute_grad:
            self.dh = xp.empty_like(h2)
            self.dw = xp.zeros(w.shape, acc)
        total = xp.zeros((), dtype=acc)
        # sum_v z_nv = h_n . w_sum with w_sum = sum_v W_v: the smoothing term's row sums
        # (and, below, its gradient) without a pass over the logits
        w_sum = w.sum(axis=1, dtype=acc) if dv else w.sum(axis=0, dtype=acc)  # (D,)
        h_sum = xp.zeros_like(w_sum)  # sum of h_n over non-padding rows
        rows = max(1, (CHUNK_ELEMENTS if xp is np else GPU_CHUNK_ELEMENTS) // V)
        chunk_loss = _fused_chunk if cuda_kernels.use_for(xp) else smoothed_ce_chunk
        for a in range(0, h2.shape[0], rows):
            hc, tcc, vc = h2[a:a + rows], tc[a:a + rows], valid[a:a + rows]
            z = hc @ w if dv else hc @ w.T  # (n, V)
            hc = backend.cast(hc, acc)
            row_loss, s, e = chunk_loss(z, tcc, vc, c_t, c_o, self.compute_grad, hc @ w_sum)
            total += row_loss.sum()
            if self.compute_grad:
                self._fold_gradient(a, hc, vc, s, e, w, w_sum, c_o, dv)
                h_sum += (hc * vc[:, None]).sum(axis=0)
        if self.compute_grad:
            c = acc.type(c_o)
            self.dw -= (c * h_sum)[:, None] if dv else c * h_sum  # the c_o term of dW
        self.h_shape, self.w_dtype = h.shape, w.dtype
        return total

    def _fold_gradient(self, a, hc, vc, s, e, w, w_sum, c_o, dv):
        """Fold the chunk of rows a.. (states hc, validity vc, sums s, e') into dh and dW:
            dz = [valid] * (e / s - c_o - (c_t - c_o) * onehot(t))
               = [valid] / s * e' - [valid] * c_o,   e' = e - (c_t - c_o) * s * onehot(t),
        so the row scale [valid] / s and the constant c_o go into the (n, D) side of the
        products: dh = scale * (e' W) - [valid] c_o w_sum,  dW = e'^T (scale * h) (the c_o
        term of dW, c_o * (sum of valid h_n) for every row v, is subtracted at the end)."""
        acc, dtype = hc.dtype, self.dh.dtype
        scale = (vc / s).astype(acc)[:, None]  # (n, 1); 0 on padding rows
        e = backend.cast(e, dtype)  # the products in h's dtype
        self.dh[a:a + len(hc)] = (e @ (w.T if dv else w)) * scale \
            - acc.type(c_o) * vc[:, None] * w_sum
        hs = backend.cast(hc * scale, dtype)
        self.dw += (hs.T @ e) if dv else (e.T @ hs)

    def backward(self, dloss):
        # the scaling in the wider dtype: a float16 run's loss scale need not fit float16
        # itself (65504 at most); the scaled gradients then overflow only if they really do
        g = dloss.astype(self.dw.dtype)
        dh = backend.cast(self.dh * g, self.dh.dtype).reshape(self.h_shape)
        return dh, backend.cast(self.dw * g, self.w_dtype), None


def linear_cross_entropy(h, weight, targets, label_smoothing=0.0, pad_id=None,
                         smoothing="others", layout="vd"):
    """Summed label-smoothed cross-entropy of the logits h W^T (layout 'vd', W (V, D)) or
    h W (layout 'dv', W (D, V)), without materialising them. -> (loss_sum, n_tokens)."""
    V = weight.shape[1] if layout == "dv" else weight.shape[0]
    t, n = checked_targets(targets, h.shape[:-1], V, pad_id, h.xp, "decoder states")
    compute_grad = is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    loss = LinearCrossEntropy.apply(h, weight, Tensor(t),
                                    label_smoothing=float(label_smoothing), pad_id=pad_id,
                                    smoothing=smoothing, layout=layout, compute_grad=compute_grad)
    return loss, n
