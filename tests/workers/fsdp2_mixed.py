"""FSDP2 mixed-precision worker: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`; 64 micro-batches in
all (64 / world_size per rank) accumulated in the sharded fp32 buffer, against the one-pass floor (the same samples
in one micro-batch per rank, same policy), both measured as the gradient's relative error vs fp64.

Usage: python tests/workers/fsdp2_mixed.py WORLD_SIZE OUT_JSON [FSDP_REDUCE_SCHEDULE]
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import GradientAccumulator  # noqa: E402
from tests.workers.fsdp2_parity import VOCAB, loss_fn, make_model, shard  # noqa: E402
from tests.workers.gloo_spawn import run_gloo  # noqa: E402

MICRO_BATCHES = 64


def data(world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """data[rank][micro]: uneven lengths, some labels ignored."""
    g = torch.Generator().manual_seed(2)
    out = []
    for r in range(world_size):
        micros = []
        for k in range(MICRO_BATCHES // world_size):
            length = 4 + (3 * r + 5 * k) % 13
            x = torch.randint(0, VOCAB, (length,), generator=g)
            y = torch.randint(0, VOCAB, (length,), generator=g)
            y[torch.rand(length, generator=g) < 0.2] = -100
            micros.append((x, y))
        out.append(micros)
    return out


def fp64_gradient(world_size: int) -> list[torch.Tensor]:
    model = make_model().double()
    batches = [m for micros in data(world_size) for m in micros]
    total = sum(int((y != -100).sum()) for _, y in batches)
    (sum(loss_fn(model, x, y, "sum") for x, y in batches) / total).backward()
    return [p.grad for p in model.parameters()]


def sharded_gradient(
    rank: int, world_size: int, one_pass: bool, schedule: str = "every_micro_batch"
) -> list[torch.Tensor]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = shard(make_model(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    micros = data(world_size)[rank]
    if one_pass:
        micros = [(torch.cat([x for x, _ in micros]), torch.cat([y for _, y in micros]))]
    acc = GradientAccumulator(model, gradient_accumulation_steps=len(micros), fsdp_reduce_schedule=schedule)
    for x, y in micros:
        acc.backward(loss_fn(model, x, y), num_items=int((y != -100).sum()))
    assert acc.finish_window().applied
    grads = [p.grad.full_tensor().double() for p in model.parameters()]
    assert all(p.grad.to_local().dtype == torch.float32 for p in model.parameters())
    return grads


def relative_error(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(grads, ref, strict=True))
    return (diff / sum(float(b.pow(2).sum()) for b in ref)) ** 0.5


def worker(rank: int, world_size: int, out: str, schedule: str) -> None:
    accumulated = sharded_gradient(rank, world_size, one_pass=False, schedule=schedule)
    one_pass = sharded_gradient(rank, world_size, one_pass=True, schedule=schedule)
    if rank == 0:
        ref = fp64_gradient(world_size)
        record = {
            "accumulated_error": relative_error(accumulated, ref),
            "one_pass_error": relative_error(one_pass, ref),
            "schedule": schedule,
        }
        with open(out, "w") as f:
            json.dump(record, f)


if __name__ == "__main__":
    run_gloo(worker, int(sys.argv[1]), sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "every_micro_batch")
