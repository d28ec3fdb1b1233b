"""A composed trainer under real DDP (2 gloo processes): `(GradAccumTrainer, SFTTrainer)` with a LoRA adapter, so
items are counted through DDP(PeftModel(...)); the update matches the large-batch step over both ranks' samples."""

import re

import pytest

from tests.multiprocess import launch

pytest.importorskip("trl")
pytest.importorskip("peft")


def test_composed_sft_with_lora_under_ddp_matches_large_batch(tmp_path):
    proc = launch(str(tmp_path), script="tests/workers/composition_ddp.py")
    err = float(re.search(r"relative update error (\S+)", proc.stdout).group(1))
    assert err <= 1e-5, proc.stdout[-2000:]
