"""DPO's `aot` and `aot_unpaired` losses under accumulation: the sort runs over the window, as the large batch's does.

AOT (`loss_type="aot"`) sorts the batch's policy log-ratios and, separately, its reference log-ratios, and pairs them
by rank: `mean_i f(L*_i - R*_i)`. `aot_unpaired` sorts the chosen and the rejected log-ratios and pairs those by
rank. Sorted within a micro-batch, rank `i` is another pair than in the window, so no weighting of micro-batches
reproduces the large batch. Sorted over the window, it is exact:

1. **The window pass** (when the window is prefetched, no autograd graph): DPO's own `compute_loss` runs on each
   micro-batch, with the two `torch.sort` calls of each sorted loss type recorded. Its metrics are put back as they
   were, and each micro-batch's random state is kept so that its second forward draws the same values.
2. **Each micro-batch** runs DPO's own `compute_loss` again, with autograd, and its `torch.sort` calls answered from
   the window: for `aot`, the policy log-ratio of pair `p` is paired with the reference log-ratio of its rank in
   the window, `f(l_p - R*_rank(l_p))`. For `aot_unpaired` both sides carry gradients, so each micro-batch's sorted
   tensors have two halves: its chosen log-ratios paired with the window's rejected log-ratio of the same rank, and
   the window's chosen log-ratio of each of its rejected log-ratios' rank paired with it. Each half carries its side's
   gradient at twice its value's weight (`2x - x.detach()`), since the loss's mean is now over twice the rows.

Summed over the window with the accumulator's weights (pairs) this is the window's sorted loss and its gradient.
Each rank sorts its own window, as the stock trainer sorts its own batch on each rank.

`torch.sort` is answered by putting a stand-in for the `torch` module into `trl.trainer.dpo_trainer`'s namespace for
the length of one `compute_loss`: everything but `sort` is torch's own. If the live log-ratios differ from the window
pass's (a forward that is not deterministic) training stops before the optimizer step.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...engine.rng import RNGState, capture_rng_state, restore_rng_state
from ...losses.composed_class import nearest_trainer_named
from ...losses.composition_error import CompositionError

__all__ = ["SORTED_LOSS_TYPES", "WindowSortedLoss", "window_sorted_loss_for"]

SORTED_LOSS_TYPES = ("aot", "aot_unpaired")
_DPO_MODULE = "trl.trainer.dpo_trainer"
# The live log-ratios must repeat the window pass's: a difference beyond rounding means another forward.
_RECOMPUTE_TOLERANCE = 1e-5


class _TorchWithSort:
    """`torch`, except `sort`: answered by `sort_fn`."""

    def __init__(self, sort_fn: Callable[..., Any]) -> None:
        self._sort_fn = sort_fn

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def sort(self, *args: Any, **kwargs: Any) -> Any:
        return self._sort_fn(*args, **kwargs)


@contextlib.contextmanager
def _answering_sort(sort_fn: Callable[..., Any]) -> Iterator[None]:
    module = sys.modules[_DPO_MODULE]
    saved = module.torch
    module.torch = _TorchWithSort(sort_fn)
    try:
        yield
    finally:
        module.torch = saved


def _ranks(values: torch.Tensor) -> torch.Tensor:
    """The rank of each value in `values` (0 for the smallest; ties in index order, as a stable sort)."""
    order = torch.sort(values, stable=True).indices
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(values.numel(), device=values.device)
    return ranks


class WindowSortedLoss:
    """
    The window pass and the sorted answers of one composed DPO trainer with `aot` or `aot_unpaired` among its loss
    types (see the module docstring). Built by [`window_sorted_loss_for`].

    Args:
        loss_types (`list[str]`): the trainer's loss types, in its order (each sorted one makes two `torch.sort` calls).

    Example:

    ```python
    >>> sorted_loss = window_sorted_loss_for(trainer)  # doctest: +SKIP  (GradAccumTrainer + DPOTrainer, "aot")
    >>> sorted_loss.window_prefetched(trainer, batches)  # doctest: +SKIP
    >>> restore = sorted_loss.present(trainer, inputs)  # doctest: +SKIP
    ```
    """

    def __init__(self, loss_types: list[str]) -> None:
        self.sorted_types = [t for t in loss_types if t in SORTED_LOSS_TYPES]
        self._slots: dict[int, tuple[Any, int, int, RNGState]] = {}
        self._window: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __repr__(self) -> str:
        return f"WindowSortedLoss({self.sorted_types})"

    def window_prefetched(self, trainer: Any, batches: list[Any]) -> None:
        """The window pass: record each micro-batch's sorted inputs, with its metrics put back."""
        self._slots, firsts, seconds, offset = {}, [], [], 0
        model = trainer.model_wrapped if getattr(trainer, "model_wrapped", None) is not None else trainer.model
        for batch in batches:
            calls: list[torch.Tensor] = []

            def record(values: torch.Tensor, *args: Any, calls: list[torch.Tensor] = calls, **kwargs: Any) -> Any:
                calls.append(values.detach())
                return torch.sort(values, *args, **kwargs)

            rng = capture_rng_state()
            metrics = copy.deepcopy(getattr(trainer, "_metrics", None))
            tokens = getattr(trainer, "_total_train_tokens", None)
            try:
                with torch.no_grad(), _answering_sort(record), trainer.compute_loss_context_manager():
                    trainer.compute_loss(model, trainer._prepare_inputs(batch))
            finally:
                if metrics is not None:
                    trainer._metrics = metrics
                if tokens is not None:
                    trainer._total_train_tokens = tokens
            if len(calls) != 2 * len(self.sorted_types):
                raise RuntimeError(
                    f"GradAccumTrainer expected DPOTrainer's loss types {self.sorted_types} to sort twice each, and "
                    f"saw {len(calls)} sorts; this TRL release computes them differently (tested with trl==1.16)."
                )
            rows = int(calls[0].shape[0])
            self._slots[id(batch)] = (batch, offset, rows, rng)
            offset += rows
            firsts.append(calls[0::2])
            seconds.append(calls[1::2])
        self._window = [
            (torch.cat([f[j] for f in firsts]), torch.cat([s[j] for s in seconds]))
            for j in range(len(self.sorted_types))
        ]

    def present(self, trainer: Any, inputs: Any) -> Callable[[], None]:
        """Answer the sorts of the loss on `inputs` (a micro-batch of the window, as prefetched) from the window;
        returns what puts `torch` back."""
        slot = self._slots.get(id(inputs))
        if slot is None or slot[0] is not inputs:
            raise RuntimeError(
                "GradAccumTrainer: DPOTrainer's sorted loss got a micro-batch that is not one of the prefetched "
                "window's, so its ranks in the window are unknown. Stopped before the optimizer step."
            )
        _, offset, rows, rng = slot
        restore_rng_state(rng)
        calls = [0]

        def answer(values: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            index = calls[0]
            calls[0] += 1
            j, second = divmod(index, 2)
            first_window, second_window = self._window[j]
            window = second_window if second else first_window
            recorded = window[offset : offset + rows]
            if not torch.allclose(values.detach(), recorded, rtol=_RECOMPUTE_TOLERANCE, atol=_RECOMPUTE_TOLERANCE):
                raise RuntimeError(
                    "GradAccumTrainer: DPOTrainer's log-ratios differ between the window pass and the training "
                    f"forward (max difference {float((values.detach() - recorded).abs().max()):.3g}): the forward is "
                    "not deterministic, so the ranks over the window do not hold. Stopped before the optimizer step."
                )
            return self._answer(j, second, values, offset, rows)

        stack = contextlib.ExitStack()
        stack.enter_context(_answering_sort(answer))
        return stack.close

    def _answer(self, j: int, second: bool, values: torch.Tensor, offset: int, rows: int) -> Any:
        first_window, second_window = self._window[j]
        first_sorted, second_sorted = torch.sort(first_window).values, torch.sort(second_window).values
        first_rank = _ranks(first_window)[offset : offset + rows]
        second_rank = _ranks(second_window)[offset : offset + rows]
        indices = torch.zeros(values.shape, dtype=torch.long, device=values.device)
        if self.sorted_types[j] == "aot":
            # The policy side (first) carries the gradient; the reference side is a constant.
            if not second:
                return values, indices
            return second_sorted[first_rank].to(values), indices
        doubled = 2 * values - values.detach()
        if not second:
            return torch.cat([doubled, first_sorted[second_rank].to(values)]), torch.cat([indices, indices])
        return torch.cat([second_sorted[first_rank].to(values), doubled]), torch.cat([indices, indices])


def window_sorted_loss_for(trainer: Any) -> WindowSortedLoss | None:
    """
    The [`WindowSortedLoss`] of a trainer composed with TRL's `DPOTrainer` with `aot` or `aot_unpaired` among its loss
    types and `gradient_accumulation_steps > 1`; `None` otherwise. Raises a `ValueError` for a configuration whose
    micro-batches cannot be matched to the window (`auto_find_batch_size=True`) with a [`CompositionError`].

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> window_sorted_loss_for(GradAccumTrainer.__new__(GradAccumTrainer)) is None
    True
    ```
    """
    if nearest_trainer_named(trainer, {"DPOTrainer"}) is None:
        return None
    args = trainer.args
    loss_type = getattr(args, "loss_type", None)
    loss_types = [loss_type] if isinstance(loss_type, str) else list(loss_type or [])
    if args.gradient_accumulation_steps == 1 or not any(t in SORTED_LOSS_TYPES for t in loss_types):
        return None
    if args.auto_find_batch_size:
        raise CompositionError(
            f"GradAccumTrainer cannot sort DPOTrainer's {loss_types} over the window with `auto_find_batch_size=True`: "
            "an out-of-memory split makes micro-batches the window pass did not see. Set `auto_find_batch_size=False`."
        )
    return WindowSortedLoss(loss_types)
