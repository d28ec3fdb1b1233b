"""Counting the items a loss averages over, so that micro-batches can be weighted like one large batch.

A mean loss over a micro-batch is `sum_i l_i / n_k`. The large-batch loss over a window is `sum_k sum_i l_i / N` with
`N = sum_k n_k`. Weighting micro-batch k by `n_k / N` makes the two identical, whatever the micro-batch sizes; `n_k`
must be what the model's own mean divides by. That is what this module counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def count_items(labels: torch.Tensor | None, *, shift_labels: bool = False, ignore_index: int = IGNORE_INDEX) -> int:
    """
    Number of items that a mean loss over `labels` divides by.

    - Integer labels (classification, token classification, masked/causal LM): entries that are not `ignore_index`.
      With `shift_labels=True` (causal LM: position 0 of each row is never a target) only `labels[..., 1:]` counts.
    - Floating labels (regression, multi-label): one item per row. The model's mean runs over rows x outputs, which
      is proportional to rows, so the weights are the same.

    Args:
        labels (`torch.Tensor` or `None`): the micro-batch's labels. `None` counts as 0 items.
        shift_labels (`bool`, *optional*, defaults to `False`): count as a causal LM does (predict the next token).
        ignore_index (`int`, *optional*, defaults to -100): the label value the loss ignores.

    Returns:
        `int`: the number of items.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.items import count_items
    >>> count_items(torch.tensor([[5, 7, -100], [1, -100, -100]]))
    3
    >>> count_items(torch.tensor([[5, 7, -100], [1, 2, -100]]), shift_labels=True)
    2
    ```
    """
    return read_counts([_items_of(labels, shift_labels=shift_labels, ignore_index=ignore_index)])[0]


def _items_of(labels: Any, *, shift_labels: bool, ignore_index: int) -> int | torch.Tensor:
    """[`count_items`] without reading the device: a count that needs the labels' values stays a 0-dim tensor where
    the labels are, so that a caller counting several batches reads them all at once."""
    if labels is None:
        return 0
    if not torch.is_tensor(labels):
        labels = torch.as_tensor(labels)
    if labels.is_floating_point():
        return int(labels.shape[0]) if labels.dim() > 0 else 1
    if shift_labels:
        labels = labels[..., 1:]
    return labels.ne(ignore_index).sum()


def count_items_in_batch(
    batch: Mapping[str, Any],
    *,
    shift_labels: bool = False,
    label_name: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> int:
    """
    [`count_items`] on a collated batch: uses `shift_labels` when the collator provides it (padding-free collators),
    else `batch[label_name]`. A batch without labels counts one item per row of its first tensor, which is what an
    unweighted mean over rows would divide by.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum import count_items_in_batch
    >>> count_items_in_batch({"input_ids": torch.zeros(4, 8), "labels": torch.tensor([0, 1, 1, -100])})
    3
    ```
    """
    return read_counts(
        [items_on_device(batch, shift_labels=shift_labels, label_name=label_name, ignore_index=ignore_index)]
    )[0]


def count_items_in_batches(
    batches: Sequence[Mapping[str, Any]],
    *,
    shift_labels: bool = False,
    label_name: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> list[int]:
    """
    [`count_items_in_batch`] of each batch, with one read from the device for all of them: counting a window of
    micro-batches whose labels are on a GPU then waits for the device once, not once per micro-batch.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum import count_items_in_batches
    >>> count_items_in_batches([{"labels": torch.tensor([0, -100])}, {"labels": torch.tensor([[1, 2, 3]])}])
    [1, 3]
    ```
    """
    return read_counts(
        [
            items_on_device(batch, shift_labels=shift_labels, label_name=label_name, ignore_index=ignore_index)
            for batch in batches
        ]
    )


def read_counts(counts: Sequence[int | float | torch.Tensor]) -> list[int | float]:
    """The values of counts from [`items_on_device`], with one read per device that holds some of them: integers,
    except counts that are sums of weights (a sample weight, a class-weighted count), which stay fractional."""
    values: list[Any] = list(counts)
    on_device: dict[torch.device, list[int]] = {}
    for index, count in enumerate(values):
        if torch.is_tensor(count):
            on_device.setdefault(count.device, []).append(index)
    for indices in on_device.values():
        floating = [values[i].is_floating_point() for i in indices]
        if len(indices) == 1:  # one count: no stacking kernel
            value = values[indices[0]].item()
            values[indices[0]] = float(value) if floating[0] else int(value)
            continue
        stacked = torch.stack([values[i].double() for i in indices]).tolist()
        for index, value, is_float in zip(indices, stacked, floating, strict=True):
            values[index] = float(value) if is_float else int(value)
    return values


def items_on_device(
    batch: Mapping[str, Any],
    *,
    shift_labels: bool = False,
    label_name: str = "labels",
    ignore_index: int = IGNORE_INDEX,
) -> int | torch.Tensor:
    """[`count_items_in_batch`] without reading the device: a count of labels stays a 0-dim tensor beside them
    (read it, with others, by [`read_counts`])."""
    if "shift_labels" in batch and batch["shift_labels"] is not None:
        return _items_of(batch["shift_labels"], shift_labels=False, ignore_index=ignore_index)
    if label_name in batch and batch[label_name] is not None:
        return _items_of(batch[label_name], shift_labels=shift_labels, ignore_index=ignore_index)
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    raise ValueError(
        f"Cannot count items in a batch with keys {sorted(batch)}: expected `{label_name}`, `shift_labels` or at "
        "least one batched tensor."
    )
