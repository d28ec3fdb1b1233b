"""Out-of-memory recovery that keeps the effective batch: recognise an allocation failure and split a micro-batch
into smaller chunks.

Splitting is exact because the accumulator weights every chunk by its own item count: a micro-batch of 32 run as
four chunks of 8 (or 8 + 8 + 8 + 5 + 3) gives the same gradient as the micro-batch of 32.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils.memory import clear_device_cache, should_reduce_batch_size


def is_out_of_memory(exception: BaseException) -> bool:
    """
    Whether `exception` is an allocation failure: `torch.OutOfMemoryError` (CUDA, XPU), or one of the messages
    Accelerate recognises, including the CPU allocator's `DefaultCPUAllocator: can't allocate memory`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.oom import is_out_of_memory
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
    >>> from hf_gradaccum.engine.oom import split_micro_batch
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
