"""Softmax and log-softmax over the last axis, numerically stable (max subtracted first)."""
from .. import backend
from .tensor import Function


class Softmax(Function):
    """p = exp(x - max x) / sum exp(x - max x)  (last axis).

    Backward through the saved output: dx = p * (dp - sum(dp * p)).
    """
    options = {}

    def forward(self, x):
        xp = backend.get_array_module(x)
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        e /= e.sum(axis=-1, keepdims=True)
        self.p = e
        return e

    def backward(self, dp):
        p = self.p
        return p * (dp - (dp * p).sum(axis=-1, keepdims=True))


class LogSoftmax(Function):
    """y = x - logsumexp(x)  (last axis), logsumexp = max + log sum exp(x - max).

    Backward: dx = dy - softmax(x) * sum(dy), softmax recomputed as exp(y).
    """
    options = {}

    def forward(self, x):
        xp = backend.get_array_module(x)
        m = x.max(axis=-1, keepdims=True)
        y = x - m
        y -= xp.log(xp.exp(y).sum(axis=-1, keepdims=True))
        self.y = y
        return y

    def backward(self, dy):
        xp = backend.get_array_module(dy)
        return dy - xp.exp(self.y) * dy.sum(axis=-1, keepdims=True)


def softmax(x):
    return Softmax.apply(x)


def log_softmax(x):
    return LogSoftmax.apply(x)
