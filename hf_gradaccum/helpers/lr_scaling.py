"""Learning rate and warmup when the effective batch size changes.

Exact accumulation makes `micro_batch_size x gradient_accumulation_steps x world_size` one batch. Changing that
effective batch size is a different optimisation problem; these helpers apply the usual scaling rules to carry a
tuned learning rate over to it:

- `"linear"` (Goyal et al. 2017, https://arxiv.org/abs/1706.02677): `lr * new / base`, for SGD with momentum. Large
  factors need a warmup ([`recommended_warmup_steps`]).
- `"sqrt"` (Malladi et al. 2022, https://arxiv.org/abs/2205.10287): `lr * sqrt(new / base)`, the square-root rule
  derived for adaptive optimizers (Adam, AdamW, RMSprop).
- `"none"`: keep the learning rate, e.g. to study the batch size alone.
"""

from __future__ import annotations

import math

from ..engine.validation import check_positive_float, check_positive_int

LR_SCALING_RULES = ("linear", "sqrt", "none")


def check_lr_scaling_rule(rule: str, reference_batch_size: int | None) -> None:
    """
    Refuse an unknown scaling rule, or a rule other than `"none"` without the batch size the learning rate was tuned
    at, with an error that names the argument.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.lr_scaling import check_lr_scaling_rule
    >>> check_lr_scaling_rule("sqrt", 32)
    ```
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"`lr_scaling_rule` must be one of {list(LR_SCALING_RULES)}, got {rule!r}.")
    if rule != "none" and (
        isinstance(reference_batch_size, bool) or not isinstance(reference_batch_size, int) or reference_batch_size < 1
    ):
        raise ValueError(
            f"`reference_batch_size` must be an integer >= 1 when `lr_scaling_rule={rule!r}`, "
            f"got {reference_batch_size!r}."
        )


def effective_batch_size(micro_batch_size: int, gradient_accumulation_steps: int = 1, world_size: int = 1) -> int:
    """
    Samples per optimizer step: `micro_batch_size * gradient_accumulation_steps * world_size`.

    Args:
        micro_batch_size (`int`): samples per forward/backward on one device (`per_device_train_batch_size`).
        gradient_accumulation_steps (`int`, *optional*, defaults to 1): micro-batches per optimizer step.
        world_size (`int`, *optional*, defaults to 1): data-parallel processes.

    Returns:
        `int`: the effective batch size.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.lr_scaling import effective_batch_size
    >>> effective_batch_size(8, 4, world_size=2)
    64
    ```
    """
    check_positive_int(micro_batch_size, "micro_batch_size")
    check_positive_int(gradient_accumulation_steps, "gradient_accumulation_steps")
    check_positive_int(world_size, "world_size")
    return micro_batch_size * gradient_accumulation_steps * world_size


def lr_scaling_factor(*, base_batch_size: int, new_batch_size: int, rule: str = "linear") -> float:
    """
    The factor [`scale_learning_rate`] multiplies the learning rate by: `new / base` (`"linear"`),
    `sqrt(new / base)` (`"sqrt"`) or `1` (`"none"`).

    Example:

    ```python
    >>> from hf_gradaccum.helpers.lr_scaling import lr_scaling_factor
    >>> lr_scaling_factor(base_batch_size=32, new_batch_size=128, rule="sqrt")
    2.0
    ```
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"`rule` must be one of {LR_SCALING_RULES}, got {rule!r}.")
    check_positive_int(base_batch_size, "base_batch_size")
    check_positive_int(new_batch_size, "new_batch_size")
    if rule == "none":
        return 1.0
    ratio = new_batch_size / base_batch_size
    return ratio if rule == "linear" else math.sqrt(ratio)


def scale_learning_rate(base_lr: float, *, base_batch_size: int, new_batch_size: int, rule: str = "linear") -> float:
    """
    Carry a learning rate tuned at `base_batch_size` over to `new_batch_size` (see the module docstring for the
    rules and their sources).

    Args:
        base_lr (`float`): the learning rate tuned at `base_batch_size`, > 0.
        base_batch_size (`int`): the effective batch size `base_lr` was tuned for, >= 1.
        new_batch_size (`int`): the new effective batch size (see [`effective_batch_size`]), >= 1.
        rule (`str`, *optional*, defaults to `"linear"`): `"linear"` (SGD), `"sqrt"` (Adam family) or `"none"`.

    Returns:
        `float`: the scaled learning rate.

    Example:

    ```python
    >>> from hf_gradaccum.helpers.lr_scaling import scale_learning_rate
    >>> scale_learning_rate(0.1, base_batch_size=256, new_batch_size=1024)
    0.4
    >>> scale_learning_rate(1e-3, base_batch_size=32, new_batch_size=128, rule="sqrt")
    0.002
    ```
    """
    base_lr = check_positive_float(base_lr, "base_lr")
    return base_lr * lr_scaling_factor(base_batch_size=base_batch_size, new_batch_size=new_batch_size, rule=rule)


def recommended_warmup_steps(
    *,
    base_batch_size: int,
    new_batch_size: int,
    steps_per_epoch: int,
    rule: str = "linear",
    warmup_epochs: float = 5.0,
) -> int:
    """
    A simple warmup heuristic after Goyal et al. (2017): when the scaling rule *raises* the learning rate, ramp it up
    linearly over `warmup_epochs` epochs (they used 5); otherwise no warmup is needed for the batch-size change.

    Goyal et al. found that the large learning rates of the linear rule diverge or generalise worse early in training,
    when the weights change fast, and that a gradual warmup from the base learning rate removes the gap. The heuristic
    ignores the size of the factor on purpose: it is a starting point to tune, not a law. Pass the result as
    `warmup_steps` of `TrainingArguments` (it counts optimizer steps, so `steps_per_epoch` must too).

    Args:
        base_batch_size (`int`): effective batch size the learning rate was tuned for.
        new_batch_size (`int`): the new effective batch size.
        steps_per_epoch (`int`): optimizer steps per epoch at `new_batch_size`, >= 1.
        rule (`str`, *optional*, defaults to `"linear"`): the scaling rule, as in [`scale_learning_rate`].
        warmup_epochs (`float`, *optional*, defaults to 5.0): warmup length in epochs when warmup is recommended.

    Returns:
        `int`: recommended warmup steps (0 when the learning rate is not raised).

    Example:

    ```python
    >>> from hf_gradaccum.helpers.lr_scaling import recommended_warmup_steps
    >>> recommended_warmup_steps(base_batch_size=256, new_batch_size=8192, steps_per_epoch=157)
    785
    >>> recommended_warmup_steps(base_batch_size=256, new_batch_size=128, steps_per_epoch=10_000)
    0
    ```
    """
    check_positive_int(steps_per_epoch, "steps_per_epoch")
    warmup_epochs = check_positive_float(warmup_epochs, "warmup_epochs")
    factor = lr_scaling_factor(base_batch_size=base_batch_size, new_batch_size=new_batch_size, rule=rule)
    if factor <= 1.0:
        return 0
    return math.ceil(warmup_epochs * steps_per_epoch)
