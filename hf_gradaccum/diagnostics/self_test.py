"""`hf-gradaccum test`: is accumulation exact on this device, in each precision it supports? One line per check, with
the figure and its tolerance; exit status 0 only when every check that could run passed.

The default set (a causal LM and a classifier in every supported precision, an fp16 overflow, the out-of-memory
retry under a real memory cap) takes seconds on a CPU; `--full` adds DDP and FSDP2 on 2 local processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence

import torch

from .checks import CheckResult, check_fp16_overflow, check_parity
from .precision import PRECISIONS, supported_precisions
from .tiny_models import MODELS


def planned_checks(
    device: torch.device, precisions: Sequence[str], full: bool
) -> list[tuple[str, Callable[[], CheckResult]]]:
    """(name, check) for every check of this run, in the order they run; unsupported precisions become skips."""
    from .distributed import check_two_processes
    from .memory_cap import check_oom_retry

    supported, reasons = supported_precisions(device)
    checks: list[tuple[str, Callable[[], CheckResult]]] = []
    for precision in precisions:
        for kind in MODELS:
            name = f"parity/{kind}/{precision}"
            if precision in supported:
                checks.append((name, lambda k=kind, p=precision: check_parity(k, p, device)))
            else:
                checks.append((name, lambda n=name, p=precision: CheckResult(n, "skip", detail=reasons[p])))
    if "fp16" in precisions:
        if "fp16" in supported:
            checks.append(("fp16-overflow/one-micro-batch", lambda: check_fp16_overflow(device)))
        else:
            checks.append(("fp16-overflow/one-micro-batch",
                           lambda: CheckResult("fp16-overflow/one-micro-batch", "skip", detail=reasons["fp16"])))  # fmt: skip
    checks.append(("oom-retry/memory-cap", lambda: check_oom_retry(device)))
    if full:
        checks += [(f"{mode}/2-processes", lambda m=mode: check_two_processes(m, device)) for mode in ("ddp", "fsdp2")]
    return checks


def run_self_test(
    device: str | torch.device = "cpu",
    precisions: Sequence[str] = PRECISIONS,
    full: bool = False,
    json_path: str | None = None,
    echo: Callable[[str], None] = print,
) -> int:
    """
    Run the self-test on `device`; print one line per check through `echo`; return the exit status (0 all passed or
    skipped, 1 a check failed). A check that raises is a failure, reported with its error.

    Example:

    ```python
    >>> from hf_gradaccum.diagnostics.self_test import run_self_test
    >>> run_self_test("cpu", precisions=["fp32"])  # doctest: +SKIP
    PASS  parity/causal-lm/fp32          rel. error vs large batch 2.30e-07 <= 1.0e-05  (2.2 s)
    ...
    0
    ```
    """
    import accelerate
    import transformers

    device = torch.device(device)
    echo(f"hf_gradaccum self-test on {device} (torch {torch.__version__}, transformers {transformers.__version__}, "
         f"accelerate {accelerate.__version__}); precisions {', '.join(precisions)}{', full' if full else ''}")  # fmt: skip
    start = time.perf_counter()
    results = []
    for name, check in planned_checks(device, precisions, full):
        began = time.perf_counter()
        try:
            result = check()
        except Exception as error:  # noqa: BLE001 (a crashing check is a failed check, not a crashed self-test)
            result = CheckResult(
                name, "fail", "raised", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            )
        result.seconds = result.seconds or time.perf_counter() - began
        results.append(result)
        echo(result.line())
    counts = {status: sum(r.status == status for r in results) for status in ("pass", "fail", "skip")}
    total = time.perf_counter() - start
    echo(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped in {total:.1f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": str(device), "seconds": total, "torch": torch.__version__,
                       "checks": [vars(r) for r in results]}, f, indent=2)  # fmt: skip
    return 1 if counts["fail"] else 0
