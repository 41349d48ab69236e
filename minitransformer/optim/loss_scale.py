"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision Training").

float16 has 5 exponent bits: values below about 6e-8 flush to 0 and values above 65504 become
inf. Many small gradients of a Transformer fall below that floor, so backward starts from
dL * S instead of dL (every gradient is multiplied by the loss scale S) and the float32
master gradients are divided by S again before the optimizer sees them:

    loss.backward(S);   g = g_scaled / S;   if any g is inf or NaN: skip the update, S /= 2
                                            else: Adam step; after W finite updates in a row S *= 2

So S settles just below the largest value that does not overflow. A run whose gradients
overflow even at a tiny S has diverged (or needs float32): S falling below ``min_scale`` stops
it with an error saying so (``LossScaleCollapse``), instead of skipping every update silently.
"""
import math


class LossScaleCollapse(FloatingPointError):
    """The loss scale fell below its minimum: gradients overflow float16 even unscaled."""


class DynamicLossScaler:
    """scale: the current S; growth_interval: W; min_scale: below it, ``update`` raises.

    The default first S, 2^7, suits a loss *summed* over a batch's tokens (as train.py's):
    its gradients are already a few thousand times those of a per-token mean.
    """

    def __init__(self, init_scale=2.0 ** 7, factor=2.0, growth_interval=2000,
                 min_scale=2.0 ** -14):
        if not init_scale > 0 or not factor > 1 or growth_interval < 1 or not min_scale > 0:
            raise ValueError(f"loss scaling needs init_scale > 0, factor > 1, growth_interval "
                             f">= 1 and min_scale > 0 (got {init_scale}, {factor}, "
                             f"{growth_interval}, {min_scale})")
        self.scale, self.factor = float(init_scale), float(factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.good_steps = 0  # finite updates since the last change of scale
        self.skipped_in_a_row = 0
        self.skipped_total = 0

    def unscale_(self, grads, multiplier=1.0):
        """Multiply every gradient in place by multiplier / S. -> True when all are finite.

        The check is one dot product a gradient (g . g is inf or NaN exactly when some
        entry is, or when the sum itself overflows, which is also a gradient to distrust),
        summed on the device, so a GPU run synchronises once.
        """
        grads = [g for g in grads if g is not None]
        if not grads:
            return True
        f = multiplier / self.scale
        total = 0.0
        for g in grads:
            g *= g.dtype.type(f)
            flat = g.ravel()
            total = total + flat @ flat
        return math.isfinite(float(total))

    def update(self, finite):
        """Adjust S after an update whose gradients were (not) finite."""
        if finite:
            self.skipped_in_a_row = 0
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.factor
                self.good_steps = 0
            return
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        self.good_steps = 0
        self.scale /= self.factor
        if self.scale < self.min_scale:
            raise LossScaleCollapse(
                f"float16 training: the loss scale fell to {self.scale:g}, below its minimum "
                f"{self.min_scale:g}, after {self.skipped_in_a_row} updates in a row whose "
                "gradients overflowed float16 (inf or NaN). The run has diverged or does not "
                "fit float16's range: resume from the last checkpoint with a smaller "
                "--lr-factor or with --clip-norm, or train in float32 (--precision float32)")

    def state_dict(self):
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_in_a_row": self.skipped_in_a_row, "skipped_total": self.skipped_total}

    def load_state_dict(self, state):
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
