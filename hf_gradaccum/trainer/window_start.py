"""What starts with each prefetched window (and where a micro-batch sits in it), before its first micro-batch: the window's loss log, and every statistic
a loss needs over the whole window rather than per micro-batch (each computed once, forward-only where it runs the
model): the loss terms' counts, GRPO's entropy quantile, DPO's sort, DeepSpeed's window items, KTO's baseline, the
MoE router statistics and the coupled mode's representations; and the first-window checks (an unknown composition,
`verify_accumulation`)."""

from __future__ import annotations

import functools
from typing import Any

from ..integrations.registry import unknown_composition_error
from ..losses.accumulation_check import check_trainer_window, should_verify


def start_window(trainer: Any, batch_samples: list[dict[str, Any]], counts: list[int] | None) -> None:
    """Start `trainer`'s window of `batch_samples`, whose items are `counts` where they were counted at prefetch."""
    trainer._window_log.start(trainer._window_items_local if trainer._count_at_prefetch else None)
    if trainer._loss_terms is not None:
        # Every rank, every window: the terms' counts are summed over ranks.
        prefetched = trainer._count_at_prefetch and counts is not None
        trainer._loss_terms.start_window(
            trainer, batch_samples if prefetched else None, counts if prefetched else None
        )
    if trainer._entropy_quantile is not None:
        trainer._entropy_quantile.start_window()
    if trainer._sorted_loss is not None and batch_samples:
        trainer._sorted_loss.window_prefetched(trainer, batch_samples)  # forward-only, this rank's window
    if trainer._deepspeed_window is not None:
        trainer._deepspeed_window.window_prefetched(trainer._window_items_local)  # all ranks' items: one all-reduce
    if batch_samples and trainer._kto_baseline is not None:
        trainer._kto_baseline.prepare(trainer, batch_samples)  # forward-only, over all ranks
    if batch_samples and trainer._unknown_composition and not getattr(trainer, "_accumulation_verified", False):
        check_trainer_window(trainer, batch_samples, refuse=functools.partial(unknown_composition_error, trainer))
    elif batch_samples and should_verify(trainer):
        trainer.verify_accumulation(batch_samples)
    if trainer.moe_mode is not None:
        trainer.moe_mode.window_prefetched(trainer, batch_samples)  # forward-only, over all ranks
    if trainer.coupled_mode is not None:
        trainer.coupled_mode.window_prefetched(batch_samples)


def place_in_window(trainer: Any, accumulator: Any, inputs: dict[str, Any]) -> None:
    """Where `inputs`, handed to `training_step`, sits in `trainer`'s prefetched window: a parent's own copy of the
    micro-batch replaces it (kept for an out-of-memory redo of the window), and a call outside the Trainer's loop is a
    window of its own."""
    index, batches = trainer._micro_index, trainer._window_batches
    if index < len(batches) and batches[index] is inputs:
        return
    if accumulator.micro_steps_in_window:
        trainer._window_batches = [*batches[:index], inputs]
    else:
        trainer._window_batches, trainer._micro_index, trainer._window_items_local = [inputs], 0, None
        trainer._window_counts = {}
        trainer._window_log.start(None)
