"""Range checks for the numeric `TrainingArguments` fields that transformers itself does not check.

`TrainingArguments(per_device_train_batch_size=0)` or `learning_rate=-1` are accepted by transformers and fail later,
inside training, with a traceback that does not name the argument (or, for a negative learning rate, train
"successfully" uphill). These checks run in `__post_init__`, before any work starts, and name the argument and the
allowed range.
"""

from __future__ import annotations

import math
from typing import Any

# field -> (lowest allowed, whether the lowest is allowed, highest allowed or None, whether the highest is allowed,
#           whether it must be an integer)
_RANGES: dict[str, tuple[float, bool, float | None, bool, bool]] = {
    "per_device_train_batch_size": (1, True, None, False, True),
    "per_device_eval_batch_size": (1, True, None, False, True),
    "learning_rate": (0, True, None, False, False),
    "weight_decay": (0, True, None, False, False),
    "adam_beta1": (0, True, 1, False, False),
    "adam_beta2": (0, True, 1, False, False),
    "adam_epsilon": (0, False, None, False, False),
    "max_grad_norm": (0, True, None, False, False),
    "warmup_steps": (0, True, None, False, False),
    "warmup_ratio": (0, True, 1, True, False),
    "label_smoothing_factor": (0, True, 1, False, False),
    "logging_steps": (0, False, None, False, False),
    "save_steps": (0, False, None, False, False),
    "eval_steps": (0, False, None, False, False),
    "seed": (0, True, None, False, True),
    "dataloader_num_workers": (0, True, None, False, True),
    "max_steps": (-1, True, None, False, True),
}


def _describe(low: float, low_ok: bool, high: float | None, high_ok: bool, integer: bool) -> str:
    kind = "an integer" if integer else "a finite number"
    lower = f"{'>=' if low_ok else '>'} {low:g}"
    if high is None:
        return f"{kind} {lower}"
    return f"{kind} {lower} and {'<=' if high_ok else '<'} {high:g}"


def validate_training_numbers(args: Any) -> None:
    """
    Raise a `ValueError` naming the first numeric `TrainingArguments` field of `args` that is out of range.
    Fields that are `None` (unset) or absent are skipped.

    Example:

    ```python
    >>> from types import SimpleNamespace
    >>> from hf_gradaccum.adapters.training_checks import validate_training_numbers
    >>> validate_training_numbers(SimpleNamespace(learning_rate=-1.0))
    Traceback (most recent call last):
    ValueError: `learning_rate` must be a finite number >= 0, got -1.0.
    ```
    """
    for name, (low, low_ok, high, high_ok, integer) in _RANGES.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        ok = (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value >= low if low_ok else value > low)
            and (high is None or (value <= high if high_ok else value < high))
            and (not integer or float(value).is_integer())
        )
        if not ok:
            raise ValueError(f"`{name}` must be {_describe(low, low_ok, high, high_ok, integer)}, got {value!r}.")
    epochs, max_steps = getattr(args, "num_train_epochs", None), getattr(args, "max_steps", -1)
    if epochs is not None and (max_steps is None or max_steps <= 0):
        if (
            isinstance(epochs, bool)
            or not isinstance(epochs, (int, float))
            or not math.isfinite(epochs)
            or epochs <= 0
        ):
            raise ValueError(
                f"`num_train_epochs` must be a finite number > 0 (or set `max_steps` > 0), got {epochs!r}."
            )


# Loss terms of known trainers that are a statistic of the whole micro-batch, not a mean over independent items, so no
# weighting of micro-batches can reproduce them on the large batch: trainer class name -> {loss_type: why}. (KTO's
# 'kto' is made exact instead: `adapters/trl_kto.py`.)
BATCH_LEVEL_LOSS_TYPES = {
    "DPOTrainer": {
        "sft": "a token mean over the micro-batch's chosen completions",
        "aot": "sorts the log-ratios across the micro-batch",
        "aot_unpaired": "sorts the log-ratios across the micro-batch",
    },
}
# What to use instead, per trainer class name (both keep the large-batch update exact under accumulation).
BATCH_LEVEL_LOSS_FIXES = {
    "DPOTrainer": "Use per-pair loss types (e.g. 'sigmoid')",
}
# Trainers whose loss depends on the whole batch whatever their loss type: trainer class name -> why. Matched by name,
# so that releases of TRL which still ship them (BCOTrainer was removed before trl 1.16) are refused too.
BATCH_LEVEL_TRAINERS = {
    "BCOTrainer": "its reward baseline (`delta`) is a running mean updated with each batch's rewards just before that "
    "batch's loss uses it, so under accumulation micro-batch k's loss would use a baseline that has seen only the "
    "first k micro-batches' rewards instead of the window's",
}


def refuse_batch_level_losses(trainer: Any) -> None:
    """
    Raise a `ValueError` when `trainer` (a composed trainer) is a trainer of `BATCH_LEVEL_TRAINERS`, or is configured
    with a loss term that depends on the whole micro-batch (see `BATCH_LEVEL_LOSS_TYPES`), at
    `gradient_accumulation_steps > 1`: accumulating such a loss over micro-batches cannot equal the large batch.
    """
    if trainer.args.gradient_accumulation_steps == 1:
        return
    for cls in type(trainer).__mro__:
        why = BATCH_LEVEL_TRAINERS.get(cls.__name__)
        if why:
            raise ValueError(
                f"{cls.__name__} cannot be accumulated exactly: {why}, so no weighting of micro-batches equals the "
                "large-batch update. Use `gradient_accumulation_steps=1` with the batch you want."
            )
    for cls in type(trainer).__mro__:
        refused = BATCH_LEVEL_LOSS_TYPES.get(cls.__name__)
        if not refused:
            continue
        loss_types = getattr(trainer.args, "loss_type", None)
        loss_types = [loss_types] if isinstance(loss_types, str) else list(loss_types or [])
        bad = [t for t in loss_types if t in refused]
        if bad:
            why = "; ".join(f"'{t}' {refused[t]}" for t in bad)
            raise ValueError(
                f"`loss_type={loss_types}` cannot be accumulated exactly with {cls.__name__}: {why}, so no weighting of "
                f"micro-batches equals the large-batch loss. {BATCH_LEVEL_LOSS_FIXES[cls.__name__]}, or "
                "`gradient_accumulation_steps=1` with the batch you want."
            )
