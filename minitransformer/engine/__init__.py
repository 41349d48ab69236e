"""The engine: Tensor and tape, the Functions (forward and backward side by side), gradcheck."""
from .anomaly import AnomalyError, detect_anomaly
from .attention import ScaledDotProductAttention, scaled_dot_product_attention
from .cross_entropy import SoftmaxCrossEntropy, softmax_cross_entropy
from .profiler import Profiler, profile
from .gradcheck import GradcheckError, gradcheck
from .layernorm import LayerNorm, layer_norm
from .linear_cross_entropy import LinearCrossEntropy, linear_cross_entropy
from .ops import (Add, Cast, Div, Dropout, Embedding, Exp, Index, Linear, Log, MatMul, Mean,
                  MergeHeads, Mul, Neg, Power, ReLU, Reshape, SplitHeads, Sub, Sum, Transpose,
                  add, cast, div, dropout, embedding, exp, index, linear, log, matmul, mean,
                  merge_heads, mul, neg, power, relu, reshape, split_heads, sub, sum, transpose)
from .residual import DropoutResidual, dropout_residual
from .softmax import LogSoftmax, Softmax, log_softmax, softmax
from .tensor import Function, Tensor, is_grad_enabled, no_grad

FUNCTIONS = [Add, Sub, Mul, Div, Neg, Power, Exp, Log, ReLU, Sum, Mean, Reshape, Transpose, Index,
             SplitHeads, MergeHeads, MatMul, Linear, Cast, Dropout, Embedding, Softmax,
             LogSoftmax, LayerNorm, DropoutResidual, ScaledDotProductAttention, SoftmaxCrossEntropy,
             LinearCrossEntropy]
