"""The plain-Accelerate example runs, in one process and under `accelerate launch` with 2 processes, and its
accumulated run ends where the large-batch run ends (AdamW + clipping, 3 epochs: relative weight difference
<= 1e-5)."""

import re
import subprocess
import sys

from tests.multiprocess import ROOT, launch


def _difference(output: str) -> float:
    return float(re.search(r"relative weight difference after \d+ epochs: (\S+)", output).group(1))


def test_plain_loop_example_single_process():
    proc = subprocess.run(
        [sys.executable, "recipes/plain_accelerate_loop.py", "--epochs", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _difference(proc.stdout) <= 1e-5


def test_plain_loop_example_two_processes():
    proc = launch("--epochs", "2", script="recipes/plain_accelerate_loop.py")
    assert "2 process(es), MULTI_CPU" in proc.stdout  # really data parallel, not two independent runs
    assert _difference(proc.stdout) <= 1e-5
