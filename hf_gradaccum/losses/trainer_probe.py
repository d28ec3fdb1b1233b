"""The loss as training computes it, for the measurement: [`TrainerLossProbe`] runs the trainer's `compute_loss` (a
user's subclass's included) on a batch at the moment and with the arguments training gives it.

Training gives a user's `compute_loss` the Trainer's window state (`current_gradient_accumulation_steps`, set before
any probe runs), the `num_items_in_batch` the stock Trainer would pass (the window's label count, a tensor on the
device), the `compute_loss_context_manager`, and a gradient graph. The probe gives it the same, except that it asks
for no graph until the loss needs one (a penalty built with `create_graph=True`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import Trainer

from ..engine.oom_retry import is_out_of_memory

# Packages whose `compute_loss` is not a user's: the Trainer's, ours, and the library trainers we compose with.
_LIBRARY_PACKAGES = ("transformers", "hf_gradaccum", "trl", "sentence_transformers", "peft", "setfit")


def loss_class(trainer: Any) -> type | None:
    """The user's class whose `compute_loss` the trainer runs, or `None` where it is a library's (the model's loss)."""
    for cls in type(trainer).__mro__:
        if "compute_loss" in vars(cls):
            return None if cls.__module__.split(".")[0] in _LIBRARY_PACKAGES else cls
    return None


def stock_num_items(trainer: Any, batches: Sequence[Any]) -> torch.Tensor | int | None:
    """The `num_items_in_batch` the stock Trainer hands the loss for this window (its own count, with its own view
    of whether the model accepts loss kwargs), on every release."""
    accepts = getattr(trainer, "_stock_accepts_loss_kwargs", trainer.model_accepts_loss_kwargs)
    counter = getattr(Trainer, "_get_num_items_in_batch", None)
    saved = trainer.model_accepts_loss_kwargs
    trainer.model_accepts_loss_kwargs = accepts
    try:
        if counter is not None:
            return counter(trainer, list(batches), trainer.args.device)
        return _older_release_count(trainer, batches)
    finally:
        trainer.model_accepts_loss_kwargs = saved


def _older_release_count(trainer: Any, batches: Sequence[Any]) -> torch.Tensor | None:
    """Releases before `_get_num_items_in_batch` count inside `get_batch_samples`: the same count, done here."""
    if not batches or "labels" not in batches[0]:
        return None
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        return None
    try:
        shift = bool(getattr(trainer, "_loss_shifts_labels", False))
        count = sum(
            (b["shift_labels"] if "shift_labels" in b else b["labels"][..., 1:] if shift else b["labels"])
            .ne(-100)
            .sum()
            for b in batches
        )
    except (TypeError, AttributeError):
        return None
    if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
        count = trainer.accelerator.gather(count.to(trainer.args.device)).sum()
    return count.to(trainer.args.device) if torch.is_tensor(count) else count


class TrainerLossProbe:
    """
    `loss_of(batch)`, the float loss of a batch as `trainer`'s `compute_loss` computes it in training, and
    `loss_with_graph(batch)`, the same with its graph (for the gradient half of the measurement).

    Args:
        trainer: the `GradAccumTrainer`.
        batches: the window's micro-batches (prepared): they fix `num_items_in_batch` and the window state.

    Example:

    ```python
    >>> probe = TrainerLossProbe(trainer, prepared_batches)  # doctest: +SKIP
    >>> probe.loss_of(prepared_batches[0])  # doctest: +SKIP
    ```
    """

    def __init__(self, trainer: Any, batches: Sequence[Any]) -> None:
        self.trainer = trainer
        self.model = trainer.model
        self.num_items = stock_num_items(trainer, batches) if loss_class(trainer) is not None else None
        # What the Trainer's loop sets right after prefetching the window; releases before 5.19 show 1 on purpose
        # while each micro-batch runs (their `training_step` divides by it).
        trainer.current_gradient_accumulation_steps = 1 if trainer._present_one_step else len(batches)
        self.needs_graph = False

    def _loss(self, batch: Mapping[str, Any]) -> torch.Tensor:
        with self.trainer.compute_loss_context_manager():
            loss = self.trainer.compute_loss(self.model, dict(batch), num_items_in_batch=self.num_items)
        if self.trainer.args.n_gpu > 1:
            loss = loss.mean()
        return loss

    def loss_of(self, batch: Mapping[str, Any]) -> float:
        """The loss's value, without a graph unless the loss needs one to be computed at all."""
        if not self.needs_graph:
            try:
                with torch.no_grad():
                    return float(self._loss(batch).detach().float())
            except Exception as error:
                if is_out_of_memory(error):
                    raise
                # A loss built from a gradient (`torch.autograd.grad(..., create_graph=True)`) needs a graph; any
                # other error raises again below, as itself.
                self.needs_graph = True
        return float(self._loss(batch).detach().float())

    def loss_with_graph(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The loss with its graph, as training back-propagates it."""
        return self._loss(batch)
