"""The item-weighted accumulated gradient of one split of a window, with `torch.autograd.grad`.

`torch.autograd.grad` returns the gradients instead of accumulating them into `.grad`, so neither the gradients of a
window in progress nor the accumulator's post-accumulate-grad hooks (which fire only when `.grad` is written) see it.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

LossFn = Callable[[nn.Module, dict[str, Any]], torch.Tensor]
CountFn = Callable[[dict[str, Any]], float]


class ForwardFailed(RuntimeError):
    """The user's forward, loss or backward raised on a micro-batch of the probe: which one, and where it raised."""

    def __init__(self, error: BaseException, index: int, rows: int) -> None:
        frames = traceback.extract_tb(error.__traceback__)
        where = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
        self.error, self.index, self.rows, self.where = error, index, rows, where.strip()
        super().__init__(f"{type(error).__name__}: {error} (micro-batch {index} of {rows} row(s){where})")


def batch_rows(batch: Mapping[str, Any]) -> int:
    return next((v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0), 0)


def model_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """
    The loss the model returns for `batch` (`model(**batch).loss`, or the first element of a tuple output): the
    default `loss_fn`, what `Trainer.compute_loss` does for a model that computes its own loss.

    Example:

    ```python
    >>> import torch
    >>> from transformers import BertConfig, BertForSequenceClassification
    >>> from hf_gradaccum.verification.gradients import model_loss
    >>> model = BertForSequenceClassification(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    ...     intermediate_size=8, vocab_size=20))
    >>> model_loss(model, {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([1])}).dim()
    0
    ```
    """
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)):
        loss = out[0]
    if loss is None and torch.is_tensor(out) and out.dim() == 0:
        loss = out
    if loss is None:
        raise ValueError(
            f"{type(model).__name__} returned no loss for the batch (keys {sorted(batch)}): pass labels in the "
            "batches, or a `loss_fn(model, batch)` that returns the micro-batch's mean loss."
        )
    return loss


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def accumulated_gradient(
    model: nn.Module,
    params: Sequence[nn.Parameter],
    micro_batches: Sequence[dict[str, Any]],
    loss_fn: LossFn,
    count_items: CountFn,
    grad_dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """
    `sum_k n_k / N * grad(loss_k)` in `grad_dtype` (fp32, or fp64 for a model run in fp64) over `micro_batches`, `n_k = count_items(micro_batch_k)`: the gradient
    that exact accumulation applies for this split of the window. Micro-batches with no items are skipped, as their
    weight is 0. An exception from `loss_fn` or the backward is raised as [`ForwardFailed`] (with the micro-batch).
    """
    counts = [float(count_items(mb)) for mb in micro_batches]
    total = sum(counts)
    if not total > 0:
        raise ValueError(f"`count_items` found no items in the window (counts {counts}): nothing to compare.")
    device = params[0].device
    grads = [torch.zeros_like(p, dtype=grad_dtype) for p in params]
    for index, (mb, n) in enumerate(zip(micro_batches, counts, strict=True)):
        if n == 0:
            continue
        try:
            loss = loss_fn(model, to_device(mb, device))
            if not torch.is_tensor(loss) or loss.dim() != 0:
                raise ValueError(f"`loss_fn` must return a scalar tensor, got {type(loss).__name__}.")
            parts = torch.autograd.grad(loss, params, allow_unused=True)
        except Exception as error:  # the user's code: becomes a "cannot decide" verdict, not a traceback
            raise ForwardFailed(error, index, batch_rows(mb)) from error
        for acc, g in zip(grads, parts, strict=True):
            if g is not None:
                acc.add_(g.to(grad_dtype), alpha=n / total)
    return grads
