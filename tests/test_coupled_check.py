"""The exactness check understands the coupled-loss mode: on CLIP and the ranking-loss encoder, plain accumulation
of the in-batch loss is reported NOT exact with the in-batch cause and the fix "use the coupled-loss mode"; the
coupled mode is reported exact (split invariance: the window as given vs halved micro-batches vs one batch)."""

from __future__ import annotations

import pytest

from hf_gradaccum import verify_split_invariance
from hf_gradaccum.losses.coupled import verify_coupled_split_invariance
from tests.workers.coupled_cases import CASES


@pytest.mark.slow  # ~1 min per model on a loaded 2-core machine (the check runs 3 splits x 2 modes + diagnosis)
@pytest.mark.parametrize("case", ["clip", "ranking"])
def test_check_reports_exact_only_in_coupled_mode(case):
    model, coupled, batches = CASES[case](0.1)
    plain = verify_split_invariance(
        model,
        batches,
        loss_fn=lambda m, b: coupled.window_loss(m, [b]),
        count_items=coupled.num_items_fn,
        include_full_batch=True,
    )
    print(f"{case} plain accumulation: {plain.summary()}")
    assert not plain.passed and plain.max_rel_diff > 1e-2
    kinds = [c.kind for c in plain.diagnosis.causes]
    assert "loss_not_an_item_mean" in kinds, kinds
    cause = next(c for c in plain.diagnosis.causes if c.kind == "loss_not_an_item_mean")
    assert "in-batch" in cause.detail.lower() or "contrastive" in cause.detail
    assert "coupled-loss mode" in cause.fix

    exact = verify_coupled_split_invariance(model, batches, coupled)
    print(f"{case} coupled mode: {exact.summary()}")
    assert exact.passed and exact.max_rel_diff <= 1e-5, exact.summary()
    assert set(exact.rel_diffs) == {"half", "full"}
