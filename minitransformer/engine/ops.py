"""Primitive Functions: each op's forward and backward side by side, on raw arrays.

Shape letters used throughout the package: B batch, S source length, T target length,
D d_model, H heads, K = D / H, F d_ff, V vocabulary, N = B * T tokens.
Broadcasting: backward returns the gradient in the *output* shape; the engine sums it back
to each input's shape (``tensor.unbroadcast``), in one place.
"""
import numpy as np

from .. import backend
from .tensor import Function, Tensor, as_tensor


def _xp(*arrays):
    return backend.get_array_module(*arrays)


def _pair(a, b):
    """Two tensors, a Python number taking the other's dtype and device (no promotion of a
    float tensor; an integer or bool one is promoted as NumPy promotes: ``as_tensor``)."""
    if not isinstance(a, Tensor):
        a = as_tensor(a, like=b)
    if not isinstance(b, Tensor):
        b = as_tensor(b, like=a)
    return a, b


# ---- elementwise arithmetic ---------------------------------------------------------------
class Add(Function):
    """y = a + b;  da = dy, db = dy (broadcast axes summed by the engine)."""
    options = {}

    def forward(self, a, b):
        return a + b

    def backward(self, dy):
        return dy, dy


class Sub(Function):
    """y = a - b;  da = dy, db = -dy."""
    options = {}

    def forward(self, a, b):
        return a - b

    def backward(self, dy):
        return dy, -dy


class Mul(Function):
    """y = a * b;  da = dy * b, db = dy * a."""
    options = {}

    def forward(self, a, b):
        self.a, self.b = a, b
        return a * b

    def backward(self, dy):
        return dy * self.b, dy * self.a


class Div(Function):
    """y = a / b;  da = dy / b, db = -dy * a / b^2 = -dy * y / b."""
    options = {}

    def forward(self, a, b):
        self.b = b
        self.y = a / b
        return self.y

    def backward(self, dy):
        da = dy / self.b
        return da, -da * self.y


class Neg(Function):
    """y = -x;  dx = -dy."""
    options = {}

    def forward(self, x):
        return -x

    def backward(self, dy):
        return -dy


class Power(Function):
    """y = x^a for a constant exponent a;  dx = dy * a * x^(a-1).

    The exponent is kept as a Python number, which never promotes x's dtype (a NumPy float64
    would).
    """
    options = {"exponent": None}

    def forward(self, x):
        self.x = x
        a = self.exponent
        self.exponent = a.item() if hasattr(a, "item") else a
        return x ** self.exponent

    def backward(self, dy):
        return dy * (self.exponent * self.x ** (self.exponent - 1))


class Exp(Function):
    """y = exp(x);  dx = dy * y (saves the output)."""
    options = {}

    def forward(self, x):
        self.y = _xp(x).exp(x)
        return self.y

    def backward(self, dy):
        return dy * self.y


class Log(Function):
    """y = log(x);  dx = dy / x."""
    options = {}

    def forward(self, x):
        self.x = x
        return _xp(x).log(x)

    def backward(self, dy):
        return dy / self.x


class ReLU(Function):
    """y = max(0, x);  dx = dy * [y > 0] (saves the output, as the mask)."""
    options = {}

    def forward(self, x):
        self.y = _xp(x).maximum(x, 0)
        return self.y

    def backward(self, dy):
        return dy * (self.y > 0)


# ---- reductions and shape -----------------------------------------------------------------
class Sum(Function):
    """y = sum(x, axis);  dx = dy broadcast back over the summed axes. A float16 x is
    summed in float32 (``backend.accumulation_dtype``: float16 stops adding 0.05s at 128)
    and y rounded back to float16."""
    options = {"axis": None, "keepdims": False}

    def forward(self, x):
        self.shape = x.shape
        return backend.sum_in_accumulation_dtype(x, axis=self.axis, keepdims=self.keepdims)

    def backward(self, dy):
        xp = _xp(dy)
        if not self.keepdims and self.axis is not None:
            axes = (self.axis,) if isinstance(self.axis, int) else self.axis
            dy = xp.expand_dims(dy, tuple(a % len(self.shape) for a in axes))
        return xp.broadcast_to(dy, self.shape)


class Mean(Function):
    """y = mean(x, axis);  dx = dy / n broadcast back (n = number of averaged elements)."""
    options = {"axis": None, "keepdims": False}

    def forward(self, x):
        self.shape = x.shape
        y = x.mean(axis=self.axis, keepdims=self.keepdims)
        self.n = x.size // max(y.size, 1)
        return y

    def backward(self, dy):
        xp = _xp(dy)
        if not self.keepdims and self.axis is not None:
            axes = (self.axis,) if isinstance(self.axis, int) else self.axis
            dy = xp.expand_dims(dy, tuple(a % len(self.shape) for a in axes))
        return xp.broadcast_to(dy / self.n, self.shape)


class Reshape(Function):
    """y = x.reshape(shape);  dx = dy.reshape(x.shape)."""
    options = {"new_shape": None}

    def forward(self, x):
        self.in_shape = x.shape
        return x.reshape(self.new_shape)

    def backward(self, dy):
        return dy.reshape(self.in_shape)


class Transpose(Function):
    """y = x.transpose(axes);  dx = dy.transpose(inverse(axes))."""
    options = {"axes": None}

    def forward(self, x):
        self.axes_ = self.axes if self.axes is not None else tuple(reversed(range(x.ndim)))
        return x.transpose(self.axes_)

    def backward(self, dy):
        inverse = [0] * len(self.axes_)
        for i, a in enumerate(self.axes_):
            inverse[a] = i
        return dy.transpose(inverse)


class SplitHeads(Function):
    """(B, T, D) -> (B, H, T, K), K = D / H: head_i takes features [i*K, (i+1)*K).

    dx = dy transposed back and merged. A contiguous copy is made so the following
    batched matmuls run on dense blocks.
    """
    options = {"n_heads": None}

    def forward(self, x):
        B, T, D = x.shape
        y = x.reshape(B, T, self.n_heads, D // self.n_heads).transpose(0, 2, 1, 3)
        return _xp(x).ascontiguousarray(y)

    def backward(self, dy):
        B, H, T, K = dy.shape
        return dy.transpose(0, 2, 1, 3).reshape(B, T, H * K)


class MergeHeads(Function):
    """(B, H, T, K) -> (B, T, D): Concat(head_1, ..., head_h) of the paper (§3.2.2)."""
    options = {"n_heads": None}

    def forward(self, x):
        B, H, T, K = x.shape
        return x.transpose(0, 2, 1, 3).reshape(B, T, H * K)

    def backward(self, dy):
        B, T, D = dy.shape
        y = dy.reshape(B, T, self.n_heads, D // self.n_heads).transpose(0, 2, 1, 3)
        return _xp(dy).ascontiguousarray(y)


# ---- linear algebra -----------------------------------------------------------------------
class MatMul(Function):
    """y = a @ b (batched over leading axes);  da = dy @ b^T, db = a^T @ dy."""
    options = {}

    def forward(self, a, b):
        self.a, self.b = a, b
        return a @ b

    def backward(self, dy):
        a, b = self.a, self.b
        if b.ndim == 1:  # matrix @ vector
            db = backend.sum_in_accumulation_dtype((a * dy[..., None]).reshape(-1, b.shape[0]),
                                                   axis=0)
            return dy[..., None] * b, db
        if a.ndim == 1:
            return (b @ dy[..., None])[..., 0], a[:, None] * dy[..., None, :]
        return dy @ b.swapaxes(-1, -2), a.swapaxes(-1, -2) @ dy


class Linear(Function):
    """y = x W + b for x (..., Din), W (Din, Dout), b (Dout,) or None.

    Runs as one 2-D GEMM over all N = prod(...) rows.
    dx = dy W^T;  dW = x^T dy;  db = sum_n dy.
    The output has x's dtype; b may be wider (float32 with float16 x and W under mixed
    precision): it is added in place, and db is summed in b's dtype.
    """
    options = {}

    def forward(self, x, w, b=None):
        self.x, self.w = x, w
        self.b_dtype = None if b is None else b.dtype
        return affine(x, w, b)

    def backward(self, dy):
        x, w = self.x, self.w
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ w.T).reshape(x.shape)
        dw = x.reshape(-1, x.shape[-1]).T @ dy2
        if self.b_dtype is None:
            return dx, dw
        return dx, dw, dy2.sum(axis=0, dtype=self.b_dtype)


# ---- precision -----------------------------------------------------------------------------
class Cast(Function):
    """y = x converted to ``dtype``;  dx = dy converted back to x's dtype.

    Mixed precision (nn/transformer.py, ``compute_dtype``) puts one in front of each
    float32 weight that enters a float16 product, so the product runs in float16 while the
    gradient lands, in float32, on the float32 master weight.
    """
    options = {"dtype": None}

    def forward(self, x):
        self.in_dtype = x.dtype
        return x.astype(self.dtype)

    def backward(self, dy):
        return dy.astype(self.in_dtype)


# ---- regularisation and lookup ------------------------------------------------------------
class Dropout(Function):
    """y = x * m / (1 - r), m ~ Bernoulli(1 - r) for the rate r, drawn from an explicit
    generator;  dx = dy * m / (1 - r).

    The scaled mask is saved (one array of x's shape and dtype).
    """
    options = {"rate": 0.0, "rng": None}

    def forward(self, x):
        note_dropout(self.rate)
        keep = self.rng.random(x.shape, x.dtype) >= self.rate
        self.mask = keep * x.dtype.type(1.0 / (1.0 - self.rate))
        return x * self.mask

    def backward(self, dy):
        return dy * self.mask


class Embedding(Function):
    """y[n] = W[ids[n]] for integer ids (...,) and table W (V, D) -> (..., D).

    dW = scatter-add of dy rows into the rows named by ids (repeats summed); the padding
    row receives none from the look-up (with shared embeddings the pre-softmax projection,
    whose padding class has a probability, still trains that row). ids get no gradient.
    """
    options = {"pad_id": None}

    def forward(self, ids, weight):
        self.ids, self.vocab = ids, weight.shape
        return weight[ids]

    def backward(self, dy):
        xp = _xp(dy)
        dw = xp.zeros(self.vocab, dtype=dy.dtype)
        backend.scatter_add(dw, self.ids.reshape(-1), dy.reshape(-1, self.vocab[1]))
        if self.pad_id is not None:
            dw[self.pad_id] = 0
        return None, dw


class Index(Function):
    """y = x[index] (NumPy's indexing: integers, slices, None, ..., integer or bool arrays);
    dx = zeros with dy added at the indexed places (repeated places summed)."""
    options = {"index": None}

    def forward(self, x):
        self.shape = x.shape
        return x[self.index]

    def backward(self, dy):
        xp = _xp(dy)
        dx = xp.zeros(self.shape, dtype=dy.dtype)
        parts = self.index if isinstance(self.index, tuple) else (self.index,)
        if all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts):
            dx[self.index] = dy  # (a view: each place once)
        else:
            backend.scatter_add(dx, self.index, dy)
        return dx


# ---- functional API: what models call -----------------------------------------------------
def add(a, b): return Add.apply(*_pair(a, b))
def sub(a, b): return Sub.apply(*_pair(a, b))
def mul(a, b): return Mul.apply(*_pair(a, b))
def div(a, b): return Div.apply(*_pair(a, b))
def neg(x): return Neg.apply(x)
def power(x, exponent):
    if isinstance(exponent, Tensor):
        if exponent.requires_grad:  # (Power differentiates x only: no gradient would reach it)
            raise TypeError("x ** t: the exponent t is a Tensor that requires grad, but Power "
                            "takes a constant exponent (its gradient would be lost); for a "
                            "gradient in t write (t * x.log()).exp()")
        exponent = exponent.item()
    return Power.apply(x, exponent=exponent)
def exp(x): return Exp.apply(x)
def log(x): return Log.apply(x)
def relu(x): return ReLU.apply(x)
def sum(x, axis=None, keepdims=False): return Sum.apply(x, axis=axis, keepdims=keepdims)  # noqa: A001
def mean(x, axis=None, keepdims=False): return Mean.apply(x, axis=axis, keepdims=keepdims)
def reshape(x, shape): return Reshape.apply(x, new_shape=tuple(shape))
def transpose(x, axes=None): return Transpose.apply(x, axes=None if axes is None else tuple(axes))
def split_heads(x, n_heads): return SplitHeads.apply(x, n_heads=n_heads)
def merge_heads(x, n_heads): return MergeHeads.apply(x, n_heads=n_heads)
def matmul(a, b): return MatMul.apply(*_pair(a, b))


def index(x, idx):
    """x[idx] (x a Tensor) with its gradient; Tensors in idx are taken as their arrays."""
    xp = x.xp

    def own(i):  # (index arrays on x's device: CuPy's scatter-add takes its own arrays)
        i = i.data if isinstance(i, Tensor) else i
        return xp.asarray(i) if isinstance(i, (list, np.ndarray)) and xp is not np else i

    idx = tuple(own(i) for i in idx) if isinstance(idx, tuple) else own(idx)
    return Index.apply(x, index=idx)


def cast(x, dtype):
    """x as ``dtype`` (a Cast node on the tape, also when the dtype is already x's)."""
    return Cast.apply(x, dtype=np.dtype(dtype))


def affine(x, w, b=None):
    """Linear's forward arithmetic on arrays: x (..., Din) @ w (Din, Dout) + b, as one 2-D
    GEMM over all rows, b added in place (in y's dtype)."""
    y = x.reshape(-1, x.shape[-1]) @ w
    if b is not None:
        y += b
    return y.reshape(x.shape[:-1] + (w.shape[1],))


def linear(x, weight, bias=None):
    """x (..., Din) @ weight (Din, Dout) + bias (Dout,)."""
    return Linear.apply(x, weight, bias) if bias is not None else Linear.apply(x, weight)


def dropout(x, rate, rng, training=True):
    """Inverted dropout with rate ``rate``, masks drawn from ``rng`` (a backend.Generator)."""
    if not dropout_active(rate, training):
        return x
    return Dropout.apply(x, rate=rate, rng=rng)


# rate -> how many dropout masks have been drawn at it, counted by every Function that draws
# one; gradcheck compares two snapshots to tell that dropout was on during its evaluations
_dropout_draws = {}


def note_dropout(rate):
    """Count one dropout mask drawn at ``rate`` (a dict update, no arithmetic on arrays)."""
    _dropout_draws[float(rate)] = _dropout_draws.get(float(rate), 0) + 1


def dropout_draws():
    """A snapshot {rate: masks drawn so far} of the counts ``note_dropout`` keeps."""
    return dict(_dropout_draws)


def dropout_active(rate, training):
    """Whether dropout at ``rate`` changes anything (training and rate > 0); a rate outside
    [0, 1) is an error."""
    if not training or rate == 0.0:
        return False
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return True


def embedding(ids, weight, pad_id=None):
    """Rows of ``weight`` (V, D) for integer ``ids``; the padding row gets no gradient from
    the look-up."""
    ids = ids.data if isinstance(ids, Tensor) else ids
    return Embedding.apply(Tensor(ids), weight, pad_id=pad_id)
