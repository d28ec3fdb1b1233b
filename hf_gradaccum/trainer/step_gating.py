"""What a skipped accumulation window (no items, NaN/inf, fp16 overflow) does to the Trainer's counters.

The accumulator never writes a skipped window's update: it leaves every `.grad` at `None`, so `optimizer.step()`
changes neither weights nor optimizer state. Everything else follows the stock Trainer:

- `global_step` advances, losses (NaN included) are logged, and the learning-rate scheduler steps, as the stock
  Trainer does after a non-finite fp32 step;
- with fp16 loss scaling, the optimizer step is reported skipped (`accelerator.optimizer_step_was_skipped`), so the
  Trainer does not step the scheduler, as it does after a `GradScaler` overflow: [`WindowGradScaler`].

`take_back_skipped_steps=True` (opt-in policy) also reports the step skipped without loss scaling and takes back the
`global_step` increment: [`SkippedStepCallback`].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback


class WindowGradScaler(torch.amp.GradScaler):
    """
    A disabled `GradScaler` (the accumulator owns loss scaling, per window, into fp32 buffers) that skips
    `optimizer.step()` after a window the accumulator did not apply. Accelerate's optimizer wrapper then reports the
    step as skipped, exactly as after a stock fp16 overflow, and the Trainer leaves the scheduler alone.

    `Accelerator.backward(loss)` back-propagates `scaler.scale(loss)`: `hand_over` (when given) receives the loss
    there and returns the tensor to back-propagate, which is how the Trainer's own backward reaches the accumulator.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.trainer.step_gating import WindowGradScaler
    >>> param = torch.nn.Parameter(torch.ones(1)); param.grad = torch.ones(1)
    >>> opt = torch.optim.SGD([param], lr=1.0)
    >>> WindowGradScaler("cpu", should_skip=lambda: True).step(opt); param.item()
    1.0
    ```
    """

    def __init__(
        self,
        device: str,
        should_skip: Callable[[], bool],
        hand_over: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(device, enabled=False)
        self._should_skip = should_skip
        self._hand_over = hand_over

    def scale(self, outputs: Any) -> Any:
        if self._hand_over is not None and isinstance(outputs, torch.Tensor):
            return self._hand_over(outputs)
        return super().scale(outputs)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if self._should_skip():
            return None
        return super().step(optimizer, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Bound methods of the trainer, not part of the scaler's state.
        state.pop("_should_skip", None)
        state.pop("_hand_over", None)
        return state


class SkippedStepCallback(TrainerCallback):
    """
    Opt-in (`take_back_skipped_steps=True`). Runs last in `on_step_end`: after a skipped window it takes back the
    `global_step` increment (and the checkpoint or evaluation that the increment may have triggered), so
    `global_step` counts applied optimizer steps only.
    """

    def __init__(self, last_window_applied: Callable[[], bool]) -> None:
        self._last_window_applied = last_window_applied

    def on_step_end(self, args, state, control, **kwargs):
        if self._last_window_applied():
            return control
        reached_max_now = state.global_step >= state.max_steps > state.global_step - 1
        state.global_step -= 1
        control.should_save = False
        control.should_evaluate = False
        if reached_max_now and control.should_training_stop:
            control.should_training_stop = False
        return control
