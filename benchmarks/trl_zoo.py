#!/usr/bin/env python
"""The TRL zoo table: every trainer TRL 1.16 ships (stable and `trl.experimental`), composed with `GradAccumTrainer`
in both class orders at GA = 3, against the same trainer, stock, at GA = 1 on the whole window (fp32, tiny random-init
models, the same samples and, for generating trainers, the same generations; `tests/trl_zoo_cases.py`).

Columns: the stock trainer at GA = 3 against the one batch (what plain accumulation gives), then for each class order
our update against the one batch and the verdict: exact (<= 1e-5 relative), refused (the `CompositionError`'s first
line), silent (trained, not exact) or crashed.

    python benchmarks/trl_zoo.py --out docs/trl_zoo.md
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.trl_zoo_cases import (  # noqa: E402
    CASES,
    NOT_RUN,
    B,
    K,
    classes,
    relative,
    run_case,
    stock_reference,
    train_once,
)

ORDERS = ("gradaccum_first", "trl_first")


def _cell(result) -> tuple[str, str]:
    if result.verdict == "exact":
        return f"{result.error:.1e}", "exact"
    if result.verdict == "silent":
        return f"{result.error:.1e}", "**silent**"
    return "-", f"{result.verdict}: {result.message.replace('|', '/')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the Markdown table here (default: print it)")
    parser.add_argument("-k", default=None, help="only trainers whose name or variant contains this")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    lines = [
        f"| trainer | variant | stock GA={K} vs one batch | {ORDERS[0]} vs one batch | {ORDERS[0]} | "
        f"{ORDERS[1]} vs one batch | {ORDERS[1]} |",
        "|---|---|---|---|---|---|---|",
    ]
    counts: dict[str, int] = {}
    start = time.time()
    for case in CASES:
        if args.k and args.k not in case.name + case.variant:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            reference = stock_reference(case, f"{tmp}/one_batch")
            try:
                stock = f"{relative(train_once(case, classes(case)['stock'], f'{tmp}/stock', K, B), reference()):.1e}"
            except Exception as e:  # a stock configuration that does not run here is reported, not raised
                stock = f"stock failed: {type(e).__name__}"
            cells = []
            for order in ORDERS:
                result = run_case(case, order, reference, f"{tmp}/{order}")
                counts[result.verdict] = counts.get(result.verdict, 0) + 1
                cells.extend(_cell(result))
        lines.append(f"| {case.name} | {case.variant} | {stock} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    for trainer, why in NOT_RUN.items():
        lines.append(f"| {trainer.rsplit(':', 1)[1]} | - | not run: {why} | | | | |")
    summary = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    text = "\n".join(lines) + f"\n\n{sum(counts.values())} composed runs: {summary} ({time.time() - start:.0f} s).\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if not counts.get("silent") and not counts.get("crashed") else 1


if __name__ == "__main__":
    sys.exit(main())
