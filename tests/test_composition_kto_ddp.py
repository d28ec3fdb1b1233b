"""A composed KTOTrainer (`loss_type='kto'`) under real DDP (2 gloo processes, one window of 3 micro-batches of 4
rows per rank): the update equals the stock KTOTrainer's one SGD(lr=1) step on both ranks' 24 rows as one batch,
computed in one process (its KL pairs rotate within the 24 rows and its baseline is one mean over them), and the
baseline every micro-batch's loss used on both ranks is that batch's. fp32, tolerance 1e-5 relative. The worker is
`tests/workers/kto_ddp.py`."""

import os

import pytest
import torch

from tests.multiprocess import launch

pytest.importorskip("trl")

from trl import KTOTrainer  # noqa: E402

from tests.kto_cases import B, K, train_kto  # noqa: E402

RTOL = 1e-5


@pytest.mark.parametrize("order", ["gradaccum_first", "kto_first"])
def test_composed_kto_under_ddp_equals_one_batch_over_both_ranks(tmp_path, order):
    launch(str(tmp_path / "ddp"), order, script="tests/workers/kto_ddp.py")
    ddp = torch.load(os.path.join(tmp_path / "ddp", "kto_ddp.pt"))
    rows = B * K * ddp["world_size"]
    reference = train_kto(KTOTrainer, str(tmp_path / "large"), ga=1, batch=rows, rows=rows)
    (large_kl,) = reference.kls
    error = float((ddp["update"] - reference.update).norm() / reference.update.norm())
    print(f"{order}: window KL {ddp['window_kl']:.6f} vs one batch {large_kl:.6f}, relative update error {error:.2e}")
    assert ddp["kls"] == pytest.approx([large_kl] * K, rel=1e-6)
    assert error <= RTOL, f"{order}: relative update difference {error:.3g} > {RTOL}"
