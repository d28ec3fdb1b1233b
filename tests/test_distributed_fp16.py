"""fp16 loss scaling across 2 ranks (gloo): an overflow on rank 1 only, in micro-batch 2 of the first window.
Both ranks must take the same decision: bitwise-equal weights and equal scales after every window, for both
overflow policies, at the cost of one small extra reduction per window (not one per micro-batch)."""

import json

import pytest

from tests.multiprocess import launch

FP16_RTOL = 1e-2  # fp16 autocast forward vs the fp32 large-batch reference


def _records(tmp_path, policy, inject):
    launch("fp16_overflow_consistency", policy, inject, str(tmp_path))
    return [json.loads((tmp_path / f"fp16_{policy}_{inject}_rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize("policy", ["recompute", "skip"])
def test_overflow_on_one_rank_gives_the_same_decision_everywhere(tmp_path, policy):
    records = _records(tmp_path, policy, "yes")
    for r in records:
        print(f"{policy} rank {r['rank']}: {r}")
        assert r["weights_bitwise_equal"]
        assert r["scales"][0] == r["scales"][1]
        # Two windows: one gradient reduction each, plus one small stats vector each; nothing per micro-batch.
        assert r["gradient_reductions"] == 2 and r["collectives"] == 4
    rank0, rank1 = records
    if policy == "recompute":
        assert rank0["applied"] == rank1["applied"] == 2
        assert rank0["recomputed"] == 0 and rank1["recomputed"] == 1  # recomputed only where it overflowed
        assert rank0["err"] <= FP16_RTOL
        assert rank0["scales"][0] < 2.0**10 * 2  # backed off in window 1, grew once in window 2
    else:
        assert rank0["skipped"] == rank1["skipped"] == {"overflow": 1}
        assert rank0["applied"] == rank1["applied"] == 1
        assert rank0["scales"][0] == 2.0**10 * 0.5 * 2  # backed off once together, then grew together


def test_no_overflow_scale_grows_in_step(tmp_path):
    for r in _records(tmp_path, "recompute", "no"):
        assert r["weights_bitwise_equal"]
        assert r["scales"] == [2.0**12, 2.0**12]  # growth_interval=1: doubled after each of the 2 windows
        assert r["applied"] == 2 and r["recomputed"] == 0
        assert r["err"] <= FP16_RTOL
