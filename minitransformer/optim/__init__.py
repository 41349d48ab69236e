"""Adam (§5.3), the paper's learning-rate schedule, and gradient clipping by global norm."""
from .adam import Adam, clip_grad_norm, linear_decay_lr, noam_lr

__all__ = ["Adam", "clip_grad_norm", "linear_decay_lr", "noam_lr"]
