"""`DynamicLossScaler`: fp16 dynamic loss scaling that the accumulator owns, so overflows are decided per window
(or per micro-batch, for the `"recompute"` policy) instead of per `optimizer.step()`.

The arithmetic is the one of `torch.amp.GradScaler` (multiply the loss by `scale`, back off by `backoff_factor` on
overflow, grow by `growth_factor` after `growth_interval` clean steps). It is re-implemented in a few lines because
GradScaler unscales `.grad` at `optimizer.step()` time; here gradients are unscaled while they are folded into the
fp32 accumulation buffers, and the overflow decision is needed per micro-batch.
"""

from __future__ import annotations

import math
from typing import Any


class DynamicLossScaler:
    """
    Dynamic loss scale for fp16 training.

    Args:
        init_scale (`float`, *optional*, defaults to 2**16): initial scale.
        growth_factor (`float`, *optional*, defaults to 2.0): multiplier after `growth_interval` clean steps; > 1.
        backoff_factor (`float`, *optional*, defaults to 0.5): multiplier on overflow; in (0, 1).
        growth_interval (`int`, *optional*, defaults to 2000): clean steps between growths; >= 1.
        min_scale (`float`, *optional*, defaults to 1.0): the scale never backs off below this; an overflow at
            the minimum scale is a real inf/NaN, not a scaling problem.

    Example:

    ```python
    >>> from hf_gradaccum import DynamicLossScaler
    >>> scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=2)
    >>> scaler.update(found_inf=True); scaler.scale
    512.0
    >>> scaler.update(found_inf=False); scaler.update(found_inf=False); scaler.scale
    1024.0
    ```
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        validate_loss_scaling(init_scale, growth_factor, backoff_factor, growth_interval)
        if not (isinstance(min_scale, (int, float)) and 0 < min_scale <= init_scale):
            raise ValueError(f"`min_scale` must be in (0, init_scale={init_scale}], got {min_scale!r}.")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.growth_tracker = 0
        self.num_overflows = 0

    @property
    def at_min_scale(self) -> bool:
        """Whether another backoff would go below `min_scale`."""
        return self.scale <= self.min_scale

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; count a clean step and grow after `growth_interval` of them."""
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            self.num_overflows += 1
        else:
            self.growth_tracker += 1
            if self.growth_tracker >= self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "growth_tracker": self.growth_tracker,
            "num_overflows": self.num_overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.num_overflows = int(state.get("num_overflows", 0))

    def __repr__(self) -> str:
        return f"DynamicLossScaler(scale={self.scale:g}, growth_tracker={self.growth_tracker})"


def validate_loss_scaling(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
    """Raise a `ValueError` naming the first invalid loss-scaling argument."""
    if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale) and init_scale > 0):
        raise ValueError(f"`loss_scale_init` (init_scale) must be a finite number > 0, got {init_scale!r}.")
    if not (isinstance(growth_factor, (int, float)) and math.isfinite(growth_factor) and growth_factor > 1):
        raise ValueError(f"`loss_scale_growth_factor` must be a finite number > 1, got {growth_factor!r}.")
    if not (isinstance(backoff_factor, (int, float)) and 0 < backoff_factor < 1):
        raise ValueError(f"`loss_scale_backoff_factor` must be in the open interval (0, 1), got {backoff_factor!r}.")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"`loss_scale_growth_interval` must be an integer >= 1, got {growth_interval!r}.")
