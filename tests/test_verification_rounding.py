"""`verify_split_invariance` tells fp32 rounding from inexactness: an item-mean loss whose fp32 split difference
exceeds 1e-5 (per-row gradients of about 1e3 that cancel to 1e-2, so the grouping of the sums shows) is exact because
the same splits agree in fp64; a per-batch mean over unequal item counts is still not exact, and so is a small real
inexactness hidden under the fp32 rounding; a split that fp64 cannot measure (NaN) approves nothing; a zero gradient
is exact rather than undecidable; the model is left as it was (dtype and values)."""

from __future__ import annotations

import re

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


def test_zero_window_gradient_with_a_nonzero_split_is_not_exact():
    """A loss over the micro-batch's rows (here their variance) is zero on micro-batches of one row, so the window's
    own gradient is zero, while the merged split (two rows) is not: the check must say "not exact" with the batch
    coupling as the cause, not "cannot decide" with a non-deterministic forward blamed for an infinite difference."""
    model = torch.nn.Linear(3, 1)
    window = [{"x": torch.randn(1, 3)} for _ in range(2)]
    result = verify_split_invariance(
        model, window, loss_fn=lambda m, b: m(b["x"]).var(unbiased=False), count_items=_rows
    )
    assert result.verdict == "not_exact", result.summary()
    assert result.rel_diffs["merge"] == 1.0 and result.rel_diffs["repeat"] == 0.0
    assert result.diagnosis is not None and any(c.kind == "loss_not_an_item_mean" for c in result.diagnosis.causes)


def test_float64_context_restores_the_same_tensors():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    weight = model[0].weight
    storage = weight.data_ptr()
    with in_float64(model):
        assert model[0].weight.dtype == model[1].running_mean.dtype == torch.float64
        assert torch.get_default_dtype() == torch.float64
    assert model[0].weight is weight and weight.data_ptr() == storage and weight.dtype == torch.float32
    assert model[1].running_mean.dtype == torch.float32 and torch.get_default_dtype() == torch.float32


def test_a_small_real_inexactness_under_fp32_rounding_is_still_caught():
    """The fp32 difference is mostly rounding (the cancelling rows), but the loss also adds a prior term divided by
    the micro-batch's rows (KL / n, as a variational loss does per batch): row-weighted, that term counts once per
    micro-batch, so its share of the gradient grows with the number of micro-batches. fp64 removes the rounding and
    leaves the term's difference (about 1e-4 of the gradient), which must keep the verdict "not exact"."""
    model = _unit_linear()
    x = _cancelling_rows()
    window = [{"x": x[:4]}, {"x": x[4:]}]
    prior = 4e-6  # its gradient adds prior * (micro-batches) / 8 rows: 1e-6 for the window, 2e-6 for the halves

    def mean_plus_prior_per_batch(model, batch):
        return model(batch["x"]).mean() + prior * model.weight.pow(2).sum() / 2 / batch["x"].shape[0]

    result = verify_split_invariance(model, window, loss_fn=mean_plus_prior_per_batch, count_items=_rows)
    assert result.verdict == "not_exact" and not result.passed
    assert result.max_rel_diff > 100 * TOL  # the fp32 figure, which alone would have sent it to fp64
    assert not any("is rounding" in note for note in result.notes)
    # The fp64 figure is the prior term's 1e-6 out of a gradient of 0.01: 1e-4, ten times the tolerance.
    fp64 = [note for note in result.notes if note.startswith("the same splits computed in fp64 differ by")]
    assert len(fp64) == 1, result.notes
    assert 9e-5 < float(re.search(r"half (\S+) ", fp64[0]).group(1)) < 1.1e-4, fp64[0]
    # Without the prior term the same window is exact (rounding only): the term is what the check caught.
    plain = verify_split_invariance(model, window, loss_fn=_mean, count_items=_rows)
    assert plain.verdict == "exact"


def test_an_fp64_split_that_cannot_be_measured_does_not_approve():
    """The fp64 rerun approves only when every split is measured: here the halves' fp64 gradient is NaN (the loss
    gives NaN for 2-row micro-batches in fp64), while the full batch agrees. `max` over {full: 0, half: NaN} would
    be 0; the fp32 verdict must stand instead."""
    model = _unit_linear()
    x = _cancelling_rows()
    window = [{"x": x[:4]}, {"x": x[4:]}]

    def nan_for_two_rows_in_fp64(model, batch):
        out = model(batch["x"]).mean()
        if out.dtype == torch.float64 and batch["x"].shape[0] == 2:
            return out * float("nan")
        return out

    result = verify_split_invariance(
        model, window, loss_fn=nan_for_two_rows_in_fp64, count_items=_rows, splits=("full", "half")
    )
    assert result.verdict != "exact" and not result.passed
    assert not any("is rounding" in note for note in result.notes)
