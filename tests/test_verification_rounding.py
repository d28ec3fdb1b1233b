"""`verify_split_invariance` tells fp32 rounding from inexactness: an item-mean loss whose fp32 split difference
exceeds 1e-5 (per-row gradients of about 1e3 that cancel to 1e-2, so the grouping of the sums shows) is exact because
the same splits agree in fp64; a per-batch mean over unequal item counts is still not exact; a zero gradient is exact
rather than undecidable; the model is left as it was (dtype and values)."""

from __future__ import annotations

import torch

from hf_gradaccum import verify_split_invariance
from hf_gradaccum.verification.float64 import in_float64

TOL = 1e-5


def _unit_linear() -> torch.nn.Linear:
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.constant_(model.weight, 1.0)
    return model


def _cancelling_rows() -> torch.Tensor:
    """8 rows of about +-1000 whose mean is 0.01: the gradient of `w * x` is that mean."""
    x = torch.randn(8, 1, generator=torch.Generator().manual_seed(2)) * 1000
    return x - x.mean() + 0.01


def _rows(batch) -> int:
    return batch["x"].shape[0]


def _mean(model, batch):
    return model(batch["x"]).mean()


def test_fp32_rounding_of_an_item_mean_is_not_a_refusal():
    model = _unit_linear()
    x = _cancelling_rows()
    window = [{"x": x[:4]}, {"x": x[4:]}]
    result = verify_split_invariance(model, window, loss_fn=_mean, count_items=_rows)
    # The fp32 difference is far above the tolerance: the verdict comes from fp64.
    assert result.max_rel_diff > 100 * TOL
    assert result.verdict == "exact" and result.passed
    assert any("is rounding" in note for note in result.notes)
    assert model.weight.dtype == torch.float32 and float(model.weight.detach()) == 1.0


def test_a_real_inexactness_is_still_caught_after_fp64():
    model = _unit_linear()
    x = _cancelling_rows() + 5.0  # no cancellation: whatever differs is the loss, not rounding
    window = [{"x": x[:3]}, {"x": x[3:]}]

    def batch_sum_over_three(model, batch):  # divides by 3 whatever the micro-batch holds
        return model(batch["x"]).sum() / 3

    result = verify_split_invariance(model, window, loss_fn=batch_sum_over_three, count_items=_rows)
    assert result.verdict == "not_exact"
    assert not any("is rounding" in note for note in result.notes)


def test_batchnorm_is_still_caught_after_fp64():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    window = [{"x": torch.randn(4, 3)} for _ in range(2)]
    before = [t.clone() for t in model.state_dict().values()]
    result = verify_split_invariance(model, window, loss_fn=lambda m, b: m(b["x"]).pow(2).mean(), count_items=_rows)
    assert result.verdict == "not_exact" and result.max_rel_diff > 1e-2
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values(), strict=True))


def test_zero_gradient_is_exact_not_undecidable():
    model = _unit_linear()
    window = [{"x": torch.randn(4, 1)} for _ in range(2)]
    result = verify_split_invariance(model, window, loss_fn=lambda m, b: (m(b["x"]) * 0).mean(), count_items=_rows)
    assert result.verdict == "exact" and result.max_rel_diff == 0.0
    assert any("zero" in note for note in result.notes)


def test_float64_context_restores_the_same_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    weight = model[0].weight
    storage = weight.data_ptr()
    with in_float64(model):
        assert model[0].weight.dtype == model[1].running_mean.dtype == torch.float64
        assert torch.get_default_dtype() == torch.float64
    assert model[0].weight is weight and weight.data_ptr() == storage and weight.dtype == torch.float32
    assert model[1].running_mean.dtype == torch.float32 and torch.get_default_dtype() == torch.float32
