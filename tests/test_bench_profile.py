"""`benchmarks/profile_trainer_window.py` end to end on CPU at a small ResNet-18 window: both trainers profiled in
their own processes, and the operator table shows what the profile is for (here: ours runs no window-end pass of
its own; the gradient-wide kernels are the stock Trainer's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "benchmarks" / "profile_trainer_window.py"


# A benchmark smoke test of ~20 s: with the slow tests, so that `make test` stays under 10 minutes.
@pytest.mark.slow
def test_profile_trainer_window_resnet18(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    cmd = [sys.executable, str(SCRIPT), "--shape", "resnet18", "--image_size", "32", "--micro_batch", "2"]
    cmd += ["--windows", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"

    payload = json.loads(out.read_text())
    stock, ours = payload["stock"], payload["gradaccum"]
    assert stock["trainer"] == "stock" and ours["trainer"] == "gradaccum"
    assert all(side["wall_ms_per_window"] > 0 for side in (stock, ours))
    # One window of 8 micro-batches of the 20 convolutions each.
    assert stock["ops"]["aten::convolution_backward"]["calls"] == ours["ops"]["aten::convolution_backward"]["calls"]
    assert "aten::_amp_foreach_non_finite_check_and_unscale_" not in ours["ops"]
    for kernel in ("aten::_foreach_norm", "aten::_foreach_mul_"):
        assert ours["ops"][kernel]["calls"] == stock["ops"][kernel]["calls"]
    markdown = out.with_suffix(".md").read_text()
    assert markdown.startswith("Command: `python benchmarks/profile_trainer_window.py --shape resnet18")
    assert "| ops | stock ms/window | ours ms/window |" in markdown
