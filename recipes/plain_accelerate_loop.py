"""Exact gradient accumulation in a plain Accelerate loop, without the Trainer.

The loop the seed tutorials write by hand (accumulate, step every N, clear), with `GradientAccumulator` doing the
bookkeeping. It trains a small classifier on scikit-learn's 8x8 digits twice, once with micro-batch 8 x 8
accumulation steps and once with batch 64, and prints how far apart the two runs end (they should agree to ~1e-6).

    accelerate launch recipes/plain_accelerate_loop.py            # or: python recipes/plain_accelerate_loop.py
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml recipes/plain_accelerate_loop.py
"""

from __future__ import annotations

import argparse

from harness.requirements import require_recipe_packages

# One line naming what to install (scikit-learn, for its digits), not an import traceback.
require_recipe_packages(__file__, "sklearn")

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from hf_gradaccum import GradientAccumulator  # noqa: E402
from hf_gradaccum.config.arguments import launched_data_parallel_without_accelerator  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402


def make_model() -> torch.nn.Module:
    set_seed(0)  # both runs start from the same weights
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))


def train(accelerator: Accelerator, micro_batch_size: int, accumulation_steps: int, epochs: int) -> torch.nn.Module:
    digits = load_digits()
    # Whole windows of the large batch on every process (1,792 of the 1,797 digits): both runs then see exactly the
    # same samples in every optimizer step, however Accelerate shards the batches over processes.
    n = len(digits.target) // (micro_batch_size * accumulation_steps * accelerator.num_processes)
    n *= micro_batch_size * accumulation_steps * accelerator.num_processes
    data = TensorDataset(torch.tensor(digits.data[:n], dtype=torch.float32) / 16.0, torch.tensor(digits.target[:n]))
    # Sequential order: both runs must see the same samples in each window.
    loader = DataLoader(data, batch_size=micro_batch_size, shuffle=False)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    accumulator = GradientAccumulator(model, gradient_accumulation_steps=accumulation_steps)
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            # Under DDP this skips the per-micro-batch all-reduce; the accumulator reduces once per window.
            with accumulator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                # Weighted by the micro-batch's item count, so a short last batch counts for what it holds.
                accumulator.backward(loss, num_items=len(y))
            # A window ends after N micro-batches, or early at the end of the epoch (a partial window).
            if accumulator.sync_gradients or i == len(loader) - 1:
                # Writes the large-batch mean gradient into .grad, clips, steps, and clears for the next window.
                result = accumulator.step(optimizer, max_grad_norm=1.0)
        accelerator.print(f"  epoch {epoch}: window loss {result.loss:.4f} ({accumulator.applied_steps} steps)")
    return accelerator.unwrap_model(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    # Without a GPU, Accelerate sets up data parallelism across the launched processes only when told to use the CPU.
    accelerator = Accelerator(cpu=launched_data_parallel_without_accelerator())
    accelerator.print(f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}")
    large = args.micro_batch_size * args.gradient_accumulation_steps
    accelerator.print(f"micro-batch {args.micro_batch_size} x {args.gradient_accumulation_steps} accumulation steps:")
    accumulated = train(accelerator, args.micro_batch_size, args.gradient_accumulation_steps, args.epochs)
    accelerator.print(f"one batch of {large} per process:")
    reference = train(accelerator, large, 1, args.epochs)

    w_acc = torch.cat([p.detach().flatten() for p in accumulated.parameters()])
    w_ref = torch.cat([p.detach().flatten() for p in reference.parameters()])
    difference = float((w_acc - w_ref).norm() / w_ref.norm())
    accelerator.print(f"relative weight difference after {args.epochs} epochs: {difference:.2e}")


if __name__ == "__main__":
    main()
    # Ranks leave together; the exit skips the interpreter teardown, where gloo can abort a finished run (SIGABRT).
    leave_process_group_and_exit(0)
