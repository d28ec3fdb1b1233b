"""`recipes/sft_tiny.py` runs offline, quickly, and its accumulated SFT run ends where the large-batch run ends."""

import os
import re
import subprocess
import sys

import pytest

from tests.multiprocess import ROOT

pytest.importorskip("trl")


def test_sft_tiny_recipe_runs_offline_and_matches_the_large_batch():
    proc = subprocess.run(
        [sys.executable, "recipes/sft_tiny.py", "--samples", "96", "--epochs", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # Without the ACCELERATE_* variables earlier tests' TrainingArguments left in this process: transformers 4.x
        # writes `ACCELERATE_MIXED_PRECISION` into os.environ (bf16 after a bf16 test) and the recipe would inherit it.
        env={**{k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    difference = float(re.search(r"relative weight difference after 1 epochs: (\S+)", proc.stdout).group(1))
    assert difference <= 1e-5, proc.stdout
    assert "mean_token_accuracy" in proc.stdout
