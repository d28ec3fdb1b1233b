"""Why the ResNet recipe's exact arms (GroupNorm, frozen BatchNorm) drift from the large batch in fp32, and why that
is rounding, not accumulation.

The default ResNet recipe trains a random-init ReLU ResNet on MNIST digits. Its accumulated GroupNorm / frozen-BN
arms agree with the large batch to ~1e-7 for the first steps, then drift to ~1e-2. This script takes the recipe's
model and data (same seed, 64x64 digits, micro-batch 16 x 8 vs batch 128) and trains with SGD(lr 0.05, momentum 0.9)
in a plain loop with `GradientAccumulator`, four ways:

1. fp32, accumulated vs large batch: the drift the recipe shows;
2. fp32, the large batch vs itself with every weight perturbed by 1e-7 relative: drift of the same size, with no
   accumulation anywhere (the recipe's `noise_floor` arms);
3. fp64, accumulated vs large batch: the same two computations with rounding 1e9 times smaller stay equal to
   ~1e-16 at every step: the accumulated update *is* the large-batch update; fp32 rounding differences flip ReLU /
   max-pool decisions, and those flips are what training amplifies.

From the repository root, with the project's virtualenv (about a minute per mode on a 2-core CPU):

    python benchmarks/resnet_rounding_drift.py --modes groupnorm freeze --steps 24
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

import finetune_resnet as recipe  # noqa: E402  (the recipe's data, model and BatchNorm treatment)
from harness.arms import perturb_for_noise_floor  # noqa: E402  (recipes/ is on sys.path)

from hf_gradaccum import GradientAccumulator  # noqa: E402

BATCH = 128


def train(base, images, labels, collator, *, dtype, micro, steps, perturb=False) -> list[float]:
    model = copy.deepcopy(base).to(dtype).train()
    if perturb:
        perturb_for_noise_floor(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    accumulator = GradientAccumulator(model, BATCH // micro, accumulation_dtype=dtype)
    losses = []
    for step in range(steps):
        total = 0.0
        for k in range(BATCH // micro):
            start = step * BATCH + k * micro
            batch = collator([{"pixel_values": images[j], "labels": labels[j]} for j in range(start, start + micro)])
            loss = model(pixel_values=batch["pixel_values"].to(dtype), labels=batch["labels"]).loss
            accumulator.backward(loss, num_items=micro)
            total += float(loss.detach()) * micro
        accumulator.step(optimizer)
        losses.append(total / BATCH)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["groupnorm", "freeze"], choices=["groupnorm", "freeze"])
    parser.add_argument("--steps", type=int, default=24, help="Optimizer steps of 128 digits each.")
    parser.add_argument("--micro", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(2)

    data = recipe.load_mnist_5k(42, 1000)
    images, labels = data.train_images, data.train_labels
    collator = recipe.ImageCollator(64, 1, recipe.MNIST_MEAN, recipe.MNIST_STD)
    config = argparse.Namespace(
        model_name_or_path=None, resnet_embedding_size=32, resnet_hidden_sizes=[32, 64, 128, 256],
        resnet_depths=[1, 1, 1, 1],
    )  # fmt: skip
    rows = []
    for mode in args.modes:
        torch.manual_seed(42)
        base, _, _ = recipe.build_model(config, data.label_names)
        recipe.apply_batchnorm_mode(base, mode, steps=BATCH // args.micro, groups=8)
        common = dict(images=images, labels=labels, collator=collator, steps=args.steps)
        large32 = train(base, dtype=torch.float32, micro=BATCH, **common)
        accumulated32 = train(base, dtype=torch.float32, micro=args.micro, **common)
        perturbed32 = train(base, dtype=torch.float32, micro=BATCH, perturb=True, **common)
        large64 = train(base, dtype=torch.float64, micro=BATCH, **common)
        accumulated64 = train(base, dtype=torch.float64, micro=args.micro, **common)
        for what, a, b in (
            ("fp32 accumulated vs large batch", accumulated32, large32),
            ("fp32 large batch perturbed 1e-7 vs large batch", perturbed32, large32),
            ("fp64 accumulated vs large batch", accumulated64, large64),
        ):
            diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
            rows.append((mode, what, diffs))
            print(
                f"{mode:9s} {what:48s} step 1 {diffs[0]:.0e}, max {max(diffs):.1e}, last {diffs[-1]:.1e}", flush=True
            )

    print(f"\n| BatchNorm | comparison | step-1 \\|Δloss\\| | max \\|Δloss\\| over {args.steps} steps |")
    print("|---|---|---:|---:|")
    for mode, what, diffs in rows:
        print(f"| {mode} | {what} | {diffs[0]:.0e} | {max(diffs):.1e} |")


if __name__ == "__main__":
    main()
