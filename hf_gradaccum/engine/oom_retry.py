"""Out-of-memory retry inside an accumulation window: shrink the micro-batch, keep the effective batch, redo the window.

A micro-batch that runs out of memory is split into chunks (each weighted by its own item count, so the gradient is
unchanged); the window's earlier micro-batches are redone at the new chunk size, because the failed backward may
already have folded part of its gradient into the buffers. The number of optimizer steps and the effective batch
stay what they were. Used by `GradAccumTrainer(auto_find_batch_size=True)` and by plain loops alike.

Splitting is exact because the accumulator weights every chunk by its own item count: a micro-batch of 32 run as
four chunks of 8 (or 8 + 8 + 8 + 5 + 3) gives the same gradient as the micro-batch of 32.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size

T = TypeVar("T")
logger = logging.getLogger(__name__)


def is_out_of_memory(exception: BaseException) -> bool:
    """
    Whether `exception` is an allocation failure: `torch.OutOfMemoryError` (CUDA, XPU), or one of the messages
    Accelerate recognises, including the CPU allocator's `DefaultCPUAllocator: can't allocate memory`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.oom_retry import is_out_of_memory
    >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_out_of_memory(ValueError("shape mismatch"))
    False
    ```
    """
    return isinstance(exception, torch.OutOfMemoryError) or (
        isinstance(exception, Exception) and should_reduce_batch_size(exception)
    )


def release_cached_memory() -> None:
    """Drop references held by the failed attempt (the traceback's frames) and return cached blocks to the device."""
    gc.collect()
    clear_device_cache(garbage_collection=True)


def batch_size_of(inputs: Mapping[str, Any]) -> int:
    """Rows in a collated batch: the first dimension of its first batched tensor."""
    for value in inputs.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(f"Cannot find a batched tensor in a batch with keys {sorted(inputs)}.")


def split_micro_batch(inputs: Mapping[str, Any], chunk_size: int) -> list[dict[str, Any]]:
    """
    Split a collated batch into chunks of at most `chunk_size` rows. Tensors whose first dimension is the batch
    are split; everything else is passed to every chunk unchanged.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.oom_retry import split_micro_batch
    >>> chunks = split_micro_batch({"input_ids": torch.zeros(5, 3), "labels": torch.arange(5)}, 2)
    >>> [c["labels"].tolist() for c in chunks]
    [[0, 1], [2, 3], [4]]
    ```
    """
    rows = batch_size_of(inputs)
    if chunk_size >= rows:
        return [dict(inputs)]
    chunks: list[dict[str, Any]] = [{} for _ in range(0, rows, chunk_size)]
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
            for chunk, part in zip(chunks, value.split(chunk_size), strict=True):
                chunk[key] = part
        else:
            for chunk in chunks:
                chunk[key] = value
    return chunks


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
