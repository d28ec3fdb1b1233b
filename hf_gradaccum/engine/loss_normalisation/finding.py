"""[`NormalisationFinding`]: what the measurement of a loss's normalisation found, and why, in words and figures."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class NormalisationFinding:
    """
    What [`measure_loss_normalisation`] found.

    Attributes:
        rule: the rule training uses: a mean rule (`"label_tokens"`, `"rows"`, `"sum:<key>"`, ...), `"sum"`, or
            `"none"` (no weighting makes the parts add up: a statistic of the batch, or terms with different counts).
        decided_by: `"values"` (the losses, and the gradients where measured, leave this rule alone), `"tie"`
            (several rules hold and give the window's micro-batches the same weights: the preferred one is kept and
            the others are re-weighed on every later window), `"fitted"` (a class-weighted count solved from the cuts),
            `"undecided"` (nothing could be measured, and every rule in play weighs the window alike),
            `"registry"` (a registered loss of several terms), `"declared"` (named by the user, and checked
            unless the check was switched off) or `"stopped"` (see `stop`).
        stop: where non-empty, why no weighting can be trusted: the caller stops before the optimizer step.
        residuals: rule -> the largest relative difference between a whole's loss and its parts' combination.
        gradient_residuals: rule -> the same for the gradient, on the most telling cut (the rules the values allow);
            `None` in JSON where it could not be measured (out of memory).
        consistent: the rules within `tolerance` on every cut (values, then gradients).
        equivalent: the rules still tied with the chosen one (the same weights on this window's micro-batches).
        window_weights: rule -> each micro-batch's share of the window under it (this process's micro-batches).
        ratios: per cut, `W_a / W_b` as the losses alone imply it (`None` where ill-conditioned).
        cut_rows: per cut, which rows it joined.
        cuts: the number of (whole, parts) comparisons made.
        forwards: forward passes spent.
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
    window_weights: dict[str, list[float]] = field(default_factory=dict)
    ratios: list[float | None] = field(default_factory=list)
    cut_rows: list[str] = field(default_factory=list)
    cuts: int = 0
    forwards: int = 0
    tolerance: float = 0.0
    seconds: float = 0.0
    note: str = ""
    stop: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for name in ("residuals", "gradient_residuals"):  # JSON has no inf or NaN
            out[name] = {k: (v if math.isfinite(v) else None) for k, v in getattr(self, name).items()}
        out["ratios"] = [v if v is not None and math.isfinite(v) else None for v in self.ratios]
        return out

    def summary(self) -> str:
        return f"loss normalisation: {self.rule} (decided by {self.decided_by}; {self.note})"
