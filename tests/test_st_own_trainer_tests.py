"""`benchmarks/st_own_trainer_tests.py` on a folder of two small test files written here (sentence-transformers' own
test files are not in this repository): in both modes every training-arguments object has the forced accumulation
steps (the stock baseline runs at the same GA); only in `ours` mode are the trainers the tests import the compositions
with `GradAccumTrainer`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "st_own_trainer_tests.py"

TESTS = """
from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.cross_encoder import CrossEncoderTrainer


def test_trainers_are_composed():
    from hf_gradaccum import GradAccumTrainer

    assert issubclass(SentenceTransformerTrainer, GradAccumTrainer)
    assert issubclass(CrossEncoderTrainer, GradAccumTrainer)


def test_accumulation_steps_are_forced(tmp_path):
    args = SentenceTransformerTrainingArguments(output_dir=str(tmp_path), report_to=[])
    assert args.gradient_accumulation_steps == 2
"""


# A harness smoke test of ~15 s: with the slow tests, so that `make test` stays under 10 minutes.
@pytest.mark.slow
def test_harness_swaps_the_trainers_and_forces_the_accumulation_steps(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_swap.py").write_text(TESTS)
    out = tmp_path / "records.json"
    cmd = [sys.executable, str(SCRIPT), "--tests", str(tests), "--ga", "2", "--modes", "stock,ours", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    outcome = {mode: {k.split("::")[-1]: v["outcome"] for k, v in runs[mode]["tests"].items()} for mode in runs}
    assert outcome["ours_ga2"] == {
        "test_trainers_are_composed": "passed",
        "test_accumulation_steps_are_forced": "passed",
    }
    assert outcome["stock_ga2"] == {
        "test_trainers_are_composed": "failed",
        "test_accumulation_steps_are_forced": "passed",
    }
