"""Out-of-memory retry inside an accumulation window: shrink the micro-batch, keep the effective batch, redo the window.

A micro-batch that runs out of memory is split into chunks (each weighted by its own item count, so the gradient is
unchanged); the window's earlier micro-batches are redone at the new chunk size, because the failed backward may
already have folded part of its gradient into the buffers. The number of optimizer steps and the effective batch
stay what they were. Used by `GradAccumTrainer(auto_find_batch_size=True)` and by plain loops alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .oom import batch_size_of, is_out_of_memory, release_cached_memory, split_micro_batch

T = TypeVar("T")
logger = logging.getLogger(__name__)


class MicroBatchTooSmallError(RuntimeError):
    """An out-of-memory error at a micro-batch of one sample: there is nothing left to shrink."""


def halve_chunk_size(chunk_size: int) -> int:
    """The next chunk size after an out-of-memory error: half, at least 1; raises at 1 already."""
    if chunk_size <= 1:
        raise MicroBatchTooSmallError(
            "Out of memory with a micro-batch of 1 sample: cannot shrink the micro-batch below 1 sample. Use a "
            "smaller model or sequence length, gradient checkpointing, or more memory."
        )
    return chunk_size // 2


class WindowOOMRetry:
    """
    Runs each micro-batch of a window, in chunks of `chunk_size` rows once an out-of-memory error has happened; on an
    out-of-memory error it discards the window, shrinks the chunks (`shrink`, default [`halve_chunk_size`]) and redoes
    the window up to the failed micro-batch. The chunk size is kept for later windows.

    Args:
        shrink (`Callable[[int], int]`, *optional*): current rows per chunk -> new rows per chunk; raise to give up.
        on_shrink (`Callable[[int], None]`, *optional*): called with each new chunk size (for logging).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum import GradientAccumulator
    >>> from hf_gradaccum.engine.oom_retry import WindowOOMRetry
    >>> model = torch.nn.Linear(4, 1)
    >>> acc = GradientAccumulator(model, gradient_accumulation_steps=2)
    >>> retry = WindowOOMRetry()
    >>> window = [{"x": torch.randn(8, 4)}, {"x": torch.randn(8, 4)}]
    >>> def micro_step(batch):  # forward + weighted backward of each chunk
    ...     for chunk in retry.chunks(batch):
    ...         acc.backward(model(chunk["x"]).pow(2).mean(), num_items=len(chunk["x"]))
    >>> for i in range(len(window)):
    ...     with acc.accumulate(model):
    ...         retry.run(acc, window, i, micro_step)
    >>> acc.finish_window().applied
    True
    ```
    """

    def __init__(
        self, shrink: Callable[[int], int] | None = None, on_shrink: Callable[[int], None] | None = None
    ) -> None:
        self.chunk_size: int | None = None
        self._shrink = shrink or halve_chunk_size
        self._on_shrink = on_shrink

    def chunks(self, inputs: Any) -> list[Any]:
        """`inputs` as one chunk, untouched (whatever its type: a trainer may hand over a list of prompt rows), or,
        after an out-of-memory error, a mapping of batched tensors split into chunks of `chunk_size` rows."""
        return [inputs] if self.chunk_size is None else split_micro_batch(inputs, self.chunk_size)

    def reset(self) -> None:
        """Forget the shrunken chunk size (e.g. when the whole loop restarts at a smaller batch)."""
        self.chunk_size = None

    def run(self, accumulator: Any, window: Sequence[Mapping[str, Any]], index: int, step: Callable[[Any], T]) -> T:
        """
        `step(window[index])`; on an out-of-memory error, shrink and redo `window[: index + 1]` through `step` until
        it fits. `accumulator` (a [`GradientAccumulator`]) has the failed window discarded before each retry.
        """
        try:
            return step(window[index])
        except Exception as error:
            if not is_out_of_memory(error):
                raise
        # Retry only after the `except` block has ended: until then the error's traceback keeps the failed attempt's
        # activations alive, and the smaller retry would run out of memory too (seen on a GPU).
        while True:
            accumulator.discard_window()
            release_cached_memory()
            current = self.chunk_size or batch_size_of(window[index])
            self.chunk_size = self._shrink(current)
            if self._on_shrink is not None:
                self._on_shrink(self.chunk_size)
            try:
                for earlier in window[:index]:
                    step(earlier)
                return step(window[index])
            except Exception as retry_error:
                if not is_out_of_memory(retry_error):
                    raise
