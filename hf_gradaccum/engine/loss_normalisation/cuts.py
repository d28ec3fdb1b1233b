"""Where to cut a window: pairs of parts whose union is a batch the probe can run, chosen where the candidate rules
disagree most on how much each part weighs.

A cut joins one row of a micro-batch with the rows of another (all but one, so that the union holds no more rows than
a micro-batch and the probe fits wherever training fits), or cuts one micro-batch into a row and the rest. Rules that
weigh rows alike within each micro-batch (the same number of label tokens in every row of it) still disagree on a cut
across micro-batches whose rows carry different counts: that is where a choice between them would change the update.
Every micro-batch of the window takes part in at least one cut.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .rules import batch_rows

# Scoring every row of every pair of micro-batches is quadratic in the window: beyond this many micro-batches, each
# is paired with this many others only.
_MOST_PARTNERS = 16


@dataclass
class CutPlan:
    """One cut: the rows of part `a` and of part `b` (micro-batch index, row indices), and how far the candidate
    rules' shares of part `a` spread (0: every rule weighs the parts alike)."""

    a: tuple[int, tuple[int, ...]]
    b: tuple[int, tuple[int, ...]]
    spread: float

    def describe(self) -> str:
        def part(index: int, rows: tuple[int, ...]) -> str:
            if len(rows) == 1:
                shown = f"row {rows[0]}"
            elif rows == tuple(range(rows[0], rows[-1] + 1)):
                shown = f"rows {rows[0]}-{rows[-1]}"
            else:
                shown = "rows " + ",".join(map(str, rows))
            return f"micro-batch {index} {shown}"

        return f"{part(*self.a)} against {part(*self.b)}"

    def micro_batches(self) -> set[int]:
        return {self.a[0], self.b[0]}


def share_spread(table: Mapping[str, Sequence[Sequence[float]]], a: tuple[int, tuple[int, ...]],
                 b: tuple[int, tuple[int, ...]]) -> float:  # fmt: skip
    """How far apart the rules of `table` (rule -> per micro-batch -> per row counts) put part `a`'s share of the
    cut `a + b`: 0 where they all weigh the two parts alike."""
    shares = []
    for per_batch in table.values():
        ca = sum(per_batch[a[0]][r] for r in a[1])
        cb = sum(per_batch[b[0]][r] for r in b[1])
        if ca + cb > 0:
            shares.append(ca / (ca + cb))
    return max(shares) - min(shares) if len(shares) > 1 else 0.0


def _cross_cuts(table: Mapping[str, Sequence[Sequence[float]]], rows: Sequence[int], i: int, j: int,
                cap: int | None = None) -> list[CutPlan]:  # fmt: skip
    """Cuts of one row of micro-batch `i` against micro-batch `j` without its last row (all of it, if it has one row:
    one-row micro-batches are joined whole); with `cap`, no cut holds more than `cap` rows."""
    rest = tuple(range(max(min(rows[j] - 1, (cap or rows[j]) - 1), 1)))
    cuts = []
    for r in range(rows[i]):
        a, b = (i, (r,)), (j, rest)
        cuts.append(CutPlan(a, b, share_spread(table, a, b)))
    return cuts


def _inner_cuts(table: Mapping[str, Sequence[Sequence[float]]], rows: Sequence[int], i: int,
                cap: int | None = None) -> list[CutPlan]:  # fmt: skip
    """Cuts of micro-batch `i` into one of its rows against the others (at most `cap - 1` of them)."""
    out = []
    for r in range(rows[i]):
        others = tuple(x for x in range(rows[i]) if x != r)
        a, b = (i, (r,)), (i, others[: (cap or rows[i]) - 1])
        out.append(CutPlan(a, b, share_spread(table, a, b)))
    return out


def plan_cuts(
    table: Mapping[str, Sequence[Sequence[float]]], rows: Sequence[int], *, most: int | None = None,
    cap: int | None = None,
) -> list[CutPlan]:  # fmt: skip
    """
    The cuts of a window of micro-batches with `rows[i]` rows each, given each candidate rule's per-row counts
    (`table[rule][i][row]`): the most telling cut first, then the best cut of every micro-batch not yet in one, then
    the most telling cut inside a micro-batch (rows against rows, where counts vary inside it). At most `most` cuts
    (beyond the first, fewer micro-batches take part); with `cap`, no cut holds more than `cap` rows (after the probe
    ran out of memory on bigger ones).

    Example:

    ```python
    >>> table = {"rows": [[1, 1], [1, 1]], "label_tokens": [[2, 2], [5, 5]]}
    >>> plan_cuts(table, [2, 2])[0].describe()
    'micro-batch 0 row 0 against micro-batch 1 row 0'
    ```
    """
    n = len(rows)
    options: list[CutPlan] = []
    for i in range(n):
        partners = [j for j in range(n) if j != i][:_MOST_PARTNERS]
        for j in partners:
            options.extend(_cross_cuts(table, rows, i, j, cap))
    inner = [c for i in range(n) if rows[i] >= 2 for c in _inner_cuts(table, rows, i, cap)]
    # Ties keep the window's order (the first micro-batch first), so a run decides the same way every time.
    options.sort(key=lambda c: -c.spread)
    inner.sort(key=lambda c: -c.spread)
    chosen: list[CutPlan] = []
    covered: set[int] = set()
    if options:
        chosen.append(options[0])
        covered |= options[0].micro_batches()
    for i in range(n):
        if i in covered:
            continue
        best = next((c for c in options if i in c.micro_batches()), None)
        if best is None:
            best = next((c for c in inner if c.a[0] == i), None)
        if best is not None:
            chosen.append(best)
            covered |= best.micro_batches()
    if inner and (not chosen or inner[0].spread > 0 or not options):
        chosen.append(inner[0])
    if most is not None:
        chosen = chosen[:most]
    return chosen


def more_cuts(table: Mapping[str, Sequence[Sequence[float]]], rows: Sequence[int], taken: Sequence[CutPlan],
              count: int) -> list[CutPlan]:  # fmt: skip
    """Up to `count` further cuts, not in `taken`, each with a micro-batch pair or row not used yet where possible
    (more equations where a count has free parameters: a class-weighted one)."""
    seen = {(c.a, c.b) for c in taken}
    n = len(rows)
    options = [c for i in range(n) for j in range(n) if i != j for c in _cross_cuts(table, rows, i, j)]
    options += [c for i in range(n) if rows[i] >= 2 for c in _inner_cuts(table, rows, i)]
    out = []
    for cut in options:
        if (cut.a, cut.b) not in seen:
            seen.add((cut.a, cut.b))
            out.append(cut)
        if len(out) >= count:
            break
    return out


def build_cut(plan: CutPlan, batches: Sequence[Mapping[str, Any]], take_rows: Callable,
              concat: Callable) -> tuple[Any, Any, Any]:  # fmt: skip
    """(whole, part a, part b) of `plan` as batches; `ValueError` where its rows cannot be joined."""
    part_a = select_rows(batches[plan.a[0]], plan.a[1], take_rows, concat)
    part_b = select_rows(batches[plan.b[0]], plan.b[1], take_rows, concat)
    try:
        whole, _ = concat([part_a, part_b])
    except TypeError as error:
        raise ValueError(str(error)) from error
    return whole, part_a, part_b


def select_rows(
    batch: Mapping[str, Any], rows: Sequence[int], take_rows: Callable, concat: Callable
) -> dict[str, Any]:
    """The rows `rows` of `batch` (consecutive runs taken as slices), per-row lists cut with them."""
    total = batch_rows(batch)
    if list(rows) == list(range(total)):
        return dict(batch)  # all of it, as it is (a padding-free row keeps the kwargs that describe it)
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    parts = [_rows_of(batch, take_rows, start, stop, total) for start, stop in runs]
    if len(parts) == 1:
        return parts[0]
    joined, _ = concat(parts)
    return joined


def _rows_of(batch: Mapping[str, Any], take_rows: Callable, start: int, stop: int, total: int) -> dict[str, Any]:
    out = take_rows(batch, start, stop)
    for key, value in batch.items():
        if isinstance(value, (list, tuple)) and len(value) == total:
            out[key] = list(value[start:stop])
    return out
