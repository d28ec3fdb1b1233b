"""Ending an in-place window inside the Trainer's gradient clipping, where that saves a pass over the gradients.

On the in-place path (`engine/in_place.py`) a window ends by dividing the summed gradients by its items and checking
them: one pass that reads and writes every gradient. The Trainer then clips them (transformers 5 measures the norm
and multiplies even at `max_grad_norm=0`): two passes more. Ended inside the clipping instead
([`GradientAccumulator.finish_window`] with `max_grad_norm`), the division, the check and the clipping share
clipping's two passes, so the gradients are read and written as often as in the stock Trainer. On a CPU the
separate pass was what remained of ResNet-18's gap to the stock Trainer.

Nothing in the Trainer's loop touches `.grad` between a window's last backward and the clipping (a subclass that
overrides `training_step` or the clipping keeps the window's end where it was), and the window still ends before
any optimizer step: a step pre-hook on the optimizer ends a window left pending, exactly when
the sums are untouched, and refuses the step when something changed them (a clipping that did not pass through
this class would have clipped sums, not the mean).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import Trainer

from ..engine.accumulator import GradientAccumulator, WindowResult

CLIPPING_METHODS = ("_clip_grad_norm", "_get_grad_norm")


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under Accelerate's (and other) wrappers: its `step` is the one that runs step hooks."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def window_end_can_wait(trainer_cls: type, gradaccum_cls: type) -> bool:
    """
    Whether a window's end can wait for the Trainer's clipping in `trainer_cls`: its `training_step` is
    `gradaccum_cls`'s (a subclass overriding it may read or change the window's gradients after it returns, e.g.
    `clip_grad_value_`, and must see the mean), and its clipping methods are `gradaccum_cls`'s with only
    `transformers.Trainer`'s after them (a class that overrides them may clip without ending the window first).

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.trainer.window_end import window_end_can_wait
    >>> window_end_can_wait(GradAccumTrainer, GradAccumTrainer)
    True
    >>> class ClipsByValue(GradAccumTrainer):
    ...     def training_step(self, model, inputs, num_items_in_batch=None):
    ...         return super().training_step(model, inputs, num_items_in_batch)
    >>> window_end_can_wait(ClipsByValue, GradAccumTrainer)
    False
    ```
    """
    if next(cls for cls in trainer_cls.__mro__ if "training_step" in vars(cls)) is not gradaccum_cls:
        return False
    for name in CLIPPING_METHODS:
        if not hasattr(Trainer, name):  # a transformers release that clips elsewhere
            return False
        owners = [cls for cls in trainer_cls.__mro__ if name in vars(cls)]
        if owners != [gradaccum_cls, Trainer]:
            return False
    return True


class WindowEndAtClipping:
    """
    Holds a window whose end waits for the Trainer's clipping (`_clip_grad_norm` or `_get_grad_norm`), and ends it
    there with the clipping; a step pre-hook on the optimizer makes sure no step sees a window that did not end.
    """

    def __init__(self, trainer: Trainer, gradaccum_cls: type) -> None:
        # (`trainer` is a `GradAccumTrainer`, whose class is handed in as `gradaccum_cls`: this module sits below it.)
        self.trainer = trainer
        self.gradaccum_cls = gradaccum_cls
        self.pending: GradientAccumulator | None = None
        self._hooked: tuple[torch.optim.Optimizer, Any] | None = None

    def defer(self, accumulator: GradientAccumulator) -> bool:
        """Leave the window's end to the clipping, where that applies; returns whether it was left."""
        trainer = self.trainer
        if not (accumulator.in_place and trainer._training):
            return False
        if trainer.coupled_mode is not None or trainer.moe_mode is not None or trainer._deepspeed_window is not None:
            return False
        if not window_end_can_wait(type(trainer), self.gradaccum_cls):
            return False
        optimizer = _innermost_optimizer(trainer.optimizer)
        if optimizer is None:
            return False
        if self._hooked is None or self._hooked[0] is not optimizer:
            if self._hooked is not None:
                self._hooked[1].remove()
            self._hooked = (optimizer, optimizer.register_step_pre_hook(self._before_optimizer_step))
        self.pending = accumulator
        return True

    def finish(self, max_grad_norm: float | None) -> WindowResult | None:
        """End the pending window (clipped to `max_grad_norm`, if given) and hand its result to `on_window_end`;
        `None` when no window is pending."""
        accumulator, self.pending = self.pending, None
        if accumulator is None:
            return None
        result = accumulator.finish_window(max_grad_norm=max_grad_norm)
        self.trainer.on_window_end(result)
        return result

    def finish_for_clipping(self, max_grad_norm: float | None) -> float | None:
        """The Trainer clips (`max_grad_norm` > 0, or `inf` to measure): end the pending window with it. Returns the
        mean gradient's norm before clipping, or `None` when no window was pending or it was skipped."""
        if max_grad_norm is None or not max_grad_norm > 0:
            max_grad_norm = math.inf
        result = self.finish(max_grad_norm)
        return None if result is None else result.grad_norm

    def discard(self) -> None:
        self.pending = None

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.pending is None:
            return
        try:
            self.finish(None)
        except RuntimeError as err:
            raise RuntimeError(
                "The optimizer was about to step on a window whose gradients are still sums, changed after the "
                "window's last backward (clipped by code that is not GradAccumTrainer's `_clip_grad_norm`?). The step "
                "was refused and the window discarded. GradAccumTrainer ends an in-place window inside the Trainer's "
                "clipping; a class that clips elsewhere needs `accumulation_path='hooks'`."
            ) from err
