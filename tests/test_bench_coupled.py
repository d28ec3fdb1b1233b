"""`benchmarks/bench_coupled.py` end to end on CPU at a tiny window: every mode in its own process, the table and the
floor line it prints (a script, not a timed test: only the structure of its output is checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "bench_coupled.py"
MODES = ("plain", "forward_no_grad", "coupled", "trainer_plain", "trainer_coupled")


# A benchmark smoke test of ~30 s on 2 cores: with the slow tests, so that `make test` stays under 10 minutes.
@pytest.mark.slow
def test_bench_coupled_runs_every_mode_and_prints_the_floor() -> None:
    cmd = [sys.executable, str(SCRIPT), "--batch", "8", "--steps", "2", "--seq_len", "8", "--repeats", "2"]
    out = subprocess.run([*cmd, "--threads", "1", "--modes", *MODES], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert set(MODES) <= set(rows), out.stdout
    for mode in MODES:
        cells = [c.strip() for c in rows[mode].strip("|").split("|")]
        assert float(cells[3]) > 0, rows[mode]  # CPU seconds per step
    assert rows["plain"].rstrip().endswith("| 1.00 |") and rows["trainer_plain"].rstrip().endswith("| 1.00 |")
    assert "floor of the coupled mode (plain + 1/2 of the no-graph forwards):" in out.stdout
