"""A user's loss of several terms, each a mean over its own count (a token head and a sequence head), made exact.

No single weight per micro-batch makes such a loss the large batch's: the window's loss is `sum_t S_t / C_t`, with
`S_t` the sum of term t over the window and `C_t` its count over the window. The user declares the terms the way the
registered models do: `count_micro_batch_items` returns each term's count (`{"tokens": ..., "rows": ...}`), and
`compute_loss` combines the terms' means with [`mean_terms`]. Under the stock `Trainer` (or one micro-batch per step)
`mean_terms` is the plain sum of the means, so the same code trains as it did; under `GradAccumTrainer` each
micro-batch's loss becomes its share `sum_t mean_t c_t / C_t`, and the accumulator sums the shares.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..engine.items import read_counts


class DeclaredTerms:
    """
    The window's count of each declared term (over every rank), and each micro-batch's share of the window's loss.

    Args:
        trainer: the `GradAccumTrainer` whose `count_micro_batch_items` returns a dict of counts.

    Example:

    ```python
    >>> terms = DeclaredTerms(trainer)  # doctest: +SKIP
    >>> terms.prepare(window_batches)  # doctest: +SKIP
    ```
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.totals: dict[str, float] | None = None

    def counts(self, inputs: Mapping[str, Any]) -> dict[str, float]:
        """Each term's count in `inputs`, as the user's `count_micro_batch_items` returns it."""
        declared = self.trainer.count_micro_batch_items(inputs)
        names = sorted(declared)
        return dict(zip(names, (float(v) for v in read_counts([declared[n] for n in names])), strict=True))

    def prepare(self, batches: Sequence[Mapping[str, Any]]) -> None:
        """The window's count of each term, summed over its micro-batches and every rank (one all-reduce)."""
        if not batches:
            return
        per_batch = [self.counts(b) for b in batches]
        names = sorted(per_batch[0])
        local = torch.tensor([sum(c[n] for c in per_batch) for n in names], dtype=torch.float64)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            device = self.trainer.args.device if dist.get_backend() == "nccl" else torch.device("cpu")
            local = local.to(device)
            dist.all_reduce(local)
        self.totals = dict(zip(names, local.cpu().tolist(), strict=True))

    def share(self, inputs: Mapping[str, Any], means: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This micro-batch's share of the window's loss: `sum_t mean_t * c_t / C_t`."""
        counts = self.counts(inputs)
        if set(counts) != set(means) or set(counts) != set(self.totals or {}):
            raise ValueError(
                f"mean_terms got the terms {sorted(means)}, but `count_micro_batch_items` returns counts for "
                f"{sorted(counts)}: name each term of the loss once, in both."
            )
        parts = [
            means[n] * (counts[n] / self.totals[n]) for n in sorted(means) if self.totals[n] > 0 and counts[n] > 0
        ]
        return torch.stack(parts).sum() if parts else sum(means.values()) * 0.0


def mean_terms(trainer: Any, inputs: Mapping[str, Any], **means: torch.Tensor) -> torch.Tensor:
    """
    The loss of several terms, each the mean over its own count: the plain sum of `means` under the stock `Trainer`,
    each micro-batch's exact share of the window's loss under `GradAccumTrainer`. Declare each term's count in
    `count_micro_batch_items`, under the same names.

    Args:
        trainer: the trainer (`self` in `compute_loss`).
        inputs: the micro-batch as `compute_loss` received it (the counts are read from it).
        **means: each term's mean, by name.

    Example:

    ```python
    >>> from hf_gradaccum import GradAccumTrainer, mean_terms
    >>> class TwoHeads(GradAccumTrainer):
    ...     def count_micro_batch_items(self, inputs):
    ...         return {"tokens": inputs["labels"].ne(-100).sum(), "rows": len(inputs["labels"])}
    ...
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         token_loss, row_loss = ...  # each a mean over its own count
    ...         return mean_terms(self, inputs, tokens=token_loss, rows=row_loss)
    ```
    """
    terms = getattr(getattr(trainer, "_loss_rule", None), "terms", None)
    if isinstance(terms, DeclaredTerms) and terms.totals is not None:
        return terms.share(inputs, means)
    return torch.stack([m for m in means.values()]).sum() if means else torch.tensor(0.0)
