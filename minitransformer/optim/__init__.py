"""Adam (§5.3), the paper's learning-rate schedule, gradient clipping by global norm, and
dynamic loss scaling for float16 training."""
from .adam import Adam, clip_grad_norm, linear_decay_lr, noam_lr, scale_gradients
from .loss_scale import DynamicLossScaler, LossScaleCollapse

__all__ = ["Adam", "DynamicLossScaler", "LossScaleCollapse", "clip_grad_norm", "linear_decay_lr",
           "noam_lr", "scale_gradients"]
