#!/usr/bin/env python
"""The model zoo table: transformers model families with a training head (causal LM, masked LM, pre-training,
seq2seq, sequence / token / image / audio classification, CTC, detection, segmentation, in-model contrastive losses,
MoE router auxiliary losses), each tiny and random-init, trained one step with `GradAccumTrainer` and default
arguments at GA 3 x 4 and with the stock `Trainer` at GA 3 x 4, each against the stock `Trainer` on the one batch of
12 rows (CPU fp32, SGD, no clipping; `tests/model_zoo_cases.py`).

Every family runs in its own process with a time limit, so one crash or hang never stops the table. Writes every row
as JSON and the table as Markdown; a progress line per family.

    python benchmarks/model_zoo.py --json benchmarks/results/model_zoo_before.json --out docs/model_zoo.md

`--counts between` switches the data: every count a loss could divide by (label / attended / masked tokens, target
lengths, boxes, masked frames) the same for every row of a micro-batch and different between micro-batches
(`tests/model_zoo_cases.py`, `COUNTS`); the default is the zoo's original rows.

    python benchmarks/model_zoo.py --counts between --json benchmarks/results/model_zoo_between_before.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.model_zoo_cases import (  # noqa: E402
    BETWEEN_ATTENDED,
    BETWEEN_ITEMS,
    COUNTS,
    MICRO,
    ROWS,
    RTOL,
    STEPS,
    TASKS,
    Family,
    families,
    find_family,
)

VERDICTS = ("exact", "refused", "silent", "crashed")


def run_in_process(family_id: str, timeout: float, counts: str = "default") -> dict[str, Any]:
    """Run one family in a fresh Python process (one CPU thread) with `timeout` seconds, on the rows of the `counts`
    variant; the row it wrote, or a row saying why there is none (a timeout, a crash of the process)."""
    family = find_family(family_id)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, __file__, "--worker", family_id, "--result", str(result), "--counts", counts]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
        start = time.time()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return _row(
                family, status="not run", reason=f"over the {timeout:.0f} s limit", seconds=time.time() - start
            )
        if result.exists():
            return json.loads(result.read_text())
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return _row(family, status="not run", reason=f"the process exited {proc.returncode}: {tail}",
                    seconds=time.time() - start)  # fmt: skip


def _row(family: Family, **fields: Any) -> dict[str, Any]:
    return {"id": family.id, "task": family.task, "model_type": family.model_type,
            "class_name": family.class_name, "variant": family.variant, **fields}  # fmt: skip


def worker(family_id: str, result: str, counts: str = "default") -> None:
    import torch

    torch.set_num_threads(1)
    from tests.model_zoo_cases import run_family

    # The Trainer prints its metrics: the row is the output.
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            row = run_family(find_family(family_id), counts)
        finally:
            sys.stdout = stdout
    Path(result).write_text(json.dumps(row, default=str))


def counts(rows: list[dict[str, Any]], kind: str) -> dict[str, int]:
    """How many run rows `kind` ("ours" or "stock") classifies as each verdict."""
    out = dict.fromkeys(VERDICTS, 0)
    for row in rows:
        if row.get("status") == "run":
            out[row[kind]["verdict"]] += 1
    return out


def _cell(outcome: dict[str, Any]) -> str:
    verdict = outcome["verdict"]
    if verdict in ("exact", "silent"):
        figure = f"{outcome['error']:.1e}"
        return figure if verdict == "exact" else f"**{figure}**"
    return f"{verdict}: {outcome['message'].replace('|', '/')}"


def _name(row: dict[str, Any]) -> str:
    return row["class_name"] + (f" [{row['variant']}]" if row.get("variant") else "")


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the rows, the families that did not run, and the counts."""
    lines = [
        "| family | task | the loss's own normalisation | ours | stock Trainer at GA 3 |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("status") == "run":
            lines.append(f"| {_name(row)} | {row['task']} | {row.get('normalisation', '')} | "
                         f"{_cell(row['ours'])} | {_cell(row['stock'])} |")  # fmt: skip
    skipped = [row for row in rows if row.get("status") != "run"]
    if skipped:
        lines += ["", "Not run:", "", "| family | task | why |", "|---|---|---|"]
        for row in skipped:
            reason = str(row.get("reason", "")).replace("|", "/")
            lines.append(f"| {_name(row)} ({row['model_type']}) | {row['task']} | {row['status']}: {reason} |")
    ours, stock = counts(rows, "ours"), counts(rows, "stock")
    ran = sum(ours.values())
    lines += [
        "",
        f"{ran} families run, {len(skipped)} not run. "
        + "Ours: " + ", ".join(f"{n} {v}" for v, n in ours.items()) + ". "
        + "Stock Trainer at GA 3: " + ", ".join(f"{n} {v}" for v, n in stock.items()) + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


HEADER = f"""The figure is the relative error of the one-step update against the stock `Trainer` on the one batch of {ROWS}
rows, `||d - d_ref|| / ||d_ref||` over all trainable parameters (`exact`: <= {RTOL:g}; in bold: trained, not exact).
Ours: `GradAccumTrainer` with `GradAccumArguments` and default accumulation options, {MICRO} x {STEPS}; stock: the
`Trainer`, {MICRO} x {STEPS}. "refused": an exception defined in `hf_gradaccum`, raised before the first optimizer step
with the weights unchanged (its first line); "crashed": any other exception. CPU fp32, SGD, constant learning rate,
no clipping, no weight decay, sequential order, every dropout-like probability 0, BatchNorm as it is. Cases:
`tests/model_zoo_cases.py`.
"""


BETWEEN_NOTE = f"""Data: `--counts between`. Micro-batch m (rows {MICRO}m to {MICRO}m+{MICRO - 1}, sequential order) has, in every row,
{" / ".join(map(str, BETWEEN_ATTENDED))} attended tokens (token tasks) and {" / ".join(map(str, BETWEEN_ITEMS))} label tokens (causal LM, MoE, token
classification: the last ones of the row), masked tokens (masked LM, pre-training), target tokens (seq2seq, CTC),
boxes (detection) or masked frames (wav2vec2 pre-training); segmentation ignores the top {{1, 2, 3}}/8 of every image.
Sequence / image / audio classification, contrastive and ViT-MAE rows are the default ones (no per-row count).
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=None, help="only family ids (task/model_type[:variant]) matching this")
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    parser.add_argument("--all", action="store_true", help="every entry of the task mappings, not the selection")
    parser.add_argument("--json", default=None, help="write every row here as JSON")
    parser.add_argument("--out", default=None, help="write the Markdown table here (default: print it)")
    parser.add_argument("--title", default="Before", help="the table's section title in --out")
    parser.add_argument("--jobs", type=int, default=1, help="families run at once, each in its own process")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per family")
    parser.add_argument("--counts", choices=COUNTS, default="default",
                        help="the data: 'between' makes every count a loss could divide by the same for every row of "
                        "a micro-batch and different between micro-batches")  # fmt: skip
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.result, args.counts)
        return 0
    tasks = tuple(t for t in args.tasks.split(",") if t)
    selected = [f for f in families(tasks, everything=args.all) if not args.families or re.search(args.families, f.id)]
    start = time.time()

    def one(family: Family) -> dict[str, Any]:
        row = run_in_process(family.id, args.timeout, args.counts)
        ours = _cell(row["ours"]) if row.get("status") == "run" else row.get("status")
        stock = _cell(row["stock"]) if row.get("status") == "run" else row.get("reason", "")
        print(f"[{time.time() - start:6.0f} s] {family.id}: ours {ours} | stock {stock} ({row.get('seconds', 0):.1f} s)",
              flush=True)  # fmt: skip
        return row

    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        rows = list(pool.map(one, selected))
    elapsed = time.time() - start
    command = "python benchmarks/model_zoo.py " + " ".join(sys.argv[1:])
    text = (
        table(rows) + f"\n{len(rows)} families in {elapsed:.0f} s with --jobs {args.jobs}. Made by\n\n    {command}\n"
    )
    if args.counts == "between":
        text = BETWEEN_NOTE + "\n" + text
    if args.json:
        Path(args.json).write_text(json.dumps({"elapsed_s": elapsed, "command": command, "rows": rows}, indent=1))
    if args.out:
        _write_section(Path(args.out), args.title, text)
    print(text)
    ours = counts(rows, "ours")
    return 0 if not ours["silent"] and not ours["crashed"] else 1


def _write_section(path: Path, title: str, text: str) -> None:
    """Write `text` as the section `## title` of `path`, replacing that section where it exists."""
    doc = path.read_text() if path.exists() else "# The model zoo\n\n" + HEADER
    section = f"## {title}\n\n{text}"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    doc = pattern.sub(lambda _: section + "\n", doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + section
    path.write_text(doc)


if __name__ == "__main__":
    sys.exit(main())
