"""Tensor parallelism in the engine: parameters that `parallelize_module` (transformers' `tp_plan`, Accelerate's
`ParallelismConfig(tp_size=...)`) made `DTensor`s sharded on a mesh dimension named `tp`, next to plain tensors that
every rank of a tensor-parallel group holds whole (norm weights).

The ranks of one tensor-parallel group see the *same* batch: each computes the gradient of its own shard of every
sharded weight, and the same gradient for a replicated one. So the accumulation buffer holds each rank's local shards
(as FSDP2's does), the item weight is applied at the fold (nothing is reduced during the backward), and at the
window's end the buffer and the window's items are summed once over the *data-parallel* group only: the ranks that
see different batches, which hold the same shards. Summed over all ranks instead, a window's items would count once
per tensor-parallel rank and different shards would be added together. With FSDP2 on top (`tp_size` x `fsdp_size`),
FSDP2's buffers (`fsdp2_buffers.py`) are used and only the items need that group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..buffers import FlatGradientBuffers
from .fsdp2_buffers import ShardedGradientBuffers, agree_any, is_dtensor

TENSOR_PARALLEL_DIM_NAMES = ("tp",)
"""Mesh dimension names that mark a tensor-parallel `DTensor` (what transformers and Accelerate name it)."""


def is_tensor_parallel(tensor: torch.Tensor) -> bool:
    """
    Whether `tensor` is a `DTensor` laid out on a tensor-parallel mesh dimension (named `tp`).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.tensor_parallel import is_tensor_parallel
    >>> is_tensor_parallel(torch.zeros(2))
    False
    ```
    """
    if not is_dtensor(tensor):
        return False
    names = tensor.device_mesh.mesh_dim_names or ()
    return any(name in TENSOR_PARALLEL_DIM_NAMES for name in names)


def has_tensor_parallel_parameters(parameters: Sequence[torch.Tensor]) -> bool:
    """Whether any of `parameters` is tensor-parallel ([`is_tensor_parallel`])."""
    return any(is_tensor_parallel(p) for p in parameters)


class TensorParallelGradientBuffers(ShardedGradientBuffers):
    """
    Accumulation buffers for tensor-parallel parameters without FSDP2: each rank's local shards (plain tensors whole),
    in fp32 by default, handed back as `DTensor`s laid out like the parameters, and all-reduced once per window over
    the data-parallel group.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.tensor_parallel import TensorParallelGradientBuffers
    >>> buffers = TensorParallelGradientBuffers(list(torch.nn.Linear(3, 2).parameters()), torch.float32)
    >>> buffers.reduced_at_window_end
    True
    ```
    """

    reduced_at_window_end = True  # nothing reduces the gradients during the backward; one all-reduce per window
    backward_without_items = False  # a tensor-parallel group shares its batch, so its ranks skip together

    def weighting(self, num_items: float, scale: float) -> tuple[float, float]:
        """As replicated buffers: the item weight at the fold (no reduction happens before it)."""
        return FlatGradientBuffers.weighting(self, num_items, scale)

    def agree(self, flag: bool) -> bool:
        """OR-ed over all ranks: the shards differ, so an fp16 overflow can show on one tensor-parallel rank only,
        and a redone micro-batch must be redone by the whole group (its forward and backward are collectives)."""
        return agree_any(flag, self.first_device)

    def all_finite_on_every_rank(self) -> bool:
        """Each rank holds other shards: one rank's inf skips the window everywhere."""
        return self.all_finite_everywhere()


def data_parallel_reduction(
    parameters: Sequence[torch.Tensor],
    reduce_gradients: bool | None,
    data_parallel_group: torch.distributed.ProcessGroup | None,
) -> bool | None:
    """
    Check how a window is reduced when `parameters` are tensor-parallel, and return the `reduce_gradients` to use.
    Without tensor-parallel parameters, `reduce_gradients` unchanged. With them, the window must be summed over the
    data-parallel group only: `data_parallel_group` names it; when the tensor-parallel dimension spans every rank
    there is no data parallelism, so nothing is reduced (`False`); otherwise a `ValueError` asks for the group.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.tensor_parallel import data_parallel_reduction
    >>> data_parallel_reduction(list(torch.nn.Linear(2, 2).parameters()), None, None) is None
    True
    ```
    """
    tensor_parallel = [p for p in parameters if is_tensor_parallel(p)]
    if not tensor_parallel or data_parallel_group is not None:
        return reduce_gradients
    dist = torch.distributed
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mesh = tensor_parallel[0].device_mesh
    tp_size = math.prod(
        mesh.size(i) for i, name in enumerate(mesh.mesh_dim_names) if name in TENSOR_PARALLEL_DIM_NAMES
    )
    if reduce_gradients is False or tp_size == world:
        return False
    raise ValueError(
        f"Tensor-parallel parameters on {world} ranks with a tensor-parallel dimension of {tp_size}: pass "
        "`data_parallel_group` (the process group of the ranks that see different batches, e.g. "
        "`device_mesh['dp'].get_group()`), so that the window's items and gradients are summed over it alone. "
        "Summed over every rank, the items of a batch would count once per tensor-parallel rank."
    )
