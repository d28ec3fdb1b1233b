"""Coupled-loss mode under 2-process DDP (gloo): each rank runs its own uneven micro-batches with its own dropout
masks; the window is both ranks' representations. Every rank compares its final `.grad` with the large-batch
gradient over all ranks' samples (one graph, each micro-batch's forward from the RNG state it had on its rank in pass
1) and with plain accumulation; rank 0 writes the relative errors to a JSON file.

    python tests/workers/coupled_ddp.py OUT.json [case ...]
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum.engine.accumulator import GradientAccumulator  # noqa: E402
from tests.workers.coupled_cases import (  # noqa: E402
    TwoTower,
    clip_batches,
    flat_grads,
    generic_batches,
    generic_coupled,
    ranking_batches,
    reference_gradient,
    relative_error,
    tiny_bert,
    tiny_clip,
)
from tests.workers.gloo_spawn import run_gloo  # noqa: E402

RANK_SIZES = ((3, 5, 2), (4, 1, 3))  # uneven within and across ranks


def build(case: str, rank: int):
    sizes = RANK_SIZES[rank]
    if case == "generic":
        torch.manual_seed(0)
        model = TwoTower(dropout=0.1)
        offset = sum(RANK_SIZES[0]) if rank else 0
        return model, generic_coupled(model, check_recompute=True), generic_batches(sizes, seed=rank, offset=offset)
    from hf_gradaccum.losses.coupled import clip_coupled_loss, ranking_coupled_loss

    if case == "clip":
        return tiny_clip(0.1), clip_coupled_loss(check_recompute=True), clip_batches(sizes, seed=rank)
    if case == "ranking":
        coupled = ranking_coupled_loss(scale=20.0, symmetric=True, check_recompute=True)
        return tiny_bert(0.1), coupled, ranking_batches(sizes, seed=rank)
    raise ValueError(case)


def run_case(case: str, rank: int, world: int) -> dict:
    model, coupled, batches = build(case, rank)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    acc = GradientAccumulator(ddp, len(batches))
    torch.manual_seed(100 + rank)  # different dropout masks on each rank
    coupled.accumulate_window(acc, ddp, batches)
    result = acc.finish_window()
    assert result.applied, result
    got = flat_grads(ddp.module)
    window = coupled.last_window
    assert window.world_size == world and window.recompute_max_abs_diff == [0.0] * len(batches)

    # The large batch over both ranks with the same masks: rank 0's micro-batches, then rank 1's.
    states, all_batches = [None] * world, [None] * world
    dist.all_gather_object(states, window.rng_states)
    dist.all_gather_object(all_batches, batches)
    ref = reference_gradient(model, coupled, [b for bs in all_batches for b in bs], [s for ss in states for s in ss])

    plain_model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    plain_acc = GradientAccumulator(plain_model, len(batches))
    torch.manual_seed(100 + rank)
    for batch in batches:
        with plain_acc.accumulate(plain_model):
            plain_acc.backward(coupled.window_loss(plain_model, [batch]), coupled.num_items_fn(batch))
    plain_acc.finish_window()
    plain = flat_grads(plain_model.module)
    return {
        "coupled": relative_error(got, ref),
        "plain": relative_error(plain, ref),
        "items": result.num_items,
        "loss_params": len(window.loss_parameter_grads),
    }


def worker(rank: int, world: int, out: str, cases: list[str]) -> None:
    results = {case: run_case(case, rank, world) for case in cases}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f, indent=1)


if __name__ == "__main__":
    run_gloo(worker, 2, sys.argv[1], sys.argv[2:] or ["generic", "clip", "ranking"])
