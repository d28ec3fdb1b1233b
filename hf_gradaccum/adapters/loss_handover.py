"""Where the accumulator's weight reaches the loss on the in-place path, in a Trainer: `Accelerator.backward`.

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


@contextlib.contextmanager
def backward_through(accelerator: Any, hand_over: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """
    Within the context, `accelerator.backward(loss, **kwargs)` back-propagates `hand_over(loss)` instead of `loss`.

    Example:

    ```python
    >>> import torch
    >>> from accelerate import Accelerator
    >>> from hf_gradaccum.adapters.loss_handover import backward_through
    >>> accelerator, w = Accelerator(cpu=True), torch.ones(1, requires_grad=True)
    >>> with backward_through(accelerator, lambda loss: loss * 3):
    ...     accelerator.backward((w * 2).sum())
    >>> w.grad
    tensor([6.])
    ```
    """
    original = accelerator.backward

    def backward(loss: torch.Tensor, **kwargs: Any) -> Any:
        return original(hand_over(loss), **kwargs)

    accelerator.backward = backward
    try:
        yield
    finally:
        del accelerator.backward  # the class's method again
