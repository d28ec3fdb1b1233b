"""The counts a loss may divide by, each a rule with a name: what a micro-batch weighs under it, and what each of its
rows weighs (every count here adds up over rows, which is what lets a cut join rows of different micro-batches)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..items import IGNORE_INDEX

SUM = "sum"
ROWS = "rows"
LABEL_TOKENS = "label_tokens"
SHIFTED_LABEL_TOKENS = "shifted_label_tokens"
BOXES = "boxes"
NONE = "none"
# The rules a user may name (`loss_normalisation=`); rules over other keys the data carries are named `count:<key>`
# (entries that are not -100, or true), `sum:<key>` (the values summed: a sample weight, a float mask) and
# `class_weighted:<key>=w0,w1,...` (entries of class c counted w_c times: a class-weighted cross-entropy).
NAMED_RULES = (LABEL_TOKENS, SHIFTED_LABEL_TOKENS, ROWS, SUM, BOXES)
CLASS_WEIGHTED = "class_weighted:"
# Keys that are model inputs, never something a loss divides by.
INPUT_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "position_ids", "pixel_values", "input_values",
     "input_features", "decoder_input_ids", "decoder_attention_mask", "pixel_mask", "head_mask", "inputs_embeds",
     "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}
)  # fmt: skip


def batch_rows(batch: Mapping[str, Any]) -> int:
    """The rows of a batch: the first dimension of its first tensor, or the length of its per-row lists."""
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    for value in batch.values():
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError(f"Cannot count the rows of a batch with keys {sorted(batch)}.")


def _boxes(labels: Any) -> list[int] | None:
    """Objects per image of a detection batch: `labels` is a list of dicts, one per image, with `class_labels`."""
    if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(t, Mapping) for t in labels):
        return None
    out = []
    for target in labels:
        value = target.get("class_labels", target.get("boxes"))
        if value is None:
            return None
        out.append(int(len(value)))
    return out


def _label_entries(value: Any, *, shifted: bool = False) -> torch.Tensor | None:
    """The entries of an integer label (or boolean mask) tensor a mean over it counts, as booleans."""
    if not torch.is_tensor(value) or value.is_floating_point() or value.dim() == 0:
        return None
    if value.dtype == torch.bool:
        return value
    if shifted:
        if value.dim() < 2:
            return None
        value = value[..., 1:]
    return value.ne(IGNORE_INDEX)


def parse_class_weights(rule: str) -> tuple[str, list[float]]:
    """The key and the per-class weights of a `class_weighted:<key>=w0,w1,...` rule."""
    key, _, weights = rule[len(CLASS_WEIGHTED) :].partition("=")
    try:
        return key, [float(w) for w in weights.split(",")]
    except ValueError as error:
        raise ValueError(f"{rule!r}: expected 'class_weighted:<key>=w0,w1,...' with one number per class.") from error


def class_weighted_rule(key: str, weights: Sequence[float]) -> str:
    """The name of the rule counting each entry of class c of `key` `weights[c]` times."""
    return f"{CLASS_WEIGHTED}{key}=" + ",".join(f"{w:.9g}" for w in weights)


def _entries(rule: str, batch: Mapping[str, Any], label_name: str) -> torch.Tensor | None:
    """A tensor whose entries, summed, are `batch`'s count under a counting rule (rows first where it has rows)."""
    labels = batch.get(label_name)
    if rule in (LABEL_TOKENS, SHIFTED_LABEL_TOKENS):
        if batch.get("shift_labels") is not None:
            return _label_entries(batch["shift_labels"])
        if torch.is_tensor(labels) and labels.is_floating_point():
            return None
        return _label_entries(labels, shifted=rule == SHIFTED_LABEL_TOKENS)
    if rule.startswith("count:"):
        key = rule[len("count:") :]
        value = batch.get(key)
        if "mask" in key and torch.is_tensor(value) and not value.is_floating_point():
            return value.ne(0)  # attended (or masked) positions
        return _label_entries(value)
    if rule.startswith("sum:"):
        value = batch.get(rule[len("sum:") :])
        if not torch.is_tensor(value) or value.dtype == torch.bool or value.dim() == 0:
            return None
        return value
    if rule.startswith(CLASS_WEIGHTED):
        key, weights = parse_class_weights(rule)
        value = batch.get(key)
        if not torch.is_tensor(value) or value.is_floating_point() or value.dtype == torch.bool:
            return None
        kept = value.ne(IGNORE_INDEX)
        table = torch.tensor(weights, dtype=torch.float64, device=value.device)
        index = value.clamp(0, len(weights) - 1) * kept
        return table[index] * kept
    raise ValueError(
        f"Unknown loss normalisation rule {rule!r}: expected one of {list(NAMED_RULES)}, 'count:<key>', "
        "'sum:<key>' or 'class_weighted:<key>=w0,w1,...'."
    )


def batch_count(
    rule: str, batch: Mapping[str, Any], *, label_name: str = "labels"
) -> int | float | torch.Tensor | None:
    """
    The count that `rule` weights `batch` by, or `None` where the rule does not apply to this batch. A count of
    labels stays a 0-dim tensor beside them (read it with [`~hf_gradaccum.engine.items.read_counts`]).

    Rules: `"rows"`; `"label_tokens"` / `"shifted_label_tokens"` (entries of `labels`, or of the `shift_labels` a
    padding-free collator provides, that are not -100; shifted: `labels[..., 1:]`); `"boxes"` (objects in a detection
    batch's list of target dicts); `"count:<key>"` (entries of another label or mask key that are not -100, or true);
    `"sum:<key>"` (the values of a numeric key summed: a `sample_weight`, a float mask); `"class_weighted:<key>=w0,..."`
    (each entry of class c counted `w_c` times); `"sum"` (1 per micro-batch: the loss is its contribution to the
    window's sum).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.loss_normalisation import batch_count
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    >>> int(batch_count("label_tokens", batch)), int(batch_count("shifted_label_tokens", batch)), batch_count("rows", batch)
    (3, 1, 2)
    >>> float(batch_count("sum:w", {"w": torch.tensor([0.5, 2.0])}))
    2.5
    ```
    """
    if rule == SUM:
        return 1
    if rule == ROWS:
        return batch_rows(batch)
    if rule == BOXES:
        boxes = _boxes(batch.get(label_name))
        return None if boxes is None else sum(boxes)
    entries = _entries(rule, batch, label_name)
    return None if entries is None else entries.sum()


def row_counts(rule: str, batch: Mapping[str, Any], *, label_name: str = "labels") -> list[float] | None:
    """`batch`'s count under `rule`, row by row (they add up to [`batch_count`]); `None` where the rule does not
    apply, or its entries are not laid out by row. Read from the device: for the measurement, not for training."""
    rows = batch_rows(batch)
    if rule == ROWS:
        return [1.0] * rows
    if rule == BOXES:
        boxes = _boxes(batch.get(label_name))
        return None if boxes is None else [float(b) for b in boxes]
    if rule == SUM:
        return None
    entries = _entries(rule, batch, label_name)
    if entries is None or entries.dim() == 0 or entries.shape[0] != rows:
        return None
    return entries.reshape(rows, -1).double().sum(dim=1).cpu().tolist()


def _applies(rule: str, batches: Sequence[Mapping[str, Any]], label_name: str) -> bool:
    return all(batch_count(rule, b, label_name=label_name) is not None for b in batches)


def candidate_rules(
    batches: Sequence[Mapping[str, Any]] | Mapping[str, Any], *, label_name: str = "labels"
) -> list[str]:
    """
    The rules that apply to every batch of `batches`: `"sum"`, every named rule with a count in each, a `count:<key>`
    for each other integer label or boolean mask they carry (a next-sentence label, masked patches, attended tokens),
    and a `sum:<key>` for each floating column that is not a model input (a sample weight, a float mask) or integer
    column named like a weight.

    Example:

    ```python
    >>> import torch
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([1, 0]), "sample_weight": torch.ones(2)}
    >>> candidate_rules([batch])
    ['sum', 'label_tokens', 'rows', 'sum:sample_weight']
    ```
    """
    batches = [batches] if isinstance(batches, Mapping) else list(batches)
    if not batches:
        return [SUM]
    first = batches[0]
    rules = [r for r in (LABEL_TOKENS, SHIFTED_LABEL_TOKENS, ROWS, BOXES) if _applies(r, batches, label_name)]
    for key, value in first.items():
        if key in (label_name, "shift_labels") or not torch.is_tensor(value) or value.dim() == 0:
            continue
        # A loss may average over the attended tokens (a discriminator's per-token loss, ELECTRA's).
        if key in INPUT_KEYS and key != "attention_mask":
            continue
        if ("label" in key or "mask" in key) and _label_entries(value) is not None:
            rules.append(f"count:{key}")
        elif key != "attention_mask" and (
            value.is_floating_point() or ("weight" in key and value.dtype != torch.bool)
        ):
            rules.append(f"sum:{key}")
    return [SUM, *(r for r in rules if r in (ROWS, BOXES) or _applies(r, batches, label_name))]


def class_keys(batches: Sequence[Mapping[str, Any]], *, label_name: str = "labels", most: int = 8) -> dict[str, int]:
    """Integer label keys whose entries take at most `most` classes over `batches` (0 to K-1, -100 ignored): the
    keys a class-weighted count may be fitted for, with their number of classes."""
    out = {}
    keys = [k for k in batches[0] if k == label_name or "label" in k] if batches else []
    for key in keys:
        values = [b.get(key) for b in batches]
        if not all(torch.is_tensor(v) and not v.is_floating_point() and v.dtype != torch.bool for v in values):
            continue
        seen = torch.cat([v.reshape(-1) for v in values])
        seen = seen[seen.ne(IGNORE_INDEX)]
        if seen.numel() == 0 or int(seen.min()) < 0:
            continue
        classes = int(seen.max()) + 1
        if 2 <= classes <= most:
            out[key] = classes
    return out


def class_row_counts(key: str, classes: int, batch: Mapping[str, Any]) -> list[list[float]]:
    """Per row of `batch`, how many entries of `key` fall in each of `classes` classes."""
    value = batch[key]
    rows = value.shape[0]
    flat = value.reshape(rows, -1)
    one_hot = torch.stack([flat.eq(c).sum(dim=1) for c in range(classes)], dim=1)
    return one_hot.double().cpu().tolist()
