"""The checks of `effective_batch_size` that run with the arguments: what it cannot honour is refused there, naming the
argument, and `gradient_accumulation_steps` is derived from it. The Trainer half (the loader of the run's windows,
resume on another layout) is `distributed/run_batch.py`."""

from __future__ import annotations

from typing import Any

from ..engine.run_batch.layout import RunBatchLayout

# `train_sampling_strategy` values whose order is the run's (transformers 5.x; 4.x samples at random).
ORDERS = ("random", "sequential")


def check_effective_batch_size(value: Any) -> None:
    """`effective_batch_size` must be `None` or an integer >= 1; refuse anything else naming it."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`effective_batch_size` must be None or an integer >= 1, got {value!r}.")


def sampling_strategy(args: Any) -> str:
    """The arguments' `train_sampling_strategy` (transformers 4.x: `"group_by_length"` or `"random"`)."""
    strategy = getattr(args, "train_sampling_strategy", None)
    if strategy is None:
        return "group_by_length" if getattr(args, "group_by_length", False) else "random"
    return strategy


def resolve_run_batch_arguments(args: Any, world_size: int) -> RunBatchLayout | None:
    """
    With `args.effective_batch_size` set: refuse what it cannot honour, naming the argument, and set
    `args.gradient_accumulation_steps` to the micro-batches per window on `world_size` processes. An explicit
    `gradient_accumulation_steps` other than 1 (its default) must equal the derived one. Returns the layout, or `None`
    without `effective_batch_size`.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumArguments
    >>> args = GradAccumArguments("out", effective_batch_size=10, per_device_train_batch_size=4, use_cpu=True)
    >>> args.gradient_accumulation_steps  # 10 rows on 1 process in micro-batches of at most 4: 4 + 3 + 3
    3
    ```
    """
    batch = getattr(args, "effective_batch_size", None)
    check_effective_batch_size(batch)
    if batch is None:
        return None
    if batch < world_size:
        raise ValueError(
            f"`effective_batch_size={batch}` is smaller than the number of processes ({world_size}): every process "
            f"must run a share of each window. Use `effective_batch_size` >= {world_size}, or fewer processes."
        )
    layout = RunBatchLayout(batch, args.per_device_train_batch_size, world_size)
    steps = layout.gradient_accumulation_steps
    if args.gradient_accumulation_steps not in (1, steps, getattr(args, "_run_batch_steps", None)):
        raise ValueError(
            f"`gradient_accumulation_steps={args.gradient_accumulation_steps}` does not match `effective_batch_size="
            f"{batch}` with `per_device_train_batch_size={args.per_device_train_batch_size}` on {world_size} "
            f"process(es), which need {steps} micro-batches per window (shares {layout.describe(batch)}). Leave "
            "`gradient_accumulation_steps` unset: it is derived."
        )
    config = getattr(args, "accelerator_config", None)
    if getattr(config, "split_batches", False):
        raise ValueError(
            "`effective_batch_size` cannot be used with `accelerator_config.split_batches=True`: the run's windows "
            "are already split over the processes. Set `split_batches=False`."
        )
    if getattr(config, "dispatch_batches", None):
        raise ValueError(
            "`effective_batch_size` cannot be used with `accelerator_config.dispatch_batches=True`: each process "
            "loads its own share of the window. Leave `dispatch_batches` unset."
        )
    strategy = sampling_strategy(args)
    if strategy not in ORDERS:
        raise ValueError(
            f"`effective_batch_size` cannot be used with `train_sampling_strategy={strategy!r}`: its batches are "
            "built from the per-device batch and the layout, so the run's windows would change with the hardware. "
            f"Use one of {list(ORDERS)}."
        )
    args.gradient_accumulation_steps = steps
    args._run_batch_steps = steps
    return layout
