"""[`LaterWindowCheck`]: the rules that tied on the first window, re-weighed on every later one.

Rules tie when the first window cannot tell them apart: they give its micro-batches the same weights (every sample
weight still 1, the same number of label tokens in every micro-batch). A later window may not: its counts alone say so,
at no forward's cost. Where they diverge, one cut across the two micro-batches whose counts differ most decides, before
that window's optimizer step: a rule the data contradicts leaves the tie; the rule training uses being contradicted,
or rules that weigh the window differently both holding, stops training.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .cuts import build_cut, plan_cuts
from .finding import NormalisationFinding
from .rules import SUM, batch_count, batch_rows, row_counts
from .weights import ReduceMax, same_window_weights


class LaterWindowCheck:
    """
    The first window's tie, kept and re-weighed on every later window (`check`).

    Args:
        finding ([`NormalisationFinding`]): the first window's; its `equivalent` rules other than `rule` are the tie.
        label_name (`str`): the labels' key.

    Example:

    ```python
    >>> check = LaterWindowCheck(finding)  # doctest: +SKIP
    >>> reason = check.check(batches, "window 7", loss_of, take_rows=take_rows, concat=concat_window)  # doctest: +SKIP
    ```
    """

    def __init__(self, finding: NormalisationFinding, *, label_name: str = "labels") -> None:
        self.rule = finding.rule
        self.tied = [r for r in finding.equivalent if r not in (finding.rule, SUM)]
        self.tolerance = finding.tolerance
        self.label_name = label_name
        self.windows_checked = 0
        self.cuts = 0

    @property
    def active(self) -> bool:
        """Whether a tie is left to re-weigh."""
        return bool(self.tied)

    def check(self, batches: Sequence[Mapping[str, Any]], window: str, loss_of: Callable[[Mapping[str, Any]], float],
              *, take_rows: Callable, concat: Callable, reduce_max: ReduceMax | None = None) -> str:  # fmt: skip
        """Re-weigh the tie on `batches` (the window named `window` in messages); an empty string, or why training
        must stop before this window's optimizer step."""
        if not self.tied or not batches:
            return ""
        self.windows_checked += 1
        counts: dict[str, list[float]] = {}
        for rule in (self.rule, *self.tied):
            got = [batch_count(rule, b, label_name=self.label_name) for b in batches]
            if any(c is None for c in got):
                if rule == self.rule:
                    return f"{window}: the count training uses ({rule}) does not apply to its micro-batches"
                self.tied.remove(rule)
                continue
            counts[rule] = [float(c) for c in got]
        diverging = [r for r in self.tied if not same_window_weights(counts[self.rule], counts[r], reduce_max)]
        if not diverging:
            return ""
        rules = [self.rule, *diverging]
        table = {r: [row_counts(r, b, label_name=self.label_name) for b in batches] for r in rules}
        table = {r: t for r, t in table.items() if all(x is not None for x in t)}
        rows = [batch_rows(b) for b in batches]
        plans = plan_cuts(table, rows, most=1)
        residuals = dict.fromkeys(rules, 0.0)
        described = "no cut"
        for plan in plans:
            try:
                whole, part_a, part_b = build_cut(plan, batches, take_rows, concat)
            except ValueError:
                continue
            values = [float(loss_of(b)) for b in (whole, part_a, part_b)]
            self.cuts += 1
            described = plan.describe()
            for rule in rules:
                ca, cb = (float(batch_count(rule, b, label_name=self.label_name)) for b in (part_a, part_b))
                predicted = (ca * values[1] + cb * values[2]) / (ca + cb) if ca + cb > 0 else math.nan
                off = abs(values[0] - predicted) / max(abs(values[0]), 1e-12)
                residuals[rule] = off if math.isfinite(off) else math.inf
            break
        if reduce_max is not None:
            residuals = dict(zip(residuals, reduce_max([min(v, 1e30) for v in residuals.values()]), strict=True))
        if residuals[self.rule] > self.tolerance:
            return (
                f"{window}: the count training uses ({self.rule}) tied on the first window with "
                f"{', '.join(diverging)}, which weigh this window's micro-batches differently; a cut of {described} "
                f"contradicts {self.rule} (off by {residuals[self.rule]:.2g} relative; tolerance {self.tolerance:.1g})"
                + (
                    f" and agrees with {', '.join(r for r in diverging if residuals[r] <= self.tolerance)}"
                    if any(residuals[r] <= self.tolerance for r in diverging)
                    else ""
                )
            )
        holding = [r for r in diverging if residuals[r] <= self.tolerance]
        for rule in diverging:
            if rule not in holding:
                self.tied.remove(rule)
        if holding:
            return (
                f"{window}: {self.rule} and {', '.join(holding)} both hold on a cut of {described}, and weigh this "
                "window's micro-batches differently: choosing one would be a guess"
            )
        return ""
