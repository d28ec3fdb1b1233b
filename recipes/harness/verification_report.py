"""The split-invariance verdict of every arm in the recipes' parity reports.

Each arm's `GradAccumTrainer` runs `verify_accumulation="first_step"` on its own first window (before its first
optimizer step) and writes `arms/<arm>/accumulation_check.json`; this module turns those files into a section of
`parity_report.{json,md}`, so the report shows what the check predicted next to what the arm then did.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_gradaccum.losses.accumulation_check import CHECK_FILE_NAME

from .arms import ArmSpec, arm_dir

logger = logging.getLogger(__name__)


def with_verification(argv: Sequence[str], training_args: Any) -> list[str]:
    """`argv` plus `--verify_accumulation first_step` unless the check was configured (`--verify_accumulation off`
    on the command line skips it). Under an FSDP launch (`ACCELERATE_USE_FSDP`) it appends `--verify_accumulation off`
    instead: the check needs a second, unsharded copy of the parameters, so `GradAccumTrainer` refuses it under FSDP2
    (and the recipes' own default is `first_step`); the report then says no check ran.

    Example:

    ```python
    >>> from harness.verification_report import with_verification
    >>> with_verification(["--max_steps", "2"], None)  # outside an FSDP launch
    ['--max_steps', '2', '--verify_accumulation', 'first_step']
    ```
    """
    argv = list(argv)
    if "--verify_accumulation" in argv:
        return argv
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes"):
        logger.warning(
            "FSDP launch: the arms' split-invariance check (`verify_accumulation`) is skipped, since it cannot run on "
            "sharded parameters. Check the model once on one process with `hf-gradaccum verify`."
        )
        return [*argv, "--verify_accumulation", "off"]
    if getattr(training_args, "verify_accumulation", "off") != "off":
        return argv
    return [*argv, "--verify_accumulation", "first_step"]


def collect_verdicts(output_dir: str | Path, specs: Sequence[ArmSpec]) -> dict[str, dict[str, Any]]:
    """Arm name -> its check's verdict (passed, max relative difference, tolerance, causes, seconds)."""
    verdicts = {}
    for spec in specs:
        path = arm_dir(output_dir, spec.name) / CHECK_FILE_NAME
        if not path.is_file():
            continue
        record = json.loads(path.read_text())
        diagnosis = record.get("diagnosis") or {}
        verdicts[spec.name] = {
            "passed": record["passed"],
            "max_rel_diff": record["max_rel_diff"],
            "tolerance": record["tolerance"],
            "causes": [cause["kind"] for cause in diagnosis.get("causes", [])],
            "modules": [m for cause in diagnosis.get("causes", []) for m in cause.get("modules", [])][:4],
            "seconds": record["seconds"],
        }
    return verdicts


def add_verification_to_report(output_dir: str | Path, specs: Sequence[ArmSpec]) -> dict[str, dict[str, Any]]:
    """
    Add the arms' check verdicts to `parity_report.json` (key `accumulation_check`) and `parity_report.md` (a
    section). Returns the verdicts; nothing is written when no arm ran the check.

    Example:

    ```python
    >>> from harness.verification_report import add_verification_to_report
    >>> add_verification_to_report("outputs/finetune_resnet", specs)  # doctest: +SKIP
    {'accumulated': {'passed': False, 'causes': ['batchnorm'], ...}, ...}
    ```
    """
    output_dir = Path(output_dir)
    verdicts = collect_verdicts(output_dir, specs)
    json_path, md_path = output_dir / "parity_report.json", output_dir / "parity_report.md"
    if not verdicts or not json_path.is_file():
        return verdicts
    report = json.loads(json_path.read_text())
    report["accumulation_check"] = verdicts
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "",
        "## Split-invariance check (before training)",
        "",
        "Each arm checked on its first window that its gradient does not depend on how the window is split "
        '(`verify_accumulation="first_step"`; N micro-batches of b vs 2N of b/2).',
        "",
        "| arm | verdict | max rel. diff | tolerance | cause | check time |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in verdicts.items():
        verdict = "exact" if v["passed"] else "**NOT exact**"
        cause = ", ".join(v["causes"]) + (f" ({', '.join(v['modules'])}, ...)" if v["modules"] else "")
        # None: nothing compared (a BatchNorm window too small to split, judged by inspection).
        diff = "-" if v["max_rel_diff"] is None else f"{v['max_rel_diff']:.2e}"
        lines.append(f"| {name} | {verdict} | {diff} | {v['tolerance']:.0e} | {cause or '-'} | {v['seconds']:.1f} s |")
    with md_path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return verdicts
