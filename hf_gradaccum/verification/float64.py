"""The same computation in fp64: tells fp32 rounding apart from a split that really changes the gradient.

Cutting a window differently changes more than the grouping of its rows: each micro-batch is padded to its own
longest row, and its sums run in another order. In fp32 that alone moves the gradient by about 1e-7 to 1e-5 of its
norm (more for a deep model or a gradient whose terms nearly cancel), which can cross the check's fp32 tolerance for a
loss that is exactly an item mean. In fp64 the same rounding is about 1e-14, while what the check exists to catch (a
mean over the micro-batch, BatchNorm, in-batch negatives) does not depend on the precision and stays where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["in_float64", "rows_in_float64"]


@contextlib.contextmanager
def in_float64(model: nn.Module, default_dtype: bool = True) -> Iterator[None]:
    """
    Context in which every fp32 parameter and buffer of `model` is fp64 (the same values: fp32 -> fp64 is exact), and
    (with `default_dtype`) new floating tensors default to fp64. On exit the original tensors are put back, bit for bit: parameters keep
    their identity (only `.data` is swapped), so references held by an optimizer or an accumulator stay valid.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.verification.float64 import in_float64
    >>> layer = torch.nn.Linear(2, 2)
    >>> with in_float64(layer):
    ...     layer.weight.dtype
    torch.float64
    >>> layer.weight.dtype
    torch.float32
    ```
    """
    params: list[tuple[nn.Parameter, torch.Tensor]] = []
    buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
    default = torch.get_default_dtype()
    try:
        for param in model.parameters():
            if param.dtype == torch.float32:
                params.append((param, param.data))
                param.data = param.data.to(torch.float64)
        for module in model.modules():
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.dtype == torch.float32:
                    buffers.append((module, name, buffer))
                    module._buffers[name] = buffer.to(torch.float64)
        if default_dtype:
            torch.set_default_dtype(torch.float64)
        yield
    finally:
        torch.set_default_dtype(default)
        for param, data in params:
            param.data = data
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


def rows_in_float64(rows: Mapping[str, Any]) -> dict[str, Any]:
    """`rows` with its fp32 tensors (embeddings, pixel values, float labels) in fp64; everything else unchanged."""
    return {k: v.to(torch.float64) if torch.is_tensor(v) and v.dtype == torch.float32 else v for k, v in rows.items()}
