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

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.users_losses_cases import (  # noqa: E402
    CASES,
    MICRO,
    ROWS,
    RTOL,
    STEPS,
    VERDICTS,
    Case,
    classify,
    find_case,
    first_line,
    relative,
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one (case, trainer) in this process


def worker(name: str, kind: str, folder: str) -> None:
    import torch

    torch.set_num_threads(1)
    from tests.users_losses_cases import quietly, train_once

    case = find_case(name)
    # The Trainer prints its metrics: the row is the output.
    with open(os.devnull, "w") as devnull:
        stdout, sys.stdout = sys.stdout, devnull
        try:
            run = quietly(lambda: train_once(case, kind, os.path.join(folder, kind)))
            if kind == "reference" and "update" in run:  # the reference again: is it deterministic?
                again = quietly(lambda: train_once(case, kind, os.path.join(folder, "reference_again")))
                if "update" in again:
                    run["repeat_error"] = float((again["update"] - run["update"]).norm() / run["update"].norm())
                else:
                    run["repeat_error"] = None
                    run["repeat_exception"] = again.get("exception")
        finally:
            sys.stdout = stdout
    update = run.pop("update", None)
    if update is not None:
        torch.save(update, os.path.join(folder, f"{kind}.pt"))
        run["update_norm"] = float(update.norm())
    Path(folder, f"{kind}.json").write_text(json.dumps(run, default=str))


def run_in_process(name: str, kind: str, folder: str, timeout: float) -> dict[str, Any]:
    """Run one (case, trainer) in a fresh Python process; the run it wrote, or a run saying why there is none."""
    cmd = [sys.executable, __file__, "--worker", name, "--kind", kind, "--folder", folder]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "not_run": f"over the {timeout:.0f} s limit", "seconds": time.time() - start}
    result = Path(folder, f"{kind}.json")
    if not result.exists():
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"kind": kind, "not_run": f"the process exited {proc.returncode}: {tail}",
                "seconds": time.time() - start}  # fmt: skip
    run = json.loads(result.read_text())
    run["seconds"] = time.time() - start
    return run


# ---------------------------------------------------------------------------------------------------------------------
# One case: three processes, classified


def run_case(case: Case, timeout: float) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"case": case.name, "divides_by": case.divides_by, "mixin": case.mixin.__name__}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="users_losses_") as folder:
        reference = run_in_process(case.name, "reference", folder, timeout)
        row["reference"] = reference
        ref_path = Path(folder, "reference.pt")
        if "not_run" in reference or not ref_path.exists():
            why = reference.get("not_run") or _exception_line(reference.get("exception"))
            row.update(status="reference failed", reason=why, seconds=time.time() - start)
            return row
        ref_update = torch.load(ref_path)
        if not ref_update.norm() > 0:
            row.update(status="reference failed", reason="the one-batch step does not move the weights",
                       seconds=time.time() - start)  # fmt: skip
            return row
        row["status"] = "run"
        for kind in ("stock", "ours"):
            run = run_in_process(case.name, kind, folder, timeout)
            path = Path(folder, f"{kind}.pt")
            if "not_run" in run:
                outcome = {"verdict": "crashed", "error": None, "message": f"not run: {run['not_run']}", "where": ""}
            else:
                update = torch.load(path) if path.exists() else None
                result = classify(run, update, ref_update)
                outcome = {"verdict": result.verdict, "error": result.error, "message": result.message,
                           "where": result.where}  # fmt: skip
                if update is not None:
                    outcome["error"] = relative(update, ref_update)
                    # SGD, one step, constant rate: the update of the loss divided by the steps is the update / steps.
                    outcome["error_divided_by_steps"] = relative(update / STEPS, ref_update)
            row[kind] = {**outcome, "run": run}
    row["seconds"] = time.time() - start
    return row


def _exception_line(exception: dict[str, Any] | None) -> str:
    if not exception:
        return "no update"
    return f"{exception['type']}: {first_line(exception['message'])} [{exception.get('where', '')}]"


# ---------------------------------------------------------------------------------------------------------------------
# The table


def counts(rows: list[dict[str, Any]], kind: str) -> dict[str, int]:
    """How many run rows `kind` ("ours" or "stock") classifies as each verdict."""
    out = dict.fromkeys(VERDICTS, 0)
    for row in rows:
        if row.get("status") == "run":
            out[row[kind]["verdict"]] += 1
    return out


def _cell(outcome: dict[str, Any]) -> str:
    verdict = outcome["verdict"]
    if verdict == "exact":
        return f"exact ({outcome['error']:.0e})"
    if verdict == "silent":
        return f"**silent {outcome['error']:.2g}**"
    error = (outcome.get("run") or {}).get("exception") or {}
    return f"{verdict} ({error['type']})" if error.get("type") else verdict


def _origin(outcome: dict[str, Any]) -> str:
    where = outcome.get("where", "")
    module = ((outcome.get("run") or {}).get("exception") or {}).get("module", "")
    source = "hf_gradaccum" if module.startswith("hf_gradaccum") else (where.split("/")[0] if where else "?")
    if "users_losses_cases" in where:
        source = "the user's compute_loss"
    return f"{source}, {where}" if where else source


def _finding(run: dict[str, Any]) -> str:
    check = (run.get("accumulation_check") or {}).get("loss_normalisation") or {}
    if not check:
        return ""
    rule = check.get("rule", "?")
    decided = check.get("decided_by") or check.get("note", "")
    return f"measured `{rule}` ({decided})"


def _note(row: dict[str, Any], limit: int) -> str:
    parts = []
    for kind, label in (("ours", "ours"), ("stock", "stock")):
        outcome = row[kind]
        if outcome["verdict"] in ("stopped", "crashed"):
            parts.append(f"{label} {outcome['verdict']}: {outcome['message'][:limit]} [{_origin(outcome)}]")
    finding = _finding(row["ours"].get("run") or {})
    if finding:
        parts.append(f"ours {finding}")
    calls = ((row["ours"].get("run") or {}).get("notes") or {}).get("calls")
    stock_calls = ((row["stock"].get("run") or {}).get("notes") or {}).get("calls")
    if calls is not None and stock_calls is not None and calls != stock_calls:
        parts.append(f"the user's loss ran {calls} times under ours, {stock_calls} under stock")
    for kind in ("stock", "ours"):
        notes = (row[kind].get("run") or {}).get("notes") or {}
        for key in ("ga_steps", "num_items_in_batch"):
            if key in notes:
                parts.append(f"{kind} saw {key}={_short(notes[key])}")
    scaled = row["stock"].get("error_divided_by_steps")
    # Only where it explains something: the stock Trainer left the user's loss undivided by the steps.
    if row["stock"]["verdict"] == "silent" and scaled is not None and scaled < row["stock"]["error"]:
        why = " (fp32 rounding of the weights: only the missing 1/steps)" if scaled < 1e-4 else ""
        parts.append(f"stock's update / {STEPS} is {scaled:.1g} off{why}")
    repeat = row["reference"].get("repeat_error")
    if repeat:
        parts.append(f"reference NOT deterministic: rerun differs by {repeat:.1e}")
    return "; ".join(parts).replace("|", "/").replace("\n", " ")


def _short(values: list[Any]) -> str:
    values = [round(v, 3) if isinstance(v, float) else v for v in values]
    return str(values if len(values) <= 6 else values[:6] + ["..."]).replace(" ", "")


def table(rows: list[dict[str, Any]], limit: int = 160) -> str:
    """The Markdown table of the rows, the cases whose reference failed, and the counts."""
    lines = [
        f"| case | the loss divides by | ours (GradAccumTrainer, {MICRO} x {STEPS}) | stock Trainer, {MICRO} x {STEPS} "
        "| note / stop message head |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("status") == "run":
            lines.append(f"| {row['case']} | {row['divides_by']} | {_cell(row['ours'])} | {_cell(row['stock'])} | "
                         f"{_note(row, limit)} |")  # fmt: skip
    skipped = [row for row in rows if row.get("status") != "run"]
    if skipped:
        lines += ["", "Not run:", "", "| case | why |", "|---|---|"]
        for row in skipped:
            lines.append(f"| {row['case']} | {row['status']}: {str(row.get('reason', '')).replace('|', '/')} |")
    ours, stock = counts(rows, "ours"), counts(rows, "stock")
    lines += [
        "",
        f"{sum(ours.values())} cases run, {len(skipped)} not run. "
        + "Ours: " + ", ".join(f"{n} {v}" for v, n in ours.items()) + ". "
        + f"Stock Trainer at {MICRO} x {STEPS}: " + ", ".join(f"{n} {v}" for v, n in stock.items()) + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def header(command: str, elapsed: float, versions: str) -> str:
    return f"""# The users' losses zoo

Made by `{command}` ({elapsed:.0f} s; {versions}). Cases: `tests/users_losses_cases.py`.

Each case is a `compute_loss` override in a mixin, trained one SGD step (CPU fp32, lr 0.1, constant schedule, no
clipping, no weight decay, dataset order, dropout 0, the same initial weights and the same {ROWS} rows) with the stock
`Trainer` on one batch of {ROWS} (the reference), the stock `Trainer` at {MICRO} x {STEPS}, and `GradAccumTrainer`
with default accumulation options at {MICRO} x {STEPS}. The figure is `||d - d_ref|| / ||d_ref||` over all
trainable parameters. `exact`: <= {RTOL:g}; `silent`: trained, not exact; `stopped`: an exception before the first
optimizer step with the weights unchanged (its type, first line and where it was raised are in the note, to judge
whether it names the real cause); `crashed`: an exception after the weights moved, or no usable update.
"""


def _versions() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    parser.add_argument("--out", default=None, help="write the Markdown table here (it is always printed)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per (case, trainer) process")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--from-json", default=None, help="render the table of an earlier --json file, run nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.kind, args.folder)
        return 0
    if args.list:
        for case in CASES:
            print(f"{case.name}: {case.divides_by}")
        return 0
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        text = (
            header(saved["command"].strip(), saved["elapsed_s"], saved.get("versions", ""))
            + "\n"
            + table(saved["rows"])
        )
        if args.out:
            Path(args.out).write_text(text)
        print(text)
        return 0
    selected = [find_case(n) for n in args.cases.split(",") if n] if args.cases else list(CASES)
    start = time.time()
    rows = []
    for i, case in enumerate(selected, 1):
        row = run_case(case, args.timeout)
        rows.append(row)
        if row.get("status") == "run":
            what = f"ours {_cell(row['ours'])} | stock {_cell(row['stock'])}"
        else:
            what = f"{row['status']}: {row.get('reason', '')}"
        _log(f"[{time.time() - start:5.0f} s] {i}/{len(selected)} {case.name}: {what} ({row['seconds']:.1f} s)")
    elapsed = time.time() - start
    command = "python benchmarks/users_losses_zoo.py " + " ".join(sys.argv[1:])
    text = header(command.strip(), elapsed, _versions()) + "\n" + table(rows)
    if args.json:
        saved = {"elapsed_s": elapsed, "command": command, "versions": _versions(), "rows": rows}
        Path(args.json).write_text(json.dumps(saved, indent=1, default=str))
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
