"""The gradient half of the first-window measurement (`engine/loss_normalisation.py`), shared by the Trainer and the
plain loop: weighted gradients of a few batches, accumulated in `.grad` one graph at a time."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..engine.oom_retry import is_out_of_memory, release_cached_memory


def gradient_norm(params: Sequence[torch.Tensor]) -> float:
    """The L2 norm of the `.grad` of `params` (0 when none has one)."""
    grads = [torch.linalg.vector_norm(p.grad.detach().float()) for p in params if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0


def gradient_residual_for(
    params: Sequence[torch.Tensor], loss_with_graph: Callable[[Mapping[str, Any]], torch.Tensor]
) -> Callable[[Sequence[tuple[Mapping[str, Any], float]]], float]:
    """
    `residual([(batch, weight), ...])`: `||sum_i weight_i grad L(batch_i)|| / ||grad L(batch_0)||`, each batch's
    graph built and back-propagated in turn into `.grad` (emptied first, put back after): no more memory than one
    training micro-step. A batch of weight 0 still runs its forward (sharded forwards are collectives). Out of memory:
    NaN (the loss values decide alone).

    Example:

    ```python
    >>> import torch
    >>> layer = torch.nn.Linear(2, 1)
    >>> residual = gradient_residual_for(list(layer.parameters()), lambda b: layer(b["x"]).sum())
    >>> x = torch.randn(4, 2)
    >>> residual([({"x": x}, 1.0), ({"x": x[:1]}, -1.0), ({"x": x[1:]}, -1.0)]) < 1e-6  # a sum over rows
    True
    ```
    """
    params = list(params)

    def residual(terms: Sequence[tuple[Mapping[str, Any], float]]) -> float:
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            first = 0.0
            for index, (batch, weight) in enumerate(terms):
                loss = loss_with_graph(batch)
                if not loss.requires_grad:
                    # A loss returned without its graph (its own backward ran inside `compute_loss`): no gradient
                    # to compare here, the loss values decide alone.
                    return math.nan
                if weight:
                    (loss.float() * weight).backward()
                if index == 0:
                    first = gradient_norm(params)
            return gradient_norm(params) / max(first, 1e-30)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            release_cached_memory()
            return math.nan
        finally:
            for p, grad in zip(params, saved, strict=True):
                p.grad = grad

    return residual


def reduce_max_over_ranks(values: list[float]) -> list[float]:
    """The element-wise maximum of `values` over every rank (unchanged in one process), so every rank decides alike."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()
