#!/usr/bin/env python
"""sentence-transformers' own trainer tests with its trainers replaced by the composition with `GradAccumTrainer`.

    python benchmarks/st_own_trainer_tests.py --tests DIR --ga 1,2 --out FILE.json
    python benchmarks/st_own_trainer_tests.py --tests DIR --ga 2 --modes ours --pytest-args "-m slow -k prompts"

`DIR` holds copies of sentence-transformers' trainer test files and a conftest that makes their fixtures offline;
they are not part of this repository. For every mode (`stock`: the trainers as shipped; `ours`: each of
`SentenceTransformerTrainer`, `CrossEncoderTrainer`, `SparseEncoderTrainer`, `MultiVectorEncoderTrainer` replaced,
under the same name and in every `sentence_transformers` module that binds it, by `type(name, (GradAccumTrainer,
stock), {})`) and every `gradient_accumulation_steps` in `--ga` (forced on every training-arguments object the tests
build, by wrapping `BaseTrainingArguments.__post_init__`), pytest runs once on `DIR` in its own process with this
file as a plugin (`-p st_own_trainer_tests`). Each test is recorded as passed / failed / error / skipped, with the
exception type and first message line of a failure and its kind: `refusal` (an `hf_gradaccum` error such as
`CompositionError` or `SentenceTransformersLossError` anywhere in the failure), `offline` (the Hub was needed),
`assertion`, or `crash`. `--out` gets every record, the counts per test file and configuration, and the regressions:
the tests that fail in `ours` but not in `stock` at the same `gradient_accumulation_steps`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

MODE_ENV, GA_ENV, OUT_ENV = "ST_OWN_MODE", "ST_OWN_GA", "ST_OWN_RESULT"
TRAINERS = (
    "SentenceTransformerTrainer",
    "CrossEncoderTrainer",
    "SparseEncoderTrainer",
    "MultiVectorEncoderTrainer",
)
REFUSAL_NAMES = (
    "CompositionError",
    "SentenceTransformersLossError",
    "AccumulationNotExactError",
    "MissingTransformersFeatureError",
    "UnsupportedVersionError",
)
OFFLINE_MARKERS = ("not runnable offline", "LocalEntryNotFoundError", "OfflineModeIsEnabled", "huggingface.co")
REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------------------------------
# patching (runs inside the pytest process)
# --------------------------------------------------------------------------------------------------------------------


def compose_trainers() -> dict[str, type]:
    """Replace the four sentence-transformers trainers by their composition with `GradAccumTrainer`.

    Every loaded module whose name starts with `sentence_transformers` and binds a stock trainer under any name gets
    the composed class instead, so that `from sentence_transformers import SentenceTransformerTrainer` (and the
    submodule imports) in a test module imported afterwards yields it.

    Returns:
        `dict[str, type]`: trainer name to the composed class (`GradAccumTrainer` first, the stock trainer second).
    """
    import sentence_transformers  # noqa: F401  (binds the trainers in the package namespaces)
    from sentence_transformers.cross_encoder.trainer import CrossEncoderTrainer
    from sentence_transformers.multi_vector_encoder.trainer import MultiVectorEncoderTrainer
    from sentence_transformers.sentence_transformer.trainer import SentenceTransformerTrainer
    from sentence_transformers.sparse_encoder.trainer import SparseEncoderTrainer

    from hf_gradaccum import GradAccumTrainer

    stock = {
        "SentenceTransformerTrainer": SentenceTransformerTrainer,
        "CrossEncoderTrainer": CrossEncoderTrainer,
        "SparseEncoderTrainer": SparseEncoderTrainer,
        "MultiVectorEncoderTrainer": MultiVectorEncoderTrainer,
    }
    composed = {
        name: type(name, (GradAccumTrainer, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        for name, cls in stock.items()
    }
    by_identity = {id(cls): composed[name] for name, cls in stock.items()}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("sentence_transformers") or module is None:
            continue
        for attribute, value in list(vars(module).items()):
            if isinstance(value, type) and id(value) in by_identity:
                setattr(module, attribute, by_identity[id(value)])
    return composed


def force_gradient_accumulation(steps: int) -> None:
    """Set `gradient_accumulation_steps=steps` on every sentence-transformers training-arguments object built from now.

    All four arguments classes inherit `BaseTrainingArguments.__post_init__`; the wrapper sets the value before the
    original runs, so whatever `transformers.TrainingArguments.__post_init__` derives from it sees the forced value.

    Args:
        steps (`int`): the number of micro-batches per optimizer step.
    """
    from sentence_transformers.base.training_args import BaseTrainingArguments

    original = BaseTrainingArguments.__post_init__

    def __post_init__(self) -> None:
        self.gradient_accumulation_steps = steps
        original(self)

    BaseTrainingArguments.__post_init__ = __post_init__


def _chain(exc: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def classify_failure(excinfo: Any, text: str) -> dict[str, Any]:
    """Describe one failed test phase.

    Args:
        excinfo (`pytest.ExceptionInfo` or `None`): the phase's exception.
        text (`str`): the report's long representation (the traceback pytest prints).

    Returns:
        `dict[str, Any]`: `exc_type`, `message` (first line), `kind` (`refusal`, `offline`, `assertion` or `crash`),
        `refusal_type` (the `hf_gradaccum` error's class name, if any) and `in_hf_gradaccum` (whether a traceback
        frame lies in the `hf_gradaccum` package).
    """
    exc = getattr(excinfo, "value", None)
    chain = _chain(exc)
    exc_type = type(exc).__name__ if exc is not None else "unknown"
    message = (str(exc).strip().splitlines() or [""])[0] if exc is not None else text.strip().splitlines()[-1]
    refusal = next(
        (
            e
            for e in chain
            if type(e).__module__.startswith("hf_gradaccum") and type(e).__name__.endswith(("Error", "Exception"))
        ),
        None,
    )
    refusal_type = type(refusal).__name__ if refusal is not None else None
    if refusal_type is None:
        refusal_type = next((name for name in REFUSAL_NAMES if name in text), None)
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else []
    in_package = any(f"{os.sep}hf_gradaccum{os.sep}" in frame.filename for frame in frames) or any(
        f"{os.sep}hf_gradaccum{os.sep}" in line for line in text.splitlines() if line.strip().endswith(":")
    )
    if refusal is not None:
        message = (str(refusal).strip().splitlines() or [""])[0]
    if refusal_type is not None:
        kind = "refusal"
    elif any(marker in text for marker in OFFLINE_MARKERS):
        kind = "offline"
    elif isinstance(exc, AssertionError) or exc_type == "Failed":
        kind = "assertion"
    else:
        kind = "crash"
    return {
        "exc_type": exc_type,
        "message": message[:400],
        "kind": kind,
        "refusal_type": refusal_type,
        "in_hf_gradaccum": in_package,
    }


class Recorder:
    """A pytest plugin object that records every test's outcome and writes them to a JSON file at the end.

    Args:
        path (`str`): where to write the records.
        mode (`str`): `stock` or `ours`.
        ga (`int`): the forced `gradient_accumulation_steps`.
    """

    def __init__(self, path: str, mode: str, ga: int) -> None:
        self.path, self.mode, self.ga = path, mode, ga
        self.records: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        """Fold each phase's report (setup, call, teardown) into the test's record: the first failure or skip wins."""
        outcome = yield
        report = outcome.get_result()
        record = self.records.setdefault(item.nodeid, {"outcome": "passed", "duration": 0.0})
        record["duration"] += report.duration
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            if record["outcome"] == "passed":
                record.update(outcome="skipped", reason=str(reason)[:300])
            if OFFLINE_MARKERS[0] in str(reason):
                record["offline"] = True
        elif report.failed:
            failure = classify_failure(call.excinfo, str(report.longrepr))
            if record["outcome"] in ("passed", "skipped"):
                record.update(outcome="failed" if report.when == "call" else "error", phase=report.when, **failure)
                if failure["kind"] == "offline":
                    record["offline"] = True

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """Write the records (with the mode and GA) to the recorder's file."""
        Path(self.path).write_text(json.dumps({"mode": self.mode, "ga": self.ga, "tests": self.records}, indent=1))


def pytest_configure(config: pytest.Config) -> None:
    """Patch the trainers and the arguments before any test module is imported, and register the recorder."""
    mode, ga = os.environ.get(MODE_ENV, "stock"), int(os.environ.get(GA_ENV, "1"))
    if mode == "ours":
        compose_trainers()
    force_gradient_accumulation(ga)
    if os.environ.get(OUT_ENV):
        config.pluginmanager.register(Recorder(os.environ[OUT_ENV], mode, ga), "st_own_recorder")


# --------------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------------


def run_configuration(tests: Path, mode: str, ga: int, pytest_args: list[str]) -> dict[str, Any]:
    """Run pytest on `tests` in a fresh process with this file as a plugin.

    Args:
        tests (`Path`): the folder of copied test files (with its own conftest and pytest.ini).
        mode (`str`): `stock` or `ours`.
        ga (`int`): the `gradient_accumulation_steps` forced on every training-arguments object.
        pytest_args (`list[str]`): extra pytest arguments (e.g. `-m slow`, `-k ...`).

    Returns:
        `dict[str, Any]`: the recorder's output plus `seconds` and `returncode`.
    """
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        env = dict(os.environ)
        env.update({MODE_ENV: mode, GA_ENV: str(ga), OUT_ENV: str(result)})
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), str(REPO), env.get("PYTHONPATH", "")])
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        command = [sys.executable, "-m", "pytest", str(tests), "-p", "st_own_trainer_tests", "-q", "-rN"]
        start = time.time()
        process = subprocess.run(
            [*command, "-W", "ignore", *pytest_args], env=env, cwd=str(tests), capture_output=True, text=True
        )
        seconds = time.time() - start
        if not result.exists():
            raise RuntimeError(f"pytest wrote no results ({mode}, GA={ga}):\n{process.stdout[-3000:]}{process.stderr}")
        data = json.loads(result.read_text())
    data.update(seconds=round(seconds, 1), returncode=process.returncode)
    return data


def summarise(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Counts per test file and configuration, and the regressions of `ours` against `stock` at each GA.

    Args:
        runs (`dict[str, dict]`): configuration name (`stock_ga1`, `ours_ga2`, ...) to `run_configuration`'s output.

    Returns:
        `dict[str, Any]`: `counts[configuration][file]` (passed / failed / error / skipped / offline) and
        `regressions[ga]` (test id to the `ours` record and the `stock` outcome).
    """
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for name, run in runs.items():
        per_file: dict[str, Counter] = {}
        for nodeid, record in run["tests"].items():
            counter = per_file.setdefault(nodeid.split("::")[0], Counter())
            counter["offline" if record.get("offline") else record["outcome"]] += 1
        counts[name] = {file: dict(counter) for file, counter in sorted(per_file.items())}
    regressions: dict[str, dict[str, Any]] = {}
    for name, run in runs.items():
        if not name.startswith("ours_"):
            continue
        stock = runs.get("stock_" + name[len("ours_") :])
        if stock is None:
            continue
        found = {}
        for nodeid, record in run["tests"].items():
            before = stock["tests"].get(nodeid, {}).get("outcome")
            if record["outcome"] in ("failed", "error") and before not in ("failed", "error"):
                found[nodeid] = {"stock": before, **record}
        regressions[name[len("ours_") :]] = found
    return {"counts": counts, "regressions": regressions}


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, run every (mode, GA) configuration one after another, write and print the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, required=True, help="folder of copied sentence-transformers tests")
    parser.add_argument("--ga", default="1,2", help="comma-separated gradient_accumulation_steps values")
    parser.add_argument("--modes", default="stock,ours", help="comma-separated: stock, ours")
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the records and the summary")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    args = parser.parse_args(argv)
    runs = {}
    for ga in [int(value) for value in args.ga.split(",")]:
        for mode in args.modes.split(","):
            runs[f"{mode}_ga{ga}"] = run = run_configuration(
                args.tests.resolve(), mode, ga, shlex.split(args.pytest_args)
            )
            outcomes = Counter(r["outcome"] for r in run["tests"].values())
            print(f"{mode} GA={ga}: {dict(outcomes)} in {run['seconds']} s", flush=True)
    summary = summarise(runs)
    args.out.write_text(json.dumps({"runs": runs, **summary}, indent=1))
    for ga, found in summary["regressions"].items():
        print(f"regressions at {ga}: {len(found)}")
        for nodeid, record in found.items():
            print(f"  {nodeid}: {record.get('kind')} {record.get('exc_type')}: {record.get('message')}")


if __name__ == "__main__":
    main()
