"""GRPO's `top_entropy_quantile < 1` under accumulation: the entropy threshold is the window's quantile.

With `top_entropy_quantile = q < 1`, GRPO trains only on the completion tokens whose entropy is at or above the
`1 - q` quantile of the batch's token entropies (over every rank: `get_high_entropy_mask`). Taken per micro-batch,
that quantile is a statistic of the micro-batch, so each would keep other tokens than the large batch does. Here:

1. **The window pass**, at the window's first loss (GRPO has generated and buffered the whole window by then, when
   `steps_per_generation == gradient_accumulation_steps`): GRPO's own `_compute_loss` runs on each buffered
   micro-batch without autograd, and the entropies its `get_high_entropy_mask` receives (the completion tokens only)
   are kept. Its metrics are put back as they were. Over every rank, as GRPO's own threshold is, the window's
   `1 - q` quantile is taken.
2. **Each micro-batch's loss** runs with `get_high_entropy_mask` answering from that threshold, with GRPO's own
   comparison (`entropies * mask >= threshold`, padding never kept).

Each micro-batch then keeps exactly the tokens the large batch keeps, and its loss is the trainer's own over them. A
static entropy bonus is then a mean over the kept tokens: the window pass counts them per micro-batch, and the bonus
is weighted by its own share of them (`integrations/trl/loss_terms.py`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from ...losses.composed_class import nearest_trainer_named
from ...losses.composition_error import CompositionError

__all__ = ["WindowEntropyQuantile", "window_entropy_quantile_for"]

# GRPO's own sentinel for the padding of a gather across processes (entropies are never negative).
_PAD = -1e9


class WindowEntropyQuantile:
    """
    The window's entropy threshold of one composed GRPO trainer (see the module docstring). Built by
    [`window_entropy_quantile_for`].

    Args:
        quantile (`float`): the trainer's `top_entropy_quantile`.

    Example:

    ```python
    >>> window = window_entropy_quantile_for(trainer)  # doctest: +SKIP  (GradAccumTrainer + GRPOTrainer, q = 0.5)
    >>> window.start_window()  # doctest: +SKIP
    >>> restore = window.present(trainer)  # doctest: +SKIP
    ```
    """

    def __init__(self, quantile: float) -> None:
        self.quantile = quantile
        self.threshold: torch.Tensor | None = None
        self.empty = False
        self._kept: dict[int, tuple[Any, int]] = {}

    def __repr__(self) -> str:
        return f"WindowEntropyQuantile(top_entropy_quantile={self.quantile})"

    def start_window(self) -> None:
        """A new window: its threshold is taken at its first loss."""
        self.threshold = None

    def _window_threshold(self, trainer: Any) -> None:
        buffered = getattr(trainer, "_buffered_inputs", None)
        if not buffered:
            raise RuntimeError(
                "GradAccumTrainer expected GRPOTrainer's buffered generation batch before its first loss, to take "
                "the entropy quantile over the window; this TRL release changed how it buffers generations (tested "
                "with trl==1.16)."
            )
        recorded: list[torch.Tensor] = []
        self._kept = {}

        def record(entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
            recorded.append(entropies[mask.bool()].detach().float())
            return torch.zeros_like(entropies, dtype=torch.bool)

        metrics = copy.deepcopy(getattr(trainer, "_metrics", None))
        trainer.get_high_entropy_mask = record
        try:
            with torch.no_grad():
                for batch in buffered:
                    trainer._compute_loss(trainer.model, batch)
        finally:
            del trainer.get_high_entropy_mask
            if metrics is not None:
                trainer._metrics = metrics
        if len(recorded) != len(buffered):
            raise RuntimeError(
                f"GradAccumTrainer expected GRPOTrainer's loss to ask for the high-entropy mask once per micro-batch, "
                f"and it asked {len(recorded)} times for {len(buffered)}; this TRL release computes it differently "
                "(tested with trl==1.16)."
            )
        local = torch.cat(recorded)
        accelerator = trainer.accelerator
        padded = accelerator.pad_across_processes(local, dim=0, pad_index=_PAD)
        gathered = accelerator.gather(padded)
        gathered = gathered[gathered != _PAD]
        self.empty = gathered.numel() == 0
        self.threshold = None if self.empty else torch.quantile(gathered, 1 - self.quantile)
        for batch, entropies in zip(buffered, recorded, strict=True):
            kept = 0 if self.empty else int((entropies >= self.threshold).sum())
            self._kept[id(batch)] = (batch, kept)

    def kept_tokens(self, trainer: Any, batch: Any) -> int:
        """The completion tokens of `batch` (a buffered micro-batch of the window) at or above the window's
        threshold: what an entropy bonus over the kept tokens is a mean over."""
        if self.threshold is None and not self.empty:
            self._window_threshold(trainer)
        found = self._kept.get(id(batch))
        if found is None or found[0] is not batch:
            raise RuntimeError(
                "GradAccumTrainer: GRPOTrainer's loss got a micro-batch that is not one of the window's buffered "
                "ones, so its tokens above the window's entropy threshold are unknown. Stopped before the optimizer "
                "step."
            )
        return found[1]

    def present(self, trainer: Any) -> Callable[[], None]:
        """For the loss about to run: `get_high_entropy_mask` answers from the window's threshold (taken first, at
        the window's first loss); returns what puts GRPO's own back."""
        if self.threshold is None and not self.empty:
            self._window_threshold(trainer)
        threshold, empty = self.threshold, self.empty

        def high_entropy_mask(entropies: torch.Tensor, mask: torch.Tensor, _: float) -> torch.Tensor:
            if empty:
                return torch.zeros_like(entropies, dtype=torch.bool)
            return ((entropies * mask.float()) >= threshold.to(entropies.device)) & mask.bool()

        trainer.get_high_entropy_mask = high_entropy_mask

        def restore() -> None:
            del trainer.get_high_entropy_mask

        return restore


def window_entropy_quantile_for(trainer: Any) -> WindowEntropyQuantile | None:
    """
    The [`WindowEntropyQuantile`] of a trainer composed with TRL's `GRPOTrainer` with `top_entropy_quantile < 1` and
    `gradient_accumulation_steps > 1`; `None` otherwise. Raises a [`CompositionError`] where the window is not one
    generation batch, or beside the adaptive entropy bonus.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer
    >>> window_entropy_quantile_for(GradAccumTrainer.__new__(GradAccumTrainer)) is None
    True
    ```
    """
    if nearest_trainer_named(trainer, {"GRPOTrainer"}) is None:
        return None
    args = trainer.args
    quantile = getattr(args, "top_entropy_quantile", 1.0)
    if quantile >= 1.0 or args.gradient_accumulation_steps == 1:
        return None
    why = None
    if args.steps_per_generation != args.gradient_accumulation_steps or getattr(args, "num_iterations", 1) != 1:
        why = (
            "the quantile is taken over the window's buffered generation batch, which is the window only with "
            "`steps_per_generation == gradient_accumulation_steps` and `num_iterations=1`"
        )
    elif getattr(args, "use_adaptive_entropy", False):
        why = (
            "the adaptive entropy bonus is then a mean over the kept tokens, which needs a weight of its own per "
            "micro-batch, and the adaptive controller rewrites the coefficient that carries it inside the loss"
        )
    if why is not None:
        raise CompositionError(
            f"GradAccumTrainer cannot make GRPOTrainer with `loss_type={getattr(args, 'loss_type', None)!r}` and "
            f"`top_entropy_quantile={quantile}` exact under gradient "
            f"accumulation: {why}. Fix: `top_entropy_quantile=1.0`, or `gradient_accumulation_steps=1` with the "
            "batch you want."
        )
    return WindowEntropyQuantile(quantile)
