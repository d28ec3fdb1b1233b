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
    >>> from hf_gradaccum.config.training_checks import validate_training_numbers
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
