"""A window whose micro-batches belong to groups with a loss each (one loss per dataset), exact per group.

When every micro-batch comes from one of several datasets and each dataset has its own loss (sentence-transformers'
dict of losses), a window may mix micro-batches of several datasets. The large batch of such a window is each
dataset's micro-batches taken together under that dataset's loss: the window gradient is
`sum_d n_d / N * grad L_d(window rows of d)`, with `n_d` the rows of dataset `d` in the window and `N` all of them.
A group whose loss couples its batch (in-batch negatives) runs through its own [`CoupledLoss`] over its micro-batches;
a group whose loss is a mean over independent items is computed per micro-batch, as plain accumulation does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..rng import RNGState, capture_rng_state, restore_rng_state
from .coupled import CoupledLoss, CoupledWindow

__all__ = ["GroupedCoupledLoss", "GroupedWindow"]

ItemMeanLoss = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class GroupedWindow:
    """Pass 1 of a grouped window: each coupled group's own [`CoupledWindow`], and where each micro-batch belongs."""

    groups: dict[Hashable, CoupledWindow]
    members: list[tuple[Hashable, int]]
    """For each micro-batch of the window: its group and its index among that group's micro-batches."""
    num_items: list[float]
    total_items: float
    loss: torch.Tensor
    """The coupled groups' losses weighted by their items (detached; for logging)."""
    rng_after: RNGState


def _unused(*args: Any) -> Any:
    raise RuntimeError("A GroupedCoupledLoss computes its groups' losses, never a loss of its own.")


class GroupedCoupledLoss(CoupledLoss):
    """
    Gradient caching per group of micro-batches: micro-batch `k` belongs to group `group_fn(batch_k)`, whose loss is
    `losses[group]`, either a [`CoupledLoss`] (a loss over all of the group's micro-batches in the window) or a
    callable `(model, batch) -> mean loss over the batch's items` (an item mean). The window gradient is
    `sum_d n_d / N * grad L_d(group d's micro-batches)`; the accumulator's item weighting does the rest, as for any
    [`CoupledLoss`], which this class is a drop-in for (`GradAccumTrainer`'s coupled-loss mode runs it unchanged).

    Args:
        group_fn (`Callable[[Any], Hashable]`): the group of a micro-batch (e.g. its dataset name).
        losses (`Mapping[Hashable, CoupledLoss | Callable]`): the loss of each group.
        num_items_fn (`Callable[[Any], float]`): items of a micro-batch (what every group's loss is a mean over).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.window_losses.coupled import CoupledLoss
    >>> from hf_gradaccum.engine.window_losses.grouped_coupled import GroupedCoupledLoss
    >>> def ranking(reps, model):
    ...     scores = reps["q"] @ reps["d"].T
    ...     return torch.nn.functional.cross_entropy(scores, torch.arange(len(scores)))
    >>> pairs = CoupledLoss(lambda model, b: {"q": model(b["q"]), "d": model(b["d"])}, ranking)
    >>> grouped = GroupedCoupledLoss(
    ...     lambda b: b["name"],
    ...     {"pairs": pairs, "rows": lambda model, b: model(b["x"]).pow(2).mean()},
    ...     num_items_fn=lambda b: len(b["q"] if "q" in b else b["x"]),
    ... )
    ```
    """

    def __init__(
        self,
        group_fn: Callable[[Any], Hashable],
        losses: Mapping[Hashable, CoupledLoss | ItemMeanLoss],
        *,
        num_items_fn: Callable[[Any], float],
    ) -> None:
        if not callable(group_fn):
            raise ValueError(f"`group_fn` must be callable, got {type(group_fn).__name__}.")
        if not isinstance(losses, Mapping) or not losses:
            raise ValueError(f"`losses` must be a non-empty mapping of group -> loss, got {losses!r}.")
        for key, loss in losses.items():
            if not callable(loss) and not isinstance(loss, CoupledLoss):
                raise ValueError(f"`losses[{key!r}]` must be a CoupledLoss or a callable, got {type(loss).__name__}.")
        super().__init__(_unused, _unused, num_items_fn=num_items_fn, keep_first_graph=False)
        self.group_fn = group_fn
        self.losses = dict(losses)
        for loss in self.losses.values():
            if isinstance(loss, CoupledLoss):
                # A kept graph would live until its group's first micro-batch, not the window's: several at once.
                loss.keep_first_graph = False

    def _loss_of(self, key: Hashable) -> CoupledLoss | ItemMeanLoss:
        if key not in self.losses:
            raise ValueError(
                f"A micro-batch of group {key!r}, which has no loss; groups: {sorted(map(str, self.losses))}."
            )
        return self.losses[key]

    def prepare_window(
        self, model: nn.Module, micro_batches: Sequence[Any], parameters: Sequence[nn.Parameter] | None = None
    ) -> GroupedWindow:
        if len(micro_batches) == 0:
            raise ValueError("`micro_batches` is empty: a coupled window needs at least one micro-batch.")
        keys = [self.group_fn(batch) for batch in micro_batches]
        num_items = [float(self.num_items_fn(batch)) for batch in micro_batches]
        total = sum(num_items)
        members: list[tuple[Hashable, int]] = []
        seen: dict[Hashable, int] = {}
        for key in keys:
            members.append((key, seen.get(key, 0)))
            seen[key] = seen.get(key, 0) + 1
        groups: dict[Hashable, CoupledWindow] = {}
        loss = torch.zeros((), dtype=torch.float32)
        for key in seen:
            coupled = self._loss_of(key)
            if not isinstance(coupled, CoupledLoss):
                continue
            batches = [b for b, k in zip(micro_batches, keys, strict=True) if k == key]
            groups[key] = coupled.prepare_window(model, batches, parameters)
            share = sum(n for n, k in zip(num_items, keys, strict=True) if k == key) / total
            loss = loss.to(groups[key].loss.device) + groups[key].loss.float() * share
        return GroupedWindow(groups, members, num_items, total, loss.detach(), capture_rng_state())

    def micro_batch_loss(self, window: GroupedWindow, model: nn.Module, index: int, micro_batch: Any) -> torch.Tensor:
        """Micro-batch `index`'s loss: its group's pass-2 surrogate (whose gradient, once the accumulator weights it
        by `n_k / N`, is `n_d / N` times its share of `grad L_d`), or its item-mean loss."""
        key, position = window.members[index]
        loss = self._loss_of(key)
        if isinstance(loss, CoupledLoss):
            return loss.micro_batch_loss(window.groups[key], model, position, micro_batch)
        return loss(model, micro_batch)

    def finish_passes(self, window: GroupedWindow) -> None:
        for key, group in window.groups.items():
            self.losses[key].finish_passes(group)
        restore_rng_state(window.rng_after)

    def window_loss(self, model: nn.Module, micro_batches: Sequence[Any]) -> torch.Tensor:
        keys = [self.group_fn(batch) for batch in micro_batches]
        counts = [float(self.num_items_fn(batch)) for batch in micro_batches]
        total, out = sum(counts), None
        for key in dict.fromkeys(keys):
            chosen = [i for i, k in enumerate(keys) if k == key]
            loss = self._loss_of(key)
            if isinstance(loss, CoupledLoss):
                term = loss.window_loss(model, [micro_batches[i] for i in chosen]) * (
                    sum(counts[i] for i in chosen) / total
                )
            else:
                term = sum(loss(model, micro_batches[i]) * (counts[i] / total) for i in chosen)
            out = term if out is None else out + term
        return out
