"""FSDP2 fp16 worker: `MixedPrecisionPolicy(param_dtype=fp16, reduce_dtype=fp32)`, dynamic loss scaling with the
`recompute` policy, an overflow injected on rank 1 only (first attempt of micro-batch 2). Records, per rank, the full
weights' checksum, the loss scale and the recompute count, and the largest difference from a clean run.

Usage: python tests/workers/fsdp2_fp16.py WORLD_SIZE OUT_DIR
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_gradaccum import DynamicLossScaler, GradientAccumulator  # noqa: E402
from tests.workers.fsdp2_parity import STEPS, data, loss_fn, make_model, shard  # noqa: E402
from tests.workers.gloo_spawn import run_gloo  # noqa: E402

INJECT_RANK, INJECT_MICRO = 1, 2


def train(rank: int, world_size: int, inject: bool) -> tuple[list[torch.Tensor], GradientAccumulator]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = shard(make_model(), MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = GradientAccumulator(model, STEPS, loss_scaler=DynamicLossScaler(init_scale=2.0**12))
    for ranks in data(world_size):
        for k, (x, y) in enumerate(ranks[rank]):
            attempts = []

            def compute_loss(x=x, y=y, k=k, attempts=attempts) -> torch.Tensor:
                attempts.append(1)
                loss = loss_fn(model, x, y)
                if inject and rank == INJECT_RANK and k == INJECT_MICRO and len(attempts) == 1:
                    # Finite loss, overflowing fp16 gradients: what too large a loss scale does.
                    return loss.float() * 1e9
                return loss

            acc.accumulate_micro_batch(compute_loss, num_items=int((y != -100).sum()))
        assert acc.step(opt).applied
    return [p.full_tensor().detach().double() for p in model.parameters()], acc


def worker(rank: int, world_size: int, out_dir: str) -> None:
    clean, _ = train(rank, world_size, inject=False)
    weights, acc = train(rank, world_size, inject=True)
    diff = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(weights, clean, strict=True))
    record = {
        "checksum": [float(w.sum()) for w in weights] + [float(w.pow(2).sum()) for w in weights],
        "scale": acc.loss_scaler.scale,
        "recomputed": acc.recomputed_micro_batches,
        "applied": acc.applied_steps,
        "max_relative_diff_vs_clean": diff,
    }
    with open(os.path.join(out_dir, f"fp16_rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    run_gloo(worker, int(sys.argv[1]), sys.argv[2])
