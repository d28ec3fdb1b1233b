"""The torch range: the package works from its declared floor, and a feature that needs a newer torch says which
torch it needs when used on an older one (instead of failing inside torch)."""

import subprocess
import sys

import pytest

from tests.multiprocess import ROOT
from tests.torch_features import FSDP2_TORCH


@pytest.mark.skipif(FSDP2_TORCH, reason="the refusal is for torch < 2.8; newer releases run the FSDP2 tests")
def test_fsdp2_on_an_older_torch_is_refused_naming_the_torch_it_needs(tmp_path):
    proc = subprocess.run(
        [sys.executable, "tests/workers/fsdp2_parity.py", "2", str(tmp_path / "out.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Accumulating an FSDP2 (`fully_shard`) model needs torch>=2.8" in proc.stderr, proc.stderr[-3000:]
