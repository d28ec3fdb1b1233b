"""FSDP2 (`fully_shard`) plain-loop parity worker: spawns `world_size` gloo CPU processes, trains 2 windows with
`GradientAccumulator` on a sharded model (uneven micro-batches, different token counts per rank, clipping in the
second window) and compares the full weights with a hand-computed large-batch step on an unsharded copy.

Usage: python tests/workers/fsdp2_parity.py WORLD_SIZE OUT_JSON
"""

import json
import os
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import GradientAccumulator  # noqa: E402
from tests.workers.gloo_spawn import run_gloo  # noqa: E402

VOCAB, DIM, STEPS, LR, CLIP = 11, 16, 3, 1.0, 0.3


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB))


def shard(model: nn.Module, policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """`fully_shard` each layer with parameters, then the root (the FSDP2 idiom), with an optional
    `MixedPrecisionPolicy`."""
    policy = policy or MixedPrecisionPolicy()
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def data(world_size: int, windows: int | tuple[int, ...] = 2) -> list[list[list[torch.Tensor]]]:
    """data[window][rank][micro] = token ids (1-D, length varies by rank and micro-batch; -100 = padding). `windows`:
    how many full windows, or the number of micro-batches in each window (fewer than `STEPS`: a partial window). The
    last rank's second micro-batch of every window has no items at all."""
    g = torch.Generator().manual_seed(1)
    out = []
    for count in (STEPS,) * windows if isinstance(windows, int) else windows:
        ranks = []
        for r in range(world_size):
            micros = []
            for k in range(count):
                length = 3 + (5 * r + 7 * k) % 9
                tokens = torch.randint(0, VOCAB, (length,), generator=g)
                labels = torch.randint(0, VOCAB, (length,), generator=g)
                labels[torch.rand(length, generator=g) < 0.3] = -100
                if (r, k) == (world_size - 1, 1):
                    labels[:] = -100  # a micro-batch with zero items on one rank: it must still join the collectives
                micros.append((tokens, labels))
            ranks.append(micros)
        out.append(ranks)
    return out


def loss_fn(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens), labels, ignore_index=-100, reduction=reduction)


def reference(
    world_size: int,
    make_optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    windows: int | tuple[int, ...] = 2,
    clip_window: int | None = 1,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The hand-computed large batch in fp64: one step per window on all ranks' samples (SGD by default)."""
    model = make_model().double()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = (make_optimizer or (lambda params: torch.optim.SGD(params, lr=LR)))(model.parameters())
    for w, ranks in enumerate(data(world_size, windows)):
        opt.zero_grad()
        total = sum(int((y != -100).sum()) for micros in ranks for _, y in micros)
        loss = sum(loss_fn(model, x, y, "sum") for micros in ranks for x, y in micros) / total
        loss.backward()
        if w == clip_window:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return initial, [p.detach().clone() for p in model.parameters()]


def relative_update_error(weights: list[torch.Tensor], initial: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """|weights - ref| / |ref - initial| over all parameters (L2)."""
    diff = sum(float((a - b).pow(2).sum()) for a, b in zip(weights, ref, strict=True)) ** 0.5
    update = sum(float((r - i).pow(2).sum()) for r, i in zip(ref, initial, strict=True)) ** 0.5
    return diff / update


def worker(rank: int, world_size: int, out: str) -> None:
    model = shard(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = GradientAccumulator(model, gradient_accumulation_steps=STEPS)
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    norms = []
    for w, ranks in enumerate(data(world_size)):
        for x, y in ranks[rank]:
            acc.backward(loss_fn(model, x, y), num_items=int((y != -100).sum()))
        result = acc.step(opt, max_grad_norm=CLIP if w == 1 else None)
        assert result.applied, result
        norms.append(result.grad_norm)
    full = [p.full_tensor().detach().double() for p in model.parameters()]
    if rank == 0:
        initial, ref = reference(world_size)
        with open(out, "w") as f:
            json.dump(
                {
                    "relative_update_error": relative_update_error(full, initial, ref),
                    "buffer_numel": acc.buffers.flat[acc.buffers.first_device].numel(),
                    "local_param_numel": local_numel,
                    "full_numel": sum(p.numel() for p in ref),
                    "grad_norm": norms[1],
                },
                f,
            )


if __name__ == "__main__":
    run_gloo(worker, int(sys.argv[1]), sys.argv[2])
