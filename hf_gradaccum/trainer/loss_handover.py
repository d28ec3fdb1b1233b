"""Where the accumulator's weight reaches each loss in a Trainer: `Accelerator.backward` on the in-place path, the
installed `WindowGradScaler` where the loss must change before its backward (fp16 loss scaling, FSDP2).

On the in-place path (`engine/in_place.py`) each micro-batch's loss is back-propagated times its items. The parents'
`training_step` ends in `self.accelerator.backward(loss)`; for the duration of one micro-batch that call is routed
through the accumulator's `loss_to_backward`, on this Accelerator instance only. No `GradScaler` is installed for it,
so the Trainer's checkpoints and its optimizer wrapper stay exactly the stock Trainer's in fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config.arguments import gradaccum_option
from ..distributed.sharding import trainer_shards_gradients
from ..engine.accumulator import GradientAccumulator
from .step_gating import WindowGradScaler


@contextlib.contextmanager
def backward_through(accelerator: Any, hand_over: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """
    Within the context, `accelerator.backward(loss, **kwargs)` back-propagates `hand_over(loss)` instead of `loss`.

    Example:

    ```python
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from hf_gradaccum.trainer.loss_handover import backward_through
    >>> accelerator, w = Accelerator(cpu=True), torch.ones(1, requires_grad=True)
    >>> with backward_through(accelerator, lambda loss: loss * 3):
    ...     accelerator.backward((w * 2).sum())
    >>> w.grad
    tensor([6.])
    ```
    """
    original = accelerator.backward
    # Nested (a user's override around a micro-batch that routes its own): the outer one is put back on exit.
    outer = accelerator.__dict__.get("backward")

    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        return original(hand_over(loss), **kwargs)

    accelerator.backward = backward
    try:
        yield
    finally:
        if outer is None:
            del accelerator.backward  # the class's method again
        else:
            accelerator.backward = outer


def install_window_scaler(trainer: Any, accumulator: GradientAccumulator | None = None) -> None:
    """
    Install `WindowGradScaler` where it is needed: Accelerate back-propagates `scaler.scale(loss)`, so it is where
    the accumulator changes a loss before its backward (fp16 loss scaling; FSDP2's item weight), and its `step`
    reports a skipped window's optimizer step as skipped (loss scaling; `take_back_skipped_steps`), as a stock
    GradScaler does after an overflow. Otherwise (fp32, replicated buffers) the Accelerator keeps no scaler, as
    in the stock Trainer: the parent's backward of its own loss is what the accumulator folds. Installed again if
    the Accelerator was re-created (a hyperparameter search does).
    """
    # Asked at every micro-batch: decided once per (Accelerator, accumulator), since the answer reads every
    # parameter (`trainer_shards_gradients`).
    decided = trainer._handover_decided
    if decided is not None and decided[0] is trainer.accelerator and decided[1] is accumulator:
        return
    trainer._handover_decided = (trainer.accelerator, accumulator)
    loss_scaling = trainer.args.fp16 or (trainer.args.bf16 and gradaccum_option(trainer.args, "bf16_loss_scaling"))
    # At construction, before any checkpoint is resumed: the Trainer saves and loads `scaler.pt` when the
    # Accelerator has a scaler, so it must be there from the start whenever it is there at all.
    needed = (
        loss_scaling
        or gradaccum_option(trainer.args, "take_back_skipped_steps")
        or trainer_shards_gradients(trainer)
        or (accumulator is not None and not accumulator.loss_factor_is_one and not accumulator.in_place)
    )
    if not needed or trainer._deepspeed_window is not None or isinstance(trainer.accelerator.scaler, WindowGradScaler):
        return
    if trainer.accelerator.gradient_accumulation_steps != 1:
        # Accelerate would divide each loss by its own steps before handing it over.
        raise RuntimeError(
            "GradAccumTrainer needs the Trainer's Accelerator at `gradient_accumulation_steps=1` (the Trainer "
            f"creates it so), got {trainer.accelerator.gradient_accumulation_steps}."
        )
    # Disabled: the accumulator owns loss scaling (per window, unscaled into the fp32 buffers); Accelerate's
    # autocast stays and its unscale calls are no-ops.
    trainer.accelerator.scaler = WindowGradScaler(
        trainer.accelerator.device.type,
        should_skip=trainer._optimizer_step_must_be_skipped,
        hand_over=trainer._loss_to_backward,
    )
