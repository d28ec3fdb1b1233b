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
from dataclasses import dataclass

import torch

from .loss_scaling import DynamicLossScaler
from .sharded import local_gradients
from .window import WindowState

logger = logging.getLogger(__name__)


def gradients_overflowed(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether any `.grad` of `parameters` holds an inf or NaN (one fused max-norm per dtype, one host sync)."""
    grads = local_gradients(parameters)
    if not grads:
        return False
    norms = torch._foreach_norm(grads, ord=math.inf)
    return not bool(torch.isfinite(torch.stack([n.float().to(norms[0].device) for n in norms])).all())


@dataclass(frozen=True)
class UnfoldedBackward:
    """
    What the recompute loop needs from the accumulator, as four callables, so that this module does not depend on
    the accumulator (it only sees a micro-batch's backward in three steps: run it unfolded, then keep or drop it).

    - `loss_non_finite(loss, num_items)`: whether the unscaled loss is inf/NaN (agreed over ranks where needed);
    - `backward_unfolded(loss, num_items)`: backward at the current scale, leaving the gradients in `.grad`
      unfolded; returns whether they overflowed (agreed over ranks where needed);
    - `fold_pending(num_items)`: fold the gradients left in `.grad` into the buffers;
    - `drop_pending()`: throw the gradients left in `.grad` away.
    """

    loss_non_finite: Callable[[torch.Tensor, float], bool]
    backward_unfolded: Callable[[torch.Tensor, float], bool]
    fold_pending: Callable[[float], None]
    drop_pending: Callable[[], None]


def accumulate_with_recompute(
    backward: UnfoldedBackward,
    compute_loss: Callable[[], torch.Tensor],
    num_items: float,
    *,
    window: WindowState,
    scaler: DynamicLossScaler,
    max_attempts: int,
    micro_step: int,
) -> torch.Tensor:
    """
    Forward + backward one micro-batch of `num_items` items, redoing it at a backed-off loss scale while its
    gradients overflow (at most `max_attempts` times). Returns the detached loss of the last attempt. A micro-batch
    that still overflows at the last attempt, or whose unscaled loss is itself non-finite, marks the `window` as
    overflowed (it is skipped at its end). A recomputed micro-batch counts once in `window.recomputed`, however many
    backoffs it needs; `micro_step` only names it in the logs.
    """
    for attempt in range(max_attempts + 1):
        loss = compute_loss()
        if backward.loss_non_finite(loss, num_items):
            # The unscaled loss itself is inf/NaN: no scale can fix that.
            window.record_loss(loss, num_items)
            window.overflowed = True
            logger.warning("Non-finite loss in micro-batch %d; the window will be skipped.", micro_step)
            return loss.detach()
        # Fold only after checking: a folded inf cannot be taken out of the buffer again.
        if not backward.backward_unfolded(loss, num_items):
            backward.fold_pending(num_items)
            window.record_loss(loss, num_items)
            return loss.detach()
        backward.drop_pending()
        at_min_scale = scaler.at_min_scale
        scaler.update(found_inf=True)
        window.backoffs += 1
        if attempt == max_attempts or at_min_scale:
            break
        if attempt == 0:  # counted once per micro-batch, however many backoffs it needs
            window.recomputed += 1
        logger.info("fp16 overflow in micro-batch %d: recomputing at scale %g.", micro_step, scaler.scale)
    logger.warning(
        "Micro-batch %d still overflows at loss scale %g: treating it as a real inf/NaN and skipping the window.",
        micro_step,
        scaler.scale,
    )
    window.overflowed = True
    return loss.detach()
