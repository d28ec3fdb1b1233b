"""Counting a micro-batch's items where its loss is computed, whatever the composed trainer does before that.

A composed trainer may rebuild the micro-batch between the batch the Trainer's loop hands to `training_step` and the
inputs its `compute_loss` sees: TRL's GKD generates and replaces the labels in its `training_step`, GRPO, RLOO, GOLD,
IW-OPD and the distillation trainers generate in `_prepare_inputs`, others collate lists that only `_prepare_inputs`
turns into tensors. The weight of a micro-batch must be what *its loss* divides by, so it is counted on the inputs that
reach `compute_loss`: for the length of one micro-step, an instance attribute `compute_loss` (which shadows every class
of the MRO, so it works in either class order) counts the inputs it receives, starts the accumulator's micro-batch,
then calls the trainer's own `compute_loss`.

The count made when the window was prefetched is reused only where it provably counts the same rows: the trainers
whose `training_step` and `_prepare_inputs` hand the batch to the loss unchanged (`hands_batch_to_loss_unchanged`),
which avoids one device read per micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .composed_class import nearest_trainer_named
from .composition_error import CompositionError

# `training_step` implementations that only add a context around `Trainer.training_step` and pass their arguments on
# unchanged (TRL 1.16's activation-offloading context), so the loss sees the very rows the loop handed over.
_PASS_THROUGH_TRAINING_STEPS = frozenset(
    {
        "transformers.trainer.Trainer",
        "trl.trainer.sft_trainer.SFTTrainer",
        "trl.trainer.dpo_trainer.DPOTrainer",
        "trl.trainer.reward_trainer.RewardTrainer",
        "trl.trainer.kto_trainer.KTOTrainer",
    }
)
# `_prepare_inputs` implementations that only move tensors to the device.
_PASS_THROUGH_PREPARE_INPUTS = frozenset({"transformers.trainer.Trainer"})
_PASS_THROUGH = {"training_step": _PASS_THROUGH_TRAINING_STEPS, "_prepare_inputs": _PASS_THROUGH_PREPARE_INPUTS}


# Packages whose trainers are composed as libraries; a class from anywhere else is the user's own code.
LIBRARY_PACKAGES = frozenset(
    {"transformers", "trl", "sentence_transformers", "peft", "setfit", "accelerate", "hf_gradaccum"}
)


def user_classes_around_training_step(trainer_cls: type) -> list[type]:
    """
    The user's classes (outside [`LIBRARY_PACKAGES`]) that define `training_step` before hf_gradaccum's own in
    `trainer_cls`'s MRO: overrides whose `super()` reaches `GradAccumTrainer.training_step` and whose calls by the
    Trainer's loop are followed one by one (`trainer/loop_calls.py`).

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.losses.counting import user_classes_around_training_step
    >>> class Logs(GradAccumTrainer):
    ...     def training_step(self, model, inputs, num_items_in_batch=None):
    ...         return super().training_step(model, inputs, num_items_in_batch)
    >>> Logs.__module__ = "my_training"  # defined in the user's own module
    >>> [cls.__name__ for cls in user_classes_around_training_step(Logs)]
    ['Logs']
    ```
    """
    found = []
    for cls in trainer_cls.__mro__:
        package = cls.__module__.split(".")[0]
        if "training_step" not in vars(cls):
            continue
        if package == "hf_gradaccum":
            return found
        if package not in LIBRARY_PACKAGES:
            found.append(cls)
    return []


@functools.cache  # asked at every micro-batch; a class's MRO does not change
def _owner(trainer_cls: type, method: str) -> str | None:
    """`module.Class` of the class that defines `method` for `trainer_cls`, looking through hf_gradaccum's own. A
    user's override before GradAccumTrainer's counts: it may change the batch in place before its `super()` call, so
    the count is taken where the loss sees it."""
    for cls in trainer_cls.__mro__:
        if cls.__module__.split(".")[0] == "hf_gradaccum":
            continue
        if method in vars(cls):
            return f"{cls.__module__}.{cls.__qualname__}"
    return None


@functools.cache
def parent_step_is_users(trainer_cls: type) -> bool:
    """Whether the `training_step` that `GradAccumTrainer`'s calls as its parent's is the user's own code (a `Trainer`
    subclass of theirs composed after it), which may divide the loss by the accumulation steps itself."""
    after = trainer_cls.__mro__[1:]
    for i, cls in enumerate(trainer_cls.__mro__):
        if cls.__module__.split(".")[0] == "hf_gradaccum" and "training_step" in vars(cls):
            after = trainer_cls.__mro__[i + 1 :]
            break
    owner = next((cls for cls in after if "training_step" in vars(cls)), None)
    return owner is not None and owner.__module__.split(".")[0] not in LIBRARY_PACKAGES


def hands_batch_to_loss_unchanged(trainer: Any) -> bool:
    """
    Whether every class of `trainer`'s MRO (other than hf_gradaccum's) hands the batch given to `training_step` to
    `compute_loss` with the same rows: its `training_step` and `_prepare_inputs` are ones known to pass it through.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from hf_gradaccum.losses.counting import hands_batch_to_loss_unchanged
    >>> hands_batch_to_loss_unchanged(Trainer)
    True
    ```
    """
    cls = trainer if isinstance(trainer, type) else type(trainer)
    return training_step_passes_through(cls) and _owner(cls, "_prepare_inputs") in _PASS_THROUGH_PREPARE_INPUTS


def training_step_passes_through(trainer: Any) -> bool:
    """
    Whether `trainer`'s `training_step` (the nearest class's, other than hf_gradaccum's) is one known to end in
    `Trainer.training_step`, which back-propagates what `compute_loss` returned through `accelerator.backward`: where
    the in-place accumulation path hands the item weight to the loss. A step that calls `loss.backward()` itself
    keeps the hook path, which folds whatever gradients arrive.

    Example:

    ```python
    >>> from transformers import Trainer
    >>> from hf_gradaccum.losses.counting import training_step_passes_through
    >>> training_step_passes_through(Trainer)
    True
    ```
    """
    cls = trainer if isinstance(trainer, type) else type(trainer)
    return _owner(cls, "training_step") in _PASS_THROUGH_TRAINING_STEPS


# Trainers whose loss divides by the `num_items_in_batch` the Trainer hands it, counted on the batch the loop handed to
# `training_step`, even where their `training_step` then replaces the rows (TRL's GKD generates on-policy or `seq_kd`
# completions and still divides their divergence by the dataset batch's label count). The large batch they define is
# that: the micro-batch is weighted by that count and handed it as its own. GOLD and IW-OPD divide by the count of the
# window the loop hands over at every micro-step, of which each micro-batch takes an equal share
# (`integrations/trl/generating.py`).
HANDED_COUNT_TRAINERS = ("GKDTrainer", "GOLDTrainer", "IWOPDTrainer")


def divides_by_handed_count(trainer: Any) -> bool:
    """
    Whether `trainer` is composed with a trainer of `HANDED_COUNT_TRAINERS` (the nearest registered class).

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> from hf_gradaccum.losses.counting import divides_by_handed_count
    >>> divides_by_handed_count(GradAccumTrainer)
    False
    ```
    """
    return nearest_trainer_named(trainer, HANDED_COUNT_TRAINERS) is not None


def refuse_rebuilt_micro_batches(trainer: Any, trainer_name: str) -> CompositionError:
    """
    The `CompositionError` for an unknown composition whose parents rebuild the micro-batch before the loss: the
    first-window check can only split the batch the loop prefetched, which is not what their loss sees.

    Example:

    ```python
    >>> raise refuse_rebuilt_micro_batches(trainer, "MyGeneratingTrainer")  # doctest: +SKIP
    CompositionError: GradAccumTrainer does not know how MyGeneratingTrainer (loss: 'nll') accumulates, and cannot check it: ...
    ```
    """
    cls = type(trainer)
    rebuilt = [m for m in ("training_step", "_prepare_inputs") if _owner(cls, m) not in _PASS_THROUGH[m]]
    loss = getattr(trainer.args, "loss_type", None) or "its compute_loss"
    return CompositionError(
        f"GradAccumTrainer does not know how {trainer_name} (loss: {loss!r}) accumulates, and cannot check it: its "
        f"{' and '.join(f'`{m}`' for m in rebuilt)} {'rebuilds' if len(rebuilt) == 1 else 'rebuild'} the "
        "micro-batch (generation, slicing or collation) "
        "before the loss, so a split of the prefetched window is not what trains. Stopped before any work.\nFix: "
        "`gradient_accumulation_steps=1` with the batch you want, or `register_composition` with what this loss "
        "divides by (hf_gradaccum/integrations/registry.py): the items are then counted on the inputs that reach "
        "its `compute_loss`; `check_unknown_compositions=False` trains without either."
    )


@contextlib.contextmanager
def counting_at_the_loss(
    trainer: Any,
    present: Callable[[Any], tuple[float, Callable[[], None]]],
    begin: Callable[[float], None],
    num_items_for_loss: Callable[[float], Any],
    returned: Callable[[Any], None] | None = None,
) -> Iterator[list[Any]]:
    """
    For the length of one micro-step, make `trainer.compute_loss` count its inputs first: `present(inputs)` returns the
    items the loss on `inputs` is a mean over and a function that undoes whatever it changed for the loss (called
    after the loss); `begin(items)` starts the accumulator's micro-batch; the trainer's own `compute_loss` then runs
    with `num_items_in_batch=num_items_for_loss(items)`. Yields a list that holds the inputs the loss last saw (the
    micro-batch an fp16 recompute replays). `returned`, if given, is called with what the loss returned.

    Example:

    ```python
    >>> with counting_at_the_loss(trainer, present, begin, lambda n: None) as seen:  # doctest: +SKIP
    ...     trainer.training_step(model, batch)
    ```
    """
    original = trainer.compute_loss  # the bound method of the class, or an instance attribute already there
    had_instance_attribute = "compute_loss" in vars(trainer)
    seen: list[Any] = []

    def compute_loss(model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        return_outputs = kwargs.pop("return_outputs", args[0] if args else False)
        kwargs.pop("num_items_in_batch", None)
        items, restore = present(inputs)
        begin(items)
        seen[:] = [inputs]
        try:
            result = original(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_for_loss(items), **kwargs
            )
        finally:
            restore()
        if returned is not None:
            returned(result)
        return result

    trainer.compute_loss = compute_loss
    try:
        yield seen
    finally:
        if had_instance_attribute:
            trainer.compute_loss = original
        else:
            del trainer.compute_loss


class WindowLossLog:
    """
    The value `training_step` returns for the logged loss: the Trainer sums them over a window, and that sum must be
    the window's local mean loss. When every micro-batch's count at the loss equals its count at prefetch time, each
    returns `loss_k * n_k / N` as soon as it runs; otherwise (a parent rebuilt the batch, a generation batch) the
    window's total is known only at its last micro-batch, which returns the remainder so that the sum is exact.

    Example:

    ```python
    >>> import torch
    >>> log = WindowLossLog()
    >>> log.start(None)
    >>> a = log.share(torch.tensor(2.0), 1, None, last=False, steps=2)
    >>> b = log.share(torch.tensor(5.0), 3, None, last=True, steps=2)
    >>> float(a + b)
    4.25
    ```
    """

    def __init__(self) -> None:
        self.start(None)

    def start(self, window_items: float | None) -> None:
        """A new window; `window_items` is its local items as counted at prefetch time (`None` if unknown)."""
        self.window_items = window_items
        self.returned: torch.Tensor | None = None
        self.weighted: torch.Tensor | None = None
        self.items = 0.0
        # (A window without items is skipped by the accumulator; its logged loss is what each micro-batch reports.)
        self.matched = bool(window_items)

    def share(
        self, loss: torch.Tensor, items: float, prefetched: float | None, *, last: bool, steps: int
    ) -> torch.Tensor:
        """What micro-batch `loss` (a mean over `items`; `prefetched` its count at prefetch time) returns."""
        self.matched = self.matched and prefetched is not None and float(prefetched) == float(items)
        weighted = loss.detach().float() * items
        self.weighted = weighted if self.weighted is None else self.weighted + weighted
        self.items += items
        if self.matched:
            value = loss * (items / self.window_items)
        elif last and self.items:
            mean = self.weighted / self.items
            value = mean.to(loss.dtype) - (self.returned if self.returned is not None else 0.0)
        else:
            value = loss / steps
        self.returned = value.detach() if self.returned is None else self.returned + value.detach()
        return value
