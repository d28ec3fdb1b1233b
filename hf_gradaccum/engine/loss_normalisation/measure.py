"""[`measure_loss_normalisation`]: which weighting of micro-batch losses makes up the loss of their concatenation,
measured over a whole window, never guessed.

Cut rows into two parts `a` and `b`: a loss that is a mean over a count `c` satisfies `L(a+b) = (c_a L(a) + c_b L(b)) /
(c_a + c_b)`, a sum satisfies `L(a+b) = L(a) + L(b)`, and a statistic of the batch satisfies neither. Every candidate
count is tried on cuts across the window's micro-batches (`cuts.py`), first on the loss values (forwards only), then,
where the caller can take gradients, on the gradients of the most telling cut. What decides the update is the weight
of each micro-batch, so rules that still hold are grouped by the weights they give the window's micro-batches: one
group is a decision (a tie inside it changes nothing on this window, and is re-weighed on later windows:
`recheck.py`); two groups, or nothing measured while the rules in play disagree, is a stop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..oom_retry import is_out_of_memory, release_cached_memory
from .cuts import CutPlan, build_cut, more_cuts, plan_cuts, select_rows
from .finding import NormalisationFinding
from .rules import (
    BOXES,
    LABEL_TOKENS,
    NONE,
    ROWS,
    SHIFTED_LABEL_TOKENS,
    SUM,
    batch_count,
    batch_rows,
    candidate_rules,
    class_keys,
    class_row_counts,
    class_weighted_rule,
    row_counts,
)
from .weights import ReduceMax, fit_class_weights, measured_ratio, window_classes

GradientResidual = Callable[[Sequence[tuple[Mapping[str, Any], float]]], float]
Counter = Callable[[Mapping[str, Any]], float]
_PREFERENCE = (ROWS, LABEL_TOKENS, SHIFTED_LABEL_TOKENS, BOXES, SUM)


class CutFailed(RuntimeError):
    """The loss of a part of a cut could not be computed, while the loss of its whole micro-batch could: rows of the
    batch refer to one another (indices into the whole batch). The original error is the cause."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}")


class ProbeRaised(RuntimeError):
    """The loss raised on a micro-batch exactly as training hands it: an error of the loss's own code, not of the
    measurement. The original error is the cause, and is kept as `error`."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        super().__init__(f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}")


@dataclass
class _Cut:
    whole: float
    parts: tuple[float, float]
    counts: dict[str, tuple[float, float]]
    batches: tuple[Any, Any, Any]
    rows: str


def _count(rule: str, batch: Mapping[str, Any], label_name: str, counters: Mapping[str, Counter]) -> float | None:
    if rule in counters:
        value = counters[rule](batch)
    else:
        value = batch_count(rule, batch, label_name=label_name)
    return None if value is None else float(value)


def _per_row(rule: str, batch: Mapping[str, Any], label_name: str, counters: Mapping[str, Counter],
             take_rows: Callable) -> list[float] | None:  # fmt: skip
    if rule not in counters:
        return row_counts(rule, batch, label_name=label_name)
    try:
        return [float(counters[rule](take_rows(batch, r, r + 1))) for r in range(batch_rows(batch))]
    except Exception:  # a count of the user's that needs the whole micro-batch: plan without it
        return None


def _predicted(rule: str, cut: _Cut) -> float | None:
    la, lb = cut.parts
    if rule == SUM:
        return la + lb
    ca, cb = cut.counts[rule]
    if math.isnan(ca) or math.isnan(cb) or ca + cb <= 0:
        return None
    # A part without items has a 0/0 mean (NaN): it contributes nothing.
    return ((ca * la if ca else 0.0) + (cb * lb if cb else 0.0)) / (ca + cb)


def _residual(rule: str, cuts: Sequence[_Cut]) -> float:
    worst = 0.0
    for cut in cuts:
        predicted = _predicted(rule, cut)
        if predicted is None or not math.isfinite(predicted) or not math.isfinite(cut.whole):
            return math.inf
        worst = max(worst, abs(cut.whole - predicted) / max(abs(cut.whole), 1e-12))
    return worst


def _share(rule: str, cut: _Cut) -> tuple[float, float]:
    if rule == SUM:
        return 1.0, 1.0
    ca, cb = cut.counts[rule]
    return ca / (ca + cb), cb / (ca + cb)


def _ordered(rules: Sequence[str], prior: str) -> list[str]:
    preference = [prior, *(r for r in _PREFERENCE if r != prior)]
    return sorted(rules, key=lambda r: preference.index(r) if r in preference else len(preference))


class _Probe:
    """The forwards of one measurement: losses of cuts, counted, equalised over ranks."""

    def __init__(self, loss_of: Callable, batches: Sequence[Mapping[str, Any]], take_rows: Callable,
                 concat: Callable, label_name: str, counters: Mapping[str, Counter]) -> None:  # fmt: skip
        self.loss_of, self.batches, self.take_rows, self.concat = loss_of, batches, take_rows, concat
        self.label_name, self.counters = label_name, counters
        self.forwards = 0
        self.checked_whole: set[int] = set()

    def run(self, plan: CutPlan, rules: Sequence[str]) -> _Cut | None:
        """The losses and counts of `plan`'s cut; `None` where its rows cannot be joined into one batch."""
        try:
            batches = build_cut(plan, self.batches, self.take_rows, self.concat)
        except ValueError:
            return None
        try:
            values = [float(self.loss_of(b)) for b in batches]
        except Exception as error:
            if is_out_of_memory(error):
                raise
            self._whole_runs(plan.a[0], error)
            batches = self._halves(plan.a[0], error)
            try:
                values = [float(self.loss_of(b)) for b in batches]
            except Exception as again:
                raise CutFailed(again) from again
        self.forwards += 3
        counts = {}
        for rule in rules:
            if rule == SUM:
                continue
            got = [_count(rule, b, self.label_name, self.counters) for b in batches[1:]]
            counts[rule] = tuple(math.nan if c is None else c for c in got)
        return _Cut(values[0], (values[1], values[2]), counts, tuple(batches), plan.describe())

    def _whole_runs(self, index: int, error: BaseException) -> None:
        """Raise [`ProbeRaised`] where the micro-batch itself, as training hands it, fails too."""
        if index in self.checked_whole:
            return
        self.checked_whole.add(index)
        try:
            self.loss_of(self.batches[index])
        except Exception as own:
            raise ProbeRaised(own) from own
        self.forwards += 1

    def _halves(self, index: int, error: BaseException) -> tuple[Any, Any, Any]:
        """A forward that cannot take one row alone (a norm over a 1x1 map): the micro-batch cut in halves."""
        batch = self.batches[index]
        rows = batch_rows(batch)
        if rows < 4:
            raise CutFailed(error) from error
        half = rows // 2
        part_a = select_rows(batch, range(half), self.take_rows, self.concat)
        part_b = select_rows(batch, range(half, rows), self.take_rows, self.concat)
        return batch, part_a, part_b


def _fallback(finding: NormalisationFinding, reason: str, in_play: Sequence[str], prior: str,
              counts: Mapping[str, Sequence[float]], reduce_max: ReduceMax | None) -> NormalisationFinding:  # fmt: skip
    """Nothing measured: keep the prior only where every rule in play weighs the window's micro-batches alike."""
    in_play = _ordered(in_play, prior)
    groups = window_classes(in_play, counts, reduce_max)
    finding.window_weights = {r: _weights(counts[r]) for r in in_play if r != SUM}
    if len(groups) == 1:
        finding.rule = prior if prior in groups[0] else groups[0][0]
        finding.decided_by, finding.equivalent = "undecided", list(groups[0])
        finding.note = (
            f"{reason}; every rule in play ({', '.join(groups[0])}) gives this window's micro-batches the same "
            f"weights: counting {finding.rule}, re-weighed on every later window"
        )
        return finding
    finding.decided_by = "stopped"
    finding.stop = (
        f"{reason}, and the rules in play weigh this window's micro-batches differently "
        f"({'; '.join(_describe_group(g, counts) for g in groups)}): nothing measured shows which one the loss follows"
    )
    finding.note = finding.stop
    return finding


def _weights(counts: Sequence[float]) -> list[float]:
    total = float(sum(counts))
    return [round(c / total, 6) if total > 0 else math.nan for c in counts]


def _describe_group(group: Sequence[str], counts: Mapping[str, Sequence[float]]) -> str:
    head = group[0]
    if head == SUM:
        return "sum: each micro-batch's loss added as it is"
    shares = ", ".join(f"{w:.3g}" for w in _weights(counts[head]))
    return f"{' = '.join(group)}: micro-batch shares {shares}"


def measure_loss_normalisation(
    loss_of: Callable[[Mapping[str, Any]], float],
    batches: Sequence[Mapping[str, Any]],
    *,
    take_rows: Callable,
    concat: Callable,
    prior: str,
    tolerance: float = 1e-5,
    label_name: str = "labels",
    reduce_max: ReduceMax | None = None,
    gradient_residual: GradientResidual | None = None,
    max_cuts: int | None = None,
    declared: str | None = None,
    counters: Mapping[str, Counter] | None = None,
    sum_in_play: bool = True,
    fit_classes: bool = True,
    registered: str | None = None,
) -> NormalisationFinding:
    """
    Find how the loss computed by `loss_of(batch)` (a float: the loss of one batch) is normalised, from every
    micro-batch of one window. Every applicable rule ([`candidate_rules`], and any `counters`) is tried on cuts
    across the window ([`plan_cuts`]: 3 forwards each, no part bigger than a micro-batch), then on the gradients of
    the most telling cut. The rules that hold are grouped by the weights they give the window's micro-batches; more
    than one group, or nothing measured while the rules in play disagree, sets `finding.stop`.

    Args:
        loss_of: the loss of one batch, as training computes it (randomness off).
        batches: the window's micro-batches (dicts of tensors, rows first).
        take_rows: `take_rows(batch, start, stop)`, rows of a batch (`verification.windows.take_rows`).
        concat: `concat(batches) -> (batch, sizes)`, batches as one (`verification.windows.concat_window`).
        prior: the rule kept where rules tie with the same weights on the window's micro-batches.
        tolerance: relative tolerance on loss values (rounding of a forward at another batch shape).
        reduce_max: under several processes, the element-wise maximum over ranks of a list of floats, so every rank
            reaches the same verdict.
        gradient_residual: `gradient_residual([(batch, weight), ...])`: `||sum_i weight_i grad L(batch_i)||` relative
            to the first batch's gradient norm (NaN: not measured).
        max_cuts: at most this many cuts (default: enough for every micro-batch to take part).
        declared: a rule the user named (or a name in `counters`): checked, and kept where the window agrees.
        counters: further rules, each a function of a batch returning its count (a user's own count).
        sum_in_play: whether "a sum" stays a possibility where nothing could be measured (a user's own loss); a
            model of transformers returns means.
        fit_classes: where no rule holds, try a count weighted per class (one process: the weights are fitted on
            this rank's cuts).
        registered: the rule the model's loss is known to follow: where it holds, it is kept, even where rules that
            weigh the window otherwise hold too (said so).

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
    counters = dict(counters or {})
    candidates = [*candidate_rules(batches, label_name=label_name), *counters] if batches else [SUM]
    for extra in (prior, declared):
        if extra and extra not in candidates and extra not in counters and batches:
            if all(batch_count(extra, b, label_name=label_name) is not None for b in batches):
                candidates.append(extra)
    counts: dict[str, list[float]] = {}
    for rule in list(candidates):
        if rule == SUM:
            continue
        got = [_count(rule, b, label_name, counters) for b in batches]
        if any(c is None for c in got):
            candidates.remove(rule)
        else:
            counts[rule] = [float(c) for c in got]
    finding = NormalisationFinding(rule=prior, decided_by="undecided", tolerance=tolerance)
    in_play = [r for r in candidates if sum_in_play or r != SUM]
    if declared is not None and declared not in candidates:
        finding.decided_by = "stopped"
        finding.stop = f"the declared count {declared!r} does not apply to every micro-batch of the window"
        return _done(finding, start)

    table = {}
    for rule in candidates:
        if rule == SUM:
            continue
        per_batch = [_per_row(rule, b, label_name, counters, take_rows) for b in batches]
        if all(p is not None and len(p) == batch_rows(b) for p, b in zip(per_batch, batches, strict=True)):
            table[rule] = per_batch
    rows = [batch_rows(b) for b in batches]
    probe = _Probe(loss_of, batches, take_rows, concat, label_name, counters)
    plans, cuts = _probe_cuts(probe, table, rows, candidates, max_cuts, reduce_max)
    if reduce_max is not None and batches:
        # Every rank runs as many forwards (sharded engines gather parameters in each, a collective).
        for _ in range(probe.forwards, int(reduce_max([float(probe.forwards)])[0])):
            loss_of(batches[0])
    any_cut = bool(cuts) if reduce_max is None else reduce_max([1.0 if cuts else 0.0])[0] > 0
    finding.cuts, finding.cut_rows = len(cuts), [c.rows for c in cuts]
    finding.ratios = [measured_ratio(c.whole, *c.parts, tolerance) for c in cuts]
    if not any_cut:
        finding.forwards = probe.forwards
        reason = "no micro-batch could be cut (one row each, and pairs could not be joined)"
        return _done(_fallback(finding, reason, in_play, prior, counts, reduce_max), start)

    residuals = {rule: (_residual(rule, cuts) if cuts else 0.0) for rule in candidates}
    if reduce_max is not None:
        values = reduce_max([min(v, 1e30) for v in residuals.values()])
        residuals = dict(zip(residuals, values, strict=True))
    finding.residuals = residuals
    consistent = [r for r in _ordered(candidates, prior) if residuals[r] <= tolerance]
    holding, unmeasured = _gradient_check(consistent, cuts, batches, gradient_residual, reduce_max, tolerance, finding)
    finding.forwards = probe.forwards
    finding.consistent = holding
    if declared is not None:
        return _done(_declared(finding, declared, holding, residuals, counts), start)
    if not holding:
        repeat = (cuts[0].batches[0], cuts[0].whole) if cuts else (batches[0], None)
        random = _random_forward(loss_of, *repeat, tolerance, reduce_max)
        finding.forwards += 1
        if random:
            reason = "the forward is random (the same batch twice gives different losses)"
            return _done(_fallback(finding, reason, in_play, prior, counts, reduce_max), start)
        if fit_classes:
            fitted = _fit_classes(probe, plans, table, rows, cuts, batches, label_name, tolerance, gradient_residual)
            finding.forwards = probe.forwards + 1
            finding.cuts, finding.cut_rows = len(cuts), [c.rows for c in cuts]
            if fitted is not None:
                rule, residual, gradient = fitted
                finding.rule, finding.decided_by, finding.consistent = rule, "fitted", [rule]
                finding.residuals[rule], finding.gradient_residuals[rule] = residual, gradient
                finding.note = "a count weighted per class, solved from the cuts, under which the parts add up"
                return _done(finding, start)
        finding.rule, finding.decided_by = NONE, "values"
        best = min(residuals, key=lambda r: residuals[r])
        finding.note = (
            f"no weighting makes the parts add up to the whole (closest: {best}, off by {residuals[best]:.2g} "
            f"relative; tolerance {tolerance:.1g})"
        )
        return _done(finding, start)

    all_groups = window_classes(holding, counts, reduce_max)
    groups = _separated(all_groups, residuals, finding.gradient_residuals)
    set_aside = [r for g in all_groups if g not in groups for r in g]
    finding.window_weights = {r: _weights(counts[r]) for r in holding if r != SUM}
    if registered in holding:
        group = next(g for g in groups if registered in g)
        finding.rule, finding.decided_by, finding.equivalent = registered, "registry", list(group)
        others = [r for r in holding if r not in group]
        finding.note = "the registered weighting of this loss, which holds on the window's cuts" + (
            f" (so do {', '.join(others)}, which weigh the window otherwise: the losses cannot tell them apart)"
            if others
            else ""
        )
        return _done(finding, start)
    if len(groups) > 1:
        finding.decided_by = "stopped"
        finding.stop = (
            f"the losses{' and gradients' if gradient_residual is not None else ''} hold within {tolerance:.1g} "
            f"under weightings that give this window's micro-batches different weights "
            f"({'; '.join(_describe_group(g, counts) for g in groups)}): choosing one would be a guess"
        )
        finding.note = finding.stop
        return _done(finding, start)
    group = groups[0]
    finding.rule, finding.equivalent = group[0], list(group)
    checked = "losses and gradients" if gradient_residual is not None and not unmeasured else "losses"
    if len(group) == 1:
        finding.decided_by = "values"
        finding.note = (
            f"the only weighting under which the parts add up ({checked}, {len(cuts)} cuts across the window)"
        )
    else:
        finding.decided_by = "tie"
        finding.note = (
            f"tied, resolved by the trainer's own count: {', '.join(group)} give this window's micro-batches the "
            f"same weights ({checked}, {len(cuts)} cuts); re-weighed on every later window"
        )
    if unmeasured:
        finding.note += f"; the gradients of {', '.join(unmeasured)} could not be measured (out of memory)"
    if set_aside:
        finding.note += (
            f"; {', '.join(set_aside)} also hold within the tolerance, at least {_SEPARATION:.0f} times further off"
        )
    return _done(finding, start)


# Rules that hold within the precision's tolerance (bf16's) may still be told apart: one group fitting the cuts this
# many times better than every other is what the data say, not a guess.
_SEPARATION = 100.0


def _separated(groups: list[list[str]], residuals: Mapping[str, float],
               gradients: Mapping[str, float]) -> list[list[str]]:  # fmt: skip
    """`groups`, or only the one whose loss residuals are `_SEPARATION` times below every other group's (and whose
    gradient residuals, where measured, are no worse)."""
    if len(groups) < 2:
        return groups
    worst = [max(residuals[r] for r in g) for g in groups]
    best = min(range(len(groups)), key=lambda i: worst[i])
    others = [min(residuals[r] for r in g) for i, g in enumerate(groups) if i != best]
    if not all(max(worst[best], 1e-12) * _SEPARATION < other for other in others):
        return groups
    measured = {r: v for r, v in gradients.items() if not math.isnan(v)}
    best_gradient = max((measured[r] for r in groups[best] if r in measured), default=None)
    if best_gradient is not None and any(v < best_gradient for r, v in measured.items() if r not in groups[best]):
        return groups
    return [groups[best]]


def _probe_cuts(probe: _Probe, table: Mapping[str, Any], rows: Sequence[int], candidates: Sequence[str],
                max_cuts: int | None, reduce_max: ReduceMax | None) -> tuple[list[CutPlan], list[_Cut]]:  # fmt: skip
    """The planned cuts and their losses; out of memory, the same with cuts of half as many rows, down to two rows
    (every rank retries alike). Out of memory at two rows propagates."""
    cap = max(rows) if rows else 0
    while True:
        plans = plan_cuts(table, rows, most=max_cuts, cap=cap) if rows else []
        out_of_memory = 0.0
        try:
            cuts = [cut for cut in (probe.run(plan, candidates) for plan in plans) if cut is not None]
        except Exception as error:
            if not is_out_of_memory(error) or cap <= 2:
                raise
            release_cached_memory()
            out_of_memory = 1.0
        if reduce_max is not None:
            out_of_memory = reduce_max([out_of_memory])[0]
        if not out_of_memory:
            return plans, cuts
        cap = max(cap // 2, 2)


def _done(finding: NormalisationFinding, start: float) -> NormalisationFinding:
    finding.seconds = time.perf_counter() - start
    return finding


def _gradient_check(consistent: Sequence[str], cuts: Sequence[_Cut], batches: Sequence[Mapping[str, Any]],
                    gradient_residual: GradientResidual | None, reduce_max: ReduceMax | None, tolerance: float,
                    finding: NormalisationFinding) -> tuple[list[str], list[str]]:  # fmt: skip
    """The consistent rules whose gradients also add up on the most telling cut (loss values can add up while
    gradients do not: a term whose values barely vary), and those whose gradients could not be measured."""
    if not consistent or gradient_residual is None:
        return list(consistent), []
    spreads = []
    for cut in cuts:
        shares = [_share(r, cut)[0] for r in consistent if r != SUM]
        spreads.append(max(shares) - min(shares) if shares else 0.0)
    index = max(range(len(cuts)), key=lambda i: spreads[i]) if cuts else -1
    # Rules that weigh the cut's parts alike share one measurement (in one process: under several, every rank
    # runs a pass per rule, so that each joins the same collectives).
    done: dict[tuple[float, float], float] = {}
    holding, unmeasured = [], []
    for rule in consistent:
        if index < 0:
            gradient_residual([(batches[0], 1.0), (batches[0], -1.0), (batches[0], 0.0)])
            found = 0.0
        else:
            cut = cuts[index]
            weights = _share(rule, cut)
            if weights not in done or reduce_max is not None:
                whole, part_a, part_b = cut.batches
                done[weights] = gradient_residual([(whole, 1.0), (part_a, -weights[0]), (part_b, -weights[1])])
            found = done[weights]
        if reduce_max is not None:
            # NaN (out of memory on a rank) is carried as -1: unmeasured.
            found = reduce_max([-1.0 if math.isnan(found) else min(found, 1e30)])[0]
            found = math.nan if found < 0 else found
        finding.gradient_residuals[rule] = found
        if math.isnan(found):
            unmeasured.append(rule)
            holding.append(rule)
        elif found <= tolerance:
            holding.append(rule)
    return holding, unmeasured


def _declared(finding: NormalisationFinding, declared: str, holding: Sequence[str], residuals: Mapping[str, float],
              counts: Mapping[str, Sequence[float]]) -> NormalisationFinding:  # fmt: skip
    finding.window_weights = {declared: _weights(counts[declared])} if declared in counts else {}
    if declared in holding:
        finding.rule, finding.decided_by = declared, "declared"
        finding.note = f"declared, and the window agrees ({finding.cuts} cuts across it)"
        return finding
    gradient = finding.gradient_residuals.get(declared)
    off = f"the losses off by {residuals[declared]:.2g} relative" + (
        f", the gradients by {gradient:.2g}" if gradient is not None else ""
    )
    finding.rule, finding.decided_by = declared, "stopped"
    finding.stop = (
        f"the declared count {declared!r} is contradicted by the window: on cuts across its micro-batches the parts "
        f"do not add up to the whole under it ({off}; tolerance {finding.tolerance:.1g})"
    )
    if holding:
        finding.stop += f"; what does hold: {', '.join(holding)}"
    finding.note = finding.stop
    return finding


def _random_forward(loss_of: Callable, batch: Mapping[str, Any], first: float | None, tolerance: float,
                    reduce_max: ReduceMax | None) -> bool:  # fmt: skip
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


def _fit_classes(probe: _Probe, plans: Sequence[CutPlan], table: Mapping[str, Any], rows: Sequence[int],
                 cuts: list[_Cut], batches: Sequence[Mapping[str, Any]], label_name: str, tolerance: float,
                 gradient_residual: GradientResidual | None) -> tuple[str, float, float] | None:  # fmt: skip
    """A class-weighted count (`class_weighted:<key>=...`) solved from the cuts, checked on all of them and on the
    gradients of one; `None` where none is determined or none holds."""
    for key, classes in class_keys(batches, label_name=label_name).items():
        per_class = {f"class{c}": [[r[c] for r in class_row_counts(key, classes, b)] for b in batches]
                     for c in range(classes)}  # fmt: skip
        # The equations need cuts where the classes' shares differ: plan on the per-class counts.
        extra = more_cuts(per_class, rows, plans, classes + 2 - len(cuts)) if len(cuts) < classes + 2 else []
        for plan in extra:
            cut = probe.run(plan, [])
            if cut is not None:
                cuts.append(cut)
        equations = []
        for cut in cuts:
            _, part_a, part_b = cut.batches
            n_a = [sum(r[c] for r in class_row_counts(key, classes, part_a)) for c in range(classes)]
            n_b = [sum(r[c] for r in class_row_counts(key, classes, part_b)) for c in range(classes)]
            equations.append((n_a, n_b, cut.whole, *cut.parts))
        weights = fit_class_weights(equations, classes, tolerance)
        if weights is None:
            continue
        rule, residual = _best_rounding(key, weights, cuts, label_name, tolerance)
        if residual > tolerance:
            continue
        gradient = 0.0
        if gradient_residual is not None:
            cut = max(cuts, key=lambda c: abs(_share(rule, c)[0] - 0.5))
            wa, wb = _share(rule, cut)
            gradient = gradient_residual([(cut.batches[0], 1.0), (cut.batches[1], -wa), (cut.batches[2], -wb)])
            if gradient > tolerance:
                continue
        return rule, residual, gradient
    return None


def _best_rounding(
    key: str, weights: Sequence[float], cuts: Sequence[_Cut], label_name: str, tolerance: float
) -> tuple[str, float]:
    """The fitted weights, or the nearest fractions of small denominators where the cuts fit those as well: a weight
    solved from rounded losses carries their rounding (0.333343 for the 1/3 that weights 1 : 3 : 0.5 scale to)."""

    def fit(shown: Sequence[float]) -> tuple[str, float]:
        rule = class_weighted_rule(key, shown)
        for cut in cuts:
            cut.counts[rule] = tuple(float(batch_count(rule, b, label_name=label_name)) for b in cut.batches[1:])
        return rule, _residual(rule, cuts)

    full = fit(weights)
    for denominator in (4, 8, 16, 32, 64, 128):
        rounded = fit([float(Fraction(w).limit_denominator(denominator)) for w in weights])
        # As well: within the rounding the losses carry (a tenth of the tolerance), where the free fit absorbs it.
        if rounded[1] <= max(full[1] * 1.5, tolerance / 10):
            return rounded
    return full
