"""Measuring how a loss is normalised: which weighting of micro-batch losses makes up the loss of their concatenation.

A micro-batch's weight must be what its loss divides by, and models differ: a mean over label tokens (causal LMs
count them after the one-token shift), over rows, over a count the data carries (boxes, masked patches), a mean of
per-sample means (CTC's `"mean"`: a mean over rows), a plain sum (CTC's `"sum"`), or no count at all (a statistic of
the whole batch: BatchNorm, in-batch negatives, a router's load-balancing loss, terms with different counts).

Cut a batch of rows into two parts `a` and `b`: a loss that is a mean over a count `c` satisfies `L(a+b) = (c_a L(a)
+ c_b L(b)) / (c_a + c_b)`, a sum satisfies `L(a+b) = L(a) + L(b)`, and a statistic of the batch satisfies neither.
[`measure_loss_normalisation`] evaluates every candidate rule on such cuts of a window with forward passes only
(under `torch.no_grad`), then, where the caller can take gradients, checks the same identity on the first cut's
gradients, which tell apart rules whose loss values barely differ. It returns the rule that holds, or `"none"`.
Rules that weigh every row seen alike, or hold within the tolerance, cannot be told apart by the data; the preferred
one (the caller's prior) is then kept, and said so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .items import IGNORE_INDEX

SUM = "sum"
ROWS = "rows"
LABEL_TOKENS = "label_tokens"
SHIFTED_LABEL_TOKENS = "shifted_label_tokens"
BOXES = "boxes"
NONE = "none"
# The rules a user may name (`loss_normalisation=`); rules over other keys the data carries are named `count:<key>`.
NAMED_RULES = (LABEL_TOKENS, SHIFTED_LABEL_TOKENS, ROWS, SUM, BOXES)
# Keys that are model inputs, never something a loss divides by.
_INPUT_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "position_ids", "pixel_values", "input_values",
     "input_features", "decoder_input_ids", "decoder_attention_mask", "pixel_mask", "head_mask", "inputs_embeds"}
)  # fmt: skip


def _rows(batch: Mapping[str, Any]) -> int:
    for value in batch.values():
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    for value in batch.values():
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError(f"Cannot count the rows of a batch with keys {sorted(batch)}.")


def _boxes(labels: Any) -> int | None:
    """Objects of a detection batch: `labels` is a list of dicts, one per image, each with `class_labels`/`boxes`."""
    if not isinstance(labels, (list, tuple)) or not labels or not all(isinstance(t, Mapping) for t in labels):
        return None
    total = 0
    for target in labels:
        value = target.get("class_labels", target.get("boxes"))
        if value is None:
            return None
        total += int(len(value))
    return total


def _label_count(value: Any, *, shifted: bool = False) -> int | torch.Tensor | None:
    if not torch.is_tensor(value) or value.is_floating_point() or value.dim() == 0:
        return None
    if value.dtype == torch.bool:
        return value.sum()
    if shifted:
        if value.dim() < 2:
            return None
        value = value[..., 1:]
    return value.ne(IGNORE_INDEX).sum()


def batch_count(rule: str, batch: Mapping[str, Any], *, label_name: str = "labels") -> int | torch.Tensor | None:
    """
    The count that `rule` weights `batch` by, or `None` where the rule does not apply to this batch. A count of
    labels stays a 0-dim tensor beside them (read it with [`~hf_gradaccum.engine.items.read_counts`]).

    Rules: `"rows"`; `"label_tokens"` / `"shifted_label_tokens"` (entries of `labels`, or of the `shift_labels` a
    padding-free collator provides, that are not -100; shifted: `labels[..., 1:]`); `"boxes"` (objects in a detection
    batch's list of target dicts); `"count:<key>"` (entries of another label or mask key that are not -100, or true);
    `"sum"` (1 per micro-batch: the loss is its contribution to the window's sum).

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.loss_normalisation import batch_count
    >>> batch = {"input_ids": torch.zeros(2, 3), "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
    >>> int(batch_count("label_tokens", batch)), int(batch_count("shifted_label_tokens", batch)), batch_count("rows", batch)
    (3, 1, 2)
    ```
    """
    if rule == SUM:
        return 1
    if rule == ROWS:
        return _rows(batch)
    labels = batch.get(label_name)
    if rule == BOXES:
        return _boxes(labels)
    if rule in (LABEL_TOKENS, SHIFTED_LABEL_TOKENS):
        if batch.get("shift_labels") is not None:
            return _label_count(batch["shift_labels"])
        if torch.is_tensor(labels) and labels.is_floating_point():
            return None
        return _label_count(labels, shifted=rule == SHIFTED_LABEL_TOKENS)
    if rule.startswith("count:"):
        key = rule[len("count:") :]
        value = batch.get(key)
        if "mask" in key and torch.is_tensor(value) and not value.is_floating_point():
            return value.ne(0).sum()  # attended (or masked) positions
        return _label_count(value)
    raise ValueError(
        f"Unknown loss normalisation rule {rule!r}: expected one of {list(NAMED_RULES)} or 'count:<key>'."
    )


def candidate_rules(batch: Mapping[str, Any], *, label_name: str = "labels") -> list[str]:
    """The rules that apply to `batch`: every named rule with a count here, and a `count:<key>` for each other
    integer label or boolean mask it carries (a next-sentence label, masked patches)."""
    rules = [
        r
        for r in (LABEL_TOKENS, SHIFTED_LABEL_TOKENS, ROWS, BOXES)
        if batch_count(r, batch, label_name=label_name) is not None
    ]
    for key, value in batch.items():
        if key in (label_name, "shift_labels") or not torch.is_tensor(value):
            continue
        # A loss may average over the attended tokens (a discriminator's per-token loss, ELECTRA's).
        if key in _INPUT_KEYS and key != "attention_mask":
            continue
        if ("label" in key or "mask" in key) and _label_count(value) is not None:
            rules.append(f"count:{key}")
    return [SUM, *rules]


@dataclass
class NormalisationFinding:
    """
    What [`measure_loss_normalisation`] found.

    Attributes:
        rule: the rule training uses: a mean rule (`"label_tokens"`, `"rows"`, ...), `"sum"`, or `"none"` (no
            weighting makes the parts add up: a statistic of the batch, or terms with different counts).
        decided_by: `"values"` (the loss values, and the first cut's gradients where measured, single it out),
            `"prior"` (several rules hold: the preferred one is kept), `"undecided"` (nothing could be measured: the
            prior is kept), `"registry"` (a registered loss of several terms) or `"declared"` (named by the user).
        residuals: rule -> the largest relative difference between a whole's loss and its parts' combination.
        gradient_residuals: rule -> the same for the gradient, on the first cut (the rules the values allow).
        consistent: the rules within `tolerance` on every cut.
        equivalent: the consistent rules that weigh every row seen as the chosen one does.
        cuts: the number of (whole, parts) comparisons made.
        forwards: forward passes spent (no backward).
        tolerance: the relative tolerance on loss values.
        seconds: wall time of the measurement.
        note: why, in words.
    """

    rule: str
    decided_by: str
    residuals: dict[str, float] = field(default_factory=dict)
    consistent: list[str] = field(default_factory=list)
    equivalent: list[str] = field(default_factory=list)
    gradient_residuals: dict[str, float] = field(default_factory=dict)
    cuts: int = 0
    forwards: int = 0
    tolerance: float = 0.0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("residuals", "gradient_residuals"):  # JSON has no inf or NaN
            out[name] = {k: (v if math.isfinite(v) else None) for k, v in getattr(self, name).items()}
        return out

    def summary(self) -> str:
        return f"loss normalisation: {self.rule} (decided by {self.decided_by}; {self.note})"


class CutFailed(RuntimeError):
    """The loss of a cut of a micro-batch could not be computed (its forward raised on some of its rows): its
    normalisation cannot be measured. The original error is the cause."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}")


@dataclass
class _Cut:
    whole: float
    parts: tuple[float, float]
    counts: dict[str, tuple[float, float]]


def _rows_of(batch: Mapping[str, Any], take_rows: Callable, start: int, stop: int) -> dict[str, Any]:
    """Rows `start:stop` of `batch`, per-row lists (a detection batch's targets) cut with them."""
    rows = _rows(batch)
    out = take_rows(batch, start, stop)
    for key, value in batch.items():
        if isinstance(value, (list, tuple)) and len(value) == rows:
            out[key] = list(value[start:stop])
    return out


def window_cuts(
    batches: Sequence[Mapping[str, Any]], take_rows: Callable, concat: Callable
) -> list[tuple[Any, Any, Any]]:
    """(whole, part a, part b) for each micro-batch of two rows or more (its first row against the rest: the most
    uneven cut, where rules that weigh rows differently disagree most); one-row micro-batches are paired."""
    cuts, singles = [], []
    for batch in batches:
        rows = _rows(batch)
        if rows >= 2:
            cuts.append((batch, _rows_of(batch, take_rows, 0, 1), _rows_of(batch, take_rows, 1, rows)))
        elif rows == 1:
            singles.append(batch)
    for a, b in zip(singles[0::2], singles[1::2], strict=False):
        try:
            whole, _ = concat([a, b])
        except (ValueError, TypeError):
            continue  # micro-batches that cannot be concatenated (images of different sizes): not a cut
        cuts.append((whole, a, b))
    return cuts


def _predicted(rule: str, cut: _Cut) -> float | None:
    la, lb = cut.parts
    if rule == SUM:
        return la + lb
    ca, cb = cut.counts[rule]
    if ca + cb <= 0:
        return None
    # A part without items has a 0/0 mean (NaN): it contributes nothing.
    return ((ca * la if ca else 0.0) + (cb * lb if cb else 0.0)) / (ca + cb)


GradientResidual = Callable[[Sequence[tuple[Mapping[str, Any], float]]], float]


def _gradient_residuals(
    gradient_residual: GradientResidual, batches: tuple[Any, Any, Any], cut: _Cut | None, rules: Sequence[str]
) -> dict[str, float]:
    """For each rule, `||grad L(whole) - (w_a grad L(a) + w_b grad L(b))|| / ||grad L(whole)||` on one cut. Without a
    cut (`cut=None`: this rank has none) the same passes run on `batches` with nothing measured, so that every rank
    joins the same collectives."""
    whole, part_a, part_b = batches
    out = {}
    for rule in rules:
        if cut is None:
            gradient_residual([(whole, 1.0), (part_a, -1.0), (part_b, 0.0)])
            out[rule] = 0.0
            continue
        if rule == SUM:
            wa, wb = 1.0, 1.0
        else:
            ca, cb = cut.counts[rule]
            wa, wb = ca / (ca + cb), cb / (ca + cb)
        out[rule] = gradient_residual([(whole, 1.0), (part_a, -wa), (part_b, -wb)])
    return out


def _random_forward(
    loss_of: Callable[[Mapping[str, Any]], float],
    batch: Mapping[str, Any],
    first: float | None,
    tolerance: float,
    reduce_max: Callable[[list[float]], list[float]] | None,
) -> bool:
    """Whether `batch`'s loss computed again differs from `first` beyond `tolerance` (on any rank): randomness the
    probe could not switch off, which no weighting explains and which must never read as a coupled batch."""
    again = float(loss_of(batch))
    if first is None:  # no cut on this rank: it joins the other ranks' verdict
        difference = 0.0
    else:
        difference = abs(again - first) / max(abs(first), 1e-12) if math.isfinite(again) else math.inf
    if reduce_max is not None:
        difference = reduce_max([min(difference, 1e30)])[0]
    return difference > tolerance


def _proportional(a: str, b: str, cuts: Sequence[_Cut]) -> bool:
    """Whether rules `a` and `b` weigh every part of every cut alike (counts proportional): the data cannot tell
    them apart, and either gives the same update on it."""
    if SUM in (a, b):
        return a == b
    pairs = [(x, y) for cut in cuts for x, y in zip(cut.counts[a], cut.counts[b], strict=True)]
    total_a, total_b = sum(x for x, _ in pairs), sum(y for _, y in pairs)
    return all(math.isclose(x * total_b, y * total_a, rel_tol=1e-9, abs_tol=1e-9) for x, y in pairs)


def measure_loss_normalisation(
    loss_of: Callable[[Mapping[str, Any]], float],
    batches: Sequence[Mapping[str, Any]],
    *,
    take_rows: Callable,
    concat: Callable,
    prior: str,
    tolerance: float = 1e-5,
    label_name: str = "labels",
    reduce_max: Callable[[list[float]], list[float]] | None = None,
    gradient_residual: GradientResidual | None = None,
    max_cuts: int = 2,
) -> NormalisationFinding:
    """
    Find how the loss computed by `loss_of(batch)` (a float: the loss of one batch, no gradient needed) is normalised,
    from the micro-batches of one window. Every applicable rule ([`candidate_rules`]) is tried on cuts of the window
    (each micro-batch's first row against its other rows; one-row micro-batches in pairs; at most `max_cuts`): 3
    forwards per cut.

    Args:
        loss_of: the loss of one batch, as training computes it (randomness off).
        batches: the window's micro-batches (dicts of tensors, rows first).
        take_rows: `take_rows(batch, start, stop)`, rows of a batch (`verification.windows.take_rows`).
        concat: `concat(batches) -> (batch, sizes)`, micro-batches as one batch (`verification.windows.concat_window`).
        prior: the rule kept when several rules hold with the same weights on the data (the model's own count).
        tolerance: relative tolerance on loss values (rounding of a forward at another batch shape).
        reduce_max: under several processes, the element-wise maximum over ranks of a list of floats, so every rank
            reaches the same verdict.
        gradient_residual: `gradient_residual([(batch, weight), ...])`: `||sum_i weight_i grad L(batch_i)||` relative
            to the first batch's gradient norm. Where given, the first cut's gradients (a forward and backward of a
            micro-batch and of its two parts, per rule the values allow) must add up under the rule too.

    Example:

    ```python
    >>> import torch
    >>> from hf_gradaccum.engine.loss_normalisation import measure_loss_normalisation
    >>> from hf_gradaccum.verification.windows import concat_window, take_rows
    >>> w = torch.tensor([1.0, 2.0, 3.0])
    >>> def loss_of(batch):  # a sum over rows
    ...     return float((batch["x"] @ w).sum())
    >>> batches = [{"x": torch.randn(3, 3), "labels": torch.tensor([1, 0, 1])} for _ in range(2)]
    >>> measure_loss_normalisation(loss_of, batches, take_rows=take_rows, concat=concat_window, prior="rows").rule
    'sum'
    ```
    """
    start = time.perf_counter()
    candidates = candidate_rules(batches[0], label_name=label_name) if batches else [SUM]
    if prior not in candidates:
        candidates.append(prior)
    cuts: list[_Cut] = []
    forwards = 0
    # Two cuts: the gradients decide what the values leave open, and each cut more costs a micro-batch's forwards.
    cut_batches = window_cuts(batches, take_rows, concat)[:max_cuts]
    for index, (whole, part_a, part_b) in enumerate(cut_batches):
        try:
            values = [float(loss_of(b)) for b in (whole, part_a, part_b)]
        except Exception as first_error:
            # A forward that cannot take one row alone (a norm over a 1x1 map): cut the micro-batch in halves.
            rows = _rows(whole)
            if rows < 4:
                raise CutFailed(first_error) from first_error
            part_a, part_b = _rows_of(whole, take_rows, 0, rows // 2), _rows_of(whole, take_rows, rows // 2, rows)
            cut_batches[index] = (whole, part_a, part_b)
            try:
                values = [float(loss_of(b)) for b in (whole, part_a, part_b)]
            except Exception as error:
                raise CutFailed(error) from error
        forwards += 3
        counts = {}
        for rule in candidates:
            if rule == SUM:
                continue
            got = [batch_count(rule, b, label_name=label_name) for b in (part_a, part_b)]
            counts[rule] = tuple(float(c) if c is not None else math.nan for c in got)
        cuts.append(_Cut(values[0], (values[1], values[2]), counts))
    if reduce_max is not None and batches:
        # Every rank runs as many forwards (sharded engines gather parameters in each, a collective): a rank with
        # fewer cuts runs its first micro-batch instead, and discards the values.
        for _ in range(len(cut_batches), int(reduce_max([float(len(cut_batches))])[0])):
            for _ in range(3):
                loss_of(batches[0])
    residuals: dict[str, float] = {}
    for rule in candidates:
        worst = 0.0
        for cut in cuts:
            if not math.isfinite(cut.whole) or (rule != SUM and any(math.isnan(c) for c in cut.counts[rule])):
                worst = math.inf
                break
            predicted = _predicted(rule, cut)
            if predicted is None or not math.isfinite(predicted):
                worst = math.inf
                break
            worst = max(worst, abs(cut.whole - predicted) / max(abs(cut.whole), 1e-12))
        residuals[rule] = worst if cuts else math.nan
    if reduce_max is not None:
        # The same candidates on every rank (they come from the batch's keys); NaN (no cut here) counts as 0.
        values = reduce_max([0.0 if math.isnan(v) else min(v, 1e30) for v in residuals.values()])
        residuals = dict(zip(residuals, values, strict=True))
        any_cut = reduce_max([1.0 if cuts else 0.0])[0] > 0
    else:
        any_cut = bool(cuts)
    finding = NormalisationFinding(rule=prior, decided_by="undecided", residuals=residuals, cuts=len(cuts),
                                   forwards=forwards, tolerance=tolerance)  # fmt: skip
    if not any_cut:
        finding.note = "no micro-batch could be cut (one row each, and pairs could not be concatenated)"
        finding.seconds = time.perf_counter() - start
        return finding
    consistent = [r for r in candidates if residuals[r] <= tolerance]
    preference = [prior, *[r for r in (ROWS, LABEL_TOKENS, SHIFTED_LABEL_TOKENS, BOXES, SUM) if r != prior]]
    consistent.sort(key=lambda r: preference.index(r) if r in preference else len(preference))
    if consistent and gradient_residual is not None:
        # Loss values can add up while gradients do not (a term whose values barely vary, such as a detection
        # head's class term at initialisation): the first cut's gradients decide, trying the rules the values allow
        # in order of preference until one holds (three forwards and backwards each).
        cut = cut_batches[0] if cut_batches else (batches[0],) * 3
        holding = []
        for rule in consistent:
            found = _gradient_residuals(gradient_residual, cut, cuts[0] if cut_batches else None, [rule])[rule]
            if reduce_max is not None:
                # NaN (out of memory on a rank) is carried as -1: unmeasured, the values decide alone.
                found = reduce_max([-1.0 if math.isnan(found) else min(found, 1e30)])[0]
                found = math.nan if found < 0 else found
            finding.gradient_residuals[rule] = found
            forwards += 3
            if not found > tolerance:
                holding = [rule]
                break
        finding.forwards = forwards
        consistent = holding
    finding.consistent = consistent
    ordered = sorted(consistent, key=lambda r: preference.index(r) if r in preference else len(preference))
    repeat = (cut_batches[0][0], cuts[0].whole) if cut_batches else (batches[0], None)
    if not ordered and _random_forward(loss_of, *repeat, tolerance, reduce_max):
        finding.forwards += 1
        finding.note = "the forward is random (the same batch twice gives different losses): the prior is kept"
    elif not ordered:
        finding.rule, finding.decided_by = NONE, "values"
        best = min(residuals, key=lambda r: residuals[r])
        finding.note = (
            f"no weighting makes the parts add up to the whole (closest: {best}, off by {residuals[best]:.2g} "
            f"relative; tolerance {tolerance:.1g})"
        )
    else:
        # Rules that weigh the rows seen alike form one class; the first class holds the preferred rule.
        classes: list[list[str]] = []
        for rule in ordered:
            for group in classes:
                if _proportional(group[0], rule, cuts):
                    group.append(rule)
                    break
            else:
                classes.append([rule])
        if len(classes) == 1:
            finding.rule, finding.decided_by, finding.equivalent = ordered[0], "values", classes[0]
            if len(classes[0]) > 1:
                finding.decided_by = "prior" if ordered[0] == prior else "values"
                finding.note = f"{', '.join(classes[0])} weigh every row seen alike"
            else:
                finding.note = "the only weighting under which the parts add up to the whole"
        else:
            # Rules that weigh differently all hold within the tolerance (a low precision, per-item losses that barely
            # vary): none is shown wrong, so the preferred one (the trainer's own count first) is kept, and said so.
            finding.rule, finding.decided_by, finding.equivalent = ordered[0], "prior", classes[0]
            finding.note = (
                f"the loss values and gradients hold within {tolerance:.1g} under weightings that differ "
                f"({', '.join(g[0] for g in classes)}); kept {ordered[0]}"
            )
    finding.seconds = time.perf_counter() - start
    return finding
