"""fp16 overflow handling that wastes one micro-batch, not a window.

Under fp16 loss scaling an overflow is usually the scale's fault, not the data's. Instead of dropping the whole
window (what `GradScaler` and other libraries do), the overflowing micro-batch's gradients are checked *before* they
are folded into the buffers, thrown away, and the micro-batch is recomputed at the backed-off scale. The micro-batches
already folded stay: they were unscaled with the scale they were computed at, so they are unaffected.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .sharded import local_gradients

if TYPE_CHECKING:
    from .accumulator import GradientAccumulator

logger = logging.getLogger(__name__)


def gradients_overflowed(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether any `.grad` of `parameters` holds an inf or NaN (one fused max-norm per dtype, one host sync)."""
    grads = local_gradients(parameters)
    if not grads:
        return False
    norms = torch._foreach_norm(grads, ord=math.inf)
    return not bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())


def accumulate_with_recompute(
    accumulator: GradientAccumulator, compute_loss: Callable[[], torch.Tensor], num_items: float
) -> torch.Tensor:
    """
    Forward + backward one micro-batch of `num_items` items, redoing it at a backed-off loss scale while its
    gradients overflow (at most `accumulator.max_recompute_attempts` times). Returns the detached loss of the last
    attempt. A micro-batch that still overflows at the last attempt, or whose unscaled loss is itself non-finite,
    marks the window as overflowed (it is skipped at its end).
    """
    window, scaler = accumulator._window, accumulator.loss_scaler
    for attempt in range(accumulator.max_recompute_attempts + 1):
        loss = compute_loss()
        if accumulator._loss_non_finite(loss, num_items):
            # The unscaled loss itself is inf/NaN: no scale can fix that.
            window.record_loss(loss, num_items)
            window.overflowed = True
            logger.warning("Non-finite loss in micro-batch %d; the window will be skipped.", accumulator.micro_step)
            return loss.detach()
        # Fold only after checking: a folded inf cannot be taken out of the buffer again.
        if not accumulator._backward_unfolded(loss, num_items):
            accumulator._fold_pending(num_items)
            window.record_loss(loss, num_items)
            return loss.detach()
        accumulator._drop_pending()
        at_min_scale = scaler.at_min_scale
        scaler.update(found_inf=True)
        window.backoffs += 1
        if attempt == accumulator.max_recompute_attempts or at_min_scale:
            break
        if attempt == 0:  # counted once per micro-batch, however many backoffs it needs
            window.recomputed += 1
            accumulator.recomputed_micro_batches += 1
        logger.info("fp16 overflow in micro-batch %d: recomputing at scale %g.", accumulator.micro_step, scaler.scale)
    logger.warning(
        "Micro-batch %d still overflows at loss scale %g: treating it as a real inf/NaN and skipping the window.",
        accumulator.micro_step,
        scaler.scale,
    )
    window.overflowed = True
    return loss.detach()
