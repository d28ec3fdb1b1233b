"""One window of micro-batches as one set of rows, and the splits of those rows that the check compares.

The check needs the *same samples* cut differently. The window's micro-batches are concatenated row-wise (token
tensors padded to the longest sequence: `input_ids` with the pad token, `labels` with -100, masks with 0, so padding
is never an item and never attended to), then re-cut into micro-batches of other sizes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..engine.items import IGNORE_INDEX

# Keys whose padding must be ignored by the loss (-100) rather than be a token or an attended position (0).
_LABEL_KEYS = ("labels", "shift_labels", "decoder_labels")
_TOKEN_KEYS = ("input_ids", "decoder_input_ids")


def _pad_value(key: str, pad_token_id: int) -> int:
    if key in _LABEL_KEYS or key.endswith("labels"):
        return IGNORE_INDEX
    if key in _TOKEN_KEYS:
        return pad_token_id
    return 0  # attention masks, token type ids, position ids beyond the sequence: never attended


def concat_window(batches: Sequence[Mapping[str, Any]], *, pad_token_id: int = 0) -> tuple[dict[str, Any], list[int]]:
    """
    Concatenate a window's micro-batches (dicts of tensors with the batch as dim 0) into one batch of rows.

    Token tensors of different lengths are right-padded to the longest (see module docstring); non-tensor values
    must be equal across micro-batches and are kept as they are, except lists with one entry per row (the prompts
    that TRL's preference collators keep as text), which are concatenated and cut with the rows.

    Returns:
        `(rows, sizes)`: the concatenated batch and the number of rows of each original micro-batch.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.verification.windows import concat_window
    >>> rows, sizes = concat_window([{"labels": torch.tensor([[1, 2]])}, {"labels": torch.tensor([[3, 4, 5]])}])
    >>> rows["labels"].tolist(), sizes
    ([[1, 2, -100], [3, 4, 5]], [1, 1])
    ```
    """
    if not batches:
        raise ValueError("`batches` is empty: pass the micro-batches of one accumulation window.")
    batches = _without_packed_row_keys(batches)
    keys = list(batches[0])
    for i, batch in enumerate(batches):
        if not isinstance(batch, Mapping):
            raise TypeError(f"`batches[{i}]` must be a dict of tensors, got {type(batch).__name__}.")
        if list(batch) != keys:
            raise ValueError(f"`batches[{i}]` has keys {sorted(batch)}, `batches[0]` has {sorted(keys)}.")
    sizes = [_rows(batch, i) for i, batch in enumerate(batches)]
    rows: dict[str, Any] = {}
    for key in keys:
        values = [batch[key] for batch in batches]
        if all(isinstance(v, (list, tuple)) and len(v) == n for v, n in zip(values, sizes, strict=True)):
            rows[key] = _RowList(item for v in values for item in v)
            continue
        if not torch.is_tensor(values[0]):
            if any(v != values[0] for v in values[1:]):
                raise ValueError(f"`batches[*][{key!r}]` is not a tensor and differs between micro-batches.")
            rows[key] = values[0]
            continue
        if values[0].dim() >= 2 and len({v.shape[1:] for v in values}) > 1:
            values = _pad_right(values, key, pad_token_id)
        rows[key] = torch.cat(values, dim=0)
    return rows, sizes


# Padding-free batches (one packed row: `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`) carry the bounds
# of their sequences twice: in `position_ids`, from which transformers keeps packed sequences apart, and in
# flash-attention kwargs that describe one packed row only. Stacked as rows, those kwargs no longer describe the batch:
# they are dropped, and `position_ids` carry the bounds.
_PACKED_ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _without_packed_row_keys(batches: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    if len(batches) < 2 or not any(k in batches[0] for k in _PACKED_ROW_KEYS):
        return batches
    if not all(isinstance(b, Mapping) and "position_ids" in b for b in batches):
        return batches
    return [{k: v for k, v in b.items() if k not in _PACKED_ROW_KEYS} for b in batches]


class _RowList(list):
    """A per-row list of a concatenated batch (one entry per row), cut with the rows."""


def _rows(batch: Mapping[str, Any], index: int) -> int:
    counts = {v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() > 0}
    if not counts:
        # No tensor at all: a batch of texts tokenised inside the loss (sentence-transformers' CrossEncoder).
        counts = {len(v) for v in batch.values() if isinstance(v, (list, tuple))}
    if len(counts) != 1:
        raise ValueError(f"`batches[{index}]` has tensors with different numbers of rows {sorted(counts)}.")
    return counts.pop()


def _pad_right(values: list[torch.Tensor], key: str, pad_token_id: int) -> list[torch.Tensor]:
    # Only the sequence dimension (dim 1) may differ; anything else (images of different sizes) cannot be padded
    # without changing what the model computes.
    if len({(v.dim(), *v.shape[2:]) for v in values}) > 1:
        raise ValueError(
            f"`batches[*][{key!r}]` differ in more than the sequence length ({[tuple(v.shape) for v in values]}): "
            "pass micro-batches of equal shapes."
        )
    length = max(v.shape[1] for v in values)
    fill = _pad_value(key, pad_token_id)
    padded = []
    for v in values:
        extra = v.new_full((v.shape[0], length - v.shape[1], *v.shape[2:]), fill)
        padded.append(torch.cat([v, extra], dim=1))
    return padded


def take_rows(rows: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows `start:stop` of a concatenated batch (per-row lists cut too, other non-tensor values kept)."""
    return {
        k: (
            v[start:stop]
            if (torch.is_tensor(v) and v.dim() > 0)
            else list(v[start:stop])
            if isinstance(v, _RowList)
            else v
        )
        for k, v in rows.items()
    }


def cut(rows: Mapping[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Cut a concatenated batch into consecutive micro-batches of `sizes` rows."""
    out, start = [], 0
    for size in sizes:
        out.append(take_rows(rows, start, start + size))
        start += size
    return out


def halve(sizes: Sequence[int]) -> list[int]:
    """Each micro-batch cut in two (the larger half first). Requires every size >= 2."""
    return [part for size in sizes for part in ((size + 1) // 2, size // 2)]


def merge_pairs(sizes: Sequence[int]) -> list[int]:
    """Consecutive micro-batches merged in pairs (an odd last one kept as is)."""
    return [sum(sizes[i : i + 2]) for i in range(0, len(sizes), 2)]
