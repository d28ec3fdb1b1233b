"""FSDP2 (`fully_shard`) plain-loop parity worker: spawns `world_size` gloo CPU processes, trains 2 windows with
`GradientAccumulator` on a sharded model (uneven micro-batches, different token counts per rank, clipping in the
second window) and compares the full weights with a hand-computed large-batch step on an unsharded copy.

Usage: python tests/workers/fsdp2_parity.py WORLD_SIZE OUT_JSON
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import GradientAccumulator  # noqa: E402

VOCAB, DIM, STEPS, LR, CLIP = 11, 16, 3, 1.0, 0.3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB))


def data(world_size: int, micro_batches: tuple[int, ...] = (STEPS, STEPS)) -> list[list[list[torch.Tensor]]]:
    """data[window][rank][micro] = token ids (1-D, length varies by rank and micro-batch; -100 = padding);
    `micro_batches[w]` micro-batches in window `w` (fewer than `STEPS`: a partial window)."""
    g = torch.Generator().manual_seed(1)
    windows = []
    for count in micro_batches:
        ranks = []
        for r in range(world_size):
            micros = []
            for k in range(count):
                length = 3 + (5 * r + 7 * k) % 9
                tokens = torch.randint(0, VOCAB, (length,), generator=g)
                labels = torch.randint(0, VOCAB, (length,), generator=g)
                labels[torch.rand(length, generator=g) < 0.3] = -100
                micros.append((tokens, labels))
            ranks.append(micros)
        windows.append(ranks)
    return windows


def loss_fn(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens), labels, ignore_index=-100, reduction=reduction)


def reference(world_size: int, windows: list | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Initial and final fp64 weights of the large-batch steps over `windows` (default `data(world_size)`)."""
    model = make_model().double()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for w, ranks in enumerate(data(world_size) if windows is None else windows):
        opt.zero_grad()
        total = sum(int((y != -100).sum()) for micros in ranks for _, y in micros)
        loss = sum(loss_fn(model, x, y, "sum") for micros in ranks for x, y in micros) / total
        loss.backward()
        if w == 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
    return initial, [p.detach().clone() for p in model.parameters()]


def worker(rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in (model[0], model[1], model[3]):
        fully_shard(layer)
    fully_shard(model)
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
        diff = sum(float((a - b).pow(2).sum()) for a, b in zip(full, ref, strict=True)) ** 0.5
        update = sum(float((r - i).pow(2).sum()) for r, i in zip(ref, initial, strict=True)) ** 0.5
        with open(out, "w") as f:
            json.dump(
                {
                    "relative_update_error": diff / update,
                    "buffer_numel": acc.buffers.flat[acc.buffers.first_device].numel(),
                    "local_param_numel": local_numel,
                    "full_numel": sum(p.numel() for p in ref),
                    "grad_norm": norms[1],
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = int(sys.argv[1])
    mp.spawn(worker, args=(world, port, sys.argv[2]), nprocs=world)
