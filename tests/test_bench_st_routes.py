"""`benchmarks/bench_st_routes.py` end to end at a tiny size: each configuration in its own process takes the route it
names (the stock trainer none), and the table has a row for each (a script, not a timed test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_st_routes.py"


# A benchmark smoke test of ~30 s on 2 cores: with the slow tests, so that `make test` stays under 10 minutes.
@pytest.mark.slow
def test_bench_st_routes_runs_each_route():
    cmd = [sys.executable, str(SCRIPT), "--hidden", "16", "--batch", "4", "--steps", "2", "--optimizer_steps", "3"]
    out = subprocess.run([*cmd, "--rounds", "1", "--loss", "contrastive"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert rows["stock"].split("|")[2].strip() == "-"
    assert rows["item_mean"].split("|")[2].strip() == "item_mean"
    assert rows["coupled"].split("|")[2].strip() == "coupled"
