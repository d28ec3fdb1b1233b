"""`GradAccumArguments`: `TrainingArguments` plus the options of exact gradient accumulation."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from ..engine.accumulator import OVERFLOW_POLICIES, resolve_accumulation_dtype, validate_accumulation_steps
from ..engine.loss_scaling import validate_loss_scaling

LR_SCALING_RULES = ("none", "linear", "sqrt")

logger = logging.getLogger(__name__)


@dataclass
class GradAccumArguments(TrainingArguments):
    """
    [`~transformers.TrainingArguments`] for [`GradAccumTrainer`]. Every standard field keeps its meaning;
    `per_device_train_batch_size` is the micro-batch and `gradient_accumulation_steps` the number of micro-batches
    per optimizer step, so the effective batch is `per_device_train_batch_size * gradient_accumulation_steps *
    world_size`, and one optimizer step equals the step of that large batch.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumArguments
    >>> args = GradAccumArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=8)
    >>> args.accumulation_dtype
    'float32'
    ```
    """

    accumulation_dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype of the explicit gradient accumulation buffers. float32 keeps bf16/fp16 gradients from "
            "rounding at every micro-batch.",
            "choices": ["float32", "float64", "bfloat16", "float16"],
        },
    )
    overflow_policy: str = field(
        default="recompute",
        metadata={
            "help": "fp16 loss scaling: what an overflowing micro-batch costs. 'recompute' redoes only that "
            "micro-batch at the backed-off scale; 'skip' drops the whole window (what other libraries do).",
            "choices": list(OVERFLOW_POLICIES),
        },
    )
    max_recompute_attempts: int = field(
        default=8,
        metadata={
            "help": "Backoffs tried for one overflowing micro-batch before the window is skipped as a real inf/NaN."
        },
    )
    loss_scale_init: float = field(default=2.0**16, metadata={"help": "Initial dynamic loss scale (fp16)."})
    loss_scale_growth_factor: float = field(
        default=2.0, metadata={"help": "Loss scale multiplier after `loss_scale_growth_interval` clean steps; > 1."}
    )
    loss_scale_backoff_factor: float = field(
        default=0.5, metadata={"help": "Loss scale multiplier after an overflow; in (0, 1)."}
    )
    loss_scale_growth_interval: int = field(
        default=2000, metadata={"help": "Clean optimizer steps between loss scale growths; >= 1."}
    )
    bf16_loss_scaling: bool = field(
        default=False,
        metadata={
            "help": "Also use dynamic loss scaling under bf16 (off by default: bf16 has fp32's exponent range)."
        },
    )
    lr_scaling_rule: str = field(
        default="none",
        metadata={
            "help": "Scale `learning_rate` from `reference_batch_size` to the effective batch: 'linear' (Goyal et al. "
            "2017, with warmup), 'sqrt' (Adam-family, Malladi et al. 2022) or 'none'.",
            "choices": list(LR_SCALING_RULES),
        },
    )
    reference_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size at which `learning_rate` was tuned; required when `lr_scaling_rule` != 'none'."},
    )
    batchnorm_momentum_correction: bool = field(
        default=False,
        metadata={
            "help": "Correct BatchNorm momentum to 1 - (1 - m) ** (1 / gradient_accumulation_steps) so running "
            "statistics decay per optimizer step as with the large batch."
        },
    )

    def __post_init__(self) -> None:
        validate_gradaccum_fields(self)
        if not self.use_cpu and launched_data_parallel_without_accelerator():
            # A multi-process launch on a machine without GPUs (e.g. `accelerate launch` with
            # configs/accelerate/cpu_2proc.yaml): Accelerate would set up no data parallelism at all unless told to
            # use the CPU, so every rank would silently train on the whole dataset alone.
            logger.info("Multi-process launch without an accelerator: data parallel on CPU (gloo), use_cpu=True.")
            self.use_cpu = True
        super().__post_init__()


def launched_data_parallel_without_accelerator() -> bool:
    """Whether this process is one of several ranks (`WORLD_SIZE` > 1) on a machine with no GPU or other accelerator."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return not accelerator.is_available()
    return not torch.cuda.is_available()


def validate_gradaccum_fields(args: Any) -> None:
    """Check the accumulation-related fields of `args` (a [`GradAccumArguments`] or a plain `TrainingArguments`)."""
    validate_accumulation_steps(args.gradient_accumulation_steps)
    if getattr(args, "fp16", False) and getattr(args, "bf16", False):
        raise ValueError("`fp16` and `bf16` cannot both be True: choose one mixed-precision mode.")
    resolve_accumulation_dtype(gradaccum_option(args, "accumulation_dtype"))
    policy = gradaccum_option(args, "overflow_policy")
    if policy not in OVERFLOW_POLICIES:
        raise ValueError(f"`overflow_policy` must be one of {list(OVERFLOW_POLICIES)}, got {policy!r}.")
    validate_accumulation_steps(gradaccum_option(args, "max_recompute_attempts"), "max_recompute_attempts")
    validate_loss_scaling(
        gradaccum_option(args, "loss_scale_init"),
        gradaccum_option(args, "loss_scale_growth_factor"),
        gradaccum_option(args, "loss_scale_backoff_factor"),
        gradaccum_option(args, "loss_scale_growth_interval"),
    )
    rule = gradaccum_option(args, "lr_scaling_rule")
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"`lr_scaling_rule` must be one of {list(LR_SCALING_RULES)}, got {rule!r}.")
    reference = gradaccum_option(args, "reference_batch_size")
    if rule != "none" and (isinstance(reference, bool) or not isinstance(reference, int) or reference < 1):
        raise ValueError(
            f"`reference_batch_size` must be an integer >= 1 when `lr_scaling_rule={rule!r}`, got {reference!r}."
        )


_DEFAULTS = {
    f.name: f.default for f in fields(GradAccumArguments) if f.name not in TrainingArguments.__dataclass_fields__
}


def gradaccum_option(args: Any, name: str) -> Any:
    """`args.<name>`, or the [`GradAccumArguments`] default when `args` is a plain `TrainingArguments`."""
    return getattr(args, name, _DEFAULTS[name])
