#!/usr/bin/env python
"""The users' losses zoo: `compute_loss` overrides that people write in a `Trainer` subclass (a hand-written mean,
sample and class weights, `num_items_in_batch` with and without its None guard, a gradient penalty, two heads,
distillation, an in-batch contrastive loss, R-drop, masks, ...), each as a mixin trained for one SGD step on the same
12 rows three ways: the stock `Trainer` on one batch of 12 (the reference), the stock `Trainer` at 3 x 4 and
`GradAccumTrainer` (default arguments) at 3 x 4. The cases are in `tests/users_losses_cases.py`.

Every (case, trainer) runs in its own process (one CPU thread) with a time limit, so one crash or hang never stops
the table. Progress lines go to stderr; the Markdown table to stdout (or `--out`), every row as JSON to `--json`.

    python benchmarks/users_losses_zoo.py --json /tmp/users_losses.json --out /tmp/users_losses.md
    python benchmarks/users_losses_zoo.py --cases mean_ce_rows,sum_rows
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.users_losses_cases as cases  # noqa: E402
from benchmarks.mixin_zoo import Zoo, join_note, main, repeat_note, stock_divided_by_steps, stops_and_finding  # noqa: E402
from tests.users_losses_cases import MICRO, ROWS, RTOL, STEPS  # noqa: E402


def _short(values: list[Any]) -> str:
    values = [round(v, 3) if isinstance(v, float) else v for v in values]
    return str(values if len(values) <= 6 else values[:6] + ["..."]).replace(" ", "")


def note(row: dict[str, Any], limit: int) -> str:
    parts = stops_and_finding(row, limit, "users_losses_cases", "the user's compute_loss")
    calls = ((row["ours"].get("run") or {}).get("notes") or {}).get("calls")
    stock_calls = ((row["stock"].get("run") or {}).get("notes") or {}).get("calls")
    if calls is not None and stock_calls is not None and calls != stock_calls:
        parts.append(f"the user's loss ran {calls} times under ours, {stock_calls} under stock")
    for kind in ("stock", "ours"):
        notes = (row[kind].get("run") or {}).get("notes") or {}
        for key in ("ga_steps", "num_items_in_batch"):
            if key in notes:
                parts.append(f"{kind} saw {key}={_short(notes[key])}")
    return join_note(parts + stock_divided_by_steps(row, STEPS) + repeat_note(row))


ABOUT = f"""Each case is a `compute_loss` override in a mixin, trained one SGD step (CPU fp32, lr 0.1, constant schedule, no
clipping, no weight decay, dataset order, dropout 0, the same initial weights and the same {ROWS} rows) with the stock
`Trainer` on one batch of {ROWS} (the reference), the stock `Trainer` at {MICRO} x {STEPS}, and `GradAccumTrainer`
with default accumulation options at {MICRO} x {STEPS}. The figure is `||d - d_ref|| / ||d_ref||` over all
trainable parameters. `exact`: <= {RTOL:g}; `silent`: trained, not exact; `stopped`: an exception before the first
optimizer step with the weights unchanged (within 1e-6 relative: an override's own perturb-and-restore may leave the last bit of some) (its type, first line and where it was raised are in the note, to judge
whether it names the real cause); `crashed`: an exception after the weights moved, or no usable update.
"""

ZOO = Zoo(script=__file__, doc=__doc__, cases=cases, title="The users' losses zoo", about=ABOUT, column="divides_by",
          column_title="the loss divides by", note=note, note_limit=160)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(ZOO))
