"""Measuring how a loss is normalised: which weighting of micro-batch losses makes up the loss of their concatenation.

May import: the rest of `engine/` only.

A micro-batch's weight must be what its loss divides by, and losses differ: a mean over label tokens (causal LMs count
them after the one-token shift), over rows, over a count the data carries (boxes, masked patches, a sample weight, a
float mask), a class-weighted count, a mean of per-sample means (CTC's `"mean"`: a mean over rows), a plain sum, or no
count at all (a statistic of the whole batch: BatchNorm, in-batch negatives, terms with different counts).

- `rules.py`: the counts, by name (`batch_count`, `row_counts`, `candidate_rules`);
- `cuts.py`: cuts across the window's micro-batches, where the rules disagree most (`plan_cuts`);
- `weights.py`: what a cut's losses say about its parts' weights; which rules weigh a window alike;
- `finding.py`: `NormalisationFinding`, what was found and why;
- `measure.py`: `measure_loss_normalisation`, the first window's measurement;
- `recheck.py`: `LaterWindowCheck`, the first window's tie re-weighed on every later window.
"""

from .cuts import CutPlan, plan_cuts
from .finding import NormalisationFinding
from .measure import CutFailed, ProbeRaised, measure_loss_normalisation
from .recheck import LaterWindowCheck
from .rules import (
    BOXES,
    CLASS_WEIGHTED,
    LABEL_TOKENS,
    NAMED_RULES,
    NONE,
    ROWS,
    SHIFTED_LABEL_TOKENS,
    SUM,
    batch_count,
    batch_rows,
    candidate_rules,
    class_weighted_rule,
    row_counts,
)
from .weights import fit_class_weights, measured_ratio, same_window_weights, window_classes

__all__ = [
    "BOXES", "CLASS_WEIGHTED", "LABEL_TOKENS", "NAMED_RULES", "NONE", "ROWS", "SHIFTED_LABEL_TOKENS", "SUM",
    "CutFailed", "CutPlan", "LaterWindowCheck", "NormalisationFinding", "ProbeRaised", "batch_count", "batch_rows",
    "candidate_rules", "class_weighted_rule", "fit_class_weights", "measure_loss_normalisation", "measured_ratio",
    "plan_cuts", "row_counts", "same_window_weights", "window_classes",
]  # fmt: skip
