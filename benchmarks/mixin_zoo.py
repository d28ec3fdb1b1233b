"""The runner shared by the mixin zoos (`benchmarks/users_losses_zoo.py`, `benchmarks/subclass_zoo.py`): each case is a
mixin trained one SGD step three ways (the stock `Trainer` on one batch: the reference; the stock `Trainer` and
`GradAccumTrainer` with accumulation), every (case, trainer) in its own process (one CPU thread) with a time limit, so
one crash or hang never stops the table. Progress lines go to stderr; the Markdown table to stdout (or `--out`), every
row as JSON to `--json`; `--from-json` renders an earlier `--json` file.

A zoo is a `Zoo`: its cases module (`CASES`, `find_case`, `train_once`, `quietly`, `classify`, `relative`,
`first_line` and the constants `MICRO`, `ROWS`, `RTOL`, `STEPS`, `VERDICTS`; see `tests/users_losses_cases.py`), its
title, header text and the column that says what each case is, and its note; `main(zoo)` is the whole command line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Zoo:
    """One zoo.

    Args:
        script: the zoo's own script (its `__file__`): the command line it was made by, and what each worker runs.
        doc: the script's docstring (the `--help` text).
        cases: the cases module.
        title: the Markdown title.
        about: the header's paragraph under "Made by ..." (what each case is, how it is run and judged).
        column: the case's field shown after its name (in the table and by `--list`).
        column_title: that column's title.
        note: the row's note (`note(row, limit)`), from the parts below (`stops_and_finding`, ...).
        note_limit: how many characters of each stop message the note keeps.
        row_fields: the case's fields saved in its row besides `case`, `column` and `mixin`.
    """

    script: str
    doc: str
    cases: ModuleType
    title: str
    about: str
    column: str
    column_title: str
    note: Callable[[dict[str, Any], int], str]
    note_limit: int = 160
    row_fields: tuple[str, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return Path(self.script).stem

    @property
    def cases_path(self) -> str:
        return Path(self.cases.__file__).resolve().relative_to(ROOT).as_posix()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one (case, trainer) in this process


def worker(zoo: Zoo, name: str, kind: str, folder: str) -> None:
    import torch

    torch.set_num_threads(1)
    quietly, train_once = zoo.cases.quietly, zoo.cases.train_once

    case = zoo.cases.find_case(name)
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


def run_in_process(zoo: Zoo, name: str, kind: str, folder: str, timeout: float) -> dict[str, Any]:
    """Run one (case, trainer) in a fresh Python process; the run it wrote, or a run saying why there is none."""
    cmd = [sys.executable, str(Path(zoo.script).resolve()), "--worker", name, "--kind", kind, "--folder", folder]
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


def run_case(zoo: Zoo, case: Any, timeout: float) -> dict[str, Any]:
    import torch

    cases = zoo.cases
    row: dict[str, Any] = {"case": case.name, zoo.column: getattr(case, zoo.column), "mixin": case.mixin.__name__}
    for key in zoo.row_fields:
        value = getattr(case, key)
        row[key] = list(value) if isinstance(value, tuple) else value
    start = time.time()
    with tempfile.TemporaryDirectory(prefix=f"{zoo.name}_") as folder:
        reference = run_in_process(zoo, case.name, "reference", folder, timeout)
        row["reference"] = reference
        ref_path = Path(folder, "reference.pt")
        if "not_run" in reference or not ref_path.exists():
            why = reference.get("not_run") or _exception_line(zoo, reference.get("exception"))
            row.update(status="reference failed", reason=why, seconds=time.time() - start)
            return row
        ref_update = torch.load(ref_path)
        if not ref_update.norm() > 0:
            row.update(status="reference failed", reason="the one-batch step does not move the weights",
                       seconds=time.time() - start)  # fmt: skip
            return row
        row["status"] = "run"
        for kind in ("stock", "ours"):
            run = run_in_process(zoo, case.name, kind, folder, timeout)
            path = Path(folder, f"{kind}.pt")
            if "not_run" in run:
                outcome = {"verdict": "crashed", "error": None, "message": f"not run: {run['not_run']}", "where": ""}
            else:
                update = torch.load(path) if path.exists() else None
                result = cases.classify(run, update, ref_update)
                outcome = {"verdict": result.verdict, "error": result.error, "message": result.message,
                           "where": result.where}  # fmt: skip
                if update is not None:
                    outcome["error"] = cases.relative(update, ref_update)
                    # SGD, one step, constant rate: the update of the loss divided by the steps is the update / steps.
                    outcome["error_divided_by_steps"] = cases.relative(update / cases.STEPS, ref_update)
            row[kind] = {**outcome, "run": run}
    row["seconds"] = time.time() - start
    return row


def _exception_line(zoo: Zoo, exception: dict[str, Any] | None) -> str:
    if not exception:
        return "no update"
    return f"{exception['type']}: {zoo.cases.first_line(exception['message'])} [{exception.get('where', '')}]"


# ---------------------------------------------------------------------------------------------------------------------
# The table


def verdict_counts(rows: list[dict[str, Any]], kind: str, verdicts: tuple[str, ...]) -> dict[str, int]:
    """How many run rows `kind` ("ours" or "stock") classifies as each of `verdicts`."""
    tally = dict.fromkeys(verdicts, 0)
    for outcome in (row[kind] for row in rows if row.get("status") == "run"):
        tally[outcome["verdict"]] += 1
    return tally


def cell(outcome: dict[str, Any]) -> str:
    verdict = outcome["verdict"]
    if verdict == "exact":
        return f"exact ({outcome['error']:.0e})"
    if verdict == "silent":
        return f"**silent {outcome['error']:.2g}**"
    error = (outcome.get("run") or {}).get("exception") or {}
    return f"{verdict} ({error['type']})" if error.get("type") else verdict


def origin(outcome: dict[str, Any], cases_marker: str, cases_label: str) -> str:
    """Where a stop or crash came from: the package, the user's code (a `where` in the cases module, `cases_marker`,
    says `cases_label`), or the library the frame is in."""
    where = outcome.get("where", "")
    module = ((outcome.get("run") or {}).get("exception") or {}).get("module", "")
    source = "hf_gradaccum" if module.startswith("hf_gradaccum") else (where.split("/")[0] if where else "?")
    if cases_marker in where:
        source = cases_label
    return f"{source}, {where}" if where else source


def _finding(run: dict[str, Any]) -> str:
    check = (run.get("accumulation_check") or {}).get("loss_normalisation") or {}
    if not check:
        return ""
    rule = check.get("rule", "?")
    decided = check.get("decided_by") or check.get("note", "")
    return f"measured `{rule}` ({decided})"


def stops_and_finding(row: dict[str, Any], limit: int, cases_marker: str, cases_label: str) -> list[str]:
    """The note's first parts: each stop or crash (its message head and origin), and ours' measured normalisation."""
    parts = []
    for kind in ("ours", "stock"):
        outcome = row[kind]
        if outcome["verdict"] in ("stopped", "crashed"):
            where = origin(outcome, cases_marker, cases_label)
            parts.append(f"{kind} {outcome['verdict']}: {outcome['message'][:limit]} [{where}]")
    finding = _finding(row["ours"].get("run") or {})
    if finding:
        parts.append(f"ours {finding}")
    return parts


def stock_divided_by_steps(row: dict[str, Any], steps: int) -> list[str]:
    """Only where it explains something: the stock Trainer left the loss undivided by the steps."""
    scaled = row["stock"].get("error_divided_by_steps")
    if row["stock"]["verdict"] == "silent" and scaled is not None and scaled < row["stock"]["error"]:
        why = " (fp32 rounding of the weights: only the missing 1/steps)" if scaled < 1e-4 else ""
        return [f"stock's update / {steps} is {scaled:.1g} off{why}"]
    return []


def repeat_note(row: dict[str, Any]) -> list[str]:
    repeat = row["reference"].get("repeat_error")
    return [f"reference NOT deterministic: rerun differs by {repeat:.1e}"] if repeat else []


def join_note(parts: list[str]) -> str:
    return "; ".join(parts).replace("|", "/").replace("\n", " ")


def table(zoo: Zoo, rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the rows, the cases whose reference failed, and the counts."""
    micro, steps = zoo.cases.MICRO, zoo.cases.STEPS
    lines = [
        f"| case | {zoo.column_title} | ours (GradAccumTrainer, {micro} x {steps}) | stock Trainer, {micro} x {steps} "
        "| note / stop message head |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("status") == "run":
            lines.append(f"| {row['case']} | {row[zoo.column]} | {cell(row['ours'])} | {cell(row['stock'])} | "
                         f"{zoo.note(row, zoo.note_limit)} |")  # fmt: skip
    skipped = [row for row in rows if row.get("status") != "run"]
    if skipped:
        lines += ["", "Not run:", "", "| case | why |", "|---|---|"]
        for row in skipped:
            lines.append(f"| {row['case']} | {row['status']}: {str(row.get('reason', '')).replace('|', '/')} |")
    ours, stock = (verdict_counts(rows, kind, zoo.cases.VERDICTS) for kind in ("ours", "stock"))
    lines += [
        "",
        f"{sum(ours.values())} cases run, {len(skipped)} not run. "
        + "Ours: " + ", ".join(f"{n} {v}" for v, n in ours.items()) + ". "
        + f"Stock Trainer at {micro} x {steps}: " + ", ".join(f"{n} {v}" for v, n in stock.items()) + ".",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def header(zoo: Zoo, command: str, elapsed: float, versions: str) -> str:
    return f"""# {zoo.title}

Made by `{command}` ({elapsed:.0f} s; {versions}). Cases: `{zoo.cases_path}`.

{zoo.about}"""


def _versions() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


# ---------------------------------------------------------------------------------------------------------------------
# The command line


def _arguments(doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--json", default=None, help="write every row as JSON here")
    parser.add_argument("--out", default=None, help="write the Markdown table here (it is always printed)")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per (case, trainer) process")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--from-json", default=None, help="render the table of an earlier --json file, run nothing")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--kind", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    return parser


def _emit(text: str, out: str | None) -> None:
    if out:
        Path(out).write_text(text)
    print(text)


def main(zoo: Zoo) -> int:
    args = _arguments(zoo.doc).parse_args()
    cases = zoo.cases
    if args.worker:
        worker(zoo, args.worker, args.kind, args.folder)
        return 0
    if args.list:
        for case in cases.CASES:
            print(f"{case.name}: {getattr(case, zoo.column)}")
        return 0
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        command = saved["command"].strip()
        _emit(header(zoo, command, saved["elapsed_s"], saved.get("versions", "")) + "\n" + table(zoo, saved["rows"]),
              args.out)  # fmt: skip
        return 0
    selected = [cases.find_case(n) for n in args.cases.split(",") if n] if args.cases else list(cases.CASES)
    start = time.time()
    rows = []
    for i, case in enumerate(selected, 1):
        row = run_case(zoo, case, args.timeout)
        rows.append(row)
        if row.get("status") == "run":
            what = f"ours {cell(row['ours'])} | stock {cell(row['stock'])}"
        else:
            what = f"{row['status']}: {row.get('reason', '')}"
        _log(f"[{time.time() - start:5.0f} s] {i}/{len(selected)} {case.name}: {what} ({row['seconds']:.1f} s)")
    elapsed = time.time() - start
    command = f"python benchmarks/{zoo.name}.py " + " ".join(sys.argv[1:])
    if args.json:
        saved = {"elapsed_s": elapsed, "command": command, "versions": _versions(), "rows": rows}
        Path(args.json).write_text(json.dumps(saved, indent=1, default=str))
    _emit(header(zoo, command.strip(), elapsed, _versions()) + "\n" + table(zoo, rows), args.out)
    return 0
