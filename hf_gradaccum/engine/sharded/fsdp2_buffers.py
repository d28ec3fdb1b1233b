"""Sharded accumulation buffers for FSDP2 (`torch.distributed.fsdp.fully_shard`) models.

FSDP2 reduce-scatters each micro-batch's gradients and hands every rank only its shard, as a `DTensor` in the
parameter's `.grad`; the post-accumulate-grad hook fires on the sharded parameter after that reduce-scatter. So the
accumulation buffer is sharded like the parameters: each rank holds one flat fp32 buffer of its *local* shards
(1/world_size of the model), fills it from `grad.to_local()`, and at the window's end hands each parameter a
`DTensor` whose local tensor is a view of that buffer.

Item weighting across ranks needs the reduce-scatter to *sum* `n_k^r * grad(mean_loss_k^r)` over ranks `r`. FSDP2
averages by default, and a rank's weight `n_k^r` cannot be applied after the reduction (it differs between ranks),
so the accumulator (a) sets every FSDP module's gradient divide factor to 1.0 and (b) multiplies each rank's loss
by its own `n_k^r` before backward. The window's items are then summed over ranks once per window.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..buffers import FlatGradientBuffers


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a `torch.distributed.tensor.DTensor` (without importing it when it is not)."""
    return type(tensor).__name__ == "DTensor" or any(c.__name__ == "DTensor" for c in type(tensor).__mro__)


def fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` was applied to (FSDP2's `FSDPModule`)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def fsdp2_supported() -> bool:
    """Whether this torch can accumulate an FSDP2 model: its reduce-scatter must be made to sum (torch>=2.8)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return hasattr(FSDPModule, "set_gradient_divide_factor")


def prepare_fsdp2_for_summing(model: nn.Module) -> list[nn.Module]:
    """
    Make every FSDP2 module's reduce-scatter sum instead of average (gradient divide factor 1.0), so item weights
    applied to each rank's loss survive the reduction. Returns the FSDP2 modules (empty for a model without any).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.fsdp2_buffers import prepare_fsdp2_for_summing
    >>> prepare_fsdp2_for_summing(torch.nn.Linear(2, 2))
    []
    ```
    """
    modules = fsdp2_modules(model)
    if modules and not fsdp2_supported():
        raise RuntimeError(
            f"Accumulating an FSDP2 (`fully_shard`) model needs torch>=2.8 (`FSDPModule.set_gradient_divide_factor`, "
            f"to make the reduce-scatter sum rather than average); found torch {torch.__version__}. Upgrade torch, or "
            "use DDP or a single process, which work from torch 2.6."
        )
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives (a divide by 1.0 after them is exact): gloo has no PREMUL_SUM, and a sum needs none.
        module.set_force_sum_reduction_for_comms(True)
    return modules


class ShardedGradientBuffers(FlatGradientBuffers):
    """
    [`FlatGradientBuffers`] over the *local shards* of `DTensor` parameters: each rank allocates only its shard of
    the gradients (fp32 by default), and [`gradient_for`] returns a `DTensor` laid out like the parameter, whose
    local tensor is the buffer view itself (no copy when the dtypes agree).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.fsdp2_buffers import ShardedGradientBuffers
    >>> buffers = ShardedGradientBuffers(list(torch.nn.Linear(3, 2).parameters()), torch.float32)
    >>> [tuple(v.shape) for v in buffers.views]  # plain tensors are their own shard
    [(2, 3), (2,)]
    ```
    """

    def __init__(self, parameters: Sequence[nn.Parameter], dtype: torch.dtype) -> None:
        self._params = list(parameters)
        local = [p.to_local() if is_dtensor(p) else p for p in self._params]
        super().__init__(local, dtype)

    def fold(self, index: int, grad: torch.Tensor, alpha: float) -> None:
        if is_dtensor(grad):
            param = self._params[index]
            if tuple(grad.placements) != tuple(param.placements):
                # Tensor parallelism can hand back a gradient laid out otherwise than its parameter (a vocabulary-
                # sharded embedding gets a replicated one): the buffer holds this rank's shard of the parameter.
                grad = grad.redistribute(param.device_mesh, param.placements)
            grad = grad.to_local()
        super().fold(index, grad, alpha)

    def gradient_for(self, index: int, param_dtype: torch.dtype) -> torch.Tensor:
        return self._as_parameter_layout(index, super().gradient_for(index, param_dtype))

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the buffer views, one per parameter, as `DTensor`s laid out like the parameters (plain tensors
        for plain parameters): `torch.distributed.checkpoint` then writes each rank's shard once and can reshard on
        load. The copies stay on the buffer's device (a `DTensor`'s local tensor lives on its mesh's device)."""
        return [self._as_parameter_layout(i, view.detach().clone()) for i, view in enumerate(self.views)]

    def restore(self, saved: Sequence[torch.Tensor]) -> None:
        """Copy a [`snapshot`] (per-parameter `DTensor`s or local tensors) back into the buffer views."""
        if len(saved) != len(self.views):
            raise ValueError(
                f"The saved sharded buffers hold {len(saved)} tensors but this accumulator has {len(self.views)} "
                "parameters: the checkpoint belongs to a different model (or to a non-FSDP2 accumulator)."
            )
        for view, tensor in zip(self.views, saved, strict=True):
            view.copy_(tensor.to_local() if is_dtensor(tensor) else tensor)

    def _as_parameter_layout(self, index: int, local: torch.Tensor) -> torch.Tensor:
        param = self._params[index]
        if not is_dtensor(param):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )

    sharded = True
    reduced_at_window_end = False  # FSDP2 reduce-scattered every micro-batch (or `once_per_window`) already
    backward_without_items = True  # every rank must join each micro-batch's reduce-scatter, even with no items

    def weighting(self, num_items: float, scale: float) -> tuple[float, float]:
        """The item weight goes into the loss: ranks' weights differ and the reduce-scatter sums their gradients
        before the fold sees them, so it could not be applied after."""
        return scale * num_items, 1.0 / scale

    def agree(self, flag: bool) -> bool:
        """`flag` OR-ed over ranks ([`agree_any`]): a skipped or redone micro-batch must be the same on every rank."""
        return agree_any(flag, self.first_device)

    def all_finite_on_every_rank(self) -> bool:
        """Each rank sees only its shard: one rank's inf must skip the window on every rank."""
        return self.all_finite_everywhere()

    def all_finite_everywhere(self) -> bool:
        """[`all_finite`] agreed over all ranks: a shard's inf on one rank skips the window on every rank."""
        flag = torch.tensor([0.0 if self.all_finite() else 1.0], device=self.first_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag)
        return float(flag.item()) == 0.0


def agree_any(flag: bool, device: torch.device) -> bool:
    """`flag` OR-ed over all ranks (one tiny all-reduce): FSDP2's backward is a collective, so a decision to skip or
    redo a micro-batch must be the same on every rank, or the ranks' reduce-scatters no longer pair up."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t)
    return float(t.item()) > 0


def local_gradients(parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The rank-local tensors of the parameters' `.grad` (DTensor or plain), skipping `None`."""
    return [p.grad.to_local() if is_dtensor(p.grad) else p.grad for p in parameters if p.grad is not None]


def refuse_unsharded_trainable_parameters(model: nn.Module, parameters: list[nn.Parameter]) -> None:
    """
    Under FSDP2 only the `DTensor` parameters are reduce-scattered; a plain trainable tensor next to them (e.g. a PEFT
    adapter attached after `fully_shard`) would be trained on each rank's own data alone. Refuse it, by name.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    plain = {id(p) for p in parameters if not is_dtensor(p)}
    if plain:
        names = [name for name, p in model.named_parameters() if id(p) in plain]
        raise ValueError(
            f"FSDP2 model with trainable parameters that `fully_shard` did not shard: {names[:5]}"
            f"{' ...' if len(names) > 5 else ''}. Their gradients would not be reduced across ranks. Apply "
            "`fully_shard` after adding them (e.g. after attaching PEFT adapters), or freeze them."
        )
