"""Flat accumulation buffers: one contiguous buffer per device, one view of it per parameter.

A flat buffer can be zeroed, checked, scaled and all-reduced in one call each, and a parameter's `.grad` can *be* its
view at the window's end (no second copy of the gradients). The buffers' dtype is fp32 by default, so bf16/fp16
gradients do not round at every micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

ACCUMULATION_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_accumulation_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """
    Turn `"float32"`, `"bf16"`, `torch.float32`, ... into a `torch.dtype`; anything else is a `ValueError` that lists
    the allowed values.

    Example:

    ```python
    >>> from hf_gradaccum.engine.buffers import resolve_accumulation_dtype
    >>> resolve_accumulation_dtype("fp32")
    torch.float32
    ```
    """
    if isinstance(dtype, torch.dtype) and dtype in ACCUMULATION_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in ACCUMULATION_DTYPES:
        return ACCUMULATION_DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(
        f"`accumulation_dtype` must be one of {sorted(set(ACCUMULATION_DTYPES))} (or the matching torch.dtype), "
        f"got {dtype!r}."
    )


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element is finite, in one fast read pass: any inf or NaN makes the sum inf or NaN. Only a
    non-finite sum (which finite values can also produce, by overflowing) pays for the exact check.
    `isfinite(t).all()` alone materialises a bool tensor as large as `t`: 20x slower than the sum on a CPU."""
    # Half-precision buffers are summed in fp32: their own range (fp16: 65504) would overflow needlessly.
    total = tensor.sum(dtype=torch.float32) if tensor.element_size() < 4 else tensor.sum()
    if bool(torch.isfinite(total)):
        return True
    return bool(torch.isfinite(tensor).all())


WIDEN_CHUNK_NUMEL = 1 << 20
"""Elements widened at a time by [`WideningAdd`]: 4 MiB of fp32 scratch, which stays in the CPU's cache."""
WIDEN_MIN_NUMEL = 4096
"""Below this many elements one mixed-dtype add costs less than the two kernels of a widened one."""


class WideningAdd:
    """
    `dst += alpha * src` where `src` is narrower than `dst` (a bf16/fp16 gradient into an fp32 buffer), fast on the CPU.

    torch's CPU kernels add mixed dtypes through a per-element cast, 5-8x slower than adding two fp32 tensors (50M
    elements, one thread: 0.091 s against 0.012 s for the same add widened chunk by chunk). So on the CPU `src` is
    widened into a small scratch, one cache-sized chunk at a time, and each chunk added in `dst`'s dtype: the same
    values as the mixed add, which also widens before it adds. CUDA kernels cast in registers: there, and wherever the
    dtypes already match, it is the one `add_`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.buffers import WideningAdd
    >>> dst, src = torch.zeros(8), torch.ones(8, dtype=torch.bfloat16)
    >>> WideningAdd()(dst, src, 0.5).tolist()
    [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]
    ```
    """

    def __init__(self, chunk_numel: int = WIDEN_CHUNK_NUMEL) -> None:
        self.chunk_numel = chunk_numel
        self._scratch: torch.Tensor | None = None

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, alpha: float) -> torch.Tensor:
        numel = src.numel()
        if (
            src.dtype == dst.dtype
            or dst.device.type != "cpu"
            or src.device != dst.device
            or numel < WIDEN_MIN_NUMEL
            or not dst.is_contiguous()
        ):
            return dst.add_(src, alpha=alpha)
        chunk = min(self.chunk_numel, numel)
        scratch = self._scratch
        if scratch is None or scratch.dtype != dst.dtype or scratch.numel() < chunk:
            scratch = self._scratch = torch.empty(self.chunk_numel, dtype=dst.dtype)
        flat_dst, flat_src = dst.view(-1), src.reshape(-1)
        for start in range(0, numel, chunk):
            stop = min(start + chunk, numel)
            widened = scratch[: stop - start].copy_(flat_src[start:stop])
            flat_dst[start:stop].add_(widened, alpha=alpha)
        return dst


class FlatGradientBuffers:
    """
    One flat buffer per device holding `sum_k n_k * grad_k` for every parameter, with `views[i]` shaped like
    `parameters[i]`.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.buffers import FlatGradientBuffers
    >>> model = torch.nn.Linear(3, 2)
    >>> buffers = FlatGradientBuffers(list(model.parameters()), torch.float32)
    >>> [tuple(v.shape) for v in buffers.views]
    [(2, 3), (2,)]
    ```
    """

    sharded = False
    """Whether each rank holds only its shard of the gradients (FSDP2, [`ShardedGradientBuffers`])."""
    reduced_at_window_end = True
    """Replicated buffers hold each rank's own gradients until the window's end, where they are summed over ranks
    (all-reduce) next to the window's statistics."""
    backward_without_items = False
    """Whether a micro-batch with zero items still needs its backward. Replicated: no, it would add nothing."""

    def __init__(self, parameters: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.fsdp_modules: list[nn.Module] = []
        """The FSDP2 modules whose reduce-scatter fills these buffers (none for replicated buffers)."""
        sizes: dict[torch.device, int] = {}
        for p in parameters:
            sizes[p.device] = sizes.get(p.device, 0) + p.numel()
        self.flat: dict[torch.device, torch.Tensor] = {
            device: self._allocate(size, dtype, device) for device, size in sizes.items()
        }
        offsets = dict.fromkeys(sizes, 0)
        self._add = WideningAdd()
        self.views: list[torch.Tensor] = []
        for p in parameters:
            start = offsets[p.device]
            self.views.append(self.flat[p.device][start : start + p.numel()].view_as(p))
            offsets[p.device] = start + p.numel()

    def _allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The flat buffer for the parameters on `device` (where they live; see `offload.py` for the host)."""
        return torch.zeros(numel, dtype=dtype, device=device)

    @property
    def first_device(self) -> torch.device:
        """The device of the first buffer: where the window's small statistics live."""
        return next(iter(self.flat))

    def zero_(self) -> None:
        for buffer in self.flat.values():
            buffer.zero_()

    def fold(self, index: int, grad: torch.Tensor, alpha: float) -> None:
        """`views[index] += alpha * grad`, a bf16/fp16 gradient widened to the buffer's dtype without a full-size
        temporary ([`WideningAdd`])."""
        self._add(self.views[index], grad, alpha)

    def scale_(self, factor: float) -> None:
        for buffer in self.flat.values():
            buffer.mul_(factor)

    def all_finite(self) -> bool:
        return all(all_finite(b) for b in self.flat.values())

    def all_reduce_(self, group: torch.distributed.ProcessGroup | None = None) -> int:
        """Sum the buffers over `group`'s ranks (the default process group's when `None`); returns the number of
        collectives."""
        for buffer in self.flat.values():
            torch.distributed.all_reduce(buffer, group=group)
        return len(self.flat)

    def all_finite_on_every_rank(self) -> bool:
        """Whether the window's gradient is finite. Replicated buffers were summed over ranks already, so this rank's
        answer is every rank's."""
        return self.all_finite()

    def agree(self, flag: bool) -> bool:
        """A per-micro-batch decision (skip it, redo it) as the ranks must take it. Replicated: this rank's own
        flag; nothing is exchanged before the window's end, which agrees on the outcome (`reduction.py`)."""
        return flag

    def weighting(self, num_items: float, scale: float) -> tuple[float, float]:
        """
        `(loss_factor, fold_alpha)` for a micro-batch of `num_items` items at loss scale `scale`: its loss is
        back-propagated times `loss_factor` and its gradient is folded times `fold_alpha`, so the buffer gains
        `num_items * grad(mean_loss)`. Replicated: the item weight is applied at the fold (the loss only carries the
        scale), which keeps the backward's gradients the unweighted ones.
        """
        return scale, num_items / scale

    def gradient_for(self, index: int, param_dtype: torch.dtype) -> torch.Tensor:
        """The accumulated gradient for `parameters[index]`: the view itself when the dtypes agree (no copy)."""
        view = self.views[index]
        return view if view.dtype == param_dtype else view.to(param_dtype)

    def close(self) -> None:
        """Release what the buffers hold besides their tensors (nothing here; a host thread when offloaded)."""

    def snapshot(self) -> list[torch.Tensor]:
        """CPU copies of the buffers, for a mid-window checkpoint."""
        return [b.detach().cpu().clone() for b in self.flat.values()]

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        if isinstance(saved, dict):
            raise ValueError(
                "This mid-window checkpoint was saved by an accumulator on the in-place path (`.grad` itself); this "
                "one folds into buffers. Resume with `accumulation_path='in_place'` (or `'auto'`)."
            )
        for buffer, tensor in zip(self.flat.values(), saved, strict=True):
            buffer.copy_(tensor)
