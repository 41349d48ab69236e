"""The functional API in one namespace: ``import minitransformer.functional as F``."""
from .engine.attention import attention_probabilities, scaled_dot_product_attention  # noqa: F401
from .engine.cross_entropy import softmax_cross_entropy  # noqa: F401
from .engine.layernorm import layer_norm  # noqa: F401
from .engine.linear_cross_entropy import linear_cross_entropy  # noqa: F401
from .engine.ops import (add, cast, div, dropout, embedding, exp, linear, log,  # noqa: F401
                         matmul, mean, merge_heads, mul, neg, power, relu, reshape, split_heads,
                         sub, sum, transpose)
from .engine.residual import dropout_residual  # noqa: F401
from .engine.softmax import log_softmax, softmax  # noqa: F401
