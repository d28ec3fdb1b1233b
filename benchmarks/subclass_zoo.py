#!/usr/bin/env python
"""The subclass zoo: `Trainer` subclasses that override `training_step` and friends as people write them in existing
Hugging Face training code (a `super()` call that logs, the stock body copied verbatim, the older hand-divided shape,
FGM, SAM, `clip_grad_value_` after `super()`, gradient masks and logging, layer-wise LR decay, a seeded weighted
sampler, an own loader, callbacks that read or clip gradients, ...), each as a mixin trained for one SGD step on the
same 12 rows three ways: the stock `Trainer` on one batch of 12 (the reference), the stock `Trainer` at 3 x 4 and
`GradAccumTrainer` (default arguments) at 3 x 4. The cases are in `tests/subclass_cases.py`; the runner is
`benchmarks/mixin_zoo.py`, as for `benchmarks/users_losses_zoo.py` (a process per (case, trainer), one CPU thread, a
time limit; progress on stderr, the Markdown table on stdout or `--out`, every row as JSON to `--json`).

    python benchmarks/subclass_zoo.py --json /tmp/subclass_zoo.json --out /tmp/subclass_zoo.md
    python benchmarks/subclass_zoo.py --cases stock_body_copy,clip_grad_value_after_super
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tests.subclass_cases as cases  # noqa: E402
from benchmarks.mixin_zoo import Zoo, join_note, main, repeat_note, stock_divided_by_steps, stops_and_finding  # noqa: E402
from tests.subclass_cases import MICRO, ROWS, RTOL, STEPS  # noqa: E402


def _short(values: Any) -> str:
    if not isinstance(values, list):
        return str(values)
    values = [round(v, 4) if isinstance(v, float) else v for v in values]
    return str(values if len(values) <= 8 else values[:8] + ["..."]).replace(" ", "")


def _order_note(row: dict[str, Any]) -> list[str]:
    """Where a run's loader fetched other rows, or in another order, than the reference's."""
    reference = row["reference"].get("fetched") or []
    parts = []
    for kind in ("stock", "ours"):
        run = row[kind].get("run") or {}
        fetched = run.get("fetched")
        if fetched is None:
            continue
        if fetched[:ROWS] != reference[:ROWS]:
            parts.append(f"{kind} fetched rows {_short(fetched[:ROWS])}, the reference {_short(reference[:ROWS])}")
        elif run.get("fetched_count", ROWS) != row["reference"].get("fetched_count", ROWS):
            parts.append(f"{kind} fetched {run['fetched_count']} rows, the reference "
                         f"{row['reference'].get('fetched_count')}")  # fmt: skip
    return parts


def note(row: dict[str, Any], limit: int) -> str:
    parts = stops_and_finding(row, limit, "subclass_cases", "the user's override")
    for key in row.get("show") or []:
        seen = []
        for kind in ("reference", "stock", "ours"):
            run = row[kind] if kind == "reference" else (row[kind].get("run") or {})
            notes = run.get("notes") or {}
            if key in notes:
                seen.append(f"{kind} {_short(notes[key])}")
        if seen:
            parts.append(f"{key}: " + ", ".join(seen))
    if (row["ours"].get("run") or {}).get("accumulator_ran") is False:
        parts.append("ours' accumulator never ran (the override bypasses `GradAccumTrainer.training_step`)")
    parts += _order_note(row) + stock_divided_by_steps(row, STEPS)
    scaled = row["ours"].get("error_divided_by_steps")
    if row["ours"]["verdict"] == "silent" and scaled is not None and scaled < 1e-4:
        parts.append(f"ours' update / {STEPS} is {scaled:.1g} off (only the missing 1/steps)")
    return join_note(parts + repeat_note(row))


ABOUT = f"""Each case is one mixin (overriding `training_step`, `create_optimizer`, `_get_train_sampler`, `get_train_dataloader`,
`compute_loss`, or adding a callback) on a tiny BERT sequence classifier, trained one SGD step (CPU fp32, lr 0.1,
constant schedule, no clipping unless the case is about it, no weight decay, dataset order unless the case samples,
dropout 0, the same initial weights and the same {ROWS} rows) with the stock `Trainer` on one batch of {ROWS} (the
reference), the stock `Trainer` at {MICRO} x {STEPS}, and `GradAccumTrainer` with default accumulation options at
{MICRO} x {STEPS}. The figure is `||d - d_ref|| / ||d_ref||` over all trainable parameters. `exact`: <= {RTOL:g};
`silent`: trained, not exact; `stopped`: an exception before the first optimizer step with the weights unchanged (within 1e-6 relative: an override's own perturb-and-restore may leave the last bit of some) (its
type, first line and where it was raised are in the note); `crashed`: an exception after the weights moved, or no
usable update. The note also shows what the override recorded (per micro-step), and any run whose loader fetched
other rows than the reference's.
"""

ZOO = Zoo(script=__file__, doc=__doc__, cases=cases, title="The subclass zoo", about=ABOUT, column="large_batch",
          column_title="what the large batch (the reference) means", note=note, note_limit=200,
          row_fields=("show",))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(ZOO))
