"""fp16 overflow handling that wastes one micro-batch, not a window.

Under fp16 loss scaling an overflow is usually the scale's fault, not the data's. Instead of dropping the whole
window (what `GradScaler` and other libraries do), the overflowing micro-batch's gradients are checked *before* they
are folded into the buffers, thrown away, and the micro-batch is recomputed at the backed-off scale. The micro-batches
already folded stay: they were unscaled with the scale they were computed at, so they are unaffected.

The accumulator runs a micro-batch in three calls (`begin_micro_batch`, `loss_to_backward`, `end_micro_batch`);
[`MicroBatch`] is what it remembers between them, and [`back_off_after_overflow`] decides, after an overflowing
attempt, whether the micro-batch is computed again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .loss_scaling import DynamicLossScaler
from .sharded.fsdp2_buffers import local_gradients
from .window import WindowState

logger = logging.getLogger(__name__)


def gradients_overflowed(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether any `.grad` of `parameters` holds an inf or NaN (one fused max-norm per dtype, one host sync)."""
    grads = local_gradients(parameters)
    if not grads:
        return False
    norms = torch._foreach_norm(grads, ord=math.inf)
    return not bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())


@dataclass
class MicroBatch:
    """One micro-batch between `begin_micro_batch` and `end_micro_batch`."""

    num_items: float
    backward_needed: bool
    """False for a micro-batch without items whose backward nobody waits for (replicated buffers): it weighs 0."""
    recompute: bool
    """fp16 with `overflow_policy="recompute"`, and a caller that can compute the loss again: the gradients stay in
    `.grad`, unfolded, until `end_micro_batch` has checked them."""
    loss_non_finite: bool | None = None
    """Whether the latest attempt's loss is inf/NaN; `None` until it is known."""
    attempt: int = 0
    gradients_arrived: bool = False
    """Whether a backward produced gradients for the trainable parameters since the micro-batch began (hook path)."""
    loss_weighted: bool = False
    """Whether the loss passed through `loss_to_backward` (the in-place path needs it: the weight rides on the loss)."""


def back_off_after_overflow(
    micro: MicroBatch, window: WindowState, scaler: DynamicLossScaler, max_attempts: int, micro_step: int
) -> bool:
    """
    After an attempt of `micro` whose gradients overflowed (and were dropped): back the scale off and return whether
    to compute the micro-batch again. A micro-batch that still overflows after `max_attempts` backoffs, or at the
    minimum scale, is treated as a real inf/NaN: the `window` is marked overflowed and skipped at its end. A
    recomputed micro-batch counts once in `window.recomputed`, however many backoffs it needs; `micro_step` only
    names it in the logs.
    """
    at_min_scale = scaler.at_min_scale
    scaler.update(found_inf=True)
    window.backoffs += 1
    if micro.attempt == max_attempts or at_min_scale:
        logger.warning(
            "Micro-batch %d still overflows at loss scale %g: treating it as a real inf/NaN and skipping the window.",
            micro_step,
            scaler.scale,
        )
        window.overflowed = True
        return False
    if micro.attempt == 0:
        window.recomputed += 1
    micro.attempt += 1
    logger.info("fp16 overflow in micro-batch %d: recomputing at scale %g.", micro_step, scaler.scale)
    return True
