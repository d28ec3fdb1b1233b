"""What the ranks exchange at the end of a window.

Everything the ranks must agree on travels in one small float64 vector, summed by one all-reduce next to the
gradient buffers': items, the overflow flag, local loss-scale backoffs, each rank's loss scale in its own slot (so
the minimum can be read back), which parameters got a gradient, and the loss sum. One overflow decision, one item
count and one scale on every rank follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffers import FlatGradientBuffers
from .window import WindowState


def world_size_and_rank(
    reduce_gradients: bool | None, group: torch.distributed.ProcessGroup | None = None
) -> tuple[int, int]:
    """`(size, rank)` in `group` (the default process group when `None`: every rank), or `(1, 0)` when not reducing
    across ranks."""
    dist = torch.distributed
    if reduce_gradients is None:
        reduce_gradients = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    if not reduce_gradients:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


@dataclass
class ReducedWindow:
    """The window's statistics summed over ranks."""

    items: float
    overflowed: bool
    backoffs: float
    min_scale: float
    touched: list[bool]
    loss_sum: float


def reduce_window(
    window: WindowState,
    buffers: FlatGradientBuffers,
    scale: float,
    world_size: int,
    rank: int,
    *,
    reduce_buffers: bool = True,
    group: torch.distributed.ProcessGroup | None = None,
) -> tuple[ReducedWindow, int]:
    """
    Sum the gradient buffers and the window's statistics over the ranks of `group` (every rank when `None`; under
    tensor parallelism the data-parallel group, see `tensor_parallel.py`), a no-op for one rank. `world_size` and
    `rank` are those within `group`. Returns the reduced statistics and the number of collectives launched.
    `reduce_buffers=False` sums only the statistics: FSDP2's sharded buffers were already reduce-scattered at every
    micro-batch.
    """
    scales = [0.0] * world_size
    scales[rank] = scale
    local = [window.items, float(window.overflowed), float(window.backoffs), *scales, *map(float, window.touched)]
    stats = torch.cat(
        [torch.tensor(local, dtype=torch.float64, device=buffers.first_device), window.loss_sum.reshape(1)]
    )
    collectives = 0
    if world_size > 1:
        if reduce_buffers:
            collectives = buffers.all_reduce_(group)
        torch.distributed.all_reduce(stats, group=group)
        collectives += 1
    values = stats.tolist()
    reduced = ReducedWindow(
        items=values[0],
        overflowed=values[1] > 0,
        backoffs=values[2],
        min_scale=min(values[3 : 3 + world_size]),
        touched=[t > 0 for t in values[3 + world_size : -1]],
        loss_sum=values[-1],
    )
    return reduced, collectives
