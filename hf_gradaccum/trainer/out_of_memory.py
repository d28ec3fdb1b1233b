"""`auto_find_batch_size=True` in `GradAccumTrainer`: an out-of-memory error inside a window halves the micro-batch
and redoes the window, keeping the effective batch (the retry itself is the engine's `WindowOOMRetry`); an OOM outside
`training_step`, which the stock loop answers by restarting at a smaller batch, drops the interrupted window."""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer, TrainerCallback

from ..helpers.planning import AccumulationPlan

logger = logging.getLogger(__name__)


def shrink_micro_batch(trainer: Any, current: int) -> int:
    """Halve the micro-batch as [`AccumulationPlan.halved`] does (keeps the effective batch exactly)."""
    micro = trainer.oom_retry.chunk_size or trainer._train_batch_size
    if trainer._run_batch is not None:
        plan = trainer._run_batch.halved(micro)
    else:
        steps = trainer.args.gradient_accumulation_steps * max(1, trainer._train_batch_size // micro)
        plan = AccumulationPlan(
            micro, steps, trainer.args.world_size, micro * steps * trainer.args.world_size
        ).halved()
    trainer.accumulation_plan = plan
    logger.warning(
        "Out of memory: micro-batch now %d x %d accumulation steps (effective batch %d unchanged); redoing "
        "the interrupted window from its first micro-batch.",
        plan.micro_batch_size,
        plan.gradient_accumulation_steps,
        plan.effective_batch_size,
    )
    trainer.log(
        {
            "oom/micro_batch_size": float(plan.micro_batch_size),
            "oom/gradient_accumulation_steps": float(plan.gradient_accumulation_steps),
        }
    )
    return plan.micro_batch_size


def restart_after_oom(trainer: Any) -> None:
    """`on_train_begin`: the stock `find_executable_batch_size` restarted the loop (an OOM outside
    `training_step`) at a smaller `per_device_train_batch_size`: drop the interrupted window and the old chunking."""
    trainer.oom_retry.reset()
    trainer._window_end.discard()
    trainer._window_batches, trainer._micro_index, trainer._window_counts = [], 0, {}
    if trainer.accumulator is not None and trainer.accumulator.micro_steps_in_window:
        trainer.accumulator.discard_window()


class LoopRestartCallback(TrainerCallback):
    """`on_train_begin` runs again when the stock `auto_find_batch_size` restarts the loop at a smaller batch."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._batch_size: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        batch_size = self._trainer._train_batch_size
        if self._batch_size is not None and batch_size != self._batch_size:
            restart_after_oom(self._trainer)
        self._batch_size = batch_size
        return control
