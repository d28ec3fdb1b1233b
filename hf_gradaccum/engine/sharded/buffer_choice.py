"""Which gradient buffers a model's parameters get (replicated, offloaded to the host, FSDP2 shards or
tensor-parallel shards), and the engines that keep gradients themselves and are refused. Above both kinds of sharded
buffers, so neither has to know the other."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..buffers import FlatGradientBuffers
from ..offload import OffloadedGradientBuffers
from .fsdp2_buffers import (
    ShardedGradientBuffers,
    fsdp2_modules,
    is_dtensor,
    prepare_fsdp2_for_summing,
    refuse_unsharded_trainable_parameters,
)
from .tensor_parallel import is_tensor_parallel


def refuse_sharded_engines(model: nn.Module | Iterable[nn.Parameter]) -> None:
    """
    DeepSpeed and FSDP1 (`FullyShardedDataParallel`) accumulate and reduce gradients themselves, so the buffers
    cannot sit between backward and the optimizer: refuse them with an error that says what to use, instead of
    training wrong (`GradAccumTrainer` under DeepSpeed weights the loss instead and installs no buffers). FSDP2
    (`fully_shard`) is supported (sharded buffers), and so is tensor parallelism (`DTensor` parameters on a mesh
    dimension named `tp`, `engine/sharded/tensor_parallel.py`); other `DTensor` parameters without FSDP2 are refused.
    """

    if not isinstance(model, nn.Module):
        if any(is_dtensor(p) for p in model):
            raise ValueError(
                "GradientAccumulator needs the `nn.Module` (not its parameters) for FSDP2/DTensor models, so it can "
                "make the reduce-scatter sum (gradient divide factor 1.0)."
            )
        return
    engine = None
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        engine = "FSDP1 (FullyShardedDataParallel)"
    elif type(model).__name__ == "DeepSpeedEngine":
        engine = "DeepSpeed"
    elif any(is_dtensor(p) and not is_tensor_parallel(p) for p in model.parameters()) and not fsdp2_modules(model):
        engine = "DTensor parameters laid out by neither FSDP2 nor tensor parallelism (a mesh dimension named 'tp')"
    if engine is not None:
        deepspeed = (
            " Under DeepSpeed, use `GradAccumTrainer`: it weights each micro-batch's loss before DeepSpeed's own "
            "accumulation (docs/engines.md)."
            if engine == "DeepSpeed"
            else ""
        )
        raise ValueError(
            f"GradientAccumulator does not support {engine}: the engine shards and reduces gradients itself. Use DDP "
            f"or FSDP2 (`torch.distributed.fsdp.fully_shard`) with hf_gradaccum.{deepspeed}"
        )


def gradient_buffers_for(
    model: nn.Module | Iterable[nn.Parameter],
    parameters: list[nn.Parameter],
    dtype: torch.dtype,
    reduce_gradients: bool | None,
    *,
    offload: bool = False,
) -> FlatGradientBuffers:
    """
    The accumulation buffers `parameters` need: [`ShardedGradientBuffers`] when they are FSDP2's `DTensor`s (after
    making FSDP2's reduce-scatter sum and refusing what it could not reduce), [`TensorParallelGradientBuffers`] for
    tensor-parallel `DTensor`s without FSDP2, else replicated
    [`FlatGradientBuffers`] (in host memory with `offload=True`: [`OffloadedGradientBuffers`]). Everything that differs between the two lives behind the buffers' interface
    (`weighting`, `agree`, `all_finite_on_every_rank`, `reduced_at_window_end`, `backward_without_items`).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.sharded.buffer_choice import gradient_buffers_for
    >>> model = torch.nn.Linear(2, 2)
    >>> type(gradient_buffers_for(model, list(model.parameters()), torch.float32, None)).__name__
    'FlatGradientBuffers'
    ```
    """
    if not any(is_dtensor(p) for p in parameters):
        return OffloadedGradientBuffers(parameters, dtype) if offload else FlatGradientBuffers(parameters, dtype)
    if offload:
        raise ValueError(
            "`offload_accumulation_buffer=True` is for replicated parameters (one device, DDP); this is an FSDP2 or "
            "tensor-parallel model, whose accumulation buffer is already sharded (each rank holds its shards on the "
            "GPU). Set `offload_accumulation_buffer=False`."
        )
    # `refuse_sharded_engines` already refused DTensor parameters passed without their module.
    fsdp_modules = prepare_fsdp2_for_summing(model)
    if not fsdp_modules:
        from .tensor_parallel import TensorParallelGradientBuffers  # imports this module

        # Tensor parallelism alone (`refuse_sharded_engines` refused any other DTensor layout without FSDP2).
        return TensorParallelGradientBuffers(parameters, dtype)
    refuse_unsharded_trainable_parameters(model, parameters)
    if reduce_gradients is False:
        raise ValueError(
            "`reduce_gradients=False` cannot be used with an FSDP2 model: FSDP2 reduce-scatters every backward, so "
            "the ranks' gradients are summed anyway while the items would be counted on this rank only. Leave "
            "`reduce_gradients` unset (None) or True."
        )
    buffers = ShardedGradientBuffers(parameters, dtype)
    buffers.fsdp_modules = fsdp_modules
    return buffers
