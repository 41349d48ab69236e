"""Neural-network modules: the layers and the paper's Transformer."""
from .module import Dropout, LayerNorm, Linear, Module, parameter

__all__ = ["Module", "Linear", "LayerNorm", "Dropout", "parameter"]
