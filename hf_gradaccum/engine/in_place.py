"""Accumulation in `.grad` itself, without hooks, where that is already exact: the in-place path.

The hook path (`buffers.py`) folds every parameter's gradient into a flat buffer as autograd produces it, one Python
call per parameter per micro-batch. That is what bf16/fp16 parameters (fp32 buffers), fp16 loss scaling (a check
before the fold), FSDP2 and the offloaded buffer need. When none of those applies (the parameters are already in
the accumulation dtype, no loss scaler, replicated, on their own device) autograd's own accumulation is exact: each
micro-batch's loss is back-propagated times its item count, autograd adds the gradients into `.grad` in place (the
first micro-batch's become `.grad`, as in the stock Trainer), and the window's end divides by the window's items
once. No hook runs, no second copy of the gradients exists, and a parameter that got no gradient keeps `.grad =
None` exactly as with one large batch.

What this path cannot see, it refuses loudly: a micro-batch whose loss did not pass through the accumulator
(`loss_to_backward`, `backward`, `accumulate_micro_batch`, or the Trainer's hand-over) would enter the window
unweighted, so `end_micro_batch` raises; and a `.grad` cleared in the middle of a window (e.g. an
`optimizer.zero_grad()` per micro-batch) would lose the micro-batches before it, so the window's end raises.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .buffers import all_finite

ACCUMULATION_PATHS = ("auto", "hooks", "in_place")
# Gradients are all-reduced in flat buckets of at most this many bytes (one collective each), so a window's
# reduction needs no second copy of all the gradients at once.
ALL_REDUCE_BUCKET_BYTES = 64 * 2**20


def check_accumulation_path(path: str) -> str:
    """Return `path` if it is one of [`ACCUMULATION_PATHS`]; otherwise a `ValueError` listing them."""
    if path not in ACCUMULATION_PATHS:
        raise ValueError(f"`accumulation_path` must be one of {ACCUMULATION_PATHS}, got {path!r}.")
    return path


def why_not_in_place(
    parameters: Sequence[nn.Parameter],
    dtype: torch.dtype,
    *,
    loss_scaled: bool,
    offload: bool,
    distributed_tensors: bool,
) -> str | None:
    """
    Why the in-place path would not be exact (or not apply) for these parameters and settings, or `None` when it
    can be used.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.in_place import why_not_in_place
    >>> params = list(torch.nn.Linear(2, 2).bfloat16().parameters())
    >>> why_not_in_place(params, torch.float32, loss_scaled=False, offload=False, distributed_tensors=False)
    'a parameter is torch.bfloat16, the accumulation dtype torch.float32 (autograd would accumulate in torch.bfloat16)'
    ```
    """
    if loss_scaled:
        return "fp16 loss scaling checks each micro-batch's gradients before they are accumulated"
    if offload:
        return "`offload_accumulation_buffer=True` keeps the buffer in host memory"
    if distributed_tensors:
        return "the parameters are DTensors (FSDP2 or tensor parallelism) with their own sharded buffers"
    for p in parameters:
        if p.dtype != dtype:
            return f"a parameter is {p.dtype}, the accumulation dtype {dtype} (autograd would accumulate in {p.dtype})"
    return None


class InPlaceGradients:
    """
    The accumulation "buffers" of the in-place path: the parameters' own `.grad`, which autograd accumulates in
    place. The interface is [`FlatGradientBuffers`]'s, so the accumulator's window logic is the same for both.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.in_place import InPlaceGradients
    >>> model = torch.nn.Linear(2, 1)
    >>> grads = InPlaceGradients(list(model.parameters()), torch.float32)
    >>> (model(torch.ones(3, 2)).sum() * 3).backward()
    >>> grads.local_touched()
    [True, True]
    ```
    """

    sharded = False
    reduced_at_window_end = True
    backward_without_items = False
    in_place = True

    def __init__(self, parameters: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self.parameters = list(parameters)
        self.dtype = dtype
        self.fsdp_modules: list[nn.Module] = []
        self.first_device = self.parameters[0].device

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.parameters if p.grad is not None]

    def zero_(self) -> None:
        """A window starts with no gradient: the first micro-batch's become `.grad`, later ones are added to it."""
        for p in self.parameters:
            p.grad = None

    def local_touched(self) -> list[bool]:
        """Which parameters got a gradient on this rank in this window."""
        return [p.grad is not None for p in self.parameters]

    def fingerprint(self) -> list[tuple[int, int] | None]:
        """Each gradient's identity and version counter: any backward into it or `zero_grad()` on it changes this
        (autograd's in-place accumulation and `zero_()` bump the version; `set_to_none` and a new tensor change the
        identity, and the tensors compared are alive, so no identity is reused)."""
        return [None if (g := p.grad) is None else (id(g), g._version) for p in self.parameters]

    def weighting(self, num_items: float, scale: float) -> tuple[float, None]:
        """`(loss_factor, None)`: the loss carries the item weight (there is no fold)."""
        return num_items * scale, None

    def agree(self, flag: bool) -> bool:
        return flag

    def scale_(self, factor: float) -> None:
        grads = self._grads()
        if grads:
            torch._foreach_mul_(grads, factor)

    def all_finite(self) -> bool:
        """Whether every gradient is finite: one multi-tensor L2 norm (the kernel gradient clipping uses; an inf or
        NaN makes a norm non-finite) and one read on the host. Only a non-finite norm, which very large finite values
        can also produce by overflowing, pays for the exact check. (A max-abs norm cannot overflow, but its
        multi-tensor kernel was measured 8x slower on a CPU.)"""
        grads = self._grads()
        if not grads:
            return True
        if bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()):
            return True
        return all(all_finite(g) for g in grads)

    def all_finite_on_every_rank(self) -> bool:
        return self.all_finite()

    def scale_and_check_(self, factor: float) -> bool:
        """`scale_(factor)` and `all_finite()` in one pass over the gradients where torch has the fused kernel
        (`GradScaler`'s unscale-and-check), two otherwise. Returns whether every gradient is finite."""
        grads = self._grads()
        if not grads:
            return True
        try:
            found_inf = torch.zeros(1, device=grads[0].device)
            inv = torch.full((1,), factor, device=grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv)
            return not bool(found_inf.item())
        except (AttributeError, NotImplementedError, RuntimeError):  # no fused kernel for this device or torch
            finite = self.all_finite()
            self.scale_(factor)
            return finite

    def mean_clip_and_check_(self, items: float, max_norm: float) -> tuple[bool, float | None]:
        """
        Turn the window's summed gradients into their mean over `items` clipped to total L2 norm `max_norm` (`inf`:
        not clipped), and check them, in the two passes gradient clipping makes anyway: one norm (read) and one
        multiply (read and write) by `clip_coefficient / items`. The stock Trainer's clipping of a mean gradient
        costs the same two passes, so dividing and checking cost no pass of their own.

        The norm of the sums is `items` times the mean's; an inf or NaN makes it non-finite. Only a non-finite norm,
        which finite values can also produce by overflowing their squares, pays for the exact check (and then
        divides before clipping, as `torch.nn.utils.clip_grad_norm_` would on the mean).

        Returns:
            `(finite, norm)`: whether every gradient is finite (if not, the gradients are left as they are, for the
            window to be skipped) and the mean gradient's L2 norm before clipping (`None` where there is no
            gradient). Reading the norm is the pass's one wait for the device.
        """
        grads = self._grads()
        if not grads:
            return True, None
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        first = grads[0].device
        norms = [norm.to(first) for group in by_device.values() for norm in torch._foreach_norm(group)]
        mean_norm = torch.linalg.vector_norm(torch.stack(norms)) / items
        norm = float(mean_norm)
        if not math.isfinite(norm):
            if not all(all_finite(g) for g in grads):
                return False, norm
            self.scale_(1.0 / items)
            params = [p for p in self.parameters if p.grad is not None]
            return True, float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        # `clip_grad_norm_`'s coefficient, from the mean's norm.
        coefficient = torch.clamp(max_norm / (mean_norm + 1e-6), max=1.0) / items
        for device, group in by_device.items():
            torch._foreach_mul_(group, coefficient.to(device))
        return True, norm

    def all_reduce_(self, group: torch.distributed.ProcessGroup | None = None) -> int:
        """Sum every parameter's gradient over `group`'s ranks, in flat buckets of one dtype and device; a parameter
        without a gradient on this rank takes part with zeros (another rank may have one). Returns the number of
        collectives."""
        for p in self.parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: list[list[torch.Tensor]] = []
        room = 0
        for grad in (p.grad for p in self.parameters):
            nbytes = grad.numel() * grad.element_size()
            last = buckets[-1] if buckets else None
            if last and (grad.dtype, grad.device) == (last[0].dtype, last[0].device) and nbytes <= room:
                last.append(grad)
                room -= nbytes
            else:
                buckets.append([grad])
                room = ALL_REDUCE_BUCKET_BYTES - nbytes
        for bucket in buckets:
            flat = torch._utils._flatten_dense_tensors(bucket)
            torch.distributed.all_reduce(flat, group=group)
            for grad, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(reduced)
        return len(buckets)

    def gradient_for(self, index: int, param_dtype: torch.dtype) -> torch.Tensor:
        """The accumulated gradient of `parameters[index]`: its `.grad` (already in `param_dtype`)."""
        return self.parameters[index].grad

    def close(self) -> None:
        """Nothing to release: no hooks, no host thread."""

    def snapshot(self) -> dict[str, list[torch.Tensor | None]]:
        """CPU copies of the window's gradients so far (`None` where a parameter has none), for a mid-window
        checkpoint."""
        return {
            "in_place_gradients": [None if p.grad is None else p.grad.detach().cpu().clone() for p in self.parameters]
        }

    def restore(self, saved: object) -> None:
        grads = saved.get("in_place_gradients") if isinstance(saved, dict) else None
        if grads is None or len(grads) != len(self.parameters):
            raise ValueError(
                "This mid-window checkpoint was not saved by an accumulator on the in-place path with these "
                f"{len(self.parameters)} parameters (saved with `accumulation_path='hooks'`?). Resume with the path "
                "it was saved with: `accumulation_path='hooks'` (GradientAccumulator) or "
                "`GradAccumArguments(accumulation_path='hooks')`."
            )
        for p, tensor in zip(self.parameters, grads, strict=True):
            p.grad = None if tensor is None else tensor.to(device=p.device, dtype=p.dtype).clone()
