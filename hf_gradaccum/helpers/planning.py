"""Splitting a target batch size into micro-batches, accumulation steps and processes, exactly.

Exact accumulation only reproduces a batch of `B` samples if `micro_batch_size x gradient_accumulation_steps x
world_size == B` holds exactly: rounding `B / micro` up or down silently trains at another batch size (and another
effective learning rate). [`plan_accumulation`] therefore only picks micro-batch sizes that divide the per-process
share, and [`AccumulationPlan.halved`] keeps that invariant when an out-of-memory retry shrinks the micro-batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..engine.run_batch.layout import RunBatchLayout
from ..engine.validation import check_positive_int
from .lr_scaling import effective_batch_size as _effective_batch_size

logger = logging.getLogger(__name__)


class CannotShrinkMicroBatchError(RuntimeError):
    """Raised by [`AccumulationPlan.halved`] when the micro-batch is already a single sample."""


def _divisors(n: int) -> list[int]:
    # Pairs (d, n // d) up to sqrt(n): fast even for batch sizes counted in the millions.
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _largest_divisor_at_most(n: int, limit: int) -> int:
    # 1 always divides, so there is always an answer for limit >= 1.
    return max(d for d in _divisors(n) if d <= limit)


@dataclass(frozen=True)
class AccumulationPlan:
    """
    How one optimizer step's batch is split: `micro_batch_size * gradient_accumulation_steps * world_size ==
    effective_batch_size`, checked on construction.

    Args:
        micro_batch_size (`int`): samples per forward/backward per process (`per_device_train_batch_size`).
        gradient_accumulation_steps (`int`): micro-batches per optimizer step.
        world_size (`int`): data-parallel processes.
        effective_batch_size (`int`): samples per optimizer step.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    effective_batch_size: int

    def __post_init__(self) -> None:
        product = _effective_batch_size(self.micro_batch_size, self.gradient_accumulation_steps, self.world_size)
        if product != self.effective_batch_size:
            raise ValueError(
                f"`effective_batch_size={self.effective_batch_size}` must equal micro_batch_size x "
                f"gradient_accumulation_steps x world_size = {self.micro_batch_size} x "
                f"{self.gradient_accumulation_steps} x {self.world_size} = {product}."
            )

    def halved(self) -> AccumulationPlan:
        """
        The plan for an out-of-memory retry: the micro-batch at most halved, the accumulation steps raised so the
        effective batch size stays exactly the same.

        An even micro-batch is halved and the steps doubled. An odd one cannot be halved exactly, so the new
        micro-batch is the largest divisor of the per-process share (`micro * steps`) that is at most half of it: the
        memory still drops by at least 2x, and the batch stays exact (e.g. 5 x 8 -> 2 x 20).

        Raises:
            [`CannotShrinkMicroBatchError`]: the micro-batch is already 1.

        Example:

        ```python
        >>> from hf_gradaccum.helpers.planning import plan_accumulation
        >>> plan = plan_accumulation(64, micro_batch_size=32)
        >>> plan.halved()
        AccumulationPlan(micro_batch_size=16, gradient_accumulation_steps=4, world_size=1, effective_batch_size=64)
        ```
        """
        if self.micro_batch_size == 1:
            raise CannotShrinkMicroBatchError(
                f"Cannot shrink the micro-batch below 1 sample (effective batch size {self.effective_batch_size}, "
                f"{self.gradient_accumulation_steps} accumulation steps, world size {self.world_size}): one sample "
                "does not fit in memory. Reduce the sequence length or image size, or use gradient checkpointing, "
                "a smaller model, lower precision or more devices."
            )
        per_process = self.micro_batch_size * self.gradient_accumulation_steps
        micro = _largest_divisor_at_most(per_process, self.micro_batch_size // 2)
        return AccumulationPlan(micro, per_process // micro, self.world_size, self.effective_batch_size)


def plan_accumulation(
    target_batch_size: int,
    *,
    micro_batch_size: int | None = None,
    world_size: int = 1,
    max_micro_batch_size: int | None = None,
) -> AccumulationPlan:
    """
    Split `target_batch_size` into micro-batch size, accumulation steps and processes with
    `micro_batch_size * gradient_accumulation_steps * world_size == target_batch_size` exactly.

    With `micro_batch_size` given, it must divide the per-process share `target_batch_size / world_size`. Without
    it, the largest divisor of that share that is at most `max_micro_batch_size` is used (the whole share, i.e. no
    accumulation, when there is no maximum): larger micro-batches mean fewer, better-utilised forward passes.

    Args:
        target_batch_size (`int`): samples per optimizer step, >= 1; must be divisible by `world_size`.
        micro_batch_size (`int`, *optional*): the micro-batch size to use.
        world_size (`int`, *optional*, defaults to 1): data-parallel processes.
        max_micro_batch_size (`int`, *optional*): largest micro-batch that fits in memory.

    Returns:
        [`AccumulationPlan`]: the plan.

    Raises:
        `ValueError`: when no exact split exists; the message names the offending argument and the valid choices.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.planning import plan_accumulation
    >>> plan_accumulation(256, world_size=2, max_micro_batch_size=48)
    AccumulationPlan(micro_batch_size=32, gradient_accumulation_steps=4, world_size=2, effective_batch_size=256)
    >>> plan_accumulation(96, micro_batch_size=12).gradient_accumulation_steps
    8
    ```
    """
    check_positive_int(target_batch_size, "target_batch_size")
    check_positive_int(world_size, "world_size")
    if target_batch_size % world_size:
        lower = target_batch_size // world_size * world_size
        raise ValueError(
            f"`target_batch_size={target_batch_size}` must be divisible by `world_size={world_size}` for an exact "
            f"split; the nearest valid targets are {', '.join(map(str, filter(None, (lower, lower + world_size))))}. "
            f"Or keep the batch: `effective_batch_size={target_batch_size}` splits each window unevenly over the "
            "processes, exactly (docs/run_batch.md)."
        )
    per_process = target_batch_size // world_size
    if max_micro_batch_size is not None:
        check_positive_int(max_micro_batch_size, "max_micro_batch_size")

    if micro_batch_size is not None:
        check_positive_int(micro_batch_size, "micro_batch_size")
        if per_process % micro_batch_size:
            raise ValueError(
                f"`micro_batch_size={micro_batch_size}` must divide target_batch_size / world_size = "
                f"{target_batch_size} / {world_size} = {per_process}; valid micro-batch sizes: {_divisors(per_process)}."
            )
        if max_micro_batch_size is not None and micro_batch_size > max_micro_batch_size:
            raise ValueError(
                f"`micro_batch_size={micro_batch_size}` exceeds `max_micro_batch_size={max_micro_batch_size}`."
            )
        micro = micro_batch_size
    elif max_micro_batch_size is None:
        micro = per_process
    else:
        micro = _largest_divisor_at_most(per_process, max_micro_batch_size)
        if micro * 2 <= min(max_micro_batch_size, per_process):
            # E.g. a prime per-process share: exact, but with tiny micro-batches. Worth a nearby target instead.
            logger.warning(
                "The largest micro-batch dividing %d samples per process is %d (max %d): training is exact but slow; "
                "a target batch size with more divisors would use the memory better.",
                per_process,
                micro,
                max_micro_batch_size,
            )
    return AccumulationPlan(micro, per_process // micro, world_size, target_batch_size)


def halved_run_batch(layout: RunBatchLayout) -> int:
    """
    The out-of-memory retry's rows per forward for a run's batch (`effective_batch_size`): the micro-batch halved
    (rounded down). Each micro-batch of the layout is then run in chunks of that size; the windows and the number of
    micro-batches per window stay, so any size is exact (each chunk is weighted by its own items).

    Raises:
        [`CannotShrinkMicroBatchError`]: the micro-batch is already 1.

    Example:

    ```python
    >>> from hf_gradaccum.engine.run_batch.layout import RunBatchLayout
    >>> from hf_gradaccum.helpers.planning import halved_run_batch
    >>> halved_run_batch(RunBatchLayout(10, micro_batch_size=5, world_size=3))
    2
    ```
    """
    if layout.micro_batch_size == 1:
        raise CannotShrinkMicroBatchError(
            f"Cannot shrink the micro-batch below 1 sample (effective batch size {layout.effective_batch_size} on "
            f"{layout.world_size} processes): one sample does not fit in memory. Reduce the sequence length or image "
            "size, or use gradient checkpointing, a smaller model, lower precision or more devices."
        )
    return layout.micro_batch_size // 2
