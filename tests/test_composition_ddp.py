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


@pytest.mark.parametrize(
    ("loss_types", "order"),
    [("sigmoid,sft", "gradaccum_first"), pytest.param("aot_unpaired", "dpo_first", marks=pytest.mark.slow)],
    ids=["rpo", "aot"],
)
def test_composed_dpo_terms_and_sorts_under_ddp(tmp_path, loss_types, order):
    # Two terms weighted by their own counts summed over both ranks; a sort over each rank's own window.
    proc = launch(str(tmp_path), loss_types, order, script="tests/workers/dpo_terms_ddp.py")
    match = re.search(r"relative update error (\S+)", proc.stdout)
    assert match, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert float(match.group(1)) <= 1e-5, proc.stdout[-2000:]
