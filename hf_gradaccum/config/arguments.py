"""`GradAccumArguments`: `TrainingArguments` plus the options of exact gradient accumulation."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from transformers import TrainingArguments

from ..engine.accumulator import OVERFLOW_POLICIES, resolve_accumulation_dtype, validate_accumulation_steps
from ..engine.in_place import check_accumulation_path
from ..engine.loss_normalisation import NAMED_RULES
from ..engine.loss_scaling import validate_loss_scaling
from ..engine.sharded.fsdp2_schedule import check_fsdp_reduce_schedule
from ..engine.window_losses.moe_balance import MOE_LOAD_BALANCE_MODES, check_moe_load_balance
from ..helpers.lr_scaling import LR_SCALING_RULES, check_lr_scaling_rule
from .run_batch_arguments import check_effective_batch_size, resolve_run_batch_arguments
from .training_checks import validate_training_numbers

VERIFY_MODES = ("off", "first_step", "every_n_steps")
LOSS_NORMALISATIONS = ("auto", *NAMED_RULES)
BATCHNORM_MODES = ("stop", "micro_batch")

logger = logging.getLogger(__name__)


@dataclass
class GradAccumFields:
    """
    The options of exact gradient accumulation as a fields-only dataclass mixin, to add them to any
    `TrainingArguments` subclass without changing that subclass's defaults: TRL's `SFTConfig` (learning rate 2e-5,
    bf16, gradient checkpointing, ...), `DPOConfig`, `Seq2SeqTrainingArguments` (`predict_with_generate`), yours.
    Put it first in the bases (then its checks run in `__post_init__`; `GradAccumTrainer` checks them again either
    way).

    Example:

    ```python
    >>> from dataclasses import dataclass
    >>> from transformers import Seq2SeqTrainingArguments
    >>> from hf_gradaccum import GradAccumFields
    >>> @dataclass
    ... class MySeq2SeqArguments(GradAccumFields, Seq2SeqTrainingArguments):
    ...     pass
    >>> args = MySeq2SeqArguments("out", predict_with_generate=True, overflow_policy="skip", use_cpu=True)
    >>> args.predict_with_generate, args.overflow_policy
    (True, 'skip')
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
    count_shifted_labels: bool | None = field(
        default=None,
        metadata={
            "help": "Count items as a causal LM's loss does (`labels[..., 1:]`). None (default): decided from the "
            "model, seen through PEFT/compile/DDP wrappers; set True/False for a model that cannot be recognised."
        },
    )
    verify_accumulation: str = field(
        default="off",
        metadata={
            "help": "Prove on the real training data that accumulation is exact for this model, loss and item "
            "counting (split invariance: the window's gradient for N micro-batches of b vs 2N of b/2). 'first_step': "
            "on the first window; 'every_n_steps': every `verify_every_n_steps` optimizer steps; 'off'. The verdict "
            "is logged (`accumulator/verify_rel_diff`) and written to `output_dir/accumulation_check.json`.",
            "choices": list(VERIFY_MODES),
        },
    )
    check_unknown_compositions: bool = field(
        default=True,
        metadata={
            "help": "Composed with a Trainer subclass from another package that the composition registry does not "
            "know (`hf-gradaccum compositions` lists it): run the split-invariance check on the first window and stop "
            "before the first optimizer step unless accumulation is exact. False: train without the check."
        },
    )
    verify_every_n_steps: int = field(
        default=500, metadata={"help": "With `verify_accumulation='every_n_steps'`: optimizer steps between checks."}
    )
    verify_raise: bool = field(
        default=False,
        metadata={"help": "Raise (instead of warning) when the check finds accumulation not exact for this model."},
    )
    fsdp_reduce_schedule: str = field(
        default="every_micro_batch",
        metadata={
            "help": "FSDP2 (`fsdp_version: 2`) only. `every_micro_batch`: reduce-scatter each micro-batch into the "
            "sharded fp32 buffer (gradient memory 1/world_size). `once_per_window`: one reduce-scatter per window, "
            "one unsharded fp32 gradient of the model per rank in between (fewer collectives, more memory).",
            "choices": ["every_micro_batch", "once_per_window"],
        },
    )
    offload_accumulation_buffer: bool = field(
        default=False,
        metadata={
            "help": "Keep the fp32 accumulation buffer in pinned host memory instead of on the GPU: each gradient is "
            "copied out as autograd produces it and folded on the host, so the GPU holds about one parameter's "
            "gradient at a time (a bf16 model's fp32 buffer would otherwise cost 4 bytes per parameter on the GPU). "
            "The mean gradient returns to the GPU at the window's end. Same update; single device and DDP only "
            "(not FSDP2, whose buffer is sharded). Costs host-device copies: see docs/gpu/."
        },
    )
    accumulation_path: str = field(
        default="auto",
        metadata={
            "help": "How gradients are accumulated. 'auto': 'in_place' where it is exact (the parameters already in "
            "the accumulation dtype, no fp16 loss scaling, not FSDP2/tensor-parallel, not offloaded), else 'hooks'. "
            "'in_place': each micro-batch's loss is weighted by its items and autograd accumulates `.grad` itself "
            "(no hook per parameter, no second copy of the gradients). 'hooks': every gradient is folded into a flat "
            "fp32 buffer as autograd produces it. Same update either way.",
            "choices": ["auto", "hooks", "in_place"],
        },
    )
    moe_load_balance: str = field(
        default="auto",
        metadata={
            "help": "Mixture-of-experts models (Mixtral, Qwen2-MoE, OLMoE, ...). 'auto': 'window' when the model adds "
            "a router auxiliary loss (`output_router_logits=True`), else nothing to balance. 'window': the window's "
            "exact auxiliary loss (one extra forward-only pass per micro-batch; docs/moe_balance.md). 'micro_batch': "
            "the model's own per-micro-batch router loss, weighted by items (free, not the large batch's).",
            "choices": list(MOE_LOAD_BALANCE_MODES),
        },
    )
    loss_normalisation: str = field(
        default="auto",
        metadata={
            "help": "What a micro-batch's loss is normalised by, which is its weight. 'auto': measured on the first "
            "window before any step, from the losses of cuts across its micro-batches (a mean over label tokens, "
            "shifted label tokens, rows, boxes, a sample weight or another count the batch carries, a class-weighted "
            "count, or a sum), and re-weighed on every later window where rules tied; a loss that is none of them, "
            "or that the window cannot tell apart, stops with the cause. Or name it: 'label_tokens', "
            "'shifted_label_tokens', 'rows', 'sum', 'boxes' (checked on the first window, see "
            "`check_declared_normalisation`). The finding is logged and written to "
            "`output_dir/accumulation_check.json`.",
            "choices": list(LOSS_NORMALISATIONS),
        },
    )
    check_declared_normalisation: bool = field(
        default=True,
        metadata={
            "help": "Check a named `loss_normalisation`, or the count a `count_micro_batch_items` override returns, "
            "against the first window's cuts, and stop with the residual where the window contradicts it. False: "
            "train with the declaration unchecked (for a loss you know the probe cannot run as training does)."
        },
    )
    batchnorm_statistics: str = field(
        default="stop",
        metadata={
            "help": "A model with BatchNorm layers in training mode normalises each micro-batch by its own "
            "statistics, which no accumulation makes the large batch. 'stop': refuse before the first step, naming "
            "the exact options (GroupNorm conversion, frozen statistics). 'micro_batch': train with per-micro-batch "
            "statistics knowingly.",
            "choices": list(BATCHNORM_MODES),
        },
    )

    effective_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "Rows per optimizer step over all processes (the paper's batch). With it, "
            "`per_device_train_batch_size` is the micro-batch that fits and `gradient_accumulation_steps` is derived; "
            "each window's rows are split as evenly as possible over any number of processes (10 on 3: 4+3+3), in "
            "the run's order (`train_sampling_strategy` 'random' or 'sequential'), and a checkpoint resumes on "
            "another number of processes or micro-batch with the same windows (docs/run_batch.md)."
        },
    )

    take_back_skipped_steps: bool = field(
        default=False,
        metadata={
            "help": "Policy, opt-in. A window whose update is not applied (NaN/inf, no items) then advances neither "
            "`global_step` nor the scheduler. Off (default): as the stock Trainer, `global_step` advances and the "
            "loss (NaN included) is logged; the non-finite update is still never written into the weights."
        },
    )
    refuse_resume_with_different_batch: bool = field(
        default=False,
        metadata={
            "help": "Policy, opt-in. Refuse to resume from a checkpoint trained with another effective batch. Off "
            "(default): warn and resume, as the stock Trainer does."
        },
    )
    atomic_checkpoints: bool = field(
        default=False,
        metadata={
            "help": "Opt-in. Write each checkpoint into a staging folder and rename it into place when complete, so "
            "a crash while saving never leaves a half-written `checkpoint-N`."
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
        # Derived before the parent's checks, which hand `gradient_accumulation_steps` to a DeepSpeed config's
        # "auto" values; checked again once the parent has set up the processes.
        resolve_run_batch_arguments(self, int(os.environ.get("WORLD_SIZE", "1")))
        super().__post_init__()
        resolve_run_batch_arguments(self, self.world_size)


@dataclass
class GradAccumArguments(GradAccumFields, TrainingArguments):
    """
    [`~transformers.TrainingArguments`] for [`GradAccumTrainer`]. Every standard field keeps its meaning;
    `per_device_train_batch_size` is the micro-batch and `gradient_accumulation_steps` the number of micro-batches
    per optimizer step, so the effective batch is `per_device_train_batch_size * gradient_accumulation_steps *
    world_size`, and one optimizer step equals the step of that large batch. The extra fields are those of
    [`GradAccumFields`] (use that mixin to add them to another arguments class, e.g. TRL's `SFTConfig`).

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumArguments
    >>> args = GradAccumArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=8)
    >>> args.accumulation_dtype
    'float32'
    ```
    """


def launched_data_parallel_without_accelerator() -> bool:
    """Whether this process is one of several ranks (`WORLD_SIZE` > 1) on a machine with no GPU or other accelerator."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and not accelerator_available()


def accelerator_available() -> bool:
    """Whether torch sees a GPU or another accelerator (pinned memory and NCCL need one)."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return accelerator.is_available()
    return torch.cuda.is_available()


def validate_gradaccum_fields(args: Any) -> None:
    """Check the accumulation-related fields of `args` (a [`GradAccumArguments`] or a plain `TrainingArguments`)."""
    validate_accumulation_steps(args.gradient_accumulation_steps)
    validate_training_numbers(args)
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
    check_lr_scaling_rule(gradaccum_option(args, "lr_scaling_rule"), gradaccum_option(args, "reference_batch_size"))
    check_effective_batch_size(gradaccum_option(args, "effective_batch_size"))
    shifted = gradaccum_option(args, "count_shifted_labels")
    if shifted is not None and not isinstance(shifted, bool):
        raise ValueError(f"`count_shifted_labels` must be None, True or False, got {shifted!r}.")
    for name in (
        "take_back_skipped_steps",
        "refuse_resume_with_different_batch",
        "atomic_checkpoints",
        "check_unknown_compositions",
        "offload_accumulation_buffer",
        "check_declared_normalisation",
    ):
        if not isinstance(gradaccum_option(args, name), bool):
            raise ValueError(f"`{name}` must be True or False, got {gradaccum_option(args, name)!r}.")
    check_fsdp_reduce_schedule(gradaccum_option(args, "fsdp_reduce_schedule"))
    check_accumulation_path(gradaccum_option(args, "accumulation_path"))
    check_moe_load_balance(gradaccum_option(args, "moe_load_balance"))
    batchnorm = gradaccum_option(args, "batchnorm_statistics")
    if batchnorm not in BATCHNORM_MODES:
        raise ValueError(f"`batchnorm_statistics` must be one of {list(BATCHNORM_MODES)}, got {batchnorm!r}.")
    normalisation = gradaccum_option(args, "loss_normalisation")
    if normalisation not in LOSS_NORMALISATIONS:
        raise ValueError(f"`loss_normalisation` must be one of {list(LOSS_NORMALISATIONS)}, got {normalisation!r}.")
    mode = gradaccum_option(args, "verify_accumulation")
    if mode not in VERIFY_MODES:
        raise ValueError(f"`verify_accumulation` must be one of {list(VERIFY_MODES)}, got {mode!r}.")
    every = gradaccum_option(args, "verify_every_n_steps")
    if mode == "every_n_steps":
        validate_accumulation_steps(every, "verify_every_n_steps")


_DEFAULTS = {f.name: f.default for f in fields(GradAccumFields)}


def gradaccum_option(args: Any, name: str) -> Any:
    """`args.<name>`, or the [`GradAccumFields`] default when `args` is a plain `TrainingArguments`."""
    return getattr(args, name, _DEFAULTS[name])
